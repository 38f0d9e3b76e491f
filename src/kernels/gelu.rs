//! GELU, in the erf form and in the tanh form (PyTorch's `approximate="tanh"`, candle's
//! `gelu`), as one op with a one-pass backward, computed in f32 whatever the storage type.
//! candle's `gelu_erf` backward is about six ops over the tensor (and scalar for half types).
//!
//! The tanh form: `gelu(x) = x/2 * (1 + tanh(u))` with `u = √(2/π) (x + 0.044715 x³)`, and
//! `gelu'(x) = (1 + tanh(u))/2 + x/2 * (1 - tanh²(u)) * √(2/π) (1 + 3 * 0.044715 x²)`;
//! `tanh(u) = 1 - 2 / (exp(2u) + 1)` with the same branch-free `exp` (exact at both
//! saturations, absolute error about 2e-7 near 0, where `1 + tanh(u)` hides it).
//!
//! `gelu(x) = x * Φ(x)` and `gelu'(x) = Φ(x) + x * φ(x)`, with `Φ(x) = (1 + erf(x/√2)) / 2`
//! and `φ(x) = exp(-x²/2) / √(2π)`. `erf` comes from the complementary error function's
//! Chebyshev-fitted form (Numerical Recipes' `erfcc`, fractional error below 1.2e-7) with a
//! branch-free `exp`, all in f32, so the loops vectorise, compiled per instruction set (see
//! `dispatch`; the tiers agree bit for bit). Absolute error about 3e-7 against the exact
//! GELU, checked in the tests. f16 and bf16 inputs look both up in tables of these same
//! results (`gelu_table`).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::dispatch::{Kernel, dispatch, split_map, split_zip};
use super::gelu_table::{self, Tabled, Tables};
use super::simd::Elem;
use super::slices::{Vx, convert_serial as convert};

const CHUNK: usize = 1 << 14;

/// `exp(x)` in f32 without a branch, so loops over it vectorise: `2^n * p(r)` with
/// `x = n ln2 + r`, `|r| <= ln2/2`, and `p` the degree-6 Taylor polynomial (relative error
/// about 1e-7 over f32's range; 0 below -87, +inf above 88.7). Also SiLU's (`kernels::gated`).
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.7);
    // Round x/ln2 to an integer with the 1.5 * 2^23 trick (no branch, no libm call).
    let shift = 12_582_912.0f32;
    let n = (x * std::f32::consts::LOG2_E + shift) - shift;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `erf(x)` from `erfc`'s Chebyshev-fitted form (Numerical Recipes' `erfcc`, fractional
/// error below 1.2e-7), in f32.
#[inline(always)]
fn erf(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204 + t * (1.488_515_9 + t * (-0.822_152_2 + t * 0.170_872_77))))))));
    let r = t * exp_f32(poly);
    (1.0 - r).copysign(x)
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;

#[inline(always)]
fn cdf(x: f32) -> f32 {
    0.5 * (1.0 + erf(x * FRAC_1_SQRT_2))
}

/// `√(2/π)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term's coefficient of the tanh form.
const TANH_CUBIC: f32 = 0.044_715;

/// `tanh(u)` without a branch: `1 - 2 / (exp(2u) + 1)` (`exp_f32` clamps, so both tails
/// saturate to exactly +-1).
#[inline(always)]
fn tanh_f32(u: f32) -> f32 {
    1.0 - 2.0 / (exp_f32(2.0 * u) + 1.0)
}

/// GELU in the erf form (`TANH` false) or the tanh form.
#[inline(always)]
fn gelu_f32<const TANH: bool>(x: f32) -> f32 {
    if TANH {
        let u = SQRT_2_OVER_PI * (x + TANH_CUBIC * x * x * x);
        0.5 * x * (1.0 + tanh_f32(u))
    } else {
        x * cdf(x)
    }
}

