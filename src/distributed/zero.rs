//! ZeRO stages 1 and 2 (DeepSpeed's, PyTorch's `ZeroRedundancyOptimizer`): each rank keeps
//! the f32 master weights and the optimizer state of its own shard of the parameters, steps
//! that shard only, and receives the others' updated working weights from their owners.
//!
//! The shard is a whole-parameter partition (as `ZeroRedundancyOptimizer`'s): a parameter's
//! master, moments and update live on one rank, so the optimizers' fused passes run
//! unchanged on a shard. It is computed from the names and sizes alone, the same on every
//! rank (whose models `DataParallel::new` has checked to be equal).

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use crate::comm::Communicator;
use crate::error::{AmpError, Result};
use crate::precision::store::{ParamKind, ParamStore};

/// How a [`crate::distributed::DataParallel`] shares the optimizer's work between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Sharding {
    /// Every rank keeps and steps every parameter (PyTorch's DDP): gradients are
    /// all-reduced.
    #[default]
    None,
    /// ZeRO stage 1: each rank keeps the f32 master weights and the optimizer state of its
    /// shard only and steps it; gradients are all-reduced, and every rank checks all of them
    /// for inf/NaN (the skip decision needs no further exchange); after the step the owners'
    /// working weights are all-gathered in their working type (half at O2 and O3: half the
    /// bytes of an f32 gather).
    Stage1,
    /// ZeRO stage 2: stage 1, and the gradients are reduce-scattered instead of all-reduced
    /// (half the traffic): each rank receives the average of its shard only, checks it, and
    /// the ranks agree on the verdict in one small sum. On the device path (NCCL) the
    /// gradients are all-reduced as in stage 1 (the `Communicator` has no reduce-scatter of
    /// device tensors): the results are the same, the traffic is stage 1's.
    Stage2,
}

impl Sharding {
    /// Whether the optimizer state is sharded (stage 1 or 2).
    pub fn is_sharded(self) -> bool {
        self != Sharding::None
    }
}

impl std::fmt::Display for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Sharding::None => "none",
            Sharding::Stage1 => "ZeRO-1",
            Sharding::Stage2 => "ZeRO-2",
        })
    }
}

/// Which rank owns each parameter: largest first (ties by name), each to the rank with the
/// fewest elements so far (ties to the lower rank), so the ranks' loads differ by at most
/// the largest parameter. Parameters built after the partition was made join it the same
/// way, in the order of their names, without moving any parameter already placed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shards {
    owner: BTreeMap<String, usize>,
    load: Vec<usize>,
}

impl Shards {
    /// An empty partition over `world` ranks.
    pub(crate) fn new(world: usize) -> Self {
        Self {
            owner: BTreeMap::new(),
            load: vec![0; world.max(1)],
        }
    }

    /// Places the parameters of `sizes` not placed yet; returns the names placed now.
    pub(crate) fn extend(&mut self, sizes: &[(String, usize)]) -> Vec<(String, usize)> {
        let mut new: Vec<&(String, usize)> = sizes.iter().filter(|(n, _)| !self.owner.contains_key(n)).collect();
        new.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        new.dedup_by(|a, b| a.0 == b.0);
        let mut placed = Vec::with_capacity(new.len());
        for (name, n) in new {
            let load = &mut self.load;
            let r = (0..load.len())
                .min_by_key(|&r| (load[r], r))
                .expect("at least one rank");
            load[r] += n;
            self.owner.insert(name.clone(), r);
            placed.push((name.clone(), r));
        }
        placed
    }

    /// The rank that owns `name`, if it is placed.
    pub(crate) fn owner(&self, name: &str) -> Option<usize> {
        self.owner.get(name).copied()
    }

    /// The elements each rank owns.
    pub(crate) fn loads(&self) -> &[usize] {
        &self.load
    }
}

/// The sizes of `store`'s trainable parameters (or of the listed ones), by name.
pub(crate) fn trainable_sizes(store: &ParamStore) -> Vec<(String, usize)> {
    store
        .params()
        .iter()
        .filter(|p| p.kind() == ParamKind::Trainable)
        .map(|p| (p.name().to_string(), p.working().elem_count()))
        .collect()
}

