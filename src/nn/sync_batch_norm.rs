//! Synchronised batch norm's statistics: per-channel sums all-reduced over the data-parallel
//! group in the forward, and the two per-channel sums the input gradient needs all-reduced
//! in the backward (PyTorch's `SyncBatchNorm`, Apex's `convert_syncbn_model`).
//!
//! Two implementations of the same arithmetic:
//!
//! * the host path (the CPU, not forced onto the device path): a custom op whose CPU forward
//!   sums in f64 per channel and reduces host buffers ([`Communicator::all_reduce_sum`]);
//! * the device path (off the CPU always, on the CPU when the run forces it): tensor ops on
//!   the input's device, the per-channel vectors summed with
//!   [`Communicator::all_reduce_sum_tensor`] (in device memory over NCCL). Nothing is read on
//!   the host here: the global count stays a device tensor too. A graph node carries the
//!   normalised values (computed before) and its backward, which reduces the gradient sums.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::comm::Communicator;
use crate::precision::autocast::SyncGroup;

/// What a synchronised forward gives the layer: the normalised `(C, M)` rows and the
/// running statistics' new terms (already times the momentum).
pub(super) struct Synced {
    /// The normalised rows.
    pub yt: Tensor,
    /// The global mean times the momentum (`None` without `remove_mean`).
    pub mean_m: Option<Tensor>,
    /// The global unbiased variance times the momentum.
    pub var_m: Tensor,
}

/// Normalises the f32 rows `xt` (`(C, everything else)`) with statistics over every rank of
/// `group`; on the device path whenever the run takes it or `xt` is off the CPU.
pub(super) fn normalise(xt: &Tensor, group: &SyncGroup, eps: f64, remove_mean: bool, momentum: f64) -> Result<Synced> {
    if group.device_path || !xt.device().is_cpu() {
        on_device(xt, group.comm.clone(), eps, remove_mean, momentum)
    } else {
        on_host(xt, group.comm.clone(), eps, remove_mean, momentum)
    }
}

/// Keeps the communicator's typed error (a timeout stays `Distributed { kind: Timeout }`
/// when it comes back through candle to our API), with where it happened as context.
fn comm_err(e: crate::AmpError) -> candle_core::Error {
    candle_core::Error::from(e).context("synchronised batch norm")
}

fn on_host(xt: &Tensor, group: Arc<dyn Communicator>, eps: f64, remove_mean: bool, m: f64) -> Result<Synced> {
    let stats = Arc::new(Mutex::new(None));
    let op = SyncNorm {
        group,
        eps,
        remove_mean,
        stats: stats.clone(),
    };
    let yt = if xt.track_op() {
        xt.apply_op1(op)?
    } else {
        xt.apply_op1_no_bwd(&op)?
    };
    let st = stats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .ok_or_else(|| candle_core::Error::Msg("synchronised batch norm: no statistics".into()))?;
    let n = st.count;
    let unbiased = if n > 1.0 { n / (n - 1.0) } else { 1.0 };
    let dev = xt.device();
    let c = st.var.len();
    let mean_m = if remove_mean {
        Some((Tensor::from_vec(st.mean, c, dev)? * m)?)
    } else {
        None
    };
    let var_m = (Tensor::from_vec(st.var, c, dev)? * (m * unbiased))?;
    Ok(Synced { yt, mean_m, var_m })
}

/// Global statistics of one synchronised forward on the host, per channel.
#[derive(Debug, Clone)]
struct SyncStats {
    mean: Vec<f32>,
    /// Biased variance (the normalisation's).
    var: Vec<f32>,
    rstd: Vec<f32>,
    /// Values per channel over every rank.
    count: f64,
}

/// Normalises `(C, M)` f32 rows with statistics all-reduced over the group in host buffers;
/// its backward all-reduces the two per-channel sums the input gradient needs. CPU only
/// (other devices take [`on_device`]).
struct SyncNorm {
    group: Arc<dyn Communicator>,
    eps: f64,
    remove_mean: bool,
    stats: Arc<Mutex<Option<SyncStats>>>,
}

