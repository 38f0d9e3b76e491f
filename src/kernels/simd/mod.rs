//! Loads and stores of f32, f16 and bf16 as f32 vectors, per instruction set, plus the
//! portable scalar forms. Every other kernel is written once over these.
//!
//! bf16 rounding is done with integer arithmetic exactly as `half` does it (round to nearest
//! even, NaN kept quiet, subnormals kept), so the vector paths and the portable one agree bit
//! for bit; f16 uses the F16C/AVX-512 conversions, which are IEEE round to nearest even, as
//! `half` is.

use half::{bf16, f16};

/// An element type the kernels read and write.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// The value as f32 (exact for all three types).
    fn to_f32(self) -> f32;
    /// The nearest value (round to nearest even).
    fn from_f32(v: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

/// On x86-64 the bit-pattern conversions below (a baseline x86-64 build has no F16C, so
/// `half` calls a run-time-dispatched function per value); elsewhere `half`'s, which use the
/// CPU's own conversion instructions where the target has them (AArch64 does).
impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        #[cfg(target_arch = "x86_64")]
        return f32::from_bits(f16_to_f32_bits(self.to_bits()));
        #[cfg(not(target_arch = "x86_64"))]
        return f16::to_f32(self);
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        #[cfg(target_arch = "x86_64")]
        return f16::from_bits(f16_bits(v.to_bits()));
        #[cfg(not(target_arch = "x86_64"))]
        return f16::from_f32(v);
    }
}

/// f16 -> f32 on the bit pattern, exactly as F16C's `vcvtph2ps` (and `half`): exponent and
/// mantissa shifted into place and rebiased; infinity and NaN given the all-ones exponent,
/// NaN made quiet; a subnormal (or zero) rebuilt as `2^-14 * (1 + m/1024) - 2^-14`, an f32
/// subtraction of normal numbers (exact), never arithmetic on an f32 subnormal, which costs a
/// microcode assist of about a hundred cycles on Intel cores. Branch-free, so the portable
/// tier's loops vectorise with SSE2; `half`'s own conversion is a run-time-dispatched call per
/// value in a build without F16C (Fabian Giesen's `half_to_float_fast4`).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn f16_to_f32_bits(h: u16) -> u32 {
    let h = h as u32;
    let mag = h & 0x7FFF;
    let exp = mag & 0x7C00;
    let normal = (mag << 13) + (112 << 23);
    let special = (normal + (112 << 23)) | (((mag > 0x7C00) as u32) << 22);
    let sub = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
    let o = if exp == 0x7C00 {
        special
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    o | (h & 0x8000) << 16
}

/// f32 -> f16 on the bit pattern, round to nearest even, exactly as F16C's `vcvtps2ph` (and
/// `half`): NaN quiet with its payload's top bits, overflow to infinity, subnormal results
/// rounded by an f32 addition that lines the mantissa up at the bottom (Fabian Giesen's
/// `float_to_half_fast3_rtne`). Every case is computed and one selected without branches,
/// so it vectorises.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn f16_bits(x: u32) -> u16 {
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7FFF_FFFF;
    let nan = 0x7E00 | ((a >> 13) & 0x3FF);
    // |x| < 2^-14: a subnormal (or zero) result; adding 0.5 rounds at f16's subnormal step.
    let sub = (f32::from_bits(a) + 0.5).to_bits().wrapping_sub(0x3F00_0000);
    // Normal: rebias the exponent (-112 << 23), round half to even on the 13 dropped bits.
    let norm = a.wrapping_add(0xC800_0FFF).wrapping_add((a >> 13) & 1) >> 13;
    let (a, sel) = (a as i32, |c: bool, t: u32, f: u32| if c { t } else { f });
    let o = sel(
        a > 0x7F80_0000,
        nan,
        sel(a >= 0x4780_0000, 0x7C00, sel(a < 0x3880_0000, sub, norm)),
    );
    (o | sign) as u16
}

/// Values per block of [`widen_f16`] and [`narrow_f16`]: one block's check and conversion
/// stay in L1, and an odd value sends only its own block down the general path.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const F16_BLOCK: usize = 128;

