//! Peak memory of saving and loading a checkpoint of a large model.
//!
//! `cargo run --release --example checkpoint_memory -- [--params-m N] [--json]`
//!
//! Builds a stack of 2048x2048 linear layers with at least N million f32 parameters (50 by
//! default), takes one AdamW step so that the optimizer has its two moments, and measures with
//! a counting global allocator:
//! * save: the heap allocated beyond the live run while `CheckpointDir::save` runs;
//! * load: the heap allocated beyond the restored run while `CheckpointDir::load` and
//!   `Checkpoint::restore` run into a fresh process-like run (new model and optimizer);
//!
//! each as a multiple of the weights' size (the target is below 1.5x). The table goes to
//! stderr; with `--json` stdout carries one JSON object.

use anyhow::{Context, Result};
use candle_amp::checkpoint::CheckpointDir;
use candle_amp::{self as amp, AmpConfig, OptLevel};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder};

// The bench's counting allocator (the bytes the program asked for): one copy for both.
#[allow(dead_code)]
#[path = "bench/counting.rs"]
mod counting;

const WIDTH: usize = 2048;

struct Stack(Vec<amp::nn::Linear>);

impl Stack {
    fn new(vb: VarBuilder, layers: usize) -> candle_core::Result<Self> {
        (0..layers)
            .map(|i| amp::nn::linear_no_bias(WIDTH, WIDTH, vb.pp(format!("l{i}"))))
            .collect::<candle_core::Result<_>>()
            .map(Stack)
    }
}

impl Module for Stack {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.iter().try_fold(x.clone(), |h, l| l.forward(&h))
    }
}

fn run(layers: usize) -> Result<(amp::AmpModel<Stack>, amp::AmpOptimizer, amp::Amp)> {
    let cfg = AmpConfig::new(OptLevel::O0).verbosity(0);
    Ok(amp::initialize(
        |vb| Stack::new(vb, layers),
        amp::optim::AdamW::new(Default::default())?,
        cfg,
    )?)
}

fn main() -> Result<()> {
    let mut params_m = 50usize;
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--params-m" => params_m = args.next().context("--params-m N")?.parse()?,
            "--json" => json = true,
            other => anyhow::bail!("unknown argument {other:?}; usage: checkpoint_memory [--params-m N] [--json]"),
        }
    }
    let layers = (params_m * 1_000_000).div_ceil(WIDTH * WIDTH);
    let params = layers * WIDTH * WIDTH;
    let weights = (params * 4) as f64;
    let dir = std::env::temp_dir().join(format!("candle-amp-ckpt-mem-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ckpts = CheckpointDir::new(&dir, 1);

    let (model, mut opt, amp) = run(layers)?;
    let x = Tensor::ones((4, WIDTH), DType::F32, &Device::Cpu)?;
    let loss = model.forward(&x)?.sqr()?.mean_all()?;
    amp.scale_loss(&loss, &mut opt)?.backward()?;
    opt.step()?;
    opt.zero_grad();
    drop(loss);

    let before = counting::reset_peak();
    let t0 = std::time::Instant::now();
    ckpts.save(&amp, &[&opt], 1, serde_json::Value::Null)?;
    let save_s = t0.elapsed().as_secs_f64();
    let save_extra = (counting::peak() - before) as f64;
    drop((model, opt, amp));

    let (_model, mut opt, amp) = run(layers)?;
    let before = counting::reset_peak();
    let t0 = std::time::Instant::now();
    let ck = ckpts.load()?;
    ck.restore(&amp, &mut [&mut opt])?;
    drop(ck);
    let load_s = t0.elapsed().as_secs_f64();
    let after = counting::live();
    let load_peak = counting::peak();
    // What the restore adds for good (the optimizer's moments) is the run, not overhead.
    let load_extra = (load_peak - after.max(before)) as f64;
    let restored_state = (after - before) as f64;
    let bytes: u64 = std::fs::read_dir(dir.join(format!("v{:08}", 1)))?
        .map(|e| e.map(|e| e.metadata().map(|m| m.len()).unwrap_or(0)).unwrap_or(0))
        .sum();
    std::fs::remove_dir_all(&dir)?;

    let mb = |b: f64| b / (1 << 20) as f64;
    eprintln!("checkpoint of {params} f32 parameters ({layers} x {WIDTH}x{WIDTH} linear, AdamW moments):");
    eprintln!(
        "  weights {:.0} MiB, checkpoint on disk {:.0} MiB",
        mb(weights),
        mb(bytes as f64)
    );
    eprintln!(
        "  save: {:.0} MiB heap beyond the live run = {:.3}x the weights ({save_s:.2} s)",
        mb(save_extra),
        save_extra / weights
    );
    eprintln!(
        "  load + restore: {:.0} MiB heap beyond the restored run = {:.3}x the weights ({load_s:.2} s); \
         the restored optimizer state itself is {:.0} MiB",
        mb(load_extra),
        load_extra / weights,
        mb(restored_state)
    );
    if json {
        println!(
            "{}",
            serde_json::json!({
                "params": params,
                "weights_mb": mb(weights),
                "checkpoint_mb": mb(bytes as f64),
                "save_peak_ratio": save_extra / weights,
                "load_peak_ratio": load_extra / weights,
                "save_s": save_s,
                "load_s": load_s,
            })
        );
    }
    Ok(())
}
