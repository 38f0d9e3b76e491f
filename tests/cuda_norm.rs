//! The CUDA LayerNorm and RMSNorm kernels without a GPU: `src/kernels/cuda/norm.cu`,
//! unmodified, built with g++ against the CPU grid emulator (`tests/cuda_emu/emu.h`) and
//! launched as the library's plan launches it on a GPU, checked against references computed
//! here in f64 with llm.c's rule: every value within `atol + |ref| * eps` plus the f32
//! arithmetic's own error. Needs g++ (C++20). Under `CANDLE_AMP_TEST_DEVICE=cuda` the last test
//! compares the library's CUDA path (the kernels, loaded by NVRTC) with its CPU path.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;

use candle_core::{DType, Tensor, Var};

use cuda_emu::{atol, decode, encode, eps, f32s, values};

#[allow(dead_code)]
#[path = "../src/kernels/cuda/norm_plan.rs"]
mod plan;

/// Runs the harness with `args` (see [`cuda_emu::run`]).
fn run(args: &[String]) {
    cuda_emu::run("norm", args)
}

/// f32's relative error over a sum of `n` terms split across a warp's lanes (generous).
fn f32_sum_err(n: usize) -> f64 {
    6e-8 * (8.0 + n as f64 / 32.0 + 5.0)
}

fn f32_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect()
}

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const EPS: f64 = 1e-5;

/// Max |error| and max error / bound of each checked output.
#[derive(Default, Debug)]
struct Worst {
    y: (f64, f64),
    dx: (f64, f64),
    dw: (f64, f64),
    db: (f64, f64),
}

fn note(w: &mut (f64, f64), err: f64, bound: f64) {
    w.0 = w.0.max(err);
    w.1 = w.1.max(err / bound);
}

