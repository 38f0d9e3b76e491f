//! The matrix product the library uses: `C (m x n, f32) = A (m x k) . B (k x n)`, or
//! `C += A . B`, with f32 accumulation whatever the input type.
//!
//! * f32: the `gemm` crate, whose AVX-512 kernel this crate enables (its `x86-v4` feature;
//!   cargo unifies it into candle's own `gemm`, so candle's matmul gets it too).
//! * f16: both operands widened to f32 (memory speed, `O(mk + kn)`), then the f32 product.
//!   f16 has no faster exact path on these CPUs: AVX-512 FP16 arithmetic accumulates in f16.
//! * bf16: AMX tiles where the CPU has them and the OS grants them (`tdpbf16ps`, 16 x 16 x 32
//!   multiply-adds per instruction); else AVX-512 BF16 dot products (`vdpbf16ps`) in a packed
//!   14 x 32 micro-kernel where they are faster than f32 FMAs (AMD Zen 4; not Intel Sapphire
//!   Rapids, which issues them at half the FMA rate: measured once per process, see
//!   `bf16_gemm::dot_products_pay`), else on that tier widened to f32 with the instructions'
//!   flushing; else widened to f32 like f16. Both instructions flush subnormal inputs and
//!   results to zero (the widened path of the lower tiers keeps them), a difference between
//!   tiers users can see (`kernels::bf16_products_flush_subnormals`).
//! * tiny products (`m*n*k` below a few thousand): a direct loop, since packing costs more
//!   than it saves.
//!
//! Operands are strided views (`rs`, `cs` in elements), so transposed operands need no copy.

// The products keep the BLAS signature (m, n, k, a, b, c, ldc, acc), as the `gemm` crate's.
#![allow(clippy::too_many_arguments)]

use half::{bf16, f16};

use super::isa::{Isa, current};
use super::mat::Mat;
use super::simd::Elem;
use super::slices::{Vx, convert};

/// Element types the product takes.
pub(crate) trait GemmElem: Elem + Vx {
    /// `c (m x n, row stride ldc) (+)= a . b`.
    fn gemm(m: usize, n: usize, k: usize, a: Mat<'_, Self>, b: Mat<'_, Self>, c: &mut [f32], ldc: usize, acc: bool);
}

fn threads() -> usize {
    rayon::current_num_threads()
}

/// Tiny products: a direct loop over f32 copies (the inner loop vectorises). The operands
/// may differ in type ([`gemm_wide_lhs`] passes an f32 left one).
fn small<A: Elem + Vx, B: Elem + Vx>(
    m: usize,
    n: usize,
    k: usize,
    a_view: Mat<'_, A>,
    b_view: Mat<'_, B>,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
) {
    if m == 0 || n == 0 || k == 0 {
        if !acc {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(0.0);
            }
        }
        return;
    }
    // Copies into this thread's scratch (grown once, never zero-filled again). m*n*k <= SMALL
    // bounds m*k and k*n by SMALL too.
    let mut run = |ab: &mut Vec<f32>, bb: &mut Vec<f32>| {
        ab.resize(ab.len().max(m * k), 0.0);
        bb.resize(bb.len().max(k * n), 0.0);
        let (a, b) = (&mut ab[..m * k], &mut bb[..k * n]);
        a_view.widen_into(m, k, a);
        b_view.widen_into(k, n, b);
        small_f32(m, n, k, a, b, c, ldc, acc)
    };
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => {
            let (sa, sb) = &mut *s;
            run(sa, sb)
        }
        Err(_) => run(&mut Vec::new(), &mut Vec::new()),
    })
}

/// The direct loop over row-major f32 copies (the inner loop vectorises).
fn small_f32(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c: &mut [f32], ldc: usize, acc: bool) {
    for i in 0..m {
        let row = &mut c[i * ldc..i * ldc + n];
        if !acc {
            row.fill(0.0);
        }
        for p in 0..k {
            let aip = a[i * k + p];
            for (cj, bj) in row.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                *cj += aip * bj;
            }
        }
    }
}

/// The largest `m * n * k` the direct loop takes.
const SMALL: usize = 4096;

fn is_small(m: usize, n: usize, k: usize) -> bool {
    m * n * k <= SMALL || m == 0 || n == 0 || k == 0
}

/// The f32 product through the `gemm` crate.
fn gemm_f32(m: usize, n: usize, k: usize, a: Mat<'_, f32>, b: Mat<'_, f32>, c: &mut [f32], ldc: usize, acc: bool) {
    if k == 0 {
        if !acc {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(0.0);
            }
        }
        return;
    }
    if m == 0 || n == 0 {
        return;
    }
    assert!(c.len() >= (m - 1) * ldc + n, "gemm: output too small");
    assert!(
        a.off + (m - 1) * a.rs + (k - 1) * a.cs < a.data.len(),
        "gemm: lhs out of bounds"
    );
    assert!(
        b.off + (k - 1) * b.rs + (n - 1) * b.cs < b.data.len(),
        "gemm: rhs out of bounds"
    );
    let par = match threads() {
        1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    };
    // SAFETY: every index the product touches was checked in bounds above; the output does
    // not alias the inputs (it is a distinct &mut).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            acc,
            a.data.as_ptr().add(a.off),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.off),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

