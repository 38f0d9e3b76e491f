//! The softmax's input gradient from its output alone, one pass per block of rows:
//! `dx = (y * (dy - Σ dy * y)) * scale`, computed in f32 and rounded once to the type asked
//! for. Composed from candle ops it was seven passes with a fresh tensor each (two per-value
//! `to_dtype` conversions, the product, the row sums, the broadcast subtraction, the product,
//! the scaling), and a cast after it in the attention's backward.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, D, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::dispatch::{Kernel, dispatch, dot_lanes};
use super::simd::Elem;
use super::slices::{Vx, convert};

/// Rows per rayon task and per conversion pass.
const ROWS_PER_TASK: usize = 16;

/// Rows of `cols` values: `dy` becomes `dx` in place.
struct Rows<'a> {
    y: &'a [f32],
    dy: &'a mut [f32],
    cols: usize,
    scale: f32,
}

impl Kernel for Rows<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for (y, dy) in self.y.chunks(self.cols).zip(self.dy.chunks_mut(self.cols)) {
            let dot = dot_lanes(y, dy);
            for (d, y) in dy.iter_mut().zip(y) {
                *d = (y * (*d - dot)) * self.scale;
            }
        }
    }
}

fn rows<T: Elem + Vx, O: Elem + Vx>(y: &[T], dy: &[T], cols: usize, scale: f32) -> Vec<O> {
    let mut out = vec![O::from_f32(0.0); y.len()];
    let task = cols * ROWS_PER_TASK;
    out.par_chunks_mut(task)
        .zip(y.par_chunks(task).zip(dy.par_chunks(task)))
        .for_each(|(o, (y, dy))| {
            let (mut yb, mut db) = (vec![0f32; y.len()], vec![0f32; y.len()]);
            convert(y, &mut yb);
            convert(dy, &mut db);
            dispatch(Rows {
                y: &yb,
                dy: &mut db,
                cols,
                scale,
            });
            convert(&db, o);
        });
    out
}

/// The op: `y` and `dy` of one type and one shape, the gradient in `out`.
struct Grad {
    scale: f32,
    out: DType,
}

fn typed<T: Elem + Vx>(y: &[T], dy: &[T], cols: usize, op: &Grad) -> Result<CpuStorage> {
    let s = op.scale;
    Ok(match op.out {
        DType::F32 => CpuStorage::F32(rows(y, dy, cols, s)),
        DType::F16 => CpuStorage::F16(rows(y, dy, cols, s)),
        DType::BF16 => CpuStorage::BF16(rows(y, dy, cols, s)),
        other => candle_core::bail!("amp-softmax-grad: {other:?} output"),
    })
}

impl CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        "amp-softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let msg = || candle_core::Error::Msg("amp-softmax-grad: tensors must be contiguous".into());
        let (a, b) = l1.contiguous_offsets().ok_or_else(msg)?;
        let (c, d) = l2.contiguous_offsets().ok_or_else(msg)?;
        if l1.shape() != l2.shape() {
            candle_core::bail!("amp-softmax-grad: shapes {:?} and {:?}", l1.shape(), l2.shape())
        }
        let cols = l1.shape().dims().last().copied().unwrap_or(1).max(1);
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => typed(&y[a..b], &g[c..d], cols, self)?,
            (CpuStorage::F16(y), CpuStorage::F16(g)) => typed(&y[a..b], &g[c..d], cols, self)?,
            (CpuStorage::BF16(y), CpuStorage::BF16(g)) => typed(&y[a..b], &g[c..d], cols, self)?,
            _ => candle_core::bail!("amp-softmax-grad: {:?} and {:?}", s1.dtype(), s2.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }
}

fn fast(dt: DType) -> bool {
    matches!(dt, DType::F32 | DType::F16 | DType::BF16)
}

