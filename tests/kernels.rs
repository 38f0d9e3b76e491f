//! The fused kernels against plain references, at every instruction set this CPU has
//! (forced one by one, down to the portable fallback): casts bit for bit against `half`,
//! unscale-and-check with inf/NaN at the first, a middle and the last element, matrix
//! products and the fused linear layer against f64 references (strided, transposed, batched,
//! odd sizes), and the fused AdamW update bit for bit against a scalar loop. The kernels
//! whose loops are compiled once per tier (GELU, ReLU, the norms, the bias gradient, SGD)
//! give every tier's results bit for bit against the portable path's.
//!
//! The ISA switch is process-wide, so this binary runs its tests one after another under a
//! lock.
//!
//! On the CPU whatever `CANDLE_AMP_TEST_DEVICE` says: instruction-set tiers and raw-slice
//! passes are the CPU kernels' own (other devices take candle's ops, which the behaviour
//! tests cover there).

mod common;

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
    common::each_tier(|isa| {
        assert_eq!(kernels::isa(), isa);
        f(isa);
    });
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
            kernels::adamw(&mut p, &g, &mut m, &mut v, kernels::HalfOut::Bf16(&mut h), &s).unwrap();
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
fn fused_adamw_refuses_mismatched_lengths_and_step_zero() {
    let s = kernels::AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        step: 1,
    };
    let n = 40;
    let (mut p, g, mut m, mut v) = (vec![1f32; n], vec![0.5f32; n], vec![0f32; n], vec![0f32; n]);
    let mut h = vec![f16::ZERO; n];
    let refused = |r: candle_amp::Result<()>, arg: &str| match r {
        Err(candle_amp::AmpError::InvalidArgument { argument, .. }) => assert_eq!(argument, arg),
        other => panic!("{arg}: {other:?}"),
    };
    refused(
        kernels::adamw(&mut p, &g[..n - 1], &mut m, &mut v, kernels::HalfOut::None, &s),
        "g",
    );
    refused(
        kernels::adamw(&mut p, &g, &mut m[..n - 1], &mut v, kernels::HalfOut::None, &s),
        "m",
    );
    refused(
        kernels::adamw(&mut p, &g, &mut m, &mut v[..1], kernels::HalfOut::None, &s),
        "v",
    );
    refused(
        kernels::adamw(&mut p, &g, &mut m, &mut v, kernels::HalfOut::F16(&mut h[..n - 8]), &s),
        "half",
    );
    let zero = kernels::AdamWStep { step: 0, ..s };
    refused(
        kernels::adamw(&mut p, &g, &mut m, &mut v, kernels::HalfOut::None, &zero),
        "step",
    );
    let one = kernels::AdamWStep { beta1: 1.0, ..s };
    refused(
        kernels::adamw(&mut p, &g, &mut m, &mut v, kernels::HalfOut::None, &one),
        "beta1",
    );
    assert!(
        p.iter().chain(&m).chain(&v).all(|x| *x == 1.0 || *x == 0.0),
        "nothing written"
    );
    kernels::adamw(&mut p, &g, &mut m, &mut v, kernels::HalfOut::F16(&mut h), &s).unwrap();
    assert!(p.iter().all(|x| *x < 1.0) && h.iter().all(|x| x.to_f32() < 1.0));
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

