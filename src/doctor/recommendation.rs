//! What the doctor recommends, as data: the problem, its severity, the action that fixes it
//! (which `Doctor::apply` carries out), and the figure behind it. The rules that produce
//! them are in `diagnose` and `gradients`.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::precision::opt_level::Properties;

/// What went wrong, as a recommendation states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Problem {
    /// Values below the half type's smallest normal (subnormal or flushed to zero).
    Underflow,
    /// Values above f16's largest finite value (they become inf).
    Overflow,
    /// A raw gradient overflowed at the loss scale (the step was skipped).
    GradientOverflow,
    /// Gradients underflow at the loss scale.
    GradientUnderflow,
    /// More binades than f16 has: no loss scale fits the gradients.
    Range,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Problem::Underflow => "underflow",
            Problem::Overflow => "overflow",
            Problem::GradientOverflow => "gradient overflow",
            Problem::GradientUnderflow => "gradient underflow",
            Problem::Range => "range",
        })
    }
}

/// How bad it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// An alternative, or what would happen at another level.
    Info,
    /// Precision is lost.
    Warning,
    /// Steps are skipped or values become inf/NaN.
    Error,
}

/// What to do: data that [`super::apply`] (or [`super::Doctor::apply`]) carries out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Keep a layer in f32 ([`crate::Amp::keep_layer_f32`]; in place at every level).
    KeepLayerF32 {
        /// The layer's VarBuilder path.
        layer: String,
    },
    /// Run an op in f32 at O1 (`amp.register_op(op, CastPolicy::Float)`; other levels do not
    /// autocast, so it applies there only through a new run at O1).
    KeepOpF32 {
        /// The op name (every call of it).
        op: String,
    },
    /// Loss scaler `loss_id`: start at `init` and stay within `[min, max]` (dynamic).
    LossScale {
        /// The scaler.
        loss_id: usize,
        /// The scale to set now.
        #[serde(with = "crate::serde_f32")]
        init: f32,
        /// The floor.
        #[serde(with = "crate::serde_f32")]
        min: f32,
        /// The ceiling.
        #[serde(with = "crate::serde_f32")]
        max: f32,
    },
    /// Use bf16 as the half type (`AmpConfig::half(HalfType::Bf16)`): needs a new run.
    UseBf16,
    /// Keep f32 master weights (O2 instead of O3): needs a new run.
    UseMasterWeights,
}

impl Action {
    /// Whether [`super::apply`] can carry it out in a live run at these properties.
    pub fn applies_in_place(&self, props: &Properties) -> bool {
        match self {
            Action::KeepLayerF32 { .. } | Action::LossScale { .. } => true,
            Action::KeepOpF32 { .. } => props.patch_functions,
            Action::UseBf16 | Action::UseMasterWeights => false,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::KeepLayerF32 { layer } => write!(f, "keep layer `{layer}` in f32"),
            Action::KeepOpF32 { op } => write!(f, "register_op(\"{op}\", CastPolicy::Float)"),
            Action::LossScale {
                loss_id,
                init,
                min,
                max,
            } => {
                write!(f, "loss scaler {loss_id}: scale {init}, within [{min}, {max}]")
            }
            Action::UseBf16 => f.write_str("use bf16 (a new run)"),
            Action::UseMasterWeights => f.write_str("keep f32 master weights: O2 (a new run)"),
        }
    }
}

/// One recommendation: what to change, on what, why (with the figures).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    /// What it is about: a layer, an op (`op#call`), a parameter, `loss_scale` or `half`.
    pub target: String,
    /// What to do.
    pub action: Action,
    /// Why, with the figure behind it.
    pub reason: String,
    /// The problem seen.
    pub problem: Problem,
    /// How bad it is.
    pub severity: Severity,
}

impl fmt::Display for Recommendation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "ERROR",
            Severity::Warning => "WARN ",
            Severity::Info => "info ",
        };
        write!(
            f,
            "{sev} {}: {} ({}: {})",
            self.target, self.action, self.problem, self.reason
        )
    }
}

pub(crate) fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The largest power of two `<= x`, within `[2^-24, 2^24]`.
pub(crate) fn pow2_floor(x: f64) -> f32 {
    2f64.powi(x.log2().floor().clamp(-24.0, 24.0) as i32) as f32
}
