//! Trains a small model on the bundled digits data at each opt level and reports loss,
//! accuracy, skipped steps, the final loss scale and the median step time.
//!
//! `cargo run --release --example train -- [--opt-level O2]... [--half f16|bf16]
//!  [--data FILE.csv] [--steps N] [--seed N] [--json] [--save DIR] [--resume DIR]`
//!
//! `--save DIR` writes a checkpoint per run under `DIR/<model>-<level>-<half>/` at the end;
//! `--resume DIR` continues each run from there (`--steps` counts from the start of
//! training), so a run cut in two prints the same JSON as one run straight through, but
//! for `step_ms`.

mod data;
mod models;

use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_amp as amp;
use candle_amp::checkpoint::{Checkpoint, CheckpointDir};
use candle_core::{DType, Device, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;

use data::Dataset;
use models::Mlp;

const HIDDEN: usize = 256;
const BATCH: usize = 128;

struct Args {
    levels: Vec<amp::OptLevel>,
    half: amp::HalfType,
    data: Option<String>,
    steps: usize,
    seed: u64,
    json: bool,
    save: Option<String>,
    resume: Option<String>,
}

fn usage() -> &'static str {
    "usage: train [--opt-level O0|O1|O2|O3]... [--half f16|bf16] [--data FILE.csv] [--steps N] [--seed N] [--json] [--save DIR] [--resume DIR]"
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        levels: Vec::new(),
        half: amp::HalfType::F16,
        data: None,
        steps: 600,
        seed: 0,
        json: false,
        save: None,
        resume: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value; {}", usage()));
        match flag.as_str() {
            "--opt-level" => a.levels.push(value()?.parse()?),
            "--half" => a.half = value()?.parse()?,
            "--data" => a.data = Some(value()?),
            "--steps" => a.steps = value()?.parse().context("--steps takes a positive integer")?,
            "--seed" => a.seed = value()?.parse().context("--seed takes a non-negative integer")?,
            "--json" => a.json = true,
            "--save" => a.save = Some(value()?),
            "--resume" => a.resume = Some(value()?),
            "-h" | "--help" => {
                eprintln!("{}", usage());
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}; {}", usage()),
        }
    }
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if a.levels.is_empty() {
        // O1's per-op autocasting is not built yet: without it O1 is O0 with a dynamic
        // scaler, so it runs only when asked for.
        a.levels = vec![amp::OptLevel::O0, amp::OptLevel::O2, amp::OptLevel::O3];
    }
    Ok(a)
}

/// One row of results.
struct RunResult {
    level: amp::OptLevel,
    param_dtype: DType,
    final_loss: f64,
    eval_loss: f64,
    accuracy: f64,
    skipped: u64,
    final_scale: f32,
    step_ms: f64,
}

fn tensors(d: &Dataset, idx: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
    let w = d.width;
    let mut x = Vec::with_capacity(idx.len() * w);
    let mut y = Vec::with_capacity(idx.len());
    for &i in idx {
        x.extend_from_slice(&d.x[i * w..(i + 1) * w]);
        y.push(d.y[i]);
    }
    Ok((
        Tensor::from_vec(x, (idx.len(), w), dev)?,
        Tensor::from_vec(y, idx.len(), dev)?,
    ))
}

/// What the example keeps in a checkpoint beside the library's state.
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct Progress {
    /// Training loss of every step so far.
    losses: Vec<f64>,
    /// Rows of the current epoch not yet used.
    order: Vec<usize>,
}

fn run_dir(root: &str, model: &str, level: amp::OptLevel, half: amp::HalfType) -> CheckpointDir {
    CheckpointDir::new(std::path::Path::new(root).join(format!("{model}-{level}-{half}")), 1)
}

