//! Multi-head self-attention from the query/key/value products to the output projection as
//! one graph node: Transformer Engine's `MultiheadAttention`, Apex's fast multi-head
//! attention.
//!
//! Unfused, a block's attention leaves about a dozen half tensors in candle's graph (the
//! three projections, their head splits, the transposed keys, the scores, the
//! probabilities, the heads' outputs and their merge), and candle's backward adds each
//! one's gradient into a `zeros_like` in half, slowly on the CPU; the attention input's
//! three gradients are also summed there, rounded to half after each add. Here the same ops
//! run on detached tensors inside one node. The forward keeps what the unfused graph keeps
//! for the backward (the input, the split heads, the transposed keys, the probabilities and
//! the heads' merged outputs), the backward runs the unfused ops' backwards in reverse,
//! sends every parameter gradient to the sink in f32, and returns only the input's gradient
//! to candle: the three projections' f32 products summed in f32 and rounded once. Every
//! other value is computed exactly as the unfused ops compute it.
//!
//! Options (Transformer Engine's `num_gqa_groups`, `rotary_pos_emb`, padding masks): fewer
//! key/value heads (each serves `heads / kv_heads` query heads: repeated inside the node as
//! candle-transformers' `repeat_kv`, their gradients summed over the group in f32), a rotary
//! embedding applied to the queries and keys in f32 (candle's `rope` layout, or its `rope_i`
//! layout for tables of half the head width; its backward the transposed rotation), and a key length per batch item applied inside the softmax as the
//! causal limit is (masked probabilities exactly 0; a row with no live key all zeros).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::chain::ChainLayer;
use super::elementwise::rearranged;
use super::matmul::bmm;
use super::wgrad::{Dx, GradSink, WgradLinear, applies};

/// The node: the four projections, the shapes, and what the forward kept.
pub(crate) struct Attention {
    /// Query, key, value and output projections.
    proj: [WgradLinear; 4],
    /// Batch, positions, heads, query/key width and value width per head.
    dims: Dims,
    scale: f32,
    /// The rotary tables narrowed to the positions, f32 `(t, dk)`.
    rope: Option<(Tensor, Tensor)>,
    /// The input in the products' type (a half copy of an f32 input at O1).
    x: Tensor,
    /// `(b, h, t, dk)` queries, `(b, h, dk, t)` transposed keys, `(b, h, t, dv)` values
    /// (rotated, and the key/value heads repeated over their groups).
    q: Tensor,
    kt: Tensor,
    v: Tensor,
    /// The softmax's output (f32 under autocast, as its policy says; else the values' type).
    probs: Tensor,
    /// The heads' outputs merged, `(b, t, h * dv)`: the output projection's input.
    merged: Tensor,
    /// The output until the forward hands it to candle.
    result: Mutex<Option<Tensor>>,
}

#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    /// Key/value heads (`h` without grouping).
    kv: usize,
    dk: usize,
    dv: usize,
}

impl Dims {
    /// `(b, t, heads * d)` to `(b, heads, t, d)`.
    fn split(&self, x: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
        let Dims { b, t, .. } = *self;
        rearranged(x, &[b, t, heads, d], &[0, 2, 1, 3], &[b, heads, t, d])
    }

    /// `(b, heads, t, d)` to `(b, t, heads * d)`.
    fn merge(&self, x: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
        let Dims { b, t, .. } = *self;
        rearranged(x, &[b, heads, t, d], &[0, 2, 1, 3], &[b, t, heads * d])
    }

    /// `(b, h, r, c)` to `(b, h, c, r)`.
    fn transpose(&self, x: &Tensor, r: usize, c: usize) -> Result<Tensor> {
        let Dims { b, h, .. } = *self;
        rearranged(x, &[b, h, r, c], &[0, 1, 3, 2], &[b, h, c, r])
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.h / self.kv
    }