/// One norm, forward and backward, on the emulator against f64.
fn case(rows: usize, cols: usize, center: bool, dt: DType, seed: u64, dir: &Path) -> Worst {
    let p = plan::norm_plan(rows, cols, dt).expect("a plan");
    let what = format!("{rows}x{cols} center {center} {dt:?}");
    // An offset, so that the mean's cancellation is exercised.
    let x: Vec<f64> = values(rows * cols, seed, 2.0).iter().map(|v| v + 1.5).collect();
    let w: Vec<f64> = values(cols, seed + 1, 1.0)
        .iter()
        .map(|v| (1.0 + v) as f32 as f64)
        .collect();
    let b: Vec<f64> = if center {
        values(cols, seed + 2, 0.5).iter().map(|v| *v as f32 as f64).collect()
    } else {
        vec![0.0; cols]
    };
    let dy = values(rows * cols, seed + 3, 1.0);
    let ((xb, xh), (dyb, dyh)) = (encode(&x, dt), encode(&dy, dt));
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    for (n, v) in [("x", &xb), ("dy", &dyb)] {
        std::fs::write(path(n), v).unwrap();
    }
    std::fs::write(path("w"), f32_bytes(&w)).unwrap();
    std::fs::write(path("b"), f32_bytes(&b)).unwrap();
    let s = |v: &dyn ToString| v.to_string();
    run(&[
        s(&"fwd"),
        s(&p.forward.kernel),
        s(&p.forward.grid),
        s(&p.forward.block),
        s(&rows),
        s(&cols),
        s(&(EPS as f32)),
        s(&(center as i32)),
        path("x"),
        path("w"),
        path("b"),
        path("y"),
        path("mean"),
        path("rstd"),
    ]);
    run(&[
        s(&"dx"),
        s(&p.dx.kernel),
        s(&p.dx.grid),
        s(&p.dx.block),
        s(&rows),
        s(&cols),
        s(&(center as i32)),
        path("x"),
        path("dy"),
        path("w"),
        path("mean"),
        path("rstd"),
        path("dx"),
    ]);
    run(&[
        s(&"wb"),
        s(&p.wb_part.kernel),
        s(&p.wb_part.grid),
        s(&p.wb_part.block),
        s(&p.wb_sum.grid),
        s(&p.wb_sum.block),
        s(&rows),
        s(&cols),
        s(&p.rows_per_chunk),
        s(&p.chunks),
        s(&p.col_tiles),
        path("x"),
        path("dy"),
        path("mean"),
        path("rstd"),
        path("wb"),
    ]);
    let y = decode(&std::fs::read(path("y")).unwrap(), dt);
    let dx = decode(&std::fs::read(path("dx")).unwrap(), dt);
    let (mean_k, rstd_k) = (
        f32s(&std::fs::read(path("mean")).unwrap()),
        f32s(&std::fs::read(path("rstd")).unwrap()),
    );
    let wb = f32s(&std::fs::read(path("wb")).unwrap());
    let mut worst = Worst::default();
    let nf = cols as f64;
    let sum_err = f32_sum_err(cols);
    let (mut dw_ref, mut db_ref, mut dw_mag, mut db_mag) =
        (vec![0f64; cols], vec![0f64; cols], vec![0f64; cols], vec![0f64; cols]);
    for r in 0..rows {
        let xr = &xh[r * cols..(r + 1) * cols];
        let dr = &dyh[r * cols..(r + 1) * cols];
        let mean = if center { xr.iter().sum::<f64>() / nf } else { 0.0 };
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / nf;
        let rstd = 1.0 / (var + EPS).sqrt();
        // The saved statistics: f32 sums of `cols` terms.
        let mabs = xr.iter().map(|v| v.abs()).sum::<f64>() / nf;
        assert!(
            (mean_k[r] - mean).abs() <= 1e-30 + mabs * sum_err,
            "{what} row {r}: mean {} vs {mean}",
            mean_k[r]
        );
        // rstd: the variance's sum, the mean's error squared into it, sqrt and divide.
        let rstd_tol = rstd * (sum_err + 2.0 * mabs * sum_err * rstd + 4.0 * 6e-8);
        assert!(
            (rstd_k[r] - rstd).abs() <= rstd_tol,
            "{what} row {r}: rstd {} vs {rstd}",
            rstd_k[r]
        );
        // Each x̂ carries the statistics' error: |x - mean| * δrstd + rstd * δmean.
        let h_err = |v: f64| (v - mean).abs() * rstd_tol + rstd * mabs * sum_err + (v - mean).abs() * rstd * 2e-7;
        let h: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
        let g: Vec<f64> = dr.iter().zip(&w).map(|(d, w)| d * w).collect();
        let mg = if center { g.iter().sum::<f64>() / nf } else { 0.0 };
        let mgh = g.iter().zip(&h).map(|(g, h)| g * h).sum::<f64>() / nf;
        let (ag, agh) = (
            g.iter().map(|v| v.abs()).sum::<f64>() / nf,
            g.iter().zip(&h).map(|(g, h)| (g * h).abs()).sum::<f64>() / nf,
        );
        for j in 0..cols {
            let want = h[j] * w[j] + b[j];
            let got = y[r * cols + j];
            let f32_err = h_err(xr[j]) * w[j].abs() + (h[j] * w[j]).abs() * 2e-7 + b[j].abs() * 6e-8;
            let bound = atol(dt) + want.abs() * eps(dt) * 1.01 + f32_err * 1.01;
            let err = (got - want).abs();
            assert!(
                err <= bound,
                "{what} y[{r}][{j}]: {got} vs {want} (error {err:e} > {bound:e})"
            );
            note(&mut worst.y, err, bound);

            let want = rstd * (g[j] - mg - h[j] * mgh);
            let got = dx[r * cols + j];
            let f32_err = rstd
                * (g[j].abs() * 2e-7
                    + ag * sum_err
                    + h[j].abs() * agh * sum_err
                    + h_err(xr[j]) * mgh.abs()
                    + h[j].abs() * ag * rstd_tol / rstd
                    + (g[j] - mg - h[j] * mgh).abs() * (rstd_tol / rstd + 2e-7))
                + (h[j] * mgh).abs() * 2e-7;
            let bound = atol(dt) + want.abs() * eps(dt) * 1.01 + f32_err * 1.5;
            let err = (got - want).abs();
            assert!(
                err <= bound,
                "{what} dx[{r}][{j}]: {got} vs {want} (error {err:e} > {bound:e})"
            );
            note(&mut worst.dx, err, bound);

            dw_ref[j] += dr[j] * h[j];
            db_ref[j] += dr[j];
            dw_mag[j] += (dr[j] * h[j]).abs() + dr[j].abs() * h_err(xr[j]);
            db_mag[j] += dr[j].abs();
        }
    }
    // Sums in row order within a chunk, then chunks in order: at most rows_per_chunk + chunks
    // roundings, each within f32's half ulp of the running total.
    let sum_rows = 6e-8 * (p.rows_per_chunk + p.chunks + 2) as f64;
    for j in 0..cols {
        let (got, want) = (wb[j], dw_ref[j]);
        let bound = 1e-30 + dw_mag[j] * (sum_rows + 4e-7);
        let err = (got - want).abs();
        assert!(
            err <= bound,
            "{what} dw[{j}]: {got} vs {want} (error {err:e} > {bound:e})"
        );
        note(&mut worst.dw, err, bound);
        let (got, want) = (wb[cols + j], db_ref[j]);
        let bound = 1e-30 + db_mag[j] * sum_rows;
        let err = (got - want).abs();
        assert!(
            err <= bound,
            "{what} db[{j}]: {got} vs {want} (error {err:e} > {bound:e})"
        );
        note(&mut worst.db, err, bound);
    }
    worst
}

