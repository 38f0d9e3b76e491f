//! What the optimizer applies is what is checked: overflow that appears only when
//! micro-batches are accumulated or ranks are averaged skips the step (every rank alike,
//! weights bit-identical), while averages that are finite stay finite. Also: a saturated
//! binary cross entropy keeps a finite gradient (PyTorch's backward), and trained
//! parameters that get no gradient are named in the first backward's warnings.
//!
//! On `common::device()` (the data-parallel tests too: ranks are threads of a `LocalGroup`,
//! which sums device tensors through the host), except the master-gradient buffer test (it
//! reads a CPU buffer's address), which stays on the CPU.

mod common;

use std::sync::Arc;
use std::time::Duration;

use candle_amp::distributed::{Communicator, DataParallel};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, Amp, GradScaler, OptLevel, StepOutcome};
use candle_core::{DType, Device, Tensor, Var};
use common::{f32_bits, flat, on_ranks};

/// An O0 run on the test device with one parameter `w` holding 1, and an SGD optimizer
/// (lr 1e-38).
fn one_param() -> (Amp, Tensor, amp::AmpOptimizer) {
    one_param_on(&common::device())
}

/// [`one_param`] on `dev`.
fn one_param_on(dev: &Device) -> (Amp, Tensor, amp::AmpOptimizer) {
    let amp = Amp::new(OptLevel::O0, dev).unwrap();
    let w = amp
        .var_builder()
        .get_with_hints((1,), "w", candle_nn::Init::Const(1.0))
        .unwrap();
    let opt = amp.optimizer(Sgd::new(SgdConfig::new(1e-38)).unwrap()).unwrap();
    (amp, w, opt)
}

/// A loss (`g w`, finite) whose gradient with respect to `w` is `g`.
fn loss_with_grad(w: &Tensor, g: f32) -> Tensor {
    (w.sum_all().unwrap() * g as f64).unwrap()
}

/// `w`'s f32 value.
fn w_of(amp: &Amp) -> f32 {
    flat(&amp.store().param("w").unwrap().f32_value().unwrap())[0]
}

#[test]
fn accumulated_overflow_skips_the_step_with_the_guard() {
    let (amp, w, mut opt) = one_param();
    let before = f32_bits(amp.store());
    // Each micro-batch's gradient, 2e38, is finite: only their sum overflows, and the
    // second backward, which makes the sum, says so.
    let mut backward = || {
        amp.scale_loss(&loss_with_grad(&w, 2e38), &mut opt)
            .unwrap()
            .backward()
            .unwrap()
    };
    assert!(!backward().found_inf);
    let second = backward();
    assert!(second.found_inf);
    assert_eq!(second.nonfinite, ["w"]);
    assert!(opt.found_inf(), "the accumulated gradient is inf");
    match opt.step().unwrap() {
        StepOutcome::Skipped { nonfinite, .. } => assert_eq!(nonfinite, ["w"]),
        other => panic!("an inf accumulated gradient must skip the step, got {other:?}"),
    }
    assert_eq!(
        f32_bits(amp.store()),
        before,
        "a skipped step leaves the weights bit-identical"
    );
    assert_eq!((opt.steps(), opt.skipped_steps()), (0, 1));
}

#[test]
fn accumulated_finite_sum_steps() {
    let (amp, w, mut opt) = one_param();
    for _ in 0..2 {
        amp.scale_loss(&loss_with_grad(&w, 1e38), &mut opt)
            .unwrap()
            .backward()
            .unwrap();
    }
    assert_eq!(opt.step().unwrap(), StepOutcome::Stepped { loss_scale: 1.0 });
    // w - lr * 2e38 = 1 - 2, up to f32 rounding of the tiny learning rate.
    assert!((w_of(&amp) + 1.0).abs() < 1e-6, "{}", w_of(&amp));
}

