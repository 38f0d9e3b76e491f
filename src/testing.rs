//! Hooks for the crate's own tests, hidden from the documentation: not part of the API.

use candle_core::Tensor;

use crate::amp::Amp;
use crate::error::Result;
use crate::train::optim::AmpOptimizer;

/// Every buffer a run keeps between calls, named: each parameter's working Var and f32
/// master, the cast cache's casts, and each optimizer's master gradients, spare
/// master-gradient buffers and algorithm state. Tests check that no two of them share
/// storage (candle's `clone`, `detach` and same-type `to_dtype` share it), since the
/// library writes most of them in place: see [`storage_key`](crate::kernels::storage_key).
pub fn live_buffers(amp: &Amp, optimizers: &[&AmpOptimizer]) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for p in amp.store().params() {
        out.push((format!("working.{}", p.name()), p.working().clone()));
        if let Some(m) = p.master() {
            out.push((format!("master.{}", p.name()), m.clone()));
        }
    }
    for (i, c) in amp.run.casts.cached_casts().into_iter().enumerate() {
        out.push((format!("cast_cache.{i}"), c));
    }
    for o in optimizers {
        out.extend(o.kept_buffers()?);
    }
    Ok(out)
}

/// A linear layer's backward (`x` m x k, `w` n x k, `b`, output gradient `g` m x n, on the
/// CPU) computed both ways: with `g` widened to f32 once for its three uses, and with each
/// product and the bias's column sums widening it themselves. Each as `[dw, db, dx]` (`db`
/// left out without a bias; `dx` in f32 when `wide`, else in `x`'s type); `None` where the
/// widened path does not apply (f32, bf16 on a tier with bf16 dot products). For the test
/// that the two agree bit for bit.
pub fn linear_backward_both_ways(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    g: &Tensor,
    wide: bool,
) -> Result<Option<[Vec<Tensor>; 2]>> {
    Ok(crate::kernels::wgrad::backward_both_ways(x, w, b, g, wide)?)
}

/// How many backwards have stashed parameter gradients (those of the run's fused layers and
/// checkpointed segments) that no call has taken yet: tests check that it stays bounded
/// over a training loop and that `zero_grad` empties it.
pub fn waiting_backwards(amp: &Amp) -> usize {
    amp.run.stash().waiting_backwards()
}

/// Makes the public ops on this thread treat CPU tensors as a GPU's for empty inputs: an op
/// with an empty input runs on host copies and moves its result back, as it does on CUDA
/// (where candle's kernels refuse empty launches). CI runs the shapes property test this
/// way, so the guards' argument handling is checked on machines without a GPU.
pub fn emulate_empty_device(on: bool) {
    crate::precision::empty::emulate_device(on);
}

/// The launch the CUDA softmax kernels (`src/kernels/cuda/softmax.cu`) get for `rows` rows of
/// `cols` values, `input` in and `out` out: `(kernel name, grid, block)`, or `None` where the
/// composed ops run instead. The tests run the same plan on the CPU grid emulator.
pub fn cuda_softmax_launch(
    backward: bool,
    rows: usize,
    cols: usize,
    input: candle_core::DType,
    out: candle_core::DType,
) -> Option<(String, u32, u32)> {
    use crate::kernels::cuda::softmax::{Pass, plan};
    let pass = if backward { Pass::Backward } else { Pass::Forward };
    plan(pass, rows, cols, input, out).map(|l| (l.kernel, l.grid, l.block))
}

/// Whether the CUDA softmax kernels are compiled and loaded on `device` (compiling and loading
/// them if not yet): false off CUDA, without the `cuda` feature, or where they failed to load.
pub fn cuda_softmax_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::softmax::available(d);
    }
    let _ = device;
    false
}

