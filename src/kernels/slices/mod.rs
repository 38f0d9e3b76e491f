//! Kernels over raw slices, one pass each, per instruction set: type conversion,
//! unscale-and-check of a gradient, and the fused AdamW and SGD updates. The Tensor-level
//! operations in the sibling modules call these; they split large slices over the rayon pool.

use half::{bf16, f16};
use rayon::prelude::*;

use super::dispatch::{Kernel, dispatch};
use super::isa::{Isa, current};
use super::simd::{Elem, retyped, retyped_mut};
use crate::error::{AmpError, Result};

/// Slices longer than this are split over the rayon pool (when it has more than one thread).
pub(crate) const PAR_CHUNK: usize = 1 << 16;

/// Whether `n` values are worth splitting into tasks of [`PAR_CHUNK`].
pub(crate) fn parallel(n: usize) -> bool {
    super::dispatch::worth_splitting(n, PAR_CHUNK)
}

// ------------------------------------------------------------------------------- convert

/// `dst[i] = src[i]` converted (round to nearest even).
pub(crate) fn convert<S: Elem + Vx, D: Elem + Vx>(src: &[S], dst: &mut [D]) {
    assert_eq!(src.len(), dst.len(), "convert: lengths differ");
    if parallel(src.len()) {
        src.par_chunks(PAR_CHUNK)
            .zip(dst.par_chunks_mut(PAR_CHUNK))
            .for_each(|(s, d)| convert_serial(s, d));
    } else {
        convert_serial(src, dst);
    }
}

/// Whether `T` is f16 (a constant once monomorphised).
fn is_f16<T: 'static>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<f16>()
}

/// [`convert`] on the calling thread. Panics if the lengths differ (the vector paths write
/// `src.len()` values through `dst`'s pointer).
pub(crate) fn convert_serial<S: Elem + Vx, D: Elem + Vx>(src: &[S], dst: &mut [D]) {
    assert_eq!(src.len(), dst.len(), "convert: lengths differ");
    #[cfg(target_arch = "x86_64")]
    match current() {
        // SAFETY: the level is only reported when the CPU has its features.
        // f16 through 256-bit F16C even where 512-bit exists: measured here, 512-bit
        // `vcvtph2ps`/`vcvtps2ph` slowed the rest of an f16 training step by about 12%
        // (the example transformer at O2: 12.5 ms against 11.1 ms), for no gain in the
        // conversion itself, which runs at memory speed either way.
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx if !is_f16::<S>() && !is_f16::<D>() => {
            return unsafe { x86::convert512(src, dst) };
        }
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx | Isa::Avx2 => return unsafe { x86::convert256(src, dst) },
        // f16 <-> f32 in SSE2 blocks, bit for bit as the loop below (`simd::widen_f16`).
        Isa::Portable => {
            if let (Some(s), Some(d)) = (retyped::<S, f16>(src), retyped_mut::<D, f32>(dst)) {
                return super::simd::widen_f16(s, d);
            }
            if let (Some(s), Some(d)) = (retyped::<S, f32>(src), retyped_mut::<D, f16>(dst)) {
                return super::simd::narrow_f16(s, d);
            }
            // bf16 <-> f32 in SSE2 as well: `half`'s rounding branches per value on NaN,
            // which left the loop below scalar (a fifth of a bf16 step on this tier).
            if let (Some(s), Some(d)) = (retyped::<S, bf16>(src), retyped_mut::<D, f32>(dst)) {
                return super::simd::widen_bf16(s, d);
            }
            if let (Some(s), Some(d)) = (retyped::<S, f32>(src), retyped_mut::<D, bf16>(dst)) {
                return super::simd::narrow_bf16(s, d);
            }
        }
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::from_f32(s.to_f32());
    }
}

// ------------------------------------------------------------------------------- unscale

/// How a raw value becomes an unscaled f32 value (see `unscale.rs` for why).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unscale {
    /// The scale is 1.
    Identity,
    /// `g * inv` in f32 (PyTorch's arithmetic).
    Mul(f32),
    /// `g / scale` in f64: the f32 inverse is not finite.
    Div(f64),
}

impl Unscale {
    pub(crate) fn new(scale: f32) -> Self {
        let inv = (1.0f64 / scale as f64) as f32;
        if inv == 1.0 {
            Unscale::Identity
        } else if inv.is_finite() {
            Unscale::Mul(inv)
        } else {
            Unscale::Div(scale as f64)
        }
    }

    #[inline(always)]
    pub(crate) fn apply(self, g: f32) -> f32 {
        match self {
            Unscale::Identity => g,
            Unscale::Mul(inv) => g * inv,
            Unscale::Div(s) => (g as f64 / s) as f32,
        }
    }
}

