//! Matrix products as candle custom ops with their own backward, over [`super::gemm`]:
//! a batched `matmul` (one product per batch entry, entries split over the rayon pool) and a
//! fused `linear` (`x w^T + b` in one op: one product each for the output, the input
//! gradient and the weight gradient, transposes as strides instead of copies, the bias added
//! and its gradient summed in f32). Inputs of one op share a type (f32, f16 or bf16); products
//! accumulate in f32 and results are rounded once to that type.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::gemm::GemmElem;
use super::mat::Mat;
use super::simd::Elem;
use super::slices::convert;

/// A strided matrix stack: the last two dims of a layout, batch dims flattened.
#[derive(Clone)]
struct Stack {
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
    /// Offset of each batch entry's (0, 0) element.
    offsets: Vec<usize>,
}

impl Stack {
    fn of(l: &Layout, transpose: bool) -> Result<Self> {
        let dims = l.dims();
        let st = l.stride();
        let r = dims.len();
        if r < 2 {
            candle_core::bail!("matmul: operands need rank >= 2, got {dims:?}")
        }
        let batch: usize = dims[..r - 2].iter().product();
        let mut offsets = Vec::with_capacity(batch);
        for bi in 0..batch {
            let mut rem = bi;
            let mut off = l.start_offset();
            for d in (0..r - 2).rev() {
                off += (rem % dims[d]) * st[d];
                rem /= dims[d];
            }
            offsets.push(off);
        }
        let (rows, cols, rs, cs) = (dims[r - 2], dims[r - 1], st[r - 2], st[r - 1]);
        Ok(if transpose {
            Stack {
                rows: cols,
                cols: rows,
                rs: cs,
                cs: rs,
                offsets,
            }
        } else {
            Stack {
                rows,
                cols,
                rs,
                cs,
                offsets,
            }
        })
    }

    fn mat<'a, T>(&self, data: &'a [T], i: usize) -> Mat<'a, T> {
        Mat {
            data,
            off: self.offsets[i],
            rs: self.rs,
            cs: self.cs,
        }
    }
}

/// The f32 products `out[b] = a[b] . b[b]` (m x n each, contiguous), batch entries over the
/// rayon pool.
fn products<T: GemmElem>(a: &[T], sa: &Stack, b: &[T], sb: &Stack, out: &mut [f32]) {
    let (m, k, n) = (sa.rows, sa.cols, sb.cols);
    // Zero-sized products: nothing to compute (m or n is 0), or a sum over nothing (k is 0):
    // zeros (`out` may be scratch).
    if out.is_empty() || k == 0 {
        out.fill(0.0);
        return;
    }
    let run = |(i, o): (usize, &mut [f32])| T::gemm(m, n, k, sa.mat(a, i), sb.mat(b, i), o, n, false);
    if sa.offsets.len() > 1 && rayon::current_num_threads() > 1 {
        out.par_chunks_mut(m * n).enumerate().for_each(run);
    } else {
        out.chunks_mut(m * n).enumerate().for_each(run);
    }
}

/// `f32` values rounded into a fresh storage of `dt` (f16 or bf16).
fn half_storage_of(v: &[f32], dt: DType) -> Result<CpuStorage> {
    Ok(match dt {
        DType::F16 => {
            let mut d = vec![f16::ZERO; v.len()];
            convert(v, &mut d);
            CpuStorage::F16(d)
        }
        DType::BF16 => {
            let mut d = vec![bf16::ZERO; v.len()];
            convert(v, &mut d);
            CpuStorage::BF16(d)
        }
        other => candle_core::bail!("matmul: unsupported type {other:?}"),
    })
}

