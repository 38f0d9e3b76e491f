//! A language model's head and its mean cross entropy as one node off the CPU, written with
//! device-generic tensor ops: the logits exist a chunk of rows at a time, never as an
//! `N x vocab` tensor (Liger's fused linear cross entropy, on candle's matmul: cuBLAS on CUDA).
//!
//! The forward walks the rows in chunks (at most [`DEVICE_CHUNK_VALUES`] logits each, the CPU
//! node's `CHUNK_VALUES` idea with a bound sized for a GPU's products): the chunk's logits
//! `h_c w^T (+ b)` in the hidden's type (the plain path's product and rounding), then one
//! launch (`amp_xent_rows`, `xent.cu`) that reads them and writes each row's log-probability
//! at its target (f32) and the gradient at the logits `(softmax - onehot) / N` (f32
//! arithmetic, stored in the logits' type: the type the next two products take, as the plain
//! path's backward stores it), then, where wanted, the hidden's rows `dh_c = dlogits_c w`, the
//! weight's `dw += dlogits_c^T h_c` and the bias's `db += colsum(dlogits_c)`. The weight's and
//! bias's sums are f32: each chunk's product comes out of the matmul in the hidden's type
//! (candle has no half product with an f32 output) and is added to the f32 sum in one kernel
//! (`rows::add_cast` on CUDA: reads the half product and the f32 sum, writes the sum), so the
//! sum over chunks never rounds to half; the chunks are large (hundreds of rows) so that pass
//! over `V x d` runs a dozen times for GPT-2's 8192 tokens, not hundreds.
//!
//! The loss is one node over `(h, w[, b])` whose forward hands on the loss computed before it
//! was applied, and whose backward scales the kept gradients by the loss's gradient (in f32)
//! and returns them through candle's graph in their own types: on a device the library has no
//! f32 gradient stash, and the weight's gradient reaches candle's `GradStore` as the plain
//! path's does, once (rounded from the f32 sum) instead of as a half product of all rows.
//! Like the CPU node, its forward costs the three products of a forward and backward, and it
//! keeps `dh` (`N x d`), `dw` (`V x d`, f32) and `db` until the backward.
//!
//! Targets arrive checked on the host (`nn::linear_cross_entropy` copies device targets once)
//! as row indices, [`super::lm_head::IGNORED`] for an ignored row (loss and gradient 0, still
//! counted in the mean).

use std::cell::Cell;
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor};

use super::lm_head::IGNORED;

/// Logits per chunk at most on a device (32 Mi values: 64 MiB in half, the gradient as much
/// again; GPT-2's vocabulary gives chunks of 640 rows, Llama 3's 256).
const DEVICE_CHUNK_VALUES: usize = 1 << 25;
/// Rows per chunk at least, and their multiple: whole tensor-core tiles for the products.
const MIN_ROWS: usize = 64;

const NAME: &str = "amp-chunked-linear-xent";