#[test]
fn the_plain_candle_path_is_selectable_and_trains_alike() {
    use candle_amp::optim::{Sgd, SgdConfig};
    use candle_amp::{HalfType, OptLevel};
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let bits = |t: &Tensor| bits_f32(t);
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let a = rand_t(&[3, 20, 30], 61, dt);
        let b = rand_t(&[3, 30, 40], 62, dt);
        let w = rand_t(&[40, 30], 63, dt);
        let bias = rand_t(&[40], 64, dt);
        let x = rand_t(&[5, 30], 65, DType::F32);
        let mut v = tricky(1000, 66);
        v[0] = 0.0;
        let z = Var::from_tensor(&Tensor::from_vec(v, 1000, &Device::Cpu).unwrap().to_dtype(dt).unwrap()).unwrap();
        let _plain = kernels::plain();
        assert!(!kernels::enabled());
        // Every entry point is candle's op, bit for bit.
        assert_eq!(
            bits(&kernels::matmul(&a, &b).unwrap()),
            bits(&a.matmul(&b).unwrap()),
            "{dt:?} matmul"
        );
        let want = a
            .broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&bias)
            .unwrap();
        assert_eq!(
            bits(&kernels::linear(&a, &w, Some(&bias)).unwrap()),
            bits(&want),
            "{dt:?} linear"
        );
        assert_eq!(
            bits(&kernels::cast(&x, dt).unwrap()),
            bits(&x.to_dtype(dt).unwrap()),
            "{dt:?} cast"
        );
        assert_eq!(
            bits(&kernels::gelu(&z).unwrap()),
            bits(&z.gelu_erf().unwrap()),
            "{dt:?} gelu"
        );
        // candle's relu passes the gradient at zero; the plain path keeps the kernel's (and
        // PyTorch's) contract instead: 0 there.
        let g = kernels::relu(&z).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(
            g.get(&z)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()[0],
            0.0
        );
    }
    {
        let z = Var::new(&[0f32, 1.0], &Device::Cpu).unwrap();
        let g = kernels::relu(&z).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(&z).unwrap().to_vec1::<f32>().unwrap(), [0.0, 1.0]);
    }
    // Whole runs with and without the kernels (and the fused optimizer) end close: the only
    // differences are summation order in the products and, in half, which way a value near a
    // tie rounds. SGD keeps them proportional (Adam's first steps move every weight by
    // about lr whatever the gradient's size, so a rounding difference in a near-zero
    // gradient would flip a whole step).
    let sgd = |fused| -> MakeOpt {
        Box::new(move |a: &candle_amp::Amp| {
            let cfg = SgdConfig {
                momentum: 0.9,
                fused,
                ..SgdConfig::new(0.05)
            };
            a.optimizer(Sgd::new(cfg).unwrap()).unwrap()
        })
    };
    for (level, half, tol) in [
        // f32 products go through the same `gemm` crate either way.
        (OptLevel::O0, HalfType::F16, 1e-6),
        // A quarter of a bf16 / f16 ulp at 1 over four steps.
        (OptLevel::O1, HalfType::Bf16, 1e-3),
        (OptLevel::O2, HalfType::F16, 1.25e-4),
        (OptLevel::O2, HalfType::Bf16, 1e-3),
    ] {
        let fast = train(level, half, sgd(true));
        let plain = {
            let _p = kernels::plain();
            train(level, half, sgd(false))
        };
        let mut worst = 0f32;
        for (pa, pb) in fast.iter().zip(&plain) {
            for (x, y) in pa.iter().zip(pb) {
                worst = worst.max((x - y).abs());
            }
        }
        assert!(
            worst <= tol,
            "{level} {half}: kernels and plain candle differ by {worst}"
        );
    }
}

/// Layer norm (or RMS norm) of `x` with `w`, `b`, everything in f64 through candle's own
/// tensor ops and autograd: `(y, dx, dw, db)` for the loss `Σ y * r`.
#[allow(clippy::type_complexity)]
fn norm_f64(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    r: &Tensor,
    center: bool,
) -> (Vec<f64>, Vec<f64>, Option<Vec<f64>>, Option<Vec<f64>>) {
    use candle_core::D;
    let v = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
    let (x, w, b) = (v(x), w.map(v), b.map(v));
    let c = if center {
        x.broadcast_sub(&x.mean_keepdim(D::Minus1).unwrap()).unwrap()
    } else {
        x.as_tensor().clone()
    };
    let var = c.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let mut y = c.broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap()).unwrap();
    if let Some(w) = &w {
        y = y.broadcast_mul(w).unwrap();
    }
    if let Some(b) = &b {
        y = y.broadcast_add(b).unwrap();
    }
    let g = (&y * r.to_dtype(DType::F64).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    (
        flat(&y),
        flat(g.get(&x).unwrap()),
        w.map(|w| flat(g.get(&w).unwrap())),
        b.map(|b| flat(g.get(&b).unwrap())),
    )
}

