//! What the training examples (`train`, `ddp`) share beyond data and models: the optimizer,
//! batches of rows, the table's labels, and checking output paths before training.

use anyhow::{Context, Result};
use candle_amp as amp;
use candle_core::{DType, Device, Tensor};

use crate::data::Dataset;

/// The optimizer every example run trains with: AdamW, learning rate 1e-3, weight decay 0.01.
pub fn adamw() -> Result<amp::optim::AdamW> {
    Ok(amp::optim::AdamW::new(amp::optim::AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.01,
        ..Default::default()
    })?)
}

/// The type the run keeps its trainable weights in (the table's `params` column).
pub fn weight_dtype(amp: &amp::Amp) -> Result<DType> {
    Ok(amp
        .store()
        .params()
        .iter()
        .find(|p| p.kind() == amp::ParamKind::Trainable && p.name().ends_with("weight"))
        .context("the model has weights")?
        .working()
        .dtype())
}

/// The rows `idx` of `d` as a feature matrix and a label vector.
pub fn rows(d: &Dataset, idx: &[usize]) -> Result<(Tensor, Tensor)> {
    let w = d.width;
    let mut x = Vec::with_capacity(idx.len() * w);
    let mut y = Vec::with_capacity(idx.len());
    for &i in idx {
        x.extend_from_slice(&d.x[i * w..(i + 1) * w]);
        y.push(d.y[i]);
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(x, (idx.len(), w), &dev)?,
        Tensor::from_vec(y, idx.len(), &dev)?,
    ))
}

/// The half type a level computes in, for the table: none at O0 (pure f32).
pub fn half_label(level: amp::OptLevel, half: amp::HalfType) -> String {
    if level == amp::OptLevel::O0 {
        "-".into()
    } else {
        half.to_string()
    }
}

/// Fails now, before any training, if `dir` cannot be created or written.
pub fn check_writable(flag: &str, dir: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{flag} {dir}: cannot create the directory"))?;
    let probe = std::path::Path::new(dir).join(format!(".candle-amp-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").with_context(|| format!("{flag} {dir}: the directory is not writable"))?;
    std::fs::remove_file(&probe).with_context(|| format!("{flag} {dir}: cannot remove {}", probe.display()))?;
    Ok(())
}
