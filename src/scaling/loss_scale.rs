//! The loss scale: a small value type with `scale`, `unscale` and `adjust(finite)`.
//!
//! # Algorithm (dynamic)
//!
//! The loss is multiplied by `scale` before backward so that small half-precision gradients
//! do not flush to zero; gradients are multiplied by `1/scale` (in f32) before the optimizer
//! sees them. After each optimizer step [`LossScale::adjust`] is told whether every gradient
//! was finite:
//!
//! * not finite: the growth tracker resets to 0. If hysteresis budget is left
//!   (`hysteresis_left > 1`), one unit is used up and the scale stays (DeepSpeed's rule);
//!   otherwise `scale = max(scale * backoff_factor, min_scale)`.
//! * finite: `tracker += 1`; when it reaches `growth_interval` it resets to 0 and, if
//!   `scale * growth_factor` is finite, `scale = min(scale * growth_factor, max_scale)`
//!   (PyTorch never grows into infinity); growth restores the hysteresis budget (every clean
//!   step restores it with `consecutive_hysteresis`).
//!
//! The scale is held as `f32`, as PyTorch does, so trajectories compare exactly with it; with
//! `min_scale = 0` and `max_scale = inf` the arithmetic is PyTorch's `_amp_update_scale`.
//! A static scale never changes; the caller still skips steps whose gradients are not finite.
//!
//! A `LossScale` is only made through [`LossScale::fixed`] and [`LossScale::dynamic`], which
//! check their arguments, so every value of the type is a valid scale.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{AmpError, Result};

/// How the loss is scaled (a property of an opt level).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LossScaleSpec {
    /// A fixed scale (1.0 disables scaling). Non-finite gradients still skip the step.
    Static(#[serde(with = "crate::serde_f32")] f32),
    /// Dynamic scaling: see [`LossScale`].
    Dynamic,
}

impl fmt::Display for LossScaleSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossScaleSpec::Static(s) => write!(f, "{s}"),
            LossScaleSpec::Dynamic => f.write_str("dynamic"),
        }
    }
}

impl FromStr for LossScaleSpec {
    type Err = AmpError;
    /// Parses `"dynamic"` or a positive number such as `"128.0"`, as Apex's `loss_scale` does.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("dynamic") {
            return Ok(LossScaleSpec::Dynamic);
        }
        match t.parse::<f32>() {
            Ok(v) if v.is_finite() && v > 0.0 => Ok(LossScaleSpec::Static(v)),
            _ => Err(AmpError::Parse {
                what: "loss scale",
                input: s.to_string(),
                expected: "\"dynamic\" or a finite number > 0",
            }),
        }
    }
}

/// Dynamic loss-scaling parameters (the defaults are Apex's and PyTorch's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicParams {
    /// The first scale (2^16).
    #[serde(with = "crate::serde_f32")]
    pub init_scale: f32,
    /// Multiplier applied after `growth_interval` clean steps (2.0).
    #[serde(with = "crate::serde_f32")]
    pub growth_factor: f32,
    /// Multiplier applied on overflow (0.5).
    #[serde(with = "crate::serde_f32")]
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows (2000).
    pub growth_interval: u32,
    /// DeepSpeed's hysteresis: overflows tolerated (minus one) before backing off (1 = none).
    pub hysteresis: u32,
    /// Restore the hysteresis budget on every clean step rather than only at growth.
    pub consecutive_hysteresis: bool,
}

impl DynamicParams {
    /// The first out-of-range value, as (name, what is required); `None` when all are fine.
    pub(crate) fn problem(&self) -> Option<(&'static str, &'static str)> {
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return Some(("init_scale", "the initial scale must be finite and > 0"));
        }
        if self.growth_factor.is_nan() || self.growth_factor <= 1.0 {
            return Some(("growth_factor", "the growth factor must be > 1"));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Some(("backoff_factor", "the backoff factor must be in (0, 1)"));
        }
        if self.growth_interval == 0 {
            return Some(("growth_interval", "the growth interval must be at least 1"));
        }
        if self.hysteresis == 0 {
            return Some(("hysteresis", "hysteresis must be at least 1 (1 = none)"));
        }
        None
    }
}

