//! bf16 matrix product with AVX-512 BF16 dot products (`vdpbf16ps`).
//!
//! `vdpbf16ps acc, a, b` adds `a[2i]*b[2i] + a[2i+1]*b[2i+1]` to f32 lane `i`, so the depth
//! dimension is consumed in pairs. Both operands are packed into pairs (a 32-bit word holds
//! two consecutive depth values of one row of A, or of one column of B; an odd depth is
//! padded with zero):
//!
//! * B, per strip of `NR = 32` columns: for each depth pair, 32 words (two vectors);
//! * A, per panel of `MR = 14` rows: for each depth pair, 14 words, each broadcast to all
//!   lanes.
//!
//! The micro-kernel keeps a 14 x 32 f32 tile of C in 28 of the 32 vector registers and
//! issues 28 dot products per depth pair. Blocks of `KC` depth and `MC` rows keep the packed
//! panels in cache (BLIS's loop order); row blocks are split over the rayon pool.
//!
//! A bf16 product fits f32's mantissa, so normal values multiply exactly and, apart from the
//! order of the f32 sums, the result is an f32 product of the same values, with one
//! exception: `vdpbf16ps` ignores MXCSR and flushes subnormals to zero, both the bf16 inputs
//! (magnitude below 2^-126) and every f32 result it writes (the running sums). The widened
//! f32 path of the lower tiers and candle keep them; `kernels::bf16_products_flush_subnormals`
//! tells users which tier they are on.
//!
//! The tier runs this kernel only where the instruction is faster than f32 FMAs
//! ([`dot_products_pay`]); elsewhere it widens to f32 and flushes the same values.

use std::arch::x86_64::*;
use std::sync::OnceLock;
use std::time::Instant;

use half::bf16;
use rayon::prelude::*;

use super::mat::Mat;

const MR: usize = 14;
const NR: usize = 32;
/// Depth per block, in pairs (512 values).
const KP: usize = 256;
/// Rows per block.
const MC: usize = MR * 12;
/// Columns per block.
const NC: usize = NR * 64;

/// How much faster than f32 FMAs `vdpbf16ps` must multiply for the tier to use it. Its
/// rate differs by CPU: Intel Sapphire Rapids issues one every two cycles (86 GFLOP/s against
/// 176 for FMAs on a 2.7 GHz Xeon core), half the FMA rate, so widening to f32 and using the
/// FMA product is faster there; AMD Zen 4 issues it at the FMA instruction rate, twice the
/// FLOPs. The packed kernel reaches the instruction's rate, the widened path about 0.85 of
/// the FMA rate (the conversions and the `gemm` crate's packing), so the dot products pay
/// from a 1.0 ratio up, with a wide margin either way on the CPUs above.
const DOT_PRODUCT_MIN_GAIN: f64 = 1.0;

/// Whether the dot-product kernel beats the widened FMA product on this CPU: both
/// instructions' throughput measured once per process (independent accumulators, about 0.2
/// ms), compared in FLOPs. The AVX-512 BF16 tier uses the faster one; both flush subnormals
/// the same way, so results agree up to the order of the f32 sums.
pub(super) fn dot_products_pay() -> bool {
    static PAY: OnceLock<bool> = OnceLock::new();
    *PAY.get_or_init(|| {
        // The packing uses AVX-512 BW and VL (every CPU with BF16 has them; checked anyway).
        if !(std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl"))
        {
            return false;
        }
        // SAFETY: the CPU has AVX-512 F and BF16 (checked above; BF16 implies F).
        let (dot, fma) = unsafe { (best_of(dot_rate), best_of(fma_rate)) };
        dot >= fma * DOT_PRODUCT_MIN_GAIN
    })
}

/// The best of a few runs of a rate measurement (the first also warms up the unit).
///
/// # Safety
/// The CPU has the features `f` is compiled for.
unsafe fn best_of(f: unsafe fn() -> f64) -> f64 {
    // SAFETY: as the caller promised.
    (0..4).map(|_| unsafe { f() }).fold(0.0, f64::max)
}

/// Iterations of the rate loops: 16 independent instructions each.
const RATE_ITERS: usize = 2048;

/// FLOPs per second of `vdpbf16ps` (64 per instruction).
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_rate() -> f64 {
    let a: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(std::hint::black_box(0x3F80_3F80))) };
    let mut acc = [_mm512_setzero_ps(); 16];
    let t = Instant::now();
    for _ in 0..RATE_ITERS {
        for v in acc.iter_mut() {
            *v = _mm512_dpbf16_ps(*v, a, a);
        }
    }
    let s = t.elapsed().as_secs_f64();
    std::hint::black_box(acc);
    (RATE_ITERS * 16 * 64) as f64 / s.max(1e-9)
}