/// `out[i] = unscale(raw[i])` (or `out[i] += ...` with `accumulate`); returns whether a raw
/// value, or a value written, is inf or NaN.
pub(crate) fn unscale<S: Elem + Vx>(raw: &[S], out: &mut [f32], u: Unscale, accumulate: bool) -> bool {
    assert_eq!(raw.len(), out.len(), "unscale: lengths differ");
    if parallel(raw.len()) {
        raw.par_chunks(PAR_CHUNK)
            .zip(out.par_chunks_mut(PAR_CHUNK))
            .map(|(r, o)| unscale_serial(r, o, u, accumulate))
            .reduce(|| false, |a, b| a | b)
    } else {
        unscale_serial(raw, out, u, accumulate)
    }
}

fn unscale_serial<S: Elem + Vx>(raw: &[S], out: &mut [f32], u: Unscale, acc: bool) -> bool {
    // The vector paths write `raw.len()` values through `out`'s pointer.
    assert_eq!(raw.len(), out.len(), "unscale: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if !matches!(u, Unscale::Div(_)) {
        let inv = match u {
            Unscale::Mul(inv) => inv,
            _ => 1.0,
        };
        match current() {
            // SAFETY: the level is only reported when the CPU has its features.
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => return unsafe { x86::unscale512(raw, out, inv, acc) },
            Isa::Avx2 => return unsafe { x86::unscale256(raw, out, inv, acc) },
            Isa::Portable => {}
        }
    }
    let mut bad = false;
    for (o, r) in out.iter_mut().zip(raw) {
        let g = r.to_f32();
        let v = if acc { *o + u.apply(g) } else { u.apply(g) };
        bad |= !g.is_finite() | !v.is_finite();
        *o = v;
    }
    bad
}

// ------------------------------------------------------------------------------- adamw

/// One AdamW step's constants for one parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The parameter's step number, counting this one (from 1).
    pub step: u64,
}

/// The f32 constants of an AdamW step, computed in f64 once (candle-nn's order of
/// operations: `p*(1-lr*wd) - lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)`).
#[derive(Clone, Copy)]
pub(crate) struct AdamWConsts {
    pub b1: f32,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    pub inv_bc1: f32,
    pub inv_bc2: f32,
    pub decay: f32,
    pub lr: f32,
    pub eps: f32,
}

impl AdamWConsts {
    pub(crate) fn new(s: &AdamWStep) -> Self {
        let t = s.step as f64;
        Self {
            b1: s.beta1 as f32,
            one_minus_b1: (1.0 - s.beta1) as f32,
            b2: s.beta2 as f32,
            one_minus_b2: (1.0 - s.beta2) as f32,
            inv_bc1: (1.0 / (1.0 - s.beta1.powf(t))) as f32,
            inv_bc2: (1.0 / (1.0 - s.beta2.powf(t))) as f32,
            decay: (1.0 - s.lr * s.weight_decay) as f32,
            lr: s.lr as f32,
            eps: s.eps as f32,
        }
    }

    /// One element, in the same order as the vector paths and candle-nn's AdamW.
    #[inline(always)]
    pub(crate) fn update(&self, p: f32, g: f32, m: &mut f32, v: &mut f32) -> f32 {
        let nm = self.b1 * *m + self.one_minus_b1 * g;
        let nv = self.b2 * *v + self.one_minus_b2 * (g * g);
        *m = nm;
        *v = nv;
        let mh = nm * self.inv_bc1;
        let vh = nv * self.inv_bc2;
        p * self.decay - (mh / (vh.sqrt() + self.eps)) * self.lr
    }
}

/// Where a fused optimizer step writes the parameter's half working copy, if anywhere.
pub enum HalfOut<'a> {
    /// No half copy (O0, O1).
    None,
    /// An f16 working copy of the same length.
    F16(&'a mut [f16]),
    /// A bf16 working copy of the same length.
    Bf16(&'a mut [bf16]),
}

impl HalfOut<'_> {
    /// The half copy's length, if there is one.
    fn len(&self) -> Option<usize> {
        match self {
            HalfOut::None => None,
            HalfOut::F16(h) => Some(h.len()),
            HalfOut::Bf16(h) => Some(h.len()),
        }
    }
}

impl std::fmt::Debug for HalfOut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HalfOut::None => "None",
            HalfOut::F16(_) => "F16",
            HalfOut::Bf16(_) => "Bf16",
        })
    }
}

