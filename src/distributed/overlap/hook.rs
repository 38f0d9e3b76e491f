//! The hook on the run's gradient stash: each piece of gradient a library layer adds during
//! candle's backward, counted (learning) or written into its bucket (armed); and, when an
//! armed backward starts, the shares of the parameters this rank's backward never reaches.

use std::sync::atomic::Ordering;

use candle_core::{Tensor, TensorId};

use super::{Armed, Mode, Overlap, State, lock, write};
use crate::precision::stash::ReadyHook;

impl ReadyHook for Overlap {
    fn grad_added(&self, id: TensorId, sum: &Tensor) {
        let mut st = lock(&self.st);
        let st = &mut *st;
        match &mut st.mode {
            Mode::Idle => {}
            Mode::Learning(l) => {
                if let Some(&i) = l.index.get(&id) {
                    l.counts[i] += 1;
                    l.events += 1;
                    l.last[i] = l.events;
                    l.sums[i] = Some(sum.id());
                }
            }
            Mode::Armed(_) => {
                let Mode::Armed(mut a) = std::mem::take(&mut st.mode) else {
                    unreachable!("matched Armed")
                };
                self.armed_grad(st, &mut a, id, sum);
                st.mode = Mode::Armed(a);
            }
        }
    }
}

impl Overlap {
    /// [`ReadyHook::grad_added`] while armed: a parameter whose every piece has arrived is
    /// written into its bucket, and the buckets now complete leave (unless they wait for
    /// the flush).
    pub(super) fn armed_grad(&self, st: &mut State, a: &mut Armed, id: TensorId, sum: &Tensor) {
        let Some(&i) = a.index.get(&id) else { return };
        let plan = st.plan.as_ref().expect("armed with a plan");
        a.counts[i] += 1;
        let expected = plan.entries[i].count;
        if expected == 0 {
            // Planned as candle's: written at the flush from the whole gradient.
            return;
        }
        if a.ready[i] {
            st.stale = true;
            return;
        }
        if a.counts[i] < expected {
            return;
        }
        if let Err(e) = write(plan, &mut st.bufs, a, i, Some(sum), self.world as f32) {
            st.error.get_or_insert(e);
            return;
        }
        if self.hold.load(Ordering::SeqCst) || st.error.is_some() {
            return;
        }
        let (out, sent) = self.send(st, a, true);
        st.early += sent;
        if let Err(e) = out {
            st.error.get_or_insert(e);
        }
    }

    /// An armed backward's start: writes the share of every parameter this rank's backward
    /// gives no gradient (learned), and sends the buckets that completes (unless they wait
    /// for the flush), so a rank whose graph lacks a parameter of an early bucket still
    /// overlaps. A gradient that arrives for one of them after all makes the plan stale (the
    /// step then reduces as without overlap and the order is learned again).
    pub(super) fn write_absent(&self, st: &mut State) {
        if !matches!(st.mode, Mode::Armed(_)) {
            return;
        }
        let Mode::Armed(mut a) = std::mem::take(&mut st.mode) else {
            unreachable!("matched Armed")
        };
        let plan = st.plan.as_ref().expect("armed with a plan");
        let absent: Vec<usize> = (0..plan.entries.len()).filter(|&i| plan.entries[i].absent).collect();
        for i in absent {
            let plan = st.plan.as_ref().expect("armed with a plan");
            if let Err(e) = write(plan, &mut st.bufs, &mut a, i, None, self.world as f32) {
                st.error.get_or_insert(e);
            }
        }
        if !self.hold.load(Ordering::SeqCst) && st.error.is_none() {
            let (out, sent) = self.send(st, &mut a, true);
            st.early += sent;
            if let Err(e) = out {
                st.error.get_or_insert(e);
            }
        }
        st.mode = Mode::Armed(a);
    }
}
