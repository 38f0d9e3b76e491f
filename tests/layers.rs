//! Gradients through every drop-in layer, op and loss: equal to central finite differences
//! in f64, and under O1 autocast equal to the f32 computation within half tolerance.
//!
//! On `common::device()`.

mod common;

use candle_amp::{self as amp, nn as ann, ops};
use candle_core::{DType, Tensor, Var};
use candle_nn::{Module, ModuleT, VarBuilder, VarMap};
use common::flat;

fn rand(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
    Tensor::from_vec(v, shape, &common::device())
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

/// Checks autograd against central differences for every Var in `vars`, at up to 6
/// coordinates each; every gradient must also be non-zero somewhere.
fn fd_check(name: &str, vars: &[Var], loss: &dyn Fn() -> Tensor) {
    let g = loss().backward().unwrap();
    for (k, v) in vars.iter().enumerate() {
        let grad = g.get(v).unwrap_or_else(|| panic!("{name}: var {k} got no gradient"));
        let gv: Vec<f64> = grad.flatten_all().unwrap().to_vec1().unwrap();
        assert!(gv.iter().any(|x| *x != 0.0), "{name}: var {k} has an all-zero gradient");
        let base: Vec<f64> = v.flatten_all().unwrap().to_vec1().unwrap();
        let n = base.len();
        for i in (0..n).step_by((n / 6).max(1)).take(6) {
            let eps = 1e-6;
            let at = |d: f64| {
                let mut b = base.clone();
                b[i] += d;
                v.set(&Tensor::from_vec(b, v.shape(), &common::device()).unwrap())
                    .unwrap();
                loss().to_scalar::<f64>().unwrap()
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps);
            v.set(&Tensor::from_vec(base.clone(), v.shape(), &common::device()).unwrap())
                .unwrap();
            assert!(
                (fd - gv[i]).abs() <= 1e-5 * (1.0 + gv[i].abs()),
                "{name}: var {k}[{i}]: autograd {} vs fd {fd}",
                gv[i]
            );
        }
    }
}

fn vars_of(vm: &VarMap) -> Vec<Var> {
    let d = vm.data().lock().unwrap();
    let mut names: Vec<&String> = d.keys().filter(|k| !k.contains("running")).collect();
    names.sort();
    names.into_iter().map(|k| d[k].clone()).collect()
}

/// Weighted sum of a layer's output, so every output element matters.
fn weighted(y: &Tensor, seed: u64) -> Tensor {
    let r = rand(y.dims(), seed, DType::F64);
    (y.to_dtype(DType::F64).unwrap() * r).unwrap().sum_all().unwrap()
}

#[test]
fn every_layer_matches_finite_differences_in_f64() {
    type Build = Box<dyn Fn(VarBuilder) -> Box<dyn Fn(&Tensor) -> Tensor>>;
    let cases: Vec<(&str, Vec<usize>, Build)> = vec![
        (
            "linear",
            vec![3, 5],
            Box::new(|vb| {
                let l = ann::linear(5, 4, vb).unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "linear rank 3",
            vec![2, 3, 5],
            Box::new(|vb| {
                let l = ann::linear_no_bias(5, 4, vb).unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "conv1d",
            vec![2, 2, 7],
            Box::new(|vb| {
                let l = ann::conv1d(2, 3, 3, Default::default(), vb).unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "conv2d",
            vec![2, 2, 5, 5],
            Box::new(|vb| {
                let l = ann::conv2d(
                    2,
                    3,
                    3,
                    candle_nn::Conv2dConfig {
                        padding: 1,
                        ..Default::default()
                    },
                    vb,
                )
                .unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "conv_transpose2d",
            vec![1, 2, 4, 4],
            Box::new(|vb| {
                let l = ann::conv_transpose2d(2, 3, 3, Default::default(), vb).unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "layer_norm",
            vec![3, 6],
            Box::new(|vb| {
                let l = ann::layer_norm(6, 1e-5, vb).unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "rms_norm",
            vec![3, 6],
            Box::new(|vb| {
                let l = ann::rms_norm(6, 1e-5, vb).unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "group_norm",
            vec![2, 4, 3],
            Box::new(|vb| {
                let l = ann::group_norm(2, 4, 1e-5, vb).unwrap();
                Box::new(move |x| l.forward(x).unwrap())
            }),
        ),
        (
            "batch_norm (train)",
            vec![4, 3, 2],
            Box::new(|vb| {
                let l = ann::batch_norm(3, 1e-5, vb).unwrap();
                Box::new(move |x| {
                    // Statistics update each call; the output does not depend on them in training.
                    l.forward_t(x, true).unwrap()
                })
            }),
        ),
        (
            "attention (causal)",
            vec![2, 5, 4],
            Box::new(|vb| {
                let q = ann::linear(4, 4, vb.pp("q")).unwrap();
                let k = ann::linear(4, 4, vb.pp("k")).unwrap();
                let v = ann::linear(4, 4, vb.pp("v")).unwrap();
                Box::new(move |x| {
                    ann::scaled_dot_product_attention(
                        &q.forward(x).unwrap(),
                        &k.forward(x).unwrap(),
                        &v.forward(x).unwrap(),
                        None,
                        true,
                        None,
                    )
                    .unwrap()
                })
            }),
        ),
        (
            "softmax",
            vec![3, 5],
            Box::new(|_| Box::new(|x| ops::softmax(x, 1).unwrap())),
        ),
        (
            "log_softmax",
            vec![3, 5],
            Box::new(|_| Box::new(|x| ops::log_softmax(x, 1).unwrap())),
        ),
        ("gelu", vec![3, 5], Box::new(|_| Box::new(|x| ops::gelu(x).unwrap()))),
        (
            "prelu",
            vec![2, 3, 4],
            Box::new(|vb| {
                let a = vb.get_with_hints(3, "alpha", candle_nn::Init::Const(0.25)).unwrap();
                Box::new(move |x| ops::prelu(x, &a).unwrap())
            }),
        ),
    ];
    for (name, shape, build) in cases {
        let vm = VarMap::new();
        let f = build(VarBuilder::from_varmap(&vm, DType::F64, &common::device()));
        let x = Var::from_tensor(&rand(&shape, 1, DType::F64)).unwrap();
        let mut vars = vars_of(&vm);
        vars.push(x.clone());
        fd_check(name, &vars, &|| weighted(&f(&x), 2));
    }
}

#[test]
fn embedding_and_dropout_gradients() {
    let vm = VarMap::new();
    let e = ann::embedding(6, 4, VarBuilder::from_varmap(&vm, DType::F64, &common::device())).unwrap();
    let ids = Tensor::new(&[[1u32, 2, 2], [5, 0, 1]], &common::device()).unwrap();
    fd_check("embedding", &vars_of(&vm), &|| weighted(&e.forward(&ids).unwrap(), 3));

    let run = amp::Amp::new(amp::OptLevel::O0, &common::device()).unwrap();
    let g = run.generator("dropout");
    let d = ann::Dropout::new(0.3, g.clone()).unwrap();
    let x = Var::from_tensor(&rand(&[4, 5], 4, DType::F64)).unwrap();
    let state = g.snapshot();
    // The same mask on every evaluation: restore the generator first.
    let f = || {
        g.restore(state.clone());
        weighted(&d.forward_t(&x, true).unwrap(), 5)
    };
    fd_check("dropout", std::slice::from_ref(&x), &f);
    g.restore(state.clone());
    let y = flat(&d.forward_t(&x, true).unwrap());
    let zeros = y.iter().filter(|v| **v == 0.0).count();
    assert!(zeros > 0 && zeros < 20, "{zeros} of 20 dropped");
    let kept: Vec<(f32, f32)> = y
        .iter()
        .zip(flat(&x))
        .filter(|(v, _)| **v != 0.0)
        .map(|(a, b)| (*a, b))
        .collect();
    assert!(
        kept.iter().all(|(a, b)| (a - b / 0.7).abs() < 1e-5),
        "kept values are scaled by 1/(1-p)"
    );
    assert_eq!(
        flat(&d.forward_t(&x, false).unwrap()),
        flat(&x),
        "evaluation is the identity"
    );
    g.restore(state);
    assert_eq!(
        flat(&d.forward_t(&x, true).unwrap()),
        y,
        "masks reproduce from the generator state"
    );
}

#[test]
fn every_loss_matches_finite_differences_in_f64() {
    let x = Var::from_tensor(&rand(&[2, 3, 4], 6, DType::F64)).unwrap();
    let t = rand(&[2, 3, 4], 7, DType::F64);
    let ids = Tensor::new(&[[0u32, 3, 1], [2, 2, 0]], &common::device()).unwrap();
    let probs = ops::softmax(&t, 2).unwrap();
    let bits = t.ge(0.0).unwrap().to_dtype(DType::F64).unwrap();
    type LossFn<'a> = Box<dyn Fn() -> Tensor + 'a>;
    let cases: Vec<(&str, LossFn)> = vec![
        (
            "cross_entropy rank 3",
            Box::new(|| ops::cross_entropy(&x, &ids).unwrap()),
        ),
        (
            "nll",
            Box::new(|| {
                ops::nll(
                    &ops::log_softmax(&x.reshape((6, 4)).unwrap(), 1).unwrap(),
                    &ids.flatten_all().unwrap(),
                )
                .unwrap()
            }),
        ),
        ("mse", Box::new(|| ops::mse(&x, &t).unwrap())),
        ("l1", Box::new(|| ops::l1(&x, &t).unwrap())),
        ("smooth_l1", Box::new(|| ops::smooth_l1(&x, &t, 0.5).unwrap())),
        (
            "kl_div",
            Box::new(|| ops::kl_div(&ops::log_softmax(&x, 2).unwrap(), &probs).unwrap()),
        ),
        (
            "bce_with_logits",
            Box::new(|| ops::binary_cross_entropy_with_logits(&x, &bits).unwrap()),
        ),
        (
            "bce",
            Box::new(|| ops::binary_cross_entropy(&candle_nn::ops::sigmoid(&x).unwrap(), &bits).unwrap()),
        ),
    ];
    for (name, f) in cases {
        assert_eq!(f().dtype(), DType::F64, "{name}: f64 is never cast");
        fd_check(name, std::slice::from_ref(&x), &|| f());
    }
    // Half inputs: losses come out f32.
    let h = x.to_dtype(DType::F16).unwrap();
    assert_eq!(ops::cross_entropy(&h, &ids).unwrap().dtype(), DType::F32);
    assert_eq!(
        ops::mse(&h, &t.to_dtype(DType::F16).unwrap()).unwrap().dtype(),
        DType::F32
    );
}

#[test]
fn o1_gradients_equal_the_f32_reference_within_half_tolerance() {
    // The same layers and input; gradients of f32 parameters with and without autocast.
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &common::device());
    let l1 = ann::linear(8, 16, vb.pp("l1")).unwrap();
    let ln = ann::layer_norm(16, 1e-5, vb.pp("ln")).unwrap();
    let conv = ann::conv1d(
        4,
        4,
        3,
        candle_nn::Conv1dConfig {
            padding: 1,
            ..Default::default()
        },
        vb.pp("c"),
    )
    .unwrap();
    let q = ann::linear(4, 4, vb.pp("q")).unwrap();
    // Seeded parameters: candle's CPU generator, which drew the initial values, cannot be
    // seeded, and about one draw in tens made a near-cancelling gradient whose half rounding
    // exceeded the tolerance (a CI run failed on it). Twenty seeds of this init all pass.
    {
        let d = vm.data().lock().unwrap();
        let mut names: Vec<&String> = d.keys().collect();
        names.sort();
        for (i, k) in names.into_iter().enumerate() {
            let v = &d[k];
            let r = rand(v.dims(), 100 + i as u64, DType::F32);
            // A norm's scale near 1, the rest as candle's uniform init: +-1/sqrt(fan in).
            let init = if k.starts_with("ln.") {
                r.affine(0.1, if k.ends_with("weight") { 1.0 } else { 0.0 })
            } else {
                let fan_in = if v.rank() >= 2 {
                    v.elem_count() / v.dims()[0]
                } else {
                    v.elem_count()
                };
                r.affine(1.0 / (fan_in.max(1) as f64).sqrt(), 0.0)
            };
            v.set(&init.unwrap()).unwrap();
        }
    }
    let x = rand(&[2, 4, 8], 8, DType::F32);
    let y = Tensor::new(&[[1u32, 0, 3, 2], [2, 3, 1, 0]], &common::device()).unwrap();
    let run = || {
        let h = ln.forward(&l1.forward(&x).unwrap()).unwrap(); // (2, 4, 16)
        let h = ops::gelu(&h).unwrap();
        let h = conv
            .forward(
                &h.transpose(1, 2)
                    .unwrap()
                    .narrow(1, 0, 4)
                    .unwrap()
                    .contiguous()
                    .unwrap(),
            )
            .unwrap(); // (2, 4, 4)
        let qh = q.forward(&h).unwrap();
        let a = ann::scaled_dot_product_attention(&qh, &h, &h, None, true, None).unwrap();
        ops::cross_entropy(&a, &y).unwrap()
    };
    let g32 = run().backward().unwrap();
    let g16 = {
        let _s = amp::autocast::scope(DType::F16);
        // Linear, conv1d and the attention products run in half.
        assert_eq!(l1.forward(&x).unwrap().dtype(), DType::F16);
        let c_in = rand(&[2, 4, 16], 9, DType::F32);
        assert_eq!(conv.forward(&c_in).unwrap().dtype(), DType::F16);
        assert_eq!(
            ops::matmul(&c_in, &c_in.transpose(1, 2).unwrap()).unwrap().dtype(),
            DType::F16
        );
        let loss = run();
        assert_eq!(loss.dtype(), DType::F32);
        loss.backward().unwrap()
    };
    for v in vars_of(&vm) {
        let (a, b) = (flat(g16.get(&v).unwrap()), flat(g32.get(&v).unwrap()));
        assert_eq!(
            g16.get(&v).unwrap().dtype(),
            DType::F32,
            "gradients of f32 weights are f32"
        );
        let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(m > 0.0);
        let d = a.iter().zip(&b).fold(0f32, |d, (p, q)| d.max((p - q).abs()));
        assert!(d <= 2e-2 * m, "{:?}: {d} vs max {m}", v.shape());
    }
}

#[test]
fn candles_fused_norms_stop_gradients_ours_do_not() {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &common::device());
    let lin = candle_nn::linear(4, 4, vb.pp("lin")).unwrap();
    let theirs = candle_nn::layer_norm(4, 1e-5, vb.pp("theirs")).unwrap();
    let ours = ann::layer_norm(4, 1e-5, vb.pp("ours")).unwrap();
    let x = rand(&[3, 4], 9, DType::F32);
    let w = vm.data().lock().unwrap()["lin.weight"].clone();
    let r = rand(&[3, 4], 10, DType::F32);
    let g = (theirs.forward(&lin.forward(&x).unwrap()).unwrap() * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(
        g.get(&w).is_none_or(|t| flat(t).iter().all(|v| *v == 0.0)),
        "candle's fused layer_norm has no backward"
    );
    let g = (ours.forward(&lin.forward(&x).unwrap()).unwrap() * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(flat(g.get(&w).unwrap()).iter().any(|v| *v != 0.0));
}

/// An empty batch (PyTorch's rule): the empty input comes back in training and in eval, the
/// running statistics stay as they were (a mean over nothing would write NaN into them),
/// and a batch with the wrong channel count is still an error.
#[test]
fn batch_norm_on_an_empty_batch_keeps_its_running_statistics() {
    let dev = common::device();
    let vm = VarMap::new();
    let l = ann::batch_norm(3, 1e-5, VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
    let x = Tensor::ones((4, 3, 2), DType::F32, &dev).unwrap();
    l.forward_t(&x, true).unwrap();
    let (mean, var) = (flat(l.running_mean()), flat(l.running_var()));
    for train in [true, false] {
        let e = x.narrow(0, 0, 0).unwrap();
        let y = l.forward_t(&e, train).unwrap();
        assert_eq!(y.dims(), [0, 3, 2]);
        assert_eq!(flat(l.running_mean()), mean);
        assert_eq!(flat(l.running_var()), var);
        assert!(mean.iter().chain(&var).all(|v| v.is_finite()));
    }
    let wrong = x.narrow(0, 0, 0).unwrap().narrow(1, 0, 2).unwrap();
    assert!(l.forward_t(&wrong, true).is_err());
}
