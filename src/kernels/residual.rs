//! A residual sub-layer as one graph node: pre-norm, `x + dropout(body(norm(x)))`
//! (Transformer Engine's `LayerNormLinear` / `LayerNormMLP` with the residual add), or
//! post-norm, `norm(x + dropout(body(x)))` (BERT, PyTorch's `norm_first=False`), with a
//! layer norm or an RMS norm, for a body that is itself a fused node (self-attention, a
//! chain of linear layers, a gated MLP).
//!
//! Unfused, each sub-layer of a transformer block leaves four tensors of the residual
//! stream's width in candle's graph besides its input (the norm's output, the body's
//! output, the dropout's output and the sum), and the input takes two gradients (through
//! the norm or the body, and through the add). candle's backward adds each of those
//! gradients into a `zeros_like` in the tensor's type, in half at O2/O3, slowly on the CPU.
//! Here the norm, the body, the dropout and the add run on detached tensors inside one
//! node, each exactly as its own op computes it; the backward runs their backwards in
//! reverse and returns one gradient for the input: its two gradients summed in f32 and
//! rounded once, which is what candle's half add of the two does. The norm's weight and
//! bias gradients go to the sink in f32 (unfused, they are rounded to the parameter's type
//! first).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::attention::Attention;
use super::chain::Chain;
use super::gated::Gated;
use super::wgrad::{Dx, GradSink};

mod stack;
pub(crate) use stack::stack;

/// The body in front of the dropout: a fused node built on the norm's output (pre-norm) or
/// on the sub-layer's input (post-norm).
pub(crate) enum Body {
    Attention(Box<Attention>),
    Chain(Chain),
    Gated(Box<Gated>),
}

impl Body {
    fn take_output(&self) -> Result<Tensor> {
        match self {
            Body::Attention(a) => a.take_output(),
            Body::Chain(c) => c.take_output(),
            Body::Gated(n) => n.take_output(),
        }
    }

    fn trains(&self) -> bool {
        match self {
            Body::Attention(a) => a.trains(),
            Body::Chain(c) => c.trains(),
            Body::Gated(n) => n.trains(),
        }
    }

    /// The gradient of the body's input `h` (dense, in `h`'s type) for the output gradient
    /// `g`; `out`: the body's output.
    fn input_grad(&self, h: &Tensor, out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = match self {
            Body::Attention(a) => a.input_grad(h.dtype(), g)?,
            Body::Chain(c) => c.input_grad(out, g, Dx::Dense)?,
            Body::Gated(n) => n.input_grad(h.dtype(), g)?,
        };
        // A chain computes in half from a cast of an f32 input (O1): the cast's backward.
        g.map(|g| super::cast(&g, h.dtype())).transpose()
    }
}

/// The norm: its parameters as computed with (detached) and the parameters their gradients
/// are for (`None`: not computed); `center`: a layer norm (the mean removed), else an RMS
/// norm (no bias).
pub(crate) struct NormSpec<'a> {
    pub w: Option<&'a Tensor>,
    pub b: Option<&'a Tensor>,
    pub w_key: Option<&'a Tensor>,
    pub b_key: Option<&'a Tensor>,
    pub eps: f64,
    pub center: bool,
}

/// Where the norm sits: in front of the body (`x + body(norm(x))`) or after the add
/// (`norm(x + body(x))`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    Pre,
    Post,
}

/// The node, and what the forward kept for the backward: built by [`build`] with its
/// forward run, applied to candle's graph alone ([`Residual::apply`]) or with the
/// sub-layers after it as one node ([`stack()`]).
pub(crate) struct Residual {
    placement: Placement,
    /// The norm's input as the norm computed with it, detached: pre-norm the node's input
    /// (or its f32 copy under autocast), post-norm the sum (likewise).
    xn: Tensor,
    /// Post-norm: the sum's type (the norm's input gradient is cast back to it).
    sum_dtype: DType,
    w: Option<Tensor>,
    w_key: Option<Tensor>,
    b_key: Option<Tensor>,
    eps: f64,
    center: bool,
    /// The body's input: pre-norm the norm's output, post-norm the node's input.
    h: Tensor,
    body: Body,
    body_out: Tensor,
    /// The dropout mask in the body output's type (`None`: no dropout).
    mask: Option<Tensor>,
    sink: Arc<dyn GradSink>,
    /// Whether a parameter of the norm or the body takes a gradient.
    trains: bool,
    result: Mutex<Option<Tensor>>,
}

