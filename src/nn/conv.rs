//! Convolutions that run in half under autocast, bf16 included on the CPU.

use std::sync::Arc;

use candle_core::{Result, Tensor};
use candle_nn::{Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig, Module, VarBuilder};

use crate::precision::{observe, ops};

/// A 1-d convolution.
#[derive(Debug, Clone)]
pub struct Conv1d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: Conv1dConfig,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

impl Module for Conv1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), x, Some(self.weight.dtype()), |x| {
            ops::conv1d(x, &self.weight, self.bias.as_ref(), self.config)
        })
    }
}

/// Builds a [`Conv1d`] as `candle_nn::conv1d` does.
pub fn conv1d(in_c: usize, out_c: usize, kernel: usize, config: Conv1dConfig, vb: VarBuilder) -> Result<Conv1d> {
    let name = crate::nn::layer_name(&vb);
    let c = candle_nn::conv1d(in_c, out_c, kernel, config, vb)?;
    Ok(Conv1d {
        weight: c.weight().clone(),
        bias: c.bias().cloned(),
        config,
        name,
    })
}

/// A 2-d convolution.
#[derive(Debug, Clone)]
pub struct Conv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: Conv2dConfig,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

impl Conv2d {
    /// The weight `(out, in/groups, k, k)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The layer's name (its VarBuilder path), if it has one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), x, Some(self.weight.dtype()), |x| {
            ops::conv2d(x, &self.weight, self.bias.as_ref(), self.config)
        })
    }
}

/// Builds a [`Conv2d`] as `candle_nn::conv2d` does.
pub fn conv2d(in_c: usize, out_c: usize, kernel: usize, config: Conv2dConfig, vb: VarBuilder) -> Result<Conv2d> {
    let name = crate::nn::layer_name(&vb);
    let c = candle_nn::conv2d(in_c, out_c, kernel, config, vb)?;
    Ok(Conv2d {
        weight: c.weight().clone(),
        bias: c.bias().cloned(),
        config,
        name,
    })
}

/// A 2-d transposed convolution.
#[derive(Debug, Clone)]
pub struct ConvTranspose2d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: ConvTranspose2dConfig,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

impl Module for ConvTranspose2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), x, Some(self.weight.dtype()), |x| {
            ops::conv_transpose2d(x, &self.weight, self.bias.as_ref(), self.config)
        })
    }
}

/// Builds a [`ConvTranspose2d`] as `candle_nn::conv_transpose2d` does.
pub fn conv_transpose2d(
    in_c: usize,
    out_c: usize,
    kernel: usize,
    config: ConvTranspose2dConfig,
    vb: VarBuilder,
) -> Result<ConvTranspose2d> {
    let name = crate::nn::layer_name(&vb);
    let c = candle_nn::conv_transpose2d(in_c, out_c, kernel, config, vb)?;
    Ok(ConvTranspose2d {
        weight: c.weight().clone(),
        bias: c.bias().cloned(),
        config,
        name,
    })
}
