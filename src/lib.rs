//! # candle-amp
//!
//! Apex-style automatic mixed precision for [candle](https://github.com/huggingface/candle):
//! train a candle model in f16 or bf16 with f32 master weights and dynamic loss scaling.
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
//! ## Where to look
//!
//! | you want to | start at |
//! |---|---|
//! | set up a run, choose or override an opt level | [`initialize`], [`AmpConfig`], [`OptLevel`], [`HalfType`] |
//! | train: the handle, its guard, the model wrapper | [`Amp`], [`ScaleLoss`], [`AmpModel`] |
//! | optimizers (SGD, AdamW, any candle optimizer) | [`optim`], [`AmpOptimizer`] |
//! | the PyTorch-style API | [`GradScaler`], [`autocast`] |
//! | run ops in the type that is safe for them (O1) | [`ops`], [`nn`] |
//! | train Llama, BERT or ViT | [`models`] |
//! | save, resume, fine-tune | [`checkpoint`], [`AmpConfig::pretrained`] |
//! | find which tensor leaves the half range | [`doctor`] |
//! | fit a larger model: gradient checkpointing | [`recompute`] |
//! | train on several processes or GPUs | [`distributed`] |
//! | the fused CPU kernels and their instruction-set tiers | [`kernels`] |
//! | match an error | [`AmpError`], [`CallOrderKind`], [`CheckpointErrorKind`], [`DistErrorKind`] |
//!
//! The extension points: a [`GradReducer`] and `distributed::StepReducer` for data
//! parallelism, a backward driver for [`ScaleLoss::backward_with`], the
//! [`optim::Optimizer`] trait.
//!
//! The repository's README and its `docs/` folder are the user's guide: getting started,
//! opt levels, porting a model, loss scaling, diagnosing, checkpoints, memory, data
//! parallel, CUDA, performance and the examples' flags.
//!
//! The crate is built in floors, each depending only on those below it (ARCHITECTURE.md
//! draws it): `error`; `scaling` (the loss scale) and `kernels`; `precision` (opt levels,
//! parameter store, autocast, ops, model wrapper); `train` (run state, optimizers, the
//! guard's pipeline, `GradScaler`); `nn`; the [`Amp`] handle; [`checkpoint`], [`distributed`],
//! [`recompute`] and [`doctor`].

#![warn(missing_docs)]
// docs.rs (nightly, `--cfg docsrs`): the `mpi`, `cuda` and `nccl` items show their feature.
#![cfg_attr(docsrs, feature(doc_cfg))]
// A doc link that no longer resolves fails the docs build, not only CI's `-D warnings` one.
#![deny(rustdoc::broken_intra_doc_links)]

// README's code blocks run as doctests, so what a user copies from it compiles and runs.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

// The guides' code blocks too (docs/): each page is one item, so a failing block names its page.
#[cfg(doctest)]
#[doc = include_str!("../docs/getting-started.md")]
pub struct GettingStartedDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/opt-levels.md")]
pub struct OptLevelsDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/porting.md")]
pub struct PortingDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/loss-scaling.md")]
pub struct LossScalingDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/diagnosing.md")]
pub struct DiagnosingDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/checkpoints.md")]
pub struct CheckpointsDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/memory.md")]
pub struct MemoryDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/distributed.md")]
pub struct DistributedDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/cuda.md")]
pub struct CudaDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/performance.md")]
pub struct PerformanceDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/examples.md")]
pub struct ExamplesDoctests;

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
