//! How the loss is scaled: the [`LossScale`] value type (static or dynamic, with its
//! algorithm) and the per-loss scalers of a run, which adjust once per optimizer step.
//!
//! This floor depends on nothing but [`crate::error`]. The guard and `GradScaler` that use
//! it are in [`crate::train`].

pub(crate) mod loss_scale;
pub(crate) mod scaler;

pub use loss_scale::{DynamicParams, LossScale, LossScaleSpec};
pub use scaler::ScalerState;
