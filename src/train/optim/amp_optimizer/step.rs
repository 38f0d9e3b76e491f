//! The optimizer step: the step reducer, clipping, skipping, applying, zeroing.

use candle_core::{DType, Tensor, Var};

use super::undo::Undo;
use super::{AmpOptimizer, Round, Stage, StepOutcome};
use crate::error::{AmpError, CallOrderKind, DistErrorKind, Result};
use crate::train::optim::{GroupHyper, ParamUpdate};

impl AmpOptimizer {
    /// Applies the master gradients, or records a skip, without any loss-scaler bookkeeping
    /// (the PyTorch-style [`crate::GradScaler`] owns its scale). All or nothing: on an error
    /// nothing was applied (on a sharded run the all-gather of the weights included, see
    /// [`apply_and_share`](Self::apply_and_share)) and the gradients stay for a retry.
    pub(crate) fn step_external(&mut self, skip: bool) -> Result<()> {
        self.run.check_not_diverged("GradScaler::step")?;
        if skip {
            self.skipped += 1;
        } else {
            let unshared = if self.stage == Stage::HasGrads {
                self.apply_and_share()?
            } else {
                None
            };
            self.steps += 1;
            self.clear_grads();
            return unshared.map_or(Ok(()), Err);
        }
        self.clear_grads();
        Ok(())
    }

    /// Runs the run's step reducer (data parallel) over this step's gradients, once: the
    /// first of `step`, `clip_grad_norm` and `GradScaler::unscale` does it. Every process
    /// then holds the same gradients and the same overflow flags. Nothing changes on an error.
    pub(crate) fn reduce_step(&mut self) -> Result<()> {
        self.run.check_not_diverged("GradScaler::unscale")?;
        if self.reduced || self.stage != Stage::HasGrads {
            return Ok(());
        }
        let Some(reducer) = self.run.step_reducer() else {
            return Ok(());
        };
        let params = self.step_params();
        // One flag per scaling round, in a fixed order: the run's losses, then GradScaler's.
        let n = self.run.props.num_losses;
        let mut flags: Vec<bool> = (0..n)
            .map(|i| self.found_inf.get(&Round::Loss(i)).copied().unwrap_or(false))
            .chain([self.found_inf.get(&Round::External).copied().unwrap_or(false)])
            .collect();
        let mut grads = self.grads.clone();
        let mut nonfinite = Vec::new();
        let mut checked = false;
        self.drop_foreign_state(&*reducer)?;
        reducer.reduce_step(crate::train::reduce::StepGrads {
            params,
            grads: &mut grads,
            found_inf: &mut flags,
            nonfinite: &mut nonfinite,
            checked: &mut checked,
        })?;
        // What the optimizer applies is the reduced gradient: check it (after the reducer's
        // sum) unless the reducer checked it in its own pass. The reduced values are the
        // same on every process, so every process reaches the same verdict.
        if self.run.props.enabled && !checked {
            if self.device_path() {
                nonfinite.extend(self.check_on_device(&grads)?);
            } else {
                for (name, g) in &grads {
                    if crate::kernels::unscale::nonfinite(g)? {
                        nonfinite.push(name.clone());
                    }
                }
            }
        }
        if !self.run.props.enabled {
            nonfinite.clear();
        }
        self.grads = grads;
        let any = flags.iter().any(|&b| b);
        for (i, inf) in flags.into_iter().enumerate() {
            let round = if i < n { Round::Loss(i) } else { Round::External };
            if let Some(f) = self.found_inf.get_mut(&round) {
                *f = inf;
            }
        }
        // Another process overflowed in a round this one did not run, or the reduced
        // gradients themselves are not finite: skip here too.
        if (any && !self.found_inf.values().any(|&b| b)) || !nonfinite.is_empty() {
            self.found_inf.values_mut().for_each(|f| *f = true);
        }
        self.nonfinite.extend(nonfinite);
        self.reduced = true;
        Ok(())
    }

