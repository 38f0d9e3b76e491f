//! The CUDA attention kernels without a GPU: `src/kernels/cuda/flash.cu`, unmodified, built with
//! g++ against the CPU grid emulator (`tests/cuda_emu/emu.h`) and launched as the library's
//! plan launches them on a GPU (both tile sizes), checked against an f64 reference: the output
//! O and the rows' log-sum-exp from the forward, dQ, dK and dV from the backward (which reads
//! the forward's O and LSE, as the library's does). Each value must lie within `atol + |ref| *
//! eps` of the type's rounding plus a bound on f32's error derived per value from the
//! magnitudes of the terms summed into it (the kernels sum in another order than the
//! reference). The tensor-core kernels (`flash_mma.cu`) run there too, their `mma` being the PTX
//! ISA's documented fragment layout (`tests/cuda_emu/mma.h`), with the half rounding of P and
//! dS added to the bound. Needs g++ (C++20). Under `CANDLE_AMP_TEST_DEVICE=cuda` the last test
//! compares `nn::scaled_dot_product_attention` on CUDA (the kernels: the tensor-core ones for
//! f16 and bf16 on compute capability 8.0+) with its CPU path, which is what confirms that the
//! hardware's fragment layout is the documented one.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;
use std::process::Command;

use candle_amp::testing::cuda_flash_launches;
use candle_core::{DType, Tensor, Var};

use cuda_emu::{atol, decode, encode, eps, f32s, values};

/// One attention: `bh` matrices of `t` rows of `d`.
struct Case {
    bh: usize,
    t: usize,
    d: usize,
    causal: bool,
    scale: f64,
    small: bool,
}

/// f64 reference of one case over the values held in the inputs' type.
struct Reference {
    o: Vec<f64>,
    lse: Vec<f64>,
    /// Per row: the largest |scale * q.k| term sum over its keys (how large its scores can be).
    smag: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// Error bounds from f32 arithmetic (and O's rounding, in Delta), per value of each.
    o_err: Vec<f64>,
    dq_err: Vec<f64>,
    dk_err: Vec<f64>,
    dv_err: Vec<f64>,
}

/// f32's relative error per unit of the magnitudes summed (about two roundings of 6e-8: the
/// bounds below multiply it by what adds up, and the emulator's worst errors sit near a fifth
/// of them).
const F32_ERR: f64 = 2.5e-7;

