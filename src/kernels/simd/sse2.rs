use std::arch::x86_64::*;

use half::{bf16, f16};

/// `if m { t } else { f }` per lane (`m` all ones or all zeros).
#[inline(always)]
unsafe fn select(m: __m128i, t: __m128i, f: __m128i) -> __m128i {
    // SAFETY (all intrinsics here): SSE2 is part of x86-64.
    unsafe { _mm_or_si128(_mm_and_si128(m, t), _mm_andnot_si128(m, f)) }
}

/// Writes every value of `s` (a multiple of 8 long) to `d`, exactly as
/// [`super::f16_to_f32_bits`] for every finite value; false if any is infinity or NaN,
/// whose results are then wrong (the caller converts the block again per value).
pub(super) fn widen_normal(s: &[f16], d: &mut [f32]) -> bool {
    assert!(s.len() == d.len() && s.len().is_multiple_of(8));
    // SAFETY: SSE2 is part of x86-64; every load and store is within the slices (8
    // values of `s`, 2 x 4 of `d` from index `i`, `i + 8 <= len`), unaligned allowed.
    unsafe {
        let zero = _mm_setzero_si128();
        let (mag_m, exp_m) = (_mm_set1_epi16(0x7FFF), _mm_set1_epi16(0x7C00));
        let sign_m = _mm_set1_epi16(0x8000u16 as i16);
        let rebias = _mm_set1_epi32(112 << 23);
        let one_exp = _mm_set1_epi32(1 << 23);
        let magic = _mm_castsi128_ps(_mm_set1_epi32(113 << 23));
        let mut odd = zero;
        for i in (0..s.len()).step_by(8) {
            // The masks on eight 16-bit lanes, then each half widened by interleaving
            // with zeros (or with itself for a lane mask): the magnitude into the low half
            // of a 32-bit lane, the sign into the high half (its place in an f32).
            let h = _mm_loadu_si128(s.as_ptr().add(i).cast());
            let mag = _mm_and_si128(h, mag_m);
            let exp = _mm_and_si128(h, exp_m);
            let sign = _mm_and_si128(h, sign_m);
            odd = _mm_or_si128(odd, _mm_cmpeq_epi16(exp, exp_m));
            let sub = _mm_cmpeq_epi16(exp, zero);
            let halves = [
                (
                    _mm_unpacklo_epi16(mag, zero),
                    _mm_unpacklo_epi16(sub, sub),
                    _mm_unpacklo_epi16(zero, sign),
                ),
                (
                    _mm_unpackhi_epi16(mag, zero),
                    _mm_unpackhi_epi16(sub, sub),
                    _mm_unpackhi_epi16(zero, sign),
                ),
            ];
            for (j, (m, is_sub, sg)) in halves.into_iter().enumerate() {
                // Normal: the bits in place, the exponent rebiased. Zero and subnormal:
                // 2^-14 (1 + m/1024) - 2^-14, exact (no arithmetic on an f32 subnormal).
                let normal = _mm_add_epi32(_mm_slli_epi32(m, 13), rebias);
                let sub = _mm_sub_ps(_mm_castsi128_ps(_mm_add_epi32(normal, one_exp)), magic);
                let o = select(is_sub, _mm_castps_si128(sub), normal);
                _mm_storeu_si128(d.as_mut_ptr().add(i + 4 * j).cast(), _mm_or_si128(o, sg));
            }
        }
        _mm_movemask_epi8(odd) == 0
    }
}

/// Writes every value of `s` (a multiple of 8 long) to `d`, exactly as
/// [`super::f16_to_f32_bits`] for every finite value, with one f32 multiplication per four
/// values in place of [`widen_normal`]'s two paths and select: the magnitude's bits shifted
/// into an f32's place are 2^-112 times the value (an f32 subnormal for an f16 subnormal),
/// and multiplying by 2^112 gives it exactly. False if any value is infinity or NaN (the
/// caller converts the block again per value). Only where [`scaled_widening_applies`]: the
/// multiplication reads subnormal inputs, which a CPU may take a microcode assist for, and
/// which flush to zero under the MXCSR's denormals-are-zero mode.
pub(super) fn widen_scaled(s: &[f16], d: &mut [f32]) -> bool {
    assert!(s.len() == d.len() && s.len().is_multiple_of(8));
    // SAFETY: SSE2 is part of x86-64; every load and store is within the slices (8
    // values of `s`, 2 x 4 of `d` from index `i`, `i + 8 <= len`), unaligned allowed.
    unsafe {
        let zero = _mm_setzero_si128();
        let (mag_m, exp_m) = (_mm_set1_epi16(0x7FFF), _mm_set1_epi16(0x7C00));
        let sign_m = _mm_set1_epi16(0x8000u16 as i16);
        let scale = _mm_castsi128_ps(_mm_set1_epi32((127 + 112) << 23));
        let mut odd = zero;
        for i in (0..s.len()).step_by(8) {
            let h = _mm_loadu_si128(s.as_ptr().add(i).cast());
            let mag = _mm_and_si128(h, mag_m);
            let sign = _mm_and_si128(h, sign_m);
            odd = _mm_or_si128(odd, _mm_cmpeq_epi16(_mm_and_si128(h, exp_m), exp_m));
            let halves = [
                (_mm_unpacklo_epi16(mag, zero), _mm_unpacklo_epi16(zero, sign)),
                (_mm_unpackhi_epi16(mag, zero), _mm_unpackhi_epi16(zero, sign)),
            ];
            for (j, (m, sg)) in halves.into_iter().enumerate() {
                let v = _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(m, 13)), scale);
                _mm_storeu_si128(
                    d.as_mut_ptr().add(i + 4 * j).cast(),
                    _mm_or_si128(_mm_castps_si128(v), sg),
                );
            }
        }
        _mm_movemask_epi8(odd) == 0
    }
}

