//! Speed and memory of mixed precision on this machine, as ratios from one run.
//!
//! `cargo run --release --example bench -- [--json] [--threads N] [--steps N] [--quick]`
//!
//! Prints a table to stderr and, with `--json`, one JSON object as the last stdout line:
//! kernel bandwidths over 64 MiB buffers (GB/s counts bytes read plus bytes written), the
//! 1024^3 matrix product per type, the median training step of the MLP 64-1024-1024-10
//! (batch 512, AdamW, digits) at every level and half type and of a plain candle f32 loop,
//! the median step of the train example's transformer, and the peak allocated memory of one
//! step of a larger transformer (4 blocks, width 256, context 64, batch 64; a counting
//! allocator). Gradient checkpointing and chunked feed-forward on an 8-block transformer at O2
//! f16 (width 128, context 64, batch 32): `checkpoint_peak_ratio`, `checkpoint_time_ratio`
//! and `chunk_peak_ratio` against the same model without them, details under
//! `memory_savers`. `--threads N` sets candle's and rayon's thread count (default 1); `--quick`
//! shrinks everything for a smoke test.

#[path = "../train/data.rs"]
#[allow(dead_code)]
mod data;
#[path = "../train/models.rs"]
#[allow(dead_code)]
mod models;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, kernels, nn as ann, ops};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, ModuleT, Optimizer as _, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn add(n: isize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        add(l.size() as isize);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        add(-(l.size() as isize));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        add(new as isize - l.size() as isize);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

struct Args {
    json: bool,
    threads: usize,
    steps: usize,
    quick: bool,
    kernels_only: bool,
    torch: Option<String>,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        json: false,
        threads: 1,
        steps: 20,
        quick: false,
        kernels_only: false,
        torch: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        match f.as_str() {
            "--json" => a.json = true,
            "--quick" => a.quick = true,
            "--kernels-only" => a.kernels_only = true,
            "--threads" => a.threads = it.next().context("--threads N")?.parse()?,
            "--steps" => a.steps = it.next().context("--steps N")?.parse()?,
            "--torch" => a.torch = Some(it.next().context("--torch FILE")?),
            other => bail!(
                "unknown argument {other:?}; usage: bench [--json] [--threads N] [--steps N] [--quick] [--kernels-only] [--torch FILE]"
            ),
        }
    }
    if a.threads == 0 || a.steps == 0 {
        bail!("--threads and --steps must be at least 1");
    }
    if a.quick && a.torch.is_some() {
        bail!("--torch compares the full-size MLP; drop --quick");
    }
    Ok(a)
}

/// Median seconds of `reps` runs of `f` after one warm-up.
fn median_s(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[t.len() / 2])
}

fn gbps(bytes: usize, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

/// Kernel bandwidths over buffers of `mib` MiB of f32.
fn kernel_bandwidths(mib: usize, reps: usize) -> Result<Value> {
    let n = mib * (1 << 20) / 4;
    let dev = Device::Cpu;
    let src: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let mut dst = vec![0f32; n];
    let memcpy = median_s(reps, || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    let x = Tensor::from_vec(src.clone(), n, &dev)?;
    let half = Tensor::zeros(n, DType::BF16, &dev)?;
    let cast = median_s(reps, || Ok(kernels::cast_into(&x, &half)?))?;
    let raw = x.to_dtype(DType::F16)?;
    let acc = Tensor::zeros(n, DType::F32, &dev)?;
    let unscale = median_s(reps, || {
        std::hint::black_box(kernels::unscale_check_into(&raw, 65536.0, &acc, false)?);
        Ok(())
    })?;
    let mut p = src.clone();
    let g = src.clone();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut h = vec![half::bf16::ZERO; n];
    let hyper = kernels::AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        step: 1,
    };
    let adamw = median_s(reps, || {
        kernels::adamw(&mut p, &g, &mut m, &mut v, kernels::HalfOut::Bf16(&mut h), &hyper)?;
        Ok(())
    })?;
    Ok(json!({
        "memcpy_gbps": gbps(2 * 4 * n, memcpy),
        "cast_gbps": gbps(6 * n, cast),
        "unscale_check_gbps": gbps(2 * n + 8 * n, unscale),
        "adamw_gbps": gbps((4 * 4 + 3 * 4 + 2) * n, adamw),
    }))
}

/// GFLOP/s of the library's matrix product, `size`^3, per type.
fn gemm_gflops(size: usize, reps: usize) -> Result<Value> {
    let dev = Device::Cpu;
    let mut out = serde_json::Map::new();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let a = Tensor::randn(0f32, 1., (size, size), &dev)?.to_dtype(dt)?;
        let b = Tensor::randn(0f32, 1., (size, size), &dev)?.to_dtype(dt)?;
        let s = median_s(reps, || {
            std::hint::black_box(kernels::matmul(&a, &b)?);
            Ok(())
        })?;
        out.insert(
            dt.as_str().to_string(),
            json!(2.0 * (size * size * size) as f64 / s / 1e9),
        );
    }
    Ok(Value::Object(out))
}

