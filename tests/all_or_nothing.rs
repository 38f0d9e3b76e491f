//! Error paths are all or nothing: a backward that fails (a communicator timing out while
//! the overflow verdict is combined) leaves every master gradient, flag and counter as it
//! was and can be retried; an optimizer step whose update returns the parameter itself
//! writes nothing twice; `GradScaler::unscale` adds a backward's gradients exactly once,
//! enabled or not, and a retry after a failed reduction does not add them again.
//!
//! On the CPU: the failing communicator is a `LocalGroup` (threads in this process), and
//! the buffers compared are read bit for bit.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use candle_amp::distributed::{Communicator, LocalComm, LocalGroup, StepGrads, StepReducer};
use candle_amp::optim::{OptimizerState, ParamUpdate, Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, DistErrorKind, GradReducer, GradScaler, OptLevel, ops};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use common::{TwoLinear, batches, f32_bits, flat};

fn bits(t: &Tensor) -> Vec<u32> {
    flat(t).into_iter().map(f32::to_bits).collect()
}

/// Everything a backward may change in an optimizer, as bits.
#[derive(Debug, PartialEq)]
struct Seen {
    grads: BTreeMap<String, Vec<u32>>,
    micro_batches: u32,
    found_inf: bool,
    state: serde_json::Value,
    weights: BTreeMap<String, Vec<u32>>,
}

fn seen(amp: &amp::Amp, opt: &amp::AmpOptimizer) -> Seen {
    Seen {
        grads: opt.master_grads().iter().map(|(k, t)| (k.clone(), bits(t))).collect(),
        micro_batches: opt.micro_batches(),
        found_inf: opt.found_inf(),
        state: serde_json::to_value(opt.state_dict().unwrap()).unwrap(),
        weights: f32_bits(amp.store()),
    }
}

/// A stage-2 reducer whose verdict exchange goes to a `LocalGroup` rank whose peer never
/// calls, while `stall` is set (the exchange then times out); otherwise the local verdict.
struct Stalling {
    comm: LocalComm,
    stall: AtomicBool,
}

impl GradReducer for Stalling {
    fn reduce(&self, _grads: &mut GradStore, _params: &[(String, Var)]) -> amp::Result<()> {
        Ok(())
    }

    fn reduce_found_inf(&self, found_inf: bool) -> amp::Result<bool> {
        if !self.stall.load(Ordering::Relaxed) {
            return Ok(found_inf);
        }
        let mut flag = [f32::from(u8::from(found_inf))];
        self.comm.all_reduce_sum(&mut flag)?;
        Ok(flag[0] > 0.0)
    }
}

fn sgd() -> Sgd {
    Sgd::new(SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.1)
    })
    .unwrap()
}

#[test]
fn a_backward_that_times_out_changes_nothing_and_can_be_retried() {
    for level in [OptLevel::O0, OptLevel::O2, OptLevel::O3] {
        for device_path in [false, true] {
            let what = format!("{level} device_path={device_path}");
            let config = || AmpConfig::new(level).verbosity(0).device_path(device_path);
            let (model, mut opt, amp) = amp::initialize_on(TwoLinear::new, sgd(), config(), &common::device()).unwrap();
            let (c_model, mut c_opt, c_amp) =
                amp::initialize_on(TwoLinear::new, sgd(), config(), &common::device()).unwrap();
            let mut ranks = LocalGroup::with_timeout(2, Duration::from_millis(30));
            let _silent_peer = ranks.pop();
            let reducer = Arc::new(Stalling {
                comm: ranks.pop().unwrap(),
                stall: AtomicBool::new(false),
            });
            amp.set_grad_reducer(Some(reducer.clone()));
            let data = batches(5, 77);
            let backward = |amp: &amp::Amp, model: &amp::AmpModel<TwoLinear>, opt: &mut amp::AmpOptimizer, i: usize| {
                let (x, y) = &data[i];
                let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
                amp.scale_loss(&loss, opt).unwrap().backward()
            };
            // A step, so that the momentum exists and the master-gradient buffers are spares.
            for (amp, model, opt) in [(&amp, &model, &mut opt), (&c_amp, &c_model, &mut c_opt)] {
                backward(amp, model, opt, 0).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            }
            // A failed first micro-batch (into the spare buffers), then a failed second one
            // (which would add into the live master gradients in place).
            for micro in [1, 2] {
                let before = seen(&amp, &opt);
                reducer.stall.store(true, Ordering::Relaxed);
                let e = backward(&amp, &model, &mut opt, micro).unwrap_err();
                // The first exchange times out; the group has failed for the second.
                let kind = if micro == 1 {
                    DistErrorKind::Timeout
                } else {
                    DistErrorKind::Backend
                };
                assert!(
                    matches!(e, AmpError::Distributed { kind: k, .. } if k == kind),
                    "{what}: {e}"
                );
                assert_eq!(
                    seen(&amp, &opt),
                    before,
                    "{what}: micro-batch {micro} failed and changed nothing"
                );
                // The retry applies it once.
                reducer.stall.store(false, Ordering::Relaxed);
                backward(&amp, &model, &mut opt, micro).unwrap();
                backward(&c_amp, &c_model, &mut c_opt, micro).unwrap();
                assert_eq!(
                    seen(&amp, &opt),
                    seen(&c_amp, &c_opt),
                    "{what}: retried micro-batch {micro}"
                );
            }
            assert_eq!(opt.micro_batches(), 2, "{what}");
            opt.step().unwrap();
            c_opt.step().unwrap();
            assert_eq!(f32_bits(amp.store()), f32_bits(c_amp.store()), "{what}: the same step");
        }
    }
}

