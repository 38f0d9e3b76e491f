//! Memory does not grow with the step count: a model with every layer of `candle_amp::nn`
//! (two stacked convolutions included) trains for 300 steps at every level, and the bytes
//! the process holds at step 300 equal those at step 50 (a counting global allocator, so
//! this test binary holds this one test only). Gradients and optimizer state never keep a
//! graph alive. The same holds with gradient checkpointing and recomputed feed-forward
//! slices, and with the numerics doctor recording every tenth step (its automatic fallback
//! on): its statistics are one bounded aggregate per tensor name.
//!
//! On the CPU whatever `CANDLE_AMP_TEST_DEVICE` says: the counting allocator sees host
//! memory only.

mod counting;

use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, nn as ann, ops};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, ModuleT, VarBuilder};

#[global_allocator]
static A: counting::Counting = counting::Counting;

/// Every layer in `candle_amp::nn`.
struct Everything {
    c1: ann::Conv2d,
    bn: ann::BatchNorm,
    c2: ann::Conv2d,
    gn: ann::GroupNorm,
    ct: ann::ConvTranspose2d,
    c1d: ann::Conv1d,
    proj: ann::Linear,
    emb: ann::Embedding,
    ln: ann::LayerNorm,
    q: ann::Linear,
    k: ann::Linear,
    v: ann::Linear,
    rms: ann::RmsNorm,
    drop: ann::Dropout,
    head: ann::Linear,
    ids: Tensor,
}

impl Everything {
    fn new(vb: VarBuilder, drop: amp::Generator) -> candle_core::Result<Self> {
        let pad = candle_nn::Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        Ok(Self {
            c1: ann::conv2d(1, 4, 3, pad, vb.pp("c1"))?,
            bn: ann::batch_norm(4, 1e-5, vb.pp("bn"))?,
            c2: ann::conv2d(4, 4, 3, pad, vb.pp("c2"))?,
            gn: ann::group_norm(2, 4, 1e-5, vb.pp("gn"))?,
            ct: ann::conv_transpose2d(
                4,
                2,
                3,
                candle_nn::ConvTranspose2dConfig {
                    padding: 1,
                    ..Default::default()
                },
                vb.pp("ct"),
            )?,
            c1d: ann::conv1d(
                2,
                4,
                3,
                candle_nn::Conv1dConfig {
                    padding: 1,
                    ..Default::default()
                },
                vb.pp("c1d"),
            )?,
            // The activation inside the layer's node (the fused path keeps GELU's input).
            proj: ann::linear(4, 8, vb.pp("proj"))?.with_activation(ann::Activation::Gelu),
            emb: ann::embedding(16, 8, vb.pp("emb"))?,
            ln: ann::layer_norm(8, 1e-5, vb.pp("ln"))?,
            q: ann::linear_no_bias(8, 8, vb.pp("q"))?,
            k: ann::linear_no_bias(8, 8, vb.pp("k"))?,
            v: ann::linear_no_bias(8, 8, vb.pp("v"))?,
            rms: ann::rms_norm(8, 1e-5, vb.pp("rms"))?,
            drop: ann::Dropout::new(0.1, drop)?,
            head: ann::linear(8, 10, vb.pp("head"))?,
            ids: Tensor::from_vec((0u32..64).map(|i| i % 16).collect::<Vec<_>>(), 64, vb.device())?,
        })
    }
}

impl ModuleT for Everything {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let b = x.dim(0)?;
        let h = self.bn.forward_t(&self.c1.forward(x)?, train)?.relu()?;
        let h = self.gn.forward(&self.c2.forward(&h)?)?.relu()?;
        let h = self.ct.forward(&h)?.reshape((b, 2, 64))?;
        let h = self.c1d.forward(&h)?.transpose(1, 2)?; // (b, 64, 4)
        let h = ops::add(&self.proj.forward(&h)?, &self.emb.forward(&self.ids)?)?;
        let n = self.ln.forward(&h)?;
        let split = |t: Tensor| t.reshape((b, 64, 2, 4))?.transpose(1, 2)?.contiguous();
        let a = ann::scaled_dot_product_attention(
            &split(self.q.forward(&n)?)?,
            &split(self.k.forward(&n)?)?,
            &split(self.v.forward(&n)?)?,
            None,
            true,
            None,
        )?;
        let a = a.transpose(1, 2)?.reshape((b, 64, 8))?;
        let h = ops::add(&h, &self.drop.forward_t(&a, train)?)?;
        let h = self.rms.forward(&h)?;
        let gate = ann::softmax(&h, 2)?;
        let h = ops::mean_keepdim(&ops::mul(&h, &gate)?, 1)?.squeeze(1)?;
        ann::log_softmax(&self.head.forward(&h)?, 1)
    }
}

