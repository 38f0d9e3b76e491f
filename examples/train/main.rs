//! Trains small models at each opt level and reports loss, accuracy, skipped steps, the
//! final loss scale and the median step time.
//!
//! `cargo run --release --example train -- [--model mlp|cnn|transformer]...
//!  [--opt-level O0|O1|O2|O3]... [--half f16|bf16] [--data FILE.csv] [--steps N] [--seed N]
//!  [--json] [--save DIR] [--resume DIR] [--report DIR] [--doctor DIR] [--checkpoint SEGMENTS]
//!  [--ffn-chunk N]`
//!
//! * `mlp` and `cnn` classify the bundled UCI digits (8x8 images), `transformer` learns to
//!   reverse short digit sequences it generates.
//! * `--save DIR` writes a checkpoint per run under `DIR/<model>-<level>-<half>/` at the end
//!   (`<model>-O0-f32` at O0, f32 whatever `--half` says); `--resume DIR` continues each run
//!   from there (`--steps` counts from the start of training, `--seed` must be the saved
//!   one), so a run cut in two prints the same JSON as one run straight through, but for
//!   `step_ms` (the median over all the run's steps). A run already at `--steps` trains
//!   nothing, says so, and prints the saved run's row.
//! * `--checkpoint SEGMENTS` runs the transformer's blocks with gradient checkpointing in
//!   that many segments (the last runs normally); `--ffn-chunk N` runs its feed-forward on
//!   slices of N positions, each recomputed in the backward. Both trade time for memory and
//!   leave the results as they are, up to rounding; the JSON rows record them
//!   (`checkpoint_segments`, `ffn_chunk`: `null` when unused).
//! * A flag given twice, or one that no model trained uses, is a usage error (exit status 2).
//! * `--doctor DIR` attaches the numerics doctor (every 10th step) to each run and writes
//!   `DIR/<model>-<level>-<half>-doctor.json` (its report) and `.svg` (per-activation amax and
//!   f16 underflow, the loss scale over the steps); at O0 too, where the report says what
//!   the half type would do.
//! * `--report DIR` draws `DIR/<model>.svg`: training loss per step for each level, and the
//!   loss scale over the steps with skipped steps marked.

mod args;
mod cli;
mod data;
mod doctor_svg;
mod models;
mod report;
mod resume;
#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_amp as amp;
use candle_core::{DType, Device, Tensor};
use candle_nn::ModuleT;
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use args::{Args, ModelKind, Parsed};
use cli::{adamw, check_writable, half_label, rows, weight_dtype};
use data::Dataset;
use models::{Cnn, Mlp, Transformer, TransformerConfig};
use resume::{Progress, Resumed, load_resumed, run_dir};

const HIDDEN: usize = 256;
const BATCH: usize = 128;
/// The sequence task: reverse `SEQ` digits written after a separator.
const SEQ: usize = 8;
const SEP: u32 = 10;
const SEQ_BATCH: usize = 32;
const SEQ_HELD_OUT: usize = 512;
const TRANSFORMER_LAYERS: usize = 2;

/// One run's results and per-step history.
struct RunResult {
    level: amp::OptLevel,
    param_dtype: DType,
    final_loss: f64,
    eval_loss: f64,
    accuracy: f64,
    skipped: u64,
    final_scale: f32,
    /// The median step time over all the run's steps (those before a resumed checkpoint
    /// included); `None` only for an old checkpoint without step times and nothing to train.
    step_ms: Option<f64>,
    /// Ops that ran in half in the last step (O1; a resumed run with nothing to train
    /// reports the saved run's).
    autocast_ops: usize,
    progress: Progress,
}

/// A task: its data and how to batch and score it.
enum Task {
    Digits {
        train: Dataset,
        test: Dataset,
        classes: usize,
    },
    Reverse {
        held_out: (Tensor, Tensor),
    },
}

