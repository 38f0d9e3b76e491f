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
        if !std::arch::is_x86_feature_detected!("avx512bf16") {
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

#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
}

/// Packs B's block `[k0, k0+2*kp) x [n0, n0+nc)` into strips of NR columns.
fn pack_b(b: &Mat<'_, bf16>, k: usize, k0: usize, kp: usize, n0: usize, nc: usize, out: &mut Vec<u32>) {
    let strips = nc.div_ceil(NR);
    out.clear();
    out.resize(strips * kp * NR, 0);
    let get = |r: usize, c: usize| {
        if r < k {
            b.data[b.off + r * b.rs + c * b.cs]
        } else {
            bf16::ZERO
        }
    };
    for s in 0..strips {
        let base = s * kp * NR;
        let cols = NR.min(nc - s * NR);
        for p in 0..kp {
            let r = k0 + 2 * p;
            let dst = &mut out[base + p * NR..base + p * NR + cols];
            for (j, w) in dst.iter_mut().enumerate() {
                let c = n0 + s * NR + j;
                *w = pair(get(r, c), get(r + 1, c));
            }
        }
    }
}

/// Packs A's block `[m0, m0+mc) x [k0, k0+2*kp)` into panels of MR rows.
fn pack_a(a: &Mat<'_, bf16>, k: usize, m0: usize, mc: usize, k0: usize, kp: usize, out: &mut Vec<u32>) {
    let panels = mc.div_ceil(MR);
    out.clear();
    out.resize(panels * kp * MR, 0);
    let get = |r: usize, c: usize| {
        if c < k {
            a.data[a.off + r * a.rs + c * a.cs]
        } else {
            bf16::ZERO
        }
    };
    for q in 0..panels {
        let base = q * kp * MR;
        let rows = MR.min(mc - q * MR);
        for p in 0..kp {
            let c = k0 + 2 * p;
            for i in 0..rows {
                let r = m0 + q * MR + i;
                out[base + p * MR + i] = pair(get(r, c), get(r, c + 1));
            }
        }
    }
}

/// The 14 x 32 tile `c` (row stride `ldc`) `+=` (or `=`) panel `a` . strip `b` over `kp`
/// depth pairs.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(kp: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
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
            let ap = a.add(p * MR);
            for i in 0..MR {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(i) as i32));
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
    let mut ap = Vec::new();
    pack_a(a, k, m0, mc, k0, kp, &mut ap);
    let mut tile = [0f32; MR * NR];
    for s in 0..nc.div_ceil(NR) {
        let cols = NR.min(nc - s * NR);
        let strip = &bp[s * kp * NR..(s + 1) * kp * NR];
        for q in 0..mc.div_ceil(MR) {
            let rows = MR.min(mc - q * MR);
            let panel = &ap[q * kp * MR..(q + 1) * kp * MR];
            let r0 = q * MR;
            let c0 = n0 + s * NR;
            if rows == MR && cols == NR {
                assert!((r0 + MR - 1) * ldc + c0 + NR <= c.len());
                // SAFETY: the tile lies inside `c` (checked above), the panels hold kp pairs,
                // and the CPU has AVX-512 BF16 (checked by the caller).
                unsafe {
                    kernel(
                        kp,
                        panel.as_ptr(),
                        strip.as_ptr(),
                        c.as_mut_ptr().add(r0 * ldc + c0),
                        ldc,
                        load,
                    )
                }
            } else {
                // Edge tile: through a full-size scratch tile.
                for i in 0..rows {
                    for j in 0..cols {
                        tile[i * NR + j] = if load { c[(r0 + i) * ldc + c0 + j] } else { 0.0 };
                    }
                }
                // SAFETY: as above, on the local scratch tile.
                unsafe { kernel(kp, panel.as_ptr(), strip.as_ptr(), tile.as_mut_ptr(), NR, true) }
                for i in 0..rows {
                    for j in 0..cols {
                        c[(r0 + i) * ldc + c0 + j] = tile[i * NR + j];
                    }
                }
            }
        }
    }
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
    let mut bp = Vec::new();
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
}
