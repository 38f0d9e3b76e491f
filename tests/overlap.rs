//! Communication overlapped with the backward (`DataParallel::set_overlap`) on the in-process
//! test double (`LocalGroup`): an overlapped run ends bit for bit where the run without
//! overlap ends (which `tests/dist.rs` checks against one process over the whole batch), at
//! every level and half type, with SGD and AdamW, accumulation with and without `no_sync`,
//! clipping, an overflowing step, synchronised batch norm, ZeRO stage 1, a head only one
//! rank uses and 3 ranks; the buckets really leave during the backward; misuse fails with
//! typed errors naming the bucket.
mod common;

mod dist_scenarios;

use std::sync::Arc;
use std::time::Duration;

use candle_amp::distributed::{Communicator, DataParallel, DataParallelConfig, LocalGroup, Sharding};
use candle_amp::{self as amp, AmpConfig, AmpError, DistErrorKind, HalfType, OptLevel};
use candle_core::{DType, Device, Tensor};
use common::on_ranks;
use dist_scenarios::*;

const T: Duration = Duration::from_secs(60);

/// The kind of a data-parallel error (`None` for any other error).
fn kind_of(e: &AmpError) -> Option<DistErrorKind> {
    match e {
        AmpError::Distributed { kind, .. } => Some(*kind),
        _ => None,
    }
}

/// `world` ranks with overlap against the same run without: the same f32 state and working
/// weights bit for bit on every rank, the same skipped steps and norms; every step after the
/// first (which learns the order) reduced from the buckets, some of which left during the
/// backward.
#[allow(clippy::too_many_arguments)]
fn check_overlapped(
    world: usize,
    level: OptLevel,
    half: HalfType,
    api: Api,
    with_bn: bool,
    extra: bool,
    extras: Extras,
    expect_overlapped: u64,
) {
    let what = format!(
        "{world} ranks, {level} {half}, bn={with_bn} extra={extra} adamw={} clip={:?} {} no_sync={} sharding={}",
        extras.adamw,
        extras.clip,
        match api {
            Api::Guard => "guard",
            Api::GuardAccumulating => "guard x2",
            Api::ScalerAccumulating => "scaler x2",
        },
        extras.no_sync,
        extras.sharding
    );
    let run = |overlap: bool| {
        on_ranks(world, T, |c| {
            train_with(
                Some(c),
                world,
                level,
                half,
                api,
                with_bn,
                extra,
                Extras { overlap, ..extras },
            )
        })
    };
    let plain = run(false);
    let over = run(true);
    for (r, (o, p)) in over.iter().zip(&plain).enumerate() {
        assert_eq!(o.state, p.state, "{what}: rank {r}'s f32 state");
        assert_eq!(o.working, p.working, "{what}: rank {r}'s working weights");
        assert_eq!(o.skipped, p.skipped, "{what}: skipped steps");
        assert_eq!(o.norms, p.norms, "{what}: clipping norms");
        assert_eq!(o.reductions, STEPS as u64, "{what}: one reduction per step");
        assert_eq!(
            o.overlapped_steps, expect_overlapped,
            "{what}: steps reduced from the buckets"
        );
        // At O0 every layer computes in f32 on candle's own path: its gradients are ready
        // only when candle's backward returns, so the buckets leave then. With the extra
        // head, rank 1 (which never uses it) writes its zeros when the backward starts, so
        // it overlaps too. With synchronised batch norm every bucket waits for the flush (its
        // sums must keep their place among the buckets).
        if with_bn {
            assert_eq!(o.early_buckets, 0, "{what}: a bucket left before batch norm's sums");
        } else if expect_overlapped > 0 && level != OptLevel::O0 {
            assert!(
                o.early_buckets > 0,
                "{what}: no bucket left during the backward on rank {r}"
            );
        }
    }
    assert_eq!(over[0].working, over[world - 1].working, "{what}: ranks diverged");
}

#[test]
fn overlapped_runs_end_bit_for_bit_where_unoverlapped_runs_end_at_every_level() {
    let d = Extras::default();
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            if level == OptLevel::O0 && half == HalfType::Bf16 {
                continue;
            }
            // The inf at INF_STEP: that step is skipped on every rank in both runs.
            check_overlapped(2, level, half, Api::Guard, false, false, d, STEPS as u64 - 1);
        }
    }
}

