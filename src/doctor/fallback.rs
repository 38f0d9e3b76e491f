//! The automatic fallback (Transformer Engine's `AutoswitchGemm`, per layer): at O1 a layer
//! whose outputs underflow or overflow in the half type in every one of the last `window`
//! observations switches to f32; one whose outputs would fit the half type again in every
//! one of the last `window` observations since it switched goes back. Each switch is logged
//! and reported; the run keeps the switched layers (and saves them in checkpoints).

use super::DoctorConfig;
use super::recorder::{State as RecState, SwitchEvent};
use crate::precision::recording::TensorKind;

/// Whether an activation is a named layer's output (ops are named `op#call`).
pub(crate) fn is_layer(name: &str) -> bool {
    !name.contains('#')
}

/// The switches to make after an observed step: (layer, to f32).
pub(crate) fn decide(cfg: &DoctorConfig, st: &mut RecState) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    // 1-based, as the report's loss-scale points (`st.step` counts the backwards before this one).
    let step = st.step + 1;
    for ((name, _, _), a) in st.tensors.iter_mut() {
        if a.kind != TensorKind::Activation || !is_layer(name) || a.window.len() < cfg.window {
            continue;
        }
        let switched = st.fallback.switched.contains(name);
        let bad = |s: &super::recorder::Sample| {
            s.underflow > cfg.threshold || s.overflow > cfg.overflow_threshold || s.root_nonfinite
        };
        if !switched && a.window.iter().all(bad) {
            let last = a.window.back().copied();
            let worst_u = a.window.iter().map(|s| s.underflow).fold(0.0, f64::max);
            let worst_o = a.window.iter().map(|s| s.overflow).fold(0.0, f64::max);
            let reason = format!(
                "outputs out of the half type's range in the last {} observations (underflow up to {:.1}%, overflow up to {:.1}%{})",
                cfg.window,
                worst_u * 100.0,
                worst_o * 100.0,
                if last.is_some_and(|s| s.root_nonfinite) {
                    ", inf/NaN"
                } else {
                    ""
                }
            );
            out.push((name.clone(), true, reason));
        } else if switched
            && a.window
                .iter()
                .all(|s| s.underflow < cfg.switch_back && s.overflow <= cfg.overflow_threshold && !s.root_nonfinite)
        {
            let reason = format!(
                "outputs would fit the half type again in the last {} observations (underflow below {:.1}%, no overflow)",
                cfg.window,
                cfg.switch_back * 100.0
            );
            out.push((name.clone(), false, reason));
        }
    }
    let mut switches = Vec::new();
    for (name, to_f32, reason) in out {
        if let Some(a) = st.tensors.get_mut(&(name.clone(), TensorKind::Activation, 0)) {
            // Observations before a switch are of the other type.
            a.window.clear();
        }
        if to_f32 {
            st.fallback.switched.insert(name.clone());
            log::warn!("doctor: layer {name} switched to f32: {reason}");
        } else {
            st.fallback.switched.remove(&name);
            log::warn!("doctor: layer {name} switched back to half: {reason}");
        }
        st.fallback.events.push_back(SwitchEvent {
            step,
            layer: name.clone(),
            to_f32,
            reason,
        });
        while st.fallback.events.len() > super::recorder::MAX_EVENTS {
            st.fallback.events.pop_front();
        }
        switches.push((name, to_f32));
    }
    switches
}
