//! The fused kernels against plain references, at every instruction set this CPU has
//! (forced one by one, down to the portable fallback): casts bit for bit against `half`,
//! unscale-and-check with inf/NaN at the first, a middle and the last element, matrix
//! products and the fused linear layer against f64 references (strided, transposed, batched,
//! odd sizes), and the fused AdamW update bit for bit against a scalar loop.
//!
//! The ISA switch is process-wide, so this binary runs its tests one after another under a
//! lock.

use std::sync::Mutex;

use candle_amp::kernels::{self, Isa};
use candle_core::{DType, Device, IndexOp, Tensor, Var};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

static LOCK: Mutex<()> = Mutex::new(());

/// Runs `f` once per instruction set the CPU has, lowest first.
fn each_isa(mut f: impl FnMut(Isa)) {
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    for isa in Isa::ALL.into_iter().filter(|i| *i <= kernels::detected_isa()) {
        kernels::force_isa(Some(isa));
        assert_eq!(kernels::isa(), isa);
        f(isa);
    }
    kernels::force_isa(None);
}

/// Values that exercise rounding: ordinary, tiny, huge, subnormal, signed zeros, ties.
fn tricky(n: usize, seed: u64) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let special = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65520.0,
        1e-8,
        -3e-39,
        1.0e38,
        f32::MIN_POSITIVE,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
    ];
    (0..n)
        .map(|i| {
            if i % 7 == 3 {
                special[(i / 7) % special.len()]
            } else {
                r.random_range(-4.0f32..4.0) * 2f32.powi(r.random_range(-20..20))
            }
        })
        .collect()
}

