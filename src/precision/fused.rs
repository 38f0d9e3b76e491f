//! The library's fused layers as ops of a run (`nn::Linear`, `nn::Mlp`,
//! `nn::SelfAttention`, `nn::GatedMlp`, `nn::Residual`): where their parameters belong to
//! the run whose context is open on this thread and the products run in half, each is one
//! node whose parameter gradients go to the run's stash in f32 (`kernels::wgrad`,
//! `kernels::chain`, `kernels::attention`, `kernels::gated`, `kernels::residual`);
//! elsewhere the plain ops of [`super::ops`].

use candle_core::{DType, Result, Tensor};

use super::autocast;
use super::observe::op as rec;
use super::ops::{gelu, gelu_tanh, prepare, relu};
use crate::kernels;
pub(crate) use crate::kernels::residual::Placement;
use crate::kernels::wgrad::Act;
use crate::precision::stash::GradStash;

/// [`super::ops::linear`] for a layer of the library (`nn::Linear`): where its parameters belong to the
/// run whose context is open on this thread and a half copy is involved (a half weight, or
/// an f32 weight cast to half at O1), the product is one node on `x` only and the weight and
/// bias gradients go, in f32, to the run's stash instead of candle's graph
/// ([`kernels::wgrad`](crate::kernels::wgrad)); a frozen parameter's gradient is not
/// computed. Elsewhere (no run, parameters of a plain `VarMap`, all in f32) it is [`super::ops::linear`].
///
/// Followed by `act` when given. Where the stashing node applies, the activation runs
/// inside it (the same values, bit for bit, as the activation applied to the layer's output)
/// and the pre-activation is no graph edge; GELU only outside autocast, whose policy runs it
/// in f32. Elsewhere the layer and then [`super::ops::relu`] or [`super::ops::gelu`]. The numerics doctor records
/// the fused node as the `linear` op (its output is the activation's).
pub(crate) fn linear_layer_act(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Option<Act>) -> Result<Tensor> {
    if let Some(r) =
        super::empty::on_host_with(&[x, w], &[b], |t, o| linear_layer_act(&t[0], &t[1], o[0].as_ref(), act))
    {
        return r;
    }
    let mut args = vec![x, w];
    if let Some(b) = b {
        args.push(b);
    }
    let (xs, _) = prepare("linear", &args)?;
    let fused = match act {
        Some(Act::Gelu | Act::GeluTanh) if autocast::is_enabled() => None,
        a => a,
    };
    if let Some(y) = wgrad_linear(&xs, w, b, fused)? {
        let y = rec("linear", Ok(y))?;
        return match (act, fused) {
            (Some(a), None) => apply_act(&y, a),
            _ => Ok(y),
        };
    }
    if let Some(y) = cuda_bias_gelu(&xs, act)? {
        return Ok(y);
    }
    let y = rec("linear", kernels::linear(&xs[0], &xs[1], xs.get(2)))?;
    match act {
        Some(a) => apply_act(&y, a),
        None => Ok(y),
    }
}

/// On CUDA, a layer with a bias and GELU (either form): the product without its bias, then
/// the bias and GELU as one kernel (`kernels::cuda::rows`) in the type [`super::ops::gelu`]
/// gives (f32 under autocast, whose policy runs GELU, both forms, in f32). `None` elsewhere:
/// off CUDA, with the kernels off, and where an observer records the step or a layer is kept
/// in f32 (they see the layer's own output); where the kernel does not apply after the
/// product, the bias is added as `kernels::linear` adds it off the CPU, then GELU.
fn cuda_bias_gelu(xs: &[Tensor], act: Option<Act>) -> Result<Option<Tensor>> {
    let (Some(act @ (Act::Gelu | Act::GeluTanh)), Some(b)) = (act, xs.get(2)) else {
        return Ok(None);
    };
    // A bias of another type is candle's error on the unfused path: kept so.
    if !kernels::enabled()
        || xs[0].device().is_cpu()
        || b.dtype() != xs[0].dtype()
        || autocast::hooked_context().is_some()
    {
        return Ok(None);
    }
    let Some(out) = super::ops::prepared_type("gelu", &[xs[0].dtype()]) else {
        return Ok(None);
    };
    let h = kernels::linear(&xs[0], &xs[1], None)?;
    match kernels::cuda::rows::bias_gelu(&h, b, out, act == Act::GeluTanh)? {
        Some(y) => Ok(Some(y)),
        None => apply_act(&h.broadcast_add(b)?, act).map(Some),
    }
}

