//! A ZeRO step is all or nothing across real processes: run under `mpirun -np 2`, one stop
//! point per launch (CI runs each). Both ranks train one clean step; in the second, rank 1
//! stops at the point given (it makes no further MPI call, as a process that hung or died
//! there) and rank 0, waiting 1 s for it, must fail with `Distributed { Timeout }` and hold
//! bit for bit what it held before the step: f32 masters, working weights, optimizer state,
//! step counters and loss scalers. From `after-clip` on, rank 0 has already stepped its own
//! shard when the all-gather of the updated weights fails: those stops check that the step
//! is undone (the earlier ones, that nothing is applied before the reduction).
//!
//! A timed-out MPI collective cannot be cancelled, so the communicator is not used again:
//! rank 1 stays stopped for longer than rank 0 waits, then both finalise MPI (OpenMPI
//! finalises with the unmatched request pending) and exit, 0 when the check held and 1 when
//! not, which makes `mpirun` exit non-zero. Rank 0 prints one line with the result.
//!
//! ```sh
//! cargo build --features mpi --example zero_stop_check
//! mpirun -np 2 target/debug/examples/zero_stop_check --stage 2 --stop after-clip
//! mpirun -np 2 target/debug/examples/zero_stop_check --stage 1 --stop gather --grad-scaler
//! ```

#[path = "../tests/dist_scenarios/mod.rs"]
mod dist_scenarios;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Result, bail};
use candle_amp::distributed::{Communicator, DataParallel, DataParallelConfig, MpiComm, Sharding};
use candle_amp::optim::{AdamW, AdamWConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, DistErrorKind, GradScaler, OptLevel};
use candle_core::{DType, Device, Tensor};
use dist_scenarios::{Net, data, shard};

/// How long rank 0 waits for the stopped rank in the failing step: short, so that CI's
/// launches finish fast, and ample for the clean collectives of this small network.
const TIMEOUT: Duration = Duration::from_secs(1);
/// How long the stopped rank stays stopped: past rank 0's timeout, with room for rank 0's
/// own compute up to the collective it waits in.
const STOPPED_FOR: Duration = Duration::from_secs(2);

const USAGE: &str = "usage: mpirun -np 2 zero_stop_check --stage 1|2 \
                     --stop before-backward|after-backward|after-clip|gather [--grad-scaler]";

/// Where rank 1 stops in the second step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stop {
    /// After the forward pass.
    BeforeBackward,
    AfterBackward,
    /// After `clip_grad_norm` reduced the gradients: the step's only collective left is
    /// the all-gather of the updated weights.
    AfterClip,
    /// Inside `step` (no clipping), at its all-gather: after the reduction (the
    /// reduce-scatter at stage 2) and this rank's own shard update.
    Gather,
}

impl Stop {
    fn name(self) -> &'static str {
        match self {
            Stop::BeforeBackward => "before its backward",
            Stop::AfterBackward => "after its backward",
            Stop::AfterClip => "after clip_grad_norm",
            Stop::Gather => "at step's all-gather",
        }
    }
}

struct Args {
    stage: Sharding,
    stop: Stop,
    grad_scaler: bool,
}

fn parse_args() -> Option<Args> {
    let (mut stage, mut stop, mut grad_scaler) = (None, None, false);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--stage" => {
                stage = match args.next()?.as_str() {
                    "1" => Some(Sharding::Stage1),
                    "2" => Some(Sharding::Stage2),
                    _ => return None,
                }
            }
            "--stop" => {
                stop = match args.next()?.as_str() {
                    "before-backward" => Some(Stop::BeforeBackward),
                    "after-backward" => Some(Stop::AfterBackward),
                    "after-clip" => Some(Stop::AfterClip),
                    "gather" => Some(Stop::Gather),
                    _ => return None,
                }
            }
            "--grad-scaler" => grad_scaler = true,
            _ => return None,
        }
    }
    Some(Args {
        stage: stage?,
        stop: stop?,
        grad_scaler,
    })
}

/// This rank's communicator, which can be told to stop at the next all-gather: the call
/// fails without reaching MPI, so the other ranks wait for it in vain.
#[derive(Debug)]
struct Stoppable {
    inner: Arc<dyn Communicator>,
    stop_at_gather: AtomicBool,
}

impl Stoppable {
    fn gate_gather(&self) -> amp::Result<()> {
        if self.stop_at_gather.load(Ordering::SeqCst) {
            return Err(AmpError::Distributed {
                rank: self.inner.rank(),
                kind: DistErrorKind::Backend,
                detail: "this rank stopped at the all-gather on purpose".into(),
            });
        }
        Ok(())
    }
}