fn bits_f32(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn casts_equal_half_bit_for_bit() {
    each_isa(|isa| {
        for n in [0, 1, 15, 16, 17, 100, 1000, 300_001] {
            let mut v = tricky(n, n as u64);
            if n > 3 {
                v[0] = f32::NAN;
                v[n / 2] = f32::INFINITY;
                v[n - 1] = f32::NEG_INFINITY;
            }
            let x = Tensor::from_vec(v.clone(), n, &Device::Cpu).unwrap();
            // f32 -> f16/bf16 against half's scalar conversion.
            let h = kernels::cast(&x, DType::F16).unwrap().to_vec1::<f16>().unwrap();
            let b = kernels::cast(&x, DType::BF16).unwrap().to_vec1::<bf16>().unwrap();
            for (i, &f) in v.iter().enumerate() {
                if f.is_nan() {
                    assert!(h[i].is_nan() && b[i].is_nan(), "{isa:?} nan at {i}");
                    continue;
                }
                assert_eq!(
                    h[i].to_bits(),
                    f16::from_f32(f).to_bits(),
                    "{isa:?} f16 of {f:e} at {i}"
                );
                assert_eq!(
                    b[i].to_bits(),
                    bf16::from_f32(f).to_bits(),
                    "{isa:?} bf16 of {f:e} at {i}"
                );
            }
            // Back to f32 is exact, and into a preallocated tensor gives the same.
            let hb = kernels::cast(&kernels::cast(&x, DType::F16).unwrap(), DType::F32).unwrap();
            let expect: Vec<u32> = h.iter().map(|v| v.to_f32().to_bits()).collect();
            assert_eq!(bits_f32(&hb), expect, "{isa:?}");
            let dst = Tensor::zeros(n, DType::BF16, &Device::Cpu).unwrap();
            kernels::cast_into(&x, &dst).unwrap();
            assert_eq!(
                dst.to_vec1::<bf16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        // Non-contiguous input.
        let x = Tensor::from_vec(tricky(60, 9), (6, 10), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        let c = kernels::cast(&x, DType::F16).unwrap();
        assert_eq!(
            bits_f32(&c),
            bits_f32(&x.to_dtype(DType::F16).unwrap()),
            "{isa:?} transposed"
        );
    });
}

#[test]
fn the_fast_cast_is_differentiable() {
    let x = Var::new(&[1.5f32, -2.0, 3.25], &Device::Cpu).unwrap();
    let y = kernels::cast(&x, DType::BF16).unwrap();
    let loss = (kernels::cast(&y, DType::F32).unwrap() * 2.0)
        .unwrap()
        .sum_all()
        .unwrap();
    let g = loss.backward().unwrap();
    assert_eq!(g.get(&x).unwrap().dtype(), DType::F32);
    assert_eq!(g.get(&x).unwrap().to_vec1::<f32>().unwrap(), [2.0, 2.0, 2.0]);
}

#[test]
fn unscale_checks_the_raw_values_and_unscales_exactly() {
    each_isa(|isa| {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for n in [1, 16, 17, 1000, 200_003] {
                let v: Vec<f32> = tricky(n, 3 + n as u64).iter().map(|x| x.clamp(-6e4, 6e4)).collect();
                let raw = Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(dt).unwrap();
                let rv = raw.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
                for scale in [1.0f32, 1024.0, 0.25] {
                    let inv = (1.0f64 / scale as f64) as f32;
                    let acc = Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
                    assert!(!kernels::unscale_check_into(&raw, scale, &acc, false).unwrap());
                    let expect: Vec<u32> = rv.iter().map(|g| (g * inv).to_bits()).collect();
                    assert_eq!(bits_f32(&acc), expect, "{isa:?} {dt:?} n={n} scale={scale}");
                    // Accumulating adds the same again.
                    assert!(!kernels::unscale_check_into(&raw, scale, &acc, true).unwrap());
                    let twice: Vec<u32> = rv.iter().map(|g| (g * inv + g * inv).to_bits()).collect();
                    assert_eq!(bits_f32(&acc), twice, "{isa:?} {dt:?} n={n} accumulated");
                }
                // inf or NaN at the first, a middle and the last element is found.
                for pos in [0, n / 2, n - 1] {
                    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                        let mut w = rv.clone();
                        w[pos] = bad;
                        let raw = Tensor::from_vec(w, n, &Device::Cpu).unwrap().to_dtype(dt).unwrap();
                        let acc = Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
                        assert!(
                            kernels::unscale_check_into(&raw, 1024.0, &acc, false).unwrap(),
                            "{isa:?} {dt:?} n={n} {bad} at {pos}"
                        );
                    }
                }
            }
        }
        // A finite gradient that overflows when unscaled (scale below 1) is an overflow.
        let raw = Tensor::new(&[3.0e38f32, 1.0], &Device::Cpu).unwrap();
        let acc = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        assert!(kernels::unscale_check_into(&raw, 0.5, &acc, false).unwrap(), "{isa:?}");
    });
}

/// `a (m x k) . b (k x n)` in f64 from the f32 values.
fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                c[i * n + j] += a[i * k + p] as f64 * b[p * n + j] as f64;
            }
        }
    }
    c
}

fn rand_t(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dt).unwrap()
}

fn close(got: &Tensor, want: &[f64], k: usize, what: &str) {
    let g = got
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(g.len(), want.len(), "{what}");
    // f32 accumulation of k exact products, then one rounding to the output type.
    let out_eps = match got.dtype() {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 0.0,
    };
    for (i, (x, y)) in g.iter().zip(want).enumerate() {
        let tol = 1e-6 * k as f64 * (1.0 + y.abs()) + out_eps * y.abs() + 1e-6;
        assert!((*x as f64 - y).abs() <= tol, "{what}: [{i}] {x} vs {y}");
    }
}

#[test]
fn matrix_products_equal_an_f64_reference() {
    each_isa(|isa| {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for (m, k, n) in [
                (1, 1, 1),
                (3, 5, 7),
                (17, 33, 31),
                (64, 64, 64),
                (70, 130, 50),
                (200, 257, 96),
            ] {
                let a = rand_t(&[m, k], 1, dt);
                let b = rand_t(&[k, n], 2, dt);
                let av = a
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let bv = b
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let want = reference(&av, &bv, m, k, n);
                let c = kernels::matmul(&a, &b).unwrap();
                assert_eq!(c.dtype(), dt);
                close(&c, &want, k, &format!("{isa:?} {dt:?} {m}x{k}x{n}"));
                // Transposed views (no copy) give the same.
                let at = a.t().unwrap().contiguous().unwrap().t().unwrap();
                let bt = b.t().unwrap().contiguous().unwrap().t().unwrap();
                close(
                    &kernels::matmul(&at, &bt).unwrap(),
                    &want,
                    k,
                    &format!("{isa:?} {dt:?} transposed"),
                );
            }
            // Batched, with a broadcast operand.
            let a = rand_t(&[3, 2, 20, 36], 3, dt);
            let b = rand_t(&[36, 24], 4, dt);
            let c = kernels::matmul(&a, &b).unwrap();
            assert_eq!(c.dims(), [3, 2, 20, 24]);
            let bv = b
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for i in 0..3 {
                for j in 0..2 {
                    let ai = a.i((i, j)).unwrap();
                    let av = ai
                        .to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap();
                    close(
                        &c.i((i, j)).unwrap(),
                        &reference(&av, &bv, 20, 36, 24),
                        36,
                        &format!("{isa:?} {dt:?} batch"),
                    );
                }
            }
        }
    });
}

