//! The data-parallel extension point: stage 2 of the backward pipeline.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::error::Result;
#[cfg(doc)]
use crate::error::{AmpError, DistErrorKind};

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

/// The once-per-step reduction: a hook that sees an optimizer's accumulated, unscaled f32
/// master gradients and its overflow flags once per optimizer step, after the last
/// micro-batch and before anything reads them (`clip_grad_norm`, `GradScaler::unscale`,
/// the update itself). Data-parallel training averages gradients here, once per step
/// whatever the number of micro-batches (PyTorch's `no_sync`), and combines the overflow
/// flags so that every process skips the same steps. Installed by
/// `distributed::DataParallel::new`.
pub trait StepReducer: Send + Sync {
    /// Reduces `step` in place.
    fn reduce_step(&self, step: StepGrads<'_>) -> Result<()>;

    /// The sum of squares of every reduced gradient of the step, given this process's sum
    /// over the gradients it holds: `clip_grad_norm` clips with its square root. A reducer
    /// that leaves each process only a shard of the gradients (ZeRO) combines the processes'
    /// sums here, so every process clips by the same global norm; called on every process
    /// in the same order. The default is the local sum.
    fn total_sum_squares(&self, local: f64) -> Result<f64> {
        Ok(local)
    }

    /// Called by the optimizer after it applied a step (not after a skipped one) with the
    /// parameters of [`StepGrads::params`]: a reducer that left each process only a shard
    /// of the gradients brings every process's working weights up to date here (ZeRO's
    /// all-gather). The default does nothing.
    ///
    /// When [`shard_rank`](Self::shard_rank) is `Some`, an error here undoes the step: the
    /// optimizer writes back what it overwrote (masters, working copies, optimizer state)
    /// and counts nothing, so this method must leave every weight it did not write as it
    /// was. One that had already written other processes' weights returns
    /// [`AmpError::Distributed`] of kind [`DistErrorKind::Diverged`] instead: the run then
    /// refuses every later step.
    fn after_step(&self, params: &[(String, Vec<usize>)]) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Whether this process keeps the f32 master and optimizer state of parameter `name`:
    /// false for another rank's shard under ZeRO (loading a checkpoint then drops that
    /// parameter's optimizer state here). The default is true.
    fn keeps(&self, name: &str) -> bool {
        let _ = name;
        true
    }

    /// This process's rank when it holds only a shard of the run's f32 master weights and
    /// optimizer state (ZeRO), else `None` (the default). Calls that need all of it on one
    /// process (`Amp::state_dict`, checkpoints, `AmpOptimizer::state_dict`,
    /// `AmpOptimizer::master_params`) are then refused with [`AmpError::Distributed`] of
    /// kind [`DistErrorKind::Sharded`].
    fn shard_rank(&self) -> Option<usize> {
        None
    }

    /// Called when a backward through the `scale_loss` guard starts, before candle's
    /// backward runs: a reducer that overlaps its communication with the backward
    /// (`DataParallel::set_overlap`) gets ready here. The default does nothing.
    fn begin_backward(&self, start: BackwardStart<'_>) -> Result<()> {
        let _ = start;
        Ok(())
    }

    /// Called by every backward (the guard's and `GradScaler`'s) with its complete raw
    /// gradients, before they are unscaled into the master gradients: an overlapping reducer
    /// sends what the backward did not send yet. The default does nothing.
    fn flush_backward(&self, grads: &GradStore, params: &[(String, Var)]) -> Result<()> {
        let _ = (grads, params);
        Ok(())
    }

    /// Called when a backward ends: with `committed` true once it can no longer fail, just
    /// before its gradients are added to the master gradients; with false when it failed
    /// (nothing was added). The default does nothing.
    fn end_backward(&self, committed: bool) {
        let _ = committed;
    }
}

/// What [`StepReducer::begin_backward`] gets.
#[derive(Debug)]
pub struct BackwardStart<'a> {
    /// The scale the loss was multiplied by (the raw gradients carry it).
    pub scale: f32,
    /// The parameters the backward trains (name, working Var), with each one's master
    /// gradient accumulated so far in this step (f32; `None` before its first gradient).
    pub params: &'a [(String, Var, Option<Tensor>)],
}

/// What a [`StepReducer`] gets for one optimizer step.
#[derive(Debug)]
pub struct StepGrads<'a> {
    /// Every parameter the optimizer trains, sorted by name, with its shape: the same list on
    /// every process (a parameter without a gradient here is still listed).
    pub params: Vec<(String, Vec<usize>)>,
    /// The accumulated f32 master gradients by name; a parameter that got no gradient is
    /// absent. The reducer replaces them (and may add absent ones).
    pub grads: &'a mut BTreeMap<String, Tensor>,
    /// Overflow flags, one per scaling round in a fixed order (the run's losses, then the
    /// `GradScaler` round); the reducer ORs them across processes.
    pub found_inf: &'a mut [bool],
    /// Where the reducer names the parameters whose reduced gradient is inf or NaN, when it
    /// checks them (see `checked`); the optimizer then skips the step on every process.
    pub nonfinite: &'a mut Vec<String>,
    /// Set by a reducer that checked every gradient it wrote for inf/NaN in its own pass
    /// (naming the bad ones in `nonfinite`). Left false, the optimizer reads the reduced
    /// gradients once more to check them: what is applied is always checked.
    pub checked: &'a mut bool,
}