/// The benchmark MLP: 64 -> hidden -> hidden -> 10 with ReLU, from `candle_amp::nn`.
struct Mlp(ann::Linear, ann::Linear, ann::Linear);

impl Mlp {
    fn new(vb: VarBuilder, input: usize, hidden: usize) -> candle_core::Result<Self> {
        Ok(Self(
            ann::linear(input, hidden, vb.pp("fc1"))?,
            ann::linear(hidden, hidden, vb.pp("fc2"))?,
            ann::linear(hidden, 10, vb.pp("fc3"))?,
        ))
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.2
            .forward(&ops::relu(&self.1.forward(&ops::relu(&self.0.forward(x)?)?)?)?)
    }
}

/// `steps + 1` batches of `batch` digits rows, cycling through the data.
fn digit_batches(batch: usize, n: usize) -> Result<Vec<(Tensor, Tensor)>> {
    let ds = data::digits()?;
    let (train, _) = data::split_standardise(&ds, 0.2, 0);
    let dev = Device::Cpu;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    (0..n)
        .map(|_| {
            let idx: Vec<usize> = (0..batch).map(|_| rng.random_range(0..train.len())).collect();
            let mut x = Vec::with_capacity(batch * train.width);
            let mut y = Vec::with_capacity(batch);
            for &i in &idx {
                x.extend_from_slice(&train.x[i * train.width..(i + 1) * train.width]);
                y.push(train.y[i]);
            }
            Ok((
                Tensor::from_vec(x, (batch, train.width), &dev)?,
                Tensor::from_vec(y, batch, &dev)?,
            ))
        })
        .collect()
}

fn adamw() -> Result<amp::optim::AdamW> {
    Ok(amp::optim::AdamW::new(amp::optim::AdamWConfig {
        lr: 1e-3,
        ..Default::default()
    })?)
}

/// Median MLP training step at a level, in ms.
fn mlp_step_ms(level: OptLevel, half: HalfType, hidden: usize, data: &[(Tensor, Tensor)]) -> Result<f64> {
    let cfg = AmpConfig::new(level).half(half).verbosity(0);
    let (model, mut opt, amp) = amp::initialize(|vb| Mlp::new(vb, 64, hidden), adamw()?, cfg)?;
    let mut i = 0;
    let s = median_s(data.len() - 1, || {
        let (x, y) = &data[i % data.len()];
        i += 1;
        let loss = ops::cross_entropy(&model.forward(x)?, y)?;
        amp.scale_loss(&loss, &mut opt)?.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(())
    })?;
    Ok(s * 1e3)
}

/// The same MLP in a plain candle loop: VarMap, candle-nn layers and AdamW.
fn plain_candle_step_ms(hidden: usize, data: &[(Tensor, Tensor)]) -> Result<f64> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let l1 = candle_nn::linear(64, hidden, vb.pp("fc1"))?;
    let l2 = candle_nn::linear(hidden, hidden, vb.pp("fc2"))?;
    let l3 = candle_nn::linear(hidden, 10, vb.pp("fc3"))?;
    let mut opt = candle_nn::AdamW::new(
        vm.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        },
    )?;
    let mut i = 0;
    let s = median_s(data.len() - 1, || {
        let (x, y) = &data[i % data.len()];
        i += 1;
        let h = l2.forward(&l1.forward(x)?.relu()?)?.relu()?;
        let loss = candle_nn::loss::cross_entropy(&l3.forward(&h)?, y)?;
        opt.backward_step(&loss)?;
        Ok(())
    })?;
    Ok(s * 1e3)
}