/// The launches of the CUDA attention kernels (`src/kernels/cuda/flash.cu`) for `bh` (batch
/// x heads) matrices of `t` rows of head dimension `d` of `dt`: forward, `Delta`, dK/dV and dQ,
/// each `(kernel name, grid, block)`, or `None` where the composed ops run instead (`d` not a
/// multiple of 8 from 8 to 128, among others; the names hold the kernels' own head dimension,
/// the smallest of 32, 48, 64, 80, 96 and 128 at least `d`, and `d` is their argument). `small`
/// forces the small (`Some(true)`) or the large tile of the FMA kernels; `None` lets the plan
/// choose, as on a device with (`tensor_cores`, compute capability 8.0+) or without tensor
/// cores: the tensor-core kernels for f16 and bf16 there. The tests run the same plan on the
/// CPU grid emulator.
pub fn cuda_flash_launches(
    bh: usize,
    t: usize,
    d: usize,
    dt: candle_core::DType,
    small: Option<bool>,
    tensor_cores: bool,
) -> Option<[(String, u32, u32); 4]> {
    cuda_flash_launches_grouped(bh, 1, t, d, dt, small, tensor_cores)
}

/// [`cuda_flash_launches`] for grouped-query attention: `bh` query matrices, each `group` of
/// them reading one key/value matrix (the dK/dV pass has a block per key/value matrix and key
/// tile); `None` also where `group` is 0 or does not divide `bh`.
pub fn cuda_flash_launches_grouped(
    bh: usize,
    group: usize,
    t: usize,
    d: usize,
    dt: candle_core::DType,
    small: Option<bool>,
    tensor_cores: bool,
) -> Option<[(String, u32, u32); 4]> {
    use crate::kernels::cuda::flash::{Tiles, flash_plan};
    let which = small.map(|s| if s { Tiles::Small } else { Tiles::Large });
    let p = flash_plan(bh, group, t, d, dt, which, tensor_cores)?;
    Some([p.forward, p.pre, p.dkv, p.dq].map(|l| (l.kernel, l.grid, l.block)))
}

/// Whether the CUDA attention kernels (`src/kernels/cuda/flash.cu`) are compiled and loaded
/// on `device` (compiling and loading them if not yet): false off CUDA, without the `cuda`
/// feature, or where they failed to load.
pub fn cuda_flash_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::flash::available(d);
    }
    let _ = device;
    false
}

/// `None` where `device` cannot run the tensor-core attention kernels
/// (`src/kernels/cuda/flash_mma.cu`: off CUDA, without the `cuda` feature, compute capability
/// below 8.0), else whether they are compiled and loaded (compiling and loading them if not
/// yet): on such a device f16 and bf16 attention runs on them.
pub fn cuda_flash_tensor_cores(device: &candle_core::Device) -> Option<bool> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::flash::tensor_cores_loaded(d);
    }
    let _ = device;
    None
}

/// Whether the CUDA norm kernels (`src/kernels/cuda/norm.cu`) are compiled and loaded on
/// `device` (compiling and loading them if not yet): false off CUDA, without the `cuda`
/// feature, or where they failed to load.
pub fn cuda_norm_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::norm::available(d);
    }
    let _ = device;
    false
}

/// Whether the CUDA cross-entropy kernels (`src/kernels/cuda/xent.cu`) are compiled and loaded
/// on `device` (compiling and loading them if not yet): false off CUDA, without the `cuda`
/// feature, or where they failed to load.
pub fn cuda_xent_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::xent::available(d);
    }
    let _ = device;
    false
}

/// The CUDA multi-tensor kernels' launch plan and records (`src/kernels/cuda/multi_tensor.rs`):
/// what the library builds for the optimizer's one-launch unscale and AdamW/SGD steps. The
/// tests build tables with the same functions (arena offsets in place of device pointers) and
/// run them on the CPU grid emulator.
pub mod cuda_multi_tensor {
    pub use crate::kernels::cuda::multi_tensor::{
        MtAdamW, MtKernel, MtLaunch, MtLimits, MtRecord, MtSgd, MtUnscale, RECORD_WORDS, mt_plan, mt_plan_with,
        type_code,
    };
}

/// Whether the CUDA multi-tensor kernels (`src/kernels/cuda/multi_tensor.cu`) are compiled and
/// loaded on `device` (compiling and loading them if not yet): false off CUDA, without the
/// `cuda` feature, or where they failed to load.
pub fn cuda_multi_tensor_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::multi_tensor::available(d);
    }
    let _ = device;
    false
}

