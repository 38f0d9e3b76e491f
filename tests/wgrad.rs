//! `candle_amp::nn::Linear`'s parameter gradients outside candle's graph: in a run, at the
//! levels where a half copy is involved, the weight and bias gradients are the products' f32
//! accumulations, stashed for the backward pipeline, never rounded to half and never in the
//! `GradStore`. Checked against an f64 reference and finite differences at every level, in
//! f16 and bf16, on every instruction-set tier the CPU has, on the CPU and the forced device
//! path; with a tied weight, a checkpointed segment, a frozen parameter, `GradScaler`, an
//! overflow only the stashed gradient shows, stale stashes, and plain candle use.

mod common;

use std::sync::Mutex;

use candle_amp::nn::{Linear, linear, linear_no_bias};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::recompute::Recompute;
use candle_amp::{self as amp, AmpConfig, GradScaler, HalfType, LossScaleSpec, OptLevel};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use common::{grid, t2, vals};

/// `force_isa` is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const M: usize = 32;
const K: usize = 40;
const N: usize = 24;
const LEVELS: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];
const HALVES: [HalfType; 2] = [HalfType::F16, HalfType::Bf16];

/// max |a - b| / max |b|.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

struct One {
    fc: Linear,
}

impl Module for One {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc.forward(x)
    }
}

fn config(level: OptLevel, half: HalfType, device_path: bool) -> AmpConfig {
    AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        .seed(3)
}

fn sgd() -> Sgd {
    Sgd::new(SgdConfig::new(0.5)).unwrap()
}

/// The type the layer computes in at `level`.
fn compute_dtype(level: OptLevel, half: HalfType) -> DType {
    if level == OptLevel::O0 {
        DType::F32
    } else {
        half.dtype()
    }
}

/// The weight as the layer computes with it (the half copy at O1), in f64.
fn computed(t: &Tensor, dt: DType) -> Vec<f64> {
    vals(&t.to_dtype(dt).unwrap())
}

/// `sum(y * r)` in f64 for the model's output `y`.
fn loss_f64(y: &Tensor, r: &[f32]) -> f64 {
    vals(y).iter().zip(r).map(|(a, b)| a * *b as f64).sum()
}

