//! The device path (what a GPU runs: master gradients, optimizer state and overflow flags as
//! tensors on the parameters' device, the verdict read on the host once per step), forced on
//! the CPU, against the CPU path's fused kernels: the same weights up to f32 rounding, the
//! same skipped steps and loss-scale trajectory, and at most one host read per step.
//!
//! The device path runs on `common::device()` (forced there on the CPU), the CPU path on the
//! CPU always (it exists nowhere else): under `CANDLE_AMP_TEST_DEVICE=cuda` each comparison
//! is the GPU against the CPU, within [`path_tol`].

mod common;

use std::collections::BTreeMap;

use candle_amp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, DynamicParams, GradScaler, HalfType, LossScaleSpec, OptLevel, StepOutcome};
use candle_core::{DType, Device, Tensor};
use common::{AmpTwoLinear, batches, f32_bits, max_rel_diff, store_values};

/// The device a run on the device path (`true`) or the CPU path takes.
fn dev_for(device_path: bool) -> Device {
    if device_path { common::device() } else { Device::Cpu }
}

/// `t` on the device of `amp`'s parameters.
fn on(amp: &amp::Amp, t: &Tensor) -> Tensor {
    t.to_device(amp.store().device()).unwrap()
}

/// How far a run on the device path may end from the CPU path's after a few steps: f32
/// rounding on the CPU (the forced device path's tensor ops against the fused kernels); on a
/// GPU, other kernels (cuBLAS, other summation orders) compounded over the steps: the test
/// tolerance of the run's narrowest type.
fn path_tol(narrowest: DType) -> f32 {
    if common::on_cpu() { 1e-5 } else { common::tol(narrowest) }
}

#[derive(Clone, Copy, Debug)]
enum Algo {
    SgdMomentum,
    AdamW,
}

fn optimizer(amp: &amp::Amp, a: Algo) -> amp::AmpOptimizer {
    match a {
        Algo::SgdMomentum => amp.optimizer(
            Sgd::new(SgdConfig {
                momentum: 0.9,
                weight_decay: 0.01,
                ..SgdConfig::new(0.05)
            })
            .unwrap(),
        ),
        Algo::AdamW => amp.optimizer(
            AdamW::new(AdamWConfig {
                lr: 1e-2,
                ..Default::default()
            })
            .unwrap(),
        ),
    }
    .unwrap()
}

/// How a run clips its gradients.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Clip {
    None,
    /// `clip_grad_norm` (returns the norm: a host read on the device path).
    Read(f64),
    /// `clip_grad_norm_tensor` (no read).
    Tensor(f64),
}

/// What a run did: per step the outcome (skipped, scale after) and the nonfinite names, the
/// clip norms, the final f32 weights, the optimizer state and the host reads.
#[derive(Debug)]
struct Trace {
    outcomes: Vec<(bool, f32, Vec<String>)>,
    norms: Vec<f32>,
    weights: BTreeMap<String, Vec<f32>>,
    state: BTreeMap<String, Vec<f32>>,
    /// Per backward: what its report said (`found_inf`, `nonfinite`, `deferred`).
    reports: Vec<(bool, Vec<String>, bool)>,
    host_syncs: u64,
    steps: usize,
}

