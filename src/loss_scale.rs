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

use serde::{Deserialize, Serialize};

use crate::opt_level::{DynamicParams, LossScaleSpec, Properties};

/// State of a dynamic loss scale.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicLossScale {
    /// The current scale.
    #[serde(with = "crate::serde_f32")]
    pub scale: f32,
    /// Clean steps since the last growth or overflow.
    pub growth_tracker: u32,
    /// Clean steps needed to grow.
    pub growth_interval: u32,
    /// Growth multiplier (> 1).
    #[serde(with = "crate::serde_f32")]
    pub growth_factor: f32,
    /// Backoff multiplier (in (0, 1)).
    #[serde(with = "crate::serde_f32")]
    pub backoff_factor: f32,
    /// Floor.
    #[serde(with = "crate::serde_f32")]
    pub min_scale: f32,
    /// Ceiling.
    #[serde(with = "crate::serde_f32")]
    pub max_scale: f32,
    /// Hysteresis budget when full (1 = no hysteresis).
    pub hysteresis: u32,
    /// Hysteresis budget left.
    pub hysteresis_left: u32,
    /// Restore the budget on every clean step, not only at growth.
    pub consecutive_hysteresis: bool,
}

/// A loss scale: static or dynamic. See the module documentation for the algorithm.
///
/// ```
/// use candle_amp::loss_scale::{DynamicLossScale, LossScale};
/// let mut s = LossScale::Dynamic(DynamicLossScale {
///     scale: 4.0, growth_tracker: 0, growth_interval: 2, growth_factor: 2.0,
///     backoff_factor: 0.25, min_scale: 0.0, max_scale: f32::INFINITY,
///     hysteresis: 1, hysteresis_left: 1, consecutive_hysteresis: false,
/// });
/// s.adjust(true);
/// assert_eq!(s.scale(), 4.0);
/// s.adjust(true);
/// assert_eq!(s.scale(), 8.0);
/// s.adjust(false);
/// assert_eq!(s.scale(), 2.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LossScale {
    /// A scale that never changes.
    Static {
        /// The scale.
        #[serde(with = "crate::serde_f32")]
        scale: f32,
    },
    /// A scale that backs off on overflow and grows after clean intervals.
    Dynamic(DynamicLossScale),
}

impl LossScale {
    /// A dynamic scale from parameters, floor and ceiling.
    pub fn dynamic(p: &DynamicParams, min_scale: f32, max_scale: f32) -> Self {
        LossScale::Dynamic(DynamicLossScale {
            // max/min rather than clamp: clamp panics on an inverted or NaN range.
            scale: p.init_scale.max(min_scale).min(max_scale),
            growth_tracker: 0,
            growth_interval: p.growth_interval,
            growth_factor: p.growth_factor,
            backoff_factor: p.backoff_factor,
            min_scale,
            max_scale,
            hysteresis: p.hysteresis,
            hysteresis_left: p.hysteresis,
            consecutive_hysteresis: p.consecutive_hysteresis,
        })
    }

    /// The scale a run's properties ask for.
    pub fn from_properties(p: &Properties) -> Self {
        match p.loss_scale {
            LossScaleSpec::Static(s) => LossScale::Static { scale: s },
            LossScaleSpec::Dynamic => Self::dynamic(&p.dynamic, p.min_loss_scale, p.max_loss_scale),
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        match self {
            LossScale::Static { scale } => *scale,
            LossScale::Dynamic(d) => d.scale,
        }
    }

    /// The factor gradients are multiplied by: `1/scale` computed in f64 then rounded to f32,
    /// as PyTorch does (a zero scale unscales by infinity, making every gradient non-finite).
    pub fn unscale_factor(&self) -> f32 {
        (1.0f64 / self.scale() as f64) as f32
    }

    /// Whether the scale changes with overflows.
    pub fn is_dynamic(&self) -> bool {
        matches!(self, LossScale::Dynamic(_))
    }

    /// Updates the scale after one optimizer step; `finite` says whether every gradient (and
    /// the loss) was finite. Returns whether the scale changed.
    pub fn adjust(&mut self, finite: bool) -> bool {
        let LossScale::Dynamic(d) = self else {
            return false;
        };
        let before = d.scale;
        if finite {
            d.growth_tracker = d.growth_tracker.saturating_add(1);
            if d.consecutive_hysteresis {
                d.hysteresis_left = d.hysteresis;
            }
            if d.growth_tracker >= d.growth_interval {
                d.growth_tracker = 0;
                let grown = d.scale * d.growth_factor;
                if grown.is_finite() {
                    d.scale = grown.min(d.max_scale);
                }
                d.hysteresis_left = d.hysteresis;
            }
        } else {
            d.growth_tracker = 0;
            if d.hysteresis_left > 1 {
                d.hysteresis_left -= 1;
            } else {
                d.scale = (d.scale * d.backoff_factor).max(d.min_scale);
            }
        }
        d.scale != before
    }

    /// Whether a dynamic scale sits at its floor (always true for a static scale, which
    /// cannot back off any further).
    pub fn at_floor(&self) -> bool {
        match self {
            LossScale::Static { .. } => true,
            LossScale::Dynamic(d) => d.scale <= d.min_scale,
        }
    }
}
