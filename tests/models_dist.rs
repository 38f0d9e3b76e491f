//! `models::llama`, `bert` and `vit` under `DataParallel` and ZeRO stages 1 and 2 on the
//! in-process test double (`LocalGroup`, ranks as threads): two ranks, each on half of every
//! batch, end with the weights of one process that runs the two halves as micro-batches of
//! half the weight (gradients accumulated in f32), bit for bit (working weights on every
//! rank, f32 masters on their owners), and within rounding of one process over the whole
//! batch in one forward.
//!
//! On the CPU: the ranks are threads of one process on the host.

mod common;
mod model_tasks;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use candle_amp::distributed::{Communicator, DataParallel, DataParallelConfig, Sharding};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::Device;
use model_tasks::*;

const STEPS: usize = 4;
const ROWS: usize = 8;
const WORLD: usize = 2;

/// How the reference process computes a step's loss.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reference {
    /// Each half of the batch as a micro-batch with half the weight, the gradients
    /// accumulated in f32 before the step: what two ranks compute, in the same order of
    /// sums (a gradient summed over the halves in half precision inside one backward would
    /// round where the ranks' f32 average does not).
    Halves,
    /// One forward over the whole batch (other sums, so equal up to rounding only).
    Whole,
}

/// A run's end: the working weights, the f32 values of the parameters this rank owns
/// (every one without sharding), and the loss of each step on this rank's rows.
struct End {
    working: BTreeMap<String, Vec<u32>>,
    owned: BTreeMap<String, Vec<u32>>,
    losses: Vec<f32>,
}

/// Trains `arch` for `STEPS` steps: with a communicator, as its rank on its half of every
/// batch; without, in one process over every batch as `reference` says.
fn train(
    arch: Arch,
    level: OptLevel,
    half: HalfType,
    comm: Option<Arc<dyn Communicator>>,
    sharding: Sharding,
    reference: Reference,
) -> End {
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
    let dev = Device::Cpu;
    // A seed per rank: DataParallel must give every rank rank 0's weights.
    let cfg = AmpConfig::new(level).half(half).seed(10 + rank as u64).verbosity(0);
    let amp = amp::Amp::new(cfg, &dev).unwrap();
    let forward = build(arch, &amp);
    let mut opt = adamw(&amp);
    let ddp =
        comm.map(|c| DataParallel::sharded(&amp, c, DataParallelConfig { bucket_bytes: 4096 }, sharding).unwrap());
    let mut losses = Vec::new();
    for b in batches(arch, ROWS, STEPS, 9, &dev) {
        // The micro-batches this process runs, each with its weight in the step's loss.
        let micro: Vec<(Batch, f64)> = match (&ddp, reference) {
            (Some(_), _) => vec![(b.shard(rank, world), 1.0)],
            (None, Reference::Whole) => vec![(b, 1.0)],
            (None, Reference::Halves) => (0..WORLD).map(|r| (b.shard(r, WORLD), 1.0 / WORLD as f64)).collect(),
        };
        let mut step_loss = 0.0;
        for (m, weight) in micro {
            let l = (loss(arch, &forward(&m.input).unwrap(), &m) * weight).unwrap();
            step_loss += l.to_scalar::<f32>().unwrap();
            let report = amp.scale_loss(&l, &mut opt).unwrap().backward().unwrap();
            assert!(!report.found_inf, "{arch:?} {level} {half}: an overflow");
        }
        losses.push(step_loss);
        opt.step().unwrap();
        opt.zero_grad();
    }
    let owns = |name: &str| {
        ddp.as_ref()
            .and_then(|d| d.owner_of(name))
            .is_none_or(|owner| Some(owner) == ddp.as_ref().map(|d| d.rank()))
    };
    End {
        working: working_state(&amp),
        owned: f32_state(&amp).into_iter().filter(|(n, _)| owns(n)).collect(),
        losses,
    }
}

fn check(arch: Arch, level: OptLevel, half: HalfType) {
    let one = train(arch, level, half, None, Sharding::None, Reference::Halves);
    for sharding in [Sharding::None, Sharding::Stage1, Sharding::Stage2] {
        let what = format!("{arch:?} {level} {half}, {WORLD} ranks, {sharding}");
        let ranks = common::on_ranks(WORLD, Duration::from_secs(120), |c| {
            train(arch, level, half, Some(c), sharding, Reference::Halves)
        });
        let mut owned = BTreeMap::new();
        for (r, end) in ranks.iter().enumerate() {
            assert_eq!(end.working, one.working, "{what}: rank {r}'s working weights");
            for (name, v) in &end.owned {
                assert_eq!(Some(v), one.owned.get(name), "{what}: `{name}`'s f32 value on rank {r}");
                owned.insert(name.clone(), r);
            }
        }
        // Every parameter has an owner; with ZeRO, both ranks own part of the state.
        assert_eq!(owned.len(), one.owned.len(), "{what}: parameters without an owner");
        if sharding != Sharding::None {
            for (r, end) in ranks.iter().enumerate() {
                assert!(owned.values().any(|&o| o == r), "{what}: rank {r} owns nothing");
                assert!(end.owned.len() < one.owned.len(), "{what}: rank {r} owns everything");
            }
        }
        // The ranks' mean loss is the reference's (the loss of the same weights).
        for (s, &l) in one.losses.iter().enumerate() {
            let mean = ranks.iter().map(|e| e.losses[s]).sum::<f32>() / WORLD as f32;
            assert!(
                (mean - l).abs() <= 1e-6 * l.abs(),
                "{what}: step {s} loss {mean} vs {l}"
            );
        }
    }
    // One forward over the whole batch: the same steps up to the order of sums, so the
    // same losses within rounding (bf16 rounds the activations of both to 8 bits). (BERT's
    // loss is a mean over the real tokens, which the halves hold unequal numbers of: its
    // whole-batch loss is another objective.)
    if arch == Arch::Bert {
        return;
    }
    let whole = train(arch, level, half, None, Sharding::None, Reference::Whole);
    let tol = if level == OptLevel::O0 { 1e-5 } else { 1e-2 };
    for (s, (w, h)) in whole.losses.iter().zip(&one.losses).enumerate() {
        let rel = (w - h).abs() / h.abs();
        eprintln!("{arch:?} {level} {half}: step {s} loss whole batch {w}, halves {h} ({rel:.2e} apart)");
        assert!(
            rel < tol,
            "{arch:?} {level} {half}: step {s} loss whole batch {w} vs halves {h}"
        );
    }
}

#[test]
fn llama_on_two_ranks_equals_one_process_with_ddp_and_zero() {
    check(Arch::Llama, OptLevel::O2, HalfType::Bf16);
    check(Arch::Llama, OptLevel::O0, HalfType::Bf16);
}

#[test]
fn bert_on_two_ranks_equals_one_process_with_ddp_and_zero() {
    check(Arch::Bert, OptLevel::O2, HalfType::Bf16);
}

#[test]
fn vit_on_two_ranks_equals_one_process_with_ddp_and_zero() {
    check(Arch::Vit, OptLevel::O2, HalfType::Bf16);
}
