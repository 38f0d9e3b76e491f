//! The optimizer's saved state: its algorithm's, its groups' and its counters.

use std::collections::BTreeMap;

use super::{AmpOptimizer, AmpOptimizerState, check_hyper};
use crate::error::{AmpError, Result};
use crate::train::optim::OptimizerState;

impl AmpOptimizer {
    /// The optimizer's state: algorithm state, groups' hyper-parameters, counters. A
    /// snapshot: later steps do not change it. Refused on a rank of a ZeRO-sharded run
    /// ([`crate::error::DistErrorKind::Sharded`]), which holds its shard's state only.
    pub fn state_dict(&self) -> Result<AmpOptimizerState> {
        self.run.check_whole_state("AmpOptimizer::state_dict")?;
        self.state_with(self.algo.state_dict()?)
    }

    /// Groups and counters, without the algorithm's per-parameter state (see
    /// [`param_buffers`](Self::param_buffers)).
    pub(crate) fn state_meta(&self) -> Result<AmpOptimizerState> {
        self.state_with(OptimizerState {
            kind: self.algo.name().into(),
            params: BTreeMap::new(),
        })
    }

    /// The algorithm's per-parameter state, borrowed where it owns f32 buffers (valid until
    /// the next step): what a checkpoint streams to disk without a copy.
    pub(crate) fn param_buffers(&self) -> Result<Vec<crate::train::optim::ParamBuffers<'_>>> {
        self.algo.buffers()
    }

    fn state_with(&self, algorithm: OptimizerState) -> Result<AmpOptimizerState> {
        Ok(AmpOptimizerState {
            algorithm,
            groups: self.groups.iter().map(|g| (g.name.clone(), g.hyper)).collect(),
            steps: self.steps,
            skipped_steps: self.skipped,
            consecutive_skips: self.consecutive_skips,
        })
    }

    /// Checks that `state` fits this optimizer (same algorithm, same group names in the same
    /// order) without changing anything.
    pub(crate) fn check_state(&self, state: &AmpOptimizerState) -> Result<()> {
        self.algo.check_state(&state.algorithm)?;
        // Saved buffers must have their parameter's shape.
        for (name, ps) in &state.algorithm.params {
            if let Some(p) = self.run.store.param(name) {
                for (k, b) in &ps.buffers {
                    if b.dims() != p.working().dims() || !b.dtype().is_float() {
                        return Err(AmpError::OptimizerState(format!(
                            "buffer `{k}` of `{name}` has shape {:?} and type {:?} but the parameter has shape {:?}",
                            b.dims(),
                            b.dtype(),
                            p.working().dims()
                        )));
                    }
                }
            }
        }
        for (g, (_, h)) in state.groups.iter().enumerate() {
            check_hyper(g, "lr", h.lr)?;
            check_hyper(g, "weight_decay", h.weight_decay)?;
        }
        let names: Vec<&String> = self.groups.iter().map(|g| &g.name).collect();
        let saved: Vec<&String> = state.groups.iter().map(|(n, _)| n).collect();
        if names != saved {
            return Err(AmpError::OptimizerState(format!(
                "the state has groups {saved:?} but this optimizer has {names:?}; add the same groups before loading"
            )));
        }
        state.algorithm.expect_kind(self.algo.name())
    }

    /// Restores [`state_dict`](Self::state_dict)'s output. The groups must have the same
    /// names in the same order (add them before loading). Gradients accumulated so far are
    /// dropped.
    pub fn load_state_dict(&mut self, state: &AmpOptimizerState) -> Result<()> {
        // Cloning shares the tensors' storage: no copy.
        self.load_state(state.clone())
    }

    /// [`load_state_dict`](Self::load_state_dict) by value: the algorithm frees each saved
    /// buffer as it takes it in ([`Optimizer::load_state`]).
    /// Loads `state` (checked first); on a rank of a sharded run only its own shard's
    /// per-parameter state is kept.
    pub(crate) fn load_state(&mut self, state: AmpOptimizerState) -> Result<()> {
        self.check_state(&state)?;
        let AmpOptimizerState {
            algorithm,
            groups,
            steps,
            skipped_steps,
            consecutive_skips,
        } = state;
        let mut algorithm = algorithm;
        // A rank of a sharded run keeps its own shard's state only.
        if let Some(reducer) = self.run.step_reducer() {
            algorithm.params.retain(|name, _| reducer.keeps(name));
        }
        self.algo.load_state(algorithm)?;
        self.zero_grad();
        for (g, (_, h)) in self.groups.iter_mut().zip(&groups) {
            g.hyper = *h;
        }
        self.steps = steps;
        self.skipped = skipped_steps;
        self.consecutive_skips = consecutive_skips;
        Ok(())
    }
}

impl AmpOptimizer {
    /// Drops the algorithm's state of parameters another rank owns: a run made sharded
    /// after this optimizer had stepped or loaded state (the first step's reduction calls it).
    pub(crate) fn drop_foreign_state(&mut self, reducer: &dyn crate::train::reduce::StepReducer) -> Result<()> {
        if reducer.shard_rank().is_none() {
            return Ok(());
        }
        let foreign = self.algo.buffers()?.iter().any(|b| !reducer.keeps(&b.param));
        if foreign {
            let mut state = self.algo.state_dict()?;
            state.params.retain(|name, _| reducer.keeps(name));
            self.algo.load_state(state)?;
        }
        Ok(())
    }
}
