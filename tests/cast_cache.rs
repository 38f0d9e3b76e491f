//! The O1 cast cache (issue 5): casts are served across steps while a weight is unchanged,
//! never after it changed (optimizer steps, `ParamStore` writes, a user's own `Var::set`),
//! the cache stays bounded, and no lock is held across a cast (rayon workers that re-enter
//! the policy through work stealing must not deadlock).
//!
//! On `common::device()`, except the rayon test: work stealing inside the CPU cast is its
//! subject, so its tensors stay on the CPU.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use candle_amp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, LossScaleSpec, OptLevel, autocast, ops};
use candle_core::{DType, Device, Module, Tensor, Var};
use common::*;

fn o1() -> amp::Amp {
    let cfg = AmpConfig::new(OptLevel::O1)
        .loss_scale(LossScaleSpec::Static(4.0))
        .verbosity(0);
    amp::Amp::new(cfg, &common::device()).unwrap()
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u64 * 2_654_435_761 + seed * 97) % 1000) as f32 - 500.0) / 4096.0)
        .collect()
}

/// What the layer must compute: the same kernel on a fresh half cast of the current f32
/// weight (a stale cached cast gives a different output).
fn fresh(x: &Tensor, w: &Tensor) -> Vec<f32> {
    let h = |t: &Tensor| t.to_dtype(DType::F16).unwrap();
    flat(&amp::kernels::linear(&h(x), &h(&w.copy().unwrap()), None).unwrap())
}

/// Runs `f` on its own thread and fails the test if it has not finished within `secs` (a
/// deadlock fails instead of hanging the suite).
fn within(secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("did not finish within {secs} s: deadlock"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the work panicked"),
    }
}

/// On the CPU whatever the test device: the deadlock it guards against is in the CPU cast's
/// rayon workers.
#[test]
fn rayon_tasks_entering_one_runs_policy_do_not_deadlock() {
    let amp = o1();
    let policy = {
        let _s = amp.autocast();
        autocast::current().unwrap()
    };
    within(60, move || {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        let x = Tensor::ones((2, 512), DType::F32, &Device::Cpu).unwrap();
        pool.install(|| {
            use rayon::prelude::*;
            (0..200).into_par_iter().for_each(|i| {
                let _g = policy.enter();
                // A new 512 x 512 weight per task: every cast misses, and 262144 values go
                // parallel inside the cast (the worker may steal another task meanwhile).
                let w = Var::from_tensor(&Tensor::full(i as f32 / 200.0, (512, 512), &Device::Cpu).unwrap()).unwrap();
                let lin = amp::nn::Linear::new(w.as_tensor().clone(), None);
                let y = lin.forward(&x).unwrap();
                assert_eq!(y.dtype(), DType::F16);
                // The same weight again: served from the cache (or cast again), never wrong.
                let again = lin.forward(&x).unwrap();
                assert_eq!(flat(&y), flat(&again));
            });
        });
    });
}

/// A two-layer O1 model: `a` frozen, `b` trained.
fn frozen_and_trained(amp: &amp::Amp) -> amp::AmpModel<(amp::nn::Linear, amp::nn::Linear)> {
    let m = amp
        .model(|vb| {
            Ok((
                amp::nn::linear_no_bias(8, 8, vb.pp("a"))?,
                amp::nn::linear_no_bias(8, 8, vb.pp("b"))?,
            ))
        })
        .unwrap();
    assert_eq!(amp.store().set_frozen(|n| n.starts_with("a."), true), 1);
    m
}

