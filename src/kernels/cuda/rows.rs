//! Row kernels on CUDA, from `rows.cu`: a linear layer's bias + GELU and the residual add
//! fused with its cast, each one pass where candle runs several generic kernels.
//!
//! * **Bias + GELU** (`y = gelu(h + bias)`, the erf form of candle's `gelu_erf` and PyTorch's
//!   default, or the tanh form of candle's `gelu` and PyTorch's `approximate="tanh"`): on
//!   CUDA a linear layer with a bias and GELU was `broadcast_add` and `gelu_erf` (or `gelu`)
//!   forward, and their backwards (about six kernels for GELU's, a sum for the bias) after
//!   it. Here the product runs without its bias and one kernel adds the bias and applies
//!   GELU, in f32 arithmetic; the pre-activation is rounded to the product's type where the
//!   bias has that type too, as the unfused layer's output is, so the values are the unfused
//!   path's up to GELU's own f32 rounding. The output is in the product's type, or f32 where
//!   autocast runs GELU in f32 (its Float list). The backward writes `dh = dy * gelu'(h + b)`
//!   in the product's type and, in the same pass, each chunk of rows' column sums of it in
//!   f32; a second kernel adds the chunks in order into the bias's gradient, in the bias's
//!   type. No atomics: the bias gradient is the same on every run.
//! * **Add with promotion** (`ops::add`): at O1 an f32 residual plus a half body output was a
//!   cast kernel and an add kernel (and their backwards). Here one kernel reads both in their
//!   own types and writes the promoted type (f32 where the types differ, f16 + bf16
//!   included, as PyTorch promotes), for operands of one shape or a bias-like one row (`b`
//!   of shape `(n)`, or `(1, .., n)`) broadcast over the other's rows. The backward is the
//!   output gradient cast to each operand's type; a broadcast operand's is its column sums
//!   in f32, in the same fixed order as the bias's, rounded once.
//!
//! Built and loaded as the softmax kernels are (see [`super::softmax`]): NVRTC at run time,
//! `get_or_load_custom_func` into candle's context, one warning per device and the composed
//! ops where that fails. The launch plan (this module's functions) is shared with the tests
//! through `candle_amp::testing`; they run the same `.cu` on the CPU grid emulator
//! (`tests/cuda_emu`).

use super::type_name;
use candle_core::{DType, Result, Tensor};

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("rows.cu");

/// Threads per block of the tiled kernels (one per column), at most.
const BLOCK: usize = 256;
/// Rows per chunk, at least: each thread's loop amortises its column's setup.
const MIN_CHUNK_ROWS: usize = 32;
/// Blocks to aim for (a few per SM of a large GPU), when the rows allow.
const TARGET_BLOCKS: usize = 1024;

/// One launch: the kernel's name and its one-dimensional grid and block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowsLaunch {
    /// The `extern "C"` kernel name.
    pub kernel: String,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

/// How the tiled kernels split `rows` rows of `cols` values: block
/// `chunk * col_tiles + tile` takes the rows of one chunk and the columns of one tile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tiles {
    /// Rows as launched (1 for an add of one shape: the values as one row).
    pub rows: usize,
    /// Columns as launched.
    pub cols: usize,
    /// Rows per chunk (the last chunk may have fewer).
    pub rows_per_chunk: usize,
    /// Chunks of rows (the column sums' scratch buffer holds `chunks * cols` f32 values).
    pub chunks: usize,
    /// Column tiles.
    pub col_tiles: usize,
}

/// The launches of one bias + GELU over `rows` rows of `cols` values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BiasGeluPlan {
    /// `amp_bias_gelu_fwd_{h}_{b}_{y}` (the tanh form: `amp_bias_gelu_tanh_fwd_...`).
    pub forward: RowsLaunch,
    /// `amp_bias_gelu_bwd_{h}_{b}_{y}` (`amp_bias_gelu_tanh_bwd_...`): `dh` and the chunks'
    /// column sums.
    pub backward: RowsLaunch,
    /// `amp_colsum_sum_{b}`: the bias gradient from the column sums.
    pub sum: RowsLaunch,
    /// The split of the rows and columns.
    pub tiles: Tiles,
}

