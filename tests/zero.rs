//! ZeRO stages 1 and 2 on the in-process test double (`LocalGroup`): a sharded run ends bit
//! for bit where the unsharded data-parallel run ends (which `tests/dist.rs` checks against
//! one process over the whole batch), at every level and half type, with SGD and AdamW,
//! accumulation, clipping and an overflowing step; the partition, the refusals of calls that
//! need the whole state, and the freed masters.
mod common;

mod dist_scenarios;

use std::time::Duration;

use candle_amp::checkpoint::CheckpointDir;
use candle_amp::distributed::{DataParallel, Sharding};
use candle_amp::{self as amp, AmpConfig, AmpError, DistErrorKind, HalfType, OptLevel};
use candle_core::Device;
use common::on_ranks;
use dist_scenarios::*;

const T: Duration = Duration::from_secs(60);

/// `world` ranks with each stage against the unsharded run with the same extras: the same
/// working weights (bit for bit, on every rank), the same f32 masters on their owners, the
/// same skipped steps and clipping norms; every parameter owned by exactly one rank.
fn check_sharded(world: usize, level: OptLevel, half: HalfType, api: Api, extras: Extras) {
    let run = |sharding: Sharding| {
        on_ranks(world, T, |c| {
            train_with(
                Some(c),
                world,
                level,
                half,
                api,
                false,
                false,
                Extras { sharding, ..extras },
            )
        })
    };
    let plain = run(Sharding::None);
    for stage in [Sharding::Stage1, Sharding::Stage2] {
        let what = format!(
            "{stage}, {world} ranks, {level} {half}, adamw={} clip={:?} scaler={}",
            extras.adamw,
            extras.clip,
            api == Api::ScalerAccumulating
        );
        let sharded = run(stage);
        for r in &sharded {
            assert_eq!(r.working, plain[0].working, "{what}: working weights");
            assert_eq!(r.skipped, plain[0].skipped, "{what}: skipped steps");
            assert_eq!(r.norms, plain[0].norms, "{what}: clipping norms");
        }
        for (name, bits) in &plain[0].state {
            let owners: Vec<&Run> = sharded.iter().filter(|r| r.owned.contains(name)).collect();
            let is_param = plain[0].owned.contains(name) && !name.contains("running");
            if is_param && owners.len() != world {
                assert_eq!(owners.len(), 1, "{what}: `{name}` has one owner");
            }
            let got = &owners[0].state.iter().find(|(n, _)| n == name).unwrap().1;
            assert_eq!(got, bits, "{what}: `{name}`'s f32 value on its owner");
        }
        // Both ranks own a shard (the partition is balanced by size).
        for r in &sharded {
            assert!(r.owned.len() < plain[0].owned.len(), "{what}: a rank owns everything");
        }
    }
}

#[test]
fn a_sharded_run_steps_bit_for_bit_like_the_unsharded_one_with_the_guard() {
    let sgd = Extras::default();
    let adamw_clipped = Extras::adamw_clipped();
    check_sharded(2, OptLevel::O0, HalfType::F16, Api::Guard, sgd);
    check_sharded(2, OptLevel::O0, HalfType::F16, Api::Guard, adamw_clipped);
    check_sharded(2, OptLevel::O2, HalfType::F16, Api::Guard, adamw_clipped);
    check_sharded(2, OptLevel::O2, HalfType::Bf16, Api::Guard, sgd);
    check_sharded(2, OptLevel::O3, HalfType::F16, Api::Guard, adamw_clipped);
    check_sharded(2, OptLevel::O3, HalfType::Bf16, Api::Guard, sgd);
}

#[test]
fn a_sharded_run_steps_bit_for_bit_like_the_unsharded_one_with_grad_scaler_and_accumulation() {
    let adamw_clipped = Extras::adamw_clipped();
    check_sharded(2, OptLevel::O1, HalfType::F16, Api::ScalerAccumulating, adamw_clipped);
    check_sharded(2, OptLevel::O2, HalfType::Bf16, Api::ScalerAccumulating, adamw_clipped);
    check_sharded(
        2,
        OptLevel::O1,
        HalfType::Bf16,
        Api::ScalerAccumulating,
        Extras::default(),
    );
}

