//! The fused modules' gradients against exact arithmetic: `Linear::with_activation` (GELU,
//! ReLU), `Mlp`, `SelfAttention` and `Residual` (attention and MLP bodies, with dropout),
//! inside a run at every level, in f16 and bf16, on every instruction-set tier the CPU has,
//! on the CPU and the forced device path. Every parameter's unscaled master gradient and the
//! input's gradient are compared with (a) the same module built outside a run in f64
//! (candle's autograd through the unfused layers) and (b) central finite differences of that
//! f64 module, which check the reference itself without autograd. The run's weights and
//! input are exact in both half types, so both sides compute with the same values and the
//! difference is the run's own rounding: f32's at O0, the half type's at O1-O3.
//!
//! At O0, and wherever a fusion does not apply, the unfused layers run (the same check then
//! covers them); `fused_dense.rs`, `fused_attention.rs` and `fused_residual.rs` show that the
//! fused nodes run at O1-O3 and equal the unfused layers bit for bit; this file shows both
//! are right.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use candle_amp::nn::{Activation, Dropout, Linear, Mlp, Residual, SelfAttention, layer_norm, linear, self_attention};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, Generator, HalfType, LossScaleSpec, OptLevel};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use common::{backward_capturing, each_tier, grid, vals};

/// `force_isa` is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const B: usize = 2;
const T: usize = 5;
const D: usize = 16;
/// A static scale: the gradients are unscaled by it, and a power of two keeps that exact.
const SCALE: f32 = 64.0;
const LEVELS: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];
const HALVES: [HalfType; 2] = [HalfType::F16, HalfType::Bf16];

#[derive(Debug, Clone, Copy)]
enum Kind {
    LinearGelu,
    LinearRelu,
    Mlp,
    Attention,
    ResidualAttention,
    ResidualMlp,
}

/// One of the fused modules (the same type inside a run and in the f64 reference).
enum Net {
    Linear(Linear),
    Mlp(Mlp),
    Attention(SelfAttention),
    Residual(Residual),
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Linear(l) => l.forward(x),
            Net::Mlp(m) => m.forward(x),
            Net::Attention(a) => a.forward(x),
            Net::Residual(r) => r.forward_t(x, true),
        }
    }
}

fn mlp(vb: &VarBuilder) -> candle_core::Result<Mlp> {
    Ok(Mlp::new(vec![
        linear(D, 2 * D, vb.pp("up"))?.with_activation(Activation::Gelu),
        linear(2 * D, 24, vb.pp("mid"))?.with_activation(Activation::Relu),
        linear(24, D, vb.pp("down"))?,
    ]))
}

fn build(kind: Kind, vb: VarBuilder, rng: &Generator) -> candle_core::Result<Net> {
    // p = 0.5: the mask's 2 is exact in every type, so the reference applies the same factor.
    let drop = || Dropout::new(0.5, rng.clone());
    Ok(match kind {
        Kind::LinearGelu => Net::Linear(linear(D, 24, vb.pp("fc"))?.with_activation(Activation::Gelu)),
        Kind::LinearRelu => Net::Linear(linear(D, 24, vb.pp("fc"))?.with_activation(Activation::Relu)),
        Kind::Mlp => Net::Mlp(mlp(&vb)?),
        Kind::Attention => Net::Attention(self_attention(D, 2, true, vb)?),
        Kind::ResidualAttention => Net::Residual(Residual::new(
            layer_norm(D, 1e-5, vb.pp("ln"))?,
            self_attention(D, 2, true, vb.clone())?,
            drop()?,
        )),
        Kind::ResidualMlp => Net::Residual(Residual::new(layer_norm(D, 1e-5, vb.pp("ln"))?, mlp(&vb)?, drop()?)),
    })
}