/// FLOPs per second of `vfmadd231ps` on 512-bit vectors (32 per instruction).
#[target_feature(enable = "avx512f")]
unsafe fn fma_rate() -> f64 {
    let a = _mm512_set1_ps(std::hint::black_box(1.0));
    let mut acc = [_mm512_setzero_ps(); 16];
    let t = Instant::now();
    for _ in 0..RATE_ITERS {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(a, a, *v);
        }
    }
    let s = t.elapsed().as_secs_f64();
    std::hint::black_box(acc);
    (RATE_ITERS * 16 * 32) as f64 / s.max(1e-9)
}

thread_local! {
    /// Packed-operand buffers kept between products on this thread: allocated fresh, a
    /// block of a few hundred KiB is mapped, faulted in page by page and unmapped again
    /// each call (as `scratch` says for the f32 buffers). At most two per thread (A's panels
    /// and B's strips), each at the size of the largest block, so memory stays bounded.
    static PACKED: std::cell::RefCell<Vec<Vec<u32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn take_packed() -> Vec<u32> {
    PACKED.with(|p| p.borrow_mut().pop()).unwrap_or_default()
}

fn give_packed(buf: Vec<u32>) {
    PACKED.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < 2 {
            p.push(buf);
        }
    });
}

#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
}

/// Packs B's block `[k0, k0+2*kp) x [n0, n0+nc)` into strips of NR columns.
///
/// Packing is a copy of the block and the micro-kernel reuses it over every row block, but
/// at a transformer's sizes (depth and width a few hundred) the copy is not small beside the
/// products: element by element through the strided view it took as long as the products
/// (measured on Zen 4). Contiguous rows or columns, the layouts the products use, are
/// copied slice by slice; other views take the element path.
fn pack_b(b: &Mat<'_, bf16>, k: usize, k0: usize, kp: usize, n0: usize, nc: usize, out: &mut Vec<u32>) {
    let strips = nc.div_ceil(NR);
    out.clear();
    out.resize(strips * kp * NR, 0);
    // Depth pairs whose both rows exist; the rest (an odd depth's last, or past the
    // end) take the element path, which pads with zero.
    let full = kp.min(k.saturating_sub(k0) / 2);
    for s in 0..strips {
        let base = s * kp * NR;
        let cols = NR.min(nc - s * NR);
        let c0 = n0 + s * NR;
        // The depth pairs a contiguous path wrote; the element path does the rest.
        let done = if b.cs == 1 && full > 0 {
            // Rows are contiguous: each depth pair interleaves two row slices.
            let first = b.off + k0 * b.rs + c0;
            let last = first + (2 * full - 1) * b.rs + cols;
            // SAFETY: the slice holds rows k0..k0+2*full of the strip's columns; `out`
            // holds the strip; the caller checked AVX-512 BF16 (F, BW and VL with it).
            unsafe {
                interleave(
                    &b.data[first..last],
                    b.rs,
                    cols,
                    full,
                    &mut out[base..base + kp * NR],
                    NR,
                )
            }
            full
        } else if let (1, Some(col_bytes), true) = (b.rs, lane_bytes(b.cs), full > 0) {
            // Columns are contiguous: a depth pair of one column is two neighbours, one
            // word; a strip's pair is two gathers of 16 columns' words.
            for j0 in (0..cols).step_by(16) {
                let lanes = 16.min(cols - j0);
                let first = b.off + (c0 + j0) * b.cs + k0;
                let last = b.off + (c0 + j0 + lanes - 1) * b.cs + k0 + 2 * full;
                let dst = &mut out[base + j0..base + kp * NR];
                // SAFETY: column j0+i's pair p, at byte 2*(i*cs + 2p) of the slice, lies
                // inside it (the last is column j0+lanes-1's pair full-1); `dst` holds
                // (full-1)*NR + lanes words; the caller checked AVX-512.
                unsafe { gather_words(&b.data[first..last], col_bytes, lanes, full, dst, NR) }
            }
            full
        } else {
            0
        };
        pack_b_elements(b, k, k0, done, kp, c0, cols, &mut out[base..base + kp * NR]);
    }
}

