//! O1: Apex's test_basic_casts, test_promotion and test_cache, the autocast scope, user
//! registrations, and the PyTorch-style GradScaler.
//!
//! On `common::device()`; the bf16 conv2d test is about candle's CPU backend and stays there.

mod common;

use candle_amp::autocast::{self, CastPolicy};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, GradScaler, LossScaleSpec, OptLevel, ops};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder};
use common::*;

fn o1() -> amp::Amp {
    amp::Amp::new(AmpConfig::new(OptLevel::O1).verbosity(0), &common::device()).unwrap()
}

fn rand(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let b = batches(n.div_ceil(128), seed);
    let v: Vec<f32> = b.iter().flat_map(|(x, _)| flat(x)).take(n).collect();
    Tensor::from_vec(v, shape, &common::device())
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

#[test]
fn basic_casts_follow_the_lists() {
    let amp = o1();
    let vb = amp.var_builder();
    let w = vb.get((4, 8), "w").unwrap();
    let cw = vb
        .get_with_hints((3, 2, 3, 3), "cw", candle_nn::init::DEFAULT_KAIMING_NORMAL)
        .unwrap();
    let _s = amp.autocast();
    for dt in [DType::F32, DType::F16] {
        let x = Var::from_tensor(&rand(&[2, 8], 1, dt)).unwrap();
        // Half list.
        let y = ops::linear(&x, &w, None).unwrap();
        assert_eq!(y.dtype(), DType::F16, "linear on {dt:?}");
        let g = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(
            g.get(&x).unwrap().dtype(),
            dt,
            "the input gradient keeps the input's type"
        );
        assert_eq!(
            g.get(&w).unwrap().dtype(),
            DType::F32,
            "the weight gradient keeps the weight's type"
        );
        assert_eq!(ops::matmul(&x, &w.t().unwrap()).unwrap().dtype(), DType::F16);
        assert_eq!(
            ops::matmul(&w, &x.t().unwrap()).unwrap().dtype(),
            DType::F16,
            "either operand order"
        );
        let img = rand(&[1, 2, 5, 5], 2, dt);
        assert_eq!(
            ops::conv2d(&img, &cw, None, Default::default()).unwrap().dtype(),
            DType::F16
        );
        // Float list.
        for (name, out) in [
            ("softmax", ops::softmax(&x, 1).unwrap()),
            ("log_softmax", ops::log_softmax(&x, 1).unwrap()),
            ("layer_norm", ops::layer_norm(&x, None, None, 1e-5).unwrap()),
            ("group_norm", ops::group_norm(&img, 2, None, None, 1e-5).unwrap()),
            ("mse", ops::mse(&x, &x.ones_like().unwrap()).unwrap()),
            ("exp", ops::exp(&x).unwrap()),
            ("pow", ops::pow(&x.abs().unwrap(), 2.0).unwrap()),
            ("sum", ops::sum_all(&x).unwrap()),
            ("gelu", ops::gelu(&x).unwrap()),
        ] {
            assert_eq!(out.dtype(), DType::F32, "{name} on {dt:?}");
        }
        // Unlisted ops follow their input: relu and batch norm (train and eval).
        assert_eq!(x.relu().unwrap().dtype(), dt);
        let bn = amp::nn::batch_norm(2, 1e-5, vb.pp(format!("bn{dt:?}"))).unwrap();
        for train in [true, false] {
            assert_eq!(
                bn.forward_t(&img, train).unwrap().dtype(),
                dt,
                "batch norm train={train}"
            );
        }
    }
    // Integer and f64 tensors are never cast.
    let x64 = rand(&[2, 8], 3, DType::F64);
    assert_eq!(ops::matmul(&x64, &x64.t().unwrap()).unwrap().dtype(), DType::F64);
    assert_eq!(ops::exp(&x64).unwrap().dtype(), DType::F64);
    let ids = Tensor::new(&[1u32, 2], &common::device()).unwrap();
    assert_eq!(ops::add(&ids, &ids).unwrap().dtype(), DType::U32);
}

#[test]
fn promotion_to_the_widest_type() {
    let _s = autocast::scope(DType::F16);
    let h = rand(&[3, 4], 4, DType::F16);
    let f = rand(&[3, 4], 5, DType::F32);
    let b = rand(&[3, 4], 6, DType::BF16);
    assert_eq!(ops::mul(&h, &f).unwrap().dtype(), DType::F32);
    assert_eq!(ops::add(&f, &h).unwrap().dtype(), DType::F32);
    assert_eq!(
        ops::add(&h, &h).unwrap().dtype(),
        DType::F16,
        "a single type passes through"
    );
    assert_eq!(
        ops::div(&h, &b).unwrap().dtype(),
        DType::F32,
        "f16 with bf16 meets in f32"
    );
    assert_eq!(ops::cat(&[&h, &f], 0).unwrap().dtype(), DType::F32);
    assert_eq!(ops::stack(&[&h, &f], 0).unwrap().dtype(), DType::F32);
    let m = ops::cmp(&h, &f, ops::CmpOp::Gt).unwrap();
    assert_eq!(m.dtype(), DType::U8);
    assert_eq!(ops::where_cond(&m, &h, &f).unwrap().dtype(), DType::F32);
    // Without autocast the same mix still promotes (PyTorch's type promotion; candle alone
    // refuses it), and the values are the f32 op's.
    drop(_s);
    let p = ops::mul(&h, &f).unwrap();
    assert_eq!(p.dtype(), DType::F32);
    let want = (h.to_dtype(DType::F32).unwrap() * &f).unwrap();
    assert_eq!(common::flat(&p), common::flat(&want));
    assert_eq!(ops::cat(&[&b, &h], 1).unwrap().dtype(), DType::F32);
}

#[test]
fn binary_cross_entropy_is_banned_on_half_and_points_to_logits() {
    let _s = autocast::scope(DType::F16);
    let p = (rand(&[4], 7, DType::F32).abs().unwrap() * 0.5).unwrap();
    let y = Tensor::new(&[1f32, 0., 1., 0.], &common::device()).unwrap();
    let e = ops::binary_cross_entropy(&p.to_dtype(DType::F16).unwrap(), &y).unwrap_err();
    assert!(e.to_string().contains("binary_cross_entropy_with_logits"), "{e}");
    let l = ops::binary_cross_entropy(&p, &y).unwrap();
    assert_eq!(l.dtype(), DType::F32);
    let pv = flat(&p);
    let expect: f32 = pv
        .iter()
        .zip([1f32, 0., 1., 0.])
        .map(|(p, y)| -(y * p.ln() + (1. - y) * (1. - p).ln()))
        .sum::<f32>()
        / 4.0;
    assert!((l.to_scalar::<f32>().unwrap() - expect).abs() < 1e-5);
    // The logits form equals the probabilities form on sigmoid(logits).
    let z = rand(&[4], 8, DType::F32);
    let a = ops::binary_cross_entropy_with_logits(&z, &y)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let b = ops::binary_cross_entropy(&candle_nn::ops::sigmoid(&z).unwrap(), &y)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
}

#[test]
fn the_cast_cache_is_reused_and_invalidated_by_weight_changes() {
    let cfg = AmpConfig::new(OptLevel::O1)
        .loss_scale(LossScaleSpec::Static(4.0))
        .verbosity(0);
    let amp = amp::Amp::new(cfg, &common::device()).unwrap();
    // Two "layers" sharing one weight.
    let model = amp
        .model(|vb| {
            let w = vb.get_with_hints((8, 8), "shared.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
            Ok(amp::nn::Linear::new(w, None))
        })
        .unwrap();
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
    let (x, y) = batches(1, 9).remove(0);
    for step in 0..3 {
        let w32 = amp.store().param("shared.weight").unwrap().working().copy().unwrap();
        let (_, hits) = amp.cast_cache_stats();
        let out = {
            let _s = amp.autocast();
            let h = candle_nn::Module::forward(model.inner(), &x).unwrap();
            candle_nn::Module::forward(model.inner(), &h).unwrap()
        };
        assert_eq!(out.dtype(), DType::F16);
        assert_eq!(
            amp.cast_cache_stats(),
            (1, hits + 1),
            "one half copy of the shared weight; the second use hit the cache"
        );
        // The f32 reference with the same half rounding: a stale cast would differ.
        let wh = w32.to_dtype(DType::F16).unwrap();
        let reference = x
            .to_dtype(DType::F16)
            .unwrap()
            .matmul(&wh.t().unwrap())
            .unwrap()
            .matmul(&wh.t().unwrap())
            .unwrap();
        // Exact on the CPU (the fused product rounds as candle's); cuBLAS may order sums apart.
        common::assert_close(
            &flat(&out),
            &flat(&reference),
            common::cross_tol(DType::F16),
            &format!("step {step}"),
        );
        let loss = ops::mse(&out, &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert_eq!(
            amp.cast_cache_stats().0,
            1,
            "kept across scale_loss; the step's write makes the next forward cast again"
        );
        assert_eq!(opt.master_grads().len(), 1);
        let g = opt.master_grads().get("shared.weight").unwrap();
        assert_eq!(g.dtype(), DType::F32);
        // Gradient against an f32 computation of the same model.
        let wv = Var::from_tensor(&w32).unwrap();
        let o32 = x.matmul(&wv.t().unwrap()).unwrap().matmul(&wv.t().unwrap()).unwrap();
        let g32 = ops::mse(&o32, &y).unwrap().backward().unwrap();
        let (a, b) = (flat(g), flat(g32.get(&wv).unwrap()));
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            a.iter().zip(&b).all(|(p, q)| (p - q).abs() <= 2e-2 * scale),
            "step {step}"
        );
        opt.step().unwrap();
        opt.zero_grad();
    }
}

#[test]
fn scopes_nest_disable_restore_and_are_per_thread() {
    assert!(!autocast::is_enabled());
    {
        let _a = autocast::scope(DType::BF16);
        assert!(autocast::is_enabled());
        {
            let _d = autocast::disable();
            assert!(!autocast::is_enabled());
            let x = rand(&[2, 2], 1, DType::F32);
            assert_eq!(ops::matmul(&x, &x).unwrap().dtype(), DType::F32, "disabled inside");
            {
                let _b = autocast::scope(DType::F16);
                assert_eq!(autocast::current().unwrap().half(), DType::F16);
            }
            assert!(!autocast::is_enabled(), "restored to disabled");
        }
        assert_eq!(
            autocast::current().unwrap().half(),
            DType::BF16,
            "restored to the outer scope"
        );
        // A worker thread starts without a policy; entering the snapshot there enables it.
        let snapshot = autocast::current().unwrap();
        std::thread::spawn(move || {
            assert!(!autocast::is_enabled());
            let _g = snapshot.enter();
            let x = rand(&[2, 2], 1, DType::F32);
            assert_eq!(ops::matmul(&x, &x).unwrap().dtype(), DType::BF16);
        })
        .join()
        .unwrap();
        let y = autocast::disabled(|| ops::matmul(&rand(&[2, 2], 1, DType::F32), &rand(&[2, 2], 2, DType::F32)));
        assert_eq!(y.unwrap().dtype(), DType::F32);
    }
    assert!(!autocast::is_enabled());
    assert_eq!(
        autocast::default_dtype(&Device::Cpu),
        DType::BF16,
        "PyTorch's CPU default"
    );
}

#[test]
fn user_registrations_cast_user_functions() {
    let amp = o1();
    amp.register_op("my_matmul", CastPolicy::Half);
    amp.register_op("my_norm", CastPolicy::Float);
    amp.register_op("softmax", CastPolicy::Half);
    let _s = amp.autocast();
    let x = rand(&[2, 3], 1, DType::F32);
    let seen = ops::call("my_matmul", &[&x], |xs| Ok(xs[0].clone())).unwrap();
    assert_eq!(seen.dtype(), DType::F16);
    let seen = ops::call("my_norm", &[&x.to_dtype(DType::F16).unwrap()], |xs| Ok(xs[0].clone())).unwrap();
    assert_eq!(seen.dtype(), DType::F32);
    let seen = ops::call("unregistered", &[&x], |xs| Ok(xs[0].clone())).unwrap();
    assert_eq!(seen.dtype(), DType::F32, "ops on no list run in their input's type");
    assert_eq!(
        amp.op_policy("softmax"),
        Some(CastPolicy::Half),
        "built-ins can be overridden"
    );
}

#[test]
fn the_model_wrapper_autocasts_at_o1_and_counts_half_ops() {
    let (model, mut opt, amp) = common::initialize(
        |vb| -> candle_core::Result<(amp::nn::Linear, amp::nn::Linear)> {
            Ok((amp::nn::linear(8, 8, vb.pp("a"))?, amp::nn::linear(8, 8, vb.pp("b"))?))
        },
        Sgd::new(SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(OptLevel::O1).verbosity(0),
    )
    .unwrap();
    let (x, y) = batches(1, 2).remove(0);
    let out = {
        let _s = model.autocast();
        let h = candle_nn::Module::forward(&model.inner().0, &x).unwrap();
        candle_nn::Module::forward(&model.inner().1, &h).unwrap()
    };
    assert_eq!(out.dtype(), DType::F16);
    let loss = ops::mse(&out, &y).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
    assert_eq!(amp.autocast_ops(), 2);
    assert!(!opt.step().unwrap().is_skipped());
    // A model built from plain candle-nn layers runs no autocast op (O1 equals O0 then).
    let (m2, mut o2, a2) = common::initialize(
        TwoLinear::new,
        Sgd::new(SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(OptLevel::O1).verbosity(0),
    )
    .unwrap();
    let loss = ops::mse(&m2.forward(&x).unwrap(), &y).unwrap();
    a2.scale_loss(&loss, &mut o2).unwrap().backward().unwrap();
    assert_eq!(a2.autocast_ops(), 0);
    // At O2 the policy is off: our layers run in the model type, no autocast.
    let amp2 = amp::Amp::new(AmpConfig::new(OptLevel::O2).verbosity(0), &common::device()).unwrap();
    let l = amp2.model(|vb| amp::nn::linear(8, 8, vb)).unwrap();
    assert_eq!(
        l.forward(&x).unwrap().dtype(),
        DType::F32,
        "cast back to f32 by the wrapper"
    );
    assert_eq!(
        candle_nn::Module::forward(l.inner(), &x.to_dtype(DType::F16).unwrap())
            .unwrap()
            .dtype(),
        DType::F16
    );
}

/// PyTorch's scaling harness with GradScaler: 2xLinear(8, 8), 4 batches, inf at iteration 2,
/// init 128, interval 1: the scale ends at 128 * 2^3 * 0.5 and the weights equal a control
/// that skips the same step.
#[test]
fn grad_scaler_trajectory_and_control() {
    let (model, mut opt, amp) = common::initialize(
        TwoLinear::new,
        Sgd::new(SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(OptLevel::O1).verbosity(0),
    )
    .unwrap();
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let mut csgd = <candle_nn::SGD as candle_nn::Optimizer>::new(vm.all_vars(), 0.1).unwrap();
    let mut scaler = GradScaler::with_params(128.0, 2.0, 0.5, 1, true).unwrap();
    let w = amp.store().param("l1.weight").unwrap().working().clone();
    for (i, (x, y)) in batches(4, 3).iter().enumerate() {
        let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        if i == 2 {
            let bad = (grads.get(&w).unwrap() * f64::INFINITY).unwrap();
            grads.insert(&w, bad);
        }
        let out = scaler.step(&mut opt, &grads).unwrap();
        assert_eq!(out.is_skipped(), i == 2);
        scaler.update(None).unwrap();
        let g = ops::mse(&candle_nn::Module::forward(&control, x).unwrap(), y)
            .unwrap()
            .backward()
            .unwrap();
        if i != 2 {
            candle_nn::Optimizer::step(&mut csgd, &g).unwrap();
        }
    }
    assert_eq!(scaler.get_scale(), 128.0 * 8.0 * 0.5);
    common::assert_values_close(
        &store_values(amp.store()),
        &varmap_values(&vm),
        common::cross_tol(DType::F32),
        "against the control",
    );
    let st = scaler.state_dict().unwrap();
    assert_eq!((st.scale, st.growth_tracker), (512.0, 0));
    let mut other = GradScaler::new();
    other.load_state_dict(Some(&st)).unwrap();
    assert_eq!(other.state_dict().unwrap(), st);
}

#[test]
fn grad_scaler_stage_rules() {
    let (model, mut opt, _amp) = common::initialize(
        TwoLinear::new,
        Sgd::new(SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(OptLevel::O1).verbosity(0),
    )
    .unwrap();
    let (x, y) = batches(1, 4).remove(0);
    let mut scaler = GradScaler::new();
    let grads = || scaler_grads(&model, &x, &y, 65536.0);
    assert!(
        matches!(GradScaler::new().update(None), Err(AmpError::CallOrder { .. })),
        "update with no recorded check"
    );
    let g = grads();
    scaler.unscale(&mut opt, &g).unwrap();
    assert!(
        matches!(scaler.unscale(&mut opt, &g), Err(AmpError::CallOrder { .. })),
        "unscale twice"
    );
    scaler.step(&mut opt, &g).unwrap();
    assert!(
        matches!(scaler.unscale(&mut opt, &g), Err(AmpError::CallOrder { .. })),
        "unscale after step"
    );
    assert!(
        matches!(scaler.step(&mut opt, &g), Err(AmpError::CallOrder { .. })),
        "step twice"
    );
    scaler.update(None).unwrap();
    // After update the cycle starts again; an explicit new scale leaves the tracker alone.
    scaler.step(&mut opt, &grads()).unwrap();
    scaler.update(Some(1000.0)).unwrap();
    assert_eq!(scaler.get_scale(), 1000.0);
    assert_eq!(
        scaler.state_dict().unwrap().growth_tracker,
        1,
        "one clean update counted, then untouched"
    );
    // Disabled: scale 1, no checks, no state.
    let mut off = GradScaler::with_params(65536.0, 2.0, 0.5, 2000, false).unwrap();
    assert_eq!(off.get_scale(), 1.0);
    off.step(&mut opt, &grads()).unwrap();
    off.update(None).unwrap();
    assert!(off.state_dict().is_none());
    assert!(GradScaler::new().load_state_dict(None).is_err());
    assert!(GradScaler::with_params(1.0, 1.0, 0.5, 1, true).is_err());
}

fn scaler_grads(
    model: &amp::AmpModel<TwoLinear>,
    x: &Tensor,
    y: &Tensor,
    scale: f64,
) -> candle_core::backprop::GradStore {
    let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
    (loss * scale).unwrap().backward().unwrap()
}

/// On the CPU whatever the test device: the point is candle's CPU backend lacking bf16 conv2d.
#[test]
fn bf16_conv2d_works_on_the_cpu() {
    let vm = candle_nn::VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::BF16, &Device::Cpu);
    let conv = amp::nn::conv2d(2, 3, 3, Default::default(), vb.pp("c")).unwrap();
    let x = Var::from_tensor(&rand(&[1, 2, 6, 6], 3, DType::BF16).to_device(&Device::Cpu).unwrap()).unwrap();
    let y = candle_nn::Module::forward(&conv, &x).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let g = y
        .to_dtype(DType::F32)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(g.get(&x).unwrap().dtype(), DType::BF16);
    assert!(flat(g.get(&x).unwrap()).iter().any(|v| *v != 0.0));
    // candle's own bf16 conv2d fails on the CPU.
    assert!(x.conv2d(conv.weight(), 0, 1, 1, 1).is_err());
}