/// Values exact in both half types for a parameter: small weights, a norm's scale near 1,
/// biases that are odd multiples of 2^-10 (at most 129 of them: 8 significant bits). The
/// input's and weights' products are multiples of 2^-9, so no pre-activation of a layer on
/// the input is exactly 0, where ReLU's finite difference would see half its slope.
fn exact_values(name: &str, n: usize, seed: u64) -> Vec<f32> {
    let v = grid(n, 1.0 / 64.0, 16, seed);
    if name.starts_with("ln.weight") {
        v.iter().map(|x| 1.0 + 2.0 * x).collect()
    } else if name.ends_with("bias") {
        grid(n, 1.0 / 512.0, 64, seed)
            .iter()
            .map(|x| x + 1.0 / 1024.0)
            .collect()
    } else {
        v
    }
}

/// The f64 module with the run's parameter values, its Vars by name.
struct Reference {
    net: Net,
    vars: BTreeMap<String, Var>,
}

fn reference(kind: Kind, values: &BTreeMap<String, Tensor>, rng: &Generator) -> Reference {
    let vm = VarMap::new();
    let net = build(kind, VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu), rng).unwrap();
    let vars: BTreeMap<String, Var> = vm.data().lock().unwrap().clone().into_iter().collect();
    assert_eq!(
        vars.keys().collect::<Vec<_>>(),
        values.keys().collect::<Vec<_>>(),
        "{kind:?}: the same parameters"
    );
    for (name, var) in &vars {
        var.set(&values[name].to_dtype(DType::F64).unwrap()).unwrap();
    }
    Reference { net, vars }
}

/// `sum(y * r)` of the f64 module on `x`, with the dropout mask drawn from `state`.
fn loss64(re: &Reference, x: &Tensor, r: &Tensor, rng: &Generator, state: &rand_chacha::ChaCha8Rng) -> Tensor {
    rng.restore(state.clone());
    (re.net.forward(x).unwrap() * r).unwrap().sum_all().unwrap()
}

