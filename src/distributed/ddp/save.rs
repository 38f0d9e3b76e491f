//! Checkpoints of a data-parallel run, saved by every rank together.

use super::{DataParallel, lock};
use crate::amp::Amp;
use crate::distributed::zero;
use crate::error::Result;

impl DataParallel {
    /// Saves a checkpoint of the run, called on every rank with the same `step`; every rank
    /// returns the committed version's directory, or the same failure (the version is then
    /// not committed; the previous one stays). Unsharded, rank 0 writes it as
    /// [`CheckpointDir::save`](crate::checkpoint::CheckpointDir::save) does and the others wait. Sharded (ZeRO), each rank writes
    /// the f32 weights and optimizer buffers of its own shard, and rank 0 the shared state
    /// (scalers, generators, counters) and the manifest over every rank's files, then
    /// commits: no rank holds another's shard. Either kind loads with
    /// [`CheckpointDir::load`](crate::checkpoint::CheckpointDir::load) at any world size, sharded or not (a rank of a sharded run
    /// keeps what its own partition needs).
    pub fn save_checkpoint(
        &self,
        dir: &crate::checkpoint::CheckpointDir,
        amp: &Amp,
        optimizers: &[&crate::train::optim::AmpOptimizer],
        step: u64,
        extra: serde_json::Value,
    ) -> Result<std::path::PathBuf> {
        if self.sharding.is_sharded() {
            // Parameters built since the last step are placed first, the same on every rank.
            self.place(&amp.run().store, &zero::trainable_sizes(amp.store()));
            let me = self.comm.rank();
            let owns = |name: &str| lock(&self.shards).owner(name).map(|r| r == me);
            return dir.save_sharded(amp, optimizers, step, extra, &*self.collective_comm(), &owns);
        }
        // With overlap on, its collectives take their turn after any bucket still on its way.
        dir.save_on_rank0(amp, optimizers, step, extra, &*self.collective_comm())
    }
}
