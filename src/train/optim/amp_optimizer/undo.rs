//! Undoing an applied step whose sharing with the other ranks failed (ZeRO's all-gather).
//!
//! A sharded rank applies its own shard's update and then all-gathers the updated working
//! weights. When a peer stops before that gather, the step must count as not taken on this
//! rank either (`docs/distributed.md`'s "nothing applied"), but the algorithm has already written the
//! shard's masters, working copies and state. The update cannot be computed out of place
//! without changing every algorithm (the fused CPU passes write in place), so the step keeps
//! a copy of what it overwrites, and restores it if the gather fails. The copy is of this
//! rank's shard only (about 1/N of the unsharded run's optimizer memory) and lives for the
//! step alone.

use candle_core::{Tensor, Var};

use crate::error::Result;
use crate::train::optim::{Optimizer, OptimizerState, ParamUpdate};

/// The values a sharded step overwrites, taken before it.
pub(super) struct Undo {
    /// Each Var the step writes (f32 masters, working copies) with a copy of its value.
    vars: Vec<(Var, Tensor)>,
    /// The algorithm's state; `None` when it cannot report it (candle's optimizers, through
    /// the adapter): such a step cannot be undone.
    pub(super) state: Option<OptimizerState>,
}

impl Undo {
    /// Copies what a step over `updates` will write: each persistent f32 Var and each
    /// working Var once (a non-persistent `var` is a throwaway copy, or the working Var
    /// itself), and the algorithm's state.
    pub(super) fn take(updates: &[ParamUpdate<'_>], algo: &dyn Optimizer) -> Result<Self> {
        let mut vars: Vec<(Var, Tensor)> = Vec::new();
        for u in updates {
            let written = u.persistent.then_some(u.var).into_iter().chain(u.working);
            for v in written {
                if vars.iter().all(|(k, _)| k.id() != v.id()) {
                    vars.push((v.clone(), v.as_tensor().copy()?));
                }
            }
        }
        Ok(Self {
            vars,
            state: algo.state_dict().ok(),
        })
    }

    /// Writes every copied value back and reloads the algorithm's state. An error means the
    /// step could not be undone (the state was not reported, or a write failed).
    pub(super) fn restore(self, algo: &mut dyn Optimizer) -> Result<()> {
        let mut first_err: Option<crate::error::AmpError> = None;
        for (var, old) in &self.vars {
            // Every Var is tried, whatever failed before: as much of the step as possible is
            // undone, and casts of the new values are never served again.
            if let Err(e) = var.set(old) {
                first_err.get_or_insert(e.into());
            }
            crate::precision::autocast::invalidate(var.as_tensor());
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        match self.state {
            Some(state) => algo.load_state(state),
            None => Err(crate::error::AmpError::OptimizerState(
                "the optimizer cannot report its state, so its step could not be undone".into(),
            )),
        }
    }
}
