//! Stages 3 and 4 of the backward pipeline for one optimizer: unscale and check into the
//! master gradients, accumulate.

use candle_core::{DType, Tensor, Var};

use super::{AmpOptimizer, Round, Stage};
use crate::error::{AmpError, Result};

/// Stage 3's output for one optimizer: one backward's unscaled gradients, made without
/// changing anything the optimizer holds, for [`AmpOptimizer::add_in_place`] and
/// [`AmpOptimizer::commit`] to apply once nothing can fail any more. A backward that fails
/// before then leaves the optimizer as it was.
#[derive(Debug)]
pub(crate) struct Unscaled {
    /// Master gradients to insert at the commit: parameters' first gradients this step (in a
    /// new buffer or a spare one), and sums made apart (off the CPU, or with the kernels off)
    /// that replace the live ones.
    pub grads: Vec<(String, Tensor)>,
    /// The parameters whose buffer in `grads` is a spare: taken from the spares at the commit.
    spares: Vec<String>,
    /// Raw gradients to add into the live master gradients in place, at the commit.
    adds: Vec<(String, Tensor)>,
    /// Whether `found_inf` and `nonfinite` already cover the sums `adds` will make (checked
    /// without writing, for a verdict that must be combined before anything is written).
    adds_checked: bool,
    scale: f32,
    check: bool,
    /// Whether any was non-finite.
    pub found_inf: bool,
    /// Which.
    pub nonfinite: Vec<String>,
    /// On the device path (with the check on): each new master gradient's flag, on the
    /// device (see the `device` module), for the pipeline to read with the loss's in one host
    /// transfer ([`Unscaled::resolve`]); until then `found_inf` is false.
    pub device_flags: Vec<(String, Tensor)>,
}

impl Unscaled {
    /// Records the device path's verdict for this optimizer's flags: `set` holds, in the
    /// order of [`device_flags`](Self::device_flags), whether each master gradient was
    /// non-finite (read by the pipeline in one host transfer with every other optimizer's).
    pub(crate) fn resolve(&mut self, set: &[bool]) {
        for ((name, _), bad) in std::mem::take(&mut self.device_flags).into_iter().zip(set) {
            if *bad {
                self.found_inf = true;
                self.nonfinite.push(name);
            }
        }
    }
}

impl AmpOptimizer {
    /// Stage 3 of the backward pipeline for this optimizer's parameters: checks each raw
    /// gradient and unscales it in one pass. A parameter's first gradient this step goes into
    /// a buffer kept from an earlier step (no one reads it), or a new one the first time;
    /// where the parameter already has a master gradient (accumulation), the raw gradient is
    /// added to it in place at the commit ([`add_in_place`](Self::add_in_place)), and the sum
    /// checked in the same pass (two finite gradients can overflow together). With
    /// `verdict_first` (something that can fail, such as combining the verdict across
    /// processes, comes before the commit) the sums are checked now, without writing.
    /// Changes nothing the optimizer holds: see [`Unscaled`].
    pub(crate) fn unscale_into(
        &self,
        grads: &candle_core::backprop::GradStore,
        params: &[(String, Var)],
        scale: f32,
        check: bool,
        verdict_first: bool,
    ) -> Result<Unscaled> {
        use crate::kernels::unscale::{sum_nonfinite, unscale_check, unscale_check_into};
        let mut out = Unscaled {
            grads: Vec::new(),
            spares: Vec::new(),
            adds: Vec::new(),
            adds_checked: verdict_first,
            scale,
            check,
            found_inf: false,
            nonfinite: Vec::new(),
            device_flags: Vec::new(),
        };
        if self.device_path() {
            // Tensor ops on the device, checked there: each master gradient this backward
            // makes (the sum, when micro-batches accumulate: two finite gradients can
            // overflow together) gets a flag, read by the pipeline before anything is written.
            // On CUDA one kernel launch makes them all (the same arithmetic); what it does not
            // take (another type, an empty tensor) runs the tensor ops below.
            // The flags stay in the parameters' order (the reports list names in it).
            let mut made = self.unscale_on_cuda(grads, params, scale)?;
            for (name, var) in params {
                let Some(raw) = grads.get(var.as_tensor()) else {
                    continue;
                };
                if let Some((g, flag)) = made.remove(name) {
                    if check {
                        out.device_flags.push((name.clone(), flag));
                    }
                    out.grads.push((name.clone(), g));
                    continue;
                }
                let g = crate::kernels::unscale::unscale_tensor(raw, scale)?;
                let g = match self.grads.get(name) {
                    Some(live) => (live + g.reshape(live.shape())?)?.detach(),
                    // At a scale of 1 an f32 gradient unscales to itself: a master gradient
                    // is storage of its own, never the caller's gradient.
                    None => crate::kernels::apart_from(&g, &[raw])?,
                };
                if check {
                    out.device_flags.push((name.clone(), super::device::flag(&g)?));
                }
                out.grads.push((name.clone(), g));
            }
            return Ok(out);
        }
        // Written in place by the one-pass kernel: f32 CPU storage of the raw gradient's size,
        // shared with nothing the raw gradient is.
        let in_place = |buf: &Tensor, raw: &Tensor| {
            crate::kernels::enabled()
                && buf.device().is_cpu()
                && raw.device().is_cpu()
                && buf.dtype() == DType::F32
                && matches!(raw.dtype(), DType::F32 | DType::F16 | DType::BF16 | DType::F64)
                && buf.is_contiguous()
                && buf.shape() == raw.shape()
                && !crate::kernels::same_storage(buf, raw)
        };
        for (name, var) in params {
            let Some(raw) = grads.get(var.as_tensor()) else {
                continue;
            };
            let raw = raw.detach();
            let bad = match self.grads.get(name) {
                Some(live) if in_place(live, &raw) => {
                    let bad = verdict_first && check && sum_nonfinite(&raw, scale, live)?;
                    out.adds.push((name.clone(), raw));
                    bad
                }
                Some(live) => {
                    // Another device (or the kernels off): unscale, then add, checked.
                    let (g, bad) = unscale_check(&raw, scale, check)?;
                    let (sum, sum_bad) = crate::kernels::unscale::add_check(live, &g, check)?;
                    out.grads.push((name.clone(), sum));
                    bad || sum_bad
                }
                None => match self.spare.get(name) {
                    Some(buf) if in_place(buf, &raw) => {
                        let bad = unscale_check_into(&raw, scale, buf, false)?;
                        out.grads.push((name.clone(), buf.clone()));
                        out.spares.push(name.clone());
                        bad
                    }
                    _ => {
                        let (g, bad) = unscale_check(&raw, scale, check)?;
                        out.grads.push((name.clone(), g));
                        bad
                    }
                },
            };
            if check && bad {
                out.found_inf = true;
                out.nonfinite.push(name.clone());
            }
        }
        Ok(out)
    }

