//! A linear layer whose parameter gradients never enter candle's graph (Megatron-LM's
//! `gradient_accumulation_fusion`, Transformer Engine's `fuse_wgrad_accumulation`).
//!
//! The forward `x w^T + b` is one graph node on the input `x` only; the weight and bias are
//! values the node holds. Its backward returns `x`'s gradient to candle and hands the weight
//! and bias gradients, as the products' f32 accumulations (never rounded to half), to a
//! [`GradSink`]: the run's stash, which the backward pipeline merges before it unscales. So
//! candle never accumulates a half gradient of a parameter (candle 0.11 accumulates every
//! node's gradient as `zeros_like` + `add` in the node's type, and its half element-wise
//! ops are slow on the CPU), and the gradient the optimizer unscales is more accurate.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, Var};

use super::matmul::{bmm, bmm_f32, f32_of, gradient_column_sums, linear_cpu, supported};

/// Where a layer's parameter gradients go instead of candle's `GradStore`.
pub(crate) trait GradSink: Send + Sync {
    /// Adds `grad` (f32, `param`'s shape) to the gradient waiting for `param`.
    fn add(&self, param: &Tensor, grad: Tensor) -> Result<()>;
}

/// An activation applied inside the node (Apex's `FusedDense` + activation, Transformer
/// Engine's `LayerNormMLP` internals): the pre-activation is then no graph edge, so candle
/// neither stores nor accumulates a half gradient for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    /// `max(h, 0)`, as [`super::relu`]; its backward needs only the output.
    Relu,
    /// GELU (erf form), as [`super::gelu`]; the node keeps the pre-activation for the backward.
    Gelu,
    /// GELU (tanh form), as [`super::gelu_tanh`]; kept as for [`Act::Gelu`].
    GeluTanh,
}

/// The form of the input gradient [`WgradLinear::bwd_x`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dx {
    /// In `x`'s type, in the layout candle's graph takes.
    Graph,
    /// In `x`'s type, dense.
    Dense,
    /// The f32 accumulation, dense, not rounded.
    Wide,
}

/// The node: the values it computes with and the parameters its gradients are for.
pub(super) struct WgradLinear {
    /// The weight as computed with (`x`'s type; a half copy at O1), detached.
    w: Tensor,
    /// The bias as computed with (n contiguous values), detached.
    b: Option<Tensor>,
    /// The parameter the weight's gradient is for (`None`: no gradient wanted, e.g. frozen).
    w_key: Option<Tensor>,
    /// The parameter the bias's gradient is for.
    b_key: Option<Tensor>,
    sink: Arc<dyn GradSink>,
    /// Whether `x` takes a gradient (false: the node hangs off an anchor, see [`linear`]).
    pub(super) x_grad: bool,
    /// The activation applied to the product, if any.
    act: Option<Act>,
    /// GELU's pre-activation, rounded to the output type as the unfused layer's output is,
    /// kept by the forward for the backward.
    pre: Mutex<Option<Tensor>>,
}

/// Whether the node computes `x w^T + b`: the kernels on, one supported type, the CPU, a 2-d
/// weight and a bias of its rows.
pub(super) fn applies(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> bool {
    let dt = x.dtype();
    super::enabled()
        && supported(dt)
        && w.dtype() == dt
        && b.is_none_or(|b| b.dtype() == dt)
        && x.device().is_cpu()
        && w.device().is_cpu()
        && b.is_none_or(|b| b.device().is_cpu())
        && x.rank() >= 1
        && w.rank() == 2
        && b.is_none_or(|b| b.dims() == [w.dims()[0]])
}

impl WgradLinear {
    /// The node for `w`, `b` (detached copies are kept) and the keys their gradients go under.
    pub(super) fn new(
        w: &Tensor,
        b: Option<&Tensor>,
        w_key: Option<&Tensor>,
        b_key: Option<&Tensor>,
        sink: Arc<dyn GradSink>,
        x_grad: bool,
        act: Option<Act>,
    ) -> Result<Self> {
        Ok(Self {
            w: super::dense(&w.detach())?,
            b: b.map(|b| super::dense(&b.detach())).transpose()?,
            w_key: w_key.cloned(),
            b_key: b_key.cloned(),
            sink,
            x_grad,
            act,
            pre: Mutex::new(None),
        })
    }
}

/// A CPU storage as a tensor of `shape`.
fn tensor_of(s: CpuStorage, shape: &Shape) -> Result<Tensor> {
    let dev = Device::Cpu;
    match s {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, &dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, &dev),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, &dev),
        other => candle_core::bail!("amp-linear-wgrad: {:?} output", other.dtype()),
    }
}