#[test]
fn accumulated_overflow_skips_the_step_with_grad_scaler() {
    let (amp, w, mut opt) = one_param();
    let before = f32_bits(amp.store());
    let mut scaler = GradScaler::with_params(1.0, 2.0, 0.5, 2000, true).unwrap();
    let micro = |scaler: &GradScaler| scaler.scale(&loss_with_grad(&w, 2e38)).unwrap().backward().unwrap();
    let r = scaler.accumulate(&mut opt, &micro(&scaler)).unwrap();
    assert!(!r.found_inf);
    let out = scaler.step(&mut opt, &micro(&scaler)).unwrap();
    assert!(out.is_skipped(), "{out:?}");
    scaler.update(None).unwrap();
    assert_eq!(scaler.get_scale(), 0.5, "the overflow backs the scale off");
    assert_eq!(f32_bits(amp.store()), before);
}

/// One data-parallel step where rank `r` runs micro-batches with gradients `grads(r)`;
/// returns (skipped, the weights' bits before, after).
fn ddp_step(c: Arc<dyn Communicator>, grads: impl Fn(usize) -> Vec<f32>) -> (bool, Vec<u32>, Vec<u32>) {
    let (amp, w, mut opt) = one_param_on(&common::device());
    let rank = c.rank();
    let _ddp = DataParallel::new(&amp, c, Default::default()).unwrap();
    let bits = |amp: &Amp| f32_bits(amp.store())["w"].clone();
    let before = bits(&amp);
    for g in grads(rank) {
        amp.scale_loss(&loss_with_grad(&w, g), &mut opt)
            .unwrap()
            .backward()
            .unwrap();
    }
    let skipped = opt.step().unwrap().is_skipped();
    (skipped, before, bits(&amp))
}

#[test]
fn ranks_average_without_overflowing() {
    // 2e38 and 3e38 sum to inf, but their average, 2.5e38, is what PyTorch's DDP applies.
    let out = on_ranks(2, Duration::from_secs(60), |c| {
        ddp_step(c, |r| vec![if r == 0 { 2e38 } else { 3e38 }])
    });
    for (skipped, _, after) in &out {
        assert!(!skipped);
        let w: Vec<f32> = after.iter().map(|b| f32::from_bits(*b)).collect();
        // 1 - 1e-38 * 2.5e38 = -1.5.
        assert!(w.iter().all(|v| (v + 1.5).abs() < 1e-6), "{w:?}");
    }
    assert_eq!(out[0].2, out[1].2);
}

#[test]
fn one_ranks_accumulated_overflow_skips_every_rank() {
    // Rank 0 accumulates two finite gradients into an inf; rank 1 is clean.
    let out = on_ranks(2, Duration::from_secs(60), |c| {
        ddp_step(c, |r| if r == 0 { vec![2e38, 2e38] } else { vec![1.0, 1.0] })
    });
    for (skipped, before, after) in &out {
        assert!(skipped, "every rank skips");
        assert_eq!(before, after, "weights bit-identical after the skip");
    }
}

/// A step reducer that scales the gradients up (and does not check them), standing for any
/// reducer whose output overflows.
struct Amplify;

impl amp::distributed::StepReducer for Amplify {
    fn reduce_step(&self, step: amp::distributed::StepGrads<'_>) -> amp::Result<()> {
        for g in step.grads.values_mut() {
            *g = (&*g * 1e30)?;
        }
        Ok(())
    }
}

