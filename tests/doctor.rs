//! The numerics doctor: statistics against an f64 reference, planted problems named exactly
//! and fixed by `apply`, a gradient overflowing at the initial scale, the automatic fallback
//! and its checkpoint.

use candle_amp::doctor::{self, Action, Doctor, DoctorConfig, Problem, Severity, TensorKind, TensorStats};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, nn as ann, ops};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, Module, VarBuilder};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ------------------------------------------------------------------ statistics

/// The statistics computed in f64 from the tensor's values (as f32, which holds f16 and
/// bf16 exactly), field by field.
fn reference(t: &Tensor, scale: f64) -> TensorStats {
    let v: Vec<f32> = t
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let n = v.len().max(1) as f64;
    let finite: Vec<f64> = v.iter().filter(|x| x.is_finite()).map(|x| x.abs() as f64).collect();
    let nz: Vec<f64> = finite.iter().copied().filter(|a| *a != 0.0).collect();
    let amax = finite.iter().copied().fold(0.0, f64::max);
    let amin = nz.iter().copied().fold(f64::INFINITY, f64::min);
    let amin = if amin.is_finite() { amin } else { 0.0 };
    let count = |f: &dyn Fn(f64) -> bool| nz.iter().filter(|a| f(**a)).count() as f64 / n;
    let inf = v.iter().filter(|x| x.is_infinite()).count();
    TensorStats {
        dtype: t.dtype().as_str().to_string(),
        elements: v.len() as u64,
        amax,
        amin_nonzero: amin,
        mean_abs: if finite.is_empty() {
            0.0
        } else {
            finite.iter().sum::<f64>() / finite.len() as f64
        },
        zero_frac: finite.iter().filter(|a| **a == 0.0).count() as f64 / n,
        underflow_f16: count(&|a| a < doctor::F16_MIN_NORMAL / scale),
        underflow_bf16: count(&|a| a < doctor::BF16_MIN_NORMAL / scale),
        overflow_f16: (nz.iter().filter(|a| **a > doctor::F16_MAX / scale).count() + inf) as f64 / n,
        nonfinite: v.iter().filter(|x| !x.is_finite()).count() as u64,
        range_binades: if nz.is_empty() { 0.0 } else { amax.log2() - amin.log2() },
        scale,
    }
}

fn assert_stats_eq(got: &TensorStats, want: &TensorStats, what: &str) {
    assert_eq!(got.dtype, want.dtype, "{what}");
    assert_eq!(got.elements, want.elements, "{what}");
    assert_eq!(got.nonfinite, want.nonfinite, "{what}");
    assert_eq!(got.amax, want.amax, "{what}: amax");
    assert_eq!(got.amin_nonzero, want.amin_nonzero, "{what}: amin_nonzero");
    assert_eq!(got.zero_frac, want.zero_frac, "{what}: zero_frac");
    assert_eq!(got.underflow_f16, want.underflow_f16, "{what}: underflow_f16");
    assert_eq!(got.underflow_bf16, want.underflow_bf16, "{what}: underflow_bf16");
    assert_eq!(got.overflow_f16, want.overflow_f16, "{what}: overflow_f16");
    assert_eq!(got.range_binades, want.range_binades, "{what}: range_binades");
    assert_eq!(got.scale, want.scale, "{what}: scale");
    let tol = 1e-12 * want.mean_abs.max(1e-300);
    assert!(
        (got.mean_abs - want.mean_abs).abs() <= tol,
        "{what}: mean_abs {} vs {}",
        got.mean_abs,
        want.mean_abs
    );
}

