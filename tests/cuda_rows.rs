//! The CUDA row kernels without a GPU: `src/kernels/cuda/rows.cu` (bias + GELU in the erf and
//! tanh forms, the add of two
//! float types, column sums), unmodified, built with g++ against the CPU grid emulator
//! (`tests/cuda_emu/emu.h`) and launched as the library's plan launches them on a GPU, checked
//! against references computed here in f64 with llm.c's rule: every value within
//! `atol + |ref| * eps` plus the f32 arithmetic's own error (the add: bit for bit). Needs g++
//! (C++20). Under `CANDLE_AMP_TEST_DEVICE=cuda` the last tests compare the library's CUDA
//! paths (`nn::Linear` with GELU, `ops::add` of mixed types) with its CPU paths.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;

use candle_amp::testing::cuda_rows::{add_plan, bias_gelu_plan, bias_gelu_tanh_plan, colsum_plan, promoted};
use candle_core::{DType, Device, Module, Tensor, Var};

use cuda_emu::{atol, cdf, decode, encode, eps, erfc, pdf, values};

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
/// Rows by columns: columns not a multiple of the blocks (1, 3, 769) and GPT-2's 3072.
const SHAPES: [(usize, usize); 5] = [(1, 1), (7, 3), (100, 3), (33, 769), (5, 3072)];

fn run(args: &[String]) {
    cuda_emu::run("rows", args)
}

fn gelu(x: f64) -> f64 {
    x * cdf(x)
}
fn gelu_grad(x: f64) -> f64 {
    cdf(x) + x * pdf(x)
}

/// `2 √(2/π) (x + 0.044715 x³)`: the tanh form's argument, doubled.
fn two_v(x: f64) -> f64 {
    2.0 * (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)
}
/// σ(z) and 1 - σ(z), each without cancellation.
fn sigmoid(z: f64) -> (f64, f64) {
    let e = (-z).exp();
    (1.0 / (1.0 + e), if e.is_infinite() { 1.0 } else { e / (1.0 + e) })
}
/// GELU's tanh form as PyTorch writes it, `x/2 (1 + tanh v)`, and its derivative.
fn gelu_t(x: f64) -> f64 {
    0.5 * x * (1.0 + (two_v(x) / 2.0).tanh())
}
fn gelu_t_grad(x: f64) -> f64 {
    let t = (two_v(x) / 2.0).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x)
}

/// One GELU form's value, derivative and second derivative (the tanh form's by a central
/// difference: it only sizes an error bound) in f64, and the kernel's own f32 errors of the
/// value and the derivative at an exact argument (see tests/cuda_gated.rs for the tanh form's).
struct Form {
    tanh: bool,
}

impl Form {
    fn f(&self, x: f64) -> f64 {
        if self.tanh { gelu_t(x) } else { gelu(x) }
    }
    fn fp(&self, x: f64) -> f64 {
        if self.tanh { gelu_t_grad(x) } else { gelu_grad(x) }
    }
    fn fpp(&self, x: f64) -> f64 {
        if self.tanh {
            (gelu_t_grad(x + 1e-5) - gelu_t_grad(x - 1e-5)) / 2e-5
        } else {
            pdf(x) * (2.0 - x * x)
        }
    }
    fn f_err(&self, x: f64) -> f64 {
        if !self.tanh {
            return gelu(x).abs() * 2e-6;
        }
        let z = two_v(x);
        gelu_t(x).abs() * (sigmoid(z).1 * (z.abs() * 5e-7 + 2.4e-7) + 3e-7)
    }
    fn fp_err(&self, x: f64) -> f64 {
        if !self.tanh {
            return (cdf(x) + (x * pdf(x)).abs()) * 2e-6;
        }
        let z = two_v(x);
        let (s, r) = sigmoid(z);
        let dv = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x);
        let t2 = (2.0 * x * s * r * dv).abs();
        s * (r * z.abs() * 5e-7 + 3e-7) + t2 * (z.abs() * 5e-7 + 1e-6) + gelu_t_grad(x).abs() * 1.2e-7
    }
}

