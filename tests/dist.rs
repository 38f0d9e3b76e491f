//! Data parallel with the in-process test double (`LocalGroup`: one thread per rank): W ranks
//! with B/W samples each against one process with B samples, skipped steps, gradient
//! accumulation, `GradScaler`, synchronised batch norm, unused parameters, mismatched models
//! and a rank that never answers. The same scenarios run across real processes under
//! `mpirun` in `examples/ddp_check.rs` (CI).
//!
//! On the CPU whatever `CANDLE_AMP_TEST_DEVICE` says: the ranks are threads of a
//! `LocalGroup`, a host-memory test double (a GPU run's data parallelism is NCCL's).
mod common;

mod dist_scenarios;

use std::sync::Arc;
use std::time::Duration;

use candle_amp::checkpoint::CheckpointDir;
use candle_amp::distributed::{Communicator, DataParallel, DistributedSampler};
use candle_amp::nn::linear;
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, CallOrderKind, DistErrorKind, HalfType, OptLevel};
use candle_core::Device;
use common::on_ranks;
use dist_scenarios::*;

/// Two ranks with half the batch each end where one process with the whole batch ends, and
/// bit-identical to each other.
fn check_two_ranks(level: OptLevel, half: HalfType, api: Api, with_bn: bool, extra: bool, tol: f32) {
    let what = format!(
        "{level} {half} bn={with_bn} extra={extra} scaler={}",
        api == Api::ScalerAccumulating
    );
    let one = train(None, 2, level, half, api, with_bn, extra);
    let two = on_ranks(2, Duration::from_secs(60), |c| {
        train(Some(c), 2, level, half, api, with_bn, extra)
    });
    assert_eq!(two[0].state, two[1].state, "{what}: the ranks diverged");
    assert_close(&two[0], &one, tol, &what);
    // The inf on rank 1 at INF_STEP skipped that step everywhere, and only that one.
    let skips = if with_bn { 0 } else { 1 };
    assert_eq!(one.skipped, skips, "{what}");
    assert_eq!((two[0].skipped, two[1].skipped), (skips, skips), "{what}");
    // One reduction per optimizer step, however many micro-batches.
    assert_eq!(
        (two[0].reductions, two[1].reductions),
        (STEPS as u64, STEPS as u64),
        "{what}"
    );
}

#[test]
fn two_ranks_equal_one_process_with_the_guard() {
    check_two_ranks(OptLevel::O0, HalfType::F16, Api::Guard, false, false, 1e-5);
    // At O2 the half forward of a half batch rounds like the whole batch's; the f32 masters
    // then differ only by summation order, within a few half ulps after 20 steps.
    check_two_ranks(OptLevel::O2, HalfType::F16, Api::Guard, false, false, 4e-3);
    check_two_ranks(OptLevel::O2, HalfType::Bf16, Api::Guard, false, false, 3e-2);
}

#[test]
fn two_ranks_equal_one_process_with_grad_scaler_and_accumulation() {
    check_two_ranks(OptLevel::O0, HalfType::F16, Api::ScalerAccumulating, false, false, 1e-5);
    check_two_ranks(OptLevel::O1, HalfType::F16, Api::ScalerAccumulating, false, false, 4e-3);
}

#[test]
fn synchronised_batch_norm_equals_the_whole_batch_running_statistics_included() {
    check_two_ranks(OptLevel::O0, HalfType::F16, Api::Guard, true, false, 1e-5);
    check_two_ranks(OptLevel::O2, HalfType::F16, Api::Guard, true, false, 4e-3);
}

#[test]
fn a_parameter_unused_on_one_rank_counts_as_a_zero_gradient_there() {
    check_two_ranks(OptLevel::O0, HalfType::F16, Api::Guard, false, true, 1e-5);
}