    /// `(b, kv, t, d)` with each head repeated over its group, `(b, h, t, d)` (head `j` is
    /// head `j / group`): candle-transformers' `repeat_kv`.
    fn repeat(&self, x: Tensor) -> Result<Tensor> {
        let n = self.group();
        if n == 1 {
            return Ok(x);
        }
        let (b, kv, t, d) = x.dims4()?;
        Tensor::cat(&vec![&x; n], 2)?.reshape((b, kv * n, t, d))
    }

    /// The gradient of [`Self::repeat`]: `(b, h, t, d)` summed over each group in f32.
    fn group_sum(&self, g: Tensor) -> Result<Tensor> {
        let n = self.group();
        if n == 1 {
            return Ok(g);
        }
        let (b, _, t, d) = g.dims4()?;
        let g = super::cast(&g, DType::F32)?;
        if g.device().is_cpu() {
            // In one pass over contiguous slices: candle's strided reduce over the middle
            // dimension was about 4% of a Llama step at O2 (Zen 4).
            return super::dense(&g)?.apply_op1_no_bwd(&GroupSum {
                kv: self.kv,
                n,
                td: t * d,
            });
        }
        g.reshape((b, self.kv, n, t, d))?.sum(2)
    }
}

/// `(b, kv * n, t, d)` f32 to `(b, kv, t, d)`, each output head the sum of its group's `n`
/// heads from zero in head order: candle's `reshape((b, kv, n, t, d)).sum(2)`, value for value.
struct GroupSum {
    kv: usize,
    n: usize,
    /// `t * d`.
    td: usize,
}

impl CustomOp1 for GroupSum {
    fn name(&self) -> &'static str {
        "amp-group-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (Some((a, e)), CpuStorage::F32(v)) = (l.contiguous_offsets(), s) else {
            candle_core::bail!("amp-group-sum: a contiguous f32 input")
        };
        let (b, dims) = (l.dims()[0], l.dims());
        let group = self.n * self.td;
        let mut out = vec![0f32; b * self.kv * self.td];
        if group > 0 {
            for (o, src) in out.chunks_mut(self.td.max(1)).zip(v[a..e].chunks(group)) {
                for head in src.chunks(self.td) {
                    for (x, y) in o.iter_mut().zip(head) {
                        *x += *y;
                    }
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((b, self.kv, dims[2], dims[3]))))
    }
}

/// `[-x2, x1]` for the halves of the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(candle_core::D::Minus1)?;
    let (x1, x2) = (x.narrow(3, 0, d / 2)?, x.narrow(3, d / 2, d / 2)?);
    Tensor::cat(&[&x2.neg()?, &x1], 3)
}

/// `x cos + rotate_half(x) sin` in f32 over `(b, h, t, d)`, returned in `x`'s type: the
/// unfused path's ops in the same order. Tables of width `d / 2` are candle's `rope_i`
/// layout instead ([`rope_i_fwd`]).
fn rope_fwd(x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
    if let Some(y) = super::rope::rotate(x, cos, sin, super::rope::Direction::Forward)? {
        return super::cast(&y, x.dtype());
    }
    rope_fwd_composed(x, (cos, sin))
}

/// [`rope_fwd`] from candle ops (what the one-pass kernel must equal, and the path off the
/// CPU).
fn rope_fwd_composed(x: &Tensor, (cos, sin): (&Tensor, &Tensor)) -> Result<Tensor> {
    let xw = super::cast(x, DType::F32)?;
    let y = if interleaved(cos, &xw)? {
        rope_i_fwd(&xw, cos, sin)?
    } else {
        (xw.broadcast_mul(cos)? + rotate_half(&xw)?.broadcast_mul(sin)?)?
    };
    super::cast(&y, x.dtype())
}

/// Whether tables `cos` are of the interleaved layout for `x` `(b, h, t, d)`: width `d / 2`.
fn interleaved(cos: &Tensor, x: &Tensor) -> Result<bool> {
    Ok(cos.dim(1)? * 2 == x.dim(3)?)
}