impl CustomOp1 for SyncNorm {
    fn name(&self) -> &'static str {
        "amp-sync-batch-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("synchronised batch norm: non-contiguous input".into()))?;
        let CpuStorage::F32(v) = s else {
            candle_core::bail!("synchronised batch norm: f32 statistics expected, got {:?}", s.dtype())
        };
        let (c, m) = l.shape().dims2()?;
        let x = &v[a..b];
        // Pass 1: the global count and mean (per-channel sums in f64 here, f32 on the wire).
        let mut buf: Vec<f32> = (0..c)
            .map(|i| x[i * m..(i + 1) * m].iter().map(|&v| v as f64).sum::<f64>() as f32)
            .chain([m as f32])
            .collect();
        if !self.remove_mean {
            buf[..c].fill(0.0);
        }
        self.group.all_reduce_sum(&mut buf).map_err(comm_err)?;
        let count = buf[c] as f64;
        let mean: Vec<f32> = buf[..c].iter().map(|s| (*s as f64 / count) as f32).collect();
        // Pass 2: the global biased variance around the global mean.
        let mut sq: Vec<f32> = (0..c)
            .map(|i| {
                x[i * m..(i + 1) * m]
                    .iter()
                    .map(|&v| {
                        let d = v as f64 - mean[i] as f64;
                        d * d
                    })
                    .sum::<f64>() as f32
            })
            .collect();
        self.group.all_reduce_sum(&mut sq).map_err(comm_err)?;
        let var: Vec<f32> = sq.iter().map(|s| (*s as f64 / count) as f32).collect();
        let rstd: Vec<f32> = var
            .iter()
            .map(|v| (1.0 / (*v as f64 + self.eps).sqrt()) as f32)
            .collect();
        let mut out = vec![0f32; c * m];
        for i in 0..c {
            for (o, &xv) in out[i * m..(i + 1) * m].iter_mut().zip(&x[i * m..(i + 1) * m]) {
                *o = (xv - mean[i]) * rstd[i];
            }
        }
        *self.stats.lock().unwrap_or_else(|p| p.into_inner()) = Some(SyncStats { mean, var, rstd, count });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let st = self
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("synchronised batch norm: backward before forward".into()))?;
        let (c, m) = res.dims2()?;
        let xhat = res.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let g = grad.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        // The two per-channel sums the input gradient needs, over every rank's batch.
        let mut sums: Vec<f32> = (0..c)
            .map(|i| g[i].iter().map(|&v| v as f64).sum::<f64>() as f32)
            .chain((0..c).map(|i| {
                g[i].iter()
                    .zip(&xhat[i])
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>() as f32
            }))
            .collect();
        self.group.all_reduce_sum(&mut sums).map_err(comm_err)?;
        let n = st.count as f32;
        let mut dx = Vec::with_capacity(c * m);
        for i in 0..c {
            let mg = if self.remove_mean { sums[i] / n } else { 0.0 };
            let mgh = sums[c + i] / n;
            dx.extend(
                g[i].iter()
                    .zip(&xhat[i])
                    .map(|(&gv, &h)| st.rstd[i] * (gv - mg - h * mgh)),
            );
        }
        Ok(Some(
            Tensor::from_vec(dx, (c, m), res.device())?.to_dtype(grad.dtype())?,
        ))
    }
}