/// `steps` optimizer steps of two micro-batches each on the two-linear model, starting from a
/// scale (2^24) at which half gradients overflow, so the first steps skip; the loss of step
/// `nan_step` is NaN.
fn train(level: OptLevel, half: HalfType, a: Algo, device_path: bool, clip: Clip, nan_step: Option<usize>) -> Trace {
    let config = AmpConfig::new(level)
        .half(half)
        .verbosity(0)
        .device_path(device_path)
        .loss_scale(LossScaleSpec::Dynamic)
        .dynamic(DynamicParams {
            init_scale: 16_777_216.0,
            growth_interval: 3,
            ..Default::default()
        });
    let amp = amp::Amp::new(config, &dev_for(device_path)).unwrap();
    let model = amp.model(AmpTwoLinear::new).unwrap();
    let mut opt = optimizer(&amp, a);
    assert_eq!(amp.device_path(), device_path);
    let data: Vec<(Tensor, Tensor)> = batches(24, 7).iter().map(|(x, y)| (on(&amp, x), on(&amp, y))).collect();
    let steps = 12;
    let mut t = Trace {
        outcomes: Vec::new(),
        norms: Vec::new(),
        weights: BTreeMap::new(),
        state: BTreeMap::new(),
        reports: Vec::new(),
        host_syncs: 0,
        steps,
    };
    for s in 0..steps {
        for m in 0..2 {
            let (x, y) = &data[2 * s + m];
            let out = model.forward(x).unwrap().to_dtype(DType::F32).unwrap();
            let mut loss = (candle_nn::loss::mse(&out, y).unwrap() / 2.0).unwrap();
            if nan_step == Some(s) && m == 1 {
                loss = (loss * f64::NAN).unwrap();
            }
            let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            t.reports.push((report.found_inf, report.nonfinite, report.deferred));
        }
        match clip {
            Clip::None => {}
            Clip::Read(c) => t.norms.push(opt.clip_grad_norm(c).unwrap()),
            Clip::Tensor(c) => t
                .norms
                .push(opt.clip_grad_norm_tensor(c).unwrap().to_scalar::<f32>().unwrap()),
        }
        let before = f32_bits(amp.store());
        let outcome = opt.step().unwrap();
        if outcome.is_skipped() {
            assert_eq!(
                f32_bits(amp.store()),
                before,
                "a skipped step leaves the weights bit-identical"
            );
        }
        let names = match &outcome {
            StepOutcome::Skipped { nonfinite, .. } => nonfinite.clone(),
            StepOutcome::Stepped { .. } => Vec::new(),
        };
        t.outcomes.push((outcome.is_skipped(), outcome.loss_scale(), names));
        opt.zero_grad();
    }
    // Reading the norms back above is the test's, not the step path's: only the library's
    // reads are counted.
    t.host_syncs = amp.host_syncs();
    t.weights = store_values(amp.store());
    for (name, ps) in opt.state_dict().unwrap().algorithm.params {
        for (k, b) in ps.buffers {
            t.state.insert(
                format!("{name}.{k}"),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
        }
    }
    t
}

#[test]
fn device_path_equals_the_cpu_path_at_every_level() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            for a in [Algo::SgdMomentum, Algo::AdamW] {
                let what = format!("{level:?} {half:?} {a:?}");
                let cpu = train(level, half, a, false, Clip::None, Some(7));
                let dev = train(level, half, a, true, Clip::None, Some(7));
                assert_eq!(
                    dev.outcomes, cpu.outcomes,
                    "{what}: the same steps skip, the same scales"
                );
                assert!(
                    cpu.outcomes[7].0 && cpu.outcomes[7].2.contains(&"<loss>".to_string()),
                    "{what}: {:?}",
                    cpu.outcomes[7]
                );
                assert!(
                    cpu.outcomes.iter().filter(|o| !o.0).count() >= 4,
                    "{what}: {:?}",
                    cpu.outcomes
                );
                if matches!(level, OptLevel::O2 | OptLevel::O3) && half == HalfType::F16 {
                    assert!(cpu.outcomes[0].0, "{what}: half gradients overflow at 2^24");
                }
                let narrowest = if level == OptLevel::O0 {
                    DType::F32
                } else {
                    half.dtype()
                };
                let dw = max_rel_diff(&dev.weights, &cpu.weights, 1e-3);
                assert!(dw <= path_tol(narrowest), "{what}: weights differ by {dw}");
                let ds = max_rel_diff(&dev.state, &cpu.state, 1e-3);
                assert!(
                    ds <= 10.0 * path_tol(narrowest),
                    "{what}: optimizer state differs by {ds}"
                );
                assert_eq!(cpu.host_syncs, 0, "{what}: the CPU path reads no device");
                // Two micro-batches per step: one read per backward, none more at the step.
                assert_eq!(
                    dev.host_syncs,
                    2 * dev.steps as u64,
                    "{what}: one host read per backward"
                );
                // Each report is the verdict on both paths (the NaN loss's included).
                assert_eq!(dev.reports, cpu.reports, "{what}: the same reports");
                assert!(dev.reports.iter().all(|r| !r.2), "{what}: never deferred");
                assert!(dev.reports[2 * 7 + 1].0, "{what}: the NaN loss is reported at once");
            }
        }
    }
}

