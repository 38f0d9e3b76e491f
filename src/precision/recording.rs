//! What the numerics doctor's recorder is to the rest of the crate: the kinds of tensors
//! it records and the trait the run's cast context holds it by (`precision::observe` has the
//! hooks that call it). Nothing here imports from the crate.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

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
pub(crate) struct BackwardInfo {
    /// The loss scale the backward ran at.
    pub scale: f32,
    /// Whether the loss or a gradient was not finite (the step will be skipped; the verdict
    /// on both paths, see `BackwardReport::found_inf`).
    pub found_inf: bool,
}

/// Whose gradients a backward produced: the run's loss scaler `loss_id`, or an outside
/// `GradScaler` (`None`).
pub(crate) type LossOf = Option<usize>;

/// A recorder the run's cast context holds (the doctor's).
pub(crate) trait Observer: Send + Sync {
    /// Whether the current step is recorded (a cheap flag).
    fn recording(&self) -> bool;
    /// Records a named tensor. `scale` multiplies its values before they are compared with
    /// the half types' limits (the loss scale, for master gradients).
    fn record(&self, name: &str, kind: TensorKind, t: &Tensor, scale: f32);
    /// Tells the observer whose gradients the records up to the next
    /// [`end_backward`](Self::end_backward) are (called before the first gradient).
    fn begin_gradients(&self, loss: LossOf);
    /// Records a parameter's raw (still scaled) gradient; `pre_round` is the same gradient
    /// in f32 before it was rounded to the raw gradient's type, where the product that made
    /// it had it (the library's kernels on the CPU), so underflow is measured where the
    /// values still exist.
    fn record_grad(&self, name: &str, raw: &Tensor, pre_round: Option<&Tensor>);
    /// Records an op's output; the observer names it by op and call index.
    fn record_op(&self, op: &str, t: &Tensor);
    /// A backward ended: the step counter advances.
    fn end_backward(&self, info: &BackwardInfo);
}
