//! The library's three model families (`candle_amp::models::{llama, bert, vit}`) trained at
//! every level, beside PyTorch (`benches/peers/torch_models.py`, same shapes).
//!
//! A step is forward, loss, scaled backward and the AdamW step (lr 1e-3, weight decay 0.01)
//! on fixed random inputs, at the shapes of `torch_models.py`:
//! - Llama: dim 256, 6 layers, 8 heads with 4 key/value heads, SwiGLU hidden 768, RoPE,
//!   sequence 128, batch 8, vocabulary 1024, untied head, next-token cross entropy.
//! - BERT: hidden 256, 4 layers, 4 heads, intermediate 1024, vocabulary 1024, sequence 128,
//!   batch 8, lengths 64-128 (padding id 0, so a key padding mask), token classification
//!   into 16 classes over the real positions.
//! - ViT: hidden 192, 6 layers, 3 heads, intermediate 768, patch 4 on 32x32x3, batch 32,
//!   10 classes.
//!
//! `--quick` shrinks each to a few thousand parameters (a smoke test of the code path; its
//! figures mean nothing). The seven configurations of a model (O0, then O1 to O3 in f16 and
//! bf16) are held at once: each runs a warm-up step and a step whose peak is reported (the
//! bytes allocated during it beyond what was live before it, `counting.rs`), then they are
//! timed in interleaved rounds of one step each, configuration after configuration, so a
//! slow spell of a shared machine falls on all of them; the figure is the median step.
//!
//! A fourth, `llama_small` ([`SMALL`]: a llama2.c-sized Llama, no PyTorch peer), is measured
//! the same way; its one target is that no half level is slower than O0.
//!
//! JSON (`bench --json`): `archs.{llama,bert,vit,llama_small}` holds `shape` (as `torch_models.py`
//! names it), `rounds`, `steps` and `levels.{O0..O3}.{f16,bf16}.{step_ms, peak_mb}` (O0 is
//! measured once, f32 throughout, and appears under both half types); the same figures
//! appear beside the MLP's as `levels[L][H].{llama,bert,vit,llama_small}_step_ms` and `..._peak_mb`.
//! With `--torch-models FILE`, `archs.torch` is that file's object and `archs.{model}` gains
//! `torch_fp32_step_ms` and `torch_autocast_bf16_step_ms`.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_amp::models::{bert, llama, vit};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::counting;

/// The model families, as `torch_models.py` names them.
pub const NAMES: [&str; 3] = ["llama", "bert", "vit"];
/// Measured besides [`NAMES`], without a PyTorch peer: a llama2.c-sized Llama (dim 128,
/// 4 layers, 4 heads, SwiGLU hidden 384, sequence 64, batch 16), where the half levels have
/// the least to win; its one target is that no half level is slower than O0.
pub const SMALL: &str = "llama_small";

/// The configurations timed per model: O0 (f32; the half type is ignored) and each half
/// level in both half types.
fn configs() -> Vec<(OptLevel, HalfType)> {
    let mut c = vec![(OptLevel::O0, HalfType::F16)];
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        c.push((level, HalfType::F16));
        c.push((level, HalfType::Bf16));
    }
    c
}

/// The shapes of `name` as `torch_models.py`'s `SHAPES` has them (full sizes), or the
/// `--quick` ones.
pub fn shape(name: &str, quick: bool) -> Result<Value> {
    Ok(match (name, quick) {
        ("llama", false) => json!({"dim": 256, "layers": 6, "heads": 8, "kv_heads": 4, "hidden": 768,
            "seq": 128, "batch": 8, "vocab": 1024, "rope_theta": 10000.0}),
        ("llama", true) => json!({"dim": 32, "layers": 2, "heads": 4, "kv_heads": 2, "hidden": 48,
            "seq": 16, "batch": 2, "vocab": 64, "rope_theta": 10000.0}),
        ("llama_small", false) => json!({"dim": 128, "layers": 4, "heads": 4, "kv_heads": 4, "hidden": 384,
            "seq": 64, "batch": 16, "vocab": 1024, "rope_theta": 10000.0}),
        ("llama_small", true) => json!({"dim": 16, "layers": 1, "heads": 2, "kv_heads": 2, "hidden": 32,
            "seq": 8, "batch": 2, "vocab": 32, "rope_theta": 10000.0}),
        ("bert", false) => json!({"hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024,
            "vocab": 1024, "seq": 128, "batch": 8, "min_len": 64, "classes": 16}),
        ("bert", true) => json!({"hidden": 32, "layers": 2, "heads": 4, "intermediate": 64,
            "vocab": 64, "seq": 16, "batch": 2, "min_len": 8, "classes": 4}),
        ("vit", false) => json!({"hidden": 192, "layers": 6, "heads": 3, "intermediate": 768,
            "patch": 4, "image": 32, "channels": 3, "batch": 32, "classes": 10}),
        ("vit", true) => json!({"hidden": 24, "layers": 2, "heads": 3, "intermediate": 48,
            "patch": 4, "image": 8, "channels": 3, "batch": 2, "classes": 10}),
        _ => bail!("unknown model {name:?} (llama, llama_small, bert, vit)"),
    })
}