/// One configuration: the layer's gradients against the f64 reference (weight and bias to
/// f32 accuracy, the input to the half type's), against finite differences, and with no
/// gradient of the parameters in the `GradStore` at O1-O3.
fn check(level: OptLevel, half: HalfType, device_path: bool, what: &str) {
    let (model, mut opt, amp) = amp::initialize(
        |vb| {
            Ok(One {
                fc: linear(K, N, vb.pp("fc"))?,
            })
        },
        sgd(),
        config(level, half, device_path),
    )
    .unwrap();
    let dt = compute_dtype(level, half);
    let xv = Var::from_tensor(&t2(&grid(M * K, 0.125, 16, 1), M, K)).unwrap();
    let r = grid(M * N, 1.0 / 64.0, 8, 2);
    let rt = t2(&r, M, N);
    let (w, b) = (
        model.inner().fc.weight().clone(),
        model.inner().fc.bias().unwrap().clone(),
    );
    let y = model.forward(&xv.as_tensor().affine(1.0, 0.0).unwrap()).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &rt).unwrap().sum_all().unwrap();
    let mut seen = None;
    let report = amp
        .scale_loss(&loss, &mut opt)
        .unwrap()
        .backward_with(|l| {
            let g = l.backward()?;
            seen = Some((
                g.get(xv.as_tensor()).cloned(),
                g.get(&w).map(|g| g.dtype()),
                g.get(&b).map(|g| g.dtype()),
            ));
            Ok(g)
        })
        .unwrap();
    assert!(!report.found_inf, "{what}");
    assert!(report.warnings.is_empty(), "{what}: {:?}", report.warnings);
    let (gx, gw_store, gb_store) = seen.unwrap();
    if level == OptLevel::O0 {
        assert_eq!((gw_store, gb_store), (Some(DType::F32), Some(DType::F32)), "{what}");
    } else {
        // The point of the change: candle never accumulated a parameter gradient.
        assert_eq!(
            (gw_store, gb_store),
            (None, None),
            "{what}: parameter gradients in the GradStore"
        );
    }
    // The reference in f64 from the values the layer computed with.
    let x = computed(xv.as_tensor(), dt);
    let wv = computed(&w, dt);
    let mut gw = vec![0f64; N * K];
    let mut gb = vec![0f64; N];
    let mut gxr = vec![0f64; M * K];
    for m in 0..M {
        for i in 0..N {
            let g = r[m * N + i] as f64;
            gb[i] += g;
            for j in 0..K {
                gw[i * K + j] += g * x[m * K + j];
                gxr[m * K + j] += g * wv[i * K + j];
            }
        }
    }
    let master = opt.master_grads();
    let (mw, mb) = (vals(&master["fc.weight"]), vals(&master["fc.bias"]));
    // f32 accumulation of exact products: far inside half rounding (2^-9 for f16, 2^-7 bf16).
    assert!(
        rel_err(&mw, &gw) < 2e-6,
        "{what}: weight gradient {}",
        rel_err(&mw, &gw)
    );
    assert!(rel_err(&mb, &gb) < 2e-6, "{what}: bias gradient {}", rel_err(&mb, &gb));
    let xtol = match dt {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2,
    };
    // The GradStore holds gradients of the scaled loss.
    let inv = 1.0 / report.loss_scale as f64;
    let gx: Vec<f64> = vals(&gx.expect("the input's gradient"))
        .iter()
        .map(|g| g * inv)
        .collect();
    assert!(
        rel_err(&gx, &gxr) < xtol,
        "{what}: input gradient {}",
        rel_err(&gx, &gxr)
    );
    // Finite differences: the loss is linear in each parameter, so a step of 1 is exact up to
    // the output's rounding.
    let fd_tol = match dt {
        DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        _ => 6e-2,
    };
    let store = amp.store().clone();
    let scale_w = gw.iter().fold(0f64, |m, v| m.max(v.abs()));
    let loss_now = |x: &Tensor| loss_f64(&model.forward(x).unwrap(), &r);
    let x0 = xv.as_tensor().detach();
    let base = loss_now(&x0);
    for (name, idx, reference, scale) in [
        ("fc.weight", 5usize, &mw, scale_w),
        ("fc.weight", 7 * K + 11, &mw, scale_w),
        ("fc.bias", 3, &mb, scale_w),
    ] {
        let p = store.param(name).unwrap();
        let old = p.f32_value().unwrap().copy().unwrap();
        let mut v = vals(&old);
        let before = computed(p.working(), dt)[idx];
        v[idx] += 1.0;
        let shape = old.shape().clone();
        let new = Tensor::from_vec(v.iter().map(|a| *a as f32).collect::<Vec<_>>(), shape, &Device::Cpu).unwrap();
        store.write_f32(name, &new).unwrap();
        let step = computed(store.param(name).unwrap().working(), dt)[idx] - before;
        let fd = (loss_now(&x0) - base) / step;
        store.write_f32(name, &old).unwrap();
        assert!(
            (fd - reference[idx]).abs() <= fd_tol * scale,
            "{what}: {name}[{idx}] finite difference {fd} vs gradient {}",
            reference[idx]
        );
    }
}

#[test]
fn gradients_match_f64_reference_and_finite_differences_everywhere() {
    let _s = serial();
    common::each_tier(|isa| {
        for level in LEVELS {
            for half in HALVES {
                for device_path in [false, true] {
                    check(
                        level,
                        half,
                        device_path,
                        &format!("{level:?} {half:?} {isa:?} device_path={device_path}"),
                    );
                }
            }
        }
    });
}

/// The layer applied to two row blocks and its weight used once more through `ops::matmul`
/// (a graph node in half): all three contributions add up.
struct Tied {
    fc: Linear,
}

impl Module for Tied {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let a = self.fc.forward(&x.narrow(0, 0, M)?)?;
        let b = self.fc.forward(&x.narrow(0, M, M)?)?;
        let c = amp::ops::matmul(&x.narrow(0, 2 * M, M)?, &self.fc.weight().t()?)?;
        Tensor::cat(&[a, b, c], 0)
    }
}

