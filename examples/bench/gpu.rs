//! The bench on a GPU (`--device cuda`), or shrunk to run anywhere (`--gpu-model tiny`):
//! O0 to O3 in f16 and bf16 on the bench's MLP, on a GPT-2-small-sized transformer, built
//! from `candle_amp::nn` as the train example's transformer is, and on `models::llama` at the
//! same size (`llama`: SwiGLU, rotary embedding, RMS norms; see `gpu/llama.rs`).
//!
//! Per model, level and half type: `step_ms` (median of the timed steps after the warm-up
//! ones, each ended by a device synchronisation so the time is the GPU's, not the launch
//! queue's), `tokens_per_s` (tokens per step over `step_ms`; for the MLP a token is one row),
//! `peak_device_mib` (the most device memory the level's run held, parameters, masters,
//! optimizer state and activations, above what the process held before it; `memory_source`
//! says how it was read), `host_syncs_per_step`, `launches_per_step` and
//! `bytes_allocated_per_step` (one counted step, on the CPU only: see `launches_source`) and
//! `skipped_steps`. A level that fails (out of memory, say) gets `{"error": ...}` and the others still run.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use candle_amp::{self as amp, Amp, AmpConfig, HalfType, OptLevel, ops};
use candle_core::{Device, Tensor};
use candle_nn::ModuleT;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::{counting, measure, models};

mod llama;

/// Which transformer the GPU bench trains.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GpuModel {
    /// GPT-2 small: 12 blocks, width 768, 12 heads, context 1024, GPT-2's vocabulary.
    Gpt2,
    /// A few-second stand-in with the same code path, for CPUs and CI.
    Tiny,
}

impl std::str::FromStr for GpuModel {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gpt2" => Ok(Self::Gpt2),
            "tiny" => Ok(Self::Tiny),
            _ => bail!("--gpu-model {s:?}: one of gpt2, tiny"),
        }
    }
}

impl GpuModel {
    /// The transformer's sizes. Dropout is 0 on both sides of the comparison: our `Dropout`
    /// draws its masks on the host, which would measure the PCIe link instead of AMP.
    pub fn config(self) -> models::TransformerConfig {
        let (vocab, context, d_model, heads, layers) = match self {
            Self::Gpt2 => (50257, 1024, 768, 12, 12),
            // A vocabulary that is not a multiple of 64, so the padded head runs here too.
            Self::Tiny => (250, 32, 64, 4, 2),
        };
        models::TransformerConfig {
            vocab,
            context,
            d_model,
            heads,
            layers,
            dropout: 0.0,
            checkpoint: 0,
            ffn_chunk: 0,
            // GPT-2's head as llm.c runs it: 50304 outputs, the logits the first 50257.
            vocab_pad: 64,
        }
    }

    /// Sequences per step. GPT-2: one training step held about 6.3 GiB per sequence of 1024
    /// tokens at O0 and 6.9 GiB at O2 f16 (the counting allocator on the CPU, extrapolated
    /// from 1 and 2 blocks: about 0.35 GiB per block and 2.1 GiB for the 50257-way head and
    /// loss), plus 2.6 GB of parameters and AdamW state. 8 sequences (about 55 GiB) leave an
    /// H200's 141 GB room for the intermediates candle's unfused ops add off the CPU; raise
    /// `--gpu-batch` to fill the card (a level that runs out of memory is reported as such).
    pub fn default_batch(self) -> usize {
        match self {
            Self::Gpt2 => 8,
            Self::Tiny => 4,
        }
    }

    /// The MLP's hidden width and batch: the CPU bench's, or its `--quick` sizes.
    fn mlp(self) -> (usize, usize) {
        match self {
            Self::Gpt2 => (1024, 512),
            Self::Tiny => (128, 64),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Tiny => "tiny",
        }
    }
}

/// What one GPU bench run measures.
pub struct GpuBench {
    pub device: Device,
    pub model: GpuModel,
    /// Sequences per transformer step.
    pub batch: usize,
    /// Timed steps per level and half type.
    pub steps: usize,
    /// Untimed steps first (kernel compilation, allocator warm-up, the scaler settling).
    pub warmup: usize,
    /// `benches/peers/torch_amp.py --device cuda`'s JSON, checked against this run's model.
    pub torch: Option<Value>,
}

