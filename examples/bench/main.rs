//! Speed and memory of mixed precision on this machine, as ratios from one run.
//!
//! `cargo run --release --example bench -- [--json] [--threads N] [--steps N] [--quick]
//! [--isa TIER] [--mallopt] [--kernels-only] [--torch [FILE]] [--no-archs] [--torch-models FILE]`
//!
//! `... --device cuda [--gpu-model gpt2|tiny] [--gpu-batch N] [--steps N] [--torch FILE]`
//! runs the GPU bench instead (`gpu.rs`, built with `--features cuda`): O0 to O3 in f16 and
//! bf16 on the MLP and a GPT-2-small-sized transformer, and prints its JSON object on stdout
//! whether or not `--json` is given (the table goes to stderr). `--device cpu --gpu-model
//! tiny` runs the same code on the CPU with tiny sizes, in seconds (a smoke test).
//!
//! Prints a table to stderr and, with `--json`, one JSON object as the only stdout line:
//! kernel bandwidths over 64 MiB buffers (GB/s counts bytes read plus bytes written), the
//! 1024^3 matrix product per type, the median training step of the MLP 64-1024-1024-10
//! (batch 512, AdamW, digits) at every level and half type and of a plain candle f32 loop,
//! and of three transformers (`measure::transformers`): the train example's (2 blocks,
//! width 64), the memory transformer (4 blocks, width 256, context 64, batch 64), whose
//! peak allocated memory of one step is also measured (a counting allocator), and a
//! mid-size one a CPU user would train (6 blocks, width 512, 8 heads, context 128, batch 16,
//! vocabulary 1024). Gradient checkpointing and chunked feed-forward on an 8-block
//! transformer at O2 f16 (width 128, context 64, batch 32): `checkpoint_peak_ratio`,
//! `checkpoint_time_ratio` and `chunk_peak_ratio` against the same model without them,
//! details under `memory_savers`.
//!
//! What it ran on: `cpu` (the model name in /proc/cpuinfo), `isa` (the tier the kernels
//! used: `portable`, `avx2`, `avx512`, `avx512bf16`, `amx`), `detected_isa` (the CPU's
//! highest), `rustflags` (`RUSTFLAGS` at build time, `""` if none) with
//! `compiled_target_features`, and `mallopt`. `mlp_param_bytes` is the MLP's f32 parameter
//! bytes; per level and half type, `levels[L][H]` has `step_ms`, `alloc_bytes_per_step`
//! (bytes allocated during one MLP step after the timed ones), `host_syncs_per_step` (host
//! reads of device values per step: 0 on the CPU path, 1 on the device path, which
//! `CANDLE_AMP_FORCE_DEVICE_PATH=1` forces on the CPU), `device_path`, `param_bytes` (working
//! parameters plus f32 masters), `transformer_step_ms`, `memory_transformer_step_ms`,
//! `transformer_mid_step_ms` and `peak_mb`. `targets` holds the
//! The targets (`docs/performance.md`) as `{name, ratio, rule, limit, met}`; missed ones print as `MISS`.
//!
//! `--threads N` sets candle's and rayon's thread count (default 1); `--quick` shrinks
//! everything for a smoke test; `--isa TIER` caps the kernels at a tier (at most the
//! detected one) so one machine can report each tier it has; `--mallopt` keeps freed memory
//! in glibc's heap (off by default: the targets are measured with the allocator a program
//! gets); `--kernels-only` stops after the kernels and products. `--torch` runs
//! `benches/peers/torch_amp.py` first (the MLP and the three transformers in PyTorch, fp32
//! and autocast bf16, same threads; `python3` from the venv `CANDLE_AMP_TORCH_VENV` names,
//! else from `PATH`) and adds the ratios to PyTorch to the targets; without torch it says
//! why on stderr, sets `torch_error` and omits them. `--torch FILE` reads what the script
//! printed instead.
//!
//! The library's Llama, BERT and ViT (`archs.rs`, on unless `--no-archs`; `--quick` runs
//! tiny shapes): per level and half type `levels[L][H]` gains `llama_step_ms`,
//! `bert_step_ms`, `vit_step_ms` and `llama_peak_mb`, `bert_peak_mb`, `vit_peak_mb`, with
//! the details under `archs.{llama,bert,vit}` (`shape`, `levels.{O0..O3}.{f16,bf16}.{step_ms,
//! peak_mb}`). `--torch-models FILE` reads what `benches/peers/torch_models.py` printed (same
//! shapes and threads) and adds the ratios to PyTorch to the targets.
//!
//! Profiling aids (environment variables, each runs one thing and prints to stderr):
//! `BENCH_MLP=LEVEL:HALF`, `BENCH_TRANSFORMER=[MODEL:]LEVEL:HALF` (one configuration's
//! median step), `BENCH_PAIR=MODEL:LEVEL:HALF` (that configuration and O0 step by step in
//! turn, `--steps` pairs, and the median per-pair ratio: steadier than two medians on a shared
//! machine), `BENCH_OPS=1` (each element-wise op per type at the `--isa` tier),
//! `BENCH_GEMM_ONLY`, `BENCH_DOCTOR_ONLY`, `BENCH_SAVERS_ONLY`, `BENCH_ARCHS_ONLY` (the three
//! models alone, with their targets; the JSON too with `--json`), `BENCH_ARCH=MODEL:LEVEL:HALF`
//! (one of them at one configuration, `--steps` timed steps).