/// The CUDA row kernels' launch plans (`src/kernels/cuda/rows.rs`): bias + GELU, the add of
/// two float types and its broadcast operand's column sums. The tests run the same plans on
/// the CPU grid emulator.
pub mod cuda_rows {
    pub use crate::kernels::cuda::rows::{
        AddPlan, BiasGeluPlan, ColSumPlan, RowsLaunch, Tiles, add_plan, bias_gelu_plan, bias_gelu_tanh_plan,
        colsum_plan, promoted,
    };
}

/// Whether the CUDA row kernels (`src/kernels/cuda/rows.cu`) are compiled and loaded on
/// `device` (compiling and loading them if not yet): false off CUDA, without the `cuda`
/// feature, or where they failed to load.
pub fn cuda_rows_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::rows::available(d);
    }
    let _ = device;
    false
}

/// The CUDA pointwise kernels' launch plans (`src/kernels/cuda/gated.rs`): a gated MLP's
/// product `act(g) * u` and an activation alone, forward and backward. The tests run the same
/// plans on the CPU grid emulator.
pub mod cuda_gated {
    pub use crate::kernels::cuda::gated::{ActPlan, GatedPlan, PointAct, PointLaunch, act_plan, gated_plan};
}

/// Whether the CUDA pointwise kernels (`src/kernels/cuda/gated.cu`) are compiled and loaded on
/// `device` (compiling and loading them if not yet): false off CUDA, without the `cuda`
/// feature, or where they failed to load.
pub fn cuda_gated_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::gated::available(d);
    }
    let _ = device;
    false
}

/// The CUDA rotary embedding's launch plan (`src/kernels/cuda/rope.rs`): one kernel each way
/// per table layout and type. The tests run the same plan on the CPU grid emulator.
pub mod cuda_rope {
    pub use crate::kernels::cuda::rope::{RopeLaunch, RopePass, rope_plan, rope_plan_with};
}

/// Whether the CUDA rotary-embedding kernels (`src/kernels/cuda/rope.cu`) are compiled and
/// loaded on `device` (compiling and loading them if not yet): false off CUDA, without the
/// `cuda` feature, or where they failed to load.
pub fn cuda_rope_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::rope::available(d);
    }
    let _ = device;
    false
}

/// `x` `(b, h, t, d)` rotated by the f32 tables `cos`, `sin` (`(t or more, d)` or `(t or more,
/// d / 2)`) with the CUDA kernels, differentiable in `x`, as `nn::SelfAttention` applies them;
/// `None` where they do not apply (see `kernels::cuda::rope::rope`).
pub fn cuda_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    Ok(crate::kernels::cuda::rope::rope(x, cos, sin)?)
}

/// The CUDA embedding lookup's launch plan (`src/kernels/cuda/embed.rs`): the gather and the
/// table's gradient summed in f32. The tests run the same plan on the CPU grid emulator.
pub mod cuda_embed {
    pub use crate::kernels::cuda::embed::{EmbedLaunch, EmbedPass, embed_plan, embed_plan_with};
}

/// Whether the CUDA embedding kernels (`src/kernels/cuda/embed.cu`) are compiled and loaded on
/// `device` (compiling and loading them if not yet): false off CUDA, without the `cuda`
/// feature, or where they failed to load.
pub fn cuda_embed_loaded(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::kernels::cuda::embed::available(d);
    }
    let _ = device;
    false
}

/// The rows of `table` (`(vocab, width)`, f32, f16 or bf16) at `ids` (u32 or i64) with the
/// CUDA kernels, differentiable in the table, as `nn::Embedding` applies them on CUDA; `None`
/// where they do not apply (see `kernels::cuda::embed::lookup`).
pub fn cuda_embedding(ids: &Tensor, table: &Tensor) -> Result<Option<Tensor>> {
    Ok(crate::kernels::cuda::embed::lookup(ids, table)?)
}

/// Makes `nn::linear_cross_entropy` on this thread run its CUDA node
/// (`src/kernels/lm_head_chunked.rs`, written with device-generic tensor ops) on the CPU
/// device too, with `rows` rows per chunk (at least 1; on CUDA devices too, where the node
/// runs anyway); `None` switches it back off. The node's per-chunk kernel then runs as its
/// CPU twin. For the tests that compare the chunked node with the plain ops without a GPU.
pub fn chunked_lm_head_on_cpu(rows: Option<usize>) {
    crate::kernels::lm_head_chunked::force_on_cpu(rows);
}