#[test]
fn layer_and_rms_norm_match_an_f64_reference_with_gradients() {
    each_isa(|isa| {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            // Widths below, at and off the vector width; enough rows to split over threads.
            for (rows, n) in [(3, 1), (5, 7), (4, 33), (700, 64), (9, 300)] {
                for (center, with_w, with_b, pdt) in [
                    (true, true, true, DType::F32),
                    (true, true, true, dt),
                    (true, false, false, dt),
                    (true, false, true, DType::F32),
                    (false, true, false, DType::F32),
                    (false, false, false, dt),
                ] {
                    let what = format!("{isa:?} {dt:?} {rows}x{n} center {center} w {with_w} b {with_b} {pdt:?}");
                    // A transposed (non-contiguous) view with an offset mean, so that
                    // centring matters.
                    let x = (rand_t(&[n, rows], 70 + n as u64, DType::F32) * 3.0).unwrap() + 2.0;
                    let x = x.unwrap().t().unwrap().to_dtype(dt).unwrap();
                    let x = Var::from_tensor(&x).unwrap();
                    let w = with_w.then(|| {
                        Var::from_tensor(&(rand_t(&[n], 71, DType::F32) + 1.0).unwrap().to_dtype(pdt).unwrap()).unwrap()
                    });
                    let b = with_b.then(|| Var::from_tensor(&rand_t(&[n], 72, pdt)).unwrap());
                    let r = rand_t(&[rows, n], 73, DType::F32);
                    let (w_t, b_t) = (w.as_ref().map(|v| v.as_tensor()), b.as_ref().map(|v| v.as_tensor()));
                    let y = if center {
                        kernels::layer_norm(&x, w_t, b_t, 1e-5).unwrap()
                    } else {
                        kernels::rms_norm(&x, w_t, 1e-5).unwrap()
                    };
                    assert_eq!(y.dtype(), dt, "{what}");
                    let g = (y.to_dtype(DType::F32).unwrap() * &r)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let (wy, wdx, wdw, wdb) = norm_f64(&x, w_t, b_t, &r, center);
                    // One rounding to the output type; f32 arithmetic inside.
                    let eps = match dt {
                        DType::BF16 => 2f64.powi(-8),
                        DType::F16 => 2f64.powi(-11),
                        _ => 0.0,
                    };
                    let got = |t: &Tensor| {
                        t.to_dtype(DType::F64)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f64>()
                            .unwrap()
                    };
                    for (i, (p, q)) in got(&y).iter().zip(&wy).enumerate() {
                        assert!((p - q).abs() <= 2e-5 + eps * q.abs(), "{what} y[{i}]: {p} vs {q}");
                    }
                    // Gradients are rounded to their own types; the input's are computed
                    // from rounded inputs, so they get a few ulps of the largest gradient.
                    let scale = |v: &[f64]| v.iter().fold(0f64, |m, x| m.max(x.abs())).max(1.0);
                    // The incoming gradient is rounded to the output's type too (the graph casts
                    // it back to `y`'s type), so every gradient gets the coarser of the two.
                    let ulp = |t: DType| match t {
                        DType::BF16 => 2f64.powi(-7),
                        DType::F16 => 2f64.powi(-10),
                        _ => 1e-5,
                    };
                    let check = |got: Vec<f64>, want: &[f64], t: DType, name: &str| {
                        let e = ulp(t).max(ulp(dt));
                        let s = scale(want);
                        for (i, (p, q)) in got.iter().zip(want).enumerate() {
                            assert!((p - q).abs() <= e * s, "{what} {name}[{i}]: {p} vs {q}");
                        }
                    };
                    check(got(g.get(&x).unwrap()), &wdx, dt, "dx");
                    if let (Some(w), Some(want)) = (&w, &wdw) {
                        let gw = g.get(w).unwrap();
                        assert_eq!(gw.dtype(), pdt, "{what}");
                        check(got(gw), want, pdt, "dw");
                    }
                    if let (Some(b), Some(want)) = (&b, &wdb) {
                        let gb = g.get(b).unwrap();
                        assert_eq!(gb.dtype(), pdt, "{what}");
                        check(got(gb), want, pdt, "db");
                    }
                }
            }
        }
    });
}

#[test]
fn norm_rejects_a_weight_of_the_wrong_length() {
    let x = rand_t(&[4, 8], 80, DType::F32);
    let w = rand_t(&[7], 81, DType::F32);
    let e = kernels::layer_norm(&x, Some(&w), None, 1e-5).unwrap_err().to_string();
    assert!(e.contains("weight") && e.contains("8 values"), "{e}");
}