#[path = "../train/data.rs"]
#[allow(dead_code)]
mod data;
#[path = "../train/models.rs"]
#[allow(dead_code)]
mod models;

mod archs;
mod counting;
mod doctor;
mod gpu;
mod machine;
mod measure;
mod ops;
mod pair;
mod peer;
mod report;

use anyhow::{Context, Result, bail};
use candle_amp::{HalfType, OptLevel};
use candle_core::{Device, Tensor};
use serde_json::{Value, json};

use measure::{digit_batches, gemm_gflops, kernel_bandwidths, median_s, memory_savers, mlp_step, transformer};

struct Args {
    json: bool,
    threads: usize,
    steps: usize,
    quick: bool,
    kernels_only: bool,
    /// `--torch`: run `benches/peers/torch_amp.py` (`None` in the option) or read its
    /// output from a file.
    torch: Option<Option<String>>,
    isa: Option<String>,
    mallopt: bool,
    /// `--device`: `cpu` (the default) or `cuda`.
    device: String,
    /// `--gpu-model`: runs the GPU bench (implied by `--device cuda`).
    gpu_model: Option<String>,
    gpu_batch: Option<usize>,
    /// Whether `--steps` was given (the GPU bench has its own default).
    steps_given: bool,
    /// Measures Llama, BERT and ViT (`archs.rs`; off with `--no-archs`).
    archs: bool,
    /// `--torch-models FILE`: what `benches/peers/torch_models.py` printed.
    torch_models: Option<String>,
}

const USAGE: &str = "usage: bench [--json] [--threads N] [--steps N] [--quick] [--isa TIER] [--mallopt] [--kernels-only] [--torch [FILE]] [--no-archs] [--torch-models FILE] [--device cpu|cuda] [--gpu-model gpt2|tiny] [--gpu-batch N]";

/// A row of `--help`'s table: flag, value, default (`-`: unset), meaning.
type Row = (&'static str, &'static str, &'static str, &'static str);