#[test]
fn norm_forward_and_backward_on_the_emulator() {
    let dir = cuda_emu::scratch("norm", "norm");
    // Rows not a multiple of the block's four; rows of one value; GPT-2's width and others;
    // enough rows for several chunks of the parameter sums (and several column tiles).
    let shapes = [(7, 1), (6, 5), (70, 33), (9, 768), (5, 1000), (3, 4096), (130, 300)];
    for (k, &(rows, cols)) in shapes.iter().enumerate() {
        for center in [true, false] {
            for dt in TYPES {
                let w = case(rows, cols, center, dt, 10 * k as u64, &dir);
                let pct = |v: (f64, f64)| format!("{:.2e} ({:.0}% of bound)", v.0, 100.0 * v.1);
                println!(
                    "{rows}x{cols} {} {dt:?}: y {}, dx {}, dw {}, db {}",
                    if center { "layer" } else { "rms" },
                    pct(w.y),
                    pct(w.dx),
                    pct(w.dw),
                    pct(w.db)
                );
            }
        }
    }
}

#[test]
fn norm_plan_covers_every_row_and_column() {
    for (rows, cols) in [(1, 1), (7, 1), (5, 1000), (3, 4096), (100_000, 768), (33, 257)] {
        let p = plan::norm_plan(rows, cols, DType::BF16).unwrap();
        assert!(p.forward.grid as usize * p.forward.block as usize / 32 >= rows);
        assert_eq!(
            p.forward,
            plan::NormLaunch {
                kernel: "amp_norm_fwd_bf16".into(),
                ..p.forward.clone()
            }
        );
        assert!(p.rows_per_chunk * p.chunks >= rows && p.rows_per_chunk * (p.chunks - 1) < rows);
        assert!(p.col_tiles * p.wb_part.block as usize >= cols);
        assert_eq!(p.wb_part.grid as usize, p.chunks * p.col_tiles);
        assert!(p.wb_sum.grid as usize * p.wb_sum.block as usize >= 2 * cols);
    }
    assert!(plan::norm_plan(0, 5, DType::F32).is_none());
    assert!(plan::norm_plan(5, 0, DType::F32).is_none());
    assert!(plan::norm_plan(5, 5, DType::F64).is_none());
}