#[test]
fn adamw_clipping_accumulation_and_no_sync_overlap_exactly() {
    let ac = Extras::adamw_clipped();
    let n = STEPS as u64 - 1;
    check_overlapped(2, OptLevel::O2, HalfType::F16, Api::Guard, false, false, ac, n);
    // Two micro-batches: the first under no_sync sends nothing, the second the whole step.
    let ns = Extras { no_sync: true, ..ac };
    check_overlapped(
        2,
        OptLevel::O2,
        HalfType::Bf16,
        Api::GuardAccumulating,
        false,
        false,
        ns,
        n,
    );
    check_overlapped(
        2,
        OptLevel::O0,
        HalfType::F16,
        Api::GuardAccumulating,
        false,
        false,
        ns,
        n,
    );
    // Without no_sync each micro-batch sends its buckets: the last ones hold the step.
    check_overlapped(
        2,
        OptLevel::O3,
        HalfType::F16,
        Api::GuardAccumulating,
        false,
        false,
        ac,
        n,
    );
    // ZeRO stage 1 all-reduces, so it overlaps too; 3 ranks.
    let z = Extras {
        sharding: Sharding::Stage1,
        ..ac
    };
    check_overlapped(2, OptLevel::O2, HalfType::F16, Api::Guard, false, false, z, n);
    check_overlapped(3, OptLevel::O2, HalfType::Bf16, Api::Guard, false, false, ac, n);
}

#[test]
fn batch_norm_an_unused_head_and_the_grad_scaler_path() {
    let d = Extras::default();
    let n = STEPS as u64 - 1;
    // Batch norm's parameters are on candle's path (sent when its backward returns) and its
    // synchronised sums take their turn on the communication thread.
    check_overlapped(2, OptLevel::O2, HalfType::F16, Api::Guard, true, false, d, n);
    check_overlapped(2, OptLevel::O1, HalfType::Bf16, Api::Guard, true, false, d, n);
    // The `extra` head trains on rank 0's samples only: rank 1 sends zeros for it.
    check_overlapped(2, OptLevel::O2, HalfType::F16, Api::Guard, false, true, d, n);
    // Both: the ranks' readiness differs and batch norm's backward sums sit among the
    // buckets, which wait for the flush so every rank's collectives keep one order.
    check_overlapped(2, OptLevel::O2, HalfType::Bf16, Api::Guard, true, true, d, n);
    // GradScaler's backward is not the guard's: reduced at the step, as without overlap.
    check_overlapped(
        2,
        OptLevel::O2,
        HalfType::F16,
        Api::ScalerAccumulating,
        false,
        false,
        d,
        0,
    );
}

#[test]
fn overlapped_ranks_match_one_process_over_the_whole_batch() {
    let one = train(None, 2, OptLevel::O0, HalfType::F16, Api::Guard, false, false);
    let two = on_ranks(2, T, |c| {
        let e = Extras {
            overlap: true,
            ..Default::default()
        };
        train_with(Some(c), 2, OptLevel::O0, HalfType::F16, Api::Guard, false, false, e)
    });
    assert_eq!(two[0].state, two[1].state);
    assert_close(&two[0], &one, 1e-6, "O0 overlapped vs one process");
    assert_eq!(two[0].skipped, 1);
}

/// Three `amp::nn::linear` layers: their gradients leave during the backward. With `tie`
/// on, the first layer's weight is also used by raw tensor maths (candle's path).
struct Three(Vec<amp::nn::Linear>, Arc<std::sync::atomic::AtomicBool>);

impl candle_nn::Module for Three {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.0.iter().try_fold(x.clone(), |h, l| l.forward(&h))?;
        if !self.1.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(y);
        }
        let w = self.0[0].weight();
        let tied = x
            .to_dtype(w.dtype())?
            .matmul(&w.t()?)?
            .sum_keepdim(1)?
            .affine(0.01, 0.0)?;
        let dt = y.dtype();
        y + tied.to_dtype(dt)?
    }
}

