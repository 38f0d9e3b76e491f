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
//! The public surface: [`initialize`], [`AmpConfig`]/[`OptLevel`]/[`HalfType`], the handle
//! [`Amp`] and its guard [`ScaleLoss`], the model wrapper [`AmpModel`], [`optim`] (our
//! optimizers and the [`AmpOptimizer`] that drives them), the PyTorch-style [`GradScaler`],
//! [`autocast`] scopes, [`ops`] and [`nn`] layers, [`checkpoint`]s (saved training state),
//! data parallelism across processes ([`distributed`]), gradient checkpointing and chunked
//! feed-forward ([`recompute`]), the numerics doctor ([`doctor`]: which tensors leave the half
//! type's range, what to keep in f32, an automatic fallback), the error types, and the
//! extension points: a
//! [`GradReducer`] and `distributed::StepReducer` for data parallelism, a backward driver for
//! [`ScaleLoss::backward_with`], the [`optim::Optimizer`] trait.
//!
//! The crate is built in floors, each depending only on those below it (ARCHITECTURE.md
//! draws it): `error`; `scaling` (the loss scale) and `kernels`; `precision` (opt levels,
//! parameter store, autocast, ops, model wrapper); `train` (run state, optimizers, the
//! guard's pipeline, `GradScaler`); `nn`; the [`Amp`] handle; [`checkpoint`], [`distributed`],
//! [`recompute`] and [`doctor`].

#![warn(missing_docs)]

// README's code blocks run as doctests, so what a user copies from it compiles and runs.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

// The guides' code blocks too.
#[cfg(doctest)]
#[doc = include_str!("../docs/porting.md")]
pub struct PortingDoctests;

mod amp;
pub mod checkpoint;
mod comm;
pub mod distributed;
/// The former name of [`distributed`], kept so that code written against it still builds.
#[doc(hidden)]
pub use distributed as dist;
pub mod doctor;
mod error;
mod files;
pub mod kernels;
pub mod models;
pub mod nn;
mod precision;
pub mod recompute;
mod scaling;
mod serde_f32;
#[doc(hidden)]
pub mod testing;
mod train;

pub use amp::{Amp, AmpState, LoadReport, initialize, initialize_on};
pub use error::{AmpError, CallOrderKind, CheckpointErrorKind, DistErrorKind, Result};
pub use kernels::cuda::pool::empty_cache;
pub use precision::model::AmpModel;
pub use precision::opt_level::{AmpConfig, HalfType, OptLevel, Properties};
pub use precision::store::{LoadMode, Param, ParamKind, ParamStore};
pub use precision::{autocast, ops};
pub use scaling::{DynamicParams, LossScale, LossScaleSpec, ScalerState};
pub use train::grad_scaler::{GradScaler, GradScalerState};
pub use train::guard::{BackwardReport, ScaleLoss};
pub use train::optim;
pub use train::optim::{AmpOptimizer, StepOutcome};
pub use train::reduce::GradReducer;
pub use train::rng::{Generator, GeneratorGuard};
