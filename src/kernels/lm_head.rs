//! A language model's head and its loss as one node: `mean cross entropy(h w^T + b, t)`
//! computed in f32 over row chunks, so the `N x vocab` logits never exist as a tensor of
//! candle's graph (Liger's and Transformer Engine's fused linear cross entropy, llm.c's
//! fused classifier).
//!
//! The forward takes a chunk of rows at a time: its logits (f32, at most [`CHUNK_VALUES`]
//! values in this thread's scratch), their log-sum-exp and the loss terms, and, where a
//! gradient is wanted, the gradient at the logits `(softmax - onehot) / N` in f32 and from it
//! the chunk's share of the hidden's gradient (`dlogits . w`) and the weight's
//! (`dlogits^T . h`), both accumulated in f32. The loss is a scalar of the graph, so its
//! backward only scales those by the loss's gradient: the hidden's is rounded once to its
//! type, the weight's and bias's go to the run's [`GradSink`] in f32 as
//! [`super::wgrad`]'s node sends them. Three products in all, as the unfused forward and
//! backward, with no half logits, no f32 copy of them and no half gradient of them.
//!
//! A target equal to its type's maximum is ignored (loss and gradient 0 for its row, still
//! counted in the mean), as `ops::cross_entropy` does.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor};

use super::gelu::exp_f32;
use super::gemm::{GemmElem, gemm_wide_lhs};
use super::mat::Mat;
use super::slices::convert;
use super::wgrad::{GradSink, apply_node};

/// Logits per chunk at most (4 MiB of f32), unless one chunk of [`MIN_ROWS`] needs more.
const CHUNK_VALUES: usize = 1 << 20;
/// Rows per chunk at least, so the products keep a useful inner dimension.
const MIN_ROWS: usize = 32;

/// The targets as row indices into the vocabulary; [`IGNORED`] for an ignored row.
pub(crate) type Targets = Arc<[u32]>;

/// An ignored row's target.
pub(crate) const IGNORED: u32 = u32::MAX;

/// What the forward computed for the backward: each gradient for a loss gradient of 1.
#[derive(Clone)]
struct Saved {
    /// `d loss / d h`, f32, `N x d`.
    dh: Option<Vec<f32>>,
    /// `d loss / d w`, f32, `V x d`.
    dw: Option<Vec<f32>>,
    /// `d loss / d b`, f32, `V`.
    db: Option<Vec<f32>>,
}

/// The node over the hidden `h` (`N x d`); the weight, bias and targets are values it holds.
struct LinearXent {
    /// The weight as computed with (`h`'s type), dense, detached.
    w: Tensor,
    /// The bias in f32, if any.
    b: Option<Vec<f32>>,
    targets: Targets,
    w_key: Option<Tensor>,
    b_key: Option<Tensor>,
    sink: Arc<dyn GradSink>,
    /// Whether `h` takes a gradient.
    h_grad: bool,
    saved: Mutex<Option<Saved>>,
}

/// What one chunk's work needs, borrowed.
struct Chunked<'a, T> {
    h: &'a [T],
    w: &'a [T],
    b: Option<&'a [f32]>,
    t: &'a [u32],
    d: usize,
    v: usize,
}

