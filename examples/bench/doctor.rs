//! The numerics doctor's cost: the bench MLP's training step with the doctor recording every
//! 10th step, against the same run without it.

use std::time::Instant;

use anyhow::Result;
use candle_amp::doctor::{Doctor, DoctorConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, nn as ann, ops};
use candle_core::Tensor;
use candle_nn::{Module, VarBuilder};

struct Mlp(ann::Linear, ann::Linear, ann::Linear);

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.2
            .forward(&ops::relu(&self.1.forward(&ops::relu(&self.0.forward(x)?)?)?)?)
    }
}

fn mlp(vb: VarBuilder, hidden: usize) -> candle_core::Result<Mlp> {
    Ok(Mlp(
        ann::linear(64, hidden, vb.pp("fc1"))?,
        ann::linear(hidden, hidden, vb.pp("fc2"))?,
        ann::linear(hidden, 10, vb.pp("fc3"))?,
    ))
}

/// Mean step time with the doctor on (every 10th step recorded) over off, at O1 f16 (the
/// level with the most hooks): blocks of 10 steps (one recorded) alternate between the two
/// runs, and the medians of the block times are compared.
pub fn doctor_overhead(hidden: usize, data: &[(Tensor, Tensor)], blocks: usize) -> Result<f64> {
    let run = |on: bool| -> Result<_> {
        let cfg = AmpConfig::new(OptLevel::O1).half(HalfType::F16).verbosity(0);
        let opt = amp::optim::AdamW::new(Default::default())?;
        let (model, opt, amp) = amp::initialize(|vb| mlp(vb, hidden), opt, cfg)?;
        let doctor = on.then(|| Doctor::attach(&amp, DoctorConfig::default())).transpose()?;
        Ok((model, opt, amp, doctor))
    };
    let mut runs = [run(false)?, run(true)?];
    let mut times = [Vec::new(), Vec::new()];
    let mut i = 0;
    for b in 0..=blocks {
        for (k, (model, opt, amp, _)) in runs.iter_mut().enumerate() {
            let t0 = Instant::now();
            for _ in 0..10 {
                let (x, y) = &data[i % data.len()];
                i += 1;
                let loss = ops::cross_entropy(&model.forward(x)?, y)?;
                amp.scale_loss(&loss, opt)?.backward()?;
                opt.step()?;
                opt.zero_grad();
            }
            // The first block warms up.
            if b > 0 {
                times[k].push(t0.elapsed().as_secs_f64());
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (off, on) = (median(&mut times[0]), median(&mut times[1]));
    Ok(on / off)
}
