//! The CUDA attention kernels without a GPU: `src/kernels/cuda/flash.cu`, unmodified, built with
//! g++ against the CPU grid emulator (`tests/cuda_emu/emu.h`) and launched as the library's
//! plan launches them on a GPU (both tile sizes), checked against an f64 reference: the output
//! O and the rows' log-sum-exp from the forward, dQ, dK and dV from the backward (which reads
//! the forward's O and LSE, as the library's does). Each value must lie within `atol + |ref| *
//! eps` of the type's rounding plus a bound on f32's error derived per value from the
//! magnitudes of the terms summed into it (the kernels sum in another order than the
//! reference). The tensor-core kernels (`flash_mma.cu`) run there too, their `mma` being the PTX
//! ISA's documented fragment layout (`tests/cuda_emu/mma.h`), with the half rounding of P and
//! dS added to the bound. Grouped key/value heads and key lengths run on every kernel set.
//! Needs g++ (C++20). The comparisons with the CPU path on a GPU are in `cuda_flash_device.rs`.

#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;
use std::process::Command;

use candle_amp::testing::{cuda_flash_launches, cuda_flash_launches_grouped};
use candle_core::DType;

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

/// Grouped key/value heads and key lengths of a case: `bh / group` key/value matrices, query
/// matrix `m` reading `m / group`; `lengths[m / heads]` live keys for it (`None`: all `t`).
struct Grouping {
    heads: usize,
    group: usize,
    lengths: Option<Vec<usize>>,
}

