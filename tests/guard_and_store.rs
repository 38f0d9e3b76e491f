//! Call-order errors, persistent overflow, the parameter store, batch norm, parameter
//! groups, frozen parameters and the candle optimizer adapter.
//!
//! On `common::device()`. Where our optimizer is compared with candle's, the two agree bit
//! for bit on the CPU (the fused update rounds as candle's ops do) and within f32 rounding
//! elsewhere.

mod common;

use candle_amp::optim::{CandleOptimizer, Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, HalfType, LossScaleSpec, OptLevel};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use candle_nn::ModuleT;
use common::*;

fn sgd(lr: f64) -> Sgd {
    Sgd::new(SgdConfig::new(lr)).unwrap()
}

fn one_step_loss(model: &amp::AmpModel<TwoLinear>, seed: u64) -> Tensor {
    let (x, y) = batches(1, seed).remove(0);
    candle_nn::loss::mse(&model.forward(&x).unwrap(), &y).unwrap()
}

#[test]
fn wrong_call_orders_are_typed_errors() {
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O2).unwrap();
    assert!(
        matches!(opt.step(), Err(AmpError::CallOrder { .. })),
        "step before any backward"
    );
    assert!(matches!(opt.clip_grad_norm(1.0), Err(AmpError::CallOrder { .. })));
    amp.scale_loss(&one_step_loss(&model, 1), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    let e = opt.step().unwrap_err();
    assert!(matches!(e, AmpError::CallOrder { .. }), "step twice: {e}");
    let e = amp.scale_loss(&one_step_loss(&model, 2), &mut opt).unwrap_err();
    assert!(e.to_string().contains("zero_grad"), "backward after step: {e}");
    assert!(matches!(
        amp.scale_loss_id(&one_step_loss(&model, 2), 1, &mut opt),
        Err(AmpError::LossId { .. })
    ));
    opt.zero_grad();
    amp.scale_loss(&one_step_loss(&model, 3), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    assert_eq!(opt.steps(), 2);
}

#[test]
fn persistent_overflow_is_an_error_naming_the_parameters() {
    let cfg = AmpConfig::new(OptLevel::O2).max_consecutive_skips(5);
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), cfg).unwrap();
    let before = store_values(amp.store());
    let w = amp.store().param("l1.weight").unwrap().working().clone();
    let mut results = Vec::new();
    for i in 0..5 {
        let w = w.clone();
        amp.scale_loss(&one_step_loss(&model, i), &mut opt)
            .unwrap()
            .backward_with(move |s: &Tensor| {
                let mut g: GradStore = s.backward()?;
                let nan = (g.get(&w).unwrap() * f64::NAN)?;
                g.insert(&w, nan);
                Ok(g)
            })
            .unwrap();
        results.push(opt.step());
        opt.zero_grad();
    }
    for r in &results[..4] {
        assert!(r.as_ref().unwrap().is_skipped());
    }
    match &results[4] {
        Err(AmpError::PersistentOverflow {
            skips, params, scale, ..
        }) => {
            assert_eq!(*skips, 5);
            assert_eq!(params, "l1.weight");
            assert_eq!(*scale, 65536.0 / 32.0);
        }
        other => panic!("expected PersistentOverflow, got {other:?}"),
    }
    assert_eq!(store_values(amp.store()), before, "nothing was applied");
}

#[test]
fn a_nan_loss_skips_even_with_a_static_scale() {
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O0).unwrap();
    let before = store_values(amp.store());
    let loss = (one_step_loss(&model, 1) * f64::NAN).unwrap();
    let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
    assert!(report.found_inf);
    assert!(report.nonfinite.contains(&"<loss>".to_string()));
    assert!(opt.step().unwrap().is_skipped());
    assert_eq!(store_values(amp.store()), before);
    assert_eq!(amp.loss_scale(0).unwrap(), 1.0);
    assert_eq!(amp.scaler_states()[0].total_skips, 1);
}

#[test]
fn the_scaled_loss_is_f32_times_the_scale() {
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O3).unwrap();
    let loss = one_step_loss(&model, 4);
    let half_loss = loss.to_dtype(DType::F16).unwrap();
    let guard = amp.scale_loss(&half_loss, &mut opt).unwrap();
    assert_eq!(guard.loss().dtype(), DType::F32);
    assert_eq!(guard.loss_scale(), 1.0);
    drop(guard);
    let cfg = AmpConfig::new(OptLevel::O3).loss_scale(LossScaleSpec::Static(65536.0));
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), cfg).unwrap();
    let loss = one_step_loss(&model, 4).to_dtype(DType::F16).unwrap();
    let g = amp.scale_loss(&loss, &mut opt).unwrap();
    let v = g.loss().to_scalar::<f32>().unwrap();
    let expect = loss.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap() * 65536.0;
    assert!(v.is_finite() && v == expect, "an f16 loss x 65536 is finite in f32");
}