/// A small run for the misuse tests, with 4-byte buckets: every parameter has its own.
fn small_run(seed: u64) -> (amp::AmpModel<Three>, amp::AmpOptimizer, amp::Amp) {
    amp::initialize(
        |vb| {
            Ok(Three(
                vec![
                    amp::nn::linear(4, 8, vb.pp("l0"))?,
                    amp::nn::linear(8, 8, vb.pp("l1"))?,
                    amp::nn::linear(8, 1, vb.pp("l2"))?,
                ],
                Arc::new(std::sync::atomic::AtomicBool::new(false)),
            ))
        },
        amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(OptLevel::O2).seed(seed).verbosity(0),
    )
    .unwrap()
}

fn small_loss(model: &amp::AmpModel<Three>, rank: usize) -> Tensor {
    let x = Tensor::arange(0f32, 16.0, &Device::Cpu)
        .unwrap()
        .affine(0.1, rank as f64)
        .unwrap()
        .reshape((4, 4))
        .unwrap();
    let h = model.forward(&x).unwrap();
    amp::ops::mse(&h.to_dtype(DType::F32).unwrap(), &x.narrow(1, 0, 1).unwrap()).unwrap()
}

fn ddp_for(amp: &amp::Amp, c: Arc<dyn Communicator>) -> Arc<DataParallel> {
    DataParallel::new(amp, c, DataParallelConfig { bucket_bytes: 4 }).unwrap()
}

#[test]
fn overlap_is_switched_on_everywhere_or_nowhere_and_not_under_stage_2() {
    let errs = on_ranks(2, T, |c| {
        let (_m, _o, amp) = small_run(1);
        let rank = c.rank();
        let ddp = ddp_for(&amp, c);
        ddp.set_overlap(&amp, rank == 0).unwrap_err()
    });
    for e in errs {
        assert_eq!(kind_of(&e), Some(DistErrorKind::Mismatch), "{e}");
    }
    let errs = on_ranks(2, T, |c| {
        let (_m, _o, amp) = small_run(1);
        let ddp = DataParallel::sharded(&amp, c, Default::default(), Sharding::Stage2).unwrap();
        let e = ddp.set_overlap(&amp, true).unwrap_err();
        (e, ddp.overlaps())
    });
    for (e, on) in errs {
        assert!(matches!(e, AmpError::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains("Stage1"), "{e}");
        assert!(!on);
    }
    // The device path (on every rank: on one only, `DataParallel::new` refuses the run).
    let errs = on_ranks(2, T, |c| {
        let cfg = AmpConfig::new(OptLevel::O2).seed(1).verbosity(0).device_path(true);
        let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
        let _model = amp.model(|vb| amp::nn::linear(4, 1, vb.pp("fc"))).unwrap();
        let _opt = amp
            .optimizer(amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1)).unwrap())
            .unwrap();
        let ddp = ddp_for(&amp, c);
        let e = ddp.set_overlap(&amp, true).unwrap_err();
        (e, ddp.overlaps())
    });
    for (e, on) in errs {
        assert!(matches!(e, AmpError::InvalidArgument { .. }), "{e}");
        assert!(!on);
    }
}

/// Two optimizers over one backward (`scale_loss_multi`): both step from the buckets, and
/// the run ends where the run without overlap ends.
#[test]
fn two_optimizers_of_one_backward_both_step_from_the_buckets() {
    let run = |overlap: bool| {
        on_ranks(2, T, |c| {
            let rank = c.rank();
            let amp = amp::Amp::new(
                AmpConfig::new(OptLevel::O2).seed(50 + rank as u64).verbosity(0),
                &Device::Cpu,
            )
            .unwrap();
            let model = amp.model(|vb| Net::new(vb, false)).unwrap();
            let sgd = amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.05)).unwrap();
            let mut sgd = amp.optimizer_for(sgd, |n| n.starts_with("a.")).unwrap();
            let adamw = amp::optim::AdamW::new(Default::default()).unwrap();
            let mut adamw = amp.optimizer_for(adamw, |n| !n.starts_with("a.")).unwrap();
            let ddp = DataParallel::new(&amp, c, DataParallelConfig { bucket_bytes: 256 }).unwrap();
            ddp.set_overlap(&amp, overlap).unwrap();
            for (x, y) in data_with(false) {
                let (x, y) = (shard(&x, rank, 2), shard(&y, rank, 2));
                let out = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
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
            (state_of(&amp), ddp.overlapped_steps())
        })
    };
    let plain = run(false);
    let over = run(true);
    for r in 0..2 {
        assert_eq!(over[r].0, plain[r].0, "rank {r}");
        // Both optimizers of every step but the first (which learns the order).
        assert_eq!(over[r].1, 2 * (STEPS as u64 - 1), "rank {r}");
    }
}