#[test]
fn matmul_and_linear_gradients_equal_candles() {
    each_isa(|isa| {
        // f32 operands: our backward against candle's matmul backward.
        let a = Var::from_tensor(&rand_t(&[2, 5, 7], 5, DType::F32)).unwrap();
        let b = Var::from_tensor(&rand_t(&[2, 7, 3], 6, DType::F32)).unwrap();
        let w = rand_t(&[2, 5, 3], 7, DType::F32);
        let ours = (kernels::matmul(&a, &b).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let theirs = (a.matmul(&b).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for v in [&a, &b] {
            let (x, y) = (bits_f32(ours.get(v).unwrap()), bits_f32(theirs.get(v).unwrap()));
            let xs: Vec<f32> = x.iter().map(|b| f32::from_bits(*b)).collect();
            let ys: Vec<f32> = y.iter().map(|b| f32::from_bits(*b)).collect();
            assert!(
                xs.iter().zip(&ys).all(|(p, q)| (p - q).abs() <= 1e-5 * (1.0 + q.abs())),
                "{isa:?}"
            );
        }
        // The fused linear layer: output and all three gradients.
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let x = Var::from_tensor(&rand_t(&[3, 4, 37], 8, dt)).unwrap();
            let wt = Var::from_tensor(&rand_t(&[19, 37], 9, dt)).unwrap();
            let bias = Var::from_tensor(&rand_t(&[19], 10, dt)).unwrap();
            let sel = rand_t(&[3, 4, 19], 11, DType::F32);
            let y = kernels::linear(&x, &wt, Some(&bias)).unwrap();
            assert_eq!((y.dims(), y.dtype()), ([3, 4, 19].as_slice(), dt));
            let g = (y.to_dtype(DType::F32).unwrap() * &sel)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            // f64 reference.
            let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let (x6, w6, b6, s6) = (
                Var::from_tensor(&f(&x)).unwrap(),
                Var::from_tensor(&f(&wt)).unwrap(),
                Var::from_tensor(&f(&bias)).unwrap(),
                f(&sel),
            );
            let y6 = x6
                .broadcast_matmul(&w6.t().unwrap())
                .unwrap()
                .broadcast_add(&b6)
                .unwrap();
            let g6 = (&y6 * &s6).unwrap().sum_all().unwrap().backward().unwrap();
            let tol = match dt {
                DType::F32 => 1e-5,
                DType::F16 => 4e-3,
                _ => 2e-2,
            };
            for (name, ours, want) in [
                ("y", y.clone(), y6.clone()),
                ("dx", g.get(&x).unwrap().clone(), g6.get(&x6).unwrap().clone()),
                ("dw", g.get(&wt).unwrap().clone(), g6.get(&w6).unwrap().clone()),
                ("db", g.get(&bias).unwrap().clone(), g6.get(&b6).unwrap().clone()),
            ] {
                assert_eq!(
                    ours.dtype(),
                    dt,
                    "{isa:?} {dt:?} {name}: gradients come back in the parameter's type"
                );
                let o = ours
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap();
                let w = want.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
                for (p, q) in o.iter().zip(&w) {
                    assert!(
                        (p - q).abs() <= tol * scale.max(1.0),
                        "{isa:?} {dt:?} {name}: {p} vs {q}"
                    );
                }
            }
        }
    });
}

#[test]
fn fused_adamw_equals_a_scalar_loop_bit_for_bit() {
    each_isa(|isa| {
        for n in [1, 15, 16, 33, 1001, 300_000] {
            let p0 = tricky(n, 20).iter().map(|x| x.clamp(-10.0, 10.0)).collect::<Vec<f32>>();
            let g: Vec<f32> = tricky(n, 21).iter().map(|x| x.clamp(-5.0, 5.0)).collect();
            let s = kernels::AdamWStep {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                step: 3,
            };
            let (mut p, mut m, mut v) = (p0.clone(), vec![0.01f32; n], vec![0.02f32; n]);
            let mut h = vec![bf16::ZERO; n];
            kernels::adamw(&mut p, &g, &mut m, &mut v, kernels::HalfOut::Bf16(&mut h), &s);
            // The scalar reference, candle-nn's order of operations.
            let t = s.step as f64;
            let (b1, b2) = (s.beta1 as f32, s.beta2 as f32);
            let (ib1, ib2) = (
                (1.0 / (1.0 - s.beta1.powf(t))) as f32,
                (1.0 / (1.0 - s.beta2.powf(t))) as f32,
            );
            for i in 0..n {
                let nm = b1 * 0.01 + (1.0 - s.beta1) as f32 * g[i];
                let nv = b2 * 0.02 + (1.0 - s.beta2) as f32 * (g[i] * g[i]);
                let np = p0[i] * (1.0 - s.lr * s.weight_decay) as f32
                    - (nm * ib1 / ((nv * ib2).sqrt() + s.eps as f32)) * s.lr as f32;
                assert_eq!(m[i].to_bits(), nm.to_bits(), "{isa:?} m[{i}]");
                assert_eq!(v[i].to_bits(), nv.to_bits(), "{isa:?} v[{i}]");
                assert_eq!(p[i].to_bits(), np.to_bits(), "{isa:?} p[{i}]");
                assert_eq!(h[i].to_bits(), bf16::from_f32(np).to_bits(), "{isa:?} half[{i}]");
            }
        }
    });
}

#[test]
fn relu_and_gelu_match_their_definitions_and_gradients() {
    each_isa(|isa| {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for n in [1, 17, 1000, 70_001] {
                let mut v = tricky(n, 30 + n as u64);
                for x in v.iter_mut() {
                    *x = x.clamp(-8.0, 8.0);
                }
                let x = Var::from_tensor(&Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(dt).unwrap()).unwrap();
                let w = rand_t(&[n], 31, dt);
                // ReLU: bit for bit, values and gradients.
                let ours = kernels::relu(&x).unwrap();
                let theirs = x.relu().unwrap();
                let (a, b) = (bits_f32(&ours), bits_f32(&theirs));
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    // -0 and 0 are both a zero output.
                    assert!(
                        p == q || f32::from_bits(*p) == f32::from_bits(*q),
                        "{isa:?} {dt:?} relu[{i}]"
                    );
                }
                // Gradient: PyTorch's subgradient, w where x > 0 and 0 elsewhere (zeros and
                // NaN included), bit for bit.
                let g1 = (kernels::relu(&x).unwrap() * &w)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let xs = bits_f32(&x);
                let ws = bits_f32(&w);
                let want: Vec<u32> = xs
                    .iter()
                    .zip(&ws)
                    .map(|(x, w)| if f32::from_bits(*x) > 0.0 { *w } else { 0 })
                    .collect();
                assert_eq!(bits_f32(g1.get(&x).unwrap()), want, "{isa:?} {dt:?} relu grad");
                // GELU: against the exact f64 erf form.
                let x64 = x.to_dtype(DType::F64).unwrap();
                let exact = x64.gelu_erf().unwrap().to_vec1::<f64>().unwrap();
                let got = kernels::gelu(&x)
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap();
                let out_eps = match dt {
                    DType::BF16 => 2f64.powi(-8),
                    DType::F16 => 2f64.powi(-11),
                    _ => 0.0,
                };
                for (i, (p, q)) in got.iter().zip(&exact).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-6 + out_eps * q.abs(),
                        "{isa:?} {dt:?} gelu[{i}]: {p} vs {q}"
                    );
                }
                let g = (kernels::gelu(&x).unwrap().to_dtype(DType::F32).unwrap() * w.to_dtype(DType::F32).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let xv = Var::from_tensor(&x64).unwrap();
                let ge = (xv.gelu_erf().unwrap() * w.to_dtype(DType::F64).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let (p, q) = (
                    g.get(&x)
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap(),
                    ge.get(&xv).unwrap().to_vec1::<f64>().unwrap(),
                );
                for (i, (a, b)) in p.iter().zip(&q).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-6 + 2.0 * out_eps * b.abs().max(1.0),
                        "{isa:?} {dt:?} gelu'[{i}]: {a} vs {b}"
                    );
                }
            }
        }
    });
}