impl Communicator for Stoppable {
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
        self.inner.all_reduce_sum(buf)
    }
    // Forwarded rather than left to the trait's defaults: MPI's own versions send the
    // buckets together and agree on every length first.
    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> amp::Result<()> {
        self.inner.all_reduce_sum_buckets(bufs)
    }
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> amp::Result<Tensor> {
        self.inner.all_reduce_sum_tensor(t)
    }
    fn reduces_in_device_memory(&self) -> bool {
        self.inner.reduces_in_device_memory()
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
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> amp::Result<()> {
        self.inner.reduce_scatter_sum(send, recv)
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> amp::Result<()> {
        self.gate_gather()?;
        self.inner.all_gather_bytes(send, recv)
    }
}

/// Everything a step may change on this rank, as bits.
#[derive(Debug, PartialEq)]
struct Held {
    masters: Vec<(String, Vec<u32>)>,
    working: Vec<(String, Vec<u32>)>,
    optimizer_state: Vec<(String, Vec<u32>)>,
    steps: (u64, u64),
    scalers: String,
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.into_iter().map(f32::to_bits).collect())
}

fn held(amp: &amp::Amp, opt: &amp::AmpOptimizer, scaler: &GradScaler) -> Result<Held> {
    let params = amp.store().params();
    // A sharded rank refuses `state_dict` (it holds a shard only): its live buffers are
    // read instead, the algorithm's state being those named `.state.`.
    let mut optimizer_state = Vec::new();
    for (name, t) in amp::testing::live_buffers(amp, &[opt])? {
        if name.contains(".state.") {
            optimizer_state.push((name, bits(&t)?));
        }
    }
    Ok(Held {
        masters: params
            .iter()
            .map(|p| Ok((p.name().to_string(), bits(&p.f32_value()?)?)))
            .collect::<Result<_>>()?,
        working: params
            .iter()
            .map(|p| Ok((p.name().to_string(), bits(p.working())?)))
            .collect::<Result<_>>()?,
        optimizer_state,
        steps: (opt.steps(), opt.skipped_steps()),
        scalers: format!("{:?} {:?}", amp.scaler_states(), scaler.state_dict()),
    })
}

/// Which parts of `after` differ from `before`.
fn changed(before: &Held, after: &Held) -> Vec<&'static str> {
    [
        ("f32 masters", before.masters == after.masters),
        ("working weights", before.working == after.working),
        ("optimizer state", before.optimizer_state == after.optimizer_state),
        ("step counters", before.steps == after.steps),
        ("loss scalers", before.scalers == after.scalers),
    ]
    .into_iter()
    .filter(|(_, same)| !same)
    .map(|(what, _)| what)
    .collect()
}

