//! `nn::Residual`: `x + dropout(body(layer_norm(x)))` as one node gives the same output,
//! the same input gradient and the same body parameter gradients as the unfused layers
//! (`LayerNorm`, the body, `Dropout`, `ops::add`) with the same dropout mask, at every level,
//! in f16 and bf16, for a self-attention body and for MLP bodies (ReLU, GELU), on every
//! instruction-set tier the CPU has, on the CPU and the forced device path. The norm's
//! weight and bias gradients are the f32 sums the unfused norm rounds to the parameter's
//! type: rounding them gives the unfused ones exactly. And the fusion takes effect: the
//! sub-layer leaves one half tensor in the loss's graph where the unfused layers leave at
//! least four.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{Activation, Dropout, LayerNorm, Mlp, Residual, ResidualBody, layer_norm, linear, self_attention};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, Generator, HalfType, OptLevel};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::ModuleT;
use common::{backward_capturing, each_tier, f64_bits as bits, grid, half_nodes};

/// `force_isa` is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const B: usize = 3;
const T: usize = 6;
const DM: usize = 16;
const SCALE: f64 = 64.0;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Attention,
    Relu,
    Gelu,
}

/// The fused module, and the same layers run one by one as a user would write them.
struct Sub {
    res: Residual,
    norm: LayerNorm,
    body: ResidualBody,
    drop: Dropout,
    rng: Generator,
    fused: AtomicBool,
}

impl Module for Sub {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused.load(Ordering::Relaxed) {
            return self.res.forward_t(x, true);
        }
        let h = self.body.forward(&self.norm.forward(x)?)?;
        amp::ops::add(x, &self.drop.forward_t(&h, true)?)
    }
}

/// Values equal as numbers (a zero's sign may differ: candle adds a gradient into zeros).
fn same(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| f64::from_bits(*x) == f64::from_bits(*y))
}

fn round_scaled(g: &[u64], dt: DType) -> Vec<u64> {
    let v: Vec<f32> = g.iter().map(|b| (f64::from_bits(*b) * SCALE) as f32).collect();
    let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
    let r = (t.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap() / SCALE).unwrap();
    bits(&r)
}

/// What one forward and backward leaves: output, input gradient, master gradients, the
/// half graph nodes.
type Seen = (Vec<u64>, Option<Vec<u64>>, BTreeMap<String, Vec<u64>>, usize);

fn check(level: OptLevel, half: HalfType, kind: Kind, device_path: bool, data: bool, what: &str) {
    let cfg = AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        .loss_scale(amp::LossScaleSpec::Static(SCALE as f32))
        .seed(5);
    let run = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let rng = run.generator("dropout");
    let model = run
        .model(|vb| {
            let norm = layer_norm(DM, 1e-5, vb.pp("ln"))?;
            let body: ResidualBody = match kind {
                Kind::Attention => self_attention(DM, 2, true, vb.clone())?.into(),
                Kind::Relu | Kind::Gelu => {
                    let act = if kind == Kind::Relu {
                        Activation::Relu
                    } else {
                        Activation::Gelu
                    };
                    Mlp::new(vec![
                        linear(DM, 2 * DM, vb.pp("up"))?.with_activation(act),
                        linear(2 * DM, DM, vb.pp("down"))?,
                    ])
                    .into()
                }
            };
            let drop = Dropout::new(0.25, rng.clone())?;
            Ok(Sub {
                res: Residual::new(norm.clone(), body.clone(), drop.clone()),
                norm,
                body,
                drop,
                rng: rng.clone(),
                fused: AtomicBool::new(true),
            })
        })
        .unwrap();
    let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
    let dev = Device::Cpu;
    // The norm's scale and shift away from 1 and 0, so their gradients matter.
    let x = Var::from_tensor(&Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap()).unwrap();
    let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 6), (B, T, DM), &dev).unwrap();
    let state = rng.snapshot();
    let mut once = |fused: bool| -> Seen {
        let m = model.inner();
        m.fused.store(fused, Ordering::Relaxed);
        m.rng.restore(state.clone());
        let input = if data {
            x.as_tensor().detach()
        } else {
            x.as_tensor().affine(1.0, 0.0).unwrap()
        };
        // The residual stream in the level's activation type (half at O2/O3), as after an
        // embedding.
        let input = if matches!(level, OptLevel::O2 | OptLevel::O3) {
            input.to_dtype(half.dtype()).unwrap()
        } else {
            input
        };
        let y = model.forward(&input).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&run, &loss, &mut opt, x.as_tensor());
        let gx = gx.as_ref().map(bits);
        assert!(!report.found_inf, "{what} fused={fused}");
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
        opt.zero_grad();
        (bits(&y), gx, grads, nodes)
    };
    let fused = once(true);
    let plain = once(false);
    assert!(same(&fused.0, &plain.0), "{what}: output");
    assert_eq!(fused.1.is_some(), !data, "{what}: input gradient present");
    if let (Some(a), Some(b)) = (&fused.1, &plain.1) {
        assert!(same(a, b), "{what}: input gradient");
        assert!(
            a.iter().any(|v| f64::from_bits(*v) != 0.0),
            "{what}: a zero input gradient"
        );
    }
    assert_eq!(
        fused.2.keys().collect::<Vec<_>>(),
        plain.2.keys().collect::<Vec<_>>(),
        "{what}"
    );
    let n_params = if kind == Kind::Attention { 10 } else { 6 };
    assert_eq!(fused.2.len(), n_params, "{what}: parameter gradients");
    let mut fused_at_all = false;
    for (k, g) in &fused.2 {
        let p = &plain.2[k];
        if k.starts_with("ln.") && level != OptLevel::O0 && level != OptLevel::O1 {
            // f32 here; the unfused norm rounds the (scaled) sum to the parameter's half type.
            assert!(same(&round_scaled(g, half.dtype()), p), "{what}: {k} rounded");
            fused_at_all |= !same(g, p);
        } else {
            assert!(same(g, p), "{what}: {k}");
        }
    }
    if level == OptLevel::O0 {
        assert_eq!(fused.3, plain.3, "{what}: O0 runs unfused");
        return;
    }
    // O2/O3: the input and the output are the only half tensors of the graph (the output
    // alone for an input without a gradient); O1: none (the stream is f32).
    let want = match (level, data) {
        (OptLevel::O1, _) => 0,
        (_, true) => 1,
        _ => 2,
    };
    assert_eq!(fused.3, want, "{what}: half graph nodes (unfused {})", plain.3);
    assert!(plain.3 >= want + 2, "{what}: unfused half nodes {}", plain.3);
    // At O2/O3 the norm's gradients are f32 sums, not their half roundings, somewhere.
    assert!(
        fused_at_all || level == OptLevel::O1,
        "{what}: the norm's gradients were rounded"
    );
}