impl Grouping {
    /// No grouping, no lengths.
    const NONE: Grouping = Grouping {
        heads: 1,
        group: 1,
        lengths: None,
    };
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
fn reference(
    c: &Case,
    gr: &Grouping,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    o_eps: f64,
    p_eps: f64,
) -> Reference {
    let (t, d, s) = (c.t, c.d, c.scale);
    let n = c.bh * t * d;
    let nkv = n / gr.group;
    let mut r = Reference {
        o: vec![0.0; n],
        lse: vec![0.0; c.bh * t],
        smag: vec![0.0; c.bh * t],
        dq: vec![0.0; n],
        dk: vec![0.0; nkv],
        dv: vec![0.0; nkv],
        o_err: vec![0.0; n],
        dq_err: vec![0.0; n],
        dk_err: vec![0.0; nkv],
        dv_err: vec![0.0; nkv],
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let absdot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f64>();
    for m in 0..c.bh {
        // The key/value matrix this query matrix reads, and its live keys.
        let mk = m / gr.group;
        let nk = gr.lengths.as_ref().map_or(t, |l| l[m / gr.heads].min(t));
        let at = |x: &[f64], m: usize, i: usize| -> Vec<f64> { x[(m * t + i) * d..(m * t + i + 1) * d].to_vec() };
        let (qm, km, vm, dm): (Vec<_>, Vec<_>, Vec<_>, Vec<_>) = (
            (0..t).map(|i| at(q, m, i)).collect(),
            (0..t).map(|i| at(k, mk, i)).collect(),
            (0..t).map(|i| at(v, mk, i)).collect(),
            (0..t).map(|i| at(dout, m, i)).collect(),
        );
        // P, dP, the rows' Delta and their error terms.
        let mut p = vec![vec![0.0; t]; t];
        let mut ds = vec![vec![0.0; t]; t];
        let mut ds_err = vec![vec![0.0; t]; t];
        for i in 0..t {
            // The live keys: a prefix (the length, and the causal mask), empty for a length 0.
            let live = nk.min(if c.causal { i + 1 } else { t });
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
            let cf = if live == 0 {
                0.0 // no term: the output 0 exactly
            } else {
                F32_ERR * (4.0 + 2.0 * smag + lse.abs() + (d as f64).sqrt() + (live as f64).sqrt())
            };
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
        // dK and dV of the key/value matrix: summed over its group's query matrices.
        for j in 0..t {
            for e in 0..d {
                let idx = (mk * t + j) * d + e;
                r.dv[idx] += (0..t).map(|i| p[i][j] * dm[i][e]).sum::<f64>();
                r.dk[idx] += s * (0..t).map(|i| ds[i][j] * qm[i][e]).sum::<f64>();
                let cf = F32_ERR * (4.0 + ((t * gr.group) as f64).sqrt());
                r.dv_err[idx] += (0..t)
                    .map(|i| p[i][j] * dm[i][e].abs() * (cf + p_eps + F32_ERR * (2.0 * r.smag[m * t + i] + 4.0)))
                    .sum::<f64>();
                r.dk_err[idx] += s * (0..t).map(|i| ds_err[i][j] * qm[i][e].abs()).sum::<f64>();
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
    run_launches(c, &Grouping::NONE, launches, dt, dir, seed, false);
}

/// As [`run_case`] for the kernels `launches` (the FMA or the tensor-core ones: a kernel name
/// ending in `m`) and the grouping `gr`; `misalign`: the inputs 2 bytes past a 16-byte boundary
/// (the harness's AMP_EMU_MISALIGN, as a view at an odd offset).
fn run_launches(
    c: &Case,
    gr: &Grouping,
    launches: [(String, u32, u32); 4],
    dt: DType,
    dir: &Path,
    seed: u64,
    misalign: bool,
) {
    let n = c.bh * c.t * c.d;
    let nkv = n / gr.group;
    let [fwd, pre, dkv, dq] = launches;
    let mma = fwd.0.ends_with('m');
    let (qb, qh) = encode(&values(n, seed, 2.0), dt);
    let (kb, kh) = encode(&values(nkv, seed + 1, 2.0), dt);
    let (vb, vh) = encode(&values(nkv, seed + 2, 1.0), dt);
    let (db, dh) = encode(&values(n, seed + 3, 1.0), dt);
    let names = ["q", "k", "v", "do"];
    for (name, bytes) in names.iter().zip([qb, kb, vb, db]) {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let [qp, kp, vp, dp] = names.map(|s| path(&dir.join(s)));
    let (op, lp, gp) = (path(&dir.join("o")), path(&dir.join("lse")), path(&dir.join("dqkv")));
    let lens = match &gr.lengths {
        Some(l) => {
            let bytes: Vec<u8> = l.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
            std::fs::write(dir.join("lens"), bytes).unwrap();
            path(&dir.join("lens"))
        }
        None => "-".to_string(),
    };
    let common = [
        c.bh.to_string(),
        c.t.to_string(),
        c.d.to_string(),
        c.scale.to_string(),
        (c.causal as i32).to_string(),
        gr.heads.to_string(),
        gr.group.to_string(),
        lens,
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
    let r = reference(&Case { scale, ..*c }, gr, &qh, &kh, &vh, &dh, o_eps, p_eps);
    let what = format!(
        "{} {dt:?} bh {} t {} d {} causal {} scale {} heads {} group {} lengths {:?}",
        fwd.0, c.bh, c.t, c.d, c.causal, c.scale, gr.heads, gr.group, gr.lengths
    );
    assert_eq!(g.len(), n + 2 * nkv, "{what}: gradient length");
    let ro = check(&format!("{what} O"), &o, &r.o, &r.o_err, dt);
    // Rows without a live key (a length of 0): LSE -inf exactly; the rest within the bound.
    for (i, (got, want)) in lse.iter().zip(&r.lse).enumerate() {
        assert_eq!(
            *want == f64::NEG_INFINITY,
            *got == f64::NEG_INFINITY,
            "{what} LSE[{i}]: {got} vs {want}"
        );
    }
    let finite = |x: &[f64]| -> Vec<f64> { x.iter().map(|v| if v.is_finite() { *v } else { 0.0 }).collect() };
    let lse_err: Vec<f64> = finite(&r.lse)
        .iter()
        .zip(&r.smag)
        .map(|(l, s)| F32_ERR * (4.0 + 2.0 * s + l.abs() + (c.d as f64).sqrt()))
        .collect();
    let rl = check(
        &format!("{what} LSE"),
        &finite(&lse),
        &finite(&r.lse),
        &lse_err,
        DType::F32,
    );
    let rq = check(&format!("{what} dQ"), &g[..n], &r.dq, &r.dq_err, dt);
    let rk = check(&format!("{what} dK"), &g[n..n + nkv], &r.dk, &r.dk_err, dt);
    let rv = check(&format!("{what} dV"), &g[n + nkv..], &r.dv, &r.dv_err, dt);
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
        run_launches(c, &Grouping::NONE, launches, *dt, &dir, 200 + k as u64, false);
    }
    // Inputs not 16-byte aligned: the tiles are loaded 16 bits at a time.
    #[rustfmt::skip]
    let cases = [
        (Case { bh: 1, t: 70, d: 128, causal: true, scale: 0.0884, small: false }, DType::BF16),
        (Case { bh: 2, t: 17, d: 64, causal: false, scale: 0.2, small: false }, DType::F16),
    ];
    for (k, (c, dt)) in cases.iter().enumerate() {
        let launches = cuda_flash_launches(c.bh, c.t, c.d, *dt, None, true).expect("a plan");
        run_launches(c, &Grouping::NONE, launches, *dt, &dir, 300 + k as u64, true);
    }
}

/// Grouped-query attention and key lengths on the emulator, every kernel set (the small and the
/// large FMA tile, the tensor-core kernels): 4 query heads over 4, 2 or 1 key/value heads, a
/// batch of 4 with key lengths 0, 1, `t` and one in between (a null pointer for none once),
/// causal or not. The reference sums each key/value head's dK and dV over its group; a length
/// of 0 must give output 0, LSE -inf and gradients 0 (within the type's rounding: exactly 0).
#[test]
fn grouped_heads_and_key_lengths_on_the_emulator() {
    let dir = cuda_emu::scratch("flash", "gqa");
    let mut seed = 500;
    for (kv, (t, d)) in [4usize, 2, 1]
        .into_iter()
        .zip([(17usize, 64usize), (70, 128), (45, 64)])
    {
        let (b, heads) = (4usize, 4usize);
        let group = heads / kv;
        for causal in [false, true] {
            let lengths = if kv == 1 && causal {
                None
            } else {
                Some(vec![0, 1, t, t / 2 + 3])
            };
            let gr = Grouping { heads, group, lengths };
            let c = Case {
                bh: b * heads,
                t,
                d,
                causal,
                scale: 0.125,
                small: false,
            };
            // (kernel set, type): the FMA tiles in f32 and one half type, the tensor cores in
            // the other.
            let sets = [(Some(true), DType::F32), (Some(false), DType::BF16), (None, DType::F16)];
            for (small, dt) in sets {
                let launches =
                    cuda_flash_launches_grouped(c.bh, group, t, d, dt, small, small.is_none()).expect("a plan");
                assert_eq!(launches[0].0.ends_with('m'), small.is_none(), "{launches:?}");
                // One block per key/value matrix and key tile in the dK/dV pass.
                let bc = match (small, d) {
                    (Some(true), _) => 8,
                    (Some(false), 64) => 32,
                    (Some(false), _) => 16,
                    (None, _) => 64,
                };
                assert_eq!(launches[2].1 as usize, b * kv * t.div_ceil(bc), "{launches:?}");
                run_launches(&c, &gr, launches, dt, &dir, seed, false);
                seed += 10;
            }
        }
    }
}

/// The head dimensions besides 64 and 128 on every kernel set (the small and the large FMA
/// tile, the tensor-core kernels), against the f64 reference: those with kernels of their own
/// (32, 48, 80, 96) and some that run on the next larger kernel with zero columns (8 and 24 on
/// 32's, 40 on 48's, 72 on 80's, 104 on 128's), whose columns past `d` must be neither read
/// nor written (the harness fails a write past an output's end). Each dimension runs one case
/// per set: grouped heads on every set, key lengths (0, 1, `t` and one between) on the large
/// tile and the tensor cores, causal or not, rows not a multiple of any tile; half inputs not
/// 16-byte aligned once (the tensor-core kernels' 16-bit loads).
#[test]
fn every_head_dimension_on_the_emulator() {
    let dir = cuda_emu::scratch("flash", "dims");
    let mut seed = 700;
    for d in [32usize, 48, 80, 96, 8, 24, 40, 72, 104] {
        let (b, heads) = (2usize, 4usize);
        let scale = 1.0 / (d as f64).sqrt();
        // (kernel set, type, t, causal, group, lengths)
        #[rustfmt::skip]
        let sets = [
            (Some(true), DType::F32, 17, true, 2, None),
            (Some(false), DType::BF16, 45, false, 4, Some(vec![0, 45])),
            (None, if d % 16 == 0 { DType::F16 } else { DType::BF16 }, 70, true, 2, Some(vec![1, 40])),
        ];
        for (small, dt, t, causal, group, lengths) in sets {
            let c = Case {
                bh: b * heads,
                t,
                d,
                causal,
                scale,
                small: small == Some(true),
            };
            let launches = cuda_flash_launches_grouped(c.bh, group, t, d, dt, small, small.is_none()).expect("a plan");
            assert_eq!(launches[0].0.ends_with('m'), small.is_none(), "{launches:?}");
            let gr = Grouping { heads, group, lengths };
            // The tensor-core kernels once with inputs at an odd offset.
            let misalign = small.is_none() && d == 40;
            run_launches(&c, &gr, launches, dt, &dir, seed, misalign);
            seed += 10;
        }
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
            .args(["1", "17", "64", "0.125", "1", "1", "1", "-"])
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
    #[rustfmt::skip]
    let sizes = [
        (1usize, 64usize), (17, 64), (1024, 64), (70, 128), (4096, 128),
        (33, 32), (70, 48), (1024, 80), (17, 96), (300, 8), (45, 40), (90, 104), (20, 120),
    ];
    for (t, d) in sizes {
        // The kernels' head dimension: the smallest of those compiled at least d.
        let kd = [32usize, 48, 64, 80, 96, 128].into_iter().find(|&k| k >= d).unwrap();
        for small in [None, Some(true), Some(false)] {
            let [fwd, pre, dkv, dq] = cuda_flash_launches(12, t, d, DType::BF16, small, false).unwrap();
            for l in [&fwd, &dkv, &dq] {
                assert!(l.0.contains(&format!("_bf16_d{kd}")), "d {d}: {l:?}");
            }
            assert_eq!(pre.0, "amp_flash_bwd_pre_bf16");
            let (br, bc) = match (kd, fwd.0.ends_with('s')) {
                (_, true) => (8, 8),
                (..=64, false) => (32, 32),
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
    for (t, d, kd, dt) in [
        (1usize, 64usize, 64usize, DType::F16),
        (130, 128, 128, DType::BF16),
        (1024, 64, 64, DType::BF16),
        (100, 32, 32, DType::F16),
        (64, 80, 80, DType::BF16),
        (65, 88, 96, DType::F16),
        (7, 16, 32, DType::BF16),
    ] {
        let [fwd, pre, dkv, dq] = cuda_flash_launches(12, t, d, dt, None, true).unwrap();
        for l in [&fwd, &dkv, &dq] {
            assert!(l.0.ends_with(&format!("_d{kd}m")), "{l:?}");
            assert_eq!((l.1 as usize, l.2), (12 * t.div_ceil(64), 128), "{l:?}");
        }
        assert!(pre.1 as usize * pre.2 as usize / 32 >= 12 * t, "{pre:?}");
    }
    assert!(
        !cuda_flash_launches(96, 1024, 64, DType::F32, None, true).unwrap()[0]
            .0
            .ends_with('m')
    );
    // No kernel: a head dimension not a multiple of 8 or past 128, another type, an empty tensor.
    for d in [0usize, 4, 12, 100, 127, 136, 256] {
        assert!(cuda_flash_launches(2, 16, d, DType::F32, None, true).is_none(), "d {d}");
        assert!(
            cuda_flash_launches(2, 16, d, DType::BF16, None, true).is_none(),
            "d {d}"
        );
    }
    assert!(cuda_flash_launches(2, 16, 64, DType::F64, None, true).is_none());
    assert!(cuda_flash_launches(0, 16, 64, DType::F32, None, true).is_none());
    assert!(cuda_flash_launches(2, 0, 64, DType::F32, None, true).is_none());
}