impl<T: GemmElem> Chunked<'_, T> {
    /// The summed loss terms (f64) and, where asked, the gradients for a loss gradient of 1.
    fn run(&self, want: (bool, bool, bool)) -> (f64, Saved) {
        let (n, d, v) = (self.t.len(), self.d, self.v);
        let rows = (CHUNK_VALUES / v.max(1)).max(MIN_ROWS).min(n.max(1));
        let mut dh = want.0.then(|| vec![0f32; n * d]);
        let mut dw = want.1.then(|| vec![0f32; v * d]);
        let mut db = want.2.then(|| vec![0f32; v]);
        let grads = want.0 || want.1 || want.2;
        let inv_n = 1.0 / n as f32;
        let mut total = 0f64;
        let mut half_dl: Option<Vec<T>> = None;
        super::scratch::with_f32(rows * v, |buf| {
            for r0 in (0..n).step_by(rows) {
                let r = rows.min(n - r0);
                let logits = &mut buf[..r * v];
                self.logits(r0, r, logits);
                for (i, row) in logits.chunks_mut(v).enumerate() {
                    total += row_loss(row, self.t[r0 + i], grads, inv_n);
                }
                if !grads {
                    continue;
                }
                let dl = &*logits;
                if let Some(dh) = dh.as_deref_mut() {
                    // dh rows = dlogits (r x v) . w (v x d), with the logits' gradient rounded
                    // to the half type as the unfused backward's product takes it (the
                    // hidden's gradient is rounded to it anyway; the weight's below stays f32):
                    // the product then runs at the half type's rate.
                    let dl_half = half_dl.get_or_insert_with(Vec::new);
                    dl_half.resize(r * v, T::from_f32(0.0));
                    convert(dl, dl_half);
                    let a = Mat {
                        data: &dl_half[..],
                        off: 0,
                        rs: v,
                        cs: 1,
                    };
                    let b = Mat {
                        data: self.w,
                        off: 0,
                        rs: d,
                        cs: 1,
                    };
                    T::gemm(r, d, v, a, b, &mut dh[r0 * d..(r0 + r) * d], d, false);
                }
                if let Some(dw) = dw.as_deref_mut() {
                    // dw (v x d) += dlogits^T (v x r) . h rows (r x d).
                    let a = Mat {
                        data: dl,
                        off: 0,
                        rs: 1,
                        cs: v,
                    };
                    let b = Mat {
                        data: self.h,
                        off: r0 * d,
                        rs: d,
                        cs: 1,
                    };
                    gemm_wide_lhs(v, d, r, a, b, dw, d, r0 > 0);
                }
                if let Some(db) = db.as_deref_mut() {
                    for row in dl.chunks(v) {
                        for (s, g) in db.iter_mut().zip(row) {
                            *s += g;
                        }
                    }
                }
            }
        });
        (total, Saved { dh, dw, db })
    }

    /// Rows `r0..r0 + r` of `h w^T + b` into `out` (`r x v`, f32).
    fn logits(&self, r0: usize, r: usize, out: &mut [f32]) {
        let (d, v) = (self.d, self.v);
        if let Some(b) = self.b {
            for row in out.chunks_mut(v) {
                row.copy_from_slice(b);
            }
        }
        let a = Mat {
            data: self.h,
            off: r0 * d,
            rs: d,
            cs: 1,
        };
        let wt = Mat {
            data: self.w,
            off: 0,
            rs: 1,
            cs: d,
        };
        T::gemm(r, v, d, a, wt, out, v, self.b.is_some());
    }
}

/// One row's loss term `logsumexp(row) - row[t]` (0 for an ignored row); with `grads`, the
/// row replaced by its gradient `(softmax(row) - onehot(t)) / n` (`inv_n` = 1/n), zero for
/// an ignored row. Compiled per instruction set, its maximum and sum in lanes (so they
/// vectorise: sequential, this row pass was about 2.5% of a Llama step at O2 on Zen 4).
fn row_loss(row: &mut [f32], t: u32, grads: bool, inv_n: f32) -> f64 {
    super::dispatch::dispatch(RowLoss { row, t, grads, inv_n })
}

struct RowLoss<'a> {
    row: &'a mut [f32],
    t: u32,
    grads: bool,
    inv_n: f32,
}

impl super::dispatch::Kernel for RowLoss<'_> {
    type Output = f64;
    #[inline(always)]
    fn run(self) -> f64 {
        let RowLoss { row, t, grads, inv_n } = self;
        if t == IGNORED {
            if grads {
                row.fill(0.0);
            }
            return 0.0;
        }
        let max = super::softmax::max_lanes(row);
        // An all -inf row (or +inf anywhere): the shift is then not finite; the plain path's
        // NaN comes out the same way.
        let sum = super::dispatch::sum_lanes(row, |x| exp_f32(x - max));
        let lse = max + sum.ln();
        let term = lse - row[t as usize];
        if grads {
            for x in row.iter_mut() {
                *x = exp_f32(*x - lse) * inv_n;
            }
            row[t as usize] -= inv_n;
        }
        term as f64
    }
}