#[test]
fn same_seed_same_start_different_seed_different_start() {
    let init = |seed| {
        let (_, _, amp) =
            common::initialize(TwoLinear::new, sgd(0.1), AmpConfig::new(OptLevel::O0).seed(seed)).unwrap();
        store_values(amp.store())
    };
    assert_eq!(init(7), init(7));
    assert_ne!(init(7), init(8));
    // A half model starts from exactly the rounded f32 model.
    let (_, _, a0) = common::initialize(TwoLinear::new, sgd(0.1), AmpConfig::new(OptLevel::O0).seed(7)).unwrap();
    let (_, _, a2) = common::initialize(TwoLinear::new, sgd(0.1), AmpConfig::new(OptLevel::O2).seed(7)).unwrap();
    assert_eq!(store_values(a0.store()), store_values(a2.store()));
}

#[test]
fn the_store_builds_the_types_each_level_asks_for() {
    #[allow(dead_code)]
    struct Net {
        fc: candle_nn::Linear,
        bn: amp::nn::BatchNorm,
    }
    let build = |vb: candle_nn::VarBuilder<'static>| -> candle_core::Result<Net> {
        Ok(Net {
            fc: candle_nn::linear(4, 3, vb.pp("fc"))?,
            bn: amp::nn::batch_norm(3, 1e-5, vb.pp("bn"))?,
        })
    };
    let cases = [
        (OptLevel::O0, DType::F32, false, DType::F32),
        (OptLevel::O1, DType::F32, false, DType::F32),
        (OptLevel::O2, DType::F16, true, DType::F32),
        (OptLevel::O3, DType::F16, false, DType::F16),
    ];
    for (level, fc_dt, master, bn_dt) in cases {
        let amp = amp::Amp::new(level, &common::device()).unwrap();
        let _net = amp.model(build).unwrap();
        let s = amp.store();
        let fc = s.param("fc.weight").unwrap();
        assert_eq!(fc.working().dtype(), fc_dt, "{level}");
        assert_eq!(fc.master().is_some(), master, "{level}");
        assert_eq!(s.param("bn.weight").unwrap().working().dtype(), bn_dt, "{level}");
        assert!(s.param("bn.weight").unwrap().master().is_none());
        let rm = s.param("bn.running_mean").unwrap();
        assert_eq!(rm.kind(), amp::ParamKind::Buffer);
        assert_eq!(rm.working().dtype(), DType::F32);
        assert!(rm.master().is_none());
        assert!(!s.trainable_names().contains(&"bn.running_var".to_string()));
    }
    // bf16 models.
    let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2).half(HalfType::Bf16), &common::device()).unwrap();
    amp.model(build).unwrap();
    assert_eq!(amp.store().param("fc.weight").unwrap().working().dtype(), DType::BF16);
}

#[test]
fn get_unchecked_returns_the_live_parameter() {
    let amp = amp::Amp::new(OptLevel::O2, &common::device()).unwrap();
    let vb = amp.var_builder();
    let w = vb.get((2, 2), "w").unwrap();
    let again = vb.get_unchecked("w").unwrap();
    amp.store()
        .write_f32("w", &Tensor::ones((2, 2), DType::F32, &common::device()).unwrap())
        .unwrap();
    assert_eq!(flat(&w), vec![1.0; 4]);
    assert_eq!(flat(&again), vec![1.0; 4]);
    assert!(vb.get_unchecked("missing").is_err());
    assert!(vb.get((3, 2), "w").is_err(), "a shape clash is an error");
}