/// Each flag's row (as printed, one line each).
#[rustfmt::skip]
const FLAGS: [Row; 14] = [
    ("--json", "", "off", "the JSON object as the only stdout line (the table is on stderr)"),
    ("--threads", "N", "1", "candle's and rayon's threads"),
    ("--steps", "N", "20 (GPU: 10)", "timed steps"),
    ("--quick", "", "off", "everything shrunk, a smoke test (the CPU bench only)"),
    ("--isa", "TIER", "the CPU's", "cap the kernels at portable|avx2|avx512|avx512bf16|amx"),
    ("--mallopt", "", "off", "keep freed memory in glibc's heap"),
    ("--kernels-only", "", "off", "stop after the kernels and matrix products"),
    ("--torch", "[FILE]", "off", "ratios to PyTorch: run benches/peers/torch_amp.py, or read FILE"),
    ("--no-archs", "", "off", "leave out Llama, BERT and ViT"),
    ("--torch-models", "FILE", "-", "their ratios to PyTorch, from benches/peers/torch_models.py"),
    ("--device", "cpu|cuda", "cpu", "cuda: the GPU bench (built with --features cuda)"),
    ("--gpu-model", "gpt2|tiny", "gpt2", "the GPU bench's transformer, on --device (tiny: a smoke test)"),
    ("--gpu-batch", "N", "8 (tiny: 4)", "sequences per step of the GPU bench"),
    ("-h, --help", "", "", "print this help and exit"),
];

/// What `--help` prints: the one-line usage, then the flags as a table (flag, value, default,
/// meaning), one line per flag.
fn help() -> String {
    let head: Row = ("flag", "value", "default", "meaning");
    let width = |f: fn(&Row) -> &'static str| FLAGS.iter().chain([&head]).map(|r| f(r).len()).max().unwrap_or(0);
    let (w0, w1, w2) = (width(|r| r.0), width(|r| r.1), width(|r| r.2));
    let rule = ("-".repeat(w0), "-".repeat(w1), "-".repeat(w2), "-".repeat(7));
    let mut out = format!(
        "{USAGE}\n\n  {:w0$}  {:w1$}  {:w2$}  {}",
        head.0, head.1, head.2, head.3
    );
    out += &format!("\n  {}  {}  {}  {}", rule.0, rule.1, rule.2, rule.3);
    for r in &FLAGS {
        out += &format!("\n  {:w0$}  {:w1$}  {:w2$}  {}", r.0, r.1, r.2, r.3);
    }
    out
}

/// Parses the arguments (without the program name); `None` for `-h` / `--help`.
fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Option<Args>> {
    let mut a = Args {
        json: false,
        threads: 1,
        steps: 20,
        quick: false,
        kernels_only: false,
        torch: None,
        isa: None,
        mallopt: false,
        device: "cpu".into(),
        gpu_model: None,
        gpu_batch: None,
        steps_given: false,
        archs: true,
        torch_models: None,
    };
    let mut it = args.into_iter().peekable();
    while let Some(f) = it.next() {
        match f.as_str() {
            "-h" | "--help" => return Ok(None),
            "--json" => a.json = true,
            "--quick" => a.quick = true,
            "--kernels-only" => a.kernels_only = true,
            "--mallopt" => a.mallopt = true,
            "--no-archs" => a.archs = false,
            "--torch-models" => a.torch_models = Some(it.next().context("--torch-models FILE")?),
            "--threads" => a.threads = it.next().context("--threads N")?.parse()?,
            "--steps" => {
                a.steps = it.next().context("--steps N")?.parse()?;
                a.steps_given = true;
            }
            // A flag, or with a file (any next argument that is not a flag).
            "--torch" => a.torch = Some(it.next_if(|n| !n.starts_with("--"))),
            "--isa" => a.isa = Some(it.next().context("--isa TIER")?),
            "--device" => a.device = it.next().context("--device cpu|cuda")?,
            "--gpu-model" => a.gpu_model = Some(it.next().context("--gpu-model gpt2|tiny")?),
            "--gpu-batch" => a.gpu_batch = Some(it.next().context("--gpu-batch N")?.parse()?),
            other => bail!("unknown argument {other:?}; {USAGE}"),
        }
    }
    if a.threads == 0 || a.steps == 0 {
        bail!("--threads and --steps must be at least 1");
    }
    let gpu = a.device != "cpu" || a.gpu_model.is_some();
    if gpu && (a.quick || a.kernels_only) {
        bail!("--quick and --kernels-only are the CPU bench's; the GPU bench shrinks with --gpu-model tiny");
    }
    if !gpu && a.gpu_batch.is_some() {
        bail!("--gpu-batch sets the GPU bench's batch; add --device cuda or --gpu-model");
    }
    Ok(Some(a))
}