/// A batch of the reversal task: `[x_0..x_{t/2-1}, SEP, reversed]`, next tokens as targets.
fn seq_batch(rng: &mut impl Rng, batch: usize, context: usize) -> Result<(Tensor, Tensor)> {
    let half = context / 2;
    let mut inp = Vec::with_capacity(batch * context);
    let mut tgt = Vec::with_capacity(batch * context);
    for _ in 0..batch {
        let x: Vec<u32> = (0..half).map(|_| rng.random_range(0..10)).collect();
        let mut s = x.clone();
        s.push(10);
        s.extend(x.iter().rev());
        inp.extend_from_slice(&s[..context]);
        tgt.extend_from_slice(&s[1..context + 1]);
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(inp, (batch, context), &dev)?,
        Tensor::from_vec(tgt, (batch, context), &dev)?,
    ))
}

/// Median training step of a transformer (ms) and the peak bytes allocated during one step
/// beyond what the run held before it. With `c.checkpoint` or `c.ffn_chunk` set, the
/// segments or slices are recomputed in the backward.
fn transformer(
    level: OptLevel,
    half: HalfType,
    c: models::TransformerConfig,
    batch: usize,
    reps: usize,
) -> Result<(f64, f64)> {
    let cfg = AmpConfig::new(level).half(half).verbosity(0);
    let amp = amp::Amp::new(cfg, &Device::Cpu)?;
    let dropout = amp.generator("dropout");
    let rc = (c.checkpoint > 0 || c.ffn_chunk > 0).then(|| amp::recompute::Recompute::new(&amp));
    let model = amp.model(|vb| models::Transformer::new(vb, c, dropout, rc.clone()))?;
    let mut opt = amp.optimizer(adamw()?)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let batches: Vec<_> = (0..reps + 2)
        .map(|_| seq_batch(&mut rng, batch, c.context))
        .collect::<Result<_>>()?;
    let mut i = 0;
    let mut step = |measure: bool| -> Result<isize> {
        let (x, y) = &batches[i % batches.len()];
        i += 1;
        let before = if measure { LIVE.load(Ordering::Relaxed) } else { 0 };
        PEAK.store(before, Ordering::Relaxed);
        let logits = model.forward_t(x, true)?;
        let loss = ops::cross_entropy(&logits, y)?;
        drop(logits);
        let guard = amp.scale_loss(&loss, &mut opt)?;
        match &rc {
            Some(rc) => guard.backward_with(|l| rc.backward(l))?,
            None => guard.backward()?,
        };
        opt.step()?;
        opt.zero_grad();
        Ok(PEAK.load(Ordering::Relaxed) - before)
    };
    step(false)?;
    let peak = step(true)? as f64 / (1 << 20) as f64;
    let s = median_s(reps, || step(false).map(|_| ()))?;
    Ok((s * 1e3, peak))
}

/// Gradient checkpointing and chunked feed-forward on the example transformer with 8 blocks
/// at O2 f16, against the same model without them: peak memory of one training step (bytes
/// allocated beyond what the run held before the step) and median step time, and the peak
/// of one inference forward with plain chunking.
fn memory_savers(quick: bool, steps: usize) -> Result<Value> {
    let layers = 8;
    let deep = models::TransformerConfig {
        vocab: 11,
        context: if quick { 16 } else { 64 },
        d_model: if quick { 64 } else { 128 },
        heads: 4,
        layers,
        dropout: 0.1,
        checkpoint: 0,
        ffn_chunk: 0,
    };
    let batch = if quick { 8 } else { 32 };
    let chunk = deep.context / 4;
    let (level, half) = (OptLevel::O2, HalfType::F16);
    let reps = steps.min(10);
    let (plain_ms, plain_mb) = transformer(level, half, deep, batch, reps)?;
    let ck = models::TransformerConfig {
        checkpoint: layers,
        ..deep
    };
    let (ck_ms, ck_mb) = transformer(level, half, ck, batch, reps)?;
    let ch = models::TransformerConfig {
        ffn_chunk: chunk,
        ..deep
    };
    let (ch_ms, ch_mb) = transformer(level, half, ch, batch, reps)?;
    let (inf_plain_mb, inf_chunk_mb) = inference_peaks(deep, batch, chunk)?;
    Ok(json!({
        "model": format!(
            "transformer: {layers} blocks, width {}, context {}, batch {batch}, O2 f16",
            deep.d_model, deep.context
        ),
        "checkpoint_segments": layers,
        "ffn_chunk": chunk,
        "plain_peak_mb": plain_mb,
        "plain_step_ms": plain_ms,
        "checkpoint_peak_mb": ck_mb,
        "checkpoint_step_ms": ck_ms,
        "chunk_peak_mb": ch_mb,
        "chunk_step_ms": ch_ms,
        "checkpoint_peak_ratio": ck_mb / plain_mb,
        "checkpoint_time_ratio": ck_ms / plain_ms,
        "chunk_peak_ratio": ch_mb / plain_mb,
        "chunk_time_ratio": ch_ms / plain_ms,
        "inference_plain_peak_mb": inf_plain_mb,
        "inference_chunk_peak_mb": inf_chunk_mb,
        "inference_chunk_peak_ratio": inf_chunk_mb / inf_plain_mb,
    }))
}

