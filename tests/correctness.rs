//! Regression tests for correctness bugs: optimizer identity across handles, parameter
//! ownership, scaler settings on resume, the reducer on the PyTorch-style path, stale casts
//! in a standalone autocast scope, overflow checks at tiny scales, scopes dropped out of
//! order, all-or-nothing steps and gradient accumulation with `GradScaler`.
//!
//! On `common::device()`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_amp::autocast;
use candle_amp::checkpoint::{Checkpoint, CheckpointDir};
use candle_amp::optim::{Optimizer, OptimizerState, ParamUpdate, Sgd, SgdConfig};
use candle_amp::{
    self as amp, AmpConfig, AmpError, DynamicParams, GradReducer, GradScaler, LossScaleSpec, OptLevel, ops,
};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer as _;
use common::*;

fn sgd(lr: f64) -> Sgd {
    Sgd::new(SgdConfig::new(lr)).unwrap()
}

fn quiet(level: OptLevel) -> AmpConfig {
    AmpConfig::new(level).verbosity(0)
}

fn grads_of(model: &amp::AmpModel<TwoLinear>, scaler: &GradScaler, x: &Tensor, y: &Tensor) -> GradStore {
    let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap()
}

#[test]
fn one_grad_scaler_serves_optimizers_of_two_handles() {
    let (m0, mut o0, a0) = common::initialize(TwoLinear::new, sgd(0.1), quiet(OptLevel::O1).seed(1)).unwrap();
    let (m1, mut o1, a1) = common::initialize(TwoLinear::new, sgd(0.1), quiet(OptLevel::O1).seed(2)).unwrap();
    let data = batches(2, 21);
    let (x, y) = &data[0];
    let mut scaler = GradScaler::new();
    let (g0, g1) = (grads_of(&m0, &scaler, x, y), grads_of(&m1, &scaler, x, y));
    assert!(!scaler.step(&mut o0, &g0).unwrap().is_skipped());
    assert!(!scaler.step(&mut o1, &g1).unwrap().is_skipped());
    scaler.update(None).unwrap();
    // unscale(o0) then step(o1): o1 must step on its own gradients.
    let (x, y) = &data[1];
    let vm = f32_copy(a1.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let (g0, g1) = (grads_of(&m0, &scaler, x, y), grads_of(&m1, &scaler, x, y));
    scaler.unscale(&mut o0, &g0).unwrap();
    let before = store_values(a1.store());
    assert!(!scaler.step(&mut o1, &g1).unwrap().is_skipped());
    assert_ne!(store_values(a1.store()), before, "o1 was updated");
    let mut c = candle_nn::SGD::new(vm.all_vars(), 0.1).unwrap();
    c.step(&mse(&control, x, y).backward().unwrap()).unwrap();
    assert!(max_rel_diff(&store_values(a1.store()), &varmap_values(&vm), 1e-3) < 1e-6);
    scaler.step(&mut o0, &g0).unwrap();
    scaler.update(None).unwrap();
    drop(a0);
}

#[test]
fn groups_select_only_their_optimizers_parameters_and_claims_do_not_overlap() {
    let amp = amp::Amp::new(quiet(OptLevel::O2), &common::device()).unwrap();
    let _g = amp.model(|vb| TwoLinear::new(vb.pp("gen"))).unwrap();
    let _d = amp.model(|vb| TwoLinear::new(vb.pp("disc"))).unwrap();
    let mut opt_g = amp.optimizer_for(sgd(0.1), |n| n.starts_with("gen.")).unwrap();
    let opt_d = amp.optimizer_for(sgd(0.1), |n| n.starts_with("disc.")).unwrap();
    let g = opt_g.add_param_group("no_decay", |n| n.ends_with("bias"), None, Some(0.0));
    assert_eq!(opt_g.groups()[g].params, vec!["gen.l1.bias", "gen.l2.bias"]);
    assert!(
        opt_g.param_names().iter().all(|n| n.starts_with("gen.")),
        "{:?}",
        opt_g.param_names()
    );
    assert!(opt_d.param_names().iter().all(|n| n.starts_with("disc.")));
    // A third optimizer claiming a parameter another one trains is refused, naming it.
    let e = amp.optimizer_for(sgd(0.1), |n| n == "disc.l2.weight").unwrap_err();
    assert!(matches!(e, AmpError::Ownership { .. }), "{e}");
    assert!(e.to_string().contains("disc.l2.weight"), "{e}");
    let e = amp.optimizer(sgd(0.1)).unwrap_err();
    assert!(e.to_string().contains("gen.l1.weight"), "{e}");
    // Once its owner is dropped, the parameters can be claimed again.
    drop(opt_d);
    assert!(amp.optimizer_for(sgd(0.1), |n| n.starts_with("disc.")).is_ok());
}

#[test]
fn resuming_keeps_the_loading_runs_scaler_settings() {
    let dir = std::env::temp_dir().join(format!("candle-amp-resume-settings-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), quiet(OptLevel::O2)).unwrap();
    for (x, y) in batches(3, 22) {
        let loss = ops::mse(&model.forward(&x).unwrap(), &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    let ckpts = CheckpointDir::new(&dir, 1);
    ckpts
        .save_checkpoint(&Checkpoint::capture(&amp, &[&opt], 3).unwrap())
        .unwrap();
    let calm = quiet(OptLevel::O2).max_loss_scale(1024.0).dynamic(DynamicParams {
        growth_interval: 7,
        hysteresis: 2,
        ..Default::default()
    });
    let (_, mut opt2, amp2) = common::initialize(TwoLinear::new, sgd(0.1), calm).unwrap();
    ckpts.load().unwrap().restore(&amp2, &mut [&mut opt2]).unwrap();
    let st = &amp2.scaler_states()[0];
    assert_eq!(
        st.scale.scale(),
        1024.0,
        "the restored 65536 is clamped into the new ceiling"
    );
    assert_eq!(st.updates, 3, "counters are restored");
    let p = st.scale.params().expect("dynamic");
    assert_eq!((st.scale.bounds().1, p.growth_interval, p.hysteresis), (1024.0, 7, 2));
    assert_eq!(st.scale.growth_tracker(), 3, "the growth tracker is restored");
    assert_eq!(amp2.properties().max_loss_scale, 1024.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A reducer that halves every gradient (as averaging with a rank whose gradients are zero
/// would) and can report an overflow found on "another rank".
struct Halving {
    calls: AtomicUsize,
    remote_inf: bool,
}

impl GradReducer for Halving {
    fn reduce(&self, grads: &mut GradStore, params: &[(String, Var)]) -> amp::Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        for (_, v) in params {
            if let Some(g) = grads.get(v) {
                let h = (g * 0.5)?;
                grads.insert(v, h);
            }
        }
        Ok(())
    }

    fn reduce_found_inf(&self, found_inf: bool) -> amp::Result<bool> {
        Ok(found_inf || self.remote_inf)
    }
}

#[test]
fn the_grad_scaler_path_runs_the_installed_reducer() {
    for remote_inf in [false, true] {
        let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), quiet(OptLevel::O1)).unwrap();
        let r = Arc::new(Halving {
            calls: AtomicUsize::new(0),
            remote_inf,
        });
        amp.set_grad_reducer(Some(r.clone()));
        let (x, y) = batches(1, 23).remove(0);
        let vm = f32_copy(amp.store());
        let control = TwoLinear::new(vb_of(&vm)).unwrap();
        let mut scaler = GradScaler::new();
        let g = grads_of(&model, &scaler, &x, &y);
        let out = scaler.step(&mut opt, &g).unwrap();
        scaler.update(None).unwrap();
        assert_eq!(r.calls.load(Ordering::Relaxed), 1);
        assert_eq!(out.is_skipped(), remote_inf, "the combined overflow flag decides");
        assert_eq!(scaler.get_scale(), if remote_inf { 32768.0 } else { 65536.0 });
        if !remote_inf {
            // Halved gradients: the same step as lr/2 on the control.
            let mut c = candle_nn::SGD::new(vm.all_vars(), 0.05).unwrap();
            c.step(&mse(&control, &x, &y).backward().unwrap()).unwrap();
            assert!(max_rel_diff(&store_values(amp.store()), &varmap_values(&vm), 1e-3) < 1e-6);
        }
    }
}

#[test]
fn a_standalone_scope_around_a_training_loop_never_serves_stale_weights() {
    let vm = candle_nn::VarMap::new();
    let lin = amp::nn::linear(8, 8, vb_of(&vm).pp("fc")).unwrap();
    let mut adamw = candle_nn::AdamW::new(
        vm.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 0.05,
            ..Default::default()
        },
    )
    .unwrap();
    let _scope = autocast::scope(DType::BF16);
    for (step, (x, y)) in batches(4, 24).iter().enumerate() {
        let w = lin.weight().copy().unwrap();
        let out = candle_nn::Module::forward(&lin, x).unwrap();
        let again = candle_nn::Module::forward(&lin, x).unwrap();
        assert_eq!(
            flat(&out),
            flat(&again),
            "step {step}: the same weights give the same output"
        );
        // The same kernel on freshly cast weights: equal only if the cast was of these.
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let fresh = amp::kernels::linear(&bf(x), &bf(&w), Some(&bf(lin.bias().unwrap()))).unwrap();
        assert_eq!(
            flat(&out),
            flat(&fresh),
            "step {step}: the cast is of the current weights"
        );
        let loss = ops::mse(&out, y).unwrap();
        adamw.step(&loss.backward().unwrap()).unwrap();
    }
}

#[test]
fn overflow_is_checked_on_the_raw_gradient_as_pytorch_does() {
    // 1/2^-130 is inf in f32: unscaling first would turn finite gradients into inf.
    let tiny = f32::from_bits(1 << 19); // 2^-130, a subnormal
    assert!(tiny > 0.0 && (1.0 / tiny).is_infinite());
    let data = batches(3, 25);
    // PyTorch-style.
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), quiet(OptLevel::O1)).unwrap();
    let mut scaler = GradScaler::with_params(tiny, 2.0, 0.5, 1, true).unwrap();
    for (i, (x, y)) in data.iter().enumerate() {
        let g = grads_of(&model, &scaler, x, y);
        assert!(
            !scaler.step(&mut opt, &g).unwrap().is_skipped(),
            "step {i} is clean, as in PyTorch"
        );
        scaler.update(None).unwrap();
    }
    assert_eq!(scaler.get_scale(), tiny * 8.0, "three clean steps, interval 1");
    assert!(store_values(amp.store()).values().flatten().all(|v| v.is_finite()));
    // Apex-style with PyTorch's bounds.
    let cfg = quiet(OptLevel::O2)
        .min_loss_scale(0.0)
        .max_loss_scale(f32::INFINITY)
        .loss_scale(LossScaleSpec::Dynamic)
        .dynamic(DynamicParams {
            init_scale: tiny,
            growth_interval: 1,
            ..Default::default()
        });
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), cfg).unwrap();
    for (x, y) in &data {
        let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
        let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert!(!report.found_inf, "{report:?}");
        assert!(!opt.step().unwrap().is_skipped());
        opt.zero_grad();
    }
    assert_eq!(amp.loss_scale(0).unwrap(), tiny * 8.0);
    assert!(store_values(amp.store()).values().flatten().all(|v| v.is_finite()));
}