#[test]
fn the_reference_erfc_is_accurate() {
    for (x, want) in [
        (1.0, 0.157_299_207_050_285_13),
        (2.5, 4.069_520_174_449_59e-4),
        (3.0, 2.209_049_699_858_544e-5),
        (5.0, 1.537_459_794_428_035e-12),
        (-1.0, 1.842_700_792_949_715),
    ] {
        assert!(
            (erfc(x) - want).abs() <= 1e-13 * want,
            "erfc({x}) = {} vs {want}",
            erfc(x)
        );
    }
}

/// `(h, bias, y)` of every bias + GELU kernel: the bias in h's type or f32, y likewise.
fn gelu_types() -> Vec<(DType, DType, DType)> {
    let mut v = Vec::new();
    for h in TYPES {
        for b in [h, DType::F32] {
            for y in [h, DType::F32] {
                if !v.contains(&(h, b, y)) {
                    v.push((h, b, y));
                }
            }
        }
    }
    v
}

/// The bytes of `v` in `dt`, written to `dir/name`; the values they hold.
fn put(dir: &Path, name: &str, v: &[f64], dt: DType) -> (String, Vec<f64>) {
    let (bytes, held) = encode(v, dt);
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    (p.to_str().unwrap().to_string(), held)
}

fn get(path: &str, dt: DType) -> Vec<f64> {
    decode(&std::fs::read(path).unwrap(), dt)
}

fn check(what: &str, got: f64, want: f64, bound: f64) {
    let err = (got - want).abs();
    assert!(err <= bound, "{what}: {got} vs {want} (error {err:e} > {bound:e})");
}

/// One bias + GELU (the tanh form where `tanh`), forward and backward, on the emulator
/// against f64; returns the bias gradient's bytes (for the determinism check).
fn gelu_case(
    rows: usize,
    cols: usize,
    (th, tb, ty): (DType, DType, DType),
    tanh: bool,
    seed: u64,
    dir: &Path,
) -> Vec<u8> {
    let plan = if tanh { bias_gelu_tanh_plan } else { bias_gelu_plan };
    let p = plan(rows, cols, th, tb, ty).expect("a plan");
    let form = Form { tanh };
    let what = format!("{rows}x{cols} h {th:?} bias {tb:?} y {ty:?} tanh {tanh}");
    let s = |v: &dyn ToString| v.to_string();
    let (hp, h) = put(dir, "h", &values(rows * cols, seed, 4.0), th);
    let (bp, b) = put(dir, "b", &values(cols, seed + 1, 1.5), tb);
    let (dyp, dy) = put(dir, "dy", &values(rows * cols, seed + 2, 2.0), ty);
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let t = &p.tiles;
    let tiles = [s(&t.rows), s(&t.cols), s(&t.rows_per_chunk), s(&t.col_tiles)];
    let mut args = vec![
        s(&"gelu_fwd"),
        s(&p.forward.kernel),
        s(&p.forward.grid),
        s(&p.forward.block),
    ];
    args.extend(tiles.iter().cloned());
    args.extend([hp.clone(), bp.clone(), path("y")]);
    run(&args);
    let mut args = vec![
        s(&"gelu_bwd"),
        s(&p.backward.kernel),
        s(&p.backward.grid),
        s(&p.backward.block),
    ];
    args.extend([s(&p.sum.kernel), s(&p.sum.grid), s(&p.sum.block)]);
    args.extend(tiles.iter().cloned());
    args.extend([s(&t.chunks), hp, bp, dyp, path("dh"), path("db")]);
    run(&args);
    // Without the bias gradient (a null scratch buffer), dh is the same.
    let last = args.len() - 1;
    args[last] = "-".into();
    args[last - 1] = path("dh_only");
    run(&args);
    let (y, dh, db) = (get(&path("y"), ty), get(&path("dh"), th), get(&path("db"), tb));
    assert_eq!(
        std::fs::read(path("dh")).unwrap(),
        std::fs::read(path("dh_only")).unwrap()
    );
    // The pre-activation is rounded to h's type where the bias has it (the kernel adds in f32
    // and rounds once; two values of one type add exactly in f64).
    let rounded = th == tb;
    let sum_err = 6e-8 * (t.rows_per_chunk + t.chunks + 2) as f64;
    for c in 0..cols {
        let (mut db_ref, mut db_mag, mut db_extra) = (0.0, 0.0, 0.0);
        for r in 0..rows {
            let i = r * cols + c;
            let pre = h[i] + b[c];
            let pre = if rounded { encode(&[pre], th).1[0] } else { pre };
            // Φ and expf within a few ulps; the f32 sum's rounding where it is not rounded again.
            let want = form.f(pre);
            let f32_err = form.f_err(pre) + form.fp(pre).abs() * pre.abs() * 6e-8;
            let bound = atol(ty) + want.abs() * eps(ty) * 1.01 + f32_err * 1.01;
            check(&format!("{what} y[{r}][{c}]"), y[i], want, bound);

            let want = dy[i] * form.fp(pre);
            let f32_err =
                dy[i].abs() * form.fp_err(pre) + (dy[i] * form.fpp(pre) * pre).abs() * 6e-8 + want.abs() * 1.2e-7;
            let bound = atol(th) + want.abs() * eps(th) * 1.01 + f32_err * 1.01;
            check(&format!("{what} dh[{r}][{c}]"), dh[i], want, bound);
            // The sum adds what dh holds where the pre-activation is rounded, else f32 values.
            if rounded {
                db_ref += dh[i];
                db_mag += dh[i].abs();
            } else {
                db_ref += want;
                db_mag += want.abs();
                db_extra += f32_err;
            }
        }
        let bound = atol(tb) + db_ref.abs() * eps(tb) * 1.01 + (db_mag * sum_err + db_extra) * 1.01;
        check(&format!("{what} dbias[{c}]"), db[c], db_ref, bound);
    }
    std::fs::read(path("db")).unwrap()
}

