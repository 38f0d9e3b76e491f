//! A ZeRO step is all or nothing across ranks. Two `LocalGroup` ranks train one clean step,
//! then rank 1 stops at one point of the second: before its backward, after it, after
//! `clip_grad_norm`, or at any one of its collectives (the flags, each reduce-scatter or
//! all-reduce round, the clipping norm, each all-gather round of the updated weights). The
//! surviving rank's step fails, and its masters, working weights, optimizer state, step
//! counters and loss scaler are bit for bit what they were before the step, on the guard's
//! path and on `GradScaler`'s, at stages 1 and 2. A retry on the failed group changes
//! nothing either; resuming from the last checkpoint on a new group trains on like a run that
//! never failed. Only a stop between two all-gather rounds (after other ranks' weights were
//! written here) cannot be undone: that step returns `Diverged` and the run refuses every
//! later call.

mod common;
mod dist_scenarios;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_amp::checkpoint::CheckpointDir;
use candle_amp::distributed::{Communicator, DataParallel, DataParallelConfig, LocalGroup, Sharding};
use candle_amp::optim::{AdamW, AdamWConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, DistErrorKind, GradScaler, OptLevel};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use dist_scenarios::{Net, data, shard, state_of, working_of};

/// How long a collective waits for the stopped rank: short, so that the many cases finish
/// fast, and ample for the clean collectives of this small network.
const TIMEOUT: Duration = Duration::from_millis(400);

/// A rank's communicator that stops (fails every call, never reaching the group) from its
/// `stop_at`-th collective after [`arm`](Self::arm) on, as a process that dies there would.
/// It records the collectives it made since `arm`.
#[derive(Debug)]
struct Stopping {
    inner: Arc<dyn Communicator>,
    stop_at: AtomicUsize,
    calls: AtomicUsize,
    stopped: AtomicBool,
    ops: Mutex<Vec<&'static str>>,
    /// How many of `ops` came before the step's last call ([`mark`](Self::mark)).
    marked: AtomicUsize,
}

impl Stopping {
    fn new(inner: Arc<dyn Communicator>) -> Self {
        Self {
            inner,
            stop_at: AtomicUsize::new(usize::MAX),
            calls: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
            ops: Mutex::new(Vec::new()),
            marked: AtomicUsize::new(0),
        }
    }

    /// Marks where the step's last call (`step`) begins: its collectives are the
    /// all-gather's rounds of the updated weights (the reduction ran in the clipping).
    fn mark(&self) {
        self.marked.store(self.ops.lock().unwrap().len(), Ordering::SeqCst);
    }

    /// Counts collectives from here on, stopping at number `stop_at` (from 0; `None`: never).
    fn arm(&self, stop_at: Option<usize>) {
        self.calls.store(0, Ordering::SeqCst);
        self.ops.lock().unwrap().clear();
        self.stop_at.store(stop_at.unwrap_or(usize::MAX), Ordering::SeqCst);
        self.marked.store(0, Ordering::SeqCst);
    }

    fn gate(&self, op: &'static str) -> amp::Result<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n == self.stop_at.load(Ordering::SeqCst) {
            self.stopped.store(true, Ordering::SeqCst);
        }
        if self.stopped.load(Ordering::SeqCst) {
            return Err(AmpError::Distributed {
                rank: self.inner.rank(),
                kind: DistErrorKind::Backend,
                detail: format!("the test stopped this rank at its `{op}`"),
            });
        }
        self.ops.lock().unwrap().push(op);
        Ok(())
    }
}

