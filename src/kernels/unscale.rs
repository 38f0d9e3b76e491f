//! Check and unscale one raw gradient.
//!
//! The check reads the raw gradient first, as PyTorch's `_amp_foreach_non_finite_check_and_unscale_`
//! does, and then unscales: `g * (1/scale)` in f32, PyTorch's arithmetic, while `1/scale` is
//! a finite f32. Below a scale of about 2^-128 that inverse is infinite in f32 and would turn
//! finite gradients into inf; there the gradient is divided by the scale in f64 instead, so a
//! finite gradient stays finite and the step counts as clean, as in PyTorch. A gradient whose
//! unscaled value does not fit in f32 (possible only with scales below 1) is reported as an
//! overflow rather than written into the weights as inf, where PyTorch would write it.

use candle_core::{CpuStorage, DType, Storage, Tensor};

use crate::error::Result;

/// How a raw value becomes an unscaled f32 value.
#[derive(Clone, Copy)]
enum Unscale {
    /// `scale` is 1: a plain conversion.
    Identity,
    /// `g * inv` in f32 (PyTorch).
    Mul(f32),
    /// `g / scale` in f64 (the f32 inverse is not finite).
    Div(f64),
}

impl Unscale {
    fn new(scale: f32) -> Self {
        let inv = (1.0f64 / scale as f64) as f32;
        if inv == 1.0 {
            Unscale::Identity
        } else if inv.is_finite() {
            Unscale::Mul(inv)
        } else {
            Unscale::Div(scale as f64)
        }
    }

    #[inline(always)]
    fn apply(self, g: f32) -> f32 {
        match self {
            Unscale::Identity => g,
            Unscale::Mul(inv) => g * inv,
            Unscale::Div(s) => (g as f64 / s) as f32,
        }
    }
}

fn run<T: Copy>(src: &[T], to_f32: impl Fn(T) -> f32, u: Unscale) -> (Vec<f32>, bool) {
    let mut bad = false;
    let out = src
        .iter()
        .map(|&x| {
            let g = to_f32(x);
            let v = u.apply(g);
            // The raw value first (PyTorch's order), then the unscaled one.
            bad |= !g.is_finite() | !v.is_finite();
            v
        })
        .collect();
    (out, bad)
}

/// Unscales one raw gradient into a new, detached f32 tensor and reports whether it held an
/// inf or NaN (before or after unscaling). With `check` false nothing is checked.
pub(crate) fn unscale_check(raw: &Tensor, scale: f32, check: bool) -> Result<(Tensor, bool)> {
    // Detached first: a gradient can come back attached to the forward graph, and anything
    // kept from it across steps would keep every step's graph alive.
    let raw = raw.detach().contiguous()?;
    let u = Unscale::new(scale);
    let cpu = {
        let (storage, layout) = raw.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(cs), Some((a, b))) => match cs {
                CpuStorage::F32(v) => Some(run(&v[a..b], |x| x, u)),
                CpuStorage::F16(v) => Some(run(&v[a..b], |x| x.to_f32(), u)),
                CpuStorage::BF16(v) => Some(run(&v[a..b], |x| x.to_f32(), u)),
                CpuStorage::F64(v) => Some(run(&v[a..b], |x| x as f32, u)),
                _ => None,
            },
            _ => None,
        }
    };
    if let Some((out, bad)) = cpu {
        return Ok((Tensor::from_vec(out, raw.shape(), raw.device())?, check && bad));
    }
    // Other devices: the same arithmetic with tensor ops.
    let g = raw.to_dtype(DType::F32)?;
    let v = match u {
        Unscale::Identity => g,
        Unscale::Mul(inv) => g.affine(inv as f64, 0.0)?,
        Unscale::Div(s) => (raw.to_dtype(DType::F64)? / s)?.to_dtype(DType::F32)?,
    };
    let bad = check && (nonfinite(&raw)? || nonfinite(&v)?);
    Ok((v, bad))
}

/// Whether any element is inf or NaN: `t * 0` is NaN exactly there and 0 elsewhere, so its
/// sum (in f32) cannot overflow the way a plain sum of large values can.
pub(crate) fn nonfinite(t: &Tensor) -> Result<bool> {
    let t = t.to_dtype(DType::F32)?;
    Ok(t.affine(0.0, 0.0)?.sum_all()?.to_scalar::<f32>()?.is_nan())
}
