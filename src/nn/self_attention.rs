//! Multi-head self-attention as one fused module.

use candle_core::{D, DType, Result, Tensor};
use candle_nn::{Module, VarBuilder};

use super::attention::{key_padding_mask, merge_heads, scaled_dot_product_attention, split_heads};
use super::linear::{Linear, linear};
use crate::precision::{fused, ops};

/// The layout of a rotary embedding's tables ([`SelfAttention::rope_layout`]): which pairs
/// of a head's values rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RopeLayout {
    /// candle's `rope` (candle-transformers' Llama, Hugging Face's `rotate_half`): the two
    /// halves, `(x[i], x[i + d/2])`; tables `(max_positions, d_head)`, each row's halves equal.
    Halves,
    /// candle's `rope_i` (GPT-J, Meta's original Llama checkpoints): neighbours,
    /// `(x[2i], x[2i+1])`; tables `(max_positions, d_head / 2)`.
    Interleaved,
}

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
/// named layer). On CUDA the unfused path's attention runs in the library's flash kernels
/// where they apply: the grouped key/value heads read in place, the keys past each length
/// masked in the kernel, the rotary embedding one kernel each way (`docs/cuda.md`).
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
/// Options (Transformer Engine's `num_gqa_groups`, `rotary_pos_emb`, padding masks):
///
/// - **grouped-query attention**: `k` and `v` with `kv_heads * d_head` outputs, fewer than
///   the queries' (inferred from the widths by [`SelfAttention::new`]; [`Self::with_kv_heads`]
///   states it); key/value head `j` serves query heads `j * g .. (j + 1) * g`,
///   `g = heads / kv_heads` (candle-transformers' `repeat_kv`);
/// - **rotary embedding** ([`Self::with_rope`], or per call in [`Self::forward_with`]): f32
///   tables `cos`, `sin` of shape `(max_positions, d_head)`, each row's two halves equal (the
///   layout candle-transformers' Llama builds), applied to the queries and keys of head width
///   `d_head` as candle's `rope`: with `x1`, `x2` the halves,
///   `[x1 cos - x2 sin, x2 cos + x1 sin]`, in f32, the result in the queries' type; or
///   ([`Self::with_rope_interleaved`]) candle's `rope_i` layout, tables `(max_positions,
///   d_head / 2)` rotating the pairs `(x[2i], x[2i+1])` by `cos[i]`, `sin[i]` (GPT-J's,
///   and Mistral's or Llama's original checkpoints'): the tables' width is the layout
///   ([`RopeLayout`]), in a call's tables too;
/// - **key padding by lengths** ([`Self::forward_masked`]): keys at or past `lengths[i]` get
///   exactly 0 probability in sequence `i` (with the causal mask too); lengths past the
///   sequence count as its length. A query with no live key (a length of 0) gets an
///   attention output of zeros (the output projection's bias after it), not PyTorch's NaN.
///
/// The fused node applies all three inside itself (the rotation's backward and the groups'
/// key/value gradient sums in f32); the unfused layers compute the same with
/// [`crate::nn::scaled_dot_product_attention`], the heads repeated, the rotation as ops and the
/// mask from [`crate::nn::key_padding_mask`].
#[derive(Debug, Clone)]
pub struct SelfAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    kv_heads: usize,
    causal: bool,
    /// f32 `(max_positions, d_head)` tables.
    rope: Option<(Tensor, Tensor)>,
}

impl SelfAttention {
    /// The module from its projections: `q` maps the width to `heads * d_head`, `k` to
    /// `kv_heads * d_head` and `v` to `kv_heads * d_value` (`kv_heads` dividing `heads`,
    /// inferred from `k`'s width: `heads` without grouping), `o` from `heads * d_value` to
    /// the output width. An error when a projection has an activation, `heads` is 0 or does
    /// not divide the widths, or the widths do not chain.
    pub fn new(q: Linear, k: Linear, v: Linear, o: Linear, heads: usize, causal: bool) -> Result<Self> {
        if [&q, &k, &v, &o].iter().any(|l| l.activation().is_some()) {
            candle_core::bail!("SelfAttention: the projections take no activation")
        }
        let rows = |l: &Linear| l.weight().dims2();
        let ((nq, iq), (nk, ik), (nv, iv), (_, io)) = (rows(&q)?, rows(&k)?, rows(&v)?, rows(&o)?);
        if heads == 0 || nq % heads != 0 || nq == 0 {
            candle_core::bail!("SelfAttention: {heads} heads do not divide the query width {nq}")
        }
        let dk = nq / heads;
        let kv_heads = nk / dk;
        let fits = nk % dk == 0 && kv_heads > 0 && heads.is_multiple_of(kv_heads) && nv.is_multiple_of(kv_heads);
        if !fits || iq != ik || iq != iv || io != nv / kv_heads.max(1) * heads {
            candle_core::bail!(
                "SelfAttention: projections q {:?}, k {:?}, v {:?}, o {:?} do not fit {heads} heads (q and k of \
                 the same head width, k's heads dividing q's, v of k's heads and the same input width, o \
                 taking the heads' values)",
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
            kv_heads,
            causal,
            rope: None,
        })
    }

