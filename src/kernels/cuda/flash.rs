//! Attention on CUDA that never stores the `(batch, heads, t, t)` scores, from `flash.cu`:
//! FlashAttention-2's tiling with an online softmax (<https://arxiv.org/abs/2307.08691>).
//!
//! The forward keeps, per query row, only the f32 log-sum-exp of its scaled scores (`b * h *
//! t` values); the backward recomputes the probabilities from it tile by tile: a pass for
//! `Delta = rowsum(dO * O)`, a pass per key tile summing `dK` and `dV` in registers, and a
//! separate pass per query tile summing `dQ` in registers. `dQ` gets its own pass rather than
//! FlashAttention-2's f32 atomic adds so that every sum runs in one fixed order (the same
//! gradients on every run, as the norm kernels' two-pass parameter gradients), at the cost of
//! computing the scores and `dO V^T` twice. Inputs f32, f16 or bf16, arithmetic in f32, the
//! output and the gradients in the inputs' type; the causal mask is computed in the kernel.
//!
//! Composed from candle ops, attention writes and reads the scores and the probabilities (two
//! `b * h * t * t` tensors, kept for the backward): at GPT-2's t = 1024 and 12 heads each is
//! 48 MiB in f32 per sequence and layer; here memory is linear in `t`.
//!
//! Two sets of kernels. `flash.cu`: scalar `fmaf` loops over f32 shared-memory tiles, for every
//! type and GPU. `flash_mma.cu`: the same passes with every product on tensor cores
//! (`mma.sync.m16n8k16`, half inputs, f32 accumulators), for f16 and bf16 on compute
//! capability 8.0 and newer, which the plan takes there. The tensor-core kernels round the
//! probabilities P and dS to the inputs' half type before they enter a product (as
//! FlashAttention-2 does; the FMA kernels keep them in f32), so their results differ from the
//! FMA kernels' by about one half rounding of those terms. Head dimensions 64 (GPT-2) and 128
//! (Llama) have kernels; [`flash_plan`] returns `None` for others and the caller keeps the
//! composed ops.
//!
//! Built and loaded as the softmax kernels are (see [`super::softmax`]): NVRTC at run time,
//! `get_or_load_custom_func` into candle's context, one warning per device and the composed
//! ops where that fails. The plan is shared with the tests (`candle_amp::testing`), which run
//! the same `.cu` on the CPU grid emulator (`tests/cuda_emu`).

use candle_core::DType;

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("flash.cu");
/// The CUDA C source of the tensor-core kernels (no kernel below compute capability 8.0).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE_MMA: &str = include_str!("flash_mma.cu");

/// Which tiles: `flash.cu`'s `AMP_FLASH_CONFIGS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tiles {
    /// The large tile of the head dimension (128 threads per block).
    Large,
    /// 8 x 8 tiles, one warp per block: more blocks for a grid the large tile leaves too small.
    Small,
    /// `flash_mma.cu`'s tensor-core kernels (f16 and bf16 only; compute capability 8.0+).
    Mma,
}

/// `(query rows, key rows, threads per row)` of a head dimension's tiles, as `flash.cu`'s
/// `AMP_FLASH_CONFIGS` defines them.
fn tiles(d: usize, which: Tiles) -> Option<(usize, usize, usize)> {
    Some(match (d, which) {
        (64, Tiles::Large) => (32, 32, 4),
        (128, Tiles::Large) => (16, 16, 8),
        (64 | 128, Tiles::Small) => (8, 8, 4),
        // flash_mma.cu: 64 rows per block (16 per warp, two threads per row) in each pass;
        // the tiles a pass loops over differ per head dimension, but the grids do not.
        (64 | 128, Tiles::Mma) => (64, 64, 2),
        _ => return None,
    })
}

/// Blocks of the large tile's forward below which the plan takes the small tile: two per SM
/// of an H100 or H200 (132 SMs), so that a short sequence or a small batch still fills the GPU.
const MIN_LARGE_BLOCKS: usize = 264;
/// Rows per block of the `Delta` kernel (one warp per row).
const PRE_ROWS_PER_BLOCK: usize = 4;

/// One launch: the kernel's name in the module and its one-dimensional grid and block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlashLaunch {
    /// The `extern "C"` kernel name.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