/// Standard-normal-like inputs from a seeded generator (candle's CPU `randn` cannot be
/// seeded, and a test whose verdict depends on the draw would be flaky).
fn seeded_inputs(shape: (usize, usize), seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| rand_distr::Distribution::sample(&rand_distr::StandardNormal, &mut rng))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Values of every kind: normal, zeros, f16 and f32 subnormals, beyond f16's range, inf, NaN.
fn awkward(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let sign = if rng.random::<bool>() { -1.0 } else { 1.0 };
            sign * match i % 11 {
                0 => 0.0,
                1 => f32::INFINITY,
                2 if i % 3 == 0 => f32::NAN,
                3 => rng.random_range(1e-9f32..6e-5),
                4 => rng.random_range(1e-42f32..1e-38),
                5 => rng.random_range(6.6e4f32..1e6),
                6 => 65504.0,
                7 => 6.103_515_6e-5,
                _ => rng.random_range(-3f32..3.0).exp(),
            }
        })
        .collect()
}

#[test]
fn statistics_equal_an_f64_reference_for_every_type_and_layout() {
    let dev = Device::Cpu;
    let base = Tensor::from_vec(awkward(3 * 1100, 7), (30, 110), &dev).unwrap();
    for dt in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let t = base.to_dtype(dt).unwrap();
        let views = [
            ("contiguous", t.clone()),
            ("transposed", t.t().unwrap()),
            ("narrowed", t.narrow(1, 3, 50).unwrap()),
            (
                "strided",
                t.t().unwrap().narrow(0, 10, 40).unwrap().narrow(1, 1, 7).unwrap(),
            ),
            ("empty", t.narrow(0, 0, 0).unwrap()),
        ];
        for (layout, v) in views {
            for scale in [1.0f32, 1024.0, 1.0 / 64.0] {
                let got = TensorStats::of(&v, scale).unwrap();
                assert_stats_eq(
                    &got,
                    &reference(&v, scale as f64),
                    &format!("{dt:?} {layout} scale {scale}"),
                );
            }
        }
    }
    // Only finite positive scales and floating tensors.
    assert!(matches!(
        TensorStats::of(&base, 0.0),
        Err(amp::AmpError::InvalidArgument { argument: "scale", .. })
    ));
    let ints = Tensor::new(&[1u32, 2], &dev).unwrap();
    assert!(matches!(
        TensorStats::of(&ints, 1.0),
        Err(amp::AmpError::InvalidArgument { argument: "tensor", .. })
    ));
}

// ------------------------------------------------------------------ planted problems

/// Three branches of the input summed into `head`: `fc1 -> relu` (well scaled), `shrink`
/// (outputs near 1e-5 to 1e-6, rescaled by 1e5 after it) and `big` (outputs around 4e4,
/// beyond 65504 for about a tenth, rescaled by 1e-4).
struct Planted {
    fc1: ann::Linear,
    shrink: ann::Linear,
    big: ann::Linear,
    head: ann::Linear,
}

impl Planted {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let randn = |stdev| Init::Randn { mean: 0.0, stdev };
        let shrink = vb.pp("shrink").get_with_hints((16, 16), "weight", randn(3e-3))?;
        let big = vb.pp("big").get_with_hints((16, 16), "weight", randn(1.0))?;
        Ok(Self {
            fc1: ann::linear(16, 16, vb.pp("fc1"))?,
            shrink: ann::Linear::new(shrink, None).with_name("shrink"),
            big: ann::Linear::new(big, None).with_name("big"),
            head: ann::linear(16, 4, vb.pp("head"))?,
        })
    }
}

impl Module for Planted {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = ops::relu(&self.fc1.forward(x)?)?;
        let s = self.shrink.forward(&x.affine(1e-3, 0.0)?)?.affine(1e5, 0.0)?;
        let g = self.big.forward(&x.affine(1e4, 0.0)?)?.affine(1e-4, 0.0)?;
        // In the type of the half-precision branch, as a model mixing them must.
        let h = h.to_dtype(s.dtype())?;
        self.head.forward(&((s + g)? + h)?)
    }
}

