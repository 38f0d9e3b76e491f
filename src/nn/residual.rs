//! A residual sub-layer (pre- or post-norm, layer or RMS norm) as one fused module.

use candle_core::{Result, Tensor};
use candle_nn::{Module, ModuleT};

use super::{Dropout, GatedMlp, LayerNorm, Mlp, RmsNorm, SelfAttention};
use crate::error::AmpError;
use crate::precision::{fused, ops};

/// What a [`Residual`] sub-layer computes in front of its dropout.
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

/// The norm of a [`Residual`] sub-layer: a [`LayerNorm`] (GPT, BERT, ViT) or an [`RmsNorm`]
/// (Llama). Both convert into it, so [`Residual::new`] takes either.
#[derive(Debug, Clone)]
pub enum ResidualNorm {
    /// Layer normalisation.
    Layer(LayerNorm),
    /// RMS normalisation.
    Rms(RmsNorm),
}

impl From<LayerNorm> for ResidualNorm {
    fn from(n: LayerNorm) -> Self {
        ResidualNorm::Layer(n)
    }
}

impl From<RmsNorm> for ResidualNorm {
    fn from(n: RmsNorm) -> Self {
        ResidualNorm::Rms(n)
    }
}

impl Module for ResidualNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            ResidualNorm::Layer(n) => n.forward(x),
            ResidualNorm::Rms(n) => n.forward(x),
        }
    }
}

impl ResidualNorm {
    /// The norm as the fused node computes it; `None` for a [`LayerNorm`] built without
    /// removing the mean (an RMS norm plus a bias: two ops, which the node does not fuse).
    fn fused_parts(&self) -> Option<fused::ResidualNorm<'_>> {
        match self {
            ResidualNorm::Layer(n) => n.centred_parts().map(|(w, b, eps)| fused::ResidualNorm {
                w,
                b,
                eps,
                center: true,
            }),
            ResidualNorm::Rms(n) => {
                let (w, eps) = n.parts();
                Some(fused::ResidualNorm {
                    w: Some(w),
                    b: None,
                    eps,
                    center: false,
                })
            }
        }
    }
}

/// Where a [`Residual`] sub-layer's norm sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormPlacement {
    /// `x + dropout(body(norm(x)))`: GPT-2, Llama, ViT; PyTorch's
    /// `TransformerEncoderLayer(norm_first=True)`.
    #[default]
    Pre,
    /// `norm(x + dropout(body(x)))`: the original Transformer and BERT; PyTorch's
    /// `norm_first=False`.
    Post,
}

/// A residual sub-layer, pre-norm `x + dropout(body(norm(x)))` ([`Residual::new`]) or
/// post-norm `norm(x + dropout(body(x)))` ([`Residual::post_norm`]), with a [`LayerNorm`] or
/// an [`RmsNorm`]: the two halves of a transformer block, Transformer Engine's
/// `LayerNormLinear` / `LayerNormMLP` with the residual add (its
/// `apply_residual_connection_post_layernorm` for post-norm), PyTorch's
/// `TransformerEncoderLayer` per sub-layer.
///
/// Inside a run, with the body's products in half on the CPU, the norm, the body, the
/// dropout and the add are one node of candle's graph, so the norm's, the body's and the
/// dropout's outputs (and, post-norm, the sum) are never half tensors of the graph (whose
/// backward would add each one's gradient into a fresh zero tensor in half, slowly on the
/// CPU) and the input takes one gradient instead of two. The output and every gradient but
/// the norm's parameters' are the same, bit for bit, as running the norm, the body,
/// [`Dropout`] and [`ops::add`] one after the other (the input's two gradients are summed in
/// f32 and rounded once, as candle's add of the two rounds; a [`GatedMlp`] body's own input
/// gradient is its fused node's, see there); the norm's weight and bias gradients go to the
/// run in f32, as a fused [`Linear`](super::Linear)'s do, where the unfused norm rounds them
/// to the parameter's type first. The dropout mask is drawn as [`Dropout`] draws it, so a run
/// reproduces either way. Elsewhere the unfused layers run: outside a run, at O0, off the
/// CPU, while the numerics doctor records or a layer is kept in f32, for a [`LayerNorm`]
/// that does not remove the mean, and where the body's own fused node does not apply (an
/// [`Mlp`] whose last layer has GELU, a [`GatedMlp`] with GELU, under autocast at O1).
///
/// A self-attention body takes per-call rotary tables and key lengths through
/// [`Residual::forward_with`] (Llama's shared tables, BERT's padding), inside the node too.
/// Consecutive sub-layers (a model's blocks) run as one node through
/// [`Residual::forward_stack`], with the same values and gradients.
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
    norm: ResidualNorm,
    body: ResidualBody,
    dropout: Dropout,
    placement: NormPlacement,
}