#[test]
fn a_reducers_output_is_checked_before_it_is_applied() {
    let (amp, w, mut opt) = one_param();
    amp.set_step_reducer(Some(Arc::new(Amplify)));
    let before = f32_bits(amp.store());
    let r = amp
        .scale_loss(&loss_with_grad(&w, 1e10), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    assert!(!r.found_inf);
    match opt.step().unwrap() {
        StepOutcome::Skipped { nonfinite, .. } => assert_eq!(nonfinite, ["w"]),
        other => panic!("{other:?}"),
    }
    assert_eq!(f32_bits(amp.store()), before);
}

#[test]
fn binary_cross_entropy_gradient_is_finite_at_zero_and_one() {
    // PyTorch: d/dp = (p - y) / max(p (1 - p), 1e-12), divided by N for the mean.
    let p = Var::new(&[0f32, 1., 0., 1., 0.25], &common::device()).unwrap();
    let y = Var::new(&[0f32, 1., 1., 0., 1.], &common::device()).unwrap();
    let loss = amp::ops::binary_cross_entropy(&p, &y).unwrap();
    // Clamped logs: the two wrong saturated entries cost 100 each.
    let want = (100.0 + 100.0 - (0.25f64).ln()) / 5.0;
    assert!((loss.to_scalar::<f32>().unwrap() as f64 - want).abs() < 1e-4);
    let g = loss.backward().unwrap();
    let gp = flat(g.get(&p).unwrap());
    let want_p = [0.0, 0.0, -1e12 / 5.0, 1e12 / 5.0, (0.25 - 1.0) / (0.25 * 0.75) / 5.0];
    for (a, b) in gp.iter().zip(want_p) {
        assert!(
            a.is_finite() && (*a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{gp:?}"
        );
    }
    // d/dy = log(1 - p) - log(p), each clamped at -100, over N.
    let gy = flat(g.get(&y).unwrap());
    let want_y = [20.0, -20.0, 20.0, -20.0, ((0.75f64).ln() - (0.25f64).ln()) / 5.0];
    for (a, b) in gy.iter().zip(want_y) {
        assert!((*a as f64 - b).abs() < 1e-5, "{gy:?}");
    }
}

#[test]
fn a_saturated_sigmoid_does_not_skip_steps() {
    let amp = Amp::new(OptLevel::O1, &common::device()).unwrap();
    let fc = amp::nn::linear(1, 1, amp.var_builder().pp("fc")).unwrap();
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(1e-3)).unwrap()).unwrap();
    // A logit of 200: sigmoid is exactly 1 in f32.
    let x = Tensor::new(&[[200f32]], &common::device()).unwrap();
    let y = Tensor::new(&[[0f32]], &common::device()).unwrap();
    for _ in 0..3 {
        let p = candle_nn::ops::sigmoid(
            &candle_nn::Module::forward(&fc, &x)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        )
        .unwrap();
        let loss = amp::ops::binary_cross_entropy(&p, &y).unwrap();
        let r = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert!(!r.found_inf, "{r:?}");
        assert!(!opt.step().unwrap().is_skipped());
        opt.zero_grad();
    }
}

#[test]
fn parameters_without_a_gradient_are_named_once() {
    let amp = Amp::new(OptLevel::O0, &common::device()).unwrap();
    let vb = amp.var_builder();
    let fc = amp::nn::linear(3, 3, vb.pp("fc")).unwrap();
    // candle-nn's fused layer norm has no backward: its weight and bias never get a gradient.
    let ln = candle_nn::layer_norm(3, 1e-5, vb.pp("ln")).unwrap();
    let frozen = amp::nn::linear(3, 3, vb.pp("frozen")).unwrap();
    amp.store().set_frozen(|n| n.starts_with("frozen."), true);
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
    let x = Tensor::ones((2, 3), DType::F32, &common::device()).unwrap();
    let fwd = || {
        use candle_nn::Module;
        let h = candle_nn::Module::forward(&fc, &x).unwrap();
        let _ = frozen.forward(&h).unwrap();
        // The loss reaches fc through h, and the norm's parameters through nothing.
        (ln.forward(&h).unwrap().sqr().unwrap().mean_all().unwrap() + h.mean_all().unwrap()).unwrap()
    };
    let r = amp.scale_loss(&fwd(), &mut opt).unwrap().backward().unwrap();
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    let w = &r.warnings[0];
    assert!(w.contains("ln.weight") && w.contains("ln.bias"), "{w}");
    assert!(!w.contains("fc.") && !w.contains("frozen."), "{w}");
    opt.step().unwrap();
    opt.zero_grad();
    let r = amp.scale_loss(&fwd(), &mut opt).unwrap().backward().unwrap();
    assert!(r.warnings.is_empty(), "once per run: {:?}", r.warnings);
}

/// The address of a CPU f32 tensor's data (so the test that reads it stays on the CPU).
fn data_ptr(t: &Tensor) -> usize {
    let (s, l) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v[l.start_offset()..].as_ptr() as usize,
        _ => panic!("not an f32 CPU tensor"),
    }
}

