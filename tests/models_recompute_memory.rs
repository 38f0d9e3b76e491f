//! What gradient checkpointing saves on `models::llama`, `bert` and `vit`: the bytes the
//! process holds between the forward and the backward (the activations the graph keeps)
//! with the model's forward as one checkpointed segment against the plain forward, at O0
//! and O2 bf16, counted by a counting global allocator (so this binary holds this one test
//! only). The checkpointed forward keeps its input and output only; the plain one keeps
//! every block's activations.
//!
//! On the CPU whatever `CANDLE_AMP_TEST_DEVICE` says: the counting allocator sees host
//! memory only.

mod counting;
mod model_tasks;

use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::recompute::Recompute;
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::Device;
use model_tasks::*;

#[global_allocator]
static A: counting::Counting = counting::Counting;

/// The bytes the forward and loss of one batch leave held (the graph the backward needs),
/// and the loss, for a plain or checkpointed forward. A first step warms the run's caches
/// (rotary tables, scratch buffers, cast cache) so that they are not counted.
fn held_by_forward(arch: Arch, level: OptLevel, checkpoint: bool) -> (isize, f32) {
    let dev = Device::Cpu;
    let amp = amp::Amp::new(AmpConfig::new(level).half(HalfType::Bf16).seed(3).verbosity(0), &dev).unwrap();
    let forward = build(arch, &amp);
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.0)).unwrap()).unwrap();
    let rc = Recompute::new(&amp);
    let b = batches(arch, 32, 1, 4, &dev).remove(0);
    let run = |b: &Batch| {
        let out = if checkpoint {
            let f = forward.clone();
            rc.checkpoint_fn(move |x| f(x), &b.input, true).unwrap()
        } else {
            forward(&b.input).unwrap()
        };
        loss(arch, &out, b)
    };
    let mut measured = (0, 0.0);
    for step in 0..2 {
        let before = counting::live();
        let l = run(&b);
        let held = counting::live() - before;
        let value = l.to_scalar::<f32>().unwrap();
        amp.scale_loss(&l, &mut opt)
            .unwrap()
            .backward_with(|s| rc.backward(s))
            .unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        drop(l);
        measured = (held, value);
        let _ = step;
    }
    measured
}

#[test]
fn a_checkpointed_forward_holds_a_fraction_of_the_plain_forwards_activations() {
    for arch in ARCHS {
        for level in [OptLevel::O0, OptLevel::O2] {
            let (plain, plain_loss) = held_by_forward(arch, level, false);
            let (ckpt, ckpt_loss) = held_by_forward(arch, level, true);
            eprintln!("{arch:?} {level} bf16: plain forward holds {plain} bytes, checkpointed {ckpt}");
            // The same computation (learning rate 0: the second step's loss is the first's).
            assert_eq!(plain_loss.to_bits(), ckpt_loss.to_bits(), "{arch:?} {level}: loss");
            assert!(plain > 0, "{arch:?} {level}: the plain forward holds its activations");
            assert!(
                ckpt * 4 < plain,
                "{arch:?} {level}: checkpointed {ckpt} bytes, not under a quarter of plain {plain}"
            );
        }
    }
}