/// `n` sequences `[x_0..x_7, SEP, x_7..x_1]` as inputs and their next tokens as targets.
/// A step's time in milliseconds, in whole microseconds: a short decimal reads back from the
/// checkpoint's JSON to the same f64 (serde_json's default parser can be one ulp off on
/// 17-digit values), so a resumed run prints the saved run's `step_ms` exactly.
fn step_time_ms(d: std::time::Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn reverse_batch(rng: &mut impl Rng, n: usize) -> Result<(Tensor, Tensor)> {
    let mut inp = Vec::with_capacity(n * 2 * SEQ);
    let mut tgt = Vec::with_capacity(n * 2 * SEQ);
    for _ in 0..n {
        let x: Vec<u32> = (0..SEQ).map(|_| rng.random_range(0..10)).collect();
        let mut s = x.clone();
        s.push(SEP);
        s.extend(x.iter().rev());
        inp.extend_from_slice(&s[..2 * SEQ]);
        tgt.extend_from_slice(&s[1..]);
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(inp, (n, 2 * SEQ), &dev)?,
        Tensor::from_vec(tgt, (n, 2 * SEQ), &dev)?,
    ))
}

/// The model variants the example trains.
enum Net {
    Mlp(Mlp),
    Cnn(Cnn),
    Transformer(Transformer),
}

impl ModuleT for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) => candle_nn::Module::forward(m, x),
            Net::Cnn(m) => m.forward_t(x, train),
            Net::Transformer(m) => m.forward_t(x, train),
        }
    }
}

/// The loss and the count of correct predictions (the sequence task scores only the
/// reversed half).
fn score(kind: ModelKind, logits: &Tensor, y: &Tensor) -> Result<(Tensor, usize, usize)> {
    let (logits, y) = match kind {
        ModelKind::Transformer => (logits.narrow(1, SEQ, SEQ)?, y.narrow(1, SEQ, SEQ)?),
        _ => (logits.clone(), y.clone()),
    };
    let loss = amp::ops::cross_entropy(&logits, &y)?;
    let last = logits.rank() - 1;
    let pred = logits.argmax(last)?.flatten_all()?.to_vec1::<u32>()?;
    let truth = y.flatten_all()?.to_vec1::<u32>()?;
    let correct = pred.iter().zip(&truth).filter(|(p, t)| p == t).count();
    Ok((loss, correct, truth.len()))
}

