//! Casts between f32, f16 and bf16 at memory speed: as a differentiable op (its backward casts
//! the gradient back), and into a preallocated tensor in place.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp2, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

use super::slices::convert;

fn fast(dt: DType) -> bool {
    matches!(dt, DType::F32 | DType::F16 | DType::BF16)
}

/// Converts a contiguous run of a CPU storage into a new storage of `to`.
fn convert_storage(s: &CpuStorage, a: usize, b: usize, to: DType) -> Result<CpuStorage> {
    macro_rules! from {
        ($src:expr) => {{
            let src = &$src[a..b];
            Ok(match to {
                DType::F32 => {
                    let mut d = vec![0f32; src.len()];
                    convert(src, &mut d);
                    CpuStorage::F32(d)
                }
                DType::F16 => {
                    let mut d = vec![f16::ZERO; src.len()];
                    convert(src, &mut d);
                    CpuStorage::F16(d)
                }
                DType::BF16 => {
                    let mut d = vec![bf16::ZERO; src.len()];
                    convert(src, &mut d);
                    CpuStorage::BF16(d)
                }
                other => candle_core::bail!("cast: unsupported target {other:?}"),
            })
        }};
    }
    match s {
        CpuStorage::F32(v) => from!(v),
        CpuStorage::F16(v) => from!(v),
        CpuStorage::BF16(v) => from!(v),
        other => candle_core::bail!("cast: unsupported source {:?}", other.dtype()),
    }
}

struct Cast(DType);

impl CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "amp-cast"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("amp-cast: input must be contiguous".into()))?;
        Ok((convert_storage(s, a, b, self.0)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // A gradient kept before rounding for the cast's output is its input's (the doctor).
        super::capture::hand_on(res, arg)?;
        Ok(Some(super::graph_grad::for_candle(cast(grad, arg.dtype())?)?))
    }
}

/// `t` in `dtype`, like `Tensor::to_dtype` (and differentiable the same way) but at memory
/// speed between f32, f16 and bf16 on the CPU (other types and devices use `to_dtype`).
/// Rounding is to nearest even, exactly as `to_dtype`.
pub fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    if !(super::enabled() && t.device().is_cpu() && fast(t.dtype()) && fast(dtype)) {
        return t.to_dtype(dtype);
    }
    let t = super::dense(t)?;
    if t.track_op() {
        t.apply_op1(Cast(dtype))
    } else {
        t.apply_op1_no_bwd(&Cast(dtype))
    }
}

struct CastInto;

impl InplaceOp2 for CastInto {
    fn name(&self) -> &'static str {
        "amp-cast-into"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> Result<()> {
        let msg = || candle_core::Error::Msg("amp-cast-into: tensors must be contiguous".into());
        let (sa, sb) = sl.contiguous_offsets().ok_or_else(msg)?;
        let (da, db) = dl.contiguous_offsets().ok_or_else(msg)?;
        if sb - sa != db - da {
            candle_core::bail!("amp-cast-into: {} values into {}", sb - sa, db - da)
        }
        macro_rules! into {
            ($d:expr) => {{
                let d = &mut $d[da..db];
                match src {
                    CpuStorage::F32(s) => convert(&s[sa..sb], d),
                    CpuStorage::F16(s) => convert(&s[sa..sb], d),
                    CpuStorage::BF16(s) => convert(&s[sa..sb], d),
                    other => candle_core::bail!("amp-cast-into: unsupported source {:?}", other.dtype()),
                }
            }};
        }
        match dst {
            CpuStorage::F32(d) => into!(d),
            CpuStorage::F16(d) => into!(d),
            CpuStorage::BF16(d) => into!(d),
            other => candle_core::bail!("amp-cast-into: unsupported target {:?}", other.dtype()),
        }
        Ok(())
    }
}

/// Writes `src` converted to `dst`'s type into `dst`'s own storage, without allocating (the
/// O2 working copy after a step). Both contiguous, of equal size; `dst` must not share
/// storage with `src`.
pub fn cast_into(src: &Tensor, dst: &Tensor) -> Result<()> {
    if src.elem_count() != dst.elem_count() {
        candle_core::bail!("cast_into: {:?} into {:?}", src.shape(), dst.shape())
    }
    if dst.device().is_cpu() && src.device().is_cpu() && fast(src.dtype()) && fast(dst.dtype()) {
        let src = super::dense(src)?;
        return dst.inplace_op2(&src, &CastInto);
    }
    // Other devices: through `dst`'s Var (a Var made from a tensor that is not one would be a
    // copy, and the write would be lost).
    if !dst.is_variable() {
        candle_core::bail!("cast_into: off the CPU the destination must be a Var")
    }
    let v = candle_core::Var::from_tensor(dst)?;
    v.set(&src.to_dtype(dst.dtype())?.reshape(dst.shape())?)
}

/// The contiguous f32 values of a CPU tensor, copied out (tests and fallbacks).
#[allow(dead_code)]
pub(crate) fn f32_values(t: &Tensor) -> Result<Vec<f32>> {
    let (s, l) = t.storage_and_layout();
    match (&*s, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(v[a..b].to_vec()),
        _ => t.flatten_all()?.to_dtype(DType::F32)?.to_vec1(),
    }
}
