//! Batch normalisation that works in mixed precision.
//!
//! candle-nn's `BatchNorm` fails in training when built in f16 and on f16 input when built
//! in f32. This one asks the store for its weight and bias in f32: under O2
//! (`keep_batchnorm_fp32`) they stay f32 and the input is cast to f32 and the output back;
//! at O3 they come back half and the affine part runs in half. Statistics are always
//! computed in f32 (f16 reductions lose precision) and the running statistics are f32
//! buffers that never get gradients.
//!
//! Under data parallel with synchronised batch norm switched on
//! (`distributed::DataParallel::sync_batch_norm`), training statistics are computed over every
//! rank's batch: per-channel sums all-reduced in f32, and a backward that all-reduces the two
//! per-channel sums the input gradient needs (PyTorch's `SyncBatchNorm`, Apex's
//! `convert_syncbn_model`). The forward must run inside the run's scope (`AmpModel`'s forward
//! enters it).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, Var};

use candle_core::backend::BackendStorage;

use crate::comm::Communicator;
use candle_nn::{BatchNormConfig, Init, ModuleT, VarBuilder};

/// Batch normalisation over dimension 1 of an input of rank >= 2.
#[derive(Debug, Clone)]
pub struct BatchNorm {
    running_mean: Var,
    running_var: Var,
    weight_and_bias: Option<(Tensor, Tensor)>,
    remove_mean: bool,
    eps: f64,
    momentum: f64,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

/// Builds a [`BatchNorm`] (same signature as `candle_nn::batch_norm`). Parameters are
/// `weight`, `bias`, `running_mean` and `running_var` under `vb`'s prefix, as in candle-nn,
/// so checkpoints are interchangeable.
pub fn batch_norm<C: Into<BatchNormConfig>>(num_features: usize, config: C, vb: VarBuilder) -> Result<BatchNorm> {
    let config = config.into();
    if config.eps < 0. {
        candle_core::bail!("batch-norm eps cannot be negative {}", config.eps)
    }
    // f32 parameters and statistics for half and f32 models (an f64 model stays f64).
    let pdt = if vb.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let f32_get = |name: &str, init: Init| vb.get_with_hints_dtype(num_features, name, init, pdt);
    let running_mean = f32_get("running_mean", Init::Const(0.))?;
    let running_var = f32_get("running_var", Init::Const(1.))?;
    let weight_and_bias = if config.affine {
        Some((f32_get("weight", Init::Const(1.))?, f32_get("bias", Init::Const(0.))?))
    } else {
        None
    };
    Ok(BatchNorm {
        running_mean: Var::from_tensor(&running_mean)?,
        running_var: Var::from_tensor(&running_var)?,
        weight_and_bias,
        remove_mean: config.remove_mean,
        eps: config.eps,
        momentum: config.momentum,
        name: crate::nn::layer_name(&vb),
    })
}

impl BatchNorm {
    /// The running mean (f32).
    pub fn running_mean(&self) -> &Tensor {
        self.running_mean.as_tensor()
    }

    /// The running variance (f32).
    pub fn running_var(&self) -> &Tensor {
        self.running_var.as_tensor()
    }

    /// The affine weight and bias, if any.
    pub fn weight_and_bias(&self) -> Option<(&Tensor, &Tensor)> {
        self.weight_and_bias.as_ref().map(|(w, b)| (w, b))
    }

    fn stat_shape(x: &Tensor) -> Vec<usize> {
        x.dims()
            .iter()
            .enumerate()
            .map(|(i, &d)| if i == 1 { d } else { 1 })
            .collect()
    }