fn train_one(
    kind: ModelKind,
    task: &Task,
    level: amp::OptLevel,
    a: &Args,
    resumed: Option<Resumed>,
) -> Result<RunResult> {
    let config = amp::AmpConfig::new(level).half(a.half).seed(a.seed);
    let amp = amp::Amp::new(config, &Device::Cpu)?;
    let dropout = amp.generator("dropout");
    // Checkpointed segments and feed-forward slices are recorded here and recomputed by its
    // backward driver.
    let recompute = (kind == ModelKind::Transformer && (a.checkpoint.is_some() || a.ffn_chunk.is_some()))
        .then(|| amp::recompute::Recompute::new(&amp));
    let model = amp.model(|vb| {
        Ok(match (kind, task) {
            (ModelKind::Mlp, Task::Digits { train, classes, .. }) => {
                Net::Mlp(Mlp::new(vb, train.width, HIDDEN, *classes)?)
            }
            (ModelKind::Cnn, Task::Digits { train, classes, .. }) => {
                let side = (train.width as f64).sqrt() as usize;
                Net::Cnn(Cnn::new(vb, side, *classes)?)
            }
            _ => {
                let c = TransformerConfig {
                    vocab: 11,
                    context: 2 * SEQ,
                    d_model: 64,
                    heads: 4,
                    layers: TRANSFORMER_LAYERS,
                    dropout: 0.1,
                    checkpoint: a.checkpoint.unwrap_or(0),
                    ffn_chunk: a.ffn_chunk.unwrap_or(0),
                    vocab_pad: 1,
                };
                Net::Transformer(Transformer::new(vb, c, dropout, recompute.clone())?)
            }
        })
    })?;
    let mut opt = amp.optimizer(adamw()?)?;
    let param_dtype = weight_dtype(&amp)?;
    let doctor = match &a.doctor {
        Some(_) => Some(amp::doctor::Doctor::attach(&amp, Default::default())?),
        None => None,
    };

    let mut progress = Progress {
        seed: Some(a.seed),
        ..Default::default()
    };
    if let Some(r) = resumed {
        r.ck.restore(&amp, &mut [&mut opt])?;
        progress = r.progress;
        progress.seed = Some(a.seed);
    }
    let start = progress.losses.len();

    let pb = ProgressBar::new(a.steps.saturating_sub(start) as u64);
    pb.set_style(ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} {msg}")?.progress_chars("=> "));
    let label = format!("{} {level} {}", kind.name(), half_label(level, a.half));
    pb.set_prefix(label.clone());
    // indicatif draws nothing when stderr is not a terminal (CI logs, `2> file`): print a
    // line per run and every tenth of it instead.
    let lines = !std::io::stderr().is_terminal();
    let every = (a.steps / 10).max(1);
    if start == a.steps {
        // Said whatever stderr is: the row printed is the saved run's (see README).
        eprintln!("{label}: the checkpoint is already at step {start} (--steps {start}): nothing to train");
    } else if lines {
        eprintln!("{label}: training steps {}..{}", start + 1, a.steps);
    }

    // Batches come from the run's own "data" generator, so checkpoints carry the data order.
    let data_rng = amp.generator("data");
    for _ in start..a.steps {
        let (x, y) = match task {
            Task::Digits { train, .. } => {
                let n = BATCH.min(train.len());
                if progress.order.len() < n {
                    let mut perm: Vec<usize> = (0..train.len()).collect();
                    perm.shuffle(&mut *data_rng.lock());
                    progress.order.extend(perm);
                }
                let idx: Vec<usize> = progress.order.drain(..n).collect();
                rows(train, &idx)?
            }
            Task::Reverse { .. } => reverse_batch(&mut *data_rng.lock(), SEQ_BATCH)?,
        };
        let t0 = Instant::now();
        let logits = model.forward(&x)?;
        let (loss, _, _) = score(kind, &logits, &y)?;
        let guard = amp.scale_loss(&loss, &mut opt)?;
        match &recompute {
            Some(rc) => guard.backward_with(|l| rc.backward(l))?,
            None => guard.backward()?,
        };
        let outcome = opt.step()?;
        opt.zero_grad();
        progress.times.push(step_time_ms(t0.elapsed()));
        let l = loss.to_scalar::<f32>()? as f64;
        progress.losses.push(l);
        progress.scales.push(outcome.loss_scale());
        progress.skipped.push(outcome.is_skipped());
        pb.set_message(format!("loss {l:.4}"));
        pb.inc(1);
        let done = progress.losses.len();
        if lines && (done.is_multiple_of(every) || done == a.steps) {
            eprintln!(
                "{label}: step {done}/{} loss {l:.4} scale {}",
                a.steps,
                outcome.loss_scale()
            );
        }
    }
    pb.finish_and_clear();
    if start < a.steps {
        progress.autocast_ops = Some(amp.autocast_ops());
    }
    if let (Some(dir), Some(doctor)) = (&a.doctor, &doctor) {
        let report = doctor.report();
        // Named with the half type at O0 too: there the report says what that type would do.
        let base = std::path::Path::new(dir).join(format!("{}-{level}-{}-doctor", kind.name(), a.half));
        let json = base.with_extension("json");
        std::fs::write(&json, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", json.display()))?;
        let svg = base.with_extension("svg");
        let title = if level == amp::OptLevel::O0 {
            format!("{} O0 f32 (what {} would do)", kind.name(), a.half)
        } else {
            format!("{} {level} {}", kind.name(), a.half)
        };
        doctor_svg::draw(&svg, &title, &report)?;
        eprintln!("{report}");
        eprintln!("wrote {} and {}", json.display(), svg.display());
    }
    if let Some(root) = &a.save {
        let dir = run_dir(root, kind, level, a.half);
        dir.save(
            &amp,
            &[&opt],
            progress.losses.len() as u64,
            serde_json::to_value(&progress)?,
        )?;
    }

    let losses = &progress.losses;
    let tail = (losses.len() / 10).max(1).min(losses.len());
    let final_loss = if tail == 0 {
        f64::NAN
    } else {
        losses[losses.len() - tail..].iter().sum::<f64>() / tail as f64
    };
    model.eval();
    let (x, y) = match task {
        Task::Digits { test, .. } => rows(test, &(0..test.len()).collect::<Vec<_>>())?,
        Task::Reverse { held_out } => held_out.clone(),
    };
    let logits = model.forward(&x)?;
    let (eval_loss, correct, total) = score(kind, &logits, &y)?;
    let mut times = progress.times.clone();
    times.sort_by(|p, q| p.total_cmp(q));
    Ok(RunResult {
        level,
        param_dtype,
        final_loss,
        eval_loss: eval_loss.to_scalar::<f32>()? as f64,
        accuracy: correct as f64 / total.max(1) as f64,
        skipped: opt.skipped_steps(),
        final_scale: amp.loss_scale(0)?,
        step_ms: times.get(times.len() / 2).copied(),
        autocast_ops: progress.autocast_ops.unwrap_or(0),
        progress,
    })
}

/// Whether rows of `width` features are square images the CNN takes (side divisible by 4).
fn cnn_fits(width: usize) -> bool {
    let side = (width as f64).sqrt() as usize;
    side * side == width && side.is_multiple_of(4)
}

/// With `--data` and no `--model`: the models that can learn from the file (the MLP always,
/// the CNN when rows are square images), saying on stderr which are left out and why.
fn models_for_data(a: &mut Args, width: usize) {
    let (Some(path), false) = (&a.data, a.models_given) else {
        return;
    };
    let mut left_out = vec!["transformer (it learns a generated sequence task, not the file's rows)".to_string()];
    if !cnn_fits(width) {
        left_out.push(format!(
            "cnn (it needs square images with a side divisible by 4; the file has {width} features)"
        ));
    }
    a.models
        .retain(|&k| k == ModelKind::Mlp || (k == ModelKind::Cnn && cnn_fits(width)));
    eprintln!(
        "--data {path}: training {}; left out: {}",
        a.models.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
        left_out.join("; ")
    );
}

/// The classification data (`--data` or the bundled digits), checked for a classifier.
fn load_data(a: &Args) -> Result<Dataset> {
    let ds = match &a.data {
        Some(p) => data::read_file(p)?,
        None => data::digits()?,
    };
    let classes = ds.classes();
    if classes < 2 {
        bail!("the data has {classes} class(es); a classifier needs at least 2");
    }
    if let Some(w) = ds.empty_classes_warning() {
        eprintln!("warning: {w}");
    }
    Ok(ds)
}

fn make_task(kind: ModelKind, ds: Option<&Dataset>, a: &Args) -> Result<Task> {
    if kind == ModelKind::Transformer {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed ^ 0x00de_ad00_beef);
        return Ok(Task::Reverse {
            held_out: reverse_batch(&mut rng, SEQ_HELD_OUT)?,
        });
    }
    let ds = ds.context("the data is loaded for the digits models")?;
    if kind == ModelKind::Cnn && !cnn_fits(ds.width) {
        bail!(
            "the cnn needs square images with a side divisible by 4; the data has {} features (leave out \
             --model cnn, or train --model mlp)",
            ds.width
        );
    }
    let (train, test) = data::split_standardise(ds, 0.2, a.seed);
    if test.len() == 0 || train.len() == 0 {
        bail!("the data has {} rows: too few for a 20% held-out split", ds.len());
    }
    Ok(Task::Digits {
        train,
        test,
        classes: ds.classes(),
    })
}