/// Linear layers (weight, bias, activation after it) applied in turn to `x` as one node of
/// the run ([`kernels::chain`](crate::kernels::chain)), or `None` where that does not apply
/// and the caller runs the layers one by one: outside a run, when an observer records the
/// step or a layer is kept in f32 (both work per named layer), with GELU on the last layer
/// under autocast (which returns it in f32), when nothing computes in half, and wherever a
/// single layer's stashing node would not apply.
pub(crate) fn linear_chain(x: &Tensor, layers: &[(&Tensor, Option<&Tensor>, Option<Act>)]) -> Result<Option<Tensor>> {
    if autocast::hooked_context().is_some() {
        return Ok(None);
    }
    let Some(stash) = autocast::run_stash() else {
        return Ok(None);
    };
    if gelu_last_under_autocast(layers) {
        return Ok(None);
    }
    let (xs, _) = prepare("linear", &[x])?;
    if !is_half(&xs[0]) {
        return Ok(None);
    }
    let Some(prepared) = prepared_layers(&stash, layers)? else {
        return Ok(None);
    };
    kernels::chain::chain(&xs[0], &chain_layers(&prepared), stash)
}

/// A layer's parameters as cast for `linear`, its keys and its activation.
type Prepared = (Vec<Tensor>, Option<Tensor>, Option<Tensor>, Option<Act>);

/// The layers' parameters as `linear` casts them, with their keys; `None` where a
/// parameter is not the run's.
fn prepared_layers(
    stash: &GradStash,
    layers: &[(&Tensor, Option<&Tensor>, Option<Act>)],
) -> Result<Option<Vec<Prepared>>> {
    let mut cast = Vec::with_capacity(layers.len());
    for (w, b, act) in layers {
        let mut args = vec![*w];
        if let Some(b) = b {
            args.push(b);
        }
        let (ps, _) = prepare("linear", &args)?;
        let Some((w_key, b_key)) = param_keys(stash, w, *b) else {
            return Ok(None);
        };
        cast.push((ps, w_key, b_key, *act));
    }
    Ok(Some(cast))
}

fn chain_layers(prepared: &[Prepared]) -> Vec<kernels::chain::ChainLayer<'_>> {
    prepared
        .iter()
        .map(|(ps, wk, bk, act)| kernels::chain::ChainLayer {
            w: &ps[0],
            b: ps.get(1),
            w_key: wk.as_ref(),
            b_key: bk.as_ref(),
            act: *act,
        })
        .collect()
}

/// The rows of `table` at `ids` (`rows`: the ids as checked row indices) as one node of the
/// run whose backward sums the table's gradient in f32 and sends it to the run's stash
/// ([`kernels::embedding`](crate::kernels::embedding)), or `None` where that does not apply
/// and the caller runs `index_select`: outside a run, when an observer records the step, for
/// a table that is not in half (candle sums an f32 table's gradient in f32 already), is not
/// the run's or is frozen.
pub(crate) fn embedding(ids: &Tensor, rows: std::sync::Arc<[u32]>, table: &Tensor) -> Result<Option<Tensor>> {
    if autocast::hooked_context().is_some() || !is_half(table) {
        return Ok(None);
    }
    let Some(stash) = autocast::run_stash() else {
        return Ok(None);
    };
    if stash.trains(table) != Some(true) {
        return Ok(None);
    }
    kernels::embedding::lookup(ids, rows, table, table, stash)
}