/// The launch of one add (and, for a broadcast operand, of its gradient's column sums).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddPlan {
    /// `amp_add_{a}_{b}_{o}`.
    pub forward: RowsLaunch,
    /// Whether `b` is one row broadcast over `a`'s rows.
    pub bcast: bool,
    /// The split of the rows and columns.
    pub tiles: Tiles,
}

/// The launches of column sums of `g` (rows, cols) into `cols` values of the output type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColSumPlan {
    /// `amp_colsum_part_{g}`: each chunk's column sums.
    pub part: RowsLaunch,
    /// `amp_colsum_sum_{o}`: the chunks in order.
    pub sum: RowsLaunch,
    /// The split of the rows and columns.
    pub tiles: Tiles,
}

/// The split of `rows` x `cols` with its tiled launch of `kernel`, or `None` where no kernel
/// applies (an empty tensor, sizes past the kernels' 32-bit arguments). A function of the
/// shape alone, so the column sums add in the same order on every run and every GPU.
fn tiled(kernel: String, rows: usize, cols: usize) -> Option<(RowsLaunch, Tiles)> {
    let fits = |v: usize| i32::try_from(v).is_ok();
    if rows == 0 || cols == 0 || !fits(rows) || !fits(rows.checked_mul(cols)?) {
        return None;
    }
    let col_tiles = cols.div_ceil(BLOCK);
    let want_chunks = (TARGET_BLOCKS / col_tiles).max(1);
    let rows_per_chunk = rows.div_ceil(want_chunks).max(MIN_CHUNK_ROWS);
    let chunks = rows.div_ceil(rows_per_chunk);
    // The scratch buffer's indices and the grid fit too.
    if !fits(chunks.checked_mul(cols)?) {
        return None;
    }
    let launch = RowsLaunch {
        kernel,
        grid: u32::try_from(chunks.checked_mul(col_tiles)?).ok()?,
        block: BLOCK.min(cols.div_ceil(32) * 32) as u32,
    };
    let tiles = Tiles {
        rows,
        cols,
        rows_per_chunk,
        chunks,
        col_tiles,
    };
    Some((launch, tiles))
}

/// `amp_colsum_sum_{o}` over `cols` columns: one thread per column.
fn sum_launch(cols: usize, out: DType) -> Option<RowsLaunch> {
    Some(RowsLaunch {
        kernel: format!("amp_colsum_sum_{}", type_name(out)?),
        grid: u32::try_from(cols.div_ceil(BLOCK)).ok()?,
        block: BLOCK as u32,
    })
}

/// The plan of bias + GELU over `h` (`rows` x `cols` of `h_dt`) and a bias of `bias_dt` (`h_dt`
/// or f32) into `y_dt` (`h_dt` or f32), or `None` where no kernel applies (another type, an
/// empty tensor, sizes past the kernels' 32-bit arguments).
pub fn bias_gelu_plan(rows: usize, cols: usize, h_dt: DType, bias_dt: DType, y_dt: DType) -> Option<BiasGeluPlan> {
    form_plan("gelu", rows, cols, h_dt, bias_dt, y_dt)
}

/// [`bias_gelu_plan`] for GELU's tanh form (`amp_bias_gelu_tanh_*` kernels).
pub fn bias_gelu_tanh_plan(rows: usize, cols: usize, h_dt: DType, bias_dt: DType, y_dt: DType) -> Option<BiasGeluPlan> {
    form_plan("gelu_tanh", rows, cols, h_dt, bias_dt, y_dt)
}