#[test]
fn a_sharded_run_on_the_device_path_steps_bit_for_bit_like_the_unsharded_one() {
    // The device path forced on the CPU: gradients, flags and clipping as device tensors.
    let on_device = |e: Extras| Extras { device_path: true, ..e };
    let adamw = on_device(Extras::adamw_clipped());
    check_sharded(2, OptLevel::O2, HalfType::F16, Api::Guard, adamw);
    check_sharded(2, OptLevel::O0, HalfType::F16, Api::ScalerAccumulating, adamw);
    check_sharded(
        3,
        OptLevel::O3,
        HalfType::Bf16,
        Api::Guard,
        on_device(Extras::default()),
    );
}

#[test]
fn three_ranks_shard_unevenly_and_still_step_like_the_unsharded_run() {
    let adamw = Extras::adamw_clipped();
    check_sharded(3, OptLevel::O2, HalfType::F16, Api::Guard, adamw);
    check_sharded(
        3,
        OptLevel::O0,
        HalfType::F16,
        Api::ScalerAccumulating,
        Extras::default(),
    );
}

/// Builds the scenarios' network at O2 on each rank with `sharding`.
fn o2_rank(
    c: std::sync::Arc<dyn amp::distributed::Communicator>,
    sharding: Sharding,
) -> (amp::Amp, std::sync::Arc<DataParallel>) {
    let amp = amp::Amp::new(
        AmpConfig::new(OptLevel::O2).seed(10 + c.rank() as u64).verbosity(0),
        &Device::Cpu,
    )
    .unwrap();
    let _m = amp.model(|vb| Net::new(vb, false)).unwrap();
    let d = DataParallel::sharded(&amp, c, Default::default(), sharding).unwrap();
    (amp, d)
}

#[test]
fn each_rank_keeps_the_masters_of_its_own_shard_only() {
    let got = on_ranks(2, T, |c| {
        let (amp, d) = o2_rank(c, Sharding::Stage1);
        let masters: Vec<(String, bool)> = amp
            .store()
            .params()
            .iter()
            .map(|p| (p.name().to_string(), p.master().is_some()))
            .collect();
        let owners: Vec<Option<usize>> = masters.iter().map(|(n, _)| d.owner_of(n)).collect();
        (d.rank(), masters, owners, d.shard_sizes())
    });
    let (_, _, owners0, sizes) = &got[0];
    assert_eq!(owners0, &got[1].2, "the ranks agree on the partition");
    // a.weight (96) alone on one rank; the rest (16 + 32 + 2 + 32 + 2 = 84) on the other.
    let mut s = sizes.clone();
    s.sort();
    assert_eq!(s, vec![84, 96]);
    for (rank, masters, owners, _) in &got {
        for ((name, has), owner) in masters.iter().zip(owners) {
            assert_eq!(*has, *owner == Some(*rank), "rank {rank}: `{name}`'s master");
        }
    }
}

#[test]
fn calls_that_need_the_whole_state_are_refused_on_a_sharded_rank_and_write_nothing() {
    let dir = std::env::temp_dir().join(format!("candle-amp-zero-refused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let errs = on_ranks(2, T, |c| {
        let (amp, _d) = o2_rank(c.clone(), Sharding::Stage2);
        let opt = amp
            .optimizer(amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1)).unwrap())
            .unwrap();
        let ckpt = CheckpointDir::new(dir.join(format!("r{}", c.rank())), 2);
        vec![
            amp.state_dict().map(|_| ()).unwrap_err(),
            opt.state_dict().map(|_| ()).unwrap_err(),
            opt.master_params().map(|_| ()).unwrap_err(),
            amp::checkpoint::Checkpoint::capture(&amp, &[&opt], 0)
                .map(|_| ())
                .unwrap_err(),
            ckpt.save(&amp, &[&opt], 0, serde_json::Value::Null)
                .map(|_| ())
                .unwrap_err(),
        ]
    });
    for (rank, errs) in errs.iter().enumerate() {
        for e in errs {
            match e {
                AmpError::Distributed {
                    rank: r,
                    kind: DistErrorKind::Sharded,
                    detail,
                } => {
                    assert_eq!(*r, rank);
                    assert!(detail.contains("shard"), "{detail}");
                }
                other => panic!("expected a Sharded error, got {other}"),
            }
        }
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing was written");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_that_disagree_on_sharding_all_fail_before_training() {
    let errs = on_ranks(2, T, |c| {
        let s = if c.rank() == 0 {
            Sharding::Stage1
        } else {
            Sharding::None
        };
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2).verbosity(0), &Device::Cpu).unwrap();
        let _m = amp.model(|vb| Net::new(vb, false)).unwrap();
        DataParallel::sharded(&amp, c, Default::default(), s)
            .map(|_| ())
            .unwrap_err()
    });
    for e in errs {
        assert!(
            matches!(
                e,
                AmpError::Distributed {
                    kind: DistErrorKind::Mismatch,
                    ..
                }
            ),
            "{e}"
        );
    }
}

