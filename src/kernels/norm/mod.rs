//! Layer and RMS normalisation over the last dimension as one op each, with a backward of
//! two ops (Apex's FusedLayerNorm). Each row is widened to f32, its statistics and the affine
//! transform computed in f32, and the result rounded once to the input's type; the weight
//! and bias may be of any float type (f32 masters with half activations at O2).
//!
//! Written as tensor ops (candle's fused `layer_norm` has no backward), a layer norm is about
//! ten graph nodes, half-precision casts around them, and a weight and bias gradient that
//! candle reduces over the leading dimensions with a strided loop. Here:
//!
//! * forward: `y = (x - mean) * rstd * w + b`, `rstd = 1 / sqrt(var + eps)` (biased
//!   variance, as PyTorch); RMS norm drops the mean (`rstd = 1 / sqrt(mean(x²) + eps)`);
//! * input gradient, per row: `dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))` with
//!   `g = dy * w` and `x̂ = (x - mean) * rstd` (RMS: no `mean(g)` term);
//! * weight and bias gradients: `Σ dy * x̂` and `Σ dy` over the rows, in f32, per chunk of
//!   rows in parallel, then added.
//!
//! The statistics are recomputed in the backward instead of kept (two f32 values per row
//! would outlive the step in the graph; recomputing is one pass over a row in cache).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::dispatch::{dispatch, sum_lanes};
use super::simd::Elem;
use super::slices::{Vx, convert_serial as convert};

/// Rows per parallel task, at least: below this many values a task is not worth it.
const TASK_VALUES: usize = 1 << 14;

fn contiguous(l: &Layout, what: &str) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("amp-norm: {what} must be contiguous")))
}

/// A weight or bias as f32 values (they are small: one per column).
fn widen_param(s: &CpuStorage, l: &Layout, n: usize, what: &str) -> Result<Vec<f32>> {
    let (a, b) = contiguous(l, what)?;
    if b - a != n {
        candle_core::bail!("amp-norm: the {what} has {} values for rows of {n}", b - a)
    }
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::F16(v) => widen(&v[a..b]),
        CpuStorage::BF16(v) => widen(&v[a..b]),
        other => candle_core::bail!("amp-norm: {what} of type {:?}", other.dtype()),
    })
}

/// `v` as f32 values, through the vectorised conversion.
fn widen<T: Elem + Vx>(v: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    convert(v, &mut out);
    out
}

/// The normalisation's parameters: `center` for layer norm (RMS norm when false).
#[derive(Clone, Copy)]
struct Norm {
    eps: f32,
    center: bool,
}

impl Norm {
    /// `(mean, rstd)` of a row in f32 (mean 0 for RMS norm). The sums are lane sums (see
    /// `dispatch`): vectorised, and the same on every tier.
    #[inline(always)]
    fn stats(&self, r: &[f32]) -> (f32, f32) {
        let n = r.len() as f32;
        let mean = if self.center { sum_lanes(r, |v| v) / n } else { 0.0 };
        let var = sum_lanes(r, |v| (v - mean) * (v - mean)) / n;
        (mean, 1.0 / (var + self.eps).sqrt())
    }

    /// Rows per task so that a task has about [`TASK_VALUES`] values.
    fn rows_per_task(n: usize) -> usize {
        (TASK_VALUES / n.max(1)).max(1)
    }

    fn forward<T: Elem + Vx>(&self, x: &[T], n: usize, w: Option<&[f32]>, b: Option<&[f32]>) -> Vec<T> {
        let mut out = vec![T::from_f32(0.0); x.len()];
        // No rows or empty ones: nothing to normalise (and rows of 0 cannot be chunked).
        if x.is_empty() {
            return out;
        }
        // A missing weight multiplies by 1 and a missing bias adds 0, as slices: the row loop
        // then has no per-value branch (and the same arithmetic as with them).
        let (ones, zeros);
        let w = match w {
            Some(w) => w,
            None => {
                ones = vec![1f32; n];
                &ones
            }
        };
        let b = match b {
            Some(b) => b,
            None => {
                zeros = vec![0f32; n];
                &zeros
            }
        };
        self.split(x, &mut out, n, |x, y| {
            dispatch(ForwardRows {
                norm: *self,
                x,
                y,
                w,
                b,
            })
        });
        out
    }

    /// Runs `f` over whole rows, in parallel when the pool and the size allow.
    fn split<T: Send + Sync, U: Send>(&self, x: &[T], y: &mut [U], n: usize, f: impl Fn(&[T], &mut [U]) + Sync) {
        let task = Self::rows_per_task(n) * n;
        if x.len() > 2 * task && rayon::current_num_threads() > 1 {
            x.par_chunks(task)
                .zip(y.par_chunks_mut(task))
                .for_each(|(a, b)| f(a, b));
        } else {
            f(x, y);
        }
    }