/// The softmax's input gradient `(y * (dy - Σ dy * y)) * scale` (sums over the last
/// dimension) in `out`, from its output `res` and the output's gradient `grad_res`: one
/// node without a backward on the CPU (the kernels on), candle's ops in f32 elsewhere.
pub(super) fn grad(res: &Tensor, grad_res: &Tensor, scale: f32, out: DType) -> Result<Tensor> {
    let cpu = super::enabled() && res.device().is_cpu() && fast(res.dtype()) && fast(grad_res.dtype()) && fast(out);
    if !cpu {
        let y = res.to_dtype(DType::F32)?;
        let dy = grad_res.to_dtype(DType::F32)?;
        let dot = (&dy * &y)?.sum_keepdim(D::Minus1)?;
        return (y * dy.broadcast_sub(&dot)?)?.affine(scale as f64, 0.0)?.to_dtype(out);
    }
    // One type for both (they have one in every caller; else both widened).
    let (y, dy) = if res.dtype() == grad_res.dtype() {
        (super::dense(res)?, super::dense(grad_res)?)
    } else {
        (super::cast(res, DType::F32)?, super::cast(grad_res, DType::F32)?)
    };
    y.detach().apply_op2_no_bwd(&dy.detach(), &Grad { scale, out })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn f64s(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// Against the same arithmetic in f64, every type pair, rows shorter and longer than the
    /// lanes, a zero row (masked) and an empty tensor.
    #[test]
    fn matches_f64_arithmetic() {
        for cols in [1usize, 5, 32, 33, 130] {
            let rows = 37;
            let n = rows * cols;
            let mut y: Vec<f32> = (0..n).map(|i| ((i * 7919 % 101) as f32) / 101.0).collect();
            for r in 0..rows {
                let s: f32 = y[r * cols..(r + 1) * cols].iter().sum();
                y[r * cols..(r + 1) * cols].iter_mut().for_each(|v| *v /= s.max(1e-3));
            }
            y[..cols].fill(0.0);
            let dy: Vec<f32> = (0..n).map(|i| ((i * 104729 % 53) as f32) / 13.0 - 2.0).collect();
            for dt in [DType::F32, DType::F16, DType::BF16] {
                for out in [DType::F32, DType::F16, DType::BF16] {
                    let typed = |v: &[f32]| {
                        let t = Tensor::from_slice(v, (rows, cols), &Device::Cpu).unwrap();
                        t.to_dtype(dt).unwrap()
                    };
                    let (yt, gt) = (typed(&y), typed(&dy));
                    let got = grad(&yt, &gt, 0.37, out).unwrap();
                    assert_eq!((got.dtype(), got.dims()), (out, &[rows, cols][..]));
                    let (got, y64, g64) = (f64s(&got), f64s(&yt), f64s(&gt));
                    let ulp = match out {
                        DType::F32 => 1e-6,
                        DType::F16 => 1e-3,
                        _ => 8e-3,
                    };
                    for r in 0..rows {
                        let row = r * cols..(r + 1) * cols;
                        let dot: f64 = row.clone().map(|i| y64[i] * g64[i]).sum();
                        for i in row {
                            let want = y64[i] * (g64[i] - dot) * 0.37;
                            let tol = ulp * (1.0 + want.abs()) + 1e-6 * cols as f64;
                            assert!(
                                (got[i] - want).abs() <= tol,
                                "{dt:?}->{out:?} cols {cols} at {i}: {} vs {want}",
                                got[i]
                            );
                            if r == 0 {
                                assert_eq!(got[i], 0.0, "a masked row's gradient is zero");
                            }
                        }
                    }
                }
            }
        }
        let e = Tensor::zeros((3, 0), DType::F16, &Device::Cpu).unwrap();
        assert_eq!(grad(&e, &e, 1.0, DType::F32).unwrap().dims(), [3, 0]);
    }

    #[test]
    fn mixed_types_and_mismatched_shapes() {
        let y = Tensor::ones((2, 3), DType::F16, &Device::Cpu).unwrap();
        let g = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
        let d = grad(&y, &g, 1.0, DType::F32).unwrap().to_vec2::<f32>().unwrap();
        // dot = 3, dx = 1 * (1 - 3) = -2
        assert_eq!(d, vec![vec![-2f32; 3]; 2]);
        let g = Tensor::ones((3, 2), DType::F16, &Device::Cpu).unwrap();
        assert!(grad(&y, &g, 1.0, DType::F32).is_err());
    }
}
