//! Fused CPU kernels: what makes mixed precision fast on a CPU.
//!
//! Each kernel makes one pass over raw tensor data, picks its instruction set at run time
//! (AMX tiles, AVX-512 with BF16 dot products, AVX-512, AVX2 with FMA and F16C, or
//! portable Rust; see [`Isa`]), splits large work over the rayon pool, and falls back to plain candle ops on
//! other devices and types. The library uses them everywhere (casts, the model wrapper,
//! `ops::linear`/`ops::matmul` and the `nn` layers, stage 3 of the guard's pipeline, the
//! optimizers); they are public for custom layers and benchmarks.
//!
//! * [`cast`] and [`cast_into`]: f32/f16/bf16 conversion at memory speed, differentiable or
//!   into a preallocated tensor;
//! * [`unscale_check_into`]: check a raw gradient for inf/NaN and unscale it into (or add it
//!   to) an f32 buffer in one pass;
//! * [`matmul`] and [`linear`]: matrix products with f32 accumulation (bf16 on AMX tiles
//!   where the CPU has them), as custom ops with their own backward; `linear` fuses the bias
//!   and, in its backward, the bias gradient;
//! * [`relu`], [`gelu`] and [`silu`]: activations with one-pass backwards (GELU and SiLU in
//!   f32 arithmetic);
//! * [`layer_norm`] and [`rms_norm`]: normalisation as one op, statistics and affine
//!   transform in f32, weight and bias gradients fused (Apex's FusedLayerNorm);
//! * [`adamw`]: the fused AdamW update of an f32 master, its moments and its half copy.
//!
//! [`force_isa`] caps the instruction set (tests check every path against the portable one).
//! [`plain`] switches them off on the current thread: every entry point then runs the plain
//! candle ops it replaces (the baseline the kernels are tested and benchmarked against).

#[cfg(target_arch = "x86_64")]
mod amx;
pub(crate) mod attention;
#[cfg(target_arch = "x86_64")]
mod bf16_gemm;
pub(crate) mod capture;
mod cast;
pub(crate) mod chain;
pub(crate) mod cuda;
mod dispatch;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod fingerprint;
pub(crate) mod gated;
mod gelu;
mod gelu_table;
mod gemm;
pub(crate) mod graph_grad;
mod isa;
pub(crate) mod lm_head;
pub(crate) mod lm_head_chunked;
mod mat;
mod matmul;
mod norm;
mod relu;
pub(crate) mod residual;
mod rope;
mod scratch;
mod simd;
pub(crate) mod slices;
mod softmax;
mod softmax_grad;
mod storage;
pub(crate) mod unscale;
pub(crate) mod wgrad;

use candle_core::Tensor;

pub use cast::{cast, cast_into};
pub use gated::silu;
pub use gelu::{gelu, gelu_tanh};
pub use isa::Isa;
pub use matmul::{linear, matmul};
pub use norm::{layer_norm, rms_norm};
pub use relu::relu;
pub use slices::{AdamWStep, HalfOut, adamw};
pub use softmax::scaled_softmax;
#[doc(hidden)]
pub use storage::storage_key;
pub(crate) use storage::{apart_from, same_storage};
pub use unscale::unscale_check_into;

/// The instruction set the kernels use now: what the CPU has, or lower after [`force_isa`].
/// On [`Isa::Amx`] and [`Isa::Avx512Bf16`] bf16 matrix products flush subnormals to zero
/// ([`bf16_products_flush_subnormals`]).
pub fn isa() -> Isa {
    isa::current()
}

/// What this CPU supports.
pub fn detected_isa() -> Isa {
    isa::detected()
}

/// Caps the kernels at `isa` (never above what the CPU has), process-wide; `None` lifts the
/// cap. Meant for checking the fallbacks against the vector paths.
///
/// One difference between tiers is visible in results: bf16 matrix products ([`matmul`],
/// [`linear`] and their backwards) on [`Isa::Amx`] and [`Isa::Avx512Bf16`] flush subnormal
/// inputs and results to zero (the instructions do), where the lower tiers and candle keep
/// them; [`bf16_products_flush_subnormals`] says which applies now.
pub fn force_isa(isa: Option<Isa>) {
    isa::force(isa)
}