/// Peak bytes of one evaluation forward of `c` without and with plain chunking of the
/// feed-forward (no recomputation: nothing is kept for a backward).
fn inference_peaks(c: models::TransformerConfig, batch: usize, chunk: usize) -> Result<(f64, f64)> {
    let mut peaks = Vec::new();
    for ffn_chunk in [0, chunk] {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2).verbosity(0), &Device::Cpu)?;
        let dropout = amp.generator("dropout");
        let cfg = models::TransformerConfig { ffn_chunk, ..c };
        let model = amp.model(|vb| models::Transformer::new(vb, cfg, dropout, None))?;
        model.eval();
        let (x, _) = seq_batch(&mut rand_chacha::ChaCha8Rng::seed_from_u64(3), batch, c.context)?;
        drop(model.forward(&x)?);
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        drop(model.forward(&x)?);
        peaks.push((PEAK.load(Ordering::Relaxed) - before) as f64 / (1 << 20) as f64);
    }
    Ok((peaks[0], peaks[1]))
}

/// glibc returns large freed blocks to the OS and faults fresh zeroed pages back in on the
/// next step; keeping them (as a caching allocator would) removes that cost for every row of
/// the table alike. `MALLOC_TRIM_THRESHOLD_`/`MALLOC_MMAP_THRESHOLD_` do the same from the
/// environment.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only changes glibc's thresholds; called before any other thread.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 1 << 30);
            mallopt(M_TRIM_THRESHOLD, i32::MAX);
        }
    }
}

