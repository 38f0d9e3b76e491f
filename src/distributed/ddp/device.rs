//! The step reduction on the device path (gradients stay in device memory; NCCL).

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Tensor};

use super::{DataParallel, step_meta};
use crate::error::{DistErrorKind, Result};

impl DataParallel {
    /// The step reduction on the device path: the same layout as the host path's flat
    /// vector, built and summed as one f32 tensor on the gradients' device
    /// ([`Communicator::all_reduce_sum_tensor`]: in device memory over NCCL), in buckets.
    /// After the sum the averages are checked on the device, and the host reads the layout
    /// check, which parameters had gradients, the overflow flags and the averages' flags in
    /// one transfer (one synchronisation, counted in the run's host reads). A communicator
    /// without a device reduction (`reduces_in_device_memory` false) also reads each bucket
    /// on the host: one more counted read per bucket. Sharded, only this rank's shard of the
    /// averages is kept.
    pub(super) fn reduce_on_device(
        &self,
        run: &crate::train::run::RunState,
        params: Vec<(String, Vec<usize>)>,
        grads: &BTreeMap<String, Tensor>,
        found_inf: &mut [bool],
        nonfinite: &mut Vec<String>,
    ) -> Result<(BTreeMap<String, Tensor>, u64, f64)> {
        let dev = run.store.device().clone();
        let world = self.comm.world_size() as f32;
        // A true division, as the host path's (candle's `t / x` multiplies by `1 / x`).
        let world_t = Tensor::new(world, &dev)?;
        let mut parts = Vec::with_capacity(params.len() + 1);
        for (name, dims) in &params {
            let len: usize = dims.iter().product();
            parts.push(match grads.get(name) {
                // Divided before the sum, as on the host path.
                Some(g) => g.flatten_all()?.to_dtype(DType::F32)?.broadcast_div(&world_t)?,
                None => Tensor::zeros(len, DType::F32, &dev)?,
            });
        }
        let meta = step_meta(&params, grads, found_inf);
        let m = meta.len();
        parts.push(Tensor::from_vec(meta, m, &dev)?);
        let flat = Tensor::cat(&parts, 0)?;
        drop(parts);

        let t0 = Instant::now();
        let total = flat.elem_count();
        let per = (self.config.bucket_bytes / 4).max(1);
        let mut sums = Vec::with_capacity(total.div_ceil(per));
        let mut at = 0;
        while at < total {
            let len = per.min(total - at);
            sums.push(self.comm.all_reduce_sum_tensor(&flat.narrow(0, at, len)?)?);
            at += len;
        }
        let calls = sums.len() as u64;
        if !self.comm.reduces_in_device_memory() {
            // The default tensor sum read each bucket on the host (MPI, `LocalGroup`).
            run.count_host_syncs(calls);
        }
        let flat = Tensor::cat(&sums, 0)?;
        drop(sums);
        let comm_s = t0.elapsed().as_secs_f64();

        let n = total - m;
        let mut avgs = Vec::with_capacity(params.len());
        let mut flags = vec![flat.narrow(0, n, m)?];
        let mut at = 0;
        for (_, dims) in &params {
            let len: usize = dims.iter().product();
            let avg = flat.narrow(0, at, len)?.reshape(dims.as_slice())?;
            flags.push(crate::train::optim::device_flag(&avg)?);
            avgs.push(avg);
            at += len;
        }
        let read = crate::train::optim::read_device_values(run, &flags)?;
        let (meta, avg_bad) = read.split_at(m);
        if meta[m - 1] != params.len() as f32 * world {
            return Err(self.err(
                DistErrorKind::Mismatch,
                "the ranks stepped optimizers over different parameters (the same optimizers, over the same \
                 parameters, must step in the same order on every rank)"
                    .into(),
            ));
        }
        let (present, flag_sums) = meta.split_at(params.len());
        // Sharded (either stage: the device path has no reduce-scatter of device tensors, so
        // stage 2 all-reduces as stage 1 does): every average is checked, this rank's kept.
        if self.sharding.is_sharded() {
            let sized: Vec<(String, usize)> = params
                .iter()
                .map(|(n, d)| (n.clone(), d.iter().product::<usize>()))
                .collect();
            self.place(&run.store, &sized);
        }
        let me = self.comm.rank();
        let mut out = BTreeMap::new();
        for ((((name, _), avg), &had), &bad) in params.into_iter().zip(avgs).zip(present).zip(avg_bad) {
            if had > 0.0 {
                if bad.is_nan() {
                    nonfinite.push(name.clone());
                }
                if self.sharding.is_sharded() && self.owner_of(&name).is_some_and(|r| r != me) {
                    continue;
                }
                // Its own storage, so the step's bucket is freed.
                out.insert(name, avg.copy()?);
            }
        }
        for (f, &v) in found_inf.iter_mut().zip(flag_sums) {
            *f = v > 0.0;
        }
        Ok((out, calls, comm_s))
    }
}
