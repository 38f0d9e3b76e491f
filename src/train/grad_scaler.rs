//! The PyTorch-style API: a [`GradScaler`] with `scale`, `unscale`, `step` and `update`.
//!
//! Over the same core as [`crate::Amp::scale_loss`], for users coming from
//! `torch.cuda.amp`. candle returns gradients from `backward()` instead of storing them on
//! parameters, so `unscale` and `step` take the `GradStore` that backward returned:
//!
//! ```text
//! PyTorch                               candle-amp
//! scaler.scale(loss).backward()         let grads = scaler.scale(&loss)?.backward()?;
//! scaler.unscale_(opt)                  scaler.unscale(&mut opt, &grads)?;
//! scaler.step(opt)                      scaler.step(&mut opt, &grads)?;
//! scaler.update()                       scaler.update(None)?;
//! ```
//!
//! Gradient accumulation (PyTorch accumulates into `.grad` across backwards): pass every
//! micro-batch but the last to [`GradScaler::accumulate`], the last to `step` (or `unscale`).

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::guard::{BackwardReport, run_stages};
use super::optim::{AmpOptimizer, Round, StepOutcome};
use crate::error::{AmpError, CallOrderKind, Result};
use crate::scaling::{DynamicParams, LossScale};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// `unscale` added the gradients, and what follows it (the step reducer) failed: a
    /// retried `unscale` or `step` finishes it without adding them again.
    Added,
    Unscaled,
    Stepped,
}

/// PyTorch's `GradScaler` state dict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// The scale.
    #[serde(with = "crate::serde_f32")]
    pub scale: f32,
    /// Growth factor.
    #[serde(with = "crate::serde_f32")]
    pub growth_factor: f32,
    /// Backoff factor.
    #[serde(with = "crate::serde_f32")]
    pub backoff_factor: f32,
    /// Growth interval.
    pub growth_interval: u32,
    /// Clean steps since the last growth or overflow (`_growth_tracker`).
    pub growth_tracker: u32,
}

/// A gradient scaler with PyTorch's defaults and rules: initial scale 2^16, growth 2,
/// backoff 0.5, interval 2000, no floor and no ceiling (so its trajectory is PyTorch's).
///
/// Its `accumulate`, `unscale` and `step` run the same stages 2 to 4 as the guard
/// ([`crate::ScaleLoss`]): the run's [`GradReducer`](crate::GradReducer) if one is installed,
/// check and unscale (the raw gradient checked first), accumulate into the optimizer's f32
/// master gradients. It does not go through [`crate::Amp::scale_loss`], so
/// [`crate::Amp::autocast_ops`] is not updated and the run's cast cache is not cleared per
/// step (a cached cast is never used once its weight has changed).
///
/// Per optimizer and iteration: any number of `accumulate` calls, then `unscale` at most
/// once and before `step` (on a disabled scaler a second `unscale` does nothing, as
/// PyTorch's: each backward's gradients are added exactly once); `step` at most once (it
/// unscales the given gradients first if `unscale` was not called, and skips silently,
/// returning [`StepOutcome::Skipped`], when a gradient of any accumulated micro-batch was
/// inf or NaN); then one `update` for all
/// optimizers, which adjusts the scale from every recorded check and resets the stages.
/// Breaking these rules is an [`AmpError::CallOrder`]. Optimizers are told apart by their
/// process-unique id, so one scaler serves optimizers of several AMP handles.
///
/// Gradients outside the `GradStore` (the run's fused layers and checkpointed segments write
/// their parameters' f32 gradients aside, see [`crate::nn::Linear`]) follow the same rule as
/// in [`crate::ScaleLoss`]: they belong to the backward that produced them. The tensor
/// `scale` returns carries a marker whose gradient the backward's `GradStore` holds, and
/// only the `accumulate`, `unscale` or `step` call given that `GradStore` applies them,
/// each to the optimizer that owns the parameter; an optimizer's `zero_grad` drops its own
/// parameters' gradients that no call took, and no other optimizer's. A backward whose
/// `GradStore` is dropped unused changes no later step.
///
/// ```
/// use candle_amp::{self as amp, GradScaler};
/// # fn main() -> anyhow::Result<()> {
/// let (model, mut opt, _amp) = amp::initialize(
///     |vb| amp::nn::linear(4, 1, vb.pp("fc")),
///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
///     amp::OptLevel::O1,
/// )?;
/// let mut scaler = GradScaler::with_params(1024.0, 2.0, 0.5, 2000, true)?;
/// let x = candle_core::Tensor::ones((2, 4), candle_core::DType::F32, &candle_core::Device::Cpu)?;
/// let loss = amp::ops::mse(&model.forward(&x)?, &x.narrow(1, 0, 1)?)?;
/// let grads = scaler.scale(&loss)?.backward()?;
/// assert!(!scaler.step(&mut opt, &grads)?.is_skipped());
/// scaler.update(None)?;
/// assert_eq!(scaler.get_scale(), 1024.0);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GradScaler {
    enabled: bool,
    scale: LossScale,
    stages: HashMap<usize, (Stage, bool)>,
}

