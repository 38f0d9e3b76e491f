//! The row loops of the norms, compiled per tier (see `dispatch`): the forward, the input
//! gradient and the weight and bias sums.

use super::super::dispatch::{Kernel, LANES, reduce};
use super::super::simd::Elem;
use super::super::slices::{Vx, convert_serial as convert};
use super::Norm;

/// `y = x̂ * w + b` for whole rows of `w.len()` values, on the calling thread, compiled per
/// tier; rows are widened to f32 and rounded back with the vectorised slice conversions.
pub(super) struct ForwardRows<'a, T> {
    pub(super) norm: Norm,
    pub(super) x: &'a [T],
    pub(super) y: &'a mut [T],
    pub(super) w: &'a [f32],
    pub(super) b: &'a [f32],
}

impl<T: Elem + Vx> Kernel for ForwardRows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let n = self.w.len();
        let mut buf = vec![0f32; n];
        for (xr, yr) in self.x.chunks(n).zip(self.y.chunks_mut(n)) {
            convert(xr, &mut buf);
            let (mean, rstd) = self.norm.stats(&buf);
            for ((v, w), b) in buf.iter_mut().zip(self.w).zip(self.b) {
                *v = (*v - mean) * rstd * w + b;
            }
            convert(&buf, yr);
        }
    }
}

/// `dx` for whole rows of `w.len()` values (as [`ForwardRows`]).
pub(super) struct GradXRows<'a, T> {
    pub(super) norm: Norm,
    pub(super) x: &'a [T],
    pub(super) dy: &'a [T],
    pub(super) dx: &'a mut [T],
    pub(super) w: &'a [f32],
}

impl<T: Elem + Vx> Kernel for GradXRows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let n = self.w.len();
        let (mut xb, mut gb) = (vec![0f32; n], vec![0f32; n]);
        let rows = self.x.chunks(n).zip(self.dy.chunks(n));
        for ((xr, dyr), dxr) in rows.zip(self.dx.chunks_mut(n)) {
            convert(xr, &mut xb);
            convert(dyr, &mut gb);
            let (mean, rstd) = self.norm.stats(&xb);
            let (sg, sgh) = normalise_and_sum(&mut xb, &mut gb, self.w, mean, rstd);
            let nf = n as f32;
            let (mg, mgh) = (if self.norm.center { sg / nf } else { 0.0 }, sgh / nf);
            for (gv, h) in gb.iter_mut().zip(&xb) {
                *gv = rstd * (*gv - mg - h * mgh);
            }
            convert(&gb, dxr);
        }
    }
}

/// In place, `x = x̂ = (x - mean) * rstd` and `g = dy * w`; returns `(Σ g, Σ g * x̂)` as lane
/// sums (see `dispatch`).
#[inline(always)]
fn normalise_and_sum(x: &mut [f32], g: &mut [f32], w: &[f32], mean: f32, rstd: f32) -> (f32, f32) {
    let (mut sg, mut sgh) = ([0f32; LANES], [0f32; LANES]);
    let mut xc = x.chunks_exact_mut(LANES);
    let mut gc = g.chunks_exact_mut(LANES);
    let mut wc = w.chunks_exact(LANES);
    for ((x, g), w) in (&mut xc).zip(&mut gc).zip(&mut wc) {
        // Arrays, not slices: whole vectors, no bounds checks.
        let x: &mut [f32; LANES] = x.try_into().expect("a whole chunk");
        let g: &mut [f32; LANES] = g.try_into().expect("a whole chunk");
        let w: &[f32; LANES] = w.try_into().expect("a whole chunk");
        for l in 0..LANES {
            x[l] = (x[l] - mean) * rstd;
            g[l] *= w[l];
            sg[l] += g[l];
            sgh[l] += g[l] * x[l];
        }
    }
    let (mut tg, mut tgh) = (0f32, 0f32);
    let rest = xc
        .into_remainder()
        .iter_mut()
        .zip(gc.into_remainder())
        .zip(wc.remainder());
    for ((x, g), w) in rest {
        *x = (*x - mean) * rstd;
        *g *= w;
        tg += *g;
        tgh += *g * *x;
    }
    (reduce(&sg, tg), reduce(&sgh, tgh))
}

/// `[Σ dy * x̂, Σ dy]` over whole rows of `n` values (as [`ForwardRows`]).
pub(super) struct GradWbRows<'a, T> {
    pub(super) norm: Norm,
    pub(super) x: &'a [T],
    pub(super) dy: &'a [T],
    pub(super) n: usize,
}

impl<T: Elem + Vx> Kernel for GradWbRows<'_, T> {
    type Output = Vec<f32>;
    #[inline(always)]
    fn run(self) -> Vec<f32> {
        let n = self.n;
        let mut acc = vec![0f32; 2 * n];
        let (mut xb, mut gb) = (vec![0f32; n], vec![0f32; n]);
        for (xr, dyr) in self.x.chunks(n).zip(self.dy.chunks(n)) {
            convert(xr, &mut xb);
            convert(dyr, &mut gb);
            let (mean, rstd) = self.norm.stats(&xb);
            let (dw, db) = acc.split_at_mut(n);
            for (((dw, db), g), x) in dw.iter_mut().zip(db.iter_mut()).zip(&gb).zip(&xb) {
                *dw += g * ((x - mean) * rstd);
                *db += g;
            }
        }
        acc
    }
}
