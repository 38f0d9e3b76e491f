//! The gradient rules, per loss scaler (each from its own backwards' gradients and
//! flags): the loss-scale range the gradients fit, and parameters whose gradient is
//! entirely zero under a static scale.

use candle_core::DType;

use super::DoctorConfig;
use super::recommendation::{Action, Problem, Recommendation, Severity, pct, pow2_floor};
use super::recorder::{Aggregate, State};
use super::stats::{BF16_MIN_NORMAL, F16_MAX, fraction_below};
use crate::precision::opt_level::Properties;
use crate::precision::recording::TensorKind;

/// A loss scaler as the rules see it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scaler {
    /// Its scale now.
    pub scale: f32,
    /// Whether it is dynamic.
    pub dynamic: bool,
}

use crate::kernels::bf16_products_flush_subnormals;

/// The tiers whose bf16 products flush subnormals (what `bf16_products_flush_subnormals`
/// answers for the active tier), for the tests that walk every tier.
#[cfg(test)]
fn flushes_on(isa: crate::kernels::Isa) -> bool {
    matches!(isa, crate::kernels::Isa::Amx | crate::kernels::Isa::Avx512Bf16)
}

/// bf16's smallest subnormal, 2^-133.
const BF16_MIN_SUBNORMAL: f64 = 9.183_549_615_799_121e-41;
/// f16's smallest subnormal, 2^-24.
const F16_MIN_SUBNORMAL: f64 = 5.960_464_477_539_063e-8;

/// The smallest magnitude a gradient keeps in `half` (below it, it is 0): f16's smallest
/// subnormal; bf16's smallest normal (2^-126) where its products flush subnormals (`flushes`),
/// else its smallest subnormal.
fn smallest_kept(half: DType, flushes: bool) -> f64 {
    match half {
        DType::BF16 if flushes => BF16_MIN_NORMAL,
        DType::BF16 => BF16_MIN_SUBNORMAL,
        _ => F16_MIN_SUBNORMAL,
    }
}