#[test]
fn scopes_dropped_out_of_order_restore_correctly() {
    let amp = amp::Amp::new(quiet(OptLevel::O1), &common::device()).unwrap();
    {
        let a = amp.autocast();
        let d = autocast::disable();
        assert!(!autocast::is_enabled());
        drop(a);
        assert!(!autocast::is_enabled(), "the disable scope is still open");
        drop(d);
    }
    assert!(!autocast::is_enabled(), "both scopes are closed");
    assert!(autocast::current().is_none());
    {
        let d = autocast::disable();
        let a = amp.autocast();
        drop(d);
        assert!(autocast::is_enabled(), "the run's scope is still open");
        drop(a);
    }
    assert!(autocast::current().is_none());
    drop(amp);
}

/// SGD that fails on one parameter while armed (a device error, say).
struct Flaky {
    inner: Sgd,
    fail_on: Option<&'static str>,
}

impl Optimizer for Flaky {
    fn name(&self) -> &'static str {
        "sgd"
    }
    fn defaults(&self) -> amp::optim::GroupHyper {
        self.inner.defaults()
    }
    fn update(&mut self, p: &ParamUpdate<'_>) -> amp::Result<Tensor> {
        if self.fail_on == Some(p.name) {
            self.fail_on = None;
            return Err(AmpError::Candle(candle_core::Error::Msg("device error".into())));
        }
        self.inner.update(p)
    }
    fn state_dict(&self) -> amp::Result<OptimizerState> {
        self.inner.state_dict()
    }
    fn load_state_dict(&mut self, s: &OptimizerState) -> amp::Result<()> {
        self.inner.load_state_dict(s)
    }
}