    /// States the number of key/value heads (grouped-query attention): an error unless the
    /// projections' widths give `kv_heads` (see [`Self::new`], which infers it).
    pub fn with_kv_heads(self, kv_heads: usize) -> Result<Self> {
        if kv_heads != self.kv_heads {
            candle_core::bail!(
                "SelfAttention: the key projection's width gives {} key/value heads, not {kv_heads}",
                self.kv_heads
            )
        }
        Ok(self)
    }

    /// A rotary embedding with tables `cos`, `sin` of shape `(max_positions, d_head)` (any
    /// float type, kept in f32; each row's halves equal, see the type's documentation). An
    /// error when the shapes differ or do not match the head width, or that width is odd.
    pub fn with_rope(mut self, cos: &Tensor, sin: &Tensor) -> Result<Self> {
        let dk = self.head_dim();
        if cos.dims() != sin.dims() || cos.rank() != 2 || cos.dim(1)? != dk || !dk.is_multiple_of(2) {
            candle_core::bail!(
                "SelfAttention: rotary tables {:?} and {:?} for an even head width {dk}: (max_positions, {dk}) each",
                cos.dims(),
                sin.dims()
            )
        }
        let f = |t: &Tensor| crate::kernels::cast(&t.detach(), candle_core::DType::F32);
        self.rope = Some((f(cos)?, f(sin)?));
        Ok(self)
    }

    /// A rotary embedding in candle's `rope_i` (interleaved) layout, with candle's tables
    /// for it: `cos`, `sin` of shape `(max_positions, d_head / 2)` (any float type, kept in
    /// f32). Each pair `(x[2i], x[2i+1])` of a query or key head becomes
    /// `(x[2i] cos[i] - x[2i+1] sin[i], x[2i] sin[i] + x[2i+1] cos[i])`, as
    /// `candle_nn::rotary_emb::rope_i` computes it. An error when the shapes differ or do not
    /// match half the head width, or that width is odd.
    ///
    /// ```
    /// use candle_amp::nn::{Linear, RopeLayout, SelfAttention};
    /// use candle_core::{DType, Device, Module, Tensor};
    /// # fn main() -> candle_core::Result<()> {
    /// let dev = Device::Cpu;
    /// let p = || Linear::new(Tensor::eye(4, DType::F32, &dev).unwrap(), None);
    /// let (cos, sin) = (Tensor::ones((8, 1), DType::F32, &dev)?, Tensor::zeros((8, 1), DType::F32, &dev)?);
    /// let attn = SelfAttention::new(p(), p(), p(), p(), 2, true)?.with_rope_interleaved(&cos, &sin)?;
    /// assert_eq!(attn.rope_layout(), Some(RopeLayout::Interleaved));
    /// let y = attn.forward(&Tensor::ones((1, 3, 4), DType::F32, &dev)?)?;
    /// assert_eq!(y.dims(), &[1, 3, 4]);
    /// # Ok(()) }
    /// ```
    pub fn with_rope_interleaved(mut self, cos: &Tensor, sin: &Tensor) -> Result<Self> {
        let dk = self.head_dim();
        if cos.dims() != sin.dims() || cos.rank() != 2 || cos.dim(1)? * 2 != dk || !dk.is_multiple_of(2) {
            candle_core::bail!(
                "SelfAttention: interleaved rotary tables {:?} and {:?} for an even head width {dk}: \
                 (max_positions, {}) each",
                cos.dims(),
                sin.dims(),
                dk / 2
            )
        }
        let f = |t: &Tensor| crate::kernels::cast(&t.detach(), candle_core::DType::F32);
        self.rope = Some((f(cos)?, f(sin)?));
        Ok(self)
    }

    /// The layout of the module's rotary tables, if it has them.
    pub fn rope_layout(&self) -> Option<RopeLayout> {
        let (c, _) = self.rope.as_ref()?;
        Some(if c.dim(1).ok()? == self.head_dim() {
            RopeLayout::Halves
        } else {
            RopeLayout::Interleaved
        })
    }

    /// The query, key, value and output projections.
    pub fn projections(&self) -> [&Linear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }

    /// The number of (query) heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// The number of key/value heads (`heads` without grouping).
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// The query/key width per head.
    pub fn head_dim(&self) -> usize {
        self.q.weight().dim(0).unwrap_or(0) / self.heads
    }

