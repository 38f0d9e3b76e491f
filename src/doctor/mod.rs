//! The numerics doctor: which tensors underflow or overflow in half precision, what to keep
//! in f32, and an automatic fallback.
//!
//! [`Doctor::attach`] installs a recorder in a run. Every `every`-th step (a `scale_loss`
//! backward; default 10) it records, in one pass per tensor ([`TensorStats`]): each named
//! `candle_amp::nn` layer's output (by VarBuilder path, e.g. `blocks.0.ffn.up`), each
//! `candle_amp::ops` op's output outside those layers (`matmul#2`: op and call index in the
//! step), the loss, and per trained parameter its working value, its raw (still scaled)
//! gradient and its f32 master gradient (whose half-type limits are compared at the loss
//! scale). A gradient one of the library's products made is also measured in f32 before
//! its rounding to half (`kernels::capture`), so one that rounds to an exact 0 counts as
//! underflow; gradients are kept per loss scaler, and each scaler is diagnosed from its own.
//! On the device path the statistics stay on the device until the end of the backward and
//! are read in one transfer per observed step (counted in [`Amp::host_syncs`]).
//! [`Doctor::report`] folds that into a [`DoctorReport`] with
//! [`Recommendation`]s; [`Doctor::apply`] carries them out in a live run where that is
//! possible (layers kept in f32, O1 op registrations, the loss scaler's range) and lists
//! what needs a new run (bf16, f32 master weights). With `auto_fallback` at O1, a layer whose
//! outputs stay out of the half type's range switches to f32 on its own (and back), and the
//! run saves the switch in checkpoints.
//!
//! Cause, not consequence: in a step where some activation became inf/NaN, only the first
//! one in forward order is a cause (its layer is named); the inf/NaN downstream, in the
//! loss and in every gradient are not. A raw gradient that is inf/NaN with a finite forward
//! names its parameter and gives the loss-scale range that avoids it.
//!
//! Off (no doctor attached) each layer and op pays a thread-local read and one branch.
//!
//! ```
//! use candle_amp::{self as amp, doctor::{Doctor, DoctorConfig}};
//! use candle_core::{DType, Device, Tensor};
//! # fn main() -> anyhow::Result<()> {
//! // A layer whose outputs exceed f16's range at O1.
//! let (model, mut opt, amp) = amp::initialize(
//!     |vb| amp::nn::linear(4, 2, vb.pp("big")),
//!     amp::optim::Sgd::new(amp::optim::SgdConfig::new(1e-9))?,
//!     amp::AmpConfig::new(amp::OptLevel::O1).verbosity(0),
//! )?;
//! let doctor = Doctor::attach(&amp, DoctorConfig { every: 1, ..Default::default() })?;
//! let x = (Tensor::ones((8, 4), DType::F32, &Device::Cpu)? * 1e5)?;
//! for _ in 0..2 {
//!     let loss = model.forward(&x)?.sqr()?.mean_all()?;
//!     amp.scale_loss(&loss, &mut opt)?.backward()?;
//!     opt.step()?;
//!     opt.zero_grad();
//! }
//! let report = doctor.report();
//! assert_eq!(report.recommendations[0].target, "big");        // the cause, not the NaN loss
//! doctor.apply(&amp)?;                                          // keeps `big` in f32
//! assert_eq!(amp.f32_layers(), vec!["big".to_string()]);
//! let loss = model.forward(&x)?.sqr()?.mean_all()?;
//! assert!(loss.to_scalar::<f32>()?.is_finite());
//! # Ok(()) }
//! ```

mod diagnose;
mod fallback;
mod gradients;
mod recommendation;
mod recorder;
mod report;
mod stats;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use recommendation::{Action, Problem, Recommendation, Severity};
pub use recorder::SwitchEvent;
pub use report::{DoctorReport, ScalePoint, TensorReport};
pub use stats::{BF16_MIN_NORMAL, F16_MAX, F16_MIN_NORMAL, TensorStats};

use crate::amp::Amp;
use crate::error::{AmpError, Result};
use crate::precision::autocast::CastPolicy;
use crate::precision::recording::Observer;
pub use crate::precision::recording::TensorKind;
use crate::scaling::LossScale;
use crate::train::run::RunState;
use recorder::Recorder;

/// The doctor's thresholds and rules, as data (like Transformer Engine's recipes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DoctorConfig {
    /// Record every `every`-th step (10); the first step is always recorded.
    pub every: u64,
    /// Underflow fraction above which a tensor is flagged and the fallback switches (0.05,
    /// Transformer Engine's `AutoswitchGemm` default).
    pub threshold: f64,
    /// Overflow fraction above which a tensor is flagged (0: any value above 65504).
    pub overflow_threshold: f64,
    /// Observations the fallback looks at (3): all of them must be out of range to switch.
    pub window: usize,
    /// Underflow fraction below which a switched layer goes back to half (0.01), in every
    /// observation of a window, with no overflow.
    pub switch_back: f64,
    /// The automatic fallback at O1 (off by default).
    pub auto_fallback: bool,
    /// Binades of headroom below f16's largest value kept by the recommended loss-scale
    /// ceiling (1: the largest gradient times the scale stays below 65504/2).
    pub margin: u32,
    /// Points of the loss-scale history kept (1024; thinned beyond).
    pub history: usize,
    /// Fraction of exact zeros (on average over the observations) at or above which a
    /// parameter's gradient under a static loss scale counts as vanished (1: entirely zero).
    #[serde(default = "default_zero_gradient")]
    pub zero_gradient: f64,
}

