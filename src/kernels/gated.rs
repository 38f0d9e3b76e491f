//! A gated MLP, `down(act(gate(x)) * up(x))` (Llama's SwiGLU, GeGLU), as one graph node:
//! Transformer Engine's `LayerNormMLP` with a gated activation, without the norm.
//!
//! Unfused, the block leaves five half tensors in candle's graph besides its input (the gate
//! and up products, the activation, the product, the output), and candle's backward adds
//! each one's gradient into a `zeros_like` in half, slowly on the CPU; the input's two
//! gradients are summed there too, rounded to half after each. Here the same ops run on
//! detached tensors inside one node ([`WgradLinear`] for the three products, one-pass f32
//! kernels for the activation and the product), every parameter gradient goes to the sink in
//! f32, and only the input's gradient goes back to candle: the gate's and up's f32 products
//! summed in f32 and rounded once. Every other value is the one the unfused ops compute (the
//! activation as [`silu`], `kernels::gelu` or `kernels::relu`, the product and its
//! gradients rounded once from f32, as candle's half `mul` rounds them), bit for bit.
//!
//! The forward keeps the gate's and up's outputs (the backward needs both; recomputing them
//! would repeat two of the three products, the whole cost of the block) and the product
//! (down's input, for down's weight gradient). The activation is not kept: the backward
//! recomputes it from the gate's output in one pointwise pass, a small fraction of a
//! product's time, which saves one hidden-width tensor per block between the passes.
//!
//! With SiLU (SwiGLU) the pointwise ops run fused, still bit for bit ([`swiglu`]): two
//! hidden-width passes forward become one (the activation's tensor is never written), four
//! backward one (one `exp` per value where there were two, nine conversions of a
//! hidden-width value in place of eleven, and two tensors never written).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

use super::chain::ChainLayer;
use super::dispatch::{Kernel, split_zip};
use super::simd::{Elem, retyped};
use super::slices::{Vx, convert_serial as convert};
use super::wgrad::{Dx, GradSink, WgradLinear, applies};

mod swiglu;
use swiglu::{silu_gate, silu_gate_grads};

/// The activation on the gate's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GateAct {
    /// `x * sigmoid(x)`, as [`silu`] (SwiGLU).
    Silu,
    /// GELU (erf form), as `kernels::gelu` (GeGLU).
    Gelu,
    /// `max(x, 0)`, as `kernels::relu` (ReGLU).
    Relu,
}

/// Values per rayon task of the pointwise passes.
const CHUNK: usize = 1 << 14;
/// Values per block converted to f32 on the stack.
const BLOCK: usize = 512;

/// `(silu(x), silu'(x))` from one `exp(-x)`: `silu(x) = x / (1 + e)` and
/// `silu'(x) = s * (1 + x * (1 - s))` with `s = 1 / (1 + e)` the sigmoid. Each of the two is
/// the same expression whether computed alone ([`silu_f32`], [`silu_grad`]) or together (the
/// fused SwiGLU passes), so both give the same bits.
#[inline(always)]
fn silu_parts(x: f32) -> (f32, f32) {
    let e = super::gelu::exp_f32(-x);
    let s = 1.0 / (1.0 + e);
    (x / (1.0 + e), s * (1.0 + x * (1.0 - s)))
}

#[inline(always)]
fn silu_f32(x: f32) -> f32 {
    silu_parts(x).0
}

/// `silu'(x) = s(x) * (1 + x * (1 - s(x)))`, `s` the sigmoid.
#[inline(always)]
fn silu_grad(x: f32) -> f32 {
    silu_parts(x).1
}

/// `d = f(a, b)` per value, in f32 blocks on the calling thread, rounded once to `T`.
struct Zip<'a, T, F> {
    a: &'a [T],
    b: &'a [T],
    d: &'a mut [T],
    f: F,
}

impl<T: Elem + Vx, F: Fn(f32, f32) -> f32> Kernel for Zip<'_, T, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (mut ba, mut bb) = ([0f32; BLOCK], [0f32; BLOCK]);
        let blocks = self.a.chunks(BLOCK).zip(self.b.chunks(BLOCK));
        for ((ac, bc), dc) in blocks.zip(self.d.chunks_mut(BLOCK)) {
            let n = ac.len();
            let (xs, ys) = (&mut ba[..n], &mut bb[..n]);
            convert(ac, xs);
            convert(bc, ys);
            for (x, y) in xs.iter_mut().zip(ys.iter()) {
                *x = (self.f)(*x, *y);
            }
            convert(xs, dc);
        }
    }
}