/// Four fixed batches of 64: inputs N(0, 1) clipped to 5, labels from a fixed linear teacher
/// with a quarter of them random (so the loss levels off well above 0 at every level).
fn batches() -> Vec<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let teacher: Vec<f32> = (0..16 * 4).map(|_| rng.random_range(-1f32..1.0)).collect();
    (0..4)
        .map(|_| {
            let x: Vec<f32> = (0..64 * 16)
                .map(|_| {
                    let u: f32 = rng.random_range(1e-6f32..1.0);
                    let w: f32 = rng.random_range(0f32..std::f32::consts::TAU);
                    ((-2.0 * u.ln()).sqrt() * w.cos()).clamp(-5.0, 5.0)
                })
                .collect();
            let y: Vec<u32> = x
                .chunks(16)
                .map(|r| {
                    (0..4)
                        .map(|c| (c, (0..16).map(|k| r[k] * teacher[k * 4 + c]).sum::<f32>()))
                        .max_by(|a, b| a.1.total_cmp(&b.1))
                        .map(|(c, _)| c as u32)
                        .unwrap_or(0)
                })
                .map(|c| {
                    if rng.random::<f32>() < 0.25 {
                        rng.random_range(0..4)
                    } else {
                        c
                    }
                })
                .collect();
            (
                Tensor::from_vec(x, (64, 16), &dev).unwrap(),
                Tensor::new(y.as_slice(), &dev).unwrap(),
            )
        })
        .collect()
}

fn config(level: OptLevel) -> AmpConfig {
    AmpConfig::new(level).half(HalfType::F16).verbosity(0).seed(3)
}

fn adamw() -> amp::optim::AdamW {
    amp::optim::AdamW::new(amp::optim::AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })
    .unwrap()
}

/// A run of the planted model: the handle, model and optimizer.
fn planted(level: OptLevel) -> (amp::AmpModel<Planted>, amp::AmpOptimizer, amp::Amp) {
    amp::initialize(Planted::new, adamw(), config(level)).unwrap()
}

/// Trains `steps` steps; returns (mean loss of the last 5 steps, skipped steps). A run that
/// skips too often to go on counts its remaining steps as skipped.
fn train(model: &amp::AmpModel<Planted>, opt: &mut amp::AmpOptimizer, amp: &amp::Amp, steps: usize) -> (f64, u64) {
    let data = batches();
    let mut losses = Vec::new();
    for i in 0..steps {
        let (x, y) = &data[i % data.len()];
        let loss = ops::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap() as f64);
        amp.scale_loss(&loss, opt).unwrap().backward().unwrap();
        if opt.step().is_err() {
            return (f64::NAN, steps as u64);
        }
        opt.zero_grad();
    }
    let tail = &losses[losses.len() - 5..];
    (tail.iter().sum::<f64>() / 5.0, opt.skipped_steps())
}

/// The layers the doctor wants in f32, with their problem.
fn layer_findings(recs: &[doctor::Recommendation]) -> Vec<(String, Problem)> {
    let mut v: Vec<(String, Problem)> = recs
        .iter()
        .filter(|r| matches!(r.action, Action::KeepLayerF32 { .. } | Action::KeepOpF32 { .. }))
        .map(|r| (r.target.clone(), r.problem))
        .collect();
    v.sort();
    v
}

const STEPS: usize = 60;