#[test]
fn an_unchanged_weight_is_served_from_the_cache_in_the_next_step() {
    let amp = o1();
    let model = frozen_and_trained(&amp);
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
    let (x, y) = batches(1, 3).remove(0);
    for step in 0..3 {
        let (_, hits) = amp.cast_cache_stats();
        let out = {
            let _s = amp.autocast();
            let h = model.inner().0.forward(&x).unwrap();
            model.inner().1.forward(&h).unwrap()
        };
        let (cached, now) = amp.cast_cache_stats();
        assert_eq!(cached, 2, "step {step}");
        // Step 0 casts both; later steps cast only the trained weight again.
        let expect = if step == 0 { hits } else { hits + 1 };
        assert_eq!(now, expect, "step {step}: the frozen weight's cast is reused");
        let loss = ops::mse(&out, &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert_eq!(
            amp.cast_cache_stats().0,
            2,
            "kept across scale_loss (both used this step)"
        );
        assert!(!opt.step().unwrap().is_skipped());
        opt.zero_grad();
    }
}

#[test]
fn entries_not_used_in_a_step_are_dropped_and_the_cache_is_bounded() {
    let amp = o1();
    let model = amp.model(|vb| amp::nn::linear_no_bias(8, 8, vb.pp("a"))).unwrap();
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
    let (x, y) = batches(1, 4).remove(0);
    {
        let _s = amp.autocast();
        // Many temporary weights, each cast once and dropped: the cache must not keep them.
        for i in 0..3000 {
            let w = Var::from_vec(values(64, i), (8, 8), &common::device()).unwrap();
            let _ = ops::linear(&x, w.as_tensor(), None).unwrap();
        }
        assert!(
            amp.cast_cache_stats().0 <= 1024,
            "bounded within a step: {} entries",
            amp.cast_cache_stats().0
        );
    }
    // Two steps: the first used the temporaries too; the second only the model's weight.
    for step in 0..2 {
        let out = model.forward(&x).unwrap();
        let loss = ops::mse(&out, &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert!(amp.cast_cache_stats().0 <= 1024, "step {step}");
    }
    assert_eq!(
        amp.cast_cache_stats().0,
        1,
        "only the model's weight, used in the last step, is kept"
    );
}

/// Trains an O1 two-layer model with `algo` and checks at every step that the forward used
/// casts of the current weights, and that the second use of a weight hit the cache.
fn never_stale_after_steps(algo: amp::optim::AdamW, what: &str) {
    never_stale_with(|amp| amp.optimizer(algo).unwrap(), what)
}

fn never_stale_with(make: impl FnOnce(&amp::Amp) -> amp::AmpOptimizer, what: &str) {
    let amp = o1();
    let model = amp.model(|vb| amp::nn::linear_no_bias(8, 8, vb.pp("shared"))).unwrap();
    let mut opt = make(&amp);
    for (step, (x, y)) in batches(4, 5).iter().enumerate() {
        let w = amp.store().param("shared.weight").unwrap().working().clone();
        let (_, hits) = amp.cast_cache_stats();
        let out = {
            let _s = amp.autocast();
            let h = model.inner().forward(x).unwrap();
            assert_eq!(flat(&h), fresh(x, &w), "{what} step {step}: first use");
            model.inner().forward(&h).unwrap()
        };
        assert_eq!(
            amp.cast_cache_stats().1,
            hits + 1,
            "{what} step {step}: second use hits"
        );
        amp.scale_loss(&ops::mse(&out, y).unwrap(), &mut opt)
            .unwrap()
            .backward()
            .unwrap();
        assert!(!opt.step().unwrap().is_skipped());
        opt.zero_grad();
    }
}

#[test]
fn no_stale_cast_after_fused_and_unfused_optimizer_steps() {
    for fused in [true, false] {
        let cfg = AdamWConfig {
            lr: 0.05,
            fused,
            ..Default::default()
        };
        never_stale_after_steps(AdamW::new(cfg).unwrap(), &format!("adamw fused={fused}"));
        let sgd = SgdConfig {
            fused,
            momentum: 0.5,
            ..SgdConfig::new(0.1)
        };
        never_stale_with(
            |amp| amp.optimizer(Sgd::new(sgd).unwrap()).unwrap(),
            &format!("sgd fused={fused}"),
        );
    }
}

#[test]
fn a_step_that_changes_one_element_is_not_served_stale() {
    // y = x w^T with x one-hot at column 5 and a loss on output 0 only: SGD changes the one
    // element w[0, 5], which a sampled check need not look at; the optimizer's write must.
    for fused in [true, false] {
        let amp = o1();
        let model = amp.model(|vb| amp::nn::linear_no_bias(64, 64, vb.pp("l"))).unwrap();
        let sgd = SgdConfig {
            fused,
            ..SgdConfig::new(1.0)
        };
        let mut opt = amp.optimizer(Sgd::new(sgd).unwrap()).unwrap();
        let mut xv = vec![0f32; 2 * 64];
        xv[5] = 1.0;
        xv[64 + 5] = 1.0;
        let x = Tensor::from_vec(xv, (2, 64), &common::device()).unwrap();
        let w = amp.store().param("l.weight").unwrap().working().clone();
        for step in 0..3 {
            let before = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let out = model.forward(&x).unwrap();
            assert_eq!(flat(&out), fresh(&x, &w), "fused={fused} step {step}");
            let loss = ops::sum_all(&out.narrow(1, 0, 1).unwrap()).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            let after = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let changed: Vec<usize> = (0..before.len()).filter(|&i| before[i] != after[i]).collect();
            assert_eq!(changed, vec![5], "fused={fused}: one element changed");
        }
    }
}

#[test]
fn no_stale_cast_after_param_store_writes() {
    let amp = o1();
    let model = amp.model(|vb| amp::nn::linear_no_bias(64, 64, vb.pp("l"))).unwrap();
    let x = Tensor::ones((2, 64), DType::F32, &common::device()).unwrap();
    let w = amp.store().param("l.weight").unwrap().working().clone();
    let _ = model.forward(&x).unwrap();
    for (i, k) in [1usize, 777, 4000].into_iter().enumerate() {
        // One element changed: only the store's write tells the cache.
        let mut v = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[k] += 0.5;
        let t = Tensor::from_vec(v, (64, 64), &common::device()).unwrap();
        amp.store().write_f32("l.weight", &t).unwrap();
        assert_eq!(flat(&model.forward(&x).unwrap()), fresh(&x, &w), "write {i}");
    }
}

#[test]
fn a_users_direct_var_set_is_detected_or_invalidated_explicitly() {
    let _s = autocast::scope(DType::F16);
    let w = Var::from_vec(values(64 * 64, 1), (64, 64), &common::device()).unwrap();
    let x = Tensor::ones((2, 64), DType::F32, &common::device()).unwrap();
    let y = |w: &Var| flat(&ops::linear(&x, w.as_tensor(), None).unwrap());
    let _ = y(&w);
    // New values everywhere (loading weights, a candle optimizer): the sampled check sees it.
    w.set(&Tensor::from_vec(values(64 * 64, 2), (64, 64), &common::device()).unwrap())
        .unwrap();
    assert_eq!(y(&w), fresh(&x, w.as_tensor()), "all values rewritten");
    // One element changed by the user: guaranteed once they invalidate it.
    let mut v = values(64 * 64, 2);
    v[1234] = 3.0;
    w.set(&Tensor::from_vec(v, (64, 64), &common::device()).unwrap())
        .unwrap();
    autocast::invalidate(w.as_tensor());
    assert_eq!(y(&w), fresh(&x, w.as_tensor()), "one element, invalidated");
    let mut v = values(64 * 64, 2);
    v[99] = -3.0;
    w.set(&Tensor::from_vec(v, (64, 64), &common::device()).unwrap())
        .unwrap();
    autocast::invalidate_all();
    assert_eq!(y(&w), fresh(&x, w.as_tensor()), "one element, everything invalidated");
}

/// The device path's rule (a GPU's; the CPU's when the path is forced): a run's parameter
/// casts are cached and checked by write generation alone, reading no parameter value (a
/// sampled read per lookup would be a host synchronisation on a GPU, where issue 38 found the
/// cache never hit). So an unchanged weight is served from the cache, every write the run
/// makes is seen, and a write behind its back is seen once `autocast::invalidate` says so.
#[test]
fn on_the_device_path_a_runs_casts_are_checked_by_write_generation_alone() {
    let cfg = AmpConfig::new(OptLevel::O1)
        .loss_scale(LossScaleSpec::Static(4.0))
        .verbosity(0)
        .device_path(true);
    let amp = amp::Amp::new(cfg, &common::device()).unwrap();
    assert!(amp.device_path());
    let model = amp.model(|vb| amp::nn::linear_no_bias(64, 64, vb.pp("l"))).unwrap();
    let w = amp.store().param("l.weight").unwrap().working().clone();
    let x = Tensor::ones((2, 64), DType::F32, &common::device()).unwrap();
    let forward = || {
        let _s = amp.autocast();
        flat(&model.inner().forward(&x).unwrap())
    };
    let first = forward();
    assert_eq!(first, fresh(&x, &w));
    let (cached, hits) = amp.cast_cache_stats();
    assert_eq!(cached, 1, "the weight's cast is cached");
    assert_eq!(forward(), first);
    assert_eq!(
        amp.cast_cache_stats(),
        (1, hits + 1),
        "unchanged: served from the cache"
    );
    // Every value rewritten behind the run's back: nothing is read, so nothing is seen...
    let var = Var::from_tensor(&w).unwrap();
    var.set(&(w.copy().unwrap() * 2.0).unwrap()).unwrap();
    assert_eq!(forward(), first, "a write the run is not told about is not seen");
    // ...until the writer says so.
    autocast::invalidate(&w);
    assert_eq!(forward(), fresh(&x, &w), "invalidated: cast again");
    // The run's own writes bump the generation.
    let v = (w.copy().unwrap() * 0.5).unwrap();
    amp.store().write_f32("l.weight", &v).unwrap();
    assert_eq!(forward(), fresh(&x, &w), "after ParamStore::write_f32");
}