/// A parameter as the fused update sees it: f32 values updated in place, or half values
/// read and written back (O3, no f32 master).
pub(crate) enum ParamSlice<'a, H> {
    F32(&'a mut [f32], Option<&'a mut [H]>),
    Half(&'a mut [H]),
}

/// One fused AdamW pass: updates `p`, `m`, `v` in place from `g` and writes the rounded new
/// values into `half`, split over the rayon pool for large parameters.
///
/// Returns [`AmpError::InvalidArgument`] (and writes nothing) when the slices (and the half
/// copy) differ in length, when `s.step` is 0 (steps count from 1: step 0's bias
/// correction divides by zero) or when a beta is outside `[0, 1)`.
///
/// ```
/// use candle_amp::kernels::{self, AdamWStep, HalfOut};
/// let (mut p, g, mut m, mut v) = (vec![1f32; 4], vec![0.5f32; 4], vec![0f32; 4], vec![0f32; 4]);
/// let mut s = AdamWStep { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1 };
/// kernels::adamw(&mut p, &g, &mut m, &mut v, HalfOut::None, &s)?;
/// assert!((p[0] - 0.9).abs() < 1e-6, "the first step moves by lr");
/// s.step = 0;
/// assert!(kernels::adamw(&mut p, &g, &mut m, &mut v, HalfOut::None, &s).is_err());
/// # Ok::<(), candle_amp::AmpError>(())
/// ```
pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], half: HalfOut<'_>, s: &AdamWStep) -> Result<()> {
    check_adamw(p.len(), g.len(), m.len(), v.len(), half.len(), s)?;
    let c = AdamWConsts::new(s);
    match half {
        HalfOut::None => adamw_param::<f16>(ParamSlice::F32(p, None), g, m, v, &c),
        HalfOut::F16(h) => adamw_param(ParamSlice::F32(p, Some(h)), g, m, v, &c),
        HalfOut::Bf16(h) => adamw_param(ParamSlice::F32(p, Some(h)), g, m, v, &c),
    }
    Ok(())
}

/// The checks of [`adamw`]: equal lengths (`half` `None` when there is no half copy), a
/// step from 1 and betas in `[0, 1)`.
fn check_adamw(p: usize, g: usize, m: usize, v: usize, half: Option<usize>, s: &AdamWStep) -> Result<()> {
    let invalid = |argument: &'static str, reason: String| Err(AmpError::InvalidArgument { argument, reason });
    for (argument, n) in [("g", g), ("m", m), ("v", v), ("half", half.unwrap_or(p))] {
        if n != p {
            return invalid(argument, format!("{n} values for a parameter of {p}"));
        }
    }
    if s.step == 0 {
        return invalid("step", "steps count from 1 (step 0 has no bias correction)".into());
    }
    for (argument, b) in [("beta1", s.beta1), ("beta2", s.beta2)] {
        if !(0.0..1.0).contains(&b) {
            return invalid(argument, format!("{b} is outside [0, 1)"));
        }
    }
    Ok(())
}

pub(crate) fn adamw_param<H: Elem + Vx>(
    p: ParamSlice<'_, H>,
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &AdamWConsts,
) {
    let n = g.len();
    assert!(m.len() == n && v.len() == n, "adamw: lengths differ");
    match p {
        ParamSlice::F32(p, h) => {
            assert_eq!(p.len(), n);
            match h {
                Some(h) => {
                    assert_eq!(h.len(), n);
                    if parallel(n) {
                        p.par_chunks_mut(PAR_CHUNK)
                            .zip(g.par_chunks(PAR_CHUNK))
                            .zip(m.par_chunks_mut(PAR_CHUNK))
                            .zip(v.par_chunks_mut(PAR_CHUNK))
                            .zip(h.par_chunks_mut(PAR_CHUNK))
                            .for_each(|((((p, g), m), v), h)| adamw_serial(p, g, m, v, Some(h), c));
                    } else {
                        adamw_serial(p, g, m, v, Some(h), c)
                    }
                }
                None => {
                    if parallel(n) {
                        p.par_chunks_mut(PAR_CHUNK)
                            .zip(g.par_chunks(PAR_CHUNK))
                            .zip(m.par_chunks_mut(PAR_CHUNK))
                            .zip(v.par_chunks_mut(PAR_CHUNK))
                            .for_each(|(((p, g), m), v)| adamw_serial::<f32, H>(p, g, m, v, None, c));
                    } else {
                        adamw_serial::<f32, H>(p, g, m, v, None, c)
                    }
                }
            }
        }
        ParamSlice::Half(p) => {
            assert_eq!(p.len(), n);
            if parallel(n) {
                p.par_chunks_mut(PAR_CHUNK)
                    .zip(g.par_chunks(PAR_CHUNK))
                    .zip(m.par_chunks_mut(PAR_CHUNK))
                    .zip(v.par_chunks_mut(PAR_CHUNK))
                    .for_each(|(((p, g), m), v)| adamw_serial::<H, H>(p, g, m, v, None, c));
            } else {
                adamw_serial::<H, H>(p, g, m, v, None, c)
            }
        }
    }
}