fn train_one(train: &Dataset, test: &Dataset, classes: usize, level: amp::OptLevel, a: &Args) -> Result<RunResult> {
    let dev = Device::Cpu;
    let config = amp::AmpConfig::new(level).half(a.half).seed(a.seed);
    let adamw = amp::optim::AdamW::new(amp::optim::AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.01,
        ..Default::default()
    })?;
    let width = train.width;
    let (model, mut opt, amp) = amp::initialize(|vb| Mlp::new(vb, width, HIDDEN, classes), adamw, config)?;
    let param_dtype = amp
        .store()
        .param("fc1.weight")
        .context("the model has fc1.weight")?
        .working
        .dtype();

    let mut start = 0usize;
    let mut progress = Progress::default();
    if let Some(root) = &a.resume {
        let dir = run_dir(root, "mlp", level, a.half);
        let ck = dir
            .load()
            .with_context(|| format!("resuming {level} from {}", dir.root().display()))?;
        ck.restore(&amp, &mut [&mut opt])?;
        progress = serde_json::from_value(ck.extra.clone()).context("the checkpoint's example progress")?;
        start = ck.step as usize;
        if start > a.steps {
            bail!(
                "the checkpoint in {} is at step {start}, beyond --steps {}",
                dir.root().display(),
                a.steps
            );
        }
        if progress.losses.len() != start {
            bail!(
                "the checkpoint in {} is inconsistent: {} losses for step {start}",
                dir.root().display(),
                progress.losses.len()
            );
        }
    }

    let pb = ProgressBar::new(a.steps.saturating_sub(start) as u64);
    pb.set_style(ProgressStyle::with_template("{prefix:>4} [{bar:30}] {pos}/{len} {msg}")?.progress_chars("=> "));
    pb.set_prefix(level.to_string());

    // Batches from a seeded permutation of the training rows, reshuffled every epoch. The
    // generator belongs to the run, so checkpoints carry it.
    let data_rng = amp.generator("data");
    let Progress { mut losses, mut order } = progress;
    let mut times = Vec::with_capacity(a.steps);
    for _ in start..a.steps {
        if order.len() < BATCH.min(train.len()) {
            let mut perm: Vec<usize> = (0..train.len()).collect();
            perm.shuffle(&mut *data_rng.lock());
            order.extend(perm);
        }
        let idx: Vec<usize> = order.drain(..BATCH.min(train.len())).collect();
        let (x, y) = tensors(train, &idx, &dev)?;
        let t0 = Instant::now();
        let logits = model.forward(&x)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
        amp.scale_loss(&loss, &mut opt)?.backward()?;
        opt.step()?;
        opt.zero_grad();
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        let l = loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        losses.push(l);
        pb.set_message(format!("loss {l:.4}"));
        pb.inc(1);
    }
    pb.finish_and_clear();
    if let Some(root) = &a.save {
        let dir = run_dir(root, "mlp", level, a.half);
        let mut ck = Checkpoint::capture(&amp, &[&opt], losses.len() as u64)?;
        ck.extra = serde_json::to_value(Progress {
            losses: losses.clone(),
            order,
        })?;
        dir.save(&ck)?;
    }

    let tail = (losses.len() / 10).max(1).min(losses.len());
    let final_loss = if tail == 0 {
        f64::NAN
    } else {
        losses[losses.len() - tail..].iter().sum::<f64>() / tail as f64
    };
    model.eval();
    let all: Vec<usize> = (0..test.len()).collect();
    let (x, y) = tensors(test, &all, &dev)?;
    let logits = model.forward(&x)?;
    let eval_loss = candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()? as f64;
    let pred = logits.argmax(1)?.to_vec1::<u32>()?;
    let correct = pred.iter().zip(&test.y).filter(|(p, t)| p == t).count();
    times.sort_by(|p, q| p.total_cmp(q));
    let step_ms = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    Ok(RunResult {
        level,
        param_dtype,
        final_loss,
        eval_loss,
        accuracy: correct as f64 / test.len().max(1) as f64,
        skipped: opt.skipped_steps(),
        final_scale: amp.loss_scale(0)?,
        step_ms,
    })
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let a = parse_args()?;
    let ds = match &a.data {
        Some(p) => data::read_file(p)?,
        None => data::digits()?,
    };
    let classes = ds.classes();
    if classes < 2 {
        bail!("the data has {classes} class(es); a classifier needs at least 2");
    }
    let (train, test) = data::split_standardise(&ds, 0.2, a.seed);
    if test.len() == 0 || train.len() == 0 {
        bail!("the data has {} rows: too few for a 20% held-out split", ds.len());
    }
    if let Some(root) = &a.resume {
        // Verify every checkpoint before training anything.
        for &level in &a.levels {
            let dir = run_dir(root, "mlp", level, a.half);
            dir.load()
                .with_context(|| format!("resuming {level} from {}", dir.root().display()))?;
        }
    }
    let mut rows = Vec::new();
    for &level in &a.levels {
        let r = train_one(&train, &test, classes, level, &a)?;
        if a.json {
            let line = serde_json::json!({
                "model": "mlp",
                "opt_level": r.level.to_string(),
                "half": a.half.name(),
                "param_dtype": r.param_dtype.as_str(),
                "seed": a.seed,
                "steps": a.steps,
                "final_loss": r.final_loss,
                "eval_loss": r.eval_loss,
                "accuracy": r.accuracy,
                "skipped_steps": r.skipped,
                "final_loss_scale": r.final_scale,
                "step_ms": r.step_ms,
            });
            println!("{line}");
        }
        rows.push(r);
    }
    let mut table = format!(
        "{:<6} {:<5} {:<6} {:>10} {:>10} {:>9} {:>8} {:>12} {:>8}\n",
        "level", "half", "params", "final_loss", "eval_loss", "accuracy", "skipped", "loss_scale", "step_ms"
    );
    for r in &rows {
        table.push_str(&format!(
            "{:<6} {:<5} {:<6} {:>10.4} {:>10.4} {:>8.2}% {:>8} {:>12} {:>8.3}\n",
            r.level.to_string(),
            a.half.name(),
            r.param_dtype.as_str(),
            r.final_loss,
            r.eval_loss,
            r.accuracy * 100.0,
            r.skipped,
            r.final_scale,
            r.step_ms
        ));
    }
    if a.json {
        eprint!("{table}");
    } else {
        print!("{table}");
    }
    Ok(())
}