/// The element path of [`pack_b`] for depth pairs `[p0, kp)` of one strip (`out`).
#[allow(clippy::too_many_arguments)]
fn pack_b_elements(
    b: &Mat<'_, bf16>,
    k: usize,
    k0: usize,
    p0: usize,
    kp: usize,
    c0: usize,
    cols: usize,
    out: &mut [u32],
) {
    let get = |r: usize, c: usize| {
        if r < k {
            b.data[b.off + r * b.rs + c * b.cs]
        } else {
            bf16::ZERO
        }
    };
    for p in p0..kp {
        let r = k0 + 2 * p;
        for (j, w) in out[p * NR..p * NR + cols].iter_mut().enumerate() {
            *w = pair(get(r, c0 + j), get(r + 1, c0 + j));
        }
    }
}

/// Packs A's block `[m0, m0+mc) x [k0, k0+2*kp)` into panels of MR rows (contiguous rows or
/// columns slice by slice, as [`pack_b`]).
fn pack_a(a: &Mat<'_, bf16>, k: usize, m0: usize, mc: usize, k0: usize, kp: usize, out: &mut Vec<u32>) {
    let panels = mc.div_ceil(MR);
    out.clear();
    out.resize(panels * kp * MR, 0);
    let full = kp.min(k.saturating_sub(k0) / 2);
    for q in 0..panels {
        let base = q * kp * MR;
        let rows = MR.min(mc - q * MR);
        let r0 = m0 + q * MR;
        // The depth pairs a contiguous path wrote; the element path does the rest.
        let done = if let (1, Some(row_bytes), true) = (a.cs, lane_bytes(a.rs), full > 0) {
            // Rows are contiguous: a depth pair of one row is two neighbours, one 32-bit
            // word. A panel's pair is one gather of the rows' words: word by word, with
            // the panel's stride between writes, the copy cost a third of the products it
            // feeds (measured on Zen 4).
            let first = a.off + r0 * a.rs + k0;
            let last = a.off + (r0 + rows - 1) * a.rs + k0 + 2 * full;
            let dst = &mut out[base..base + full * MR];
            // SAFETY: every word gathered, row i's pair p at byte 2*(i*rs + 2p) of the
            // slice, lies inside it (its last is row rows-1's pair full-1, and the slice ends
            // after it); `dst` holds full*MR words; the CPU has AVX-512 (the caller checked
            // AVX-512 BF16).
            unsafe { gather_words(&a.data[first..last], row_bytes, rows, full, dst, MR) }
            full
        } else if a.rs == 1 && full > 0 {
            // Columns are contiguous: each depth pair interleaves two column slices.
            let first = a.off + k0 * a.cs + r0;
            let last = first + (2 * full - 1) * a.cs + rows;
            // SAFETY: the slice holds columns k0..k0+2*full of the panel's rows; `out`
            // holds the panel; the caller checked AVX-512 BF16 (F, BW and VL with it).
            unsafe {
                interleave(
                    &a.data[first..last],
                    a.cs,
                    rows,
                    full,
                    &mut out[base..base + kp * MR],
                    MR,
                )
            }
            full
        } else {
            0
        };
        pack_a_elements(a, k, done, kp, k0, r0, rows, &mut out[base..base + kp * MR]);
    }
}

/// `dst[p*stride + i]` = the 32-bit word at byte `i*lane_bytes + 4p` of `src`, for
/// `i < lanes` (at most 16) and `p < count` (the other words are left as they are): `lanes`
/// rows (or columns) of depth pairs, one gather per pair.
///
/// # Safety
/// Every such word lies inside `src`, `dst` holds `(count - 1) * stride + lanes` words, and
/// the CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn gather_words(src: &[bf16], lane_bytes: i32, lanes: usize, count: usize, dst: &mut [u32], stride: usize) {
    debug_assert!(lanes <= 16 && (count == 0 || dst.len() >= (count - 1) * stride + lanes));
    let idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(lane_bytes),
    );
    let mask: __mmask16 = ((1u32 << lanes) - 1) as u16;
    let base = src.as_ptr() as *const u8;
    for p in 0..count {
        // SAFETY: as the caller promised, for the lanes in the mask.
        unsafe {
            let w = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, idx, base.add(4 * p) as *const i32);
            _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(p * stride) as *mut i32, mask, w);
        }
    }
}