    fn normalise(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let c = self.running_mean.dim(0)?;
        if x.rank() < 2 || x.dim(1)? != c {
            candle_core::bail!(
                "batch-norm expects input of rank >= 2 with {c} features in dimension 1, got shape {:?}",
                x.shape()
            )
        }
        let shape = Self::stat_shape(x);
        let sdt = if crate::precision::autocast::eligible(x.dtype()) {
            DType::F32
        } else {
            x.dtype()
        };
        let x = x.to_dtype(sdt)?;
        if !train {
            let mean = self
                .running_mean
                .as_detached_tensor()
                .to_dtype(sdt)?
                .reshape(shape.as_slice())?;
            let var = self
                .running_var
                .as_detached_tensor()
                .to_dtype(sdt)?
                .reshape(shape.as_slice())?;
            let x = if self.remove_mean { x.broadcast_sub(&mean)? } else { x };
            return x.broadcast_div(&(var + self.eps)?.sqrt()?);
        }
        // Per-channel statistics over every dimension but 1.
        let xt = x.transpose(0, 1)?.flatten_from(1)?.contiguous()?;
        if let Some(group) = crate::precision::autocast::sync_group() {
            if sdt != DType::F32 {
                candle_core::bail!("synchronised batch norm computes in f32; an {sdt:?} model cannot use it")
            }
            return self.normalise_synced(&x, &xt, group);
        }
        let n = xt.dim(1)? as f64;
        // A segment recomputed by gradient checkpointing already updated them in its forward.
        let update_running = crate::precision::autocast::phase() != crate::precision::autocast::Phase::Recompute;
        let (centred, mean_b) = if self.remove_mean {
            let mean = xt.mean_keepdim(1)?;
            let rm = self.running_mean.as_tensor();
            let new_mean = ((rm * (1.0 - self.momentum))?
                + (mean.flatten_all()?.detach().to_dtype(rm.dtype())? * self.momentum)?)?;
            if update_running {
                self.running_mean.set(&new_mean)?;
                crate::precision::autocast::invalidate(self.running_mean.as_tensor());
            }
            (xt.broadcast_sub(&mean)?, Some(mean.reshape(shape.as_slice())?))
        } else {
            (xt, None)
        };
        let var = centred.sqr()?.mean_keepdim(1)?;
        let unbiased = if n > 1.0 { n / (n - 1.0) } else { 1.0 };
        let rv = self.running_var.as_tensor();
        let new_var = ((rv * (1.0 - self.momentum))?
            + (var.flatten_all()?.detach().to_dtype(rv.dtype())? * (self.momentum * unbiased))?)?;
        if update_running {
            self.running_var.set(&new_var)?;
            crate::precision::autocast::invalidate(self.running_var.as_tensor());
        }
        let x = match mean_b {
            Some(m) => x.broadcast_sub(&m)?,
            None => x,
        };
        x.broadcast_div(&(var.reshape(shape.as_slice())? + self.eps)?.sqrt()?)
    }
}

impl BatchNorm {
    /// Training-mode normalisation with statistics over every rank's batch (synchronised
    /// batch norm): `xt` is the f32 input as `(C, everything else)`; the result has `x`'s
    /// layout. The running statistics get the global mean and unbiased variance, so they are
    /// the same on every rank.
    fn normalise_synced(&self, x: &Tensor, xt: &Tensor, group: Arc<dyn Communicator>) -> Result<Tensor> {
        let stats = Arc::new(Mutex::new(None));
        let op = SyncNorm {
            group,
            eps: self.eps,
            remove_mean: self.remove_mean,
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
        let m = self.momentum;
        let dev = x.device();
        // A segment recomputed by gradient checkpointing already updated them in its forward.
        if crate::precision::autocast::phase() == crate::precision::autocast::Phase::Recompute {
            let mut dims = x.dims().to_vec();
            dims.swap(0, 1);
            return yt.reshape(dims)?.transpose(0, 1);
        }
        if self.remove_mean {
            let rm = self.running_mean.as_tensor();
            let mean = Tensor::from_vec(st.mean, rm.dims(), dev)?.to_dtype(rm.dtype())?;
            self.running_mean.set(&((rm * (1.0 - m))? + (mean * m)?)?)?;
            crate::precision::autocast::invalidate(self.running_mean.as_tensor());
        }
        let rv = self.running_var.as_tensor();
        let var = Tensor::from_vec(st.var, rv.dims(), dev)?.to_dtype(rv.dtype())?;
        self.running_var.set(&((rv * (1.0 - m))? + (var * (m * unbiased))?)?)?;
        crate::precision::autocast::invalidate(self.running_var.as_tensor());
        let mut dims = x.dims().to_vec();
        dims.swap(0, 1);
        yt.reshape(dims)?.transpose(0, 1)
    }
}

/// Global statistics of one synchronised forward, per channel.
#[derive(Debug, Clone)]
struct SyncStats {
    mean: Vec<f32>,
    /// Biased variance (the normalisation's).
    var: Vec<f32>,
    rstd: Vec<f32>,
    /// Values per channel over every rank.
    count: f64,
}

/// Normalises `(C, M)` f32 rows with statistics all-reduced over the group; its backward
/// all-reduces the two per-channel sums the input gradient needs (PyTorch's SyncBatchNorm).
struct SyncNorm {
    group: Arc<dyn Communicator>,
    eps: f64,
    remove_mean: bool,
    stats: Arc<Mutex<Option<SyncStats>>>,
}

/// Keeps the communicator's typed error (a timeout stays `Distributed { kind: Timeout }`
/// when it comes back through candle to our API), with where it happened as context.
fn comm_err(e: crate::AmpError) -> candle_core::Error {
    candle_core::Error::from(e).context("synchronised batch norm")
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

    /// Through the host: the statistics are a few sums per channel, each all-reduced over the
    /// group's host buffers anyway, so the input is copied to the host once, normalised there
    /// as on the CPU, and the result copied back.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendDevice;
        let (out, shape) = self.cpu_fwd(&s.to_cpu_storage()?, l)?;
        Ok((s.device().storage_from_cpu_storage(&out)?, shape))
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

impl ModuleT for BatchNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        crate::precision::observe::layer(self.name.as_ref(), x, None, |x| self.forward_named(x, train))
    }
}

impl BatchNorm {
    fn forward_named(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let in_dtype = x.dtype();
        let xn = self.normalise(x, train)?;
        let y = match &self.weight_and_bias {
            None => xn,
            Some((w, b)) => {
                let shape = Self::stat_shape(x);
                let xn = xn.to_dtype(w.dtype())?;
                xn.broadcast_mul(&w.reshape(shape.as_slice())?)?
                    .broadcast_add(&b.reshape(shape.as_slice())?)?
            }
        };
        y.to_dtype(in_dtype)
    }
}