#[test]
fn device_path_clips_as_the_cpu_path() {
    for (clip, extra) in [(Clip::Read(0.05), 1), (Clip::Tensor(0.05), 0)] {
        let cpu = train(OptLevel::O2, HalfType::F16, Algo::AdamW, false, clip, None);
        let dev = train(OptLevel::O2, HalfType::F16, Algo::AdamW, true, clip, None);
        assert_eq!(dev.outcomes, cpu.outcomes, "{clip:?}");
        assert_eq!(dev.norms.len(), cpu.norms.len());
        for (d, c) in dev.norms.iter().zip(&cpu.norms) {
            assert!(
                (d == c) || (d.is_nan() && c.is_nan()) || (d - c).abs() <= path_tol(DType::F16) / 10.0 * c.abs(),
                "{clip:?}: norm {d} vs {c}"
            );
        }
        // The clip did clip (a norm above 0.05 on a clean step).
        assert!(
            cpu.norms.iter().zip(&cpu.outcomes).any(|(n, o)| !o.0 && *n > 0.05),
            "{:?}",
            cpu.norms
        );
        let dw = max_rel_diff(&dev.weights, &cpu.weights, 1e-3);
        assert!(dw <= path_tol(DType::F16), "{clip:?}: weights differ by {dw}");
        assert_eq!(dev.host_syncs, (2 + extra) * dev.steps as u64, "{clip:?}");
    }
}

/// A one-parameter O0 run on the device path (`w` = 1, SGD with a tiny learning rate).
fn one_param(device_path: bool) -> (amp::Amp, Tensor, amp::AmpOptimizer) {
    let config = AmpConfig::new(OptLevel::O0).verbosity(0).device_path(device_path);
    let amp = amp::Amp::new(config, &dev_for(device_path)).unwrap();
    let w = amp
        .var_builder()
        .get_with_hints((1,), "w", candle_nn::Init::Const(1.0))
        .unwrap();
    let opt = amp.optimizer(Sgd::new(SgdConfig::new(1e-38)).unwrap()).unwrap();
    (amp, w, opt)
}

#[test]
fn device_path_checks_the_accumulated_sum() {
    let (amp, w, mut opt) = one_param(true);
    let before = f32_bits(amp.store());
    for i in 0..2u64 {
        let loss = (w.sum_all().unwrap() * 2e38).unwrap();
        let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        // Each backward reads its flags (one read) and reports the verdict: the first
        // gradient is finite, the sum of the two overflows.
        assert!(!report.deferred);
        assert_eq!(report.found_inf, i == 1, "backward {i}");
        let names: &[&str] = if i == 1 { &["w"] } else { &[] };
        assert_eq!(report.nonfinite, names, "backward {i}");
        assert_eq!(amp.host_syncs(), i + 1);
    }
    // Asking before the step, and the step itself, reuse what the backwards read.
    assert!(opt.found_inf());
    match opt.step().unwrap() {
        StepOutcome::Skipped { nonfinite, .. } => assert_eq!(nonfinite, ["w"]),
        other => panic!("2e38 + 2e38 overflows: the step must skip, got {other:?}"),
    }
    assert_eq!(amp.host_syncs(), 2);
    assert_eq!(f32_bits(amp.store()), before);
    assert_eq!((opt.steps(), opt.skipped_steps()), (0, 1));
    opt.zero_grad();
    // A finite step afterwards applies.
    let loss = (w.sum_all().unwrap() * 1e38).unwrap();
    amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
    assert_eq!(opt.step().unwrap(), StepOutcome::Stepped { loss_scale: 1.0 });
    let w1 = common::flat(&amp.store().param("w").unwrap().f32_value().unwrap())[0];
    assert!((w1 - 0.0).abs() < 1e-6, "1 - 1e-38 * 1e38 = 0, got {w1}");
    assert_eq!(amp.host_syncs(), 3);
}