impl GemmElem for f32 {
    fn gemm(m: usize, n: usize, k: usize, a: Mat<'_, f32>, b: Mat<'_, f32>, c: &mut [f32], ldc: usize, acc: bool) {
        if is_small(m, n, k) {
            return small(m, n, k, a, b, c, ldc, acc);
        }
        gemm_f32(m, n, k, a, b, c, ldc, acc)
    }
}

thread_local! {
    /// Widened operands, reused across calls on this thread (no allocation, no page faults).
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// The span of a view: offsets `[lo, hi)` its elements lie in, when they fill it densely
/// (row-major, column-major or any transposed contiguous block).
fn dense_span<T>(v: &Mat<'_, T>, rows: usize, cols: usize) -> Option<(usize, usize)> {
    let extent = (rows - 1) * v.rs + (cols - 1) * v.cs + 1;
    let dense = (v.cs == 1 && v.rs == cols) || (v.rs == 1 && v.cs == rows) || rows == 1 || cols == 1;
    (dense && extent == rows * cols).then_some((v.off, v.off + extent))
}

/// The strides of a dense view once its span is copied out as one slice (what [`widen`]
/// gives the product).
fn dense_strides<T>(v: &Mat<'_, T>, rows: usize, cols: usize) -> (usize, usize) {
    (if rows == 1 { cols } else { v.rs }, if cols == 1 { 1 } else { v.cs })
}

/// Widens a view into `buf` and returns the f32 view with the same layout (dense blocks are
/// converted as one slice at memory speed; other views are gathered row-major). A dense f32
/// view that is not flushed is already what the product takes: its span, not copied.
fn widen<'b, T: Elem + Vx>(
    v: &Mat<'b, T>,
    rows: usize,
    cols: usize,
    buf: &'b mut Vec<f32>,
    flush: bool,
) -> Mat<'b, f32> {
    if !flush
        && let Some((lo, hi)) = dense_span(v, rows, cols)
        && let Some(data) = super::simd::retyped::<T, f32>(&v.data[lo..hi])
    {
        let (rs, cs) = dense_strides(v, rows, cols);
        return Mat { data, off: 0, rs, cs };
    }
    // Grown, never cleared: every value used is overwritten below, so no zero-fill pass.
    if buf.len() < rows * cols {
        buf.resize(rows * cols, 0.0);
    }
    let dst = &mut buf[..rows * cols];
    let (rs, cs) = match dense_span(v, rows, cols) {
        Some((lo, hi)) => {
            convert(&v.data[lo..hi], dst);
            dense_strides(v, rows, cols)
        }
        None => {
            v.widen_into(rows, cols, dst);
            (cols, 1)
        }
    };
    if flush {
        // Every value of the view is in `dst` once (dense or gathered).
        flush_subnormals(dst);
    }
    Mat {
        data: dst,
        off: 0,
        rs,
        cs,
    }
}

/// Widens both operands to f32 (same layouts) and runs the f32 product. With `flush`,
/// subnormal inputs and results become zero (sign kept), as the bf16 dot-product
/// instructions make them: the AVX-512 BF16 tier's product where `vdpbf16ps` is the slower
/// path (see [`super::bf16_gemm::dot_products_pay`]), so the tier's results do not depend on
/// which path it takes.
fn widened<A: Elem + Vx, B: Elem + Vx>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, A>,
    b: Mat<'_, B>,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
    flush: bool,
) {
    let mut run = |sa: &mut Vec<f32>, sb: &mut Vec<f32>| {
        let av = widen(&a, m, k, sa, flush);
        let bv = widen(&b, k, n, sb, flush);
        gemm_f32(m, n, k, av, bv, c, ldc, acc);
        if flush && n > 0 {
            for i in 0..m {
                flush_subnormals(&mut c[i * ldc..i * ldc + n]);
            }
        }
    };
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => {
            let (sa, sb) = &mut *s;
            run(sa, sb)
        }
        // Re-entered on this thread (rayon ran another product while this one waits inside
        // the parallel gemm): fresh buffers.
        Err(_) => run(&mut Vec::new(), &mut Vec::new()),
    })
}

/// Whether `T`'s product on the active tier is the plain widened one: both operands widened
/// exactly, then the f32 product (f16 on every tier; bf16 where it has no dot products). A
/// caller may then widen an operand itself, once for several products ([`gemm_wide_lhs`]).
pub(crate) fn widens_plainly<T: 'static>() -> bool {
    let id = std::any::TypeId::of::<T>();
    if id == std::any::TypeId::of::<f16>() {
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(current(), Isa::Amx | Isa::Avx512Bf16) {
        return false;
    }
    id == std::any::TypeId::of::<bf16>()
}

