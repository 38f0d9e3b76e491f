//! `nn::Linear::with_activation`: the activation inside the layer's node (the pre-activation
//! is no half edge of candle's graph) gives the same output, input gradient and parameter
//! gradients, bit for bit, as the plain layer followed by `ops::relu` / `ops::gelu`, at
//! every level, in f16 and bf16, on every instruction-set tier the CPU has, on the CPU and
//! the forced device path. The plain layer's gradients are checked against f64 references
//! and finite differences in `tests/wgrad.rs`; here the fused layer's are also checked
//! against an f64 reference directly, for ReLU, whose derivative is exact. And the fusion
//! takes effect: the loss's graph has that many fewer half tensors (candle's backward
//! accumulates a gradient in half for each).

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{Activation, Linear, Mlp, linear};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, ops};
use candle_core::{DType, Device, Module, Tensor, Var};
use common::{backward_capturing, each_tier, f64_bits as bits, grid, half_nodes, t2, vals};

/// `force_isa` is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const M: usize = 24;
const K: usize = 40;
const H: usize = 48;
const N: usize = 16;

/// Two layers: `fc1` with the activation fused, `plain1` the same parameters without it.
struct Two {
    fc1: Linear,
    plain1: Linear,
    fc2: Linear,
    act: Activation,
    /// Which of the two the model's forward runs.
    fused: AtomicBool,
}

impl Two {
    fn run(&self, x: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
        let h = if fused {
            let h = self.fc1.forward(x)?;
            if CAPTURE.with(|c| c.get()) {
                HIDDEN.with(|c| *c.borrow_mut() = Some(h.clone()));
            }
            h
        } else {
            let y = self.plain1.forward(x)?;
            match self.act {
                Activation::Relu => ops::relu(&y)?,
                _ => ops::gelu(&y)?,
            }
        };
        self.fc2.forward(&h)
    }
}

impl Module for Two {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.run(x, self.fused.load(Ordering::Relaxed))
    }
}

/// What one forward and backward leaves: the output, the input's gradient, the master
/// gradients.
type Seen = (Vec<u64>, Vec<u64>, BTreeMap<String, Vec<u64>>, f64, usize);

fn check(level: OptLevel, half: HalfType, act: Activation, device_path: bool, what: &str) {
    let cfg = AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        .seed(5);
    let (model, mut opt, amp) = amp::initialize(
        |vb| {
            let fc1 = linear(K, H, vb.pp("fc1"))?;
            let plain1 = Linear::new(fc1.weight().clone(), fc1.bias().cloned());
            Ok(Two {
                fc1: fc1.with_activation(act),
                plain1,
                fc2: linear(H, N, vb.pp("fc2"))?,
                act,
                fused: AtomicBool::new(true),
            })
        },
        Sgd::new(SgdConfig::new(0.5)).unwrap(),
        cfg,
    )
    .unwrap();
    let x = Var::from_tensor(&t2(&grid(M * K, 0.125, 16, 1), M, K)).unwrap();
    let r = t2(&grid(M * N, 1.0 / 64.0, 8, 2), M, N);
    let mut once = |fused: bool| -> Seen {
        model.inner().fused.store(fused, Ordering::Relaxed);
        let y = model.forward(&x.as_tensor().affine(1.0, 0.0).unwrap()).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&amp, &loss, &mut opt, x.as_tensor());
        assert!(!report.found_inf, "{what}");
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
        let seen = (
            bits(&y),
            bits(&gx.expect("the input's gradient")),
            grads,
            report.loss_scale as f64,
            nodes,
        );
        opt.zero_grad();
        seen
    };
    let fused = once(true);
    let plain = once(false);
    assert_eq!(fused.0, plain.0, "{what}: output");
    assert_eq!(fused.1, plain.1, "{what}: input gradient");
    assert_eq!(
        fused.2.keys().collect::<Vec<_>>(),
        ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    );
    assert_eq!(fused.2, plain.2, "{what}: parameter gradients");
    // The point of the fusion: the pre-activation is no half edge of the graph where the
    // layer computes in half (GELU under autocast runs after the layer, in f32).
    let fuses = level != OptLevel::O0 && !(level == OptLevel::O1 && act == Activation::Gelu);
    let want = if fuses { plain.4 - 1 } else { plain.4 };
    assert_eq!(fused.4, want, "{what}: half graph nodes (unfused {})", plain.4);
    if act == Activation::Relu {
        relu_reference(&model, &x, &r, &fused.2, fused.3, level, half, what);
    }
}