/// A failed training step: the call that failed and its error.
#[derive(Debug)]
struct Failed {
    call: &'static str,
    err: AmpError,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` failed: {}", self.call, self.err)
    }
}

impl std::error::Error for Failed {}

/// The parts of a training run the check steps.
struct Run {
    amp: amp::Amp,
    model: amp::AmpModel<Net>,
    opt: amp::AmpOptimizer,
    scaler: GradScaler,
    grad_scaler: bool,
}

impl Run {
    /// One training step up to `stop` (`None`: all of it), clipping the gradients with
    /// `clip` (every rank must agree, since the clipping's collectives are the reduction).
    fn step(
        &mut self,
        comm: &Stoppable,
        (x, y): (&Tensor, &Tensor),
        clip: bool,
        stop: Option<Stop>,
    ) -> Result<(), Failed> {
        let at = |call: &'static str| move |err: AmpError| Failed { call, err };
        let forward = || amp::ops::mse(&self.model.forward(x)?.to_dtype(DType::F32)?, y);
        let loss = forward().map_err(|e| at("forward")(e.into()))?;
        if stop == Some(Stop::BeforeBackward) {
            return Ok(());
        }
        let grads = if self.grad_scaler {
            let scaled = self.scaler.scale(&loss).map_err(at("GradScaler::scale"))?;
            Some(scaled.backward().map_err(|e| at("backward")(e.into()))?)
        } else {
            let guard = self.amp.scale_loss(&loss, &mut self.opt).map_err(at("scale_loss"))?;
            guard.backward().map_err(at("backward"))?;
            None
        };
        if stop == Some(Stop::AfterBackward) {
            return Ok(());
        }
        if let Some(g) = &grads {
            self.scaler
                .unscale(&mut self.opt, g)
                .map_err(at("GradScaler::unscale"))?;
        }
        if clip {
            self.opt.clip_grad_norm(0.5).map_err(at("clip_grad_norm"))?;
        }
        if stop == Some(Stop::AfterClip) {
            return Ok(());
        }
        comm.stop_at_gather.store(stop == Some(Stop::Gather), Ordering::SeqCst);
        match &grads {
            Some(g) => {
                self.scaler.step(&mut self.opt, g).map_err(at("GradScaler::step"))?;
                self.scaler.update(None).map_err(at("GradScaler::update"))?;
            }
            None => {
                self.opt.step().map_err(at("step"))?;
            }
        }
        self.opt.zero_grad();
        Ok(())
    }
}

/// Runs the check on this rank; `Ok(false)`: it did not hold (said on stderr or stdout).
fn check(mpi: Arc<MpiComm>, args: &Args) -> Result<bool> {
    let rank = mpi.rank();
    let comm = Arc::new(Stoppable {
        inner: mpi.clone(),
        stop_at_gather: AtomicBool::new(false),
    });
    let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2).seed(20).verbosity(0), &Device::Cpu)?;
    let model = amp.model(|vb| Net::new(vb, false))?;
    let opt = amp.optimizer(AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })?)?;
    // Buckets larger than the model: the weights' all-gather is one round, which a stopped
    // rank either joined or not (a stop between rounds is `Diverged`, tests/zero_atomic.rs).
    let config = DataParallelConfig { bucket_bytes: 1 << 20 };
    let _ddp = DataParallel::sharded(&amp, comm.clone(), config, args.stage)?;
    let mut run = Run {
        amp,
        model,
        opt,
        scaler: GradScaler::new(),
        grad_scaler: args.grad_scaler,
    };
    let batches: Vec<(Tensor, Tensor)> = data()
        .into_iter()
        .map(|(x, y)| (shard(&x, rank, 2), shard(&y, rank, 2)))
        .collect();
    // A clean first step, so that the optimizer has state and the scaler a history.
    run.step(&comm, (&batches[0].0, &batches[0].1), true, None)?;
    let before = held(&run.amp, &run.opt, &run.scaler)?;
    mpi.set_timeout(TIMEOUT);
    let batch = (&batches[1].0, &batches[1].1);
    // Stopping at step's gather needs a step that reduces there: no clipping, on every rank.
    let clip = args.stop != Stop::Gather;
    let what = format!(
        "{}, {}, rank 1 stopping {}",
        args.stage,
        if args.grad_scaler { "GradScaler" } else { "guard" },
        args.stop.name()
    );
    if rank == 1 {
        let outcome = run.step(&comm, batch, clip, Some(args.stop));
        std::thread::sleep(STOPPED_FOR);
        // Stopped in a collective of its own, this rank's step failed too and must have
        // applied nothing either; at the other points it returned before the step.
        return match (args.stop, outcome) {
            (
                Stop::Gather,
                Err(Failed {
                    err:
                        AmpError::Distributed {
                            kind: DistErrorKind::Backend,
                            ..
                        },
                    ..
                }),
            )
            | (Stop::BeforeBackward | Stop::AfterBackward | Stop::AfterClip, Ok(())) => {
                let c = changed(&before, &held(&run.amp, &run.opt, &run.scaler)?);
                if !c.is_empty() {
                    eprintln!("zero_stop_check: {what}: rank 1's own stopped step changed its {c:?}");
                }
                Ok(c.is_empty())
            }
            (_, other) => {
                eprintln!("zero_stop_check: {what}: rank 1's step gave {other:?}");
                Ok(false)
            }
        };
    }
    let outcome = run.step(&comm, batch, clip, None);
    let c = changed(&before, &held(&run.amp, &run.opt, &run.scaler)?);
    // Past the reduction, rank 0's own shard is stepped inside the step call before its
    // all-gather waits for rank 1: that call must be the one that fails.
    let in_step = |call: &str| !matches!(args.stop, Stop::AfterClip | Stop::Gather) || call.ends_with("step");
    Ok(match outcome {
        Err(Failed {
            call,
            err: AmpError::Distributed {
                kind: DistErrorKind::Timeout,
                ..
            },
        }) if c.is_empty() && in_step(call) => {
            println!(
                "zero_stop_check: {what}: rank 0's `{call}` timed out and its masters, weights, optimizer state, \
                 counters and scalers are as before"
            );
            true
        }
        Err(Failed {
            call,
            err:
                err @ AmpError::Distributed {
                    kind: DistErrorKind::Timeout,
                    ..
                },
        }) => {
            println!("zero_stop_check: FAILED {what}: rank 0's `{call}` timed out ({err}) and changed its {c:?}");
            false
        }
        other => {
            println!("zero_stop_check: FAILED {what}: rank 0's step gave {other:?}, not a timeout");
            false
        }
    })
}

fn main() -> Result<()> {
    let Some(args) = parse_args() else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    if !MpiComm::launched() {
        eprintln!("run me under MPI: {USAGE}");
        std::process::exit(2);
    }
    // Generous for the setup and the clean step; the failing step waits `TIMEOUT`.
    let mpi = Arc::new(MpiComm::with_timeout(Duration::from_secs(60))?);
    if mpi.world_size() != 2 {
        bail!("run me on 2 ranks: {USAGE}");
    }
    let held = check(mpi.clone(), &args)?;
    // The run is gone with `check`: this is the last handle, and dropping it finalises MPI
    // (so that mpirun takes a clean exit; the timed-out request is never completed).
    drop(mpi);
    if !held {
        std::process::exit(1);
    }
    Ok(())
}
