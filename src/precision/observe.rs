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

use super::autocast::{self, Phase};
use super::recording::TensorKind;

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
