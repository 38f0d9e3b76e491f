//! The data-parallel extension point: stage 2 of the backward pipeline.

use candle_core::Var;
use candle_core::backprop::GradStore;

use crate::error::Result;

/// Stage 2 of the backward pipeline: a hook that sees the raw (scaled, working-type)
/// gradients before they are unscaled. Data-parallel training all-reduces them here. The
/// default is none; install one with [`crate::Amp::set_grad_reducer`]. Both the guard and
/// [`crate::GradScaler`] run it.
pub trait GradReducer: Send + Sync {
    /// Reduces `grads` in place; `params` are the (name, working Var) pairs being trained.
    fn reduce(&self, grads: &mut GradStore, params: &[(String, Var)]) -> Result<()>;

    /// Combines this process's overflow flag with the other processes' so that every
    /// process skips the same steps. The default is the local flag.
    fn reduce_found_inf(&self, found_inf: bool) -> Result<bool> {
        Ok(found_inf)
    }
}
