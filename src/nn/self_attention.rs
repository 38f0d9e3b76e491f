//! Multi-head self-attention as one fused module.

use candle_core::{Result, Tensor};
use candle_nn::{Module, VarBuilder};

use super::attention::{merge_heads, scaled_dot_product_attention, split_heads};
use super::linear::{Linear, linear};
use crate::precision::fused;

/// Multi-head self-attention `o(softmax(q k^T / sqrt(d_head) + mask) v)` over `x` of shape
/// `(batch, positions, width)`, with the query, key, value and output projections as
/// [`Linear`] layers: Transformer Engine's `MultiheadAttention`, Apex's fast multi-head
/// attention, PyTorch's `nn.MultiheadAttention` with `q = k = v = x` (no attention dropout).
/// `causal`: position `i` attends to positions `j <= i`.
///
/// Inside a run, with the products in half on the CPU, everything from the three
/// projections to the output projection is one node of candle's graph: none of the
/// projections, head splits, scores or probabilities is a half tensor of the graph (whose
/// backward would accumulate each one's gradient in half, slowly on the CPU), and each
/// parameter's gradient goes to the run in f32, as a single [`Linear`]'s does. The forward
/// values are the same, bit for bit, as the unfused layers' ([`split_heads`],
/// [`scaled_dot_product_attention`], [`merge_heads`]), and so are the four projections'
/// gradients for the same output gradient; the input's gradient is the three projections'
/// f32 products summed in f32 and rounded once, where the unfused graph rounds each partial
/// sum to half. Elsewhere the unfused layers run: outside a run, in f32 (O0), off the CPU,
/// and while the numerics doctor records or a projection is kept in f32 (both work per
/// named layer).
///
/// ```
/// use candle_amp::nn::{Linear, SelfAttention};
/// use candle_core::{Device, Module, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let eye = || Linear::new(Tensor::eye(2, candle_core::DType::F32, &dev).unwrap(), None);
/// let attn = SelfAttention::new(eye(), eye(), eye(), eye(), 1, true)?;
/// let x = Tensor::new(&[[[1f32, 0.], [0., 1.]]], &dev)?;
/// // The first position sees only itself.
/// let y = attn.forward(&x)?;
/// assert_eq!(y.get(0)?.get(0)?.to_vec1::<f32>()?, [1.0, 0.0]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SelfAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    causal: bool,
}

impl SelfAttention {
    /// The module from its projections: `q` and `k` map the width to `heads * d_head`, `v`
    /// to `heads * d_value`, `o` from `heads * d_value` to the output width. An error when a
    /// projection has an activation, `heads` is 0 or does not divide the widths, or the
    /// widths do not chain.
    pub fn new(q: Linear, k: Linear, v: Linear, o: Linear, heads: usize, causal: bool) -> Result<Self> {
        if [&q, &k, &v, &o].iter().any(|l| l.activation().is_some()) {
            candle_core::bail!("SelfAttention: the projections take no activation")
        }
        let rows = |l: &Linear| l.weight().dims2();
        let ((nq, iq), (nk, ik), (nv, iv), (_, io)) = (rows(&q)?, rows(&k)?, rows(&v)?, rows(&o)?);
        if heads == 0 || nq % heads != 0 || nv % heads != 0 {
            candle_core::bail!("SelfAttention: {heads} heads do not divide the widths {nq} (queries) and {nv} (values)")
        }
        if nq != nk || iq != ik || iq != iv || io != nv {
            candle_core::bail!(
                "SelfAttention: projections q {:?}, k {:?}, v {:?}, o {:?} do not fit (q and k of equal shape, v \
                 of the same input width, o taking v's width)",
                q.weight().dims(),
                k.weight().dims(),
                v.weight().dims(),
                o.weight().dims()
            )
        }
        Ok(Self {
            q,
            k,
            v,
            o,
            heads,
            causal,
        })
    }

    /// The query, key, value and output projections.
    pub fn projections(&self) -> [&Linear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }

    /// The number of heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Whether each position attends only to itself and earlier positions.
    pub fn causal(&self) -> bool {
        self.causal
    }

    /// The unfused layers (what runs where the fused node does not apply).
    fn unfused(&self, x: &Tensor) -> Result<Tensor> {
        let split = |l: &Linear| split_heads(&l.forward(x)?, self.heads);
        let (q, k, v) = (split(&self.q)?, split(&self.k)?, split(&self.v)?);
        let a = scaled_dot_product_attention(&q, &k, &v, None, self.causal, None)?;
        self.o.forward(&merge_heads(&a)?)
    }
}

impl Module for SelfAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        fn p(l: &Linear) -> (&Tensor, Option<&Tensor>) {
            (l.weight(), l.bias())
        }
        let proj = [p(&self.q), p(&self.k), p(&self.v), p(&self.o)];
        if let Some(y) = fused::self_attention(x, proj, self.heads, self.causal)? {
            return Ok(y);
        }
        self.unfused(x)
    }
}

/// Builds a [`SelfAttention`] of width `d` with projections named `q`, `k`, `v`, `o` under
/// `vb` (each as [`linear`] builds it, with bias).
pub fn self_attention(d: usize, heads: usize, causal: bool, vb: VarBuilder) -> Result<SelfAttention> {
    SelfAttention::new(
        linear(d, d, vb.pp("q"))?,
        linear(d, d, vb.pp("k"))?,
        linear(d, d, vb.pp("v"))?,
        linear(d, d, vb.pp("o"))?,
        heads,
        causal,
    )
}
