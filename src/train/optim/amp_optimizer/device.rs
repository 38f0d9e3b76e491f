//! The device path: master gradients, optimizer state and overflow flags stay on the
//! parameters' device, and the host reads one small vector of flags per backward.
//!
//! Off the CPU every host read of a device value is a synchronisation that stalls the
//! device's queue. PyTorch's AMP never reads on the host (`_amp_foreach_non_finite_check_and_unscale_`
//! writes a device flag that `step` consults on the device); Apex's `scale_loss` reads its
//! overflow buffer once per backward. Our `BackwardReport` (`found_inf`, `nonfinite`), the
//! step outcome, the skip counters and `PersistentOverflow` need the verdict on the host, so
//! we do as Apex does: each backward through the pipeline (the guard's, `GradScaler`'s) reads
//! its flags in one host transfer before it writes anything: the loss's flag and one per
//! master gradient it produces (the sum, when micro-batches accumulate, so an overflowing sum
//! is caught by the backward that made it, as on the CPU path). A report's `found_inf` is
//! therefore always the verdict, never "not known yet", and the step reads nothing more
//! unless something changed the gradients since (a step reducer's sums are checked in their
//! own read). A step with one backward costs one host read; with k micro-batches, k. The
//! loss scale needs no device copy: the host decides it from those flags.
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

use super::AmpOptimizer;
use crate::error::Result;

/// The flag of a tensor: a 0-d f32 tensor on its device, 0 if every value is finite, NaN if
/// not. No host read.
pub(crate) fn flag(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(DType::F32)?.affine(0.0, 0.0)?.sum_all()?)
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
