//! How training state is stepped and saved.
//!
//! * [`run`]: the state one run's handle, models and optimizers share;
//! * [`optim`]: our object-safe optimizer trait, its algorithms and the [`crate::AmpOptimizer`]
//!   that drives one over the parameter store;
//! * [`guard`]: the `scale_loss` guard and its staged backward pipeline;
//! * [`grad_scaler`]: the PyTorch-style `GradScaler` over the same stages;
//! * [`reduce`]: the stage-2 extension point for data parallelism;
//! * [`rng`]: the run's seeded generators.
//!
//! This floor depends on [`crate::precision`], [`crate::scaling`] and [`crate::kernels`].

pub(crate) mod grad_scaler;
pub(crate) mod guard;
pub mod optim;
pub(crate) mod reduce;
pub(crate) mod rng;
pub(crate) mod run;
