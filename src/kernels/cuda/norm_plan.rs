//! The launch plan of `norm.cu`'s kernels (kept free of the crate's other items: the tests
//! include this file to launch the emulator exactly as the library launches the GPU).

use candle_core::DType;

/// Rows per block of the one-warp-per-row kernels (four warps: 128 threads).
const ROWS_PER_BLOCK: usize = 4;
/// Threads per block of the parameter-gradient kernels (one per column).
const WB_BLOCK: usize = 256;
/// Rows per chunk of the parameter-gradient partial sums, at least.
const MIN_CHUNK_ROWS: usize = 32;
/// Blocks of the partial-sum kernel to aim for (a few per SM of a large GPU).
const WB_BLOCKS: usize = 1024;

/// One launch: the kernel's name and its one-dimensional grid and block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormLaunch {
    /// The `extern "C"` kernel name.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

/// The launches of one norm over `rows` rows of `cols` values of `dt`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormPlan {
    /// `amp_norm_fwd_{t}`.
    pub forward: NormLaunch,
    /// `amp_norm_dx_{t}`.
    pub dx: NormLaunch,
    /// `amp_norm_wb_part_{t}`.
    pub wb_part: NormLaunch,
    /// `amp_norm_wb_sum`.
    pub wb_sum: NormLaunch,
    /// Rows per chunk of the partial sums.
    pub rows_per_chunk: usize,
    /// Chunks (the scratch buffer holds `chunks * 2 * cols` f32 values).
    pub chunks: usize,
    /// Column tiles of `wb_part`'s block.
    pub col_tiles: usize,
}

/// The plan, or `None` where no kernel applies (another type, an empty tensor, sizes past the
/// kernels' 32-bit arguments).
pub fn norm_plan(rows: usize, cols: usize, dt: DType) -> Option<NormPlan> {
    let t = match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => return None,
    };
    let fits = |v: usize| i32::try_from(v).is_ok();
    if rows == 0 || cols == 0 || !fits(rows) || !fits(rows.checked_mul(cols)?) || !fits(cols.checked_mul(2)?) {
        return None;
    }
    let warp_grid = u32::try_from(rows.div_ceil(ROWS_PER_BLOCK)).ok()?;
    let col_tiles = cols.div_ceil(WB_BLOCK);
    // Enough chunks to fill the GPU, each at least MIN_CHUNK_ROWS rows (a deterministic
    // function of the shape alone).
    let want_chunks = (WB_BLOCKS / col_tiles).max(1);
    let rows_per_chunk = rows.div_ceil(want_chunks).max(MIN_CHUNK_ROWS);
    let chunks = rows.div_ceil(rows_per_chunk);
    let block = |kernel: String, grid: usize, block: usize| -> Option<NormLaunch> {
        Some(NormLaunch {
            kernel,
            grid: u32::try_from(grid).ok()?,
            block: block as u32,
        })
    };
    let wb_block = WB_BLOCK.min(cols.div_ceil(32) * 32);
    Some(NormPlan {
        forward: block(format!("amp_norm_fwd_{t}"), warp_grid as usize, 32 * ROWS_PER_BLOCK)?,
        dx: block(format!("amp_norm_dx_{t}"), warp_grid as usize, 32 * ROWS_PER_BLOCK)?,
        wb_part: block(format!("amp_norm_wb_part_{t}"), chunks * col_tiles, wb_block)?,
        wb_sum: block("amp_norm_wb_sum".into(), (2 * cols).div_ceil(WB_BLOCK), WB_BLOCK)?,
        rows_per_chunk,
        chunks,
        col_tiles,
    })
}