fn main() -> Result<()> {
    let a = parse_args()?;
    if std::env::var("BENCH_NO_MALLOPT").is_err() {
        keep_freed_memory();
    }
    // Candle reads RAYON_NUM_THREADS for its own parallel loops and gemm.
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", a.threads.to_string()) };
    rayon::ThreadPoolBuilder::new().num_threads(a.threads).build_global()?;
    let (mib, reps, gsize, hidden, batch) = if a.quick {
        (4, 3, 256, 128, 64)
    } else {
        (64, 7, 1024, 1024, 512)
    };
    let steps = if a.quick { 3 } else { a.steps };

    // Read the PyTorch figures first: a bad file fails before minutes of measuring.
    let torch = match &a.torch {
        Some(path) => Some(read_torch(path, a.threads)?),
        None => None,
    };
    let mut out = json!({ "threads": a.threads });
    let data = digit_batches(batch, steps + 1)?;
    // Profiling aid: BENCH_ISA=portable|avx2|avx512|avx512bf16 caps the kernels.
    if let Ok(isa) = std::env::var("BENCH_ISA") {
        let cap = kernels::Isa::ALL
            .into_iter()
            .find(|i| format!("{i:?}").eq_ignore_ascii_case(&isa))
            .with_context(|| format!("BENCH_ISA={isa}: one of {:?}", kernels::Isa::ALL))?;
        kernels::force_isa(Some(cap));
    }
    // Profiling aid: BENCH_MLP=O2:bf16 runs that MLP configuration alone.
    if let Ok(which) = std::env::var("BENCH_MLP") {
        let (l, h) = which.split_once(':').context("BENCH_MLP=LEVEL:HALF")?;
        let ms = mlp_step_ms(l.parse()?, h.parse()?, hidden, &data)?;
        eprintln!("{which}: {ms:.2} ms");
        return Ok(());
    }
    if let Ok(which) = std::env::var("BENCH_TRANSFORMER") {
        let (l, h) = which.split_once(':').context("BENCH_TRANSFORMER=LEVEL:HALF")?;
        let c = models::TransformerConfig {
            vocab: 11,
            context: 16,
            d_model: 64,
            heads: 4,
            layers: 2,
            dropout: 0.1,
            checkpoint: 0,
            ffn_chunk: 0,
        };
        let (ms, _) = transformer(l.parse()?, h.parse()?, c, 32, steps)?;
        eprintln!("transformer {which}: {ms:.2} ms");
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
    out["plain_candle_f32_step_ms"] = json!(plain_candle_step_ms(hidden, &data)?);
    let small = models::TransformerConfig {
        vocab: 11,
        context: 16,
        d_model: 64,
        heads: 4,
        layers: 2,
        dropout: 0.1,
        checkpoint: 0,
        ffn_chunk: 0,
    };
    let big = models::TransformerConfig {
        vocab: 11,
        context: if a.quick { 16 } else { 64 },
        d_model: if a.quick { 64 } else { 256 },
        heads: 4,
        layers: if a.quick { 2 } else { 4 },
        dropout: 0.1,
        checkpoint: 0,
        ffn_chunk: 0,
    };
    let big_batch = if a.quick { 8 } else { 64 };
    let mut levels = serde_json::Map::new();
    for level in OptLevel::ALL {
        let mut per_half = serde_json::Map::new();
        for half in [HalfType::F16, HalfType::Bf16] {
            eprintln!("{level} {half} ...");
            let step_ms = mlp_step_ms(level, half, hidden, &data)?;
            let (transformer_step_ms, _) = transformer(level, half, small, 32, steps)?;
            let (_, peak_mb) = transformer(level, half, big, big_batch, 1)?;
            per_half.insert(
                half.to_string(),
                json!({ "step_ms": step_ms, "transformer_step_ms": transformer_step_ms, "peak_mb": peak_mb }),
            );
        }
        levels.insert(level.to_string(), Value::Object(per_half));
    }
    out["levels"] = Value::Object(levels);
    eprintln!("memory savers (8-block transformer, O2 f16) ...");
    let savers = memory_savers(a.quick, steps)?;
    for k in ["checkpoint_peak_ratio", "checkpoint_time_ratio", "chunk_peak_ratio"] {
        out[k] = savers[k].clone();
    }
    out["memory_savers"] = savers;
    if let Some(t) = torch {
        out["torch"] = t;
    }
    out["targets"] = targets(&out);

    print_table(&out);
    if a.json {
        println!("{out}");
    }
    Ok(())
}

fn print_table(o: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mem = f(&o["memcpy_gbps"]);
    eprintln!("\nthreads {}", o["threads"]);
    for k in ["memcpy_gbps", "cast_gbps", "unscale_check_gbps", "adamw_gbps"] {
        eprintln!("{k:<20} {:>8.2}   {:.2}x memcpy", f(&o[k]), f(&o[k]) / mem);
    }
    for dt in ["f32", "f16", "bf16"] {
        eprintln!("gemm {dt:<15} {:>8.1} GFLOP/s", f(&o["gemm_gflops"][dt]));
    }
    let plain = f(&o["plain_candle_f32_step_ms"]);
    let o0 = f(&o["levels"]["O0"]["f16"]["step_ms"]);
    let t0 = f(&o["levels"]["O0"]["f16"]["transformer_step_ms"]);
    let p0 = f(&o["levels"]["O0"]["f16"]["peak_mb"]);
    eprintln!("plain candle f32 MLP step {plain:.2} ms");
    eprintln!(
        "{:<6} {:<5} {:>10} {:>9} {:>12} {:>9} {:>9} {:>9}",
        "level", "half", "mlp_ms", "vs O0", "transf_ms", "vs O0", "peak_mb", "vs O0"
    );
    for level in ["O0", "O1", "O2", "O3"] {
        for half in ["f16", "bf16"] {
            let r = &o["levels"][level][half];
            eprintln!(
                "{level:<6} {half:<5} {:>10.2} {:>8.2}x {:>12.2} {:>8.2}x {:>9.1} {:>8.2}x",
                f(&r["step_ms"]),
                f(&r["step_ms"]) / o0,
                f(&r["transformer_step_ms"]),
                f(&r["transformer_step_ms"]) / t0,
                f(&r["peak_mb"]),
                f(&r["peak_mb"]) / p0
            );
        }
    }
    let targets = o["targets"].as_array().cloned().unwrap_or_default();
    if !targets.is_empty() {
        eprintln!("\ntargets (ratio from this run, one line each):");
        for t in &targets {
            eprintln!(
                "  {:<4} {:<52} {:>6.2} {} {:.2}",
                if t["met"].as_bool() == Some(true) {
                    "met"
                } else {
                    "MISS"
                },
                t["name"].as_str().unwrap_or(""),
                f(&t["ratio"]),
                t["rule"].as_str().unwrap_or(""),
                f(&t["limit"]),
            );
        }
    }
}

/// The PyTorch figures `benches/peers/torch_amp.py` printed (its last stdout line, or the
/// whole file as one JSON object), checked before anything is measured.
fn read_torch(path: &str, threads: usize) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--torch: cannot read {path}"))?;
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let v: Value = serde_json::from_str(line)
        .with_context(|| format!("--torch: {path} must end with the JSON line torch_amp.py prints"))?;
    for k in ["fp32_step_ms", "autocast_bf16_step_ms"] {
        if !v[k].as_f64().is_some_and(|x| x > 0.0) {
            bail!("--torch: {path} has no positive {k:?}; run benches/peers/torch_amp.py again");
        }
    }
    if v["threads"].as_u64() != Some(threads as u64) {
        bail!(
            "--torch: {path} was measured with {} threads, this run uses {threads}; pass the same --threads to both",
            v["threads"]
        );
    }
    Ok(v)
}