/// The rule for a parameter whose gradient is entirely zero under a static scale (at least
/// `zero_gradient` of it exactly 0 on average): unless the product that made it had it in
/// f32 and it was 0 there too (a true zero; not trusted for bf16 where products flush
/// subnormals), it underflowed to 0 in half: dynamic loss scaling within the range the
/// gradients fit (applied in place), a larger static scale, or keeping the layer in f32.
pub(crate) fn zero_gradient_rule(
    cfg: &DoctorConfig,
    props: &Properties,
    st: &State,
    loss: usize,
    scaler: Scaler,
    recs: &mut Vec<Recommendation>,
) {
    if scaler.dynamic {
        return;
    }
    let half = props.half.dtype();
    let flushes = half == DType::BF16 && bf16_products_flush_subnormals();
    let kept = smallest_kept(half, flushes);
    let (normal_exp, headroom) = if half == DType::BF16 {
        (-126, f32::MAX as f64)
    } else {
        (-14, F16_MAX)
    };
    let headroom = headroom / 2f64.powi(cfg.margin as i32);
    let masters: Vec<(&String, &Aggregate)> = st
        .tensors
        .iter()
        .filter(|((_, k, l), _)| *l == loss && *k == TensorKind::MasterGrad)
        .map(|((n, _, _), a)| (n, a))
        .collect();
    let amax = masters.iter().map(|(_, a)| a.amax_unscaled).fold(0.0, f64::max);
    let ceiling = if amax > 0.0 {
        pow2_floor(headroom / amax)
    } else {
        pow2_floor(f64::MAX)
    };
    for (name, a) in masters {
        let n = a.observations.max(1) as f64;
        if a.sum_zero / n < cfg.zero_gradient || a.nonfinite > 0 {
            continue;
        }
        // Only a gradient rounded to half (its raw gradient is half, or its ops autocast).
        let raw_half = st
            .tensors
            .get(&(name.clone(), TensorKind::Grad, loss))
            .is_some_and(|r| r.dtype == half);
        if !(raw_half || props.patch_functions) {
            continue;
        }
        let seen = a.pre_round_observations > 0;
        if seen && a.pre_round_amax == 0.0 && !flushes {
            continue;
        }
        // The smallest power of two at which its largest value before rounding reaches the
        // half type's smallest normal and at most `threshold` of it lies below (the
        // histogram does not resolve f32's subnormals, where bf16's gradients can lie).
        let floor = (seen && a.pre_round_amax > 0.0)
            .then(|| {
                let normal = 2f64.powi(normal_exp);
                let by_amax = 2f64.powi((normal / a.pre_round_amax).log2().ceil().max(-24.0) as i32);
                let by_share = a.binades.as_deref().and_then(|h| {
                    (-24..=24)
                        .map(|e| 2f64.powi(e))
                        .find(|s| fraction_below(h, a.binade_elements, *s, normal_exp) <= cfg.threshold)
                });
                by_share.map(|s| s.max(by_amax)).unwrap_or(by_amax)
            })
            .filter(|s| *s <= 2f64.powi(24))
            .map(|s| s as f32);
        let min = floor.unwrap_or(props.min_loss_scale).min(ceiling);
        let evidence = if seen && a.pre_round_amax > 0.0 {
            format!(
                "; before rounding to {} it reached {:.2e}, below {}'s smallest kept magnitude {kept:.2e}{} at that scale",
                props.half,
                a.pre_round_amax,
                props.half,
                if flushes {
                    " (bf16 products on this CPU's AMX/AVX-512 BF16 tier flush subnormals)"
                } else {
                    ""
                }
            )
        } else if seen {
            format!(
                "; its product computed 0 in f32 (bf16 products on this CPU's AMX/AVX-512 BF16 tier flush what lies below {kept:.2e})"
            )
        } else {
            "; its value before rounding was not seen (not one of the library's products): if its true gradient is not 0, it underflowed".to_string()
        };
        let layer = name.rsplit_once('.').map_or(name.as_str(), |(l, _)| l);
        let alternative = match floor {
            Some(f) => format!("a static scale of at least {f}"),
            None => "a larger static scale".to_string(),
        };
        let f32_layer = if props.patch_functions {
            format!(", or keep layer `{layer}` in f32")
        } else if half == DType::F16 {
            ", or bf16 (f32's range; a new run)".to_string()
        } else {
            String::new()
        };
        recs.push(Recommendation {
            target: name.clone(),
            action: Action::LossScale {
                loss_id: loss,
                init: ceiling.max(min),
                min,
                max: ceiling,
            },
            reason: format!(
                "its gradient was exactly 0 in {} of {} observed step(s) at loss scaler {loss}'s static scale {}{evidence}: dynamic loss scaling within [{min}, {ceiling}] keeps it, or {alternative}{f32_layer}",
                pct(a.sum_zero / n),
                a.observations,
                scaler.scale
            ),
            problem: Problem::GradientUnderflow,
            severity: Severity::Warning,
        });
    }
}

