//! Trains the digits MLP data-parallel across MPI processes: every rank holds the whole
//! model and trains on its shard of every batch; gradients are averaged once per step.
//!
//! ```sh
//! cargo build --release --features mpi --example ddp
//! mpirun -np 2 target/release/examples/ddp [--opt-level O0|O1|O2|O3]... [--half f16|bf16]
//!     [--data FILE.csv] [--steps N] [--seed N] [--batch N] [--bucket-kb N] [--timeout SECS] [--json]
//!     [--sharding none|1|2] [--overlap] [--hidden N] [--layers N] [--save DIR] [--resume DIR] [--report DIR]
//! ```
//!
//! Run without a launcher it prints how to launch it. The flags are the `train` example's
//! (the model is the MLP); `--batch` is the global batch (128), split evenly over the ranks;
//! `--bucket-kb` the gradient bucket size (25 MiB, PyTorch's default); `--timeout` how long a
//! rank waits for the others before failing (300 s); `--sharding 1` or `2` shards the f32
//! master weights and optimizer state over the ranks (ZeRO stage 1 or 2; `none` by default);
//! `--overlap` sends the gradients while the backward runs (`DataParallel::set_overlap`);
//! `--hidden N` and `--layers N` set the MLP's hidden width (256) and hidden layers (2), for
//! more gradient bytes per step and more backward to hide them behind.
//! Rank 0 alone prints the table, progress and JSON lines and writes checkpoints and
//! reports; the JSON lines carry `world_size`, `global_batch`, `comm_ms` (the median time
//! per step of the gradient all-reduce), and its two parts `comm_wait_ms` (waiting in the
//! step's first collective for the slowest rank's backward) and `comm_transfer_ms` (the
//! gradient buckets after it) beside the `train` example's keys, and `sharding`,
//! `comm_gather_ms` (the all-gather of the updated weights of a sharded run) and
//! `master_state_bytes` (rank 0's f32 masters and optimizer state), and `overlap`,
//! `comm_exposed_ms` (how long a step waited for its reduction: all of `comm_ms` without
//! overlap), `comm_exposed_share` (the two's ratio), `overlapped_steps` and `early_buckets`
//! (buckets sent while the backward still ran; `early_buckets_per_rank`: every rank's). A
//! checkpoint
//! written on one number of ranks resumes on any other, sharded or not.

#[path = "../train/cli.rs"]
mod cli;
#[path = "../train/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "../train/models.rs"]
mod models;
#[path = "../train/report.rs"]
mod report;

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use candle_amp as amp;
use candle_amp::checkpoint::CheckpointDir;
use candle_amp::distributed::{Communicator, DataParallel, DataParallelConfig, DistributedSampler, MpiComm, Sharding};
use candle_core::{DType, Device};

use cli::{adamw, check_writable, half_label, rows, weight_dtype};
use data::Dataset;
use models::Mlp;

struct Args {
    levels: Vec<amp::OptLevel>,
    half: amp::HalfType,
    data: Option<String>,
    steps: usize,
    seed: u64,
    batch: usize,
    timeout: u64,
    bucket_kb: usize,
    json: bool,
    save: Option<String>,
    resume: Option<String>,
    report: Option<String>,
    sharding: Sharding,
    overlap: bool,
    /// The MLP's hidden width and hidden layers.
    hidden: usize,
    layers: usize,
}

fn usage() -> &'static str {
    "usage: mpirun -np N ddp [--opt-level O0|O1|O2|O3]... [--half f16|bf16] [--data FILE.csv] \
     [--steps N] [--seed N] [--batch N] [--bucket-kb N] [--timeout SECS] [--json] [--sharding none|1|2] [--overlap] [--hidden N] [--layers N] [--save DIR] [--resume DIR] [--report DIR]"
}

