//! The loss scalers of a run: one [`LossScale`] per loss id plus the bookkeeping that makes
//! the scale adjust once per optimizer step (PyTorch's rule).
//!
//! A backward through loss id `k` enlists each optimizer of its block with scaler `k`. When
//! an enlisted optimizer steps (or skips, or zeroes its gradients), it reports whether its
//! gradients from that scaler were finite. When the last enlisted optimizer has reported,
//! the scaler adjusts once from the OR of their overflow flags. With gradient accumulation
//! an optimizer reports once per step, so the scale adjusts once per step, however many
//! micro-batches came before.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::loss_scale::LossScale;

/// One loss scaler and its counters (read them with [`crate::Amp::scaler_states`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The scale.
    pub scale: LossScale,
    /// Adjustments made (optimizer steps seen, skipped or not).
    pub updates: u64,
    /// Adjustments that followed an overflow.
    pub total_skips: u64,
    /// Overflowed adjustments in a row.
    pub consecutive_skips: u32,
}

impl ScalerState {
    /// Takes a saved scaler's progress while keeping this scaler's settings: where both are
    /// dynamic, the scale (clamped into this floor and ceiling), the growth tracker and the
    /// hysteresis left; always the counters.
    pub(crate) fn restore_from(&mut self, saved: &ScalerState) {
        self.scale.restore_progress(&saved.scale);
        self.updates = saved.updates;
        self.total_skips = saved.total_skips;
        self.consecutive_skips = saved.consecutive_skips;
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ScalerSlot {
    pub state: ScalerState,
    waiting: BTreeSet<usize>,
    reported: bool,
    pending_inf: bool,
}

impl ScalerSlot {
    pub(crate) fn new(scale: LossScale) -> Self {
        Self {
            state: ScalerState {
                scale,
                updates: 0,
                total_skips: 0,
                consecutive_skips: 0,
            },
            waiting: BTreeSet::new(),
            reported: false,
            pending_inf: false,
        }
    }

    /// An optimizer ran a backward through this scaler.
    pub(crate) fn enlist(&mut self, opt: usize) {
        self.waiting.insert(opt);
    }

    /// An optimizer stepped or skipped; `inf` says whether its gradients from this scaler
    /// overflowed. Returns `Some(overflowed)` when this closed the round and the scale was
    /// adjusted.
    pub(crate) fn report(&mut self, opt: usize, inf: bool, loss_id: usize) -> Option<bool> {
        if !self.waiting.remove(&opt) {
            return None;
        }
        self.reported = true;
        self.pending_inf |= inf;
        self.close_if_done(loss_id)
    }

    /// An optimizer dropped its gradients without stepping.
    pub(crate) fn withdraw(&mut self, opt: usize, loss_id: usize) {
        if self.waiting.remove(&opt) {
            self.close_if_done(loss_id);
        }
    }

    fn close_if_done(&mut self, loss_id: usize) -> Option<bool> {
        if !self.waiting.is_empty() || !self.reported {
            return None;
        }
        let overflow = self.pending_inf;
        self.pending_inf = false;
        self.reported = false;
        let before = self.state.scale.scale();
        self.state.scale.adjust(!overflow);
        self.state.updates = self.state.updates.saturating_add(1);
        if overflow {
            self.state.total_skips = self.state.total_skips.saturating_add(1);
            self.state.consecutive_skips = self.state.consecutive_skips.saturating_add(1);
            if self.state.scale.is_dynamic() {
                log::warn!(
                    "Gradient overflow. Skipping step, loss scaler {loss_id} reducing loss scale to {}",
                    self.state.scale.scale()
                );
            } else {
                log::warn!("Gradient overflow. Skipping step, loss scaler {loss_id} is static at {before}");
            }
        } else {
            self.state.consecutive_skips = 0;
        }
        Some(overflow)
    }
}
