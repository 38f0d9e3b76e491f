//! Linear and embedding layers.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use candle_nn::{Module, VarBuilder};

use crate::kernels::wgrad::Act;
use crate::precision::{fused, observe};

/// An activation a [`Linear`] layer applies to its output ([`Linear::with_activation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Activation {
    /// `max(x, 0)`, as [`crate::ops::relu`] (gradient 0 at 0, as PyTorch's).
    Relu,
    /// GELU in the erf form, as [`crate::ops::gelu`] (in f32 under autocast).
    Gelu,
    /// GELU in the tanh form (PyTorch's `approximate="tanh"`, candle's `gelu`, Hugging Face's
    /// `gelu_new`/`gelu_pytorch_tanh`), as [`crate::ops::gelu_tanh`] (in f32 under autocast).
    GeluTanh,
}

/// A linear layer `x w^T + b` that runs in half under autocast, optionally followed by an
/// activation.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
    activation: Option<Activation>,
}

impl Linear {
    /// A layer from its weight `(out, in)` and optional bias `(out,)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            bias,
            name: None,
            activation: None,
        }
    }

    /// The layer followed by `activation`: `forward` returns `activation(x w^T + b)`, the same
    /// values and gradients, bit for bit, as applying [`crate::ops::relu`],
    /// [`crate::ops::gelu`] or [`crate::ops::gelu_tanh`] to the plain layer's output (Apex's `FusedDense` with its
    /// activation). Inside a run, with half values on the CPU, the activation runs inside the
    /// layer's node, so the pre-activation is never a half tensor of candle's graph (whose
    /// backward would accumulate its gradient in half, slowly on the CPU); GELU under autocast
    /// (O1) runs after the layer, in f32, as its cast policy says. The numerics doctor then
    /// sees the activation's output as the layer's output.
    ///
    /// ```
    /// use candle_amp::nn::{Activation, Linear};
    /// use candle_core::{Device, Module, Tensor};
    /// # fn main() -> candle_core::Result<()> {
    /// let w = Tensor::new(&[[1f32, -1.], [2., 0.]], &Device::Cpu)?;
    /// let layer = Linear::new(w, None).with_activation(Activation::Relu);
    /// let y = layer.forward(&Tensor::new(&[[1f32, 3.]], &Device::Cpu)?)?;
    /// assert_eq!(y.to_vec2::<f32>()?, [[0.0, 2.0]]);
    /// # Ok(()) }
    /// ```
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = Some(activation);
        self
    }

    /// The activation applied to the output, if any.
    pub fn activation(&self) -> Option<Activation> {
        self.activation
    }

    /// Names the layer (its VarBuilder path when built by the constructor function): the name
    /// the numerics doctor reports and [`crate::Amp::keep_layer_f32`] takes.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(Arc::from(name.into()));
        self
    }

    /// The layer's name, if it has one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Linear {
    fn named(mut self, name: Option<Arc<str>>) -> Self {
        self.name = name;
        self
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), x, Some(self.weight.dtype()), |x| {
            // Parameters of a run: their gradients skip candle's graph (see `linear_layer_act`).
            let act = self.activation.map(|a| match a {
                Activation::Relu => Act::Relu,
                Activation::Gelu => Act::Gelu,
                Activation::GeluTanh => Act::GeluTanh,
            });
            fused::linear_layer_act(x, &self.weight, self.bias.as_ref(), act)
        })
    }
}

/// Builds a [`Linear`] as `candle_nn::linear` does (names `weight`, `bias`; same init).
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let name = crate::nn::layer_name(&vb);
    let l = candle_nn::linear(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), l.bias().cloned()).named(name))
}

/// Builds a [`Linear`] without bias, as `candle_nn::linear_no_bias` does.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let name = crate::nn::layer_name(&vb);
    let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), None).named(name))
}