fn is_half(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::F16 | DType::BF16)
}

/// Under autocast GELU runs in f32 and returns f32 (its cast policy). Inside a chain, where
/// the next layer casts that f32 output back to half, GELU in half gives the same values,
/// bit for bit (the kernel computes in f32 and rounds once, as the cast does, and its
/// backward rounds `g * gelu'(x)` once, as the cast's backward does), so it fuses; on the
/// last layer the output's type would differ, so the chain runs layer by layer.
fn gelu_last_under_autocast(layers: &[(&Tensor, Option<&Tensor>, Option<Act>)]) -> bool {
    autocast::is_enabled()
        && layers
            .last()
            .is_some_and(|l| matches!(l.2, Some(Act::Gelu | Act::GeluTanh)))
}

fn apply_act(y: &Tensor, act: Act) -> Result<Tensor> {
    match act {
        Act::Relu => relu(y),
        Act::Gelu => gelu(y),
        Act::GeluTanh => gelu_tanh(y),
    }
}

/// The stashing node for [`linear_layer_act`], or `None` where it does not apply. `xs`: the
/// arguments as cast for the op; `w`, `b`: the layer's parameters.
fn wgrad_linear(xs: &[Tensor], w: &Tensor, b: Option<&Tensor>, act: Option<Act>) -> Result<Option<Tensor>> {
    let half = |t: &Tensor| matches!(t.dtype(), DType::F16 | DType::BF16);
    // All in f32 (O0, a layer kept in f32 at O1): candle's accumulation is f32 already.
    if !(half(&xs[1]) || half(w)) {
        return Ok(None);
    }
    let Some(stash) = autocast::run_stash() else {
        return Ok(None);
    };
    let Some((w_key, b_key)) = param_keys(&stash, w, b) else {
        return Ok(None);
    };
    kernels::wgrad::linear(&xs[0], &xs[1], xs.get(2), w_key.as_ref(), b_key.as_ref(), stash, act)
}

/// A layer's weight and bias keys for the stashing node.
type Keys = (Option<Tensor>, Option<Tensor>);

/// Each key `Some(p)` where the parameter trains (its gradient is stashed), `None` where it
/// is frozen (none computed); `None` overall where a parameter is not the run's, so the layer
/// keeps the graph path.
fn param_keys(stash: &GradStash, w: &Tensor, b: Option<&Tensor>) -> Option<Keys> {
    let key = |p: &Tensor| stash.trains(p).map(|t| t.then(|| p.clone()));
    let w_key = key(w)?;
    let b_key = match b {
        Some(b) => key(b)?,
        None => None,
    };
    Some((w_key, b_key))
}

/// Self-attention over `x` `(b, t, d)` with the projections `[q, k, v, o]` (weight, bias) as
/// one node of the run ([`kernels::attention`](crate::kernels::attention)), or `None` where
/// that does not apply and the caller runs the unfused ops: outside a run, when an observer
/// records the step or a layer is kept in f32 (both work per named layer), when the
/// products do not run in half, and wherever the node's shapes do not fit. Under autocast
/// the probabilities are computed in f32 and cast for the product, as softmax's policy and
/// the unfused [`crate::nn::scaled_dot_product_attention`] do.
pub(crate) fn self_attention(
    x: &Tensor,
    proj: [(&Tensor, Option<&Tensor>); 4],
    heads: usize,
    causal: bool,
    opts: &AttentionOptions,
) -> Result<Option<Tensor>> {
    if autocast::hooked_context().is_some() {
        return Ok(None);
    }
    let Some(stash) = autocast::run_stash() else {
        return Ok(None);
    };
    // The type the projections compute in: the input's as `linear` casts it.
    let (xs, _) = prepare("linear", &[x])?;
    if !is_half(&xs[0]) {
        return Ok(None);
    }
    let proj = proj.map(|(w, b)| (w, b, None));
    let Some(prepared) = prepared_layers(&stash, &proj)? else {
        return Ok(None);
    };
    let layers = chain_layers(&prepared);
    // At O1 the node takes the f32 input itself and casts it once inside, so neither the
    // input's half copy nor its three gradients are half tensors of the graph.
    let input = if xs[0].dtype() == x.dtype() { &xs[0] } else { x };
    let layers = [&layers[0], &layers[1], &layers[2], &layers[3]];
    kernels::attention::self_attention(input, layers, attention_spec(heads, causal, opts), stash)
}

