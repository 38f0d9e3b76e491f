//! The training path against plain-candle f32 controls: skipped steps, clipping,
//! accumulation, several losses and optimizers, O2 masters, and loss decrease per level.
//!
//! On `common::device()`. Against the plain-candle controls the CPU is bit-exact (or within
//! the stated f32 bound); other devices' kernels round apart, within f32 tolerance.

mod common;

use candle_amp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, DynamicParams, HalfType, LossScaleSpec, OptLevel, StepOutcome};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use candle_nn::Optimizer as _;
use common::*;

/// O0 with a dynamic scaler from `init` growing every `interval` steps, PyTorch's bounds.
fn o0_dynamic(init: f32, interval: u32) -> AmpConfig {
    AmpConfig::new(OptLevel::O0)
        .loss_scale(LossScaleSpec::Dynamic)
        .dynamic(DynamicParams {
            init_scale: init,
            growth_interval: interval,
            ..Default::default()
        })
        .min_loss_scale(0.0)
        .max_loss_scale(f32::INFINITY)
}

fn sgd(lr: f64) -> Sgd {
    Sgd::new(SgdConfig::new(lr)).unwrap()
}

/// A backward driver that multiplies one parameter's gradient by inf.
fn inject_inf(amp: &amp::Amp, name: &str) -> impl FnOnce(&Tensor) -> candle_core::Result<GradStore> {
    let w = amp.store().param(name).unwrap().working().clone();
    move |scaled: &Tensor| {
        let mut g = scaled.backward()?;
        let bad = (g.get(&w).unwrap() * f64::INFINITY)?;
        g.insert(&w, bad);
        Ok(g)
    }
}

#[test]
fn inf_at_step_k_skips_exactly_that_step_and_matches_a_control() {
    let data = batches(4, 1);
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), o0_dynamic(128.0, 1)).unwrap();
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let mut csgd = candle_nn::SGD::new(vm.all_vars(), 0.1).unwrap();

    for (i, (x, y)) in data.iter().enumerate() {
        let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
        let guard = amp.scale_loss(&loss, &mut opt).unwrap();
        let before = working_bits(amp.store());
        let report = if i == 2 {
            guard.backward_with(inject_inf(&amp, "l2.weight")).unwrap()
        } else {
            guard.backward().unwrap()
        };
        assert_eq!(report.found_inf, i == 2);
        let out = opt.step().unwrap();
        assert_eq!(out.is_skipped(), i == 2, "step {i}");
        if i == 2 {
            assert_eq!(
                working_bits(amp.store()),
                before,
                "a skipped step must not touch the weights"
            );
            match out {
                StepOutcome::Skipped { nonfinite, .. } => assert_eq!(nonfinite, vec!["l2.weight".to_string()]),
                _ => unreachable!(),
            }
        }
        opt.zero_grad();
        // The control skips the same step.
        let closs = mse(&control, x, y);
        let g = closs.backward().unwrap();
        if i != 2 {
            csgd.step(&g).unwrap();
        }
    }
    // PyTorch's harness: init 128, interval 1, inf at iteration 2 -> 128 * 2^3 * 0.5.
    assert_eq!(amp.loss_scale(0).unwrap(), 128.0 * 8.0 * 0.5);
    assert_eq!(opt.skipped_steps(), 1);
    assert_eq!(opt.steps(), 3);
    // Power-of-two scaling is exact, so the weights are bit-identical to the control's.
    assert_values_close(
        &store_values(amp.store()),
        &varmap_values(&vm),
        cross_tol(DType::F32),
        "against the control",
    );
}

#[test]
fn o2_skipped_step_leaves_working_and_master_weights_bit_identical() {
    let data = batches(2, 2);
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O2).unwrap();
    let (x, y) = &data[0];
    let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
    let masters = store_values(amp.store());
    let working = working_bits(amp.store());
    amp.scale_loss(&loss, &mut opt)
        .unwrap()
        .backward_with(inject_inf(&amp, "l1.bias"))
        .unwrap();
    let out = opt.step().unwrap();
    assert_eq!(
        out,
        StepOutcome::Skipped {
            loss_scale: 32768.0,
            nonfinite: vec!["l1.bias".into()]
        }
    );
    assert_eq!(store_values(amp.store()), masters);
    assert_eq!(working_bits(amp.store()), working);
    opt.zero_grad();
    // The next clean step does update.
    let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
    amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
    assert!(!opt.step().unwrap().is_skipped());
    assert_ne!(store_values(amp.store()), masters);
}