/// A result of `len` values of `dt` that `f` computes in f32 (writing every value): an f32
/// result is the buffer itself; a half one is rounded from this thread's scratch
/// (`scratch`), so the f32 accumulation is not a fresh allocation each call.
pub(super) fn f32_result(len: usize, dt: DType, f: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<CpuStorage> {
    if dt == DType::F32 {
        let mut v = vec![0f32; len];
        f(&mut v)?;
        return Ok(CpuStorage::F32(v));
    }
    super::scratch::with_f32(len, |buf| {
        f(buf)?;
        half_storage_of(buf, dt)
    })
}

pub(super) fn supported(dt: DType) -> bool {
    matches!(dt, DType::F32 | DType::F16 | DType::BF16)
}

/// Batched `op(a) . op(b)`, where `op` transposes the last two dims when asked.
struct Bmm {
    ta: bool,
    tb: bool,
    /// The result in f32, not rounded to the inputs' type: a gradient kept for the doctor,
    /// or a weight gradient that goes straight into an f32 master gradient.
    f32_out: bool,
}

impl CustomOp2 for Bmm {
    fn name(&self) -> &'static str {
        "amp-matmul"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (sa, sb) = (Stack::of(l1, self.ta)?, Stack::of(l2, self.tb)?);
        if sa.cols != sb.rows || sa.offsets.len() != sb.offsets.len() {
            candle_core::bail!("amp-matmul: shapes {:?} and {:?} do not multiply", l1.dims(), l2.dims())
        }
        let batch = sa.offsets.len();
        let dt = if self.f32_out { DType::F32 } else { s1.dtype() };
        let len = batch * sa.rows * sb.cols;
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => f32_result(len, dt, |o| {
                products(a, &sa, b, &sb, o);
                Ok(())
            })?,
            (CpuStorage::F16(a), CpuStorage::F16(b)) => f32_result(len, dt, |o| {
                products(a, &sa, b, &sb, o);
                Ok(())
            })?,
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => f32_result(len, dt, |o| {
                products(a, &sa, b, &sb, o);
                Ok(())
            })?,
            _ => candle_core::bail!("amp-matmul: {:?} x {:?}", s1.dtype(), s2.dtype()),
        };
        let mut dims = l1.dims()[..l1.dims().len() - 2].to_vec();
        dims.extend([sa.rows, sb.cols]);
        Ok((out, Shape::from(dims)))
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // out = op(a) . op(b); d op(a) = g . op(b)^T, d op(b) = op(a)^T . g.
        let ga = a.track_op().then(|| {
            if self.ta {
                grad_bmm(a.is_variable().then_some(a), b, g, self.tb, true)
            } else {
                grad_bmm(a.is_variable().then_some(a), g, b, false, !self.tb)
            }
        });
        let gb = b.track_op().then(|| {
            if self.tb {
                grad_bmm(b.is_variable().then_some(b), g, a, true, self.ta)
            } else {
                grad_bmm(b.is_variable().then_some(b), a, g, !self.ta, false)
            }
        });
        let out = |g: Option<Tensor>| g.map(super::graph_grad::for_candle).transpose();
        Ok((out(ga.transpose()?)?, out(gb.transpose()?)?))
    }
}

/// `op(a) . op(b)` without a backward.
pub(super) fn bmm(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
    a.apply_op2_no_bwd(b, &Bmm { ta, tb, f32_out: false })
}

/// `op(a) . op(b)` without a backward, the f32 accumulation kept as an f32 result.
pub(super) fn bmm_f32(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
    a.apply_op2_no_bwd(b, &Bmm { ta, tb, f32_out: true })
}

/// [`bmm`] for the gradient of `of` (a parameter: a linear's weight, a matmul's variable;
/// `None` for activations): while a capture is open (the doctor records this backward), a
/// gradient rounded to half is kept in f32 first (`super::capture`); the rounding is the
/// same (`to_dtype` rounds to nearest even as `half_storage_of` does).
fn grad_bmm(of: Option<&Tensor>, a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
    let Some(of) = of.filter(|_| super::capture::active() && matches!(a.dtype(), DType::F16 | DType::BF16)) else {
        return bmm(a, b, ta, tb);
    };
    let g32 = bmm_f32(a, b, ta, tb)?;
    super::capture::keep(of, &g32)?;
    g32.to_dtype(a.dtype())
}