/// Checks the flags against the models; a usage error exits with status 2.
fn check_models(a: &Args) {
    match args::check_models(a) {
        Ok(warnings) => warnings.iter().for_each(|w| eprintln!("warning: {w}")),
        Err(e) => {
            eprintln!("Error: {e}");
            std::process::exit(2);
        }
    }
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let mut a = match args::parse(std::env::args().skip(1)) {
        Ok(Parsed::Run(a)) => *a,
        Ok(Parsed::Help) => {
            println!("{}", args::usage());
            return Ok(());
        }
        Err(e) => {
            eprintln!("Error: {e}");
            std::process::exit(2);
        }
    };
    // With --model given, the flags are checked before the data is read.
    if a.models_given {
        check_models(&a);
    }
    let ds = if a.data.is_some() || a.models.iter().any(|&k| k != ModelKind::Transformer) {
        Some(load_data(&a)?)
    } else {
        None
    };
    if let (false, Some(ds)) = (a.models_given, &ds) {
        models_for_data(&mut a, ds.width);
        check_models(&a);
    }
    // Output paths are checked before the first step, not after a long run.
    if let Some(dir) = &a.save {
        check_writable("--save", dir)?;
    }
    if let Some(dir) = &a.report {
        check_writable("--report", dir)?;
    }
    if let Some(dir) = &a.doctor {
        check_writable("--doctor", dir)?;
    }
    // Every checkpoint is loaded and checked before training anything, once (a recovery
    // from a damaged LATEST is logged once).
    let mut resumed = std::collections::HashMap::new();
    if let Some(root) = &a.resume {
        for &kind in &a.models {
            for &level in &a.levels {
                resumed.insert((kind, level), load_resumed(root, kind, level, &a)?);
            }
        }
    }
    let mut table = format!(
        "{:<12} {:<6} {:<5} {:<6} {:>10} {:>10} {:>9} {:>8} {:>12} {:>8}\n",
        "model", "level", "half", "params", "final_loss", "eval_loss", "accuracy", "skipped", "loss_scale", "step_ms"
    );
    // Prepare every task first, so that bad data fails before any training.
    let tasks = a
        .models
        .iter()
        .map(|&k| Ok((k, make_task(k, ds.as_ref(), &a)?)))
        .collect::<Result<Vec<_>>>()?;
    for (kind, task) in &tasks {
        let (kind, task) = (*kind, task);
        let mut runs = Vec::new();
        for &level in &a.levels {
            let r = train_one(kind, task, level, &a, resumed.remove(&(kind, level)))?;
            if a.json {
                let transformer = kind == ModelKind::Transformer;
                let mut line = serde_json::json!({
                    "model": kind.name(),
                    "opt_level": r.level.to_string(),
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
                    "checkpoint_segments": a.checkpoint.filter(|_| transformer),
                    "ffn_chunk": a.ffn_chunk.filter(|_| transformer),
                });
                if r.level == amp::OptLevel::O1 {
                    line["autocast_ops"] = r.autocast_ops.into();
                }
                println!("{line}");
            }
            table.push_str(&format!(
                "{:<12} {:<6} {:<5} {:<6} {:>10.4} {:>10.4} {:>8.2}% {:>8} {:>12} {:>8}\n",
                kind.name(),
                r.level.to_string(),
                half_label(r.level, a.half),
                r.param_dtype.as_str(),
                r.final_loss,
                r.eval_loss,
                r.accuracy * 100.0,
                r.skipped,
                r.final_scale,
                r.step_ms.map_or("-".into(), |t| format!("{t:.3}"))
            ));
            runs.push(r);
        }
        if let Some(dir) = &a.report {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {dir}"))?;
            let path = std::path::Path::new(dir).join(format!("{}.svg", kind.name()));
            let series: Vec<report::Series> = runs
                .iter()
                .map(|r| report::Series {
                    label: r.level.to_string(),
                    losses: r.progress.losses.clone(),
                    scales: r.progress.scales.clone(),
                    skipped: r.progress.skipped.clone(),
                })
                .collect();
            report::draw(&path, &format!("{} ({})", kind.name(), a.half), &series)?;
            eprintln!("wrote {}", path.display());
        }
    }
    if a.json {
        eprint!("{table}");
    } else {
        print!("{table}");
    }
    Ok(())
}