/// An SGD whose update of `frozen_name` returns the parameter itself (an identity update).
struct Identity {
    inner: Sgd,
    identity: &'static str,
}

impl amp::optim::Optimizer for Identity {
    fn name(&self) -> &'static str {
        "identity-sgd"
    }
    fn defaults(&self) -> amp::optim::GroupHyper {
        self.inner.defaults()
    }
    fn update(&mut self, p: &ParamUpdate<'_>) -> amp::Result<Tensor> {
        if p.name == self.identity {
            return Ok(p.var.as_tensor().clone());
        }
        self.inner.update(p)
    }
    fn state_dict(&self) -> amp::Result<OptimizerState> {
        let mut s = self.inner.state_dict()?;
        s.kind = self.name().into();
        Ok(s)
    }
    fn load_state_dict(&mut self, state: &OptimizerState) -> amp::Result<()> {
        let mut s = state.clone();
        s.kind = self.inner.name().into();
        self.inner.load_state_dict(&s)
    }
}

#[test]
fn an_identity_update_is_written_like_any_other() {
    for level in [OptLevel::O0, OptLevel::O2] {
        let identity = Identity {
            inner: Sgd::new(SgdConfig::new(0.1)).unwrap(),
            identity: "l2.weight",
        };
        let (model, mut opt, amp) = amp::initialize_on(
            TwoLinear::new,
            identity,
            AmpConfig::new(level).verbosity(0),
            &common::device(),
        )
        .unwrap();
        let before = f32_bits(amp.store());
        let (x, y) = &batches(1, 78)[0];
        let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        let grads: BTreeMap<String, Vec<f32>> = opt.master_grads().iter().map(|(k, t)| (k.clone(), flat(t))).collect();
        assert!(!opt.step().unwrap().is_skipped(), "{level}: the step succeeds");
        let after = f32_bits(amp.store());
        assert_eq!(
            after["l2.weight"], before["l2.weight"],
            "{level}: the identity update keeps the value"
        );
        for (name, g) in &grads {
            if name == "l2.weight" {
                continue;
            }
            let want: Vec<f32> = before[name]
                .iter()
                .zip(g)
                .map(|(w, g)| f32::from_bits(*w) - 0.1f32 * g)
                .collect();
            let got: Vec<f32> = after[name].iter().map(|b| f32::from_bits(*b)).collect();
            // Bit for bit with the CPU kernels; a device's kernels may fuse the multiply-add.
            common::assert_close(
                &got,
                &want,
                common::exact_or_te(DType::F32),
                &format!("{level}: {name} stepped once"),
            );
        }
    }
}

fn grads_of(model: &amp::AmpModel<TwoLinear>, scaler: &GradScaler, i: usize) -> GradStore {
    let (x, y) = &batches(i + 1, 79)[i];
    let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap()
}

#[test]
fn a_disabled_scalers_second_unscale_adds_nothing() {
    let (model, mut opt, amp) = amp::initialize_on(
        TwoLinear::new,
        sgd(),
        AmpConfig::new(OptLevel::O0).verbosity(0),
        &common::device(),
    )
    .unwrap();
    let (c_model, mut c_opt, _c_amp) = amp::initialize_on(
        TwoLinear::new,
        sgd(),
        AmpConfig::new(OptLevel::O0).verbosity(0),
        &common::device(),
    )
    .unwrap();
    let mut off = GradScaler::with_params(65536.0, 2.0, 0.5, 2000, false).unwrap();
    let mut c_off = GradScaler::with_params(65536.0, 2.0, 0.5, 2000, false).unwrap();
    let g = grads_of(&model, &off, 0);
    off.unscale(&mut opt, &g).unwrap();
    let once: BTreeMap<String, Vec<u32>> = opt.master_grads().iter().map(|(k, t)| (k.clone(), bits(t))).collect();
    // PyTorch's disabled `unscale_` is a no-op: the second call adds nothing, and the step
    // applies the gradients once.
    off.unscale(&mut opt, &g).unwrap();
    let twice: BTreeMap<String, Vec<u32>> = opt.master_grads().iter().map(|(k, t)| (k.clone(), bits(t))).collect();
    assert_eq!(twice, once, "the second unscale added nothing");
    assert_eq!(opt.micro_batches(), 1);
    off.step(&mut opt, &g).unwrap();
    off.update(None).unwrap();
    c_off.step(&mut c_opt, &grads_of(&c_model, &c_off, 0)).unwrap();
    c_off.update(None).unwrap();
    assert_eq!(f32_bits(amp.store()), f32_bits(_c_amp.store()), "applied once");
    // An enabled scaler refuses a second unscale, as PyTorch does.
    let mut on = GradScaler::new();
    opt.zero_grad();
    let g = grads_of(&model, &on, 1);
    on.unscale(&mut opt, &g).unwrap();
    assert!(matches!(on.unscale(&mut opt, &g), Err(AmpError::CallOrder { .. })));
    assert_eq!(opt.micro_batches(), 1);
}

