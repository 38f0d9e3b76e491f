//! The CUDA multi-tensor optimizer kernels without a GPU: `src/kernels/cuda/multi_tensor.cu`,
//! unmodified, built with g++ against the CPU grid emulator (`tests/cuda_emu/emu.h`) and
//! launched as the library's plan launches it (the plan's own records, with arena offsets in
//! place of device pointers). Each result is checked twice: against an f64 reference with
//! llm.c's rule (`|got - ref| <= atol + |ref| * eps`, eps covering the f32 arithmetic), and bit
//! for bit against the device path's f32 arithmetic (the candle tensor ops' operations in their
//! order, each rounded), which is what the kernels promise. Needs g++ (C++20).
//!
//! Under `CANDLE_AMP_TEST_DEVICE=cuda` the last tests train through the public API on the GPU
//! (the kernels, loaded by NVRTC) and on the CPU, AdamW and SGD at O2, and compare.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;

use candle_amp::testing::cuda_multi_tensor::{
    MtAdamW, MtKernel, MtLaunch, MtLimits, MtRecord, MtSgd, MtUnscale, mt_plan, mt_plan_with, type_code,
};
use candle_core::DType;
use cuda_emu::{decode, encode, values};

/// The tensors' lengths: an empty one (skipped by the plan), one of each small size, one of
/// several chunks.
const LENS: [usize; 5] = [0, 1, 3, 1000, 70000];

/// Device buffers as one host arena; a pointer is an offset plus one (0: none).
#[derive(Default)]
struct Arena(Vec<u8>);