impl Residual {
    /// The sub-layer's output, as the node hands it to candle (the forward ran in [`build`]);
    /// an error once it was handed over.
    pub(crate) fn output(&self) -> Result<Tensor> {
        let out = self.result.lock().unwrap_or_else(|e| e.into_inner()).clone();
        out.ok_or_else(|| candle_core::Error::Msg("amp-residual: the output was handed over".into()))
    }

    /// The node applied to candle's graph on its input `x` (the tensor it was built on).
    pub(crate) fn apply(self, x: &Tensor) -> Result<Tensor> {
        let trains = self.trains;
        let x = super::dense(x)?;
        super::wgrad::apply_node(&x, self, trains)
    }

    /// The input's gradient (dense, in `x_dtype`; `None` when the input takes none) after
    /// the parameters' gradients went to the sink.
    fn input_grad(&self, x_dtype: DType, x_grad: bool, g: &Tensor) -> Result<Option<Tensor>> {
        let g = super::dense(g)?;
        match self.placement {
            Placement::Pre => {
                let gh = self.body_grad(&g)?;
                let Some(gxn) = self.norm_grad(&gh, x_grad)? else {
                    return Ok(None);
                };
                // The cast's backward where the norm computed on an f32 copy, then the add's
                // and the norm's gradients summed in f32 and rounded once.
                let gxn = super::cast(&gxn, x_dtype)?;
                Ok(Some(super::elementwise::sum_rounded(&g, &gxn, x_dtype)?))
            }
            Placement::Post => {
                let Some(gxn) = self.norm_grad(&g, true)? else {
                    candle_core::bail!("amp-residual: the norm returned no input gradient")
                };
                let gs = super::cast(&gxn, self.sum_dtype)?;
                let gh = self.body_grad(&gs)?;
                if !x_grad {
                    return Ok(None);
                }
                let gh = super::cast(&gh, x_dtype)?;
                Ok(Some(super::elementwise::sum_rounded(&gs, &gh, x_dtype)?))
            }
        }
    }

    /// The body input's gradient for the sum's gradient `g`: the add's backward to the
    /// body's branch (a promoted half operand: the cast's backward), the dropout's, the
    /// body's (its parameters' gradients to the sink).
    fn body_grad(&self, g: &Tensor) -> Result<Tensor> {
        let gd = super::cast(g, self.body_out.dtype())?;
        let gd = match &self.mask {
            Some(m) => super::elementwise::mul_const(&gd, m)?,
            None => gd,
        };
        match self.body.input_grad(&self.h, &self.body_out, &gd)? {
            Some(gh) => Ok(gh),
            None => candle_core::bail!("amp-residual: the body returned no input gradient"),
        }
    }

    /// The norm input's gradient (where `want_x`) for its output gradient `gy`, after its
    /// weight and bias gradients went to the sink in f32.
    fn norm_grad(&self, gy: &Tensor, want_x: bool) -> Result<Option<Tensor>> {
        let want_wb = self.w_key.is_some() || self.b_key.is_some();
        let norm = (self.eps, self.center);
        let (gxn, wb) = super::norm::norm_bwd(&self.xn, self.w.as_ref(), gy, norm, (want_x, want_wb))?;
        if let Some(wb) = wb {
            if let Some(k) = &self.w_key {
                self.sink.add(k, wb.get(0)?.reshape(k.shape())?)?;
            }
            if let Some(k) = &self.b_key {
                self.sink.add(k, wb.get(1)?.reshape(k.shape())?)?;
            }
        }
        Ok(gxn)
    }

    fn fwd(&self) -> Result<(CpuStorage, Shape)> {
        super::chain::hand_over(&self.result, "amp-residual")
    }

    fn bwd(&self, x: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.input_grad(x.dtype(), true, g)?
            .map(super::graph_grad::for_candle)
            .transpose()
    }
}

impl CustomOp1 for Residual {
    fn name(&self) -> &'static str {
        "amp-residual"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.bwd(x, g)
    }
}

