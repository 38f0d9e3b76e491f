//! The matrix product the library uses: `C (m x n, f32) = A (m x k) . B (k x n)`, or
//! `C += A . B`, with f32 accumulation whatever the input type.
//!
//! * f32: the `gemm` crate, whose AVX-512 kernel this crate enables (its `x86-v4` feature;
//!   cargo unifies it into candle's own `gemm`, so candle's matmul gets it too).
//! * f16: both operands widened to f32 (memory speed, `O(mk + kn)`), then the f32 product.
//!   f16 has no faster exact path on these CPUs: AVX-512 FP16 arithmetic accumulates in f16.
//! * bf16: AMX tiles where the CPU has them and the OS grants them (`tdpbf16ps`, 16 x 16 x 32
//!   multiply-adds per instruction); else AVX-512 BF16 dot products (`vdpbf16ps`) in a packed
//!   14 x 32 micro-kernel; else widened to f32 like f16. Both instructions flush subnormal
//!   inputs and results to zero (the widened path keeps them), a difference between tiers
//!   users can see (`kernels::bf16_products_flush_subnormals`).
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

/// Tiny products: a direct loop over f32 copies (the inner loop vectorises).
fn small<T: Elem + Vx>(
    m: usize,
    n: usize,
    k: usize,
    a_view: Mat<'_, T>,
    b_view: Mat<'_, T>,
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

/// Widens a view into `buf` and returns the f32 view with the same layout (dense blocks are
/// converted as one slice at memory speed; other views are gathered row-major).
fn widen<'b, T: Elem + Vx>(v: &Mat<'_, T>, rows: usize, cols: usize, buf: &'b mut Vec<f32>) -> Mat<'b, f32> {
    // Grown, never cleared: every value used is overwritten below, so no zero-fill pass.
    if buf.len() < rows * cols {
        buf.resize(rows * cols, 0.0);
    }
    let dst = &mut buf[..rows * cols];
    match dense_span(v, rows, cols) {
        Some((lo, hi)) => {
            convert(&v.data[lo..hi], dst);
            Mat {
                data: dst,
                off: 0,
                rs: if rows == 1 { cols } else { v.rs },
                cs: if cols == 1 { 1 } else { v.cs },
            }
        }
        None => {
            v.widen_into(rows, cols, dst);
            Mat {
                data: dst,
                off: 0,
                rs: cols,
                cs: 1,
            }
        }
    }
}

/// Widens both operands to f32 (same layouts) and runs the f32 product.
fn widened<T: Elem + Vx>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
) {
    let mut run = |sa: &mut Vec<f32>, sb: &mut Vec<f32>| {
        let av = widen(&a, m, k, sa);
        let bv = widen(&b, k, n, sb);
        gemm_f32(m, n, k, av, bv, c, ldc, acc)
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

impl GemmElem for f16 {
    fn gemm(m: usize, n: usize, k: usize, a: Mat<'_, f16>, b: Mat<'_, f16>, c: &mut [f32], ldc: usize, acc: bool) {
        if is_small(m, n, k) {
            return small(m, n, k, a, b, c, ldc, acc);
        }
        widened(m, n, k, a, b, c, ldc, acc)
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
            Isa::Avx512Bf16 => return super::bf16_gemm::gemm(m, n, k, a, b, c, ldc, acc),
            _ => {}
        }
        widened(m, n, k, a, b, c, ldc, acc)
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(dead_code)]
fn _isa_used() -> Isa {
    current()
}
