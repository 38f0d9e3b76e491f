//! The layout of a half-precision gradient that a custom op hands back to candle.
//!
//! candle 0.11's backward adds every gradient a node returns into a fresh `zeros_like` of
//! the argument (`sum_grad = sum_grad.add(&arg_grad)`). For a bf16 or f16 argument that add
//! runs candle's own element-wise code, whose contiguous path is its slowest: on CPUs with
//! AVX-512 BF16 its bf16 vector path checks CPU features per 8 values and calls the
//! conversions out of line (`cpu::avx::vec_add_bf16`), about 17 ns a value on an Intel Xeon
//! with AMX in a build without CPU flags, nine times its f32 add; its f16 path converts
//! value by value through `half`'s run-time dispatch. A dependent crate cannot patch it.
//!
//! candle takes that vector path only when both operands have an innermost stride of 1.
//! Any other layout goes through its scalar closure (`half`'s inline software conversions
//! for bf16), which is several times faster there: measured on the same Xeon, one thread,
//! 512x1024 values, zeros + add took 9.0 ms contiguous and 1.4 ms with a strided gradient
//! in bf16 (2.4 and 1.7 ms in f16; f32's contiguous add 0.9 ms). So a half gradient
//! leaves our ops as a strided view: every other value of a buffer twice its size, written
//! in one pass (a value and a zero per pair). The values are the same; only the layout
//! candle sees differs, and the sum candle stores is contiguous again.

use candle_core::{CpuStorage, DType, Result, Storage, Tensor};
use half::{bf16, f16};

/// Below this many values candle's add is cheap whatever its path.
const MIN_VALUES: usize = 1024;

/// `grad` as a view candle's gradient accumulation adds quickly: for a bf16 or f16 CPU
/// tensor of at least [`MIN_VALUES`] values whose last dimension has at least 2, the same
/// values in a layout with an innermost stride of 2; anything else unchanged.
pub(crate) fn for_candle(grad: Tensor) -> Result<Tensor> {
    let n = grad.elem_count();
    let last = grad.dims().last().copied().unwrap_or(1);
    if !matches!(grad.dtype(), DType::BF16 | DType::F16) || !grad.device().is_cpu() || n < MIN_VALUES || last < 2 {
        return Ok(grad);
    }
    let grad = super::dense(&grad)?;
    let (st, l) = grad.storage_and_layout();
    let Storage::Cpu(cpu) = &*st else {
        return Ok(grad.clone());
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        return Ok(grad.clone());
    };
    let mut dims = grad.dims().to_vec();
    dims.push(2);
    let wide = match cpu {
        CpuStorage::BF16(v) => Tensor::from_vec(spread(&v[a..b], bf16::ZERO), dims, grad.device())?,
        CpuStorage::F16(v) => Tensor::from_vec(spread(&v[a..b], f16::ZERO), dims, grad.device())?,
        _ => return Ok(grad.clone()),
    };
    drop(st);
    let r = wide.rank();
    wide.narrow(r - 1, 0, 1)?.squeeze(r - 1)
}

/// `[v0, 0, v1, 0, ...]`, written as one zero-extended 32-bit word per value where the
/// buffer is 4-byte aligned (it is, from the allocator), so the pass runs at memory speed
/// and the buffer is written once (no zeroing first).
fn spread<T: Copy + Bits16>(src: &[T], zero: T) -> Vec<T> {
    let n = 2 * src.len();
    let mut out: Vec<T> = Vec::with_capacity(n);
    let ptr = out.as_mut_ptr();
    if (ptr as usize).is_multiple_of(std::mem::align_of::<u32>()) {
        let words = ptr.cast::<u32>();
        for (i, v) in src.iter().enumerate() {
            let b = u32::from(v.bits16());
            // The first value of a pair is the low half on a little-endian machine.
            let w = if cfg!(target_endian = "big") { b << 16 } else { b };
            // SAFETY: `i < src.len()`, so word `i` lies in the capacity of `n` 16-bit values;
            // the pointer is 4-byte aligned (checked), and `T` is a plain 16-bit value.
            unsafe { words.add(i).write(w) };
        }
    } else {
        for (i, v) in src.iter().enumerate() {
            // SAFETY: `2 * i + 1 < n`, within the capacity.
            unsafe {
                ptr.add(2 * i).write(*v);
                ptr.add(2 * i + 1).write(zero);
            }
        }
    }
    // SAFETY: all `n` values were written above.
    unsafe { out.set_len(n) };
    out
}

/// A 16-bit float's bits.
trait Bits16 {
    fn bits16(self) -> u16;
}

impl Bits16 for bf16 {
    fn bits16(self) -> u16 {
        self.to_bits()
    }
}

impl Bits16 for f16 {
    fn bits16(self) -> u16 {
        self.to_bits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn flat(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    #[test]
    fn the_view_has_the_values_and_a_strided_layout() {
        for dt in [DType::BF16, DType::F16, DType::F32] {
            let t = Tensor::arange(0f32, 2048.0, &Device::Cpu)
                .unwrap()
                .reshape((2, 32, 32))
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let v = for_candle(t.clone()).unwrap();
            assert_eq!(v.dims(), t.dims());
            let want = flat(&t);
            assert_eq!(want, flat(&v));
            // Half: innermost stride 2; f32 is left as it is.
            let inner = *v.stride().last().unwrap();
            assert_eq!(inner, if dt == DType::F32 { 1 } else { 2 }, "{dt:?}");
            // What candle's accumulation does with it.
            assert_eq!(want, flat(&t.zeros_like().unwrap().add(&v).unwrap()));
        }
    }
}