fn zip_slices<T: Elem + Vx, F: Fn(f32, f32) -> f32 + Copy + Send + Sync>(a: &[T], b: &[T], f: F) -> Vec<T> {
    let mut out = vec![T::from_f32(0.0); a.len()];
    split_zip(a, b, &mut out, CHUNK, |a, b, d| Zip { a, b, d, f });
    out
}

/// `f(a, b)` per value of two contiguous CPU storages of one type (f32, f16, bf16) at the
/// offsets given, computed in f32 and rounded once.
fn zip_storage<F: Fn(f32, f32) -> f32 + Copy + Send + Sync>(
    (ca, (a0, a1)): (&CpuStorage, (usize, usize)),
    (cb, (b0, b1)): (&CpuStorage, (usize, usize)),
    f: F,
    op: &str,
) -> Result<CpuStorage> {
    if a1 - a0 != b1 - b0 {
        candle_core::bail!("{op}: operands of {} and {} values", a1 - a0, b1 - b0)
    }
    Ok(match (ca, cb) {
        (CpuStorage::F32(x), CpuStorage::F32(y)) => CpuStorage::F32(zip_slices(&x[a0..a1], &y[b0..b1], f)),
        (CpuStorage::F16(x), CpuStorage::F16(y)) => CpuStorage::F16(zip_slices(&x[a0..a1], &y[b0..b1], f)),
        (CpuStorage::BF16(x), CpuStorage::BF16(y)) => CpuStorage::BF16(zip_slices(&x[a0..a1], &y[b0..b1], f)),
        _ => candle_core::bail!("{op}: {:?} and {:?} operands", ca.dtype(), cb.dtype()),
    })
}

/// `f(a, b)` per value of two CPU tensors of one shape and type (f32, f16, bf16), computed in
/// f32 and rounded once, as a new dense tensor outside any graph.
fn zip<F: Fn(f32, f32) -> f32 + Copy + Send + Sync>(a: &Tensor, b: &Tensor, f: F, op: &str) -> Result<Tensor> {
    let out = on_values(&[a, b], op, |v| Some(zip_storage(v[0], v[1], f, op)))??;
    storage_tensor(out, a.shape())
}

/// A CPU storage as a tensor of `shape`.
fn storage_tensor(s: CpuStorage, shape: &Shape) -> Result<Tensor> {
    let dev = Device::Cpu;
    match s {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, &dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, &dev),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, &dev),
        other => candle_core::bail!("amp-gated-mlp: {:?} values", other.dtype()),
    }
}

fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    zip(a, b, |x, y| x * y, "amp-gated-mul")
}

/// A view's values as `T` (`None`: another type).
fn values<T: 'static>((c, (a, b)): (&CpuStorage, (usize, usize))) -> Option<&[T]> {
    match c {
        CpuStorage::F32(v) => retyped::<f32, T>(&v[a..b]),
        CpuStorage::F16(v) => retyped::<f16, T>(&v[a..b]),
        CpuStorage::BF16(v) => retyped::<bf16, T>(&v[a..b]),
        _ => None,
    }
}

/// `f` on the values of CPU tensors of one shape and one type (f32, f16, bf16), made dense,
/// each as its storage and offsets; typed errors for anything else (another shape, a tensor
/// off the CPU, `f` finding another type).
fn on_values<R>(ts: &[&Tensor], op: &str, f: impl FnOnce(&[(&CpuStorage, (usize, usize))]) -> Option<R>) -> Result<R> {
    if let Some(t) = ts.iter().find(|t| t.shape() != ts[0].shape()) {
        candle_core::bail!("{op}: operands {:?} and {:?}", ts[0].dims(), t.dims())
    }
    let dense = ts.iter().map(|t| super::dense(t)).collect::<Result<Vec<_>>>()?;
    let held: Vec<_> = dense.iter().map(|t| t.storage_and_layout()).collect();
    let mut views = Vec::with_capacity(held.len());
    for (s, l) in &held {
        let Storage::Cpu(c) = &**s else {
            candle_core::bail!("{op}: operands off the CPU")
        };
        let Some(r) = l.contiguous_offsets() else {
            candle_core::bail!("{op}: operands not contiguous")
        };
        views.push((c, r));
    }
    f(&views).ok_or_else(|| {
        let types: Vec<DType> = ts.iter().map(|t| t.dtype()).collect();
        candle_core::Error::Msg(format!("{op}: operands of types {types:?}"))
    })
}

/// SiLU as one op whose backward is one pass (`g * silu'(x)` in f32, rounded once).
struct Silu;

impl CustomOp1 for Silu {
    fn name(&self) -> &'static str {
        "amp-silu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let r = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("amp-silu: the input is not contiguous".into()))?;
        Ok((
            zip_storage((s, r), (s, r), |v, _| silu_f32(v), "amp-silu")?,
            l.shape().clone(),
        ))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dx = zip(arg, grad, |x, g| g * silu_grad(x), "amp-silu-grad")?;
        Ok(Some(super::graph_grad::for_candle(dx)?))
    }
}

