//! Pointwise kernels on CUDA, from `gated.cu`: a gated MLP's product `act(g) * u` (SwiGLU,
//! GeGLU in either GELU form, ReGLU) and an activation alone (GELU's tanh form), each one pass
//! forward and one pass backward where candle runs several generic kernels.
//!
//! * **Gated product** (`nn::GatedMlp` off the CPU): unfused, the activation (SiLU and GELU
//!   are chains of candle kernels on CUDA, their backwards longer chains) and `ops::mul` are
//!   separate nodes with a hidden-width tensor between them. Here one kernel computes
//!   `y = act(g) * u` in f32: the activation rounded to the type the unfused activation
//!   returns (g's, or f32 where autocast runs it in f32), the product rounded once to the
//!   type `ops::mul` gives (g's, or f32 where it promotes). The backward is one kernel too:
//!   `dg = dy * u * act'(g)` and `du = dy * act(g)`, rounded as the unfused graph rounds them
//!   (the product's gradient in its type, cast to each operand's), the activation recomputed
//!   from `g` rather than kept. The values are the unfused ops' up to the activation's own
//!   f32 rounding.
//! * **Activation** (`kernels::gelu_tanh` off the CPU): `y = act(x)`, `dx = dy * act'(x)`, in
//!   f32 arithmetic, in x's type; SiLU, GELU and ReLU are built too (one template).
//!
//! Built and loaded as the other kernel families are (see [`super::softmax`]): NVRTC at run
//! time, one warning per device and the composed ops where that fails. The launch plan (this
//! module's functions) is shared with the tests through `candle_amp::testing`; they run the
//! same `.cu` on the CPU grid emulator (`tests/cuda_emu`).

use super::type_name;
use candle_core::{DType, Result, Tensor};

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("gated.cu");

/// Threads per block.
const BLOCK: usize = 256;
/// Blocks at most: the grid-stride loop covers the rest (a few waves on a large GPU).
const MAX_BLOCKS: usize = 4096;

/// The activation a kernel applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointAct {
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU in the erf form, `x * Φ(x)`.
    Gelu,
    /// GELU in the tanh form, `x/2 * (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    GeluTanh,
    /// `max(x, 0)`, with gradient 0 at 0.
    Relu,
}

impl PointAct {
    /// The activation's part of the kernel names.
    pub fn name(self) -> &'static str {
        match self {
            PointAct::Silu => "silu",
            PointAct::Gelu => "gelu",
            PointAct::GeluTanh => "gelu_tanh",
            PointAct::Relu => "relu",
        }
    }
}

/// One launch: the kernel's name and its one-dimensional grid and block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PointLaunch {
    /// The `extern "C"` kernel name.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

/// The launches of one gated product over `n` values, forward and backward (same grid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatedPlan {
    /// `amp_gated_fwd_{act}_{t}_{a}_{p}`: the product.
    pub forward: PointLaunch,
    /// `amp_gated_bwd_{act}_{t}_{a}_{p}`: both operands' gradients.
    pub backward: PointLaunch,
    /// Values.
    pub n: usize,
}

/// The launches of one activation over `n` values, forward and backward (same grid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActPlan {
    /// `amp_act_fwd_{act}_{t}`.
    pub forward: PointLaunch,
    /// `amp_act_bwd_{act}_{t}`.
    pub backward: PointLaunch,
    /// Values.
    pub n: usize,
}

/// The grid-stride launch of `kernel` over `n` values (a function of `n` alone), or `None`
/// for an empty tensor or one past the 64-bit length argument.
fn launch(kernel: String, n: usize) -> Option<PointLaunch> {
    if n == 0 || i64::try_from(n).is_err() {
        return None;
    }
    Some(PointLaunch {
        kernel,
        grid: n.div_ceil(BLOCK).min(MAX_BLOCKS) as u32,
        block: BLOCK as u32,
    })
}

/// The plan of `act(g) * u` over `n` values of `t` (g's and u's type), the activation
/// rounded to `a` and the product to `p`, or `None` where no kernel applies: `a` and `p`
/// each `t` or f32, `p` f32 where `a` is (a promoting multiply), types f32, f16 or bf16, and
/// `n` not 0.
pub fn gated_plan(n: usize, act: PointAct, t: DType, a: DType, p: DType) -> Option<GatedPlan> {
    let (nt, na, np) = (type_name(t)?, type_name(a)?, type_name(p)?);
    let widened = |d: DType| d == t || d == DType::F32;
    if !widened(a) || !widened(p) || (a == DType::F32 && p != DType::F32) {
        return None;
    }
    let name = format!("{}_{nt}_{na}_{np}", act.name());
    let forward = launch(format!("amp_gated_fwd_{name}"), n)?;
    let backward = PointLaunch {
        kernel: format!("amp_gated_bwd_{name}"),
        ..forward.clone()
    };
    Some(GatedPlan { forward, backward, n })
}

/// The plan of `act(x)` over `n` values of `t` (f32, f16 or bf16), or `None` where no kernel
/// applies (another type, `n` 0).
pub fn act_plan(n: usize, act: PointAct, t: DType) -> Option<ActPlan> {
    let name = format!("{}_{}", act.name(), type_name(t)?);
    let forward = launch(format!("amp_act_fwd_{name}"), n)?;
    let backward = PointLaunch {
        kernel: format!("amp_act_bwd_{name}"),
        ..forward.clone()
    };
    Some(ActPlan { forward, backward, n })
}

/// `act(g) * u` for `g` and `u` of one shape and type, the activation rounded to `a` and the
/// product returned in `p` (see [`gated_plan`]), differentiable with respect to both, as the
/// kernels of `gated.cu`; `Ok(None)` where they do not apply (not CUDA, built without the
/// `cuda` feature, other types or shapes, an empty tensor, kernels that failed to load): the
/// caller runs the unfused ops.
pub(crate) fn gated_product(g: &Tensor, u: &Tensor, act: PointAct, a: DType, p: DType) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return device::gated_product(g, u, act, a, p);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (g, u, act, a, p);
        Ok(None)
    }
}

/// `act(x)` in x's type, differentiable, as the kernels of `gated.cu`; `Ok(None)` where they
/// do not apply (as [`gated_product`]).
pub(crate) fn activation(x: &Tensor, act: PointAct) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return device::activation(x, act);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, act);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use device::available;

#[cfg(feature = "cuda")]
#[path = "gated_device.rs"]
mod device;