    /// Whether each position attends only to itself and earlier positions.
    pub fn causal(&self) -> bool {
        self.causal
    }

    /// The rotary tables given to [`Self::with_rope`], f32.
    pub fn rope(&self) -> Option<(&Tensor, &Tensor)> {
        self.rope.as_ref().map(|(c, s)| (c, s))
    }

    /// The attention over `x` `(batch, positions, width)` with keys at or past `lengths[i]`
    /// masked in sequence `i` (`None`: none masked; see the type's documentation). An error
    /// when `lengths` does not hold one length per sequence.
    pub fn forward_masked(&self, x: &Tensor, lengths: Option<&[usize]>) -> Result<Tensor> {
        self.forward_with(x, None, lengths)
    }

    /// [`Self::forward_masked`] with rotary tables for this call (f32 `(positions or more,
    /// d_head)`) in place of the module's: a model that keeps one table cache for its layers
    /// (`models::llama`). An error when the tables are shorter than the sequence.
    pub fn forward_with(
        &self,
        x: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        let (rope, lengths) = self.call_options(x, rope, lengths)?;
        fn p(l: &Linear) -> (&Tensor, Option<&Tensor>) {
            (l.weight(), l.bias())
        }
        let proj = [p(&self.q), p(&self.k), p(&self.v), p(&self.o)];
        let opts = fused::AttentionOptions {
            kv_heads: self.kv_heads,
            rope: rope.map(|(c, s)| (c.clone(), s.clone())),
            lengths: lengths.as_deref().map(Into::into),
        };
        if let Some(y) = fused::self_attention(x, proj, self.heads, self.causal, &opts)? {
            return Ok(y);
        }
        self.unfused(x, rope, lengths.as_deref())
    }

    /// The tables of a call over `x` (the call's, else the module's), checked to cover its
    /// positions, and its key lengths, checked against its batch and clipped to its positions.
    fn call_options<'a>(
        &'a self,
        x: &Tensor,
        rope: Option<(&'a Tensor, &'a Tensor)>,
        lengths: Option<&[usize]>,
    ) -> Result<CallOptions<'a>> {
        let (b, t, _) = x.dims3()?;
        let rope = rope.or(self.rope());
        if let Some((c, s)) = rope {
            let dk = self.head_dim();
            // Full width: the halves layout; half of it: the interleaved one.
            if c.rank() != 2 || c.dims() != s.dims() || c.dim(0)? < t || (c.dim(1)? != dk && c.dim(1)? * 2 != dk) {
                candle_core::bail!(
                    "SelfAttention: rotary tables {:?} do not cover {t} positions of head width {dk}",
                    c.dims()
                )
            }
        }
        let lengths: Option<Vec<usize>> = match lengths {
            Some(l) if l.len() != b => {
                candle_core::bail!("SelfAttention: {} key lengths for a batch of {b}", l.len())
            }
            Some(l) => Some(l.iter().map(|&n| n.min(t)).collect()),
            None => None,
        };
        Ok((rope, lengths))
    }

    /// The body of a fused `nn::Residual` over `x` with [`Self::forward_with`]'s tables and
    /// lengths (checked as there).
    pub(crate) fn body_spec_with(
        &self,
        x: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        lengths: Option<&[usize]>,
    ) -> Result<fused::BodySpec<'_>> {
        let (rope, lengths) = self.call_options(x, rope, lengths)?;
        let [q, k, v, o] = self.projections().map(|l| (l.weight(), l.bias()));
        Ok(fused::BodySpec::Attention {
            proj: [q, k, v, o],
            heads: self.heads,
            causal: self.causal,
            opts: fused::AttentionOptions {
                kv_heads: self.kv_heads,
                rope: rope.map(|(c, s)| (c.clone(), s.clone())),
                lengths: lengths.as_deref().map(Into::into),
            },
        })
    }

    /// The unfused layers (what runs where the fused node does not apply).
    fn unfused(&self, x: &Tensor, rope: Option<(&Tensor, &Tensor)>, lengths: Option<&[usize]>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let q = split_heads(&self.q.forward(x)?, self.heads)?;
        let k = split_heads(&self.k.forward(x)?, self.kv_heads)?;
        let v = split_heads(&self.v.forward(x)?, self.kv_heads)?;
        let (q, k) = match rope {
            Some((c, s)) => {
                let (c, s) = (c.narrow(0, 0, t)?, s.narrow(0, 0, t)?);
                (apply_rope(&q, &c, &s)?, apply_rope(&k, &c, &s)?)
            }
            None => (q, k),
        };
        if crate::kernels::enabled() && crate::kernels::cuda::flash::applies_with(&q, &k, &v, lengths) {
            // The CUDA flash kernels read the grouped heads in place and mask the keys past the
            // lengths themselves (a length of 0 gives zeros): no repeated K and V, no mask
            // tensor, no (b, h, t, t) scores. Cast and recorded as `scaled_dot_product_attention`'s
            // flash branch does (as its `matmul`).
            let scale = 1.0 / (self.head_dim() as f64).sqrt();
            let a = ops::call("matmul", &[&q, &k, &v], |xs| {
                crate::kernels::cuda::flash::attention_with(&xs[0], &xs[1], &xs[2], scale, self.causal, lengths)?
                    .ok_or_else(|| candle_core::Error::Msg("SelfAttention: the CUDA kernels do not apply".into()))
            })?;
            return self.o.forward(&merge_heads(&a)?);
        }
        let n = self.heads / self.kv_heads;
        let (k, v) = (repeat_kv(k, n)?, repeat_kv(v, n)?);
        let mask = lengths.map(|l| key_padding_mask(l, t, x.device())).transpose()?;
        let mut a = scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), self.causal, None)?;
        if let Some(l) = lengths.filter(|l| l.contains(&0)) {
            // A sequence with no live key: zeros (the fused softmax's empty rows), where the
            // finite additive mask would leave the unmasked softmax.
            let keep: Vec<f32> = l.iter().map(|&n| if n == 0 { 0.0 } else { 1.0 }).collect();
            let keep = Tensor::from_vec(keep, (b, 1, 1, 1), x.device())?.to_dtype(a.dtype())?;
            a = a.broadcast_mul(&keep)?;
        }
        self.o.forward(&merge_heads(&a)?)
    }
}