/// The self-attention's options beyond its heads and causal mask (`nn::SelfAttention`'s).
#[derive(Debug, Clone, Default)]
pub(crate) struct AttentionOptions {
    /// Key/value heads; 0: one per query head.
    pub kv_heads: usize,
    /// Rotary tables `cos`, `sin`, f32 `(max_t, head_dim)`.
    pub rope: Option<(Tensor, Tensor)>,
    /// A key length per batch item.
    pub lengths: Option<std::sync::Arc<[usize]>>,
}

fn attention_spec(heads: usize, causal: bool, opts: &AttentionOptions) -> kernels::attention::AttentionSpec {
    kernels::attention::AttentionSpec {
        heads,
        kv_heads: if opts.kv_heads == 0 { heads } else { opts.kv_heads },
        causal,
        scale: None,
        probs_f32: autocast::is_enabled(),
        rope: opts.rope.clone(),
        lengths: opts.lengths.clone(),
    }
}

/// The body of a fused residual sub-layer ([`residual`]).
pub(crate) enum BodySpec<'a> {
    /// Self-attention with the projections `[q, k, v, o]` (weight, bias).
    Attention {
        proj: [(&'a Tensor, Option<&'a Tensor>); 4],
        heads: usize,
        causal: bool,
        opts: AttentionOptions,
    },
    /// Linear layers, each with its activation.
    Chain(&'a [(&'a Tensor, Option<&'a Tensor>, Option<Act>)]),
    /// A gated MLP with the projections `[gate, up, down]` (weight, bias).
    Gated {
        proj: [(&'a Tensor, Option<&'a Tensor>); 3],
        act: kernels::gated::GateAct,
    },
}

/// A fused residual sub-layer's norm (`nn::Residual`'s): weight, bias, epsilon, and
/// whether it removes the mean (a layer norm; else an RMS norm without bias).
pub(crate) struct ResidualNorm<'a> {
    pub w: Option<&'a Tensor>,
    pub b: Option<&'a Tensor>,
    pub eps: f64,
    pub center: bool,
}