/// The device path: the host path's arithmetic as tensor ops on `xt`'s device, two
/// per-channel tensor sums (the sums with the count, then the centred squares), no host read.
fn on_device(xt: &Tensor, group: Arc<dyn Communicator>, eps: f64, remove_mean: bool, m: f64) -> Result<Synced> {
    let (c, len) = xt.dims2()?;
    let dev = xt.device();
    let x = xt.detach();
    // Pass 1: the global count and mean.
    let sums = if remove_mean {
        x.sum(1)?
    } else {
        Tensor::zeros(c, DType::F32, dev)?
    };
    let local = Tensor::cat(&[&sums, &Tensor::new(&[len as f32], dev)?], 0)?;
    let global = group.all_reduce_sum_tensor(&local).map_err(comm_err)?;
    let count = global.narrow(0, c, 1)?;
    let mean = global.narrow(0, 0, c)?.broadcast_div(&count)?;
    // Pass 2: the global biased variance around the global mean.
    let centred = x.broadcast_sub(&mean.unsqueeze(1)?)?;
    let sq = group.all_reduce_sum_tensor(&centred.sqr()?.sum(1)?).map_err(comm_err)?;
    let var = sq.broadcast_div(&count)?;
    let rstd = (var.affine(1.0, eps)?.sqrt()?.recip()?).unsqueeze(1)?;
    let yt = centred.broadcast_mul(&rstd)?;
    // n / (n - 1), 1 for a single value (as on the host), without reading n.
    let unbiased = count.broadcast_div(&count.affine(1.0, -1.0)?.maximum(1.0)?)?;
    let var_m = (var.broadcast_mul(&unbiased)? * m)?;
    let mean_m = if remove_mean { Some((mean * m)?) } else { None };
    let yt = if xt.track_op() {
        let node = DeviceNorm {
            group,
            remove_mean,
            rstd,
            count,
            out: Mutex::new(Some(yt)),
        };
        xt.apply_op1(node)?
    } else {
        yt
    };
    Ok(Synced { yt, mean_m, var_m })
}

/// The graph node of a synchronised normalisation on the device path: its argument is the
/// input rows, its value the normalised rows (computed with tensor ops before, copied into
/// the node on its device), and its backward all-reduces the two per-channel gradient sums
/// as one device tensor.
struct DeviceNorm {
    group: Arc<dyn Communicator>,
    remove_mean: bool,
    /// `(C, 1)`: the global inverse standard deviations.
    rstd: Tensor,
    /// `(1,)`: values per channel over every rank.
    count: Tensor,
    /// The normalised rows, until the forward copies them into the node.
    out: Mutex<Option<Tensor>>,
}

impl DeviceNorm {
    /// The normalised rows, which the node's forward takes exactly once.
    fn take_out(&self) -> Result<Tensor> {
        self.out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("synchronised batch norm: its node ran its forward twice".into()))
    }
}

impl CustomOp1 for DeviceNorm {
    fn name(&self) -> &'static str {
        "amp-sync-batch-norm-device"
    }

    /// On the CPU (the forced device path) the host's memory is the device's: a copy.
    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.take_out()?;
        let shape = out.shape().clone();
        Ok((CpuStorage::F32(out.flatten_all()?.to_vec1::<f32>()?), shape))
    }

    /// The normalised rows (computed on the device) copied into the node's own buffer.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _s: &candle_core::CudaStorage, _l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda_owned_copy(&self.take_out()?, "synchronised batch norm: the normalised rows")
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let c = res.dim(0)?;
        let xhat = res.to_dtype(DType::F32)?;
        let g = grad.to_dtype(DType::F32)?;
        // The two per-channel sums the input gradient needs, over every rank's batch.
        let local = Tensor::cat(&[&g.sum(1)?, &(&g * &xhat)?.sum(1)?], 0)?;
        let sums = self.group.all_reduce_sum_tensor(&local).map_err(comm_err)?;
        let mgh = sums.narrow(0, c, c)?.broadcast_div(&self.count)?.unsqueeze(1)?;
        let mut inner = g.broadcast_sub(&xhat.broadcast_mul(&mgh)?)?;
        if self.remove_mean {
            let mg = sums.narrow(0, 0, c)?.broadcast_div(&self.count)?.unsqueeze(1)?;
            inner = inner.broadcast_sub(&mg)?;
        }
        Ok(Some(inner.broadcast_mul(&self.rstd)?.to_dtype(grad.dtype())?))
    }
}
