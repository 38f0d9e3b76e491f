//! The CUDA kernels without a GPU: `src/kernels/cuda/softmax.cu`, unmodified, built with g++
//! against the CPU grid emulator (`tests/cuda_emu/emu.h`: one thread per CUDA thread, real
//! barriers and warp shuffles) and launched as the library's plan launches it on a GPU, checked
//! against references computed here in f64 with llm.c's rule: every value within
//! `atol + |ref| * eps`. Needs g++ (C++20). Under `CANDLE_AMP_TEST_DEVICE=cuda` the last test
//! compares the library's CUDA path (the kernels, loaded by NVRTC) with its CPU path.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;
use std::process::Command;

use candle_amp::testing::cuda_softmax_launch;
use candle_core::{DType, Tensor, Var};

use cuda_emu::{atol, decode, encode, eps, values};

/// One forward case: `rows` rows of `cols`, `q_len` queries per matrix when causal, padding
/// lengths per `rows_per_len` rows.
struct Fwd<'a> {
    rows: usize,
    cols: usize,
    q_len: usize,
    causal: bool,
    lens: Option<(&'a [i32], usize)>,
    scale: f32,
}

fn live(c: &Fwd, row: usize) -> usize {
    let mut l = c.cols as i64;
    if c.causal {
        l = l.min((row % c.q_len) as i64 + 1 + c.cols as i64 - c.q_len as i64);
    }
    if let Some((lens, per)) = c.lens {
        l = l.min(lens[row / per] as i64);
    }
    l.max(0) as usize
}