#[test]
fn a_tied_weight_gets_every_contribution() {
    let _s = serial();
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in HALVES {
            let what = format!("{level:?} {half:?}");
            let (model, mut opt, amp) = amp::initialize(
                |vb| {
                    Ok(Tied {
                        fc: linear_no_bias(K, N, vb.pp("fc"))?,
                    })
                },
                sgd(),
                // The matmul's weight gradient is rounded to half in candle's graph: a static
                // scale keeps it in f16's range.
                config(level, half, false).loss_scale(LossScaleSpec::Static(8.0)),
            )
            .unwrap();
            let dt = compute_dtype(level, half);
            let xt = t2(&grid(3 * M * K, 0.125, 16, 4), 3 * M, K);
            let r = grid(3 * M * N, 1.0 / 64.0, 8, 5);
            let y = model.forward(&xt).unwrap();
            let loss = (y.to_dtype(DType::F32).unwrap() * t2(&r, 3 * M, N))
                .unwrap()
                .sum_all()
                .unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            let x = computed(&xt, dt);
            let mut gw = vec![0f64; N * K];
            for m in 0..3 * M {
                for i in 0..N {
                    for j in 0..K {
                        gw[i * K + j] += r[m * N + i] as f64 * x[m * K + j];
                    }
                }
            }
            let mw = vals(&opt.master_grads()["fc.weight"]);
            // The matmul's contribution is rounded to half in candle's graph.
            let tol = if half == HalfType::F16 { 2e-3 } else { 1e-2 };
            assert!(rel_err(&mw, &gw) < tol, "{what}: {}", rel_err(&mw, &gw));
        }
    }
}

struct Two {
    a: Linear,
    b: Linear,
    rc: Option<Recompute>,
}

impl ModuleT for Two {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = amp::ops::relu(&self.a.forward(x)?)?;
        match &self.rc {
            Some(rc) => Ok(rc.checkpoint(&self.b, &h, train)?),
            None => self.b.forward(&h),
        }
    }
}

fn two(vb: VarBuilder) -> candle_core::Result<Two> {
    Ok(Two {
        a: linear(K, N, vb.pp("a"))?,
        b: linear(N, N, vb.pp("b"))?,
        rc: None,
    })
}

/// Master gradients after one backward of `sum(y * r)` through [`Two`].
fn two_grads(level: OptLevel, half: HalfType, ck: bool) -> Vec<(String, Vec<u32>)> {
    let (mut model, mut opt, amp) = amp::initialize(two, sgd(), config(level, half, false)).unwrap();
    let rc = Recompute::new(&amp);
    if ck {
        model.inner_mut().rc = Some(rc.clone());
    }
    let x = t2(&grid(M * K, 0.125, 16, 6), M, K);
    let r = t2(&grid(M * N, 1.0 / 64.0, 8, 7), M, N);
    let y = model.forward(&x).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * r).unwrap().sum_all().unwrap();
    let guard = amp.scale_loss(&loss, &mut opt).unwrap();
    let report = if ck {
        guard.backward_with(|l| rc.backward(l)).unwrap()
    } else {
        guard.backward().unwrap()
    };
    assert!(!report.found_inf);
    opt.master_grads()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|f| f.to_bits())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn a_checkpointed_segment_gives_the_same_gradients() {
    let _s = serial();
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in HALVES {
            let plain = two_grads(level, half, false);
            assert_eq!(plain.len(), 4);
            assert_eq!(two_grads(level, half, true), plain, "{level:?} {half:?}");
        }
    }
}

#[test]
fn a_frozen_parameter_gets_no_gradient_and_nothing_stale_is_left() {
    let _s = serial();
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        let what = format!("{level:?}");
        let (model, mut opt, amp) = amp::initialize(
            |vb| {
                Ok(One {
                    fc: linear(K, N, vb.pp("fc"))?,
                })
            },
            sgd(),
            config(level, HalfType::Bf16, false),
        )
        .unwrap();
        let x = t2(&grid(M * K, 0.125, 16, 8), M, K);
        let r = t2(&grid(M * N, 1.0 / 64.0, 8, 9), M, N);
        let loss_of = || {
            (model.forward(&x).unwrap().to_dtype(DType::F32).unwrap() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let bias_bits = || common_bits(&amp.store().param("fc.bias").unwrap().f32_value().unwrap());
        assert_eq!(amp.store().set_frozen(|n| n == "fc.bias", true), 1);
        let before = bias_bits();
        let report = amp.scale_loss(&loss_of(), &mut opt).unwrap().backward().unwrap();
        assert!(report.warnings.is_empty(), "{what}: {:?}", report.warnings);
        assert!(!opt.master_grads().contains_key("fc.bias"), "{what}");
        let w_once = common_bits(&opt.master_grads()["fc.weight"]);
        opt.step().unwrap();
        opt.zero_grad();
        assert_eq!(bias_bits(), before, "{what}: a frozen bias changed");
        // Unfrozen: its gradient is one backward's, and a plain backward's stash (no stage
        // took it) does not leak into the next step.
        amp.store().set_frozen(|n| n == "fc.bias", false);
        drop(loss_of().backward().unwrap());
        amp.scale_loss(&loss_of(), &mut opt).unwrap().backward().unwrap();
        let gb = vals(&opt.master_grads()["fc.bias"]);
        let rv = vals(&r);
        let reference: Vec<f64> = (0..N).map(|i| (0..M).map(|m| rv[m * N + i]).sum()).collect();
        assert!(
            rel_err(&gb, &reference) < 1e-6,
            "{what}: bias {}",
            rel_err(&gb, &reference)
        );
        // The loss is linear in the weight, so its gradient does not depend on it: the same
        // bits as the first backward's (a stale stash would have doubled it).
        assert_eq!(common_bits(&opt.master_grads()["fc.weight"]), w_once, "{what}");
    }
}

fn common_bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|f| f.to_bits())
        .collect()
}