/// The README's targets as ratios from this run: `{name, ratio, rule, limit, met}`, where
/// `rule` is `"<="`, `"<"` or `">="` (the ratio against the limit). The PyTorch ones appear
/// only with `--torch`.
fn targets(o: &Value) -> Value {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let lv = |level: &str, half: &str, k: &str| f(&o["levels"][level][half][k]);
    let mut t = Vec::new();
    let mut add = |name: String, ratio: f64, rule: &str, limit: f64| {
        let met = match rule {
            "<" => ratio < limit,
            ">=" => ratio >= limit,
            _ => ratio <= limit,
        };
        t.push(json!({ "name": name, "ratio": ratio, "rule": rule, "limit": limit, "met": met }));
    };
    let mem = f(&o["memcpy_gbps"]);
    add("cast bandwidth / memcpy".into(), f(&o["cast_gbps"]) / mem, ">=", 0.6);
    add(
        "unscale+check bandwidth / memcpy".into(),
        f(&o["unscale_check_gbps"]) / mem,
        ">=",
        0.6,
    );
    add(
        "fused AdamW bandwidth / memcpy".into(),
        f(&o["adamw_gbps"]) / mem,
        ">=",
        0.5,
    );
    let o0 = lv("O0", "f16", "step_ms");
    add(
        "O0 step / plain candle f32 step".into(),
        o0 / f(&o["plain_candle_f32_step_ms"]),
        "<=",
        1.0,
    );
    let best_bf16 = lv("O1", "bf16", "step_ms").min(lv("O2", "bf16", "step_ms"));
    add("best of O1/O2 bf16 step / O0 step".into(), best_bf16 / o0, "<=", 0.6);
    for level in ["O1", "O2", "O3"] {
        add(
            format!("{level} f16 step / O0 step"),
            lv(level, "f16", "step_ms") / o0,
            "<=",
            1.0,
        );
    }
    let t0 = lv("O0", "f16", "transformer_step_ms");
    for level in ["O1", "O2", "O3"] {
        for half in ["f16", "bf16"] {
            add(
                format!("{level} {half} transformer step / O0"),
                lv(level, half, "transformer_step_ms") / t0,
                "<=",
                1.0,
            );
        }
    }
    let p0 = lv("O0", "f16", "peak_mb");
    for level in ["O2", "O3"] {
        for half in ["f16", "bf16"] {
            add(
                format!("{level} {half} peak memory / O0 (below 1)"),
                lv(level, half, "peak_mb") / p0,
                "<",
                1.0,
            );
        }
    }
    add(
        "checkpointing peak memory / plain (8-block transformer, O2 f16)".into(),
        f(&o["checkpoint_peak_ratio"]),
        "<=",
        0.6,
    );
    add(
        "checkpointing step time / plain".into(),
        f(&o["checkpoint_time_ratio"]),
        "<=",
        1.4,
    );
    add(
        "chunked feed-forward peak memory / plain (training)".into(),
        f(&o["chunk_peak_ratio"]),
        "<",
        1.0,
    );
    if o["torch"].is_object() {
        let fp32 = f(&o["torch"]["fp32_step_ms"]);
        let tbf16 = f(&o["torch"]["autocast_bf16_step_ms"]);
        add("O0 step / PyTorch fp32 step".into(), o0 / fp32, "<=", 0.8);
        add("best of O1/O2 bf16 / PyTorch fp32".into(), best_bf16 / fp32, "<=", 1.0);
        let best_any = ["O1", "O2", "O3"]
            .iter()
            .map(|l| lv(l, "bf16", "step_ms"))
            .fold(f64::INFINITY, f64::min);
        add(
            "stretch: best bf16 level / PyTorch autocast bf16".into(),
            best_any / tbf16,
            "<=",
            0.8,
        );
    }
    Value::Array(t)
}