/// A shape field as `usize`.
fn dim(s: &Value, k: &str) -> Result<usize> {
    s[k].as_u64()
        .map(|n| n as usize)
        .with_context(|| format!("shape has no {k:?}"))
}

/// One model under training, with its fixed batch.
enum Net {
    Llama(amp::AmpModel<llama::Llama>, Tensor, Tensor),
    /// The ids (0 on padding), the flat indices of the real positions and their tags.
    Bert(amp::AmpModel<bert::BertForTokenClassification>, Tensor, Tensor, Tensor),
    Vit(amp::AmpModel<vit::Model>, Tensor, Tensor),
}

/// One configuration's run: the model, its optimizer and its `Amp`.
struct Run {
    net: Net,
    opt: amp::AmpOptimizer,
    amp: amp::Amp,
}

impl Run {
    fn new(name: &str, s: &Value, level: OptLevel, half: HalfType) -> Result<Self> {
        let cfg = AmpConfig::new(level).half(half).verbosity(0).seed(1);
        let amp = amp::Amp::new(cfg, &Device::Cpu)?;
        let opt = amp.optimizer(amp::optim::AdamW::new(amp::optim::AdamWConfig {
            lr: 1e-3,
            weight_decay: 0.01,
            ..Default::default()
        })?)?;
        let dev = Device::Cpu;
        // The same batch for every configuration of a model.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let (batch, vocab) = (dim(s, "batch")?, s["vocab"].as_u64().unwrap_or(0) as u32);
        let net = match name {
            "llama" | "llama_small" => {
                let (d, t) = (dim(s, "dim")?, dim(s, "seq")?);
                let c = llama::Config {
                    hidden_size: d,
                    intermediate_size: dim(s, "hidden")?,
                    vocab_size: vocab as usize,
                    num_hidden_layers: dim(s, "layers")?,
                    num_attention_heads: dim(s, "heads")?,
                    num_key_value_heads: Some(dim(s, "kv_heads")?),
                    rms_norm_eps: 1e-5,
                    rope_theta: 10_000.0,
                    rope_scaling: None,
                    max_position_embeddings: t,
                    tie_word_embeddings: false,
                };
                let seq: Vec<u32> = (0..batch * (t + 1)).map(|_| rng.random_range(0..vocab)).collect();
                let seq = Tensor::from_vec(seq, (batch, t + 1), &dev)?;
                Net::Llama(
                    amp.model(|vb| llama::Llama::load(vb, &c))?,
                    seq.narrow(1, 0, t)?.contiguous()?,
                    seq.narrow(1, 1, t)?.contiguous()?,
                )
            }
            "bert" => {
                let t = dim(s, "seq")?;
                let c = bert::Config {
                    vocab_size: vocab as usize,
                    hidden_size: dim(s, "hidden")?,
                    num_hidden_layers: dim(s, "layers")?,
                    num_attention_heads: dim(s, "heads")?,
                    intermediate_size: dim(s, "intermediate")?,
                    max_position_embeddings: t,
                    layer_norm_eps: 1e-12,
                    pad_token_id: 0,
                    ..bert::Config::default()
                };
                let classes = dim(s, "classes")?;
                let (mut ids, mut real, mut tags) = (Vec::new(), Vec::new(), Vec::new());
                for i in 0..batch {
                    let n = rng.random_range(dim(s, "min_len")?..=t);
                    for j in 0..t {
                        // Real tokens are never the padding id 0: the model masks by id.
                        ids.push(if j < n { rng.random_range(1..vocab) } else { 0 });
                        if j < n {
                            real.push((i * t + j) as u32);
                            tags.push(rng.random_range(0..classes as u32));
                        }
                    }
                }
                Net::Bert(
                    amp.model(|vb| bert::BertForTokenClassification::load(vb, &c, classes))?,
                    Tensor::from_vec(ids, (batch, t), &dev)?,
                    Tensor::new(real.as_slice(), &dev)?,
                    Tensor::new(tags.as_slice(), &dev)?,
                )
            }
            "vit" => {
                let (image, channels) = (dim(s, "image")?, dim(s, "channels")?);
                let c = vit::Config {
                    hidden_size: dim(s, "hidden")?,
                    num_hidden_layers: dim(s, "layers")?,
                    num_attention_heads: dim(s, "heads")?,
                    intermediate_size: dim(s, "intermediate")?,
                    image_size: image,
                    patch_size: dim(s, "patch")?,
                    num_channels: channels,
                    layer_norm_eps: 1e-12,
                    ..vit::Config::vit_base_patch16_224()
                };
                let classes = dim(s, "classes")?;
                let px: Vec<f32> = (0..batch * channels * image * image)
                    .map(|_| rng.random_range(-1f32..1.0))
                    .collect();
                let labels: Vec<u32> = (0..batch).map(|_| rng.random_range(0..classes as u32)).collect();
                Net::Vit(
                    amp.model(|vb| vit::Model::load(vb, &c, classes))?,
                    Tensor::from_vec(px, (batch, channels, image, image), &dev)?,
                    Tensor::new(labels.as_slice(), &dev)?,
                )
            }
            _ => bail!("unknown model {name:?}"),
        };
        Ok(Self { net, opt, amp })
    }