impl Default for GradScaler {
    fn default() -> Self {
        Self::new()
    }
}

impl GradScaler {
    /// PyTorch's defaults.
    pub fn new() -> Self {
        Self::with_params(65536.0, 2.0, 0.5, 2000, true).expect("the defaults are valid")
    }

    /// PyTorch's constructor: growth must be > 1 and backoff < 1.
    pub fn with_params(
        init_scale: f32,
        growth_factor: f32,
        backoff_factor: f32,
        growth_interval: u32,
        enabled: bool,
    ) -> Result<Self> {
        let params = DynamicParams {
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            ..Default::default()
        };
        Ok(Self {
            enabled,
            // No floor and no ceiling: PyTorch's arithmetic.
            scale: LossScale::dynamic(&params, 0.0, f32::INFINITY)?,
            stages: HashMap::new(),
        })
    }

    /// Whether scaling is enabled.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The current scale (1.0 when disabled, as PyTorch).
    pub fn get_scale(&self) -> f32 {
        if self.enabled { self.scale.scale() } else { 1.0 }
    }

    /// The loss, in f32, times the scale (the loss's values when disabled).
    ///
    /// The result carries a marker (an extra `u8` variable whose gradient the returned
    /// `GradStore` holds): the gradients the run's fused layers and checkpointed segments
    /// produce outside candle's graph during its backward are filed under it, so the
    /// `accumulate`, `unscale` or `step` call given that `GradStore` applies them, and no
    /// other call does (see [`GradScaler`]'s rule on stashed gradients).
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        let scaled = match self.enabled {
            false => loss.clone(),
            true => loss.to_dtype(DType::F32)?.affine(self.scale.scale() as f64, 0.0)?,
        };
        Ok(crate::precision::stash::mark(&scaled)?)
    }

    /// Stages 2 to 4 on one backward's gradients, as the guard runs them.
    fn add(&self, opt: &mut AmpOptimizer, grads: &GradStore) -> Result<BackwardReport> {
        let run = opt.run().clone();
        let scale = self.get_scale();
        // The stages own (and a reducer rewrites) the gradients: take this optimizer's.
        let mut own = GradStore::default();
        for (_, v) in opt.trained_vars()? {
            if let Some(g) = grads.get(&v) {
                own.insert(&v, g.clone());
            }
        }
        // With the backward's markers: the stages take the gradients it stashed.
        crate::precision::stash::copy_markers(grads, &mut own);
        run_stages(
            &run,
            own,
            &mut [opt],
            Round::External,
            scale,
            (false, None),
            self.enabled,
            &Default::default(),
        )
    }

    /// Refuses `call` on an optimizer already unscaled or stepped since the last `update`.
    fn check_ready(&self, opt: &AmpOptimizer, call: &'static str) -> Result<()> {
        match self.stages.get(&opt.id()) {
            Some((Stage::Unscaled, _)) => Err(AmpError::call_order(
                call,
                CallOrderKind::AlreadyUnscaled,
                "unscale() has already been called on this optimizer since the last update(); call step() \
                 and update() first",
            )),
            Some((Stage::Stepped, _)) => Err(AmpError::call_order(
                call,
                CallOrderKind::AlreadyStepped,
                "step() has already been called on this optimizer since the last update(); call update() \
                 and zero_grad() first",
            )),
            Some((Stage::Added, _)) => Err(AmpError::call_order(
                call,
                CallOrderKind::AlreadyUnscaled,
                "unscale() has added this optimizer's gradients and then failed (see its error); call \
                 unscale() or step() again to finish it, or zero_grad() and update() to drop the step",
            )),
            None => Ok(()),
        }
    }

    /// Adds one micro-batch's gradients (from `scale(&loss)?.backward()`) to the optimizer's
    /// f32 master gradients, unscaled and checked, OR-ing its overflow flag into the step's:
    /// gradient accumulation. Allowed any number of times before this iteration's `unscale` or
    /// `step`; it records no check for `update` (the step does).
    ///
    /// ```
    /// use candle_amp::{self as amp, GradScaler};
    /// # fn main() -> anyhow::Result<()> {
    /// let (model, mut opt, _amp) = amp::initialize(
    ///     |vb| amp::nn::linear(4, 1, vb.pp("fc")),
    ///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
    ///     amp::OptLevel::O1,
    /// )?;
    /// let mut scaler = GradScaler::new();
    /// let x = candle_core::Tensor::ones((2, 4), candle_core::DType::F32, &candle_core::Device::Cpu)?;
    /// let micro = |scaler: &GradScaler| -> anyhow::Result<_> {
    ///     let loss = (amp::ops::mse(&model.forward(&x)?, &x.narrow(1, 0, 1)?)? / 2.0)?;
    ///     Ok(scaler.scale(&loss)?.backward()?)
    /// };
    /// scaler.accumulate(&mut opt, &micro(&scaler)?)?;        // micro-batch 1 of 2
    /// scaler.step(&mut opt, &micro(&scaler)?)?;              // micro-batch 2, then the step
    /// scaler.update(None)?;
    /// opt.zero_grad();
    /// assert_eq!(opt.steps(), 1);
    /// # Ok(()) }
    /// ```
    pub fn accumulate(&mut self, opt: &mut AmpOptimizer, grads: &GradStore) -> Result<BackwardReport> {
        self.check_ready(opt, "accumulate")?;
        self.add(opt, grads)
    }

    /// Adds `grads` to the optimizer's f32 master gradients (unscaled) and records whether any
    /// gradient accumulated since the last step is inf or NaN. At most once per optimizer
    /// between updates, and not after its `step`; a second call is an error, except on a
    /// disabled scaler, where it does nothing (PyTorch's disabled `unscale_` is a no-op).
    ///
    /// Each backward's gradients are added exactly once: after `unscale`, the `grads` given
    /// to `step` (or to a disabled scaler's later `unscale`) are not used. If `unscale` fails
    /// after adding them (the step reducer of data parallel timed out), a retried `unscale`
    /// or `step` finishes it without adding them again.
    pub fn unscale(&mut self, opt: &mut AmpOptimizer, grads: &GradStore) -> Result<()> {
        match self.stages.get(&opt.id()).map(|s| s.0) {
            // A disabled scaler's gradients were added by the first call: nothing to do.
            Some(Stage::Unscaled | Stage::Stepped) if !self.enabled => return Ok(()),
            Some(Stage::Added) => {}
            _ => {
                self.check_ready(opt, "unscale")?;
                self.add(opt, grads)?;
                self.stages.insert(opt.id(), (Stage::Added, false));
            }
        }
        // Under data parallel, average the step's gradients and combine the overflow flags
        // now, so that clipping after `unscale` and the skip decision see the same values on
        // every process.
        opt.reduce_step()?;
        let found_inf = self.enabled && opt.external_found_inf();
        self.stages.insert(opt.id(), (Stage::Unscaled, found_inf));
        Ok(())
    }

    /// Steps the optimizer unless a gradient of any accumulated micro-batch was inf or NaN
    /// (then skips silently and says so in the outcome). Unscales `grads` first if `unscale`
    /// was not called (after `unscale`, `grads` is not used again). All or nothing: on an
    /// error nothing was applied, and the step can be retried.
    pub fn step(&mut self, opt: &mut AmpOptimizer, grads: &GradStore) -> Result<StepOutcome> {
        if let Some((Stage::Stepped, _)) = self.stages.get(&opt.id()) {
            return Err(AmpError::call_order(
                "step",
                CallOrderKind::AlreadyStepped,
                "step() has already been called on this optimizer since the last update()",
            ));
        }
        if !matches!(self.stages.get(&opt.id()), Some((Stage::Unscaled, _))) {
            self.unscale(opt, grads)?;
        }
        let found_inf = self.stages.get(&opt.id()).is_some_and(|s| s.1);
        let nonfinite: Vec<String> = if found_inf { opt.nonfinite_names() } else { Vec::new() };
        opt.step_external(found_inf)?;
        self.stages.insert(opt.id(), (Stage::Stepped, found_inf));
        let loss_scale = self.get_scale();
        Ok(if found_inf {
            StepOutcome::Skipped { loss_scale, nonfinite }
        } else {
            StepOutcome::Stepped { loss_scale }
        })
    }

    /// Updates the scale once per iteration: to `new_scale` if given (the growth tracker is
    /// untouched), else backs off if any recorded check found inf and counts a clean step
    /// otherwise. Resets every optimizer's stage. With no recorded check (and no
    /// `new_scale`) it is an error.
    pub fn update(&mut self, new_scale: Option<f32>) -> Result<()> {
        if !self.enabled {
            self.stages.clear();
            return Ok(());
        }
        match new_scale {
            Some(s) => {
                if s.is_nan() || s < 0.0 {
                    return Err(AmpError::InvalidArgument {
                        argument: "new_scale",
                        reason: format!("GradScaler::update needs a number >= 0, got {s}"),
                    });
                }
                self.scale.set_scale(s);
            }
            None => {
                // An `unscale` that failed after adding its gradients recorded no check.
                if self.stages.values().all(|s| s.0 == Stage::Added) {
                    return Err(AmpError::call_order(
                        "update",
                        CallOrderKind::NothingRecorded,
                        "No inf checks were recorded prior to update(): call step() (or unscale()) on the \
                         optimizers first",
                    ));
                }
                let inf = self.stages.values().any(|s| s.0 != Stage::Added && s.1);
                self.scale.adjust(!inf);
            }
        }
        self.stages.clear();
        Ok(())
    }

    /// PyTorch's state dict (`None` when disabled, where PyTorch returns `{}`).
    pub fn state_dict(&self) -> Option<GradScalerState> {
        let p = self.scale.params()?;
        self.enabled.then_some(GradScalerState {
            scale: self.scale.scale(),
            growth_factor: p.growth_factor,
            backoff_factor: p.backoff_factor,
            growth_interval: p.growth_interval,
            growth_tracker: self.scale.growth_tracker(),
        })
    }

    /// Loads a state dict (PyTorch raises on an empty one; here that is `None`).
    pub fn load_state_dict(&mut self, state: Option<&GradScalerState>) -> Result<()> {
        let Some(s) = state else {
            return Err(AmpError::OptimizerState(
                "the state dict is empty (saved from a disabled GradScaler); there is nothing to load".into(),
            ));
        };
        if s.scale.is_nan() || s.scale < 0.0 {
            return Err(AmpError::OptimizerState(format!(
                "the saved scale {} is not a number >= 0; the state is damaged",
                s.scale
            )));
        }
        let mut fresh = Self::with_params(
            65536.0,
            s.growth_factor,
            s.backoff_factor,
            s.growth_interval,
            self.enabled,
        )?;
        fresh.scale.restore_pytorch(s.scale, s.growth_tracker);
        *self = fresh;
        Ok(())
    }
}