/// `p` is updated in place (f32, or half at O3); `h` gets the rounded copy when given.
/// Panics if the lengths differ (the vector paths write `p.len()` values through every
/// pointer).
fn adamw_serial<P: Elem + Vx, H: Elem + Vx>(
    p: &mut [P],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: Option<&mut [H]>,
    c: &AdamWConsts,
) {
    let n = p.len();
    let same = g.len() == n && m.len() == n && v.len() == n && h.as_ref().is_none_or(|h| h.len() == n);
    assert!(same, "adamw: lengths differ");
    #[cfg(target_arch = "x86_64")]
    match current() {
        // SAFETY: the level is only reported when the CPU has its features.
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => return unsafe { x86::adamw512(p, g, m, v, h, c) },
        Isa::Avx2 => return unsafe { x86::adamw256(p, g, m, v, h, c) },
        Isa::Portable => {}
    }
    // Zipped slices: no bounds checks in the loop, so it vectorises (with SSE2 on the
    // portable tier; indexed, the f16 loop ran about 4x slower than the f32 one).
    let pgmv = p.iter_mut().zip(g).zip(m.iter_mut().zip(v.iter_mut()));
    match h {
        Some(h) => {
            for (((p, g), (m, v)), h) in pgmv.zip(h.iter_mut()) {
                let np = c.update(p.to_f32(), *g, m, v);
                *p = P::from_f32(np);
                *h = H::from_f32(np);
            }
        }
        None => {
            for ((p, g), (m, v)) in pgmv {
                let np = c.update(p.to_f32(), *g, m, v);
                *p = P::from_f32(np);
            }
        }
    }
}

// ------------------------------------------------------------------------------- sgd

/// One SGD step's constants (PyTorch's `torch.optim.SGD`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SgdConsts {
    pub lr: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    pub one_minus_dampening: f32,
    pub nesterov: bool,
    /// The first step with momentum: the buffer starts as the gradient.
    pub first: bool,
}

impl SgdConsts {
    /// One value's update, with the step's flags as constants (`DECAY`: a weight decay other
    /// than 0; `FIRST` and `NESTEROV` as the fields): the loop calling it is then straight-line
    /// code the compiler vectorises, where a per-value test of the fields kept the AVX2 loop
    /// scalar.
    #[inline(always)]
    fn update<const DECAY: bool, const FIRST: bool, const NESTEROV: bool>(
        &self,
        p: f32,
        g: f32,
        buf: Option<&mut f32>,
    ) -> f32 {
        let mut d = if DECAY { g + p * self.weight_decay } else { g };
        if let Some(b) = buf {
            let nb = if FIRST {
                d
            } else {
                self.momentum * *b + self.one_minus_dampening * d
            };
            *b = nb;
            d = if NESTEROV { d + nb * self.momentum } else { nb };
        }
        p - d * self.lr
    }
}

/// Values per block of the SGD update: widened to f32 on the stack, updated, narrowed back.
const SGD_BLOCK: usize = 512;

/// One fused SGD pass (momentum optional), compiled per tier (see `dispatch`): the same
/// operations in the same order on each, so they agree bit for bit.
pub(crate) fn sgd_param<H: Elem + Vx>(p: ParamSlice<'_, H>, g: &[f32], buf: Option<&mut [f32]>, c: &SgdConsts) {
    match p {
        ParamSlice::F32(p, h) => dispatch(Sgd { p, g, buf, h, c }),
        ParamSlice::Half(p) => dispatch(Sgd::<H, H> { p, g, buf, h: None, c }),
    }
}

/// The SGD update of `p` (and its half copy `h`) on the calling thread.
struct Sgd<'a, P, H> {
    p: &'a mut [P],
    g: &'a [f32],
    buf: Option<&'a mut [f32]>,
    h: Option<&'a mut [H]>,
    c: &'a SgdConsts,
}

