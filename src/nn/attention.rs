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
    let d = q.dim(candle_core::D::Minus1)?;
    let t = q.dim(candle_core::D::Minus2)?;
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let scores = ops::matmul(
        q,
        &k.transpose(candle_core::D::Minus2, candle_core::D::Minus1)?
            .contiguous()?,
    )?;
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