impl Residual {
    /// The pre-norm sub-layer `x + dropout(body(norm(x)))`; `norm` a [`LayerNorm`] or an
    /// [`RmsNorm`].
    pub fn new(norm: impl Into<ResidualNorm>, body: impl Into<ResidualBody>, dropout: Dropout) -> Self {
        Self {
            norm: norm.into(),
            body: body.into(),
            dropout,
            placement: NormPlacement::Pre,
        }
    }

    /// The post-norm sub-layer `norm(x + dropout(body(x)))` (BERT's).
    ///
    /// ```
    /// use candle_amp::nn::{Dropout, Linear, Mlp, NormPlacement, Residual, rms_norm};
    /// use candle_amp::{Amp, OptLevel};
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{ModuleT, VarBuilder, VarMap};
    /// # fn main() -> candle_core::Result<()> {
    /// let dev = Device::Cpu;
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
    /// let body = Mlp::new(vec![Linear::new(Tensor::zeros((2, 2), DType::F32, &dev)?, None)]);
    /// let none = Dropout::new(0.0, Amp::new(OptLevel::O0, &dev)?.generator("dropout"))?;
    /// let block = Residual::post_norm(rms_norm(2, 0.0, vb.pp("norm"))?, body, none);
    /// assert_eq!(block.placement(), NormPlacement::Post);
    /// // A zero body: the RMS norm of the input, [3, 4] / sqrt(12.5).
    /// let y = block.forward_t(&Tensor::new(&[[3f32, 4.]], &dev)?, false)?;
    /// let want = [3. / 12.5f32.sqrt(), 4. / 12.5f32.sqrt()];
    /// let got = y.to_vec2::<f32>()?;
    /// assert!((got[0][0] - want[0]).abs() < 1e-6 && (got[0][1] - want[1]).abs() < 1e-6);
    /// # Ok(()) }
    /// ```
    pub fn post_norm(norm: impl Into<ResidualNorm>, body: impl Into<ResidualBody>, dropout: Dropout) -> Self {
        Self {
            placement: NormPlacement::Post,
            ..Self::new(norm, body, dropout)
        }
    }

    /// The norm.
    pub fn norm(&self) -> &ResidualNorm {
        &self.norm
    }

    /// The body.
    pub fn body(&self) -> &ResidualBody {
        &self.body
    }

    /// Where the norm sits.
    pub fn placement(&self) -> NormPlacement {
        self.placement
    }

    /// The sub-layer over `x` with a self-attention body's per-call options, as
    /// [`SelfAttention::forward_with`] takes them: rotary tables (in place of the module's
    /// own) and key lengths. An [`AmpError::InvalidArgument`] when either is given for
    /// another body; the attention's own errors for tables or lengths that do not fit.
    pub fn forward_with(
        &self,
        x: &Tensor,
        train: bool,
        rope: Option<(&Tensor, &Tensor)>,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        if (rope.is_some() || lengths.is_some()) && !matches!(self.body, ResidualBody::Attention(_)) {
            return Err(AmpError::InvalidArgument {
                argument: "rope/lengths",
                reason: "rotary tables and key lengths apply to a self-attention body only".into(),
            }
            .into());
        }
        // Drawn once, before either path, so both consume the generator alike.
        let mask = self.dropout.mask(x.shape(), x.device(), train)?;
        match self.fused_node(x, mask.as_ref(), rope, lengths)? {
            Some(node) => fused::residual_stack(x, vec![node]),
            None => self.unfused(x, mask.as_ref(), rope, lengths),
        }
    }