/// The device `--device` names: `cpu` or `cuda` (GPU 0).
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Device::new_cuda(0).context(
            "--device cuda: cannot open CUDA device 0 (build with `--features cuda` and run where an NVIDIA GPU is)",
        ),
        _ => bail!("--device {s:?}: one of cpu, cuda"),
    }
}

/// The transformer's description, the same keys `torch_amp.py --device cuda` writes, so a
/// comparison of different models is refused.
fn transformer_json(c: &models::TransformerConfig, batch: usize) -> Value {
    json!({
        "layers": c.layers,
        "d_model": c.d_model,
        "heads": c.heads,
        "context": c.context,
        "vocab": c.vocab,
        "head_width": c.vocab.next_multiple_of(c.vocab_pad.max(1)),
        "batch": batch,
    })
}

/// `--device`'s name for `dev`, as the JSON and `torch_amp.py` write it: `cpu` or `cuda:N`.
fn device_name(dev: &Device) -> String {
    match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Reads `torch_amp.py --device cuda`'s JSON (its last line, or the whole file) and checks
/// it measured this model and batch on this kind of device (`--device cpu --gpu-model tiny`
/// on both sides makes a CPU comparison of the same code path).
pub fn read_torch(path: &str, dev: &Device, model: GpuModel, batch: usize) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--torch: cannot read {path}"))?;
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let v: Value = serde_json::from_str(line)
        .with_context(|| format!("--torch: {path} must end with the JSON line torch_amp.py prints"))?;
    let kind = if dev.is_cpu() { "cpu" } else { "cuda" };
    if v["device"].as_str() != Some(kind) {
        bail!(
            "--torch: {path} was measured on {} but this run is on {kind}; run benches/peers/torch_amp.py --device {kind}",
            v["device"]
        );
    }
    let want = transformer_json(&model.config(), batch);
    if v["transformer"] != want {
        bail!(
            "--torch: {path} measured {} but this run trains {want}; pass torch_amp.py the same --gpu-model and --gpu-batch",
            v["transformer"]
        );
    }
    for mode in ["fp32", "autocast_f16", "autocast_bf16"] {
        if !v["modes"][mode]["tokens_per_s"].as_f64().is_some_and(|x| x > 0.0) {
            bail!("--torch: {path} has no positive modes.{mode}.tokens_per_s; run torch_amp.py --device cuda again");
        }
    }
    Ok(v)
}

/// The run's host synchronisations so far.
/// The run's host reads of device values so far (the device path's synchronisations).
fn host_syncs(amp: &Amp) -> Option<u64> {
    Some(amp.host_syncs())
}

/// Reads the peak device memory of one level's run.
enum Meter {
    /// The counting allocator (the CPU's "device" memory is the heap).
    Host { before: isize },
    /// `nvidia-smi` printing the GPU's used memory every 20 ms while the level runs.
    Smi { sampler: Sampler, base: u64 },
    /// No way to read it here.
    Unavailable,
}

/// The GPU's used memory in MiB, as `nvidia-smi` reports it (None without `nvidia-smi`).
fn smi_used_mib() -> Option<u64> {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// How `peak_device_mib` is read on `dev`, for the JSON.
fn memory_source(dev: &Device) -> &'static str {
    match dev {
        Device::Cpu => "counting allocator: peak heap bytes above the level's start",
        _ if smi_used_mib().is_some() => {
            "nvidia-smi memory.used of GPU 0, sampled every 20 ms, peak above the level's start (candle has no device-memory API)"
        }
        _ => "unavailable: nvidia-smi not found (candle has no device-memory API)",
    }
}

/// A running `nvidia-smi -lms 20` and the thread keeping the highest value it printed. It
/// is stopped when dropped, so a level that fails leaves no sampler behind.
struct Sampler {
    child: Child,
    reader: Option<JoinHandle<()>>,
    peak: Arc<AtomicU64>,
}

impl Drop for Sampler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