/// The results of every kernel whose loops are compiled once per tier (GELU, ReLU, the
/// softmax's backward, layer and RMS norm, the bias gradient's column sums, the fused SGD
/// update), named, as bit patterns.
fn per_tier_results() -> Vec<(String, Vec<u32>)> {
    use candle_amp::optim::{GroupHyper, Optimizer, ParamUpdate, Sgd, SgdConfig};
    let mut out = Vec::new();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        // Off the vector widths and over the rayon split (more than two tasks' worth).
        for n in [1000, 70_001] {
            let seed = 90 + n as u64;
            let w = rand_t(&[n], seed + 1, dt);
            let grads = |y: &Tensor| (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            // GELU on finite values of every magnitude (tiny, huge, subnormal, zeros).
            let x = Var::from_tensor(
                &Tensor::from_vec(tricky(n, seed), n, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap(),
            )
            .unwrap();
            let y = kernels::gelu(&x).unwrap();
            out.push((format!("{dt:?} {n} gelu"), bits_f32(&y)));
            out.push((format!("{dt:?} {n} gelu'"), bits_f32(grads(&y).get(&x).unwrap())));
            // ReLU with a NaN and signed zeros too.
            let mut v = tricky(n, seed + 2);
            v[5] = f32::NAN;
            let x = Var::from_tensor(&Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(dt).unwrap()).unwrap();
            let y = kernels::relu(&x).unwrap();
            out.push((format!("{dt:?} {n} relu"), bits_f32(&y)));
            out.push((format!("{dt:?} {n} relu'"), bits_f32(grads(&y).get(&x).unwrap())));
        }
        // The scaled softmax's backward (row sums of a fixed order), causal and not, rows
        // off the lane count, into every output type.
        for (shape, causal) in [(vec![3, 37, 37], true), (vec![70, 100], false)] {
            let x = Var::from_tensor(&(rand_t(&shape, 140, DType::F32) * 4.0).unwrap().to_dtype(dt).unwrap()).unwrap();
            let w = rand_t(&shape, 141, DType::F32);
            for out_dt in [DType::F32, DType::F16, DType::BF16] {
                let p = kernels::scaled_softmax(&x, 0.3, causal, out_dt).unwrap();
                let loss = (p.to_dtype(DType::F32).unwrap() * &w).unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                out.push((
                    format!("{dt:?} {shape:?} softmax' -> {out_dt:?}"),
                    bits_f32(g.get(&x).unwrap()),
                ));
            }
        }
        // Norms: rows narrower than, at and off the lane count, and enough to split.
        for (rows, n) in [(5, 7), (700, 64), (9, 300)] {
            let seed = 100 + n as u64;
            let x = Var::from_tensor(
                &((rand_t(&[rows, n], seed, DType::F32) * 3.0).unwrap() + 2.0)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap(),
            )
            .unwrap();
            let w = Var::from_tensor(&(rand_t(&[n], seed + 1, DType::F32) + 1.0).unwrap()).unwrap();
            let b = Var::from_tensor(&rand_t(&[n], seed + 2, dt)).unwrap();
            let r = rand_t(&[rows, n], seed + 3, DType::F32);
            let cases = [
                ("layer_norm", kernels::layer_norm(&x, Some(&w), Some(&b), 1e-5).unwrap()),
                ("layer_norm_plain", kernels::layer_norm(&x, None, None, 1e-5).unwrap()),
                ("rms_norm", kernels::rms_norm(&x, Some(&w), 1e-5).unwrap()),
            ];
            for (name, y) in cases {
                let what = format!("{dt:?} {rows}x{n} {name}");
                out.push((what.clone(), bits_f32(&y)));
                let g = (y.to_dtype(DType::F32).unwrap() * &r)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                for (p, pname) in [(&x, "dx"), (&w, "dw"), (&b, "db")] {
                    if let Some(gp) = g.get(p) {
                        out.push((format!("{what} {pname}"), bits_f32(gp)));
                    }
                }
            }
        }
        // The bias gradient of `linear` alone (x and w untracked): the column sums of the
        // incoming gradient, which does not depend on the (tier-dependent) product.
        for (m, n) in [(3, 5), (300, 45), (64, 1000)] {
            let x = rand_t(&[m, 20], 110 + m as u64, dt);
            let wt = rand_t(&[n, 20], 111, dt);
            let b = Var::from_tensor(&rand_t(&[n], 112, dt)).unwrap();
            let r = rand_t(&[m, n], 113, DType::F32);
            let y = kernels::linear(&x, &wt, Some(&b)).unwrap();
            let g = (y.to_dtype(DType::F32).unwrap() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            out.push((format!("{dt:?} {m}x{n} linear db"), bits_f32(g.get(&b).unwrap())));
        }
        // The fused SGD update: f32 parameters in place, half ones (O3) through f32 blocks;
        // without momentum, with it (the first step starts the buffer) and Nesterov's.
        let n = 2 * 512 + 37;
        for (momentum, nesterov, weight_decay) in [(0.0, false, 0.0), (0.9, false, 0.01), (0.9, true, 0.01)] {
            let mut opt = Sgd::new(SgdConfig {
                momentum,
                nesterov,
                weight_decay,
                ..SgdConfig::new(0.05)
            })
            .unwrap();
            let var = Var::from_tensor(&rand_t(&[n], 120, dt)).unwrap();
            for s in 0..3 {
                let grad = (rand_t(&[n], 121 + s, DType::F32) * 10.0).unwrap();
                let p = ParamUpdate {
                    name: "p",
                    var: &var,
                    working: (dt != DType::F32).then_some(&var),
                    grad: &grad,
                    hyper: GroupHyper { lr: 0.05, weight_decay },
                    persistent: dt == DType::F32,
                };
                opt.step(&[p]).unwrap();
                let what = format!("{dt:?} sgd momentum {momentum} nesterov {nesterov} step {s}");
                out.push((what, bits_f32(var.as_tensor())));
            }
        }
    }
    out
}

/// Every tier computes what the portable path does, bit for bit: the per-tier loops run the
/// same operations in the same order (no FMA contraction, lane sums of a fixed width).
#[test]
fn every_tier_computes_the_portable_results_bit_for_bit() {
    let mut portable = Vec::new();
    each_isa(|isa| {
        let got = per_tier_results();
        if isa == Isa::Portable {
            portable = got;
            return;
        }
        assert_eq!(got.len(), portable.len(), "{isa:?}");
        for ((what, a), (_, b)) in got.iter().zip(&portable) {
            assert_eq!(a.len(), b.len(), "{isa:?} {what}");
            if let Some(i) = a.iter().zip(b).position(|(p, q)| p != q) {
                let (p, q) = (f32::from_bits(a[i]), f32::from_bits(b[i]));
                panic!("{isa:?} {what}[{i}]: {p:e} against the portable {q:e}");
            }
        }
    });
    assert!(!portable.is_empty());
}

/// bf16 products on AMX and AVX-512 BF16 flush subnormal inputs and results to zero (the
/// instructions do), and `kernels::bf16_products_flush_subnormals` says so; the other tiers
/// keep them, as candle does. Small products (the direct loop) keep them on every tier.
#[test]
fn bf16_products_flush_subnormals_exactly_on_the_bf16_tiers() {
    // a (m x k) times b = diag(d) (k x k): c[i][j] = a[i][j] * d[j], one exact product each.
    let product = |m: usize, k: usize| {
        let mut a = rand_t(&[m, k], 130, DType::F32).to_vec2::<f32>().unwrap();
        let mut d = vec![1f32; k];
        a[0][0] = f32::MIN_POSITIVE / 16.0; // a subnormal input (bf16 holds it exactly)
        a[1][1] = 2f32.powi(-64); // normal, times d[1]: a subnormal result, 2^-128
        d[1] = 2f32.powi(-64);
        let a = Tensor::new(a, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let mut b = vec![0f32; k * k];
        for (j, v) in d.iter().enumerate() {
            b[j * k + j] = *v;
        }
        let b = Tensor::from_vec(b, (k, k), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        (a, b)
    };
    let mut checked = 0;
    each_isa(|isa| {
        let flush = matches!(isa, Isa::Amx | Isa::Avx512Bf16);
        assert_eq!(kernels::bf16_products_flush_subnormals(), flush, "{isa:?}");
        for (m, k) in [(40, 64), (2, 2)] {
            let (a, b) = product(m, k);
            let want = {
                let _p = kernels::plain();
                (a.matmul(&b).unwrap(), a.matmul(&b).unwrap())
            };
            // linear: x w^T with w = b^T (= b, diagonal).
            let got = (kernels::matmul(&a, &b).unwrap(), kernels::linear(&a, &b, None).unwrap());
            for (what, g, w) in [("matmul", &got.0, &want.0), ("linear", &got.1, &want.1)] {
                let (g, w) = (g.to_dtype(DType::F32).unwrap(), w.to_dtype(DType::F32).unwrap());
                let (g, w) = (g.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
                assert_eq!(w[0][0], f32::MIN_POSITIVE / 16.0, "candle keeps a subnormal input");
                assert_eq!(w[1][1], f32::MIN_POSITIVE / 4.0, "candle keeps a subnormal result");
                let large = m * k * k > 4096;
                for (i, j) in [(0, 0), (1, 1)] {
                    let want = if flush && large { 0.0 } else { w[i][j] };
                    assert_eq!(g[i][j].to_bits(), want.to_bits(), "{isa:?} {what} {m}x{k} [{i}][{j}]");
                }
                // Everything else: the same exact products.
                let (mut g, mut w) = (g, w);
                for (i, j) in [(0, 0), (1, 1)] {
                    (g[i][j], w[i][j]) = (0.0, 0.0);
                }
                assert_eq!(g, w, "{isa:?} {what} {m}x{k}");
                checked += 1;
            }
        }
    });
    assert!(checked >= 4);
}
