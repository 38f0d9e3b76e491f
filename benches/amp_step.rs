//! One training step of the digits-sized MLP (64-256-256-10, batch 128, AdamW, built from
//! `candle_amp::nn` and `ops::relu` so that O1 autocasts) at each opt level, with the kernels
//! and, for O0 and O2 bf16, on the plain candle path (`kernels::plain`, unfused AdamW).
//! Compare the lines as ratios from one run. At this small size the step is dominated by
//! per-op overhead, not arithmetic; the bench example's 64-1024-1024-10 MLP is the one the
//! targets of `docs/performance.md` are measured on. Per-kernel benchmarks: `benches/kernels.rs`.

use candle_amp::kernels;
use candle_amp::nn::{Linear, linear};
use candle_amp::optim::{AdamW, AdamWConfig};
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
        self.2.forward(&amp::ops::relu(
            &self.1.forward(&amp::ops::relu(&self.0.forward(x)?)?)?,
        )?)
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
    for (level, half, plain) in [
        (OptLevel::O0, HalfType::F16, false),
        (OptLevel::O0, HalfType::F16, true),
        (OptLevel::O1, HalfType::Bf16, false),
        (OptLevel::O2, HalfType::F16, false),
        (OptLevel::O2, HalfType::Bf16, false),
        (OptLevel::O2, HalfType::Bf16, true),
        (OptLevel::O3, HalfType::Bf16, false),
    ] {
        let cfg = AmpConfig::new(level).half(half).verbosity(0);
        let adamw = AdamW::new(AdamWConfig {
            fused: !plain,
            ..Default::default()
        })
        .unwrap();
        let (model, mut opt, amp) = amp::initialize(Mlp::new, adamw, cfg).unwrap();
        let name = format!("{level}-{half}{}", if plain { "-plain" } else { "" });
        g.bench_function(name, |b| {
            let _plain = plain.then(kernels::plain);
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