/// The matrix product of the last two dims, batched over the others (which must be equal or
/// broadcastable), differentiable. f32, f16 and bf16 on the CPU run through the library's
/// product (f32 accumulation; bf16 on AMX tiles or AVX-512 BF16 dot products where the CPU
/// has them, see [`Isa`](super::Isa)); other types and devices use candle's `matmul`.
///
/// On those two tiers a bf16 product (above 4096 multiply-adds) flushes subnormal inputs and
/// results to zero, as the instructions do; the other tiers and candle keep them
/// ([`bf16_products_flush_subnormals`](super::bf16_products_flush_subnormals)).
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let a = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?.to_dtype(DType::BF16)?;
/// let b = Tensor::ones((3, 2), DType::BF16, &Device::Cpu)?;
/// let c = kernels::matmul(&a, &b)?;
/// assert_eq!(c.dtype(), DType::BF16);
/// assert_eq!(c.to_dtype(DType::F32)?.to_vec2::<f32>()?, [[3.0, 3.0], [12.0, 12.0]]);
/// # Ok(()) }
/// ```
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let cpu = a.device().is_cpu() && b.device().is_cpu();
    if !(super::enabled() && cpu && a.dtype() == b.dtype() && supported(a.dtype()) && a.rank() >= 2 && b.rank() >= 2) {
        // The same contract as the fast path: batch dims broadcast (candle's `matmul` alone
        // wants them equal).
        return plain_matmul(a, b);
    }
    // Equal batch dims: broadcast them (a stride-0 view, no copy).
    let (ra, rb) = (a.rank(), b.rank());
    let (ba, bb) = (&a.dims()[..ra - 2], &b.dims()[..rb - 2]);
    let (a, b) = if ba == bb {
        (a.clone(), b.clone())
    } else {
        let batch = Shape::from(ba).broadcast_shape_binary_op(&Shape::from(bb), "matmul")?;
        let mut da = batch.dims().to_vec();
        da.extend(&a.dims()[ra - 2..]);
        let mut db = batch.dims().to_vec();
        db.extend(&b.dims()[rb - 2..]);
        (a.broadcast_as(da)?, b.broadcast_as(db)?)
    };
    if a.track_op() || b.track_op() {
        a.apply_op2(
            &b,
            Bmm {
                ta: false,
                tb: false,
                f32_out: false,
            },
        )
    } else {
        bmm(&a, &b, false, false)
    }
}

/// candle's product with the batch dims broadcast, on every device and type: what
/// [`matmul`] computes when its own product does not apply. `broadcast_matmul` needs rank
/// >= 2 on both sides; below that candle's `matmul` gives its own error.
fn plain_matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.rank() < 2 || b.rank() < 2 || a.dims()[..a.rank() - 2] == b.dims()[..b.rank() - 2] {
        a.matmul(b)
    } else {
        a.broadcast_matmul(b)
    }
}

/// `x w^T + b` in one op.
struct Linear;

/// Rows of `x` (all dims but the last, flattened; `x` contiguous), `w` (n x k) as the
/// transposed right operand, into `out` (m x n, every value written).
fn linear_fwd<T: GemmElem>(
    x: &[T],
    xl: &Layout,
    w: &[T],
    wl: &Layout,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    let (xa, xb) = xl
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("amp-linear: x must be contiguous".into()))?;
    let dims = xl.dims();
    let k = *dims.last().unwrap_or(&0);
    // Rows from the shape, not from the element count: with k = 0 there are no elements but
    // still m rows of output (each the bias, or 0).
    let m: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    debug_assert_eq!(xb - xa, m * k);
    let ws = Stack::of(wl, true)?; // w^T: k x n
    if ws.rows != k {
        candle_core::bail!("amp-linear: x {:?} and weight {:?} do not match", xl.dims(), wl.dims())
    }
    let n = ws.cols;
    if out.len() != m * n {
        candle_core::bail!("amp-linear: output of {} values for {m} x {n}", out.len())
    }
    match bias {
        Some(b) if n > 0 => {
            for row in out.chunks_mut(n) {
                row.copy_from_slice(b);
            }
        }
        // Overwritten by the product unless it is a sum over nothing.
        _ if k == 0 => out.fill(0.0),
        _ => {}
    }
    let xm = Mat {
        data: x,
        off: xa,
        rs: k,
        cs: 1,
    };
    if m > 0 && n > 0 && k > 0 {
        T::gemm(m, n, k, xm, ws.mat(w, 0), out, n, bias.is_some());
    }
    Ok(())
}

