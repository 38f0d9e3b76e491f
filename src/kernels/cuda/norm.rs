//! LayerNorm and RMSNorm over the last dimension on CUDA, from `norm.cu`: the forward writes
//! `y` in the input's type and keeps each row's f32 mean and rstd for the backward; the
//! backward gives `dx` in the input's type and the weight and bias gradients in f32, summed
//! over the rows in two deterministic passes (no atomics).
//!
//! Built and loaded as the softmax kernels are (see [`super::softmax`]): NVRTC at run time,
//! `get_or_load_custom_func` into candle's context, one warning per device and the composed
//! ops where that fails. The launch plan (`norm_plan.rs`) is shared with the tests, which run
//! the same `.cu` on the CPU grid emulator (`tests/cuda_emu`).

/// The CUDA C source of the kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SOURCE: &str = include_str!("norm.cu");

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[path = "norm_plan.rs"]
mod plan;
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use plan::norm_plan;

#[cfg(feature = "cuda")]
pub(crate) use device::{available, norm};

#[cfg(feature = "cuda")]
#[path = "norm_device.rs"]
mod device;