#[test]
fn grad_scaler_on_the_device_path_equals_the_cpu_path() {
    let run = |device_path: bool| {
        let config = AmpConfig::new(OptLevel::O1).verbosity(0).device_path(device_path);
        let amp = amp::Amp::new(config, &dev_for(device_path)).unwrap();
        let model = amp.model(AmpTwoLinear::new).unwrap();
        let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.05)).unwrap()).unwrap();
        let mut scaler = GradScaler::new();
        let mut outcomes = Vec::new();
        for (i, (x, y)) in batches(8, 3).iter().enumerate() {
            let (x, y) = (&on(&amp, x), &on(&amp, y));
            let out = model.forward(x).unwrap().to_dtype(DType::F32).unwrap();
            let mut loss = candle_nn::loss::mse(&out, y).unwrap();
            if i == 2 {
                loss = (loss * f64::INFINITY).unwrap();
            }
            let grads = scaler.scale(&loss).unwrap().backward().unwrap();
            let o = scaler.step(&mut opt, &grads).unwrap();
            scaler.update(None).unwrap();
            opt.zero_grad();
            outcomes.push((o.is_skipped(), scaler.get_scale()));
        }
        (outcomes, store_values(amp.store()), amp.host_syncs())
    };
    let (co, cw, cs) = run(false);
    let (dout, dw, ds) = run(true);
    assert_eq!(dout, co);
    assert!(co[2].0 && co.iter().filter(|o| o.0).count() == 1, "{co:?}");
    assert!(max_rel_diff(&dw, &cw, 1e-3) <= path_tol(DType::F16));
    assert_eq!((cs, ds), (0, 8));
}