#[test]
fn a_failed_step_changes_nothing_and_a_retry_applies_it_once() {
    let momentum = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.1)
    };
    let flaky = Flaky {
        inner: Sgd::new(momentum).unwrap(),
        fail_on: Some("l2.weight"),
    };
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, flaky, quiet(OptLevel::O2)).unwrap();
    let (model_c, mut opt_c, amp_c) =
        common::initialize(TwoLinear::new, Sgd::new(momentum).unwrap(), quiet(OptLevel::O2)).unwrap();
    let (x, y) = batches(1, 26).remove(0);
    for (m, o, a) in [(&model, &mut opt, &amp), (&model_c, &mut opt_c, &amp_c)] {
        let loss = ops::mse(&m.forward(&x).unwrap(), &y).unwrap();
        a.scale_loss(&loss, o).unwrap().backward().unwrap();
    }
    let (w, bits, st) = (
        store_values(amp.store()),
        working_bits(amp.store()),
        opt.state_dict().unwrap(),
    );
    assert!(opt.step().is_err());
    assert_eq!(store_values(amp.store()), w, "masters untouched");
    assert_eq!(working_bits(amp.store()), bits, "working weights untouched");
    assert_eq!(opt.state_dict().unwrap(), st, "optimizer state untouched");
    assert!(!opt.step().unwrap().is_skipped(), "the retry steps");
    opt_c.step().unwrap();
    assert_eq!(
        store_values(amp.store()),
        store_values(amp_c.store()),
        "applied exactly once"
    );
    assert_eq!(
        opt.state_dict().unwrap().algorithm,
        opt_c.state_dict().unwrap().algorithm
    );
}