/// The plan of bias + GELU in the form the kernel names' `form` part says.
fn form_plan(form: &str, rows: usize, cols: usize, h_dt: DType, bias_dt: DType, y_dt: DType) -> Option<BiasGeluPlan> {
    let (h, b, y) = (type_name(h_dt)?, type_name(bias_dt)?, type_name(y_dt)?);
    if !(bias_dt == h_dt || bias_dt == DType::F32) || !(y_dt == h_dt || y_dt == DType::F32) {
        return None;
    }
    let (forward, tiles) = tiled(format!("amp_bias_{form}_fwd_{h}_{b}_{y}"), rows, cols)?;
    let backward = RowsLaunch {
        kernel: format!("amp_bias_{form}_bwd_{h}_{b}_{y}"),
        ..forward.clone()
    };
    Some(BiasGeluPlan {
        forward,
        backward,
        sum: sum_launch(cols, bias_dt)?,
        tiles,
    })
}

/// The type an add of `a` and `b` gives (PyTorch's promotion over f32, f16 and bf16): their
/// type where they share it, else f32.
pub fn promoted(a: DType, b: DType) -> DType {
    if a == b { a } else { DType::F32 }
}

/// The plan of `a + b` into `out` (the promoted type, or f32 where autocast computes in
/// f32): `rows` x `cols` values, `b` of the same shape or (`bcast`) one row of `cols`. `None`
/// where no kernel applies (another type or output type, an empty tensor, sizes past the
/// kernels' 32-bit arguments).
pub fn add_plan(rows: usize, cols: usize, bcast: bool, a: DType, b: DType, out: DType) -> Option<AddPlan> {
    let (na, nb, no) = (type_name(a)?, type_name(b)?, type_name(out)?);
    if out != promoted(a, b) && out != DType::F32 {
        return None;
    }
    let kernel = format!("amp_add_{na}_{nb}_{no}");
    // One shape: the values as one row (each thread one value, no row loop to amortise).
    let (forward, tiles) = if bcast {
        tiled(kernel, rows, cols)?
    } else {
        tiled(kernel, 1, rows.checked_mul(cols)?)?
    };
    Some(AddPlan { forward, bcast, tiles })
}

/// The plan of the column sums of `g` (`rows` x `cols` of `g_dt`), in f32, into `out`.
pub fn colsum_plan(rows: usize, cols: usize, g_dt: DType, out: DType) -> Option<ColSumPlan> {
    let (part, tiles) = tiled(format!("amp_colsum_part_{}", type_name(g_dt)?), rows, cols)?;
    Some(ColSumPlan {
        part,
        sum: sum_launch(cols, out)?,
        tiles,
    })
}

/// `gelu(h + bias)` over the last dimension of `h` (`bias` of shape `(n)`, in `h`'s type or
/// f32) into `out` (`h`'s type or f32), GELU in the tanh form where `tanh`, else the erf form,
/// differentiable, as the kernels of `rows.cu`; `Ok(None)` where they do not apply (not CUDA,
/// built without the `cuda` feature, other types or shapes, an empty tensor, kernels that
/// failed to load): the caller runs the composed ops.
pub(crate) fn bias_gelu(h: &Tensor, bias: &Tensor, out: DType, tanh: bool) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return device::bias_gelu(h, bias, out, tanh);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (h, bias, out, tanh);
        Ok(None)
    }
}

/// `a + b` into `out` (the promoted type, or f32 under autocast's f32 policy), differentiable,
/// as one kernel of `rows.cu` for operands of one shape or a bias-like one (`(n)`, `(1, .., n)`)
/// broadcast over the other's rows; `Ok(None)` where it does not apply (not CUDA, built
/// without the `cuda` feature, other types or shapes, an empty tensor, kernels that failed to
/// load): the caller runs the composed ops.
pub(crate) fn add_cast(a: &Tensor, b: &Tensor, out: DType) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return device::add_cast(a, b, out);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, b, out);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use device::available;

#[cfg(feature = "cuda")]
#[path = "rows_device.rs"]
mod device;
