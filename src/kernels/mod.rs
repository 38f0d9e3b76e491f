//! CPU kernels: fused passes over raw tensor data, each with a fallback to plain candle ops
//! on other devices.
//!
//! * [`unscale`]: check a raw (scaled) gradient for inf/NaN and unscale it into f32 in one
//!   pass.
//! * [`fingerprint`]: a content hash of a tensor's data, which the autocast cache checks so
//!   that it never serves a cast of data that has since changed.

pub(crate) mod fingerprint;
pub(crate) mod unscale;
