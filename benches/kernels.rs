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
//!   vs `broadcast_matmul` + `broadcast_add`;
//! * `gelu`, `relu`: the forward over 4 Mi values per dtype, vs `gelu_erf` and `relu`;
//! * `norm`: layer and RMS norm of 4096 rows of 1024 forward (bf16), and the layer norm's
//!   backward over 512 rows (f32), vs the same maths as tensor ops (the `plain` path);
//! * `sgd`: the fused momentum update of 4 Mi parameters, f32 in place and bf16 (O3);
//! * `bias_grad`: the backward of a 1024 x 8 -> 1024 layer where only the bias is tracked
//!   (the column sums of its output gradient).
//!
//! `RAYON_NUM_THREADS=1 cargo bench --bench kernels` for one thread (the bench example's
//! JSON gives the same kernels as GB/s and GFLOP/s). `CANDLE_AMP_ISA=portable` (or `avx2`,
//! `avx512`, `avx512bf16`, `amx`) caps the kernels' instruction set for the run: compare it
//! with a run at the detected one, e.g.
//! `CANDLE_AMP_ISA=portable RAYON_NUM_THREADS=1 cargo bench --bench kernels -- 'gelu/kernels'`.

use std::time::Duration;

use candle_amp::kernels::{self, AdamWStep, HalfOut, Isa};
use candle_amp::optim::{GroupHyper, Optimizer, ParamUpdate, Sgd, SgdConfig};
use candle_core::{DType, Device, Tensor, Var};
use criterion::{Criterion, Throughput, criterion_group};
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

fn gelu_relu(c: &mut Criterion) {
    let n = 4 << 20;
    for (name, kernel, candle) in [
        (
            "gelu",
            kernels::gelu as fn(&Tensor) -> candle_core::Result<Tensor>,
            Tensor::gelu_erf as fn(&Tensor) -> _,
        ),
        ("relu", kernels::relu, Tensor::relu),
    ] {
        let mut g = c.benchmark_group(name);
        short(&mut g);
        g.throughput(Throughput::Elements(n as u64));
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let x = data(n, dt);
            g.bench_function(format!("kernels_{dt:?}"), |b| b.iter(|| kernel(&x).unwrap()));
            g.bench_function(format!("candle_{dt:?}"), |b| b.iter(|| candle(&x).unwrap()));
        }
        g.finish();
    }
}

fn norm(c: &mut Criterion) {
    let (rows, n) = (4096, 1024);
    let mut g = c.benchmark_group("norm");
    short(&mut g);
    g.throughput(Throughput::Elements((rows * n) as u64));
    let w = Var::from_tensor(&data(n, DType::F32).affine(0.5, 1.0).unwrap()).unwrap();
    let bias = Var::from_tensor(&data(n, DType::F32)).unwrap();
    let x = data(rows * n, DType::BF16).reshape((rows, n)).unwrap();
    let small = 512;
    let xv = Var::from_tensor(&data(small * n, DType::F32).reshape((small, n)).unwrap()).unwrap();
    for plain in [false, true] {
        let who = if plain { "plain" } else { "kernels" };
        g.bench_function(format!("{who}_layer_norm_fwd_BF16"), |b| {
            let _p = plain.then(kernels::plain);
            b.iter(|| kernels::layer_norm(&x, Some(&w), Some(&bias), 1e-5).unwrap())
        });
        g.bench_function(format!("{who}_rms_norm_fwd_BF16"), |b| {
            let _p = plain.then(kernels::plain);
            b.iter(|| kernels::rms_norm(&x, Some(&w), 1e-5).unwrap())
        });
        // The backward alone, on a graph built once (smaller, so the kernels and not the
        // allocation of the gradients dominate).
        g.bench_function(format!("{who}_layer_norm_bwd_F32"), |b| {
            let _p = plain.then(kernels::plain);
            let y = kernels::layer_norm(&xv, Some(&w), Some(&bias), 1e-5).unwrap();
            b.iter(|| y.backward().unwrap())
        });
    }
    g.finish();
}

fn sgd(c: &mut Criterion) {
    let n = 4 << 20;
    let mut g = c.benchmark_group("sgd");
    short(&mut g);
    // Reads p, g and the momentum buffer; writes p and the buffer.
    g.throughput(Throughput::Elements(n as u64));
    let grad = data(n, DType::F32).affine(1e-3, 0.0).unwrap();
    for dt in [DType::F32, DType::BF16] {
        let var = Var::from_tensor(&data(n, dt)).unwrap();
        let cfg = SgdConfig {
            momentum: 0.9,
            weight_decay: 1e-4,
            ..SgdConfig::new(1e-3)
        };
        let mut opt = Sgd::new(cfg).unwrap();
        g.bench_function(format!("kernels_momentum_{dt:?}"), |b| {
            b.iter(|| {
                // f32: the parameter itself; bf16: O3, the half Var updated in place.
                let p = ParamUpdate {
                    name: "p",
                    var: &var,
                    working: (dt != DType::F32).then_some(&var),
                    grad: &grad,
                    hyper: GroupHyper {
                        lr: 1e-3,
                        weight_decay: 1e-4,
                    },
                    persistent: dt == DType::F32,
                };
                opt.step(&[p]).unwrap()
            })
        });
    }
    g.finish();
}

fn bias_grad(c: &mut Criterion) {
    let (m, n) = (1024, 1024);
    let mut g = c.benchmark_group("bias_grad");
    short(&mut g);
    g.throughput(Throughput::Elements((m * n) as u64));
    for dt in [DType::F32, DType::BF16] {
        // Only the bias is tracked, and the graph is built once: each backward is the column
        // sums of the (all-ones) output gradient.
        let x = data(m * 8, dt).reshape((m, 8)).unwrap();
        let w = data(n * 8, dt).reshape((n, 8)).unwrap();
        let bias = Var::from_tensor(&data(n, dt)).unwrap();
        let y = kernels::linear(&x, &w, Some(&bias)).unwrap();
        g.bench_function(format!("kernels_linear_bwd_{dt:?}"), |b| {
            b.iter(|| y.backward().unwrap())
        });
    }
    g.finish();
}

/// Shorter runs for the element-wise groups (each iteration is milliseconds).
fn short(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    g.sample_size(20);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
}

/// Caps the kernels at `CANDLE_AMP_ISA` when it is set (one of `portable`, `avx2`, `avx512`,
/// `avx512bf16`, `amx`): the tiers are compared run against run.
fn isa_from_env() {
    let Ok(v) = std::env::var("CANDLE_AMP_ISA") else {
        return;
    };
    let isa = match v.to_ascii_lowercase().as_str() {
        "portable" => Isa::Portable,
        "avx2" => Isa::Avx2,
        "avx512" => Isa::Avx512,
        "avx512bf16" => Isa::Avx512Bf16,
        "amx" => Isa::Amx,
        other => panic!("CANDLE_AMP_ISA={other}: expected portable, avx2, avx512, avx512bf16 or amx"),
    };
    kernels::force_isa(Some(isa));
    eprintln!(
        "kernels at {:?} (the CPU has {:?})",
        kernels::isa(),
        kernels::detected_isa()
    );
}

criterion_group!(
    benches, cast, unscale, adamw, gemm, linear, gelu_relu, norm, sgd, bias_grad
);

fn main() {
    // `criterion_main!` with the tier read first.
    isa_from_env();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
