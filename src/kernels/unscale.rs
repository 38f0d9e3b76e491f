//! Check and unscale one raw gradient.
//!
//! The check reads the raw gradient first, as PyTorch's `_amp_foreach_non_finite_check_and_unscale_`
//! does, and then unscales: `g * (1/scale)` in f32, PyTorch's arithmetic, while `1/scale` is
//! a finite f32. Below a scale of about 2^-128 that inverse is infinite in f32 and would turn
//! finite gradients into inf; there the gradient is divided by the scale in f64 instead, so a
//! finite gradient stays finite and the step counts as clean, as in PyTorch. A gradient whose
//! unscaled value does not fit in f32 (possible only with scales below 1) is reported as an
//! overflow rather than written into the weights as inf, where PyTorch would write it.
//!
//! One pass over the raw values on the CPU (vectorised, split over the rayon pool for large
//! tensors); the same arithmetic with tensor ops elsewhere.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Storage, Tensor};

use rayon::prelude::*;

use super::simd::Elem;
use super::slices::{Unscale, Vx, unscale as unscale_slice};
use crate::error::Result;

fn run_on<S: Elem + Vx>(raw: &[S], out: &mut [f32], u: Unscale, acc: bool) -> bool {
    unscale_slice(raw, out, u, acc)
}

/// Unscales `raw` (any float type, contiguous CPU storage) into `out`, or adds it there.
fn unscale_storage(raw: &CpuStorage, a: usize, b: usize, out: &mut [f32], u: Unscale, acc: bool) -> Option<bool> {
    Some(match raw {
        CpuStorage::F32(v) => run_on(&v[a..b], out, u, acc),
        CpuStorage::F16(v) => run_on(&v[a..b], out, u, acc),
        CpuStorage::BF16(v) => run_on(&v[a..b], out, u, acc),
        CpuStorage::F64(v) => {
            let tmp: Vec<f32> = v[a..b].iter().map(|x| *x as f32).collect();
            run_on(&tmp, out, u, acc)
        }
        _ => return None,
    })
}

/// Unscales one raw gradient into a new, detached f32 tensor and reports whether it held an
/// inf or NaN (before or after unscaling). With `check` false nothing is checked.
pub(crate) fn unscale_check(raw: &Tensor, scale: f32, check: bool) -> Result<(Tensor, bool)> {
    // Detached first: a gradient can come back attached to the forward graph, and anything
    // kept from it across steps would keep every step's graph alive.
    let raw = super::dense(&raw.detach())?;
    let u = Unscale::new(scale);
    let cpu = if !super::enabled() {
        None
    } else {
        let (storage, layout) = raw.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(cs), Some((a, b))) => {
                let mut out = vec![0f32; b - a];
                unscale_storage(cs, a, b, &mut out, u, false).map(|bad| (out, bad))
            }
            _ => None,
        }
    };
    if let Some((out, bad)) = cpu {
        return Ok((Tensor::from_vec(out, raw.shape(), raw.device())?, check && bad));
    }
    // Other devices (and the plain path): the same arithmetic with tensor ops. At a scale of
    // 1 that is `raw` itself, which the caller does not own (it is kept as a master gradient
    // and written in place later): copied.
    let v = super::apart_from(&unscale_tensor(&raw, scale)?, &[&raw])?;
    let bad = check && (nonfinite(&raw)? || nonfinite(&v)?);
    Ok((v, bad))
}

