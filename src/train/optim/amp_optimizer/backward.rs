//! Stages 3 and 4 of the backward pipeline for one optimizer: unscale and check into the
//! master gradients, accumulate.

use candle_core::{DType, Tensor, Var};

use super::{AmpOptimizer, Round, Stage};
use crate::error::{AmpError, Result};

impl AmpOptimizer {
    /// Stage 3 of the backward pipeline for this optimizer's parameters: checks each raw
    /// gradient and unscales it into its f32 master gradient in one pass. Where the
    /// parameter already has a master gradient this step (accumulation), the unscaled value
    /// is added to it in place and the sum is checked in the same pass (two finite
    /// gradients can overflow together); otherwise it is written into a buffer kept from an
    /// earlier step, or into a new one the first time. Returns the new master gradients
    /// for [`accumulate`](Self::accumulate), and what was non-finite.
    pub(crate) fn unscale_into(
        &mut self,
        grads: &candle_core::backprop::GradStore,
        params: &[(String, Var)],
        scale: f32,
        check: bool,
    ) -> Result<crate::train::guard::Unscaled> {
        use crate::kernels::unscale::{unscale_check, unscale_check_into};
        let mut out = crate::train::guard::Unscaled {
            grads: Vec::new(),
            found_inf: false,
            nonfinite: Vec::new(),
            device_flag: None,
        };
        if self.device_path() {
            // Tensor ops on the device, checked there: the flag is read at the step.
            let mut flag: Option<Tensor> = None;
            for (name, var) in params {
                let Some(raw) = grads.get(var.as_tensor()) else {
                    continue;
                };
                let g = crate::kernels::unscale::unscale_tensor(raw, scale)?;
                if check {
                    let f = super::device::flag(&g)?;
                    flag = Some(match flag {
                        Some(a) => (a + f)?,
                        None => f,
                    });
                }
                let g = match self.grads.get(name) {
                    Some(live) => (live + g.reshape(live.shape())?)?.detach(),
                    None => g,
                };
                out.grads.push((name.clone(), g));
            }
            out.device_flag = Some(match flag {
                Some(f) => f,
                None => Tensor::zeros((), DType::F32, self.run.store.device())?,
            });
            return Ok(out);
        }
        let in_place = |buf: &Tensor, raw: &Tensor| {
            crate::kernels::enabled()
                && buf.device().is_cpu()
                && raw.device().is_cpu()
                && buf.dtype() == DType::F32
                && buf.is_contiguous()
                && buf.shape() == raw.shape()
        };
        for (name, var) in params {
            let Some(raw) = grads.get(var.as_tensor()) else {
                continue;
            };
            let raw = raw.detach();
            let bad = match self.grads.get(name) {
                Some(live) if in_place(live, &raw) => unscale_check_into(&raw, scale, live, true)?,
                Some(live) => {
                    // Another device (or the kernels off): unscale, then add, checked.
                    let (g, bad) = unscale_check(&raw, scale, check)?;
                    let (sum, sum_bad) = crate::kernels::unscale::add_check(live, &g, check)?;
                    out.grads.push((name.clone(), sum));
                    bad || sum_bad
                }
                None => match self.spare.remove(name) {
                    Some(buf) if in_place(&buf, &raw) => {
                        let bad = unscale_check_into(&raw, scale, &buf, false)?;
                        out.grads.push((name.clone(), buf));
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

    /// Stage 4 of the backward pipeline: adds one backward's unscaled gradients (already
    /// detached f32) and OR-s its overflow flag into the round's.
    pub(crate) fn accumulate(
        &mut self,
        round: Round,
        grads: Vec<(String, Tensor)>,
        found_inf: bool,
        nonfinite: Vec<String>,
        device_flags: Option<(Option<Tensor>, Option<Tensor>)>,
    ) -> Result<()> {
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
        // Gradients accumulated in place (and their sums checked) by `unscale_into`; these
        // are the parameters' first gradients this step, or sums made off the CPU.
        self.grads.extend(grads);
        *self.found_inf.entry(round).or_insert(false) |= found_inf;
        // The device path: this backward's gradient and loss flags, read at the step.
        if let Some((grads, loss)) = device_flags {
            self.defer_flags(round, grads, loss)?;
        }
        self.nonfinite.extend(nonfinite);
        self.micro_batches += 1;
        self.stage = Stage::HasGrads;
        if let Round::Loss(loss_id) = round {
            self.run.scalers_mut()[loss_id].enlist(self.id);
        }
        Ok(())
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

    /// Whether the gradients scaled by an outside `GradScaler` overflowed.
    pub(crate) fn external_found_inf(&self) -> bool {
        self.found_inf.get(&Round::External).copied().unwrap_or(false)
    }
}