#[test]
fn a_backward_under_no_sync_on_one_rank_only_fails_naming_the_bucket() {
    // A short timeout: after the mismatch, rank 0's later buckets wait for a rank that left.
    let out = on_ranks(2, Duration::from_secs(3), |c| {
        let (model, mut opt, amp) = small_run(c.rank() as u64);
        let rank = c.rank();
        let ddp = ddp_for(&amp, c);
        ddp.set_overlap(&amp, true).unwrap();
        // Step 1 learns the order.
        amp.scale_loss(&small_loss(&model, rank), &mut opt)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        assert_eq!(ddp.overlap_buckets(), 6);
        let before = amp.store().params()[0].f32_value().unwrap().to_vec2::<f32>().unwrap();
        // Step 2: rank 1 wraps its only backward in no_sync (misuse), rank 0 sends.
        {
            let _g = (rank == 1).then(|| ddp.no_sync());
            amp.scale_loss(&small_loss(&model, rank), &mut opt)
                .unwrap()
                .backward()
                .unwrap();
        }
        let e = opt.step().unwrap_err();
        let after = amp.store().params()[0].f32_value().unwrap().to_vec2::<f32>().unwrap();
        (e, before == after)
    });
    for (r, (e, unchanged)) in out.iter().enumerate() {
        assert_eq!(kind_of(e), Some(DistErrorKind::Mismatch), "rank {r}: {e}");
        assert!(unchanged, "rank {r}: a failed step changed the weights");
    }
    // The rank whose buckets went out names the first one.
    assert!(out[0].0.to_string().contains("bucket 0 of 6"), "{}", out[0].0);
}

#[test]
fn buckets_of_different_backwards_meeting_fail_on_their_header() {
    // Two micro-batches; rank 0 wraps the first in no_sync, rank 1 does not: rank 1's first
    // buckets meet rank 0's second ones, of the same lengths, so only the header tells.
    let out = on_ranks(2, Duration::from_secs(3), |c| {
        let (model, mut opt, amp) = small_run(c.rank() as u64);
        let rank = c.rank();
        let ddp = ddp_for(&amp, c);
        ddp.set_overlap(&amp, true).unwrap();
        amp.scale_loss(&small_loss(&model, rank), &mut opt)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        let before = amp.store().params()[0].f32_value().unwrap().to_vec2::<f32>().unwrap();
        let first = {
            let _g = (rank == 0).then(|| ddp.no_sync());
            amp.scale_loss(&small_loss(&model, rank), &mut opt).unwrap().backward()
        };
        let e = match first {
            Err(e) => e,
            Ok(_) => match amp.scale_loss(&small_loss(&model, rank), &mut opt).unwrap().backward() {
                Err(e) => e,
                Ok(_) => opt.step().unwrap_err(),
            },
        };
        let after = amp.store().params()[0].f32_value().unwrap().to_vec2::<f32>().unwrap();
        (e, before == after)
    });
    for (r, (e, unchanged)) in out.iter().enumerate() {
        assert_eq!(kind_of(e), Some(DistErrorKind::Mismatch), "rank {r}: {e}");
        assert!(e.to_string().contains("summed different buckets"), "rank {r}: {e}");
        assert!(e.to_string().contains("bucket 0 of 6"), "rank {r}: {e}");
        assert!(unchanged, "rank {r}");
    }
}