#[test]
fn batch_norm_matches_candle_nn_in_f32_and_trains_in_half() {
    let x = batches(1, 11).remove(0).0.reshape((4, 2, 4, 4)).unwrap();
    // O0: ours equals candle-nn's BatchNorm (train and eval).
    let amp0 = amp::Amp::new(OptLevel::O0, &common::device()).unwrap();
    let ours = amp::nn::batch_norm(2, 1e-5, amp0.var_builder().pp("bn")).unwrap();
    let vm = candle_nn::VarMap::new();
    let theirs = candle_nn::batch_norm(2, 1e-5, vb_of(&vm).pp("bn")).unwrap();
    for train in [true, true, false] {
        let a = flat(&ours.forward_t(&x, train).unwrap());
        let b = flat(&theirs.forward_t(&x, train).unwrap());
        let d = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "train={train}: {d}");
    }
    assert!(
        max_rel_diff(
            &[("m".to_string(), flat(ours.running_var()))].into(),
            &[("m".to_string(), flat(theirs.running_var()))].into(),
            1e-3
        ) < 1e-5
    );
    // O2 and O3: half input, gradients reach the weight, statistics stay f32.
    for level in [OptLevel::O2, OptLevel::O3] {
        let amp = amp::Amp::new(level, &common::device()).unwrap();
        let bn = amp.model(|vb| amp::nn::batch_norm(2, 1e-5, vb.pp("bn"))).unwrap();
        let mut opt = amp.optimizer(sgd(0.1)).unwrap();
        let y = bn.forward(&x).unwrap();
        assert_eq!(y.dtype(), DType::F32, "outputs are cast to f32");
        let loss = (y.sqr().unwrap()
            * (Tensor::arange(0f32, 128., &common::device()).unwrap() / 128.0)
                .unwrap()
                .reshape((4, 2, 4, 4))
                .unwrap())
        .unwrap()
        .mean_all()
        .unwrap();
        let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert!(!report.found_inf, "{level}: {report:?}");
        let g = opt
            .master_grads()
            .get("bn.weight")
            .expect("batch-norm weight gets a gradient");
        assert!(flat(g).iter().all(|v| v.is_finite() && *v != 0.0), "{level}");
        assert_eq!(bn.inner().running_mean().dtype(), DType::F32);
        // Eval uses the running statistics and does not change them.
        let rm = flat(bn.inner().running_mean());
        bn.eval();
        bn.forward(&x).unwrap();
        assert_eq!(flat(bn.inner().running_mean()), rm);
    }
}

#[test]
fn integer_inputs_are_never_cast() {
    let amp = amp::Amp::new(OptLevel::O2, &common::device()).unwrap();
    let emb = amp.model(|vb| candle_nn::embedding(10, 4, vb.pp("emb"))).unwrap();
    let ids = Tensor::new(&[1u32, 2, 3], &common::device()).unwrap();
    assert_eq!(emb.cast_input(&ids).unwrap().dtype(), DType::U32);
    let out = emb.forward(&ids).unwrap();
    assert_eq!(out.dtype(), DType::F32);
    assert_eq!(emb.cast_input(&out).unwrap().dtype(), DType::F16);
}

#[test]
fn groups_frozen_and_gradless_parameters() {
    let amp = amp::Amp::new(OptLevel::O2, &common::device()).unwrap();
    let model = amp.model(TwoLinear::new).unwrap();
    let _unused = amp.var_builder().get((3,), "unused.w").unwrap();
    let mut opt = amp
        .optimizer(amp::optim::AdamW::new(Default::default()).unwrap())
        .unwrap();
    let g = opt.add_param_group("frozen_lr", |n| n.starts_with("l2."), Some(0.0), Some(0.0));
    assert_eq!(opt.groups()[g].params, vec!["l2.weight", "l2.bias"]);
    assert_eq!(opt.lr(g).unwrap(), 0.0);
    assert_eq!(opt.lr(0).unwrap(), 1e-3);
    assert!(opt.lr(9).is_err());
    amp.store().set_frozen(|n| n == "l1.bias", true);
    let before = store_values(amp.store());
    let step = |opt: &mut amp::AmpOptimizer, seed| {
        amp.scale_loss(&one_step_loss(&model, seed), opt)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    };
    step(&mut opt, 1);
    let after = store_values(amp.store());
    assert_ne!(after["l1.weight"], before["l1.weight"]);
    assert_eq!(after["l1.bias"], before["l1.bias"], "frozen");
    assert_eq!(after["l2.weight"], before["l2.weight"], "lr 0 group");
    assert_eq!(after["unused.w"], before["unused.w"], "no gradient");
    let st = opt.state_dict().unwrap();
    assert!(!st.algorithm.params.contains_key("unused.w"));
    assert!(!st.algorithm.params.contains_key("l1.bias"));
    // Unfreeze and raise the group's learning rate after initialize.
    amp.store().set_frozen(|n| n == "l1.bias", false);
    opt.set_lr(g, 1e-2).unwrap();
    step(&mut opt, 2);
    let later = store_values(amp.store());
    assert_ne!(later["l1.bias"], after["l1.bias"]);
    assert_ne!(later["l2.weight"], after["l2.weight"]);
    assert_eq!(opt.state_dict().unwrap().algorithm.params["l1.bias"].step, 1);
    assert_eq!(opt.state_dict().unwrap().algorithm.params["l1.weight"].step, 2);
}