/// `out = (acc + unscale(raw)) / div` (`unscale(raw) / div` without `acc`), unchecked: one
/// rank's share of an accumulated master gradient, written where data parallel's overlap
/// sends it (`distributed::overlap`). The arithmetic is the backward's own (the same pass
/// that adds into the master gradient, then the division the step's reduction makes), so a
/// share made during the backward has the bits the step would have sent.
pub(crate) fn unscale_share(raw: &Tensor, scale: f32, acc: Option<&Tensor>, div: f32, out: &mut [f32]) -> Result<()> {
    let raw = super::dense(&raw.detach())?;
    let n = raw.elem_count();
    if out.len() != n || acc.is_some_and(|a| a.elem_count() != n) {
        return Err(crate::AmpError::InvalidArgument {
            argument: "out",
            reason: format!("a share of {n} values needs {n} places, got {}", out.len()),
        });
    }
    let u = Unscale::new(scale);
    let mut done = false;
    if super::enabled() {
        let (storage, layout) = raw.storage_and_layout();
        if let (Storage::Cpu(cs), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            if let Some(acc) = acc {
                read_f32_into(acc, out)?;
            }
            done = unscale_storage(cs, a, b, out, u, acc.is_some()).is_some();
        }
    }
    if !done {
        // Other types and devices, and the plain path: the tensor ops of `unscale_check` and
        // `add_check`.
        let (g, _) = unscale_check(&raw, scale, false)?;
        let sum = match acc {
            Some(a) => add_check(a, &g.reshape(a.shape())?, false)?.0,
            None => g,
        };
        read_f32_into(&sum, out)?;
    }
    if div != 1.0 {
        for v in out.iter_mut() {
            *v /= div;
        }
    }
    Ok(())
}

/// Copies `t`'s values (f32) into `out` (of `t`'s size), straight from contiguous CPU storage.
pub(crate) fn read_f32_into(t: &Tensor, out: &mut [f32]) -> Result<()> {
    if t.dtype() == DType::F32 && t.device().is_cpu() {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) = (&*storage, layout.contiguous_offsets())
            && b - a == out.len()
        {
            out.copy_from_slice(&v[a..b]);
            return Ok(());
        }
    }
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if v.len() != out.len() {
        return Err(crate::AmpError::InvalidArgument {
            argument: "out",
            reason: format!("{} values do not fit {} places", v.len(), out.len()),
        });
    }
    out.copy_from_slice(&v);
    Ok(())
}

/// The unscaled f32 gradient with tensor ops on the gradient's device, unchecked and
/// detached: the arithmetic of [`unscale_check`] without any host read (the device path
/// checks the result on the device; an inf or NaN in `raw` stays inf or NaN).
pub(crate) fn unscale_tensor(raw: &Tensor, scale: f32) -> Result<Tensor> {
    let raw = raw.detach();
    let g = raw.to_dtype(DType::F32)?;
    Ok(match Unscale::new(scale) {
        Unscale::Identity => g,
        Unscale::Mul(inv) => g.affine(inv as f64, 0.0)?,
        Unscale::Div(s) => (raw.to_dtype(DType::F64)? / s)?.to_dtype(DType::F32)?,
    })
}

struct UnscaleInto {
    u: Unscale,
    accumulate: bool,
    bad: std::sync::atomic::AtomicBool,
}