    fn clear_grads(&mut self) {
        // The buffers stay for the next backward to unscale into (the CPU path writes into
        // them in place; the device path makes new tensors, so it keeps none).
        let grads = std::mem::take(&mut self.grads);
        if !self.device_path() {
            self.spare.extend(grads);
        }
        self.found_inf.clear();
        self.nonfinite.clear();
        self.micro_batches = 0;
        self.reduced = false;
        self.stage = Stage::Clean;
    }

    /// Clips the accumulated master gradients to a total L2 norm of `max_norm` (PyTorch's
    /// `clip_grad_norm_` on unscaled gradients) and returns the norm before clipping. When a
    /// gradient is non-finite the norm is returned as is and nothing is clipped (the step
    /// will be skipped). Call between the backward and `step`.
    ///
    /// On the device path returning the norm reads it on the host (one synchronisation,
    /// counted in [`crate::Amp::host_syncs`]);
    /// [`clip_grad_norm_tensor`](Self::clip_grad_norm_tensor) clips without reading.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f32> {
        let device = self.device_path();
        let norm = self.clip_grad_norm_tensor(max_norm)?;
        let norm = norm.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        if device {
            self.run.count_host_sync();
        }
        Ok(norm)
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) returning the norm before clipping as a 0-d
    /// f32 tensor on the gradients' device, as PyTorch's `clip_grad_norm_` does: on the device
    /// path nothing is read on the host (the clipping coefficient is computed and applied
    /// on the device). The same errors as `clip_grad_norm`.
    pub fn clip_grad_norm_tensor(&mut self, max_norm: f64) -> Result<Tensor> {
        self.run.check_not_diverged("AmpOptimizer::clip_grad_norm")?;
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(AmpError::InvalidArgument {
                argument: "max_norm",
                reason: format!("clip_grad_norm needs a finite max_norm >= 0, got {max_norm}"),
            });
        }
        if self.stage != Stage::HasGrads {
            let kind = if self.stage == Stage::Stepped {
                CallOrderKind::AlreadyStepped
            } else {
                CallOrderKind::NoGradients
            };
            return Err(AmpError::call_order(
                "clip_grad_norm",
                kind,
                "there are no gradients to clip: call it after backward and before step",
            ));
        }
        // Clip the step's gradients, not this process's share of them.
        self.reduce_step()?;
        if self.device_path() {
            return self.clip_on_device(max_norm);
        }
        let mut total = 0f64;
        for g in self.grads.values() {
            // In f64: squares of large finite f32 gradients would overflow f32.
            total += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        // A sharded run holds its shard's gradients only: the norm is over every rank's.
        if let Some(reducer) = self.run.step_reducer() {
            total = reducer.total_sum_squares(total)?;
        }
        let norm = total.sqrt();
        if norm.is_finite() {
            let coef = (max_norm / (norm + 1e-6)).min(1.0);
            if coef < 1.0 {
                for g in self.grads.values_mut() {
                    *g = (&*g * coef)?;
                }
            }
        }
        Ok(Tensor::new(norm as f32, self.run.store.device())?)
    }

    /// The device path's clipping: the norm (in f64, as on the CPU), the coefficient
    /// `min(max_norm / (norm + 1e-6), 1)` (1 when the norm is not finite) and the products,
    /// all on the device. The coefficient multiplies every gradient, by exactly 1 when no
    /// clipping is needed, so the values equal the CPU path's.
    fn clip_on_device(&mut self, max_norm: f64) -> Result<Tensor> {
        let dev = self.run.store.device().clone();
        let mut total = Tensor::zeros((), DType::F64, &dev)?;
        for g in self.grads.values() {
            total = (total + g.to_dtype(DType::F64)?.sqr()?.sum_all()?)?;
        }
        // A sharded run holds its shard's gradients only: the norm is over every rank's
        // (the local sum read on the host, one counted synchronisation).
        if let Some(reducer) = self.run.step_reducer().filter(|r| r.shard_rank().is_some()) {
            let local = total.to_scalar::<f64>()?;
            self.run.count_host_sync();
            total = Tensor::new(reducer.total_sum_squares(local)?, &dev)?;
        }
        let norm = total.sqrt()?;
        let coef = Tensor::new(max_norm, &dev)?
            .div(&norm.affine(1.0, 1e-6)?)?
            .minimum(1.0)?;
        // `norm * 0` is 0 exactly where the norm is finite.
        let finite = norm.affine(0.0, 0.0)?.eq(0.0)?;
        let coef = finite.where_cond(&coef, &Tensor::ones((), DType::F64, &dev)?)?;
        let coef = coef.to_dtype(DType::F32)?;
        for g in self.grads.values_mut() {
            *g = g.broadcast_mul(&coef)?;
        }
        Ok(norm.to_dtype(DType::F32)?)
    }

    /// Applies the accumulated gradients, or skips the step if any of them (or a loss) was
    /// non-finite. Either way the loss scalers used since the last `zero_grad` are adjusted
    /// once. After `max_consecutive_skips` skips in a row returns
    /// [`AmpError::PersistentOverflow`] naming the parameters with non-finite gradients (the
    /// weights are still untouched).
    ///
    /// All or nothing: on an error nothing was applied, no scaler and no counter changed, and
    /// the gradients stay for a retry. On a ZeRO-sharded run this includes the all-gather of
    /// the updated weights: if it fails (another rank stopped), this rank's shard is put back
    /// as it was. Only when it fails after some of the other ranks' weights were written here
    /// does the step return [`DistErrorKind::Diverged`](crate::error::DistErrorKind), and the
    /// run then refuses every later step: resume from the last checkpoint.
    pub fn step(&mut self) -> Result<StepOutcome> {
        self.run.check_not_diverged("AmpOptimizer::step")?;
        match self.stage {
            Stage::HasGrads => {}
            Stage::Clean => {
                return Err(AmpError::call_order(
                    "step",
                    CallOrderKind::NoGradients,
                    "no gradients since the last zero_grad: run a backward inside scale_loss before step",
                ));
            }
            Stage::Stepped => {
                return Err(AmpError::call_order(
                    "step",
                    CallOrderKind::AlreadyStepped,
                    "this optimizer has already stepped: call zero_grad() and run a new backward before stepping again",
                ));
            }
        }
        self.reduce_step()?;
        let overflow = self.found_inf();
        // Shared with the other ranks before anything is reported or counted, so that a
        // failure leaves the scalers and counters as they were.
        let unshared = if overflow { None } else { self.apply_and_share()? };
        self.stage = Stage::Stepped;
        // Report the scaler that overflowed (or the first one used).
        let loss_id = |r: &Round| match r {
            Round::Loss(id) => Some(*id),
            Round::External => None,
        };
        let first_id = self
            .found_inf
            .iter()
            .find(|(_, inf)| **inf)
            .or(self.found_inf.iter().next())
            .and_then(|(r, _)| loss_id(r))
            .unwrap_or(0);
        let scale = {
            let mut scalers = self.run.scalers_mut();
            for (round, &inf) in &self.found_inf {
                // Gradients scaled by a GradScaler have no scaler of this run to report to.
                if let Some(id) = loss_id(round)
                    && let Some(s) = scalers.get_mut(id)
                {
                    s.report(self.id, inf, id);
                }
            }
            scalers.get(first_id).map_or(1.0, |s| s.state.scale.scale())
        };
        if !overflow {
            self.steps += 1;
            self.consecutive_skips = 0;
            return unshared.map_or(Ok(StepOutcome::Stepped { loss_scale: scale }), Err);
        }
        self.skipped = self.skipped.saturating_add(1);
        self.consecutive_skips = self.consecutive_skips.saturating_add(1);
        let nonfinite: Vec<String> = self.nonfinite.iter().cloned().collect();
        if self.consecutive_skips >= self.run.props.max_consecutive_skips {
            return Err(AmpError::PersistentOverflow {
                loss_id: first_id,
                skips: self.consecutive_skips,
                scale,
                params: if nonfinite.is_empty() {
                    "(none recorded)".into()
                } else {
                    nonfinite.join(", ")
                },
            });
        }
        Ok(StepOutcome::Skipped {
            loss_scale: scale,
            nonfinite,
        })
    }

    /// Applies the master gradients and lets the run's step reducer share them with the other
    /// ranks (a sharded run all-gathers the updated working weights there), all or nothing.
    /// On a sharded run the step keeps a copy of what it overwrites (this rank's shard: its
    /// masters, working copies and optimizer state) until the gather has succeeded, and
    /// writes it back if the gather fails. A failure that cannot be undone (the gather had
    /// written other ranks' weights, or the copy could not be written back) marks the run
    /// diverged: this and every later step return [`DistErrorKind::Diverged`].
    ///
    /// `Ok(Some(e))`: a reducer that does not shard failed in its `after_step` with `e`
    /// after the step was applied; there is nothing of ours to undo, so the step counts as
    /// taken (a retry must not apply it again) and the caller returns `e` once it is counted.
    fn apply_and_share(&mut self) -> Result<Option<AmpError>> {
        let reducer = self.run.step_reducer();
        let shard = reducer.as_ref().and_then(|r| r.shard_rank());
        let undo = self.apply(shard.is_some())?;
        let Some(reducer) = reducer else {
            return Ok(None);
        };
        let Err(e) = reducer.after_step(&self.step_params()) else {
            return Ok(None);
        };
        let (Some(rank), Some(undo)) = (shard, undo) else {
            return Ok(Some(e));
        };
        let restored = undo.restore(&mut *self.algo);
        match (e, restored) {
            (
                AmpError::Distributed {
                    kind: DistErrorKind::Diverged,
                    detail,
                    ..
                },
                _,
            ) => Err(self.run.set_diverged(rank, detail)),
            (e, Err(r)) => Err(self.run.set_diverged(
                rank,
                format!("the all-gather of the updated weights failed ({e}), and undoing this rank's step failed: {r}"),
            )),
            (e, Ok(())) => Err(e),
        }
    }

    /// The parameters the step reducer is told about (`StepGrads::params`): every one this
    /// optimizer owns, sorted by name, with its shape.
    fn step_params(&self) -> Vec<(String, Vec<usize>)> {
        let mut params: Vec<(String, Vec<usize>)> = self
            .owned()
            .into_iter()
            .map(|(_, p)| (p.name().to_string(), p.working().dims().to_vec()))
            .collect();
        params.sort();
        params
    }

    /// Applies the master gradients through the algorithm, all or nothing: the algorithm
    /// writes nothing unless every update succeeded (see [`Optimizer::step`]), and on an
    /// error its state is restored from a snapshot taken before, so a retried step applies
    /// exactly once. With `keep`, returns what undoes the applied step (see [`Undo`]).
    fn apply(&mut self, keep: bool) -> Result<Option<Undo>> {
        // The device path forced on the CPU: the algorithms take their tensor-op path (what
        // they run off the CPU), not the fused CPU passes; also when asked whether they read
        // f32 copies.
        let _plain = (self.device_path() && self.run.store.device().is_cpu()).then(crate::kernels::plain);
        struct Item {
            name: String,
            var: Var,
            working: Option<Var>,
            grad: Tensor,
            hyper: GroupHyper,
            persistent: bool,
        }
        // A parameter without an f32 Var (O3) is first offered as its half working Var: an
        // algorithm that updates it in place (the fused CPU passes) never reads an f32 copy,
        // so none is made. Only one that reads the values gets throwaway f32 copies.
        let build = |copies: bool| -> Result<Vec<Item>> {
            let mut items = Vec::new();
            for (g, p) in self.owned() {
                if !p.trains() {
                    continue;
                }
                let Some(grad) = self.grads.get(p.name()) else { continue };
                let (var, working, persistent) = match p.f32_var() {
                    Some(v) => {
                        let working = (p.working().id() != v.id()).then(|| p.working_var().clone());
                        (v.clone(), working, true)
                    }
                    None if copies => (Var::from_tensor(&p.f32_value()?)?, Some(p.working_var().clone()), false),
                    None => (p.working_var().clone(), Some(p.working_var().clone()), false),
                };
                items.push(Item {
                    name: p.name().to_string(),
                    var,
                    working,
                    grad: grad.clone(),
                    hyper: self.groups[g].hyper,
                    persistent,
                });
            }
            Ok(items)
        };
        fn view(items: &[Item]) -> Vec<ParamUpdate<'_>> {
            items
                .iter()
                .map(|i| ParamUpdate {
                    name: &i.name,
                    var: &i.var,
                    working: i.working.as_ref(),
                    grad: &i.grad,
                    hyper: i.hyper,
                    persistent: i.persistent,
                })
                .collect()
        }
        let mut items = build(false)?;
        if items.iter().any(|i| !i.persistent) && self.algo.reads_f32_copies(&view(&items)) {
            items = build(true)?;
        }
        let updates = view(&items);
        let undo = if keep {
            Some(Undo::take(&updates, &*self.algo)?)
        } else {
            None
        };
        // An algorithm that cannot report its state (candle's, through the adapter) cannot be
        // rolled back; its own step says how far it is atomic. The undo's copy serves too.
        let snapshot = if keep { None } else { self.algo.step_snapshot(&updates) };
        let stepped = self.algo.step(&updates);
        // Whatever the algorithm (ours bump their own writes; a user's or candle's does not
        // know of the cast cache), no cast of a value from before this step is served again.
        for u in &updates {
            crate::precision::autocast::invalidate(u.var.as_tensor());
            if let Some(w) = u.working {
                crate::precision::autocast::invalidate(w.as_tensor());
            }
        }
        match stepped {
            Ok(()) => Ok(undo),
            Err(e) => {
                let snapshot = snapshot.as_ref().or(undo.as_ref().and_then(|u| u.state.as_ref()));
                if let Some(snapshot) = snapshot
                    && let Err(r) = self.algo.load_state_dict(snapshot)
                {
                    log::error!("could not restore the optimizer state after a failed step: {r}");
                }
                Err(e)
            }
        }
    }

    /// Drops the accumulated gradients and overflow flags; the next backward starts afresh.
    /// The f32 buffers that held them are kept and the next backward unscales into them
    /// (PyTorch's `zero_grad(set_to_none=False)` without the zero fill: a first gradient
    /// overwrites, later ones add), so a step allocates no parameter-sized memory of ours.
    /// [`zero_grad_set_to_none`](Self::zero_grad_set_to_none) frees them instead.
    ///
    /// It also drops the gradients of this optimizer's parameters that the run's fused
    /// layers and checkpointed segments produced in earlier backwards and no call has taken
    /// (a backward that also reached this optimizer's parameters, such as a GAN generator's
    /// through the discriminator), and only those: other optimizers' are theirs to drop.
    pub fn zero_grad(&mut self) {
        self.withdraw_all();
        self.clear_grads();
        let owned = self.owned();
        self.run
            .stash()
            .clear(owned.iter().map(|(_, p)| p.working_var().as_tensor()));
    }

    /// [`zero_grad`](Self::zero_grad) that also frees the master-gradient buffers
    /// (PyTorch's `set_to_none=True`): memory between steps drops by one f32 copy of the
    /// trained parameters, and the next backward allocates them again.
    pub fn zero_grad_set_to_none(&mut self) {
        self.zero_grad();
        self.spare.clear();
    }
}