#[test]
fn the_candle_adapter_equals_our_sgd_at_o2_and_refuses_o3() {
    let data = batches(5, 12);
    let run = |algo: Box<dyn FnOnce(&amp::Amp) -> amp::AmpOptimizer>, level| {
        let amp = amp::Amp::new(level, &common::device()).unwrap();
        let model = amp.model(TwoLinear::new).unwrap();
        let mut opt = algo(&amp);
        for (x, y) in &data {
            let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            opt.step()?;
            opt.zero_grad();
        }
        Ok::<_, AmpError>(store_values(amp.store()))
    };
    let ours = run(Box::new(|a| a.optimizer(sgd(0.1)).unwrap()), OptLevel::O2).unwrap();
    let adapted = run(
        Box::new(|a| a.optimizer(CandleOptimizer::<candle_nn::SGD>::new(0.1, 0.1)).unwrap()),
        OptLevel::O2,
    )
    .unwrap();
    assert_values_close(&ours, &adapted, cross_tol(DType::F32), "our SGD against candle's");
    let e = run(
        Box::new(|a| a.optimizer(CandleOptimizer::<candle_nn::SGD>::new(0.1, 0.1)).unwrap()),
        OptLevel::O3,
    )
    .unwrap_err();
    assert!(matches!(e, AmpError::OptimizerState(_)), "{e}");
}

#[test]
fn disabled_amp_trains_like_plain_candle_and_does_not_skip() {
    let data = batches(3, 13);
    let cfg = AmpConfig::new(OptLevel::O2).enabled(false);
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), cfg).unwrap();
    assert_eq!(amp.store().param("l1.weight").unwrap().working().dtype(), DType::F32);
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let mut c = <candle_nn::SGD as candle_nn::Optimizer>::new(vm.all_vars(), 0.1).unwrap();
    for (x, y) in &data {
        let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        candle_nn::Optimizer::step(&mut c, &mse(&control, x, y).backward().unwrap()).unwrap();
    }
    assert_values_close(
        &store_values(amp.store()),
        &varmap_values(&vm),
        cross_tol(DType::F32),
        "disabled against plain candle",
    );
    let loss = (one_step_loss(&model, 1) * f64::NAN).unwrap();
    assert!(!amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap().found_inf);
    assert!(
        !opt.step().unwrap().is_skipped(),
        "disabled: no checks, like plain candle"
    );
}