#[test]
fn planted_problems_are_named_exactly_and_apply_fixes_o1_and_o3() {
    let (m0, mut o0, a0) = planted(OptLevel::O0);
    let (l0, s0) = train(&m0, &mut o0, &a0, STEPS);
    eprintln!("O0 loss {l0}");
    assert_eq!(s0, 0);
    assert!(l0.is_finite() && l0 < 1.0, "O0 must learn the task: {l0}");
    for level in [OptLevel::O1, OptLevel::O3] {
        // Unfixed, with the doctor watching every 5th step.
        let (m, mut o, a) = planted(level);
        let doc = Doctor::attach(
            &a,
            DoctorConfig {
                every: 5,
                ..Default::default()
            },
        )
        .unwrap();
        let (l, skipped) = train(&m, &mut o, &a, STEPS);
        assert!(
            skipped as usize >= STEPS / 2 || l.is_nan() || l >= 1.02 * l0,
            "{level}: the unfixed run should stall or skip: loss {l} vs O0 {l0}, {skipped} skipped"
        );
        let report = doc.report();
        assert_eq!(report.steps_observed, (STEPS as u64).div_ceil(5));
        // The loss scale at every step (unthinned at this length), the steps counted from 1 as
        // the train example's progress lines.
        let scale_steps: Vec<u64> = report.loss_scale.iter().map(|p| p.step).collect();
        assert_eq!(scale_steps, (1..=report.steps).collect::<Vec<_>>(), "{level}");
        assert_eq!(
            layer_findings(&report.recommendations),
            vec![
                ("big".to_string(), Problem::Overflow),
                ("shrink".to_string(), Problem::Underflow)
            ],
            "{level}:\n{report}"
        );
        // Nothing else that apply would carry out: the NaN loss and gradients follow from `big`.
        let others: Vec<_> = report
            .recommendations
            .iter()
            .filter(|r| r.severity > Severity::Info && !matches!(r.action, Action::KeepLayerF32 { .. }))
            .collect();
        assert!(others.is_empty(), "{level}: {others:?}");
        let shrink = report.tensors.iter().find(|t| t.name == "shrink").unwrap();
        assert_eq!((shrink.kind, shrink.dtype.as_str()), (TensorKind::Activation, "f16"));
        assert!(shrink.underflow_f16 > 0.9 && shrink.underflow_bf16 == 0.0, "{shrink:?}");
        let big = report.tensors.iter().find(|t| t.name == "big").unwrap();
        assert!(big.nonfinite > 0 && big.root_nonfinite > 0, "{big:?}");
        // The worst first: the table starts with `big`, the cause.
        assert_eq!(report.tensors[0].name, "big");
        let json = report.to_json();
        for k in ["steps_observed", "tensors", "recommendations"] {
            assert!(json.get(k).is_some(), "{k}");
        }
        // Fixed: a fresh run of the same seed with the recommendations applied.
        let (m, mut o, a) = planted(level);
        let applied = doc.apply(&a).unwrap();
        assert_eq!(applied.applied.len(), 2, "{applied:?}");
        assert_eq!(a.f32_layers(), vec!["big".to_string(), "shrink".to_string()]);
        let (l, skipped) = train(&m, &mut o, &a, STEPS);
        // At most the usual back-off from O1's initial scale 65536 (a gradient of the f16
        // layers), never a NaN loss.
        eprintln!("{level} fixed: loss {l}, {skipped} skipped");
        assert!(skipped <= 2, "{level} fixed: {skipped} skipped");
        assert!((l - l0).abs() <= 0.02 * l0, "{level} fixed: loss {l} vs O0 {l0}");
    }
}

// ------------------------------------------------------------------ loss scale

/// One linear layer fit to targets of 10: its gradient reaches a few units, so at 65536 its
/// raw f16 gradient overflows.
struct Fit {
    fc: ann::Linear,
}

impl Module for Fit {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc.forward(x)
    }
}

fn fit_run() -> (amp::AmpModel<Fit>, amp::AmpOptimizer, amp::Amp) {
    amp::initialize(
        |vb| {
            Ok(Fit {
                fc: ann::linear(8, 4, vb.pp("fc"))?,
            })
        },
        amp::optim::AdamW::new(Default::default()).unwrap(),
        config(OptLevel::O2),
    )
    .unwrap()
}