#[test]
fn grad_scaler_picks_up_the_stashed_gradients() {
    let _s = serial();
    for level in [OptLevel::O1, OptLevel::O2] {
        for half in HALVES {
            let what = format!("{level:?} {half:?}");
            let run = |scaler: bool| {
                let cfg = config(level, half, false);
                let (model, mut opt, amp) = amp::initialize(two, sgd(), cfg).unwrap();
                let x = t2(&grid(M * K, 0.125, 16, 10), M, K);
                let r = t2(&grid(M * N, 1.0 / 64.0, 8, 11), M, N);
                let loss = (model.forward(&x).unwrap().to_dtype(DType::F32).unwrap() * r)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                if scaler {
                    let mut s = GradScaler::new();
                    let grads = s.scale(&loss).unwrap().backward().unwrap();
                    assert!(grads.get(model.inner().a.weight()).is_none(), "{what}");
                    s.step(&mut opt, &grads).unwrap();
                    s.update(None).unwrap();
                } else {
                    amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
                    opt.step().unwrap();
                }
                amp.store()
                    .params()
                    .iter()
                    .map(|p| common_bits(&p.f32_value().unwrap()))
                    .collect::<Vec<_>>()
            };
            let (a, b) = (run(true), run(false));
            assert_eq!(a, b, "{what}: GradScaler's step differs from the guard's");
            let (_, _, fresh) = amp::initialize(two, sgd(), config(level, half, false)).unwrap();
            let init: Vec<_> = fresh
                .store()
                .params()
                .iter()
                .map(|p| common_bits(&p.f32_value().unwrap()))
                .collect();
            assert_ne!(a, init, "{what}: nothing trained");
        }
    }
}

#[test]
fn an_overflow_only_in_the_stashed_gradient_skips_the_step() {
    let _s = serial();
    for level in [OptLevel::O1, OptLevel::O2] {
        for device_path in [false, true] {
            let what = format!("{level:?} device_path={device_path}");
            let (model, mut opt, amp) = amp::initialize(
                |vb| {
                    Ok(One {
                        fc: linear(K, N, vb.pp("fc"))?,
                    })
                },
                sgd(),
                config(level, HalfType::F16, device_path),
            )
            .unwrap();
            // The input is data (no gradient of its own): the loss is finite, and its upstream
            // gradient 4 * 65536 overflows f16, so only the parameters' gradients are inf.
            let x = t2(&grid(M * K, 0.125, 16, 12), M, K);
            let loss = (model.forward(&x).unwrap().to_dtype(DType::F32).unwrap() * 4.0)
                .unwrap()
                .sum_all()
                .unwrap();
            let before: Vec<_> = amp.store().params().iter().map(|p| common_bits(p.working())).collect();
            let mut seen = 0;
            let report = amp
                .scale_loss(&loss, &mut opt)
                .unwrap()
                .backward_with(|l| {
                    let g = l.backward()?;
                    // Every float gradient (the scaled loss's marker, a u8 variable, names
                    // the backward: see GradScaler's rule on stashed gradients).
                    seen = g
                        .get_ids()
                        .filter(|id| g.get_id(**id).unwrap().dtype() != DType::U8)
                        .count();
                    Ok(g)
                })
                .unwrap();
            assert_eq!(seen, 0, "{what}: the GradStore holds gradients");
            if !device_path {
                assert!(report.found_inf, "{what}");
                assert!(
                    report.nonfinite.contains(&"fc.weight".to_string()),
                    "{what}: {:?}",
                    report.nonfinite
                );
            }
            let out = opt.step().unwrap();
            assert!(matches!(out, amp::StepOutcome::Skipped { .. }), "{what}: {out:?}");
            let after: Vec<_> = amp.store().params().iter().map(|p| common_bits(p.working())).collect();
            assert_eq!(after, before, "{what}: weights changed");
        }
    }
}

