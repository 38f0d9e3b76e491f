//! Each kernel against the candle op it replaces, in one run (compare the two lines of a
//! group as a ratio; absolute times on a shared machine mean little).
//!
//! * `cast`: f32 -> f16 / bf16 over 16 Mi values, `kernels::cast` vs `to_dtype`;
//! * `unscale_check`: a 16 Mi-value f16 gradient checked and unscaled into an f32 buffer,
//!   vs candle's `to_dtype` + `affine` + a finiteness sum;
//! * `adamw`: the fused update of 4 Mi parameters with a bf16 working copy, vs the same step
//!   as candle tensor ops;
//! * `gemm`: a 512^3 product per dtype, `kernels::matmul` vs candle's `matmul`;
//! * `linear`: forward and backward of a 512 x 1024 -> 1024 layer in bf16, `kernels::linear`
//!   vs `broadcast_matmul` + `broadcast_add`.
//!
//! `RAYON_NUM_THREADS=1 cargo bench --bench kernels` for one thread (the bench example's
//! JSON gives the same kernels as GB/s and GFLOP/s).

use candle_amp::kernels::{self, AdamWStep, HalfOut};
use candle_core::{DType, Device, Tensor, Var};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;

fn data(n: usize, dt: DType) -> Tensor {
    // Deterministic, finite, varied values (no RNG needed).
    let v: Vec<f32> = (0..n).map(|i| ((i * 7919) % 10007) as f32 / 5003.5 - 1.0).collect();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(dt).unwrap()
}

fn cast(c: &mut Criterion) {
    let n = 16 << 20;
    let x = data(n, DType::F32);
    let mut g = c.benchmark_group("cast");
    g.sample_size(20);
    g.throughput(Throughput::Bytes((n * 6) as u64));
    for dt in [DType::F16, DType::BF16] {
        g.bench_function(format!("kernels_f32_to_{dt:?}"), |b| {
            b.iter(|| kernels::cast(&x, dt).unwrap())
        });
        g.bench_function(format!("candle_f32_to_{dt:?}"), |b| b.iter(|| x.to_dtype(dt).unwrap()));
    }
    g.finish();
}

fn unscale(c: &mut Criterion) {
    let n = 16 << 20;
    let raw = data(n, DType::F16);
    let acc = Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
    let mut g = c.benchmark_group("unscale_check");
    g.sample_size(20);
    g.throughput(Throughput::Bytes((n * 6) as u64));
    g.bench_function("kernels", |b| {
        b.iter(|| assert!(!kernels::unscale_check_into(&raw, 1024.0, &acc, false).unwrap()))
    });
    g.bench_function("candle", |b| {
        b.iter(|| {
            let u = raw.to_dtype(DType::F32).unwrap().affine(1.0 / 1024.0, 0.0).unwrap();
            let s = u.sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(s.is_finite());
            u
        })
    });
    g.finish();
}

fn adamw(c: &mut Criterion) {
    let n = 4 << 20;
    let mut p = data(n, DType::F32).to_vec1::<f32>().unwrap();
    let gr = data(n, DType::F32).affine(1e-3, 0.0).unwrap().to_vec1::<f32>().unwrap();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut h = vec![bf16::ZERO; n];
    let mut g = c.benchmark_group("adamw");
    g.sample_size(20);
    // Reads p, g, m, v; writes p, m, v and the bf16 copy.
    g.throughput(Throughput::Bytes((n * (4 * 7 + 2)) as u64));
    let mut step = 0;
    g.bench_function("kernels_fused", |b| {
        b.iter(|| {
            step += 1;
            let s = AdamWStep {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                step,
            };
            kernels::adamw(&mut p, &gr, &mut m, &mut v, HalfOut::Bf16(&mut h), &s).unwrap()
        })
    });
    let pv = Var::from_tensor(&data(n, DType::F32)).unwrap();
    let hv = Var::from_tensor(&data(n, DType::BF16)).unwrap();
    let gt = data(n, DType::F32).affine(1e-3, 0.0).unwrap();
    let mv = Var::zeros(n, DType::F32, &Device::Cpu).unwrap();
    let vv = Var::zeros(n, DType::F32, &Device::Cpu).unwrap();
    let mut t = 0;
    g.bench_function("candle_tensor_ops", |b| {
        b.iter(|| {
            t += 1;
            let (b1, b2, lr, eps, wd) = (0.9f64, 0.999f64, 1e-3, 1e-8, 0.01);
            let m = ((mv.as_tensor() * b1).unwrap() + (&gt * (1.0 - b1)).unwrap()).unwrap();
            let v = ((vv.as_tensor() * b2).unwrap() + (gt.sqr().unwrap() * (1.0 - b2)).unwrap()).unwrap();
            let mh = (&m / (1.0 - b1.powi(t))).unwrap();
            let vh = (&v / (1.0 - b2.powi(t))).unwrap();
            let upd = (mh / (vh.sqrt().unwrap() + eps).unwrap()).unwrap();
            let p = ((pv.as_tensor() * (1.0 - lr * wd)).unwrap() - (upd * lr).unwrap()).unwrap();
            hv.set(&p.to_dtype(DType::BF16).unwrap()).unwrap();
            pv.set(&p).unwrap();
            mv.set(&m).unwrap();
            vv.set(&v).unwrap();
        })
    });
    g.finish();
}

fn gemm(c: &mut Criterion) {
    let n = 512;
    let mut g = c.benchmark_group("gemm");
    g.sample_size(20);
    g.throughput(Throughput::Elements((2 * n * n * n) as u64));
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let a = data(n * n, dt).reshape((n, n)).unwrap();
        let b = data(n * n, dt)
            .reshape((n, n))
            .unwrap()
            .t()
            .unwrap()
            .contiguous()
            .unwrap();
        g.bench_function(format!("kernels_{dt:?}"), |bn| {
            bn.iter(|| kernels::matmul(&a, &b).unwrap())
        });
        g.bench_function(format!("candle_{dt:?}"), |bn| bn.iter(|| a.matmul(&b).unwrap()));
    }
    g.finish();
}

fn linear(c: &mut Criterion) {
    let (m, k, n) = (512, 1024, 1024);
    let x = Var::from_tensor(&data(m * k, DType::BF16).reshape((m, k)).unwrap()).unwrap();
    let w = Var::from_tensor(&data(n * k, DType::BF16).reshape((n, k)).unwrap()).unwrap();
    let bias = Var::from_tensor(&data(n, DType::BF16)).unwrap();
    let mut g = c.benchmark_group("linear_fwd_bwd_bf16");
    g.sample_size(20);
    // Forward and the two gradient products.
    g.throughput(Throughput::Elements((3 * 2 * m * n * k) as u64));
    g.bench_function("kernels", |b| {
        b.iter(|| {
            let y = kernels::linear(&x, &w, Some(&bias)).unwrap();
            y.sum_all().unwrap().backward().unwrap()
        })
    });
    g.bench_function("candle", |b| {
        b.iter(|| {
            let y = x
                .broadcast_matmul(&w.t().unwrap())
                .unwrap()
                .broadcast_add(&bias)
                .unwrap();
            y.sum_all().unwrap().backward().unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, cast, unscale, adamw, gemm, linear);
criterion_main!(benches);
