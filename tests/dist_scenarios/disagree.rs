//! Ranks that disagree, shared by `tests/dist.rs` (ranks as threads) and
//! `examples/ddp_check.rs` (ranks as MPI processes, 2 and 3 of them in CI): collectives
//! called with different lengths, bucket splits, roots or kinds, and data-parallel runs
//! started with different options, a parameter only one rank has, or one rank in `no_sync`.
//! Every case must fail on every rank with a `DistErrorKind::Mismatch` that names what
//! differs, before any data moves (buffers and weights untouched), and leave the group
//! usable: each case ends with the ranks paired, so the next one starts clean.

use std::sync::Arc;

use candle_amp::distributed::{Communicator, DataParallel, DataParallelConfig, Sharding};
use candle_amp::nn::linear;
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, DistErrorKind, HalfType, LossScaleSpec, OptLevel};
use candle_core::{DType, Device};

use super::{Net, data_with, shard, state_of};

/// What a case found on this rank: the error's detail, or what was wrong.
pub type Outcome = Result<String, String>;

/// `r` must be a `Mismatch` whose detail contains `needle`.
fn mismatch<T: std::fmt::Debug>(r: Result<T, AmpError>, needle: &str) -> Outcome {
    match r {
        Err(AmpError::Distributed {
            kind: DistErrorKind::Mismatch,
            detail,
            ..
        }) if detail.contains(needle) => Ok(detail),
        other => Err(format!("expected a Mismatch naming {needle}, got {other:?}")),
    }
}

/// `v` must still hold only `x`.
fn untouched(v: &[f32], x: f32, detail: String) -> Outcome {
    if v.iter().all(|y| *y == x) {
        Ok(detail)
    } else {
        Err(format!("the buffer was written: {v:?}"))
    }
}

/// An O2 run of `Net` on this rank (seeded per rank: `DataParallel` must equalise it).
fn setup(rank: usize, half: HalfType, device_path: bool) -> (amp::Amp, amp::AmpModel<Net>) {
    let cfg = AmpConfig::new(OptLevel::O2)
        .half(half)
        .seed(10 + rank as u64)
        .loss_scale(LossScaleSpec::Static(64.0))
        .verbosity(0)
        .device_path(device_path);
    let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let model = amp.model(|vb| Net::new(vb, false)).unwrap();
    (amp, model)
}

fn sgd(amp: &amp::Amp) -> amp::AmpOptimizer {
    amp.optimizer(Sgd::new(SgdConfig::new(0.05)).unwrap()).unwrap()
}

/// One backward of this rank's shard of the first batch.
fn backward(amp: &amp::Amp, model: &amp::AmpModel<Net>, opt: &mut amp::AmpOptimizer, rank: usize, world: usize) {
    let (x, y) = data_with(false).swap_remove(0);
    let (x, y) = (shard(&x, rank, world), shard(&y, rank, world));
    let out = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
    let loss = amp::ops::mse(&out, &y).unwrap();
    amp.scale_loss(&loss, opt).unwrap().backward().unwrap();
}

/// `DataParallel::new` with `bucket_bytes`.
fn ddp(amp: &amp::Amp, comm: &Arc<dyn Communicator>, bucket_bytes: usize) -> amp::Result<Arc<DataParallel>> {
    DataParallel::new(amp, comm.clone(), DataParallelConfig { bucket_bytes })
}

