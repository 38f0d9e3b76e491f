//! Drop-in layers that autocast at O1 and behave correctly at every opt level.
//!
//! Same constructor signatures as candle-nn (parameter names and initialisation too, so
//! checkpoints are interchangeable), but their forward passes go through [`crate::ops`]:
//! under O1's autocast, linear layers and convolutions run in half and normalisation in f32;
//! at every level normalisation statistics and softmax accumulate in f32, and every layer is
//! differentiable (candle 0.11's fused `layer_norm`, `rms_norm` and `softmax_last_dim` are
//! not). `Dropout` draws its masks from a generator the run owns and checkpoints.

mod attention;
mod batch_norm;
mod conv;
mod dropout;
mod linear;
mod norm;

pub use attention::{causal_mask, scaled_dot_product_attention};
pub use batch_norm::{BatchNorm, batch_norm};
pub use candle_nn::{BatchNormConfig, Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig, LayerNormConfig};
pub use conv::{Conv1d, Conv2d, ConvTranspose2d, conv_transpose2d, conv1d, conv2d};
pub use dropout::Dropout;
pub use linear::{Embedding, Linear, embedding, linear, linear_no_bias};
pub use norm::{GroupNorm, LayerNorm, RmsNorm, group_norm, layer_norm, rms_norm};

pub use crate::ops::{log_softmax, softmax};

/// Losses: always computed and returned in f32.
pub mod loss {
    pub use crate::ops::{
        binary_cross_entropy, binary_cross_entropy_with_logits, cross_entropy, kl_div, l1, mse, nll, smooth_l1,
    };
}