/// Whether bf16 matrix products ([`matmul`], [`linear`] and their backwards) flush subnormals
/// to zero on the active tier (after [`force_isa`]): true when it is [`Isa::Amx`] or
/// [`Isa::Avx512Bf16`].
///
/// Their instructions (`tdpbf16ps`, `vdpbf16ps`) treat subnormal bf16 inputs (magnitude
/// below 2^-126) as zero and flush subnormal f32 results, partial sums included, to zero,
/// whatever the MXCSR register says. On a CPU that issues `vdpbf16ps` slower than f32 FMAs
/// (Intel Sapphire Rapids does, at half their rate) the AVX-512 BF16 tier multiplies in f32
/// instead, with the same flushing of inputs and results (partial sums are not flushed
/// there, which changes a result by less than 2^-126). Products small enough for the direct loop (up to 4096
/// multiply-adds) and every f32 or f16 product keep subnormals on every tier, as candle does.
/// A tool that watches for bf16 underflow (the numerics doctor) should count values below
/// 2^-126 as lost where this is true.
///
/// ```
/// use candle_amp::kernels::{self, Isa};
/// let flush = kernels::bf16_products_flush_subnormals();
/// assert_eq!(flush, matches!(kernels::isa(), Isa::Amx | Isa::Avx512Bf16));
/// ```
pub fn bf16_products_flush_subnormals() -> bool {
    isa::bf16_products_flush_subnormals()
}

/// `t` in row-major order, as the kernels read it (one slice of its storage): `contiguous()`,
/// except that an empty tensor is always copied (nothing to copy), since an empty view can
/// start past the end of its storage (`zeros((0, 2)).narrow(1, 1, 1)` starts at 1 of 0
/// values), where slicing would panic.
pub(crate) fn dense(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.elem_count() == 0 {
        t.force_contiguous()
    } else {
        t.contiguous()
    }
}

/// A custom op's CUDA forward that hands on a result computed before (with tensor ops on the
/// device): `out` copied into a buffer of the node's own. `try_clone` copies the whole
/// buffer, so it must hold `out` row-major from its start (a fresh result does; a view is
/// copied so first). `what` names the op in the error for a tensor off CUDA.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_owned_copy(
    out: &Tensor,
    what: &str,
) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
    use candle_core::backend::BackendStorage;
    let out = if out.is_contiguous() && out.layout().start_offset() == 0 {
        out.clone()
    } else {
        out.force_contiguous()?
    };
    let (st, layout) = out.storage_and_layout();
    let candle_core::Storage::Cuda(cuda) = &*st else {
        candle_core::bail!("{what} is not on the input's CUDA device")
    };
    Ok((cuda.try_clone(layout)?, out.shape().clone()))
}

thread_local! {
    /// Open [`plain`] guards on this thread.
    static PLAIN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether the kernels run on this thread: true unless a [`plain`] guard is open here.
pub fn enabled() -> bool {
    PLAIN.with(|p| p.get() == 0)
}

/// Switches the kernels off on this thread until the returned guard drops (guards nest).
///
/// While it is open, [`cast`], [`matmul`], [`linear`], [`relu`], [`gelu`], [`layer_norm`],
/// [`rms_norm`] and the guard's unscale-and-check stage run the candle ops they replace
/// (`to_dtype`, `matmul`, `broadcast_matmul` + `broadcast_add`, `relu`, `gelu_erf`, tensor
/// arithmetic), and so do the half nodes of `ops::add`, `nn::Dropout`, `nn::split_heads` /
/// `merge_heads` and attention's key transpose (candle's `broadcast_add`, `broadcast_mul`,
/// reshape, permute and copy), so a model
/// can be compared with and without them. The choice is made when an op is recorded: a
/// backward runs whatever the forward recorded. The optimizers' fused update has its own
/// switch (`fused` in [`crate::optim::AdamWConfig`] and [`crate::optim::SgdConfig`]).
///
/// ```
/// use candle_amp::kernels;
/// assert!(kernels::enabled());
/// {
///     let _plain = kernels::plain();
///     assert!(!kernels::enabled());
/// }
/// assert!(kernels::enabled());
/// ```
pub fn plain() -> Plain {
    PLAIN.with(|p| p.set(p.get() + 1));
    Plain(std::marker::PhantomData)
}

/// The guard [`plain`] returns; the kernels come back on this thread when the last one drops.
/// It stays on the thread that made it (not `Send`).
#[must_use = "the kernels are off only while the guard is alive"]
#[derive(Debug)]
pub struct Plain(std::marker::PhantomData<*const ()>);

impl Drop for Plain {
    fn drop(&mut self) {
        PLAIN.with(|p| p.set(p.get().saturating_sub(1)));
    }
}
