//! The numerics doctor's low-floor hook: what layers, ops and the guard call so that a
//! recorder on a higher floor (`crate::doctor`) can see their tensors, and how a layer kept in
//! f32 runs.
//!
//! The hooks find the run through the thread's innermost autocast scope (the model wrapper
//! enters one at every level). Without an observer and without f32 layers a hook costs a
//! thread-local read and one branch; nothing here imports upward: the recorder is a trait
//! object the run's cast context holds.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::autocast::{self, Phase};

/// What a recorded tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A layer's output (named by its VarBuilder path) or an op's output (`op#call`).
    Activation,
    /// A parameter's working value (the type the model computes with).
    Weight,
    /// A parameter's raw gradient, still multiplied by the loss scale.
    Grad,
    /// A parameter's unscaled f32 master gradient, as the optimizer reads it.
    MasterGrad,
    /// The loss.
    Loss,
}

impl TensorKind {
    /// The lower-case name used in reports (`activation`, `weight`, `grad`, `master_grad`,
    /// `loss`).
    pub fn name(self) -> &'static str {
        match self {
            TensorKind::Activation => "activation",
            TensorKind::Weight => "weight",
            TensorKind::Grad => "grad",
            TensorKind::MasterGrad => "master_grad",
            TensorKind::Loss => "loss",
        }
    }
}

/// What the guard tells the observer at the end of each backward (observed or not).
#[derive(Debug, Clone)]
pub(crate) struct BackwardInfo<'a> {
    /// The loss scale the backward ran at.
    pub scale: f32,
    /// Whether the loss or a gradient was not finite (the step will be skipped).
    pub found_inf: bool,
    /// The parameters whose raw gradients were not finite (`"<loss>"` for the loss).
    pub nonfinite: &'a [String],
}

/// A recorder the run's cast context holds (the doctor's).
pub(crate) trait Observer: Send + Sync {
    /// Whether the current step is recorded (a cheap flag).
    fn recording(&self) -> bool;
    /// Records a named tensor. `scale` multiplies its values before they are compared with
    /// the half types' limits (the loss scale, for master gradients).
    fn record(&self, name: &str, kind: TensorKind, t: &Tensor, scale: f32);
    /// Records an op's output; the observer names it by op and call index.
    fn record_op(&self, op: &str, t: &Tensor);
    /// A backward ended: the step counter advances.
    fn end_backward(&self, info: &BackwardInfo<'_>);
}

fn replaying() -> bool {
    matches!(autocast::phase(), Phase::Recompute | Phase::SliceRepeat)
}

/// Runs a named layer's forward `f` on `x`: in f32 when the run keeps the layer in f32, its
/// output recorded when an observer records this step. `align`: at levels that do not
/// autocast, while some layer is kept in f32 (so its f32 output can reach this layer), a
/// floating input is cast to this type first (the layer's weights').
pub(crate) fn layer(
    name: Option<&Arc<str>>,
    x: &Tensor,
    align: Option<DType>,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (Some(name), Some(ctx)) = (name, autocast::hooked_context()) else {
        return f(x);
    };
    let forced = ctx.is_f32_layer(name);
    let aligned;
    let mut x = x;
    if let Some(to) = align
        && !forced
        && ctx.has_f32_layers()
        && x.dtype() != to
        && autocast::eligible(x.dtype())
        && autocast::eligible(to)
        && !autocast::is_enabled()
    {
        aligned = crate::kernels::cast(x, to)?;
        x = &aligned;
    }
    let observer = ctx.recording_observer().filter(|_| !replaying());
    let scope = (observer.is_some() || forced).then(|| autocast::enter_layer(ctx.clone(), forced));
    let y = f(x);
    drop(scope);
    let y = y?;
    if let Some(o) = observer {
        o.record(name, TensorKind::Activation, &y, 1.0);
    }
    Ok(y)
}

/// Records an op's output (outside named layers, whose outputs are recorded instead).
pub(crate) fn op(name: &str, y: Result<Tensor>) -> Result<Tensor> {
    let y = y?;
    if let Some(ctx) = autocast::hooked_context()
        && let Some(o) = ctx.recording_observer()
        && !autocast::in_layer()
        && !replaying()
    {
        o.record_op(name, &y);
    }
    Ok(y)
}