/// Central differences of the f64 loss at a few coordinates of `var`, checked against the
/// f64 autograd gradient `exact` (which validates the reference) and returned.
fn finite_differences(var: &Var, exact: &[f64], loss: &dyn Fn() -> f64, what: &str) -> Vec<(usize, f64)> {
    let base = vals(var.as_tensor());
    let n = base.len();
    let eps = 1e-6;
    (0..n)
        .step_by((n / 4).max(1))
        .take(4)
        .map(|i| {
            let at = |d: f64| {
                let mut b = base.clone();
                b[i] += d;
                var.set(&Tensor::from_vec(b, var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                loss()
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps);
            var.set(&Tensor::from_vec(base.clone(), var.shape(), &Device::Cpu).unwrap())
                .unwrap();
            assert!(
                (fd - exact[i]).abs() <= 1e-6 * (1.0 + exact[i].abs()),
                "{what}[{i}]: f64 autograd {} vs finite difference {fd}",
                exact[i]
            );
            (i, fd)
        })
        .collect()
}

/// How close a gradient of the run must be to exact arithmetic, relative to its largest
/// value: f32 accumulation at O0; at O1-O3 the half type's rounding of the activations the
/// module keeps in half (2^-11 for f16, 2^-8 for bf16), compounded over a few layers.
fn tolerance(level: OptLevel, half: HalfType) -> f64 {
    match (level, half) {
        (OptLevel::O0, _) => 1e-5,
        (_, HalfType::F16) => 1e-2,
        _ => 6e-2,
    }
}

fn check(kind: Kind, level: OptLevel, half: HalfType, device_path: bool, what: &str) {
    let cfg = AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        .loss_scale(LossScaleSpec::Static(SCALE))
        .seed(7);
    let run = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let rng = run.generator("dropout");
    let model = run.model(|vb| build(kind, vb, &rng)).unwrap();
    let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
    let store = run.store().clone();
    let mut values = BTreeMap::new();
    for (k, name) in store.trainable_names().into_iter().enumerate() {
        let shape = store.param(&name).unwrap().working().shape().clone();
        let v = Tensor::from_vec(
            exact_values(&name, shape.elem_count(), 40 + k as u64),
            shape,
            &Device::Cpu,
        )
        .unwrap();
        store.write_f32(&name, &v).unwrap();
        values.insert(name, v);
    }
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::from_vec(grid(B * T * D, 0.125, 8, 5), (B, T, D), &dev).unwrap()).unwrap();
    let state = rng.snapshot();

    // The run: forward through the model wrapper (which casts the input to the model type),
    // backward through the guard's pipeline.
    let y = model.forward(&x.as_tensor().affine(1.0, 0.0).unwrap()).unwrap();
    let out = y.dims().to_vec();
    let r32 = Tensor::from_vec(grid(y.elem_count(), 1.0 / 64.0, 8, 6), out.as_slice(), &dev).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &r32).unwrap().sum_all().unwrap();
    let (report, gx) = backward_capturing(&run, &loss, &mut opt, x.as_tensor());
    assert!(!report.found_inf, "{what}: overflow");
    assert!(report.warnings.is_empty(), "{what}: {:?}", report.warnings);
    let inv = 1.0 / report.loss_scale as f64;
    let gx: Vec<f64> = vals(&gx.expect("the input's gradient"))
        .iter()
        .map(|g| g * inv)
        .collect();
    let master = opt.master_grads();

    // The reference: the same module outside a run in f64, the same mask.
    let re = reference(kind, &values, &rng);
    let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
    let r64 = r32.to_dtype(DType::F64).unwrap();
    let g64 = loss64(&re, x64.as_tensor(), &r64, &rng, &state).backward().unwrap();
    let f64_loss = || {
        loss64(&re, x64.as_tensor(), &r64, &rng, &state)
            .to_scalar::<f64>()
            .unwrap()
    };
    let tol = tolerance(level, half);

    // The key bias's exact gradient is zero (softmax ignores a shift shared by a query's
    // scores), so every gradient is measured against a floor from the module's largest one.
    let mut named: Vec<(String, Vec<f64>, &Var)> = re
        .vars
        .iter()
        .map(|(name, var)| {
            let got = master
                .get(name)
                .unwrap_or_else(|| panic!("{what}: no master gradient for {name}"));
            (name.clone(), vals(got), var)
        })
        .collect();
    named.push(("input".to_string(), gx, &x64));
    let exact: Vec<Vec<f64>> = named
        .iter()
        .map(|(name, _, var)| {
            vals(
                g64.get(var)
                    .unwrap_or_else(|| panic!("{what}: no f64 gradient for {name}")),
            )
        })
        .collect();
    let largest = exact.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
    for ((name, got, var), exact) in named.iter().zip(&exact) {
        assert!(
            name.ends_with("k.bias") || exact.iter().any(|v| *v != 0.0),
            "{what}: {name}'s reference gradient is all zero"
        );
        let scale = exact.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-2 * largest);
        let e = got.iter().zip(exact).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(
            e <= tol,
            "{what}: {name} gradient off the f64 reference by {e:.2e} (at most {tol:.0e})"
        );
        for (i, fd) in finite_differences(var, exact, &f64_loss, &format!("{what}: {name}")) {
            assert!(
                (got[i] - fd).abs() <= tol * scale,
                "{what}: {name}[{i}] gradient {} vs finite difference {fd}",
                got[i]
            );
        }
    }
}

fn everywhere(kind: Kind) {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    each_tier(|isa| {
        for level in LEVELS {
            for half in HALVES {
                for device_path in [false, true] {
                    let what = format!("{kind:?} {level:?} {half:?} {isa:?} device_path={device_path}");
                    check(kind, level, half, device_path, &what);
                }
            }
        }
    });
}

#[test]
fn linear_with_gelu_matches_f64_and_finite_differences_everywhere() {
    everywhere(Kind::LinearGelu);
}

#[test]
fn linear_with_relu_matches_f64_and_finite_differences_everywhere() {
    everywhere(Kind::LinearRelu);
}

#[test]
fn mlp_matches_f64_and_finite_differences_everywhere() {
    everywhere(Kind::Mlp);
}

#[test]
fn self_attention_matches_f64_and_finite_differences_everywhere() {
    everywhere(Kind::Attention);
}

#[test]
fn residual_attention_matches_f64_and_finite_differences_everywhere() {
    everywhere(Kind::ResidualAttention);
}

#[test]
fn residual_mlp_matches_f64_and_finite_differences_everywhere() {
    everywhere(Kind::ResidualMlp);
}