    fn grad_x<T: Elem + Vx>(&self, x: &[T], dy: &[T], n: usize, w: Option<&[f32]>) -> Vec<T> {
        let mut out = vec![T::from_f32(0.0); x.len()];
        if x.is_empty() {
            return out;
        }
        let task = Self::rows_per_task(n) * n;
        let ones;
        let w = match w {
            Some(w) => w,
            None => {
                ones = vec![1f32; n];
                &ones
            }
        };
        let run = |x, dy, dx| {
            dispatch(GradXRows {
                norm: *self,
                x,
                dy,
                dx,
                w,
            })
        };
        if x.len() > 2 * task && rayon::current_num_threads() > 1 {
            x.par_chunks(task)
                .zip(dy.par_chunks(task))
                .zip(out.par_chunks_mut(task))
                .for_each(|((x, dy), dx)| run(x, dy, dx));
        } else {
            run(x, dy, &mut out);
        }
        out
    }

    /// `[Σ dy * x̂, Σ dy]` over the rows, as `2 * n` f32 values.
    fn grad_wb<T: Elem + Vx>(&self, x: &[T], dy: &[T], n: usize) -> Vec<f32> {
        if x.is_empty() {
            return vec![0f32; 2 * n];
        }
        let task = Self::rows_per_task(n) * n;
        let run = |x, dy| dispatch(GradWbRows { norm: *self, x, dy, n });
        let add = |mut a: Vec<f32>, b: Vec<f32>| {
            for (p, q) in a.iter_mut().zip(&b) {
                *p += q;
            }
            a
        };
        if x.len() > 2 * task && rayon::current_num_threads() > 1 {
            x.par_chunks(task)
                .zip(dy.par_chunks(task))
                .map(|(x, dy)| run(x, dy))
                .reduce(|| vec![0f32; 2 * n], add)
        } else {
            run(x, dy)
        }
    }
}

mod rows;
use rows::{ForwardRows, GradWbRows, GradXRows};

/// Dispatches a function generic over the element type on an f32/f16/bf16 storage.
macro_rules! on_float {
    ($s:expr, $v:ident => $body:expr, $what:expr) => {
        match $s {
            CpuStorage::F32($v) => CpuStorage::F32($body),
            CpuStorage::F16($v) => CpuStorage::F16($body),
            CpuStorage::BF16($v) => CpuStorage::BF16($body),
            other => candle_core::bail!("amp-norm: {} of type {:?}", $what, other.dtype()),
        }
    };
}

/// The length of the rows. An empty last dimension is taken (the row loops are skipped: the
/// result and the gradients are empty, as the fallback's).
fn last_dim(l: &Layout) -> Result<usize> {
    l.shape()
        .dims()
        .last()
        .copied()
        .ok_or_else(|| candle_core::Error::Msg("amp-norm: the input needs at least one dimension".into()))
}

/// The forward op, over `x` and the parameters present (`w`, `b` in that order).
struct Fwd {
    norm: Norm,
    has_w: bool,
    has_b: bool,
}

impl Fwd {
    fn run(&self, x: (&CpuStorage, &Layout), params: &[(&CpuStorage, &Layout)]) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(x.1)?;
        let (a, b) = contiguous(x.1, "the input")?;
        let mut it = params.iter();
        let w = if self.has_w {
            let (s, l) = it.next().expect("weight");
            Some(widen_param(s, l, n, "weight")?)
        } else {
            None
        };
        let bias = if self.has_b {
            let (s, l) = it.next().expect("bias");
            Some(widen_param(s, l, n, "bias")?)
        } else {
            None
        };
        let (w, bias) = (w.as_deref(), bias.as_deref());
        let out = on_float!(x.0, v => self.norm.forward(&v[a..b], n, w, bias), "input");
        Ok((out, x.1.shape().clone()))
    }

    /// The gradients of `x` and of the parameters present.
    fn grads(&self, x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, dy: &Tensor) -> Result<Grads> {
        let dy = super::dense(dy)?;
        let want_params = w.is_some_and(|w| w.track_op()) || b.is_some_and(|b| b.track_op());
        let dx = if x.track_op() {
            Some(match w {
                Some(w) => x.apply_op3_no_bwd(w, &dy, &GradX(self.norm))?,
                None => x.apply_op2_no_bwd(&dy, &GradXNoW(self.norm))?,
            })
        } else {
            None
        };
        let (mut dw, mut db) = (None, None);
        if want_params {
            let wb = x.apply_op2_no_bwd(&dy, &GradWB(self.norm))?;
            if let Some(w) = w.filter(|w| w.track_op()) {
                dw = Some(super::cast(&wb.get(0)?.reshape(w.shape())?, w.dtype())?);
            }
            if let Some(b) = b.filter(|b| b.track_op()) {
                db = Some(super::cast(&wb.get(1)?.reshape(b.shape())?, b.dtype())?);
            }
        }
        let out = |g: Option<Tensor>| g.map(super::graph_grad::for_candle).transpose();
        Ok((out(dx)?, out(dw)?, out(db)?))
    }
}