fn default_zero_gradient() -> f64 {
    1.0
}

impl Default for DoctorConfig {
    fn default() -> Self {
        Self {
            every: 10,
            threshold: 0.05,
            overflow_threshold: 0.0,
            window: 3,
            switch_back: 0.01,
            auto_fallback: false,
            margin: 1,
            history: 1024,
            zero_gradient: default_zero_gradient(),
        }
    }
}

impl DoctorConfig {
    fn check(&self) -> Result<()> {
        let bad = |argument: &'static str, reason: &str| {
            Err(AmpError::InvalidArgument {
                argument,
                reason: reason.to_string(),
            })
        };
        if self.every == 0 {
            return bad("every", "record every k-th step with k >= 1");
        }
        for (name, v) in [
            ("threshold", self.threshold),
            ("overflow_threshold", self.overflow_threshold),
            ("switch_back", self.switch_back),
            ("zero_gradient", self.zero_gradient),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return bad(name, "a fraction in [0, 1]");
            }
        }
        if self.switch_back > self.threshold {
            return bad(
                "switch_back",
                "must not exceed `threshold` (or a layer would switch back and forth)",
            );
        }
        if self.window == 0 {
            return bad("window", "at least one observation");
        }
        if self.history < 4 {
            return bad("history", "at least 4 points");
        }
        if self.margin > 15 {
            return bad("margin", "at most 15 binades (f16 has 30)");
        }
        Ok(())
    }
}

/// What [`Doctor::apply`] did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    /// Carried out in the run.
    pub applied: Vec<Recommendation>,
    /// Needing a new run (bf16, f32 master weights, an op registration at a level that
    /// does not autocast).
    pub needs_new_run: Vec<Recommendation>,
}

/// The numerics doctor attached to a run. Dropping it (or [`detach`](Self::detach))
/// removes its recorder; what it applied stays.
///
/// Attach it to the handle, train as usual, then read the [`report`](Self::report) (which
/// tensors leave the half type's range, what to keep in f32) or [`apply`](Self::apply) its
/// recommendations:
///
/// ```
/// use candle_amp::{self as amp, doctor::{Doctor, DoctorConfig}};
/// use candle_core::{DType, Device, Tensor};
///
/// # fn main() -> anyhow::Result<()> {
/// let (model, mut opt, amp) = amp::initialize(
///     |vb| amp::nn::linear(4, 3, vb.pp("fc")),
///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
///     amp::OptLevel::O2,
/// )?;
/// let doctor = Doctor::attach(&amp, DoctorConfig { every: 1, ..DoctorConfig::default() })?;
/// let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
/// let y = Tensor::new(&[0u32, 1, 2, 0, 1, 2, 0, 1], &Device::Cpu)?;
/// for _ in 0..3 {
///     let loss = amp::ops::cross_entropy(&model.forward(&x)?, &y)?;
///     amp.scale_loss(&loss, &mut opt)?.backward()?;
///     opt.step()?;
///     opt.zero_grad();
/// }
/// let report = doctor.report();
/// assert_eq!((report.steps, report.steps_observed), (3, 3));
/// assert!(report.tensors.iter().any(|t| t.name == "fc"));     // the layer's output
/// let applied = doctor.apply(&amp)?;                          // what it recommends, done
/// assert!(applied.applied.len() + applied.needs_new_run.len() == report.recommendations.len());
/// # Ok(()) }
/// ```
pub struct Doctor {
    recorder: Arc<Recorder>,
    run: Arc<RunState>,
}

impl std::fmt::Debug for Doctor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Doctor").field("config", &self.recorder.cfg).finish()
    }
}

impl Doctor {
    /// Attaches a doctor to `amp`'s run (replacing one attached before). The next step is
    /// recorded. Layers the run already keeps in f32 by the automatic fallback (restored
    /// from a checkpoint) count as its switches, so they can switch back.
    pub fn attach(amp: &Amp, config: DoctorConfig) -> Result<Doctor> {
        config.check()?;
        let run = amp.run().clone();
        let rec = Arc::new(Recorder::new(
            config,
            run.props.half.dtype(),
            run.props.patch_functions,
            run.device_path(),
            Arc::downgrade(&run),
            fallback::decide,
        ));
        {
            let mut st = rec.lock();
            for (layer, origin) in run.casts.f32_layers() {
                if origin == "auto" {
                    st.fallback.switched.insert(layer);
                }
            }
        }
        run.casts.set_observer(Some(rec.clone() as Arc<dyn Observer>));
        Ok(Doctor { recorder: rec, run })
    }