impl Meter {
    fn start(dev: &Device) -> Result<Self> {
        if dev.is_cpu() {
            return Ok(Self::Host {
                before: counting::reset_peak(),
            });
        }
        dev.synchronize()?;
        let Some(base) = smi_used_mib() else {
            return Ok(Self::Unavailable);
        };
        let mut child = Command::new("nvidia-smi")
            .args([
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                "0",
                "-lms",
                "20",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nvidia-smi")?;
        let stdout = child.stdout.take().context("nvidia-smi's stdout")?;
        let peak = Arc::new(AtomicU64::new(base));
        let seen = peak.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if let Ok(v) = line.trim().parse::<u64>() {
                    seen.fetch_max(v, Ordering::Relaxed);
                }
            }
        });
        Ok(Self::Smi {
            sampler: Sampler {
                child,
                reader: Some(reader),
                peak,
            },
            base,
        })
    }

    /// The peak in MiB above the start, and (on a GPU) the used MiB at the start, which
    /// shows memory an earlier level's run left cached; None where it cannot be read.
    fn finish(self, dev: &Device) -> Result<(Option<f64>, Option<f64>)> {
        Ok(match self {
            Self::Host { before } => (Some((counting::peak() - before) as f64 / (1 << 20) as f64), None),
            Self::Smi { sampler, base } => {
                dev.synchronize()?;
                // One more sample after the last step's memory is certainly in use.
                std::thread::sleep(Duration::from_millis(60));
                let peak = sampler.peak.clone();
                drop(sampler);
                (
                    Some(peak.load(Ordering::Relaxed).saturating_sub(base) as f64),
                    Some(base as f64),
                )
            }
            Self::Unavailable => (None, None),
        })
    }
}

/// Trains `model` for the warm-up and timed steps on `batches` (cycled) and returns the
/// level's figures; the meter was started before the run was built.
fn train<M: ModuleT>(
    b: &GpuBench,
    amp: &Amp,
    model: amp::AmpModel<M>,
    batches: &[(Tensor, Tensor)],
    tokens_per_step: usize,
    meter: Meter,
) -> Result<Value> {
    let mut opt = amp.optimizer(amp::optim::AdamW::new(amp::optim::AdamWConfig {
        lr: 1e-4,
        weight_decay: 0.01,
        ..Default::default()
    })?)?;
    let mut i = 0;
    let mut step = || -> Result<()> {
        let (x, y) = &batches[i % batches.len()];
        i += 1;
        let loss = ops::cross_entropy(&model.forward(x)?, y)?;
        amp.scale_loss(&loss, &mut opt)?.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(())
    };
    for _ in 0..b.warmup {
        step()?;
    }
    b.device.synchronize()?;
    let syncs_before = host_syncs(amp);
    let mut times = Vec::with_capacity(b.steps);
    for _ in 0..b.steps {
        let t0 = Instant::now();
        step()?;
        b.device.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    let syncs = match (syncs_before, host_syncs(amp)) {
        (Some(a), Some(z)) => Some((z - a) as f64 / b.steps as f64),
        _ => None,
    };
    // One more step, counted: the buffers the CPU's ops write (one kernel launch each on
    // CUDA) and the bytes allocated. Only the host's allocator can be counted, so the
    // figures exist on the CPU, where `CANDLE_AMP_FORCE_DEVICE_PATH=1` runs the GPU's path.
    let (buffers0, bytes0) = (counting::buffers(), counting::allocated());
    step()?;
    b.device.synchronize()?;
    let (launches, bytes) = match b.device {
        Device::Cpu => (
            Some(counting::buffers() - buffers0),
            Some(counting::allocated() - bytes0),
        ),
        _ => (None, None),
    };
    let skipped = opt.skipped_steps();
    let (peak, start) = meter.finish(&b.device)?;
    times.sort_by(f64::total_cmp);
    let s = times[times.len() / 2];
    Ok(json!({
        "step_ms": s * 1e3,
        "tokens_per_s": tokens_per_step as f64 / s,
        "peak_device_mib": peak,
        "device_mib_at_start": start,
        "host_syncs_per_step": syncs,
        "launches_per_step": launches,
        "bytes_allocated_per_step": bytes,
        "skipped_steps": skipped,
    }))
}

/// Random token sequences with their next tokens as targets: the content does not change
/// the work, and the vocabulary is GPT-2's.
fn token_batches(c: &models::TransformerConfig, batch: usize, dev: &Device) -> Result<Vec<(Tensor, Tensor)>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    (0..2)
        .map(|_| {
            let s: Vec<u32> = (0..batch * (c.context + 1))
                .map(|_| rng.random_range(0..c.vocab as u32))
                .collect();
            let seq = Tensor::from_vec(s, (batch, c.context + 1), dev)?;
            Ok((
                seq.narrow(1, 0, c.context)?.contiguous()?,
                seq.narrow(1, 1, c.context)?.contiguous()?,
            ))
        })
        .collect()
}