#[test]
fn device_path_state_round_trips() {
    // Optimizer state saved on the device path (on the test device) loads into a CPU-path
    // optimizer (on the CPU) and the two continue alike.
    let cfg = |dp: bool| AmpConfig::new(OptLevel::O2).verbosity(0).device_path(dp);
    let data = batches(6, 11);
    let step = |amp: &amp::Amp, model: &amp::AmpModel<AmpTwoLinear>, opt: &mut amp::AmpOptimizer, i: usize| {
        let (x, y) = (on(amp, &data[i].0), on(amp, &data[i].1));
        let out = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
        let loss = candle_nn::loss::mse(&out, &y).unwrap();
        amp.scale_loss(&loss, opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    };
    let build = |dp: bool| {
        let amp = amp::Amp::new(cfg(dp), &dev_for(dp)).unwrap();
        let model = amp.model(AmpTwoLinear::new).unwrap();
        let opt = amp.optimizer(AdamW::new(AdamWConfig::default()).unwrap()).unwrap();
        (amp, model, opt)
    };
    let (da, dm, mut dopt) = build(true);
    for i in 0..3 {
        step(&da, &dm, &mut dopt, i);
    }
    let saved = dopt.state_dict().unwrap();
    let (ca, cm, mut copt) = build(false);
    ca.load_state_dict(&da.state_dict().unwrap()).unwrap();
    copt.load_state_dict(&saved).unwrap();
    for i in 3..6 {
        step(&da, &dm, &mut dopt, i);
        step(&ca, &cm, &mut copt, i);
    }
    let d = max_rel_diff(&store_values(da.store()), &store_values(ca.store()), 1e-3);
    assert!(d <= path_tol(DType::F16), "{d}");
}

#[test]
fn data_parallel_on_the_device_path_equals_the_host_path() {
    use amp::distributed::{DataParallel, DataParallelConfig};
    // Two ranks as threads, each with its own shard; rank 1's third step overflows. Buckets
    // of 64 values, so each step's reduction takes several.
    let run = |device_path: bool| {
        common::on_ranks(2, std::time::Duration::from_secs(60), |c| {
            let rank = c.rank();
            let config = AmpConfig::new(OptLevel::O2).verbosity(0).device_path(device_path);
            let amp = amp::Amp::new(config, &dev_for(device_path)).unwrap();
            let model = amp.model(AmpTwoLinear::new).unwrap();
            let mut opt = amp.optimizer(AdamW::new(AdamWConfig::default()).unwrap()).unwrap();
            let ddp = DataParallel::new(&amp, c, DataParallelConfig { bucket_bytes: 256 }).unwrap();
            let mut outcomes = Vec::new();
            for (s, (x, y)) in batches(12, 5).iter().enumerate().filter(|(i, _)| i % 2 == rank) {
                let (x, y) = (&on(&amp, x), &on(&amp, y));
                let out = model.forward(x).unwrap().to_dtype(DType::F32).unwrap();
                let mut loss = candle_nn::loss::mse(&out, y).unwrap();
                if s == 5 {
                    loss = (loss * 1e30).unwrap();
                }
                amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
                let o = opt.step().unwrap();
                outcomes.push((o.is_skipped(), o.loss_scale()));
                opt.zero_grad();
            }
            let buckets = ddp.collectives() / ddp.reductions();
            assert_eq!(ddp.collectives(), buckets * 6);
            (outcomes, store_values(amp.store()), amp.host_syncs(), buckets)
        })
    };
    let host = run(false);
    let dev = run(true);
    for r in 0..2 {
        assert_eq!(dev[r].0, host[r].0, "rank {r}");
        assert!(
            host[r].0[2].0,
            "rank {r}: the overflow on rank 1 skips both: {:?}",
            host[r].0
        );
        assert_eq!(host[r].0.iter().filter(|o| o.0).count(), 1);
        let d = max_rel_diff(&dev[r].1, &host[r].1, 1e-3);
        assert!(d <= path_tol(DType::F16), "rank {r}: {d}");
        assert_eq!(host[r].2, 0);
        // The step's flags, then the reduced layout, flags and averages' checks, and each
        // bucket, which LocalGroup (no device reduction) reads on the host.
        assert!(dev[r].3 > 1, "{}", dev[r].3);
        assert_eq!(dev[r].2, (2 + dev[r].3) * 6, "rank {r}");
    }
    assert_eq!(dev[0].1, dev[1].1, "the ranks hold the same weights");
}

#[test]
fn an_overflow_in_one_optimizer_skips_every_optimizer_of_the_block() {
    let config = AmpConfig::new(OptLevel::O2).verbosity(0).device_path(true);
    let amp = amp::Amp::new(config, &common::device()).unwrap();
    let model = amp.model(AmpTwoLinear::new).unwrap();
    let mut o1 = amp
        .optimizer_for(Sgd::new(SgdConfig::new(0.1)).unwrap(), |n| n.starts_with("l1"))
        .unwrap();
    let mut o2 = amp
        .optimizer_for(Sgd::new(SgdConfig::new(0.1)).unwrap(), |n| n.starts_with("l2"))
        .unwrap();
    let before = f32_bits(amp.store());
    let w = amp.store().param("l2.weight").unwrap().working().clone();
    let (x, y) = &batches(1, 2)[0];
    let out = model.forward(x).unwrap().to_dtype(DType::F32).unwrap();
    let loss = candle_nn::loss::mse(&out, y).unwrap();
    amp.scale_loss_multi(&loss, 0, vec![&mut o1, &mut o2])
        .unwrap()
        .backward_with(|scaled| {
            let mut g = scaled.backward()?;
            // l2's weight gradient is stashed outside the GradStore (`nn::Linear`): an inf
            // added to it for the stages to merge.
            let bad = Tensor::full(f32::INFINITY, w.shape(), w.device())?;
            g.insert(&w, bad);
            Ok(g)
        })
        .unwrap();
    assert!(
        o1.step().unwrap().is_skipped(),
        "l1's gradients are finite, but the block overflowed"
    );
    assert!(o2.step().unwrap().is_skipped());
    assert_eq!(f32_bits(amp.store()), before);
    // The scale backs off once, when the last optimizer of the block reports.
    assert_eq!(amp.loss_scale(0).unwrap(), 32768.0);
    assert_eq!(amp.host_syncs(), 1, "one read for the backward of both optimizers");
}

/// A rank's communicator that counts what goes through it: sums of host buffers asked for
/// directly, and tensor sums. `device` makes it answer that it reduces in device memory (a
/// stand-in for NCCL: its tensor sums are then not counted as host reads).
#[derive(Debug)]
struct Watch {
    inner: std::sync::Arc<dyn amp::distributed::Communicator>,
    device: bool,
    host_sums: std::sync::atomic::AtomicU64,
    tensor_sums: std::sync::atomic::AtomicU64,
}

impl Watch {
    fn counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.host_sums.load(Relaxed), self.tensor_sums.load(Relaxed))
    }
}

