//! SwiGLU's pointwise ops fused, bit for bit the separate ones: the forward's activation
//! and product in one pass ([`SiluGate`]), the backward's activation, two products and
//! activation gradient in one ([`SiluGateGrad`], one `exp` per value for the activation and
//! its derivative). Each intermediate is rounded to the half type in a block on the stack
//! where its own op would store it, so only the passes over memory and the repeated
//! conversions go, not the roundings.

use candle_core::{CpuStorage, DType, Result, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::super::dispatch::{Kernel, dispatch, split_zip, worth_splitting};
use super::super::simd::Elem;
use super::super::slices::{Vx, convert_serial as convert};
use super::{BLOCK, CHUNK, on_values, silu_f32, silu_parts, storage_tensor, values};

/// Rounds each value of `v` to `T` and back (what storing it in `T` and reading it again
/// gives), through `t` (at least as long as `v`).
#[inline(always)]
fn round_through<T: Elem + Vx>(v: &mut [f32], t: &mut [T]) {
    let t = &mut t[..v.len()];
    convert(v, t);
    convert(&*t, v);
}

/// SwiGLU's product `p = silu(g) * u` in one pass per block of values: the activation
/// rounded to `T` in between, as its own op stores it, then the product rounded once, as
/// `mul` rounds it; bit for bit `mul(&activate(g), u)`, without the activation's tensor.
struct SiluGate<'a, T> {
    g: &'a [T],
    u: &'a [T],
    p: &'a mut [T],
}

impl<T: Elem + Vx> Kernel for SiluGate<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (mut bx, mut by) = ([0f32; BLOCK], [0f32; BLOCK]);
        let mut t = [T::from_f32(0.0); BLOCK];
        let blocks = self.g.chunks(BLOCK).zip(self.u.chunks(BLOCK));
        for ((gc, uc), pc) in blocks.zip(self.p.chunks_mut(BLOCK)) {
            let n = gc.len();
            let (x, y) = (&mut bx[..n], &mut by[..n]);
            convert(gc, x);
            convert(uc, y);
            for v in x.iter_mut() {
                *v = silu_f32(*v);
            }
            round_through(x, &mut t);
            for (v, w) in x.iter_mut().zip(y.iter()) {
                *v *= w;
            }
            convert(x, pc);
        }
    }
}

/// SwiGLU's backward at the product in one pass per block: from `gp` (the product's
/// gradient), `g` and `u`, the gradients `gu = gp * silu(g)` and `gg = (gp * u) * silu'(g)`,
/// each intermediate rounded to `T` where its own op stores it (the activation, `gp * u`),
/// the sigmoid computed once for the activation and its derivative. Bit for bit the
/// unfused `activate`, two `mul`s and `act_grad`, with one of their two `exp`s gone and two
/// hidden-width tensors (the activation, `gp * u`) never written.
struct SiluGateGrad<'a, T> {
    gp: &'a [T],
    g: &'a [T],
    u: &'a [T],
    gu: &'a mut [T],
    gg: &'a mut [T],
}

impl<T: Elem + Vx> Kernel for SiluGateGrad<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let mut b = [[0f32; BLOCK]; 5];
        let mut t = [T::from_f32(0.0); BLOCK];
        let ins = self
            .gp
            .chunks(BLOCK)
            .zip(self.g.chunks(BLOCK))
            .zip(self.u.chunks(BLOCK));
        let outs = self.gu.chunks_mut(BLOCK).zip(self.gg.chunks_mut(BLOCK));
        for (((pc, gc), uc), (guc, ggc)) in ins.zip(outs) {
            let n = pc.len();
            let [p, x, y, a, d] = &mut b;
            let (p, x, y, a, d) = (&mut p[..n], &mut x[..n], &mut y[..n], &mut a[..n], &mut d[..n]);
            convert(pc, p);
            convert(gc, x);
            convert(uc, y);
            for ((x, a), d) in x.iter().zip(a.iter_mut()).zip(d.iter_mut()) {
                (*a, *d) = silu_parts(*x);
            }
            round_through(a, &mut t);
            // gu = gp * a, rounded once.
            for (a, p) in a.iter_mut().zip(p.iter()) {
                *a *= p;
            }
            convert(&*a, guc);
            // ga = gp * u, stored rounded; gg = ga * silu'(g), rounded once.
            for (y, p) in y.iter_mut().zip(p.iter()) {
                *y *= p;
            }
            round_through(y, &mut t);
            for (d, y) in d.iter_mut().zip(y.iter()) {
                *d *= y;
            }
            convert(&*d, ggc);
        }
    }
}