/// A bias as f32 values (`linear` made it contiguous).
pub(super) fn f32_of(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("amp-linear: the bias must be contiguous".into()))?;
    let mut out = vec![0f32; b - a];
    match s {
        CpuStorage::F32(v) => out.copy_from_slice(&v[a..b]),
        CpuStorage::F16(v) => convert(&v[a..b], &mut out),
        CpuStorage::BF16(v) => convert(&v[a..b], &mut out),
        other => candle_core::bail!("amp-linear: {:?} bias", other.dtype()),
    }
    Ok(out)
}

fn linear_shape(xl: &Layout, wl: &Layout) -> Shape {
    let mut dims = xl.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = wl.dims()[0];
    }
    Shape::from(dims)
}

pub(super) fn linear_cpu(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    bias: Option<Vec<f32>>,
) -> Result<(CpuStorage, Shape)> {
    if l2.dims().len() != 2 {
        candle_core::bail!("amp-linear: the weight must be 2-d, got {:?}", l2.dims())
    }
    let shape = linear_shape(l1, l2);
    let (len, dt, b) = (shape.elem_count(), s1.dtype(), bias.as_deref());
    let out = match (s1, s2) {
        (CpuStorage::F32(x), CpuStorage::F32(w)) => f32_result(len, dt, |o| linear_fwd(x, l1, w, l2, b, o))?,
        (CpuStorage::F16(x), CpuStorage::F16(w)) => f32_result(len, dt, |o| linear_fwd(x, l1, w, l2, b, o))?,
        (CpuStorage::BF16(x), CpuStorage::BF16(w)) => f32_result(len, dt, |o| linear_fwd(x, l1, w, l2, b, o))?,
        _ => candle_core::bail!("amp-linear: {:?} x {:?}", s1.dtype(), s2.dtype()),
    };
    Ok((out, shape))
}

/// The column sums of `g` (rows of length n), in f32.
pub(super) fn column_sums<T: Elem + super::slices::Vx>(g: &[T], n: usize) -> Vec<f32> {
    if n == 0 {
        return Vec::new();
    }
    super::dispatch::dispatch(ColumnSums { g, n })
}

/// [`column_sums`]' loop, compiled per tier (the same additions in the same order on each):
/// each row widened to f32 with the vectorised conversion, then added.
struct ColumnSums<'a, T> {
    g: &'a [T],
    n: usize,
}

impl<T: Elem + super::slices::Vx> super::dispatch::Kernel for ColumnSums<'_, T> {
    type Output = Vec<f32>;
    #[inline(always)]
    fn run(self) -> Vec<f32> {
        let mut sum = vec![0f32; self.n];
        let mut row = vec![0f32; self.n];
        for r in self.g.chunks(self.n) {
            let row = &mut row[..r.len()];
            convert(r, row);
            for (s, v) in sum.iter_mut().zip(row.iter()) {
                *s += v;
            }
        }
        sum
    }
}

/// The column sums of a dense CPU gradient `g2` (m x n), in f32: the bias's gradient.
pub(super) fn gradient_column_sums(g2: &Tensor, n: usize) -> Result<Vec<f32>> {
    let (s, l) = g2.storage_and_layout();
    let (a, e) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("amp-linear: gradient layout".into()))?;
    Ok(match &*s {
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => column_sums(&v[a..e], n),
        candle_core::Storage::Cpu(CpuStorage::F16(v)) => column_sums(&v[a..e], n),
        candle_core::Storage::Cpu(CpuStorage::BF16(v)) => column_sums(&v[a..e], n),
        _ => candle_core::bail!("amp-linear: gradient storage"),
    })
}