/// `x` `(b, h, t, d)` as its pairs `(x[2i], x[2i+1])`: the two `(b, h, t, d/2)` halves of
/// each pair, and the tables `(t, d/2)` as they broadcast over them.
fn pairs(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, h, t, d) = x.dims4()?;
    let p = x.reshape((b, h, t, d / 2, 2))?;
    Ok((p.narrow(4, 0, 1)?.squeeze(4)?, p.narrow(4, 1, 1)?.squeeze(4)?))
}

/// The pairs `(y0, y1)` back into `(b, h, t, d)` in pair order.
fn unpair(y0: &Tensor, y1: &Tensor) -> Result<Tensor> {
    let (b, h, t, half) = y0.dims4()?;
    Tensor::stack(&[y0, y1], 4)?.reshape((b, h, t, half * 2))
}

/// candle's `rope_i` in f32: each pair rotated, `(x0 cos - x1 sin, x0 sin + x1 cos)`, with
/// `cos`, `sin` `(t, d/2)`.
fn rope_i_fwd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (x0, x1) = pairs(x)?;
    let y0 = (x0.broadcast_mul(cos)? - x1.broadcast_mul(sin)?)?;
    let y1 = (x0.broadcast_mul(sin)? + x1.broadcast_mul(cos)?)?;
    unpair(&y0, &y1)
}

/// The gradient of [`rope_i_fwd`] in f32: each pair rotated back,
/// `(g0 cos + g1 sin, g1 cos - g0 sin)`.
fn rope_i_bwd(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (g0, g1) = pairs(g)?;
    let d0 = (g0.broadcast_mul(cos)? + g1.broadcast_mul(sin)?)?;
    let d1 = (g1.broadcast_mul(cos)? - g0.broadcast_mul(sin)?)?;
    unpair(&d0, &d1)
}

/// The gradient of [`rope_fwd`] in f32: `g cos + R^T(g sin)` with `R^T([z1, z2]) = [z2, -z1]`
/// (the transposed rotation).
fn rope_bwd(g: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
    if let Some(dx) = super::rope::rotate(g, cos, sin, super::rope::Direction::Backward)? {
        return Ok(dx);
    }
    rope_bwd_composed(g, (cos, sin))
}

/// [`rope_bwd`] from candle ops.
fn rope_bwd_composed(g: &Tensor, (cos, sin): (&Tensor, &Tensor)) -> Result<Tensor> {
    let g = super::cast(g, DType::F32)?;
    if interleaved(cos, &g)? {
        return rope_i_bwd(&g, cos, sin);
    }
    let z = g.broadcast_mul(sin)?;
    let d = z.dim(3)?;
    let (z1, z2) = (z.narrow(3, 0, d / 2)?, z.narrow(3, d / 2, d / 2)?);
    g.broadcast_mul(cos)? + Tensor::cat(&[&z2, &z1.neg()?], 3)?
}

impl Attention {
    fn fwd(&self) -> Result<(CpuStorage, Shape)> {
        super::chain::hand_over(&self.result, "amp-self-attention")
    }

    /// Whether a projection's parameter takes a gradient.
    pub(super) fn trains(&self) -> bool {
        self.proj.iter().any(|p| p.has_keys())
    }

    /// The output the forward computed, once (for a node that holds this one).
    pub(super) fn take_output(&self) -> Result<Tensor> {
        let out = self.result.lock().unwrap_or_else(|e| e.into_inner()).take();
        out.ok_or_else(|| candle_core::Error::Msg("amp-self-attention: the output was taken twice".into()))
    }

    /// The input's gradient for candle's graph (see [`Self::input_grad`]).
    fn bwd(&self, x_dtype: DType, g: &Tensor) -> Result<Option<Tensor>> {
        self.input_grad(x_dtype, g)?
            .map(super::graph_grad::for_candle)
            .transpose()
    }