#[test]
fn memory_does_not_grow_with_the_step_count_at_any_level() {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (4, 1, 8, 8), &dev).unwrap();
    let y = Tensor::new(&[1u32, 3, 5, 7], &dev).unwrap();
    let cases = [
        (OptLevel::O0, HalfType::F16),
        (OptLevel::O1, HalfType::F16),
        (OptLevel::O2, HalfType::F16),
        (OptLevel::O3, HalfType::F16),
        (OptLevel::O2, HalfType::Bf16),
    ];
    for (level, half) in cases {
        let cfg = AmpConfig::new(level).half(half).verbosity(0);
        let amp = amp::Amp::new(cfg, &dev).unwrap();
        let drop = amp.generator("dropout");
        let model = amp.model(|vb| Everything::new(vb, drop)).unwrap();
        let mut opt = amp
            .optimizer(amp::optim::AdamW::new(Default::default()).unwrap())
            .unwrap();
        let doctor = amp::doctor::Doctor::attach(
            &amp,
            amp::doctor::DoctorConfig {
                auto_fallback: true,
                ..Default::default()
            },
        )
        .unwrap();
        let mut at = [0isize; 2];
        for step in 1..=300 {
            let logp = model.forward(&x).unwrap();
            let loss = ops::nll(&logp, &y).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            if step == 300 {
                for (name, g) in opt.master_grads() {
                    assert!(
                        !g.track_op(),
                        "{level} {half}: the master gradient of {name} keeps a graph"
                    );
                    assert_eq!(g.dtype(), DType::F32);
                }
            }
            opt.step().unwrap();
            opt.zero_grad();
            drop_all([logp, loss]);
            if step == 50 {
                at[0] = counting::live();
            }
            if step == 300 {
                at[1] = counting::live();
            }
        }
        let st = opt.state_dict().unwrap();
        assert!(!st.algorithm.params.is_empty());
        let report = doctor.report();
        assert_eq!(report.steps_observed, 30, "{level} {half}");
        assert!(
            report.tensors.len() > 20,
            "{level} {half}: {} tensors recorded",
            report.tensors.len()
        );
        let grown = at[1] - at[0];
        eprintln!("{level} {half}: live bytes at step 50 {}, at step 300 {}", at[0], at[1]);
        assert!(
            grown < 256 * 1024,
            "{level} {half}: {grown} bytes more at step 300 than at step 50"
        );
    }
    memory_is_flat_with_recomputation();
}

fn drop_all<const N: usize>(_: [Tensor; N]) {}

/// A residual block whose feed-forward runs in recomputed slices.
#[derive(Clone)]
struct Block {
    up: ann::Linear,
    down: ann::Linear,
    drop: ann::Dropout,
    rc: amp::recompute::Recompute,
}

impl ModuleT for Block {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let (up, down) = (self.up.clone(), self.down.clone());
        let ffn = move |x: &Tensor| match up.activation() {
            // Fused: the node keeps the pre-activation, recomputed in each slice.
            Some(_) => down.forward(&up.forward(x)?),
            None => down.forward(&ops::gelu(&up.forward(x)?)?),
        };
        let h = self.rc.chunked_forward(&ffn, 3, 1, x, train)?;
        ops::add(x, &self.drop.forward_t(&h, train)?)
    }
}

/// The same with gradient checkpointing and chunked feed-forward: nothing of a step's
/// recomputation (segments, stashed gradients, graphs) outlives the step.
fn memory_is_flat_with_recomputation() {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (4, 8, 16), &dev).unwrap();
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2] {
        let amp = amp::Amp::new(AmpConfig::new(level).verbosity(0), &dev).unwrap();
        let rc = amp::recompute::Recompute::new(&amp);
        let drop = amp.generator("dropout");
        let model = amp
            .model(|vb| {
                (0..4)
                    .map(|i| {
                        Ok(Block {
                            up: match ann::linear(16, 32, vb.pp(format!("b{i}.up")))? {
                                up if i % 2 == 0 => up.with_activation(ann::Activation::Gelu),
                                up => up,
                            },
                            down: ann::linear(32, 16, vb.pp(format!("b{i}.down")))?,
                            drop: ann::Dropout::new(0.1, drop.clone())?,
                            rc: rc.clone(),
                        })
                    })
                    .collect::<candle_core::Result<Vec<_>>>()
            })
            .unwrap();
        let mut opt = amp
            .optimizer(amp::optim::AdamW::new(Default::default()).unwrap())
            .unwrap();
        // The blocks are called directly (not through the model wrapper, which casts).
        let x = x
            .to_dtype(if level == OptLevel::O2 { DType::F16 } else { DType::F32 })
            .unwrap();
        let mut at = [0isize; 2];
        for step in 1..=300 {
            let h = rc.checkpoint_sequential(model.inner(), 4, &x, true).unwrap();
            let loss = ops::mean_keepdim(&h.to_dtype(DType::F32).unwrap().sqr().unwrap(), 2)
                .unwrap()
                .mean_all()
                .unwrap();
            amp.scale_loss(&loss, &mut opt)
                .unwrap()
                .backward_with(|l| rc.backward(l))
                .unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            drop_all([h, loss]);
            if step == 50 {
                at[0] = counting::live();
            }
            if step == 300 {
                at[1] = counting::live();
            }
        }
        let grown = at[1] - at[0];
        eprintln!(
            "recompute {level}: live bytes at step 50 {}, at step 300 {}",
            at[0], at[1]
        );
        assert!(
            grown < 256 * 1024,
            "recompute {level}: {grown} bytes more at step 300 than at step 50"
        );
    }
}