impl WgradLinear {
    fn fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cpu(wc) = &*ws else {
            candle_core::bail!("amp-linear-wgrad: the weight is not on the CPU")
        };
        let bias = match &self.b {
            Some(b) => {
                let (bs, bl) = b.storage_and_layout();
                let Storage::Cpu(bc) = &*bs else {
                    candle_core::bail!("amp-linear-wgrad: the bias is not on the CPU")
                };
                Some(f32_of(bc, bl)?)
            }
            None => None,
        };
        let (h, shape) = linear_cpu(s, l, wc, wl, bias)?;
        // The activation runs on the rounded product, exactly as the unfused layer's
        // activation runs on the layer's output: the same values, bit for bit.
        let layout = Layout::contiguous(&shape);
        match self.act {
            None => Ok((h, shape)),
            Some(Act::Relu) => super::relu::Relu.cpu_fwd(&h, &layout),
            Some(a @ (Act::Gelu | Act::GeluTanh)) => {
                let pre = tensor_of(h, &shape)?;
                let out = {
                    let (ps, _) = pre.storage_and_layout();
                    let Storage::Cpu(pc) = &*ps else {
                        candle_core::bail!("amp-linear-wgrad: the pre-activation is not on the CPU")
                    };
                    if a == Act::Gelu {
                        super::gelu::Gelu.cpu_fwd(pc, &layout)?
                    } else {
                        super::gelu::GeluTanh.cpu_fwd(pc, &layout)?
                    }
                };
                *self.pre.lock().unwrap_or_else(|e| e.into_inner()) = Some(pre);
                Ok(out)
            }
        }
    }

    /// Whether any parameter gradient is wanted.
    pub(super) fn has_keys(&self) -> bool {
        self.w_key.is_some() || self.b_key.is_some()
    }

    /// The gradient at the product's output: `g` through the activation's backward.
    pub(super) fn through_act(&self, res: &Tensor, g: &Tensor) -> Result<Tensor> {
        let g = super::dense(g)?;
        match self.act {
            None => Ok(g),
            Some(Act::Relu) => res.apply_op2_no_bwd(&g, &super::relu::ReluGrad),
            Some(a @ (Act::Gelu | Act::GeluTanh)) => {
                let pre = self.pre.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let pre = pre.ok_or_else(|| candle_core::Error::Msg("amp-linear-wgrad: no forward ran".into()))?;
                if a == Act::Gelu {
                    pre.apply_op2_no_bwd(&g, &super::gelu::GeluGrad)
                } else {
                    pre.apply_op2_no_bwd(&g, &super::gelu::GeluTanhGrad)
                }
            }
        }
    }

    /// Gives the parameter gradients to the sink and returns `x`'s: for candle's graph
    /// ([`Dx::Graph`]), dense for the next layer of a chain ([`Dx::Dense`]), or the product's
    /// f32 accumulation ([`Dx::Wide`]) for a fused node that sums several.
    pub(super) fn bwd_x(&self, x: &Tensor, g: &Tensor, out: Dx) -> Result<Option<Tensor>> {
        let (n, k) = self.w.dims2()?;
        let m: usize = x.dims()[..x.rank().saturating_sub(1)].iter().product();
        let g = super::dense(g)?;
        let g2 = g.reshape((m, n))?;
        if let Some(r) = self.bwd_x_widened(x, &g2, (m, n, k), out)? {
            return Ok(r);
        }
        self.bwd_x_per_product(x, &g2, (m, k), out)
    }

    /// [`Self::bwd_x`] with each product and the column sums on `g2` (m x n) as it is.
    fn bwd_x_per_product(&self, x: &Tensor, g2: &Tensor, (m, k): (usize, usize), out: Dx) -> Result<Option<Tensor>> {
        let n = g2.dim(1)?;
        // dw = g^T . x (n x m . m x k) and db = column sums of g, both kept in f32.
        if let Some(key) = &self.w_key {
            let x2 = super::dense(&x.detach())?.reshape((m, k))?;
            self.sink.add(key, bmm_f32(g2, &x2, true, false)?)?;
        }
        if let Some(key) = &self.b_key {
            let sums = gradient_column_sums(g2, n)?;
            self.sink.add(key, Tensor::from_vec(sums, n, g2.device())?)?;
        }
        // dx = g . w (m x n . n x k), in x's type.
        if !self.x_grad {
            return Ok(None);
        }
        Ok(Some(match out {
            Dx::Graph => super::graph_grad::for_candle(bmm(g2, &self.w, false, false)?.reshape(x.shape())?)?,
            Dx::Dense => bmm(g2, &self.w, false, false)?.reshape(x.shape())?,
            Dx::Wide => bmm_f32(g2, &self.w, false, false)?.reshape(x.shape())?,
        }))
    }
}

