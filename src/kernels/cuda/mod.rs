//! What the library does on CUDA devices below candle's own kernels: the stream-ordered
//! memory pool's settings ([`pool`]) and the fused kernels, CUDA C compiled at run time by
//! NVRTC ([`softmax`]: attention's scale + mask + softmax and its backward; [`norm`]: LayerNorm
//! and RMSNorm, forward and backward; [`xent`]: cross entropy fused with the softmax over the
//! classes, forward and backward; [`flash`]: attention without the stored scores,
//! FlashAttention-2's tiling, forward and backward; [`multi_tensor`]: the optimizer side, the
//! unscale and finite check and the AdamW/SGD updates over all parameters in one launch;
//! [`rows`]: a linear layer's bias + GELU and the add of two float types fused with its cast,
//! forward and backward; [`rope`]: the rotary position embedding, forward and backward;
//! [`gated`]: a gated MLP's product `act(gate) * up` and GELU's tanh form, forward and backward;
//! [`embed`]: the embedding lookup and its backward summed in f32),
//! built and loaded through `nvrtc.rs` from a shared `prelude.cuh`.

#[cfg(feature = "cuda")]
pub(crate) mod buffers;
pub(crate) mod embed;
pub(crate) mod flash;
pub(crate) mod gated;
pub(crate) mod multi_tensor;
pub(crate) mod norm;
#[cfg(feature = "cuda")]
mod nvrtc;
pub(crate) mod pool;
pub(crate) mod rope;
pub(crate) mod rows;
pub(crate) mod softmax;
pub(crate) mod xent;

/// A float type's part of the kernel names (`f32`, `f16`, `bf16`); `None` for a type no
/// kernel takes. Shared by the launch plans.
pub(crate) fn type_name(d: candle_core::DType) -> Option<&'static str> {
    match d {
        candle_core::DType::F32 => Some("f32"),
        candle_core::DType::F16 => Some("f16"),
        candle_core::DType::BF16 => Some("bf16"),
        _ => None,
    }
}
