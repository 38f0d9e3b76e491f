//! The host path's step reduction: one small collective for the flags and the layout,
//! then the gradients in buckets (or, with overlap, the buckets the backward already sent;
//! under ZeRO stage 2 a reduce-scatter).

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Tensor};

use super::{DataParallel, lock, step_meta};
use crate::error::{DistErrorKind, Result};

use super::super::zero::{self, Sharding};

impl DataParallel {
    /// [`StepReducer::reduce_step`](crate::train::reduce::StepReducer::reduce_step) off the
    /// device path.
    pub(super) fn reduce_on_host(
        &self,
        params: Vec<(String, Vec<usize>)>,
        grads: &mut BTreeMap<String, Tensor>,
        found_inf: &mut [bool],
        nonfinite: &mut Vec<String>,
        checked: &mut bool,
    ) -> Result<()> {
        let sizes: Vec<usize> = params.iter().map(|(_, d)| d.iter().product()).collect();
        let world = self.comm.world_size() as f32;
        // With overlap, the buckets sent during the backward: waited for here (what is still
        // on its way is the exposed part of their time).
        let overlap = self.overlap();
        let t_drain = Instant::now();
        let ov_flags = match &overlap {
            Some(o) => Some(o.step_flags(&params)?),
            None => None,
        };
        let drain_s = if overlap.is_some() {
            t_drain.elapsed().as_secs_f64()
        } else {
            0.0
        };
        let (thread_s, summed) = overlap.as_ref().map_or((0.0, 0), |o| o.take_thread_secs());
        let mut meta = step_meta(&params, grads, found_inf);
        if let Some(f) = ov_flags {
            let at = meta.len() - 1;
            meta.splice(at..at, f.values());
        }
        let check = params.len() as f32;

        // The first collective returns once the slowest rank has called it: the waiting.
        let t0 = Instant::now();
        // Its length is the parameter count plus the flags: ranks that step over different
        // parameters (one built on some ranks only) or at different points (one rank in a
        // step while another's buckets are on their way) meet here with different lengths,
        // which the communicator refuses before anything is summed.
        self.comm.all_reduce_sum(&mut meta).map_err(|e| match e {
            crate::AmpError::Distributed {
                rank,
                kind: DistErrorKind::Mismatch,
                detail,
            } => self.err(
                DistErrorKind::Mismatch,
                format!(
                    "the step's agreement on rank {rank} over {} parameter(s) met another collective or another \
                     parameter count ({detail}): every rank must step the same optimizers over the same \
                     parameters, in the same backwards (no_sync on every rank or none)",
                    params.len()
                ),
            ),
            e => e,
        })?;
        let wait_s = t0.elapsed().as_secs_f64();
        // The layout is checked before any gradient moves: ranks that disagree would
        // otherwise pair up buckets of different lengths.
        if *meta.last().expect("non-empty") != check * world {
            return Err(self.err(
                DistErrorKind::Mismatch,
                "the ranks stepped optimizers over different parameters (the same optimizers, over the same \
                 parameters, must step in the same order on every rank)"
                    .into(),
            ));
        }
        // The overlap's agreement: the buckets hold every rank's whole step; every rank
        // learned the order; some rank's plan no longer fits.
        let (use_buckets, learned_everywhere, stale) = match ov_flags {
            Some(_) => {
                let at = params.len() + found_inf.len();
                (meta[at] == world, meta[at + 1] == world, meta[at + 2] > 0.0)
            }
            None => (false, false, false),
        };
        let sharding = self.sharding;
        let me = self.comm.rank();
        let shards = if sharding.is_sharded() {
            // Parameters built since the last step join the partition (the same on every rank:
            // the layout check above passed).
            if let Some(run) = self.run.upgrade() {
                let sized: Vec<(String, usize)> = params
                    .iter()
                    .map(|(n, _)| n.clone())
                    .zip(sizes.iter().copied())
                    .collect();
                self.place(&run.store, &sized);
            }
            Some(lock(&self.shards).clone())
        } else {
            None
        };
        let present = &meta[..params.len()];
        let flags = &meta[params.len()..params.len() + found_inf.len()];
        for (f, &v) in found_inf.iter_mut().zip(flags) {
            *f = v > 0.0;
        }
        let device = grads
            .values()
            .next()
            .map_or(candle_core::Device::Cpu, |g| g.device().clone());
        let flat = if use_buckets {
            Vec::new()
        } else {
            let mut flat = Vec::with_capacity(sizes.iter().sum());
            for ((name, _), &len) in params.iter().zip(&sizes) {
                match grads.get(name) {
                    // Divided before the sum, as PyTorch's DDP does: the sum of the shares
                    // is finite wherever the average is (2e38 on each of two ranks averages
                    // to 2e38, where their sum would be inf).
                    Some(g) => {
                        let v = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                        flat.extend(v.into_iter().map(|g| g / world));
                    }
                    None => flat.resize(flat.len() + len, 0.0),
                }
            }
            flat
        };
        let mut flat = flat;
        // Only the collectives count as the transfer.
        let mut transfer_s = 0.0;
        let mut timed = |t: Instant| transfer_s += t.elapsed().as_secs_f64();
        let per = (self.config.bucket_bytes / 4).max(1);
        let mut out = BTreeMap::new();
        let calls = match (&shards, sharding) {
            (Some(shards), Sharding::Stage2) => {
                let t = Instant::now();
                let (sums, rounds) = zero::reduce_scatter_shares(&*self.comm, shards, &params, &sizes, &flat, per)?;
                timed(t);
                drop(flat);
                // This rank's shard is checked in the pass that keeps it; the ranks then agree
                // on the verdict, so every rank skips the same steps.
                let mut bad = 0usize;
                for (((name, dims), sum), &had) in params.iter().zip(sums).zip(present) {
                    let Some(avg) = sum else { continue };
                    if had > 0.0 {
                        if avg.iter().any(|g| !g.is_finite()) {
                            nonfinite.push(name.clone());
                            bad += 1;
                        }
                        out.insert(name.clone(), Tensor::from_vec(avg, dims.as_slice(), &device)?);
                    }
                }
                let mut agree = [bad as f32];
                let t = Instant::now();
                self.comm.all_reduce_sum(&mut agree)?;
                timed(t);
                if agree[0] > 0.0 {
                    found_inf.fill(true);
                }
                rounds + 2
            }
            _ => {
                // With overlap, the averages are already in the buckets on every rank.
                let results = overlap.as_ref().filter(|_| use_buckets).map(|o| o.results());
                let calls = if results.is_some() {
                    1
                } else {
                    let mut buckets: Vec<&mut [f32]> = flat.chunks_mut(per).collect();
                    let calls = buckets.len() as u64 + 1;
                    let t = Instant::now();
                    self.comm.all_reduce_sum_buckets(&mut buckets)?;
                    timed(t);
                    calls
                };
                let mut at = 0;
                for (((name, dims), &len), &had) in params.iter().zip(&sizes).zip(present) {
                    if had > 0.0 {
                        // The average is what the optimizer applies: checked in this pass, on
                        // every rank for every parameter (so the verdict needs no exchange).
                        let avg = match &results {
                            Some(r) => r.get(name).ok_or_else(|| {
                                self.err(
                                    DistErrorKind::Mismatch,
                                    format!("parameter `{name}` is in no bucket of the overlap's plan"),
                                )
                            })?,
                            None => &flat[at..at + len],
                        };
                        if avg.iter().any(|g| !g.is_finite()) {
                            nonfinite.push(name.clone());
                        }
                        // Sharded (stage 1): only this rank's shard is kept and stepped.
                        if shards.as_ref().is_none_or(|s| s.owner(name) == Some(me)) {
                            out.insert(name.clone(), Tensor::from_vec(avg.to_vec(), dims.as_slice(), &device)?);
                        }
                    }
                    at += len;
                }
                calls
            }
        };
        let mut calls = calls + summed;
        if let Some(o) = &overlap {
            let t = Instant::now();
            calls += o.after_agreement(&*self.comm, stale, learned_everywhere)?;
            timed(t);
        }
        *checked = true;
        *grads = out;
        // With overlap the buckets' all-reduces ran on the thread (during the backward,
        // mostly); the step saw only the wait for those still on their way.
        self.record_overlapped(calls, wait_s, transfer_s, thread_s, drain_s);
        if use_buckets {
            lock(&self.stats).overlapped += 1;
        }
        Ok(())
    }
}
