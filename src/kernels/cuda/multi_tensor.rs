//! The optimizer side on CUDA in one launch over all parameters, from `multi_tensor.cu`
//! (Apex's `multi_tensor_apply`, PyTorch's fused AdamW): the device path's unscale and finite
//! check of every master gradient, and the AdamW and SGD updates with f32 masters, each one
//! kernel launch (per size cap, see [`MtLimits`]) instead of several candle ops per parameter.
//!
//! **Tables.** Each kernel reads a table of [`MtRecord`]s in device memory, one per tensor:
//! raw device pointers, the length, the record's first block, the types and the per-tensor
//! constants. Each block takes one chunk of [`MtLimits::chunk`] values of one tensor; a block
//! finds its record by a binary search over the first blocks. The table is built on the host
//! per launch and uploaded with one host-to-device copy (not cached: the master gradients and
//! moments are new buffers each step, so their pointers change anyway; the copy is a few KiB).
//!
//! **What each kernel computes** (the device path's arithmetic, bit for bit: the same f32
//! operations in the same order as the candle tensor ops of `unscale_tensor`, `AdamW::update`
//! and `Sgd::update`, each rounded on its own, with the f64 hyper-parameters rounded to f32 as
//! candle's `affine` rounds its scalars):
//! - `amp_mt_unscale_check`: `out = [acc +] unscale(raw)` into a fresh f32 buffer per tensor,
//!   and one f32 flag per tensor in one zeroed device buffer: NaN where a value written is inf
//!   or NaN, 0 otherwise, what `device::flag` (`sum(g * 0)`) gives and `read_flags` reads. The
//!   scale comes by value (the host decides it; [`MtUnscale::new`] picks the arithmetic as the
//!   CPU path does).
//! - `amp_mt_adamw`: the f32 master updated in place, new moments written into fresh buffers
//!   (the tensor path replaces its moments each step, and a snapshot taken before the step
//!   shares the old ones), the half working copy written from the new master in the same pass.
//! - `amp_mt_sgd`: likewise, with the momentum buffer (absent before the first step: it then
//!   starts as the step's direction, PyTorch's rule).
//!
//! A skipped step launches nothing: the host knows the verdict before it steps.
//!
//! The launch plan ([`mt_plan`]) is shared with the tests (through `candle_amp::testing`),
//! which run the same `.cu` on the CPU grid emulator (`tests/cuda_emu`) with arena offsets in
//! place of device pointers.

use candle_core::DType;

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("multi_tensor.cu");

/// Words (u64) per record (`AMP_MT_RECORD` in the source).
pub const RECORD_WORDS: usize = 16;
const N: usize = 7;
const FIRST: usize = 8;
const TYPE: usize = 9;

/// Which kernel a table is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MtKernel {
    /// `amp_mt_unscale_check`.
    UnscaleCheck,
    /// `amp_mt_adamw`.
    AdamW,
    /// `amp_mt_sgd`.
    Sgd,
}

impl MtKernel {
    /// The `extern "C"` kernel name.
    pub fn name(self) -> &'static str {
        match self {
            MtKernel::UnscaleCheck => "amp_mt_unscale_check",
            MtKernel::AdamW => "amp_mt_adamw",
            MtKernel::Sgd => "amp_mt_sgd",
        }
    }

    /// The record words that hold device pointers (0 in one of them: none).
    pub fn pointer_words(self) -> &'static [usize] {
        match self {
            MtKernel::UnscaleCheck => &[0, 1, 2],
            MtKernel::AdamW => &[0, 1, 2, 3, 4, 5, 6],
            MtKernel::Sgd => &[0, 1, 2, 3, 6],
        }
    }
}

