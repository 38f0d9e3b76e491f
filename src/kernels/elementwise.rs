//! Half-precision `a + b`, `x * mask` and layout copies as single graph nodes, so that a
//! half activation's residual add, dropout and head split never run candle's own half
//! element-wise code (see `graph_grad`: its bf16 add is nine times its f32 add on CPUs with
//! AVX-512 BF16, in a build without CPU flags). Each forward runs in f32 blocks around the
//! vectorised slice conversions, compiled per tier; each backward hands its gradients to
//! candle through `graph_grad::for_candle`. f32 (and every other type and device) keeps
//! candle's ops, which are fast there.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::dispatch::{Kernel, split_zip};
use super::graph_grad::for_candle;
use super::simd::Elem;
use super::slices::{Vx, convert_serial as convert};

/// Elements per block: widened to f32 on the stack, computed, narrowed back.
const BLOCK: usize = 512;
const CHUNK: usize = 1 << 14;

/// Whether a tensor takes the half path.
fn half_cpu(t: &Tensor) -> bool {
    super::enabled() && t.device().is_cpu() && matches!(t.dtype(), DType::F16 | DType::BF16)
}

/// What two slices combine to.
#[derive(Clone, Copy)]
enum Combine {
    Add,
    Mul,
}

struct Blocks<'a, T> {
    a: &'a [T],
    b: &'a [T],
    d: &'a mut [T],
    how: Combine,
}

impl<T: Elem + Vx> Kernel for Blocks<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (mut ba, mut bb) = ([0f32; BLOCK], [0f32; BLOCK]);
        let blocks = self.a.chunks(BLOCK).zip(self.b.chunks(BLOCK));
        for ((ac, bc), dc) in blocks.zip(self.d.chunks_mut(BLOCK)) {
            let (xs, ys) = (&mut ba[..ac.len()], &mut bb[..ac.len()]);
            convert(ac, xs);
            convert(bc, ys);
            match self.how {
                Combine::Add => xs.iter_mut().zip(ys.iter()).for_each(|(x, y)| *x += *y),
                Combine::Mul => xs.iter_mut().zip(ys.iter()).for_each(|(x, y)| *x *= *y),
            }
            convert(xs, dc);
        }
    }
}

/// Panics if the lengths differ (checked by the op before).
fn combine<T: Elem + Vx>(a: &[T], b: &[T], how: Combine) -> Vec<T> {
    assert_eq!(a.len(), b.len(), "amp-elementwise: lengths differ");
    let mut out = vec![T::from_f32(0.0); a.len()];
    split_zip(a, b, &mut out, CHUNK, |a, b, d| Blocks { a, b, d, how });
    out
}

fn contiguous(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("amp-elementwise: tensors must be contiguous".into()))
}

fn combine_storage(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    how: Combine,
) -> Result<(CpuStorage, Shape)> {
    let ((a, b), (c, d)) = (contiguous(l1)?, contiguous(l2)?);
    if b - a != d - c {
        candle_core::bail!("amp-elementwise: lengths differ ({} and {})", b - a, d - c)
    }
    let out = match (s1, s2) {
        (CpuStorage::F16(x), CpuStorage::F16(y)) => CpuStorage::F16(combine(&x[a..b], &y[c..d], how)),
        (CpuStorage::BF16(x), CpuStorage::BF16(y)) => CpuStorage::BF16(combine(&x[a..b], &y[c..d], how)),
        _ => candle_core::bail!("amp-elementwise: {:?} and {:?}", s1.dtype(), s2.dtype()),
    };
    Ok((out, l1.shape().clone()))
}

/// `a + b` of one shape.
struct Add;

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "amp-add"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        combine_storage(s1, l1, s2, l2, Combine::Add)
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // One strided copy serves both arguments (candle only reads it).
        let g = for_candle(g.clone())?;
        Ok((a.track_op().then(|| g.clone()), b.track_op().then_some(g)))
    }
}

/// `x * m` for a constant `m` of `x`'s shape (a dropout mask): no gradient for `m`.
struct MulConst;

impl CustomOp2 for MulConst {
    fn name(&self) -> &'static str {
        "amp-mul-const"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        combine_storage(s1, l1, s2, l2, Combine::Mul)
    }
    fn bwd(&self, _x: &Tensor, m: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = super::dense(g)?;
        let gx = g.apply_op2_no_bwd(&super::dense(m)?, &MulConst)?;
        Ok((Some(for_candle(gx)?), None))
    }
}

/// `a + b` with broadcasting, as candle's `broadcast_add`; for half tensors on the CPU one
/// node computed in f32 arithmetic whose backward stays out of candle's half element-wise
/// code (a broadcast argument's gradient is summed in f32 and rounded once).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !(half_cpu(a) && half_cpu(b) && a.dtype() == b.dtype()) {
        return a.broadcast_add(b);
    }
    let shape = a.shape().broadcast_shape_binary_op(b.shape(), "add")?;
    let a2 = broadcast_arg(a, &shape)?;
    let b2 = broadcast_arg(b, &shape)?;
    a2.apply_op2(&b2, Add)
}

/// `a + b` (one shape) summed in f32 and rounded once to `out`, outside the graph: one pass
/// over two half tensors of `out`'s type on the CPU (the add's forward: the same bits), else
/// both cast to f32, candle's add and a cast.
pub(crate) fn sum_rounded(a: &Tensor, b: &Tensor, out: DType) -> Result<Tensor> {
    if half_cpu(a) && a.dtype() == b.dtype() && a.dtype() == out && a.shape() == b.shape() {
        return super::dense(a)?
            .detach()
            .apply_op2_no_bwd(&super::dense(b)?.detach(), &Add);
    }
    let sum = (super::cast(a, DType::F32)? + super::cast(b, DType::F32)?)?;
    super::cast(&sum, out)
}

