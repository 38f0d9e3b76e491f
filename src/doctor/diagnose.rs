//! From the recorded statistics to recommendations: what to keep in f32, which loss-scale
//! range the gradients fit, whether bf16 is the safer half type. Each rule's thresholds are
//! in [`DoctorConfig`]; every recommendation carries the figure behind it.

use candle_core::DType;

use super::DoctorConfig;
use super::fallback::is_layer;
pub(crate) use super::gradients::Scaler;
use super::recommendation::pct;
use super::recommendation::{Action, Problem, Recommendation, Severity};
use super::recorder::{Aggregate, State};
use crate::precision::opt_level::Properties;
use crate::precision::recording::TensorKind;

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