    /// Removes the recorder from the run (also done on drop).
    pub fn detach(self) {}

    /// The configuration.
    pub fn config(&self) -> &DoctorConfig {
        &self.recorder.cfg
    }

    /// What the doctor saw so far and recommends. On the device path, records of a step
    /// still in progress (a forward whose backward has not ended) are read first, in one
    /// transfer.
    pub fn report(&self) -> DoctorReport {
        self.recorder.flush();
        let props = &self.run.props;
        let f32_layers = self.run.casts.f32_layers();
        let scalers: Vec<diagnose::Scaler> = self
            .run
            .scalers_mut()
            .iter()
            .map(|s| diagnose::Scaler {
                scale: s.state.scale.scale(),
                dynamic: s.state.scale.is_dynamic(),
            })
            .collect();
        let st = self.recorder.lock();
        let recommendations = diagnose::diagnose(&self.recorder.cfg, props, &st, &f32_layers, &scalers);
        let bf16 = props.half == crate::HalfType::Bf16;
        let mut tensors: Vec<(u64, TensorReport)> = st
            .tensors
            .iter()
            .map(|((n, _, _), a)| (a.order, TensorReport::summary(n, a)))
            .collect();
        tensors.sort_by(|(oa, a), (ob, b)| b.badness(bf16).total_cmp(&a.badness(bf16)).then(oa.cmp(ob)));
        let tensors = tensors.into_iter().map(|(_, t)| t).collect();
        DoctorReport {
            opt_level: props.opt_level.to_string(),
            half: props.half.to_string(),
            steps: st.step,
            steps_observed: st.observed,
            every: self.recorder.cfg.every,
            skipped_steps: st.skipped_steps,
            tensors,
            recommendations,
            switches: st.fallback.events.iter().cloned().collect(),
            f32_layers,
            loss_scale: st
                .scales
                .iter()
                .map(|&(step, scale, skipped)| ScalePoint { step, scale, skipped })
                .collect(),
        }
    }

    /// The current recommendations (the report's).
    pub fn recommendations(&self) -> Vec<Recommendation> {
        self.report().recommendations
    }

    /// The automatic fallback's switches so far.
    pub fn switches(&self) -> Vec<SwitchEvent> {
        self.recorder.switches()
    }

    /// Carries out the current recommendations in `amp`'s run (this doctor's run or a new
    /// one of the same model): see [`apply`].
    pub fn apply(&self, amp: &Amp) -> Result<Applied> {
        apply(amp, &self.recommendations())
    }
}

impl Drop for Doctor {
    fn drop(&mut self) {
        let mine: Arc<dyn Observer> = self.recorder.clone();
        if self.run.casts.observer().is_some_and(|o| Arc::ptr_eq(&o, &mine)) {
            self.run.casts.set_observer(None);
        }
    }
}

/// Carries out `recs` (warnings and errors; `Info` ones are alternatives and are left out)
/// in `amp`'s run: layers kept in f32 ([`Amp::keep_layer_f32`]), ops registered in f32 at O1
/// ([`Amp::register_op`]), a loss scaler's scale, floor and ceiling (made dynamic, its
/// growth and backoff settings kept). What needs a new run is returned, not done. A
/// recommendation naming a loss scaler the run does not have is an
/// [`AmpError::LossId`], before anything changes.
pub fn apply(amp: &Amp, recs: &[Recommendation]) -> Result<Applied> {
    let run = amp.run();
    for r in recs {
        if let Action::LossScale {
            loss_id,
            init,
            min,
            max,
        } = &r.action
        {
            run.check_loss_id(*loss_id)?;
            LossScale::dynamic(&run.props.dynamic, *min, *max)?;
            if !(init.is_finite() && *init > 0.0) {
                return Err(AmpError::InvalidArgument {
                    argument: "init",
                    reason: format!("a loss scale must be finite and > 0, got {init}"),
                });
            }
        }
    }
    let mut applied = Vec::new();
    let mut needs_new_run = Vec::new();
    for r in recs.iter().filter(|r| r.severity > Severity::Info) {
        if !r.action.applies_in_place(&run.props) {
            needs_new_run.push(r.clone());
            continue;
        }
        match &r.action {
            Action::KeepLayerF32 { layer } => {
                run.casts.set_f32_layer(layer, Some("doctor"));
            }
            Action::KeepOpF32 { op } => amp.register_op(op, CastPolicy::Float),
            Action::LossScale {
                loss_id,
                init,
                min,
                max,
            } => {
                let mut params = run.props.dynamic;
                params.init_scale = init.clamp(*min, *max);
                let scale = LossScale::dynamic(&params, *min, *max)?;
                run.scalers_mut()[*loss_id].state.scale = scale;
            }
            // Filtered above: they need a new run.
            Action::UseBf16 | Action::UseMasterWeights => continue,
        }
        log::info!("doctor: applied {}", r.action);
        applied.push(r.clone());
    }
    Ok(Applied { applied, needs_new_run })
}
