//! Layer, RMS and group normalisation: differentiable, statistics in f32.

use std::sync::Arc;

use candle_core::{Result, Tensor};
use candle_nn::{Init, LayerNormConfig, Module, VarBuilder};

use crate::precision::{observe, ops};

/// Layer normalisation over the last dimension.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

impl LayerNorm {
    /// The weight, bias and epsilon of a layer norm that removes the mean (`None` for the
    /// RMS form), for the fused residual sub-layer.
    pub(crate) fn centred_parts(&self) -> Option<(Option<&Tensor>, Option<&Tensor>, f64)> {
        self.remove_mean
            .then_some((self.weight.as_ref(), self.bias.as_ref(), self.eps))
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), x, None, |x| {
            if self.remove_mean {
                ops::layer_norm(x, self.weight.as_ref(), self.bias.as_ref(), self.eps)
            } else {
                let y = ops::rms_norm(x, self.weight.as_ref(), self.eps)?;
                match &self.bias {
                    Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?),
                    None => Ok(y),
                }
            }
        })
    }
}

/// Builds a [`LayerNorm`] (same signature, names and init as `candle_nn::layer_norm`).
pub fn layer_norm<C: Into<LayerNormConfig>>(size: usize, config: C, vb: VarBuilder) -> Result<LayerNorm> {
    let c = config.into();
    let weight = vb.get_with_hints(size, "weight", Init::Const(1.))?;
    let bias = if c.affine {
        Some(vb.get_with_hints(size, "bias", Init::Const(0.))?)
    } else {
        None
    };
    Ok(LayerNorm {
        weight: Some(weight),
        bias,
        remove_mean: c.remove_mean,
        eps: c.eps,
        name: crate::nn::layer_name(&vb),
    })
}

/// RMS normalisation over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

impl RmsNorm {
    /// The weight and epsilon, for the fused residual sub-layer.
    pub(crate) fn parts(&self) -> (&Tensor, f64) {
        (&self.weight, self.eps)
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), x, None, |x| {
            ops::rms_norm(x, Some(&self.weight), self.eps)
        })
    }
}

/// Builds an [`RmsNorm`] as `candle_nn::rms_norm` does (name `weight`, ones).
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    Ok(RmsNorm {
        weight: vb.get_with_hints(size, "weight", Init::Const(1.))?,
        eps,
        name: crate::nn::layer_name(&vb),
    })
}

/// Group normalisation over `(N, C, ...)`.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f64,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

impl Module for GroupNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), x, None, |x| {
            ops::group_norm(x, self.groups, Some(&self.weight), Some(&self.bias), self.eps)
        })
    }
}

/// Builds a [`GroupNorm`] as `candle_nn::group_norm` does.
pub fn group_norm(num_groups: usize, num_channels: usize, eps: f64, vb: VarBuilder) -> Result<GroupNorm> {
    if num_groups == 0 || !num_channels.is_multiple_of(num_groups) {
        candle_core::bail!("group_norm: {num_channels} channels cannot be split into {num_groups} groups")
    }
    Ok(GroupNorm {
        weight: vb.get_with_hints(num_channels, "weight", Init::Const(1.))?,
        bias: vb.get_with_hints(num_channels, "bias", Init::Const(0.))?,
        groups: num_groups,
        eps,
        name: crate::nn::layer_name(&vb),
    })
}