/// Trains steps `from..to` of `data()` on this rank's shard (AdamW, dynamic loss scale,
/// `sharding`), restoring `resume` first and saving to `save` at `to` with
/// `DataParallel::save_checkpoint` (every rank; one process saves alone). Returns the
/// working weights, each owned parameter's f32 value and the loss scale.
fn span(
    comm: Option<std::sync::Arc<dyn amp::distributed::Communicator>>,
    level: OptLevel,
    sharding: Sharding,
    from: usize,
    to: usize,
    resume: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Span {
    let rank = comm.as_ref().map_or(0, |c| c.rank());
    let world = comm.as_ref().map_or(1, |c| c.world_size());
    let cfg = AmpConfig::new(level).seed(30 + rank as u64).verbosity(0);
    let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let model = amp.model(|vb| Net::new(vb, false)).unwrap();
    let adamw = amp::optim::AdamW::new(amp::optim::AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })
    .unwrap();
    let mut opt = amp.optimizer(adamw).unwrap();
    let ddp = comm.map(|c| DataParallel::sharded(&amp, c, Default::default(), sharding).unwrap());
    if let Some(dir) = resume {
        let ck = CheckpointDir::new(dir, 1).load().unwrap();
        assert_eq!(ck.step(), from as u64);
        ck.restore(&amp, &mut [&mut opt]).unwrap();
    }
    for (x, y) in data().into_iter().take(to).skip(from) {
        let (x, y) = (shard(&x, rank, world), shard(&y, rank, world));
        let loss = amp::ops::mse(
            &model.forward(&x).unwrap().to_dtype(candle_core::DType::F32).unwrap(),
            &y,
        )
        .unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    if let Some(dir) = save {
        let d = CheckpointDir::new(dir, 1);
        match &ddp {
            Some(ddp) => ddp.save_checkpoint(&d, &amp, &[&opt], to as u64, serde_json::Value::Null),
            None => d.save(&amp, &[&opt], to as u64, serde_json::Value::Null),
        }
        .unwrap();
    }
    let owned = |n: &str| ddp.as_ref().and_then(|d| d.owner_of(n)).is_none_or(|r| r == rank);
    // The optimizer state this rank holds: its own shard's only.
    let state: Vec<String> = amp::testing::live_buffers(&amp, &[&opt])
        .unwrap()
        .into_iter()
        .filter_map(|(n, _)| {
            n.split_once(".state.")
                .map(|(_, rest)| rest.rsplit_once('.').unwrap().0.to_string())
        })
        .collect();
    for n in &state {
        assert!(owned(n), "rank {rank} holds optimizer state of `{n}`, another rank's");
    }
    Span {
        working: working_of(&amp),
        owned: state_of(&amp).into_iter().filter(|(n, _)| owned(n)).collect(),
        state,
        scale: amp.loss_scale(0).unwrap(),
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Span {
    working: Vec<(String, Vec<u32>)>,
    owned: Vec<(String, Vec<u32>)>,
    /// The parameters this rank holds optimizer state of.
    state: Vec<String>,
    scale: f32,
}

/// Every rank's owned f32 values together (each parameter once), by name.
fn all_owned(ranks: &[Span]) -> Vec<(String, Vec<u32>)> {
    let mut all: Vec<(String, Vec<u32>)> = ranks.iter().flat_map(|s| s.owned.clone()).collect();
    all.sort();
    all.dedup();
    all
}

#[test]
fn a_sharded_checkpoint_resumes_bit_for_bit_on_the_same_ranks_and_at_any_world_size() {
    let dir = std::env::temp_dir().join(format!("candle-amp-zero-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let half = STEPS / 2;
    for level in [OptLevel::O2, OptLevel::O0] {
        for stage in [Sharding::Stage1, Sharding::Stage2] {
            let what = format!("{level} {stage}");
            let _ = std::fs::remove_dir_all(&dir);
            on_ranks(2, T, |c| span(Some(c), level, stage, 0, half, None, Some(&dir)));
            // Each rank wrote its own shard's files.
            let files = CheckpointDir::new(&dir, 1).latest_weight_files().unwrap();
            assert_eq!(files.len(), 2, "{what}");
            let straight = on_ranks(2, T, |c| span(Some(c), level, stage, 0, STEPS, None, None));
            // The same ranks: bit for bit as training straight through.
            let two = on_ranks(2, T, |c| span(Some(c), level, stage, half, STEPS, Some(&dir), None));
            assert_eq!(two, straight, "{what}: resumed on 2 ranks");
            // Three sharded ranks (or one process) restore exactly the saved state: every
            // parameter's f32 value on its new owner, and the working weights.
            let saved = on_ranks(2, T, |c| span(Some(c), level, stage, 0, half, None, None));
            let three = on_ranks(3, T, |c| span(Some(c), level, stage, half, half, Some(&dir), None));
            for r in &three {
                assert_eq!(r.working, saved[0].working, "{what}: 3 ranks' working weights");
            }
            assert_eq!(all_owned(&three), all_owned(&saved), "{what}: 3 ranks' f32 values");
            let one = span(None, level, Sharding::None, half, half, Some(&dir), None);
            assert_eq!(one.working, saved[0].working, "{what}: one process");
            assert_eq!(one.owned, all_owned(&saved), "{what}: one process's f32 values");
            assert_eq!(one.scale, saved[0].scale, "{what}: loss scale");
            // ... and one process trains on from there like the ranks (O0: up to f32 sums).
            if level == OptLevel::O0 {
                let one = span(None, level, Sharding::None, half, STEPS, Some(&dir), None);
                for ((n, a), (_, b)) in one.owned.iter().zip(&all_owned(&straight)) {
                    for (x, y) in a.iter().zip(b) {
                        let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
                        assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{what}: {n} {x} vs {y}");
                    }
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_one_process_saved_loads_into_a_sharded_run() {
    let dir = std::env::temp_dir().join(format!("candle-amp-zero-from-one-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let half = STEPS / 2;
    let saved = span(None, OptLevel::O2, Sharding::None, 0, half, None, Some(&dir));
    let plain = on_ranks(2, T, |c| {
        span(Some(c), OptLevel::O2, Sharding::None, half, STEPS, Some(&dir), None)
    });
    for stage in [Sharding::Stage1, Sharding::Stage2] {
        let restored = on_ranks(2, T, |c| {
            span(Some(c), OptLevel::O2, stage, half, half, Some(&dir), None)
        });
        assert_eq!(all_owned(&restored), saved.owned, "{stage}: the restored f32 values");
        let sharded = on_ranks(2, T, |c| {
            span(Some(c), OptLevel::O2, stage, half, STEPS, Some(&dir), None)
        });
        for r in &sharded {
            assert_eq!(
                r.working, plain[0].working,
                "{stage}: trained on like the unsharded ranks"
            );
        }
        assert_eq!(all_owned(&sharded), all_owned(&plain), "{stage}");
        // The ranks split the optimizer state between them.
        assert!(
            sharded
                .iter()
                .all(|r| !r.state.is_empty() && r.state.len() < saved.state.len())
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_dies_mid_step_ends_a_sharded_step_with_a_timeout_and_nothing_applied() {
    let out = common::on_ranks(2, Duration::from_millis(500), |c| {
        let rank = c.rank();
        let (amp, _d) = o2_rank(c, Sharding::Stage2);
        let model = amp.model(|vb| Net::new(vb, false)).unwrap();
        let mut opt = amp
            .optimizer(amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1)).unwrap())
            .unwrap();
        let (x, y) = data().remove(0);
        let loss = amp::ops::mse(
            &model.forward(&x).unwrap().to_dtype(candle_core::DType::F32).unwrap(),
            &y,
        )
        .unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        if rank == 1 {
            return None; // dies after its backward, before the step's collectives
        }
        let before = working_of(&amp);
        let err = opt.step().unwrap_err();
        Some((err, before == working_of(&amp), opt.steps()))
    });
    match &out[0] {
        Some((
            AmpError::Distributed {
                kind: DistErrorKind::Timeout,
                ..
            },
            unchanged,
            steps,
        )) => {
            assert!(*unchanged, "a failed step changed the weights");
            assert_eq!(*steps, 0);
        }
        Some((other, ..)) => panic!("expected a timeout, got {other}"),
        None => unreachable!(),
    }
}

/// Two optimizers (SGD for `a`, AdamW for the rest), O2, `ranks` ranks: every parameter's
/// working bits and the f32 values this rank owns.
fn two_optimizers(c: Option<std::sync::Arc<dyn amp::distributed::Communicator>>, sharding: Sharding) -> Span {
    let rank = c.as_ref().map_or(0, |c| c.rank());
    let world = c.as_ref().map_or(1, |c| c.world_size());
    let amp = amp::Amp::new(
        AmpConfig::new(OptLevel::O2).seed(50 + rank as u64).verbosity(0),
        &Device::Cpu,
    )
    .unwrap();
    let model = amp.model(|vb| Net::new(vb, false)).unwrap();
    let mut sgd = amp
        .optimizer_for(amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.05)).unwrap(), |n| {
            n.starts_with("a.")
        })
        .unwrap();
    let mut adamw = amp
        .optimizer_for(amp::optim::AdamW::new(Default::default()).unwrap(), |n| {
            !n.starts_with("a.")
        })
        .unwrap();
    let ddp = c.map(|c| DataParallel::sharded(&amp, c, Default::default(), sharding).unwrap());
    for (x, y) in data_with(false) {
        let (x, y) = (shard(&x, rank, world), shard(&y, rank, world));
        let out = model.forward(&x).unwrap().to_dtype(candle_core::DType::F32).unwrap();
        let loss = amp::ops::mse(&out, &y).unwrap();
        amp.scale_loss_multi(&loss, 0, vec![&mut sgd, &mut adamw])
            .unwrap()
            .backward()
            .unwrap();
        sgd.step().unwrap();
        adamw.step().unwrap();
        sgd.zero_grad();
        adamw.zero_grad();
    }
    let owned = |n: &str| ddp.as_ref().and_then(|d| d.owner_of(n)).is_none_or(|r| r == rank);
    Span {
        working: working_of(&amp),
        owned: state_of(&amp).into_iter().filter(|(n, _)| owned(n)).collect(),
        state: Vec::new(),
        scale: amp.loss_scale(0).unwrap(),
    }
}

#[test]
fn two_optimizers_over_one_sharded_run_step_like_the_unsharded_run() {
    let plain = on_ranks(2, T, |c| two_optimizers(Some(c), Sharding::None));
    for stage in [Sharding::Stage1, Sharding::Stage2] {
        let sharded = on_ranks(2, T, |c| two_optimizers(Some(c), stage));
        for r in &sharded {
            assert_eq!(r.working, plain[0].working, "{stage}");
        }
        assert_eq!(all_owned(&sharded), all_owned(&plain), "{stage}");
    }
}

#[test]
fn one_sharded_rank_owns_everything_and_steps_like_one_process() {
    let one = two_optimizers(None, Sharding::None);
    for stage in [Sharding::Stage1, Sharding::Stage2] {
        let r = on_ranks(1, T, |c| two_optimizers(Some(c), stage));
        assert_eq!(r[0].working, one.working, "{stage}");
        assert_eq!(r[0].owned, one.owned, "{stage}");
    }
}