thread_local! {
    /// The testing switch: rows per chunk, and the node taken on the CPU device too.
    static FORCED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Makes [`applies`] take the CPU device on this thread, with `rows` rows per chunk (`None`:
/// back to the CUDA devices only). For the tests: see `testing::chunked_lm_head_on_cpu`.
pub(crate) fn force_on_cpu(rows: Option<usize>) {
    FORCED.with(|f| f.set(rows.map(|r| r.max(1))));
}

/// Whether the testing switch is on for this thread.
pub(crate) fn forced() -> bool {
    FORCED.with(Cell::get).is_some()
}

/// Rows per chunk for `n` rows of `v` logits.
fn chunk_rows(n: usize, v: usize) -> usize {
    let r = FORCED.with(Cell::get).unwrap_or_else(|| {
        let r = (DEVICE_CHUNK_VALUES / v.max(1)).max(MIN_ROWS);
        r - r % MIN_ROWS
    });
    r.min(n).max(1)
}

/// Whether the node computes `mean cross entropy(h w^T + b, t)` for `h` (`N x d`): the kernels
/// on, one float type for all three, a 2-d weight and a bias of its rows, no empty dimension,
/// and a CUDA device with the cross-entropy kernels loaded (or the CPU under the testing
/// switch).
pub(crate) fn applies(h: &Tensor, w: &Tensor, b: Option<&Tensor>) -> bool {
    let dt = h.dtype();
    let shapes = h.rank() == 2
        && w.rank() == 2
        && h.dims()[1] == w.dims()[1]
        && b.is_none_or(|b| b.dims() == [w.dims()[0]])
        && h.elem_count() > 0
        && w.elem_count() > 0;
    let types =
        matches!(dt, DType::F32 | DType::F16 | DType::BF16) && w.dtype() == dt && b.is_none_or(|b| b.dtype() == dt);
    let same = w.device().same_device(h.device()) && b.is_none_or(|b| b.device().same_device(h.device()));
    if !(super::enabled() && shapes && types && same) {
        return false;
    }
    match h.device() {
        Device::Cpu => FORCED.with(Cell::get).is_some(),
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let (n, v) = (h.dims()[0], w.dims()[0]);
            super::cuda::xent::xent_plan(chunk_rows(n, v), v, dt, DType::U32).is_some()
                && super::cuda::xent::available(dev)
        }
        _ => false,
    }
}

/// `mean cross entropy(h w^T + b, targets)` as one node over `(h, w[, b])` (see the module's
/// documentation), for inputs [`applies`] accepts and `targets` checked: `N` values in `0..V`
/// or [`IGNORED`].
pub(crate) fn linear_cross_entropy(h: &Tensor, w: &Tensor, b: Option<&Tensor>, targets: &[u32]) -> Result<Tensor> {
    let (n, _) = h.dims2()?;
    if targets.len() != n {
        candle_core::bail!("{NAME}: {} targets for {n} rows", targets.len())
    }
    let t = Tensor::from_slice(targets, n, h.device())?;
    let want = [h.track_op(), w.track_op(), b.is_some_and(Tensor::track_op)];
    let (loss, grads) = forward(
        &super::dense(&h.detach())?,
        &super::dense(&w.detach())?,
        b.map(Tensor::detach).as_ref(),
        &t,
        want,
    )?;
    let node = Node {
        result: Mutex::new(Some(loss)),
        grads: Mutex::new(Some(grads)),
    };
    match b {
        Some(b) => h.apply_op3(w, b, node),
        None => h.apply_op2(w, node),
    }
}

/// The gradients for a loss gradient of 1, each where wanted: the hidden's in its type, the
/// weight's and bias's in f32.
#[derive(Clone)]
struct Grads {
    dh: Option<Tensor>,
    dw: Option<Tensor>,
    db: Option<Tensor>,
}

/// The loss (f32, shape `()`) and [`Grads`] for `want` = (h, w, b), a chunk of rows at a time.
fn forward(h: &Tensor, w: &Tensor, b: Option<&Tensor>, t: &Tensor, want: [bool; 3]) -> Result<(Tensor, Grads)> {
    let (n, _) = h.dims2()?;
    let v = w.dim(0)?;
    let rows = chunk_rows(n, v);
    let wt = w.t()?;
    let inv_n = (1.0 / n as f64) as f32;
    let mut logp = Vec::new();
    let mut dh = Vec::new();
    let (mut dw, mut db): (Option<Tensor>, Option<Tensor>) = (None, None);
    for r0 in (0..n).step_by(rows) {
        let r = rows.min(n - r0);
        let hc = h.narrow(0, r0, r)?;
        let mut logits = hc.matmul(&wt)?;
        if let Some(b) = b {
            logits = logits.broadcast_add(b)?;
        }
        let (lp, dl) = rows_logp_grad(&logits, &t.narrow(0, r0, r)?, inv_n)?;
        drop(logits);
        logp.push(lp);
        if want[0] {
            dh.push(dl.matmul(w)?);
        }
        if want[1] {
            let part = dl.t()?.matmul(&hc)?;
            dw = Some(add_f32(dw, &part)?);
        }
        if want[2] {
            let part = dl.to_dtype(DType::F32)?.sum(0)?;
            db = Some(add_f32(db, &part)?);
        }
    }
    // The mean as the plain CUDA path takes it: the rows' log-probabilities summed, times
    // -1/N rounded to f32.
    let scale = (-1.0 / n as f64) as f32;
    let loss = Tensor::cat(&logp, 0)?.sum_all()?.affine(scale as f64, 0.0)?;
    let dh = if want[0] { Some(Tensor::cat(&dh, 0)?) } else { None };
    Ok((loss, Grads { dh, dw, db }))
}

/// `sum + part` in f32 (`part` of any float type); `part` widened where there is no sum yet.
fn add_f32(sum: Option<Tensor>, part: &Tensor) -> Result<Tensor> {
    let Some(sum) = sum else {
        return part.to_dtype(DType::F32);
    };
    // One pass on CUDA: the half product read and widened in the add's kernel.
    if let Some(s) = super::cuda::rows::add_cast(&sum, part, DType::F32)? {
        return Ok(s);
    }
    sum + part.to_dtype(DType::F32)?
}

/// One chunk's log-probabilities (f32, `(r)`) and logits' gradient (the logits' type, `(r, V)`).
fn rows_logp_grad(logits: &Tensor, t: &Tensor, inv_n: f32) -> Result<(Tensor, Tensor)> {
    let r = logits.dim(0)?;
    let op = RowsOp {
        inv_n,
        logp: Mutex::new(None),
    };
    let dl = logits.apply_op2_no_bwd(t, &op)?;
    let lp = op.logp.lock().unwrap_or_else(|e| e.into_inner()).take();
    let lp = lp.ok_or_else(|| candle_core::Error::Msg(format!("{NAME}: no log-probabilities")))?;
    Ok((Tensor::from_storage(lp, r, BackpropOp::none(), false), dl))
}

/// The op over one chunk's `(logits (r, V), targets (r) u32)`: its output is the logits'
/// gradient; the rows' log-probabilities, a second output, are kept for [`rows_logp_grad`].
struct RowsOp {
    inv_n: f32,
    logp: Mutex<Option<Storage>>,
}

impl RowsOp {
    fn keep(&self, s: Storage) {
        *self.logp.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
    }
}

/// The CPU's pass (the testing switch's; the same arithmetic as `amp_xent_rows`, in another
/// order): each row's maximum `m` and sum `s` of `exp(x - m)` in f32, `log p_t = (x_t - m) -
/// ln s`, and `(exp(x - m) / s - onehot) * inv_n` rounded to `T`.
fn rows_cpu<T: Copy>(
    x: &[T],
    t: &[u32],
    v: usize,
    inv_n: f32,
    to: impl Fn(T) -> f32,
    from: impl Fn(f32) -> T,
) -> (Vec<f32>, Vec<T>) {
    let mut logp = Vec::with_capacity(t.len());
    let mut dx = Vec::with_capacity(x.len());
    for (row, &ti) in x.chunks_exact(v).zip(t) {
        let m = row.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(to(a)));
        let s = if m == f32::NEG_INFINITY {
            f32::NAN
        } else {
            row.iter().map(|&a| (to(a) - m).exp()).sum::<f32>()
        };
        let (lp, gn) = match ti {
            IGNORED => (0.0, 0.0),
            c if c as usize >= v => (f32::NAN, f32::NAN),
            c => ((to(row[c as usize]) - m) - s.ln(), inv_n),
        };
        logp.push(lp);
        for (j, &a) in row.iter().enumerate() {
            let g = if ti == IGNORED {
                0.0
            } else {
                ((to(a) - m).exp() / s - f32::from(j == ti as usize)) * gn
            };
            dx.push(from(g));
        }
    }
    (logp, dx)
}

