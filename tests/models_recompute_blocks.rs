//! `models::llama`, `bert` and `vit` checkpointed per block (`set_block_runner` with
//! `Recompute::checkpoint_fn`): the plain run's losses, f32 gradients and weights bit for bit
//! at O0 and O2 (bf16, f16), and the bytes the forward leaves held fall to a fraction (a
//! counting global allocator: this binary holds this one test).
//!
//! On the CPU whatever `CANDLE_AMP_TEST_DEVICE` says: the counting allocator sees host
//! memory only.

mod counting;
mod model_tasks;

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_amp::models::{BlockRunner, bert, llama, vit};
use candle_amp::recompute::Recompute;
use candle_amp::{self as amp, Amp, AmpConfig, HalfType, OptLevel};
use candle_core::{Device, Tensor};
use model_tasks::*;

#[global_allocator]
static A: counting::Counting = counting::Counting;

/// Layers per model: enough that the blocks' activations dominate what the forward holds.
const LAYERS: usize = 6;

/// `arch` with `LAYERS` blocks, run through `runner` when given.
fn build_with(arch: Arch, amp: &Amp, runner: Option<BlockRunner>) -> Forward {
    fn share<M: candle_nn::ModuleT + Send + Sync + 'static>(m: amp::AmpModel<M>) -> Forward {
        let m = Arc::new(m);
        Arc::new(move |x: &Tensor| m.forward(x))
    }
    match arch {
        Arch::Llama => {
            let cfg = llama::Config {
                num_hidden_layers: LAYERS,
                ..llama_cfg()
            };
            let mut m = amp.model(|vb| llama::Llama::load(vb, &cfg)).unwrap();
            m.inner_mut().set_block_runner(runner);
            share(m)
        }
        Arch::Bert => {
            let cfg = bert::Config {
                num_hidden_layers: LAYERS,
                ..bert_cfg()
            };
            let mut m = amp
                .model(|vb| bert::BertForTokenClassification::load(vb, &cfg, 3))
                .unwrap();
            m.inner_mut().bert_mut().set_block_runner(runner);
            share(m)
        }
        Arch::Vit => {
            let cfg = vit::Config {
                num_hidden_layers: LAYERS,
                ..vit_cfg()
            };
            let mut m = amp.model(|vb| vit::Model::load(vb, &cfg, 4)).unwrap();
            m.inner_mut().set_block_runner(runner);
            share(m)
        }
    }
}

/// Losses and per-step f32 gradients (bits), final f32 weights (bits), and the bytes the
/// last step's forward left held.
type Trace = (
    Vec<u32>,
    Vec<BTreeMap<String, Vec<u32>>>,
    BTreeMap<String, Vec<u32>>,
    isize,
);

fn train(arch: Arch, level: OptLevel, half: HalfType, per_block: bool) -> Trace {
    let dev = Device::Cpu;
    let amp = amp::Amp::new(AmpConfig::new(level).half(half).seed(3).verbosity(0), &dev).unwrap();
    let rc = Recompute::new(&amp);
    let runner: Option<BlockRunner> = per_block.then(|| {
        let rc = rc.clone();
        Arc::new(move |_: usize, block: amp::models::BlockFn, x: &Tensor| {
            Ok(rc.checkpoint_fn(move |x| block(x), x, true)?)
        }) as BlockRunner
    });
    let forward = build_with(arch, &amp, runner);
    let mut opt = adamw(&amp);
    let (mut losses, mut grads, mut held) = (Vec::new(), Vec::new(), 0);
    for b in batches(arch, 16, 3, 9, &dev) {
        let before = counting::live();
        let l = loss(arch, &forward(&b.input).unwrap(), &b);
        held = counting::live() - before;
        losses.push(l.to_scalar::<f32>().unwrap().to_bits());
        amp.scale_loss(&l, &mut opt)
            .unwrap()
            .backward_with(|s| rc.backward(s))
            .unwrap();
        grads.push(opt.master_grads().iter().map(|(n, g)| (n.clone(), bits(g))).collect());
        opt.step().unwrap();
        opt.zero_grad();
    }
    (losses, grads, f32_state(&amp), held)
}

#[test]
fn checkpointed_per_block_equals_plain_and_holds_less() {
    for arch in ARCHS {
        for (level, half) in [
            (OptLevel::O0, HalfType::Bf16),
            (OptLevel::O2, HalfType::Bf16),
            (OptLevel::O2, HalfType::F16),
        ] {
            let what = format!("{arch:?} {level} {half}");
            let plain = train(arch, level, half, false);
            let blocks = train(arch, level, half, true);
            assert_eq!(plain.0, blocks.0, "{what}: losses");
            for (a, b) in plain.1.iter().zip(&blocks.1) {
                assert_eq!(a.len(), plain.2.len(), "{what}: a parameter without a gradient");
                assert_eq!(a, b, "{what}: gradients");
            }
            assert_eq!(plain.2, blocks.2, "{what}: weights");
            eprintln!(
                "{what}: the forward holds {} bytes plain, {} checkpointed per block",
                plain.3, blocks.3
            );
            assert!(blocks.3 * 3 < plain.3, "{what}: {} vs {}", blocks.3, plain.3);
        }
    }
}
