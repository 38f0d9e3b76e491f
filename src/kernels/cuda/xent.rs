//! Cross entropy over the last dimension on CUDA, fused with the softmax over the classes,
//! from `xent.cu`: the forward reads the logits once in their own type (no f32 copy, no
//! stored log-probabilities) and keeps two f32 values per row (the row's maximum and sum of
//! exponentials); a second one-block kernel takes the mean over the rows in a fixed order; the
//! backward recomputes the softmax from those two values and writes `(softmax - onehot) * g / N`
//! in the logits' type in one pass. A third kernel does both for one chunk of rows of the
//! chunked LM head (`kernels::lm_head_chunked`): each row's log-probability and its gradient
//! at the logits, for the whole batch's mean, in one launch (`rows_logp_grad`).
//!
//! Built and loaded as the softmax kernels are (see [`super::softmax`]): NVRTC at run time,
//! `get_or_load_custom_func` into candle's context, one warning per device and the composed
//! ops where that fails. The launch plan (`xent_plan.rs`) is shared with the tests, which run
//! the same `.cu` on the CPU grid emulator (`tests/cuda_emu`).

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("xent.cu");

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[path = "xent_plan.rs"]
mod plan;
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use plan::xent_plan;

#[cfg(feature = "cuda")]
pub(crate) use device::{available, cross_entropy, rows_logp_grad};

#[cfg(feature = "cuda")]
#[path = "xent_device.rs"]
mod device;
