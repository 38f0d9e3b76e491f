//! Empty inputs through the fused modules inside a run: a batch of none, sequences of no
//! tokens, and both, through the two fused `Residual` sub-layers (attention, and a GELU
//! `Mlp`), `softmax` and `log_softmax`, at every level, in f16 and bf16, on the CPU and the
//! forced device path. As in PyTorch, an empty batch is a valid step: the output keeps the
//! input's shape, the input's gradient too, no overflow is reported, every master gradient
//! there is zero, and the optimizer's step leaves the weights bit for bit as they were.

mod common;

use candle_amp::nn::{Activation, Dropout, Mlp, Residual, layer_norm, linear, log_softmax, self_attention, softmax};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, Generator, HalfType, LossScaleSpec, OptLevel};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder};
use common::backward_capturing;

const DM: usize = 8;

/// A transformer block's two fused sub-layers, then both normalisations of the last axis.
struct Block {
    attn: Residual,
    ffn: Residual,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.ffn.forward_t(&self.attn.forward_t(x, true)?, true)?;
        softmax(&h, 2)?.to_dtype(DType::F32)? + log_softmax(&h, 2)?.to_dtype(DType::F32)?
    }
}

fn build(vb: VarBuilder, rng: &Generator) -> candle_core::Result<Block> {
    let mlp = Mlp::new(vec![
        linear(DM, 2 * DM, vb.pp("up"))?.with_activation(Activation::Gelu),
        linear(2 * DM, DM, vb.pp("down"))?,
    ]);
    Ok(Block {
        attn: Residual::new(
            layer_norm(DM, 1e-5, vb.pp("ln1"))?,
            self_attention(DM, 2, true, vb.pp("attn"))?,
            Dropout::new(0.1, rng.clone())?,
        ),
        ffn: Residual::new(
            layer_norm(DM, 1e-5, vb.pp("ln2"))?,
            mlp,
            Dropout::new(0.1, rng.clone())?,
        ),
    })
}

/// Every parameter's working copy in f32, by name.
fn weights(run: &amp::Amp) -> Vec<(String, Vec<f32>)> {
    run.store()
        .trainable_names()
        .into_iter()
        .map(|n| {
            let w = run.store().param(&n).unwrap().working().clone();
            (
                n,
                w.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            )
        })
        .collect()
}

#[test]
fn empty_batches_and_sequences_are_valid_steps() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            for device_path in [false, true] {
                for (b, t) in [(0, 4), (2, 0), (0, 0)] {
                    let what = format!("{level:?} {half:?} device_path={device_path} ({b}, {t}, {DM})");
                    let cfg = AmpConfig::new(level)
                        .half(half)
                        .device_path(device_path)
                        .verbosity(0)
                        .loss_scale(LossScaleSpec::Static(64.0))
                        .seed(3);
                    let run = amp::Amp::new(cfg, &Device::Cpu).unwrap();
                    let rng = run.generator("dropout");
                    let model = run.model(|vb| build(vb, &rng)).unwrap();
                    let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
                    let before = weights(&run);
                    let x = Var::from_tensor(&Tensor::zeros((b, t, DM), DType::F32, &Device::Cpu).unwrap()).unwrap();
                    // Through an op, so that the input takes a gradient.
                    let y = model.forward(&x.as_tensor().affine(1.0, 0.0).unwrap()).unwrap();
                    assert_eq!(y.dims(), [b, t, DM], "{what}: output");
                    let (report, gx) = backward_capturing(&run, &y.sum_all().unwrap(), &mut opt, x.as_tensor());
                    assert!(!report.found_inf, "{what}: overflow reported");
                    assert_eq!(gx.expect("the input's gradient").dims(), [b, t, DM], "{what}");
                    // O2/O3: the layers' own nodes (the fused sub-layers fall back to them on
                    // an empty input) write every parameter's gradient, zero here, as
                    // PyTorch's backward does. At O0/O1 the layers run candle's ops, which on
                    // an empty operand return it (or zeros) without recording the op: no
                    // gradient reaches the parameters, and the run warns that they got none.
                    let want = if matches!(level, OptLevel::O2 | OptLevel::O3) {
                        before.len()
                    } else {
                        0
                    };
                    assert_eq!(opt.master_grads().len(), want, "{what}: master gradients");
                    assert_eq!(report.warnings.is_empty(), want > 0, "{what}: {:?}", report.warnings);
                    for (name, g) in opt.master_grads() {
                        let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
                        assert!(g.iter().all(|v| *v == 0.0), "{what}: {name}'s gradient {g:?}");
                    }
                    opt.step().unwrap();
                    assert_eq!(weights(&run), before, "{what}: weights after the step");
                }
            }
        }
    }
}