    /// One training step; the peak bytes it allocated beyond what was live before it.
    fn step(&mut self) -> Result<isize> {
        let before = counting::reset_peak();
        let loss = match &self.net {
            Net::Llama(m, x, y) => m.call(|m| m.loss(x, y))?,
            Net::Bert(m, ids, real, tags) => {
                let picked = m.forward(ids)?.flatten_to(1)?.index_select(real, 0)?;
                amp::nn::loss::cross_entropy(&picked, tags)?
            }
            Net::Vit(m, x, y) => amp::nn::loss::cross_entropy(&m.forward(x)?, y)?,
        };
        self.amp.scale_loss(&loss, &mut self.opt)?.backward()?;
        self.opt.step()?;
        self.opt.zero_grad();
        Ok(counting::peak() - before)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Measures one model at every configuration: a warm-up step and a step for the peak each,
/// then `rounds` interleaved rounds of `steps` timed steps per configuration. Returns
/// `archs.{name}` (see the module doc).
pub fn measure(name: &str, quick: bool, rounds: usize, steps: usize) -> Result<Value> {
    let s = shape(name, quick)?;
    let mut runs = configs()
        .into_iter()
        .map(|(l, h)| Ok(((l, h), Run::new(name, &s, l, h)?)))
        .collect::<Result<Vec<_>>>()?;
    // A warm-up step (it allocates the optimizer's moments, which later steps keep), then
    // one untimed step whose peak is reported, configuration after configuration.
    let mut peaks = Vec::with_capacity(runs.len());
    for (_, run) in runs.iter_mut() {
        run.step()?;
        peaks.push(run.step()?);
    }
    let mut times = vec![Vec::new(); runs.len()];
    for _ in 0..rounds {
        for (i, (_, run)) in runs.iter_mut().enumerate() {
            for _ in 0..steps {
                let t0 = Instant::now();
                run.step()?;
                times[i].push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    for (i, ((l, h), _)) in runs.iter().enumerate() {
        eprintln!("{name} {l} {h}: {:.1} ms", median(&mut times[i].clone()));
    }
    let mut levels = serde_json::Map::new();
    for (i, ((l, h), _)) in runs.iter().enumerate() {
        let fig = json!({
            "step_ms": median(&mut times[i]),
            "peak_mb": peaks[i] as f64 / (1 << 20) as f64,
        });
        let halves = if *l == OptLevel::O0 {
            vec![HalfType::F16, HalfType::Bf16]
        } else {
            vec![*h]
        };
        let entry = levels.entry(l.to_string()).or_insert_with(|| json!({}));
        for h in halves {
            entry[h.to_string()] = fig.clone();
        }
    }
    Ok(json!({"shape": s, "rounds": rounds, "steps": steps, "levels": levels}))
}

/// Profiling aid (`BENCH_ARCH=MODEL:LEVEL:HALF`): that configuration alone, a warm-up step
/// then `steps` timed ones, its median on stderr (run it under `perf record`).
pub fn profile(which: &str, quick: bool, steps: usize) -> Result<()> {
    let mut it = which.split(':');
    let (Some(name), Some(l), Some(h), None) = (it.next(), it.next(), it.next(), it.next()) else {
        bail!("BENCH_ARCH=MODEL:LEVEL:HALF, e.g. bert:O2:bf16");
    };
    let mut run = Run::new(name, &shape(name, quick)?, l.parse()?, h.parse()?)?;
    run.step()?;
    let mut t = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t0 = Instant::now();
        run.step()?;
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    eprintln!("{which}: {:.1} ms (median of {steps})", median(&mut t));
    Ok(())
}

/// Measures the three models into `out["archs"]` and copies the figures to
/// `out["levels"][L][H]` as `{model}_step_ms` and `{model}_peak_mb`; with `torch`
/// (`torch_models.py`'s checked object) adds the PyTorch step times beside them.
pub fn measure_into(out: &mut Value, quick: bool, torch: Option<Value>) -> Result<()> {
    // Rounds of one step: the finest interleaving, so a busy spell of a shared machine
    // falls on every configuration alike.
    let (rounds, steps) = if quick { (1, 1) } else { (7, 1) };
    let mut archs = json!({});
    for name in NAMES.into_iter().chain([SMALL]) {
        eprintln!("{name} (2 untimed steps, then {rounds} rounds of {steps} per configuration) ...");
        archs[name] = measure(name, quick, rounds, steps)?;
        for level in ["O0", "O1", "O2", "O3"] {
            for half in ["f16", "bf16"] {
                let fig = &archs[name]["levels"][level][half];
                let slot = &mut out["levels"][level][half];
                slot[format!("{name}_step_ms")] = fig["step_ms"].clone();
                slot[format!("{name}_peak_mb")] = fig["peak_mb"].clone();
            }
        }
        if let Some(t) = torch.as_ref().filter(|_| name != SMALL) {
            for k in ["fp32_step_ms", "autocast_bf16_step_ms"] {
                archs[name][format!("torch_{k}")] = t[name][k].clone();
            }
        }
    }
    if let Some(t) = torch {
        archs["torch"] = t;
    }
    out["archs"] = archs;
    Ok(())
}

/// `torch_models.py`'s output (its last non-empty line), checked: this run's thread count,
/// and each model's shape equal to the bench's (full sizes: the script has no `--quick`).
pub fn read_torch(path: &str, threads: usize, quick: bool) -> Result<Value> {
    if quick {
        bail!("--torch-models compares the full shapes; drop --quick");
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("--torch-models: cannot read {path}"))?;
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let v: Value = serde_json::from_str(line)
        .with_context(|| format!("--torch-models {path}: not the JSON line torch_models.py prints"))?;
    if v["threads"].as_u64() != Some(threads as u64) {
        bail!(
            "--torch-models {path}: measured with {} threads, this run uses {threads}; pass the same --threads to both",
            v["threads"]
        );
    }
    for name in NAMES {
        let want = shape(name, false)?;
        if v[name]["shape"] != want {
            bail!(
                "--torch-models {path}: its {name} shape {} is not the bench's {want}",
                v[name]["shape"]
            );
        }
        for k in ["fp32_step_ms", "autocast_bf16_step_ms"] {
            if !v[name][k].as_f64().is_some_and(|x| x > 0.0) {
                bail!("--torch-models {path}: no positive {k:?} for {name}");
            }
        }
    }
    Ok(v)
}

/// The models' targets as `{name, ratio, rule, limit, met}` (all `<=`): no half level slower
/// than O0; O2 bf16 at most 0.6x O0 for Llama and BERT on the tiers that multiply bf16
/// natively (`isa` `avx512bf16` or `amx`); O2 peak at most 0.6x O0's; with PyTorch, O0 no
/// slower than its fp32 and the best bf16 level no slower than its autocast bf16.
pub fn targets(o: &Value) -> Vec<Value> {
    let mut t = Vec::new();
    let a = &o["archs"];
    if !a.is_object() {
        return t;
    }
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mut add = |name: String, ratio: f64, limit: f64| {
        t.push(json!({"name": name, "ratio": ratio, "rule": "<=", "limit": limit, "met": ratio <= limit}));
    };
    let bf16_tier = matches!(o["isa"].as_str(), Some("avx512bf16" | "amx"));
    for name in NAMES.into_iter().chain([SMALL]) {
        let lv = |l: &str, h: &str, k: &str| f(&a[name]["levels"][l][h][k]);
        let o0 = lv("O0", "f16", "step_ms");
        for level in ["O1", "O2", "O3"] {
            for half in ["f16", "bf16"] {
                add(
                    format!("{name}: no half level slower than O0: {level} {half}"),
                    lv(level, half, "step_ms") / o0,
                    1.0,
                );
            }
        }
        if name == SMALL {
            continue;
        }
        if bf16_tier && name != "vit" {
            add(
                format!("{name}: O2 bf16 step / O0 (bf16 tiers)"),
                lv("O2", "bf16", "step_ms") / o0,
                0.6,
            );
        }
        for half in ["f16", "bf16"] {
            add(
                format!("{name}: O2 {half} peak memory / O0"),
                lv("O2", half, "peak_mb") / lv("O0", "f16", "peak_mb"),
                0.6,
            );
        }
        if a["torch"].is_object() {
            add(
                format!("{name}: O0 step / PyTorch fp32"),
                o0 / f(&a[name]["torch_fp32_step_ms"]),
                1.0,
            );
            let best = ["O1", "O2", "O3"]
                .iter()
                .map(|l| lv(l, "bf16", "step_ms"))
                .fold(f64::INFINITY, f64::min);
            add(
                format!("{name}: best bf16 level / PyTorch autocast bf16"),
                best / f(&a[name]["torch_autocast_bf16_step_ms"]),
                1.0,
            );
        }
    }
    t
}

/// The models' table on stderr: step and peak per configuration, as ratios to O0, and the
/// PyTorch figures when read.
pub fn print_table(o: &Value) {
    let a = &o["archs"];
    if !a.is_object() {
        return;
    }
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "\n{:<6} {:<6} {:<5} {:>10} {:>8} {:>9} {:>8}",
        "model", "level", "half", "step_ms", "vs O0", "peak_mb", "vs O0"
    );
    for name in NAMES.into_iter().chain([SMALL]) {
        let r0 = &a[name]["levels"]["O0"]["f16"];
        for (l, h) in configs() {
            let h = if l == OptLevel::O0 { "f32".into() } else { h.to_string() };
            let r = &a[name]["levels"][l.to_string()][if h == "f32" { "f16" } else { h.as_str() }];
            eprintln!(
                "{name:<6} {:<6} {h:<5} {:>10.1} {:>7.2}x {:>9.1} {:>7.2}x",
                l.to_string(),
                f(&r["step_ms"]),
                f(&r["step_ms"]) / f(&r0["step_ms"]),
                f(&r["peak_mb"]),
                f(&r["peak_mb"]) / f(&r0["peak_mb"]),
            );
        }
        if a["torch"].is_object() && name != SMALL {
            let (tf, tb) = (
                f(&a[name]["torch_fp32_step_ms"]),
                f(&a[name]["torch_autocast_bf16_step_ms"]),
            );
            eprintln!(
                "{name:<6} PyTorch fp32 {tf:.1} ms ({:.2}x O0), autocast bf16 {tb:.1} ms",
                tf / f(&r0["step_ms"])
            );
        }
    }
}