/// Gradients of `x w^T (+ b)` for `x` (rows m x k), `w` (n x k), given `g` (m x n).
fn linear_bwd(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    g: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let k = w.dim(1)?;
    let n = w.dim(0)?;
    // Rows from the shape: `reshape(((), n))` cannot infer them when n or k is 0.
    let m: usize = x.dims()[..x.rank().saturating_sub(1)].iter().product();
    let g = super::dense(g)?;
    let g2 = g.reshape((m, n))?;
    // dx = g . w (m x n . n x k); dw = g^T . x (n x m . m x k); db = column sums of g.
    let gx = if x.track_op() {
        Some(bmm(&g2, w, false, false)?.reshape(x.shape())?)
    } else {
        None
    };
    let gw = if w.track_op() {
        let x2 = super::dense(x)?.reshape((m, k))?;
        Some(grad_bmm(Some(w), &g2, &x2, true, false)?)
    } else {
        None
    };
    let gb = match b {
        Some(b) if b.track_op() => {
            let sums = Tensor::from_vec(gradient_column_sums(&g2, n)?, n, b.device())?;
            if b.dtype() != DType::F32 {
                super::capture::keep(b, &sums)?;
            }
            Some(super::cast::cast(&sums, b.dtype())?)
        }
        _ => None,
    };
    let out = |g: Option<Tensor>| g.map(super::graph_grad::for_candle).transpose();
    Ok((out(gx)?, out(gw)?, out(gb)?))
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "amp-linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        linear_cpu(s1, l1, s2, l2, None)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (gx, gw, _) = linear_bwd(x, w, None, g)?;
        Ok((gx, gw))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "amp-linear"
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
        if l3.dims() != [l2.dims()[0]] {
            candle_core::bail!("amp-linear: bias {:?} for weight {:?}", l3.dims(), l2.dims())
        }
        linear_cpu(s1, l1, s2, l2, Some(f32_of(s3, l3)?))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        linear_bwd(x, w, Some(b), g)
    }
}

/// `x w^T + b` for `x` of any rank >= 1 (the last dim is the features), as one differentiable
/// op (candle-nn's `Linear` is three: a transpose, a matmul and a broadcast add, each with
/// its own gradient to accumulate). `x`, `w` and `b` share one type; f32, f16 and bf16 on
/// the CPU run through the library's product, others through candle's ops. Any layout of
/// each argument is taken (transposed, strided, broadcast), as on the fallback.
///
/// bf16 products on AMX and AVX-512 BF16 flush subnormal inputs and results to zero, in the
/// forward and in the gradients (see [`matmul`] and
/// [`bf16_products_flush_subnormals`](super::bf16_products_flush_subnormals)).
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{DType, Device, Tensor, Var};
/// # fn main() -> candle_core::Result<()> {
/// let x = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let w = Var::new(&[[1f32, 0.], [1., 1.], [0., 2.]], &Device::Cpu)?;
/// let b = Var::new(&[0.5f32, 0., -1.], &Device::Cpu)?;
/// let y = kernels::linear(&x, &w, Some(&b))?;
/// assert_eq!(y.to_vec2::<f32>()?, [[1.5, 3.0, 3.0], [3.5, 7.0, 7.0]]);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&b).unwrap().to_vec1::<f32>()?, [2.0, 2.0, 2.0]);
/// assert_eq!(g.get(&w).unwrap().to_vec2::<f32>()?, [[4.0, 6.0], [4.0, 6.0], [4.0, 6.0]]);
/// # Ok(()) }
/// ```
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let same = x.dtype() == w.dtype() && b.is_none_or(|b| b.dtype() == x.dtype());
    let cpu = x.device().is_cpu() && w.device().is_cpu() && b.is_none_or(|b| b.device().is_cpu());
    if !(super::enabled() && same && cpu && supported(x.dtype()) && x.rank() >= 1 && w.rank() == 2) {
        // A 1-d `x` is one row, as on the fast path (and PyTorch's `F.linear`).
        if x.rank() == 1 {
            return linear(&x.unsqueeze(0)?, w, b)?.squeeze(0);
        }
        let y = x.broadcast_matmul(&w.t()?)?;
        return match b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        };
    }
    let x = super::dense(x)?;
    // The op reads the bias as n contiguous values. Another layout (a view, a broadcast) is
    // copied first (a differentiable copy: its gradient reaches the original); another
    // shape that broadcasts to the output is added after the product, as on the fallback.
    let b = match b {
        Some(b) if b.dims() != [w.dim(0)?] => return linear(&x, w, None)?.broadcast_add(b),
        Some(b) => Some(super::dense(b)?),
        None => None,
    };
    let b = b.as_ref();
    let grad = x.track_op() || w.track_op() || b.is_some_and(|b| b.track_op());
    match (b, grad) {
        (Some(b), true) => x.apply_op3(w, b, Linear),
        (Some(b), false) => x.apply_op3_no_bwd(w, b, &Linear),
        (None, true) => x.apply_op2(w, Linear),
        (None, false) => x.apply_op2_no_bwd(w, &Linear),
    }
}