/// The GPU bench (`--device cuda`, or `--gpu-model` on any device): its JSON on stdout.
fn gpu_main(a: &Args) -> Result<()> {
    let device = gpu::parse_device(&a.device)?;
    let model: gpu::GpuModel = a.gpu_model.as_deref().unwrap_or("gpt2").parse()?;
    let batch = a.gpu_batch.unwrap_or(model.default_batch());
    // Read the PyTorch figures first: a bad file fails before minutes of measuring.
    let torch = match &a.torch {
        Some(Some(path)) => Some(gpu::read_torch(path, &device, model, batch)?),
        Some(None) => bail!(
            "--torch without a file runs the CPU comparison; for the GPU bench pass the file `benches/peers/torch_amp.py --device cuda` printed"
        ),
        None => None,
    };
    let b = gpu::GpuBench {
        device,
        model,
        batch,
        steps: if a.steps_given { a.steps } else { 10 },
        warmup: 2,
        torch,
    };
    let out = gpu::run(&b)?;
    gpu::print_table(&out);
    println!("{out}");
    Ok(())
}

fn main() -> Result<()> {
    let Some(a) = parse_args(std::env::args().skip(1))? else {
        println!("{}", help());
        return Ok(());
    };
    // Before any other thread exists (mallopt) and before anything is measured (the tier).
    let mallopt = a.mallopt && machine::keep_freed_memory();
    if let Some(isa) = &a.isa {
        machine::force_isa(isa)?;
    }
    // Candle reads RAYON_NUM_THREADS for its own parallel loops and gemm.
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", a.threads.to_string()) };
    rayon::ThreadPoolBuilder::new().num_threads(a.threads).build_global()?;
    if a.device != "cpu" || a.gpu_model.is_some() {
        return gpu_main(&a);
    }
    let (mib, reps, gsize) = if a.quick { (4, 3, 256) } else { (64, 7, 1024) };
    let (hidden, batch) = measure::mlp_size(a.quick);
    let steps = if a.quick { 3 } else { a.steps };

    let mut torch_error = None;
    // The PyTorch figures first: a bad file fails before minutes of measuring, and a
    // missing torch is said before them (the run goes on without the PyTorch ratios).
    let torch = match &a.torch {
        Some(Some(path)) => Some(peer::read_torch(path, a.threads, a.quick)?),
        Some(None) => match peer::run_torch(a.threads, a.quick) {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("bench --torch: {e}; the PyTorch ratios are omitted");
                torch_error = Some(e.to_string());
                None
            }
        },
        None => None,
    };
    let torch_models = match &a.torch_models {
        Some(path) => Some(archs::read_torch(path, a.threads, a.quick)?),
        None => None,
    };
    let mut out = machine::describe(mallopt);
    out["threads"] = json!(a.threads);
    if let Ok(which) = std::env::var("BENCH_ARCH") {
        return archs::profile(&which, a.quick, steps);
    }
    if std::env::var("BENCH_ARCHS_ONLY").is_ok() {
        archs::measure_into(&mut out, a.quick, torch_models)?;
        out["targets"] = json!(archs::targets(&out));
        archs::print_table(&out);
        report::print_targets(&out);
        if a.json {
            println!("{out}");
        }
        return Ok(());
    }
    out["mlp_param_bytes"] = json!(measure::mlp_params(64, hidden) * 4);
    let data = digit_batches(batch, steps + 1)?;
    // Profiling aid: BENCH_MLP=O2:bf16 runs that MLP configuration alone.
    if let Ok(which) = std::env::var("BENCH_MLP") {
        let (l, h) = which.split_once(':').context("BENCH_MLP=LEVEL:HALF")?;
        let r = mlp_step(l.parse()?, h.parse()?, hidden, &data)?;
        eprintln!("{which}: {:.2} ms, {} bytes allocated per step", r.ms, r.alloc_bytes);
        return Ok(());
    }
    if let Ok(which) = std::env::var("BENCH_PAIR") {
        return pair::paired(&which, steps, hidden, &data, a.quick);
    }
    // BENCH_TRANSFORMER=O2:bf16 runs the example transformer alone; MODEL:O2:bf16 picks
    // another of `measure::transformers` (`memory`, `mid`).
    if let Ok(which) = std::env::var("BENCH_TRANSFORMER") {
        let (name, lh) = match which.matches(':').count() {
            2 => which.split_once(':').context("BENCH_TRANSFORMER=[MODEL:]LEVEL:HALF")?,
            _ => ("example", which.as_str()),
        };
        let (l, h) = lh.split_once(':').context("BENCH_TRANSFORMER=[MODEL:]LEVEL:HALF")?;
        let (_, c, batch) = measure::transformers(a.quick)
            .into_iter()
            .find(|(n, ..)| *n == name)
            .context("BENCH_TRANSFORMER: MODEL is example, memory or mid")?;
        let (ms, peak_mb) = transformer(l.parse()?, h.parse()?, c, batch, steps)?;
        eprintln!("transformer {which}: {ms:.2} ms, peak {peak_mb:.1} MB");
        return Ok(());
    }
    if std::env::var("BENCH_OPS").is_ok() {
        return ops::op_times(steps);
    }
    if std::env::var("BENCH_DOCTOR_ONLY").is_ok() {
        eprintln!("doctor_overhead {:.3}", doctor::doctor_overhead(hidden, &data, 9)?);
        return Ok(());
    }
    if std::env::var("BENCH_SAVERS_ONLY").is_ok() {
        eprintln!("{:#}", memory_savers(a.quick, steps)?);
        return Ok(());
    }
    if std::env::var("BENCH_GEMM_ONLY").is_ok() {
        eprintln!("{}", gemm_gflops(gsize, 30)?);
        let a = Tensor::randn(0f32, 1., (gsize, gsize), &Device::Cpu)?;
        let s = median_s(30, || {
            std::hint::black_box(a.matmul(&a)?);
            Ok(())
        })?;
        eprintln!(
            "candle f32 matmul {:.1}",
            2.0 * (gsize * gsize * gsize) as f64 / s / 1e9
        );
        return Ok(());
    }
    eprintln!("kernels ({mib} MiB buffers) ...");
    let bw = kernel_bandwidths(mib, reps)?;
    for (k, v) in bw.as_object().unwrap() {
        out[k] = v.clone();
    }
    eprintln!("matrix products ({gsize}^3) ...");
    out["gemm_gflops"] = gemm_gflops(gsize, reps)?;
    if a.kernels_only {
        eprintln!("{out:#}");
        return Ok(());
    }

    eprintln!("plain candle f32 MLP ...");
    out["plain_candle_f32_step_ms"] = json!(measure::plain_candle_step_ms(hidden, &data)?);
    let [(_, small, small_batch), (_, big, big_batch), (_, mid, mid_batch)] = measure::transformers(a.quick);
    // The larger models get fewer timed steps: a mid step takes seconds on one thread.
    let (big_reps, mid_reps) = if a.quick { (1, 1) } else { (3, a.steps.min(3)) };
    let mut levels = serde_json::Map::new();
    for level in OptLevel::ALL {
        let mut per_half = serde_json::Map::new();
        for half in [HalfType::F16, HalfType::Bf16] {
            eprintln!("{level} {half} ...");
            let mlp = mlp_step(level, half, hidden, &data)?;
            let (transformer_step_ms, _) = transformer(level, half, small, small_batch, steps)?;
            let (memory_ms, peak_mb) = transformer(level, half, big, big_batch, big_reps)?;
            let mid_ms = measure::transformer_ms(level, half, mid, mid_batch, mid_reps)?;
            per_half.insert(
                half.to_string(),
                json!({
                    "step_ms": mlp.ms,
                    "alloc_bytes_per_step": mlp.alloc_bytes,
                    "param_bytes": mlp.param_bytes,
                    "host_syncs_per_step": mlp.host_syncs_per_step,
                    "device_path": mlp.device_path,
                    "transformer_step_ms": transformer_step_ms,
                    "memory_transformer_step_ms": memory_ms,
                    "transformer_mid_step_ms": mid_ms,
                    "peak_mb": peak_mb,
                }),
            );
        }
        levels.insert(level.to_string(), Value::Object(per_half));
    }
    out["levels"] = Value::Object(levels);
    if a.archs {
        archs::measure_into(&mut out, a.quick, torch_models)?;
    }
    eprintln!("memory savers (8-block transformer, O2 f16) ...");
    let savers = memory_savers(a.quick, steps)?;
    for k in ["checkpoint_peak_ratio", "checkpoint_time_ratio", "chunk_peak_ratio"] {
        out[k] = savers[k].clone();
    }
    out["memory_savers"] = savers;
    out["doctor_overhead"] = json!(doctor::doctor_overhead(hidden, &data, if a.quick { 2 } else { 9 })?);
    if let Some(t) = torch {
        out["torch"] = t;
    }
    if let Some(e) = torch_error {
        out["torch_error"] = json!(e);
    }
    out["targets"] = report::targets(&out);

    report::print_table(&out);
    if a.json {
        println!("{out}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Option<Args>> {
        parse_args(line.split_whitespace().map(String::from))
    }

    #[test]
    fn help_is_usage_and_unknown_flags_are_refused() {
        assert!(parse("--help").unwrap().is_none());
        assert!(parse("--quick -h").unwrap().is_none());
        let a = parse("--quick --json --threads 2").unwrap().unwrap();
        assert!(a.quick && a.json && a.threads == 2 && a.steps == 20);
        assert!(a.archs && a.torch_models.is_none());
        let a = parse("--no-archs --torch-models t.json").unwrap().unwrap();
        assert!(!a.archs && a.torch_models.as_deref() == Some("t.json"));
        assert!(parse("--torch-models").is_err());
        let e = parse("--frobnicate").err().unwrap().to_string();
        assert!(
            e.contains("unknown argument \"--frobnicate\"") && e.contains("usage: bench"),
            "{e}"
        );
    }

    #[test]
    fn help_is_a_table_of_every_flag_with_the_parsers_defaults() {
        let h = help();
        assert!(h.starts_with("usage: bench "));
        let lines: Vec<&str> = h.lines().collect();
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            ["flag", "value", "default", "meaning"]
        );
        // One line per flag, each flag of the usage line among them, and no other.
        let usage_flags: Vec<&str> = USAGE
            .split('[')
            .skip(1)
            .map(|s| s.split([' ', ']']).next().unwrap())
            .collect();
        let usage_flags: Vec<&str> = usage_flags.into_iter().filter(|f| f.starts_with("--")).collect();
        let row_flags: Vec<&str> = FLAGS.iter().map(|r| r.0).filter(|f| !f.starts_with("-h")).collect();
        assert_eq!(row_flags, usage_flags);
        assert_eq!(lines.len(), 4 + FLAGS.len());
        for (line, r) in lines[4..].iter().zip(&FLAGS) {
            assert!(line.trim_start().starts_with(r.0) && line.ends_with(r.3), "{line}");
        }
        // The defaults shown are the parser's and the GPU bench's.
        let a = parse("").unwrap().unwrap();
        let default = |flag: &str| FLAGS.iter().find(|r| r.0 == flag).unwrap().2;
        assert_eq!(default("--threads"), a.threads.to_string());
        assert!(default("--steps").starts_with(&format!("{} ", a.steps)));
        assert_eq!(default("--device"), a.device);
        assert_eq!(
            default("--gpu-model").parse::<gpu::GpuModel>().unwrap(),
            gpu::GpuModel::Gpt2
        );
        let batch = |m: gpu::GpuModel| m.default_batch().to_string();
        assert_eq!(
            default("--gpu-batch"),
            format!("{} (tiny: {})", batch(gpu::GpuModel::Gpt2), batch(gpu::GpuModel::Tiny))
        );
        assert!(!a.json && !a.quick && !a.mallopt && !a.kernels_only && a.archs && a.torch.is_none());
    }
}