impl LinearXent {
    fn fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, d) = l.shape().dims2()?;
        let (v, wd) = self.w.dims2()?;
        if wd != d || self.targets.len() != n || self.b.as_ref().is_some_and(|b| b.len() != v) {
            candle_core::bail!(
                "amp-linear-xent: hidden {n} x {d}, weight {v} x {wd}, {} targets",
                self.targets.len()
            )
        }
        let (ha, hb) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("amp-linear-xent: the hidden must be dense".into()))?;
        let (ws, wl) = self.w.storage_and_layout();
        let (wa, wb) = wl
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("amp-linear-xent: the weight must be dense".into()))?;
        let want = (self.h_grad, self.w_key.is_some(), self.b_key.is_some());
        let (b, t) = (self.b.as_deref(), &self.targets[..]);
        let (total, saved) = match (s, &*ws) {
            (CpuStorage::F16(h), Storage::Cpu(CpuStorage::F16(w))) => Chunked {
                h: &h[ha..hb],
                w: &w[wa..wb],
                b,
                t,
                d,
                v,
            }
            .run(want),
            (CpuStorage::BF16(h), Storage::Cpu(CpuStorage::BF16(w))) => Chunked {
                h: &h[ha..hb],
                w: &w[wa..wb],
                b,
                t,
                d,
                v,
            }
            .run(want),
            (CpuStorage::F32(h), Storage::Cpu(CpuStorage::F32(w))) => Chunked {
                h: &h[ha..hb],
                w: &w[wa..wb],
                b,
                t,
                d,
                v,
            }
            .run(want),
            _ => candle_core::bail!("amp-linear-xent: hidden {:?}, weight {:?}", s.dtype(), self.w.dtype()),
        };
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(saved);
        // The mean over every row, ignored ones counted (0/0 for no rows, as the plain path).
        let loss = (total / n as f64) as f32;
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    /// Sends the parameters' gradients, scaled by the loss's gradient `g`, to the sink and
    /// returns the hidden's.
    fn bwd_h(&self, h: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let gv = g.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let saved = self.saved.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let saved = saved.ok_or_else(|| candle_core::Error::Msg("amp-linear-xent: no forward ran".into()))?;
        let dev = Device::Cpu;
        let scaled = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| x * gv).collect() };
        if let (Some(key), Some(dw)) = (&self.w_key, saved.dw) {
            self.sink
                .add(key, Tensor::from_vec(scaled(dw), self.w.shape(), &dev)?)?;
        }
        if let (Some(key), Some(db)) = (&self.b_key, saved.db) {
            let len = db.len();
            self.sink.add(key, Tensor::from_vec(scaled(db), len, &dev)?)?;
        }
        let Some(dh) = saved.dh.filter(|_| self.h_grad) else {
            return Ok(None);
        };
        let dh = scaled(dh);
        let out = match h.dtype() {
            DType::F32 => Tensor::from_vec(dh, h.shape(), &dev)?,
            DType::F16 => {
                let mut o = vec![half::f16::ZERO; dh.len()];
                convert(&dh, &mut o);
                Tensor::from_vec(o, h.shape(), &dev)?
            }
            DType::BF16 => {
                let mut o = vec![half::bf16::ZERO; dh.len()];
                convert(&dh, &mut o);
                Tensor::from_vec(o, h.shape(), &dev)?
            }
            other => candle_core::bail!("amp-linear-xent: {other:?} hidden"),
        };
        Ok(Some(super::graph_grad::for_candle(out)?))
    }
}

impl CustomOp1 for LinearXent {
    fn name(&self) -> &'static str {
        "amp-linear-xent"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd(s, l)
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.bwd_h(h, g)
    }
}

/// The node over `(h, anchor)` for a hidden that takes no gradient (see `wgrad::apply_node`).
impl CustomOp2 for LinearXent {
    fn name(&self) -> &'static str {
        "amp-linear-xent"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd(s1, l1)
    }

    fn bwd(&self, h: &Tensor, _anchor: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((self.bwd_h(h, g)?, None))
    }
}

/// The parameters of [`linear_cross_entropy`]: the weight and bias as computed with (the
/// hidden's type), and the parameters their gradients go under (`None`: not computed).
pub(crate) struct Head<'a> {
    pub w: &'a Tensor,
    pub b: Option<&'a Tensor>,
    pub w_key: Option<&'a Tensor>,
    pub b_key: Option<&'a Tensor>,
}

/// `mean cross entropy(h w^T + b, targets)` as one node on `h` (`N x d`, f16, bf16 or f32 on
/// the CPU, `w` of its type, the targets checked by the caller: `N` values in `0..V` or
/// [`IGNORED`]), the parameter gradients sent to `sink` in f32. `None` where it does not
/// apply (the kernels off, another device or type): the caller runs the plain ops.
pub(crate) fn linear_cross_entropy(
    h: &Tensor,
    head: Head<'_>,
    targets: Targets,
    sink: Arc<dyn GradSink>,
) -> Result<Option<Tensor>> {
    let dt = h.dtype();
    let cpu = h.device().is_cpu() && head.w.device().is_cpu() && head.b.is_none_or(|b| b.device().is_cpu());
    if !(super::enabled() && cpu && super::matmul::supported(dt) && head.w.dtype() == dt && h.rank() == 2) {
        return Ok(None);
    }
    if head.w.rank() != 2 || head.b.is_some_and(|b| b.dims() != [head.w.dims()[0]]) {
        return Ok(None);
    }
    let b = match head.b {
        Some(b) => Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    };
    let h = super::dense(h)?;
    let node = LinearXent {
        w: super::dense(&head.w.detach())?,
        b,
        targets,
        w_key: head.w_key.cloned(),
        b_key: head.b_key.cloned(),
        sink,
        h_grad: h.track_op(),
        saved: Mutex::new(None),
    };
    let trains = node.w_key.is_some() || node.b_key.is_some();
    Ok(Some(apply_node(&h, node, trains)?))
}