#[test]
fn bias_gelu_forward_and_backward_on_the_emulator() {
    let dir = cuda_emu::scratch("rows", "gelu");
    for (k, &(rows, cols)) in SHAPES.iter().enumerate() {
        for (j, types) in gelu_types().into_iter().enumerate() {
            for tanh in [false, true] {
                gelu_case(rows, cols, types, tanh, (10 * k + j) as u64, &dir);
            }
        }
    }
}

#[test]
fn bias_gradients_are_the_same_on_every_run() {
    let dir = cuda_emu::scratch("rows", "determinism");
    // Several chunks of rows, several tiles of columns.
    for types in [
        (DType::BF16, DType::BF16, DType::F32),
        (DType::F32, DType::F32, DType::F32),
    ] {
        let a = gelu_case(130, 300, types, false, 7, &dir);
        let b = gelu_case(130, 300, types, false, 7, &dir);
        assert_eq!(a, b, "{types:?}: two runs differ");
    }
    for _ in 0..2 {
        let first = colsum_case(130, 300, DType::F16, DType::F16, 3, &dir);
        assert_eq!(first, colsum_case(130, 300, DType::F16, DType::F16, 3, &dir));
    }
}

/// Every add kernel's `(a, b, out)`: one type kept or widened to f32, two promoted to f32.
fn add_types() -> Vec<(DType, DType, DType)> {
    let mut v = Vec::new();
    for a in TYPES {
        for b in TYPES {
            for o in [promoted(a, b), DType::F32] {
                if !v.contains(&(a, b, o)) {
                    v.push((a, b, o));
                }
            }
        }
    }
    v
}

