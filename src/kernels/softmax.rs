//! Attention's softmax as one op: `softmax(x * scale)` over the last dimension, optionally
//! causal (key `j > query i` masked), computed in f32 whatever the input's type and written
//! in the type the next product wants, with a backward that needs only the output.
//!
//! Composed from candle ops, the same softmax keeps an f32 copy of the scores, the scaled
//! scores, the masked scores, the exponentials and the probabilities alive for the backward
//! (about 20 bytes per score); at O2 the half scores' cast to f32 adds to that, so a half
//! level held more attention memory than O0. Here the graph keeps the input and the output
//! (2 + 2 bytes per score in half), and the forward is one pass per row.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, D, DType, Layout, Result, Shape, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Rows per rayon task (a row of a 1024-long sequence is 4 KiB of f32).
const ROWS_PER_TASK: usize = 16;

/// Slice conversions to and from f32 (the half crate's are vectorised at run time).
trait Elem: Copy + Send + Sync + Default {
    fn to_f32(src: &[Self], dst: &mut [f32]);
    fn from_f32(src: &[f32], dst: &mut [Self]);
}

impl Elem for f32 {
    fn to_f32(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn from_f32(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl Elem for f16 {
    fn to_f32(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn from_f32(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Elem for bf16 {
    fn to_f32(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn from_f32(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// `exp(x)` for the softmax: [`super::gelu::exp_f32`] (branch-free, so the loop
/// vectorises), exactly 0 below f32's range as libm's is, so a masked (`-inf`) score gets
/// probability 0.
#[inline(always)]
fn exp_or_zero(x: f32) -> f32 {
    let e = super::gelu::exp_f32(x);
    if x < -87.5 { 0.0 } else { e }
}

/// The largest value of `x` as [`LANES`](super::dispatch::LANES) partial maxima (NaN values
/// are skipped, as `f32::max` skips them; the row's NaN still reaches the result through
/// its own exponential). Maxima are exact in any order, so this equals the sequential one.
#[inline(always)]
pub(super) fn max_lanes(x: &[f32]) -> f32 {
    use super::dispatch::LANES;
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        let c: &[f32; LANES] = c.try_into().expect("a whole chunk");
        for l in 0..LANES {
            acc[l] = acc[l].max(c[l]);
        }
    }
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    acc.iter().fold(tail, |m, v| m.max(*v))
}

/// One row in place: the first `live` values are scaled and normalised, the rest (masked)
/// become 0. The operations are the composed softmax's (scale, subtract the row's maximum,
/// exponentiate, divide by the sum), compiled per instruction set: the exponential is the
/// polynomial of [`super::gelu::exp_f32`] (relative error about 1e-7 against libm's) and the
/// sum runs in lanes ([`super::dispatch::sum_lanes`]), so the row vectorises (with libm's
/// `expf` per value, the softmax was about 6% of a Llama step at O2 on Zen 4) and the tiers
/// agree bit for bit.
struct Row<'a> {
    x: &'a mut [f32],
    live: usize,
    scale: f32,
}

impl super::dispatch::Kernel for Row<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (live, dead) = self.x.split_at_mut(self.live);
        for v in live.iter_mut() {
            *v *= self.scale;
        }
        let m = max_lanes(live);
        for v in live.iter_mut() {
            *v = exp_or_zero(*v - m);
        }
        let s = super::dispatch::sum_lanes(live, |v| v);
        for v in live.iter_mut() {
            *v /= s;
        }
        dead.fill(0.0);
    }
}

fn row(x: &mut [f32], live: usize, scale: f32) {
    super::dispatch::dispatch(Row { x, live, scale })
}

fn run<I: Elem, O: Elem>(x: &[I], cols: usize, rows_per_matrix: usize, op: &ScaledSoftmax) -> Vec<O> {
    let (scale, causal) = (op.scale, op.causal);
    let mut out = vec![O::default(); x.len()];
    out.par_chunks_mut(cols * ROWS_PER_TASK)
        .zip(x.par_chunks(cols * ROWS_PER_TASK))
        .enumerate()
        .for_each(|(task, (o, x))| {
            let mut buf = vec![0f32; cols];
            for (r, (o, x)) in o.chunks_mut(cols).zip(x.chunks(cols)).enumerate() {
                let global = task * ROWS_PER_TASK + r;
                let i = global % rows_per_matrix;
                let mut live = if causal { (i + 1).min(cols) } else { cols };
                if let Some(keys) = &op.keys {
                    // The batch item of this row's matrix: `keys.per_item` matrices (heads) each.
                    let item = global / rows_per_matrix / keys.per_item.max(1);
                    live = live.min(keys.lengths.get(item).copied().unwrap_or(cols));
                }
                I::to_f32(x, &mut buf);
                row(&mut buf, live, scale);
                O::from_f32(&buf, o);
            }
        });
    out
}

/// A per-batch-item key length for [`forward_no_bwd`]: the keys at or past `lengths[item]`
/// get probability 0 (a row with no live key is all zeros), for `(b, per_item, t, t)` scores.
#[derive(Debug, Clone)]
pub(super) struct KeyLengths {
    pub lengths: std::sync::Arc<[usize]>,
    /// The matrices (heads) per batch item.
    pub per_item: usize,
}

struct ScaledSoftmax {
    scale: f32,
    causal: bool,
    out: DType,
    /// Inside the fused attention only: the keys' lengths per batch item.
    keys: Option<KeyLengths>,
}

fn typed<I: Elem>(x: &[I], cols: usize, rows: usize, op: &ScaledSoftmax) -> Result<CpuStorage> {
    Ok(match op.out {
        DType::F32 => CpuStorage::F32(run(x, cols, rows, op)),
        DType::F16 => CpuStorage::F16(run(x, cols, rows, op)),
        DType::BF16 => CpuStorage::BF16(run(x, cols, rows, op)),
        other => candle_core::bail!("amp-softmax: {other:?} output"),
    })
}

impl CustomOp1 for ScaledSoftmax {
    fn name(&self) -> &'static str {
        "amp-scaled-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("amp-softmax: the input must be contiguous".into()))?;
        let dims = l.shape().dims();
        let cols = dims.last().copied().unwrap_or(1);
        let rows = if dims.len() >= 2 { dims[dims.len() - 2] } else { 1 };
        if cols == 0 || b == a {
            let empty = match self.out {
                DType::F16 => CpuStorage::F16(Vec::new()),
                DType::BF16 => CpuStorage::BF16(Vec::new()),
                _ => CpuStorage::F32(Vec::new()),
            };
            return Ok((empty, l.shape().clone()));
        }
        let out = match s {
            CpuStorage::F32(v) => typed(&v[a..b], cols, rows, self)?,
            CpuStorage::F16(v) => typed(&v[a..b], cols, rows, self)?,
            CpuStorage::BF16(v) => typed(&v[a..b], cols, rows, self)?,
            other => candle_core::bail!("amp-softmax: {:?} input", other.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    /// `dx = scale * y * (dy - sum(dy * y))` in f32, from the output alone (masked entries
    /// have `y = 0`, so their gradient is 0), returned in the input's type.
    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let dx = super::softmax_grad::grad(res, grad_res, self.scale, arg.dtype())?;
        Ok(Some(super::graph_grad::for_candle(dx)?))
    }
}

/// [`scaled_softmax`] on the CPU without a backward (inside a fused node): `x` of an
/// f32/f16/bf16 type, the kernels on; `keys`: the keys' lengths per batch item, applied as
/// the causal limit is (masked entries exactly 0, so the backward needs nothing more).
pub(super) fn forward_no_bwd(
    x: &Tensor,
    scale: f64,
    causal: bool,
    keys: Option<KeyLengths>,
    out: DType,
) -> Result<Tensor> {
    super::dense(x)?.apply_op1_no_bwd(&ScaledSoftmax {
        scale: scale as f32,
        causal,
        out,
        keys,
    })
}

/// `softmax(x * scale)` over the last dimension, keys after the query masked when `causal`
/// (then the last two dimensions must be equal: query `i` sees keys `j <= i`), computed in
/// f32 and returned as `out`. Differentiable. On the CPU for f32, f16 and bf16 in and out, one
/// op whose backward needs only its output; on CUDA (feature `cuda`) the same as one kernel
/// each way, compiled at run time by NVRTC; elsewhere (and inside [`super::plain`], or where
/// the CUDA kernels fail to load) the same arithmetic composed from candle ops. A row whose
/// scores hold an inf or NaN comes out NaN, as the composed softmax's does, so an overflow in
/// the scores is not hidden. Over an empty last dimension the result is empty, as PyTorch's
/// softmax.
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[0f32, 0.], [1., 1.]], &Device::Cpu)?.to_dtype(DType::F16)?;
/// let p = kernels::scaled_softmax(&x, 1.0, true, DType::F32)?;
/// assert_eq!(p.to_vec2::<f32>()?, [[1.0, 0.0], [0.5, 0.5]]);
/// # Ok(()) }
/// ```
pub fn scaled_softmax(x: &Tensor, scale: f64, causal: bool, out: DType) -> Result<Tensor> {
    let half_or_f32 = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let dims = x.dims();
    if causal && (dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2]) {
        candle_core::bail!(
            "scaled_softmax: a causal softmax needs square trailing dimensions (queries = keys), got {:?}",
            dims
        );
    }
    if x.rank() == 0 {
        candle_core::bail!("scaled_softmax: needs at least one dimension");
    }
    if super::enabled() && x.device().is_cpu() && half_or_f32(x.dtype()) && half_or_f32(out) {
        let x = super::dense(x)?;
        return x.apply_op1(ScaledSoftmax {
            scale: scale as f32,
            causal,
            out,
            keys: None,
        });
    }
    // On CUDA the fused kernel (kernels/cuda/softmax.cu), where it loads.
    #[cfg(feature = "cuda")]
    if super::enabled()
        && half_or_f32(x.dtype())
        && half_or_f32(out)
        && let Some(p) = super::cuda::softmax::scaled_softmax(x, scale, causal, out)?
    {
        return Ok(p);
    }
    composed(x, scale, causal, out)
}

/// The same softmax from candle ops (other devices, other types, the plain path).
fn composed(x: &Tensor, scale: f64, causal: bool, out: DType) -> Result<Tensor> {
    // An empty tensor's softmax is empty (PyTorch's; candle's reduce would fail).
    if x.elem_count() == 0 {
        return x.to_dtype(out);
    }
    let wide = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let mut s = (x.to_dtype(wide)? * scale)?;
    if causal {
        let t = x.dim(D::Minus1)?;
        let v: Vec<f32> = (0..t * t)
            .map(|k| if k % t > k / t { f32::NEG_INFINITY } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(v, (t, t), x.device())?.to_dtype(wide)?;
        s = s.broadcast_add(&mask)?;
    }
    let d = s.rank() - 1;
    let m = s.max_keepdim(d)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(d)?)?.to_dtype(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn input(shape: &[usize], seed: u32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32 / 125.0 - 4.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Value and input gradient (of `sum(p * w)`), fused and composed, for every type pair.
    #[test]
    fn equals_the_composed_softmax_with_its_gradient() {
        for (shape, causal) in [
            (vec![2, 3, 5, 5], true),
            (vec![4, 7], false),
            (vec![3, 1, 1], true),
            (vec![2, 33, 33], true),
        ] {
            for dt in [DType::F32, DType::F16, DType::BF16] {
                for out in [DType::F32, DType::F16, DType::BF16] {
                    let x = Var::from_tensor(&input(&shape, 3).to_dtype(dt).unwrap()).unwrap();
                    let w = input(&shape, 9);
                    let run = |fused: bool| {
                        let _plain = (!fused).then(crate::kernels::plain);
                        let p = scaled_softmax(x.as_tensor(), 0.37, causal, out).unwrap();
                        assert_eq!((p.dtype(), p.dims()), (out, &shape[..]));
                        let loss = (p.to_dtype(DType::F32).unwrap() * &w).unwrap().sum_all().unwrap();
                        let g = loss.backward().unwrap().get(x.as_tensor()).unwrap().clone();
                        (p, g)
                    };
                    let (pf, gf) = run(true);
                    let (pc, gc) = run(false);
                    let what = format!("{shape:?} causal {causal} {dt:?} -> {out:?}");
                    // One rounding of the output type apart at most (f32: sums in another order).
                    let tol = match out {
                        DType::F32 => 1e-6,
                        DType::F16 => 1e-3,
                        _ => 8e-3,
                    };
                    assert!(max_diff(&pf, &pc) <= tol, "{what}: values {}", max_diff(&pf, &pc));
                    assert_eq!(gf.dtype(), dt, "{what}");
                    let gtol = match (dt, out) {
                        (DType::F32, DType::F32) => 1e-5,
                        _ => 3e-2,
                    };
                    assert!(max_diff(&gf, &gc) <= gtol, "{what}: gradients {}", max_diff(&gf, &gc));
                    if causal {
                        // Above the diagonal: probability 0, gradient 0.
                        let p = pf
                            .to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap();
                        let t = shape[shape.len() - 1];
                        for (k, v) in p.iter().enumerate() {
                            if k % t > (k / t) % t {
                                assert_eq!(*v, 0.0, "{what} at {k}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_non_finite_score_makes_its_row_nan_and_only_it() {
        let mut v = vec![0.5f32; 12];
        v[5] = f32::INFINITY;
        let x = Tensor::from_vec(v, (3, 4), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        let p = scaled_softmax(&x, 1.0, false, DType::F32)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!(p[1].iter().all(|v| v.is_nan()), "{p:?}");
        assert!(p[0].iter().chain(&p[2]).all(|v| (v - 0.25).abs() < 1e-7), "{p:?}");
    }

    #[test]
    fn empty_and_bad_shapes() {
        let x = Tensor::zeros((2, 0, 0), DType::F16, &Device::Cpu).unwrap();
        assert_eq!(scaled_softmax(&x, 1.0, true, DType::F16).unwrap().dims(), [2, 0, 0]);
        let x = Tensor::zeros((0, 5), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(scaled_softmax(&x, 1.0, false, DType::BF16).unwrap().dims(), [0, 5]);
        let x = Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(
            scaled_softmax(&x, 1.0, true, DType::F32).is_err(),
            "causal needs queries = keys"
        );
        let x = Tensor::new(1f32, &Device::Cpu).unwrap();
        assert!(scaled_softmax(&x, 1.0, false, DType::F32).is_err());
    }

    #[test]
    fn key_lengths_mask_like_the_causal_limit() {
        // (b = 2, heads = 2, 3, 3) scores; item 0 sees 2 keys, item 1 none.
        let v: Vec<f32> = (0..36).map(|i| (i % 7) as f32 * 0.25).collect();
        let x = Tensor::from_vec(v, (2, 2, 3, 3), &Device::Cpu).unwrap();
        let keys = |l: &[usize]| {
            Some(KeyLengths {
                lengths: l.into(),
                per_item: 2,
            })
        };
        for causal in [false, true] {
            let p = forward_no_bwd(&x, 0.5, causal, keys(&[2, 0]), DType::F32).unwrap();
            let rows = p.flatten_to(2).unwrap().to_vec2::<f32>().unwrap();
            for (r, row) in rows.iter().enumerate() {
                let (item, i) = (r / 6, r % 3);
                let live = if item == 1 {
                    0
                } else if causal {
                    (i + 1).min(2)
                } else {
                    2
                };
                assert!(row[live..].iter().all(|&p| p == 0.0), "{r}: {row:?}");
                let sum: f32 = row.iter().sum();
                let want = if live == 0 { 0.0 } else { 1.0 };
                assert!((sum - want).abs() < 1e-6, "{r}: {row:?}");
            }
            // Lengths at or past the keys change nothing.
            let full = forward_no_bwd(&x, 0.5, causal, keys(&[3, 9]), DType::F32).unwrap();
            let none = forward_no_bwd(&x, 0.5, causal, None, DType::F32).unwrap();
            assert_eq!(
                full.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                none.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
    }
}
