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
//! `convert_syncbn_model`; `super::sync_batch_norm`, on the host or, on the device path, as
//! device tensors). The forward must run inside the run's scope (`AmpModel`'s forward
//! enters it).

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, Var};

use crate::precision::autocast::SyncGroup;
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

    /// Refuses an input without this layer's features in dimension 1.
    fn check_input(&self, x: &Tensor) -> Result<()> {
        let c = self.running_mean.dim(0)?;
        if x.rank() < 2 || x.dim(1)? != c {
            candle_core::bail!(
                "batch-norm expects input of rank >= 2 with {c} features in dimension 1, got shape {:?}",
                x.shape()
            )
        }
        Ok(())
    }

    fn normalise(&self, x: &Tensor, train: bool) -> Result<Tensor> {
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
    fn normalise_synced(&self, x: &Tensor, xt: &Tensor, group: SyncGroup) -> Result<Tensor> {
        let synced = super::sync_batch_norm::normalise(xt, &group, self.eps, self.remove_mean, self.momentum)?;
        let m = self.momentum;
        let mut dims = x.dims().to_vec();
        dims.swap(0, 1);
        let y = synced.yt.reshape(dims)?.transpose(0, 1)?;
        // A segment recomputed by gradient checkpointing already updated them in its forward.
        if crate::precision::autocast::phase() == crate::precision::autocast::Phase::Recompute {
            return Ok(y);
        }
        if let Some(mean_m) = synced.mean_m {
            let rm = self.running_mean.as_tensor();
            self.running_mean
                .set(&((rm * (1.0 - m))? + mean_m.to_dtype(rm.dtype())?)?)?;
            crate::precision::autocast::invalidate(self.running_mean.as_tensor());
        }
        let rv = self.running_var.as_tensor();
        self.running_var
            .set(&((rv * (1.0 - m))? + synced.var_m.to_dtype(rv.dtype())?)?)?;
        crate::precision::autocast::invalidate(self.running_var.as_tensor());
        Ok(y)
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
        self.check_input(x)?;
        if x.elem_count() == 0 {
            // PyTorch's rule for an empty batch, on every device: the (empty) input comes
            // back and the running statistics stay as they are (a mean over nothing would
            // write NaN into them). No kernel runs, so none is launched with no blocks.
            return Ok(x.clone());
        }
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
