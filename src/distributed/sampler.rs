//! A rank-aware sampler: PyTorch's `DistributedSampler`.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::error::{AmpError, Result};

/// Splits the indices `0..len` of a dataset into disjoint shards, one per rank, as PyTorch's
/// `DistributedSampler` does:
///
/// * with `shuffle` (the default) the order is a permutation drawn from `seed + epoch`, the
///   same on every rank: call [`set_epoch`](Self::set_epoch) at the start of every epoch to
///   reshuffle (without it every epoch has the same order);
/// * the indices are made divisible by the world size: padded by repeating indices from the
///   start of the (shuffled) order, or, with `drop_last`, truncated, so that every rank has
///   [`num_samples`](Self::num_samples) indices and no rank waits for another at the end of an
///   epoch;
/// * rank `r` takes every `world_size`-th index starting at `r`.
///
/// The permutation comes from a ChaCha8 stream, not from PyTorch's generator: the shards are
/// the same across ranks and runs, not the same as PyTorch's.
///
/// ```
/// use candle_amp::distributed::DistributedSampler;
/// # fn main() -> candle_amp::Result<()> {
/// // 10 samples on 4 ranks, no shuffling: padded to 12 with indices 0 and 1.
/// let shard = |rank| DistributedSampler::new(10, 4, rank).map(|s| s.shuffle(false).indices());
/// assert_eq!(shard(0)?, [0, 4, 8]);
/// assert_eq!(shard(1)?, [1, 5, 9]);
/// assert_eq!(shard(2)?, [2, 6, 0]);
/// assert_eq!(shard(3)?, [3, 7, 1]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `rank` of `world_size`: shuffled, seed 0, padding
    /// the last partial round (PyTorch's defaults). An [`AmpError::InvalidArgument`] for an
    /// empty world or a rank outside it.
    pub fn new(len: usize, world_size: usize, rank: usize) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(AmpError::InvalidArgument {
                argument: "rank",
                reason: format!("rank {rank} is not in a world of {world_size} rank(s); ranks are 0..world_size"),
            });
        }
        Ok(Self {
            len,
            world_size,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// Whether to shuffle (per epoch, from the seed).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed every rank must share.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drop the tail that does not divide evenly instead of padding it.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch: the next [`indices`](Self::indices) are shuffled from `seed + epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Indices per rank per epoch: `ceil(len / world)` when padding, `floor(len / world)`
    /// with `drop_last` (PyTorch's `num_samples`).
    pub fn num_samples(&self) -> usize {
        if self.drop_last && !self.len.is_multiple_of(self.world_size) {
            // PyTorch: ceil((len - world) / world), which is floor(len / world).
            self.len / self.world_size
        } else {
            self.len.div_ceil(self.world_size)
        }
    }

    /// This rank's indices for the current epoch, in order.
    pub fn indices(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(self.epoch)));
        }
        let total = self.num_samples() * self.world_size;
        if total > order.len() {
            // Pad by repeating the order from its start (more than once for tiny datasets).
            let mut padded = Vec::with_capacity(total);
            while padded.len() < total && !order.is_empty() {
                let take = (total - padded.len()).min(order.len());
                padded.extend_from_slice(&order[..take]);
            }
            order = padded;
        } else {
            order.truncate(total);
        }
        order.into_iter().skip(self.rank).step_by(self.world_size).collect()
    }
}