#[test]
fn master_gradient_buffers_live_across_steps() {
    // The host path's buffers, read by address: on the CPU whatever the test device.
    let (amp, w, mut opt) = one_param_on(&Device::Cpu);
    amp.scale_loss(&loss_with_grad(&w, 3.0), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    let first = data_ptr(&opt.master_grads()["w"]);
    opt.step().unwrap();
    opt.zero_grad();
    assert!(opt.master_grads().is_empty());
    // The next backward writes into the same buffer, overwriting (not adding to) the old value.
    amp.scale_loss(&loss_with_grad(&w, 5.0), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(data_ptr(&opt.master_grads()["w"]), first);
    assert_eq!(flat(&opt.master_grads()["w"]), [5.0]);
    // A second micro-batch adds in place.
    amp.scale_loss(&loss_with_grad(&w, 2.0), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(data_ptr(&opt.master_grads()["w"]), first);
    assert_eq!(flat(&opt.master_grads()["w"]), [7.0]);
    opt.step().unwrap();
    opt.zero_grad_set_to_none();
    assert!(opt.master_grads().is_empty());
    amp.scale_loss(&loss_with_grad(&w, 1.0), &mut opt)
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(flat(&opt.master_grads()["w"]), [1.0]);
}

/// Records what `step` was given at O3: whether `var` was an f32 copy or the half working
/// Var, and whether `update` (the values) was ever asked for.
struct Probe {
    reads: bool,
    seen: std::sync::Arc<std::sync::Mutex<Vec<(DType, bool)>>>,
}

impl amp::optim::Optimizer for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }
    fn defaults(&self) -> amp::optim::GroupHyper {
        amp::optim::GroupHyper {
            lr: 0.0,
            weight_decay: 0.0,
        }
    }
    fn reads_f32_copies(&self, _params: &[amp::optim::ParamUpdate<'_>]) -> bool {
        self.reads
    }
    fn update(&mut self, p: &amp::optim::ParamUpdate<'_>) -> amp::Result<Tensor> {
        Ok(p.var.as_tensor().clone())
    }
    fn step(&mut self, params: &[amp::optim::ParamUpdate<'_>]) -> amp::Result<()> {
        let mut seen = self.seen.lock().unwrap();
        for p in params {
            let same = p.working.is_some_and(|w| w.id() == p.var.id());
            seen.push((p.var.dtype(), same));
        }
        Ok(())
    }
    fn state_dict(&self) -> amp::Result<amp::optim::OptimizerState> {
        Err(amp::AmpError::OptimizerState("probe".into()))
    }
    fn load_state_dict(&mut self, _state: &amp::optim::OptimizerState) -> amp::Result<()> {
        Ok(())
    }
}

#[test]
fn o3_makes_f32_copies_only_for_algorithms_that_read_them() {
    for reads in [true, false] {
        let amp = Amp::new(OptLevel::O3, &common::device()).unwrap();
        let fc = amp::nn::linear(2, 2, amp.var_builder().pp("fc")).unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut opt = amp
            .optimizer(Probe {
                reads,
                seen: seen.clone(),
            })
            .unwrap();
        let x = Tensor::ones((1, 2), DType::F16, &common::device()).unwrap();
        let loss = candle_nn::Module::forward(&fc, &x).unwrap().sum_all().unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        for (dtype, same) in seen {
            if reads {
                assert_eq!((dtype, same), (DType::F32, false), "an f32 copy");
            } else {
                assert_eq!((dtype, same), (DType::F16, true), "the half working Var, no copy");
            }
        }
    }
}

#[test]
fn accumulated_overflow_is_caught_on_the_fallback_path_too() {
    // With the kernels off (the path every other device takes) the sum is made with tensor
    // ops and checked after it.
    let _plain = amp::kernels::plain();
    let (amp, w, mut opt) = one_param();
    let before = f32_bits(amp.store());
    let mut backward = || {
        amp.scale_loss(&loss_with_grad(&w, 2e38), &mut opt)
            .unwrap()
            .backward()
            .unwrap()
    };
    assert!(!backward().found_inf);
    assert_eq!(backward().nonfinite, ["w"]);
    assert!(opt.step().unwrap().is_skipped());
    assert_eq!(f32_bits(amp.store()), before);
}