#[test]
fn a_parameter_no_rank_uses_gets_no_gradient_and_stays() {
    let runs = on_ranks(2, Duration::from_secs(60), |c| {
        train(Some(c), 2, OptLevel::O0, HalfType::F16, Api::Guard, false, false)
    });
    // `extra` is never used: rank 0's initial values, untouched (no weight decay).
    let init = on_ranks(2, Duration::from_secs(60), |c| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).seed(10 + c.rank() as u64), &Device::Cpu).unwrap();
        let _m = amp.model(|vb| Net::new(vb, false)).unwrap();
        let _d = DataParallel::new(&amp, c, Default::default()).unwrap();
        amp.store()
            .param("extra.weight")
            .unwrap()
            .f32_value()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    });
    let extra = |r: &Run| r.state.iter().find(|(n, _)| n == "extra.weight").unwrap().1.clone();
    let bits: Vec<u32> = init[0].iter().map(|v| v.to_bits()).collect();
    assert_eq!(extra(&runs[0]), bits);
    assert_eq!(extra(&runs[1]), bits);
    // ... while the layers in use trained.
    let a = |r: &Run| r.state.iter().find(|(n, _)| n == "a.weight").unwrap().1.clone();
    assert_eq!(a(&runs[0]), a(&runs[1]));
}

