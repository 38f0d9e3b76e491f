//! Layers that behave correctly at every opt level. More arrive with O1 autocasting; for
//! now, batch norm, which candle-nn cannot run on half inputs.

mod batch_norm;

pub use batch_norm::{BatchNorm, batch_norm};
pub use candle_nn::BatchNormConfig;