#[test]
fn a_rank_that_stops_mid_step_times_out_the_others_naming_the_bucket() {
    let comms = LocalGroup::with_timeout(2, Duration::from_millis(400));
    let out: Vec<Option<(AmpError, bool)>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let c: Arc<dyn Communicator> = Arc::new(c);
                    let rank = c.rank();
                    let (model, mut opt, amp) = small_run(rank as u64);
                    let ddp = ddp_for(&amp, c);
                    ddp.set_overlap(&amp, true).unwrap();
                    amp.scale_loss(&small_loss(&model, rank), &mut opt)
                        .unwrap()
                        .backward()
                        .unwrap();
                    opt.step().unwrap();
                    opt.zero_grad();
                    if rank == 1 {
                        // Dies before its second backward.
                        return None;
                    }
                    let before = amp.store().params()[0].f32_value().unwrap().to_vec2::<f32>().unwrap();
                    amp.scale_loss(&small_loss(&model, rank), &mut opt)
                        .unwrap()
                        .backward()
                        .unwrap();
                    let e = opt.step().unwrap_err();
                    let after = amp.store().params()[0].f32_value().unwrap().to_vec2::<f32>().unwrap();
                    Some((e, before == after))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (e, unchanged) = out[0].as_ref().unwrap();
    assert_eq!(kind_of(e), Some(DistErrorKind::Timeout), "{e}");
    assert!(e.to_string().contains("bucket 0 of 6"), "{e}");
    assert!(unchanged);
}

#[test]
fn a_one_rank_group_overlaps_and_steps_as_without() {
    let run = |overlap: bool| {
        let c: Arc<dyn Communicator> = Arc::new(LocalGroup::new(1).remove(0));
        let (model, mut opt, amp) = small_run(3);
        let ddp = ddp_for(&amp, c);
        ddp.set_overlap(&amp, overlap).unwrap();
        for _ in 0..4 {
            amp.scale_loss(&small_loss(&model, 0), &mut opt)
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
        let w: Vec<Vec<f32>> = amp
            .store()
            .params()
            .iter()
            .map(|p| p.f32_value().unwrap().flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        (w, ddp.overlapped_steps(), ddp.early_buckets())
    };
    let (plain, _, _) = run(false);
    let (over, steps, early) = run(true);
    assert_eq!(over, plain);
    assert_eq!(steps, 3);
    // Six buckets a step, all but candle's own leave during the backward: here every
    // parameter is a library layer's, so all six.
    assert_eq!(early, 18);
}

/// Five steps on two ranks, with the first layer's weight tied to raw tensor maths from step
/// `tie_from` on (never with `None`): the weights (as bits), steps reduced from the buckets,
/// buckets sent during the backward.
fn tied_run(overlap: bool, tie_from: Option<usize>) -> (Vec<Vec<u32>>, u64, u64) {
    let out = on_ranks(2, T, |c| {
        let rank = c.rank();
        let (model, mut opt, amp) = small_run(rank as u64);
        let ddp = ddp_for(&amp, c);
        ddp.set_overlap(&amp, overlap).unwrap();
        for step in 0..5 {
            let tie = tie_from.is_some_and(|t| step >= t);
            model.inner().1.store(tie, std::sync::atomic::Ordering::SeqCst);
            amp.scale_loss(&small_loss(&model, rank), &mut opt)
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
        let w: Vec<Vec<u32>> = amp
            .store()
            .params()
            .iter()
            .map(|p| {
                let v: Vec<f32> = p.f32_value().unwrap().flatten_all().unwrap().to_vec1().unwrap();
                v.into_iter().map(f32::to_bits).collect()
            })
            .collect();
        (w, ddp.overlapped_steps(), ddp.early_buckets())
    });
    assert_eq!(out[0].0, out[1].0, "the ranks diverged");
    out.into_iter().next().unwrap()
}

#[test]
fn a_weight_also_on_candles_path_is_sent_when_the_backward_returns() {
    let (plain, _, _) = tied_run(false, Some(0));
    let (over, steps, early) = tied_run(true, Some(0));
    assert_eq!(over, plain);
    // Learned once (step 1), then every step from the buckets; the tied weight's bucket and
    // those after it leave when candle's backward returns, the ones before it earlier.
    assert_eq!(steps, 4);
    assert!(early > 0 && early < 4 * 6, "{early} of 24 buckets left early");
}

#[test]
fn a_graph_that_changes_after_the_plan_is_reduced_without_the_buckets_and_learned_again() {
    let (plain, _, _) = tied_run(false, Some(1));
    let (over, steps, _) = tied_run(true, Some(1));
    // Step 1 learns without the tie; step 2's tied weight gets a gradient after its bucket
    // left: reduced as without overlap, the plan dropped; step 3 learns again; steps 4
    // and 5 use the buckets.
    assert_eq!(over, plain);
    assert_eq!(steps, 2);
}