/// Trains steps `from..to` of `data()` on this rank's shard (O0, AdamW, dynamic loss
/// scale), restoring `resume` first and saving to `save` at `to` (rank 0 writes, the others
/// wait). Returns every parameter's bits and the loss scale.
fn train_span(
    comm: Option<Arc<dyn Communicator>>,
    from: usize,
    to: usize,
    resume: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> (Vec<(String, Vec<u32>)>, f32) {
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
    let cfg = AmpConfig::new(OptLevel::O0).seed(30 + rank as u64).verbosity(0);
    let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let model = amp.model(|vb| Net::new(vb, false)).unwrap();
    let adamw = amp::optim::AdamW::new(amp::optim::AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })
    .unwrap();
    let mut opt = amp.optimizer(adamw).unwrap();
    if let Some(dir) = resume {
        let ck = CheckpointDir::new(dir, 1).load().unwrap();
        assert_eq!(ck.step(), from as u64);
        ck.restore(&amp, &mut [&mut opt]).unwrap();
    }
    let ddp = comm.map(|c| DataParallel::new(&amp, c, Default::default()).unwrap());
    for (x, y) in data().into_iter().take(to).skip(from) {
        let (x, y) = (shard(&x, rank, world), shard(&y, rank, world));
        let loss = amp::ops::mse(&model.forward(&x).unwrap(), &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    if let Some(dir) = save {
        if rank == 0 {
            CheckpointDir::new(dir, 1)
                .save(&amp, &[&opt], to as u64, serde_json::Value::Null)
                .unwrap();
        }
        if let Some(d) = &ddp {
            d.barrier().unwrap();
        }
    }
    (state_of(&amp), amp.loss_scale(0).unwrap())
}

#[test]
fn a_checkpoint_rank_0_wrote_resumes_on_any_world_size() {
    let dir = std::env::temp_dir().join(format!("candle-amp-dist-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let half = STEPS / 2;
    // Two ranks save at the half-way step (the skipped step INF_STEP is before it).
    on_ranks(2, Duration::from_secs(60), |c| {
        train_span(Some(c), 0, half, None, Some(&dir))
    });
    let straight = on_ranks(2, Duration::from_secs(60), |c| {
        train_span(Some(c), 0, STEPS, None, None)
    });
    // Resumed on the same world size: bit-identical to training straight through.
    let two = on_ranks(2, Duration::from_secs(60), |c| {
        train_span(Some(c), half, STEPS, Some(&dir), None)
    });
    assert_eq!(two[0], straight[0]);
    assert_eq!(two[1], straight[0]);
    // On one process and on four ranks: the same training, up to f32 rounding of the sums.
    let one = train_span(None, half, STEPS, Some(&dir), None);
    let four = on_ranks(4, Duration::from_secs(60), |c| {
        train_span(Some(c), half, STEPS, Some(&dir), None)
    });
    for r in &four[1..] {
        assert_eq!(r, &four[0], "the four ranks diverged");
    }
    for (what, run) in [("1 process", &one), ("4 ranks", &four[0])] {
        assert_eq!(run.1, straight[0].1, "{what}: loss scale");
        for ((n, a), (_, b)) in run.0.iter().zip(&straight[0].0) {
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
                assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{what}: {n} {x} vs {y}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn different_models_fail_on_every_rank() {
    let errs = on_ranks(2, Duration::from_secs(60), |c| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2), &Device::Cpu).unwrap();
        let width = if c.rank() == 0 { 16 } else { 12 };
        let _m = amp.model(|vb| linear(6, width, vb.pp("a"))).unwrap();
        DataParallel::new(&amp, c, Default::default()).unwrap_err()
    });
    for (r, e) in errs.iter().enumerate() {
        match e {
            AmpError::Distributed { rank, kind, detail } => {
                assert_eq!((*rank, *kind), (r, DistErrorKind::Mismatch));
                assert!(detail.contains("a.weight") || detail.contains("1 rank(s)"), "{detail}");
            }
            other => panic!("rank {r}: {other}"),
        }
    }
    let errs = on_ranks(2, Duration::from_secs(60), |c| {
        let level = if c.rank() == 0 { OptLevel::O1 } else { OptLevel::O2 };
        let amp = amp::Amp::new(AmpConfig::new(level), &Device::Cpu).unwrap();
        let _m = amp.model(|vb| linear(6, 4, vb.pp("a"))).unwrap();
        DataParallel::new(&amp, c, Default::default()).unwrap_err().to_string()
    });
    assert!(
        errs[1].contains("opt level O1") && errs[1].contains("opt level O2"),
        "{}",
        errs[1]
    );
}

/// The cases of `dist_scenarios/disagree.rs` (which `examples/ddp_check.rs` runs on 2, 3
/// and 4 MPI processes): different lengths, bucket splits, collectives and roots, options
/// that shape the collectives (bucket_bytes, the device path, the half type, the ZeRO stage,
/// synchronised batch norm, overlap), a parameter only rank 0 has (at the start and built
/// later) and `no_sync` on one rank: every rank fails with a `Mismatch` naming the
/// difference, nothing moved, and the group stays paired for the next case.
#[test]
fn ranks_that_disagree_all_fail_with_a_mismatch_before_data_moves() {
    for world in [2, 3] {
        let out = on_ranks(world, Duration::from_secs(20), |c| disagree::run_all(&c));
        for (r, cases) in out.iter().enumerate() {
            assert_eq!(cases.len(), 15, "rank {r}");
            for (name, outcome) in cases {
                if let Err(p) = outcome {
                    panic!("{world} ranks, rank {r}, \"{name}\": {p}");
                }
            }
        }
    }
}

#[test]
fn a_rank_that_never_answers_times_out_instead_of_hanging() {
    let out = on_ranks(2, Duration::from_millis(300), |c| {
        if c.rank() == 1 {
            return None; // dies before joining
        }
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0), &Device::Cpu).unwrap();
        let _m = amp.model(|vb| linear(6, 4, vb.pp("a"))).unwrap();
        Some(DataParallel::new(&amp, c, Default::default()).unwrap_err())
    });
    match &out[0] {
        Some(AmpError::Distributed {
            kind: DistErrorKind::Timeout,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_backward_after_the_gradients_were_averaged_is_refused() {
    on_ranks(2, Duration::from_secs(60), |c| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0), &Device::Cpu).unwrap();
        let model = amp.model(|vb| linear(6, 2, vb.pp("a"))).unwrap();
        let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
        let _d = DataParallel::new(&amp, c, Default::default()).unwrap();
        let (x, y) = data().swap_remove(0);
        let loss = || amp::ops::mse(&model.forward(&x).unwrap(), &y).unwrap();
        amp.scale_loss(&loss(), &mut opt).unwrap().backward().unwrap();
        // Clipping needs the global norm: it averages first.
        opt.clip_grad_norm(1.0).unwrap();
        let e = amp.scale_loss(&loss(), &mut opt).unwrap_err();
        assert!(
            matches!(
                e,
                AmpError::CallOrder {
                    kind: CallOrderKind::AlreadyReduced,
                    ..
                }
            ),
            "{e}"
        );
        opt.step().unwrap();
    });
}

#[test]
fn the_sampler_shards_like_pytorch() {
    for (len, world, drop_last) in [
        (10, 4, false),
        (10, 4, true),
        (3, 4, false),
        (12, 3, false),
        (0, 2, false),
    ] {
        let shards: Vec<Vec<usize>> = (0..world)
            .map(|r| {
                let mut s = DistributedSampler::new(len, world, r)
                    .unwrap()
                    .seed(7)
                    .drop_last(drop_last);
                s.set_epoch(3);
                s.indices()
            })
            .collect();
        let per = if drop_last { len / world } else { len.div_ceil(world) };
        assert!(
            shards.iter().all(|s| s.len() == per),
            "{len} {world} {drop_last}: {shards:?}"
        );
        let mut all: Vec<usize> = shards.concat();
        all.sort();
        if drop_last {
            all.dedup();
            assert_eq!(all.len(), per * world, "disjoint");
        } else {
            // Every index at least once; the padding repeats some.
            let mut uniq = all.clone();
            uniq.dedup();
            assert_eq!(uniq, (0..len).collect::<Vec<_>>());
        }
    }
    // Same seed and epoch: the same order on every rank; another epoch: another order.
    let at = |epoch| {
        let mut s = DistributedSampler::new(100, 2, 0).unwrap().seed(1);
        s.set_epoch(epoch);
        s.indices()
    };
    assert_eq!(at(0), at(0));
    assert_ne!(at(0), at(1));
    assert!(DistributedSampler::new(10, 2, 2).is_err());
}

#[test]
fn the_rank_that_finishes_first_waits_and_the_wait_is_reported_apart_from_the_transfer() {
    let out = on_ranks(2, Duration::from_secs(60), |c| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0), &Device::Cpu).unwrap();
        let model = amp.model(|vb| linear(6, 2, vb.pp("a"))).unwrap();
        let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
        let ddp = DataParallel::new(&amp, c.clone(), Default::default()).unwrap();
        let (x, y) = data().swap_remove(0);
        for _ in 0..3 {
            let loss = amp::ops::mse(&model.forward(&x).unwrap(), &y).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            // Both ranks leave the barrier together; rank 1 then stands for a slower backward.
            c.barrier().unwrap();
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(150));
            }
            opt.step().unwrap();
            opt.zero_grad();
        }
        (
            ddp.comm_wait_ms(),
            ddp.comm_transfer_ms(),
            ddp.comm_ms(),
            ddp.collectives(),
            ddp.reductions(),
        )
    });
    let (wait0, transfer0, total0, calls, steps) = out[0];
    let (wait1, ..) = out[1];
    assert_eq!(steps, 3);
    // Per step: the flags, then one bucket of gradients (well under 25 MiB).
    assert_eq!(calls, 3 * 2);
    // Rank 0 reaches the step's first collective at once and waits there for rank 1, which
    // then finds it waiting: the waiting is rank 0's, in the first collective.
    assert!(wait0 >= 100.0, "rank 0 waited {wait0} ms");
    assert!(wait1 < wait0, "rank 1 waited {wait1} ms, rank 0 {wait0} ms");
    assert!(transfer0 > 0.0 && total0 >= wait0, "{transfer0} {total0} {wait0}");
}