    /// The device path's unscale and check of `params`' raw gradients by the multi-tensor
    /// kernel, in one launch (CUDA, kernels on): each master gradient and flag it made, by
    /// parameter name; the rest are left to the tensor ops.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn unscale_on_cuda(
        &self,
        grads: &candle_core::backprop::GradStore,
        params: &[(String, Var)],
        scale: f32,
    ) -> Result<std::collections::HashMap<String, (Tensor, Tensor)>> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut made = std::collections::HashMap::new();
        #[cfg(feature = "cuda")]
        if crate::kernels::enabled() && self.run.store.device().is_cuda() {
            let mut names = Vec::new();
            let mut items = Vec::new();
            for (name, var) in params {
                if let Some(raw) = grads.get(var.as_tensor()) {
                    names.push(name);
                    items.push((raw, self.grads.get(name)));
                }
            }
            let out = crate::kernels::cuda::multi_tensor::unscale_check(&items, scale)?;
            for (name, m) in names.into_iter().zip(out) {
                if let Some(m) = m {
                    made.insert(name.clone(), m);
                }
            }
        }
        Ok(made)
    }

    /// The first write of a backward: adds the raw gradients `u` holds into the live master
    /// gradients in place (checked by [`unscale_into`](Self::unscale_into): CPU buffers of the
    /// right type and size, so the kernel does not refuse), recording in `u` the sums that
    /// overflowed unless they were checked before.
    pub(crate) fn add_in_place(&self, u: &mut Unscaled) -> Result<()> {
        for (name, raw) in std::mem::take(&mut u.adds) {
            let Some(live) = self.grads.get(&name) else {
                continue;
            };
            let bad = crate::kernels::unscale::unscale_check_into(&raw, u.scale, live, true)?;
            if u.check && bad && !u.adds_checked {
                u.found_inf = true;
                u.nonfinite.push(name);
            }
        }
        Ok(())
    }

    /// Refuses a backward this optimizer cannot take: after a step without `zero_grad`, or
    /// for a loss id the run does not have. Checked before anything is written.
    pub(crate) fn check_accumulate(&self, round: Round) -> Result<()> {
        self.check_can_backward("backward")?;
        if let Round::Loss(loss_id) = round {
            let n = self.run.props.num_losses;
            if loss_id >= n {
                return Err(AmpError::LossId {
                    id: loss_id,
                    num_losses: n,
                });
            }
        }
        Ok(())
    }

    /// Stage 4 of the backward pipeline, the commit: records one backward's unscaled
    /// gradients (already detached f32; those accumulated in place were added by
    /// [`add_in_place`](Self::add_in_place)), OR-s its overflow flag into the round's, and
    /// counts the micro-batch. Nothing here can fail: everything that can was done before
    /// ([`check_accumulate`](Self::check_accumulate), [`unscale_into`](Self::unscale_into),
    /// the device path's read of the flags).
    pub(crate) fn commit(&mut self, round: Round, u: Unscaled, found_inf: bool, nonfinite: Vec<String>) {
        for name in &u.spares {
            self.spare.remove(name);
        }
        self.grads.extend(u.grads);
        *self.found_inf.entry(round).or_insert(false) |= found_inf;
        self.nonfinite.extend(nonfinite);
        self.micro_batches += 1;
        self.stage = Stage::HasGrads;
        if let Round::Loss(loss_id) = round
            && let Some(s) = self.run.scalers_mut().get_mut(loss_id)
        {
            s.enlist(self.id);
        }
    }

    /// The (name, working Var) pairs of the parameters this optimizer trains. Checks
    /// parameters built since the last call against other optimizers' claims.
    pub(crate) fn trained_vars(&mut self) -> Result<Vec<(String, Var)>> {
        self.check_claims()?;
        Ok(self
            .owned()
            .into_iter()
            .filter(|(_, p)| p.trains())
            .map(|(_, p)| (p.name().to_string(), p.working_var().clone()))
            .collect())
    }

    /// Parameter `name`'s master gradient accumulated so far in this step (`None` before its
    /// first gradient): the value the next backward adds to.
    pub(crate) fn live_grad(&self, name: &str) -> Option<Tensor> {
        self.grads.get(name).cloned()
    }

    /// Whether the gradients scaled by an outside `GradScaler` overflowed.
    pub(crate) fn external_found_inf(&self) -> bool {
        self.found_inf.get(&Round::External).copied().unwrap_or(false)
    }
}