    /// The input's gradient (dense, in `x_dtype`; `None` when the input takes none) after
    /// the parameters' gradients went to the sink.
    pub(super) fn input_grad(&self, x_dtype: DType, g: &Tensor) -> Result<Option<Tensor>> {
        let d = self.dims;
        let [pq, pk, pv, po] = &self.proj;
        let missing = || candle_core::Error::Msg("amp-self-attention: no input gradient from a projection".into());
        // y = merged . wo^T + bo
        let g_merged = po.bwd_x(&self.merged, g, Dx::Dense)?.ok_or_else(missing)?;
        let g_a = d.split(&g_merged, d.h, d.dv)?;
        // a = p . v (p in the values' type, as the product runs)
        let p = super::cast(&self.probs, self.v.dtype())?;
        let g_p = bmm(&g_a, &self.v, false, true)?;
        let g_v = bmm(&p, &g_a, true, false)?;
        drop(p);
        // p = softmax(scores * scale), its gradient in the scores' type (masked keys have
        // p = 0, so their gradient is 0)
        let dt = self.q.dtype();
        let g_s = super::softmax_grad::grad(&self.probs, &g_p, self.scale, dt)?;
        // scores = q . kt
        let g_q = bmm(&g_s, &self.kt, false, true)?;
        let g_kt = bmm(&self.q, &g_s, true, false)?;
        let g_k = d.group_sum(d.transpose(&g_kt, d.dk, d.t)?)?;
        let g_v = super::cast(&d.group_sum(g_v)?, dt)?;
        // The rotation's backward in f32, rounded once.
        let (g_q, g_k) = match &self.rope {
            Some(r) => (
                super::cast(&rope_bwd(&g_q, r)?, dt)?,
                super::cast(&rope_bwd(&g_k, r)?, dt)?,
            ),
            None => (g_q, super::cast(&g_k, dt)?),
        };
        let (g_q, g_k, g_v) = (
            d.merge(&g_q, d.h, d.dk)?,
            d.merge(&g_k, d.kv, d.dk)?,
            d.merge(&g_v, d.kv, d.dv)?,
        );
        // x's three gradients summed in f32, rounded once.
        let dq = pq.bwd_x(&self.x, &g_q, Dx::Wide)?;
        let dk = pk.bwd_x(&self.x, &g_k, Dx::Wide)?;
        let dv = pv.bwd_x(&self.x, &g_v, Dx::Wide)?;
        match (dq, dk, dv) {
            (Some(a), Some(b), Some(c)) => {
                let sum = ((a + b)? + c)?;
                Ok(Some(super::cast(&sum, x_dtype)?))
            }
            _ => Ok(None),
        }
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "amp-self-attention"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.bwd(x.dtype(), g)
    }
}

/// The same node over `(x, anchor)` for an input outside any graph (see `wgrad::linear`).
impl CustomOp2 for Attention {
    fn name(&self) -> &'static str {
        "amp-self-attention"
    }

    fn cpu_fwd(&self, _s1: &CpuStorage, _l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, x: &Tensor, _anchor: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((self.bwd(x.dtype(), g)?, None))
    }
}

/// How [`self_attention`] runs: heads, the options, the softmax's scale and output type.
#[derive(Debug, Clone)]
pub(crate) struct AttentionSpec {
    pub heads: usize,
    /// Key/value heads (grouped-query attention); equal to `heads` without grouping.
    pub kv_heads: usize,
    pub causal: bool,
    /// `None`: `1/sqrt(dk)`.
    pub scale: Option<f64>,
    /// The probabilities in f32 (autocast's softmax policy), cast to the values' type for
    /// the product; else written in the values' type.
    pub probs_f32: bool,
    /// Rotary tables `cos`, `sin`, f32 `(max_t, dk)` (each half of a row repeated: candle's
    /// `rope` layout), applied to the queries and keys; of width `dk / 2`: candle's `rope_i`
    /// layout (pairs `(x[2i], x[2i+1])` rotated by `cos[i]`, `sin[i]`).
    pub rope: Option<(Tensor, Tensor)>,
    /// A key length per batch item: keys at or past it get probability 0.
    pub lengths: Option<Arc<[usize]>>,
}