impl CustomOp2 for RowsOp {
    fn name(&self) -> &'static str {
        "amp-chunked-linear-xent-rows"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (r, v) = l1.shape().dims2()?;
        let dense = |l: &Layout| {
            l.contiguous_offsets()
                .ok_or_else(|| candle_core::Error::Msg(format!("{NAME}: a chunk must be dense")))
        };
        let ((xa, xb), (ta, tb)) = (dense(l1)?, dense(l2)?);
        let CpuStorage::U32(t) = s2 else {
            candle_core::bail!("{NAME}: {:?} targets", s2.dtype())
        };
        let t = &t[ta..tb];
        if t.len() != r {
            candle_core::bail!("{NAME}: {} targets for {r} rows", t.len())
        }
        let (logp, dx) = match s1 {
            CpuStorage::F32(x) => {
                let (lp, d) = rows_cpu(&x[xa..xb], t, v, self.inv_n, |a| a, |g| g);
                (lp, CpuStorage::F32(d))
            }
            CpuStorage::F16(x) => {
                let (lp, d) = rows_cpu(&x[xa..xb], t, v, self.inv_n, half::f16::to_f32, half::f16::from_f32);
                (lp, CpuStorage::F16(d))
            }
            CpuStorage::BF16(x) => {
                let (lp, d) = rows_cpu(&x[xa..xb], t, v, self.inv_n, half::bf16::to_f32, half::bf16::from_f32);
                (lp, CpuStorage::BF16(d))
            }
            other => candle_core::bail!("{NAME}: {:?} logits", other.dtype()),
        };
        self.keep(Storage::Cpu(CpuStorage::F32(logp)));
        Ok((dx, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (logp, dx) = super::cuda::xent::rows_logp_grad(s1, l1, s2, l2, self.inv_n)?;
        self.keep(Storage::Cuda(logp));
        Ok((dx, l1.shape().clone()))
    }
}

/// The loss node over `(h, w[, b])`: the loss and gradients computed before it was applied.
struct Node {
    /// The loss until the forward hands it to candle.
    result: Mutex<Option<Tensor>>,
    /// The gradients for a loss gradient of 1, kept (as the CPU node keeps them) so that a
    /// second backward through the same graph gets them too.
    grads: Mutex<Option<Grads>>,
}

impl Node {
    fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        super::chain::hand_over(&self.result, NAME)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = self.result.lock().unwrap_or_else(|e| e.into_inner()).take();
        let out = out.ok_or_else(|| candle_core::Error::Msg(format!("{NAME}: the forward ran twice")))?;
        super::cuda_owned_copy(&out, NAME)
    }