/// The code of a value type in a record (f32 0, f16 1, bf16 2), `None` for the others.
pub fn type_code(dt: DType) -> Option<u64> {
    match dt {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

/// Two f32 values in one word: `lo` in the low half.
fn pair(lo: f32, hi: f32) -> u64 {
    u64::from(lo.to_bits()) | (u64::from(hi.to_bits()) << 32)
}

/// How the unscale kernel unscales (`mode`, `inv`, `div` of `AMP_MT_UNSCALE_ARGS`): the CPU
/// path's rule (`kernels::slices::Unscale`): `g * (1/scale)` in f32 while the inverse is a
/// finite f32, `g / scale` in f64 below that, and nothing at a scale of 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MtUnscale {
    /// 0: identity, 1: `g * inv`, 2: `(float)((double)g / div)`.
    pub mode: i32,
    /// The f32 inverse of the scale.
    pub inv: f32,
    /// The scale, for mode 2.
    pub div: f64,
}

impl MtUnscale {
    /// The arithmetic for `scale`.
    pub fn new(scale: f32) -> Self {
        let inv = (1.0f64 / scale as f64) as f32;
        let mode = if inv == 1.0 {
            0
        } else if inv.is_finite() {
            1
        } else {
            2
        };
        Self {
            mode,
            inv,
            div: scale as f64,
        }
    }
}

/// AdamW's per-tensor constants as the device path rounds them (f64 to f32).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MtAdamW {
    /// `beta1`, `1 - beta1`.
    pub b1: (f32, f32),
    /// `beta2`, `1 - beta2`.
    pub b2: (f32, f32),
    /// `1/(1 - beta1^t)`, `1/(1 - beta2^t)`.
    pub inv_bc: (f32, f32),
    /// `1 - lr*wd`.
    pub decay: f32,
    /// The learning rate.
    pub lr: f32,
    /// The denominator's epsilon.
    pub eps: f32,
}

impl MtAdamW {
    /// The constants of step `t` (1 at the first step) of a parameter.
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, t: u64) -> Self {
        let t = t as f64;
        Self {
            b1: (beta1 as f32, (1.0 - beta1) as f32),
            b2: (beta2 as f32, (1.0 - beta2) as f32),
            inv_bc: (
                (1.0 / (1.0 - beta1.powf(t))) as f32,
                (1.0 / (1.0 - beta2.powf(t))) as f32,
            ),
            decay: (1f64 - lr * weight_decay) as f32,
            lr: lr as f32,
            eps: eps as f32,
        }
    }
}

/// SGD's per-tensor constants (f64 rounded to f32, as the device path's `affine` does).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MtSgd {
    /// The learning rate.
    pub lr: f32,
    /// L2 weight decay (0: none added).
    pub weight_decay: f32,
    /// The momentum factor.
    pub momentum: f32,
    /// `1 - dampening`.
    pub one_minus_dampening: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl MtSgd {
    /// The constants from the f64 settings.
    pub fn new(lr: f64, weight_decay: f64, momentum: f64, dampening: f64, nesterov: bool) -> Self {
        Self {
            lr: lr as f32,
            weight_decay: weight_decay as f32,
            momentum: momentum as f32,
            one_minus_dampening: (1.0 - dampening) as f32,
            nesterov,
        }
    }
}

/// One tensor's record: the words its kernel reads (layouts in `multi_tensor.cu`). Pointer
/// words hold device addresses (the emulator's tests: arena offsets plus one). The first block
/// is filled in by [`mt_plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MtRecord {
    /// The record's words.
    pub words: [u64; RECORD_WORDS],
}

impl MtRecord {
    /// The values in the tensor.
    pub fn len(&self) -> u64 {
        self.words[N]
    }

    /// Whether the tensor is empty (the plan skips it).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An unscale record: `n` values of `raw` (of type code `raw_type`), `acc` (0: none) added,
    /// into `out`, the flag at `flag` of the launch's flag buffer.
    pub fn unscale(raw: u64, raw_type: u64, acc: u64, out: u64, n: u64, flag: u64) -> Self {
        let mut w = [0u64; RECORD_WORDS];
        (w[0], w[1], w[2], w[N], w[TYPE], w[10]) = (raw, acc, out, n, raw_type, flag);
        Self { words: w }
    }

