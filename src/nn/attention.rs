//! Scaled dot-product attention with the softmax in f32.

use candle_core::{DType, Device, Result, Tensor};

use crate::precision::autocast;
use crate::precision::ops;

/// A `(t, t)` f32 mask with 0 on and below the diagonal and -inf above (position `i` may
/// attend to `j <= i`).
pub fn causal_mask(t: usize, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * t)
        .map(|k| if k % t > k / t { f32::NEG_INFINITY } else { 0.0 })
        .collect();
    Tensor::from_vec(v, (t, t), device)
}

/// `x` with its last two dimensions swapped, contiguous, as one graph node (see
/// [`split_heads`]).
fn transpose_last(x: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let r = dims.len();
    if r < 2 {
        candle_core::bail!("transpose_last: a tensor of rank {r}")
    }
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    let merged: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    crate::kernels::elementwise::rearrange(x, dims, &perm, &merged)
}

/// `(b, t, heads * d)` to `(b, heads, t, d)`, contiguous: the layout
/// [`scaled_dot_product_attention`] takes. The same values as
/// `x.reshape((b, t, heads, d))?.transpose(1, 2)?.contiguous()`, as one graph node: for
/// half tensors on the CPU its backward stays out of candle's half element-wise code, where
/// candle's three ops (reshape, transpose, copy) would each add a half gradient.
///
/// ```
/// use candle_amp::nn::{merge_heads, split_heads};
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((1, 3, 8))?;
/// let h = split_heads(&x, 2)?;
/// assert_eq!(h.dims(), [1, 2, 3, 4]);
/// assert_eq!(h.get(0)?.get(1)?.get(0)?.to_vec1::<f32>()?, [4.0, 5.0, 6.0, 7.0]);
/// assert_eq!(merge_heads(&h)?.to_vec3::<f32>()?, x.to_vec3::<f32>()?);
/// # Ok(()) }
/// ```
pub fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, d) = x.dims3()?;
    if heads == 0 || d % heads != 0 {
        candle_core::bail!("split_heads: width {d} does not split into {heads} heads")
    }
    let dh = d / heads;
    crate::kernels::elementwise::rearrange(x, &[b, t, heads, dh], &[0, 2, 1, 3], &[b, heads, t, dh])
}

/// `(b, heads, t, d)` back to `(b, t, heads * d)`: the inverse of [`split_heads`], as one
/// graph node.
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, dh) = x.dims4()?;
    crate::kernels::elementwise::rearrange(x, &[b, h, t, dh], &[0, 2, 1, 3], &[b, t, h * dh])
}

/// `softmax(q k^T * scale + mask) v` for `q`, `k`, `v` of shape `(..., t, d)`. The products
/// run in half under autocast; the scores are taken to f32 for the mask and the softmax,
/// then the probabilities return to the value's type. `scale` defaults to `1/sqrt(d)`.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: Option<f64>,
) -> Result<Tensor> {
    if let Some(r) = crate::precision::empty::on_host_with(&[q, k, v], &[mask], |t, o| {
        scaled_dot_product_attention(&t[0], &t[1], &t[2], o[0].as_ref(), causal, scale)
    }) {
        return r;
    }
    let d = q.dim(candle_core::D::Minus1)?;
    let t = q.dim(candle_core::D::Minus2)?;
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    if mask.is_none() && crate::kernels::enabled() && crate::kernels::cuda::flash::applies(q, k, v) {
        // FlashAttention-2 on CUDA: no (.., t, t) scores stored. q, k and v are cast as
        // `ops::matmul` casts its operands (half under autocast), the arithmetic inside is f32,
        // and the output comes in that type, as the composed path's last product's does; it
        // is recorded for the numerics doctor as that `matmul`.
        return ops::call("matmul", &[q, k, v], |xs| {
            crate::kernels::cuda::flash::attention(&xs[0], &xs[1], &xs[2], scale, causal)?
                .ok_or_else(|| candle_core::Error::Msg("attention: the CUDA kernels do not apply".into()))
        });
    }
    let scores = ops::matmul(q, &transpose_last(k)?)?;
    if mask.is_none() && autocast::eligible(scores.dtype()) {
        // One op: scale, causal mask and softmax in f32, keeping only its input and output
        // for the backward. Under autocast the probabilities stay f32, as softmax's policy
        // says (the product casts them); otherwise they are written in `v`'s type, which the
        // product runs in. Recorded for the numerics doctor as the `softmax` op it replaces.
        let out = if autocast::is_enabled() { DType::F32 } else { v.dtype() };
        let probs =
            crate::precision::observe::op("softmax", crate::kernels::scaled_softmax(&scores, scale, causal, out))?;
        return ops::matmul(&probs, v);
    }
    // f32 for the mask and softmax (f64 stays f64).
    let sdt = if autocast::eligible(scores.dtype()) {
        DType::F32
    } else {
        scores.dtype()
    };
    let mut scores = (crate::kernels::cast(&scores, sdt)? * scale)?;
    if causal {
        scores = scores.broadcast_add(&causal_mask(t, q.device())?.to_dtype(sdt)?)?;
    }
    if let Some(m) = mask {
        scores = scores.broadcast_add(&m.to_dtype(sdt)?)?;
    }
    let probs = ops::softmax(&scores, scores.rank() - 1)?;
    let probs = if autocast::is_enabled() {
        probs
    } else {
        crate::kernels::cast(&probs, v.dtype())?
    };
    ops::matmul(&probs, v)
}

/// The value [`key_padding_mask`] adds to the scores of keys that are padding: the most
/// negative f16, so the mask stays finite in every float type (a half `-inf` would make a
/// fully padded row NaN, and `0 * -inf` is NaN). Added to f32 scores it gives those keys
/// exactly 0 probability: their scores then sit far more than the 104 (f32) or 745 (f64)
/// below the row's maximum past which `exp` underflows to 0.
pub const MASKED: f32 = -65504.0;

/// An additive key-padding mask for [`scaled_dot_product_attention`]: `(b, 1, 1, t)` in f32,
/// 0 for the first `lengths[i]` keys of sequence `i` and [`MASKED`] for the rest (its
/// padding), broadcasting over the heads and the queries of `(b, heads, t, t)` scores.
/// The attention adds it to the scores in f32 under autocast and at every opt level, so a
/// padded key gets exactly 0 probability and no NaN appears. Lengths past `t` count as `t`.
///
/// ```
/// use candle_amp::nn::{MASKED, key_padding_mask};
/// use candle_core::Device;
/// # fn main() -> candle_core::Result<()> {
/// let m = key_padding_mask(&[3, 1], 3, &Device::Cpu)?;
/// assert_eq!(m.dims(), [2, 1, 1, 3]);
/// assert_eq!(m.flatten_all()?.to_vec1::<f32>()?, [0.0, 0.0, 0.0, 0.0, MASKED, MASKED]);
/// # Ok(()) }
/// ```
pub fn key_padding_mask(lengths: &[usize], t: usize, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = lengths
        .iter()
        .flat_map(|&n| (0..t).map(move |j| if j < n { 0.0 } else { MASKED }))
        .collect();
    Tensor::from_vec(v, (lengths.len(), 1, 1, t), device)
}