/// How much slower a multiplication of subnormal inputs may be than of normal ones for
/// [`widen_scaled`] to be used: a microcode assist (Intel cores without denormals-are-zero)
/// costs on the order of a hundred cycles, tens of times the measured ratio; AMD Zen 4
/// multiplies subnormals at full rate (measured: 1.1x).
const SUBNORMAL_SLOWDOWN_MAX: f64 = 1.5;

/// Whether [`widen_scaled`] may be used on this thread now: this CPU multiplies subnormal
/// f32 inputs at about the normal rate (measured once per process: a few microseconds, about
/// a millisecond where each takes an assist) and the thread's MXCSR does not flush subnormal
/// inputs to zero (denormals-are-zero, which code built with `-ffast-math` may set, would
/// turn every f16 subnormal into a zero).
pub(super) fn scaled_widening_applies() -> bool {
    static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let fast = *FAST.get_or_init(|| {
        let best = |v: f32| (0..4).map(|_| multiply_time(v)).fold(f64::INFINITY, f64::min);
        let (normal, sub) = (best(1.5), best(f32::MIN_POSITIVE / 3.0));
        sub <= normal * SUBNORMAL_SLOWDOWN_MAX
    });
    fast && !denormals_are_zero()
}

/// Seconds for 16384 multiplications of `v` by 2^112, four per instruction, independent.
fn multiply_time(v: f32) -> f64 {
    let src = [std::hint::black_box(v); 64];
    let t = std::time::Instant::now();
    // SAFETY: SSE2 is part of x86-64; the loads are within `src` (64 values, 4 at a time).
    let acc = unsafe {
        let scale = _mm_set1_ps(f32::from_bits((127 + 112) << 23));
        let mut acc = _mm_setzero_ps();
        for _ in 0..64 {
            for c in 0..16 {
                let x = _mm_loadu_ps(std::hint::black_box(&src).as_ptr().add(4 * c));
                acc = _mm_or_ps(acc, _mm_mul_ps(x, scale));
            }
        }
        acc
    };
    std::hint::black_box(acc);
    t.elapsed().as_secs_f64()
}

/// Whether this thread's MXCSR has denormals-are-zero set (bit 6).
fn denormals_are_zero() -> bool {
    let mut csr: u32 = 0;
    // SAFETY: `stmxcsr` stores the 32-bit MXCSR to the given address (SSE, part of x86-64).
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
    }
    csr & (1 << 6) != 0
}

/// Writes every value of `s` (a multiple of 8 long) to `d`, exactly as
/// [`super::f16_bits`] for every magnitude below 2^16; false if any is 2^16 or more
/// (infinity, NaN included), whose results are then wrong (the caller converts the block
/// again per value).
pub(super) fn narrow_normal(s: &[f32], d: &mut [f16]) -> bool {
    assert!(s.len() == d.len() && s.len().is_multiple_of(8));
    // SAFETY: SSE2 is part of x86-64; every load and store is within the slices (2 x 4
    // values of `s`, 8 of `d` from index `i`, `i + 8 <= len`), unaligned allowed.
    unsafe {
        let zero = _mm_setzero_si128();
        let abs = _mm_set1_epi32(0x7FFF_FFFF);
        let one = _mm_set1_epi32(1);
        let round = _mm_set1_epi32(0xC800_0FFFu32 as i32);
        let (lo, hi) = (_mm_set1_epi32(0x3880_0000), _mm_set1_epi32(0x477F_FFFF));
        let half = _mm_set1_ps(0.5);
        let half_bits = _mm_set1_epi32(0x3F00_0000);
        let sign_m = _mm_set1_epi32(0xFFFF_8000u32 as i32);
        let mut odd = zero;
        for i in (0..s.len()).step_by(8) {
            let mut out = [zero; 2];
            for (j, out) in out.iter_mut().enumerate() {
                let x = _mm_loadu_si128(s.as_ptr().add(i + 4 * j).cast());
                // Non-negative as i32, so the signed compares order magnitudes.
                let a = _mm_and_si128(x, abs);
                odd = _mm_or_si128(odd, _mm_cmpgt_epi32(a, hi));
                // Normal result: rebias, round half to even on the 13 dropped bits.
                let lsb = _mm_and_si128(_mm_srli_epi32(a, 13), one);
                let norm = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(a, round), lsb), 13);
                // Below 2^-14 (zero included): adding 0.5 rounds at f16's subnormal step.
                let sub = _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(a), half)), half_bits);
                let o = select(_mm_cmpgt_epi32(lo, a), sub, norm);
                // The sign as 0 or 0xFFFF8000: the lane is then an i16 value, which the
                // saturating pack keeps exactly.
                *out = _mm_or_si128(o, _mm_and_si128(_mm_srai_epi32(x, 16), sign_m));
            }
            _mm_storeu_si128(d.as_mut_ptr().add(i).cast(), _mm_packs_epi32(out[0], out[1]));
        }
        _mm_movemask_epi8(odd) == 0
    }
}