/// The same node over `(x, anchor)` for an input outside any graph (see `wgrad::linear`).
impl CustomOp2 for Residual {
    fn name(&self) -> &'static str {
        "amp-residual"
    }

    fn cpu_fwd(&self, _s1: &CpuStorage, _l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, x: &Tensor, _anchor: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.input_grad(x.dtype(), false, g)?;
        Ok((None, None))
    }
}

/// The sub-layer as one node: pre-norm `x + dropout(body(norm(x)))`, post-norm
/// `norm(x + dropout(body(x)))`. `prep` gives a tensor as the norm computes with it (itself,
/// or its f32 copy under autocast); `body` builds its fused node on its input (`None`: it
/// does not apply, and neither does this node). `mask`: the dropout's mask in f32 (`None`:
/// no dropout), cast to the body output's type as `nn::Dropout` casts it. The add promotes
/// a half body output to an f32 `x` (O1); any other mix of types, a body output of another
/// shape, another device or the kernels off give `None`: the caller runs the unfused ops
/// (with the same mask).
///
/// The node with its forward run (its output waits in it, [`Residual::output`]), not
/// applied to any graph.
pub(crate) fn build(
    x: &Tensor,
    norm: NormSpec<'_>,
    placement: Placement,
    prep: impl Fn(&Tensor) -> Result<Tensor>,
    body: impl FnOnce(&Tensor) -> Result<Option<Body>>,
    mask: Option<&Tensor>,
    sink: Arc<dyn GradSink>,
) -> Result<Option<Residual>> {
    let float = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !(super::enabled() && x.device().is_cpu() && float(x) && x.rank() >= 2 && x.elem_count() > 0) {
        return Ok(None);
    }
    let (w, b) = (norm.w.map(|t| t.detach()), norm.b.map(|t| t.detach()));
    let normed = |xn: &Tensor| match norm.center {
        true => super::layer_norm(xn, w.as_ref(), b.as_ref(), norm.eps),
        false => super::rms_norm(xn, w.as_ref(), norm.eps),
    };
    let prepared = |t: &Tensor| -> Result<Option<Tensor>> {
        let t = super::dense(&prep(t)?.detach())?;
        Ok(float(&t).then_some(t))
    };
    let xd = super::dense(&x.detach())?;
    // Pre-norm: the norm on the input, the body on its output.
    let pre = match placement {
        Placement::Pre => match prepared(x)? {
            Some(xn) => Some((normed(&xn)?, xn)),
            None => return Ok(None),
        },
        Placement::Post => None,
    };
    let h = match &pre {
        Some((h, _)) => h.clone(),
        None => xd.clone(),
    };
    let Some(body) = body(&h)? else {
        return Ok(None);
    };
    let out = body.take_output()?;
    let promoted = x.dtype() == DType::F32 && out.dtype() != DType::F32;
    if out.shape() != x.shape() || !(out.dtype() == x.dtype() || promoted) {
        return Ok(None);
    }
    let mask = mask.map(|m| super::cast(m, out.dtype())).transpose()?;
    let d = match &mask {
        Some(m) => super::elementwise::mul_const(&out, m)?,
        None => out.clone(),
    };
    let sum = if promoted {
        (&xd + super::cast(&d, DType::F32)?)?
    } else {
        super::elementwise::add(&xd, &d)?
    };
    let (y, xn) = match pre {
        Some((_, xn)) => (sum, xn),
        None => match prepared(&sum)? {
            Some(xn) => (normed(&xn)?, xn),
            None => return Ok(None),
        },
    };
    // A fresh buffer of its own for `hand_over` (the add and the norm write one).
    let y = super::dense(&y)?;
    let trains = body.trains() || norm.w_key.is_some() || norm.b_key.is_some();
    let node = Residual {
        placement,
        xn,
        sum_dtype: x.dtype(),
        w,
        w_key: norm.w_key.cloned(),
        b_key: norm.b_key.cloned(),
        eps: norm.eps,
        center: norm.center,
        h,
        body,
        body_out: out,
        mask,
        sink,
        trains,
        result: Mutex::new(Some(y)),
    };
    Ok(Some(node))
}
