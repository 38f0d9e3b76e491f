//! Trains `candle_amp::models::llama` as a byte-level language model (vocabulary 256) on a
//! text, at one opt level, then samples from it; or, with `--model bert|vit`, BERT or ViT on
//! a synthetic task.
//!
//! `cargo run --release --example lm -- [--model llama|bert|vit] [--text FILE] [--steps N]
//!  [--opt-level O0|O1|O2|O3] [--half f16|bf16] [--size tiny|small] [--seed N] [--json]
//!  [--save DIR] [--resume DIR] [--report FILE.svg] [--prompt TEXT] [--sample BYTES]
//!  [--temperature T]` (`--help` prints the flags as a table).
//!
//! * Llama (the default) learns `--text FILE`'s bytes, or by default the bundled "Around the
//!   World in 80 Days" (Project Gutenberg, public domain; its header and licence left out);
//!   the last tenth is held out for the final evaluation.
//! * `--model bert`: token classification of padded sequences (lengths from half the
//!   context to all of it; the tag of a token depends on the first token, so attention must
//!   carry it), loss and accuracy over the real tokens. `--model vit`: noisy images, the
//!   class the lit quadrant and channel (8 classes). Both are learnable in a few hundred
//!   steps; their held-out sets are fixed. See `tasks.rs`.
//! * Defaults: 300 steps at O2 bf16, the tiny model (width 64, 2 blocks; Llama with
//!   grouped-query attention and context 64), seed 0. `--steps 20` runs in seconds even in a
//!   debug build.
//! * `--save DIR` writes a checkpoint there at the end (the library's `CheckpointDir`);
//!   `--resume DIR` continues from it (`--steps` counts from the start of training; the
//!   model, seed, size, level and half type must be the saved run's), so a run cut in two
//!   ends with the same weights and losses as one run straight through.
//! * `--report FILE.svg` draws the training loss per step and the loss scale.
//! * Llama: at the end `--sample` bytes (200) are generated after `--prompt` ("Phileas
//!   Fogg") with temperature `--temperature` (0.8; 0 is greedy), from a generator seeded by
//!   `--seed`, and printed to stderr. Those flags are refused with the other models.
//! * `--json` prints one JSON object on stdout and the progress on stderr: `model`, `size`,
//!   `opt_level`, `half`, `seed`, `steps`, `final_loss`, `eval_loss`, `skipped_steps`,
//!   `final_loss_scale`, `step_ms`, and Llama's `eval_bits_per_byte` and `sample` or the
//!   others' `eval_accuracy`.

mod args;
mod data;
#[path = "../train/report.rs"]
mod report;
mod tasks;

use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_amp as amp;
use candle_amp::checkpoint::CheckpointDir;
use candle_amp::models::bert::BertForTokenClassification;
use candle_amp::models::llama::{Config, Llama};
use candle_amp::models::vit;
use candle_core::{D, DType, Device, Tensor};
use rand::SeedableRng;
use rand::distr::{Distribution, weighted::WeightedIndex};

use args::{Args, Model, Parsed, Size};

/// Windows (Llama) or sequences (BERT) per training batch.
const BATCH: usize = 16;
/// Images per ViT training batch.
const VIT_BATCH: usize = 32;
/// Windows or sequences of the held-out evaluation.
const HELD_OUT: usize = 64;
/// Images of ViT's held-out evaluation.
const VIT_HELD_OUT: usize = 256;

/// The model for a size: bytes in, bytes out, untied head (candle-nn's embedding
/// initialisation, N(0, 1), would make a tied head's first logits huge).
fn config(size: Size) -> Config {
    let (hidden, layers, heads, kv_heads, context) = match size {
        Size::Tiny => (64, 2, 4, 2, 64),
        Size::Small => (128, 4, 8, 4, 128),
    };
    Config {
        hidden_size: hidden,
        intermediate_size: hidden * 8 / 3,
        vocab_size: 256,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: context,
        tie_word_embeddings: false,
    }
}

/// What the example keeps in a checkpoint beside the library's state.
#[derive(serde::Serialize, serde::Deserialize, Default, Clone)]
struct Progress {
    losses: Vec<f64>,
    scales: Vec<f32>,
    skipped: Vec<bool>,
    times: Vec<f64>,
    seed: u64,
    /// `None` in a checkpoint from before `--model`: Llama.
    #[serde(default)]
    model: Option<Model>,
    size: Option<Size>,
    opt_level: String,
    half: String,
}