/// An embedding table. Lookups are on no cast list: they return the table's type.
///
/// Ids are u8, u32 or i64 of any shape; the output has their shape plus the table's width.
/// An id of another type, negative or past the table's rows is an
/// [`AmpError::InvalidArgument`](crate::AmpError::InvalidArgument) naming `ids` (checked on
/// the CPU at every level; on a GPU, where the ids are not read back, u32 and i64 ids go to
/// the library's CUDA kernel, which gives a row of NaN for an id outside the table, and of
/// zeros for its type's largest value, candle's padding id, neither with a gradient; u8 ids
/// go to candle's `index_select`, whose device assert stops the device). On CUDA the table's
/// gradient is summed in f32 in the ids' order and rounded once to its type. Inside a run
/// whose table is in half (O2, O3), the table's gradient is summed in f32, the looked-up rows
/// added in their order, and joins the f32 main gradient directly, rather than summed in half
/// by candle's `index_select` backward (a token repeated across a batch would lose its small
/// gradients in bf16).
#[derive(Debug, Clone)]
pub struct Embedding {
    embeddings: Tensor,
    hidden: usize,
    /// Its VarBuilder path (what the numerics doctor and per-layer f32 overrides call it).
    name: Option<Arc<str>>,
}

impl Embedding {
    /// The table `(vocab, hidden)`.
    pub fn embeddings(&self) -> &Tensor {
        &self.embeddings
    }

    /// The layer's name (its VarBuilder path), if it has one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        observe::layer(self.name.as_ref(), ids, None, |ids| {
            // An empty batch on a GPU: candle's select launches no blocks, which CUDA refuses.
            let lookup = |t: &[Tensor]| {
                let mut shape = t[0].dims().to_vec();
                shape.push(self.hidden);
                t[1].index_select(&t[0].flatten_all()?, 0)?.reshape(shape)
            };
            if let Some(r) = crate::precision::empty::on_host(&[ids, &self.embeddings], lookup) {
                return r;
            }
            if ids.device().is_cpu() {
                // Checked here, so a bad id is the same typed error at every level.
                let rows = checked_rows(ids, self.embeddings.dim(0)?)?;
                if let Some(y) = fused::embedding(ids, rows, &self.embeddings)? {
                    return Ok(y);
                }
            }
            // On CUDA the ids stay on the device (no host read): the kernel's backward sums
            // the table's gradient in f32 where candle's `index_add` sums in the table's type.
            if !ids.device().is_cpu()
                && crate::kernels::enabled()
                && let Some(y) = crate::kernels::cuda::embed::lookup(ids, &self.embeddings)?
            {
                return Ok(y);
            }
            let mut shape = ids.dims().to_vec();
            shape.push(self.hidden);
            self.embeddings.index_select(&ids.flatten_all()?, 0)?.reshape(shape)
        })
    }
}

/// The ids (u8, u32 or i64, any shape) as row indices, each checked to lie in `0..vocab`.
fn checked_rows(ids: &Tensor, vocab: usize) -> Result<Arc<[u32]>> {
    let bad = |reason: String| -> candle_core::Error {
        crate::AmpError::InvalidArgument {
            argument: "ids",
            reason,
        }
        .into()
    };
    let flat = ids.flatten_all()?;
    let values: Vec<i64> = match ids.dtype() {
        DType::U8 => flat.to_vec1::<u8>()?.into_iter().map(i64::from).collect(),
        DType::U32 => flat.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
        DType::I64 => flat.to_vec1::<i64>()?,
        dt => {
            return Err(bad(format!(
                "token indices of type u8, u32 or i64, got {dt:?} (convert them with `to_dtype(DType::U32)`)"
            )));
        }
    };
    values
        .into_iter()
        .map(|v| {
            if v < 0 || v as u64 >= vocab as u64 {
                Err(bad(format!(
                    "token indices in 0..{vocab} (the embedding's rows), got {v}"
                )))
            } else {
                Ok(v as u32)
            }
        })
        .collect()
}

/// Builds an [`Embedding`] as `candle_nn::embedding` does (name `weight`, normal init).
pub fn embedding(vocab: usize, hidden: usize, vb: VarBuilder) -> Result<Embedding> {
    let name = crate::nn::layer_name(&vb);
    let e = candle_nn::embedding(vocab, hidden, vb)?;
    Ok(Embedding {
        embeddings: e.embeddings().clone(),
        hidden,
        name,
    })
}