/// `t` at `shape`: itself when it has it, else a node copying the broadcast (whose
/// backward sums the gradient back to `t`'s shape in f32).
fn broadcast_arg(t: &Tensor, shape: &Shape) -> Result<Tensor> {
    if t.shape() == shape {
        return super::dense(t);
    }
    let t = super::dense(t)?;
    if t.track_op() {
        t.apply_op1(Broadcast(shape.clone()))
    } else {
        t.apply_op1_no_bwd(&Broadcast(shape.clone()))
    }
}

struct Broadcast(Shape);

impl CustomOp1 for Broadcast {
    fn name(&self) -> &'static str {
        "amp-broadcast"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let bl = l.broadcast_as(&self.0)?;
        let mut out = unsafe { s.device().alloc_uninit(&self.0, s.dtype())? };
        s.copy_strided_src(&mut out, 0, &bl)?;
        Ok((out, self.0.clone()))
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let summed = sum_to(&g.to_dtype(DType::F32)?, arg.dims())?;
        Ok(Some(for_candle(super::cast(&summed, arg.dtype())?)?))
    }
}

/// `g` summed over the dimensions a broadcast to its shape added or widened from 1.
fn sum_to(g: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let mut g = g.clone();
    while g.rank() > dims.len() {
        g = g.sum(0)?;
    }
    for (i, &d) in dims.iter().enumerate() {
        if d == 1 && g.dim(i)? != 1 {
            g = g.sum_keepdim(i)?;
        }
    }
    g.reshape(dims)
}

/// `x * m` for a mask or other constant `m` (no gradient) broadcastable to `x`: one node for
/// half tensors on the CPU, else candle's `broadcast_mul`.
pub(crate) fn mul_const(x: &Tensor, m: &Tensor) -> Result<Tensor> {
    if !(half_cpu(x) && m.dtype() == x.dtype() && m.device().is_cpu()) {
        return x.broadcast_mul(m);
    }
    let m = m.detach().broadcast_as(x.shape())?.contiguous()?;
    let x = super::dense(x)?;
    if x.track_op() {
        x.apply_op2(&m, MulConst)
    } else {
        x.apply_op2_no_bwd(&m, &MulConst)
    }
}

/// `x.reshape(split).permute(perm).contiguous().reshape(merged)` as one node (a head split
/// or merge, a contiguous transpose): candle's reshape, transpose and copy are three nodes,
/// and the backward of the reshape and of the copy each add a contiguous half gradient.
/// Other types and devices run those candle ops.
pub(crate) fn rearrange(x: &Tensor, split: &[usize], perm: &[usize], merged: &[usize]) -> Result<Tensor> {
    let r = Rearrange {
        split: split.to_vec(),
        perm: perm.to_vec(),
        merged: merged.to_vec(),
    };
    if !half_cpu(x) {
        return r.apply(x);
    }
    let x = super::dense(x)?;
    if x.track_op() {
        x.apply_op1(r)
    } else {
        x.apply_op1_no_bwd(&r)
    }
}

/// [`rearrange`] on the CPU without a backward (inside a fused node).
pub(super) fn rearranged(x: &Tensor, split: &[usize], perm: &[usize], merged: &[usize]) -> Result<Tensor> {
    let r = Rearrange {
        split: split.to_vec(),
        perm: perm.to_vec(),
        merged: merged.to_vec(),
    };
    super::dense(x)?.apply_op1_no_bwd(&r)
}

struct Rearrange {
    split: Vec<usize>,
    perm: Vec<usize>,
    merged: Vec<usize>,
}

impl Rearrange {
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        // No reshape node where the shape already is the one wanted.
        let x = if x.dims() == self.split.as_slice() {
            x.clone()
        } else {
            x.reshape(self.split.as_slice())?
        };
        let y = x.permute(self.perm.as_slice())?.contiguous()?;
        if y.dims() == self.merged.as_slice() {
            Ok(y)
        } else {
            y.reshape(self.merged.as_slice())
        }
    }
}

impl CustomOp1 for Rearrange {
    fn name(&self) -> &'static str {
        "amp-rearrange"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, _) = contiguous(l)?;
        let split = Layout::contiguous_with_offset(self.split.as_slice(), a);
        if split.shape().elem_count() != l.shape().elem_count() {
            candle_core::bail!("amp-rearrange: {:?} into {:?}", l.dims(), self.split)
        }
        let permuted = split.permute(&self.perm)?;
        let merged = Shape::from(self.merged.as_slice());
        if merged.elem_count() != l.shape().elem_count() {
            candle_core::bail!("amp-rearrange: {:?} into {:?}", l.dims(), self.merged)
        }
        let mut out = unsafe { s.device().alloc_uninit(&merged, s.dtype())? };
        s.copy_strided_src(&mut out, 0, &permuted)?;
        Ok((out, merged))
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        // The inverse: the gradient in the permuted dims, permuted back, in `arg`'s shape.
        let permuted: Vec<usize> = self.perm.iter().map(|&p| self.split[p]).collect();
        let mut inverse = vec![0; self.perm.len()];
        for (i, &p) in self.perm.iter().enumerate() {
            inverse[p] = i;
        }
        let back = Rearrange {
            split: permuted,
            perm: inverse,
            merged: arg.dims().to_vec(),
        };
        let gx = super::dense(g)?.apply_op1_no_bwd(&back)?;
        Ok(Some(for_candle(gx)?))
    }
}