/// One call's rotary tables and key lengths (see `SelfAttention::call_options`).
type CallOptions<'a> = (Option<(&'a Tensor, &'a Tensor)>, Option<Vec<usize>>);

impl Module for SelfAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, None, None)
    }
}

/// `[-x2, x1]` for the halves `x1`, `x2` of the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// `x cos + rotate_half(x) sin` over `x` `(b, heads, t, head_dim)`, computed in f32 (f64
/// stays f64) and returned in `x`'s type: candle-nn's `rope` (the same rotation) has no
/// backward. Tables of width `head_dim / 2`: candle's `rope_i` instead ([`rope_i_ops`]).
/// On CUDA one kernel each way (`kernels::cuda::rope`: the same values, a zero gradient's
/// sign aside) where it takes the types and the tables are `(t, width)`, as the composed ops
/// need them.
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if crate::kernels::enabled()
        && !x.device().is_cpu()
        && x.rank() == 4
        && cos.rank() == 2
        && cos.dim(0)? == x.dim(2)?
        && let Some(y) = crate::kernels::cuda::rope::rope(x, cos, sin)?
    {
        return Ok(y);
    }
    let dt = x.dtype();
    let wide = if dt == DType::F64 { DType::F64 } else { DType::F32 };
    let xw = crate::kernels::cast(x, wide)?;
    let (cos, sin) = (cos.to_dtype(wide)?, sin.to_dtype(wide)?);
    let y = if cos.dim(D::Minus1)? * 2 == x.dim(D::Minus1)? {
        rope_i_ops(&xw, &cos, &sin)?
    } else {
        ops::add(&ops::mul(&xw, &cos)?, &ops::mul(&rotate_half(&xw)?, &sin)?)?
    };
    crate::kernels::cast(&y, dt)
}

/// candle's `rope_i` as differentiable ops over `x` `(b, heads, t, d)` and tables
/// `(t, d/2)`: each pair `(x0, x1) = (x[2i], x[2i+1])` becomes
/// `(x0 cos - x1 sin, x0 sin + x1 cos)`.
fn rope_i_ops(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    let p = x.reshape((b, h, t, d / 2, 2))?;
    let (x0, x1) = (p.narrow(4, 0, 1)?.squeeze(4)?, p.narrow(4, 1, 1)?.squeeze(4)?);
    let y0 = ops::sub(&ops::mul(&x0, cos)?, &ops::mul(&x1, sin)?)?;
    let y1 = ops::add(&ops::mul(&x0, sin)?, &ops::mul(&x1, cos)?)?;
    Tensor::stack(&[&y0, &y1], 4)?.reshape((b, h, t, d))
}

/// Each of `x`'s `(b, kv_heads, t, d)` heads repeated `n` times in place (head `j` of the
/// result is head `j / n` of `x`), as candle-transformers' `repeat_kv`.
pub(crate) fn repeat_kv(x: Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x);
    }
    let (b, kv, t, d) = x.dims4()?;
    Tensor::cat(&vec![&x; n], 2)?.reshape((b, kv * n, t, d))
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