/// A residual sub-layer as one node of the run ([`kernels::residual`](crate::kernels::residual)):
/// pre-norm `x + dropout(body(norm(x)))`, post-norm `norm(x + dropout(body(x)))`, the norm
/// computed as [`super::ops::layer_norm`] or [`super::ops::rms_norm`] computes it. `None`
/// where that does not apply and the caller runs the unfused ops with the same `mask` (f32,
/// `None`: no dropout): where the body's own fused node does not apply ([`self_attention`],
/// [`linear_chain`], [`gated_mlp`]), or a norm parameter is not the run's.
///
/// The node comes back with its forward run (its output is [`ResidualNode::output`]), not
/// applied to any graph: [`residual_stack`] applies it, alone or with the sub-layers built
/// after it on that output.
pub(crate) fn residual_node(
    x: &Tensor,
    norm: ResidualNorm<'_>,
    placement: kernels::residual::Placement,
    body: BodySpec<'_>,
    mask: Option<&Tensor>,
) -> Result<Option<ResidualNode>> {
    if autocast::hooked_context().is_some() {
        return Ok(None);
    }
    let Some(stash) = autocast::run_stash() else {
        return Ok(None);
    };
    // A body that computes in f32 (O0) has no fused node: known from the input's type, before
    // the norm runs for nothing (a pre-norm body's input has the input's type or, under
    // autocast, is cast to half as the input would be).
    if super::ops::prepared_type("linear", &[x.dtype()]) == Some(DType::F32) {
        return Ok(None);
    }
    let ResidualNorm { w, b, eps, center } = norm;
    let key = |p: Option<&Tensor>| match p {
        None => Some(None),
        Some(p) => stash.trains(p).map(|t| t.then(|| p.clone())),
    };
    let (Some(w_key), Some(b_key)) = (key(w), key(b)) else {
        return Ok(None);
    };
    let spec = kernels::residual::NormSpec {
        w,
        b,
        w_key: w_key.as_ref(),
        b_key: b_key.as_ref(),
        eps,
        center,
    };
    // The norm's input as its op casts it (f32 under autocast).
    let op = if center { "layer_norm" } else { "rms_norm" };
    let prep = |t: &Tensor| Ok(prepare(op, &[t])?.0.swap_remove(0));
    let sink: std::sync::Arc<dyn kernels::wgrad::GradSink> = stash.clone();
    let run = |build: &dyn Fn(&Tensor) -> Result<Option<kernels::residual::Body>>| {
        kernels::residual::build(x, spec, placement, prep, build, mask, stash.clone())
    };
    match body {
        BodySpec::Chain(layers) => {
            if gelu_last_under_autocast(layers) {
                return Ok(None);
            }
            let Some(prepared) = prepared_layers(&stash, layers)? else {
                return Ok(None);
            };
            let chain = chain_layers(&prepared);
            run(&|h: &Tensor| {
                let (hs, _) = prepare("linear", &[h])?;
                if !is_half(&hs[0]) {
                    return Ok(None);
                }
                let node = kernels::chain::build(&hs[0], &chain, sink.clone(), true)?;
                Ok(node.map(kernels::residual::Body::Chain))
            })
        }
        BodySpec::Attention {
            proj,
            heads,
            causal,
            opts,
        } => {
            let proj = proj.map(|(w, b)| (w, b, None));
            let Some(prepared) = prepared_layers(&stash, &proj)? else {
                return Ok(None);
            };
            let layers = chain_layers(&prepared);
            run(&|h: &Tensor| {
                let (hs, _) = prepare("linear", &[h])?;
                if !is_half(&hs[0]) {
                    return Ok(None);
                }
                let input = if hs[0].dtype() == h.dtype() { &hs[0] } else { h };
                let layers = [&layers[0], &layers[1], &layers[2], &layers[3]];
                let node =
                    kernels::attention::build(input, layers, attention_spec(heads, causal, &opts), sink.clone(), true)?;
                Ok(node.map(|n| kernels::residual::Body::Attention(Box::new(n))))
            })
        }
        BodySpec::Gated { proj, act } => {
            let proj = proj.map(|(w, b)| (w, b, None));
            let Some(prepared) = prepared_layers(&stash, &proj)? else {
                return Ok(None);
            };
            let layers = chain_layers(&prepared);
            run(&|h: &Tensor| {
                let (hs, _) = prepare("linear", &[h])?;
                if !is_half(&hs[0]) || !gated_in_half(hs[0].dtype(), act) {
                    return Ok(None);
                }
                let input = if hs[0].dtype() == h.dtype() { &hs[0] } else { h };
                let layers = [&layers[0], &layers[1], &layers[2]];
                let node = kernels::gated::build(input, layers, act, sink.clone(), true)?;
                Ok(node.map(|n| kernels::residual::Body::Gated(Box::new(n))))
            })
        }
    }
}

/// A fused residual sub-layer's node ([`residual_node`]).
pub(crate) type ResidualNode = kernels::residual::Residual;

/// Consecutive fused residual sub-layers' nodes ([`residual_node`], the first built on `x`,
/// each other on the previous one's output) as one node of candle's graph
/// ([`kernels::residual::stack`](crate::kernels::residual::stack)): the last output, the
/// values and gradients of applying each node alone, bit for bit.
pub(crate) fn residual_stack(x: &Tensor, nodes: Vec<ResidualNode>) -> Result<Tensor> {
    kernels::residual::stack(x, nodes)
}