/// `dst[p*stride + i] = pair(src[2p*step + i], src[(2p+1)*step + i])` for `i < width` (at
/// most 32) and `p < count`: the depth pairs of `width` contiguous rows (or columns) whose
/// neighbours lie `step` apart, 16 words per masked load, widen and store.
///
/// # Safety
/// `src` holds `(2*count - 1) * step + width` values, `dst` holds `(count - 1) * stride +
/// width` words, and the CPU has AVX-512 F, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn interleave(src: &[bf16], step: usize, width: usize, count: usize, dst: &mut [u32], stride: usize) {
    debug_assert!(width <= 32 && count > 0 && src.len() > (2 * count - 1) * step + width - 1);
    debug_assert!(dst.len() >= (count - 1) * stride + width);
    let (s, d) = (src.as_ptr() as *const i16, dst.as_mut_ptr() as *mut i32);
    for w0 in (0..width).step_by(16) {
        let mask: __mmask16 = ((1u32 << (width - w0).min(16)) - 1) as u16;
        for p in 0..count {
            // SAFETY: the lanes in the mask lie inside `src` and `dst`, as the caller promised.
            unsafe {
                let lo = _mm256_maskz_loadu_epi16(mask, s.add(2 * p * step + w0));
                let hi = _mm256_maskz_loadu_epi16(mask, s.add((2 * p + 1) * step + w0));
                let w = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(lo),
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)),
                );
                _mm512_mask_storeu_epi32(d.add(p * stride + w0), mask, w);
            }
        }
    }
}

/// The byte distance between neighbouring lanes of a gather, when 16 of them fit in `i32`.
fn lane_bytes(stride: usize) -> Option<i32> {
    i32::try_from(2 * stride).ok().filter(|b| b.checked_mul(16).is_some())
}

/// The element path of [`pack_a`] for depth pairs `[p0, kp)` of one panel (`out`).
#[allow(clippy::too_many_arguments)]
fn pack_a_elements(
    a: &Mat<'_, bf16>,
    k: usize,
    p0: usize,
    kp: usize,
    k0: usize,
    r0: usize,
    rows: usize,
    out: &mut [u32],
) {
    let get = |r: usize, c: usize| {
        if c < k {
            a.data[a.off + r * a.rs + c * a.cs]
        } else {
            bf16::ZERO
        }
    };
    for p in p0..kp {
        let c = k0 + 2 * p;
        for i in 0..rows {
            out[p * MR + i] = pair(get(r0 + i, c), get(r0 + i, c + 1));
        }
    }
}

/// Where the micro-kernel reads A's depth-pair words: a packed panel, or (row-major A
/// whose block has no padded pair) the rows themselves, which a block reuses from L2 for
/// every strip of B: packing them was a copy that cost a sixth of the products (Zen 4).
#[derive(Clone, Copy)]
enum PanelA {
    /// A packed panel: pair `p` of row `i` at word `p * MR + i`.
    Packed(*const u32),
    /// Row 0's first pair at `base`; row `i` starts `i * row_bytes` later.
    Rows { base: *const u8, row_bytes: usize },
}

impl PanelA {
    /// The word of row `i`, pair `p`.
    ///
    /// # Safety
    /// The panel holds that pair of that row.
    #[inline(always)]
    unsafe fn word(self, p: usize, i: usize) -> i32 {
        // SAFETY: as the caller promised; rows need not be 4-byte aligned (an unaligned read).
        unsafe {
            match self {
                PanelA::Packed(a) => *a.add(p * MR + i) as i32,
                PanelA::Rows { base, row_bytes } => (base.add(i * row_bytes + 4 * p) as *const i32).read_unaligned(),
            }
        }
    }
}