impl Default for DynamicParams {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            consecutive_hysteresis: false,
        }
    }
}

/// A dynamic scale's state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Dynamic {
    #[serde(with = "crate::serde_f32")]
    scale: f32,
    growth_tracker: u32,
    hysteresis_left: u32,
    params: DynamicParams,
    #[serde(with = "crate::serde_f32")]
    min_scale: f32,
    #[serde(with = "crate::serde_f32")]
    max_scale: f32,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
enum Kind {
    Static(#[serde(with = "crate::serde_f32")] f32),
    Dynamic(Dynamic),
}

/// A loss scale: static or dynamic. See the module documentation for the algorithm.
///
/// ```
/// use candle_amp::{DynamicParams, LossScale};
/// # fn main() -> candle_amp::Result<()> {
/// let p = DynamicParams { init_scale: 4.0, growth_interval: 2, backoff_factor: 0.25, ..Default::default() };
/// let mut s = LossScale::dynamic(&p, 0.0, f32::INFINITY)?;
/// s.adjust(true);
/// assert_eq!((s.scale(), s.growth_tracker()), (4.0, 1));
/// s.adjust(true);
/// assert_eq!((s.scale(), s.growth_tracker()), (8.0, 0));
/// s.adjust(false);
/// assert_eq!(s.scale(), 2.0);
/// assert!(LossScale::dynamic(&DynamicParams { growth_factor: 1.0, ..p }, 0.0, 1.0).is_err());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScale(Kind);

impl LossScale {
    /// A scale that never changes: finite and > 0.
    pub fn fixed(scale: f32) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(AmpError::InvalidArgument {
                argument: "scale",
                reason: format!("a static scale must be finite and > 0, got {scale}"),
            });
        }
        Ok(LossScale(Kind::Static(scale)))
    }

    /// A dynamic scale from parameters, floor and ceiling (`0 <= min_scale <= max_scale`; `0`
    /// and infinity are PyTorch's). The first scale is `init_scale` brought into the bounds.
    pub fn dynamic(params: &DynamicParams, min_scale: f32, max_scale: f32) -> Result<Self> {
        if let Some((argument, reason)) = params.problem() {
            return Err(AmpError::InvalidArgument {
                argument,
                reason: reason.into(),
            });
        }
        if min_scale.is_nan() || max_scale.is_nan() || min_scale < 0.0 || min_scale > max_scale {
            return Err(AmpError::InvalidArgument {
                argument: "min_scale",
                reason: format!("need 0 <= min_scale <= max_scale, got {min_scale} and {max_scale}"),
            });
        }
        Ok(Self::dynamic_unchecked(params, min_scale, max_scale))
    }

    /// [`dynamic`](Self::dynamic) for arguments the caller has checked.
    pub(crate) fn dynamic_unchecked(params: &DynamicParams, min_scale: f32, max_scale: f32) -> Self {
        LossScale(Kind::Dynamic(Dynamic {
            // max/min rather than clamp: clamp panics on an inverted or NaN range.
            scale: params.init_scale.max(min_scale).min(max_scale),
            growth_tracker: 0,
            hysteresis_left: params.hysteresis,
            params: *params,
            min_scale,
            max_scale,
        }))
    }

    /// The scale a spec asks for ([`LossScaleSpec::Static`] values are checked by the config).
    pub(crate) fn from_spec(spec: LossScaleSpec, params: &DynamicParams, min_scale: f32, max_scale: f32) -> Self {
        match spec {
            LossScaleSpec::Static(s) => LossScale(Kind::Static(s)),
            LossScaleSpec::Dynamic => Self::dynamic_unchecked(params, min_scale, max_scale),
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        match &self.0 {
            Kind::Static(s) => *s,
            Kind::Dynamic(d) => d.scale,
        }
    }

    /// Whether the scale changes with overflows.
    pub fn is_dynamic(&self) -> bool {
        matches!(self.0, Kind::Dynamic(_))
    }

    /// Clean steps since the last growth or overflow (0 for a static scale).
    pub fn growth_tracker(&self) -> u32 {
        match &self.0 {
            Kind::Static(_) => 0,
            Kind::Dynamic(d) => d.growth_tracker,
        }
    }

    /// Overflows still tolerated before the next backoff, plus one (1 = the next overflow
    /// backs off; always 1 for a static scale).
    pub fn hysteresis_left(&self) -> u32 {
        match &self.0 {
            Kind::Static(_) => 1,
            Kind::Dynamic(d) => d.hysteresis_left,
        }
    }

    /// A dynamic scale's parameters (`init_scale` is the one it started from); `None` for a
    /// static scale.
    pub fn params(&self) -> Option<DynamicParams> {
        match &self.0 {
            Kind::Static(_) => None,
            Kind::Dynamic(d) => Some(d.params),
        }
    }

    /// The floor and ceiling of a dynamic scale (a static scale is its own bounds).
    pub fn bounds(&self) -> (f32, f32) {
        match &self.0 {
            Kind::Static(s) => (*s, *s),
            Kind::Dynamic(d) => (d.min_scale, d.max_scale),
        }
    }

    /// Sets a dynamic scale's value, leaving the tracker alone (PyTorch's
    /// `update(new_scale)`); a static scale does not change.
    pub(crate) fn set_scale(&mut self, scale: f32) {
        if let Kind::Dynamic(d) = &mut self.0 {
            d.scale = scale;
        }
    }

    /// Takes another scale's progress while keeping these settings: where both are dynamic,
    /// the scale (clamped into this floor and ceiling), the growth tracker and the hysteresis
    /// left. Returns whether anything was taken.
    pub(crate) fn restore_progress(&mut self, saved: &LossScale) -> bool {
        if let (Kind::Dynamic(d), Kind::Dynamic(s)) = (&mut self.0, &saved.0) {
            // max/min rather than clamp: clamp panics on an inverted range.
            d.scale = s.scale.max(d.min_scale).min(d.max_scale);
            d.growth_tracker = s.growth_tracker;
            d.hysteresis_left = s.hysteresis_left.clamp(1, d.params.hysteresis.max(1));
            return true;
        }
        false
    }

    /// Takes a saved PyTorch-style state: scale and tracker (kept below the interval).
    pub(crate) fn restore_pytorch(&mut self, scale: f32, growth_tracker: u32) {
        if let Kind::Dynamic(d) = &mut self.0 {
            d.scale = scale;
            d.growth_tracker = growth_tracker.min(d.params.growth_interval);
        }
    }

    /// Updates the scale after one optimizer step; `finite` says whether every gradient (and
    /// the loss) was finite. Returns whether the scale changed.
    pub fn adjust(&mut self, finite: bool) -> bool {
        let Kind::Dynamic(d) = &mut self.0 else {
            return false;
        };
        let before = d.scale;
        if finite {
            d.growth_tracker = d.growth_tracker.saturating_add(1);
            if d.params.consecutive_hysteresis {
                d.hysteresis_left = d.params.hysteresis;
            }
            if d.growth_tracker >= d.params.growth_interval {
                d.growth_tracker = 0;
                let grown = d.scale * d.params.growth_factor;
                if grown.is_finite() {
                    d.scale = grown.min(d.max_scale);
                }
                d.hysteresis_left = d.params.hysteresis;
            }
        } else {
            d.growth_tracker = 0;
            if d.hysteresis_left > 1 {
                d.hysteresis_left -= 1;
            } else {
                d.scale = (d.scale * d.params.backoff_factor).max(d.min_scale);
            }
        }
        d.scale != before
    }
}