/// f16 -> f32 over slices, bit for bit as [`f16_to_f32_bits`], for the portable tier on
/// x86-64 (SSE2, no F16C). A block whose values are all normal or zero (activations,
/// weights and scaled gradients nearly always are) takes a short path: the bits shifted
/// into an f32's place make a normal f32 2^-112 times the value, and a multiplication by
/// 2^112 rebiases it exactly (zero stays zero; never arithmetic on an f32 subnormal, which
/// costs a microcode assist on Intel cores). A block with a subnormal, infinity or NaN takes
/// the general conversion. Both loops vectorise; the short one is about twice as fast. On
/// x86-64 the SSE2 forms below instead, which take subnormals in the vector path too: on a
/// CPU that multiplies subnormal inputs at full rate (and a thread without
/// denormals-are-zero), one multiplication by 2^112 for every finite value.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_f16: lengths differ");
    let rebias = f32::from_bits((127 + 112) << 23);
    #[cfg(target_arch = "x86_64")]
    let scaled = sse2::scaled_widening_applies();
    for (s, d) in src.chunks(F16_BLOCK).zip(dst.chunks_mut(F16_BLOCK)) {
        // SSE2 (part of x86-64) in one pass: the short path's results and the check together.
        #[cfg(target_arch = "x86_64")]
        if s.len().is_multiple_of(8) {
            let done = if scaled {
                sse2::widen_scaled(s, d)
            } else {
                sse2::widen_normal(s, d)
            };
            if !done {
                for (d, h) in d.iter_mut().zip(s) {
                    *d = f32::from_bits(f16_to_f32_bits(h.to_bits()));
                }
            }
            continue;
        }
        let odd = s.iter().fold(0u16, |acc, h| {
            let mag = h.to_bits() & 0x7FFF;
            let exp = mag & 0x7C00;
            acc | ((exp == 0x7C00) | ((exp == 0) & (mag != 0))) as u16
        });
        if odd != 0 {
            for (d, h) in d.iter_mut().zip(s) {
                *d = f32::from_bits(f16_to_f32_bits(h.to_bits()));
            }
        } else {
            for (d, h) in d.iter_mut().zip(s) {
                let h = h.to_bits() as u32;
                let v = f32::from_bits((h & 0x7FFF) << 13) * rebias;
                *d = f32::from_bits(v.to_bits() | (h & 0x8000) << 16);
            }
        }
    }
}

/// f32 -> f16 over slices, bit for bit as [`f16_bits`], for the portable tier on x86-64. A
/// block whose values are all zero or of a magnitude in `[2^-14, 2^16)` takes the
/// rebias-and-round step alone (which also rounds 65520 and above to infinity, as the
/// general conversion does); a block with anything else (a result below f16's normal range,
/// a magnitude of 2^16 or more, infinity, NaN) the general conversion.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "narrow_f16: lengths differ");
    for (s, d) in src.chunks(F16_BLOCK).zip(dst.chunks_mut(F16_BLOCK)) {
        #[cfg(target_arch = "x86_64")]
        if s.len().is_multiple_of(8) {
            if !sse2::narrow_normal(s, d) {
                for (d, x) in d.iter_mut().zip(s) {
                    *d = f16::from_bits(f16_bits(x.to_bits()));
                }
            }
            continue;
        }
        // Bitwise `|` and `&`, not a short-circuiting range check, so the fold vectorises.
        #[allow(clippy::manual_range_contains)]
        let odd = s.iter().fold(0u32, |acc, x| {
            let a = x.to_bits() & 0x7FFF_FFFF;
            acc | (((a < 0x3880_0000) | (a >= 0x4780_0000)) & (a != 0)) as u32
        });
        if odd != 0 {
            for (d, x) in d.iter_mut().zip(s) {
                *d = f16::from_bits(f16_bits(x.to_bits()));
            }
        } else {
            for (d, x) in d.iter_mut().zip(s) {
                let x = x.to_bits();
                let a = x & 0x7FFF_FFFF;
                // `f16_bits`' normal case; zero masked to zero.
                let n =
                    (a.wrapping_add(0xC800_0FFF).wrapping_add((a >> 13) & 1) >> 13) & ((a != 0) as u32).wrapping_neg();
                *d = f16::from_bits((n | ((x >> 16) & 0x8000)) as u16);
            }
        }
    }
}

/// [`widen_f16`] and [`narrow_f16`] in SSE2 intrinsics for every finite value, the check
/// for the rest in the same pass. Subnormal results are not rare in a training step (a block
/// of 128 attention probabilities or small gradients nearly always holds one: measured, a
/// third of the values widened and half of those narrowed in a mid-size f16 transformer
/// step), so they are computed here branch-free as in [`f16_to_f32_bits`] and [`f16_bits`];
/// only infinity, NaN and overflow send a block to the per-value conversion. LLVM's SSE2
/// code for the plain loops also ran the check as a second pass and narrowed 32-bit lanes
/// to 16 with seven shuffles per eight values.
#[cfg(target_arch = "x86_64")]
mod sse2;