/// A step reducer that fails while `fail` is set, and leaves the gradients as they are
/// otherwise (one process).
struct Flaky {
    fail: AtomicBool,
}

impl StepReducer for Flaky {
    fn reduce_step(&self, _step: StepGrads<'_>) -> amp::Result<()> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(AmpError::InvalidArgument {
                argument: "step",
                reason: "the reduction failed (test)".into(),
            });
        }
        Ok(())
    }
}

#[test]
fn an_unscale_retried_after_its_reduction_failed_adds_the_gradients_once() {
    for enabled in [true, false] {
        let config = || AmpConfig::new(OptLevel::O1).verbosity(0);
        let (model, mut opt, amp) = amp::initialize_on(TwoLinear::new, sgd(), config(), &common::device()).unwrap();
        let (c_model, mut c_opt, c_amp) =
            amp::initialize_on(TwoLinear::new, sgd(), config(), &common::device()).unwrap();
        let flaky = Arc::new(Flaky {
            fail: AtomicBool::new(true),
        });
        amp.set_step_reducer(Some(flaky.clone()));
        let mut scaler = GradScaler::with_params(1024.0, 2.0, 0.5, 2000, enabled).unwrap();
        let mut c_scaler = GradScaler::with_params(1024.0, 2.0, 0.5, 2000, enabled).unwrap();
        let g = grads_of(&model, &scaler, 0);
        assert!(scaler.unscale(&mut opt, &g).is_err());
        // Micro-batches may not join a half-finished unscale.
        assert!(matches!(
            scaler.accumulate(&mut opt, &g),
            Err(AmpError::CallOrder { .. })
        ));
        flaky.fail.store(false, Ordering::Relaxed);
        scaler.unscale(&mut opt, &g).unwrap();
        c_scaler.unscale(&mut c_opt, &grads_of(&c_model, &c_scaler, 0)).unwrap();
        let grads = |o: &amp::AmpOptimizer| -> BTreeMap<String, Vec<u32>> {
            o.master_grads().iter().map(|(k, t)| (k.clone(), bits(t))).collect()
        };
        assert_eq!(grads(&opt), grads(&c_opt), "enabled={enabled}: added once");
        scaler.step(&mut opt, &g).unwrap();
        c_scaler.step(&mut c_opt, &g).unwrap();
        scaler.update(None).unwrap();
        c_scaler.update(None).unwrap();
        assert_eq!(f32_bits(amp.store()), f32_bits(c_amp.store()), "enabled={enabled}");
        assert_eq!(scaler.get_scale(), c_scaler.get_scale());
    }
}

/// With a stage-2 reducer the verdict is combined before anything is written, so the sum a
/// second micro-batch will make in place is checked first, without writing: two finite
/// gradients whose sum overflows still skip the step, with every process agreeing.
#[test]
fn with_a_reducer_an_accumulated_overflow_is_found_before_the_write() {
    for (g, overflow) in [(2e38f32, true), (1e38, false)] {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).verbosity(0), &common::device()).unwrap();
        let w = amp
            .var_builder()
            .get_with_hints((1,), "w", candle_nn::Init::Const(1.0))
            .unwrap();
        let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(1e-38)).unwrap()).unwrap();
        let mut ranks = LocalGroup::with_timeout(1, Duration::from_secs(5));
        let reducer = Arc::new(Stalling {
            comm: ranks.pop().unwrap(),
            stall: AtomicBool::new(true),
        });
        amp.set_grad_reducer(Some(reducer));
        let before = f32_bits(amp.store());
        let loss = (w.sum_all().unwrap() * g as f64).unwrap();
        let first = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert!(!first.found_inf, "each gradient is finite");
        let second = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert_eq!(second.found_inf, overflow, "g = {g}");
        assert_eq!(opt.step().unwrap().is_skipped(), overflow, "g = {g}");
        let want = if overflow { f32::INFINITY } else { 2.0 * g };
        assert!(
            flat(&opt.master_grads()["w"]).iter().all(|v| *v == want),
            "g = {g}: the sum was written once"
        );
        if overflow {
            assert_eq!(f32_bits(amp.store()), before, "skipped");
        }
    }
}