/// A gated MLP `down(act(gate(x)) * up(x))` (`nn::GatedMlp`) with the projections
/// `[gate, up, down]` (weight, bias) as one node of the run
/// ([`kernels::gated`](crate::kernels::gated)), or `None` where that does not apply and the
/// caller runs the unfused ops: under the same conditions as [`linear_chain`], and where the
/// thread's policy would not run the activation and the product in the products' half type
/// (GELU under autocast, which runs it in f32).
pub(crate) fn gated_mlp(
    x: &Tensor,
    proj: [(&Tensor, Option<&Tensor>); 3],
    act: kernels::gated::GateAct,
) -> Result<Option<Tensor>> {
    if autocast::hooked_context().is_some() {
        return Ok(None);
    }
    let Some(stash) = autocast::run_stash() else {
        return Ok(None);
    };
    let (xs, _) = prepare("linear", &[x])?;
    if !is_half(&xs[0]) {
        return Ok(None);
    }
    if !gated_in_half(xs[0].dtype(), act) {
        return Ok(None);
    }
    let proj = proj.map(|(w, b)| (w, b, None));
    let Some(prepared) = prepared_layers(&stash, &proj)? else {
        return Ok(None);
    };
    let layers = chain_layers(&prepared);
    // At O1 the node takes the f32 input itself and casts it once inside, as attention does.
    let input = if xs[0].dtype() == x.dtype() { &xs[0] } else { x };
    kernels::gated::gated_mlp(input, [&layers[0], &layers[1], &layers[2]], act, stash)
}

/// Whether the thread's policy runs a gated MLP's activation and product in `dt`, the type
/// of its products (GELU under autocast runs in f32: not so).
fn gated_in_half(dt: DType, act: kernels::gated::GateAct) -> bool {
    let act_op = match act {
        kernels::gated::GateAct::Silu => "silu",
        kernels::gated::GateAct::Gelu => "gelu",
        kernels::gated::GateAct::Relu => "relu",
    };
    let keeps = |op: &str, n: usize| super::ops::prepared_type(op, &vec![dt; n]) == Some(dt);
    keeps(act_op, 1) && keeps("mul", 2)
}

/// On CUDA, a gated MLP's product `act(g) * u` (`nn::GatedMlp` where its fused node does not
/// apply) as one kernel each way ([`kernels::cuda::gated`](crate::kernels::cuda::gated)), in
/// the types the unfused ops give: the activation's as its op's policy gives it (`"silu"`'s,
/// `"gelu"`'s: f32 under autocast; ReLU, on no list, in g's type), the product's as
/// [`super::ops::mul`] promotes it. `None` elsewhere: off CUDA, with the kernels off, where an
/// observer records the step or a layer is kept in f32 (they see each op's output), for
/// operands of two types or shapes, an empty tensor, and a policy that would cast to half or
/// refuse; the caller then runs the unfused ops.
pub(crate) fn cuda_gated_product(g: &Tensor, u: &Tensor, act: kernels::gated::GateAct) -> Result<Option<Tensor>> {
    use kernels::cuda::gated::PointAct;
    use kernels::gated::GateAct;
    if !kernels::enabled() || g.device().is_cpu() || g.dtype() != u.dtype() || autocast::hooked_context().is_some() {
        return Ok(None);
    }
    let (op, point) = match act {
        GateAct::Silu => (Some("silu"), PointAct::Silu),
        GateAct::Gelu => (Some("gelu"), PointAct::Gelu),
        GateAct::Relu => (None, PointAct::Relu),
    };
    let a = match op {
        Some(op) => super::ops::prepared_type(op, &[g.dtype()]),
        None => Some(g.dtype()),
    };
    let Some((a, p)) = a.and_then(|a| Some((a, super::ops::prepared_type("mul", &[a, u.dtype()])?))) else {
        return Ok(None);
    };
    kernels::cuda::gated::gated_product(g, u, point, a, p)
}