/// bf16 -> f32 over slices in SSE2, for the portable tier on x86-64 (exact).
#[cfg(target_arch = "x86_64")]
pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    sse2::widen_bf16(src, dst)
}

/// f32 -> bf16 over slices in SSE2, bit for bit as [`bf16_bits`], for the portable tier on
/// x86-64.
#[cfg(target_arch = "x86_64")]
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    sse2::narrow_bf16(src, dst)
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_bits(bf16_bits(v.to_bits()))
    }
}

/// `s` as a slice of `U` when `T` is `U` (decided at compile time once monomorphised): a
/// generic kernel can then take a type's own path, or work on f32 data in place instead of
/// through a conversion buffer.
#[inline(always)]
pub(crate) fn retyped<T: 'static, U: 'static>(s: &[T]) -> Option<&[U]> {
    // SAFETY: `T` is `U`: the same slice, retyped to itself.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>()).then(|| unsafe { &*(s as *const [T] as *const [U]) })
}

/// [`retyped`] for a mutable slice.
#[inline(always)]
pub(crate) fn retyped_mut<T: 'static, U: 'static>(s: &mut [T]) -> Option<&mut [U]> {
    // SAFETY: `T` is `U`: the same slice, retyped to itself.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>()).then(|| unsafe { &mut *(s as *mut [T] as *mut [U]) })
}