/// fc1's weight gradient against f64 arithmetic on the values the layers computed with:
/// `dW1 = (dy W2 * [h > 0])^T x`, where `h` and `dy W2` come from the model's own rounded
/// forward values, and `dh` is rounded to the half type as the backward rounds it: scaled by
/// the loss scale `scale`.
#[allow(clippy::too_many_arguments)]
fn relu_reference(
    model: &amp::AmpModel<Two>,
    x: &Var,
    r: &Tensor,
    grads: &BTreeMap<String, Vec<u64>>,
    scale: f64,
    level: OptLevel,
    half: HalfType,
    what: &str,
) {
    let dt = if level == OptLevel::O0 {
        DType::F32
    } else {
        half.dtype()
    };
    let m = model.inner();
    let at = |t: &Tensor| vals(&t.to_dtype(dt).unwrap());
    // The forward's hidden values, through the model (its run context: the half copies).
    m.fused.store(true, Ordering::Relaxed);
    let h = vals(&hidden(model, x));
    let (w2, xv, rv) = (at(m.fc2.weight()), at(x.as_tensor()), vals(r));
    let mut gw = vec![0f64; H * K];
    for i in 0..M {
        for j in 0..H {
            if h[i * H + j] <= 0.0 {
                continue;
            }
            // The gradient at h, as the layer's backward computes it: of the scaled loss,
            // rounded to the half type (the product dy W2 is written in x's type).
            let dh: f64 = (0..N).map(|n| rv[i * N + n] * w2[n * H + j]).sum::<f64>() * scale;
            let dh = Tensor::new(dh as f32, &Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let dh = dh.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap() / scale;
            for k in 0..K {
                gw[j * K + k] += dh * xv[i * K + k];
            }
        }
    }
    let got: Vec<f64> = grads["fc1.weight"].iter().map(|b| f64::from_bits(*b)).collect();
    let scale = gw.iter().fold(0f64, |a, v| a.max(v.abs())).max(1e-30);
    let err = got.iter().zip(&gw).fold(0f64, |a, (g, w)| a.max((g - w).abs())) / scale;
    assert!(err < 2e-6, "{what}: fc1 weight gradient vs f64 {err}");
}

/// fc1's output as the model computes it in its run (fc2 replaced by an identity read).
fn hidden(model: &amp::AmpModel<Two>, x: &Var) -> Tensor {
    HIDDEN.with(|h| h.borrow_mut().take());
    CAPTURE.with(|c| c.set(true));
    model.forward(x.as_tensor()).unwrap();
    CAPTURE.with(|c| c.set(false));
    HIDDEN.with(|h| h.borrow_mut().take()).expect("captured")
}

thread_local! {
    static CAPTURE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static HIDDEN: std::cell::RefCell<Option<Tensor>> = const { std::cell::RefCell::new(None) };
}

/// `f(level, half, act, device_path, what)` for every configuration, on every tier the CPU
/// has (`force_isa`), the tier lifted after.
fn each_config(mut f: impl FnMut(OptLevel, HalfType, Activation, bool, &str)) {
    each_tier(|isa| {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            for half in [HalfType::F16, HalfType::Bf16] {
                for act in [Activation::Relu, Activation::Gelu] {
                    for device_path in [false, true] {
                        let what = format!("{level:?} {half:?} {act:?} {isa:?} device_path={device_path}");
                        f(level, half, act, device_path, &what);
                    }
                }
            }
        }
    });
}

#[test]
fn fused_activations_match_the_unfused_layers_bit_for_bit_everywhere() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    each_config(check);
}

/// The fused layer keeps the activation's edge cases: NaN stays NaN through ReLU, GELU of
/// an empty batch is empty, and outside a run (plain candle use) it is the same function.
#[test]
fn the_fused_layer_outside_a_run_and_on_edge_cases() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let w = Tensor::new(&[[1f32, 0.], [0., 1.]], &Device::Cpu).unwrap();
    let relu = Linear::new(w.clone(), None).with_activation(Activation::Relu);
    let x = Tensor::new(&[[f32::NAN, 1.], [-2., 3.]], &Device::Cpu).unwrap();
    let y = relu.forward(&x).unwrap().to_vec2::<f32>().unwrap();
    assert!(y[0][0].is_nan() && y[0][1].is_nan(), "{y:?}");
    assert_eq!(y[1], [0.0, 3.0]);
    let gelu = Linear::new(w, None).with_activation(Activation::Gelu);
    let empty = gelu
        .forward(&Tensor::zeros((0, 2), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    assert_eq!(empty.dims(), [0, 2]);
    assert_eq!(gelu.activation(), Some(Activation::Gelu));
}

/// `nn::Mlp` runs its layers as one node; layer by layer is the reference.
struct Chain {
    mlp: Mlp,
    fused: AtomicBool,
}

impl Module for Chain {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused.load(Ordering::Relaxed) {
            self.mlp.forward(x)
        } else {
            self.mlp.layers().iter().try_fold(x.clone(), |h, l| l.forward(&h))
        }
    }
}