fn launch_help(program: &str) -> String {
    format!(
        "This example trains across MPI processes; start it with an MPI launcher.\n\
         \n\
         One machine, 2 processes:\n\
         \x20   mpirun -np 2 {program} --steps 200\n\
         Several machines (the same build at the same path on each, a shared or copied\n\
         data file), with a hostfile listing one machine per line and its process slots:\n\
         \x20   printf 'node1 slots=2\\nnode2 slots=2\\n' > hosts\n\
         \x20   mpirun -np 4 --hostfile hosts {program} --steps 200\n\
         As root (containers), OpenMPI also needs OMPI_ALLOW_RUN_AS_ROOT=1 and\n\
         OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.\n\
         \n\
         {}\n",
        usage()
    )
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        levels: Vec::new(),
        half: amp::HalfType::F16,
        data: None,
        steps: 600,
        seed: 0,
        batch: 128,
        timeout: 300,
        bucket_kb: 25 << 10,
        json: false,
        save: None,
        resume: None,
        report: None,
        sharding: Sharding::None,
        overlap: false,
        hidden: 256,
        layers: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value; {}", usage()));
        match flag.as_str() {
            "--model" => {
                let m = value()?;
                if m != "mlp" {
                    bail!("the ddp example trains the mlp only, not {m:?}");
                }
            }
            "--opt-level" => a.levels.push(value()?.parse()?),
            "--half" => a.half = value()?.parse()?,
            "--data" => a.data = Some(value()?),
            "--steps" => a.steps = value()?.parse().context("--steps takes a positive integer")?,
            "--seed" => a.seed = value()?.parse().context("--seed takes a non-negative integer")?,
            "--batch" => a.batch = value()?.parse().context("--batch takes a positive integer")?,
            "--timeout" => a.timeout = value()?.parse().context("--timeout takes whole seconds")?,
            "--bucket-kb" => a.bucket_kb = value()?.parse().context("--bucket-kb takes a positive integer")?,
            "--json" => a.json = true,
            "--sharding" => {
                a.sharding = match value()?.to_ascii_lowercase().as_str() {
                    "none" | "0" => Sharding::None,
                    "1" | "zero1" | "zero-1" => Sharding::Stage1,
                    "2" | "zero2" | "zero-2" => Sharding::Stage2,
                    other => bail!("--sharding takes none, 1 or 2 (ZeRO stage), got {other:?}"),
                }
            }
            "--overlap" => a.overlap = true,
            "--hidden" => a.hidden = value()?.parse().context("--hidden takes a positive integer")?,
            "--layers" => a.layers = value()?.parse().context("--layers takes a positive integer")?,
            "--save" => a.save = Some(value()?),
            "--resume" => a.resume = Some(value()?),
            "--report" => a.report = Some(value()?),
            "-h" | "--help" => {
                eprintln!("{}", launch_help("target/release/examples/ddp"));
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}; {}", usage()),
        }
    }
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if a.batch == 0 {
        bail!("--batch must be at least 1");
    }
    if a.hidden == 0 || a.layers == 0 {
        bail!("--hidden and --layers must be at least 1");
    }
    if a.bucket_kb == 0 {
        bail!("--bucket-kb must be at least 1");
    }
    if a.timeout == 0 {
        bail!("--timeout must be at least 1 second");
    }
    if a.levels.is_empty() {
        a.levels = amp::OptLevel::ALL.to_vec();
    }
    Ok(a)
}

/// What the example keeps in a checkpoint beside the library's state. The data position is
/// counted in global samples, so a checkpoint resumes on any number of ranks.
#[derive(serde::Serialize, serde::Deserialize, Default, Clone)]
struct Progress {
    losses: Vec<f64>,
    scales: Vec<f32>,
    skipped: Vec<bool>,
    /// The sampler's epoch.
    epoch: u64,
    /// Global samples of this epoch already used.
    consumed: usize,
}

struct RunResult {
    param_dtype: DType,
    final_loss: f64,
    eval_loss: f64,
    accuracy: f64,
    skipped: u64,
    final_scale: f32,
    step_ms: f64,
    comm_ms: f64,
    comm_wait_ms: f64,
    comm_transfer_ms: f64,
    comm_gather_ms: f64,
    comm_exposed_ms: f64,
    overlapped_steps: u64,
    early_buckets: u64,
    /// Every rank's `early_buckets`, in rank order.
    early_buckets_per_rank: Vec<u64>,
    master_state_bytes: usize,
    autocast_ops: usize,
    progress: Progress,
}

fn run_dir(root: &str, level: amp::OptLevel, half: amp::HalfType) -> CheckpointDir {
    CheckpointDir::new(std::path::Path::new(root).join(format!("mlp-{level}-{half}")), 1)
}

