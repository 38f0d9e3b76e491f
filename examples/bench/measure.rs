//! What the bench measures: kernel bandwidths, matrix products, the MLP and transformer
//! training steps, and the memory savers.

use std::time::Instant;

use anyhow::Result;
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, kernels, nn as ann, ops};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, ModuleT, Optimizer as _, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::{counting, data, models};

/// Median seconds of `reps` runs of `f` after one warm-up.
pub fn median_s(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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
pub fn kernel_bandwidths(mib: usize, reps: usize) -> Result<Value> {
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
pub fn gemm_gflops(size: usize, reps: usize) -> Result<Value> {
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

/// The benchmark MLP: 64 -> hidden -> hidden -> 10 with ReLU, from `candle_amp::nn`: the
/// fused `nn::Mlp` (one node in a run, so no half tensor between its layers is an edge of
/// candle's graph).
pub struct Mlp(ann::Mlp);

impl Mlp {
    pub fn new(vb: VarBuilder, input: usize, hidden: usize) -> candle_core::Result<Self> {
        Ok(Self(ann::Mlp::new(vec![
            ann::linear(input, hidden, vb.pp("fc1"))?.with_activation(ann::Activation::Relu),
            ann::linear(hidden, hidden, vb.pp("fc2"))?.with_activation(ann::Activation::Relu),
            ann::linear(hidden, 10, vb.pp("fc3"))?,
        ])))
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
}

/// `steps + 1` batches of `batch` digits rows, cycling through the data.
pub fn digit_batches(batch: usize, n: usize) -> Result<Vec<(Tensor, Tensor)>> {
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

/// The bench MLP's parameter count: `input -> hidden -> hidden -> 10`, weights and biases.
pub fn mlp_params(input: usize, hidden: usize) -> usize {
    (input + 1) * hidden + (hidden + 1) * hidden + (hidden + 1) * 10
}

/// One level's MLP figures.
pub struct MlpStep {
    /// Median training step.
    pub ms: f64,
    /// Bytes allocated during one step after the timed ones (allocation traffic, not peak).
    pub alloc_bytes: u64,
    /// Bytes of the working parameters plus their f32 masters.
    pub param_bytes: usize,
    /// Host reads of device values per step (the device path's synchronisations; 0 on the
    /// CPU path, which has no device to read from).
    pub host_syncs_per_step: f64,
    /// Whether the run took the device path (`CANDLE_AMP_FORCE_DEVICE_PATH=1` on the CPU).
    pub device_path: bool,
}

/// The MLP training step at a level: median time, then the allocations of one more step.
pub fn mlp_step(level: OptLevel, half: HalfType, hidden: usize, data: &[(Tensor, Tensor)]) -> Result<MlpStep> {
    let mut run = MlpRun::new(level, half, hidden, data)?;
    let param_bytes = run
        .amp
        .store()
        .params()
        .iter()
        .flat_map(|p| [Some(p.working()), p.master()])
        .flatten()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    let syncs0 = run.amp.host_syncs();
    let timed = data.len() - 1;
    let s = median_s(timed, || run.step())?;
    // `median_s` runs one warm-up step before the timed ones.
    let host_syncs_per_step = (run.amp.host_syncs() - syncs0) as f64 / (timed + 1) as f64;
    // Counted after the timed steps, so buffers the run keeps across steps already exist
    // and only what every step allocates afresh remains.
    let before = counting::allocated();
    run.step()?;
    let alloc_bytes = counting::allocated() - before;
    Ok(MlpStep {
        ms: s * 1e3,
        alloc_bytes,
        param_bytes,
        host_syncs_per_step,
        device_path: run.amp.device_path(),
    })
}

/// One MLP training run at a level: [`MlpRun::step`] takes the next batch.
pub struct MlpRun<'a> {
    model: amp::AmpModel<Mlp>,
    opt: amp::AmpOptimizer,
    amp: amp::Amp,
    data: &'a [(Tensor, Tensor)],
    i: usize,
}

impl<'a> MlpRun<'a> {
    pub fn new(level: OptLevel, half: HalfType, hidden: usize, data: &'a [(Tensor, Tensor)]) -> Result<Self> {
        let cfg = AmpConfig::new(level).half(half).verbosity(0);
        let (model, opt, amp) = amp::initialize(|vb| Mlp::new(vb, 64, hidden), adamw()?, cfg)?;
        Ok(Self {
            model,
            opt,
            amp,
            data,
            i: 0,
        })
    }

    /// One training step: forward, scaled backward, optimizer step, zeroed gradients.
    pub fn step(&mut self) -> Result<()> {
        let (x, y) = &self.data[self.i % self.data.len()];
        self.i += 1;
        let loss = ops::cross_entropy(&self.model.forward(x)?, y)?;
        self.amp.scale_loss(&loss, &mut self.opt)?.backward()?;
        self.opt.step()?;
        self.opt.zero_grad();
        Ok(())
    }
}

/// The same MLP in a plain candle loop: VarMap, candle-nn layers and AdamW.
pub fn plain_candle_step_ms(hidden: usize, data: &[(Tensor, Tensor)]) -> Result<f64> {
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

/// A batch for a transformer of vocabulary `vocab`: the reversal task `[x_0..x_{t/2-1}, SEP,
/// reversed]` with next tokens as targets when `vocab` is the train example's 11 (digits and
/// SEP), else uniform random tokens (the time of a step does not depend on what it learns).
fn seq_batch(rng: &mut impl Rng, batch: usize, context: usize, vocab: usize) -> Result<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    if vocab != 11 {
        let seq: Vec<u32> = (0..batch * (context + 1))
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let s = Tensor::from_vec(seq, (batch, context + 1), &dev)?;
        return Ok((
            s.narrow(1, 0, context)?.contiguous()?,
            s.narrow(1, 1, context)?.contiguous()?,
        ));
    }
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
    Ok((
        Tensor::from_vec(inp, (batch, context), &dev)?,
        Tensor::from_vec(tgt, (batch, context), &dev)?,
    ))
}

/// Median training step of a transformer (ms) and the peak bytes allocated during one step
/// beyond what the run held before it. With `c.checkpoint` or `c.ffn_chunk` set, the
/// segments or slices are recomputed in the backward.
pub fn transformer(
    level: OptLevel,
    half: HalfType,
    c: models::TransformerConfig,
    batch: usize,
    reps: usize,
) -> Result<(f64, f64)> {
    transformer_run(level, half, c, batch, reps, true)
}

/// Median training step of a transformer (ms) after one warm-up step, without the two steps
/// `transformer` spends on the peak: for models whose steps take seconds.
pub fn transformer_ms(
    level: OptLevel,
    half: HalfType,
    c: models::TransformerConfig,
    batch: usize,
    reps: usize,
) -> Result<f64> {
    Ok(transformer_run(level, half, c, batch, reps, false)?.0)
}

fn transformer_run(
    level: OptLevel,
    half: HalfType,
    c: models::TransformerConfig,
    batch: usize,
    reps: usize,
    with_peak: bool,
) -> Result<(f64, f64)> {
    let mut run = TransformerRun::new(level, half, c, batch, reps + 2)?;
    let peak = if with_peak {
        run.step(false)?;
        run.step(true)? as f64 / (1 << 20) as f64
    } else {
        f64::NAN
    };
    let s = median_s(reps, || run.step(false).map(|_| ()))?;
    Ok((s * 1e3, peak))
}

/// One transformer training run at a level, over `n` fixed batches.
pub struct TransformerRun {
    model: amp::AmpModel<models::Transformer>,
    opt: amp::AmpOptimizer,
    amp: amp::Amp,
    rc: Option<amp::recompute::Recompute>,
    batches: Vec<(Tensor, Tensor)>,
    i: usize,
}

impl TransformerRun {
    pub fn new(level: OptLevel, half: HalfType, c: models::TransformerConfig, batch: usize, n: usize) -> Result<Self> {
        let cfg = AmpConfig::new(level).half(half).verbosity(0);
        let amp = amp::Amp::new(cfg, &Device::Cpu)?;
        let dropout = amp.generator("dropout");
        let rc = (c.checkpoint > 0 || c.ffn_chunk > 0).then(|| amp::recompute::Recompute::new(&amp));
        let model = amp.model(|vb| models::Transformer::new(vb, c, dropout, rc.clone()))?;
        let opt = amp.optimizer(adamw()?)?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let batches: Vec<_> = (0..n)
            .map(|_| seq_batch(&mut rng, batch, c.context, c.vocab))
            .collect::<Result<_>>()?;
        Ok(Self {
            model,
            opt,
            amp,
            rc,
            batches,
            i: 0,
        })
    }

    /// One training step; with `measure`, the peak bytes it allocated beyond what was live
    /// before it (else 0).
    pub fn step(&mut self, measure: bool) -> Result<isize> {
        let (x, y) = &self.batches[self.i % self.batches.len()];
        self.i += 1;
        let before = counting::reset_peak();
        let logits = self.model.forward_t(x, true)?;
        let loss = ops::cross_entropy(&logits, y)?;
        drop(logits);
        let guard = self.amp.scale_loss(&loss, &mut self.opt)?;
        match &self.rc {
            Some(rc) => guard.backward_with(|l| rc.backward(l))?,
            None => guard.backward()?,
        };
        self.opt.step()?;
        self.opt.zero_grad();
        Ok(if measure { counting::peak() - before } else { 0 })
    }
}

/// Gradient checkpointing and chunked feed-forward on the example transformer with 8 blocks
/// at O2 f16, against the same model without them: peak memory of one training step (bytes
/// allocated beyond what the run held before the step) and median step time, and the peak
/// of one inference forward with plain chunking.
pub fn memory_savers(quick: bool, steps: usize) -> Result<Value> {
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
        vocab_pad: 1,
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
        let (x, _) = seq_batch(
            &mut rand_chacha::ChaCha8Rng::seed_from_u64(3),
            batch,
            c.context,
            c.vocab,
        )?;
        drop(model.forward(&x)?);
        let before = counting::reset_peak();
        drop(model.forward(&x)?);
        peaks.push((counting::peak() - before) as f64 / (1 << 20) as f64);
    }
    Ok((peaks[0], peaks[1]))
}

/// The bench's three transformers and their batches: `example` (the train example's: 2
/// blocks, width 64, context 16, batch 32), `memory` (activations outweigh weights: 4
/// blocks, width 256, context 64, batch 64) and `mid` (a model a CPU user would train: 6
/// blocks, width 512, 8 heads, context 128, vocabulary 1024, batch 16). `quick` shrinks the
/// last two for a smoke test. `benches/peers/torch_amp.py` has the same table.
pub fn transformers(quick: bool) -> [(&'static str, models::TransformerConfig, usize); 3] {
    let base = models::TransformerConfig {
        vocab: 11,
        context: 16,
        d_model: 64,
        heads: 4,
        layers: 2,
        dropout: 0.1,
        checkpoint: 0,
        ffn_chunk: 0,
        vocab_pad: 1,
    };
    let memory = models::TransformerConfig {
        context: 64,
        d_model: 256,
        layers: 4,
        ..base
    };
    let mid = models::TransformerConfig {
        vocab: 1024,
        context: 128,
        d_model: 512,
        heads: 8,
        layers: 6,
        ..base
    };
    if quick {
        let mid = models::TransformerConfig {
            vocab: 64,
            heads: 8,
            ..base
        };
        return [("example", base, 32), ("memory", base, 8), ("mid", mid, 4)];
    }
    [("example", base, 32), ("memory", memory, 64), ("mid", mid, 16)]
}

/// The bench MLP's hidden width and batch (`quick`: the smoke test's).
pub fn mlp_size(quick: bool) -> (usize, usize) {
    if quick { (128, 64) } else { (1024, 512) }
}
