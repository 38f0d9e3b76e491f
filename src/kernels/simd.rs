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

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
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

/// `s` as f32 values when `T` is f32 (decided at compile time once monomorphised), so a
/// kernel can work on f32 data in place instead of through a conversion buffer.
#[inline(always)]
pub(crate) fn as_f32_mut<T: Elem>(s: &mut [T]) -> Option<&mut [f32]> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        // SAFETY: `T` is `f32`: the same slice, retyped to itself.
        Some(unsafe { &mut *(s as *mut [T] as *mut [f32]) })
    } else {
        None
    }
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