/// Every rank learns whether any rank failed `r` (a collective: call it on every rank), so
/// that a bad path or checkpoint on one rank stops them all with a message instead of
/// leaving the others waiting for it.
fn agree<T>(comm: &Arc<dyn Communicator>, what: &str, r: Result<T>) -> Result<T> {
    let mut failed = [if r.is_err() { 1.0f32 } else { 0.0 }];
    comm.all_reduce_sum(&mut failed)?;
    match r {
        Err(e) => Err(e),
        Ok(_) if failed[0] > 0.0 => bail!(
            "{what} failed on {} other rank(s); see their message",
            failed[0] as usize
        ),
        Ok(v) => Ok(v),
    }
}

struct Data {
    train: Dataset,
    test: Dataset,
    classes: usize,
}

fn train_one(comm: &Arc<dyn Communicator>, d: &Data, level: amp::OptLevel, a: &Args) -> Result<RunResult> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let main = rank == 0;
    let config = amp::AmpConfig::new(level)
        .half(a.half)
        .seed(a.seed)
        .verbosity(if main { 1 } else { 0 });
    let amp = amp::Amp::new(config, &Device::Cpu)?;
    let model = amp.model(|vb| Mlp::deep(vb, d.train.width, a.hidden, a.layers, d.classes))?;
    let mut opt = amp.optimizer(adamw()?)?;
    let param_dtype = weight_dtype(&amp)?;

    // Every rank reads the checkpoint (a shared or copied directory); DataParallel::new
    // below makes the weights rank 0's anyway.
    let resumed = (|| -> Result<Progress> {
        let Some(root) = &a.resume else {
            return Ok(Progress::default());
        };
        let dir = run_dir(root, level, a.half);
        let ck = dir
            .load()
            .with_context(|| format!("resuming {level} from {}", dir.root().display()))?;
        ck.restore(&amp, &mut [&mut opt])?;
        let progress: Progress =
            serde_json::from_value(ck.extra().clone()).context("the checkpoint's example progress")?;
        let start = ck.step() as usize;
        if start > a.steps || progress.losses.len() != start {
            bail!(
                "the checkpoint in {} is at step {start} with {} losses; --steps is {}",
                dir.root().display(),
                progress.losses.len(),
                a.steps
            );
        }
        Ok(progress)
    })();
    let mut progress = agree(comm, "resuming", resumed)?;
    let ddp = DataParallel::sharded(
        &amp,
        comm.clone(),
        DataParallelConfig {
            bucket_bytes: a.bucket_kb << 10,
        },
        a.sharding,
    )?;
    ddp.set_overlap(&amp, a.overlap)?;

    let per_rank = a.batch.div_ceil(world);
    let mut sampler = DistributedSampler::new(d.train.len(), world, rank)?
        .seed(a.seed)
        .drop_last(false);
    if per_rank > sampler.num_samples() {
        bail!(
            "--batch {} gives {per_rank} samples per rank, more than the {} each of {world} ranks has per epoch",
            a.batch,
            sampler.num_samples()
        );
    }
    let start = progress.losses.len();
    let label = format!("mlp {level} {} x{world}", half_label(level, a.half));
    let lines = main && !std::io::stderr().is_terminal();
    let bar = (main && !lines).then(|| {
        let pb = indicatif::ProgressBar::new(a.steps.saturating_sub(start) as u64);
        if let Ok(style) = indicatif::ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} {msg}") {
            pb.set_style(style.progress_chars("=> "));
        }
        pb.set_prefix(label.clone());
        pb
    });
    let every = (a.steps / 10).max(1);
    if lines {
        eprintln!("{label}: training steps {}..{}", start + 1, a.steps);
    }

    let mut times = Vec::with_capacity(a.steps);
    // This rank's indices of the epoch they belong to; its position in them is derived from
    // the global count of samples used (which is what a checkpoint keeps).
    let mut epoch_idx: Vec<usize> = Vec::new();
    let mut loaded_epoch = None;
    for _ in start..a.steps {
        // The rest of an epoch shorter than a batch is dropped, like a DataLoader with drop_last.
        if progress.consumed / world + per_rank > sampler.num_samples() {
            progress.epoch += 1;
            progress.consumed = 0;
        }
        if loaded_epoch != Some(progress.epoch) {
            sampler.set_epoch(progress.epoch);
            epoch_idx = sampler.indices();
            loaded_epoch = Some(progress.epoch);
        }
        let pos = progress.consumed / world;
        let (x, y) = rows(&d.train, &epoch_idx[pos..pos + per_rank])?;
        progress.consumed += per_rank * world;

        let t0 = Instant::now();
        let logits = model.forward(&x)?;
        let loss = amp::ops::cross_entropy(&logits, &y)?;
        amp.scale_loss(&loss, &mut opt)?.backward()?;
        let outcome = opt.step()?;
        opt.zero_grad();
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        // The logged loss is the mean over the ranks' shards (outside the timed step).
        let mut l = [loss.to_scalar::<f32>()?];
        comm.all_reduce_sum(&mut l)?;
        let l = (l[0] / world as f32) as f64;
        progress.losses.push(l);
        progress.scales.push(outcome.loss_scale());
        progress.skipped.push(outcome.is_skipped());
        let done = progress.losses.len();
        if let Some(pb) = &bar {
            pb.set_message(format!("loss {l:.4}"));
            pb.inc(1);
        }
        if lines && (done % every == 0 || done == a.steps) {
            eprintln!(
                "{label}: step {done}/{} loss {l:.4} scale {}",
                a.steps,
                outcome.loss_scale()
            );
        }
    }
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    if let Some(root) = &a.save {
        // Every rank calls it: rank 0 writes (a sharded run: each rank its shard) and every
        // rank returns once the checkpoint is committed.
        ddp.save_checkpoint(
            &run_dir(root, level, a.half),
            &amp,
            &[&opt],
            progress.losses.len() as u64,
            serde_json::to_value(&progress)?,
        )?;
    }

    let losses = &progress.losses;
    let tail = (losses.len() / 10).max(1).min(losses.len());
    let final_loss = losses[losses.len() - tail..].iter().sum::<f64>() / tail as f64;
    // Every rank holds the same weights: rank 0 evaluates the whole held-out set.
    model.eval();
    let (x, y) = rows(&d.test, &(0..d.test.len()).collect::<Vec<_>>())?;
    let logits = model.forward(&x)?;
    let eval_loss = amp::ops::cross_entropy(&logits, &y)?.to_scalar::<f32>()? as f64;
    let pred = logits.argmax(1)?.to_vec1::<u32>()?;
    let correct = pred.iter().zip(&d.test.y).filter(|(p, t)| p == t).count();
    times.sort_by(f64::total_cmp);
    // Every rank's overlap, not only rank 0's (ranks whose graphs differ overlap differently).
    let mut every = vec![0u8; 8 * comm.world_size()];
    comm.all_gather_bytes(&ddp.early_buckets().to_le_bytes(), &mut every)?;
    let early_buckets_per_rank = every
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect();
    Ok(RunResult {
        param_dtype,
        final_loss,
        eval_loss,
        accuracy: correct as f64 / d.test.len().max(1) as f64,
        skipped: opt.skipped_steps(),
        final_scale: amp.loss_scale(0)?,
        step_ms: times.get(times.len() / 2).copied().unwrap_or(f64::NAN),
        comm_ms: ddp.comm_ms(),
        comm_wait_ms: ddp.comm_wait_ms(),
        comm_transfer_ms: ddp.comm_transfer_ms(),
        comm_gather_ms: ddp.comm_gather_ms(),
        comm_exposed_ms: ddp.comm_exposed_ms(),
        overlapped_steps: ddp.overlapped_steps(),
        early_buckets: ddp.early_buckets(),
        early_buckets_per_rank,
        master_state_bytes: amp.store().master_bytes() + opt.state_bytes()?,
        autocast_ops: amp.autocast_ops(),
        progress,
    })
}

