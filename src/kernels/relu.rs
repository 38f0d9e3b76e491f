//! ReLU as one op with a one-pass backward. candle's `relu` backward is three ops over the
//! tensor (compare, cast of the mask, multiply), and its half-precision compare is scalar.
//! Here the forward keeps `max(x, 0)` (NaN stays NaN) and the backward passes the gradient
//! where the output is positive, on the bit patterns of the tensor's own type.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use super::dispatch::{Kernel, split_map, split_zip};

const CHUNK: usize = 1 << 16;

/// Values as their bits, with the sign bit and the "positive non-zero" test for each type.
trait Bits: Copy + Send + Sync {
    /// Whether the value is > 0 (false for NaN, zeros and negatives).
    fn positive(self) -> bool;
    /// `max(self, 0)`, NaN kept.
    fn relu(self) -> Self;
    /// `g` where `self` (the output) is positive, else 0.
    fn keep(self, g: Self) -> Self;
    const ZERO: Self;
}

impl Bits for f32 {
    #[inline(always)]
    fn positive(self) -> bool {
        self > 0.0
    }
    #[inline(always)]
    fn relu(self) -> Self {
        if self < 0.0 { 0.0 } else { self }
    }
    #[inline(always)]
    fn keep(self, g: Self) -> Self {
        if self.positive() { g } else { 0.0 }
    }
    const ZERO: Self = 0.0;
}

/// Half types on their bits (no conversion): `inf` is the largest magnitude that is not NaN.
/// Written without branches on signed 16-bit compares, which AVX2 has (it has no unsigned
/// ones): with a branch or an unsigned compare the AVX2 loop stays scalar.
macro_rules! half_bits {
    ($t:ty, $inf:expr) => {
        impl Bits for $t {
            #[inline(always)]
            fn positive(self) -> bool {
                // Sign clear, not zero, not NaN: 0 < bits <= inf as a signed value.
                let s = self.to_bits() as i16;
                (s > 0) & (s <= $inf)
            }
            #[inline(always)]
            fn relu(self) -> Self {
                let b = self.to_bits();
                // Negative (or -0) and not NaN: the sign is set and the magnitude <= inf.
                let zero = ((b as i16) < 0) & (((b & 0x7FFF) as i16) <= $inf);
                Self::from_bits(b & (zero as u16).wrapping_sub(1))
            }
            #[inline(always)]
            fn keep(self, g: Self) -> Self {
                Self::from_bits(g.to_bits() & (self.positive() as u16).wrapping_neg())
            }
            const ZERO: Self = <$t>::ZERO;
        }
    };
}

half_bits!(f16, 0x7C00);
half_bits!(bf16, 0x7F80);

/// `dst = relu(src)` on the calling thread, compiled per tier (bit operations: the tiers
/// agree bit for bit).
struct Forward<'a, T> {
    src: &'a [T],
    dst: &'a mut [T],
}

impl<T: Bits> Kernel for Forward<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for (d, s) in self.dst.iter_mut().zip(self.src) {
            *d = s.relu();
        }
    }
}

/// `dst = g` where `y > 0`, else 0, on the calling thread, compiled per tier.
struct Backward<'a, T> {
    y: &'a [T],
    g: &'a [T],
    dst: &'a mut [T],
}

impl<T: Bits> Kernel for Backward<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for ((d, y), g) in self.dst.iter_mut().zip(self.y).zip(self.g) {
            *d = y.keep(*g);
        }
    }
}

fn forward<T: Bits>(src: &[T]) -> Vec<T> {
    let mut out = vec![T::ZERO; src.len()];
    split_map(src, &mut out, CHUNK, |src, dst| Forward { src, dst });
    out
}

fn contiguous(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("amp-relu: tensors must be contiguous".into()))
}

pub(super) struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "amp-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = contiguous(l)?;
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(forward(&v[a..b])),
            CpuStorage::F16(v) => CpuStorage::F16(forward(&v[a..b])),
            CpuStorage::BF16(v) => CpuStorage::BF16(forward(&v[a..b])),
            other => candle_core::bail!("amp-relu: {:?}", other.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = super::dense(grad)?;
        let dx = res.apply_op2_no_bwd(&grad, &ReluGrad)?;
        Ok(Some(super::graph_grad::for_candle(dx)?))
    }
}

/// `grad` where `y > 0`, else 0.
pub(super) struct ReluGrad;

/// Panics if the lengths differ (checked by the op before).
fn masked<T: Bits>(y: &[T], g: &[T]) -> Vec<T> {
    assert_eq!(y.len(), g.len(), "relu grad: lengths differ");
    let mut out = vec![T::ZERO; y.len()];
    split_zip(y, g, &mut out, CHUNK, |y, g, dst| Backward { y, g, dst });
    out
}

impl CustomOp2 for ReluGrad {
    fn name(&self) -> &'static str {
        "amp-relu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let ((a, b), (c, d)) = (contiguous(l1)?, contiguous(l2)?);
        // An error, not the kernel's panic: the op may be applied to any pair of tensors.
        if b - a != d - c {
            candle_core::bail!("amp-relu-grad: lengths differ ({} outputs, {} gradients)", b - a, d - c)
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => CpuStorage::F32(masked(&y[a..b], &g[c..d])),
            (CpuStorage::F16(y), CpuStorage::F16(g)) => CpuStorage::F16(masked(&y[a..b], &g[c..d])),
            (CpuStorage::BF16(y), CpuStorage::BF16(g)) => CpuStorage::BF16(masked(&y[a..b], &g[c..d])),
            _ => candle_core::bail!("amp-relu-grad: {:?} and {:?}", s1.dtype(), s2.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// `max(x, 0)`, differentiable, as one op with a one-pass backward (f32, f16 and bf16 on the
/// CPU; candle's `relu` elsewhere). Its gradient is the incoming gradient where the output
/// is positive and 0 elsewhere, as PyTorch's (`threshold_backward`): at `x == 0` the
/// gradient is 0. candle's own `relu` passes the gradient at `x >= 0`, so the two differ
/// exactly at zeros (and off the CPU, where this falls back to candle's).
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{Device, Var};
/// # fn main() -> candle_core::Result<()> {
/// let x = Var::new(&[-1f32, 0., 2.], &Device::Cpu)?;
/// let y = kernels::relu(&x)?;
/// assert_eq!(y.to_vec1::<f32>()?, [0.0, 0.0, 2.0]);
/// let g = (y * 3.0)?.sum_all()?.backward()?;
/// assert_eq!(g.get(&x).unwrap().to_vec1::<f32>()?, [0.0, 0.0, 3.0]);
/// # Ok(()) }
/// ```
pub fn relu(x: &Tensor) -> Result<Tensor> {
    if !(super::enabled() && x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)) {
        // Off the fast path, the same contract: candle's own `relu` passes the gradient
        // through at 0 (its backward tests `x >= 0`); PyTorch's, and the fused op's, is 0
        // there. Untracked tensors need no backward: candle's forward is the same.
        if !x.track_op() {
            return x.relu();
        }
        // `x <= 0` picks 0, so NaN stays NaN, as in PyTorch.
        return x.le(0f64)?.where_cond(&x.zeros_like()?, x);
    }
    let x = super::dense(x)?;
    if x.track_op() {
        x.apply_op1(Relu)
    } else {
        x.apply_op1_no_bwd(&Relu)
    }
}
