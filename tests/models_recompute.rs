//! `models::llama`, `bert` and `vit` under gradient checkpointing (`recompute::Recompute`):
//! a run whose forward is one checkpointed segment (only the input kept, everything
//! recomputed in the backward) gives the plain run's losses, f32 gradients and weights bit
//! for bit, at O0 and O2 (f16 and bf16), with the guard's driver and with `GradScaler`.
//!
//! The segment is the whole model: the models keep their blocks private, so checkpointing
//! per block needs a hook in the models (see `tests/models_recompute_memory.rs` for what
//! checkpointing saves). On `common::device()`: a recomputation runs the same kernels as the
//! forward it replays, so the bit-for-bit comparisons hold on any device.

mod common;
mod model_tasks;

use std::collections::BTreeMap;

use candle_amp::recompute::Recompute;
use candle_amp::{self as amp, AmpConfig, GradScaler, HalfType, OptLevel};
use model_tasks::*;

const STEPS: usize = 3;

/// What a run leaves to compare: each step's loss, each step's f32 gradients (before the
/// step), and the f32 weights at the end, all as bits.
#[derive(Debug, PartialEq)]
struct Trace {
    losses: Vec<u32>,
    grads: Vec<BTreeMap<String, Vec<u32>>>,
    weights: BTreeMap<String, Vec<u32>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Driver {
    Guard,
    Scaler,
}

fn train(arch: Arch, level: OptLevel, half: HalfType, checkpoint: bool, driver: Driver) -> Trace {
    let dev = common::device();
    let amp = amp::Amp::new(AmpConfig::new(level).half(half).seed(3).verbosity(0), &dev).unwrap();
    let forward = build(arch, &amp);
    let mut opt = adamw(&amp);
    let rc = Recompute::new(&amp);
    let mut scaler = GradScaler::new();
    let mut trace = Trace {
        losses: Vec::new(),
        grads: Vec::new(),
        weights: BTreeMap::new(),
    };
    for b in batches(arch, 8, STEPS, 9, &dev) {
        let out = if checkpoint {
            let f = forward.clone();
            rc.checkpoint_fn(move |x| f(x), &b.input, true).unwrap()
        } else {
            forward(&b.input).unwrap()
        };
        let l = loss(arch, &out, &b);
        trace.losses.push(l.to_scalar::<f32>().unwrap().to_bits());
        match driver {
            Driver::Guard => {
                let guard = amp.scale_loss(&l, &mut opt).unwrap();
                let report = if checkpoint {
                    guard.backward_with(|s| rc.backward(s)).unwrap()
                } else {
                    guard.backward().unwrap()
                };
                assert!(!report.found_inf, "{arch:?} {level} {half}: an overflow");
            }
            Driver::Scaler => {
                let scaled = scaler.scale(&l).unwrap();
                let grads = if checkpoint {
                    rc.backward(&scaled).unwrap()
                } else {
                    scaled.backward().unwrap()
                };
                scaler.unscale(&mut opt, &grads).unwrap();
            }
        }
        trace
            .grads
            .push(opt.master_grads().iter().map(|(n, g)| (n.clone(), bits(g))).collect());
        match driver {
            Driver::Guard => {
                opt.step().unwrap();
            }
            Driver::Scaler => {
                // `unscale` ran: the step reuses its gradients.
                let none = candle_core::backprop::GradStore::default();
                scaler.step(&mut opt, &none).unwrap();
                scaler.update(None).unwrap();
            }
        }
        opt.zero_grad();
    }
    trace.weights = f32_state(&amp);
    trace
}

fn check(arch: Arch, level: OptLevel, half: HalfType, driver: Driver) {
    let plain = train(arch, level, half, false, driver);
    let checkpointed = train(arch, level, half, true, driver);
    let what = format!("{arch:?} {level} {half} {driver:?}");
    // Every parameter got its gradient both ways (a recomputed segment's included).
    let params = plain.weights.len();
    for g in plain.grads.iter().chain(&checkpointed.grads) {
        assert_eq!(g.len(), params, "{what}: a parameter without a gradient");
    }
    assert_eq!(plain.losses, checkpointed.losses, "{what}: losses");
    for (s, (a, b)) in plain.grads.iter().zip(&checkpointed.grads).enumerate() {
        for (name, g) in a {
            assert_eq!(Some(g), b.get(name), "{what}: step {s}, `{name}`'s gradient");
        }
    }
    assert_eq!(plain.weights, checkpointed.weights, "{what}: final weights");
    // The run learned something (the comparison is not between two frozen runs).
    assert_ne!(plain.losses[0], plain.losses[STEPS - 1], "{what}: the loss never moved");
}

#[test]
fn llama_checkpointed_equals_plain_bit_for_bit() {
    check(Arch::Llama, OptLevel::O0, HalfType::Bf16, Driver::Guard);
    check(Arch::Llama, OptLevel::O2, HalfType::Bf16, Driver::Guard);
    check(Arch::Llama, OptLevel::O2, HalfType::F16, Driver::Scaler);
}

#[test]
fn bert_checkpointed_equals_plain_bit_for_bit() {
    check(Arch::Bert, OptLevel::O0, HalfType::Bf16, Driver::Guard);
    check(Arch::Bert, OptLevel::O2, HalfType::Bf16, Driver::Guard);
    check(Arch::Bert, OptLevel::O2, HalfType::F16, Driver::Scaler);
}

#[test]
fn vit_checkpointed_equals_plain_bit_for_bit() {
    check(Arch::Vit, OptLevel::O0, HalfType::Bf16, Driver::Guard);
    check(Arch::Vit, OptLevel::O2, HalfType::Bf16, Driver::Guard);
    check(Arch::Vit, OptLevel::O2, HalfType::F16, Driver::Scaler);
}