/// Self-attention over `x` `(b, t, d)` as one node: `o(attention(q(x), k(x), v(x)))` with
/// the projections `layers` = `[q, k, v, o]` (no activations), the products in the
/// projections' type (half); `x` may be f32 (O1: cast inside, its gradient returned in
/// f32). `None` where the node does not apply (another device or type, the kernels off,
/// shapes that do not fit, an empty input): the caller runs the unfused ops.
pub(crate) fn self_attention(
    x: &Tensor,
    layers: [&ChainLayer<'_>; 4],
    spec: AttentionSpec,
    sink: Arc<dyn GradSink>,
) -> Result<Option<Tensor>> {
    let x_grad = x.track_op();
    let Some(node) = build(x, layers, spec, sink, x_grad)? else {
        return Ok(None);
    };
    let trains = node.trains();
    let x = super::dense(x)?;
    Ok(Some(super::wgrad::apply_node(&x, node, trains)?))
}

/// The node of [`self_attention`] with its forward run (its output waits in the node), not
/// applied to any graph; `x_grad`: whether the input's gradient is wanted.
pub(crate) fn build(
    x: &Tensor,
    layers: [&ChainLayer<'_>; 4],
    spec: AttentionSpec,
    sink: Arc<dyn GradSink>,
    x_grad: bool,
) -> Result<Option<Attention>> {
    let dt = layers[0].w.dtype();
    if !matches!(dt, DType::F16 | DType::BF16) || !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Ok(None);
    }
    if x.rank() != 3 || x.elem_count() == 0 || !x.device().is_cpu() || spec.heads == 0 {
        return Ok(None);
    }
    let (b, t, d_in) = x.dims3()?;
    let [lq, lk, lv, lo] = layers;
    if layers.iter().any(|l| l.act.is_some() || l.w.rank() != 2) {
        return Ok(None);
    }
    let (dq, dk_all, dv_all) = (lq.w.dim(0)?, lk.w.dim(0)?, lv.w.dim(0)?);
    let (h, kv) = (spec.heads, spec.kv_heads);
    let fits = [lq, lk, lv].iter().all(|l| l.w.dim(1).ok() == Some(d_in))
        && kv > 0
        && h % kv == 0
        && dq % h == 0
        && dk_all * h == dq * kv
        && dv_all % kv == 0
        && dq > 0
        && dv_all > 0
        && lo.w.dim(1)? == dv_all / kv * h
        && lo.w.dim(0)? > 0;
    if !fits {
        return Ok(None);
    }
    let dk = dq / h;
    let rope = match &spec.rope {
        None => None,
        Some((c, s)) => {
            let ok = |x: &Tensor| {
                let w = x.dims().get(1).copied();
                let width = w == Some(dk) || w == Some(dk / 2);
                x.dtype() == DType::F32 && x.rank() == 2 && width && x.dims()[0] >= t && x.device().is_cpu()
            };
            if dk % 2 != 0 || c.dims() != s.dims() || !ok(c) || !ok(s) {
                return Ok(None);
            }
            Some((super::dense(&c.narrow(0, 0, t)?)?, super::dense(&s.narrow(0, 0, t)?)?))
        }
    };
    if spec.lengths.as_ref().is_some_and(|l| l.len() != b) {
        return Ok(None);
    }
    let xc = super::dense(&super::cast(&x.detach(), dt)?)?;
    if layers.iter().any(|l| !applies(&xc, l.w, l.b)) {
        return Ok(None);
    }
    let node = |l: &ChainLayer<'_>, grad: bool| WgradLinear::new(l.w, l.b, l.w_key, l.b_key, sink.clone(), grad, None);
    let proj = [node(lq, x_grad)?, node(lk, x_grad)?, node(lv, x_grad)?, node(lo, true)?];
    let dims = Dims {
        b,
        t,
        h,
        kv,
        dk,
        dv: dv_all / kv,
    };
    let scale = spec.scale.unwrap_or(1.0 / (dims.dk as f64).sqrt());
    // The forward, op by op as the unfused attention runs them (`nn::scaled_dot_product_attention`).
    let q = dims.split(&xc.apply_op1_no_bwd(&proj[0])?, h, dk)?;
    let k = dims.split(&xc.apply_op1_no_bwd(&proj[1])?, kv, dk)?;
    let v = dims.split(&xc.apply_op1_no_bwd(&proj[2])?, kv, dims.dv)?;
    let (q, k) = match &rope {
        Some(r) => (rope_fwd(&q, r)?, rope_fwd(&k, r)?),
        None => (q, k),
    };
    let (k, v) = (dims.repeat(k)?, super::dense(&dims.repeat(v)?)?);
    let kt = dims.transpose(&super::dense(&k)?, t, dk)?;
    drop(k);
    let scores = bmm(&q, &kt, false, false)?;
    let out = if spec.probs_f32 { DType::F32 } else { dt };
    let keys = spec
        .lengths
        .clone()
        .map(|lengths| super::softmax::KeyLengths { lengths, per_item: h });
    let probs = super::softmax::forward_no_bwd(&scores, scale, spec.causal, keys, out)?;
    drop(scores);
    let a = bmm(&super::cast(&probs, dt)?, &v, false, false)?;
    let merged = dims.merge(&a, h, dims.dv)?;
    drop(a);
    let y = merged.apply_op1_no_bwd(&proj[3])?;
    Ok(Some(Attention {
        proj,
        dims,
        scale: scale as f32,
        rope,
        x: xc,
        q,
        kt,
        v,
        probs,
        merged,
        result: Mutex::new(Some(y)),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The one-pass rotation equals the composed ops bit for bit, both ways, in both table
    /// layouts, from every input type, and the pass does apply (not the fallback).
    #[test]
    fn the_one_pass_rotation_equals_the_composed_ops() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 5, 8);
        let x = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        for w in [d, d / 2] {
            let cos = Tensor::randn(0f32, 1.0, (t, w), &dev).unwrap();
            let sin = Tensor::randn(0f32, 1.0, (t, w), &dev).unwrap();
            for dt in [DType::F32, DType::F16, DType::BF16] {
                let x = x.to_dtype(dt).unwrap();
                let pass = super::super::rope::rotate(&x, &cos, &sin, super::super::rope::Direction::Forward)
                    .unwrap()
                    .expect("the pass applies");
                let fwd = rope_fwd(&x, &(cos.clone(), sin.clone())).unwrap();
                assert_eq!(bits(&super::super::cast(&pass, dt).unwrap()), bits(&fwd));
                assert_eq!(
                    bits(&fwd),
                    bits(&rope_fwd_composed(&x, (&cos, &sin)).unwrap()),
                    "w={w} {dt:?}"
                );
                let bwd = rope_bwd(&x, &(cos.clone(), sin.clone())).unwrap();
                assert_eq!(bwd.dtype(), DType::F32);
                assert_eq!(
                    bits(&bwd),
                    bits(&rope_bwd_composed(&x, (&cos, &sin)).unwrap()),
                    "w={w} {dt:?}"
                );
            }
        }
        // Tables of another length or type: the pass declines and the composed ops run.
        let long = Tensor::ones((t + 1, d), DType::F32, &dev).unwrap();
        assert!(
            super::super::rope::rotate(&x, &long, &long, super::super::rope::Direction::Forward)
                .unwrap()
                .is_none()
        );
    }
}