fn fit_steps(model: &amp::AmpModel<Fit>, opt: &mut amp::AmpOptimizer, amp: &amp::Amp, steps: usize) -> u64 {
    let dev = Device::Cpu;
    let x = seeded_inputs((16, 8), 3);
    // Far from the output, so that the output's gradient (in half) overflows at the initial
    // scale: the weight gradient itself is accumulated in f32 and would not.
    let t = Tensor::full(200f32, (16, 4), &dev).unwrap();
    for _ in 0..steps {
        let loss = ops::mse(&model.forward(&x).unwrap(), &t).unwrap();
        amp.scale_loss(&loss, opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    opt.skipped_steps()
}

#[test]
fn a_gradient_overflowing_at_the_initial_scale_gets_a_scale_range_that_avoids_it() {
    let (m, mut o, a) = fit_run();
    let doc = Doctor::attach(
        &a,
        DoctorConfig {
            every: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let skipped = fit_steps(&m, &mut o, &a, 20);
    assert!(skipped >= 3, "the initial scale 65536 must overflow: {skipped} skipped");
    let report = doc.report();
    let recs: Vec<_> = report
        .recommendations
        .iter()
        .filter(|r| r.problem == Problem::GradientOverflow)
        .collect();
    assert!(recs.iter().any(|r| r.target == "fc.weight"), "{report}");
    assert!(recs.iter().all(|r| r.target.starts_with("fc.")), "{report}");
    let amax = report
        .tensors
        .iter()
        .filter(|t| t.kind == TensorKind::MasterGrad)
        .map(|t| t.amax)
        .fold(0.0, f64::max);
    for r in &recs {
        let Action::LossScale {
            init,
            min,
            max,
            loss_id,
        } = r.action
        else {
            panic!("{r:?}")
        };
        assert_eq!(loss_id, 0);
        assert!(min <= init && init <= max, "{r:?}");
        // The ceiling keeps the largest gradient seen below f16's max with a binade to spare,
        // and is the largest power of two that does.
        assert!(max as f64 * amax <= 65504.0 / 2.0, "{r:?} amax {amax}");
        assert!(2.0 * max as f64 * amax > 65504.0 / 2.0, "{r:?} amax {amax}");
    }
    // Applied to a fresh run, no step is skipped.
    let (m, mut o, a) = fit_run();
    let applied = doc.apply(&a).unwrap();
    assert!(!applied.applied.is_empty());
    assert_eq!(fit_steps(&m, &mut o, &a, 30), 0);
}

// ------------------------------------------------------------------ automatic fallback

#[test]
fn the_fallback_switches_the_planted_layers_only_and_a_checkpoint_keeps_the_switch() {
    let (m, mut o, a) = planted(OptLevel::O1);
    let cfg = DoctorConfig {
        every: 1,
        auto_fallback: true,
        ..Default::default()
    };
    let doc = Doctor::attach(&a, cfg.clone()).unwrap();
    let data = batches();
    let step = |i: usize, m: &amp::AmpModel<Planted>, o: &mut amp::AmpOptimizer, a: &amp::Amp| {
        let (x, y) = &data[i % data.len()];
        let loss = ops::cross_entropy(&m.forward(x).unwrap(), y).unwrap();
        let l = loss.to_scalar::<f32>().unwrap();
        a.scale_loss(&loss, o).unwrap().backward().unwrap();
        let skipped = o.step().unwrap().is_skipped();
        o.zero_grad();
        (l, skipped)
    };
    let mut skips = Vec::new();
    for i in 0..10 {
        skips.push(step(i, &m, &mut o, &a).1);
    }
    let switches = doc.switches();
    let mut names: Vec<_> = switches.iter().map(|s| (s.layer.clone(), s.to_f32, s.step)).collect();
    names.sort();
    // Three bad observations (steps 1, 2, 3, counting from 1), then the switch: step 4 on
    // trains. (The event carries the step whose observation decided it; the switch holds
    // from the next.)
    assert_eq!(
        names,
        vec![("big".into(), true, 3), ("shrink".into(), true, 3)],
        "{switches:?}"
    );
    assert_eq!(
        skips,
        [true, true, true, false, false, false, false, false, false, false]
    );
    assert_eq!(a.f32_layers(), vec!["big".to_string(), "shrink".to_string()]);
    assert!(doc.report().to_string().contains("fallback at step 3: big -> f32"));

    // Save, resume in a new run: the switch is in place and training continues exactly.
    let dir = std::env::temp_dir().join(format!("candle-amp-doctor-{}", std::process::id()));
    let ckd = amp::checkpoint::CheckpointDir::new(&dir, 1);
    ckd.save(&a, &[&o], 10, serde_json::json!({})).unwrap();
    let (m2, mut o2, a2) = planted(OptLevel::O1);
    assert!(a2.f32_layers().is_empty());
    ckd.load().unwrap().restore(&a2, &mut [&mut o2]).unwrap();
    assert_eq!(a2.f32_layers(), vec!["big".to_string(), "shrink".to_string()]);
    assert_eq!(a2.state_dict().unwrap().f32_layers["big"], "auto");
    let doc2 = Doctor::attach(&a2, cfg).unwrap();
    for i in 10..14 {
        let (l1, s1) = step(i, &m, &mut o, &a);
        let (l2, s2) = step(i, &m2, &mut o2, &a2);
        assert_eq!((l1, s1), (l2, s2), "step {i}");
        assert!(!s2);
    }
    assert!(doc2.switches().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_config_is_a_typed_error() {
    let (_m, _o, a) = planted(OptLevel::O1);
    for (cfg, arg) in [
        (
            DoctorConfig {
                every: 0,
                ..Default::default()
            },
            "every",
        ),
        (
            DoctorConfig {
                threshold: 1.5,
                ..Default::default()
            },
            "threshold",
        ),
        (
            DoctorConfig {
                window: 0,
                ..Default::default()
            },
            "window",
        ),
        (
            DoctorConfig {
                switch_back: 0.2,
                ..Default::default()
            },
            "switch_back",
        ),
    ] {
        match Doctor::attach(&a, cfg) {
            Err(amp::AmpError::InvalidArgument { argument, .. }) => assert_eq!(argument, arg),
            other => panic!("{arg}: {other:?}"),
        }
    }
}

/// A layer whose input the test scales: tiny (its outputs underflow f16) or normal.
struct Knob {
    lin: ann::Linear,
    head: ann::Linear,
    gain: std::rc::Rc<std::cell::Cell<f64>>,
}

impl Module for Knob {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.gain.get();
        // Rescaled in f32 (1e6 is beyond f16).
        let h = self
            .lin
            .forward(&x.affine(g, 0.0)?)?
            .to_dtype(DType::F32)?
            .affine(1.0 / g, 0.0)?;
        self.head.forward(&h)
    }
}

#[test]
fn the_fallback_switches_back_when_the_outputs_fit_again() {
    let gain = std::rc::Rc::new(std::cell::Cell::new(1e-6));
    let g2 = gain.clone();
    let (m, mut o, a) = amp::initialize(
        move |vb| {
            Ok(Knob {
                lin: ann::linear_no_bias(16, 16, vb.pp("lin"))?,
                head: ann::linear(16, 4, vb.pp("head"))?,
                gain: g2,
            })
        },
        adamw(),
        config(OptLevel::O1),
    )
    .unwrap();
    let doc = Doctor::attach(
        &a,
        DoctorConfig {
            every: 1,
            auto_fallback: true,
            ..Default::default()
        },
    )
    .unwrap();
    let data = batches();
    let mut layers = Vec::new();
    for i in 0..12 {
        if i == 5 {
            gain.set(1.0);
        }
        let (x, y) = &data[i % data.len()];
        let loss = ops::cross_entropy(&m.forward(x).unwrap(), y).unwrap();
        a.scale_loss(&loss, &mut o).unwrap().backward().unwrap();
        o.step().unwrap();
        o.zero_grad();
        layers.push(a.f32_layers());
    }
    let events: Vec<_> = doc
        .switches()
        .iter()
        .map(|s| (s.layer.clone(), s.to_f32, s.step))
        .collect();
    // Steps counting from 1: in f32 from step 4 (after three bad observations, the event at
    // step 3) until three good ones (steps 6-8, the event at step 8).
    assert_eq!(events, vec![("lin".into(), true, 3), ("lin".into(), false, 8)]);
    let lin = vec!["lin".to_string()];
    let expect: Vec<Vec<String>> = (0..12)
        .map(|i| if (2..7).contains(&i) { lin.clone() } else { vec![] })
        .collect();
    assert_eq!(layers, expect);
}

// ------------------------------------------------------------------ more

#[path = "doctor/device.rs"]
mod device;
#[path = "doctor/gradients.rs"]
mod gradients;