/// Runs the forward on the emulator; returns (max |error|, max error / bound).
fn forward(c: &Fwd, x: &[f64], ti: DType, to: DType, dir: &Path) -> (f64, f64) {
    let (kernel, grid, block) = cuda_softmax_launch(false, c.rows, c.cols, ti, to).expect("a kernel");
    let (xb, xh) = encode(x, ti);
    let (xp, yp, lp) = (dir.join("x"), dir.join("y"), dir.join("lens"));
    std::fs::write(&xp, xb).unwrap();
    let lens_arg = match c.lens {
        Some((l, _)) => {
            std::fs::write(&lp, l.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
            lp.to_str().unwrap().to_string()
        }
        None => "-".into(),
    };
    let per = c.lens.map_or(1, |(_, p)| p);
    let st = Command::new(cuda_emu::harness("softmax"))
        .args(["fwd", &kernel, &grid.to_string(), &block.to_string()])
        .args([c.rows, c.cols, c.q_len].map(|v| v.to_string()))
        .args([c.scale.to_string(), (c.causal as i32).to_string(), per.to_string()])
        .args([xp.to_str().unwrap(), &lens_arg, yp.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success(), "{kernel}: harness failed");
    let y = decode(&std::fs::read(&yp).unwrap(), to);
    let (mut worst, mut ratio) = (0f64, 0f64);
    for r in 0..c.rows {
        let n = live(c, r);
        let row = &xh[r * c.cols..(r + 1) * c.cols];
        let v: Vec<f64> = row[..n].iter().map(|x| (*x as f32 * c.scale) as f64).collect();
        let m = v.iter().fold(f64::NEG_INFINITY, |a, b| a.max(*b));
        let s: f64 = v.iter().map(|v| (v - m).exp()).sum();
        for j in 0..c.cols {
            let got = y[r * c.cols + j];
            let what = format!("{kernel} {}x{} causal {} row {r} col {j}", c.rows, c.cols, c.causal);
            if j >= n {
                assert!(got == 0.0, "{what}: masked value {got}");
                continue;
            }
            let want = (v[j] - m).exp() / s;
            if want.is_nan() {
                assert!(got.is_nan(), "{what}: {got}, expected NaN");
                continue;
            }
            if !v[j].is_finite() {
                // A -inf score next to finite ones: exactly 0.
                assert!(got == want, "{what}: {got} vs {want}");
                continue;
            }
            // f32 arithmetic: the scaled score and the maximum each rounded, exp's error.
            let bound = atol(to) + want.abs() * (eps(to) * 1.01 + 1e-6 * (4.0 + v[j].abs() + m.abs()));
            let err = (got - want).abs();
            assert!(err <= bound, "{what}: {got} vs {want} (error {err:e} > {bound:e})");
            worst = worst.max(err);
            ratio = ratio.max(err / bound);
        }
    }
    (worst, ratio)
}

/// Runs the backward on the emulator over `y` (a softmax's rows, shaped as `c`) and `dy`.
fn backward(c: &Fwd, y: &[f64], dy: &[f64], ti: DType, to: DType, dir: &Path) -> (f64, f64) {
    let (rows, cols, scale) = (c.rows, c.cols, c.scale);
    let (kernel, grid, block) = cuda_softmax_launch(true, rows, cols, ti, to).expect("a kernel");
    let ((yb, yh), (db, dh)) = (encode(y, ti), encode(dy, ti));
    let (yp, dp, xp) = (dir.join("y"), dir.join("dy"), dir.join("dx"));
    std::fs::write(&yp, yb).unwrap();
    std::fs::write(&dp, db).unwrap();
    let st = Command::new(cuda_emu::harness("softmax"))
        .args(["bwd", &kernel, &grid.to_string(), &block.to_string()])
        .args([rows.to_string(), cols.to_string(), scale.to_string()])
        .args([yp.to_str().unwrap(), dp.to_str().unwrap(), xp.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success(), "{kernel}: harness failed");
    let dx = decode(&std::fs::read(&xp).unwrap(), to);
    let (mut worst, mut ratio) = (0f64, 0f64);
    for r in 0..rows {
        let (yr, dr) = (&yh[r * cols..(r + 1) * cols], &dh[r * cols..(r + 1) * cols]);
        let dot: f64 = yr.iter().zip(dr).map(|(a, b)| a * b).sum();
        let mag: f64 = yr.iter().zip(dr).map(|(a, b)| (a * b).abs()).sum();
        for j in 0..cols {
            let want = scale as f64 * yr[j] * (dr[j] - dot);
            let got = dx[r * cols + j];
            // The output's rounding, and f32's in the row's dot product (a sum of `cols` terms).
            let f32_err = scale as f64 * yr[j].abs() * (dr[j].abs() + mag) * 1e-6 * (1.0 + (cols as f64).sqrt() / 8.0);
            let bound = atol(to) + want.abs() * eps(to) * 1.01 + f32_err;
            let err = (got - want).abs();
            assert!(
                err <= bound,
                "{kernel} {rows}x{cols} row {r} col {j}: {got} vs {want} (error {err:e} > {bound:e})"
            );
            worst = worst.max(err);
            ratio = ratio.max(err / bound);
        }
    }
    (worst, ratio)
}

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// A softmax's output for `x` rows (f64), masked as `c` says: the backward's input.
fn probs(c: &Fwd, x: &[f64]) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for r in 0..c.rows {
        let n = live(c, r);
        let v = &x[r * c.cols..r * c.cols + n];
        let m = v.iter().fold(f64::NEG_INFINITY, |a, b| a.max(*b));
        let s: f64 = v.iter().map(|v| (v - m).exp()).sum();
        for j in 0..n {
            y[r * c.cols + j] = (v[j] - m).exp() / s;
        }
    }
    y
}

#[test]
fn softmax_forward_and_backward_on_the_emulator() {
    let dir = cuda_emu::scratch("softmax", "softmax");
    let lens: [i32; 2] = [17, 0];
    #[rustfmt::skip]
    let cases = [
        // Rows not a multiple of the block's four, rows of one value, short rows.
        Fwd { rows: 7, cols: 5, q_len: 7, causal: false, lens: None, scale: 0.37 },
        Fwd { rows: 6, cols: 1, q_len: 1, causal: true, lens: None, scale: 1.0 },
        Fwd { rows: 2 * 33, cols: 33, q_len: 33, causal: true, lens: None, scale: 0.125 },
        // Padding by length (a fully padded batch entry: all zero) with and without causal.
        Fwd { rows: 2 * 3 * 5, cols: 40, q_len: 5, causal: true, lens: Some((&lens, 15)), scale: 0.5 },
        Fwd { rows: 2 * 3 * 5, cols: 40, q_len: 5, causal: false, lens: Some((&lens, 15)), scale: 0.5 },
        // The sequence lengths of a GPT-2 layer, and the one-block-per-row kernels past 1024.
        Fwd { rows: 9, cols: 1000, q_len: 9, causal: false, lens: None, scale: 0.125 },
        Fwd { rows: 64, cols: 1024, q_len: 64, causal: true, lens: None, scale: 0.125 },
        Fwd { rows: 5, cols: 1025, q_len: 5, causal: true, lens: None, scale: 0.125 },
        Fwd { rows: 3, cols: 9000, q_len: 3, causal: false, lens: None, scale: 0.3 },
    ];
    for (k, c) in cases.iter().enumerate() {
        let x = values(c.rows * c.cols, k as u64, 8.0);
        let big = c.rows * c.cols > 20_000;
        for ti in TYPES {
            for to in TYPES {
                // Every type pair on the small shapes; on the large ones the pairs the library uses.
                if big && !(ti == to || to == DType::F32) {
                    continue;
                }
                let (e, r) = forward(c, &x, ti, to, &dir);
                let y = probs(
                    c,
                    &encode(&x, ti)
                        .1
                        .iter()
                        .map(|v| (*v as f32 * c.scale) as f64)
                        .collect::<Vec<_>>(),
                );
                let dy = values(c.rows * c.cols, 100 + k as u64, 2.0);
                let (be, br) = backward(c, &y, &dy, to, ti, &dir);
                println!(
                    "{}x{} causal {} lens {} {ti:?}->{to:?}: forward max error {e:.2e} ({:.0}% of bound), backward {be:.2e} ({:.0}%)",
                    c.rows,
                    c.cols,
                    c.causal,
                    c.lens.is_some(),
                    100.0 * r,
                    100.0 * br
                );
            }
        }
    }
}

#[test]
fn non_finite_scores_on_the_emulator() {
    let dir = cuda_emu::scratch("softmax", "nonfinite");
    // Per row of 40 (warp kernel) and 1500 (block kernel): a NaN, a +inf, a -inf among finite
    // values (which adds nothing), every live value -inf (NaN row, as the CPU's), a -inf first.
    for cols in [40usize, 1500] {
        let rows = 5;
        let mut x = values(rows * cols, 7, 4.0);
        x[3] = f64::NAN;
        x[cols + 5] = f64::INFINITY;
        x[2 * cols + 1] = f64::NEG_INFINITY;
        x[3 * cols..4 * cols].fill(f64::NEG_INFINITY);
        x[4 * cols] = f64::NEG_INFINITY;
        let c = Fwd {
            rows,
            cols,
            q_len: rows,
            causal: false,
            lens: None,
            scale: 1.0,
        };
        for t in TYPES {
            forward(&c, &x, t, DType::F32, &dir);
        }
    }
}

/// The library's CUDA path against its CPU path (runs only with `CANDLE_AMP_TEST_DEVICE=cuda`):
/// `kernels::scaled_softmax` forward and input gradient, and `ops::softmax` over the last
/// dimension, with Transformer Engine's tolerances.
#[test]
fn cuda_softmax_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_softmax_loaded(&dev),
        "the CUDA softmax kernels did not load (see the log's warning)"
    );
    let cpu = candle_core::Device::Cpu;
    for (shape, causal) in [
        (vec![2, 3, 5, 5], true),
        (vec![7, 33], false),
        (vec![1, 2, 1024, 1024], true),
        (vec![3, 1, 1], true),
        (vec![2, 1500], false),
    ] {
        let n: usize = shape.iter().product();
        let x32: Vec<f32> = values(n, 3, 8.0).iter().map(|v| *v as f32).collect();
        let w32: Vec<f32> = values(n, 4, 1.0).iter().map(|v| *v as f32).collect();
        for ti in TYPES {
            for to in TYPES {
                let run = |d: &candle_core::Device| {
                    let x = Tensor::from_vec(x32.clone(), &shape[..], d)
                        .unwrap()
                        .to_dtype(ti)
                        .unwrap();
                    let x = Var::from_tensor(&x).unwrap();
                    let w = Tensor::from_vec(w32.clone(), &shape[..], d).unwrap();
                    let p = candle_amp::kernels::scaled_softmax(x.as_tensor(), 0.125, causal, to).unwrap();
                    let loss = (p.to_dtype(DType::F32).unwrap() * &w).unwrap().sum_all().unwrap();
                    let g = loss.backward().unwrap().get(x.as_tensor()).unwrap().clone();
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
                    (f(&p), f(&g))
                };
                let ((pc, gc), (pg, gg)) = (run(&cpu), run(&dev));
                let what = format!("{shape:?} causal {causal} {ti:?}->{to:?}");
                let tol = |dt: DType, want: f32, got: f32| {
                    (got - want).abs() <= 1e-6 + 2.0 * common::te_rtol(dt) * want.abs()
                };
                for (a, b) in pc.iter().zip(&pg) {
                    assert!(tol(to, *a, *b), "{what}: probabilities {b} vs {a}");
                }
                let gmax = gc.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in gc.iter().zip(&gg) {
                    // The gradient's cancellation (dy - rowsum) scales with the row's largest term.
                    let close =
                        (b - a).abs() <= 1e-6 + 2.0 * common::te_rtol(ti).max(common::te_rtol(to)) * gmax.max(a.abs());
                    assert!(close, "{what}: gradient {b} vs {a}");
                }
            }
        }
        let x = Tensor::from_vec(x32.clone(), &shape[..], &cpu).unwrap();
        let last = shape.len() - 1;
        let pc = candle_amp::ops::softmax(&x, last)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let pg = candle_amp::ops::softmax(&x.to_device(&dev).unwrap(), last).unwrap();
        let pg = pg
            .flatten_all()
            .unwrap()
            .to_device(&cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (a, b) in pc.iter().zip(&pg) {
            assert!(
                (a - b).abs() <= 1e-6 + 2.6e-6 * a.abs(),
                "ops::softmax {shape:?}: {b} vs {a}"
            );
        }
    }
}