type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// A layer norm's (`center`) or RMS norm's backward for a fused node that holds the norm
/// (`kernels::residual`): `dx` in `x`'s type where `want_x`, and `[Σ dy x̂, Σ dy]` (f32,
/// `(2, n)`) where `want_wb`, computed as the norm's own backward computes them; `x`, `w`,
/// `dy` dense.
pub(super) fn norm_bwd(
    x: &Tensor,
    w: Option<&Tensor>,
    dy: &Tensor,
    (eps, center): (f64, bool),
    want: (bool, bool),
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let norm = Norm {
        eps: eps as f32,
        center,
    };
    let dx = match (want.0, w) {
        (false, _) => None,
        (true, Some(w)) => Some(x.apply_op3_no_bwd(w, dy, &GradX(norm))?),
        (true, None) => Some(x.apply_op2_no_bwd(dy, &GradXNoW(norm))?),
    };
    let wb = if want.1 {
        Some(x.apply_op2_no_bwd(dy, &GradWB(norm))?)
    } else {
        None
    };
    Ok((dx, wb))
}

impl CustomOp1 for Fwd {
    fn name(&self) -> &'static str {
        "amp-norm"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.run((s, l), &[])
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.grads(x, None, None, dy)?.0)
    }
}

impl CustomOp2 for Fwd {
    fn name(&self) -> &'static str {
        "amp-norm"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.run((s1, l1), &[(s2, l2)])
    }
    fn bwd(&self, x: &Tensor, p: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Two arguments: the weight alone, or the bias alone.
        if self.has_w {
            let (dx, dw, _) = self.grads(x, Some(p), None, dy)?;
            Ok((dx, dw))
        } else {
            let (dx, _, db) = self.grads(x, None, Some(p), dy)?;
            Ok((dx, db))
        }
    }
}

impl CustomOp3 for Fwd {
    fn name(&self) -> &'static str {
        "amp-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.run((s1, l1), &[(s2, l2), (s3, l3)])
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.grads(x, Some(w), Some(b), dy)
    }
}

/// `dx` from `(x, w, dy)`.
struct GradX(Norm);

impl CustomOp3 for GradX {
    fn name(&self) -> &'static str {
        "amp-norm-grad-x"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l1)?;
        let w = widen_param(s2, l2, n, "weight")?;
        grad_x(&self.0, (s1, l1), (s3, l3), n, Some(&w))
    }
}

/// `dx` from `(x, dy)` (no weight).
struct GradXNoW(Norm);

impl CustomOp2 for GradXNoW {
    fn name(&self) -> &'static str {
        "amp-norm-grad-x"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        grad_x(&self.0, (s1, l1), (s2, l2), last_dim(l1)?, None)
    }
}

fn grad_x(
    norm: &Norm,
    x: (&CpuStorage, &Layout),
    dy: (&CpuStorage, &Layout),
    n: usize,
    w: Option<&[f32]>,
) -> Result<(CpuStorage, Shape)> {
    let ((a, b), (c, d)) = (contiguous(x.1, "the input")?, contiguous(dy.1, "the gradient")?);
    let out = match (x.0, dy.0) {
        (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(norm.grad_x(&x[a..b], &g[c..d], n, w)),
        (CpuStorage::F16(x), CpuStorage::F16(g)) => CpuStorage::F16(norm.grad_x(&x[a..b], &g[c..d], n, w)),
        (CpuStorage::BF16(x), CpuStorage::BF16(g)) => CpuStorage::BF16(norm.grad_x(&x[a..b], &g[c..d], n, w)),
        (x, g) => candle_core::bail!("amp-norm: input {:?} with gradient {:?}", x.dtype(), g.dtype()),
    };
    Ok((out, x.1.shape().clone()))
}

/// `[Σ dy * x̂, Σ dy]` (f32, shape `(2, n)`) from `(x, dy)`.
struct GradWB(Norm);

impl CustomOp2 for GradWB {
    fn name(&self) -> &'static str {
        "amp-norm-grad-wb"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l1)?;
        let ((a, b), (c, d)) = (contiguous(l1, "the input")?, contiguous(l2, "the gradient")?);
        let v = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => self.0.grad_wb(&x[a..b], &g[c..d], n),
            (CpuStorage::F16(x), CpuStorage::F16(g)) => self.0.grad_wb(&x[a..b], &g[c..d], n),
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => self.0.grad_wb(&x[a..b], &g[c..d], n),
            (x, g) => candle_core::bail!("amp-norm: input {:?} with gradient {:?}", x.dtype(), g.dtype()),
        };
        Ok((CpuStorage::F32(v), Shape::from((2, n))))
    }
}

