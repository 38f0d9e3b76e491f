//! Gradients that round to zero in half precision, and two losses diagnosed apart.

use candle_amp::doctor::{Action, Doctor, DoctorConfig, Problem, TensorKind};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, nn as ann, ops};
use candle_core::{DType, Device, Tensor};
use candle_nn::Module;

/// A linear layer through `ops::linear`, whose parameter gradients candle computes and rounds
/// to the parameter's type (`nn::Linear` in a run keeps them in f32, outside candle's graph,
/// so nothing of it rounds to zero or overflows in half: these tests need a gradient that does).
struct Rounded(ann::Linear);

impl Module for Rounded {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ops::linear(x, self.0.weight(), self.0.bias())
    }
}

/// `fc(x)` plus `dead(x)` times 0: `dead`'s gradient is a true zero.
struct Tiny {
    fc: Rounded,
    dead: Rounded,
}

impl Module for Tiny {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let d = self.dead.forward(x)?;
        self.fc.forward(x)? + (d.zeros_like()? * d)?
    }
}

/// One step of the tiny model on inputs of 1e-5 with dL/dy = 1e-4: `fc.weight`'s gradient
/// is 1e-4 * 1e-5 = 1e-9 in f32, an exact 0 in f16 at scale 1 (its bias's is 1e-4).
fn tiny_step(model: &amp::AmpModel<Tiny>, opt: &mut amp::AmpOptimizer, amp: &amp::Amp) {
    let x = Tensor::full(1e-5f32, (1, 4), &Device::Cpu).unwrap();
    let y = model.forward(&x).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap().sum_all().unwrap() * 1e-4).unwrap();
    amp.scale_loss(&loss, opt).unwrap().backward().unwrap();
}