/// Runs every case on this rank, in the same order on every rank; returns each case's name
/// and outcome.
pub fn run_all(comm: &Arc<dyn Communicator>) -> Vec<(&'static str, Outcome)> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if world < 2 {
        return Vec::new();
    }
    // Rank 0 against the others (on 3 ranks two agree with each other).
    let others = rank > 0;
    let mut out: Vec<(&'static str, Outcome)> = Vec::new();

    let mut v = vec![1.5f32; if others { 4 } else { 3 }];
    let r = mismatch(comm.all_reduce_sum(&mut v), "`all_reduce_sum`");
    out.push((
        "all_reduce_sum with different lengths",
        r.and_then(|d| untouched(&v, 1.5, d)),
    ));

    let mut v = vec![1.5f32; if others { 4 } else { 3 }];
    let r = mismatch(comm.broadcast(&mut v, 0), "`broadcast`");
    out.push((
        "broadcast with different lengths",
        r.and_then(|d| untouched(&v, 1.5, d)),
    ));

    // The same first buckets; the others have one more.
    let mut v = vec![1.5f32; 6];
    let mut bufs: Vec<&mut [f32]> = v.chunks_mut(2).take(if others { 3 } else { 2 }).collect();
    let r = mismatch(comm.all_reduce_sum_buckets(&mut bufs), "`all_reduce_sum`");
    out.push((
        "a step split into different buckets",
        r.and_then(|d| untouched(&v, 1.5, d)),
    ));

    let mut v = vec![1.5f32; 4];
    let r = if others {
        comm.broadcast(&mut v, 0)
    } else {
        comm.all_reduce_sum(&mut v)
    };
    let r = mismatch(r, "`broadcast`").and_then(|d| {
        if d.contains("`all_reduce_sum`") {
            Ok(d)
        } else {
            Err(format!("the detail names one collective only: {d}"))
        }
    });
    out.push((
        "different collectives of one length",
        r.and_then(|d| untouched(&v, 1.5, d)),
    ));

    let mut v = vec![1.5f32 + rank as f32; 4];
    let r = mismatch(comm.broadcast(&mut v, usize::from(others)), "`broadcast` from rank");
    out.push((
        "broadcasts from different roots",
        r.and_then(|d| untouched(&v, 1.5 + rank as f32, d)),
    ));

    // Still paired: a plain sum works after all of the above.
    let mut one = [1.0f32];
    out.push((
        "the group is usable after the refusals",
        match comm.all_reduce_sum(&mut one) {
            Ok(()) if one[0] == world as f32 => Ok(format!("a sum over {world} ranks gives {}", one[0])),
            other => Err(format!("{other:?}, sum {}", one[0])),
        },
    ));

    let (a, _m) = setup(rank, HalfType::F16, false);
    let r = mismatch(ddp(&a, comm, if others { 512 } else { 256 }), "`bucket_bytes`");
    out.push(("different bucket_bytes", r));

    let (a, _m) = setup(rank, HalfType::F16, others);
    out.push((
        "the device path on some ranks",
        mismatch(ddp(&a, comm, 256), "`device path`"),
    ));

    let (a, _m) = setup(rank, if others { HalfType::Bf16 } else { HalfType::F16 }, false);
    out.push((
        "different half types (the gathers' types)",
        mismatch(ddp(&a, comm, 256), "`gather types`"),
    ));

    let (a, _m) = setup(rank, HalfType::F16, false);
    let sharding = if others { Sharding::Stage2 } else { Sharding::Stage1 };
    out.push((
        "different ZeRO stages",
        mismatch(
            DataParallel::sharded(&a, comm.clone(), Default::default(), sharding),
            "`sharding`",
        ),
    ));

    let (a, _m) = setup(rank, HalfType::F16, false);
    let _late = (!others).then(|| a.model(|vb| linear(2, 2, vb.pp("late"))).unwrap());
    out.push((
        "a parameter only rank 0 has at the start",
        mismatch(ddp(&a, comm, 256), "`parameters`"),
    ));

    let (a, _m) = setup(rank, HalfType::F16, false);
    let d = ddp(&a, comm, 256).unwrap();
    out.push((
        "synchronised batch norm on rank 0 only",
        mismatch(d.sync_batch_norm(&a, !others), "sync_batch_norm"),
    ));
    out.push((
        "overlap on rank 0 only",
        mismatch(d.set_overlap(&a, !others), "set_overlap"),
    ));
    drop(d);

    // A parameter built after the start, on rank 0 only: the step's agreement refuses it.
    let (a, model) = setup(rank, HalfType::F16, false);
    let _d = ddp(&a, comm, 256).unwrap();
    let _late = (!others).then(|| a.model(|vb| linear(2, 2, vb.pp("late"))).unwrap());
    let mut opt = sgd(&a);
    backward(&a, &model, &mut opt, rank, world);
    let before = state_of(&a);
    let r = mismatch(opt.step(), "parameter");
    let same = state_of(&a) == before;
    out.push((
        "a parameter only rank 0 has, built after the start",
        r.and_then(|d| {
            if same {
                Ok(d)
            } else {
                Err("the step changed the weights".into())
            }
        }),
    ));

    // Overlap with one bucket: rank 0's backward under no_sync sends nothing, the others'
    // send their bucket, which meets rank 0's step agreement.
    let (a, model) = setup(rank, HalfType::F16, false);
    let d = ddp(&a, comm, 1 << 20).unwrap();
    let mut opt = sgd(&a);
    d.set_overlap(&a, true).unwrap();
    backward(&a, &model, &mut opt, rank, world);
    opt.step().unwrap();
    opt.zero_grad();
    let before = state_of(&a);
    {
        let _local = (!others).then(|| d.no_sync());
        backward(&a, &model, &mut opt, rank, world);
    }
    let r = mismatch(opt.step(), "");
    let same = state_of(&a) == before;
    out.push((
        "one rank's backward under no_sync",
        r.and_then(|d| {
            if same {
                Ok(d)
            } else {
                Err("the step changed the weights".into())
            }
        }),
    ));
    drop(d);
    out
}