/// The loss-scale rules: a ceiling from the largest unscaled gradient (with `margin`
/// binades of headroom below 65504, as Transformer Engine's recipe keeps), a floor from the
/// gradients' binade histograms (the smallest power of two at which at most `threshold` of
/// every parameter's gradient underflows f16), the parameters that overflowed, and f16's
/// lack of headroom when the floor exceeds the ceiling.
pub(crate) fn loss_scale_rules(
    cfg: &DoctorConfig,
    props: &Properties,
    st: &State,
    loss: usize,
    current_scale: f32,
    what_if: bool,
    recs: &mut Vec<Recommendation>,
) {
    let grads: Vec<(&String, &Aggregate)> = st
        .tensors
        .iter()
        .filter(|((_, k, l), _)| *l == loss && matches!(k, TensorKind::MasterGrad | TensorKind::Grad))
        .map(|((n, _, _), a)| (n, a))
        .collect();
    if grads.is_empty() {
        return;
    }
    let amax = grads.iter().map(|(_, a)| a.amax_unscaled).fold(0.0, f64::max);
    let headroom = F16_MAX / 2f64.powi(cfg.margin as i32);
    let overflowed: Vec<(&String, &u64)> = st
        .overflowed_params
        .iter()
        .filter(|((l, _), _)| *l == loss)
        .map(|((_, p), n)| (p, n))
        .collect();
    // The smallest scale seen overflowing bounds the ceiling when no finite gradient was seen.
    let ceiling = if amax > 0.0 {
        pow2_floor(headroom / amax)
    } else if !overflowed.is_empty() {
        pow2_floor(current_scale as f64 / 2f64.powi(cfg.margin as i32 + 1))
    } else {
        return;
    };
    let masters: Vec<(&String, &Aggregate)> = grads
        .iter()
        .copied()
        .filter(|(_, a)| a.kind == TensorKind::MasterGrad && a.binades.is_some())
        .collect();
    // All gradient elements together (a parameter whose gradient is ~0 by symmetry, such as
    // attention's key bias, must not decide the scale for the rest).
    let mut total = vec![0u64; super::stats::BINADES];
    let mut elements = 0u64;
    for (_, a) in &masters {
        for (t, c) in total.iter_mut().zip(a.binades.as_deref().unwrap_or(&[])) {
            *t += c;
        }
        elements += a.binade_elements;
    }
    let all_below = |s: f64| fraction_below(&total, elements, s, -14);
    // The parameter losing the most of its gradient at a scale (for the reason's text).
    let worst_at = |s: f64| -> (String, f64) {
        masters
            .iter()
            .map(|(n, a)| {
                (
                    (*n).clone(),
                    fraction_below(a.binades.as_deref().unwrap_or(&[]), a.binade_elements, s, -14),
                )
            })
            .max_by(|x, y| x.1.total_cmp(&y.1))
            .unwrap_or_default()
    };
    let floor = (!masters.is_empty())
        .then(|| {
            (-24..=24)
                .map(|e| 2f64.powi(e))
                .find(|s| all_below(*s) <= cfg.threshold)
                .map(|s| s as f32)
        })
        .flatten();
    let dynamic_min = props.min_loss_scale;
    if !overflowed.is_empty() {
        let min = floor.map_or(dynamic_min, |f| f.min(ceiling)).min(ceiling);
        for (p, times) in overflowed {
            let own = st
                .tensors
                .get(&(p.clone(), TensorKind::MasterGrad, loss))
                .map(|a| a.amax_unscaled)
                .filter(|v| *v > 0.0)
                .unwrap_or(amax);
            recs.push(Recommendation {
                target: p.clone(),
                action: Action::LossScale {
                    loss_id: loss,
                    init: ceiling,
                    min,
                    max: ceiling,
                },
                reason: format!(
                    "its raw gradient was inf/NaN with a finite forward in {times} observed step(s) (skipped); its unscaled gradient reaches {own:.3e}, so scales up to {ceiling} keep every gradient below 65504/2^{}",
                    cfg.margin
                ),
                problem: Problem::GradientOverflow,
                severity: Severity::Error,
            });
        }
        return;
    }
    match floor {
        Some(f) if f > ceiling => recs.push(Recommendation {
            target: "half".into(),
            action: Action::UseBf16,
            reason: format!(
                "no f16 loss scale fits the gradients: at most {} of them underflowing needs a scale of at least {f}, the largest gradient ({amax:.3e}) allows at most {ceiling}",
                pct(cfg.threshold)
            ),
            problem: Problem::Range,
            severity: if what_if { Severity::Info } else { Severity::Warning },
        }),
        Some(f) if (current_scale as f64) < f as f64 => {
            let u = all_below(current_scale as f64);
            let (worst, wu) = worst_at(current_scale as f64);
            recs.push(Recommendation {
                target: "loss_scale".into(),
                action: Action::LossScale {
                    loss_id: loss,
                    init: ceiling,
                    min: f,
                    max: ceiling,
                },
                reason: format!(
                    "at scale {current_scale} {} of the gradients underflow f16 ({} of `{worst}`'s); from {f} on at most {} do, and up to {ceiling} none overflows",
                    pct(u),
                    pct(wu),
                    pct(cfg.threshold)
                ),
                problem: Problem::GradientUnderflow,
                severity: if what_if { Severity::Info } else { Severity::Warning },
            });
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Isa;

    #[test]
    fn bf16_keeps_subnormals_only_on_tiers_whose_products_do_not_flush_them() {
        for isa in Isa::ALL {
            let flushes = flushes_on(isa);
            assert_eq!(flushes, isa >= Isa::Avx512Bf16, "{isa:?}");
            let want = if flushes { 2f64.powi(-126) } else { 2f64.powi(-133) };
            assert_eq!(smallest_kept(DType::BF16, flushes), want, "{isa:?}");
            assert_eq!(smallest_kept(DType::F16, flushes), 2f64.powi(-24), "{isa:?}");
        }
        assert_eq!(bf16_products_flush_subnormals(), flushes_on(crate::kernels::isa()));
    }
}
