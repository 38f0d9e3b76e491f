//! A pre-norm residual sub-layer as one fused module.

use candle_core::{Result, Tensor};
use candle_nn::{Module, ModuleT};

use super::{Dropout, GatedMlp, LayerNorm, Mlp, SelfAttention};
use crate::precision::{fused, ops};

/// What a [`Residual`] sub-layer computes between its norm and its dropout.
#[derive(Debug, Clone)]
pub enum ResidualBody {
    /// Self-attention (a transformer block's first sub-layer).
    Attention(SelfAttention),
    /// A chain of linear layers (the feed-forward sub-layer).
    Mlp(Mlp),
    /// A gated MLP (SwiGLU, GeGLU: the feed-forward sub-layer of Llama-style models).
    Gated(GatedMlp),
}

impl From<SelfAttention> for ResidualBody {
    fn from(a: SelfAttention) -> Self {
        ResidualBody::Attention(a)
    }
}

impl From<Mlp> for ResidualBody {
    fn from(m: Mlp) -> Self {
        ResidualBody::Mlp(m)
    }
}

impl From<GatedMlp> for ResidualBody {
    fn from(m: GatedMlp) -> Self {
        ResidualBody::Gated(m)
    }
}

impl Module for ResidualBody {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            ResidualBody::Attention(a) => a.forward(x),
            ResidualBody::Mlp(m) => m.forward(x),
            ResidualBody::Gated(m) => m.forward(x),
        }
    }
}

/// A pre-norm residual sub-layer, `x + dropout(body(norm(x)))` (the two halves of a GPT-style
/// transformer block): Transformer Engine's `LayerNormLinear` / `LayerNormMLP` with the
/// residual add, PyTorch's `TransformerEncoderLayer(norm_first=True)` per sub-layer.
///
/// Inside a run, with the body's products in half on the CPU and a layer norm that removes
/// the mean, the norm, the body, the dropout and the add are one node of candle's graph, so
/// the norm's, the body's and the dropout's outputs are never half tensors of the graph
/// (whose backward would add each one's gradient into a fresh zero tensor in half, slowly on
/// the CPU) and the input takes one gradient instead of two. The output and every gradient
/// but the norm's parameters' are the same, bit for bit, as running [`LayerNorm`], the
/// body, [`Dropout`] and [`ops::add`] one after the other (the input's two gradients are
/// summed in f32 and rounded once, as candle's add of the two rounds; a [`GatedMlp`] body's
/// own input gradient is its fused node's, see there); the norm's weight and
/// bias gradients go to the run in f32, as a fused [`Linear`](super::Linear)'s do, where the
/// unfused norm rounds them to the parameter's type first. The dropout mask is drawn as
/// [`Dropout`] draws it, so a run reproduces either way. Elsewhere the unfused layers run:
/// outside a run, at O0, off the CPU, while the numerics doctor records or a layer is kept
/// in f32, for an RMS norm, and where the body's own fused node does not apply (an
/// [`Mlp`] whose last layer has GELU, a [`GatedMlp`] with GELU, under autocast at O1).
///
/// ```
/// use candle_amp::nn::{Dropout, Linear, Mlp, Residual, layer_norm};
/// use candle_amp::{Amp, OptLevel};
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{ModuleT, VarBuilder, VarMap};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
/// let norm = layer_norm(2, 1e-5, vb.pp("ln"))?;
/// // A body that returns zero: the sub-layer is the identity.
/// let body = Mlp::new(vec![Linear::new(Tensor::zeros((2, 2), DType::F32, &dev)?, None)]);
/// let run = Amp::new(OptLevel::O0, &dev)?;
/// let block = Residual::new(norm, body, Dropout::new(0.1, run.generator("dropout"))?);
/// let x = Tensor::new(&[[1f32, 2.]], &dev)?;
/// assert_eq!(block.forward_t(&x, true)?.to_vec2::<f32>()?, [[1.0, 2.0]]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Residual {
    norm: LayerNorm,
    body: ResidualBody,
    dropout: Dropout,
}

impl Residual {
    /// The sub-layer `x + dropout(body(norm(x)))`.
    pub fn new(norm: LayerNorm, body: impl Into<ResidualBody>, dropout: Dropout) -> Self {
        Self {
            norm,
            body: body.into(),
            dropout,
        }
    }

    /// The norm in front of the body.
    pub fn norm(&self) -> &LayerNorm {
        &self.norm
    }

    /// The body.
    pub fn body(&self) -> &ResidualBody {
        &self.body
    }
}

impl ModuleT for Residual {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        // Drawn once, before either path, so both consume the generator alike.
        let mask = self.dropout.mask(x.shape(), x.device(), train)?;
        if let Some(norm) = self.norm.centred_parts()
            && let Some(y) = self.fused(x, norm, mask.as_ref())?
        {
            return Ok(y);
        }
        let h = self.body.forward(&self.norm.forward(x)?)?;
        if h.shape() != x.shape() {
            candle_core::bail!(
                "Residual: the body maps {:?} to {:?}; a residual sub-layer needs its input's shape back",
                x.dims(),
                h.dims()
            )
        }
        ops::add(x, &Dropout::apply(&h, mask.as_ref())?)
    }
}

impl Residual {
    fn fused(
        &self,
        x: &Tensor,
        norm: (Option<&Tensor>, Option<&Tensor>, f64),
        mask: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        match &self.body {
            ResidualBody::Attention(a) => fused::residual(x, norm, a.body_spec(), mask),
            ResidualBody::Mlp(m) => {
                let spec = m.chain_spec();
                fused::residual(x, norm, fused::BodySpec::Chain(&spec), mask)
            }
            ResidualBody::Gated(m) => match m.fused_spec() {
                Some((proj, act)) => fused::residual(x, norm, fused::BodySpec::Gated { proj, act }, mask),
                None => Ok(None),
            },
        }
    }
}