    /// An AdamW record: `param` and `grad` f32, the moments read from `m_in`/`v_in` (0: zeros)
    /// and written to `m_out`/`v_out`, the working copy `working` (0: none) of type code
    /// `working_type`.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        param: u64,
        grad: u64,
        (m_in, v_in): (u64, u64),
        (m_out, v_out): (u64, u64),
        working: u64,
        working_type: u64,
        n: u64,
        c: &MtAdamW,
    ) -> Self {
        let mut w = [0u64; RECORD_WORDS];
        (w[0], w[1], w[2], w[3], w[4], w[5], w[6]) = (param, grad, m_in, v_in, m_out, v_out, working);
        (w[N], w[TYPE]) = (n, working_type);
        w[10] = pair(c.b1.0, c.b1.1);
        w[11] = pair(c.b2.0, c.b2.1);
        w[12] = pair(c.inv_bc.0, c.inv_bc.1);
        w[13] = pair(c.decay, c.lr);
        w[14] = pair(c.eps, 0.0);
        Self { words: w }
    }

    /// An SGD record: `param` and `grad` f32, the momentum buffer read from `buf_in` (0: the
    /// first step) and written to `buf_out` (0: no momentum), the working copy as for AdamW.
    #[allow(clippy::too_many_arguments)]
    pub fn sgd(
        param: u64,
        grad: u64,
        buf_in: u64,
        buf_out: u64,
        working: u64,
        working_type: u64,
        n: u64,
        c: &MtSgd,
    ) -> Self {
        let mut w = [0u64; RECORD_WORDS];
        (w[0], w[1], w[2], w[3], w[6]) = (param, grad, buf_in, buf_out, working);
        (w[N], w[TYPE]) = (n, working_type);
        w[10] = pair(c.lr, c.weight_decay);
        w[11] = pair(c.momentum, c.one_minus_dampening);
        w[12] = u64::from(c.nesterov);
        Self { words: w }
    }
}

/// The launch shape and the size caps past which a list is split over several launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MtLimits {
    /// Values per block (each thread a strided share: 32 at the defaults).
    pub chunk: u64,
    /// Threads per block (a multiple of 32, at most 1024).
    pub block: u32,
    /// Records per launch (the table's size: 128 KiB at the default).
    pub max_tensors: usize,
    /// Blocks per launch (far below CUDA's 2^31 - 1).
    pub max_blocks: u64,
}

impl Default for MtLimits {
    fn default() -> Self {
        Self {
            chunk: 16384,
            block: 512,
            max_tensors: 1024,
            max_blocks: 1 << 24,
        }
    }
}

/// One launch: the kernel, its grid and block, the chunk, and its table (records back to back,
/// first blocks filled in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MtLaunch {
    /// The kernel.
    pub kernel: MtKernel,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Values per block.
    pub chunk: u64,
    /// Records in the table.
    pub count: u32,
    /// The table's words: `count` records of [`RECORD_WORDS`].
    pub table: Vec<u64>,
}

/// The launches over `records` with the default limits (see [`mt_plan_with`]).
pub fn mt_plan(kernel: MtKernel, records: Vec<MtRecord>) -> Vec<MtLaunch> {
    mt_plan_with(kernel, records, MtLimits::default())
}

/// The launches over `records` in order, empty tensors skipped, each launch at most
/// `limits.max_tensors` records and `limits.max_blocks` blocks: a tensor that does not fit in
/// the current launch starts the next. A tensor of more than `max_blocks` chunks, or a zero
/// limit, gives no launches at all (the caller keeps its composed ops).
pub fn mt_plan_with(kernel: MtKernel, records: Vec<MtRecord>, limits: MtLimits) -> Vec<MtLaunch> {
    // The grid is a u32 (CUDA's limit is 2^31 - 1 blocks).
    let max_blocks = limits.max_blocks.min(i32::MAX as u64);
    if limits.chunk == 0 || limits.block == 0 || limits.max_tensors == 0 || max_blocks == 0 {
        return Vec::new();
    }
    let mut launches = Vec::new();
    let mut table: Vec<u64> = Vec::new();
    let (mut count, mut blocks) = (0usize, 0u64);
    let mut flush = |table: &mut Vec<u64>, count: &mut usize, blocks: &mut u64| {
        if *count > 0 {
            launches.push(MtLaunch {
                kernel,
                grid: *blocks as u32,
                block: limits.block,
                chunk: limits.chunk,
                count: *count as u32,
                table: std::mem::take(table),
            });
        }
        (*count, *blocks) = (0, 0);
    };
    for mut r in records {
        if r.is_empty() {
            continue;
        }
        let need = r.len().div_ceil(limits.chunk);
        if need > max_blocks {
            return Vec::new();
        }
        if count == limits.max_tensors || blocks + need > max_blocks {
            flush(&mut table, &mut count, &mut blocks);
        }
        r.words[FIRST] = blocks;
        table.extend_from_slice(&r.words);
        count += 1;
        blocks += need;
    }
    flush(&mut table, &mut count, &mut blocks);
    launches
}

#[cfg(feature = "cuda")]
pub(crate) use device::{StepItem, adamw_step, available, sgd_step, unscale_check};

#[cfg(feature = "cuda")]
#[path = "multi_tensor_device.rs"]
mod device;