/// How the chain's input is given.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Input {
    /// Through a differentiable op: the input takes a gradient.
    Grad,
    /// Data as it is: no gradient.
    Data,
    /// A transposed (non-contiguous) view of a variable.
    Transposed,
    /// An empty batch.
    Empty,
}

fn check_chain(level: OptLevel, half: HalfType, act: Activation, device_path: bool, input: Input, what: &str) {
    let cfg = AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        .seed(7);
    let (model, mut opt, amp) = amp::initialize(
        |vb| {
            Ok(Chain {
                mlp: Mlp::new(vec![
                    linear(K, H, vb.pp("fc1"))?.with_activation(act),
                    linear(H, H, vb.pp("fc2"))?.with_activation(Activation::Relu),
                    linear(H, N, vb.pp("fc3"))?,
                ]),
                fused: AtomicBool::new(true),
            })
        },
        Sgd::new(SgdConfig::new(0.5)).unwrap(),
        cfg,
    )
    .unwrap();
    let rows = if input == Input::Empty { 0 } else { M };
    let x = match input {
        Input::Transposed => Var::from_tensor(&t2(&grid(M * K, 0.125, 16, 3), K, M)).unwrap(),
        _ => Var::from_tensor(&t2(&grid(rows * K, 0.125, 16, 3), rows, K)).unwrap(),
    };
    let r = t2(&grid(rows * N, 1.0 / 64.0, 8, 4), rows, N);
    let mut once = |fused: bool| {
        model.inner().fused.store(fused, Ordering::Relaxed);
        let x_in = match input {
            Input::Grad | Input::Empty => x.as_tensor().affine(1.0, 0.0).unwrap(),
            Input::Data => x.as_tensor().detach(),
            Input::Transposed => x.as_tensor().t().unwrap(),
        };
        let y = model.forward(&x_in).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&amp, &loss, &mut opt, x.as_tensor());
        let gx = gx.as_ref().map(bits);
        assert!(!report.found_inf, "{what}");
        let grads: BTreeMap<String, Vec<u64>> = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
        opt.zero_grad();
        (bits(&y), gx, grads, nodes)
    };
    let fused = once(true);
    let plain = once(false);
    assert_eq!(fused.0, plain.0, "{what}: output");
    assert_eq!(fused.1, plain.1, "{what}: input gradient");
    assert_eq!(
        fused.1.is_some(),
        input != Input::Data,
        "{what}: input gradient present"
    );
    assert_eq!(fused.2.len(), 6, "{what}");
    assert_eq!(fused.2, plain.2, "{what}: parameter gradients");
    // Fused, the three layers' outputs are one half node, where the layers one by one (each
    // with its activation inside) have three: unless nothing runs in half (O0). GELU on the
    // first layer under autocast (O1) fuses too: one by one it runs in f32, after the layer,
    // and the values are the same, bit for bit.
    let fuses = level != OptLevel::O0;
    if fuses && input == Input::Empty {
        // An empty input is copied before each layer one by one (a node each), once for the
        // chain: the count differs by more, and only fewer is the point.
        assert!(fused.3 < plain.3, "{what}: half graph nodes {} vs {}", fused.3, plain.3);
    } else {
        // One by one, GELU under autocast also leaves the first layer's half output.
        let gelu_o1 = usize::from(level == OptLevel::O1 && act == Activation::Gelu);
        let want = if fuses { plain.3 - 2 - gelu_o1 } else { plain.3 };
        assert_eq!(fused.3, want, "{what}: half graph nodes (unfused {})", plain.3);
    }
}

#[test]
fn a_chain_of_layers_as_one_node_matches_the_layers_one_by_one_everywhere() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    each_config(|level, half, act, device_path, what| {
        for input in [Input::Grad, Input::Data, Input::Transposed, Input::Empty] {
            check_chain(level, half, act, device_path, input, &format!("{what} {input:?}"));
        }
    });
}

/// An empty chain is the identity; a chain whose widths do not match fails as the layers do.
#[test]
fn empty_and_mismatched_chains() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let x = Tensor::new(&[[1f32, 2.]], &Device::Cpu).unwrap();
    assert_eq!(
        Mlp::new(vec![]).forward(&x).unwrap().to_vec2::<f32>().unwrap(),
        [[1.0, 2.0]]
    );
    let w = Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap();
    let bad = Mlp::new(vec![Linear::new(w.clone(), None), Linear::new(w, None)]);
    assert!(bad.forward(&x).is_err());
}
