//! # candle-amp
//!
//! Apex-style automatic mixed precision for [candle](https://github.com/huggingface/candle).
//!
//! Call [`initialize`] once with how to build the model, the optimizer and an [`OptLevel`];
//! wrap each backward in [`Amp::scale_loss`]; step the optimizer:
//!
//! ```
//! use candle_amp as amp;
//! use candle_core::{DType, Device, Tensor};
//!
//! # fn main() -> anyhow::Result<()> {
//! let (model, mut opt, amp) = amp::initialize(
//!     |vb| candle_nn::linear(3, 2, vb.pp("fc")),
//!     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
//!     amp::OptLevel::O2,
//! )?;
//! let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
//! let y = Tensor::zeros((4, 2), DType::F32, &Device::Cpu)?;
//! let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;    // output is f32
//! amp.scale_loss(&loss, &mut opt)?.backward()?;                   // scaled backward
//! match opt.step()? {                                            // skipped on overflow
//!     amp::StepOutcome::Stepped { .. } => {}
//!     amp::StepOutcome::Skipped { loss_scale, .. } => assert_eq!(loss_scale, 32768.0),
//! }
//! opt.zero_grad();
//! # Ok(()) }
//! ```
//!
//! Modules, one concept each: [`opt_level`] (the property table, as data), [`loss_scale`]
//! (the scale value type), [`store`] (parameters and f32 masters), [`guard`] (the
//! `scale_loss` pipeline), [`optim`] (our optimizer trait and algorithms), [`model`] (the
//! wrapper), [`nn`] (layers that work at every level).

#![warn(missing_docs)]

pub mod amp;
pub mod autocast;
pub mod checkpoint;
pub mod error;
pub mod grad_scaler;
pub mod guard;
mod kernels;
pub mod loss_scale;
pub mod model;
pub mod nn;
pub mod ops;
pub mod opt_level;
pub mod optim;
pub mod rng;
pub mod scaler;
mod serde_f32;
pub mod store;

pub use amp::{Amp, AmpState, GradReducer, LoadMode, LoadReport, STATE_FORMAT_VERSION, initialize, initialize_on};
pub use error::{AmpError, CheckpointErrorKind, Result};
pub use grad_scaler::{GradScaler, GradScalerState};
pub use guard::{BackwardReport, ScaleLoss};
pub use loss_scale::LossScale;
pub use model::AmpModel;
pub use opt_level::{AmpConfig, DynamicParams, HalfType, LossScaleSpec, OptLevel, Properties};
pub use optim::{AmpOptimizer, StepOutcome};
pub use scaler::ScalerState;
pub use store::ParamStore;