#[test]
fn clipping_after_unscale_equals_the_control() {
    let data = batches(5, 3);
    let max_norm = 0.05;
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.5), o0_dynamic(65536.0, 2000)).unwrap();
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let vars: Vec<(String, candle_core::Var)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (x, y) in &data {
        let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        let norm = opt.clip_grad_norm(max_norm).unwrap();
        opt.step().unwrap();
        opt.zero_grad();

        let g = mse(&control, x, y).backward().unwrap();
        let total: f64 = vars
            .iter()
            .map(|(_, v)| {
                g.get(v)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            })
            .sum::<f64>()
            .sqrt();
        let bound = cpu_or_tol(1e-6, DType::F32) as f64;
        assert!(((norm as f64) - total).abs() <= bound * total, "{norm} vs {total}");
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        assert!(coef < 1.0, "the test must actually clip");
        for (_, v) in &vars {
            let gi = (g.get(v).unwrap() * coef).unwrap();
            v.set(&(v.as_tensor() - (gi * 0.5).unwrap()).unwrap()).unwrap();
        }
    }
    let d = max_rel_diff(&store_values(amp.store()), &varmap_values(&vm), 1e-3);
    assert!(d < cpu_or_tol(1e-6, DType::F32), "relative difference {d}");
}

#[test]
fn accumulation_over_two_micro_batches_equals_the_control_and_adjusts_once_per_step() {
    let data = batches(6, 4);
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.2), o0_dynamic(128.0, 1)).unwrap();
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let mut csgd = candle_nn::SGD::new(vm.all_vars(), 0.2).unwrap();
    for pair in data.chunks(2) {
        for (x, y) in pair {
            let loss = (candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap() / 2.0).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        }
        assert_eq!(opt.micro_batches(), 2);
        opt.step().unwrap();
        opt.zero_grad();

        let mut acc: Option<GradStore> = None;
        for (x, y) in pair {
            let g = (mse(&control, x, y) / 2.0).unwrap().backward().unwrap();
            acc = Some(match acc {
                None => g,
                Some(mut a) => {
                    for v in vm.all_vars() {
                        let s = (a.get(&v).unwrap() + g.get(&v).unwrap()).unwrap();
                        a.insert(&v, s);
                    }
                    a
                }
            });
        }
        csgd.step(&acc.unwrap()).unwrap();
    }
    // Three optimizer steps with interval 1: the scale grew three times, not six.
    assert_eq!(amp.loss_scale(0).unwrap(), 128.0 * 8.0);
    assert_values_close(
        &store_values(amp.store()),
        &varmap_values(&vm),
        cross_tol(DType::F32),
        "against the control",
    );
}

#[test]
fn an_overflow_in_one_micro_batch_skips_the_whole_accumulated_step() {
    let data = batches(2, 5);
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.2), o0_dynamic(128.0, 1)).unwrap();
    let before = store_values(amp.store());
    for (i, (x, y)) in data.iter().enumerate() {
        let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
        let g = amp.scale_loss(&loss, &mut opt).unwrap();
        if i == 0 {
            g.backward_with(inject_inf(&amp, "l1.weight")).unwrap();
        } else {
            g.backward().unwrap();
        }
    }
    assert!(opt.found_inf());
    assert!(opt.step().unwrap().is_skipped());
    assert_eq!(store_values(amp.store()), before);
    assert_eq!(amp.loss_scale(0).unwrap(), 64.0, "one backoff for one step");
}