fn fast(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// The same maths as tensor ops (other devices and types, and the plain path): statistics in
/// f32 (f64 stays f64), the normalised value in the input's type, then the affine transform
/// in that type.
fn plain(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64, center: bool) -> Result<Tensor> {
    use candle_core::D;
    let orig = x.dtype();
    let xw = if fast(orig) { x.to_dtype(DType::F32)? } else { x.clone() };
    let c = if center {
        xw.broadcast_sub(&xw.mean_keepdim(D::Minus1)?)?
    } else {
        xw
    };
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    let y = c.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(orig)?;
    let y = match w {
        Some(w) => y.broadcast_mul(&w.to_dtype(orig)?)?,
        None => y,
    };
    match b {
        Some(b) => y.broadcast_add(&b.to_dtype(orig)?),
        None => Ok(y),
    }
}

fn norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64, center: bool) -> Result<Tensor> {
    let on_cpu = x.device().is_cpu() && w.is_none_or(|w| w.device().is_cpu()) && b.is_none_or(|b| b.device().is_cpu());
    let types = fast(x.dtype()) && w.is_none_or(|w| fast(w.dtype())) && b.is_none_or(|b| fast(b.dtype()));
    // On CUDA the fused kernels (kernels/cuda/norm.cu), where they load.
    #[cfg(feature = "cuda")]
    if super::enabled()
        && types
        && let Some(y) = super::cuda::norm::norm(x, w, b, eps, center)?
    {
        return Ok(y);
    }
    if !(super::enabled() && on_cpu && types && x.rank() >= 1) {
        return plain(x, w, b, eps, center);
    }
    let n = x.dims()[x.rank() - 1];
    for (p, what) in [(w, "weight"), (b, "bias")] {
        if let Some(p) = p
            && p.elem_count() != n
        {
            candle_core::bail!(
                "amp-norm: the {what} has shape {:?}; it needs {n} values, one per element of the last dimension",
                p.shape()
            )
        }
    }
    let x = super::dense(x)?;
    let (w, b) = (w.map(super::dense).transpose()?, b.map(super::dense).transpose()?);
    let op = Fwd {
        norm: Norm {
            eps: eps as f32,
            center,
        },
        has_w: w.is_some(),
        has_b: b.is_some(),
    };
    let grad = x.track_op() || w.as_ref().is_some_and(|w| w.track_op()) || b.as_ref().is_some_and(|b| b.track_op());
    match (w, b, grad) {
        (None, None, true) => x.apply_op1(op),
        (None, None, false) => x.apply_op1_no_bwd(&op),
        (Some(p), None, true) | (None, Some(p), true) => x.apply_op2(&p, op),
        (Some(p), None, false) | (None, Some(p), false) => x.apply_op2_no_bwd(&p, &op),
        (Some(w), Some(b), true) => x.apply_op3(&w, &b, op),
        (Some(w), Some(b), false) => x.apply_op3_no_bwd(&w, &b, &op),
    }
}

/// Layer normalisation over the last dimension, `(x - mean) / sqrt(var + eps) * w + b`
/// (biased variance, as PyTorch's `layer_norm`), differentiable, as one op with its own
/// backward (Apex's FusedLayerNorm). On the CPU, for f32, f16 and bf16 inputs, statistics and
/// the affine transform are computed in f32 and the result is rounded once to the input's
/// type; `w` and `b` (one value per element of the last dimension) may have any of those
/// types, and their gradients come back in their own types. Other devices and types, and
/// [`plain`](super::plain) threads, compute the same maths as tensor ops. Any layout of each
/// argument is taken; an empty last dimension gives the empty result (and empty gradients),
/// as the fallback does.
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{DType, Device, Tensor, Var};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[1f32, 2., 3., 6.]], &Device::Cpu)?.to_dtype(DType::BF16)?;
/// let w = Var::new(&[1f32, 1., 2., 2.], &Device::Cpu)?;
/// let y = kernels::layer_norm(&x, Some(&w), None, 1e-5)?;
/// assert_eq!(y.dtype(), DType::BF16);
/// // mean 3, variance 3.5: (6 - 3) / sqrt(3.5) * 2 = 3.207..., 3.203125 in bf16
/// assert_eq!(y.to_dtype(DType::F32)?.to_vec2::<f32>()?[0][3], 3.203125);
/// let g = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
/// assert_eq!(g.get(&w).unwrap().dtype(), DType::F32);
/// # Ok(()) }
/// ```
pub fn layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    norm(x, w, b, eps, true)
}

/// RMS normalisation over the last dimension, `x / sqrt(mean(x²) + eps) * w`,
/// differentiable, as one op with its own backward; the same types and precision as
/// [`layer_norm`].
pub fn rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    norm(x, w, None, eps, false)
}
