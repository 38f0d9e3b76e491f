//! A pre-norm residual sub-layer, `x + dropout(body(layer_norm(x)))`, as one graph node:
//! Transformer Engine's `LayerNormLinear` / `LayerNormMLP` with the residual add, for a body
//! that is itself a fused node (self-attention, a chain of linear layers, a gated MLP).
//!
//! Unfused, each sub-layer of a transformer block leaves four tensors of the residual
//! stream's width in candle's graph besides its input (the norm's output, the body's
//! output, the dropout's output and the sum), and the input takes two gradients (through
//! the norm and through the add). candle's backward adds each of those five gradients into
//! a `zeros_like` in the tensor's type, in half at O2/O3, slowly on the CPU. Here the norm,
//! the body, the dropout and the add run on detached tensors inside one node, each exactly
//! as its own op computes it; the backward runs their backwards in reverse and returns one
//! gradient for the input: the add's and the norm's summed in f32 and rounded once, which
//! is what candle's half add of the two does. The norm's weight and bias gradients go to the
//! sink in f32 (unfused, they are rounded to the parameter's type first).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::attention::Attention;
use super::chain::Chain;
use super::gated::Gated;
use super::wgrad::{Dx, GradSink};

/// The body between the norm and the dropout: a fused node built on the norm's output.
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

/// The layer norm in front of the body: its parameters as computed with (detached) and the
/// parameters their gradients are for (`None`: not computed).
pub(crate) struct NormSpec<'a> {
    pub w: Option<&'a Tensor>,
    pub b: Option<&'a Tensor>,
    pub w_key: Option<&'a Tensor>,
    pub b_key: Option<&'a Tensor>,
    pub eps: f64,
}

/// The node, and what the forward kept for the backward.
struct Residual {
    /// The norm's input as the norm computed with it (the node's input, or its f32 copy
    /// under autocast), detached.
    xn: Tensor,
    w: Option<Tensor>,
    w_key: Option<Tensor>,
    b_key: Option<Tensor>,
    eps: f64,
    /// The norm's output, the body's input.
    h: Tensor,
    body: Body,
    body_out: Tensor,
    /// The dropout mask in the body output's type (`None`: no dropout).
    mask: Option<Tensor>,
    sink: Arc<dyn GradSink>,
    result: Mutex<Option<Tensor>>,
}

impl Residual {
    /// The input's gradient (dense, in `x_dtype`; `None` when the input takes none) after
    /// the parameters' gradients went to the sink.
    fn input_grad(&self, x_dtype: DType, x_grad: bool, g: &Tensor) -> Result<Option<Tensor>> {
        let g = super::dense(g)?;
        // The add's backward to the body's branch (a promoted half operand: the cast's
        // backward), then the dropout's.
        let gd = super::cast(&g, self.body_out.dtype())?;
        let gd = match &self.mask {
            Some(m) => super::elementwise::mul_const(&gd, m)?,
            None => gd,
        };
        let gh = self.body.input_grad(&self.h, &self.body_out, &gd)?;
        let Some(gh) = gh else {
            candle_core::bail!("amp-residual: the body returned no input gradient")
        };
        let want_wb = self.w_key.is_some() || self.b_key.is_some();
        let (gxn, wb) = super::norm::layer_norm_bwd(&self.xn, self.w.as_ref(), &gh, self.eps, (x_grad, want_wb))?;
        if let Some(wb) = wb {
            if let Some(k) = &self.w_key {
                self.sink.add(k, wb.get(0)?.reshape(k.shape())?)?;
            }
            if let Some(k) = &self.b_key {
                self.sink.add(k, wb.get(1)?.reshape(k.shape())?)?;
            }
        }
        let Some(gxn) = gxn else { return Ok(None) };
        // The add's and the norm's gradients, summed in f32 and rounded once.
        Ok(Some(super::elementwise::sum_rounded(&g, &gxn, x_dtype)?))
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

/// `x + dropout(body(layer_norm(xn)))` as one node, where `xn` is `x` as the norm computes
/// with it (itself, or its f32 copy under autocast) and `body` builds its fused node on the
/// norm's output (`None`: it does not apply, and neither does this node). `mask`: the
/// dropout's mask in f32 (`None`: no dropout), cast to the body output's type as
/// `nn::Dropout` casts it. The add promotes a half body output to an f32 `x` (O1); any
/// other mix of types, a body output of another shape, another device or the kernels off
/// give `None`: the caller runs the unfused ops (with the same mask).
pub(crate) fn residual(
    x: &Tensor,
    xn: &Tensor,
    norm: NormSpec<'_>,
    body: impl FnOnce(&Tensor) -> Result<Option<Body>>,
    mask: Option<&Tensor>,
    sink: Arc<dyn GradSink>,
) -> Result<Option<Tensor>> {
    let float = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !(super::enabled() && x.device().is_cpu() && float(x) && float(xn) && x.rank() >= 2 && x.elem_count() > 0) {
        return Ok(None);
    }
    let xn = super::dense(&xn.detach())?;
    let (w, b) = (norm.w.map(|t| t.detach()), norm.b.map(|t| t.detach()));
    let h = super::layer_norm(&xn, w.as_ref(), b.as_ref(), norm.eps)?;
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
    let xd = super::dense(&x.detach())?;
    let y = if promoted {
        (xd + super::cast(&d, DType::F32)?)?
    } else {
        super::elementwise::add(&xd, &d)?
    };
    // A fresh buffer of its own for `hand_over` (the add writes one).
    let y = super::dense(&y)?;
    let trains = body.trains() || norm.w_key.is_some() || norm.b_key.is_some();
    let node = Residual {
        xn,
        w,
        w_key: norm.w_key.cloned(),
        b_key: norm.b_key.cloned(),
        eps: norm.eps,
        h,
        body,
        body_out: out,
        mask,
        sink,
        result: Mutex::new(Some(y)),
    };
    let x = super::dense(x)?;
    Ok(Some(super::wgrad::apply_node(&x, node, trains)?))
}
