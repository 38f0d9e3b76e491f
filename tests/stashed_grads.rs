//! Whose stashed gradients are applied. The run's fused layers (`amp::nn::Linear` at O1-O3)
//! write their parameters' f32 gradients outside candle's `GradStore`; they must behave as
//! the rest of a backward's gradients do, as in PyTorch: a parameter's gradient is the sum
//! of the backwards handed to its optimizer since that optimizer's last `zero_grad`,
//! `zero_grad` drops its own parameters' (and only theirs), and a backward whose store is
//! dropped unused changes no later step.
//!
//! The check is a GAN loop: the generator's backward also reaches the discriminator's
//! parameters, then the discriminator trains on its own loss. Its weights must end bit for
//! bit where a run that never ran the generator's backward ends (the discriminator's loss
//! does not depend on the generator here), at every level, f16 and bf16, through the
//! `GradScaler` and through the guard. On `common::device()`.

mod common;

use candle_amp::nn::{Linear, linear};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpModel, AmpOptimizer, GradScaler, HalfType, OptLevel, ops};
use candle_core::{DType, Module, Tensor};

const LEVELS: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];
const HALVES: [HalfType; 2] = [HalfType::F16, HalfType::Bf16];

struct Net {
    a: Linear,
    b: Linear,
}

impl Net {
    fn new(i: usize, h: usize, o: usize, vb: candle_nn::VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            a: linear(i, h, vb.pp("a"))?,
            b: linear(h, o, vb.pp("b"))?,
        })
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = ops::relu(&self.a.forward(x)?).map_err(candle_core::Error::wrap)?;
        self.b.forward(&h)
    }
}

/// How the gradients reach the optimizers.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    Scaler,
    Guard,
}

/// What the loop does besides the discriminator's own step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Extra {
    /// Nothing: the control.
    None,
    /// The generator's step first, its backward reaching the discriminator.
    Generator,
    /// A discriminator backward whose gradients are dropped unused, with no `zero_grad`
    /// after it, before the real one.
    Dropped,
}

struct Gan {
    amp: amp::Amp,
    g: AmpModel<Net>,
    d: AmpModel<Net>,
    opt_g: AmpOptimizer,
    opt_d: AmpOptimizer,
}

fn gan(level: OptLevel, half: HalfType) -> Gan {
    let config = AmpConfig::new(level).half(half).verbosity(0).seed(7);
    let amp = amp::Amp::new(config, &common::device()).unwrap();
    let g = amp.model(|vb| Net::new(5, 12, 6, vb.pp("gen"))).unwrap();
    let d = amp.model(|vb| Net::new(6, 10, 1, vb.pp("disc"))).unwrap();
    let sgd = || {
        Sgd::new(SgdConfig {
            momentum: 0.9,
            ..SgdConfig::new(0.05)
        })
        .unwrap()
    };
    let opt_g = amp.optimizer_for(sgd(), |n| n.starts_with("gen.")).unwrap();
    let opt_d = amp.optimizer_for(sgd(), |n| n.starts_with("disc.")).unwrap();
    Gan {
        amp,
        g,
        d,
        opt_g,
        opt_d,
    }
}

fn data(rows: usize, cols: usize, seed: u64) -> Tensor {
    common::t2(&common::grid(rows * cols, 0.25, 8, seed), rows, cols)
        .to_device(&common::device())
        .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    common::flat(t).into_iter().map(f32::to_bits).collect()
}

/// The discriminator's f32 weights and master gradients after each of three iterations.
type Trace = Vec<(Vec<(String, Vec<u32>)>, Vec<(String, Vec<u32>)>)>;

fn run(level: OptLevel, half: HalfType, path: Path, extra: Extra) -> (Trace, Vec<usize>) {
    let Gan {
        amp,
        g,
        d,
        mut opt_g,
        mut opt_d,
    } = gan(level, half);
    let mut scaler = GradScaler::new();
    let mut trace = Vec::new();
    let mut waiting = Vec::new();
    for it in 0..3u64 {
        let z = data(8, 5, 100 + it);
        let real = data(8, 6, 200 + it);
        let fake = data(8, 6, 300 + it);
        let ones = Tensor::ones((8, 1), DType::F32, &common::device()).unwrap();
        let zeros = ones.zeros_like().unwrap();
        if extra == Extra::Generator {
            // The generator's loss goes through the discriminator: its backward reaches the
            // discriminator's parameters too, as PyTorch's does.
            let g_loss = ops::mse(&d.forward(&g.forward(&z).unwrap()).unwrap(), &ones).unwrap();
            match path {
                Path::Scaler => {
                    let grads = scaler.scale(&g_loss).unwrap().backward().unwrap();
                    scaler.step(&mut opt_g, &grads).unwrap();
                }
                Path::Guard => {
                    amp.scale_loss(&g_loss, &mut opt_g).unwrap().backward().unwrap();
                    opt_g.step().unwrap();
                }
            }
            opt_g.zero_grad();
            opt_d.zero_grad();
        }
        let d_loss = || {
            let r = ops::mse(&d.forward(&real).unwrap(), &ones).unwrap();
            let f = ops::mse(&d.forward(&fake).unwrap(), &zeros).unwrap();
            (r + f).unwrap()
        };
        if extra == Extra::Dropped {
            // Gradients computed and never handed over (a probe, an aborted step).
            match path {
                Path::Scaler => drop(scaler.scale(&d_loss()).unwrap().backward().unwrap()),
                Path::Guard => {
                    let loss = d_loss();
                    let guard = amp.scale_loss(&loss, &mut opt_d).unwrap();
                    drop(guard.loss().backward().unwrap());
                }
            }
        }
        match path {
            Path::Scaler => {
                let grads = scaler.scale(&d_loss()).unwrap().backward().unwrap();
                scaler.unscale(&mut opt_d, &grads).unwrap();
                let master = named_bits(opt_d.master_grads().iter());
                scaler.step(&mut opt_d, &grads).unwrap();
                scaler.update(None).unwrap();
                trace.push((disc_weights(&amp), master));
            }
            Path::Guard => {
                amp.scale_loss(&d_loss(), &mut opt_d).unwrap().backward().unwrap();
                let master = named_bits(opt_d.master_grads().iter());
                opt_d.step().unwrap();
                trace.push((disc_weights(&amp), master));
            }
        }
        opt_d.zero_grad();
        opt_g.zero_grad();
        waiting.push(amp::testing::waiting_backwards(&amp));
    }
    (trace, waiting)
}