#[test]
fn unmodified_candle_layers_train_at_every_level() {
    // conv2d (f16 at O2/O3), embedding and activations from candle-nn, unchanged.
    struct Net {
        emb: candle_nn::Embedding,
        conv: candle_nn::Conv2d,
        fc: candle_nn::Linear,
    }
    let x_ids = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 0]], &common::device()).unwrap();
    for level in OptLevel::ALL {
        let amp = amp::Amp::new(level, &common::device()).unwrap();
        let net = amp
            .model(|vb| {
                Ok(Net {
                    emb: candle_nn::embedding(8, 16, vb.pp("emb"))?,
                    conv: candle_nn::conv2d(1, 2, 3, Default::default(), vb.pp("conv"))?,
                    fc: candle_nn::linear(2 * 4 * 2, 1, vb.pp("fc"))?,
                })
            })
            .unwrap();
        let mut opt = amp
            .optimizer(amp::optim::AdamW::new(Default::default()).unwrap())
            .unwrap();
        let mut losses = Vec::new();
        let mut clean = 0;
        for _ in 0..10 {
            let n = net.inner();
            let h = candle_nn::Module::forward(&n.emb, &x_ids).unwrap(); // (2, 4, 16)
            let h = h.reshape((2, 1, 4, 16)).unwrap();
            let h = candle_nn::Module::forward(&n.conv, &h).unwrap().gelu().unwrap(); // (2, 2, 2, 14)
            let h = h.narrow(3, 0, 4).unwrap().flatten_from(1).unwrap();
            let out = candle_nn::Module::forward(&n.fc, &h).unwrap();
            let out = net.cast_output(&out).unwrap();
            let loss = (out - 1.0).unwrap().sqr().unwrap().mean_all().unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            // Every parameter got a finite, non-zero f32 master gradient.
            let names: Vec<&String> = opt.master_grads().keys().collect();
            assert_eq!(
                names,
                ["conv.bias", "conv.weight", "emb.weight", "fc.bias", "fc.weight"],
                "{level}"
            );
            for (n, g) in opt.master_grads() {
                let v = flat(g);
                assert_eq!(g.dtype(), DType::F32, "{level} {n}");
                let finite = v.iter().all(|x| x.is_finite());
                assert_eq!(finite, !report.nonfinite.contains(n), "{level} {n}: {report:?}");
                assert!(!finite || v.iter().any(|x| *x != 0.0), "{level} {n}");
            }
            clean += !report.found_inf as usize;
            // candle_nn layers do not autocast: O1 says so in its first report, once.
            if level == OptLevel::O1 {
                assert_eq!(report.autocast_ops, Some(0));
                assert_eq!(
                    report.warnings.len(),
                    (losses.len() == 1) as usize,
                    "{:?}",
                    report.warnings
                );
                if let Some(w) = report.warnings.first() {
                    assert!(w.contains("candle_amp::nn"), "{w}");
                }
            } else {
                assert!(report.warnings.is_empty() && report.autocast_ops.is_none());
            }
            opt.step().unwrap();
            opt.zero_grad();
        }
        assert!(losses[9] < losses[0], "{level}: {losses:?}");
        assert!(clean >= 5, "{level}: {clean} clean steps of 10");
    }
}

#[test]
fn foreign_optimizers_bad_clip_norms_and_dropped_optimizers() {
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O2).unwrap();
    let (_, mut other_opt, _other) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O2).unwrap();
    let e = amp.scale_loss(&one_step_loss(&model, 1), &mut other_opt).unwrap_err();
    assert!(
        matches!(e, AmpError::CallOrder { .. }) && e.to_string().contains("another AMP handle"),
        "{e}"
    );
    amp.scale_loss(&one_step_loss(&model, 1), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(opt.clip_grad_norm(bad), Err(AmpError::InvalidArgument { .. })),
            "{bad}"
        );
    }
    assert!(matches!(opt.set_lr(0, f64::NAN), Err(AmpError::Group { group: 0, .. })));
    assert!(matches!(opt.set_lr(0, -1.0), Err(AmpError::Group { .. })));
    assert!(matches!(opt.set_lr(7, 0.1), Err(AmpError::Group { group: 7, .. })));
    // Huge but finite gradients: the norm is computed in f64 and clipping still works.
    let grads: Vec<String> = opt.master_grads().keys().cloned().collect();
    let big = opt.master_grads()[&grads[0]].affine(0.0, 1e20).unwrap();
    let (_, mut o3, a3) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O0).unwrap();
    let w = a3.store().param(&grads[0]).unwrap().working().clone();
    let loss = (&w * &big).unwrap().sum_all().unwrap();
    a3.scale_loss(&loss, &mut o3).unwrap().backward().unwrap();
    let n = o3.clip_grad_norm(1.0).unwrap();
    assert!(n.is_finite() && n > 1e20, "{n}");
    let clipped: f64 = flat(o3.master_grads().get(&grads[0]).unwrap())
        .iter()
        .map(|v| (*v as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!((clipped - 1.0).abs() < 1e-3, "{clipped}");

    // An optimizer dropped with pending gradients does not hold the scaler's round open.
    let amp = amp::Amp::new(OptLevel::O2, &common::device()).unwrap();
    let m = amp.model(TwoLinear::new).unwrap();
    let mut o1 = amp.optimizer_for(sgd(0.1), |n| n.starts_with("l1.")).unwrap();
    let mut o2 = amp.optimizer_for(sgd(0.1), |n| n.starts_with("l2.")).unwrap();
    let loss = (one_step_loss(&m, 2) * f64::INFINITY).unwrap();
    amp.scale_loss_multi(&loss, 0, vec![&mut o1, &mut o2])
        .unwrap()
        .backward()
        .unwrap();
    drop(o2);
    assert!(o1.step().unwrap().is_skipped());
    assert_eq!(
        amp.loss_scale(0).unwrap(),
        32768.0,
        "the round closed without the dropped optimizer"
    );
}
