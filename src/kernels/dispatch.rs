//! One loop body compiled per instruction set, picked at run time.
//!
//! The crate is built for baseline x86-64 (a dependent crate never sees our compile flags),
//! so a plain Rust loop is vectorised for SSE2 only. [`dispatch`] runs a [`Kernel`]'s body
//! inside a `#[target_feature]` function for the tier [`isa::current`] reports: the body is
//! `#[inline(always)]`, so the compiler inlines it into each wrapper and vectorises the same
//! source three times (AVX-512, AVX2 with FMA and F16C, and the baseline), and
//! [`force_isa`](super::force_isa) changes the code that really runs.
//!
//! The three copies compute the same operations in the same order: Rust never contracts
//! `a * b + c` into an FMA, and vector lanes of `+`, `*`, `/`, `sqrt` are IEEE like the scalar
//! forms, so the tiers agree bit for bit. Sums that the compiler would otherwise leave
//! sequential (it may not reorder float additions) go through [`sum_lanes`]: a fixed number
//! of partial sums, the same on every tier, so they vectorise and still agree.
//!
//! [`isa::current`]: super::isa::current

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::isa::{Isa, current};

/// A kernel's loop body, compiled once per tier by [`dispatch`].
///
/// Implementations mark [`Kernel::run`] `#[inline(always)]`, and what their hot loop calls
/// too (directly or through `#[inline(always)]` helpers): a call left out of line is
/// compiled once, for the baseline, and runs that code on every tier.
pub(crate) trait Kernel {
    /// What the body returns.
    type Output;
    /// The body.
    fn run(self) -> Self::Output;
}

/// Runs `k` compiled for the tier the kernels use now (AVX-512 from [`Isa::Avx512`] up, AVX2
/// at [`Isa::Avx2`], the baseline otherwise).
pub(crate) fn dispatch<K: Kernel>(k: K) -> K::Output {
    #[cfg(target_arch = "x86_64")]
    match current() {
        // SAFETY: a level is only reported when the CPU has its features (and every tier has
        // those of the tiers below), so the wrappers' features are present.
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => return unsafe { x86::avx512(k) },
        Isa::Avx2 => return unsafe { x86::avx2(k) },
        Isa::Portable => {}
    }
    k.run()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Kernel;

    /// `k`'s body compiled with AVX-512 (F, BW, VL), AVX2, FMA and F16C.
    ///
    /// # Safety
    /// The CPU has those features.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn avx512<K: Kernel>(k: K) -> K::Output {
        k.run()
    }

    /// `k`'s body compiled with AVX2, FMA and F16C.
    ///
    /// # Safety
    /// The CPU has those features.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2<K: Kernel>(k: K) -> K::Output {
        k.run()
    }
}

/// Whether `n` values are worth splitting into tasks of `chunk` over the rayon pool: more
/// than two tasks' worth, and more than one thread to run them.
pub(crate) fn worth_splitting(n: usize, chunk: usize) -> bool {
    n > 2 * chunk && rayon::current_num_threads() > 1
}

/// The kernel `make(src, dst)` builds, over equal-length slices: on pieces of `chunk` values
/// in rayon tasks where [`worth_splitting`], else once on the calling thread. Each piece runs
/// through [`dispatch`].
pub(crate) fn split_map<'a, S: Sync, D: Send, K: Kernel<Output = ()>>(
    src: &'a [S],
    dst: &'a mut [D],
    chunk: usize,
    make: impl Fn(&'a [S], &'a mut [D]) -> K + Sync + Send,
) {
    if worth_splitting(src.len(), chunk) {
        src.par_chunks(chunk)
            .zip(dst.par_chunks_mut(chunk))
            .for_each(|(s, d)| dispatch(make(s, d)));
    } else {
        dispatch(make(src, dst));
    }
}

/// [`split_map`] with two inputs: the kernel `make(a, b, dst)` builds, over equal-length
/// slices.
pub(crate) fn split_zip<'a, A: Sync, B: Sync, D: Send, K: Kernel<Output = ()>>(
    a: &'a [A],
    b: &'a [B],
    dst: &'a mut [D],
    chunk: usize,
    make: impl Fn(&'a [A], &'a [B], &'a mut [D]) -> K + Sync + Send,
) {
    if worth_splitting(a.len(), chunk) {
        a.par_chunks(chunk)
            .zip(b.par_chunks(chunk))
            .zip(dst.par_chunks_mut(chunk))
            .for_each(|((a, b), d)| dispatch(make(a, b, d)));
    } else {
        dispatch(make(a, b, dst));
    }
}

/// The partial sums of [`sum_lanes`]: two AVX-512 registers, four AVX2 ones, eight SSE2 ones
/// (several independent chains, so the adds are not bound by their latency).
pub(crate) const LANES: usize = 32;

/// `Σ f(x[i])` as [`LANES`] partial sums (sum `l` takes `i % LANES == l` of the whole
/// chunks), the rest summed in order, then [`reduce`]: the same order on every tier, so
/// it vectorises (a sum in index order cannot: float addition is not associative) and the
/// tiers still agree bit for bit.
#[inline(always)]
pub(crate) fn sum_lanes(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        // An array, not a slice: the compiler then sees whole vectors, with no bounds checks.
        let c: &[f32; LANES] = c.try_into().expect("a whole chunk");
        for l in 0..LANES {
            acc[l] += f(c[l]);
        }
    }
    let mut tail = 0f32;
    for v in chunks.remainder() {
        tail += f(*v);
    }
    reduce(&acc, tail)
}

/// `Σ a[i] * b[i]` as [`LANES`] partial sums, the rest in order, then [`reduce`]: the same
/// order on every tier, as [`sum_lanes`].
#[inline(always)]
pub(crate) fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut ca).zip(&mut cb) {
        let x: &[f32; LANES] = x.try_into().expect("a whole chunk");
        let y: &[f32; LANES] = y.try_into().expect("a whole chunk");
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    reduce(&acc, tail)
}

/// The partial sums added pairwise (halves, then quarters, ...), then `tail`. Out of line on
/// purpose: inlined after the loop, the compiler's vectoriser pairs the final additions with
/// the loop's and vectorises the loop two lanes wide.
#[inline(never)]
pub(crate) fn reduce(acc: &[f32; LANES], tail: f32) -> f32 {
    let mut a = *acc;
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            a[l] += a[l + w];
        }
    }
    a[0] + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sum<'a>(&'a [f32]);

    impl Kernel for Sum<'_> {
        type Output = f32;
        #[inline(always)]
        fn run(self) -> f32 {
            sum_lanes(self.0, |v| v * v)
        }
    }

    struct Dot<'a>(&'a [f32], &'a [f32]);

    impl Kernel for Dot<'_> {
        type Output = f32;
        #[inline(always)]
        fn run(self) -> f32 {
            dot_lanes(self.0, self.1)
        }
    }

    #[test]
    fn lane_dot_products_add_every_product_once() {
        for n in [0, 1, 31, 32, 33, 100, 1000] {
            let a: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
            let b: Vec<f32> = (0..n).map(|i| (i % 5) as f32 - 2.0).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            // Small integers: every order gives the exact sum.
            assert_eq!(dispatch(Dot(&a, &b)), want, "{n} values");
        }
    }

    #[test]
    fn lane_sums_add_every_value_once() {
        for n in [0, 1, 31, 32, 33, 100, 1000] {
            let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
            let want: f32 = x.iter().map(|v| v * v).sum();
            // Small integers: every order gives the exact sum.
            assert_eq!(dispatch(Sum(&x)), want, "{n} values");
        }
    }
}