/// The 14 x 32 tile `c` (row stride `ldc`) `+=` (or `=`) panel `a` . strip `b` over `kp`
/// depth pairs.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(kp: usize, a: PanelA, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 2 * MR];
        if load {
            for i in 0..MR {
                acc[2 * i] = _mm512_loadu_ps(c.add(i * ldc));
                acc[2 * i + 1] = _mm512_loadu_ps(c.add(i * ldc + 16));
            }
        }
        for p in 0..kp {
            let bp = b.add(p * NR);
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp as *const __m512i));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(16) as *const __m512i));
            for i in 0..MR {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(a.word(p, i)));
                acc[2 * i] = _mm512_dpbf16_ps(acc[2 * i], av, b0);
                acc[2 * i + 1] = _mm512_dpbf16_ps(acc[2 * i + 1], av, b1);
            }
        }
        for i in 0..MR {
            _mm512_storeu_ps(c.add(i * ldc), acc[2 * i]);
            _mm512_storeu_ps(c.add(i * ldc + 16), acc[2 * i + 1]);
        }
    }
}

/// One block of rows `[m0, m0+mc)` of C against a packed B block; `c` starts at row `m0`.
#[allow(clippy::too_many_arguments)]
fn block(
    a: &Mat<'_, bf16>,
    k: usize,
    m0: usize,
    mc: usize,
    k0: usize,
    kp: usize,
    n0: usize,
    nc: usize,
    bp: &[u32],
    c: &mut [f32],
    ldc: usize,
    load: bool,
) {
    let mut ap = take_packed();
    // Row-major A with every pair of the block inside its rows: the whole panels are read
    // in place and only the last, partial one is packed (its missing rows as zeros).
    let direct = a.cs == 1 && 2 * kp <= k.saturating_sub(k0);
    let whole = if direct { mc / MR } else { 0 };
    pack_a(a, k, m0 + whole * MR, mc - whole * MR, k0, kp, &mut ap);
    let mut tile = [0f32; MR * NR];
    for s in 0..nc.div_ceil(NR) {
        let cols = NR.min(nc - s * NR);
        let strip = &bp[s * kp * NR..(s + 1) * kp * NR];
        for q in 0..mc.div_ceil(MR) {
            let rows = MR.min(mc - q * MR);
            let panel = if q < whole {
                // Row m0+q*MR+i's pairs lie inside A (whole rows, `2 kp <= k - k0`, and
                // `check_product` bounded A's rows and columns).
                let start = a.off + (m0 + q * MR) * a.rs + k0;
                let last = start + (MR - 1) * a.rs + 2 * kp;
                assert!(last <= a.data.len());
                PanelA::Rows {
                    base: a.data[start..].as_ptr() as *const u8,
                    row_bytes: 2 * a.rs,
                }
            } else {
                let q = q - whole;
                PanelA::Packed(ap[q * kp * MR..(q + 1) * kp * MR].as_ptr())
            };
            let r0 = q * MR;
            let c0 = n0 + s * NR;
            if rows == MR && cols == NR {
                assert!((r0 + MR - 1) * ldc + c0 + NR <= c.len());
                // SAFETY: the tile lies inside `c` (checked above), the panels hold kp pairs,
                // and the CPU has AVX-512 BF16 (checked by the caller).
                unsafe { kernel(kp, panel, strip.as_ptr(), c.as_mut_ptr().add(r0 * ldc + c0), ldc, load) }
            } else {
                // Edge tile: through a full-size scratch tile.
                for i in 0..rows {
                    for j in 0..cols {
                        tile[i * NR + j] = if load { c[(r0 + i) * ldc + c0 + j] } else { 0.0 };
                    }
                }
                // SAFETY: as above, on the local scratch tile.
                unsafe { kernel(kp, panel, strip.as_ptr(), tile.as_mut_ptr(), NR, true) }
                for i in 0..rows {
                    for j in 0..cols {
                        c[(r0 + i) * ldc + c0 + j] = tile[i * NR + j];
                    }
                }
            }
        }
    }
    give_packed(ap);
}