/// One add on the emulator: bit for bit the sum of the held values rounded once to `out`
/// (f32 addition then one rounding to half is the correctly rounded half sum).
fn add_case(rows: usize, cols: usize, bcast: bool, (ta, tb, to): (DType, DType, DType), seed: u64, dir: &Path) {
    let p = add_plan(rows, cols, bcast, ta, tb, to).expect("a plan");
    let what = format!("{rows}x{cols} bcast {bcast} {ta:?} + {tb:?} -> {to:?}");
    let s = |v: &dyn ToString| v.to_string();
    let (ap, a) = put(dir, "a", &values(rows * cols, seed, 3.0), ta);
    let nb = if bcast { cols } else { rows * cols };
    let (bp, b) = put(dir, "b", &values(nb, seed + 1, 3.0), tb);
    let out = dir.join("out").to_str().unwrap().to_string();
    let t = &p.tiles;
    run(&[
        s(&"add"),
        s(&p.forward.kernel),
        s(&p.forward.grid),
        s(&p.forward.block),
        s(&t.rows),
        s(&t.cols),
        s(&t.rows_per_chunk),
        s(&t.col_tiles),
        s(&i32::from(p.bcast)),
        ap,
        bp,
        out.clone(),
    ]);
    let got = get(&out, to);
    for (i, g) in got.iter().enumerate() {
        let bv = if bcast { b[i % cols] } else { b[i] };
        let want = encode(&[a[i] + bv], to).1[0];
        assert!(g.to_bits() == want.to_bits(), "{what} [{i}]: {g} vs {want}");
    }
}

/// Column sums of `g` into `out` on the emulator against f64; returns the result's bytes.
fn colsum_case(rows: usize, cols: usize, tg: DType, to: DType, seed: u64, dir: &Path) -> Vec<u8> {
    let p = colsum_plan(rows, cols, tg, to).expect("a plan");
    let s = |v: &dyn ToString| v.to_string();
    let (gp, g) = put(dir, "g", &values(rows * cols, seed, 2.0), tg);
    let out = dir.join("sum").to_str().unwrap().to_string();
    let t = &p.tiles;
    run(&[
        s(&"colsum"),
        s(&p.part.kernel),
        s(&p.part.grid),
        s(&p.part.block),
        s(&p.sum.kernel),
        s(&p.sum.grid),
        s(&p.sum.block),
        s(&t.rows),
        s(&t.cols),
        s(&t.rows_per_chunk),
        s(&t.col_tiles),
        s(&t.chunks),
        gp,
        out.clone(),
    ]);
    let got = get(&out, to);
    let sum_err = 6e-8 * (t.rows_per_chunk + t.chunks + 2) as f64;
    for c in 0..cols {
        let want: f64 = (0..rows).map(|r| g[r * cols + c]).sum();
        let mag: f64 = (0..rows).map(|r| g[r * cols + c].abs()).sum();
        let bound = atol(to) + want.abs() * eps(to) * 1.01 + mag * sum_err * 1.01;
        check(&format!("{rows}x{cols} {tg:?} -> {to:?} sum[{c}]"), got[c], want, bound);
    }
    std::fs::read(out).unwrap()
}

#[test]
fn add_and_its_column_sums_on_the_emulator() {
    let dir = cuda_emu::scratch("rows", "add");
    for (k, &(rows, cols)) in SHAPES.iter().enumerate() {
        for (j, types) in add_types().into_iter().enumerate() {
            for bcast in [false, true] {
                add_case(rows, cols, bcast, types, (20 * k + j) as u64, &dir);
            }
            // The broadcast operand's gradient: the output's gradient summed into b's type.
            colsum_case(rows, cols, types.2, types.1, (20 * k + j) as u64, &dir);
        }
    }
}

