//! Attention's softmax on CUDA: `softmax(x * scale)` over the last dimension with the causal
//! mask computed in the kernel, and its one-pass backward, from `softmax.cu`.
//!
//! Composed from candle ops the same softmax was six f32 passes over the (batch, heads, t, t)
//! scores (mask add, max, subtract, exp, sum, divide) plus the casts around them: about 85% of
//! an O2 bf16 GPT-2 step's GPU time on an H200 (issue 38). Here the forward reads the scores
//! once in their own type and writes the probabilities once in the type asked; the backward
//! reads `y` and `dy` once and writes `dx` once.
//!
//! **Build:** the CUDA C is compiled at run time by NVRTC (cudarc's `nvrtc`, which candle's
//! `cuda` feature already links), once per compute capability per process, for the device's
//! own architecture, and loaded into candle's context with `get_or_load_custom_func`, so it
//! runs on candle's stream with candle's allocations. Chosen over nvcc in `build.rs` because
//! users then need no CUDA toolkit (nor `CUDA_COMPUTE_CAP`) to build the library beyond what
//! candle itself needs, the PTX always matches the GPU and the driver's NVRTC, and the source
//! needs no header (the half types are 16-bit patterns), so no toolkit headers at run time
//! either. Where NVRTC or the module load fails (an architecture the NVRTC does not know, a
//! driver older than the PTX), the library logs one warning per device and keeps the composed
//! path: results stay the same, only slower.
//!
//! The launch plan ([`plan`]) is shared with the tests, which run the same `.cu` on the CPU
//! grid emulator (`tests/cuda_emu`).

use super::type_name;
use candle_core::DType;

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("softmax.cu");

/// Rows per block of the one-warp-per-row kernels (four warps: 128 threads).
const WARP_ROWS_PER_BLOCK: usize = 4;
/// Values per lane the one-warp kernels exist for (`AMP_SOFTMAX_WARP_SIZES` in the source).
const WARP_VALUES: [usize; 3] = [2, 8, 32];

/// Which kernel: the forward or the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// `y = softmax(x * scale)`, masked.
    Forward,
    /// `dx = scale * y * (dy - rowsum(dy * y))`.
    Backward,
}

/// One launch: the kernel's name in the module and its one-dimensional grid and block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The `extern "C"` kernel name.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

/// The launch for `rows` rows of `cols` values, `input` in (the scores, or `y` and `dy`) and
/// `out` out, or `None` where no kernel applies (another type, an empty tensor, sizes past
/// the kernels' 32-bit arguments). Rows up to 1024 long: one warp per row, the row in
/// registers; longer rows: one block per row.
pub fn plan(pass: Pass, rows: usize, cols: usize, input: DType, out: DType) -> Option<Launch> {
    let (ni, no) = (type_name(input)?, type_name(out)?);
    let fits = |v: usize| i32::try_from(v).is_ok();
    if rows == 0 || cols == 0 || !fits(rows) || !fits(cols) || !fits(rows.checked_mul(cols)?) {
        return None;
    }
    let which = match pass {
        Pass::Forward => "fwd",
        Pass::Backward => "bwd",
    };
    if let Some(n) = WARP_VALUES.iter().find(|&&n| cols <= 32 * n) {
        return Some(Launch {
            kernel: format!("amp_softmax_{which}_w{n}_{ni}_{no}"),
            grid: u32::try_from(rows.div_ceil(WARP_ROWS_PER_BLOCK)).ok()?,
            block: (32 * WARP_ROWS_PER_BLOCK) as u32,
        });
    }
    // Long rows (a vocabulary): enough threads that each reads a few dozen values at most.
    let block = if cols <= 8192 { 512 } else { 1024 };
    Some(Launch {
        kernel: format!("amp_softmax_{which}_b_{ni}_{no}"),
        grid: u32::try_from(rows).ok()?,
        block,
    })
}

#[cfg(feature = "cuda")]
pub(crate) use device::{available, scaled_softmax};

#[cfg(feature = "cuda")]
#[path = "softmax_device.rs"]
mod device;