/// One level and half type of one model; an error becomes `{"error": ...}`.
fn level(b: &GpuBench, level: OptLevel, half: HalfType, which: &str, data: &[(Tensor, Tensor)]) -> Value {
    let run = || -> Result<Value> {
        let meter = Meter::start(&b.device)?;
        let amp = Amp::new(AmpConfig::new(level).half(half).verbosity(0), &b.device)?;
        if which == "mlp" {
            let (hidden, batch) = b.model.mlp();
            let model = amp.model(|vb| measure::Mlp::new(vb, 64, hidden))?;
            train(b, &amp, model, data, batch, meter)
        } else if which == "llama" {
            let c = llama::config(b.model);
            let model = amp.model(|vb| candle_amp::models::llama::Llama::load(vb, &c))?;
            train(b, &amp, model, data, b.batch * c.max_position_embeddings, meter)
        } else {
            let c = b.model.config();
            let model = amp.model(|vb| models::Transformer::new(vb, c, amp.generator("dropout"), None))?;
            train(b, &amp, model, data, b.batch * c.context, meter)
        }
    };
    run().unwrap_or_else(|e| {
        eprintln!("  {which} {level} {half} failed: {e:#}");
        json!({ "error": format!("{e:#}") })
    })
}

/// Runs the GPU bench and returns its JSON object.
pub fn run(b: &GpuBench) -> Result<Value> {
    if b.steps == 0 || b.batch == 0 {
        bail!("--steps and --gpu-batch must be at least 1");
    }
    let c = b.model.config();
    let (hidden, mlp_batch) = b.model.mlp();
    let mlp_data: Vec<_> = measure::digit_batches(mlp_batch, 2)?
        .into_iter()
        .map(|(x, y)| Ok((x.to_device(&b.device)?, y.to_device(&b.device)?)))
        .collect::<Result<_>>()?;
    let tok_data = token_batches(&c, b.batch, &b.device)?;
    let llama_cfg = llama::config(b.model);
    let llama_data = llama::token_batches(&llama_cfg, b.batch, &b.device)?;
    let mut out = json!({
        "device": device_name(&b.device),
        "gpu": gpu_name(&b.device),
        "gpu_model": b.model.name(),
        "memory_source": memory_source(&b.device),
        "host_syncs_source": "Amp::host_syncs (reads of device values on the step path)",
        "launches_source": "CPU only (null on CUDA): buffers of alignment <= 4 (candle's f32/f16/bf16/u32/u8 storage) the counting allocator saw in one step after the timed ones; each op writes one, as each CUDA op launches one kernel; CANDLE_AMP_FORCE_DEVICE_PATH=1 counts the GPU's path (candle ops only: the library's CUDA kernels exist on CUDA only)",
        "bytes_allocated_source": "CPU only (null on CUDA): bytes the counting allocator handed out in that step (the allocation traffic, whatever was freed in between)",
        "steps": b.steps,
        "warmup_steps": b.warmup,
        "optimizer": "AdamW lr 1e-4, weight decay 0.01",
    });
    let mut models = serde_json::Map::new();
    for (which, data, desc) in [
        (
            "mlp",
            &mlp_data,
            json!({ "sizes": format!("64-{hidden}-{hidden}-10, ReLU, digits"), "batch": mlp_batch }),
        ),
        ("transformer", &tok_data, transformer_json(&c, b.batch)),
        ("llama", &llama_data, llama::describe(&llama_cfg, b.batch)),
    ] {
        let mut levels = serde_json::Map::new();
        for lv in OptLevel::ALL {
            let mut per_half = serde_json::Map::new();
            for half in [HalfType::F16, HalfType::Bf16] {
                eprintln!("{which} {lv} {half} ...");
                per_half.insert(half.to_string(), level(b, lv, half, which, data));
            }
            levels.insert(lv.to_string(), Value::Object(per_half));
        }
        models.insert(which.into(), json!({ "model": desc, "levels": levels }));
    }
    out["models"] = Value::Object(models);
    if let Some(t) = &b.torch {
        out["torch"] = t.clone();
    }
    out["targets"] = targets(&out);
    Ok(out)
}

/// The GPU's name from `nvidia-smi`, or null.
fn gpu_name(dev: &Device) -> Value {
    if dev.is_cpu() {
        return Value::Null;
    }
    Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader", "-i", "0"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .map_or(Value::Null, Value::from)
}