impl<P: Elem + Vx, H: Elem + Vx> Kernel for Sgd<'_, P, H> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Sgd {
            p,
            g,
            mut buf,
            mut h,
            c,
        } = self;
        let n = p.len();
        let same = g.len() == n && buf.as_ref().is_none_or(|b| b.len() == n) && h.as_ref().is_none_or(|h| h.len() == n);
        assert!(same, "sgd: lengths differ");
        // f32 values are updated where they are; half ones in f32 blocks, through the
        // vectorised slice conversions (a per-value `half` conversion is an out-of-line call
        // in a baseline build).
        if let Some(p) = retyped_mut::<_, f32>(p) {
            sgd_block(p, g, buf, c);
            if let Some(h) = h {
                convert_serial(p, h);
            }
            return;
        }
        let mut pb = [0f32; SGD_BLOCK];
        for start in (0..n).step_by(SGD_BLOCK) {
            let end = (start + SGD_BLOCK).min(n);
            let f = &mut pb[..end - start];
            convert_serial(&p[start..end], f);
            sgd_block(f, &g[start..end], buf.as_deref_mut().map(|b| &mut b[start..end]), c);
            convert_serial(f, &mut p[start..end]);
            if let Some(h) = h.as_deref_mut() {
                convert_serial(f, &mut h[start..end]);
            }
        }
    }
}

/// The SGD update of f32 values in place (lengths checked by the caller), through the loop
/// for this step's flags.
#[inline(always)]
fn sgd_block(p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>, c: &SgdConsts) {
    match (c.weight_decay != 0.0, c.first, c.nesterov) {
        (false, false, false) => sgd_loop::<false, false, false>(p, g, buf, *c),
        (false, false, true) => sgd_loop::<false, false, true>(p, g, buf, *c),
        (false, true, false) => sgd_loop::<false, true, false>(p, g, buf, *c),
        (false, true, true) => sgd_loop::<false, true, true>(p, g, buf, *c),
        (true, false, false) => sgd_loop::<true, false, false>(p, g, buf, *c),
        (true, false, true) => sgd_loop::<true, false, true>(p, g, buf, *c),
        (true, true, false) => sgd_loop::<true, true, false>(p, g, buf, *c),
        (true, true, true) => sgd_loop::<true, true, true>(p, g, buf, *c),
    }
}

/// [`sgd_block`] for one combination of flags. `c` by value: held in registers, where
/// through a reference the compiler reloads it after every store (the stores might alias it
/// as far as it can tell once inlined).
#[inline(always)]
fn sgd_loop<const DECAY: bool, const FIRST: bool, const NESTEROV: bool>(
    p: &mut [f32],
    g: &[f32],
    buf: Option<&mut [f32]>,
    c: SgdConsts,
) {
    match buf {
        Some(b) => {
            for ((p, g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                *p = c.update::<DECAY, FIRST, NESTEROV>(*p, *g, Some(b));
            }
        }
        None => {
            for (p, g) in p.iter_mut().zip(g) {
                *p = c.update::<DECAY, FIRST, NESTEROV>(*p, *g, None);
            }
        }
    }
}

// ------------------------------------------------------------------------------- x86

/// Types with vector loads and stores on x86 (every [`Elem`]); a marker elsewhere.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Vx: super::simd::x86::V16 + super::simd::x86::V8 {}
#[cfg(target_arch = "x86_64")]
impl<T: super::simd::x86::V16 + super::simd::x86::V8> Vx for T {}
/// Types with vector loads and stores on x86 (every [`Elem`]); a marker elsewhere.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait Vx {}
#[cfg(not(target_arch = "x86_64"))]
impl<T> Vx for T {}

/// The vector paths.
///
/// # Safety
/// Every function needs the target features it enables, and each slice it is given at least
/// as long as its first slice argument (it writes that many values through raw pointers):
/// the safe wrappers in this module check both (the level comes from `isa::current`,
/// lengths are asserted equal).
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn convert_serial_checks_lengths_before_writing() {
        // The destination is a prefix of a larger buffer, so an unchecked write past it would
        // go unnoticed (no crash) instead of panicking.
        let src = vec![1f32; 64];
        let mut big = vec![bf16::ZERO; 128];
        convert_serial(&src, &mut big[..32]);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn the_serial_adamw_checks_lengths_before_writing() {
        let s = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
        };
        let c = AdamWConsts::new(&s);
        let (mut p, g) = (vec![0f32; 64], vec![0f32; 64]);
        let (mut m, mut v) = (vec![0f32; 128], vec![0f32; 128]);
        adamw_serial::<f32, f16>(&mut p, &g, &mut m[..32], &mut v, None, &c);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn the_serial_unscale_checks_lengths_before_writing() {
        let raw = vec![1f32; 64];
        let mut out = vec![0f32; 128];
        unscale_serial(&raw, &mut out[..32], Unscale::Identity, false);
    }
}