#[test]
fn plain_candle_use_keeps_its_gradients() {
    let _s = serial();
    // A layer over a VarMap's variables, inside a run's autocast scope and outside any scope:
    // its gradients are in the GradStore (nothing is stashed away from a plain backward).
    let (_, _, amp) = amp::initialize(
        |vb| {
            Ok(One {
                fc: linear(K, N, vb.pp("fc"))?,
            })
        },
        sgd(),
        config(OptLevel::O1, HalfType::Bf16, false),
    )
    .unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &Device::Cpu);
        let fc = linear(K, N, vb.pp("fc")).unwrap();
        let x = t2(&grid(M * K, 0.125, 16, 13), M, K).to_dtype(dtype).unwrap();
        for in_run in [false, true] {
            let _scope = in_run.then(|| amp.autocast());
            let y = fc.forward(&x).unwrap();
            let g = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(g.get(fc.weight()).is_some(), "{dtype:?} in_run={in_run}");
            assert!(g.get(fc.bias().unwrap()).is_some(), "{dtype:?} in_run={in_run}");
        }
    }
}

/// The layer's backward widens its output gradient once for the weight's and the input's
/// products and the bias's sums; the same values, bit for bit, as each widening it itself.
/// An empty batch and both sizes (the direct loop and the packed product), with and without a bias, the input
/// gradient in the input's type and in f32, in f16 and bf16, on every tier; values from
/// subnormal to large, so a difference in any rounding or flushing would show.
#[test]
fn widening_the_output_gradient_once_changes_no_bit() {
    let _g = serial();
    common::each_tier(|isa| {
        for dt in [DType::F16, DType::BF16] {
            for (m, k, n) in [(0, 4, 5), (3, 4, 5), (64, 96, 80)] {
                let scaled = |len: usize, seed: u64| -> Tensor {
                    // Magnitudes 2^-20 .. 2^6: f16 subnormals included.
                    let v: Vec<f32> = grid(len, 1.0, 1000, seed)
                        .iter()
                        .enumerate()
                        .map(|(i, u)| u / 1000.0 * 2f32.powi((i % 27) as i32 - 20))
                        .collect();
                    Tensor::from_vec(v, len, &Device::Cpu).unwrap().to_dtype(dt).unwrap()
                };
                let x = scaled(m * k, 1).reshape((m, k)).unwrap();
                let w = scaled(n * k, 2).reshape((n, k)).unwrap();
                let b = scaled(n, 3);
                let g = scaled(m * n, 4).reshape((m, n)).unwrap();
                for bias in [Some(&b), None] {
                    for wide in [false, true] {
                        let what = format!("{isa:?} {dt:?} {m}x{k}x{n} bias {} wide {wide}", bias.is_some());
                        let got = amp::testing::linear_backward_both_ways(&x, &w, bias, &g, wide).unwrap();
                        let plain = isa < amp::kernels::Isa::Avx512Bf16;
                        let Some([once, each]) = got else {
                            assert!(dt == DType::BF16 && !plain, "{what}: the widened path did not apply");
                            continue;
                        };
                        assert!(dt == DType::F16 || plain, "{what}: applied with bf16 dot products");
                        assert_eq!(once.len(), 2 + usize::from(bias.is_some()), "{what}");
                        assert_eq!(once.len(), each.len(), "{what}");
                        for (a, e) in once.iter().zip(&each) {
                            assert_eq!((a.dims(), a.dtype()), (e.dims(), e.dtype()), "{what}");
                            assert_eq!(common_bits(a), common_bits(e), "{what}");
                        }
                        let dx = once.last().unwrap();
                        assert_eq!(dx.dtype(), if wide { DType::F32 } else { dt }, "{what}");
                        // Not all zero: the values reached the products (an empty batch has none).
                        assert!(m == 0 || vals(dx).iter().any(|v| *v != 0.0), "{what}");
                    }
                }
            }
        }
    });
}
