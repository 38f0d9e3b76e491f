//! What the step reads from an overlapped run: the rank's flags for the agreement, and the
//! averaged gradients in the buckets.

use std::sync::MutexGuard;

use super::State;

/// What a rank brings to the step's agreement.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepFlags {
    /// The buckets hold this step's gradients of every parameter asked about.
    pub valid: bool,
    /// A learning backward's order waits for a plan.
    pub learned: bool,
    /// The plan no longer fits.
    pub stale: bool,
}

impl StepFlags {
    /// As the values the ranks sum.
    pub(crate) fn values(self) -> [f32; 3] {
        [self.valid, self.learned, self.stale].map(|b| if b { 1.0 } else { 0.0 })
    }
}

/// The buckets' averaged gradients, held while the step reads them.
pub(crate) struct Results<'a>(pub(super) MutexGuard<'a, State>);

impl Results<'_> {
    /// Parameter `name`'s average (`None`: not in the plan).
    pub(crate) fn get(&self, name: &str) -> Option<&[f32]> {
        let plan = self.0.plan.as_ref()?;
        let i = plan.index(name)?;
        let (b, off) = plan.slot[i];
        let buf = self.0.bufs.get(b)?.as_ref()?;
        Some(&buf[off..off + plan.entries[i].size])
    }
}
