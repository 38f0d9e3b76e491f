//! One training step of the digits-sized MLP (64-256-256-10, batch 128, AdamW, built from
//! `candle_amp::nn` so that O1 autocasts) at each opt level, and the unscale-and-check stage
//! alone. Compare the levels as ratios from one run:
//! on a CPU, half precision is not expected to be faster (candle's CPU matmul widens bf16 to
//! f32 and its f16 gemm is no faster than f32).

use candle_amp::nn::{Linear, linear};
use candle_amp::optim::AdamW;
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder};
use criterion::{Criterion, criterion_group, criterion_main};

struct Mlp(Linear, Linear, Linear);

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self(
            linear(64, 256, vb.pp("fc1"))?,
            linear(256, 256, vb.pp("fc2"))?,
            linear(256, 10, vb.pp("fc3"))?,
        ))
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.2.forward(&self.1.forward(&self.0.forward(x)?.relu()?)?.relu()?)
    }
}

fn step(c: &mut Criterion) {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (128, 64), &dev).unwrap();
    let y = Tensor::arange(0u32, 128, &dev).unwrap().affine(1.0, 0.0).unwrap();
    let y = (y.to_dtype(DType::F32).unwrap() / 13.0)
        .unwrap()
        .floor()
        .unwrap()
        .to_dtype(DType::U32)
        .unwrap();
    let mut g = c.benchmark_group("mlp_step");
    for (level, half) in [
        (OptLevel::O0, HalfType::F16),
        (OptLevel::O1, HalfType::F16),
        (OptLevel::O2, HalfType::F16),
        (OptLevel::O2, HalfType::Bf16),
        (OptLevel::O3, HalfType::F16),
    ] {
        let cfg = AmpConfig::new(level).half(half).verbosity(0);
        let (model, mut opt, amp) = amp::initialize(Mlp::new, AdamW::new(Default::default()).unwrap(), cfg).unwrap();
        g.bench_function(format!("{level}-{half}"), |b| {
            b.iter(|| {
                let loss = amp::ops::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
                amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