/// After a step: every rank sends the working values of the parameters of `params` it owns
/// (in `params`' order, in their working type) and writes the other ranks' into its own
/// working Vars. In rounds: each rank's parameters are grouped in order into rounds of at
/// most `cap` bytes (a larger parameter alone), and round `k` is one all-gather of equal
/// blocks (the largest rank's round-`k` bytes; the others padded), so no rank ever receives
/// more than about `world * cap` bytes at once. This rank's values are read in one transfer
/// per working type (on a device: one synchronisation each). Returns the reads and the
/// all-gathers. A failure before any other rank's weights were written here leaves every
/// working weight as it was (the optimizer then undoes its own shard's step); one after is
/// [`DistErrorKind::Diverged`](crate::error::DistErrorKind).
pub(crate) fn gather_working(
    comm: &dyn Communicator,
    store: &ParamStore,
    shards: &Shards,
    params: &[(String, Vec<usize>)],
    cap: usize,
) -> Result<(u64, u64)> {
    let world = comm.world_size();
    let me = comm.rank();
    // Each rank's rounds, from the shapes and the working types (the same on every rank):
    // (rank, round, offset in the round's block, bytes, parameter).
    let mut rounds: Vec<Vec<usize>> = vec![Vec::new(); world];
    let mut entries = Vec::new();
    for (name, dims) in params {
        let (Some(r), Some(p)) = (shards.owner(name), store.param(name)) else {
            continue;
        };
        let bytes = dims.iter().product::<usize>() * p.working().dtype().size_in_bytes();
        let mine = &mut rounds[r];
        if mine.last().is_none_or(|&used| used > 0 && used + bytes > cap) {
            mine.push(0);
        }
        let k = mine.len() - 1;
        entries.push((r, k, mine[k], bytes, p));
        mine[k] += bytes;
    }
    let n_rounds = rounds.iter().map(Vec::len).max().unwrap_or(0);
    // This rank's values, one flat tensor (one read) per working type, in order.
    let mut by_type: Vec<(DType, Vec<Tensor>)> = Vec::new();
    for (r, _, _, _, p) in &entries {
        if *r != me {
            continue;
        }
        let w = p.working().flatten_all()?;
        match by_type.iter_mut().find(|(d, _)| *d == w.dtype()) {
            Some((_, v)) => v.push(w),
            None => by_type.push((w.dtype(), vec![w])),
        }
    }
    let mut read = Vec::with_capacity(by_type.len());
    for (_, parts) in &by_type {
        read.push(crate::files::tensor_bytes(&Tensor::cat(parts, 0)?)?);
    }
    let reads = read.len() as u64;
    let mut taken = vec![0usize; by_type.len()];
    let mut gathers = 0;
    // Other ranks' parameters written here so far. Before the first, a failure leaves this
    // rank's working weights as they were (its optimizer then undoes its own shard's step);
    // after it, the old values are gone (keeping them would cost a copy of every weight),
    // so the failure is `Diverged`.
    let mut written = 0usize;
    let mut rounds_done = || -> Result<()> {
        for k in 0..n_rounds {
            let block = rounds.iter().map(|r| r.get(k).copied().unwrap_or(0)).max().unwrap_or(0);
            if block == 0 {
                continue;
            }
            let mut mine = vec![0u8; block];
            for (_, _, at, len, p) in entries.iter().filter(|e| e.0 == me && e.1 == k) {
                let t = by_type
                    .iter()
                    .position(|(d, _)| *d == p.working().dtype())
                    .expect("grouped above");
                mine[*at..at + len].copy_from_slice(&read[t][taken[t]..taken[t] + len]);
                taken[t] += len;
            }
            let mut all = vec![0u8; block * world];
            comm.all_gather_bytes(&mine, &mut all)?;
            gathers += 1;
            for (r, _, at, len, p) in entries.iter().filter(|e| e.0 != me && e.1 == k) {
                let from = r * block + at;
                let w = p.working_var();
                let t = Tensor::from_raw_buffer(&all[from..from + len], w.dtype(), w.dims(), w.device())?;
                written += 1;
                let set = w.set(&t);
                crate::precision::autocast::invalidate(w.as_tensor());
                set?;
            }
        }
        Ok(())
    };
    match rounds_done() {
        Ok(()) => Ok((reads, gathers)),
        Err(e) if written > 0 => Err(AmpError::Distributed {
            rank: me,
            kind: crate::error::DistErrorKind::Diverged,
            detail: format!(
                "the all-gather of the updated working weights failed after {gathers} of its rounds, with \
                 {written} of the other ranks' parameters already written here: {e}"
            ),
        }),
        Err(e) => Err(e),
    }
}