/// `c (+)= a . b` with `a` already widened to f32, bit for bit as `T::gemm` on `a`'s half
/// values where [`widens_plainly::<T>`] holds: the same f32 views reach the same product.
pub(crate) fn gemm_wide_lhs<T: Elem + Vx>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, f32>,
    b: Mat<'_, T>,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
) {
    if is_small(m, n, k) {
        return small(m, n, k, a, b, c, ldc, acc);
    }
    widened(m, n, k, a, b, c, ldc, acc, false)
}

/// Subnormal values set to zero of the same sign, compiled per tier.
fn flush_subnormals(v: &mut [f32]) {
    super::dispatch::dispatch(Flush(v))
}

struct Flush<'a>(&'a mut [f32]);

impl super::dispatch::Kernel for Flush<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for v in self.0 {
            let b = v.to_bits();
            // Exponent zero (zero or subnormal): keep the sign only. Branch-free, so it
            // vectorises.
            let keep = ((b & 0x7F80_0000 != 0) as u32).wrapping_neg() | 0x8000_0000;
            *v = f32::from_bits(b & keep);
        }
    }
}

impl GemmElem for f16 {
    fn gemm(m: usize, n: usize, k: usize, a: Mat<'_, f16>, b: Mat<'_, f16>, c: &mut [f32], ldc: usize, acc: bool) {
        if is_small(m, n, k) {
            return small(m, n, k, a, b, c, ldc, acc);
        }
        widened(m, n, k, a, b, c, ldc, acc, false)
    }
}

impl GemmElem for bf16 {
    fn gemm(m: usize, n: usize, k: usize, a: Mat<'_, bf16>, b: Mat<'_, bf16>, c: &mut [f32], ldc: usize, acc: bool) {
        if is_small(m, n, k) {
            return small(m, n, k, a, b, c, ldc, acc);
        }
        #[cfg(target_arch = "x86_64")]
        match current() {
            Isa::Amx => return super::amx::gemm(m, n, k, a, b, c, ldc, acc),
            Isa::Avx512Bf16 if super::bf16_gemm::dot_products_pay() => {
                return super::bf16_gemm::gemm(m, n, k, a, b, c, ldc, acc);
            }
            // The same flushing as the dot products, at FMA speed.
            Isa::Avx512Bf16 => return widened(m, n, k, a, b, c, ldc, acc, true),
            _ => {}
        }
        widened(m, n, k, a, b, c, ldc, acc, false)
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(dead_code)]
fn _isa_used() -> Isa {
    current()
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX-512 BF16 tier takes the dot-product kernel or the widened flushing product,
    /// whichever is faster here: both must give the same values. Small integers times powers
    /// of two sum exactly in any order, so the two agree bit for bit, subnormal inputs and
    /// results (flushed by both) included, with and without accumulation.
    #[test]
    fn the_dot_product_kernel_and_the_widened_flushing_product_agree() {
        if !std::arch::is_x86_feature_detected!("avx512bf16") {
            return;
        }
        let tiny = f32::MIN_POSITIVE / 8.0; // subnormal, exact in bf16
        for (m, n, k) in [(40, 33, 64), (15, 70, 7), (100, 64, 513)] {
            let val = |i: usize| bf16::from_f32(((i * 7919) % 13) as f32 - 6.0);
            let mut a: Vec<bf16> = (0..m * k).map(val).collect();
            let mut b: Vec<bf16> = (0..k * n).map(|i| val(i + 5)).collect();
            a[0] = bf16::from_f32(tiny);
            // Row 1 of a is 2^-70 at column 0 and b's row 0 is 2^-70: products 2^-140.
            a[k] = bf16::from_f32(2f32.powi(-70));
            for v in &mut b[..n] {
                *v = bf16::from_f32(2f32.powi(-70));
            }
            // Row 2 of a is 2^-64 at column 0 and zero elsewhere: results 2^-134, subnormal.
            a[2 * k..3 * k].fill(bf16::ZERO);
            a[2 * k] = bf16::from_f32(2f32.powi(-64));
            let av = Mat {
                data: &a,
                off: 0,
                rs: k,
                cs: 1,
            };
            let bv = Mat {
                data: &b,
                off: 0,
                rs: n,
                cs: 1,
            };
            for acc in [false, true] {
                let start: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32).collect();
                let (mut dot, mut wide) = (start.clone(), start.clone());
                super::super::bf16_gemm::gemm(m, n, k, av, bv, &mut dot, n, acc);
                widened(m, n, k, av, bv, &mut wide, n, acc, true);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&dot), bits(&wide), "{m}x{n}x{k} acc={acc}");
                // The case is live: without the flush, row 2 keeps its subnormal results.
                let mut kept = start.clone();
                widened(m, n, k, av, bv, &mut kept, n, acc, false);
                assert_ne!(bits(&kept[2 * n..3 * n]), bits(&wide[2 * n..3 * n]));
            }
        }
    }
}
