//! GELU in the tanh form (`kernels::gelu_tanh`, `ops::gelu_tanh`, `Activation::GeluTanh`):
//! values and derivatives against f64 arithmetic of PyTorch's formula
//! (`0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`) and against candle's own `gelu` (the tanh
//! form, code nobody here wrote); half inputs round the f32 result once; `nn::Linear`'s fused
//! activation gives the same values and gradients, bit for bit, as the layer followed by
//! `ops::gelu_tanh`, at every level in f16 and bf16, with one half edge fewer in the graph.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{Activation, Linear, linear};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, kernels, ops};
use candle_core::{DType, Device, Module, Tensor, Var};
use common::{backward_capturing, grid, half_nodes, t2};

fn gelu64(x: f64) -> f64 {
    let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

fn grad64(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

/// Points over [-12, 12], dense near 0, with the tails.
fn points() -> Vec<f32> {
    let mut v: Vec<f32> = (-3000..=3000).map(|i| i as f32 / 250.0).collect();
    v.extend([1e-6, -1e-6, 1e-3, -1e-3, 20.0, -20.0, 60.0, -60.0]);
    v
}

/// The op's values and its gradient (for an upstream gradient of 1) on `x` in `dt`, as f64.
fn value_and_grad(x: &[f32], dt: DType, f: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> (Vec<f64>, Vec<f64>) {
    let v = Var::from_tensor(&Tensor::new(x, &Device::Cpu).unwrap().to_dtype(dt).unwrap()).unwrap();
    let y = f(v.as_tensor()).unwrap();
    assert_eq!(y.dtype(), dt);
    let g = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
    let as64 = |t: &Tensor| -> Vec<f64> { t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap() };
    (as64(&y), as64(g.get(v.as_tensor()).unwrap()))
}

#[test]
fn f32_values_and_derivatives_match_f64_and_candle() {
    let x = points();
    let (y, g) = value_and_grad(&x, DType::F32, kernels::gelu_tanh);
    for (i, &xi) in x.iter().enumerate() {
        let x64 = xi as f64;
        // Absolute error near 0 (tanh by exp), relative in the linear tail.
        let tol = 1e-6 * (1.0 + x64.abs());
        assert!(
            (y[i] - gelu64(x64)).abs() <= tol,
            "gelu({xi}) = {} vs {}",
            y[i],
            gelu64(x64)
        );
        assert!(
            (g[i] - grad64(x64)).abs() <= 2e-6,
            "gelu'({xi}) = {} vs {}",
            g[i],
            grad64(x64)
        );
    }
    // candle's `gelu` is the tanh form (its own f32 code).
    let t = Tensor::new(&x[..], &Device::Cpu).unwrap();
    let c = t.gelu().unwrap().to_vec1::<f32>().unwrap();
    for (i, &xi) in x.iter().enumerate() {
        assert!(
            (y[i] - c[i] as f64).abs() <= 2e-6 * (1.0 + (xi as f64).abs()),
            "candle gelu({xi})"
        );
    }
    // `ops::gelu_tanh` outside autocast is the kernel.
    let o = ops::gelu_tanh(&t).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(o, y.iter().map(|v| *v as f32).collect::<Vec<_>>());
}

#[test]
fn half_inputs_round_the_f32_result_once() {
    let x = points();
    for dt in [DType::F16, DType::BF16] {
        // The f32 result on the half values, rounded once to the type.
        let xh: Vec<f32> = Tensor::new(&x[..], &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        let (y32, g32) = value_and_grad(&xh, DType::F32, kernels::gelu_tanh);
        let round = |v: &[f64]| -> Vec<f64> {
            Tensor::new(v, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (yh, gh) = value_and_grad(&xh, dt, kernels::gelu_tanh);
        assert_eq!(yh, round(&y32), "{dt:?} values");
        assert_eq!(gh, round(&g32), "{dt:?} gradients");
    }
}

/// `fc1` with the activation fused, `plain1` the same parameters without it.
struct Two {
    fc1: Linear,
    plain1: Linear,
    fc2: Linear,
    fused: AtomicBool,
}

impl Module for Two {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = if self.fused.load(Ordering::Relaxed) {
            self.fc1.forward(x)?
        } else {
            ops::gelu_tanh(&self.plain1.forward(x)?)?
        };
        self.fc2.forward(&h)
    }
}

fn bits(t: &Tensor) -> Vec<u64> {
    common::vals(t).iter().map(|v| v.to_bits()).collect()
}

#[test]
fn the_fused_linear_activation_matches_the_layer_then_the_op_bit_for_bit() {
    let (m, k, h, n) = (24, 40, 48, 16);
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            let what = format!("{level:?} {half:?}");
            let cfg = AmpConfig::new(level).half(half).verbosity(0).seed(7);
            let (model, mut opt, amp) = amp::initialize(
                |vb| {
                    let fc1 = linear(k, h, vb.pp("fc1"))?;
                    let plain1 = Linear::new(fc1.weight().clone(), fc1.bias().cloned());
                    Ok(Two {
                        fc1: fc1.with_activation(Activation::GeluTanh),
                        plain1,
                        fc2: linear(h, n, vb.pp("fc2"))?,
                        fused: AtomicBool::new(true),
                    })
                },
                Sgd::new(SgdConfig::new(0.5)).unwrap(),
                cfg,
            )
            .unwrap();
            let x = Var::from_tensor(&t2(&grid(m * k, 0.125, 16, 1), m, k)).unwrap();
            let r = t2(&grid(m * n, 1.0 / 64.0, 8, 2), m, n);
            let mut once = |fused: bool| {
                model.inner().fused.store(fused, Ordering::Relaxed);
                let y = model.forward(&x.as_tensor().affine(1.0, 0.0).unwrap()).unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
                let nodes = half_nodes(&loss);
                let (report, gx) = backward_capturing(&amp, &loss, &mut opt, x.as_tensor());
                assert!(!report.found_inf, "{what}");
                let grads: BTreeMap<String, Vec<u64>> =
                    opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
                opt.zero_grad();
                (bits(&y), bits(&gx.expect("the input's gradient")), grads, nodes)
            };
            let fused = once(true);
            let plain = once(false);
            assert_eq!(fused.0, plain.0, "{what}: output");
            assert_eq!(fused.1, plain.1, "{what}: input gradient");
            assert_eq!(fused.2.len(), 4, "{what}");
            assert_eq!(fused.2, plain.2, "{what}: parameter gradients");
            // The pre-activation is no half edge where the layer computes in half (under
            // autocast GELU runs after the layer, in f32, as its policy says).
            let fuses = !matches!(level, OptLevel::O0 | OptLevel::O1);
            let want = if fuses { plain.3 - 1 } else { plain.3 };
            assert_eq!(fused.3, want, "{what}: half graph nodes (unfused {})", plain.3);
        }
    }
}

#[test]
fn under_autocast_the_op_returns_f32() {
    let cfg = AmpConfig::new(OptLevel::O1).verbosity(0);
    let (model, _opt, _amp) = amp::initialize(
        |vb| linear(4, 4, vb.pp("fc")),
        Sgd::new(SgdConfig::new(0.1)).unwrap(),
        cfg,
    )
    .unwrap();
    let _g = model.autocast().expect("O1 autocasts");
    let x = Tensor::new(&[[-1f32, 0.5], [2.0, -3.0]], &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let y = ops::gelu_tanh(&x).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    let want: Vec<f32> = [-1f64, 0.5, 2.0, -3.0].iter().map(|&v| gelu64(v) as f32).collect();
    let got = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{got:?} vs {want:?}");
    }
}