#[test]
fn row_plans_cover_every_row_and_column() {
    for (rows, cols) in [(1, 1), (7, 3), (5, 3072), (100_000, 768), (33, 257), (1 << 20, 1)] {
        let p = bias_gelu_plan(rows, cols, DType::BF16, DType::BF16, DType::F32).unwrap();
        let t = &p.tiles;
        assert_eq!(p.forward.kernel, "amp_bias_gelu_fwd_bf16_bf16_f32");
        let q = bias_gelu_tanh_plan(rows, cols, DType::BF16, DType::BF16, DType::F32).unwrap();
        assert_eq!(q.backward.kernel, "amp_bias_gelu_tanh_bwd_bf16_bf16_f32");
        assert_eq!((&q.tiles, &q.sum), (&p.tiles, &p.sum));
        assert_eq!(p.sum.kernel, "amp_colsum_sum_bf16");
        assert!(t.rows_per_chunk * t.chunks >= rows && t.rows_per_chunk * (t.chunks - 1) < rows);
        assert!(t.col_tiles * p.forward.block as usize >= cols);
        assert_eq!(p.forward.grid as usize, t.chunks * t.col_tiles);
        assert!(p.sum.grid as usize * p.sum.block as usize >= cols);
        let a = add_plan(rows, cols, false, DType::F32, DType::F16, DType::F32).unwrap();
        assert_eq!((a.tiles.rows, a.tiles.cols), (1, rows * cols));
        assert!(a.forward.grid as usize * a.forward.block as usize >= rows * cols);
    }
    // Types and shapes without a kernel: the composed ops run.
    assert!(bias_gelu_plan(0, 5, DType::F32, DType::F32, DType::F32).is_none());
    assert!(bias_gelu_plan(5, 0, DType::F32, DType::F32, DType::F32).is_none());
    assert!(bias_gelu_plan(5, 5, DType::F16, DType::BF16, DType::F16).is_none());
    assert!(bias_gelu_plan(5, 5, DType::F16, DType::F16, DType::BF16).is_none());
    assert!(bias_gelu_plan(5, 5, DType::F64, DType::F64, DType::F64).is_none());
    assert!(add_plan(5, 5, true, DType::F16, DType::F32, DType::F16).is_none());
    assert!(add_plan(1 << 16, 1 << 16, false, DType::F32, DType::F32, DType::F32).is_none());
    assert_eq!(promoted(DType::F16, DType::BF16), DType::F32);
    assert_eq!(promoted(DType::BF16, DType::BF16), DType::BF16);
}

// ------------------------------------------------------------------------------ GPU vs CPU

/// Values of `t` on the host as f32.
fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `b` against `a` within TE's relative tolerance of `dt` (twice it, relative to the larger
/// of the value and a tenth of the result's largest: a GELU near its zero and the gradients'
/// sums cancel), and 1e-5 absolute.
fn close(what: &str, a: &[f32], b: &[f32], dt: DType) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let rt = 2.0 * common::te_rtol(dt);
    let m = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 + rt * x.abs().max(0.1 * m),
            "{what}[{i}]: {y} (CUDA) vs {x} (CPU)"
        );
    }
}

fn var(v: &[f64], shape: &[usize], dt: DType, dev: &Device) -> Var {
    let t = Tensor::from_vec(v.iter().map(|x| *x as f32).collect::<Vec<_>>(), shape, dev).unwrap();
    Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap()
}