#[test]
fn grad_scaler_accumulates_micro_batches_like_one_full_batch() {
    let (x, y) = batches(1, 27).remove(0);
    let halves = [
        (x.narrow(0, 0, 8).unwrap(), y.narrow(0, 0, 8).unwrap()),
        (x.narrow(0, 8, 8).unwrap(), y.narrow(0, 8, 8).unwrap()),
    ];
    let (model, mut opt, amp) = common::initialize(TwoLinear::new, sgd(0.1), quiet(OptLevel::O1)).unwrap();
    let vm = f32_copy(amp.store());
    let control = TwoLinear::new(vb_of(&vm)).unwrap();
    let mut scaler = GradScaler::with_params(1024.0, 2.0, 0.5, 1, true).unwrap();
    for round in 0..2 {
        for (i, (hx, hy)) in halves.iter().enumerate() {
            let loss = (ops::mse(&model.forward(hx).unwrap(), hy).unwrap() / 2.0).unwrap();
            let g = scaler.scale(&loss).unwrap().backward().unwrap();
            if i == 0 {
                scaler.accumulate(&mut opt, &g).unwrap();
            } else {
                assert!(!scaler.step(&mut opt, &g).unwrap().is_skipped());
            }
        }
        assert_eq!(opt.micro_batches(), 0, "the step consumed both micro-batches");
        scaler.update(None).unwrap();
        opt.zero_grad();
        let mut c = candle_nn::SGD::new(vm.all_vars(), 0.1).unwrap();
        c.step(&mse(&control, &x, &y).backward().unwrap()).unwrap();
        let d = max_rel_diff(&store_values(amp.store()), &varmap_values(&vm), 1e-3);
        assert!(d < 1e-5, "round {round}: {d}");
    }
    assert_eq!(scaler.get_scale(), 4096.0, "one update per step, interval 1");
    // An overflow in the first micro-batch skips the whole step.
    let before = store_values(amp.store());
    let w = amp.store().param("l1.weight").unwrap().working().clone();
    for (i, (hx, hy)) in halves.iter().enumerate() {
        let loss = ops::mse(&model.forward(hx).unwrap(), hy).unwrap();
        let mut g = scaler.scale(&loss).unwrap().backward().unwrap();
        if i == 0 {
            let bad = (g.get(&w).unwrap() * f64::NAN).unwrap();
            g.insert(&w, bad);
            assert!(scaler.accumulate(&mut opt, &g).unwrap().found_inf);
        } else {
            assert!(scaler.step(&mut opt, &g).unwrap().is_skipped());
        }
    }
    scaler.update(None).unwrap();
    assert_eq!(store_values(amp.store()), before);
    assert_eq!(scaler.get_scale(), 2048.0);
}
