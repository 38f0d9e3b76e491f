//! Optimizers: our object-safe [`Optimizer`] trait, its implementations ([`Sgd`],
//! [`AdamW`], the [`CandleOptimizer`] adapter), and the [`AmpOptimizer`] that drives one
//! over the parameter store with loss scaling, parameter groups and step skipping.
//!
//! An algorithm sees f32 parameters and f32 unscaled gradients only, whatever the model's
//! type: its arithmetic and state are f32 even at O3 (candle's AdamW on f16 Vars divides
//! 0/0 because eps underflows). Its state is keyed by parameter name and serialisable.

mod adamw;
mod amp_optimizer;
mod candle_adapter;
mod sgd;
mod state;

pub use adamw::{AdamW, AdamWConfig};
pub use amp_optimizer::{AmpOptimizer, AmpOptimizerState, ParamGroup, StepOutcome};
pub use candle_adapter::CandleOptimizer;
pub use sgd::{Sgd, SgdConfig};
pub use state::{OptimizerState, ParamState, TensorData};

use candle_core::{Tensor, Var};

use crate::error::Result;

/// Hyper-parameters that vary per parameter group.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupHyper {
    /// Learning rate.
    pub lr: f64,
    /// Weight decay (L2 for SGD, decoupled for AdamW).
    pub weight_decay: f64,
}

/// One parameter to update in a step.
#[derive(Debug)]
pub struct ParamUpdate<'a> {
    /// The parameter's dotted name (the key of its optimizer state).
    pub name: &'a str,
    /// The parameter as an f32 Var, updated in place by the step.
    pub var: &'a Var,
    /// Its unscaled f32 gradient.
    pub grad: &'a Tensor,
    /// Its group's hyper-parameters.
    pub hyper: GroupHyper,
    /// `false` when `var` is a temporary f32 copy of a half parameter (O3, no masters): an
    /// algorithm must not keep the Var itself between steps.
    pub persistent: bool,
}

/// An optimization algorithm over f32 parameters. Object-safe, so an [`AmpOptimizer`] can
/// hold any of them.
///
/// Implement [`update`](Optimizer::update) for an element-wise algorithm; override
/// [`step`](Optimizer::step) to see all parameters at once (fused kernels, adapters).
pub trait Optimizer: Send {
    /// A short name ("sgd", "adamw").
    fn name(&self) -> &'static str;

    /// The hyper-parameters new groups start from.
    fn defaults(&self) -> GroupHyper;

    /// The new f32 value of one parameter. Called once per parameter that has a gradient.
    fn update(&mut self, param: &ParamUpdate<'_>) -> Result<Tensor>;

    /// Updates every parameter that has a gradient. The default calls
    /// [`update`](Optimizer::update) and writes each result into its Var.
    fn step(&mut self, params: &[ParamUpdate<'_>]) -> Result<()> {
        for p in params {
            let new = self.update(p)?;
            p.var.set(&new)?;
        }
        Ok(())
    }

    /// The algorithm's state (moments, step counters), for checkpoints.
    fn state_dict(&self) -> Result<OptimizerState>;

    /// Restores state produced by [`state_dict`](Optimizer::state_dict).
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()>;

    /// Checks, without changing anything, that `state` would load: by default that it was
    /// saved by an algorithm of the same name. Implementations add their own checks (required
    /// buffers) so that a checkpoint fails before anything is restored.
    fn check_state(&self, state: &OptimizerState) -> Result<()> {
        state.expect_kind(self.name())
    }
}