impl amp::distributed::Communicator for Watch {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> &'static str {
        "watch"
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> amp::Result<()> {
        self.host_sums.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.all_reduce_sum(buf)
    }
    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> amp::Result<()> {
        self.host_sums
            .fetch_add(bufs.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.inner.all_reduce_sum_buckets(bufs)
    }
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> amp::Result<Tensor> {
        self.tensor_sums.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // LocalComm's default: through host memory, without calling `self.all_reduce_sum`.
        self.inner.all_reduce_sum_tensor(t)
    }
    fn reduces_in_device_memory(&self) -> bool {
        self.device
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> amp::Result<()> {
        self.inner.broadcast(buf, root)
    }
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> amp::Result<()> {
        self.inner.broadcast_bytes(buf, root)
    }
    fn barrier(&self) -> amp::Result<()> {
        self.inner.barrier()
    }
}

/// One training step of a batch norm (3 channels, input `(rows, 3, 2)`), loss
/// `sum(out * r)`: the output, the input's and the affine parameters' gradients, the running
/// statistics after it, and what the step cost.
#[derive(Debug)]
struct BnStep {
    out: Vec<f32>,
    dx: Vec<f32>,
    dparams: Vec<f32>,
    running: Vec<f32>,
    weights: BTreeMap<String, Vec<f32>>,
    host_syncs: u64,
    /// The communicator's direct host sums and tensor sums during the step.
    sums: (u64, u64),
    /// DataParallel's bucket collectives during the step.
    buckets: u64,
}

/// `watch`: this rank's communicator, with synchronised batch norm switched on (None: one
/// process, unsynchronised). Buckets of 4 values, so the step's reduction takes several.
fn bn_step(watch: Option<std::sync::Arc<Watch>>, x: &Tensor, r: &Tensor, device_path: bool) -> BnStep {
    use amp::distributed::{DataParallel, DataParallelConfig};
    let config = AmpConfig::new(OptLevel::O0).verbosity(0).device_path(device_path);
    let amp = amp::Amp::new(config, &dev_for(device_path)).unwrap();
    let (x, r) = (&on(&amp, x), &on(&amp, r));
    let model = amp.model(|vb| amp::nn::batch_norm(3, 1e-5, vb.pp("bn"))).unwrap();
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
    let ddp = watch.clone().map(|w| {
        let d = DataParallel::new(&amp, w, DataParallelConfig { bucket_bytes: 16 }).unwrap();
        d.sync_batch_norm(&amp, true).unwrap();
        d
    });
    let (syncs0, sums0) = (amp.host_syncs(), watch.as_ref().map_or((0, 0), |w| w.counts()));
    let buckets0 = ddp.as_ref().map_or(0, |d| d.collectives());
    let xv = candle_core::Var::from_tensor(x).unwrap();
    let out = model.forward(xv.as_tensor()).unwrap();
    let loss = (&out * r).unwrap().sum_all().unwrap();
    let params: Vec<Tensor> = ["bn.weight", "bn.bias"]
        .iter()
        .map(|n| amp.store().param(n).unwrap().working().clone())
        .collect();
    let mut grads = Vec::new();
    amp.scale_loss(&loss, &mut opt)
        .unwrap()
        .backward_with(|scaled| {
            let g = scaled.backward()?;
            grads.push(common::flat(g.get(xv.as_tensor()).unwrap()));
            for p in &params {
                grads.push(common::flat(g.get(p).unwrap()));
            }
            Ok(g)
        })
        .unwrap();
    assert!(!opt.step().unwrap().is_skipped());
    let sums1 = watch.as_ref().map_or((0, 0), |w| w.counts());
    let bn = amp.store();
    let running = ["bn.running_mean", "bn.running_var"]
        .iter()
        .flat_map(|n| common::flat(&bn.param(n).unwrap().f32_value().unwrap()))
        .collect();
    BnStep {
        out: common::flat(&out),
        dx: grads[0].clone(),
        dparams: grads[1..].concat(),
        running,
        weights: store_values(amp.store()),
        host_syncs: amp.host_syncs() - syncs0,
        sums: (sums1.0 - sums0.0, sums1.1 - sums0.1),
        buckets: ddp.as_ref().map_or(0, |d| d.collectives()) - buckets0,
    }
}

fn assert_near(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= path_tol(DType::F32) * y.abs().max(1.0),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn synchronised_batch_norm_on_the_device_path_sums_device_tensors_and_counts_every_read() {
    let data = batches(2, 11);
    let x = Tensor::cat(&[&data[0].0, &data[1].0], 0).unwrap();
    let rows = x.dim(0).unwrap();
    let x = x.narrow(1, 0, 6).unwrap().reshape((rows, 3, 2)).unwrap();
    let r = x.sin().unwrap().affine(2.0, 0.5).unwrap();
    let shard = |t: &Tensor, rank: usize| t.narrow(0, rank * rows / 2, rows / 2).unwrap();
    // One process, the whole batch, plain batch norm.
    let whole = bn_step(None, &x, &r, true);
    for (device_path, device) in [(true, false), (true, true), (false, false)] {
        let what = format!("device_path={device_path} device_reduction={device}");
        let ranks = common::on_ranks(2, std::time::Duration::from_secs(60), |c| {
            let rank = c.rank();
            let watch = std::sync::Arc::new(Watch {
                inner: c,
                device,
                host_sums: Default::default(),
                tensor_sums: Default::default(),
            });
            bn_step(Some(watch), &shard(&x, rank), &shard(&r, rank), device_path)
        });
        let half = whole.out.len() / 2;
        for (rank, s) in ranks.iter().enumerate() {
            let part = |v: &[f32]| v[rank * half..(rank + 1) * half].to_vec();
            assert_near(&s.out, &part(&whole.out), &format!("{what} rank {rank} output"));
            assert_near(&s.dx, &part(&whole.dx), &format!("{what} rank {rank} input gradient"));
            assert_near(
                &s.running,
                &whole.running,
                &format!("{what} rank {rank} running statistics"),
            );
            if device_path {
                // Only tensor sums: BN's two in the forward and one in the backward, and
                // DataParallel's buckets (several: 4 values each).
                assert!(s.buckets > 1, "{what}: {}", s.buckets);
                assert_eq!(s.sums, (0, 3 + s.buckets), "{what} rank {rank}");
                // The step's flags, DataParallel's layout/flags read, and one per tensor sum
                // unless the communicator reduces in device memory.
                let counted = if device { 0 } else { 3 + s.buckets };
                assert_eq!(s.host_syncs, 2 + counted, "{what} rank {rank}");
            } else {
                // The CPU path: host buffers, nothing read from a device.
                assert_eq!(s.sums.1, 0, "{what}");
                assert_eq!(s.host_syncs, 0, "{what}");
            }
        }
        // The ranks' parameter gradients add up to the whole batch's; the ranks agree.
        let sum: Vec<f32> = ranks[0]
            .dparams
            .iter()
            .zip(&ranks[1].dparams)
            .map(|(a, b)| a + b)
            .collect();
        assert_near(&sum, &whole.dparams, &format!("{what} parameter gradients"));
        assert_eq!(ranks[0].weights, ranks[1].weights, "{what}");
        assert_eq!(ranks[0].running, ranks[1].running, "{what}");
    }
}
