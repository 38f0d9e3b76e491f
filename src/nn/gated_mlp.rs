//! The gated MLP of Llama-style models (SwiGLU, GeGLU) as one fused module.

use candle_core::{Result, Tensor};
use candle_nn::{Module, VarBuilder};

use super::linear::{Linear, linear, linear_no_bias};
use crate::kernels::gated::GateAct;
use crate::precision::{fused, ops};

/// The activation on a [`GatedMlp`]'s gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GateActivation {
    /// SiLU `x * sigmoid(x)` (SwiGLU: Llama, Mistral, Qwen), as [`crate::kernels::silu`]
    /// computes it (in f32, rounded once), under the policy registered for `"silu"`.
    Silu,
    /// GELU in the erf form (GeGLU), as [`crate::ops::gelu`].
    Gelu,
    /// `max(x, 0)` (ReGLU), as [`crate::ops::relu`].
    Relu,
}

impl GateActivation {
    fn fused(self) -> GateAct {
        match self {
            GateActivation::Silu => GateAct::Silu,
            GateActivation::Gelu => GateAct::Gelu,
            GateActivation::Relu => GateAct::Relu,
        }
    }
}

/// `down(act(gate(x)) * up(x))`: the feed-forward block of Llama (SwiGLU), Gemma (GeGLU) and
/// their kin, as one fused module (Transformer Engine's `LayerNormMLP` with a gated
/// activation, without the norm).
///
/// Inside a run, with half values on the CPU, the whole block is one node of candle's graph:
/// the gate's and up's outputs, the activation and the product are never half tensors of
/// the graph, whose backward would accumulate each one's gradient in half (slowly on the
/// CPU); each parameter's gradient goes to the run in f32, as a single [`Linear`]'s does;
/// the input's two gradients (through the gate and through up) are summed in f32 and
/// rounded once. The activation and the product are computed in f32 and rounded once to the
/// half type, their gradients too. Elsewhere the layers and ops run one by one: outside a
/// run, in f32 (O0), off the CPU, while the numerics doctor records the step or a layer is
/// kept in f32 (both work per named layer), with GELU under autocast (O1 runs it in f32),
/// and where a layer has an activation of its own ([`Linear::with_activation`]). On CUDA,
/// unless the doctor records or a layer is kept in f32, the activation and the product then
/// run as one kernel forward and one backward, in the types and, up to the activation's f32
/// rounding, the values of the separate ops.
///
/// ```
/// use candle_amp::nn::{GateActivation, GatedMlp, Linear};
/// use candle_core::{Device, Module, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let gate = Linear::new(Tensor::new(&[[1f32], [-1.]], &dev)?, None);
/// let up = Linear::new(Tensor::new(&[[2f32], [3.]], &dev)?, None);
/// let down = Linear::new(Tensor::new(&[[1f32, 1.]], &dev)?, None);
/// let mlp = GatedMlp::new(gate, up, down, GateActivation::Relu);
/// // relu(2) * 4 + relu(-2) * 6
/// let y = mlp.forward(&Tensor::new(&[[2f32]], &dev)?)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[8.0]]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GatedMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    act: GateActivation,
}

impl GatedMlp {
    /// The block from its three projections: `gate` and `up` `(hidden, d)`, `down`
    /// `(d_out, hidden)`.
    pub fn new(gate: Linear, up: Linear, down: Linear, act: GateActivation) -> Self {
        Self { gate, up, down, act }
    }

    /// The gate projection.
    pub fn gate(&self) -> &Linear {
        &self.gate
    }

    /// The up projection.
    pub fn up(&self) -> &Linear {
        &self.up
    }

    /// The down projection.
    pub fn down(&self) -> &Linear {
        &self.down
    }

    /// The activation on the gate.
    pub fn activation(&self) -> GateActivation {
        self.act
    }

    /// The block as separate layers and ops, each one a node of the graph.
    fn unfused(&self, x: &Tensor) -> Result<Tensor> {
        let g = self.gate.forward(x)?;
        if !g.device().is_cpu() {
            // On CUDA the activation and the product as one kernel each way, in the types
            // and (up to the activation's f32 rounding) the values of the ops below.
            let u = self.up.forward(x)?;
            if let Some(p) = fused::cuda_gated_product(&g, &u, self.act.fused())? {
                return self.down.forward(&p);
            }
            return self.down.forward(&ops::mul(&self.activate(&g)?, &u)?);
        }
        let a = self.activate(&g)?;
        let u = self.up.forward(x)?;
        self.down.forward(&ops::mul(&a, &u)?)
    }

    /// The activation on the gate's output, as its op under the thread's policy.
    fn activate(&self, g: &Tensor) -> Result<Tensor> {
        match self.act {
            // `kernels::silu` under `ops::silu`'s policy: what the fused node computes.
            GateActivation::Silu => ops::call("silu", &[g], |t| crate::kernels::silu(&t[0])),
            GateActivation::Gelu => ops::gelu(g),
            GateActivation::Relu => ops::relu(g),
        }
    }
}

/// The projections `[gate, up, down]` (weight, bias) as the fused node takes them.
type Projections<'a> = [(&'a Tensor, Option<&'a Tensor>); 3];

impl GatedMlp {
    /// The projections and the activation as the fused node takes them; `None` where a
    /// layer has an activation of its own (the block then runs unfused).
    pub(crate) fn fused_spec(&self) -> Option<(Projections<'_>, GateAct)> {
        let layers = [&self.gate, &self.up, &self.down];
        if layers.iter().any(|l| l.activation().is_some()) {
            return None;
        }
        Some((layers.map(|l| (l.weight(), l.bias())), self.act.fused()))
    }
}

impl Module for GatedMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some((proj, act)) = self.fused_spec()
            && let Some(y) = fused::gated_mlp(x, proj, act)?
        {
            return Ok(y);
        }
        self.unfused(x)
    }
}

/// Builds a [`GatedMlp`] from `d` to `hidden` and back to `d` with the Hugging Face Llama
/// names `gate_proj`, `up_proj` and `down_proj` under `vb` (each as [`linear`] or, without
/// `bias`, [`linear_no_bias`] builds it: names `weight`, `bias`; same init).
pub fn gated_mlp(d: usize, hidden: usize, act: GateActivation, bias: bool, vb: VarBuilder) -> Result<GatedMlp> {
    let layer = |i, o, name: &str| {
        if bias {
            linear(i, o, vb.pp(name))
        } else {
            linear_no_bias(i, o, vb.pp(name))
        }
    };
    Ok(GatedMlp::new(
        layer(d, hidden, "gate_proj")?,
        layer(d, hidden, "up_proj")?,
        layer(hidden, d, "down_proj")?,
        act,
    ))
}
