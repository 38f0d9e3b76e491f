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
//! Grouped-query attention and key lengths are computed in the kernels too, for
//! `nn::SelfAttention` on CUDA: K and V with fewer heads than Q (each read by `group`
//! consecutive query heads, no copies; the dK/dV pass sums a key/value head's gradients over
//! its group's query heads in a fixed order, no atomics), and per-sequence key lengths (keys
//! past the length masked, a sequence of length 0 giving output and gradients 0, as the CPU
//! path's empty softmax rows).
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
//! FMA kernels' by about one half rounding of those terms.
//!
//! Head dimensions: every multiple of 8 up to 128. Both sets have kernels for 32 (a 256-wide
//! model of 8 heads), 48 (llama2.c's 15M), 64 (GPT-2), 80 (Phi), 96 and 128 (Llama), their
//! register arrays and unrolled loops sized at compile time; the tensors' own head dimension
//! is an argument, and one between those runs on the next larger kernel with the columns past
//! it loaded as zeros (which change no score and no product) and never stored: 40 on 48's, 104
//! on 128's. That wastes `(D - d) / D` of the products there (17% at 40, 19% at 104) rather
//! than compile a module nearly three times as large (NVRTC compiles every kernel of a module at
//! its first use) for head dimensions no common model has. [`flash_plan`] returns `None` for
//! other head dimensions (not a multiple of 8, or past 128) and the caller keeps the composed
//! ops.
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

/// The head dimensions the kernels are compiled for (`flash.cu`'s `AMP_FLASH_CONFIGS`,
/// `flash_mma.cu`'s `AMP_FLASH_MMA_CONFIGS`).
const KERNEL_DIMS: [usize; 6] = [32, 48, 64, 80, 96, 128];

/// The kernels' head dimension for a tensor's `d`: the smallest of [`KERNEL_DIMS`] at least
/// `d`, for `d` a multiple of 8 up to 128 (the tensor-core kernels load and zero rows in blocks
/// of 8 columns, 16 bytes); `None` otherwise.
fn kernel_dim(d: usize) -> Option<usize> {
    if d == 0 || !d.is_multiple_of(8) {
        return None;
    }
    KERNEL_DIMS.into_iter().find(|&k| k >= d)
}

/// `(query rows, key rows, threads per row)` of the tiles of kernel head dimension `dk`, as
/// `flash.cu`'s `AMP_FLASH_CONFIGS` defines them.
fn tiles(dk: usize, which: Tiles) -> (usize, usize, usize) {
    match (dk, which) {
        // Past 64, four 32-row tiles of `dk + 1` f32 would pass 48 KiB of shared memory.
        (..=64, Tiles::Large) => (32, 32, 4),
        (_, Tiles::Large) => (16, 16, 8),
        (_, Tiles::Small) => (8, 8, 4),
        // flash_mma.cu: 64 rows per block (16 per warp, two threads per row) in each pass;
        // the tiles a pass loops over differ per head dimension, but the grids do not.
        (_, Tiles::Mma) => (64, 64, 2),
    }
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

/// The launches of one attention over `bh` (batch x heads) query matrices of `t` rows of `d`
/// (and `bh / group` key/value matrices). `D` in the kernel names is the kernels' head
/// dimension, the smallest of 32, 48, 64, 80, 96 and 128 at least `d` (`d` itself is the
/// kernels' argument).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlashPlan {
    /// `amp_flash_fwd_{t}_d{D}{c}`: O and the rows' LSE.
    pub forward: FlashLaunch,
    /// `amp_flash_bwd_pre_{t}`: `Delta = rowsum(dO * O)` (one kernel per type for every `d`).
    pub pre: FlashLaunch,
    /// `amp_flash_bwd_dkv_{t}_d{D}{c}`: dK and dV, one block per key/value matrix and key tile.
    pub dkv: FlashLaunch,
    /// `amp_flash_bwd_dq_{t}_d{D}{c}`: dQ.
    pub dq: FlashLaunch,
    /// Whether the forward, dK/dV and dQ kernels are `flash_mma.cu`'s (tensor cores; `c` is
    /// `m`) rather than `flash.cu`'s; the `Delta` kernel is always `flash.cu`'s.
    pub tensor_cores: bool,
}

/// The plan for `bh` query matrices read by `group` each per key/value matrix (1: as many key/value
/// as query matrices), or `None` where no kernel applies (another type, a head dimension `d`
/// that is not a multiple of 8 from 8 to 128, an empty tensor, `group` 0 or not dividing `bh`, sizes past the kernels' 32-bit arguments,
/// [`Tiles::Mma`] for f32). `which` forces
/// a tile (the tests); `None` takes the tensor-core kernels for f16 and bf16 where
/// `tensor_cores` (the device has compute capability 8.0 or more and their module loaded),
/// otherwise the large tile unless its grid would be small.
pub fn flash_plan(
    bh: usize,
    group: usize,
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
    if bh == 0
        || t == 0
        || group == 0
        || !bh.is_multiple_of(group)
        || !fits(bh.checked_mul(t)?)
        || !fits(bh.checked_mul(t)?.checked_mul(d)?.checked_mul(3)?)
    {
        return None;
    }
    let dk = kernel_dim(d)?;
    let (large_rows, _, _) = tiles(dk, Tiles::Large);
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
    let (br, bc, tpr) = tiles(dk, which);
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
        forward: launch(format!("amp_flash_fwd_{ty}_d{dk}{c}"), bh * t.div_ceil(br), br * tpr)?,
        pre: launch(
            format!("amp_flash_bwd_pre_{ty}"),
            (bh * t).div_ceil(PRE_ROWS_PER_BLOCK),
            32 * PRE_ROWS_PER_BLOCK,
        )?,
        dkv: launch(
            format!("amp_flash_bwd_dkv_{ty}_d{dk}{c}"),
            bh / group * t.div_ceil(bc),
            bc * tpr,
        )?,
        dq: launch(format!("amp_flash_bwd_dq_{ty}_d{dk}{c}"), bh * t.div_ceil(br), br * tpr)?,
        tensor_cores: which == Tiles::Mma,
    })
}

#[cfg(feature = "cuda")]
pub(crate) use device::{applies, applies_with, attention, attention_with, available, tensor_cores_loaded};

/// Whether [`attention`] runs the kernels for `(q, k, v)`: never without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn applies(_: &candle_core::Tensor, _: &candle_core::Tensor, _: &candle_core::Tensor) -> bool {
    false
}

/// Whether [`attention_with`] runs the kernels: never without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn applies_with(
    _: &candle_core::Tensor,
    _: &candle_core::Tensor,
    _: &candle_core::Tensor,
    _: Option<&[usize]>,
) -> bool {
    false
}

/// The kernels' attention with grouped key/value heads and key lengths: never without the
/// `cuda` feature (the caller runs the composed ops).
#[cfg(not(feature = "cuda"))]
pub(crate) fn attention_with(
    _: &candle_core::Tensor,
    _: &candle_core::Tensor,
    _: &candle_core::Tensor,
    _: f64,
    _: bool,
    _: Option<&[usize]>,
) -> candle_core::Result<Option<candle_core::Tensor>> {
    Ok(None)
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