/// The stage-2 reduction of the averaged shares in `flat` (laid out in `params`' order,
/// `sizes` elements each, every parameter placed in `shards`): reduce-scattered in rounds of
/// at most `per` elements per rank, so that this rank ends with the sums of the parameters it
/// owns. Returns them (`None` for the others' parameters) in `params`' order, and the number
/// of collective calls.
pub(crate) fn reduce_scatter_shares(
    comm: &dyn Communicator,
    shards: &Shards,
    params: &[(String, Vec<usize>)],
    sizes: &[usize],
    flat: &[f32],
    per: usize,
) -> Result<(Vec<Option<Vec<f32>>>, u64)> {
    let world = comm.world_size();
    let me = comm.rank();
    // Each rank's block: its parameters' shares in order.
    let mut blocks: Vec<Vec<f32>> = vec![Vec::new(); world];
    let mut place = Vec::with_capacity(params.len());
    let mut at = 0;
    for ((name, _), &len) in params.iter().zip(sizes) {
        let r = shards.owner(name).ok_or_else(|| AmpError::InvalidArgument {
            argument: "params",
            reason: format!("parameter `{name}` has no owner in the partition"),
        })?;
        place.push((r, blocks[r].len()));
        blocks[r].extend_from_slice(&flat[at..at + len]);
        at += len;
    }
    let block = blocks.iter().map(Vec::len).max().unwrap_or(0);
    let chunk = (per / world).max(1);
    let mut sums = vec![0f32; block];
    let mut calls = 0;
    let mut send = Vec::new();
    let mut from = 0;
    while from < block {
        let len = chunk.min(block - from);
        send.clear();
        for b in &blocks {
            // Past a shorter block's end the rank sends zeros (the padding).
            let start = from.min(b.len());
            let have = (b.len() - start).min(len);
            send.extend_from_slice(&b[start..start + have]);
            send.resize(send.len() + len - have, 0.0);
        }
        comm.reduce_scatter_sum(&send, &mut sums[from..from + len])?;
        calls += 1;
        from += len;
    }
    let out = place
        .into_iter()
        .zip(sizes)
        .map(|((r, at), &len)| (r == me).then(|| sums[at..at + len].to_vec()))
        .collect();
    Ok((out, calls))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(v: &[(&str, usize)]) -> Vec<(String, usize)> {
        v.iter().map(|(n, s)| (n.to_string(), *s)).collect()
    }

    #[test]
    fn a_mid_size_transformer_splits_within_five_percent_of_an_even_share() {
        // The bench's mid transformer: 6 blocks of width 512 (q, k, v, o, up, down, two
        // norms), vocabulary 1024, context 128. A rank's masters and moments are 12 bytes
        // per element it owns (tests/zero_memory.rs measures that), so the loads are the
        // memory split.
        let d = 512;
        let mut all = vec![
            ("tok.weight".to_string(), 1024 * d),
            ("pos".to_string(), 128 * d),
            ("ln.weight".to_string(), d),
            ("ln.bias".to_string(), d),
            ("head.weight".to_string(), 1024 * d),
            ("head.bias".to_string(), 1024),
        ];
        for b in 0..6 {
            for (n, size) in [
                ("q.weight", d * d),
                ("k.weight", d * d),
                ("v.weight", d * d),
                ("o.weight", d * d),
                ("q.bias", d),
                ("k.bias", d),
                ("v.bias", d),
                ("o.bias", d),
                ("up.weight", 4 * d * d),
                ("up.bias", 4 * d),
                ("down.weight", 4 * d * d),
                ("down.bias", d),
                ("ln1.weight", d),
                ("ln1.bias", d),
                ("ln2.weight", d),
                ("ln2.bias", d),
            ] {
                all.push((format!("block{b}.{n}"), size));
            }
        }
        let total: usize = all.iter().map(|(_, n)| n).sum();
        for world in [2, 4, 8] {
            let mut p = Shards::new(world);
            p.extend(&all);
            let max = *p.loads().iter().max().unwrap();
            let share = max as f64 / total as f64;
            assert!(
                share <= 1.0 / world as f64 + 0.05,
                "{world} ranks: the largest shard is {share:.3}"
            );
            assert_eq!(p.loads().iter().sum::<usize>(), total);
        }
    }

    #[test]
    fn the_partition_balances_largest_first_and_is_stable() {
        let all = sizes(&[("a", 10), ("b", 7), ("c", 5), ("d", 5), ("e", 1)]);
        let mut p = Shards::new(2);
        p.extend(&all);
        // a -> 0 (10); b -> 1 (7); c -> 1 (12); d -> 0 (15); e -> 1 (13).
        let got: Vec<Option<usize>> = ["a", "b", "c", "d", "e"].iter().map(|n| p.owner(n)).collect();
        assert_eq!(got, [0, 1, 1, 0, 1].map(Some));
        assert_eq!(p.loads(), &[15, 13]);
        let mut rev = all.clone();
        rev.reverse();
        let mut q = Shards::new(2);
        q.extend(&rev);
        assert_eq!(q.owner, p.owner, "the input order does not matter");
        // A parameter built later joins the lighter rank; nothing placed moves.
        assert_eq!(p.extend(&sizes(&[("a", 10), ("f", 4)])), vec![("f".to_string(), 1)]);
        assert_eq!(p.loads(), &[15, 17]);
        // One rank owns everything; more ranks than parameters leave some empty.
        let mut one = Shards::new(1);
        one.extend(&all);
        assert!(one.owner.values().all(|&r| r == 0));
        let mut wide = Shards::new(8);
        wide.extend(&all);
        assert_eq!(wide.loads().iter().filter(|&&l| l > 0).count(), 5);
    }
}