/// [`SiluGate`] over slices, blocks of [`CHUNK`] values over the rayon pool.
fn silu_gate_slices<T: Elem + Vx>(g: &[T], u: &[T]) -> Vec<T> {
    let mut p = vec![T::from_f32(0.0); g.len()];
    split_zip(g, u, &mut p, CHUNK, |g, u, p| SiluGate { g, u, p });
    p
}

/// [`SiluGateGrad`] over slices, blocks of [`CHUNK`] values over the rayon pool.
fn silu_gate_grad_slices<T: Elem + Vx>(gp: &[T], g: &[T], u: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut gu, mut gg) = (vec![T::from_f32(0.0); gp.len()], vec![T::from_f32(0.0); gp.len()]);
    if worth_splitting(gp.len(), CHUNK) {
        let ins = gp.par_chunks(CHUNK).zip(g.par_chunks(CHUNK)).zip(u.par_chunks(CHUNK));
        let outs = gu.par_chunks_mut(CHUNK).zip(gg.par_chunks_mut(CHUNK));
        ins.zip(outs)
            .for_each(|(((gp, g), u), (gu, gg))| dispatch(SiluGateGrad { gp, g, u, gu, gg }));
    } else {
        dispatch(SiluGateGrad {
            gp,
            g,
            u,
            gu: &mut gu,
            gg: &mut gg,
        });
    }
    (gu, gg)
}

/// `silu(g) * u` as one pass ([`SiluGate`]): bit for bit `mul(&activate(g, Silu), u)`.
pub(super) fn silu_gate(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    fn run<T: Elem + Vx>(v: &[(&CpuStorage, (usize, usize))]) -> Option<Vec<T>> {
        Some(silu_gate_slices(values::<T>(v[0])?, values::<T>(v[1])?))
    }
    let out = on_values(&[g, u], "amp-swiglu", |v| match g.dtype() {
        DType::F32 => run::<f32>(v).map(CpuStorage::F32),
        DType::F16 => run::<f16>(v).map(CpuStorage::F16),
        DType::BF16 => run::<bf16>(v).map(CpuStorage::BF16),
        _ => None,
    })?;
    storage_tensor(out, g.shape())
}

/// `(gu, gg)`, the gradients at up's and gate's outputs for the product's gradient `gp`, as
/// one pass ([`SiluGateGrad`]): bit for bit the unfused `activate`, `mul`s and `act_grad`.
pub(super) fn silu_gate_grads(gp: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    fn run<T: Elem + Vx>(v: &[(&CpuStorage, (usize, usize))]) -> Option<(Vec<T>, Vec<T>)> {
        Some(silu_gate_grad_slices(
            values::<T>(v[0])?,
            values::<T>(v[1])?,
            values::<T>(v[2])?,
        ))
    }
    let (gu, gg) = on_values(&[gp, g, u], "amp-swiglu-grad", |v| match g.dtype() {
        DType::F32 => run::<f32>(v).map(|(a, b)| (CpuStorage::F32(a), CpuStorage::F32(b))),
        DType::F16 => run::<f16>(v).map(|(a, b)| (CpuStorage::F16(a), CpuStorage::F16(b))),
        DType::BF16 => run::<bf16>(v).map(|(a, b)| (CpuStorage::BF16(a), CpuStorage::BF16(b))),
        _ => None,
    })?;
    Ok((storage_tensor(gu, g.shape())?, storage_tensor(gg, g.shape())?))
}