fn named_bits<'a>(it: impl Iterator<Item = (&'a String, &'a Tensor)>) -> Vec<(String, Vec<u32>)> {
    it.map(|(n, t)| (n.clone(), bits(t))).collect()
}

fn disc_weights(amp: &amp::Amp) -> Vec<(String, Vec<u32>)> {
    amp.store()
        .params()
        .iter()
        .filter(|p| p.name().starts_with("disc."))
        .map(|p| (p.name().to_string(), bits(&p.f32_value().unwrap())))
        .collect()
}

fn check(path: Path, extra: Extra) {
    for level in LEVELS {
        for half in HALVES {
            if level == OptLevel::O0 && half == HalfType::Bf16 {
                continue;
            }
            let what = format!("{level:?} {half:?} {path:?} {extra:?}");
            let (control, _) = run(level, half, path, Extra::None);
            let (got, waiting) = run(level, half, path, extra);
            assert_eq!(control.len(), 3);
            assert!(control[0].1.len() == 4, "{what}: four master gradients");
            for (i, (c, g)) in control.iter().zip(&got).enumerate() {
                assert_eq!(g.1, c.1, "{what}: iteration {i}: the discriminator's master gradients");
                assert_eq!(g.0, c.0, "{what}: iteration {i}: the discriminator's weights");
            }
            assert_ne!(control[0].0, control[2].0, "{what}: the discriminator trained");
            // Nothing waits once every optimizer has called zero_grad: memory stays flat.
            assert_eq!(waiting, vec![0, 0, 0], "{what}: stashed gradients left behind");
        }
    }
}

#[test]
fn gan_discriminator_steps_on_its_own_gradients_with_grad_scaler() {
    check(Path::Scaler, Extra::Generator);
}

#[test]
fn gan_discriminator_steps_on_its_own_gradients_with_the_guard() {
    check(Path::Guard, Extra::Generator);
}

#[test]
fn a_dropped_backward_changes_no_later_step_with_grad_scaler() {
    check(Path::Scaler, Extra::Dropped);
}

#[test]
fn a_dropped_backward_changes_no_later_step_with_the_guard() {
    check(Path::Guard, Extra::Dropped);
}

/// `zero_grad` drops its own optimizer's stashed gradients and no other's: a backward that
/// reaches both models, then the discriminator's `zero_grad` only, leaves the generator's
/// stashed gradients for the call given that backward's store.
#[test]
fn zero_grad_drops_only_its_own_parameters_stashed_gradients() {
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in HALVES {
            let what = format!("{level:?} {half:?}");
            let step = |zero_d_first: bool| {
                let Gan {
                    amp,
                    g,
                    d,
                    mut opt_g,
                    mut opt_d,
                } = gan(level, half);
                let mut scaler = GradScaler::new();
                let ones = Tensor::ones((8, 1), DType::F32, &common::device()).unwrap();
                let loss = ops::mse(&d.forward(&g.forward(&data(8, 5, 1)).unwrap()).unwrap(), &ones).unwrap();
                let grads = scaler.scale(&loss).unwrap().backward().unwrap();
                assert_eq!(amp::testing::waiting_backwards(&amp), 1, "{what}");
                if zero_d_first {
                    opt_d.zero_grad();
                }
                scaler.unscale(&mut opt_g, &grads).unwrap();
                let master = named_bits(opt_g.master_grads().iter());
                // The discriminator's part: still waiting unless its zero_grad dropped it.
                scaler.unscale(&mut opt_d, &grads).unwrap();
                let d_master = opt_d.master_grads().len();
                assert_eq!(amp::testing::waiting_backwards(&amp), 0, "{what}");
                (master, d_master)
            };
            let (a, da) = step(false);
            let (b, db) = step(true);
            assert_eq!(a.len(), 4, "{what}");
            assert_eq!(
                a, b,
                "{what}: the discriminator's zero_grad changed the generator's gradients"
            );
            assert_eq!(da, 4, "{what}: the discriminator's own part, handed over");
            assert_eq!(db, 0, "{what}: dropped by the discriminator's zero_grad");
        }
    }
}