impl WgradLinear {
    /// [`Self::bwd_x`] with `g` widened to f32 once for its three uses (the weight's and the
    /// input's products, the bias's column sums) instead of once in each, where the products
    /// widen their operands plainly (`gemm::widens_plainly`): the same f32 values reach the
    /// same products and sums, so the results are the same bit for bit. `None`: not that case
    /// (f32, a tier with bf16 dot products, a layout that is not dense).
    fn bwd_x_widened(
        &self,
        x: &Tensor,
        g2: &Tensor,
        mnk: (usize, usize, usize),
        out: Dx,
    ) -> Result<Option<Option<Tensor>>> {
        let want = Wanted {
            w: self.w_key.is_some(),
            b: self.b_key.is_some(),
            x: self
                .x_grad
                .then_some(if out == Dx::Wide { DType::F32 } else { x.dtype() }),
        };
        let (dw, db, dx) = {
            // Read guards only, released before the sink (which writes other buffers) runs.
            let (gs, gl) = g2.storage_and_layout();
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = self.w.storage_and_layout();
            let (Storage::Cpu(gc), Storage::Cpu(xc), Storage::Cpu(wc)) = (&*gs, &*xs, &*ws) else {
                return Ok(None);
            };
            let (Some((ga, gb)), Some((xa, xb)), Some((wa, wb))) = (
                gl.contiguous_offsets(),
                xl.contiguous_offsets(),
                wl.contiguous_offsets(),
            ) else {
                return Ok(None);
            };
            match (gc, xc, wc) {
                (CpuStorage::F16(g), CpuStorage::F16(x), CpuStorage::F16(w)) => {
                    widened_grads(&g[ga..gb], &x[xa..xb], &w[wa..wb], mnk, want)?
                }
                (CpuStorage::BF16(g), CpuStorage::BF16(x), CpuStorage::BF16(w))
                    if super::gemm::widens_plainly::<half::bf16>() =>
                {
                    widened_grads(&g[ga..gb], &x[xa..xb], &w[wa..wb], mnk, want)?
                }
                _ => return Ok(None),
            }
        };
        let (_, n, k) = mnk;
        let dev = Device::Cpu;
        if let (Some(key), Some(dw)) = (&self.w_key, dw) {
            self.sink.add(key, Tensor::from_vec(dw, (n, k), &dev)?)?;
        }
        if let (Some(key), Some(db)) = (&self.b_key, db) {
            self.sink.add(key, Tensor::from_vec(db, n, &dev)?)?;
        }
        let Some(dx) = dx else {
            return Ok(Some(None));
        };
        let dx = tensor_of(dx, x.shape())?;
        Ok(Some(Some(if out == Dx::Graph {
            super::graph_grad::for_candle(dx)?
        } else {
            dx
        })))
    }
}

/// For the crate's tests: a layer's backward (`x`, `w`, `b`, output gradient `g`, rank 2)
/// both ways, widened once and per product, each as `[dw, db, dx]` (dx in f32 when `wide`);
/// `None` where the widened path does not apply.
pub(crate) fn backward_both_ways(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    g: &Tensor,
    wide: bool,
) -> Result<Option<[Vec<Tensor>; 2]>> {
    struct Keep(Mutex<Vec<Tensor>>);
    impl GradSink for Keep {
        fn add(&self, _param: &Tensor, grad: Tensor) -> Result<()> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).push(grad);
            Ok(())
        }
    }
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let out = if wide { Dx::Wide } else { Dx::Dense };
    let run = |widened: bool| -> Result<Option<Vec<Tensor>>> {
        let sink = Arc::new(Keep(Mutex::new(Vec::new())));
        let node = WgradLinear::new(w, b, Some(w), b, sink.clone(), true, None)?;
        let dx = if widened {
            match node.bwd_x_widened(x, g, (m, n, k), out)? {
                Some(dx) => dx,
                None => return Ok(None),
            }
        } else {
            node.bwd_x_per_product(x, g, (m, k), out)?
        };
        let mut all = std::mem::take(&mut *sink.0.lock().unwrap_or_else(|e| e.into_inner()));
        all.extend(dx);
        Ok(Some(all))
    };
    Ok(match (run(true)?, run(false)?) {
        (Some(a), Some(b)) => Some([a, b]),
        _ => None,
    })
}

/// Which gradients [`widened_grads`] computes; `x`: the input's, in this type.
#[derive(Clone, Copy)]
struct Wanted {
    w: bool,
    b: bool,
    x: Option<DType>,
}