/// Builds the optimizer under test for an `Amp`.
type MakeOpt = Box<dyn Fn(&candle_amp::Amp) -> candle_amp::AmpOptimizer>;

/// Weights after `steps` steps of a small model with one optimizer configuration.
fn train(level: candle_amp::OptLevel, half: candle_amp::HalfType, algo: MakeOpt) -> Vec<Vec<f32>> {
    use candle_amp::{AmpConfig, ops};
    let amp = candle_amp::Amp::new(AmpConfig::new(level).half(half).verbosity(0), &Device::Cpu).unwrap();
    let model = amp
        .model(|vb| {
            Ok((
                candle_amp::nn::linear(33, 40, vb.pp("a"))?,
                candle_amp::nn::linear(40, 7, vb.pp("b"))?,
            ))
        })
        .unwrap();
    let mut opt = algo(&amp);
    for s in 0..4 {
        let x = rand_t(&[16, 33], 40 + s, DType::F32);
        let y = rand_t(&[16, 7], 50 + s, DType::F32);
        let h = {
            let _a = model.autocast();
            let x = model.cast_input(&x).unwrap();
            let h = ops::relu(&candle_nn::Module::forward(&model.inner().0, &x).unwrap()).unwrap();
            candle_nn::Module::forward(&model.inner().1, &h).unwrap()
        };
        let loss = ops::mse(&h.to_dtype(DType::F32).unwrap(), &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        assert!(!opt.step().unwrap().is_skipped());
        opt.zero_grad();
    }
    amp.store()
        .params()
        .iter()
        .map(|p| p.f32_value().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

#[test]
fn fused_optimizers_equal_the_tensor_paths() {
    use candle_amp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
    use candle_amp::{HalfType, OptLevel};
    each_isa(|isa| {
        for level in [OptLevel::O0, OptLevel::O2, OptLevel::O3] {
            for half in [HalfType::F16, HalfType::Bf16] {
                let adamw = |fused| -> MakeOpt {
                    Box::new(move |a: &candle_amp::Amp| {
                        let cfg = AdamWConfig {
                            lr: 1e-2,
                            weight_decay: 0.1,
                            fused,
                            ..Default::default()
                        };
                        a.optimizer(AdamW::new(cfg).unwrap()).unwrap()
                    })
                };
                let sgd = |fused, nesterov| -> MakeOpt {
                    Box::new(move |a: &candle_amp::Amp| {
                        let cfg = SgdConfig {
                            momentum: 0.9,
                            weight_decay: 0.01,
                            nesterov,
                            fused,
                            ..SgdConfig::new(0.05)
                        };
                        a.optimizer(Sgd::new(cfg).unwrap()).unwrap()
                    })
                };
                for (name, f, u) in [
                    ("adamw", adamw(true), adamw(false)),
                    ("sgd", sgd(true, false), sgd(false, false)),
                    ("nesterov", sgd(true, true), sgd(false, true)),
                ] {
                    let (a, b) = (train(level, half, f), train(level, half, u));
                    for (pa, pb) in a.iter().zip(&b) {
                        for (x, y) in pa.iter().zip(pb) {
                            // O3 rounds every step to half: allow one half ulp there.
                            let tol = if level == OptLevel::O3 {
                                1e-2 * y.abs().max(1e-3)
                            } else {
                                1e-6 * y.abs().max(1e-3)
                            };
                            assert!((x - y).abs() <= tol, "{isa:?} {level} {half} {name}: {x} vs {y}");
                        }
                    }
                }
            }
        }
    });
}