#[test]
fn two_losses_two_scalers_two_optimizers_skip_only_what_overflowed() {
    let cfg = AmpConfig::new(OptLevel::O2).num_losses(2);
    let amp = amp::Amp::new(cfg, &common::device()).unwrap();
    let a = amp.model(|vb| TwoLinear::new(vb.pp("a"))).unwrap();
    let b = amp.model(|vb| TwoLinear::new(vb.pp("b"))).unwrap();
    let mut opt_a = amp.optimizer_for(sgd(0.1), |n| n.starts_with("a.")).unwrap();
    let mut opt_b = amp.optimizer_for(sgd(0.1), |n| n.starts_with("b.")).unwrap();
    assert!(opt_a.param_names().iter().all(|n| n.starts_with("a.")));
    assert_eq!(opt_a.param_names().len(), 4);
    let data = batches(4, 6);
    let mut skipped = (Vec::new(), Vec::new());
    for (i, (x, y)) in data.iter().enumerate() {
        let la = candle_nn::loss::mse(&a.forward(x).unwrap(), y).unwrap();
        let lb = candle_nn::loss::mse(&b.forward(x).unwrap(), y).unwrap();
        amp.scale_loss_id(&la, 0, &mut opt_a).unwrap().backward().unwrap();
        let gb = amp.scale_loss_id(&lb, 1, &mut opt_b).unwrap();
        if i == 1 {
            gb.backward_with(inject_inf(&amp, "b.l2.bias")).unwrap();
        } else {
            gb.backward().unwrap();
        }
        skipped.0.push(opt_a.step().unwrap().is_skipped());
        skipped.1.push(opt_b.step().unwrap().is_skipped());
        opt_a.zero_grad();
        opt_b.zero_grad();
    }
    assert_eq!(skipped.0, vec![false; 4]);
    assert_eq!(skipped.1, vec![false, true, false, false]);
    assert_eq!(amp.loss_scale(0).unwrap(), 65536.0);
    assert_eq!(amp.loss_scale(1).unwrap(), 32768.0);
    let st = amp.scaler_states();
    assert_eq!((st[0].total_skips, st[1].total_skips), (0, 1));
    assert!(matches!(
        amp.loss_scale(2),
        Err(AmpError::LossId { id: 2, num_losses: 2 })
    ));
}

#[test]
fn several_optimizers_in_one_block_all_skip_on_overflow() {
    let amp = amp::Amp::new(OptLevel::O2, &common::device()).unwrap();
    let m = amp.model(TwoLinear::new).unwrap();
    let mut o1 = amp.optimizer_for(sgd(0.1), |n| n.starts_with("l1.")).unwrap();
    let mut o2 = amp.optimizer_for(sgd(0.1), |n| n.starts_with("l2.")).unwrap();
    let (x, y) = &batches(1, 7)[0];
    let loss = candle_nn::loss::mse(&m.forward(x).unwrap(), y).unwrap();
    amp.scale_loss_multi(&loss, 0, vec![&mut o1, &mut o2])
        .unwrap()
        .backward_with(inject_inf(&amp, "l2.weight"))
        .unwrap();
    assert!(o1.step().unwrap().is_skipped());
    // The scale adjusts once, when the last optimizer of the block reports.
    assert_eq!(amp.loss_scale(0).unwrap(), 65536.0);
    assert!(o2.step().unwrap().is_skipped());
    assert_eq!(amp.loss_scale(0).unwrap(), 32768.0);
}

#[test]
fn o2_masters_track_an_f32_reference() {
    for half in [HalfType::F16, HalfType::Bf16] {
        let data = batches(20, 8);
        let run = |cfg: AmpConfig| {
            let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.05), cfg).unwrap();
            for (x, y) in &data {
                let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
                amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
                assert!(!opt.step().unwrap().is_skipped());
                opt.zero_grad();
            }
            let p = amp.store().param("l1.weight").unwrap();
            (
                store_values(amp.store()),
                p.working().dtype(),
                p.master().map(|m| m.dtype()),
            )
        };
        let (o0, _, _) = run(AmpConfig::new(OptLevel::O0));
        let (o2, wdt, mdt) = run(AmpConfig::new(OptLevel::O2).half(half));
        assert_eq!(wdt, half.dtype());
        assert_eq!(mdt, Some(DType::F32));
        let tol = if half == HalfType::F16 { 5e-3 } else { 3e-2 };
        let d = max_rel_diff(&o2, &o0, 0.1);
        assert!(d < tol, "{half}: masters differ from f32 by {d}");
        assert!(d > 0.0, "half arithmetic must differ a little from f32");
    }
}

#[test]
fn our_sgd_and_adamw_equal_candle_nn_on_f32() {
    let data = batches(10, 9);
    // SGD.
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), OptLevel::O0).unwrap();
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let mut c = candle_nn::SGD::new(vm.all_vars(), 0.1).unwrap();
    for (x, y) in &data {
        let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        c.step(&mse(&control, x, y).backward().unwrap()).unwrap();
    }
    let d = max_rel_diff(&store_values(amp.store()), &varmap_values(&vm), 1e-6);
    assert!(d <= cpu_or_tol(1e-6, DType::F32), "SGD differs from candle-nn's by {d}");
    // AdamW.
    let cfg = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.05,
        ..Default::default()
    };
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, AdamW::new(cfg).unwrap(), OptLevel::O0).unwrap();
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let mut c = candle_nn::AdamW::new(
        vm.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 0.01,
            weight_decay: 0.05,
            ..Default::default()
        },
    )
    .unwrap();
    for (x, y) in &data {
        let loss = candle_nn::loss::mse(&model.forward(x).unwrap(), y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        c.step(&mse(&control, x, y).backward().unwrap()).unwrap();
    }
    let d = max_rel_diff(&store_values(amp.store()), &varmap_values(&vm), 1e-6);
    assert!(
        d <= cpu_or_tol(1e-6, DType::F32),
        "AdamW differs from candle-nn's by {d}"
    );
}