/// GELU's derivative in the form `TANH` says.
#[inline(always)]
fn gelu_grad<const TANH: bool>(x: f32) -> f32 {
    if TANH {
        let x2 = x * x;
        let t = tanh_f32(SQRT_2_OVER_PI * (x + TANH_CUBIC * x2 * x));
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * x2)
    } else {
        cdf(x) + x * INV_SQRT_2PI * exp_f32(-0.5 * x * x)
    }
}

/// Elements per block: widened to f32 on the stack, computed, narrowed back.
const BLOCK: usize = 512;

/// `dst = gelu(src)` in f32 blocks on the calling thread: the vectorised slice conversions
/// around the arithmetic (a per-value `half` conversion is an out-of-line call in a baseline
/// build), the arithmetic compiled per tier.
struct Forward<'a, T, const TANH: bool> {
    src: &'a [T],
    dst: &'a mut [T],
}

impl<T: Elem + Vx, const TANH: bool> Kernel for Forward<'_, T, TANH> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let mut buf = [0f32; BLOCK];
        for (sc, dc) in self.src.chunks(BLOCK).zip(self.dst.chunks_mut(BLOCK)) {
            let b = &mut buf[..sc.len()];
            convert(sc, b);
            for v in b.iter_mut() {
                *v = gelu_f32::<TANH>(*v);
            }
            convert(b, dc);
        }
    }
}

/// `gelu` over `src` into a new vector, computed.
fn computed_map<T: Elem + Vx, const TANH: bool>(src: &[T]) -> Vec<T> {
    let mut out = vec![T::from_f32(0.0); src.len()];
    split_map(src, &mut out, CHUNK, |src, dst| Forward::<T, TANH> { src, dst });
    out
}

fn contiguous(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("amp-gelu: tensors must be contiguous".into()))
}

/// `T`'s tables, filled on first use from the computed kernels: `gelu` through the forward
/// loop itself, `gelu'` as the backward's factor.
fn tables<T: Tabled, const TANH: bool>() -> &'static Tables<T> {
    gelu_table::tables(TANH, || {
        let all = gelu_table::patterns::<T>();
        let mut grad = vec![0f32; all.len()];
        convert(&all, &mut grad);
        grad_factors::<TANH>(&mut grad);
        // On this thread alone: a rayon join here could run, while it waits, another task
        // that asks for these tables, re-entering their initialisation.
        let mut gelu = vec![T::from_f32(0.0); all.len()];
        dispatch(Forward::<T, TANH> {
            src: &all,
            dst: &mut gelu,
        });
        Tables::new(gelu, grad)
    })
}

/// GELU in the erf form.
pub(super) struct Gelu;

/// GELU in the tanh form.
pub(super) struct GeluTanh;

/// The forward of either form.
fn forward<const TANH: bool>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let (a, b) = contiguous(l)?;
    let out = match s {
        CpuStorage::F32(v) => CpuStorage::F32(computed_map::<f32, TANH>(&v[a..b])),
        CpuStorage::F16(v) => CpuStorage::F16(gelu_table::map(&v[a..b], tables::<_, TANH>())),
        CpuStorage::BF16(v) => CpuStorage::BF16(gelu_table::map(&v[a..b], tables::<_, TANH>())),
        other => candle_core::bail!("amp-gelu: {:?}", other.dtype()),
    };
    Ok((out, l.shape().clone()))
}

/// The backward of either form through its gradient op `op`.
fn backward(op: &impl CustomOp2, arg: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
    let grad = super::dense(grad)?;
    let dx = super::dense(arg)?.apply_op2_no_bwd(&grad, op)?;
    Ok(Some(super::graph_grad::for_candle(dx)?))
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "amp-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        forward::<false>(s, l)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        backward(&GeluGrad, arg, grad)
    }
}

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "amp-gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        forward::<true>(s, l)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        backward(&GeluTanhGrad, arg, grad)
    }
}

/// `grad * gelu'(x)` (erf form), in f32 arithmetic.
pub(super) struct GeluGrad;

/// `grad * gelu'(x)` (tanh form), in f32 arithmetic.
pub(super) struct GeluTanhGrad;