/// `nn::Linear` with GELU in either form (the CUDA kernels: product, then bias + GELU) against
/// the CPU path: the output and the gradients of x, w and b, in f32, f16 and bf16, and at
/// O1-style autocast (f32 parameters, GELU's output in f32).
#[test]
fn cuda_linear_gelu_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_rows_loaded(&dev),
        "the CUDA row kernels did not load (see the log's warning)"
    );
    let cpu = Device::Cpu;
    for (rows, k, n) in [(1, 8, 1), (7, 16, 3), (33, 64, 769), (4, 32, 3072)] {
        let (xv, wv, bv) = (values(rows * k, 1, 2.0), values(n * k, 2, 0.3), values(n, 3, 1.0));
        let cv = values(rows * n, 4, 1.0);
        let cases = [
            (DType::F32, None),
            (DType::F16, None),
            (DType::BF16, None),
            (DType::F32, Some(DType::F16)),
            (DType::F32, Some(DType::BF16)),
        ];
        let acts = [candle_amp::nn::Activation::Gelu, candle_amp::nn::Activation::GeluTanh];
        for ((dt, autocast), act) in cases.into_iter().flat_map(|c| acts.map(|a| (c, a))) {
            let run = |d: &Device| {
                let (x, w, b) = (
                    var(&xv, &[rows, k], dt, d),
                    var(&wv, &[n, k], dt, d),
                    var(&bv, &[n], dt, d),
                );
                let layer = candle_amp::nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))
                    .with_activation(act);
                let y = {
                    let _s = autocast.map(candle_amp::autocast::scope);
                    layer.forward(x.as_tensor()).unwrap()
                };
                let want = if autocast.is_some() { DType::F32 } else { dt };
                assert_eq!(y.dtype(), want);
                let c = Tensor::from_vec(cv.iter().map(|v| *v as f32).collect::<Vec<_>>(), (rows, n), d).unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * c).unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                let grad = |v: &Var| {
                    let t = g.get(v.as_tensor()).unwrap();
                    assert_eq!(t.dtype(), dt);
                    host(t)
                };
                [host(&y), grad(&x), grad(&w), grad(&b)]
            };
            let (c, gpu) = (run(&cpu), run(&dev));
            let tol = autocast.unwrap_or(dt);
            for (name, (a, b)) in ["y", "dx", "dw", "db"].iter().zip(c.iter().zip(&gpu)) {
                close(
                    &format!("{rows}x{k}x{n} {dt:?} {act:?} autocast {autocast:?} {name}"),
                    a,
                    b,
                    tol,
                );
            }
        }
    }
}

/// `ops::add` on CUDA (one kernel) against the CPU path: mixed types under autocast (an f32
/// residual plus a half body output, f16 + bf16), one type without it, operands of one shape
/// and a bias-like row on either side; the sum and both gradients.
#[test]
fn cuda_add_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(candle_amp::testing::cuda_rows_loaded(&dev));
    let cpu = Device::Cpu;
    let (rows, n) = (37, 769);
    let cases = [
        (DType::F32, DType::F16, Some(DType::F16)),
        (DType::BF16, DType::F32, Some(DType::BF16)),
        (DType::F16, DType::BF16, Some(DType::F16)),
        (DType::F16, DType::F16, Some(DType::F16)),
        (DType::BF16, DType::BF16, None),
        (DType::F32, DType::F32, None),
    ];
    for (ta, tb, autocast) in cases {
        for (sa, sb) in [
            (vec![rows, n], vec![rows, n]),
            (vec![3, rows, n], vec![n]),
            (vec![1, n], vec![rows, n]),
        ] {
            let (av, bv) = (values(sa.iter().product(), 5, 3.0), values(sb.iter().product(), 6, 3.0));
            let run = |d: &Device| {
                let (a, b) = (var(&av, &sa, ta, d), var(&bv, &sb, tb, d));
                let y = {
                    let _s = autocast.map(candle_amp::autocast::scope);
                    candle_amp::ops::add(a.as_tensor(), b.as_tensor()).unwrap()
                };
                assert_eq!(y.dtype(), promoted(ta, tb));
                let c = values(y.elem_count(), 7, 1.0)
                    .iter()
                    .map(|v| *v as f32)
                    .collect::<Vec<_>>();
                let c = Tensor::from_vec(c, y.shape(), d).unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * c).unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                let (ga, gb) = (g.get(a.as_tensor()).unwrap(), g.get(b.as_tensor()).unwrap());
                assert_eq!((ga.dtype(), gb.dtype()), (ta, tb));
                assert_eq!((ga.dims(), gb.dims()), (&sa[..], &sb[..]));
                [host(&y), host(ga), host(gb)]
            };
            let (c, gpu) = (run(&cpu), run(&dev));
            let tol = looser(ta, tb);
            for (name, (x, y)) in ["y", "da", "db"].iter().zip(c.iter().zip(&gpu)) {
                close(&format!("{sa:?} {ta:?} + {sb:?} {tb:?} {name}"), x, y, tol);
            }
        }
    }
}

/// The looser of two types' tolerances.
fn looser(a: DType, b: DType) -> DType {
    if common::te_rtol(a) >= common::te_rtol(b) { a } else { b }
}