/// The type a run computes in, for labels: f32 at O0 whatever `--half` says.
fn compute_type(a: &Args) -> String {
    if a.level == amp::OptLevel::O0 {
        "f32".into()
    } else {
        a.half.to_string()
    }
}

/// Loads `dir`'s checkpoint into the run after checking it against the command line.
fn resume(dir: &str, a: &Args, amp: &amp::Amp, opt: &mut amp::AmpOptimizer) -> Result<Progress> {
    let ck = CheckpointDir::new(dir, 1)
        .load()
        .with_context(|| format!("--resume {dir}"))?;
    let mut p: Progress = serde_json::from_value(ck.extra().clone()).with_context(|| format!("{dir}: the progress"))?;
    // The losses are f32 values; rounded back so that a resumed run's numbers equal a straight run's.
    for l in &mut p.losses {
        *l = *l as f32 as f64;
    }
    let saved_model = p.model.unwrap_or(Model::Llama);
    let saved = (saved_model, p.seed, p.size, p.opt_level.clone(), p.half.clone());
    let now = (a.model, a.seed, Some(a.size), a.level.to_string(), compute_type(a));
    if saved != now {
        bail!(
            "--resume {dir}: saved with --model {} --seed {} --size {} --opt-level {} ({}); this run asks for --model {} \
             --seed {} --size {} --opt-level {} ({})",
            saved_model.name(),
            p.seed,
            p.size.map_or("?", Size::name),
            p.opt_level,
            p.half,
            a.model.name(),
            a.seed,
            a.size.name(),
            a.level,
            now.4
        );
    }
    let step = ck.step() as usize;
    if step > a.steps || p.losses.len() != step {
        bail!(
            "--resume {dir}: the checkpoint is at step {step} ({} losses), beyond --steps {}",
            p.losses.len(),
            a.steps
        );
    }
    ck.restore(amp, &mut [opt])?;
    Ok(p)
}

/// Generates `n` bytes after `prompt`: each from the last position's logits over at most
/// `context` bytes, greedy at temperature 0, else sampled.
fn sample(model: &amp::AmpModel<Llama>, prompt: &[u8], n: usize, temperature: f64, seed: u64) -> Result<Vec<u8>> {
    let context = model.inner().config().max_position_embeddings;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5a3b_1e00);
    let mut out = prompt.to_vec();
    for _ in 0..n {
        let window = &out[out.len().saturating_sub(context)..];
        let ids = Tensor::from_vec(
            window.iter().map(|b| *b as u32).collect(),
            (1, window.len()),
            &Device::Cpu,
        )?;
        // In f32: at O1 the logits come as the head's product made them, in half.
        let logits = model
            .forward(&ids)?
            .get(0)?
            .get(window.len() - 1)?
            .to_dtype(DType::F32)?;
        let next = if temperature == 0.0 {
            logits.argmax(D::Minus1)?.to_scalar::<u32>()? as u8
        } else {
            let p = candle_nn::ops::softmax_last_dim(&(logits / temperature)?)?.to_vec1::<f32>()?;
            WeightedIndex::new(&p)?.sample(&mut rng) as u8
        };
        out.push(next);
    }
    Ok(out)
}

/// The model being trained, with what its batches come from.
// One per process: the variants' sizes do not matter (they differ with the `cuda` feature).
#[allow(clippy::large_enum_variant)]
enum Net {
    Llama {
        model: amp::AmpModel<Llama>,
        text: data::Text,
        context: usize,
    },
    Bert {
        model: amp::AmpModel<BertForTokenClassification>,
        context: usize,
    },
    Vit {
        model: amp::AmpModel<vit::Model>,
        side: usize,
    },
}

/// What the held-out evaluation measured: the loss, and the accuracy (BERT, ViT).
struct Eval {
    loss: f64,
    accuracy: Option<f64>,
}

impl Net {
    /// Builds `a.model` in `amp`'s run; Llama reads its text first (so a bad `--text` fails
    /// before anything is built).
    fn build(a: &Args, amp: &amp::Amp) -> Result<Self> {
        Ok(match a.model {
            Model::Llama => {
                let cfg = config(a.size);
                let context = cfg.max_position_embeddings;
                let what = a.text.as_deref().unwrap_or("the bundled text");
                let text = data::Text::split(data::load(a.text.as_deref())?, context, what)?;
                Net::Llama {
                    model: amp.model(|vb| Llama::load(vb, &cfg))?,
                    text,
                    context,
                }
            }
            Model::Bert => {
                let cfg = tasks::bert_config(a.size);
                Net::Bert {
                    model: amp.model(|vb| BertForTokenClassification::load(vb, &cfg, tasks::BERT_TAGS))?,
                    context: cfg.max_position_embeddings,
                }
            }
            Model::Vit => {
                let cfg = tasks::vit_config(a.size);
                Net::Vit {
                    model: amp.model(|vb| vit::Model::load(vb, &cfg, tasks::VIT_CLASSES))?,
                    side: cfg.image_size,
                }
            }
        })
    }