/// The launches of one attention over `bh` (batch x heads) matrices of `t` rows of `d`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlashPlan {
    /// `amp_flash_fwd_{t}_d{d}{c}`: O and the rows' LSE.
    pub forward: FlashLaunch,
    /// `amp_flash_bwd_pre_{t}_d{d}`: `Delta = rowsum(dO * O)`.
    pub pre: FlashLaunch,
    /// `amp_flash_bwd_dkv_{t}_d{d}{c}`: dK and dV.
    pub dkv: FlashLaunch,
    /// `amp_flash_bwd_dq_{t}_d{d}{c}`: dQ.
    pub dq: FlashLaunch,
    /// Whether the forward, dK/dV and dQ kernels are `flash_mma.cu`'s (tensor cores; `c` is
    /// `m`) rather than `flash.cu`'s; the `Delta` kernel is always `flash.cu`'s.
    pub tensor_cores: bool,
}

/// The plan, or `None` where no kernel applies (another type or head dimension, an empty
/// tensor, sizes past the kernels' 32-bit arguments, [`Tiles::Mma`] for f32). `which` forces
/// a tile (the tests); `None` takes the tensor-core kernels for f16 and bf16 where
/// `tensor_cores` (the device has compute capability 8.0 or more and their module loaded),
/// otherwise the large tile unless its grid would be small.
pub fn flash_plan(
    bh: usize,
    t: usize,
    d: usize,
    dt: DType,
    which: Option<Tiles>,
    tensor_cores: bool,
) -> Option<FlashPlan> {
    let ty = match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => return None,
    };
    let fits = |v: usize| i32::try_from(v).is_ok();
    // The dq/dk/dv buffer holds 3 * bh * t * d values; the kernels index it with 64-bit
    // offsets but take bh * t (the rows) and t as 32-bit integers.
    if bh == 0 || t == 0 || !fits(bh.checked_mul(t)?) || !fits(bh.checked_mul(t)?.checked_mul(d)?.checked_mul(3)?) {
        return None;
    }
    let (large_rows, _, _) = tiles(d, Tiles::Large)?;
    let half = matches!(dt, DType::F16 | DType::BF16);
    let which = which.unwrap_or(if tensor_cores && half {
        Tiles::Mma
    } else if bh.saturating_mul(t.div_ceil(large_rows)) >= MIN_LARGE_BLOCKS {
        Tiles::Large
    } else {
        Tiles::Small
    });
    if which == Tiles::Mma && !half {
        return None;
    }
    let (br, bc, tpr) = tiles(d, which)?;
    let c = match which {
        Tiles::Large => "l",
        Tiles::Small => "s",
        Tiles::Mma => "m",
    };
    let launch = |kernel: String, grid: usize, block: usize| -> Option<FlashLaunch> {
        Some(FlashLaunch {
            kernel,
            grid: u32::try_from(grid).ok().filter(|g| i32::try_from(*g).is_ok())?,
            block: block as u32,
        })
    };
    Some(FlashPlan {
        forward: launch(format!("amp_flash_fwd_{ty}_d{d}{c}"), bh * t.div_ceil(br), br * tpr)?,
        pre: launch(
            format!("amp_flash_bwd_pre_{ty}_d{d}"),
            (bh * t).div_ceil(PRE_ROWS_PER_BLOCK),
            32 * PRE_ROWS_PER_BLOCK,
        )?,
        dkv: launch(format!("amp_flash_bwd_dkv_{ty}_d{d}{c}"), bh * t.div_ceil(bc), bc * tpr)?,
        dq: launch(format!("amp_flash_bwd_dq_{ty}_d{d}{c}"), bh * t.div_ceil(br), br * tpr)?,
        tensor_cores: which == Tiles::Mma,
    })
}

#[cfg(feature = "cuda")]
pub(crate) use device::{applies, attention, available, tensor_cores_loaded};

/// Whether [`attention`] runs the kernels for `(q, k, v)`: never without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn applies(_: &candle_core::Tensor, _: &candle_core::Tensor, _: &candle_core::Tensor) -> bool {
    false
}

/// The kernels' attention: never without the `cuda` feature (the caller runs the composed ops).
#[cfg(not(feature = "cuda"))]
pub(crate) fn attention(
    _: &candle_core::Tensor,
    _: &candle_core::Tensor,
    _: &candle_core::Tensor,
    _: f64,
    _: bool,
) -> candle_core::Result<Option<candle_core::Tensor>> {
    Ok(None)
}

#[cfg(feature = "cuda")]
#[path = "flash_device.rs"]
mod device;