/// SiLU (swish) `x * sigmoid(x)`, differentiable, computed in f32 and rounded once for f32,
/// f16 and bf16 on the CPU (the backward too: `g * silu'(x)` in one pass); on CUDA one kernel
/// each way, in f32 arithmetic; candle's `silu` elsewhere, where the CUDA kernels do not
/// load, and while [`super::plain`] is open. candle's own half `silu` rounds each step
/// of `x / (1 + exp(-x))` and its backward is about six half ops.
///
/// ```
/// use candle_amp::kernels;
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[-1f32, 0., 2.], &Device::Cpu)?;
/// let y = kernels::silu(&x)?.to_vec1::<f32>()?;
/// assert!((y[0] + 0.268_941_4).abs() < 1e-6 && y[1] == 0.0 && (y[2] - 1.761_594_2).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn silu(x: &Tensor) -> Result<Tensor> {
    // On CUDA one kernel each way (`cuda::gated`), where candle's `silu` backward is composed ops.
    if super::enabled()
        && x.device().is_cuda()
        && let Some(y) = super::cuda::gated::activation(x, super::cuda::gated::PointAct::Silu)?
    {
        return Ok(y);
    }
    if !(super::enabled() && x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)) {
        return x.silu();
    }
    let x = super::dense(x)?;
    if x.track_op() {
        x.apply_op1(Silu)
    } else {
        x.apply_op1_no_bwd(&Silu)
    }
}

/// `act(g)` outside the graph, as the activation's own op computes it.
fn activate(g: &Tensor, act: GateAct) -> Result<Tensor> {
    match act {
        GateAct::Silu => zip(g, g, |v, _| silu_f32(v), "amp-silu"),
        GateAct::Gelu => g.apply_op1_no_bwd(&super::gelu::Gelu),
        GateAct::Relu => g.apply_op1_no_bwd(&super::relu::Relu),
    }
}

/// The gradient at the gate's output: `ga` (at the activation's output) through the
/// activation's backward, as its op computes it; `a`: the activation's output.
fn act_grad(g: &Tensor, a: &Tensor, ga: &Tensor, act: GateAct) -> Result<Tensor> {
    match act {
        GateAct::Silu => zip(g, ga, |x, d| d * silu_grad(x), "amp-silu-grad"),
        GateAct::Gelu => g.apply_op2_no_bwd(ga, &super::gelu::GeluGrad),
        GateAct::Relu => a.apply_op2_no_bwd(ga, &super::relu::ReluGrad),
    }
}

/// The node: the three projections and what the forward kept.
pub(crate) struct Gated {
    gate: WgradLinear,
    up: WgradLinear,
    down: WgradLinear,
    act: GateAct,
    /// The input in the products' type (a half copy of an f32 input at O1).
    x: Tensor,
    /// The gate's and up's outputs.
    g: Tensor,
    u: Tensor,
    /// `act(g) * u`: down's input.
    p: Tensor,
    /// The output until the forward hands it to candle.
    result: Mutex<Option<Tensor>>,
}

impl Gated {
    fn fwd(&self) -> Result<(CpuStorage, Shape)> {
        super::chain::hand_over(&self.result, "amp-gated-mlp")
    }

    /// Whether a projection's parameter takes a gradient.
    pub(super) fn trains(&self) -> bool {
        self.gate.has_keys() || self.up.has_keys() || self.down.has_keys()
    }

    /// The output the forward computed, once (for a node that holds this one).
    pub(super) fn take_output(&self) -> Result<Tensor> {
        let out = self.result.lock().unwrap_or_else(|e| e.into_inner()).take();
        out.ok_or_else(|| candle_core::Error::Msg("amp-gated-mlp: the output was taken twice".into()))
    }

    /// The input's gradient (dense, in `x_dtype`; `None` when the input takes none) after
    /// the parameters' gradients went to the sink.
    pub(super) fn input_grad(&self, x_dtype: DType, g: &Tensor) -> Result<Option<Tensor>> {
        let missing = || candle_core::Error::Msg("amp-gated-mlp: no input gradient from down".into());
        let gp = self.down.bwd_x(&self.p, g, Dx::Dense)?.ok_or_else(missing)?;
        let (gu, gg) = if self.act == GateAct::Silu {
            silu_gate_grads(&gp, &self.g, &self.u)?
        } else {
            let a = activate(&self.g, self.act)?;
            // p = a * u: each operand's gradient rounded once, as candle's half `mul` rounds it.
            let gu = mul(&gp, &a)?;
            let ga = mul(&gp, &self.u)?;
            drop(gp);
            (gu, act_grad(&self.g, &a, &ga, self.act)?)
        };
        // x's two gradients summed in f32, rounded once.
        let dg = self.gate.bwd_x(&self.x, &gg, Dx::Wide)?;
        drop(gg);
        let du = self.up.bwd_x(&self.x, &gu, Dx::Wide)?;
        match (dg, du) {
            (Some(a), Some(b)) => Ok(Some(super::cast(&(a + b)?, x_dtype)?)),
            _ => Ok(None),
        }
    }

