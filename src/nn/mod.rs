//! Drop-in layers that autocast at O1 and behave correctly at every opt level.
//!
//! Same constructor signatures as candle-nn (parameter names and initialisation too, so
//! checkpoints are interchangeable), but their forward passes go through [`crate::ops`]:
//! under O1's autocast, linear layers and convolutions run in half and normalisation in f32;
//! at every level normalisation statistics and softmax accumulate in f32, and every layer is
//! differentiable (candle 0.11's fused `layer_norm`, `rms_norm` and `softmax_last_dim` are
//! not). `Dropout` draws its masks from a generator the run owns and checkpoints.
//!
//! ```
//! use candle_amp::{self as amp, nn as ann};
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::Module;
//! # fn main() -> anyhow::Result<()> {
//! struct Block { fc: ann::Linear, ln: ann::LayerNorm }
//! let (model, _opt, amp) = amp::initialize(
//!     |vb| Ok(Block { fc: ann::linear(8, 8, vb.pp("fc"))?, ln: ann::layer_norm(8, 1e-5, vb.pp("ln"))? }),
//!     amp::optim::AdamW::new(Default::default())?,
//!     amp::OptLevel::O1,
//! )?;
//! let x = Tensor::ones((2, 8), DType::F32, &Device::Cpu)?;
//! let _autocast = amp.autocast();                              // what the model wrapper does at O1
//! let h = model.inner().fc.forward(&x)?;
//! assert_eq!(h.dtype(), DType::F16);                           // linear runs in half
//! assert_eq!(model.inner().ln.forward(&h)?.dtype(), DType::F32); // layer norm in f32
//! # Ok(()) }
//! ```

use candle_nn::VarBuilder;

mod attention;
mod batch_norm;
mod conv;
mod dropout;
mod gated_mlp;
mod linear;
mod lm_head;
mod mlp;
mod norm;
mod residual;
mod self_attention;
mod sync_batch_norm;

pub use attention::{MASKED, causal_mask, key_padding_mask, merge_heads, scaled_dot_product_attention, split_heads};
pub use batch_norm::{BatchNorm, batch_norm};
pub use candle_nn::{BatchNormConfig, Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig, LayerNormConfig};
pub use conv::{Conv1d, Conv2d, ConvTranspose2d, conv_transpose2d, conv1d, conv2d};
pub use dropout::Dropout;
pub use gated_mlp::{GateActivation, GatedMlp, gated_mlp};
pub use linear::{Activation, Embedding, Linear, embedding, linear, linear_no_bias};
pub use lm_head::linear_cross_entropy;
pub use mlp::Mlp;
pub use norm::{GroupNorm, LayerNorm, RmsNorm, group_norm, layer_norm, rms_norm};
pub use residual::{NormPlacement, Residual, ResidualBody, ResidualNorm};
pub use self_attention::{RopeLayout, SelfAttention, self_attention};

pub use crate::precision::ops::{log_softmax, softmax};

/// A layer's name: its VarBuilder path (`None` at the root).
fn layer_name(vb: &VarBuilder) -> Option<std::sync::Arc<str>> {
    let p = vb.prefix();
    (!p.is_empty()).then(|| std::sync::Arc::from(p))
}

/// Losses: always computed and returned in f32.
pub mod loss {
    pub use crate::precision::ops::{
        binary_cross_entropy, binary_cross_entropy_with_logits, cross_entropy, kl_div, l1, mse, nll, smooth_l1,
    };
}