/// The library's CUDA path against its CPU path (runs only with `CANDLE_AMP_TEST_DEVICE=cuda`):
/// `kernels::layer_norm` and `kernels::rms_norm`, forward and the gradients of x, w and b,
/// with Transformer Engine's tolerances.
#[test]
fn cuda_norm_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_norm_loaded(&dev),
        "the CUDA norm kernels did not load (see the log's warning)"
    );
    let cpu = candle_core::Device::Cpu;
    for shape in [
        vec![7, 1],
        vec![2, 3, 768],
        vec![5, 1000],
        vec![3, 4096],
        vec![130, 300],
    ] {
        let cols = *shape.last().unwrap();
        let n: usize = shape.iter().product();
        let x32: Vec<f32> = values(n, 3, 2.0).iter().map(|v| (*v + 1.5) as f32).collect();
        let c32: Vec<f32> = values(n, 4, 1.0).iter().map(|v| *v as f32).collect();
        let w32: Vec<f32> = values(cols, 5, 1.0).iter().map(|v| (1.0 + *v) as f32).collect();
        let b32: Vec<f32> = values(cols, 6, 0.5).iter().map(|v| *v as f32).collect();
        for dt in TYPES {
            for (center, pdt) in [(true, DType::F32), (false, DType::F32), (true, dt)] {
                let run = |d: &candle_core::Device| {
                    let x = Var::from_tensor(
                        &Tensor::from_vec(x32.clone(), &shape[..], d)
                            .unwrap()
                            .to_dtype(dt)
                            .unwrap(),
                    )
                    .unwrap();
                    let w = Var::from_tensor(&Tensor::from_vec(w32.clone(), cols, d).unwrap().to_dtype(pdt).unwrap())
                        .unwrap();
                    let b = Var::from_tensor(&Tensor::from_vec(b32.clone(), cols, d).unwrap().to_dtype(pdt).unwrap())
                        .unwrap();
                    let y = if center {
                        candle_amp::kernels::layer_norm(x.as_tensor(), Some(w.as_tensor()), Some(b.as_tensor()), EPS)
                    } else {
                        candle_amp::kernels::rms_norm(x.as_tensor(), Some(w.as_tensor()), EPS)
                    }
                    .unwrap();
                    assert_eq!(y.dtype(), dt);
                    let c = Tensor::from_vec(c32.clone(), &shape[..], d).unwrap();
                    let loss = (y.to_dtype(DType::F32).unwrap() * &c).unwrap().sum_all().unwrap();
                    let grads = loss.backward().unwrap();
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
                    let gw = grads.get(w.as_tensor()).unwrap();
                    assert_eq!(gw.dtype(), pdt);
                    let gb = if center {
                        f(grads.get(b.as_tensor()).unwrap())
                    } else {
                        vec![]
                    };
                    (f(&y), f(grads.get(x.as_tensor()).unwrap()), f(gw), gb)
                };
                let (c, g) = (run(&cpu), run(&dev));
                let what = format!("{shape:?} center {center} x {dt:?} params {pdt:?}");
                // Relative to the largest value of each result (the gradients' cancellations
                // scale with the row's largest term), twice TE's tolerance of the types involved.
                let check = |name: &str, a: &[f32], b: &[f32], rt: f32| {
                    let m = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (i, (a, b)) in a.iter().zip(b).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 + 2.0 * rt * m.max(a.abs()),
                            "{what}: {name}[{i}] {b} vs {a}"
                        );
                    }
                };
                let rt = common::te_rtol(dt).max(common::te_rtol(pdt)).max(1e-5);
                check("y", &c.0, &g.0, rt);
                check("dx", &c.1, &g.1, rt);
                check("dw", &c.2, &g.2, rt);
                check("db", &c.3, &g.3, rt);
            }
        }
    }
}
