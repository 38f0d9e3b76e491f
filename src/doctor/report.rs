//! The doctor's report: a serde value (the JSON the `train` example writes) whose `Display`
//! is a table sorted by severity.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::recommendation::Recommendation;
use super::recorder::{Aggregate, SwitchEvent};
use crate::precision::recording::TensorKind;

/// One tensor's statistics over the observed steps: means of the per-step fractions and
/// magnitudes, the largest `amax`, the smallest `amin_nonzero`, the total non-finite count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorReport {
    /// A layer's VarBuilder path, an op as `op#call`, a parameter's store name, or `loss`.
    pub name: String,
    /// What it is.
    pub kind: TensorKind,
    /// Gradients: the loss scaler whose backwards made them (0 for other tensors).
    #[serde(default)]
    pub loss_id: usize,
    /// The type it ran in (at its last observation).
    pub dtype: String,
    /// Observed steps in which it was recorded.
    pub observations: u64,
    /// Its number of elements (at its last observation).
    pub elements: u64,
    /// Largest finite magnitude.
    pub amax: f64,
    /// Smallest nonzero finite magnitude (0 if none).
    pub amin_nonzero: f64,
    /// Mean magnitude.
    pub mean_abs: f64,
    /// Fraction of exact zeros.
    pub zero_frac: f64,
    /// Fraction below f16's smallest normal (gradients: at the loss scale).
    pub underflow_f16: f64,
    /// Fraction below bf16's smallest normal.
    pub underflow_bf16: f64,
    /// Fraction above f16's largest finite value, infinities included.
    pub overflow_f16: f64,
    /// inf and NaN values, summed over the observations.
    pub nonfinite: u64,
    /// Largest dynamic range seen, in binades.
    pub range_binades: f64,
    /// Observations in which it was the first inf/NaN of its step (a cause, not a
    /// consequence).
    pub root_nonfinite: u64,
}

impl TensorReport {
    /// The report's statistics of one aggregate (means over the observations).
    pub(crate) fn summary(name: &str, a: &Aggregate) -> TensorReport {
        let n = a.observations.max(1) as f64;
        let amin = if a.amin_nonzero.is_finite() {
            a.amin_nonzero
        } else {
            0.0
        };
        TensorReport {
            name: name.to_string(),
            kind: a.kind,
            loss_id: a.loss,
            dtype: a.dtype.as_str().to_string(),
            observations: a.observations,
            elements: a.elements,
            amax: a.amax,
            amin_nonzero: amin,
            mean_abs: a.sum_mean_abs / n,
            zero_frac: a.sum_zero / n,
            underflow_f16: a.sum_under16 / n,
            underflow_bf16: a.sum_underbf / n,
            overflow_f16: a.sum_over16 / n,
            nonfinite: a.nonfinite,
            range_binades: a.range,
            root_nonfinite: a.root_nonfinite,
        }
    }

    /// How bad it looks in `half` (f16 unless `bf16`): first inf/NaN first, then the
    /// larger of the overflow and underflow fractions.
    pub fn badness(&self, bf16: bool) -> f64 {
        let under = if bf16 { self.underflow_bf16 } else { self.underflow_f16 };
        let over = if bf16 { 0.0 } else { self.overflow_f16 };
        (self.root_nonfinite > 0) as u8 as f64 * 10.0 + over.max(under)
    }
}

/// One point of the loss scale's history.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalePoint {
    /// The doctor's step: backward passes since it was attached, counting from 1 (as the
    /// `train` example's progress lines).
    pub step: u64,
    /// The scale the backward ran at.
    #[serde(with = "crate::serde_f32")]
    pub scale: f32,
    /// Whether that step was skipped.
    pub skipped: bool,
}

/// What the doctor saw and recommends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DoctorReport {
    /// The run's opt level (`"O1"`, ...).
    pub opt_level: String,
    /// The run's half type (`"f16"`, `"bf16"`).
    pub half: String,
    /// Backward passes since the doctor was attached.
    pub steps: u64,
    /// Steps whose tensors were recorded (every `every`-th).
    pub steps_observed: u64,
    /// The observation interval.
    pub every: u64,
    /// Steps skipped for inf/NaN gradients since the doctor was attached.
    pub skipped_steps: u64,
    /// Every recorded tensor, the worst first.
    pub tensors: Vec<TensorReport>,
    /// What to change, the most severe first.
    pub recommendations: Vec<Recommendation>,
    /// The automatic fallback's switches.
    pub switches: Vec<SwitchEvent>,
    /// Layers the run keeps in f32 now, with who asked.
    pub f32_layers: std::collections::BTreeMap<String, String>,
    /// The loss scale over the steps (thinned to a bounded length).
    pub loss_scale: Vec<ScalePoint>,
}

impl DoctorReport {
    /// The report as a JSON value (the object the `train` example writes).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

impl fmt::Display for DoctorReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "numerics doctor: {} {}, {} steps, {} observed (every {}), {} skipped",
            self.opt_level, self.half, self.steps, self.steps_observed, self.every, self.skipped_steps
        )?;
        if self.recommendations.is_empty() {
            writeln!(f, "recommendations: none")?;
        } else {
            writeln!(f, "recommendations:")?;
            for r in &self.recommendations {
                writeln!(f, "  {r}")?;
            }
        }
        for s in &self.switches {
            writeln!(
                f,
                "  fallback at step {}: {} -> {} ({})",
                s.step,
                s.layer,
                if s.to_f32 { "f32" } else { "half" },
                s.reason
            )?;
        }
        writeln!(
            f,
            "{:<28} {:<11} {:<5} {:>10} {:>10} {:>10} {:>7} {:>8} {:>8} {:>8} {:>7} {:>6}",
            "tensor",
            "kind",
            "dtype",
            "amax",
            "amin_nz",
            "mean_abs",
            "zeros",
            "uf_f16",
            "uf_bf16",
            "of_f16",
            "nonfin",
            "range"
        )?;
        for t in &self.tensors {
            // Another loss's gradients carry its id.
            let full = if t.loss_id > 0 {
                format!("{}@loss{}", t.name, t.loss_id)
            } else {
                t.name.clone()
            };
            let name = match full.char_indices().rev().nth(27) {
                Some((i, _)) => &full[i..],
                None => &full,
            };
            writeln!(
                f,
                "{:<28} {:<11} {:<5} {:>10.3e} {:>10.3e} {:>10.3e} {:>6.1}% {:>7.2}% {:>7.2}% {:>7.2}% {:>7} {:>6.1}",
                name,
                t.kind.name(),
                t.dtype,
                t.amax,
                t.amin_nonzero,
                t.mean_abs,
                t.zero_frac * 100.0,
                t.underflow_f16 * 100.0,
                t.underflow_bf16 * 100.0,
                t.overflow_f16 * 100.0,
                t.nonfinite,
                t.range_binades
            )?;
        }
        Ok(())
    }
}
