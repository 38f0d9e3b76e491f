//! The device path: master gradients, optimizer state and overflow flags stay on the
//! parameters' device, and the host reads one small vector of flags per optimizer step.
//!
//! Off the CPU every host read of a device value is a synchronisation that stalls the
//! device's queue. PyTorch's AMP never reads on the host (`_amp_foreach_non_finite_check_and_unscale_`
//! writes a device flag that `step` consults on the device); our step outcome, skip counters
//! and `PersistentOverflow` need the verdict on the host, so the flags are read once, at the
//! step, all together: one flag per scaling round (which loss scaler's gradients overflowed),
//! one for the losses, and one per applied master gradient (checked after every sum that
//! produced it). The loss scale needs no device copy: the host decides it from those flags.
//!
//! A flag is `sum(x * 0)` over a tensor in f32: 0 when every value is finite, NaN otherwise
//! (`inf * 0` and `NaN * 0` are NaN), so the sum of flags is again a flag and large finite
//! values cannot overflow it.
//!
//! The CPU takes the device path too when the run forces it ([`crate::AmpConfig::device_path`],
//! `CANDLE_AMP_FORCE_DEVICE_PATH=1`): then the same tensor ops run on the CPU, so every machine
//! tests what a GPU runs.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use super::{AmpOptimizer, Round};
use crate::error::Result;

/// Overflow flags of the device path not read on the host yet.
#[derive(Debug, Default, Clone)]
pub(crate) struct Pending {
    /// Per scaling round, the sum of its backwards' flags (raw gradients and losses).
    rounds: BTreeMap<Round, Tensor>,
    /// The sum of the losses' flags (reported as `"<loss>"`).
    loss: Option<Tensor>,
}

impl Pending {
    pub(crate) fn is_empty(&self) -> bool {
        self.rounds.is_empty() && self.loss.is_none()
    }

    /// These flags with one backward's (its raw gradients' and its loss's) added for
    /// `round`; `self` is left as it is, so a backward that fails later changes nothing.
    pub(crate) fn with(
        &self,
        round: Round,
        grads: Option<Tensor>,
        loss: Option<Tensor>,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let mut p = self.clone();
        if let Some(l) = &loss {
            p.loss = Some(add(p.loss.take(), l)?);
        }
        let both = match (grads, loss) {
            (Some(g), Some(l)) => Some((g + l)?),
            (g, l) => g.or(l),
        };
        let entry = p.rounds.remove(&round);
        let sum = match both {
            Some(b) => add(entry, &b)?,
            None => match entry {
                Some(e) => e,
                // A round with nothing to check still takes part (the scaler waits for it).
                None => Tensor::zeros((), DType::F32, device)?,
            },
        };
        p.rounds.insert(round, sum);
        Ok(p)
    }
}

/// The flag of a tensor: a 0-d f32 tensor on its device, 0 if every value is finite, NaN if
/// not. No host read.
pub(crate) fn flag(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(DType::F32)?.affine(0.0, 0.0)?.sum_all()?)
}

/// `a + b` for two optional flags.
fn add(a: Option<Tensor>, b: &Tensor) -> Result<Tensor> {
    Ok(match a {
        Some(a) => (a + b)?,
        None => b.clone(),
    })
}

/// Reads f32 tensors (any shape) in one host transfer, one synchronisation counted by
/// `run`, their values concatenated in order.
pub(crate) fn read_values(run: &crate::train::run::RunState, ts: &[Tensor]) -> Result<Vec<f32>> {
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    let flat: Vec<Tensor> = ts.iter().map(|t| t.flatten_all()).collect::<candle_core::Result<_>>()?;
    let v = Tensor::cat(&flat, 0)?.to_vec1::<f32>()?;
    run.count_host_sync();
    Ok(v)
}

/// Reads flags in one host transfer (see [`read_values`]) and returns which are set.
pub(crate) fn read_flags(run: &crate::train::run::RunState, flags: &[Tensor]) -> Result<Vec<bool>> {
    Ok(read_values(run, flags)?.into_iter().map(|x| x.is_nan()).collect())
}

impl AmpOptimizer {
    /// Whether this optimizer's gradients take the device path (see the module docs).
    pub(crate) fn device_path(&self) -> bool {
        self.run.device_path()
    }

    /// Reads the pending flags and the applied gradients' flags in one host transfer and
    /// records the verdict as the CPU path would have: which rounds overflowed and which
    /// parameters (or `"<loss>"`). A sum that overflowed although none of its backwards did
    /// marks every round of the step (the device path does not know which addition did it).
    pub(crate) fn resolve_flags(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let verdict = self.read_pending()?;
        self.pending = Pending::default();
        self.record(verdict);
        Ok(())
    }

    /// What [`resolve_flags`](Self::resolve_flags) would record, without recording it.
    pub(crate) fn read_pending(&self) -> Result<Verdict> {
        let rounds: Vec<Round> = self.pending.rounds.keys().copied().collect();
        let names: Vec<String> = self.grads.keys().cloned().collect();
        let mut flags: Vec<Tensor> = self.pending.rounds.values().cloned().collect();
        let loss = self.pending.loss.is_some();
        flags.extend(self.pending.loss.clone());
        for g in self.grads.values() {
            flags.push(flag(g)?);
        }
        let check = self.run.props.enabled;
        let set = read_flags(&self.run, &flags)?;
        let (round_set, rest) = set.split_at(rounds.len());
        let (loss_set, grad_set) = rest.split_at(usize::from(loss));
        let mut nonfinite: Vec<String> = Vec::new();
        if loss_set.first() == Some(&true) {
            nonfinite.push("<loss>".into());
        }
        nonfinite.extend(names.into_iter().zip(grad_set).filter(|(_, b)| **b).map(|(n, _)| n));
        let mut rounds: Vec<(Round, bool)> = rounds.into_iter().zip(round_set.iter().copied()).collect();
        if !nonfinite.is_empty() && !rounds.iter().any(|r| r.1) {
            rounds.iter_mut().for_each(|r| r.1 = true);
        }
        if !check {
            nonfinite.clear();
            rounds.iter_mut().for_each(|r| r.1 = false);
        }
        Ok(Verdict { rounds, nonfinite })
    }

    fn record(&mut self, v: Verdict) {
        for (round, inf) in v.rounds {
            *self.found_inf.entry(round).or_insert(false) |= inf;
        }
        self.nonfinite.extend(v.nonfinite);
    }

    /// Checks the given gradients (a step reducer's output) with one host transfer and
    /// returns the names of the non-finite ones.
    pub(crate) fn check_on_device(&self, grads: &BTreeMap<String, Tensor>) -> Result<Vec<String>> {
        let flags: Vec<Tensor> = grads.values().map(flag).collect::<Result<_>>()?;
        let set = read_flags(&self.run, &flags)?;
        Ok(grads
            .keys()
            .zip(set)
            .filter(|(_, b)| *b)
            .map(|(n, _)| n.clone())
            .collect())
    }
}

/// The host's reading of the flags of a step.
#[derive(Debug)]
pub(crate) struct Verdict {
    rounds: Vec<(Round, bool)>,
    nonfinite: Vec<String>,
}

impl Verdict {
    /// Whether any round overflowed.
    pub(crate) fn any(&self) -> bool {
        self.rounds.iter().any(|r| r.1)
    }
}