/// `half`'s f32 -> bf16 rounding on the bit pattern.
#[inline(always)]
pub(crate) fn bf16_bits(x: u32) -> u16 {
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((x >> 16) | 0x0040) as u16;
    }
    ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) as u16
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! Vector forms. Every function needs the target features of its family: `avx512*` the
    //! AVX-512 family (F, BW, VL) plus F16C, `avx2*` AVX2, FMA and F16C.
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    /// 16 lanes as f32.
    ///
    /// # Safety (both methods)
    /// `p` is valid for 16 reads (or writes) of `Self`, unaligned allowed, and the CPU has
    /// AVX-512 F, BW and VL with F16C. Callers check the slice lengths before taking `p`.
    pub(crate) trait V16: Copy {
        /// Loads 16 values as f32.
        unsafe fn load16(p: *const Self) -> __m512;
        /// Stores 16 f32 values rounded to this type.
        unsafe fn store16(p: *mut Self, v: __m512);
    }

    /// 8 lanes as f32.
    ///
    /// # Safety (both methods)
    /// `p` is valid for 8 reads (or writes) of `Self`, unaligned allowed, and the CPU has
    /// AVX2, FMA and F16C. Callers check the slice lengths before taking `p`.
    pub(crate) trait V8: Copy {
        /// Loads 8 values as f32.
        unsafe fn load8(p: *const Self) -> __m256;
        /// Stores 8 f32 values rounded to this type.
        unsafe fn store8(p: *mut Self, v: __m256);
    }

    impl V16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store16(p: *mut Self, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
    }

    impl V16 for f16 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
        }
        #[inline(always)]
        unsafe fn store16(p: *mut Self, v: __m512) {
            unsafe {
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                _mm256_storeu_si256(p as *mut __m256i, h)
            }
        }
    }

    impl V16 for bf16 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            unsafe {
                let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
            }
        }
        #[inline(always)]
        unsafe fn store16(p: *mut Self, v: __m512) {
            unsafe {
                let x = _mm512_castps_si512(v);
                let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
                let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb));
                let nan = _mm512_cmpgt_epi32_mask(
                    _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF)),
                    _mm512_set1_epi32(0x7F80_0000),
                );
                let q = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
                let r = _mm512_mask_blend_epi32(nan, r, q);
                _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtepi32_epi16(r))
            }
        }
    }

    impl V8 for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store8(p: *mut Self, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
    }

    impl V8 for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
        #[inline(always)]
        unsafe fn store8(p: *mut Self, v: __m256) {
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(p as *mut __m128i, h)
            }
        }
    }

    impl V8 for bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            unsafe {
                let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
            }
        }
        #[inline(always)]
        unsafe fn store8(p: *mut Self, v: __m256) {
            unsafe {
                let x = _mm256_castps_si256(v);
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
                let r = _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb));
                let nan = _mm256_cmpgt_epi32(
                    _mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF)),
                    _mm256_set1_epi32(0x7F80_0000),
                );
                let q = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
                let r = _mm256_blendv_epi8(r, q, nan);
                // Narrow 8 x u32 (each < 2^16) to 8 x u16.
                let packed = _mm256_packus_epi32(r, r);
                let lo = _mm256_permute4x64_epi64::<0b1000>(packed);
                _mm_storeu_si128(p as *mut __m128i, _mm256_castsi256_si128(lo))
            }
        }
    }

    /// A mask of the lanes of `v` that are inf or NaN (the exponent is all ones).
    #[inline(always)]
    pub(crate) unsafe fn nonfinite16(v: __m512) -> __mmask16 {
        unsafe {
            let e = _mm512_set1_epi32(0x7F80_0000);
            _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), e), e)
        }
    }

    /// Non-zero where a lane of `v` is inf or NaN.
    #[inline(always)]
    pub(crate) unsafe fn nonfinite8(v: __m256) -> i32 {
        unsafe {
            let e = _mm256_set1_epi32(0x7F80_0000);
            _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), e), e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 value converts as `half` (F16C on this machine) converts it.
    #[test]
    fn f16_to_f32_matches_half_for_every_value() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32().to_bits();
            assert_eq!(f16_to_f32_bits(h), want, "{h:#06x}");
        }
    }

    /// f32 -> f16 matches `half` on a dense sweep of bit patterns (every 61st, both signs),
    /// on every rounding boundary between f16 values (the midpoints and their neighbours),
    /// and on the special values.
    #[test]
    fn f32_to_f16_matches_half_on_a_dense_sweep_and_every_midpoint() {
        let check = |x: u32| {
            let want = f16::from_f32(f32::from_bits(x)).to_bits();
            assert_eq!(f16_bits(x), want, "{x:#010x} ({})", f32::from_bits(x));
        };
        let mut x = 0u32;
        while let Some(n) = x.checked_add(61) {
            check(x);
            x = n;
        }
        for h in 0..0x7C00u32 {
            // The f32 midway between f16 h and h + 1, and one ulp either side.
            let lo = f32::from_bits(f16_to_f32_bits(h as u16)) as f64;
            let hi = f32::from_bits(f16_to_f32_bits(h as u16 + 1)) as f64;
            let mid = ((lo + hi) / 2.0) as f32;
            for v in [mid.to_bits() - 1, mid.to_bits(), mid.to_bits() + 1] {
                check(v);
                check(v | 0x8000_0000);
            }
        }
        for v in [
            0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            65504.0,
            65519.99,
            65520.0,
            f32::MAX,
            f32::MIN_POSITIVE,
        ] {
            check(v.to_bits());
        }
        for payload in [1u32, 0x1FFF, 0x2000, 0x3F_FFFF, 0x40_0001] {
            check(0x7F80_0000 | payload);
            check(0xFF80_0000 | payload);
        }
    }

    /// The SSE2 bf16 slice conversions equal `half`'s per value (a NaN's widening aside):
    /// every bf16 value widened, and f32 patterns narrowed across every rounding boundary kind (a dense sweep, the
    /// midpoints between bf16 values and their neighbours, infinities, NaNs with payloads
    /// only in the dropped bits), at every length mod 8 (the tail).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sse2_bf16_conversions_match_half() {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        for len in [all.len(), all.len() - 3, 7, 1, 0] {
            let mut got = vec![0f32; len];
            widen_bf16(&all[..len], &mut got);
            for (h, g) in all.iter().zip(&got) {
                // The widening every tier does (`Elem::to_f32`, `vpslld`): the bits moved up,
                // a signalling NaN kept as it is, where `half` sets its quiet bit.
                let want = if h.is_nan() {
                    (h.to_bits() as u32) << 16
                } else {
                    h.to_f32().to_bits()
                };
                assert_eq!(g.to_bits(), want, "{:#06x}", h.to_bits());
            }
        }
        let mut xs: Vec<u32> = (0..u32::MAX / 509).map(|i| i * 509).collect();
        for h in 0..=u16::MAX as u32 {
            let mid = (h << 16) | 0x8000;
            xs.extend([mid - 1, mid, mid + 1, h << 16, (h << 16) | 0xFFFF]);
        }
        xs.extend([
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0xFF80_0001,
            0x7FC0_0000,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
        ]);
        let src: Vec<f32> = xs.iter().map(|&x| f32::from_bits(x)).collect();
        for len in [src.len(), src.len() - 5, 9] {
            let mut got = vec![bf16::ZERO; len];
            narrow_bf16(&src[..len], &mut got);
            for (x, g) in src.iter().zip(&got) {
                assert_eq!(g.to_bits(), bf16::from_f32(*x).to_bits(), "{:#010x}", x.to_bits());
            }
        }
    }

    /// Both SSE2 widening forms give every finite f16 exactly, whichever this CPU takes
    /// (the scaled one's subnormals included, however fast the CPU multiplies them), and
    /// report a block with infinity or NaN; on a thread whose MXCSR flushes subnormal inputs
    /// (denormals-are-zero), `widen_f16` stays exact, where the scaled form is not (the check
    /// that keeps it from that thread is live).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_sse2_widenings_are_exact_and_denormals_are_zero_is_respected() {
        let finite: Vec<f16> = (0..=u16::MAX)
            .map(f16::from_bits)
            .filter(|h| h.to_bits() & 0x7C00 != 0x7C00)
            .collect();
        let n = finite.len() - finite.len() % 8;
        let exact = |got: &[f32]| {
            for (h, g) in finite.iter().zip(got) {
                assert_eq!(g.to_bits(), f16_to_f32_bits(h.to_bits()), "{:#06x}", h.to_bits());
            }
        };
        type Form = fn(&[f16], &mut [f32]) -> bool;
        for form in [sse2::widen_normal as Form, sse2::widen_scaled as Form] {
            let mut got = vec![0f32; n];
            assert!(form(&finite[..n], &mut got));
            exact(&got);
            let mut odd = finite[..8].to_vec();
            odd[3] = f16::INFINITY;
            assert!(!form(&odd, &mut got[..8]));
        }
        std::thread::scope(|scope| {
            scope.spawn(|| {
                // Denormals-are-zero (MXCSR bit 6) on this thread only.
                let mut csr: u32 = 0;
                // SAFETY: `stmxcsr` / `ldmxcsr` store and load the 32-bit MXCSR (SSE).
                unsafe {
                    std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
                    csr |= 1 << 6;
                    std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags));
                }
                let mut got = vec![0f32; n];
                widen_f16(&finite[..n], &mut got);
                exact(&got);
                sse2::widen_scaled(&finite[..n], &mut got);
                assert_eq!(got[1], 0.0, "the scaled form flushes f16 subnormals under DAZ");
            });
        });
    }

    /// The blocked slice conversions equal the per-value ones: every f16 value (in blocks
    /// with and without odd values), and f32 values across every f16 range and boundary.
    #[test]
    fn blocked_f16_conversions_match_the_per_value_ones() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let normal: Vec<f16> = all
            .iter()
            .copied()
            .filter(|h| {
                let (mag, exp) = (h.to_bits() & 0x7FFF, h.to_bits() & 0x7C00);
                exp != 0x7C00 && (exp != 0 || mag == 0)
            })
            .collect();
        let finite: Vec<f16> = all.iter().copied().filter(|h| h.to_bits() & 0x7C00 != 0x7C00).collect();
        for src in [&all, &normal, &finite] {
            let mut got = vec![0f32; src.len()];
            widen_f16(src, &mut got);
            for (h, g) in src.iter().zip(&got) {
                assert_eq!(g.to_bits(), f16_to_f32_bits(h.to_bits()), "{:#06x}", h.to_bits());
            }
        }
        // Every 997th bit pattern, every pattern near the fast path's bounds, and the same
        // values with the odd ones zeroed (so whole blocks take the fast path).
        let mut xs: Vec<f32> = (0..u32::MAX / 997).map(|i| f32::from_bits(i * 997)).collect();
        for edge in [0x3880_0000u32, 0x4780_0000, 0x477F_E000, 0x477F_F000, 0] {
            for d in 0..4096u32 {
                for sign in [0, 0x8000_0000] {
                    xs.push(f32::from_bits(edge.wrapping_add(d).wrapping_sub(2048) | sign));
                }
            }
        }
        let fast: Vec<f32> = xs
            .iter()
            .map(|x| {
                let a = x.to_bits() & 0x7FFF_FFFF;
                if (0x3880_0000..0x4780_0000).contains(&a) {
                    *x
                } else {
                    0.0
                }
            })
            .collect();
        // Every value below 2^16 (subnormal results included), big ones zeroed: no block
        // leaves the vector path.
        let below: Vec<f32> = xs
            .iter()
            .map(|x| {
                if x.to_bits() & 0x7FFF_FFFF < 0x4780_0000 {
                    *x
                } else {
                    0.0
                }
            })
            .collect();
        for src in [&xs, &fast, &below] {
            let mut got = vec![f16::ZERO; src.len()];
            narrow_f16(src, &mut got);
            for (x, g) in src.iter().zip(&got) {
                assert_eq!(g.to_bits(), f16_bits(x.to_bits()), "{:#010x}", x.to_bits());
            }
        }
    }
}