    /// What the run trains on, for the first progress line.
    fn describe(&self) -> String {
        match self {
            Net::Llama { text, .. } => format!("{} training bytes, {} held out", text.train.len(), text.held_out.len()),
            Net::Bert { context, .. } => format!(
                "synthetic token classification, {BATCH} sequences of {} to {context} tokens per batch",
                context / 2
            ),
            Net::Vit { side, .. } => {
                format!(
                    "synthetic {side}x{side} images, {VIT_BATCH} per batch, {} classes",
                    tasks::VIT_CLASSES
                )
            }
        }
    }

    /// Draws a batch from `rng` (on the host), then returns the time the forward started
    /// and the loss.
    fn step_loss(&self, rng: &mut impl rand::Rng) -> Result<(Instant, Tensor)> {
        Ok(match self {
            Net::Llama { model, text, context } => {
                let (x, y) = data::batch(&text.train, BATCH, *context, rng)?;
                let t0 = Instant::now();
                // The head and the loss as one node in the run's scope: no logits tensor.
                (t0, model.call(|m| m.loss(&x, &y))?)
            }
            Net::Bert { model, context } => {
                let b = tasks::bert_batch(BATCH, *context, rng)?;
                let t0 = Instant::now();
                (t0, tasks::loss(true, &model.forward(&b.input)?, &b)?)
            }
            Net::Vit { model, side } => {
                let b = tasks::vit_batch(VIT_BATCH, *side, rng)?;
                let t0 = Instant::now();
                (t0, tasks::loss(false, &model.forward(&b.input)?, &b)?)
            }
        })
    }

    /// The held-out loss (and accuracy), in evaluation mode.
    fn evaluate(&self) -> Result<Eval> {
        let scalar = |t: Tensor| -> Result<f64> { Ok(t.to_scalar::<f32>()? as f64) };
        Ok(match self {
            Net::Llama { model, text, context } => {
                model.eval();
                let (hx, hy) = data::held_out(&text.held_out, HELD_OUT, *context)?;
                Eval {
                    loss: scalar(amp::ops::cross_entropy(&model.forward(&hx)?, &hy)?)?,
                    accuracy: None,
                }
            }
            Net::Bert { model, context } => {
                model.eval();
                let b = tasks::held_out(true, HELD_OUT, *context)?;
                let logits = model.forward(&b.input)?;
                Eval {
                    loss: scalar(tasks::loss(true, &logits, &b)?)?,
                    accuracy: Some(tasks::accuracy(true, &logits, &b)?),
                }
            }
            Net::Vit { model, side } => {
                model.eval();
                let b = tasks::held_out(false, VIT_HELD_OUT, *side)?;
                let logits = model.forward(&b.input)?;
                Eval {
                    loss: scalar(tasks::loss(false, &logits, &b)?)?,
                    accuracy: Some(tasks::accuracy(false, &logits, &b)?),
                }
            }
        })
    }
}