    fn bwd(&self, x_dtype: DType, g: &Tensor) -> Result<Option<Tensor>> {
        self.input_grad(x_dtype, g)?
            .map(super::graph_grad::for_candle)
            .transpose()
    }
}

impl CustomOp1 for Gated {
    fn name(&self) -> &'static str {
        "amp-gated-mlp"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.bwd(x.dtype(), g)
    }
}

/// The same node over `(x, anchor)` for an input outside any graph (see `wgrad::linear`).
impl CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        "amp-gated-mlp"
    }

    fn cpu_fwd(&self, _s1: &CpuStorage, _l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, x: &Tensor, _anchor: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.input_grad(x.dtype(), g)?;
        Ok((None, None))
    }
}

/// `down(act(gate(x)) * up(x))` as one node, `layers` = `[gate, up, down]` (no activations
/// of their own), the products in the projections' type (half); `x` may be f32 (O1: cast
/// inside, its gradient returned in f32). `None` where the node does not apply (another
/// device or type, the kernels off, shapes that do not fit, an empty input): the caller runs
/// the unfused ops.
pub(crate) fn gated_mlp(
    x: &Tensor,
    layers: [&ChainLayer<'_>; 3],
    act: GateAct,
    sink: Arc<dyn GradSink>,
) -> Result<Option<Tensor>> {
    if x.rank() == 1 {
        // One row, as a linear layer takes it.
        return gated_mlp(&x.unsqueeze(0)?, layers, act, sink)?
            .map(|y| y.squeeze(0))
            .transpose();
    }
    let x_grad = x.track_op();
    let Some(node) = build(x, layers, act, sink, x_grad)? else {
        return Ok(None);
    };
    let trains = node.trains();
    let x = super::dense(x)?;
    Ok(Some(super::wgrad::apply_node(&x, node, trains)?))
}

/// The node of [`gated_mlp`] over `x` of rank 2 or more with its forward run (its output
/// waits in the node), not applied to any graph; `x_grad`: whether the input's gradient is
/// wanted.
pub(crate) fn build(
    x: &Tensor,
    layers: [&ChainLayer<'_>; 3],
    act: GateAct,
    sink: Arc<dyn GradSink>,
    x_grad: bool,
) -> Result<Option<Gated>> {
    let dt = layers[0].w.dtype();
    if !matches!(dt, DType::F16 | DType::BF16) || !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Ok(None);
    }
    if !super::enabled() || x.rank() < 2 || x.elem_count() == 0 || !x.device().is_cpu() {
        return Ok(None);
    }
    let [lg, lu, ld] = layers;
    if layers.iter().any(|l| l.act.is_some() || l.w.rank() != 2) {
        return Ok(None);
    }
    let d_in = x.dim(candle_core::D::Minus1)?;
    let hidden = lg.w.dim(0)?;
    let fits =
        lg.w.dim(1)? == d_in && lu.w.dims() == lg.w.dims() && ld.w.dim(1)? == hidden && hidden > 0 && ld.w.dim(0)? > 0;
    if !fits {
        return Ok(None);
    }
    let xc = super::dense(&super::cast(&x.detach(), dt)?)?;
    if layers.iter().any(|l| !applies(&xc, l.w, l.b)) {
        return Ok(None);
    }
    let node = |l: &ChainLayer<'_>, grad: bool| WgradLinear::new(l.w, l.b, l.w_key, l.b_key, sink.clone(), grad, None);
    let (gate, up, down) = (node(lg, x_grad)?, node(lu, x_grad)?, node(ld, true)?);
    // The forward, op by op as the unfused block runs them.
    let g = xc.apply_op1_no_bwd(&gate)?;
    let u = xc.apply_op1_no_bwd(&up)?;
    let p = match act {
        GateAct::Silu => silu_gate(&g, &u)?,
        _ => mul(&activate(&g, act)?, &u)?,
    };
    let y = p.apply_op1_no_bwd(&down)?;
    Ok(Some(Gated {
        gate,
        up,
        down,
        act,
        x: xc,
        g,
        u,
        p,
        result: Mutex::new(Some(y)),
    }))
}