/// Panics unless every dimension is at least 1 and the product's operands and output lie
/// inside their slices: what the raw-pointer kernels (this one and AMX's) rely on. The
/// arithmetic is checked, so no wrap-around can pass.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_product(
    m: usize,
    n: usize,
    k: usize,
    a: &Mat<'_, bf16>,
    b: &Mat<'_, bf16>,
    c_len: usize,
    ldc: usize,
    what: &str,
) {
    assert!(m > 0 && n > 0 && k > 0, "{what}: empty product ({m} x {k} . {k} x {n})");
    // The offset of element (rows - 1, cols - 1) of a view.
    let last = |off: usize, rows: usize, rs: usize, cols: usize, cs: usize| {
        off.checked_add((rows - 1).checked_mul(rs)?)?
            .checked_add((cols - 1).checked_mul(cs)?)
    };
    let c_end = (m - 1).checked_mul(ldc).and_then(|x| x.checked_add(n));
    assert!(c_end.is_some_and(|e| e <= c_len), "{what}: output too small");
    let a_last = last(a.off, m, a.rs, k, a.cs);
    assert!(a_last.is_some_and(|l| l < a.data.len()), "{what}: lhs out of bounds");
    let b_last = last(b.off, k, b.rs, n, b.cs);
    assert!(b_last.is_some_and(|l| l < b.data.len()), "{what}: rhs out of bounds");
}

