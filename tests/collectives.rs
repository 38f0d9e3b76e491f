//! `Communicator::reduce_scatter_sum` and `all_gather_bytes` (what ZeRO's sharded steps
//! need) on `LocalGroup` and through the trait's default implementations (a communicator
//! that implements only the required methods, as a user's own backend may): the values
//! every rank gets, agreement with `all_reduce_sum` bit for bit, a partition the ranks
//! disagree on refused on every rank before any data moves, a wrong local layout refused
//! before anything is sent, empty blocks, and a rank that never calls.

mod common;

use std::sync::Arc;
use std::time::Duration;

use candle_amp::distributed::Communicator;
use candle_amp::{AmpError, DistErrorKind};
use common::on_ranks;

/// Only the required methods, delegated: the provided `reduce_scatter_sum` and
/// `all_gather_bytes` run their default implementations over them.
#[derive(Debug)]
struct Plain(Arc<dyn Communicator>);

impl Communicator for Plain {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn backend(&self) -> &'static str {
        "plain"
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> candle_amp::Result<()> {
        self.0.all_reduce_sum(buf)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> candle_amp::Result<()> {
        self.0.broadcast(buf, root)
    }
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> candle_amp::Result<()> {
        self.0.broadcast_bytes(buf, root)
    }
    fn barrier(&self) -> candle_amp::Result<()> {
        self.0.barrier()
    }
}

/// The group's communicator as it is, or wrapped so the defaults run.
fn each_impl(c: Arc<dyn Communicator>, defaults: bool) -> Arc<dyn Communicator> {
    if defaults { Arc::new(Plain(c)) } else { c }
}

/// Rank `r`'s contribution: values whose sum over ranks rounds (large and small mixed), so
/// a sum in another order or over other blocks would show in the bits.
fn contribution(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let big = if (i + rank).is_multiple_of(3) { 1.0e8 } else { 1.0 };
            (i as f32 * 0.37 + rank as f32 * 1.91 - 2.5) * big * if rank.is_multiple_of(2) { 1.0 } else { -0.999 }
        })
        .collect()
}

#[test]
fn reduce_scatter_gives_each_rank_its_block_of_the_all_reduce() {
    for defaults in [false, true] {
        for world in [1, 2, 3] {
            for block in [0, 1, 5] {
                let out = on_ranks(world, Duration::from_secs(60), |c| {
                    let c = each_impl(c, defaults);
                    let send = contribution(c.rank(), world * block);
                    let mut all = send.clone();
                    c.all_reduce_sum(&mut all).unwrap();
                    let mut recv = vec![f32::NAN; block];
                    c.reduce_scatter_sum(&send, &mut recv).unwrap();
                    (c.rank(), all, recv)
                });
                for (r, all, recv) in out {
                    let want: Vec<u32> = all[r * block..(r + 1) * block].iter().map(|v| v.to_bits()).collect();
                    let got: Vec<u32> = recv.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "defaults {defaults}, {world} ranks, block {block}, rank {r}");
                }
            }
        }
    }
}

#[test]
fn all_gather_puts_every_ranks_bytes_in_rank_order_on_every_rank() {
    for defaults in [false, true] {
        for world in [1, 2, 3] {
            for len in [0, 1, 7] {
                let out = on_ranks(world, Duration::from_secs(60), |c| {
                    let c = each_impl(c, defaults);
                    let send: Vec<u8> = (0..len).map(|i| (c.rank() * 31 + i * 7) as u8).collect();
                    let mut recv = vec![0xAAu8; world * len];
                    c.all_gather_bytes(&send, &mut recv).unwrap();
                    recv
                });
                let want: Vec<u8> = (0..world)
                    .flat_map(|r| (0..len).map(move |i| (r * 31 + i * 7) as u8))
                    .collect();
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(got, &want, "defaults {defaults}, {world} ranks, {len} bytes, rank {r}");
                }
            }
        }
    }
}

#[test]
fn a_partition_the_ranks_disagree_on_is_refused_on_every_rank_before_data_moves() {
    for defaults in [false, true] {
        let out = on_ranks(3, Duration::from_secs(60), |c| {
            let c = each_impl(c, defaults);
            // Rank 2 thinks the blocks have 3 values, the others 2.
            let block = if c.rank() == 2 { 3 } else { 2 };
            let send = contribution(c.rank(), 3 * block);
            let mut recv = vec![-7.0f32; block];
            let e = c.reduce_scatter_sum(&send, &mut recv).unwrap_err();
            let untouched = recv.iter().all(|v| *v == -7.0);
            let len = if c.rank() == 1 { 5 } else { 4 };
            let mut gathered = vec![0x55u8; 3 * len];
            let g = c.all_gather_bytes(&vec![1u8; len], &mut gathered).unwrap_err();
            (e, untouched, g, gathered.iter().all(|b| *b == 0x55))
        });
        for (r, (e, untouched, g, gathered_untouched)) in out.into_iter().enumerate() {
            for (what, e) in [("reduce_scatter_sum", e), ("all_gather_bytes", g)] {
                match e {
                    AmpError::Distributed { rank, kind, detail } => {
                        assert_eq!((rank, kind), (r, DistErrorKind::Mismatch), "{what} defaults {defaults}");
                        assert!(detail.contains(what), "{detail}");
                    }
                    other => panic!("{what} rank {r} defaults {defaults}: {other}"),
                }
            }
            assert!(untouched && gathered_untouched, "rank {r}: an output was written");
        }
        // The group is still usable: nothing was half sent.
        if !defaults {
            let sums = on_ranks(2, Duration::from_secs(60), |c| {
                let mut v = [1.0f32];
                c.all_reduce_sum(&mut v).unwrap();
                v[0]
            });
            assert_eq!(sums, [2.0, 2.0]);
        }
    }
}

#[test]
fn a_layout_that_is_not_world_size_blocks_is_refused_before_anything_is_sent() {
    // On every rank, so no rank waits in a collective the others never join.
    for defaults in [false, true] {
        let out = on_ranks(2, Duration::from_millis(500), |c| {
            let c = each_impl(c, defaults);
            let rs = c.reduce_scatter_sum(&[1.0; 5], &mut [0.0; 2]).unwrap_err();
            let ag = c.all_gather_bytes(&[1u8; 3], &mut [0u8; 5]).unwrap_err();
            (rs, ag)
        });
        for (rs, ag) in out {
            for (arg, e) in [("send", rs), ("recv", ag)] {
                match e {
                    AmpError::InvalidArgument { argument, reason } => {
                        assert_eq!(argument, arg);
                        assert!(reason.contains("blocks"), "{reason}");
                    }
                    other => panic!("{other}"),
                }
            }
        }
    }
}

#[test]
fn a_rank_that_never_calls_makes_the_others_time_out() {
    let out = on_ranks(2, Duration::from_millis(300), |c| {
        if c.rank() == 1 {
            return None;
        }
        let mut recv = [0.0f32; 1];
        Some(c.reduce_scatter_sum(&[1.0, 2.0], &mut recv).unwrap_err())
    });
    match &out[0] {
        Some(AmpError::Distributed {
            kind: DistErrorKind::Timeout,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}
