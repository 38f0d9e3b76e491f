//! What the library does on CUDA devices below candle's own kernels: the stream-ordered
//! memory pool's settings ([`pool`]) and the fused kernels, CUDA C compiled at run time by
//! NVRTC ([`softmax`]: attention's scale + mask + softmax and its backward; [`norm`]: LayerNorm
//! and RMSNorm, forward and backward; [`xent`]: cross entropy fused with the softmax over the
//! classes, forward and backward), built and loaded through `nvrtc.rs` from a shared
//! `prelude.cuh`.

#[cfg(feature = "cuda")]
pub(crate) mod buffers;
pub(crate) mod norm;
#[cfg(feature = "cuda")]
mod nvrtc;
pub(crate) mod pool;
pub(crate) mod softmax;
pub(crate) mod xent;