// Index loops: the formulas read as the maths does.
#[allow(clippy::needless_range_loop)]
// `o_eps`: the rounding of the O that Delta reads; `p_eps`: the rounding of P and dS before
// their products (the tensor-core kernels round them to the half type; 0 for the FMA kernels).
#[allow(clippy::too_many_arguments)]
fn reference(c: &Case, q: &[f64], k: &[f64], v: &[f64], dout: &[f64], o_eps: f64, p_eps: f64) -> Reference {
    let (t, d, s) = (c.t, c.d, c.scale);
    let n = c.bh * t * d;
    let mut r = Reference {
        o: vec![0.0; n],
        lse: vec![0.0; c.bh * t],
        smag: vec![0.0; c.bh * t],
        dq: vec![0.0; n],
        dk: vec![0.0; n],
        dv: vec![0.0; n],
        o_err: vec![0.0; n],
        dq_err: vec![0.0; n],
        dk_err: vec![0.0; n],
        dv_err: vec![0.0; n],
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let absdot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f64>();
    for m in 0..c.bh {
        let at = |x: &[f64], i: usize| -> Vec<f64> { x[(m * t + i) * d..(m * t + i + 1) * d].to_vec() };
        let (qm, km, vm, dm): (Vec<_>, Vec<_>, Vec<_>, Vec<_>) = (
            (0..t).map(|i| at(q, i)).collect(),
            (0..t).map(|i| at(k, i)).collect(),
            (0..t).map(|i| at(v, i)).collect(),
            (0..t).map(|i| at(dout, i)).collect(),
        );
        // P, dP, the rows' Delta and their error terms.
        let mut p = vec![vec![0.0; t]; t];
        let mut ds = vec![vec![0.0; t]; t];
        let mut ds_err = vec![vec![0.0; t]; t];
        for i in 0..t {
            let live = if c.causal { i + 1 } else { t };
            let sc: Vec<f64> = (0..live).map(|j| s * dot(&qm[i], &km[j])).collect();
            let smag = (0..live).map(|j| s * absdot(&qm[i], &km[j])).fold(0.0, f64::max);
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
            let lse = mx + sum.ln();
            r.lse[m * t + i] = lse;
            r.smag[m * t + i] = smag;
            for j in 0..live {
                p[i][j] = (sc[j] - lse).exp();
            }
            // f32's relative error of a probability: the score's dot product, the exponent's
            // argument and exp itself, and the sum over `live` terms.
            let cf = F32_ERR * (4.0 + 2.0 * smag + lse.abs() + (d as f64).sqrt() + (live as f64).sqrt());
            let o: Vec<f64> = (0..d).map(|e| (0..live).map(|j| p[i][j] * vm[j][e]).sum()).collect();
            for e in 0..d {
                r.o[(m * t + i) * d + e] = o[e];
                r.o_err[(m * t + i) * d + e] = (cf + p_eps) * (0..live).map(|j| p[i][j] * vm[j][e].abs()).sum::<f64>();
            }
            let delta = dot(&dm[i], &o);
            let dmag = absdot(&dm[i], &o);
            for j in 0..live {
                let dp = dot(&dm[i], &vm[j]);
                let dpmag = absdot(&dm[i], &vm[j]);
                ds[i][j] = p[i][j] * (dp - delta);
                // Delta is taken from O rounded to the inputs' type: o_eps of its magnitude.
                ds_err[i][j] =
                    p[i][j] * (cf * (dp.abs() + delta.abs() + dpmag + dmag) + o_eps * dmag) + p_eps * ds[i][j].abs();
            }
        }
        for i in 0..t {
            for e in 0..d {
                let idx = (m * t + i) * d + e;
                r.dq[idx] = s * (0..t).map(|j| ds[i][j] * km[j][e]).sum::<f64>();
                r.dq_err[idx] = s * (0..t).map(|j| ds_err[i][j] * km[j][e].abs()).sum::<f64>();
            }
        }
        for j in 0..t {
            for e in 0..d {
                let idx = (m * t + j) * d + e;
                r.dv[idx] = (0..t).map(|i| p[i][j] * dm[i][e]).sum::<f64>();
                r.dk[idx] = s * (0..t).map(|i| ds[i][j] * qm[i][e]).sum::<f64>();
                let cf = F32_ERR * (4.0 + (t as f64).sqrt());
                r.dv_err[idx] = (0..t)
                    .map(|i| p[i][j] * dm[i][e].abs() * (cf + p_eps + F32_ERR * (2.0 * r.smag[m * t + i] + 4.0)))
                    .sum::<f64>();
                r.dk_err[idx] = s * (0..t).map(|i| ds_err[i][j] * qm[i][e].abs()).sum::<f64>();
            }
        }
    }
    r
}

/// Checks `got` against `want` within `atol + |want| * eps + 2 * err` (the type's rounding and
/// twice the f32 bound); returns the largest error's share of its bound.
fn check(what: &str, got: &[f64], want: &[f64], err: &[f64], dt: DType) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut ratio = 0f64;
    for (idx, ((g, w), e)) in got.iter().zip(want).zip(err).enumerate() {
        let bound = atol(dt) + w.abs() * eps(dt) * 1.01 + 2.0 * e + 1e-12;
        let diff = (g - w).abs();
        assert!(diff <= bound, "{what}[{idx}]: {g} vs {w} (error {diff:e} > {bound:e})");
        ratio = ratio.max(diff / bound);
    }
    ratio
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// Runs one case's forward and backward on the emulator in `dt` and checks them: the FMA
/// kernels (the tile `c.small` says).
fn run_case(c: &Case, dt: DType, dir: &Path, seed: u64) {
    let launches = cuda_flash_launches(c.bh, c.t, c.d, dt, Some(c.small), false).expect("a plan");
    run_launches(c, launches, dt, dir, seed, false);
}

/// As [`run_case`] for the kernels `launches` (the FMA or the tensor-core ones: a kernel name
/// ending in `m`); `misalign`: the inputs 2 bytes past a 16-byte boundary (the harness's
/// AMP_EMU_MISALIGN, as a view at an odd offset).
fn run_launches(c: &Case, launches: [(String, u32, u32); 4], dt: DType, dir: &Path, seed: u64, misalign: bool) {
    let n = c.bh * c.t * c.d;
    let [fwd, pre, dkv, dq] = launches;
    let mma = fwd.0.ends_with('m');
    let (qb, qh) = encode(&values(n, seed, 2.0), dt);
    let (kb, kh) = encode(&values(n, seed + 1, 2.0), dt);
    let (vb, vh) = encode(&values(n, seed + 2, 1.0), dt);
    let (db, dh) = encode(&values(n, seed + 3, 1.0), dt);
    let names = ["q", "k", "v", "do"];
    for (name, bytes) in names.iter().zip([qb, kb, vb, db]) {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let [qp, kp, vp, dp] = names.map(|s| path(&dir.join(s)));
    let (op, lp, gp) = (path(&dir.join("o")), path(&dir.join("lse")), path(&dir.join("dqkv")));
    let common = [
        c.bh.to_string(),
        c.t.to_string(),
        c.scale.to_string(),
        (c.causal as i32).to_string(),
    ];
    let misalign = if misalign { "1" } else { "0" };
    let st = Command::new(cuda_emu::harness("flash"))
        .env("AMP_EMU_MISALIGN", misalign)
        .args(["fwd".to_string(), fwd.0.clone(), fwd.1.to_string(), fwd.2.to_string()])
        .args(&common)
        .args([&qp, &kp, &vp, &op, &lp])
        .status()
        .unwrap();
    assert!(st.success(), "{}: harness failed", fwd.0);
    let mut args = vec!["bwd".to_string()];
    for l in [&pre, &dkv, &dq] {
        args.extend([l.0.clone(), l.1.to_string(), l.2.to_string()]);
    }
    let st = Command::new(cuda_emu::harness("flash"))
        .env("AMP_EMU_MISALIGN", misalign)
        .args(&args)
        .args(&common)
        .args([&qp, &kp, &vp, &op, &dp, &lp, &gp])
        .status()
        .unwrap();
    assert!(st.success(), "{}: harness failed", dkv.0);
    let o = decode(&std::fs::read(&op).unwrap(), dt);
    let lse = f32s(&std::fs::read(&lp).unwrap());
    let g = decode(&std::fs::read(&gp).unwrap(), dt);
    // The backward's Delta reads O as rounded to the inputs' type.
    let o_eps = if dt == DType::F32 { 0.0 } else { eps(dt) };
    // The reference's scale is the f32 the kernel gets.
    let scale = c.scale as f32 as f64;
    // The tensor-core kernels round P and dS to the half type before their products.
    let p_eps = if mma { eps(dt) } else { 0.0 };
    let r = reference(&Case { scale, ..*c }, &qh, &kh, &vh, &dh, o_eps, p_eps);
    let what = format!(
        "{} {dt:?} bh {} t {} d {} causal {} scale {}",
        fwd.0, c.bh, c.t, c.d, c.causal, c.scale
    );
    let ro = check(&format!("{what} O"), &o, &r.o, &r.o_err, dt);
    let lse_err: Vec<f64> = r
        .lse
        .iter()
        .zip(&r.smag)
        .map(|(l, s)| F32_ERR * (4.0 + 2.0 * s + l.abs() + (c.d as f64).sqrt()))
        .collect();
    let rl = check(&format!("{what} LSE"), &lse, &r.lse, &lse_err, DType::F32);
    let rq = check(&format!("{what} dQ"), &g[..n], &r.dq, &r.dq_err, dt);
    let rk = check(&format!("{what} dK"), &g[n..2 * n], &r.dk, &r.dk_err, dt);
    let rv = check(&format!("{what} dV"), &g[2 * n..], &r.dv, &r.dv_err, dt);
    println!(
        "{what}: worst error / bound: O {:.0}%, LSE {:.0}%, dQ {:.0}%, dK {:.0}%, dV {:.0}%",
        100.0 * ro,
        100.0 * rl,
        100.0 * rq,
        100.0 * rk,
        100.0 * rv
    );
}

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn flash_attention_forward_and_backward_on_the_emulator() {
    let dir = cuda_emu::scratch("flash", "cases");
    #[rustfmt::skip]
    let cases = [
        // One row; rows not a multiple of the tile; the two head dimensions; both tiles.
        Case { bh: 2, t: 1, d: 64, causal: true, scale: 0.3, small: true },
        Case { bh: 3, t: 17, d: 64, causal: false, scale: 0.2, small: true },
        Case { bh: 2, t: 17, d: 128, causal: true, scale: 0.09, small: true },
        Case { bh: 2, t: 70, d: 128, causal: false, scale: 0.11, small: true },
        Case { bh: 2, t: 70, d: 64, causal: true, scale: 0.125, small: false },
        Case { bh: 2, t: 33, d: 128, causal: false, scale: 0.1, small: false },
        Case { bh: 2, t: 70, d: 128, causal: true, scale: 0.0884, small: false },
        // A few hundred rows (the large tile, as the GPU runs them).
        Case { bh: 2, t: 260, d: 64, causal: true, scale: 0.125, small: false },
    ];
    for (k, c) in cases.iter().enumerate() {
        for (ti, dt) in TYPES.into_iter().enumerate() {
            run_case(c, dt, &dir, 10 * k as u64 + ti as u64);
        }
    }
    // The larger sizes in one type each, non-causal too, on the small tile.
    run_case(
        &Case {
            bh: 2,
            t: 200,
            d: 64,
            causal: false,
            scale: 0.125,
            small: true,
        },
        DType::BF16,
        &dir,
        90,
    );
    run_case(
        &Case {
            bh: 2,
            t: 130,
            d: 128,
            causal: true,
            scale: 0.0884,
            small: true,
        },
        DType::F16,
        &dir,
        91,
    );
}

/// The tensor-core kernels (`flash_mma.cu`, f16 and bf16) on the emulator, whose `mma` is the
/// PTX ISA's documented fragment layout (`tests/cuda_emu/mma.h`): every length from one row to
/// several tiles of 64 with a ragged end, both head dimensions, causal or not, both half types.
/// The bound adds one half rounding of every P and dS term (the kernels round them before
/// their products).
#[test]
fn flash_attention_on_tensor_cores_on_the_emulator() {
    let dir = cuda_emu::scratch("flash", "mma");
    #[rustfmt::skip]
    let cases = [
        (Case { bh: 2, t: 1, d: 64, causal: true, scale: 0.3, small: false }, DType::F16),
        (Case { bh: 1, t: 1, d: 128, causal: false, scale: 0.09, small: false }, DType::BF16),
        (Case { bh: 2, t: 17, d: 128, causal: true, scale: 0.09, small: false }, DType::BF16),
        (Case { bh: 3, t: 17, d: 64, causal: false, scale: 0.2, small: false }, DType::F16),
        (Case { bh: 1, t: 64, d: 64, causal: true, scale: 0.125, small: false }, DType::BF16),
        (Case { bh: 1, t: 64, d: 128, causal: false, scale: 0.0884, small: false }, DType::F16),
        (Case { bh: 1, t: 130, d: 128, causal: false, scale: 0.0884, small: false }, DType::F16),
        (Case { bh: 1, t: 130, d: 64, causal: true, scale: 0.125, small: false }, DType::BF16),
        (Case { bh: 1, t: 260, d: 64, causal: false, scale: 0.125, small: false }, DType::BF16),
        (Case { bh: 1, t: 260, d: 128, causal: true, scale: 0.0884, small: false }, DType::F16),
    ];
    for (k, (c, dt)) in cases.iter().enumerate() {
        let launches = cuda_flash_launches(c.bh, c.t, c.d, *dt, None, true).expect("a plan");
        assert!(launches[0].0.ends_with('m'), "{:?}", launches[0]);
        run_launches(c, launches, *dt, &dir, 200 + k as u64, false);
    }
    // Inputs not 16-byte aligned: the tiles are loaded 16 bits at a time.
    #[rustfmt::skip]
    let cases = [
        (Case { bh: 1, t: 70, d: 128, causal: true, scale: 0.0884, small: false }, DType::BF16),
        (Case { bh: 2, t: 17, d: 64, causal: false, scale: 0.2, small: false }, DType::F16),
    ];
    for (k, (c, dt)) in cases.iter().enumerate() {
        let launches = cuda_flash_launches(c.bh, c.t, c.d, *dt, None, true).expect("a plan");
        run_launches(c, launches, *dt, &dir, 300 + k as u64, true);
    }
}

#[test]
fn non_finite_scores_propagate_on_the_emulator() {
    // A NaN in one query row makes that row's output and LSE NaN and leaves the others finite
    // (as the composed softmax does: an overflow is not hidden); an inf in a key makes the
    // rows that see it with a +inf score NaN, and only those (causal: from its position on).
    let dir = cuda_emu::scratch("flash", "nonfinite");
    let (bh, t, d) = (1usize, 17usize, 64usize);
    let n = bh * t * d;
    let [fwd, ..] = cuda_flash_launches(bh, t, d, DType::F32, Some(true), false).unwrap();
    for (bad_q, bad_k) in [(Some(3usize), None), (None, Some(5usize))] {
        let mut q = values(n, 1, 2.0);
        let mut k = values(n, 2, 2.0);
        if let Some(r) = bad_q {
            q[r * d + 7] = f64::NAN;
        }
        if let Some(r) = bad_k {
            k[r * d + 7] = f64::INFINITY;
        }
        for (name, x) in [("q", &q), ("k", &k), ("v", &values(n, 3, 1.0))] {
            std::fs::write(dir.join(name), encode(x, DType::F32).0).unwrap();
        }
        let p = |s: &str| path(&dir.join(s));
        let st = Command::new(cuda_emu::harness("flash"))
            .args(["fwd".to_string(), fwd.0.clone(), fwd.1.to_string(), fwd.2.to_string()])
            .args(["1", "17", "0.125", "1"])
            .args([p("q"), p("k"), p("v"), p("o"), p("lse")])
            .status()
            .unwrap();
        assert!(st.success());
        let o = f32s(&std::fs::read(dir.join("o")).unwrap());
        let lse = f32s(&std::fs::read(dir.join("lse")).unwrap());
        assert!(lse.iter().any(|v| v.is_nan()) && lse.iter().any(|v| v.is_finite()));
        for r in 0..t {
            // The key's score is +inf (a NaN row) where the query's matching value is
            // positive, -inf (the key adds nothing, as a masked one) where it is negative.
            let bad = bad_q == Some(r) || bad_k.is_some_and(|j| r >= j && q[r * d + 7] > 0.0);
            let row = &o[r * d..(r + 1) * d];
            assert_eq!(lse[r].is_nan(), bad, "row {r}: LSE {}", lse[r]);
            assert!(row.iter().all(|v| v.is_nan() == bad), "row {r}: {row:?}");
        }
    }
}

#[test]
fn flash_plan_covers_every_row_and_falls_back() {
    for (t, d) in [(1usize, 64usize), (17, 64), (1024, 64), (70, 128), (4096, 128)] {
        for small in [None, Some(true), Some(false)] {
            let [fwd, pre, dkv, dq] = cuda_flash_launches(12, t, d, DType::BF16, small, false).unwrap();
            let (br, bc) = match (d, fwd.0.ends_with('s')) {
                (_, true) => (8, 8),
                (64, false) => (32, 32),
                _ => (16, 16),
            };
            assert_eq!(fwd.1 as usize, 12 * t.div_ceil(br), "{fwd:?}");
            assert_eq!(dq.1, fwd.1);
            assert_eq!(dkv.1 as usize, 12 * t.div_ceil(bc), "{dkv:?}");
            assert!(pre.1 as usize * pre.2 as usize / 32 >= 12 * t, "{pre:?}");
        }
    }
    // The plan's own choice: the large tile once its grid fills the GPU.
    assert!(
        cuda_flash_launches(96, 1024, 64, DType::BF16, None, false).unwrap()[0]
            .0
            .ends_with('l')
    );
    assert!(
        cuda_flash_launches(1, 64, 64, DType::BF16, None, false).unwrap()[0]
            .0
            .ends_with('s')
    );
    // With tensor cores (compute capability 8.0+): f16 and bf16 on flash_mma.cu's kernels,
    // 64 rows per block of 128 threads in each pass; f32 keeps flash.cu's.
    for (t, d, dt) in [
        (1usize, 64usize, DType::F16),
        (130, 128, DType::BF16),
        (1024, 64, DType::BF16),
    ] {
        let [fwd, pre, dkv, dq] = cuda_flash_launches(12, t, d, dt, None, true).unwrap();
        for l in [&fwd, &dkv, &dq] {
            assert!(l.0.ends_with(&format!("_d{d}m")), "{l:?}");
            assert_eq!((l.1 as usize, l.2), (12 * t.div_ceil(64), 128), "{l:?}");
        }
        assert!(pre.1 as usize * pre.2 as usize / 32 >= 12 * t, "{pre:?}");
    }
    assert!(
        !cuda_flash_launches(96, 1024, 64, DType::F32, None, true).unwrap()[0]
            .0
            .ends_with('m')
    );
    // No kernel: another head dimension or type, an empty tensor.
    assert!(cuda_flash_launches(2, 16, 96, DType::F32, None, true).is_none());
    assert!(cuda_flash_launches(2, 16, 64, DType::F64, None, true).is_none());
    assert!(cuda_flash_launches(0, 16, 64, DType::F32, None, true).is_none());
    assert!(cuda_flash_launches(2, 0, 64, DType::F32, None, true).is_none());
}

/// `nn::scaled_dot_product_attention` on CUDA (the flash kernels) against its CPU path (runs
/// only with `CANDLE_AMP_TEST_DEVICE=cuda`): the output and the gradients of q, k and v.
///
/// Tolerance: the two paths round differently (the CPU path rounds the scores and the
/// probabilities to the inputs' type where the kernels keep them in f32, and sums in another
/// order), so each value is compared with `2 * rtol * (|cpu| + max |cpu| over the tensor)`:
/// Transformer Engine's rtol for half types ([`common::te_rtol`]) and 1e-5 for f32 (TE's
/// 1.3e-6 is one rounding; a reordered sum of t products is several). Against an f64
/// reference on these inputs the CPU path stays under a fifth of that bound in every type.
///
/// On compute capability 8.0+ the f16 and bf16 cases run the tensor-core kernels, which round
/// P and dS to the half type before their products. The bound is kept: the CPU path rounds
/// its probabilities to the half type too, the two roundings are independent (their
/// difference is at most the sum of two errors each under a fifth of the bound), and a wrong
/// fragment layout gives errors of the size of the values themselves. The worst share of the
/// bound is printed per tensor (`--nocapture`) so that a GPU run shows the margin.
#[test]
fn cuda_attention_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_flash_loaded(&dev),
        "the CUDA attention kernels did not load (see the log's warning)"
    );
    // On compute capability 8.0+ the f16 and bf16 cases must run the tensor-core kernels (a
    // module that failed to load would fall back to the FMA kernels and test those instead).
    let tc = candle_amp::testing::cuda_flash_tensor_cores(&dev);
    assert_ne!(
        tc,
        Some(false),
        "the tensor-core attention kernels did not load (see the log's warning)"
    );
    println!(
        "tensor-core attention kernels: {}",
        if tc.is_some() { "used" } else { "not on this GPU" }
    );
    let cpu = candle_core::Device::Cpu;
    for (shape, causal, scale) in [
        ([2usize, 3, 70, 64], true, None),
        ([1, 2, 130, 128], false, Some(0.07)),
        ([1, 1, 1, 64], true, None),
        // Large enough for the plan's large tiles.
        ([4, 12, 256, 64], true, None),
        ([2, 8, 300, 128], false, None),
    ] {
        let n: usize = shape.iter().product();
        let data: Vec<Vec<f32>> = (0..4)
            .map(|s| values(n, 40 + s, 1.0).iter().map(|v| *v as f32).collect())
            .collect();
        for dt in TYPES {
            let run = |d: &candle_core::Device| {
                let vars: Vec<Var> = (0..3)
                    .map(|i| {
                        let x = Tensor::from_vec(data[i].clone(), &shape[..], d).unwrap();
                        Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap()
                    })
                    .collect();
                let w = Tensor::from_vec(data[3].clone(), &shape[..], d).unwrap();
                let o = candle_amp::nn::scaled_dot_product_attention(
                    vars[0].as_tensor(),
                    vars[1].as_tensor(),
                    vars[2].as_tensor(),
                    None,
                    causal,
                    scale,
                )
                .unwrap();
                assert_eq!(o.dtype(), dt);
                let loss = (o.to_dtype(DType::F32).unwrap() * &w).unwrap().sum_all().unwrap();
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
                let mut out = vec![f(&o)];
                out.extend(vars.iter().map(|v| f(grads.get(v.as_tensor()).unwrap())));
                out
            };
            let (c, g) = (run(&cpu), run(&dev));
            let rtol = if dt == DType::F32 { 1e-5 } else { common::te_rtol(dt) };
            for (name, (a, b)) in ["O", "dQ", "dK", "dV"].iter().zip(c.iter().zip(&g)) {
                let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                let mut worst = 0f32;
                for (x, y) in a.iter().zip(b) {
                    let bound = 2.0 * rtol * (x.abs() + amax);
                    assert!(
                        (x - y).abs() <= bound,
                        "{shape:?} causal {causal} {dt:?} {name}: cuda {y} vs cpu {x}"
                    );
                    worst = worst.max((x - y).abs() / bound.max(f32::MIN_POSITIVE));
                }
                println!(
                    "{shape:?} causal {causal} {dt:?} {name}: worst error / bound {:.0}%",
                    100.0 * worst
                );
            }
        }
        // Under autocast (O1): f32 inputs, the products in bf16 as `ops::matmul` casts them,
        // the output in bf16 (as the composed path's last product returns it).
        let run_o1 = |d: &candle_core::Device| -> Vec<f32> {
            let _s = candle_amp::autocast::scope(DType::BF16);
            let x: Vec<Tensor> = (0..3)
                .map(|i| Tensor::from_vec(data[i].clone(), &shape[..], d).unwrap())
                .collect();
            let o = candle_amp::nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], None, causal, scale).unwrap();
            assert_eq!(o.dtype(), DType::BF16);
            o.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_device(&cpu)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (a, b) = (run_o1(&cpu), run_o1(&dev));
        let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let rtol = common::te_rtol(DType::BF16);
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 2.0 * rtol * (x.abs() + amax),
                "{shape:?} causal {causal} autocast bf16 O: cuda {y} vs cpu {x}"
            );
        }
    }
}