impl InplaceOp2 for UnscaleInto {
    fn name(&self) -> &'static str {
        "amp-unscale-into"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> candle_core::Result<()> {
        let msg = || candle_core::Error::Msg("amp-unscale-into: tensors must be contiguous".into());
        let (sa, sb) = sl.contiguous_offsets().ok_or_else(msg)?;
        let (da, db) = dl.contiguous_offsets().ok_or_else(msg)?;
        let CpuStorage::F32(d) = dst else {
            candle_core::bail!("amp-unscale-into: the destination must be f32")
        };
        if sb - sa != db - da {
            candle_core::bail!("amp-unscale-into: {} values into {}", sb - sa, db - da)
        }
        let bad = unscale_storage(src, sa, sb, &mut d[da..db], self.u, self.accumulate)
            .ok_or_else(|| candle_core::Error::Msg(format!("amp-unscale-into: {:?} gradient", src.dtype())))?;
        self.bad.store(bad, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// Unscales `raw` into the f32 tensor `acc` in place (or adds it to `acc`'s values with
/// `accumulate`), in one pass, and returns whether a raw value or a value written is inf or
/// NaN (see the module documentation for the arithmetic). `acc` must be a contiguous f32 CPU
/// tensor of the same size that shares no storage with `raw` (off the CPU, a Var).
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_amp::Result<()> {
/// let raw = Tensor::new(&[1024f32, -2048., 4096.], &Device::Cpu)?.to_dtype(DType::F16)?;
/// let acc = Tensor::zeros(3, DType::F32, &Device::Cpu)?;
/// assert!(!kernels::unscale_check_into(&raw, 1024.0, &acc, false)?);
/// assert!(!kernels::unscale_check_into(&raw, 1024.0, &acc, true)?);
/// assert_eq!(acc.to_vec1::<f32>()?, [2.0, -4.0, 8.0]);
/// let bad = Tensor::new(&[1f32, f32::NAN, 3.], &Device::Cpu)?;
/// assert!(kernels::unscale_check_into(&bad, 1.0, &acc, false)?);
/// # Ok(()) }
/// ```
pub fn unscale_check_into(raw: &Tensor, scale: f32, acc: &Tensor, accumulate: bool) -> Result<bool> {
    if acc.dtype() != DType::F32 || acc.elem_count() != raw.elem_count() {
        return Err(crate::AmpError::InvalidArgument {
            argument: "acc",
            reason: format!(
                "needs an f32 tensor of {} values, got {:?} {:?}",
                raw.elem_count(),
                acc.dtype(),
                acc.shape()
            ),
        });
    }
    let u = Unscale::new(scale);
    if raw.device().is_cpu() && acc.device().is_cpu() {
        let raw = super::dense(raw)?;
        let op = UnscaleInto {
            u,
            accumulate,
            bad: std::sync::atomic::AtomicBool::new(false),
        };
        acc.inplace_op2(&raw, &op)?;
        return Ok(op.bad.into_inner());
    }
    // Off the CPU only a Var can be written in place (`Var::from_tensor` of a plain tensor
    // would write a copy and leave `acc` as it was).
    if !acc.is_variable() {
        return Err(crate::AmpError::InvalidArgument {
            argument: "acc",
            reason: "off the CPU the destination must be a Var (a plain tensor cannot be written in place)".into(),
        });
    }
    let (g, bad) = unscale_check(raw, scale, true)?;
    let v = if accumulate {
        (acc + g.reshape(acc.shape())?)?
    } else {
        g.reshape(acc.shape())?
    };
    candle_core::Var::from_tensor(acc)?.set(&v)?;
    Ok(bad || nonfinite(&v)?)
}

/// Whether `acc + unscale(raw)` (what [`unscale_check_into`] with `accumulate` writes) or
/// `raw` holds an inf or NaN, read without writing anything: the verdict that call will
/// give, for a backward that must agree on it with other processes before it writes.
pub(crate) fn sum_nonfinite(raw: &Tensor, scale: f32, acc: &Tensor) -> Result<bool> {
    let u = Unscale::new(scale);
    let raw = raw.contiguous()?;
    if raw.device().is_cpu() && acc.device().is_cpu() && acc.dtype() == DType::F32 {
        let (rs, rl) = raw.storage_and_layout();
        let (as_, al) = acc.storage_and_layout();
        if let (Storage::Cpu(r), Storage::Cpu(CpuStorage::F32(a)), Some((ra, rb)), Some((aa, ab))) =
            (&*rs, &*as_, rl.contiguous_offsets(), al.contiguous_offsets())
            && rb - ra == ab - aa
        {
            let a = &a[aa..ab];
            let bad = match r {
                CpuStorage::F32(v) => Some(unscale_sum_nonfinite(&v[ra..rb], a, u)),
                CpuStorage::F16(v) => Some(unscale_sum_nonfinite(&v[ra..rb], a, u)),
                CpuStorage::BF16(v) => Some(unscale_sum_nonfinite(&v[ra..rb], a, u)),
                _ => None,
            };
            if let Some(bad) = bad {
                return Ok(bad);
            }
        }
    }
    // Other types and devices: the same arithmetic with tensor ops, into a temporary.
    let (g, bad) = unscale_check(&raw, scale, true)?;
    Ok(bad || nonfinite(&(acc + g.reshape(acc.shape())?)?)?)
}

/// Whether the unscale pass with `accumulate` would find an inf or NaN (in a raw value or in
/// `acc[i] + unscale(raw[i])`), without writing: the same arithmetic in the same order (the
/// product, then the sum), so the verdict is the one the write will give. For a backward
/// that must know its verdict before it may write.
fn unscale_sum_nonfinite<S: Elem>(raw: &[S], acc: &[f32], u: Unscale) -> bool {
    assert_eq!(raw.len(), acc.len(), "unscale_sum_nonfinite: lengths differ");
    let serial = |r: &[S], a: &[f32]| {
        r.iter().zip(a).fold(false, |bad, (r, a)| {
            let g = r.to_f32();
            let v = *a + u.apply(g);
            bad | !g.is_finite() | !v.is_finite()
        })
    };
    if super::slices::parallel(raw.len()) {
        raw.par_chunks(super::slices::PAR_CHUNK)
            .zip(acc.par_chunks(super::slices::PAR_CHUNK))
            .map(|(r, a)| serial(r, a))
            .reduce(|| false, |a, b| a | b)
    } else {
        serial(raw, acc)
    }
}

/// `prev + g` for two f32 gradients of one shape, into a new detached tensor, and whether a
/// sum is inf or NaN (with `check`): gradient accumulation where the sum cannot be made in
/// place by [`unscale_check_into`] (off the CPU, or with the kernels off), and where two
/// finite gradients can still add up to an overflow that neither raw gradient showed.
pub(crate) fn add_check(prev: &Tensor, g: &Tensor, check: bool) -> Result<(Tensor, bool)> {
    let sum = (prev + g)?.detach();
    let bad = check && nonfinite(&sum)?;
    Ok((sum, bad))
}

/// Whether any element is inf or NaN: `t * 0` is NaN exactly there and 0 elsewhere, so its
/// sum (in f32) cannot overflow the way a plain sum of large values can.
pub(crate) fn nonfinite(t: &Tensor) -> Result<bool> {
    let t = t.to_dtype(DType::F32)?;
    Ok(t.affine(0.0, 0.0)?.sum_all()?.to_scalar::<f32>()?.is_nan())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The read-only check agrees with the write's verdict, in one chunk and split over
    /// the pool, for each raw type, where only one sum (the last) overflows.
    #[test]
    fn the_read_only_sum_check_gives_the_writes_verdict() {
        for n in [1000usize, 300_000] {
            for dt in [DType::F32, DType::F16, DType::BF16] {
                for last in [1.0f32, 19260.0] {
                    let mut r = vec![0.5f32; n];
                    r[n - 1] = last;
                    let raw = Tensor::from_vec(r, n, &Device::Cpu).unwrap().to_dtype(dt).unwrap();
                    let mut a = vec![1.0f32; n];
                    a[n - 1] = 3e38;
                    let acc = Tensor::from_vec(a, n, &Device::Cpu).unwrap();
                    // 19260 * 2^112 is about 1e38: finite alone, not added to 3e38.
                    let scale = 2f32.powi(-112);
                    let predicted = sum_nonfinite(&raw, scale, &acc).unwrap();
                    assert_eq!(predicted, last > 1.0, "n={n} {dt:?} last={last}");
                    assert_eq!(
                        unscale_check_into(&raw, scale, &acc, true).unwrap(),
                        predicted,
                        "n={n} {dt:?}"
                    );
                }
            }
        }
    }
}
