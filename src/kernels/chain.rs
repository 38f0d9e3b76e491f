//! A chain of linear layers (each with its activation) as one graph node: Apex's fused
//! `apex.mlp.MLP`, Transformer Engine's `LayerNormMLP` without the norm.
//!
//! Between two of the library's linear nodes candle's graph holds a half tensor, and its
//! backward adds that tensor's gradient into a `zeros_like` in half, slowly on the CPU. Here
//! the layers run one after the other on detached tensors inside one node: the forward keeps
//! each layer's input (and GELU's pre-activation) for the backward, which runs the layers'
//! backwards in reverse ([`WgradLinear::through_act`], [`WgradLinear::bwd_x`]), sends every
//! parameter gradient to the sink in f32, and returns only the chain input's gradient to
//! candle. Each layer computes exactly what the layer's own node computes, so values and
//! gradients are the same, bit for bit.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use super::wgrad::{Act, Dx, GradSink, WgradLinear, applies};

/// One layer of a chain: the values to compute with (of the input's type), the parameters
/// their gradients are for (`None`: not computed) and the activation after it.
pub(crate) struct ChainLayer<'a> {
    pub w: &'a Tensor,
    pub b: Option<&'a Tensor>,
    pub w_key: Option<&'a Tensor>,
    pub b_key: Option<&'a Tensor>,
    pub act: Option<Act>,
}

/// The node: the layers, and what their forward kept.
pub(crate) struct Chain {
    nodes: Vec<WgradLinear>,
    /// Each layer's input (the chain's input first, detached).
    inputs: Vec<Tensor>,
    /// Each layer's output but the last (the node's result is the last).
    outputs: Vec<Tensor>,
    /// The last layer's output until the forward hands it to candle.
    result: Mutex<Option<Tensor>>,
}

impl Chain {
    fn fwd(&self) -> Result<(CpuStorage, Shape)> {
        hand_over(&self.result, "amp-linear-chain")
    }

    /// Whether a layer's parameter takes a gradient.
    pub(super) fn trains(&self) -> bool {
        self.nodes.iter().any(|n| n.has_keys())
    }

    /// The output the forward computed, once (for a node that holds this one).
    pub(super) fn take_output(&self) -> Result<Tensor> {
        let out = self.result.lock().unwrap_or_else(|e| e.into_inner()).take();
        out.ok_or_else(|| candle_core::Error::Msg("amp-linear-chain: the output was taken twice".into()))
    }

    /// The input's gradient (for candle's graph) after every layer's backward.
    fn bwd(&self, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.input_grad(res, g, Dx::Graph)
    }

    /// The input's gradient in the form `dx` after every layer's backward; `res`: the
    /// chain's output.
    pub(super) fn input_grad(&self, res: &Tensor, g: &Tensor, dx: Dx) -> Result<Option<Tensor>> {
        let last = self.nodes.len() - 1;
        let mut g = g.clone();
        for i in (1..=last).rev() {
            let out = if i == last { res } else { &self.outputs[i] };
            let gi = self.nodes[i].through_act(out, &g)?;
            g = self.nodes[i].bwd_x(&self.inputs[i], &gi, Dx::Dense)?.ok_or_else(|| {
                candle_core::Error::Msg("amp-linear-chain: an inner layer without input gradient".into())
            })?;
        }
        let out = if last == 0 { res } else { &self.outputs[0] };
        let g0 = self.nodes[0].through_act(out, &g)?;
        self.nodes[0].bwd_x(&self.inputs[0], &g0, dx)
    }
}

/// A fused node's result, computed before the node was applied, as its forward's output:
/// taken once from `result` (the node's forward runs once), and a fresh buffer of its own, so
/// the storage's clone is the result.
pub(super) fn hand_over(result: &Mutex<Option<Tensor>>, op: &str) -> Result<(CpuStorage, Shape)> {
    let out = result.lock().unwrap_or_else(|e| e.into_inner()).take();
    let out = out.ok_or_else(|| candle_core::Error::Msg(format!("{op}: the forward ran twice")))?;
    let (s, l) = out.storage_and_layout();
    let Storage::Cpu(c) = &*s else {
        candle_core::bail!("{op}: the result is not on the CPU")
    };
    let len = match c {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        _ => usize::MAX,
    };
    match l.contiguous_offsets() {
        Some((0, e)) if e == len => Ok((c.clone(), l.shape().clone())),
        _ => candle_core::bail!("{op}: the result is not a fresh buffer"),
    }
}

impl CustomOp1 for Chain {
    fn name(&self) -> &'static str {
        "amp-linear-chain"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, _x: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.bwd(res, g)
    }
}

/// The same node over `(x, anchor)` for an input outside any graph (see `wgrad::linear`).
impl CustomOp2 for Chain {
    fn name(&self) -> &'static str {
        "amp-linear-chain"
    }

    fn cpu_fwd(&self, _s1: &CpuStorage, _l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd()
    }

    fn bwd(&self, _x: &Tensor, _anchor: &Tensor, res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((self.bwd(res, g)?, None))
    }
}

/// `layers` applied in turn to `x` as one node; `None` where a layer's node does not apply
/// (another device or type, the kernels off, mismatched shapes) or the chain is empty: the
/// caller then runs the layers one by one.
pub(crate) fn chain(x: &Tensor, layers: &[ChainLayer<'_>], sink: Arc<dyn GradSink>) -> Result<Option<Tensor>> {
    if layers.is_empty() {
        return Ok(None);
    }
    if x.rank() < 2 {
        if x.rank() == 1 {
            return chain(&x.unsqueeze(0)?, layers, sink)?.map(|y| y.squeeze(0)).transpose();
        }
        return Ok(None);
    }
    let x_grad = x.track_op();
    let Some(node) = build(x, layers, sink, x_grad)? else {
        return Ok(None);
    };
    let x = super::dense(x)?;
    let trains = node.trains();
    Ok(Some(super::wgrad::apply_node(&x, node, trains)?))
}

/// The node of [`chain`] over `x` of rank 2 or more with its forward run (its output waits
/// in the node), not applied to any graph; `x_grad`: whether the input's gradient is wanted.
pub(crate) fn build(
    x: &Tensor,
    layers: &[ChainLayer<'_>],
    sink: Arc<dyn GradSink>,
    x_grad: bool,
) -> Result<Option<Chain>> {
    if layers.is_empty() || x.rank() < 2 {
        return Ok(None);
    }
    // Every layer applies to the previous one's output: same type, matching widths.
    let mut width = x.dim(candle_core::D::Minus1)?;
    for l in layers {
        if !applies(x, l.w, l.b) || l.w.dim(1)? != width {
            return Ok(None);
        }
        width = l.w.dim(0)?;
    }
    let x = super::dense(x)?;
    let mut nodes = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        nodes.push(WgradLinear::new(
            l.w,
            l.b,
            l.w_key,
            l.b_key,
            sink.clone(),
            i > 0 || x_grad,
            l.act,
        )?);
    }
    // The forward, layer by layer on detached tensors; what the backward needs is kept.
    let mut inputs = Vec::with_capacity(nodes.len());
    let mut outputs = Vec::with_capacity(nodes.len());
    let mut h = x.detach();
    for node in &nodes {
        let y = h.apply_op1_no_bwd(node)?;
        inputs.push(std::mem::replace(&mut h, y.clone()));
        outputs.push(y);
    }
    let result = outputs.pop();
    Ok(Some(Chain {
        nodes,
        inputs,
        outputs,
        result: Mutex::new(result),
    }))
}