fn main() -> Result<()> {
    if !MpiComm::launched() {
        let program = std::env::args().next().unwrap_or_else(|| "ddp".into());
        print!("{}", launch_help(&program));
        return Ok(());
    }
    let a = parse_args()?;
    let comm: Arc<dyn Communicator> = Arc::new(MpiComm::with_timeout(Duration::from_secs(a.timeout))?);
    let (rank, world) = (comm.rank(), comm.world_size());
    let main = rank == 0;
    // Logs from rank 0 only; the others report errors.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(if main { "warn" } else { "error" }))
        .init();
    let prepared = (|| -> Result<Data> {
        if main {
            if let Some(dir) = &a.save {
                check_writable("--save", dir)?;
            }
            if let Some(dir) = &a.report {
                check_writable("--report", dir)?;
            }
        }
        // Every rank reads the data itself (the same file, the same split).
        let ds = match &a.data {
            Some(p) => data::read_file(p)?,
            None => data::digits()?,
        };
        let classes = ds.classes();
        if classes < 2 {
            bail!("the data has {classes} class(es); a classifier needs at least 2");
        }
        if let (true, Some(w)) = (main, ds.empty_classes_warning()) {
            eprintln!("warning: {w}");
        }
        let (train, test) = data::split_standardise(&ds, 0.2, a.seed);
        if train.len() < world || test.len() == 0 {
            bail!(
                "the data has {} rows: too few for {world} ranks and a 20% held-out split",
                ds.len()
            );
        }
        Ok(Data { train, test, classes })
    })();
    let d = agree(&comm, "preparing", prepared)?;

    let mut table = format!(
        "{:<6} {:<5} {:<6} {:>5} {:>10} {:>10} {:>9} {:>8} {:>12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}\n",
        "level",
        "half",
        "params",
        "ranks",
        "final_loss",
        "eval_loss",
        "accuracy",
        "skipped",
        "loss_scale",
        "step_ms",
        "comm_ms",
        "wait_ms",
        "xfer_ms",
        "exp_ms",
        "gath_ms",
        "state_kb"
    );
    let mut runs = Vec::new();
    for &level in &a.levels {
        let r = train_one(&comm, &d, level, &a)?;
        if main && a.json {
            let mut line = serde_json::json!({
                "model": "mlp",
                "opt_level": level.to_string(),
                "half": a.half.to_string(),
                "param_dtype": r.param_dtype.as_str(),
                "seed": a.seed,
                "steps": a.steps,
                "final_loss": r.final_loss,
                "eval_loss": r.eval_loss,
                "accuracy": r.accuracy,
                "skipped_steps": r.skipped,
                "final_loss_scale": r.final_scale,
                "step_ms": r.step_ms,
                "world_size": world,
                "global_batch": a.batch.div_ceil(world) * world,
                "hidden": a.hidden,
                "layers": a.layers,
                "comm_ms": r.comm_ms,
                "comm_wait_ms": r.comm_wait_ms,
                "comm_transfer_ms": r.comm_transfer_ms,
                "sharding": a.sharding.to_string(),
                "comm_gather_ms": r.comm_gather_ms,
                "master_state_bytes": r.master_state_bytes,
                "overlap": a.overlap,
                "comm_exposed_ms": r.comm_exposed_ms,
                "comm_exposed_share": if r.comm_ms > 0.0 { r.comm_exposed_ms / r.comm_ms } else { 0.0 },
                "overlapped_steps": r.overlapped_steps,
                "early_buckets": r.early_buckets,
                "early_buckets_per_rank": r.early_buckets_per_rank,
            });
            if level == amp::OptLevel::O1 {
                line["autocast_ops"] = r.autocast_ops.into();
            }
            println!("{line}");
        }
        table.push_str(&format!(
            "{:<6} {:<5} {:<6} {:>5} {:>10.4} {:>10.4} {:>8.2}% {:>8} {:>12} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>9.1}\n",
            level.to_string(),
            half_label(level, a.half),
            r.param_dtype.as_str(),
            world,
            r.final_loss,
            r.eval_loss,
            r.accuracy * 100.0,
            r.skipped,
            r.final_scale,
            r.step_ms,
            r.comm_ms,
            r.comm_wait_ms,
            r.comm_transfer_ms,
            r.comm_exposed_ms,
            r.comm_gather_ms,
            r.master_state_bytes as f64 / 1024.0
        ));
        runs.push((level, r));
    }
    if main {
        if let Some(dir) = &a.report {
            let path = std::path::Path::new(dir).join("mlp-ddp.svg");
            let series: Vec<report::Series> = runs
                .iter()
                .map(|(level, r)| report::Series {
                    label: level.to_string(),
                    losses: r.progress.losses.clone(),
                    scales: r.progress.scales.clone(),
                    skipped: r.progress.skipped.clone(),
                })
                .collect();
            report::draw(&path, &format!("mlp ({}, {world} ranks)", a.half), &series)?;
            eprintln!("wrote {}", path.display());
        }
        if a.json {
            eprint!("{table}");
        } else {
            print!("{table}");
        }
    }
    Ok(())
}
