//! The rotary position embedding on CUDA, forward and backward, from `rope.cu`: one kernel
//! each way for `x` `(b, h, t, d)` in f32, f16 or bf16 and f32 tables `(t or more, w)`, in
//! candle's `rope` layout (`w = d`: the halves of each head rotate together) or its `rope_i`
//! layout (`w = d / 2`: neighbouring pairs).
//!
//! Composed from candle ops (`nn::SelfAttention`'s `apply_rope`) a rotation was about ten
//! generic kernels (the casts, two broadcast products, the halves' `narrow`/`neg`/`cat` or the
//! pairs' `reshape`/`narrow`/`stack`, the sum), each writing a full tensor, and as many again
//! in the backward. Here the forward reads `x` once and writes `y` once in `x`'s type; the
//! backward reads the output's gradient once and writes `x`'s once. The arithmetic is the
//! composed ops' in their order (f32 products rounded one by one, then their f32 sum, compiled
//! without FMA contraction), so the values are theirs bit for bit, and the CPU pass's
//! (`kernels::rope`); a zero gradient may differ in its sign only (candle's gradient sums
//! start from +0).
//!
//! Built and loaded as the softmax kernels are (see [`super::softmax`]): NVRTC at run time,
//! `get_or_load_custom_func` into candle's context, one warning per device and the composed
//! ops where that fails. The launch plan ([`rope_plan`]) is shared with the tests through
//! `candle_amp::testing`; they run the same `.cu` on the CPU grid emulator (`tests/cuda_emu`).

use super::type_name;
use candle_core::{DType, Result, Tensor};

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("rope.cu");

/// Threads per block.
const BLOCK: u32 = 256;
/// Blocks at most: enough for several waves on the largest GPU (132 SMs of 2048 threads);
/// past it each thread takes several pairs in the grid-stride loop.
const MAX_GRID: u32 = 8192;

/// Which way a rotation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePass {
    /// The embedding, `y = R x`.
    Forward,
    /// Its gradient, `dx = R^T dy`.
    Backward,
}

/// One launch of a rotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RopeLaunch {
    /// The `extern "C"` kernel name, `amp_rope_{halves|pairs}_{fwd|bwd}_{f32|f16|bf16}`.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Whether the tables are `(t, d)` (candle's `rope`, the halves) rather than `(t, d / 2)`
    /// (candle's `rope_i`, the pairs).
    pub halves: bool,
}

/// The launch of one rotation of `rows` rows of `d` values (`rows` a multiple of the `t`
/// positions: row `r` takes the tables' row `r % t`) with tables of width `w` (`d`: the
/// halves layout; `d / 2`: the pairs), `dt` in and out; `None` where no kernel applies
/// (another type, an odd or zero `d`, a width that is neither, no rows, sizes past the
/// kernels' 32-bit arguments).
pub fn rope_plan(pass: RopePass, rows: usize, t: usize, d: usize, w: usize, dt: DType) -> Option<RopeLaunch> {
    rope_plan_with(pass, rows, t, d, w, dt, MAX_GRID)
}

/// [`rope_plan`] with at most `max_grid` blocks (at least one): the tests run the grid-stride
/// loop with a small grid.
pub fn rope_plan_with(
    pass: RopePass,
    rows: usize,
    t: usize,
    d: usize,
    w: usize,
    dt: DType,
    max_grid: u32,
) -> Option<RopeLaunch> {
    let ty = type_name(dt)?;
    let fits = |v: usize| i32::try_from(v).is_ok();
    if rows == 0 || t == 0 || !rows.is_multiple_of(t) || d == 0 || !d.is_multiple_of(2) || !fits(rows.checked_mul(d)?) {
        return None;
    }
    let halves = match w {
        w if w == d => true,
        w if 2 * w == d => false,
        _ => return None,
    };
    let layout = if halves { "halves" } else { "pairs" };
    let dir = match pass {
        RopePass::Forward => "fwd",
        RopePass::Backward => "bwd",
    };
    let pairs = rows * d / 2;
    // At most MAX_GRID * BLOCK threads (2^21): k + stride stays within the kernels' u32 index.
    let grid = u32::try_from(pairs.div_ceil(BLOCK as usize))
        .ok()?
        .clamp(1, max_grid.clamp(1, MAX_GRID));
    Some(RopeLaunch {
        kernel: format!("amp_rope_{layout}_{dir}_{ty}"),
        grid,
        block: BLOCK,
        halves,
    })
}

/// `x` `(b, h, t, d)` (f32, f16 or bf16) rotated by the f32 tables `cos`, `sin` (`(t or more,
/// d)`: candle's `rope` layout; `(t or more, d / 2)`: its `rope_i` layout; the first `t` rows
/// are used) as the kernels of `rope.cu`, in `x`'s type, differentiable in `x` (its gradient in
/// `x`'s type); `Ok(None)` where they do not apply (not CUDA, built without the `cuda` feature,
/// other types or shapes, an empty tensor, tables that track a gradient of their own, kernels
/// that failed to load): the caller runs the composed ops.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return device::rope(x, cos, sin);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, cos, sin);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use device::available;

#[cfg(feature = "cuda")]
#[path = "rope_device.rs"]
mod device;