    /// Consecutive sub-layers over `x`, `layers[0]` first, each on the previous one's output:
    /// the value of calling [`forward_with`](Self::forward_with) on each in turn, with
    /// `rope` and `lengths` given to each self-attention body (and no other), and the same
    /// values, parameter gradients and input gradient, bit for bit, dropout masks included
    /// (drawn in the same order). Where consecutive sub-layers each run as one fused node
    /// (inside a run, in half on the CPU), they run as one node of candle's graph: the
    /// residual stream between them is no half tensor of the graph, whose gradient candle's
    /// backward would add into a fresh zero tensor in half, slowly on the CPU; each
    /// sub-layer's input gradient goes straight to the one before. A sub-layer whose node
    /// does not apply (see [`Residual`]) runs on its own between them. No layers: `x` back.
    ///
    /// ```
    /// use candle_amp::nn::{Dropout, Linear, Mlp, Residual, rms_norm};
    /// use candle_amp::{Amp, OptLevel};
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// # fn main() -> candle_core::Result<()> {
    /// let dev = Device::Cpu;
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
    /// let none = || Dropout::new(0.0, Amp::new(OptLevel::O0, &dev)?.generator("dropout"));
    /// // Zero bodies: each sub-layer is the identity, and so is the stack.
    /// let zero = || Mlp::new(vec![Linear::new(Tensor::zeros((2, 2), DType::F32, &dev).unwrap(), None)]);
    /// let a = Residual::new(rms_norm(2, 1e-5, vb.pp("a"))?, zero(), none()?);
    /// let b = Residual::new(rms_norm(2, 1e-5, vb.pp("b"))?, zero(), none()?);
    /// let x = Tensor::new(&[[1f32, 2.]], &dev)?;
    /// let y = Residual::forward_stack(&[&a, &b], &x, true, None, None)?;
    /// assert_eq!(y.to_vec2::<f32>()?, [[1.0, 2.0]]);
    /// # Ok(()) }
    /// ```
    pub fn forward_stack(
        layers: &[&Residual],
        x: &Tensor,
        train: bool,
        rope: Option<(&Tensor, &Tensor)>,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        // The nodes built so far, each on the previous one's output, not yet in the graph.
        let mut nodes: Vec<fused::ResidualNode> = Vec::new();
        // The graph tensor the pending nodes start from.
        let mut x = x.clone();
        for layer in layers {
            let (rope, lengths) = match layer.body {
                ResidualBody::Attention(_) => (rope, lengths),
                _ => (None, None),
            };
            let input = match nodes.last() {
                Some(n) => n.output()?,
                None => x.clone(),
            };
            let mask = layer.dropout.mask(input.shape(), input.device(), train)?;
            if let Some(node) = layer.fused_node(&input, mask.as_ref(), rope, lengths)? {
                nodes.push(node);
                continue;
            }
            x = fused::residual_stack(&x, std::mem::take(&mut nodes))?;
            x = layer.unfused(&x, mask.as_ref(), rope, lengths)?;
        }
        fused::residual_stack(&x, nodes)
    }

    /// The unfused layers, one op after the other, with the dropout `mask`.
    fn unfused(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        rope: Option<(&Tensor, &Tensor)>,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        let body = |h: &Tensor| {
            let y = match &self.body {
                ResidualBody::Attention(a) => a.forward_with(h, rope, lengths)?,
                other => other.forward(h)?,
            };
            if y.shape() != h.shape() {
                candle_core::bail!(
                    "Residual: the body maps {:?} to {:?}; a residual sub-layer needs its input's shape back",
                    h.dims(),
                    y.dims()
                )
            }
            Dropout::apply(&y, mask)
        };
        match self.placement {
            NormPlacement::Pre => ops::add(x, &body(&self.norm.forward(x)?)?),
            NormPlacement::Post => self.norm.forward(&ops::add(x, &body(x)?)?),
        }
    }

    /// The sub-layer's fused node on `x`, its forward run, not yet in the graph; `None` where
    /// it does not apply.
    fn fused_node(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        rope: Option<(&Tensor, &Tensor)>,
        lengths: Option<&[usize]>,
    ) -> Result<Option<fused::ResidualNode>> {
        let Some(norm) = self.norm.fused_parts() else {
            return Ok(None);
        };
        let placement = match self.placement {
            NormPlacement::Pre => fused::Placement::Pre,
            NormPlacement::Post => fused::Placement::Post,
        };
        match &self.body {
            ResidualBody::Attention(a) => {
                let spec = a.body_spec_with(x, rope, lengths)?;
                fused::residual_node(x, norm, placement, spec, mask)
            }
            ResidualBody::Mlp(m) => {
                let spec = m.chain_spec();
                fused::residual_node(x, norm, placement, fused::BodySpec::Chain(&spec), mask)
            }
            ResidualBody::Gated(m) => match m.fused_spec() {
                Some((proj, act)) => {
                    fused::residual_node(x, norm, placement, fused::BodySpec::Gated { proj, act }, mask)
                }
                None => Ok(None),
            },
        }
    }
}

impl ModuleT for Residual {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with(x, train, None, None)
    }
}
