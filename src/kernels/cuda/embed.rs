//! The embedding lookup on CUDA, forward and backward, from `embed.cu`: the rows of an f32,
//! f16 or bf16 table `(vocab, width)` at u32 or i64 ids, and the table's gradient with each
//! row's contributions summed in f32, in the order of the ids, rounded once to the table's
//! type.
//!
//! Through candle's ops the lookup is `index_select`, whose backward is `index_add` in the
//! table's type: for a half table a token repeated across a batch has its gradient summed in
//! f16 or bf16 (bf16 keeps 8 bits; in f16 a few hundred repeats of a gradient scaled by the
//! initial loss scale 2^16 overflow). Here the backward kernel sums in f32 and rounds once;
//! the gradient still returns through candle's graph in the table's type (on CUDA there is no
//! f32 gradient stash; the device path widens it). The f32 sum is sequential in the ids'
//! order, so it equals candle's f32 `index_add` on the CPU bit for bit, and is the same on
//! every run (no atomics). Ids outside the table read nothing: an id equal to its type's
//! largest value gives a zero row and no gradient (candle's padding id), any other a NaN row
//! and no gradient (see `embed.cu`).
//!
//! Built and loaded as the softmax kernels are (see [`super::softmax`]): NVRTC at run time,
//! `get_or_load_custom_func` into candle's context, one warning per device and candle's ops
//! where that fails. The launch plan ([`embed_plan`]) is shared with the tests through
//! `candle_amp::testing`; they run the same `.cu` on the CPU grid emulator (`tests/cuda_emu`).

use super::type_name;
use candle_core::{DType, Result, Tensor};

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("embed.cu");

/// Threads per block of the forward.
const FWD_BLOCK: u32 = 256;
/// Threads per block of the backward at most: `AMP_EMBED_CHUNK` in `embed.cu`.
const BWD_BLOCK: u32 = 128;
/// Blocks at most: enough for several waves on the largest GPU (132 SMs of 2048 threads);
/// past it the grid-stride loops take several values (forward) or tiles (backward) a thread.
const MAX_GRID: u32 = 8192;
/// Threads the backward aims for (a full H100/H200: 132 SMs of 2048): the rows are cut into
/// as many tiles as it takes, so every SM has work even for a narrow table.
const TARGET_THREADS: usize = 132 * 2048;

/// Which way a lookup runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedPass {
    /// The rows at the ids.
    Forward,
    /// The table's gradient from the rows' gradients.
    Backward,
}

/// One launch of a lookup or of its backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedLaunch {
    /// The `extern "C"` kernel name, `amp_embed_{fwd|bwd}_{f32|f16|bf16}_{u32|i64}`.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block (the backward's column tile: a multiple of 32, at most 128).
    pub block: u32,
    /// Backward: the table's rows per row tile (forward: 0).
    pub rows_per_tile: u32,
    /// Backward: the row tiles, `vocab.div_ceil(rows_per_tile)` (forward: 0).
    pub row_tiles: u32,
}

fn id_name(d: DType) -> Option<&'static str> {
    match d {
        DType::U32 => Some("u32"),
        DType::I64 => Some("i64"),
        _ => None,
    }
}

/// The launch of one pass over `n` ids of `ids` type into a table of `vocab` rows of `width`
/// values of `table` type; `None` where no kernel applies (another table or id type, no ids,
/// an empty table, sizes past the kernels' 32-bit arguments: `n * width` and `vocab * width`
/// within `i32`).
pub fn embed_plan(
    pass: EmbedPass,
    n: usize,
    vocab: usize,
    width: usize,
    table: DType,
    ids: DType,
) -> Option<EmbedLaunch> {
    embed_plan_with(pass, n, vocab, width, table, ids, MAX_GRID)
}

/// [`embed_plan`] with at most `max_grid` blocks (at least one): the tests run the
/// grid-stride loops with a small grid.
pub fn embed_plan_with(
    pass: EmbedPass,
    n: usize,
    vocab: usize,
    width: usize,
    table: DType,
    ids: DType,
    max_grid: u32,
) -> Option<EmbedLaunch> {
    let (t, i) = (type_name(table)?, id_name(ids)?);
    let fits = |v: usize| i32::try_from(v).is_ok();
    if n == 0 || vocab == 0 || width == 0 || !fits(n.checked_mul(width)?) || !fits(vocab.checked_mul(width)?) {
        return None;
    }
    let cap = max_grid.clamp(1, MAX_GRID);
    Some(match pass {
        EmbedPass::Forward => EmbedLaunch {
            kernel: format!("amp_embed_fwd_{t}_{i}"),
            // At most MAX_GRID * FWD_BLOCK threads (2^21): k + stride stays within u32.
            grid: u32::try_from((n * width).div_ceil(FWD_BLOCK as usize))
                .ok()?
                .clamp(1, cap),
            block: FWD_BLOCK,
            rows_per_tile: 0,
            row_tiles: 0,
        },
        EmbedPass::Backward => {
            // A narrow table gets a block of its width (rounded up to a warp), so fewer
            // threads idle; the ids are staged a block's worth at a time.
            let block = (width.next_multiple_of(32) as u32).min(BWD_BLOCK);
            let col_tiles = width.div_ceil(block as usize);
            let wanted = TARGET_THREADS.div_ceil(col_tiles * block as usize).clamp(1, vocab);
            let rows_per_tile = vocab.div_ceil(wanted);
            let row_tiles = vocab.div_ceil(rows_per_tile);
            EmbedLaunch {
                kernel: format!("amp_embed_bwd_{t}_{i}"),
                grid: u32::try_from(row_tiles * col_tiles).ok()?.clamp(1, cap),
                block,
                rows_per_tile: u32::try_from(rows_per_tile).ok()?,
                row_tiles: u32::try_from(row_tiles).ok()?,
            }
        }
    })
}

/// The rows of `table` (`(vocab, width)`, f32, f16 or bf16) at `ids` (u32 or i64, any shape),
/// shaped `ids`' dimensions + `width`, in the table's type, as the kernels of `embed.cu`;
/// differentiable in the table (its gradient summed in f32 and returned in its type), none
/// for the ids. No id is read on the host: an out-of-range id gives a zero row (its type's
/// largest value) or a NaN row (any other), and no gradient. `Ok(None)` where they do not
/// apply (not CUDA, built without the `cuda` feature, other types, a table that is not 2-D,
/// an empty tensor, sizes past the plan, kernels that failed to load): the caller runs
/// `index_select`.
pub(crate) fn lookup(ids: &Tensor, table: &Tensor) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return device::lookup(ids, table);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ids, table);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use device::available;

#[cfg(feature = "cuda")]
#[path = "embed_device.rs"]
mod device;
