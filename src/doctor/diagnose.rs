//! From the recorded statistics to recommendations: what to keep in f32, which loss-scale
//! range the gradients fit, whether bf16 is the safer half type. Each rule's thresholds are
//! in [`DoctorConfig`]; every recommendation carries the figure behind it.

use std::fmt;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::DoctorConfig;
use super::fallback::is_layer;
pub(crate) use super::gradients::Scaler;
use super::recorder::{Aggregate, State};
use crate::precision::opt_level::Properties;
use crate::precision::recording::TensorKind;

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

/// The run-type underflow fraction of an aggregate (means over observations).
fn underflow(a: &Aggregate, half: DType) -> f64 {
    let n = a.observations.max(1) as f64;
    if half == DType::BF16 {
        a.sum_underbf / n
    } else {
        a.sum_under16 / n
    }
}

/// The recommendations for what the recorder saw.
pub(crate) fn diagnose(
    cfg: &DoctorConfig,
    props: &Properties,
    st: &State,
    f32_layers: &std::collections::BTreeMap<String, String>,
    scalers: &[Scaler],
) -> Vec<Recommendation> {
    let half = props.half.dtype();
    let f16 = half == DType::F16;
    // At O0 (nothing in half) the rules say what would happen in the half type.
    let what_if = props.cast_model_type.is_none_or(|t| t == DType::F32) && !props.patch_functions;
    let mut recs = Vec::new();
    let mut half_trouble = Vec::new();
    let mut acts: Vec<(&String, &Aggregate)> = st
        .tensors
        .iter()
        .filter(|(_, a)| a.kind == TensorKind::Activation)
        .map(|((n, _, _), a)| (n, a))
        .collect();
    acts.sort_by_key(|(_, a)| a.order);
    for (name, a) in acts {
        let layer = is_layer(name);
        if layer && f32_layers.contains_key(name.as_str()) {
            continue;
        }
        let in_half = a.dtype == half;
        if !in_half && !what_if {
            continue;
        }
        let n = a.observations.max(1) as f64;
        let over = a.sum_over16 / n;
        let under = underflow(a, half);
        let action = || {
            if layer {
                Action::KeepLayerF32 { layer: name.clone() }
            } else {
                Action::KeepOpF32 {
                    op: name.split('#').next().unwrap_or(name).to_string(),
                }
            }
        };
        let sev = |s: Severity| if what_if { Severity::Info } else { s };
        if f16 && (a.root_nonfinite > 0 || (what_if && a.worst_over16 > cfg.overflow_threshold)) {
            let reason = if a.root_nonfinite > 0 {
                format!(
                    "first inf/NaN of the forward in {} of {} observed steps ({} of its outputs above f16's max 65504 on average; largest finite {:.3e})",
                    a.root_nonfinite,
                    a.observations,
                    pct(over),
                    a.amax
                )
            } else {
                format!(
                    "{} of its outputs would exceed f16's max 65504 (largest {:.3e})",
                    pct(a.worst_over16),
                    a.amax
                )
            };
            half_trouble.push(name.clone());
            recs.push(Recommendation {
                target: name.clone(),
                action: action(),
                reason,
                problem: Problem::Overflow,
                severity: sev(Severity::Error),
            });
        } else if under > cfg.threshold {
            let amin = if a.amin_nonzero.is_finite() {
                a.amin_nonzero
            } else {
                0.0
            };
            half_trouble.push(name.clone());
            recs.push(Recommendation {
                target: name.clone(),
                action: action(),
                reason: format!(
                    "{} of its outputs below {}'s smallest normal {} (magnitudes {:.2e} to {:.2e}, mean {:.2e}; threshold {})",
                    pct(under),
                    props.half,
                    if f16 { "6.1e-5" } else { "1.2e-38" },
                    amin,
                    a.amax,
                    a.sum_mean_abs / n,
                    pct(cfg.threshold)
                ),
                problem: Problem::Underflow,
                severity: sev(Severity::Warning),
            });
        }
    }
    // Weights kept in half without masters (O3).
    if !props.master_weights && props.cast_model_type.is_some_and(|t| t == half) {
        let tiny: Vec<(&String, f64)> = st
            .tensors
            .iter()
            .filter(|(_, a)| a.kind == TensorKind::Weight && a.dtype == half)
            .map(|((n, _, _), a)| (n, underflow(a, half)))
            .filter(|(_, u)| *u > cfg.threshold)
            .collect();
        if let Some((worst, u)) = tiny.iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
            recs.push(Recommendation {
                target: (*worst).clone(),
                action: Action::UseMasterWeights,
                reason: format!(
                    "{} weight(s) have over {} of their values below {}'s smallest normal ({} for `{worst}`): updates to them are lost without f32 masters",
                    tiny.len(),
                    pct(cfg.threshold),
                    props.half,
                    pct(*u)
                ),
                problem: Problem::Underflow,
                severity: Severity::Warning,
            });
        }
    }
    // Each loss scaler from its own backwards' gradients and flags.
    let losses: std::collections::BTreeSet<usize> = st
        .tensors
        .values()
        .filter(|a| matches!(a.kind, TensorKind::MasterGrad | TensorKind::Grad))
        .map(|a| a.loss)
        .chain(st.overflowed_params.keys().map(|(l, _)| *l))
        .collect();
    for loss in losses {
        let scaler = scalers.get(loss).copied().unwrap_or(Scaler {
            scale: 1.0,
            dynamic: false,
        });
        if !what_if {
            super::gradients::zero_gradient_rule(cfg, props, st, loss, scaler, &mut recs);
        }
        if f16 {
            super::gradients::loss_scale_rules(cfg, props, st, loss, scaler.scale, what_if, &mut recs);
        }
    }
    if f16 && !half_trouble.is_empty() {
        let bf16_ok = half_trouble.iter().all(|n| {
            st.tensors
                .get(&(n.clone(), TensorKind::Activation, 0))
                .is_some_and(|a| a.sum_underbf / (a.observations.max(1) as f64) <= cfg.threshold)
        });
        if bf16_ok {
            recs.push(Recommendation {
                target: "half".into(),
                action: Action::UseBf16,
                reason: format!(
                    "bf16 has f32's range: {} would fit it ({}); a new run with AmpConfig::half(HalfType::Bf16)",
                    half_trouble.join(", "),
                    "no overflow, underflow below the threshold"
                ),
                problem: Problem::Range,
                severity: Severity::Info,
            });
        }
    }
    recs.sort_by_key(|r| std::cmp::Reverse(r.severity));
    recs
}