fn run(a: &Args) -> Result<()> {
    if let Some(dir) = &a.save {
        std::fs::create_dir_all(dir).with_context(|| format!("--save {dir}: cannot create the directory"))?;
    }
    if let Some(path) = &a.report
        && let Some(parent) = std::path::Path::new(path)
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent).with_context(|| format!("--report {path}: cannot create its directory"))?;
    }
    let amp = amp::Amp::new(amp::AmpConfig::new(a.level).half(a.half).seed(a.seed), &Device::Cpu)?;
    let net = Net::build(a, &amp)?;
    let mut opt = amp.optimizer(amp::optim::AdamW::new(amp::optim::AdamWConfig {
        // Post-norm BERT with a constant rate is unstable at 3e-3 (its loss jumps back up
        // after converging, in f32 too).
        lr: if a.model == Model::Bert { 1e-3 } else { 3e-3 },
        weight_decay: 0.01,
        ..Default::default()
    })?)?;
    let mut p = match &a.resume {
        Some(dir) => resume(dir, a, &amp, &mut opt)?,
        None => Progress {
            seed: a.seed,
            model: Some(a.model),
            size: Some(a.size),
            opt_level: a.level.to_string(),
            half: compute_type(a),
            ..Default::default()
        },
    };
    let label = format!("{} {} {} {}", a.model.name(), a.size.name(), a.level, compute_type(a));
    let start = p.losses.len();
    if start == a.steps {
        eprintln!("{label}: the checkpoint is already at step {start}: nothing to train");
    } else {
        eprintln!("{label}: {}; steps {}..{}", net.describe(), start + 1, a.steps);
    }
    // Batches come from the run's "data" generator, so a checkpoint carries the data order.
    let data_rng = amp.generator("data");
    let every = (a.steps / 10).max(1);
    for step in start + 1..=a.steps {
        let (t0, loss) = net.step_loss(&mut *data_rng.lock())?;
        amp.scale_loss(&loss, &mut opt)?.backward()?;
        let outcome = opt.step()?;
        opt.zero_grad();
        // Whole microseconds: the value reads back from the checkpoint's JSON exactly.
        p.times.push((t0.elapsed().as_secs_f64() * 1e6).round() / 1e3);
        let l = loss.to_scalar::<f32>()? as f64;
        p.losses.push(l);
        p.scales.push(outcome.loss_scale());
        p.skipped.push(outcome.is_skipped());
        if step % every == 0 || step == a.steps {
            eprintln!(
                "{label}: step {step}/{} loss {l:.4} scale {}",
                a.steps,
                outcome.loss_scale()
            );
        }
    }
    if let Some(dir) = &a.save {
        let path = CheckpointDir::new(dir, 1).save(&amp, &[&opt], p.losses.len() as u64, serde_json::to_value(&p)?)?;
        eprintln!("saved {}", path.display());
    }
    if let Some(path) = &a.report {
        let series = [report::Series {
            label: format!("{} {}", a.level, compute_type(a)),
            losses: p.losses.clone(),
            scales: p.scales.clone(),
            skipped: p.skipped.clone(),
        }];
        report::draw(
            std::path::Path::new(path),
            &format!("lm, {} {}", a.model.name(), a.size.name()),
            &series,
        )?;
        eprintln!("wrote {path}");
    }

    let eval = net.evaluate()?;
    let sample_text = match &net {
        Net::Llama { model, .. } => {
            let generated = sample(model, a.prompt.as_bytes(), a.sample, a.temperature, a.seed)?;
            let text = String::from_utf8_lossy(&generated).into_owned();
            eprintln!("--- sample (temperature {}) ---\n{text}\n---", a.temperature);
            Some(text)
        }
        _ => None,
    };

    let tail = (p.losses.len() / 10).max(1).min(p.losses.len());
    let final_loss = p.losses[p.losses.len() - tail..].iter().sum::<f64>() / tail.max(1) as f64;
    let mut times = p.times.clone();
    times.sort_by(|x, y| x.total_cmp(y));
    let step_ms = times.get(times.len() / 2).copied();
    let skipped = p.skipped.iter().filter(|s| **s).count();
    let bits = eval.loss / std::f64::consts::LN_2;
    if a.json {
        let mut line = serde_json::json!({
            "model": a.model.name(),
            "size": a.size.name(),
            "opt_level": a.level.to_string(),
            "half": compute_type(a),
            "seed": a.seed,
            "steps": a.steps,
            "final_loss": final_loss,
            "eval_loss": eval.loss,
            "skipped_steps": skipped,
            "final_loss_scale": amp.loss_scale(0)?,
            "step_ms": step_ms,
        });
        // Llama's keys as before `--model`; the classifiers' accuracy instead.
        match (sample_text, eval.accuracy) {
            (Some(text), _) => {
                line["eval_bits_per_byte"] = bits.into();
                line["sample"] = text.into();
            }
            (None, acc) => line["eval_accuracy"] = acc.into(),
        }
        println!("{line}");
    } else {
        let measured = match eval.accuracy {
            Some(acc) => format!("held-out loss {:.4}, accuracy {:.1}%", eval.loss, 100.0 * acc),
            None => format!("held-out loss {:.4} ({bits:.3} bits per byte)", eval.loss),
        };
        println!(
            "{label}: final loss {final_loss:.4}, {measured}, {skipped} skipped steps, loss scale {}, median step {} ms",
            amp.loss_scale(0)?,
            step_ms.map_or("-".into(), |t| format!("{t:.3}"))
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let a = match args::parse(std::env::args().skip(1)) {
        Ok(Parsed::Run(a)) => *a,
        Ok(Parsed::Help) => {
            print!("{}", args::help());
            return Ok(());
        }
        Err(e) => {
            eprintln!("Error: {e}");
            std::process::exit(2);
        }
    };
    run(&a)
}