impl Arena {
    fn put(&mut self, b: &[u8]) -> u64 {
        while !self.0.len().is_multiple_of(16) {
            self.0.push(0);
        }
        let at = self.0.len() as u64 + 1;
        self.0.extend_from_slice(b);
        at
    }
    fn f32s(&mut self, v: &[f32]) -> u64 {
        self.put(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }
    fn zeros(&mut self, bytes: usize) -> u64 {
        self.put(&vec![0x7f; bytes])
    }
    fn read(&self, at: u64, bytes: usize) -> &[u8] {
        let a = (at - 1) as usize;
        &self.0[a..a + bytes]
    }
    fn read_f32(&self, at: u64, n: usize) -> Vec<f32> {
        self.read(at, 4 * n)
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

/// Runs `launches` over `arena` (and `flags` for the unscale kernel) on the emulator.
fn run(launches: &[MtLaunch], arena: &mut Arena, flags: &mut [f32], u: MtUnscale, dir: &Path) {
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    std::fs::write(path("arena"), &arena.0).unwrap();
    std::fs::write(
        path("flags"),
        flags.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();
    for l in launches {
        let table: Vec<u8> = l.table.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(path("table"), table).unwrap();
        let args = [
            l.kernel.name().to_string(),
            l.grid.to_string(),
            l.block.to_string(),
            l.chunk.to_string(),
            l.count.to_string(),
            path("table"),
            path("arena"),
            path("flags"),
            u.mode.to_string(),
            format!("{:e}", u.inv),
            format!("{:e}", u.div),
        ];
        cuda_emu::run("multi_tensor", &args);
    }
    arena.0 = std::fs::read(path("arena")).unwrap();
    let f = std::fs::read(path("flags")).unwrap();
    for (d, c) in flags.iter_mut().zip(f.chunks(4)) {
        *d = f32::from_le_bytes(c.try_into().unwrap());
    }
}

/// The value types the tests cycle through.
const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Whether `got` is within llm.c's rule of `want` with relative `eps` (plus a floor `atol`).
fn near(got: f64, want: f64, eps: f64, atol: f64) -> bool {
    (got - want).abs() <= atol + want.abs() * eps || (got.is_nan() && want.is_nan()) || got == want
}

/// The plan skips empty tensors, fills in first blocks in order, and splits at its caps.
#[test]
fn the_plan_skips_empties_and_splits_at_its_caps() {
    let recs: Vec<MtRecord> = [0usize, 5, 40, 0, 17, 33]
        .iter()
        .map(|&n| MtRecord::unscale(1, 0, 0, 1, n as u64, 0))
        .collect();
    let limits = MtLimits {
        chunk: 16,
        block: 32,
        max_tensors: 1024,
        max_blocks: 1 << 20,
    };
    let one = mt_plan_with(MtKernel::UnscaleCheck, recs.clone(), limits);
    assert_eq!(one.len(), 1);
    // 5 -> 1 block, 40 -> 3, 17 -> 2, 33 -> 3.
    assert_eq!((one[0].count, one[0].grid), (4, 9));
    let firsts: Vec<u64> = one[0].table.chunks(16).map(|r| r[8]).collect();
    assert_eq!(firsts, [0, 1, 4, 6]);
    let split = mt_plan_with(
        MtKernel::UnscaleCheck,
        recs.clone(),
        MtLimits {
            max_tensors: 2,
            max_blocks: 4,
            ..limits
        },
    );
    let shape: Vec<(u32, u32)> = split.iter().map(|l| (l.count, l.grid)).collect();
    assert_eq!(shape, [(2, 4), (1, 2), (1, 3)]);
    // Each launch's first blocks start again at 0.
    assert_eq!(split[0].table[16 + 8], 1);
    assert_eq!(split[2].table[8], 0);
    // A tensor past the block cap alone: no plan (the composed ops run).
    let big = vec![MtRecord::unscale(1, 0, 0, 1, 1000, 0)];
    assert!(
        mt_plan_with(
            MtKernel::UnscaleCheck,
            big,
            MtLimits {
                max_blocks: 4,
                ..limits
            }
        )
        .is_empty()
    );
    assert!(mt_plan(MtKernel::AdamW, Vec::new()).is_empty());
    assert_eq!(type_code(DType::F64), None);
}

/// One unscale launch over [`LENS`] (types cycling, every other tensor accumulating into a
/// live master gradient), `poison` writing one raw value of one tensor: the master gradients
/// and the flags the emulator gives, checked against the reference and the device path's f32.
fn check_unscale(scale: f32, lo: f64, poison: Option<(usize, usize, f64)>, name: &str) {
    let dir = cuda_emu::scratch("multi_tensor", name);
    let u = MtUnscale::new(scale);
    let mut arena = Arena::default();
    let mut records = Vec::new();
    let mut inputs = Vec::new();
    for (i, &n) in LENS.iter().enumerate() {
        let dt = TYPES[i % 3];
        let mut v = values(n, 11 + i as u64, lo);
        if let Some((t, at, x)) = poison
            && t == i
        {
            v[at] = x;
        }
        let (bytes, held) = encode(&v, dt);
        let raw = arena.put(&bytes);
        let acc = (i % 2 == 1).then(|| {
            values(n, 101 + i as u64, 2.0)
                .iter()
                .map(|&x| x as f32)
                .collect::<Vec<_>>()
        });
        let ap = acc.as_ref().map_or(0, |a| arena.f32s(a));
        let out = arena.zeros(4 * n);
        records.push(MtRecord::unscale(
            raw,
            type_code(dt).unwrap(),
            ap,
            out,
            n as u64,
            i as u64,
        ));
        inputs.push((held, acc, out));
    }
    let launches = mt_plan(MtKernel::UnscaleCheck, records);
    assert_eq!(launches.len(), 1, "one launch");
    let mut flags = vec![0f32; LENS.len()];
    run(&launches, &mut arena, &mut flags, u, &dir);
    for (i, (held, acc, out)) in inputs.iter().enumerate() {
        let got = arena.read_f32(*out, held.len());
        let mut bad = false;
        for (j, &x) in held.iter().enumerate() {
            let xf = x as f32;
            let g = match u.mode {
                0 => xf,
                1 => xf * u.inv,
                _ => (xf as f64 / u.div) as f32,
            };
            let want = acc.as_ref().map_or(g, |a| a[j] + g);
            assert_eq!(
                got[j].to_bits(),
                want.to_bits(),
                "{name}: tensor {i}[{j}]: {} vs {want}",
                got[j]
            );
            let reference = acc.as_ref().map_or(0.0, |a| a[j] as f64) + x / scale as f64;
            let mag = acc.as_ref().map_or(0.0, |a| a[j].abs() as f64) + (x / scale as f64).abs();
            assert!(
                !want.is_finite() || near(got[j] as f64, reference, 0.0, mag * 1.2e-7 + 1e-44),
                "{name}: tensor {i}[{j}]: {} vs the reference {reference}",
                got[j]
            );
            bad |= !want.is_finite();
        }
        assert_eq!(flags[i].is_nan(), bad, "{name}: flag {i} is {}", flags[i]);
        assert!(flags[i].is_nan() || flags[i] == 0.0, "{name}: flag {i} is {}", flags[i]);
    }
}

#[test]
fn unscale_check_writes_every_master_gradient_and_one_flag_per_tensor() {
    check_unscale(1024.0, 60000.0, None, "mul");
    check_unscale(1.0, 3.0, None, "identity");
    // The f32 inverse of 2^-130 is not finite: g / scale in f64 (finite here: small values).
    check_unscale(2f32.powi(-130), 1e-36, None, "div");
}

#[test]
fn a_nan_or_inf_sets_only_its_tensors_flag() {
    let cases = [
        (3usize, 999usize, f64::NAN, "nan"),
        (4, 69999, f64::INFINITY, "inf_last_chunk"),
        (2, 0, f64::NEG_INFINITY, "neg_inf"),
    ];
    for (t, at, x, name) in cases {
        check_unscale(1024.0, 100.0, Some((t, at, x)), name);
    }
    // A finite raw value whose unscaled value overflows f32 (a scale below 1): flagged too.
    check_unscale(0.5, 3e38, None, "overflow");
}

/// The working copy's type of tensor `i` (none, f16, bf16, f32 in turn).
fn working_type(i: usize) -> Option<DType> {
    [None, Some(DType::F16), Some(DType::BF16), Some(DType::F32)][i % 4]
}

/// `v` rounded to `dt` and back, as the kernels write a working copy.
fn round_to(v: f32, dt: DType) -> f32 {
    match dt {
        DType::F16 => half::f16::from_f32(v).to_f32(),
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// One tensor of a step test: the f32 parameter and its state, as the emulator left them,
/// and the f64 reference's.
struct Param {
    p: Vec<f32>,
    state: Vec<Vec<f32>>,
    p64: Vec<f64>,
    state64: Vec<Vec<f64>>,
}

/// Runs `steps` steps of `kernel` over [`LENS`]: `record` makes a tensor's record from its
/// pointers (param, grad, state in x2, state out x2, working), working type and step; `model`
/// updates one value and its state in the device path's f32 (tensor, `g`, `p`, state, step)
/// and returns the new value, `reference` likewise in f64; `tol` bounds their difference.
#[allow(clippy::type_complexity)]
fn check_steps(
    kernel: MtKernel,
    name: &str,
    nstate: usize,
    record: &dyn Fn(usize, [u64; 7], u64, u64) -> MtRecord,
    model: &dyn Fn(usize, f32, f32, &mut [f32], u64) -> f32,
    reference: &dyn Fn(usize, f64, f64, &mut [f64], u64) -> f64,
    tol: &dyn Fn(usize, f64) -> f64,
) {
    let dir = cuda_emu::scratch("multi_tensor", name);
    let mut params: Vec<Param> = LENS
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p: Vec<f32> = values(n, 7 + i as u64, 1.0).iter().map(|&x| x as f32).collect();
            Param {
                p64: p.iter().map(|&x| x as f64).collect(),
                p,
                state: vec![vec![0.0; n]; nstate],
                state64: vec![vec![0.0; n]; nstate],
            }
        })
        .collect();
    for step in 1..=3u64 {
        let mut arena = Arena::default();
        let mut records = Vec::new();
        let mut at = Vec::new();
        let mut grads = Vec::new();
        for (i, prm) in params.iter().enumerate() {
            let n = prm.p.len();
            let g: Vec<f32> = values(n, 1000 * step + i as u64, 0.5)
                .iter()
                .map(|&x| x as f32)
                .collect();
            let pp = arena.f32s(&prm.p);
            let gp = arena.f32s(&g);
            // The first step reads no state (zeros, or the first momentum).
            let sin: Vec<u64> = prm
                .state
                .iter()
                .map(|s| if step == 1 { 0 } else { arena.f32s(s) })
                .collect();
            let sout: Vec<u64> = prm.state.iter().map(|_| arena.zeros(4 * n)).collect();
            let wt = working_type(i);
            let wp = wt.map_or(0, |dt| arena.zeros(n * dt.size_in_bytes()));
            let s = |v: &[u64], j: usize| v.get(j).copied().unwrap_or(0);
            let ptrs = [pp, gp, s(&sin, 0), s(&sin, 1), s(&sout, 0), s(&sout, 1), wp];
            let code = wt.and_then(type_code).unwrap_or(0);
            records.push(record(i, ptrs, code, step));
            at.push((pp, sout, wp));
            grads.push(g);
        }
        let launches = mt_plan(kernel, records);
        assert_eq!(launches.len(), 1, "{name}: one launch");
        run(&launches, &mut arena, &mut [], MtUnscale::new(1.0), &dir);
        for (i, (prm, ((pp, sout, wp), g))) in params.iter_mut().zip(at.into_iter().zip(grads)).enumerate() {
            let n = prm.p.len();
            let got = arena.read_f32(pp, n);
            let got_state: Vec<Vec<f32>> = sout.iter().map(|&s| arena.read_f32(s, n)).collect();
            for j in 0..n {
                let mut st: Vec<f32> = prm.state.iter().map(|s| s[j]).collect();
                let p = model(i, g[j], prm.p[j], &mut st, step);
                let what = format!("{name} step {step}: tensor {i}[{j}]");
                assert_eq!(
                    got[j].to_bits(),
                    p.to_bits(),
                    "{what}: {} vs the device path's {p}",
                    got[j]
                );
                for (k, s) in st.iter().enumerate() {
                    assert_eq!(got_state[k][j].to_bits(), s.to_bits(), "{what}: state {k}");
                    prm.state[k][j] = *s;
                }
                prm.p[j] = p;
                let mut st64: Vec<f64> = prm.state64.iter().map(|s| s[j]).collect();
                let p64 = reference(i, g[j] as f64, prm.p64[j], &mut st64, step);
                assert!(
                    near(p as f64, p64, 0.0, tol(i, p64)),
                    "{what}: {p} vs the reference {p64}"
                );
                prm.p64[j] = p64;
                for (k, s) in st64.into_iter().enumerate() {
                    prm.state64[k][j] = s;
                }
            }
            if let Some(dt) = working_type(i) {
                let w = decode(arena.read(wp, n * dt.size_in_bytes()), dt);
                for (j, (w, p)) in w.iter().zip(&prm.p).enumerate() {
                    let what = format!("{name} step {step}: working {i}[{j}]");
                    assert_eq!(*w as f32, round_to(*p, dt), "{what}");
                }
            }
        }
    }
}

/// The learning rate and weight decay of tensor `i` (its group's).
fn hyper(i: usize) -> (f64, f64) {
    (1e-2 * (1 + i) as f64, 0.1 / (1 + i % 2) as f64)
}

#[test]
fn adamw_updates_every_tensor_in_one_launch() {
    let (b1, b2, eps) = (0.9, 0.999, 1e-8);
    let consts = |i: usize, step: u64| {
        let (lr, wd) = hyper(i);
        MtAdamW::new(lr, b1, b2, eps, wd, step)
    };
    check_steps(
        MtKernel::AdamW,
        "adamw",
        2,
        &|i, p, code, step| {
            MtRecord::adamw(
                p[0],
                p[1],
                (p[2], p[3]),
                (p[4], p[5]),
                p[6],
                code,
                LENS[i] as u64,
                &consts(i, step),
            )
        },
        // The device path's tensor ops (`AdamW::update`), value by value.
        &|i, g, p, st, step| {
            let c = consts(i, step);
            let nm = st[0] * c.b1.0 + g * c.b1.1;
            let nv = st[1] * c.b2.0 + (g * g) * c.b2.1;
            let (mh, vh) = (nm * c.inv_bc.0, nv * c.inv_bc.1);
            st[0] = nm;
            st[1] = nv;
            p * c.decay - (mh / (vh.sqrt() + c.eps)) * c.lr
        },
        &|i, g, p, st, step| {
            let (lr, wd) = hyper(i);
            let t = step as i32;
            st[0] = b1 * st[0] + (1.0 - b1) * g;
            st[1] = b2 * st[1] + (1.0 - b2) * g * g;
            let (mh, vh) = (st[0] / (1.0 - b1.powi(t)), st[1] / (1.0 - b2.powi(t)));
            p * (1.0 - lr * wd) - lr * mh / (vh.sqrt() + eps)
        },
        &|i, p| p.abs() * 4e-7 + hyper(i).0 * 2e-5,
    );
}

#[test]
fn sgd_updates_every_tensor_in_one_launch() {
    // (momentum, dampening, nesterov): with dampening, Nesterov, and without momentum.
    for (k, (mom, damp, nesterov)) in [(0.9, 0.1, false), (0.9, 0.0, true), (0.0, 0.0, false)]
        .into_iter()
        .enumerate()
    {
        let consts = |i: usize| {
            let (lr, wd) = hyper(i);
            // Tensor 0's group has no weight decay (the path that adds none).
            MtSgd::new(lr, if i.is_multiple_of(3) { 0.0 } else { wd }, mom, damp, nesterov)
        };
        let momentum = mom != 0.0;
        check_steps(
            MtKernel::Sgd,
            &format!("sgd{k}"),
            usize::from(momentum),
            &|i, p, code, _| {
                let out = if momentum { p[4] } else { 0 };
                MtRecord::sgd(p[0], p[1], p[2], out, p[6], code, LENS[i] as u64, &consts(i))
            },
            // The device path's tensor ops (`Sgd::update`), value by value.
            &|i, g, p, st, step| {
                let c = consts(i);
                let mut d = if c.weight_decay != 0.0 {
                    g + p * c.weight_decay
                } else {
                    g
                };
                if let Some(b) = st.first_mut() {
                    let nb = if step == 1 {
                        d
                    } else {
                        *b * c.momentum + d * c.one_minus_dampening
                    };
                    *b = nb;
                    d = if c.nesterov { d + nb * c.momentum } else { nb };
                }
                p - d * c.lr
            },
            &|i, g, p, st, step| {
                let (lr, wd) = hyper(i);
                let wd = if i.is_multiple_of(3) { 0.0 } else { wd };
                let mut d = g + p * wd;
                if let Some(b) = st.first_mut() {
                    *b = if step == 1 { d } else { mom * *b + (1.0 - damp) * d };
                    d = if nesterov { d + mom * *b } else { *b };
                }
                p - lr * d
            },
            &|i, p| p.abs() * 4e-7 + hyper(i).0 * 1e-5,
        );
    }
}

/// Split over several launches by small caps, the kernels give the bits of one launch.
#[test]
fn a_split_plan_gives_the_bits_of_one_launch() {
    let dir = cuda_emu::scratch("multi_tensor", "split");
    let c = MtAdamW::new(1e-2, 0.9, 0.999, 1e-8, 0.1, 2);
    let mut outs = Vec::new();
    for limits in [
        MtLimits::default(),
        MtLimits {
            // Launches [1, 3] (the tensor cap), [1000] (2 blocks: the next needs 137 more),
            // [70000].
            chunk: 512,
            block: 64,
            max_tensors: 2,
            max_blocks: 138,
        },
    ] {
        let mut arena = Arena::default();
        let mut records = Vec::new();
        let mut at = Vec::new();
        for (i, &n) in LENS.iter().enumerate() {
            let f = |seed: u64, lo: f64| values(n, seed, lo).iter().map(|&x| x as f32).collect::<Vec<f32>>();
            let (p, g, m) = (f(i as u64, 1.0), f(50 + i as u64, 0.5), f(90 + i as u64, 0.1));
            let v: Vec<f32> = m.iter().map(|x| x * x).collect();
            let pp = arena.f32s(&p);
            let ptrs = [
                arena.f32s(&g),
                arena.f32s(&m),
                arena.f32s(&v),
                arena.zeros(4 * n),
                arena.zeros(4 * n),
            ];
            let wp = arena.zeros(2 * n);
            records.push(MtRecord::adamw(
                pp,
                ptrs[0],
                (ptrs[1], ptrs[2]),
                (ptrs[3], ptrs[4]),
                wp,
                1,
                n as u64,
                &c,
            ));
            at.push([pp, ptrs[3], ptrs[4]]);
        }
        let launches = mt_plan_with(MtKernel::AdamW, records, limits);
        run(&launches, &mut arena, &mut [], MtUnscale::new(1.0), &dir);
        let got: Vec<Vec<f32>> = at
            .iter()
            .zip(LENS)
            .flat_map(|(a, n)| a.iter().map(|&p| arena.read_f32(p, n)).collect::<Vec<_>>())
            .collect();
        outs.push((launches.len(), got));
    }
    assert_eq!(outs[0].0, 1);
    assert_eq!(outs[1].0, 3, "split into three launches");
    let bits = |v: &Vec<Vec<f32>>| {
        v.iter()
            .map(|t| t.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&outs[0].1), bits(&outs[1].1));
}

/// What an O2 run did: per step whether it skipped, and the masters, working copies and
/// optimizer state at the end.
struct Run {
    skipped: Vec<bool>,
    masters: std::collections::BTreeMap<String, Vec<f32>>,
    working: std::collections::BTreeMap<String, Vec<f32>>,
    state: std::collections::BTreeMap<String, Vec<f32>>,
    host_syncs: u64,
}

/// Six steps at O2 on `dev` through `amp::initialize_on` with AdamW or SGD (momentum, weight
/// decay, Nesterov): the loss of step 3 is NaN (and with f16 the first steps overflow at the
/// initial scale of 2^24), so some steps skip; a skipped step must leave the masters and the
/// working copies bit-identical.
fn train_o2(dev: &candle_core::Device, half: candle_amp::HalfType, adamw: bool) -> Run {
    use candle_amp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
    use candle_amp::{AmpConfig, DynamicParams, LossScaleSpec, OptLevel};
    let config = AmpConfig::new(OptLevel::O2)
        .half(half)
        .verbosity(0)
        .loss_scale(LossScaleSpec::Dynamic)
        .dynamic(DynamicParams {
            init_scale: 16_777_216.0,
            growth_interval: 2,
            ..Default::default()
        });
    let adamw_config = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let sgd_config = SgdConfig {
        momentum: 0.9,
        weight_decay: 0.01,
        nesterov: true,
        ..SgdConfig::new(0.05)
    };
    let build = common::AmpTwoLinear::new;
    let (model, mut opt, amp) = if adamw {
        candle_amp::initialize_on(build, AdamW::new(adamw_config).unwrap(), config, dev).unwrap()
    } else {
        candle_amp::initialize_on(build, Sgd::new(sgd_config).unwrap(), config, dev).unwrap()
    };
    let data = common::batches(6, 3);
    let mut skipped = Vec::new();
    for (s, (x, y)) in data.iter().enumerate() {
        let (x, y) = (x.to_device(dev).unwrap(), y.to_device(dev).unwrap());
        let out = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
        let mut loss = candle_nn::loss::mse(&out, &y).unwrap();
        if s == 3 {
            loss = (loss * f64::NAN).unwrap();
        }
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        let (before, wbefore) = (common::f32_bits(amp.store()), common::working_bits(amp.store()));
        let outcome = opt.step().unwrap();
        if outcome.is_skipped() {
            assert_eq!(common::f32_bits(amp.store()), before, "step {s}: the masters moved");
            assert_eq!(
                common::working_bits(amp.store()),
                wbefore,
                "step {s}: the working copies moved"
            );
        }
        skipped.push(outcome.is_skipped());
        opt.zero_grad();
    }
    let mut state = std::collections::BTreeMap::new();
    for (name, ps) in opt.state_dict().unwrap().algorithm.params {
        for (k, b) in ps.buffers {
            state.insert(format!("{name}.{k}"), common::flat(&b.to_dtype(DType::F32).unwrap()));
        }
    }
    let working = amp
        .store()
        .params()
        .into_iter()
        .map(|p| {
            (
                p.name().to_string(),
                common::flat(&p.working().to_dtype(DType::F32).unwrap()),
            )
        })
        .collect();
    Run {
        skipped,
        masters: common::store_values(amp.store()),
        working,
        state,
        host_syncs: amp.host_syncs(),
    }
}

/// On a GPU the kernels do the unscale and the step; the run ends where the CPU's does.
#[test]
fn cuda_o2_adamw_and_sgd_match_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_multi_tensor_loaded(&dev),
        "the CUDA multi-tensor kernels did not load (see the log's warning)"
    );
    for half in [candle_amp::HalfType::F16, candle_amp::HalfType::Bf16] {
        for adamw in [true, false] {
            let what = format!("{half:?} adamw={adamw}");
            let gpu = train_o2(&dev, half, adamw);
            let cpu = train_o2(&candle_core::Device::Cpu, half, adamw);
            assert_eq!(gpu.skipped, cpu.skipped, "{what}: the same steps skip");
            assert!(
                gpu.skipped[3] && gpu.skipped.iter().any(|s| !s),
                "{what}: {:?}",
                gpu.skipped
            );
            // cuBLAS and other summation orders in the forward and backward: the test
            // tolerance of the half type, compounded over the steps.
            let tol = common::tol(half.dtype());
            let dm = common::max_rel_diff(&gpu.masters, &cpu.masters, 1e-3);
            assert!(dm <= tol, "{what}: masters differ by {dm}");
            let dw = common::max_rel_diff(&gpu.working, &cpu.working, 1e-3);
            assert!(dw <= 2.0 * tol, "{what}: working copies differ by {dw}");
            let ds = common::max_rel_diff(&gpu.state, &cpu.state, 1e-3);
            assert!(ds <= 10.0 * tol, "{what}: optimizer state differs by {ds}");
            assert_eq!(gpu.host_syncs, 6, "{what}: one host read per step");
        }
    }
}