#[test]
fn sgd_momentum_and_nesterov_follow_pytorch() {
    // One parameter, gradient g = p (loss = p^2/2), by hand; the fused and tensor paths.
    for (nesterov, fused) in [(false, true), (true, true), (false, false), (true, false)] {
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.1,
            nesterov,
            fused,
        };
        let (model, mut opt, amp) = common::initialize(
            |vb| vb.get_with_hints(1, "p", candle_nn::Init::Const(1.0)),
            Sgd::new(cfg).unwrap(),
            OptLevel::O0,
        )
        .unwrap();
        let (mut p, mut buf) = (1.0f64, None::<f64>);
        for _ in 0..3 {
            let loss = (model.inner().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            let d = p + 0.1 * p;
            let b = match buf {
                None => d,
                Some(b) => 0.9 * b + d,
            };
            buf = Some(b);
            let step = if nesterov { d + 0.9 * b } else { b };
            p -= 0.1 * step;
        }
        let got = flat(model.inner())[0] as f64;
        assert!(
            (got - p).abs() < 1e-6,
            "nesterov={nesterov} fused={fused}: {got} vs {p}"
        );
    }
}

#[test]
fn loss_decreases_at_every_level_and_half_type() {
    let (x, y) = batches(1, 10).remove(0);
    for half in [HalfType::F16, HalfType::Bf16] {
        for level in OptLevel::ALL {
            let cfg = AmpConfig::new(level).half(half);
            let opt = AdamW::new(AdamWConfig {
                lr: 1e-2,
                ..Default::default()
            })
            .unwrap();
            // Built from candle_amp::nn, so that the O1 row really autocasts.
            let (model, mut opt, amp) = common::initialize(AmpTwoLinear::new, opt, cfg).unwrap();
            let mut losses = Vec::new();
            for _ in 0..40 {
                let out = model.forward(&x).unwrap();
                // O1 casts per op and leaves outputs as the last op made them (Apex).
                let expect = if level == OptLevel::O1 {
                    half.dtype()
                } else {
                    DType::F32
                };
                assert_eq!(out.dtype(), expect, "{level} {half}: output type");
                let loss = amp::ops::mse(&out, &y).unwrap();
                losses.push(loss.to_scalar::<f32>().unwrap());
                let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
                let expect = (level == OptLevel::O1).then_some(2);
                assert_eq!(report.autocast_ops, expect, "{level}: both linear layers ran in half");
                opt.step().unwrap();
                opt.zero_grad();
            }
            let (first, last) = (losses[0], *losses.last().unwrap());
            assert!(
                last.is_finite() && last < 0.7 * first,
                "{level} {half}: {first} -> {last}"
            );
        }
    }
}

#[test]
fn o3_adamw_with_zero_gradients_stays_finite() {
    // A parameter with a zero gradient: in f16 arithmetic eps = 1e-8 underflows and 0/0 is NaN.
    let (model, mut opt, amp) = common::initialize(
        |vb| {
            let used = vb.get_with_hints(4, "used", candle_nn::Init::Const(1.0))?;
            let idle = vb.get_with_hints(4, "idle", candle_nn::Init::Const(1.0))?;
            Ok((used, idle))
        },
        AdamW::new(Default::default()).unwrap(),
        OptLevel::O3,
    )
    .unwrap();
    for _ in 0..3 {
        let (used, idle) = model.inner();
        let loss = ((used.sqr().unwrap().sum_all().unwrap() + (idle * 0.0).unwrap().sum_all().unwrap()).unwrap())
            .to_dtype(DType::F32)
            .unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert!(!opt.step().unwrap().is_skipped());
        opt.zero_grad();
    }
    let (used, idle) = model.inner();
    assert_eq!(used.dtype(), DType::F16);
    assert!(flat(used).iter().all(|v| v.is_finite() && *v < 1.0));
    assert!(flat(idle).iter().all(|v| v.is_finite()));
}