    /// The kept gradients times the loss's gradient `g` (in f32), each in its input's type.
    fn bwd(&self, inputs: [Option<&Tensor>; 3], g: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let grads = self.grads.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let grads = grads.ok_or_else(|| candle_core::Error::Msg(format!("{NAME}: no forward ran")))?;
        let g = g.to_dtype(DType::F32)?;
        let scaled = |d: Option<Tensor>, x: Option<&Tensor>| -> Result<Option<Tensor>> {
            match (d, x) {
                (Some(d), Some(x)) => Ok(Some(
                    d.to_dtype(DType::F32)?
                        .broadcast_mul(&g)?
                        .to_dtype(x.dtype())?
                        .reshape(x.shape())?,
                )),
                _ => Ok(None),
            }
        };
        Ok([
            scaled(grads.dh, inputs[0])?,
            scaled(grads.dw, inputs[1])?,
            scaled(grads.db, inputs[2])?,
        ])
    }
}

impl CustomOp2 for Node {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda()
    }

    fn bwd(&self, h: &Tensor, w: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [dh, dw, _] = self.bwd([Some(h), Some(w), None], g)?;
        Ok((dh, dw))
    }
}

impl CustomOp3 for Node {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda()
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dh, dw, db] = self.bwd([Some(h), Some(w), Some(b)], g)?;
        Ok((dh, dw, db))
    }
}
