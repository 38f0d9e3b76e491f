//! The CUDA cross-entropy kernels without a GPU: `src/kernels/cuda/xent.cu`, unmodified,
//! built with g++ against the CPU grid emulator (`tests/cuda_emu/emu.h`) and launched as the
//! library's plan launches it on a GPU, checked against references computed here in f64 with
//! llm.c's rule: every value within `atol + |ref| * eps` of its type plus the f32 arithmetic's
//! own error. Needs g++ (C++20). Under `CANDLE_AMP_TEST_DEVICE=cuda` the last test compares
//! `ops::cross_entropy` on CUDA (the kernels, loaded by NVRTC) with its CPU path.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;

use candle_core::{DType, Tensor, Var};

use cuda_emu::{atol, decode, encode, f32s, values};

#[allow(dead_code)]
#[path = "../src/kernels/cuda/xent_plan.rs"]
mod plan;

/// Runs the harness with `args` (see [`cuda_emu::run`]).
fn run(args: &[String]) {
    cuda_emu::run("xent", args)
}

/// Targets as the kernels read them: little-endian u8, u32 or i64.
fn target_bytes(t: &[i64], dt: DType) -> Vec<u8> {
    match dt {
        DType::U8 => t.iter().map(|v| *v as u8).collect(),
        DType::U32 => t.iter().flat_map(|v| (*v as u32).to_le_bytes()).collect(),
        _ => t.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// The ignored target of each type (candle's gather reads it as "no value").
fn ignored(dt: DType) -> i64 {
    match dt {
        DType::U8 => u8::MAX as i64,
        DType::U32 => u32::MAX as i64,
        _ => i64::MAX,
    }
}

/// Half a unit in the last place of `dt` (its rounding), relative.
fn eps(dt: DType) -> f64 {
    match dt {
        DType::F32 => 6e-8,
        DType::F16 => 4.9e-4,
        _ => 3.91e-3,
    }
}

/// f32's relative error over a row's sum of exponentials: each thread's strided terms, then a
/// block tree, plus the exponentials' own few ulps (generous).
fn f32_row_err(cols: usize, block: usize) -> f64 {
    6e-8 * (16.0 + (cols / block) as f64 + 10.0)
}

/// What the emulator gave for one cross entropy: the loss, each row's log-probability and
/// the logits' gradient (as f64).
struct Got {
    loss: f64,
    logp: Vec<f64>,
    dx: Vec<f64>,
}

/// Forward and backward on the emulator.
fn emulate(x: &[u8], t: &[u8], (rows, cols): (usize, usize), (dt, tdt): (DType, DType), g: f32, dir: &Path) -> Got {
    let p = plan::xent_plan(rows, cols, dt, tdt).expect("a plan");
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    std::fs::write(path("x"), x).unwrap();
    std::fs::write(path("t"), t).unwrap();
    std::fs::write(path("g"), g.to_le_bytes()).unwrap();
    let s = |v: &dyn ToString| v.to_string();
    run(&[
        s(&"fwd"),
        s(&p.forward.kernel),
        s(&p.forward.grid),
        s(&p.forward.block),
        s(&p.mean.grid),
        s(&p.mean.block),
        s(&rows),
        s(&cols),
        s(&((-1.0 / rows as f64) as f32)),
        path("x"),
        path("t"),
        path("logp"),
        path("stats"),
        path("loss"),
    ]);
    run(&[
        s(&"bwd"),
        s(&p.backward.kernel),
        s(&p.backward.grid),
        s(&p.backward.block),
        s(&rows),
        s(&cols),
        s(&((1.0 / rows as f64) as f32)),
        path("x"),
        path("t"),
        path("stats"),
        path("g"),
        path("dx"),
    ]);
    let rd = |n: &str| std::fs::read(path(n)).unwrap();
    Got {
        loss: f32s(&rd("loss"))[0],
        logp: f32s(&rd("logp")),
        dx: decode(&rd("dx"), dt),
    }
}

/// One cross entropy, forward and backward, on the emulator against f64: the worst error over
/// its bound of the loss, the rows' log-probabilities and the gradient, and the worst |error|s.
fn case(rows: usize, cols: usize, dt: DType, tdt: DType, lo: f64, seed: u64) -> [(f64, f64); 3] {
    let what = format!("{rows}x{cols} {dt:?} targets {tdt:?}");
    let block = plan::xent_plan(rows, cols, dt, tdt).unwrap().forward.block as usize;
    let (xb, x) = encode(&values(rows * cols, seed, lo), dt);
    let classes = if tdt == DType::U8 { cols.min(255) } else { cols };
    let mut t: Vec<i64> = values(rows, seed + 1, 1.0)
        .iter()
        .map(|v| ((v + 1.0) / 2.0 * classes as f64) as i64 % classes as i64)
        .collect();
    // One ignored row where there are a few.
    if rows > 2 {
        t[1] = ignored(tdt);
    }
    let g = 0.75f32;
    let dir = cuda_emu::scratch("xent", &format!("{rows}x{cols}-{dt:?}-{tdt:?}"));
    let got = emulate(&xb, &target_bytes(&t, tdt), (rows, cols), (dt, tdt), g, &dir);
    let rerr = f32_row_err(cols, block);
    let gn = g as f64 / rows as f64;
    let mut worst = [(0f64, 0f64); 3];
    let mut sum = 0.0;
    for r in 0..rows {
        let xr = &x[r * cols..(r + 1) * cols];
        let m = xr.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = xr.iter().map(|v| (v - m).exp()).sum();
        let lse = m + s.ln();
        let ignore = t[r] == ignored(tdt);
        let lp = if ignore { 0.0 } else { xr[t[r] as usize] - lse };
        sum += lp;
        // x_t - m and the log of a sum good to `rerr`, each rounded in f32.
        let bound = rerr + 6e-8 * (2.0 * lp.abs() + m.abs() + s.ln().abs()) + 1e-30;
        let err = (got.logp[r] - lp).abs();
        assert!(
            err <= bound,
            "{what}: logp[{r}] {} vs {lp} (bound {bound})",
            got.logp[r]
        );
        worst[0] = (worst[0].0.max(err), worst[0].1.max(err / bound));
        for (j, &v) in xr.iter().enumerate() {
            let p = (v - m).exp() / s;
            let d = if ignore {
                0.0
            } else {
                (p - f64::from(j as i64 == t[r])) * gn
            };
            let got_d = got.dx[r * cols + j];
            // The f32 softmax good to `rerr` (plus the exponential's argument rounded, 6e-8 *
            // |v - m|), the onehot subtraction, g / N and the product each rounded once in
            // f32, then the rounding to the logits' type.
            let f32_err = (p * (rerr + 6e-8 * (v - m).abs()) + 6e-8) * gn + 4.0 * 6e-8 * d.abs();
            let bound = atol(dt) + d.abs() * eps(dt) + f32_err * (1.0 + eps(dt)) + 1e-30;
            let err = (got_d - d).abs();
            assert!(err <= bound, "{what}: dx[{r}, {j}] {got_d} vs {d} (bound {bound})");
            worst[2] = (worst[2].0.max(err), worst[2].1.max(err / bound));
        }
    }
    let loss = -sum / rows as f64;
    // The rows' errors averaged, the sum's own f32 rounding over rows and the scale's.
    let bound = worst[0].0 + 6e-8 * (rows as f64 / 1024.0 + 12.0) * (sum.abs() / rows as f64 + loss.abs()) + 1e-30;
    let err = (got.loss - loss).abs();
    assert!(err <= bound, "{what}: loss {} vs {loss} (bound {bound})", got.loss);
    worst[1] = (err, err / bound);
    worst
}

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const TARGETS: [DType; 3] = [DType::U32, DType::I64, DType::U8];

/// Classes 1, 7, 1000 and GPT-2's 50257, rows from 1 to past the mean kernel's 1024 threads,
/// each logit type (f32 only on the two largest) with each target type; logits spread over [-4, 4) and, in f32, over
/// [-60, 60) (exponentials far below 1: the maximum's subtraction matters).
#[test]
fn xent_matches_f64_on_the_emulator() {
    let mut seed = 11;
    for (rows, cols) in [(5, 1), (1, 7), (1100, 7), (37, 1000), (3, 50257)] {
        for (k, dt) in TYPES.into_iter().enumerate() {
            // The emulator starts a thread per CUDA thread: the many-row and the wide shapes
            // (the mean kernel past 1024 rows, GPT-2's vocabulary) run in f32 only; the half
            // types' kernels, the same source instantiated per type, run on the others.
            if (rows >= 1000 || cols >= 50000) && dt != DType::F32 {
                continue;
            }
            let tdt = TARGETS[(k + rows) % 3];
            for lo in if dt == DType::F32 { vec![4.0, 60.0] } else { vec![4.0] } {
                seed += 7;
                let w = case(rows, cols, dt, tdt, lo, seed);
                eprintln!(
                    "{rows}x{cols} {dt:?} {tdt:?} lo {lo}: max |err| logp {:.2e} loss {:.2e} dx {:.2e} (of bound {:.2} {:.2} {:.2})",
                    w[0].0, w[1].0, w[2].0, w[0].1, w[1].1, w[2].1
                );
            }
        }
    }
}

/// A target outside the classes (not the ignored value) gives a NaN loss and a NaN gradient
/// on its row only; the others' gradients are untouched.
#[test]
fn out_of_range_targets_give_nan() {
    let (rows, cols) = (4, 9);
    for tdt in TARGETS {
        let (xb, _) = encode(&values(rows * cols, 5, 3.0), DType::F32);
        let mut t = vec![0i64, 3, 8, 2];
        t[2] = if tdt == DType::I64 { -1 } else { cols as i64 };
        let dir = cuda_emu::scratch("xent", &format!("oor-{tdt:?}"));
        let got = emulate(&xb, &target_bytes(&t, tdt), (rows, cols), (DType::F32, tdt), 1.0, &dir);
        assert!(got.loss.is_nan(), "{tdt:?}: loss {}", got.loss);
        for r in 0..rows {
            let row = &got.dx[r * cols..(r + 1) * cols];
            assert_eq!(row.iter().all(|v| v.is_nan()), r == 2, "{tdt:?} row {r}: {row:?}");
            assert!(r == 2 || row.iter().all(|v| v.is_finite()));
        }
    }
}

/// The plan: one block per row sized to the row, one block for the mean, none where no kernel
/// applies (the composed ops run).
#[test]
fn xent_plan_covers_the_types_and_refuses_the_rest() {
    let p = plan::xent_plan(7, 50257, DType::BF16, DType::U32).unwrap();
    assert_eq!(
        (p.forward.kernel.as_str(), p.forward.grid, p.forward.block),
        ("amp_xent_fwd_bf16_u32", 7, 1024)
    );
    assert_eq!(
        (p.backward.kernel.as_str(), p.mean.grid, p.mean.block),
        ("amp_xent_bwd_bf16_u32", 1, 1024)
    );
    assert_eq!(plan::xent_plan(3, 1, DType::F32, DType::I64).unwrap().forward.block, 32);
    assert!(plan::xent_plan(0, 7, DType::F32, DType::U32).is_none());
    assert!(plan::xent_plan(7, 0, DType::F32, DType::U32).is_none());
    assert!(plan::xent_plan(7, 5, DType::F64, DType::U32).is_none());
    assert!(plan::xent_plan(7, 5, DType::F32, DType::F32).is_none());
    assert!(plan::xent_plan(1 << 16, 1 << 16, DType::F32, DType::U32).is_none());
}

/// `ops::cross_entropy` on CUDA (the kernels) against the CPU path (runs only with
/// `CANDLE_AMP_TEST_DEVICE=cuda`): the loss and the logits' gradient, in the logits' type,
/// with Transformer Engine's tolerances.
#[test]
fn cuda_xent_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_xent_loaded(&dev),
        "the CUDA cross-entropy kernels did not load (see the log's warning)"
    );
    let cpu = candle_core::Device::Cpu;
    for shape in [vec![5, 1], vec![2, 3, 7], vec![37, 1000], vec![3, 50257], vec![1100, 7]] {
        let cols = *shape.last().unwrap();
        let rows: usize = shape[..shape.len() - 1].iter().product();
        let x32: Vec<f32> = values(rows * cols, 3, 4.0).iter().map(|v| *v as f32).collect();
        let mut t: Vec<u32> = values(rows, 4, 1.0)
            .iter()
            .map(|v| ((v + 1.0) / 2.0 * cols as f64) as u32 % cols as u32)
            .collect();
        if rows > 2 {
            t[1] = u32::MAX;
        }
        for dt in TYPES {
            let run = |d: &candle_core::Device| {
                let x = Var::from_tensor(
                    &Tensor::from_vec(x32.clone(), &shape[..], d)
                        .unwrap()
                        .to_dtype(dt)
                        .unwrap(),
                )
                .unwrap();
                let tt = Tensor::from_vec(t.clone(), &shape[..shape.len() - 1], d).unwrap();
                let loss = candle_amp::ops::cross_entropy(x.as_tensor(), &tt).unwrap();
                assert_eq!((loss.dtype(), loss.dims()), (DType::F32, &[][..]));
                let grads = (&loss * 0.75).unwrap().backward().unwrap();
                let gx = grads.get(x.as_tensor()).unwrap();
                assert_eq!(gx.dtype(), dt);
                let f = |t: &Tensor| -> Vec<f32> {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_device(&cpu)
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                };
                (loss.to_device(&cpu).unwrap().to_scalar::<f32>().unwrap(), f(gx))
            };
            let (c, g) = (run(&cpu), run(&dev));
            let what = format!("{shape:?} {dt:?}");
            assert!(
                (c.0 - g.0).abs() <= 1e-5 * c.0.abs().max(1.0),
                "{what}: loss {} vs {}",
                g.0,
                c.0
            );
            let rt = common::te_rtol(dt).max(1e-5);
            let m = c.1.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in c.1.iter().zip(&g.1).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-7 + 2.0 * rt * m.max(a.abs()),
                    "{what}: dx[{i}] {b} vs {a}"
                );
            }
        }
    }
}