/// `d = g * gelu'(x)` in f32 blocks on the calling thread (as [`Forward`]).
struct Backward<'a, T, const TANH: bool> {
    x: &'a [T],
    g: &'a [T],
    d: &'a mut [T],
}

impl<T: Elem + Vx, const TANH: bool> Kernel for Backward<'_, T, TANH> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (mut bx, mut bg) = ([0f32; BLOCK], [0f32; BLOCK]);
        let blocks = self.x.chunks(BLOCK).zip(self.g.chunks(BLOCK));
        for ((xc, gc), dc) in blocks.zip(self.d.chunks_mut(BLOCK)) {
            let (xs, gs) = (&mut bx[..xc.len()], &mut bg[..xc.len()]);
            convert(xc, xs);
            convert(gc, gs);
            for (gv, xv) in gs.iter_mut().zip(xs.iter()) {
                *gv *= gelu_grad::<TANH>(*xv);
            }
            convert(gs, dc);
        }
    }
}

/// `g * gelu'(x)`, computed. Panics if the lengths differ (checked by the op before).
fn computed_grad_of<T: Elem + Vx, const TANH: bool>(x: &[T], g: &[T]) -> Vec<T> {
    assert_eq!(x.len(), g.len(), "gelu grad: lengths differ");
    let mut out = vec![T::from_f32(0.0); x.len()];
    split_zip(x, g, &mut out, CHUNK, |x, g, d| Backward::<T, TANH> { x, g, d });
    out
}

/// Each value `x` replaced by `gelu'(x)`: the backward's factor (for the tables).
struct Factors<'a, const TANH: bool>(&'a mut [f32]);

impl<const TANH: bool> Kernel for Factors<'_, TANH> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for v in self.0.iter_mut() {
            *v = gelu_grad::<TANH>(*v);
        }
    }
}

/// `gelu'` of every value in place, as the computed backward's factor.
fn grad_factors<const TANH: bool>(x: &mut [f32]) {
    dispatch(Factors::<TANH>(x))
}

/// The gradient op of either form.
fn grad_forward<const TANH: bool>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let ((a, b), (c, d)) = (contiguous(l1)?, contiguous(l2)?);
    // The blocked loops pair x and the gradient chunk by chunk: equal lengths are what
    // keeps every conversion inside its buffer.
    if b - a != d - c {
        candle_core::bail!("amp-gelu-grad: lengths differ ({} inputs, {} gradients)", b - a, d - c)
    }
    let out = match (s1, s2) {
        (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(computed_grad_of::<f32, TANH>(&x[a..b], &g[c..d])),
        (CpuStorage::F16(x), CpuStorage::F16(g)) => {
            CpuStorage::F16(gelu_table::grad_of(&x[a..b], &g[c..d], tables::<_, TANH>()))
        }
        (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
            CpuStorage::BF16(gelu_table::grad_of(&x[a..b], &g[c..d], tables::<_, TANH>()))
        }
        _ => candle_core::bail!("amp-gelu-grad: {:?} and {:?}", s1.dtype(), s2.dtype()),
    };
    Ok((out, l1.shape().clone()))
}

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "amp-gelu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        grad_forward::<false>(s1, l1, s2, l2)
    }
}

impl CustomOp2 for GeluTanhGrad {
    fn name(&self) -> &'static str {
        "amp-gelu-tanh-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        grad_forward::<true>(s1, l1, s2, l2)
    }
}

/// GELU in the erf form (`x * Φ(x)`, what PyTorch's `gelu` and candle's `gelu_erf` compute),
/// differentiable, as one op with a one-pass backward, in f32 arithmetic for every storage
/// type (f32, f16, bf16 on the CPU; on CUDA one kernel each way, in f32 arithmetic; candle's
/// `gelu_erf` elsewhere, and where the CUDA kernels do not load).
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[-1f32, 0., 1.], &Device::Cpu)?;
/// let y = kernels::gelu(&x)?.to_vec1::<f32>()?;
/// assert!((y[0] + 0.158_655_25).abs() < 1e-6 && y[1] == 0.0 && (y[2] - 0.841_344_7).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    // On CUDA one kernel each way (`cuda::gated`), where candle's `gelu_erf` backward is
    // composed ops.
    if super::enabled()
        && x.device().is_cuda()
        && let Some(y) = super::cuda::gated::activation(x, super::cuda::gated::PointAct::Gelu)?
    {
        return Ok(y);
    }
    if !(super::enabled() && x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)) {
        return x.gelu_erf();
    }
    let x = super::dense(x)?;
    if x.track_op() {
        x.apply_op1(Gelu)
    } else {
        x.apply_op1_no_bwd(&Gelu)
    }
}