/// bf16 -> f32 over slices: each value's 16 bits become the high half of an f32 (exact),
/// eight values per step by interleaving with zeros; the rest one by one.
pub(super) fn widen_bf16(s: &[bf16], d: &mut [f32]) {
    assert_eq!(s.len(), d.len(), "widen_bf16: lengths differ");
    let body = s.len() - s.len() % 8;
    // SAFETY: SSE2 is part of x86-64; every load and store is within the slices (8 values
    // of `s`, 2 x 4 of `d` from index `i`, `i + 8 <= body`), unaligned allowed.
    unsafe {
        let zero = _mm_setzero_si128();
        for i in (0..body).step_by(8) {
            let h = _mm_loadu_si128(s.as_ptr().add(i).cast());
            _mm_storeu_si128(d.as_mut_ptr().add(i).cast(), _mm_unpacklo_epi16(zero, h));
            _mm_storeu_si128(d.as_mut_ptr().add(i + 4).cast(), _mm_unpackhi_epi16(zero, h));
        }
    }
    for (d, h) in d[body..].iter_mut().zip(&s[body..]) {
        *d = f32::from_bits((h.to_bits() as u32) << 16);
    }
}

/// f32 -> bf16 over slices, bit for bit as [`super::bf16_bits`] (`half`'s rounding: to
/// nearest even, a NaN kept and made quiet), eight values per step; the rest one by one.
/// `half`'s own conversion branches per value on NaN, which keeps LLVM from vectorising it.
/// The vector step rounds every value as a finite one (five integer operations per four
/// values, the arithmetic shift leaving each result sign-extended for the saturating pack)
/// and notes whether a NaN went by; eight values that held one are converted again value
/// by value (a NaN's rounding can carry into the sign). NaN is rare in what is narrowed (an
/// overflowing step's gradients), so the branch is always predicted and the common case
/// pays no select.
pub(super) fn narrow_bf16(s: &[f32], d: &mut [bf16]) {
    assert_eq!(s.len(), d.len(), "narrow_bf16: lengths differ");
    let body = s.len() - s.len() % 8;
    // Out of line and cold (it also converts the tail): inlined, LLVM loaded the eight
    // values into general registers on every step of the vector loop, ahead of the branch
    // that almost never calls it.
    #[cold]
    #[inline(never)]
    fn scalar(s: &[f32], d: &mut [bf16]) {
        for (d, x) in d.iter_mut().zip(s) {
            *d = bf16::from_bits(super::bf16_bits(x.to_bits()));
        }
    }
    // SAFETY: SSE2 is part of x86-64; every load and store is within the slices (2 x 4
    // values of `s`, 8 of `d` from index `i`, `i + 8 <= body`), unaligned allowed.
    unsafe {
        let abs = _mm_set1_epi32(0x7FFF_FFFF);
        let inf = _mm_set1_epi32(0x7F80_0000);
        let (one, round) = (_mm_set1_epi32(1), _mm_set1_epi32(0x7FFF));
        for i in (0..body).step_by(8) {
            let mut out = [_mm_setzero_si128(); 2];
            let mut nan = _mm_setzero_si128();
            for (j, out) in out.iter_mut().enumerate() {
                let x = _mm_loadu_si128(s.as_ptr().add(i + 4 * j).cast());
                // Add 0x7FFF plus the kept part's lowest bit, keep the high half: no carry
                // past bit 31 for a finite or infinite value (the largest such pattern is
                // -inf's), so the arithmetic shift gives the pattern sign-extended.
                let lsb = _mm_and_si128(_mm_srli_epi32(x, 16), one);
                *out = _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(x, round), lsb), 16);
                // NaN: a magnitude above infinity's (a signed compare: both are below 2^31).
                nan = _mm_or_si128(nan, _mm_cmpgt_epi32(_mm_and_si128(x, abs), inf));
            }
            _mm_storeu_si128(d.as_mut_ptr().add(i).cast(), _mm_packs_epi32(out[0], out[1]));
            if _mm_movemask_epi8(nan) != 0 {
                scalar(&s[i..i + 8], &mut d[i..i + 8]);
            }
        }
    }
    scalar(&s[body..], &mut d[body..]);
}