#[test]
fn a_gradient_that_rounds_to_zero_in_f16_is_underflow_and_gets_a_loss_scale() {
    let (model, mut opt, amp) = amp::initialize(
        |vb| {
            Ok(Tiny {
                fc: Rounded(ann::linear(4, 1, vb.pp("fc"))?),
                dead: Rounded(ann::linear(4, 1, vb.pp("dead"))?),
            })
        },
        amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(OptLevel::O3).half(HalfType::F16).verbosity(0).seed(1),
    )
    .unwrap();
    assert!(!amp.scaler_states()[0].scale.is_dynamic(), "O3: static 1");
    let doc = Doctor::attach(
        &amp,
        DoctorConfig {
            every: 1,
            ..Default::default()
        },
    )
    .unwrap();
    for _ in 0..2 {
        tiny_step(&model, &mut opt, &amp);
        // Rounded to 0 in f16: the optimizer sees nothing.
        let g = opt.master_grads()["fc.weight"]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(g, vec![0.0; 4]);
        opt.step().unwrap();
        opt.zero_grad();
    }
    let report = doc.report();
    let row = |name: &str, kind: TensorKind| {
        report
            .tensors
            .iter()
            .find(|t| t.name == name && t.kind == kind)
            .unwrap()
    };
    for kind in [TensorKind::Grad, TensorKind::MasterGrad] {
        let w = row("fc.weight", kind);
        // Every element is 0 in the tensor, and every one of them underflowed.
        assert_eq!(
            (w.zero_frac, w.underflow_f16, w.underflow_bf16),
            (1.0, 1.0, 0.0),
            "{w:?}"
        );
        // A true zero is a zero, not underflow.
        let d = row("dead.weight", kind);
        assert_eq!((d.zero_frac, d.underflow_f16), (1.0, 0.0), "{d:?}");
        let b = row("fc.bias", kind);
        assert_eq!((b.zero_frac, b.underflow_f16), (0.0, 0.0), "{b:?}");
    }
    let zero: Vec<_> = report
        .recommendations
        .iter()
        .filter(|r| r.problem == Problem::GradientUnderflow && r.target != "loss_scale")
        .collect();
    assert_eq!(zero.len(), 1, "{report}");
    let r = zero[0];
    assert_eq!(r.target, "fc.weight", "{report}");
    let Action::LossScale {
        loss_id,
        init,
        min,
        max,
    } = r.action
    else {
        panic!("{r:?}")
    };
    // 1e-9 reaches f16's smallest normal (6.1e-5) from 2^16 on; the bias (1e-4) leaves room
    // up to the cap 2^24.
    assert_eq!(
        (loss_id, min, max, init),
        (0, 65536.0, 16_777_216.0, 16_777_216.0),
        "{r}"
    );
    assert!(
        r.reason.contains("1.00e-9") && r.reason.contains("static scale 1"),
        "{r}"
    );
    // Applied: the scaler is dynamic within that range, and the gradient survives.
    doc.apply(&amp).unwrap();
    assert!(amp.scaler_states()[0].scale.is_dynamic());
    assert_eq!(amp.loss_scale(0).unwrap(), 16_777_216.0);
    tiny_step(&model, &mut opt, &amp);
    let g = opt.master_grads()["fc.weight"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    // f16's 1e-5 and 1e-4 are 1.0014e-5 and 1.0002e-4.
    for v in g {
        assert!((v as f64 / 1.0016e-9 - 1.0).abs() < 2e-3, "{v}");
    }
}

/// A linear fit: targets of 10 make its gradient reach a few units (its f16 raw gradient
/// overflows at 65536); targets of 0 keep it small.
fn fit_loss(model: &amp::AmpModel<Rounded>, x: &Tensor, target: f32) -> Tensor {
    let t = Tensor::full(target, (16, 4), &Device::Cpu).unwrap();
    ops::mse(&model.forward(x).unwrap(), &t).unwrap()
}

/// Two losses, one scaler each: `a` (healthy) on loss 0, `b` (overflowing) on loss 1.
fn two_loss_run() -> (amp::Amp, [amp::AmpModel<Rounded>; 2], [amp::AmpOptimizer; 2]) {
    let cfg = AmpConfig::new(OptLevel::O2)
        .half(HalfType::F16)
        .verbosity(0)
        .seed(5)
        .num_losses(2);
    let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let a = amp.model(|vb| Ok(Rounded(ann::linear(8, 4, vb.pp("a"))?))).unwrap();
    let b = amp.model(|vb| Ok(Rounded(ann::linear(8, 4, vb.pp("b"))?))).unwrap();
    let adam = || amp::optim::AdamW::new(Default::default()).unwrap();
    let oa = amp.optimizer_for(adam(), |n| n.starts_with("a.")).unwrap();
    let ob = amp.optimizer_for(adam(), |n| n.starts_with("b.")).unwrap();
    (amp, [a, b], [oa, ob])
}

fn two_loss_steps(
    amp: &amp::Amp,
    models: &[amp::AmpModel<Rounded>; 2],
    opts: &mut [amp::AmpOptimizer; 2],
    steps: usize,
) -> [u64; 2] {
    let x = super::seeded_inputs((16, 8), 1);
    let xa = (&x * 0.25).unwrap();
    for _ in 0..steps {
        let [oa, ob] = opts;
        // Loss 0 sees a quarter of the inputs, so its f16 weight gradient at 65536 is a
        // sixteenth of what it would be: at full inputs some draws overflowed it (4 in 60
        // seeds), at a quarter none of 100 came near.
        let la = fit_loss(&models[0], &xa, 0.0);
        let lb = fit_loss(&models[1], &x, 10.0);
        amp.scale_loss_id(&la, 0, oa).unwrap().backward().unwrap();
        amp.scale_loss_id(&lb, 1, ob).unwrap().backward().unwrap();
        for o in opts.iter_mut() {
            o.step().unwrap();
            o.zero_grad();
        }
    }
    [opts[0].skipped_steps(), opts[1].skipped_steps()]
}

#[test]
fn with_two_losses_only_the_overflowing_loss_scaler_is_named_and_retuned() {
    let (amp, models, mut opts) = two_loss_run();
    let doc = Doctor::attach(
        &amp,
        DoctorConfig {
            every: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let skipped = two_loss_steps(&amp, &models, &mut opts, 20);
    assert_eq!(skipped[0], 0);
    assert!(skipped[1] >= 3, "loss 1 overflows at 65536: {skipped:?}");
    let report = doc.report();
    let scale_recs: Vec<_> = report
        .recommendations
        .iter()
        .filter_map(|r| match r.action {
            Action::LossScale { loss_id, init, .. } => Some((r, loss_id, init)),
            _ => None,
        })
        .collect();
    assert!(
        scale_recs
            .iter()
            .any(|(r, _, _)| r.target == "b.weight" && r.problem == Problem::GradientOverflow),
        "{report}"
    );
    for (r, loss_id, _) in &scale_recs {
        assert_eq!(*loss_id, 1, "{r}");
        assert!(r.target.starts_with("b."), "{r}");
    }
    // Loss 1's gradients are its own rows.
    let b = report
        .tensors
        .iter()
        .find(|t| t.name == "b.weight" && t.kind == TensorKind::Grad)
        .unwrap();
    assert!(b.loss_id == 1 && b.nonfinite > 0, "{b:?}");
    let a = report
        .tensors
        .iter()
        .find(|t| t.name == "a.weight" && t.kind == TensorKind::Grad)
        .unwrap();
    assert!(a.loss_id == 0 && a.nonfinite == 0, "{a:?}");
    // Applied to a fresh run: loss 1's scaler is retuned, loss 0's keeps its 65536.
    let (amp2, models2, mut opts2) = two_loss_run();
    let applied = doc.apply(&amp2).unwrap();
    assert!(!applied.applied.is_empty());
    assert_eq!(amp2.loss_scale(0).unwrap(), 65536.0);
    assert_eq!(amp2.loss_scale(1).unwrap(), scale_recs[0].2);
    assert!(scale_recs[0].2 < 65536.0);
    assert_eq!(two_loss_steps(&amp2, &models2, &mut opts2, 10), [0, 0]);
}

/// A bf16 layer large enough for the tier's bf16 product (more than 4096 multiply-adds)
/// whose inputs are bf16 subnormals (1e-39).
struct Wide {
    fc: Rounded,
}

impl Module for Wide {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc.forward(x)
    }
}

#[test]
fn a_bf16_gradient_lost_to_a_flushing_product_is_named_on_that_tier() {
    let (model, mut opt, amp) = amp::initialize(
        |vb| {
            Ok(Wide {
                fc: Rounded(ann::linear_no_bias(64, 64, vb.pp("fc"))?),
            })
        },
        amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(OptLevel::O3).half(HalfType::Bf16).verbosity(0).seed(2),
    )
    .unwrap();
    let doc = Doctor::attach(
        &amp,
        DoctorConfig {
            every: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let x = Tensor::full(1e-39f32, (2, 64), &Device::Cpu).unwrap();
    let y = model.forward(&x).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap().sum_all().unwrap() * 1e-4).unwrap();
    amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
    // The true gradient, 2 * 1e-4 * 1e-39, is below bf16's smallest subnormal: 0 in bf16.
    let g = opt.master_grads()["fc.weight"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(g.iter().all(|v| *v == 0.0));
    let report = doc.report();
    let r = report
        .recommendations
        .iter()
        .find(|r| r.target == "fc.weight" && r.problem == Problem::GradientUnderflow)
        .unwrap_or_else(|| panic!("{report}"));
    // AMX and AVX-512 BF16 products treat the subnormal inputs as 0 (the f32 accumulation
    // is 0 too, which proves nothing there); other tiers keep them, and the f32 value shows.
    let flushes = candle_amp::kernels::isa() >= candle_amp::kernels::Isa::Avx512Bf16;
    if flushes {
        assert!(r.reason.contains("flush") && r.reason.contains("1.18e-38"), "{r}");
    } else {
        // 2^16 brings 2.02e-43 (f32's rounding of 2 * 1e-4 * 1e-39 in bf16) to 2^-126.
        assert!(
            r.reason.contains("reached 2.02e-43") && r.reason.contains("at least 65536"),
            "{r}"
        );
    }
}