/// GELU in the tanh form (`x/2 * (1 + tanh(√(2/π) (x + 0.044715 x³)))`, what PyTorch's
/// `gelu(x, approximate="tanh")` and candle's `gelu` compute), differentiable, as one op with
/// a one-pass backward, in f32 arithmetic for every storage type (f32, f16, bf16 on the CPU,
/// half types by table as [`gelu`]; on CUDA one kernel each way, in f32 arithmetic; candle's
/// `gelu` elsewhere, and where the CUDA kernels do not load).
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[-1f32, 0., 1.], &Device::Cpu)?;
/// let y = kernels::gelu_tanh(&x)?.to_vec1::<f32>()?;
/// assert!((y[0] + 0.158_808).abs() < 1e-6 && y[1] == 0.0 && (y[2] - 0.841_192).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    // On CUDA one kernel each way (`cuda::gated`), where candle's backward is composed ops.
    if super::enabled()
        && x.device().is_cuda()
        && let Some(y) = super::cuda::gated::activation(x, super::cuda::gated::PointAct::GeluTanh)?
    {
        return Ok(y);
    }
    if !(super::enabled() && x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)) {
        return x.gelu();
    }
    let x = super::dense(x)?;
    if x.track_op() {
        x.apply_op1(GeluTanh)
    } else {
        x.apply_op1_no_bwd(&GeluTanh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every bit pattern, the forward and the backward (with gradients of several
    /// magnitudes and signs, an infinity and a NaN among them): the lookups return the
    /// computed results bit for bit.
    fn every_pattern<T: Tabled, const TANH: bool>() {
        let all = gelu_table::patterns::<T>();
        let want = computed_map::<T, TANH>(&all);
        let got = gelu_table::map(&all, tables::<T, TANH>());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.bits(), b.bits(), "gelu of pattern {i:#06x}");
        }
        for gv in [1.0f32, -3.5, 1e-3, 6e4, f32::INFINITY, f32::NAN] {
            let g = vec![T::from_f32(gv); all.len()];
            let want = computed_grad_of::<T, TANH>(&all, &g);
            let got = gelu_table::grad_of(&all, &g, tables::<T, TANH>());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.bits(), b.bits(), "gelu' of pattern {i:#06x} times {gv}");
            }
        }
    }

    #[test]
    fn f16_lookups_equal_the_computed_values() {
        every_pattern::<half::f16, false>();
        every_pattern::<half::f16, true>();
    }

    #[test]
    fn bf16_lookups_equal_the_computed_values() {
        every_pattern::<half::bf16, false>();
        every_pattern::<half::bf16, true>();
    }

    #[test]
    fn the_gradient_op_rejects_operands_of_different_lengths() {
        let x = Tensor::ones(10, DType::F32, &Device::Cpu).unwrap();
        let g = Tensor::ones(20, DType::F32, &Device::Cpu).unwrap();
        for (a, b) in [(&x, &g), (&g, &x)] {
            let e = a.apply_op2_no_bwd(b, &GeluGrad).unwrap_err();
            assert!(e.to_string().contains("lengths"), "{e}");
            let e = a.apply_op2_no_bwd(b, &GeluTanhGrad).unwrap_err();
            assert!(e.to_string().contains("lengths"), "{e}");
        }
        let ok = x.apply_op2_no_bwd(&x, &GeluGrad).unwrap();
        assert_eq!(ok.dims(), &[10]);
    }
}