/// Issue 17's targets on the transformer, as `{name, ratio, rule, limit, met}`; `ratio`
/// and `met` are null where this run cannot know them (no PyTorch figures, no sync counter,
/// a level that failed).
pub fn targets(o: &Value) -> Value {
    let lv = |level: &str, half: &str, k: &str| o["models"]["transformer"]["levels"][level][half][k].as_f64();
    let mut t = Vec::new();
    let mut add = |name: String, ratio: Option<f64>, rule: &str, limit: f64| {
        let met = ratio.map(|r| match rule {
            "<" => r < limit,
            ">=" => r >= limit,
            _ => r <= limit,
        });
        t.push(json!({ "name": name, "ratio": ratio, "rule": rule, "limit": limit, "met": met }));
    };
    let ratio = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    for half in ["f16", "bf16"] {
        add(
            format!("O2 {half} tokens/s / O0 (transformer)"),
            ratio(lv("O2", half, "tokens_per_s"), lv("O0", half, "tokens_per_s")),
            ">=",
            2.0,
        );
        add(
            format!("O2 {half} peak device memory / O0 (below 1)"),
            ratio(lv("O2", half, "peak_device_mib"), lv("O0", half, "peak_device_mib")),
            "<",
            1.0,
        );
    }
    // The worst level of any model; unknown if any is.
    let mut worst = Some(0f64);
    for model in ["mlp", "transformer", "llama"] {
        for level in ["O0", "O1", "O2", "O3"] {
            for half in ["f16", "bf16"] {
                let s = o["models"][model]["levels"][level][half]["host_syncs_per_step"].as_f64();
                worst = worst.zip(s).map(|(w, s)| w.max(s));
            }
        }
    }
    add("host syncs per step (worst level)".into(), worst, "<=", 1.0);
    for (half, mode) in [("f16", "autocast_f16"), ("bf16", "autocast_bf16")] {
        let torch = o["torch"]["modes"][mode]["tokens_per_s"].as_f64();
        let best = ["O1", "O2"]
            .iter()
            .filter_map(|l| lv(l, half, "tokens_per_s"))
            .reduce(f64::max);
        add(
            format!("best of O1/O2 {half} tokens/s / PyTorch {mode}"),
            ratio(best, torch),
            ">=",
            0.9,
        );
    }
    Value::Array(t)
}

/// The table on stderr.
pub fn print_table(o: &Value) {
    let f = |v: &Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.1}"));
    eprintln!(
        "\n{} ({}) | memory: {}",
        o["device"].as_str().unwrap_or("?"),
        o["gpu"].as_str().unwrap_or("no name"),
        o["memory_source"].as_str().unwrap_or("?")
    );
    for model in ["mlp", "transformer", "llama"] {
        eprintln!("{model}: {}", o["models"][model]["model"]);
        eprintln!(
            "  {:<6} {:<5} {:>10} {:>14} {:>10} {:>12} {:>10} {:>12}",
            "level", "half", "step_ms", "tokens/s", "peak_mib", "syncs/step", "launches", "alloc_MiB"
        );
        for level in ["O0", "O1", "O2", "O3"] {
            for half in ["f16", "bf16"] {
                let r = &o["models"][model]["levels"][level][half];
                if let Some(e) = r["error"].as_str() {
                    eprintln!("  {level:<6} {half:<5} failed: {e}");
                    continue;
                }
                eprintln!(
                    "  {level:<6} {half:<5} {:>10} {:>14} {:>10} {:>12} {:>10} {:>12}",
                    f(&r["step_ms"]),
                    f(&r["tokens_per_s"]),
                    f(&r["peak_device_mib"]),
                    f(&r["host_syncs_per_step"]),
                    f(&r["launches_per_step"]),
                    f(&r["bytes_allocated_per_step"].as_f64().map(|b| b / 1048576.0).into())
                );
            }
        }
    }
    eprintln!("\ntargets (ratio from this run, one line each):");
    for t in o["targets"].as_array().into_iter().flatten() {
        let met = match t["met"].as_bool() {
            Some(true) => "met",
            Some(false) => "MISS",
            None => "n/a",
        };
        let ratio = t["ratio"].as_f64().map_or("-".to_string(), |r| format!("{r:.2}"));
        eprintln!(
            "  {met:<4} {:<52} {ratio:>6} {} {}",
            t["name"].as_str().unwrap_or(""),
            t["rule"].as_str().unwrap_or(""),
            t["limit"]
        );
    }
}