#[test]
fn fused_residual_matches_the_unfused_layers_everywhere() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    each_tier(|isa| {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            for half in [HalfType::F16, HalfType::Bf16] {
                for kind in [Kind::Attention, Kind::Relu, Kind::Gelu] {
                    for (device_path, data) in [(false, false), (true, false), (false, true)] {
                        let what = format!("{level:?} {half:?} {kind:?} {isa:?} device_path={device_path} data={data}");
                        check(level, half, kind, device_path, data, &what);
                    }
                }
            }
        }
    });
}

/// Outside a run the sub-layer is the unfused function; evaluation draws no mask; a body
/// that changes the shape is a typed error; an empty batch gives an empty result.
#[test]
fn outside_a_run_and_edge_cases() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    let run = amp::Amp::new(OptLevel::O0, &dev).unwrap();
    let rng = run.generator("dropout");
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let norm = layer_norm(8, 1e-5, vb.pp("ln")).unwrap();
    let mlp = Mlp::new(vec![linear(8, 8, vb.pp("l")).unwrap()]);
    let drop = Dropout::new(0.5, rng.clone()).unwrap();
    let res = Residual::new(norm.clone(), mlp.clone(), drop.clone());
    let x = Tensor::from_vec(grid(2 * 5 * 8, 0.125, 8, 9), (2, 5, 8), &dev).unwrap();
    let state = rng.snapshot();
    let fused = res.forward_t(&x, true).unwrap();
    rng.restore(state.clone());
    let plain = amp::ops::add(
        &x,
        &drop
            .forward_t(&mlp.forward(&norm.forward(&x).unwrap()).unwrap(), true)
            .unwrap(),
    )
    .unwrap();
    assert!(same(&bits(&fused), &bits(&plain)));
    // Evaluation: no dropout, and the generator is not touched.
    rng.restore(state.clone());
    let eval = res.forward_t(&x, false).unwrap();
    let want = amp::ops::add(&x, &mlp.forward(&norm.forward(&x).unwrap()).unwrap()).unwrap();
    assert!(same(&bits(&eval), &bits(&want)));
    assert_eq!(rng.snapshot(), state);
    let empty = Tensor::zeros((0, 5, 8), DType::F32, &dev).unwrap();
    assert_eq!(res.forward_t(&empty, true).unwrap().dims(), [0, 5, 8]);
    let wide = Residual::new(norm, Mlp::new(vec![linear(8, 4, vb.pp("w")).unwrap()]), drop);
    let err = wide.forward_t(&x, true).unwrap_err().to_string();
    assert!(err.contains("input's shape"), "{err}");
}
