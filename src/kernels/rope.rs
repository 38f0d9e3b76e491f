//! The rotary position embedding inside the fused attention, forward and backward, as one
//! pass over `(b, h, t, d)` in f32.
//!
//! Composed from candle ops, a rotation is about seven passes over the heads (the cast,
//! two broadcast products, the halves' `narrow`/`neg`/`cat`, the sum), each a fresh
//! tensor: on Zen 4 they were about a tenth of a Llama step at O2. Here each value is
//! computed with the composed ops' arithmetic in their order (two products, each rounded,
//! then their sum or difference; Rust never contracts them into an FMA), so the results are
//! the composed ones bit for bit, compiled per instruction set through
//! [`dispatch`](super::dispatch).
//!
//! Two table layouts, told apart by their width: `d` is candle's `rope` (the halves of the
//! head rotated together, `x cos + rotate_half(x) sin`), `d / 2` is candle's `rope_i`
//! (interleaved pairs `(x[2i], x[2i+1])`).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::dispatch::{Kernel, dispatch};
use super::simd::Elem;
use super::slices::{Vx, convert};

/// A half slice widened to f32 (exact), with the crate's per-tier conversion.
fn widen<T: Elem + Vx>(v: &[T]) -> Vec<f32> {
    let mut w = vec![0f32; v.len()];
    convert(v, &mut w);
    w
}

/// Which way the rotation runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Direction {
    /// The embedding: `y = R x`.
    Forward,
    /// Its gradient: `dx = R^T g`.
    Backward,
}

/// The op: the tables `(t, w)` as f32 rows, for heads of `d` values (`w = d` or `d / 2`).
struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    t: usize,
    w: usize,
    d: usize,
    dir: Direction,
}

/// `x` `(b, h, t, d)` (f32, f16 or bf16, on the CPU) rotated by the f32 tables `cos`, `sin`
/// `(t, d)` or `(t, d / 2)` in f32, returned in f32. `None` where this pass does not apply
/// (another device or table type, a shape it does not know): the caller composes the ops.
pub(super) fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, dir: Direction) -> Result<Option<Tensor>> {
    let Ok((_, _, t, d)) = x.dims4() else {
        return Ok(None);
    };
    let tables_fit = |c: &Tensor| {
        c.dtype() == DType::F32
            && c.device().is_cpu()
            && c.dims2().is_ok_and(|(ct, w)| ct == t && (w == d || 2 * w == d))
    };
    let x_fits = x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !x_fits || d % 2 != 0 || !tables_fit(cos) || !tables_fit(sin) || cos.dims() != sin.dims() {
        return Ok(None);
    }
    let w = cos.dim(1)?;
    let flat = |c: &Tensor| c.flatten_all()?.to_vec1::<f32>();
    let op = Rope {
        cos: flat(cos)?,
        sin: flat(sin)?,
        t,
        w,
        d,
        dir,
    };
    Ok(Some(super::dense(x)?.apply_op1_no_bwd(&op)?))
}

/// One pass over every row of the heads.
struct Pass<'a> {
    x: &'a [f32],
    out: &'a mut [f32],
    op: &'a Rope,
}

impl Kernel for Pass<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Rope { cos, sin, t, w, d, dir } = self.op;
        let (t, w, d) = (*t, *w, *d);
        for (r, (x, y)) in self.x.chunks_exact(d).zip(self.out.chunks_exact_mut(d)).enumerate() {
            let i = r % t;
            let (c, s) = (&cos[i * w..(i + 1) * w], &sin[i * w..(i + 1) * w]);
            if w == d {
                halves(x, y, c, s, *dir);
            } else {
                pairs(x, y, c, s, *dir);
            }
        }
    }
}

/// candle's `rope` layout: forward `y = x c + rotate_half(x) s` with
/// `rotate_half([x1, x2]) = [-x2, x1]`; backward `dx = g c + [z2, -z1]` with `z = g s`.
#[inline(always)]
fn halves(x: &[f32], y: &mut [f32], c: &[f32], s: &[f32], dir: Direction) {
    let h = x.len() / 2;
    let (x1, x2) = x.split_at(h);
    let (y1, y2) = y.split_at_mut(h);
    let (c1, c2) = c.split_at(h);
    let (s1, s2) = s.split_at(h);
    match dir {
        Direction::Forward => {
            for j in 0..h {
                y1[j] = x1[j] * c1[j] + -x2[j] * s1[j];
                y2[j] = x2[j] * c2[j] + x1[j] * s2[j];
            }
        }
        Direction::Backward => {
            for j in 0..h {
                y1[j] = x1[j] * c1[j] + x2[j] * s2[j];
                y2[j] = x2[j] * c2[j] + -(x1[j] * s1[j]);
            }
        }
    }
}

/// candle's `rope_i` layout, pair `(x0, x1)` with `c`, `s` of its index: forward
/// `(x0 c - x1 s, x0 s + x1 c)`; backward `(g0 c + g1 s, g1 c - g0 s)`.
#[inline(always)]
fn pairs(x: &[f32], y: &mut [f32], c: &[f32], s: &[f32], dir: Direction) {
    for (i, (x, y)) in x.chunks_exact(2).zip(y.chunks_exact_mut(2)).enumerate() {
        let (x0, x1) = (x[0], x[1]);
        match dir {
            Direction::Forward => {
                y[0] = x0 * c[i] - x1 * s[i];
                y[1] = x0 * s[i] + x1 * c[i];
            }
            Direction::Backward => {
                y[0] = x0 * c[i] + x1 * s[i];
                y[1] = x1 * c[i] - x0 * s[i];
            }
        }
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "amp-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, e) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("amp-rope: the input must be contiguous".into()))?;
        let x: std::borrow::Cow<'_, [f32]> = match s {
            CpuStorage::F32(v) => std::borrow::Cow::Borrowed(&v[a..e]),
            CpuStorage::F16(v) => std::borrow::Cow::Owned(widen(&v[a..e])),
            CpuStorage::BF16(v) => std::borrow::Cow::Owned(widen(&v[a..e])),
            other => candle_core::bail!("amp-rope: {:?} input", other.dtype()),
        };
        let mut out = vec![0f32; x.len()];
        if !x.is_empty() {
            dispatch(Pass {
                x: &x,
                out: &mut out,
                op: self,
            });
        }
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}