impl Communicator for Stopping {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> amp::Result<()> {
        self.gate("all_reduce_sum")?;
        self.inner.all_reduce_sum(buf)
    }
    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> amp::Result<()> {
        self.gate("all_reduce_sum_buckets")?;
        self.inner.all_reduce_sum_buckets(bufs)
    }
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> amp::Result<Tensor> {
        self.gate("all_reduce_sum_tensor")?;
        self.inner.all_reduce_sum_tensor(t)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> amp::Result<()> {
        self.gate("broadcast")?;
        self.inner.broadcast(buf, root)
    }
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> amp::Result<()> {
        self.gate("broadcast_bytes")?;
        self.inner.broadcast_bytes(buf, root)
    }
    fn barrier(&self) -> amp::Result<()> {
        self.gate("barrier")?;
        self.inner.barrier()
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> amp::Result<()> {
        self.gate("reduce_scatter_sum")?;
        self.inner.reduce_scatter_sum(send, recv)
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> amp::Result<()> {
        self.gate("all_gather_bytes")?;
        self.inner.all_gather_bytes(send, recv)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Guard,
    Scaler,
}

/// Where rank 1 stops in the second step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stop {
    Never,
    BeforeBackward,
    AfterBackward,
    AfterClip,
    /// At its collective number `k` of the step (from the backward on).
    At(usize),
}

#[derive(Debug, Clone, Copy)]
struct Case {
    level: OptLevel,
    stage: Sharding,
    api: Api,
    bucket_bytes: usize,
    device_path: bool,
}

impl Case {
    fn new(level: OptLevel, stage: Sharding, api: Api) -> Self {
        Self {
            level,
            stage,
            api,
            bucket_bytes: 1 << 20,
            device_path: false,
        }
    }
}

/// Everything a step may change on a rank, as bits.
#[derive(Debug, Clone, PartialEq)]
struct Held {
    f32_values: Vec<(String, Vec<u32>)>,
    working: Vec<(String, Vec<u32>)>,
    opt_state: Vec<(String, Vec<u32>)>,
    steps: (u64, u64),
    scalers: String,
}

fn held(amp: &amp::Amp, opt: &amp::AmpOptimizer, scaler: &GradScaler) -> Held {
    let opt_state = amp::testing::live_buffers(amp, &[opt])
        .unwrap()
        .into_iter()
        // Named without the optimizer's process-unique id, so that runs compare.
        .filter_map(|(n, t)| Some((n.split_once(".state.")?.1.to_string(), t)))
        .map(|(n, t)| (n, common::flat(&t).into_iter().map(f32::to_bits).collect()))
        .collect();
    Held {
        f32_values: state_of(amp),
        working: working_of(amp),
        opt_state,
        steps: (opt.steps(), opt.skipped_steps()),
        scalers: format!("{:?} {:?}", amp.scaler_states(), scaler.state_dict()),
    }
}

/// What one rank saw in the second step.
#[derive(Debug)]
struct Seen {
    /// The first error of the step (`None`: it completed, or this rank stopped on purpose
    /// before calling anything).
    err: Option<AmpError>,
    /// Whether everything was as before the step after the error.
    unchanged: bool,
    /// The error of a retried step (the survivor only).
    retry: Option<AmpError>,
    /// Whether everything was still as before the step after the retry.
    unchanged_after_retry: bool,
    /// The collectives of the step (rank 1, until it stopped).
    ops: Vec<&'static str>,
    /// Where in `ops` the all-gather of the updated weights begins (a clean step).
    gather_from: usize,
    /// The state before the step and at the end.
    before: Held,
    after: Held,
}

fn kind(e: &Option<AmpError>) -> Option<DistErrorKind> {
    match e {
        Some(AmpError::Distributed { kind, .. }) => Some(*kind),
        _ => None,
    }
}

/// The second step's calls up to `stop` (rank 1) or all of them; the first error.
#[allow(clippy::too_many_arguments)]
fn second_step(
    case: Case,
    amp: &amp::Amp,
    model: &amp::AmpModel<Net>,
    opt: &mut amp::AmpOptimizer,
    scaler: &mut GradScaler,
    grads: &mut Option<GradStore>,
    stop: Stop,
    comm: &Stopping,
    (x, y): (&Tensor, &Tensor),
) -> amp::Result<()> {
    if stop == Stop::BeforeBackward {
        return Ok(());
    }
    let loss = amp::ops::mse(&model.forward(x)?.to_dtype(DType::F32)?, y)?;
    match case.api {
        Api::Guard => {
            amp.scale_loss(&loss, opt)?.backward()?;
        }
        Api::Scaler => *grads = Some(scaler.scale(&loss)?.backward()?),
    }
    if stop == Stop::AfterBackward {
        return Ok(());
    }
    if let Some(g) = grads.as_ref() {
        scaler.unscale(opt, g)?;
    }
    opt.clip_grad_norm(0.5)?;
    if stop == Stop::AfterClip {
        return Ok(());
    }
    comm.mark();
    match grads.as_ref() {
        Some(g) => {
            scaler.step(opt, g)?;
            scaler.update(None)?;
        }
        None => {
            opt.step()?;
        }
    }
    opt.zero_grad();
    Ok(())
}

/// A retry of the step's last call.
fn retry(opt: &mut amp::AmpOptimizer, scaler: &mut GradScaler, grads: &Option<GradStore>) -> amp::Result<()> {
    match grads {
        Some(g) => scaler.step(opt, g).map(|_| ()),
        None => opt.step().map(|_| ()),
    }
}

/// Rank `c.rank()` of two: one clean step (saved to `save` when given, loaded from `resume`
/// instead when given), then the second with rank 1 stopping at `stop`.
fn rank(c: Arc<dyn Communicator>, case: Case, stop: Stop, save: Option<&std::path::Path>, resume: bool) -> Seen {
    let r = c.rank();
    let cfg = AmpConfig::new(case.level).seed(20 + r as u64).verbosity(0);
    let cfg = if case.device_path { cfg.device_path(true) } else { cfg };
    let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let model = amp.model(|vb| Net::new(vb, false)).unwrap();
    let adamw = AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })
    .unwrap();
    let mut opt = amp.optimizer(adamw).unwrap();
    let comm = Arc::new(Stopping::new(c));
    let config = DataParallelConfig {
        bucket_bytes: case.bucket_bytes,
    };
    let ddp = DataParallel::sharded(&amp, comm.clone(), config, case.stage).unwrap();
    let mut scaler = GradScaler::new();
    let batches: Vec<(Tensor, Tensor)> = data()
        .into_iter()
        .map(|(x, y)| (shard(&x, r, 2), shard(&y, r, 2)))
        .collect();
    let dir = save.map(|d| CheckpointDir::new(d, 1));
    if resume {
        let ck = dir.as_ref().unwrap().load().unwrap();
        ck.restore(&amp, &mut [&mut opt]).unwrap();
        let state: Option<amp::GradScalerState> = serde_json::from_value(ck.extra()["scaler"].clone()).unwrap();
        scaler.load_state_dict(state.as_ref()).unwrap();
    } else {
        let (x, y) = (&batches[0].0, &batches[0].1);
        second_step(
            case,
            &amp,
            &model,
            &mut opt,
            &mut scaler,
            &mut None,
            Stop::Never,
            &comm,
            (x, y),
        )
        .unwrap();
        if let Some(dir) = &dir {
            let extra = serde_json::json!({ "scaler": scaler.state_dict() });
            ddp.save_checkpoint(dir, &amp, &[&opt], 1, extra).unwrap();
        }
    }
    let before = held(&amp, &opt, &scaler);
    let mine = if r == 1 { stop } else { Stop::Never };
    comm.arm(match mine {
        Stop::At(k) => Some(k),
        _ => None,
    });
    let mut grads = None;
    let (x, y) = (&batches[1].0, &batches[1].1);
    let err = second_step(
        case,
        &amp,
        &model,
        &mut opt,
        &mut scaler,
        &mut grads,
        mine,
        &comm,
        (x, y),
    )
    .err();
    let ops = comm.ops.lock().unwrap().clone();
    let gather_from = comm.marked.load(Ordering::SeqCst);
    let unchanged = held(&amp, &opt, &scaler) == before;
    let (mut retried, mut unchanged_after_retry) = (None, unchanged);
    if r == 0 && err.is_some() {
        retried = retry(&mut opt, &mut scaler, &grads).err();
        unchanged_after_retry = held(&amp, &opt, &scaler) == before;
        if kind(&err) == Some(DistErrorKind::Diverged) {
            check_refusals(&amp, &model, &mut opt, &ddp, (x, y));
        }
    }
    Seen {
        err,
        unchanged,
        retry: retried,
        unchanged_after_retry,
        ops,
        gather_from,
        before,
        after: held(&amp, &opt, &scaler),
    }
}

/// A diverged run refuses every later call with `Diverged`.
fn check_refusals(
    amp: &amp::Amp,
    model: &amp::AmpModel<Net>,
    opt: &mut amp::AmpOptimizer,
    ddp: &DataParallel,
    (x, y): (&Tensor, &Tensor),
) {
    let diverged = |e: AmpError, call: &str| match e {
        AmpError::Distributed {
            kind: DistErrorKind::Diverged,
            detail,
            ..
        } => assert!(
            detail.contains("resume it from the last checkpoint"),
            "{call}: {detail}"
        ),
        other => panic!("{call}: expected Diverged, got {other}"),
    };
    diverged(opt.step().unwrap_err(), "step");
    diverged(opt.clip_grad_norm(1.0).unwrap_err(), "clip_grad_norm");
    let loss = amp::ops::mse(&model.forward(x).unwrap().to_dtype(DType::F32).unwrap(), y).unwrap();
    diverged(amp.scale_loss(&loss, opt).err().unwrap(), "scale_loss");
    let dir = std::env::temp_dir().join(format!("candle-amp-zero-atomic-refused-{}", std::process::id()));
    let saved = ddp.save_checkpoint(&CheckpointDir::new(&dir, 1), amp, &[opt], 2, serde_json::Value::Null);
    diverged(saved.unwrap_err(), "save_checkpoint");
    assert!(
        !dir.exists() || std::fs::read_dir(&dir).unwrap().next().is_none(),
        "a refused save wrote"
    );
}

fn on_two(case: Case, stop: Stop, save: Option<&std::path::Path>, resume: bool) -> Vec<Seen> {
    let comms = LocalGroup::with_timeout(2, TIMEOUT);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || rank(Arc::new(c), case, stop, save, resume)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every stop of `case`, the cases run together (each its own group). Returns how many
/// stops ended `Diverged`.
fn check_case(case: Case) -> usize {
    let clean = on_two(case, Stop::Never, None, false);
    for s in &clean {
        assert!(s.err.is_none(), "{case:?}: the clean step failed: {:?}", s.err);
    }
    let ops = clean[1].ops.clone();
    assert!(ops.contains(&"all_gather_bytes"), "{case:?}: no all-gather in {ops:?}");
    let mut stops = vec![Stop::BeforeBackward, Stop::AfterBackward, Stop::AfterClip];
    stops.extend((0..ops.len()).map(Stop::At));
    let seen: Vec<(Stop, Vec<Seen>)> = std::thread::scope(|s| {
        let hs: Vec<_> = stops
            .iter()
            .map(|&stop| s.spawn(move || (stop, on_two(case, stop, None, false))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The collectives of the weights' all-gather, one per round, end the step.
    let first_gather = clean[1].gather_from;
    assert!(
        ops[first_gather..].iter().all(|o| *o == "all_gather_bytes"),
        "{case:?}: {ops:?} from {first_gather}"
    );
    let mut diverged = 0;
    for (stop, ranks) in &seen {
        let what = format!("{case:?}, rank 1 stopping {stop:?} (step's collectives {ops:?})");
        let s = &ranks[0];
        match kind(&s.err) {
            Some(DistErrorKind::Timeout) => {
                assert!(
                    s.unchanged,
                    "{what}: the failed step changed the survivor: {:#?}",
                    diff(s)
                );
                assert!(s.retry.is_some(), "{what}: a retry on the failed group succeeded");
                assert!(
                    s.unchanged_after_retry,
                    "{what}: the retry changed the survivor: {:#?}",
                    diff(s)
                );
            }
            Some(DistErrorKind::Diverged) => {
                // Only a stop after the gather's first round leaves other ranks' weights
                // written here.
                assert!(matches!(stop, Stop::At(k) if *k > first_gather), "{what}: diverged");
                diverged += 1;
            }
            _ => panic!("{what}: the survivor's step gave {:?}", s.err),
        }
        // The stopped rank itself, when it failed in a collective: nothing applied either,
        // unless its gather had written the survivor's weights.
        let own = &ranks[1];
        match (stop, kind(&own.err)) {
            (Stop::At(k), Some(DistErrorKind::Diverged)) => assert!(*k > first_gather, "{what}: rank 1 diverged"),
            (Stop::At(_), Some(_)) => assert!(own.unchanged, "{what}: the stopping rank changed"),
            (Stop::At(_), None) => panic!("{what}: rank 1 did not stop"),
            _ => {}
        }
    }
    diverged
}

/// What differs between before and after on the survivor, by field.
fn diff(s: &Seen) -> Vec<&'static str> {
    let (a, b) = (&s.before, &s.after);
    [
        ("f32 values", a.f32_values == b.f32_values),
        ("working", a.working == b.working),
        ("optimizer state", a.opt_state == b.opt_state),
        ("step counters", a.steps == b.steps),
        ("scalers", a.scalers == b.scalers),
    ]
    .into_iter()
    .filter(|(_, same)| !same)
    .map(|(n, _)| n)
    .collect()
}

#[test]
fn a_rank_that_stops_anywhere_in_a_guard_step_leaves_the_survivor_as_before() {
    for level in [OptLevel::O0, OptLevel::O2, OptLevel::O3] {
        for stage in [Sharding::Stage1, Sharding::Stage2] {
            assert_eq!(check_case(Case::new(level, stage, Api::Guard)), 0);
        }
    }
}

#[test]
fn a_rank_that_stops_anywhere_in_a_grad_scaler_step_leaves_the_survivor_as_before() {
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for stage in [Sharding::Stage1, Sharding::Stage2] {
            assert_eq!(check_case(Case::new(level, stage, Api::Scaler)), 0);
        }
    }
}

#[test]
fn a_rank_that_stops_anywhere_on_the_device_path_leaves_the_survivor_as_before() {
    for api in [Api::Guard, Api::Scaler] {
        let case = Case {
            device_path: true,
            ..Case::new(OptLevel::O2, Sharding::Stage2, api)
        };
        assert_eq!(check_case(case), 0);
    }
}

#[test]
fn a_stop_between_two_gather_rounds_is_diverged_and_everything_later_is_refused() {
    // Buckets of 64 bytes: the weights' all-gather takes several rounds, and a stop after
    // the first leaves the survivor with some of rank 1's new weights.
    for api in [Api::Guard, Api::Scaler] {
        let case = Case {
            bucket_bytes: 64,
            ..Case::new(OptLevel::O2, Sharding::Stage2, api)
        };
        assert!(check_case(case) > 0, "{api:?}: no stop ended diverged");
    }
}

#[test]
fn after_a_failed_gather_the_run_resumes_from_its_checkpoint_like_a_run_that_never_failed() {
    let dir = std::env::temp_dir().join(format!("candle-amp-zero-atomic-{}", std::process::id()));
    for api in [Api::Guard, Api::Scaler] {
        let _ = std::fs::remove_dir_all(&dir);
        let case = Case::new(OptLevel::O2, Sharding::Stage2, api);
        let straight = on_two(case, Stop::Never, None, false);
        // Rank 1 stops at its first all-gather of the weights: after the reduce-scatter (and
        // the clipping norm's gather).
        let (ops, at) = (&straight[1].ops, straight[1].gather_from);
        assert!(
            ops[..at].contains(&"reduce_scatter_sum") && ops[at] == "all_gather_bytes",
            "{ops:?}"
        );
        let failed = on_two(case, Stop::At(at), Some(&dir), false);
        assert_eq!(
            kind(&failed[0].err),
            Some(DistErrorKind::Timeout),
            "{:?}",
            failed[0].err
        );
        assert!(failed[0].unchanged, "{api:?}: {:?}", diff(&failed[0]));
        // A new group of new runs loads the checkpoint: exactly the survivor's state, and
        // its second step ends where the run that never failed ends.
        let resumed = on_two(case, Stop::Never, Some(&dir), true);
        assert_eq!(
            resumed[0].before, failed[0].after,
            "{api:?}: the checkpoint is the survivor's state"
        );
        for (r, s) in resumed.iter().enumerate() {
            assert!(s.err.is_none(), "{api:?}: {:?}", s.err);
            assert_eq!(s.after, straight[r].after, "{api:?}: rank {r} after resuming");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
