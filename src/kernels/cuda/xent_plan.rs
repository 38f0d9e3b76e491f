//! The launch plan of `xent.cu`'s kernels (kept free of the crate's other items: the tests
//! include this file to launch the emulator exactly as the library launches the GPU).

use candle_core::DType;

/// Threads of the one-block mean kernel.
const MEAN_BLOCK: u32 = 1024;

/// One launch: the kernel's name and its one-dimensional grid and block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XentLaunch {
    /// The `extern "C"` kernel name.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

/// The launches of one cross entropy over `rows` rows of `cols` logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XentPlan {
    /// `amp_xent_fwd_{t}_{i}`: one block per row.
    pub forward: XentLaunch,
    /// `amp_xent_mean`: one block.
    pub mean: XentLaunch,
    /// `amp_xent_bwd_{t}_{i}`: one block per row.
    pub backward: XentLaunch,
    /// `amp_xent_rows_{t}_{i}` (a chunk of the chunked LM head: the log-probabilities and the
    /// gradient in one launch): one block per row, as the forward.
    pub rows: XentLaunch,
}

/// The plan for logits of `dt` and targets of `targets`, or `None` where no kernel applies
/// (another type, an empty tensor, sizes past the kernels' 32-bit arguments).
pub fn xent_plan(rows: usize, cols: usize, dt: DType, targets: DType) -> Option<XentPlan> {
    let t = match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => return None,
    };
    let i = match targets {
        DType::U8 => "u8",
        DType::U32 => "u32",
        DType::I64 => "i64",
        _ => return None,
    };
    let fits = |v: usize| i32::try_from(v).is_ok();
    if rows == 0 || cols == 0 || !fits(rows) || !fits(rows.checked_mul(2)?) || !fits(rows.checked_mul(cols)?) {
        return None;
    }
    // Enough threads that each reads a few dozen logits at most (a vocabulary: 50 each).
    let block = match cols {
        0..=32 => 32,
        33..=1024 => 128,
        1025..=8192 => 512,
        _ => 1024,
    };
    let grid = u32::try_from(rows).ok()?;
    let row = |pass: &str| XentLaunch {
        kernel: format!("amp_xent_{pass}_{t}_{i}"),
        grid,
        block,
    };
    Some(XentPlan {
        forward: row("fwd"),
        mean: XentLaunch {
            kernel: "amp_xent_mean".into(),
            grid: 1,
            block: MEAN_BLOCK,
        },
        backward: row("bwd"),
        rows: row("rows"),
    })
}