/// `c (m x n, row stride ldc) (+)= a . b`. The caller checked that the CPU has AVX-512 BF16;
/// every dimension is at least 1 (the dispatcher sends empty products to the direct loop).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
) {
    check_product(m, n, k, &a, &b, c.len(), ldc, "bf16 gemm");
    let pairs = k.div_ceil(2);
    let threads = rayon::current_num_threads();
    let mut bp = take_packed();
    for n0 in (0..n).step_by(NC) {
        let nc = NC.min(n - n0);
        for (blk, p0) in (0..pairs).step_by(KP).enumerate() {
            let kp = KP.min(pairs - p0);
            let k0 = 2 * p0;
            pack_b(&b, k, k0, kp, n0, nc, &mut bp);
            let load = acc || blk > 0;
            if threads > 1 && m > MC {
                // Row blocks are disjoint rows of C.
                c.par_chunks_mut(MC * ldc)
                    .enumerate()
                    .filter(|(i, _)| i * MC < m)
                    .for_each(|(i, rows)| {
                        let m0 = i * MC;
                        block(&a, k, m0, MC.min(m - m0), k0, kp, n0, nc, &bp, rows, ldc, load);
                    });
            } else {
                for m0 in (0..m).step_by(MC) {
                    block(
                        &a,
                        k,
                        m0,
                        MC.min(m - m0),
                        k0,
                        kp,
                        n0,
                        nc,
                        &bp,
                        &mut c[m0 * ldc..],
                        ldc,
                        load,
                    );
                }
            }
        }
    }
    give_packed(bp);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(data: &[bf16], rs: usize, cs: usize) -> Mat<'_, bf16> {
        Mat { data, off: 0, rs, cs }
    }

    #[test]
    fn the_bounds_check_takes_exact_fits_and_refuses_the_rest() {
        let (a, b) = (vec![bf16::ONE; 6], vec![bf16::ONE; 12]);
        // 2 x 3 . 3 x 4 into 2 x 4: fits exactly.
        check_product(2, 4, 3, &view(&a, 3, 1), &view(&b, 4, 1), 8, 4, "t");
        let refused = |f: fn()| assert!(std::panic::catch_unwind(f).is_err());
        refused(|| {
            let (a, b) = (vec![bf16::ONE; 6], vec![bf16::ONE; 12]);
            check_product(2, 4, 3, &view(&a, 3, 1), &view(&b, 4, 1), 7, 4, "output");
        });
        refused(|| {
            let (a, b) = (vec![bf16::ONE; 5], vec![bf16::ONE; 12]);
            check_product(2, 4, 3, &view(&a, 3, 1), &view(&b, 4, 1), 8, 4, "lhs");
        });
        refused(|| {
            let (a, b) = (vec![bf16::ONE; 6], vec![bf16::ONE; 12]);
            check_product(2, 4, 3, &view(&a, 3, 1), &view(&b, usize::MAX / 2, 1), 8, 4, "wraps");
        });
        refused(|| {
            let (a, b) = (vec![bf16::ONE; 6], vec![bf16::ONE; 12]);
            check_product(0, 4, 3, &view(&a, 3, 1), &view(&b, 4, 1), 8, 4, "empty");
        });
    }

    /// The slice-by-slice packers write what the element path writes, for row-major,
    /// column-major and general views, with offsets, odd depths, depths past a block and
    /// edge strips and panels.
    #[test]
    fn the_contiguous_packers_equal_the_element_path() {
        let data: Vec<bf16> = (0..20_000)
            .map(|i| bf16::from_bits(((i * 2_654_435_761usize) >> 7) as u16))
            .collect();
        for (rows, cols) in [(1, 1), (3, 5), (14, 32), (29, 70), (40, 33)] {
            // (rs, cs) for a row-major, a column-major and a strided view, each at an offset.
            for (rs, cs) in [(cols + 3, 1), (1, rows + 2), (2 * cols + 1, 2)] {
                let m = Mat {
                    data: &data,
                    off: 5,
                    rs,
                    cs,
                };
                for (k0, kp) in [(0, rows.div_ceil(2)), (2, 4), (0, 1)] {
                    // As B: depth = rows, width = cols.
                    let (mut fast, mut slow) = (Vec::new(), vec![0; cols.div_ceil(NR) * kp * NR]);
                    pack_b(&m, rows, k0, kp, 0, cols, &mut fast);
                    for s in 0..cols.div_ceil(NR) {
                        let w = NR.min(cols - s * NR);
                        pack_b_elements(
                            &m,
                            rows,
                            k0,
                            0,
                            kp,
                            s * NR,
                            w,
                            &mut slow[s * kp * NR..(s + 1) * kp * NR],
                        );
                    }
                    assert_eq!(fast, slow, "B {rows}x{cols} rs={rs} cs={cs} k0={k0} kp={kp}");
                    // As A: height = rows, depth = cols.
                    let kpa = kp.min(cols.div_ceil(2)).max(1);
                    let (mut fast, mut slow) = (Vec::new(), vec![0; rows.div_ceil(MR) * kpa * MR]);
                    pack_a(&m, cols, 0, rows, k0, kpa, &mut fast);
                    for q in 0..rows.div_ceil(MR) {
                        let h = MR.min(rows - q * MR);
                        pack_a_elements(
                            &m,
                            cols,
                            0,
                            kpa,
                            k0,
                            q * MR,
                            h,
                            &mut slow[q * kpa * MR..(q + 1) * kpa * MR],
                        );
                    }
                    assert_eq!(fast, slow, "A {rows}x{cols} rs={rs} cs={cs} k0={k0} kp={kpa}");
                }
            }
        }
    }

    /// The product equals a direct sum for every operand layout (A read in place or packed,
    /// B's rows or columns contiguous, views with offsets and padded strides, odd depths and
    /// depths past a block): small integers, so every order of the f32 sums is exact.
    #[test]
    fn every_layout_gives_the_exact_product() {
        if !dot_products_pay() {
            return;
        }
        let val = |i: usize| bf16::from_f32(((i * 7919) % 11) as f32 - 5.0);
        for (m, n, k) in [(29, 40, 64), (14, 32, 9), (45, 70, 515), (3, 5, 2)] {
            let data: Vec<bf16> = (0..(m + 3) * (k + 5) + (k + 5) * (n + 3) + 64).map(val).collect();
            // (off, rs, cs) per operand: row-major padded, column-major padded.
            let a_views = [(3, k + 2, 1), (5, 1, m + 1)];
            let b_views = [(7, n + 3, 1), (2, 1, k + 4)];
            for &(ao, ars, acs) in &a_views {
                for &(bo, brs, bcs) in &b_views {
                    let a = Mat {
                        data: &data,
                        off: ao,
                        rs: ars,
                        cs: acs,
                    };
                    let b = Mat {
                        data: &data,
                        off: bo,
                        rs: brs,
                        cs: bcs,
                    };
                    let mut c = vec![1f32; m * n];
                    gemm(m, n, k, a, b, &mut c, n, true);
                    for i in 0..m {
                        for j in 0..n {
                            let want: f32 =
                                1.0 + (0..k).map(|p| a.at(i, p).to_f32() * b.at(p, j).to_f32()).sum::<f32>();
                            assert_eq!(
                                c[i * n + j],
                                want,
                                "{m}x{n}x{k} a=({ao},{ars},{acs}) b=({bo},{brs},{bcs}) at {i},{j}"
                            );
                        }
                    }
                }
            }
        }
    }
}