/// A linear layer's gradients from its output gradient `g` (m x n), input `x` (m x k) and
/// weight `w` (n x k), all dense: `g` widened once into this thread's scratch, then
/// dw = g^T . x and db = column sums of g in f32, dx = g . w in `want.x`'s type.
#[allow(clippy::type_complexity)]
fn widened_grads<T: super::gemm::GemmElem>(
    g: &[T],
    x: &[T],
    w: &[T],
    (m, n, k): (usize, usize, usize),
    want: Wanted,
) -> Result<(Option<Vec<f32>>, Option<Vec<f32>>, Option<CpuStorage>)> {
    use super::mat::Mat;
    if g.len() != m * n || x.len() != m * k || w.len() != n * k {
        candle_core::bail!(
            "amp-linear-wgrad: gradient {} x {}, input {m} x {k}, weight {n} x {k}",
            g.len(),
            n
        )
    }
    super::scratch::with_f32(m * n, |g32| {
        super::slices::convert(g, g32);
        let dw = want.w.then(|| {
            let mut dw = vec![0f32; n * k];
            let gt = Mat {
                data: &g32[..],
                off: 0,
                rs: 1,
                cs: n,
            };
            let xm = Mat {
                data: x,
                off: 0,
                rs: k,
                cs: 1,
            };
            super::gemm::gemm_wide_lhs(n, k, m, gt, xm, &mut dw, k, false);
            dw
        });
        let db = want.b.then(|| super::matmul::column_sums(&g32[..], n));
        let dx = want
            .x
            .map(|dt| {
                super::matmul::f32_result(m * k, dt, |o| {
                    let gm = Mat {
                        data: &g32[..],
                        off: 0,
                        rs: n,
                        cs: 1,
                    };
                    let wm = Mat {
                        data: w,
                        off: 0,
                        rs: k,
                        cs: 1,
                    };
                    super::gemm::gemm_wide_lhs(m, k, n, gm, wm, o, k, false);
                    Ok(())
                })
            })
            .transpose()?;
        Ok((dw, db, dx))
    })
}

impl CustomOp1 for WgradLinear {
    fn name(&self) -> &'static str {
        "amp-linear-wgrad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd(s, l)
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.bwd_x(x, &self.through_act(res, g)?, Dx::Graph)
    }
}

/// The same node over `(x, anchor)` for an input outside any graph (data): the anchor is a
/// one-element variable that makes the node part of the graph without copying `x`.
impl CustomOp2 for WgradLinear {
    fn name(&self) -> &'static str {
        "amp-linear-wgrad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd(s1, l1)
    }

    fn bwd(&self, x: &Tensor, _anchor: &Tensor, res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((self.bwd_x(x, &self.through_act(res, g)?, Dx::Graph)?, None))
    }
}

/// `act(x w^T + b)` as one node on `x`, whose backward sends the weight's and bias's f32
/// gradients to `sink` under `w_key` and `b_key` (each `None`: that gradient is not computed).
/// `w` and `b` are the values to compute with, of `x`'s type. `None` where the node does not apply
/// (another device or type, the kernels off, a bias of another shape): the caller then runs
/// [`super::linear`] with the parameters in the graph.
pub(crate) fn linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    w_key: Option<&Tensor>,
    b_key: Option<&Tensor>,
    sink: Arc<dyn GradSink>,
    act: Option<Act>,
) -> Result<Option<Tensor>> {
    if !applies(x, w, b) {
        return Ok(None);
    }
    if x.rank() == 1 {
        // One row, as `kernels::linear` and PyTorch's `F.linear` take it.
        let y = linear(&x.unsqueeze(0)?, w, b, w_key, b_key, sink, act)?;
        return y.map(|y| y.squeeze(0)).transpose();
    }
    let x = super::dense(x)?;
    let node = WgradLinear::new(w, b, w_key, b_key, sink, x.track_op(), act)?;
    let trains = node.has_keys();
    Ok(Some(apply_node(&x, node, trains)?))
}

/// Puts a fused node (its result computed) into candle's graph over `x`: on `x` where `x`
/// takes a gradient; outside the graph where neither `x` nor a parameter (`trains`) wants
/// one; else over `(x, anchor)`, a fresh f32 scalar that takes none, so that candle's
/// backward still reaches the node for its parameters' gradients.
pub(super) fn apply_node<N: CustomOp1 + CustomOp2 + Send + Sync + 'static>(
    x: &Tensor,
    node: N,
    trains: bool,
) -> Result<Tensor> {
    if x.track_op() {
        return x.apply_op1(node);
    }
    if !trains {
        return x.apply_op1_no_bwd(&node);
    }
    let anchor = Var::zeros((), DType::F32, x.device())?;
    x.apply_op2(anchor.as_tensor(), node)
}
