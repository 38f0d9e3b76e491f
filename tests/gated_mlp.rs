//! `nn::GatedMlp` (SwiGLU, GeGLU, ReGLU): the block as one node of the run gives the same
//! output and parameter gradients, bit for bit, as its layers and ops one by one, at every
//! level, in f16 and bf16, on every instruction-set tier the CPU has; the input's gradient
//! (its two parts summed in f32 and rounded once, where candle rounds each part and the sum)
//! within the half type's rounding; on the CPU pipeline and the forced device path. Both
//! are checked against f64 arithmetic; the weight gradients reach the run in f32 (not
//! rounded to half); and the fusion takes effect: the loss's graph has four fewer half
//! tensors (six at O1). `nn::Residual` takes the block as its body.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{Activation, GateActivation, GatedMlp, Linear, gated_mlp};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, LossScaleSpec, OptLevel, kernels, ops};
use candle_core::{DType, Device, Module, Tensor, Var};
use common::{backward_capturing, each_tier, grid, half_nodes, t2, vals};

/// `force_isa` is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const B: usize = 2;
const T: usize = 12;
const D: usize = 40;
const H: usize = 48;

struct Block {
    mlp: GatedMlp,
    /// Which of the two the model's forward runs: the module, or its parts one by one.
    fused: AtomicBool,
    /// One by one, SiLU as `ops::silu` (candle's `silu`) instead of `kernels::silu`.
    candle_silu: AtomicBool,
}

impl Block {
    fn unfused(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let m = &self.mlp;
        let g = m.gate().forward(x)?;
        let a = match m.activation() {
            GateActivation::Silu if self.candle_silu.load(Ordering::Relaxed) => ops::silu(&g)?,
            GateActivation::Silu => ops::call("silu", &[&g], |t| kernels::silu(&t[0]))?,
            GateActivation::Gelu => ops::gelu(&g)?,
            _ => ops::relu(&g)?,
        };
        let u = m.up().forward(x)?;
        m.down().forward(&ops::mul(&a, &u)?)
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused.load(Ordering::Relaxed) {
            self.mlp.forward(x)
        } else {
            self.unfused(x)
        }
    }
}

/// One forward and backward: the output, the input's gradient, the master gradients (f64
/// values), the loss scale, the half tensors of the loss's graph.
struct Seen {
    y: Vec<f64>,
    gx: Option<Vec<f64>>,
    grads: BTreeMap<String, Vec<f64>>,
    scale: f64,
    nodes: usize,
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The type the block computes in at `level`.
fn computes_in(level: OptLevel, half: HalfType) -> DType {
    if level == OptLevel::O0 {
        DType::F32
    } else {
        half.dtype()
    }
}

#[allow(clippy::too_many_arguments)]
fn check(level: OptLevel, half: HalfType, act: GateActivation, bias: bool, data: bool, device_path: bool, what: &str) {
    let cfg = AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .loss_scale(LossScaleSpec::Static(256.0))
        .verbosity(0)
        .seed(11);
    let (model, mut opt, amp) = amp::initialize(
        |vb| {
            Ok(Block {
                mlp: gated_mlp(D, H, act, bias, vb.pp("mlp"))?,
                fused: AtomicBool::new(true),
                candle_silu: AtomicBool::new(false),
            })
        },
        Sgd::new(SgdConfig::new(0.5)).unwrap(),
        cfg,
    )
    .unwrap();
    let x = Var::from_tensor(&t2(&grid(B * T * D, 0.125, 16, 3), B * T, D).reshape((B, T, D)).unwrap()).unwrap();
    let r = t2(&grid(B * T * D, 1.0 / 64.0, 8, 4), B * T, D)
        .reshape((B, T, D))
        .unwrap();
    let mut once = |fused: bool| -> Seen {
        model.inner().fused.store(fused, Ordering::Relaxed);
        let x_in = if data {
            x.as_tensor().detach()
        } else {
            x.as_tensor().affine(1.0, 0.0).unwrap()
        };
        let y = model.forward(&x_in).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&amp, &loss, &mut opt, x.as_tensor());
        assert!(!report.found_inf, "{what}");
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
        opt.zero_grad();
        Seen {
            y: vals(&y),
            gx: gx.as_ref().map(vals),
            grads,
            scale: report.loss_scale as f64,
            nodes,
        }
    };
    let fused = once(true);
    let plain = once(false);
    assert_eq!(bits(&fused.y), bits(&plain.y), "{what}: output");
    let mut names = vec!["mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"];
    if bias {
        names.extend(["mlp.down_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias"]);
        names.sort();
    }
    assert_eq!(fused.grads.keys().collect::<Vec<_>>(), names, "{what}");
    for (k, v) in &fused.grads {
        assert_eq!(bits(v), bits(&plain.grads[k]), "{what}: {k} gradient");
    }
    let dt = computes_in(level, half);
    // The input's gradient: fused, its gate and up parts are summed in f32 and rounded once;
    // one by one each part is rounded, then their sum (at O1, in f32 after the casts' backward).
    assert_eq!(fused.gx.is_some(), !data, "{what}: input gradient present");
    if let (Some(a), Some(b)) = (&fused.gx, &plain.gx) {
        if level == OptLevel::O0 {
            assert_eq!(bits(a), bits(b), "{what}: input gradient");
        } else {
            let ulp = if dt == DType::BF16 {
                2f64.powi(-8)
            } else {
                2f64.powi(-11)
            };
            let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (i, (p, q)) in a.iter().zip(b).enumerate() {
                // Three roundings apart at most, each of a part no larger than the largest.
                assert!(
                    (p - q).abs() <= 3.0 * ulp * scale,
                    "{what}: input gradient {i}: {p} vs {q}"
                );
            }
        }
    }
    // The point of the fusion: the gate's and up's outputs, the activation and the product are
    // no half edges of the graph (at O1 neither are the input's two half copies, one for
    // the gate and one for up), where the block
    // fuses: in half, and with the activation in half (GELU under autocast runs in f32).
    let fuses = level != OptLevel::O0 && !(level == OptLevel::O1 && act == GateActivation::Gelu);
    let fewer = match (fuses, level) {
        (false, _) => 0,
        (true, OptLevel::O1) if !data => 6,
        (true, _) => 4,
    };
    assert_eq!(fused.nodes + fewer, plain.nodes, "{what}: half graph nodes");
    // The weight gradients went to the run in f32: not every value is one of the half type's.
    // (The bias gradients here are sums of few short values, exact in half too.)
    if fuses && level != OptLevel::O1 {
        for (k, v) in fused.grads.iter().filter(|(k, _)| k.ends_with("weight")) {
            let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
            let rounded = vals(&t.to_dtype(dt).unwrap());
            assert_ne!(bits(v), bits(&rounded), "{what}: {k} gradient rounded to half");
        }
    }
    reference(&model, &x, &r, &fused, dt, what);
}

/// The f64 forward and backward of the block on the values it computes with (parameters
/// and input rounded to `dt`): output, input gradient and parameter gradients within the
/// half type's precision of the block's (relative to each tensor's largest value).
fn reference(model: &amp::AmpModel<Block>, x: &Var, r: &Tensor, seen: &Seen, dt: DType, what: &str) {
    let m = &model.inner().mlp;
    let f64_of = |t: &Tensor| t.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap();
    let lin = |x: &Tensor, l: &Linear| {
        let y = x.broadcast_matmul(&f64_of(l.weight()).t().unwrap()).unwrap();
        match l.bias() {
            Some(b) => y.broadcast_add(&f64_of(b)).unwrap(),
            None => y,
        }
    };
    let xv = f64_of(x.as_tensor()).reshape((B * T, D)).unwrap();
    let g = lin(&xv, m.gate());
    let u = lin(&xv, m.up());
    let (a, da) = match m.activation() {
        GateActivation::Silu => {
            let s = (g.neg().unwrap().exp().unwrap() + 1.0).unwrap().recip().unwrap();
            let a = (&g * &s).unwrap();
            let d = (&s * ((&g * (1.0 - &s).unwrap()).unwrap() + 1.0).unwrap()).unwrap();
            (a, d)
        }
        GateActivation::Gelu => {
            let cdf = (((&g / 2f64.sqrt()).unwrap().erf().unwrap() + 1.0).unwrap() * 0.5).unwrap();
            let pdf = ((&g * &g).unwrap() * -0.5).unwrap().exp().unwrap() / (2.0 * std::f64::consts::PI).sqrt();
            ((&g * &cdf).unwrap(), (&cdf + (&g * pdf.unwrap()).unwrap()).unwrap())
        }
        _ => (g.relu().unwrap(), g.gt(0.0).unwrap().to_dtype(DType::F64).unwrap()),
    };
    let p = (&a * &u).unwrap();
    let y = lin(&p, m.down());
    let dy = r.to_dtype(DType::F64).unwrap().reshape((B * T, D)).unwrap();
    let dp = dy.matmul(&f64_of(m.down().weight())).unwrap();
    let du = (&dp * &a).unwrap();
    let dg = ((&dp * &u).unwrap() * &da).unwrap();
    let dx = (dg.matmul(&f64_of(m.gate().weight())).unwrap() + du.matmul(&f64_of(m.up().weight())).unwrap()).unwrap();
    let mut want = BTreeMap::new();
    for (name, d, input) in [("down", &dy, &p), ("gate", &dg, &xv), ("up", &du, &xv)] {
        want.insert(
            format!("mlp.{name}_proj.weight"),
            vals(&d.t().unwrap().matmul(input).unwrap()),
        );
        want.insert(format!("mlp.{name}_proj.bias"), vals(&d.sum(0).unwrap()));
    }
    let tol = match dt {
        DType::BF16 => 3e-2,
        DType::F16 => 4e-3,
        _ => 1e-5,
    };
    let close = |got: &[f64], want: &[f64], which: &str| {
        assert_eq!(got.len(), want.len(), "{what}: {which}");
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        let err = got.iter().zip(want).fold(0f64, |m, (g, w)| m.max((g - w).abs())) / scale;
        assert!(err < tol, "{what}: {which} vs f64: {err}");
    };
    close(&seen.y, &vals(&y), "output");
    if let Some(gx) = &seen.gx {
        // candle's gradient of the scaled loss.
        let gx: Vec<f64> = gx.iter().map(|v| v / seen.scale).collect();
        close(&gx, &vals(&dx), "input gradient");
    }
    for (k, v) in &seen.grads {
        close(v, &want[k], k);
    }
}

#[test]
fn the_fused_block_matches_its_layers_one_by_one_everywhere() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    each_tier(|isa| {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            for half in [HalfType::F16, HalfType::Bf16] {
                for act in [GateActivation::Silu, GateActivation::Gelu, GateActivation::Relu] {
                    for (bias, data, device_path) in [
                        (false, false, false),
                        (true, false, false),
                        (true, true, false),
                        (true, false, true),
                    ] {
                        let what = format!(
                            "{level:?} {half:?} {act:?} {isa:?} bias={bias} data={data} device_path={device_path}"
                        );
                        check(level, half, act, bias, data, device_path, &what);
                    }
                }
            }
        }
    });
}

/// Outside a run (plain candle use) the block is the same function of its layers; one row,
/// an empty batch and a gate with an activation of its own (which runs unfused) work.
#[test]
fn outside_a_run_and_edge_cases() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    let w = |v: &[f32], r: usize, c: usize| Tensor::from_vec(v.to_vec(), (r, c), &dev).unwrap();
    let gate = Linear::new(w(&[1., -1., 0.5, 2.], 2, 2), None);
    let up = Linear::new(w(&[2., 1., -1., 3.], 2, 2), None);
    let down = Linear::new(w(&[1., 1.], 1, 2), None);
    let mlp = GatedMlp::new(gate.clone(), up.clone(), down.clone(), GateActivation::Silu);
    let x = Tensor::new(&[[1f32, -2.], [0.5, 3.]], &dev).unwrap();
    let y = mlp.forward(&x).unwrap();
    let g = gate.forward(&x).unwrap();
    let want = down
        .forward(&(kernels::silu(&g).unwrap() * up.forward(&x).unwrap()).unwrap())
        .unwrap();
    assert_eq!(y.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
    let row = mlp.forward(&Tensor::new(&[1f32, -2.], &dev).unwrap()).unwrap();
    assert_eq!(row.dims(), [1]);
    let empty = mlp.forward(&Tensor::zeros((0, 2), DType::F32, &dev).unwrap()).unwrap();
    assert_eq!(empty.dims(), [0, 1]);
    let own = GatedMlp::new(gate.with_activation(Activation::Relu), up, down, GateActivation::Gelu);
    assert_eq!(own.forward(&x).unwrap().dims(), [2, 1]);
    assert_eq!(own.activation(), GateActivation::Gelu);
}

/// Inside a run at O2: one row, an empty batch and a batch of rank 4 give the unfused
/// block's values.
#[test]
fn shapes_inside_a_run() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = AmpConfig::new(OptLevel::O2).half(HalfType::Bf16).verbosity(0).seed(3);
    let (model, _opt, _amp) = amp::initialize(
        |vb| {
            Ok(Block {
                mlp: gated_mlp(D, H, GateActivation::Silu, true, vb.pp("mlp"))?,
                fused: AtomicBool::new(true),
                candle_silu: AtomicBool::new(false),
            })
        },
        Sgd::new(SgdConfig::new(0.5)).unwrap(),
        cfg,
    )
    .unwrap();
    for dims in [vec![D], vec![0, D], vec![2, 3, 2, D]] {
        let n: usize = dims.iter().product();
        let x = Tensor::from_vec(grid(n, 0.125, 16, 9), dims.as_slice(), &Device::Cpu).unwrap();
        model.inner().fused.store(true, Ordering::Relaxed);
        let a = model.forward(&x).unwrap();
        model.inner().fused.store(false, Ordering::Relaxed);
        let b = model.forward(&x).unwrap();
        assert_eq!(a.dims(), b.dims(), "{dims:?}");
        assert_eq!(bits(&vals(&a)), bits(&vals(&b)), "{dims:?}");
    }
}

/// A quick ratio, not a benchmark: a Llama-shaped block (d 256, hidden 768, batch 8 x 128
/// positions) forward and backward at O0 and O2 bf16, fused and one by one. Run in release
/// on one thread: `RAYON_NUM_THREADS=1 cargo test --release --test gated_mlp -- --ignored
/// --nocapture` (candle's products read the same variable).
#[test]
#[ignore = "timing; run by hand in release"]
fn llama_shaped_step_times() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    const D: usize = 256;
    const H: usize = 768;
    let x = Tensor::from_vec(grid(8 * 128 * D, 1.0 / 16.0, 16, 1), (8, 128, D), &Device::Cpu).unwrap();
    let r = Tensor::from_vec(grid(8 * 128 * D, 1.0 / 256.0, 8, 2), (8, 128, D), &Device::Cpu).unwrap();
    let mut o0 = None;
    for (level, fused, candle_silu) in [
        (OptLevel::O0, false, true),
        (OptLevel::O2, true, false),
        (OptLevel::O2, false, false),
        (OptLevel::O2, false, true),
    ] {
        let cfg = AmpConfig::new(level).half(HalfType::Bf16).verbosity(0).seed(1);
        let (model, mut opt, amp) = amp::initialize(
            |vb| {
                Ok(Block {
                    mlp: gated_mlp(D, H, GateActivation::Silu, false, vb.pp("mlp"))?,
                    fused: AtomicBool::new(fused),
                    candle_silu: AtomicBool::new(candle_silu),
                })
            },
            Sgd::new(SgdConfig::new(0.0)).unwrap(),
            cfg,
        )
        .unwrap();
        let mut times = Vec::new();
        for i in 0..12 {
            let t0 = std::time::Instant::now();
            let xv = Var::from_tensor(&x).unwrap();
            let y = model.forward(xv.as_tensor()).unwrap();
            let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            opt.zero_grad();
            if i >= 2 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let base = *o0.get_or_insert(med);
        let how = match (fused, candle_silu) {
            (true, _) => "fused",
            (false, false) => "one by one, kernels::silu",
            (false, true) => "one by one, candle's silu (ops::silu)",
        };
        println!(
            "{level:?} bf16 {how}: {:.2} ms, {:.2}x O0 (tier {:?})",
            med * 1e3,
            med / base,
            kernels::detected_isa()
        );
    }
}

/// `nn::Residual` with a gated MLP body, against the norm, the block (itself fused where it
/// applies), the dropout and the add one by one, with the same dropout mask: the same
/// output, input gradient and block parameter gradients (numbers; a zero's sign may differ,
/// candle adds gradients into zeros); the norm's parameter gradients are the f32 sums the
/// unfused norm rounds to half at O2/O3. Fused, the sub-layer leaves fewer half tensors.
#[test]
fn a_residual_sub_layer_with_a_gated_body() {
    use candle_amp::nn::{Dropout, Residual, layer_norm};
    use candle_nn::ModuleT;
    struct Sub {
        res: Residual,
        norm: candle_amp::nn::LayerNorm,
        mlp: GatedMlp,
        drop: Dropout,
        rng: amp::Generator,
        fused: AtomicBool,
    }
    impl Module for Sub {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            if self.fused.load(Ordering::Relaxed) {
                return self.res.forward_t(x, true);
            }
            let h = self.mlp.forward(&self.norm.forward(x)?)?;
            ops::add(x, &self.drop.forward_t(&h, true)?)
        }
    }
    let same = |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y);
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            for act in [GateActivation::Silu, GateActivation::Gelu] {
                let what = format!("{level:?} {half:?} {act:?}");
                let scale = 64.0;
                let cfg = AmpConfig::new(level)
                    .half(half)
                    .verbosity(0)
                    .loss_scale(LossScaleSpec::Static(scale))
                    .seed(5);
                let run = amp::Amp::new(cfg, &Device::Cpu).unwrap();
                let rng = run.generator("dropout");
                let model = run
                    .model(|vb| {
                        let norm = layer_norm(D, 1e-5, vb.pp("ln"))?;
                        let mlp = gated_mlp(D, H, act, true, vb.pp("mlp"))?;
                        let drop = Dropout::new(0.25, rng.clone())?;
                        Ok(Sub {
                            res: Residual::new(norm.clone(), mlp.clone(), drop.clone()),
                            norm,
                            mlp,
                            drop,
                            rng: rng.clone(),
                            fused: AtomicBool::new(true),
                        })
                    })
                    .unwrap();
                let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
                let x = Var::from_tensor(&t2(&grid(B * T * D, 0.125, 16, 5), B * T, D).reshape((B, T, D)).unwrap())
                    .unwrap();
                let r = t2(&grid(B * T * D, 1.0 / 64.0, 8, 6), B * T, D)
                    .reshape((B, T, D))
                    .unwrap();
                let state = rng.snapshot();
                let mut once = |fused: bool| {
                    let m = model.inner();
                    m.fused.store(fused, Ordering::Relaxed);
                    m.rng.restore(state.clone());
                    let input = x.as_tensor().affine(1.0, 0.0).unwrap();
                    let input = if matches!(level, OptLevel::O2 | OptLevel::O3) {
                        input.to_dtype(half.dtype()).unwrap()
                    } else {
                        input
                    };
                    let y = model.forward(&input).unwrap();
                    let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
                    let nodes = half_nodes(&loss);
                    let (report, gx) = backward_capturing(&run, &loss, &mut opt, x.as_tensor());
                    assert!(!report.found_inf, "{what}");
                    let grads: BTreeMap<String, Vec<f64>> =
                        opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
                    opt.zero_grad();
                    (vals(&y), vals(&gx.expect("input gradient")), grads, nodes)
                };
                let fused = once(true);
                let plain = once(false);
                assert!(same(&fused.0, &plain.0), "{what}: output");
                assert!(same(&fused.1, &plain.1), "{what}: input gradient");
                assert_eq!(fused.2.len(), 8, "{what}");
                for (k, g) in &fused.2 {
                    let p = &plain.2[k];
                    if k.starts_with("ln.") && matches!(level, OptLevel::O2 | OptLevel::O3) {
                        let t = Tensor::new(g.as_slice(), &Device::Cpu).unwrap();
                        let rounded = ((t * scale as f64).unwrap().to_dtype(half.dtype()).unwrap())
                            .to_dtype(DType::F64)
                            .unwrap();
                        assert!(
                            same(&vals(&(rounded / scale as f64).unwrap()), p),
                            "{what}: {k} rounded"
                        );
                    } else {
                        assert!(same(g, p), "{what}: {k}");
                    }
                }
                let fuses = level != OptLevel::O0 && !(level == OptLevel::O1 && act == GateActivation::Gelu);
                if fuses {
                    assert!(fused.3 < plain.3, "{what}: half nodes {} vs {}", fused.3, plain.3);
                } else {
                    assert_eq!(fused.3, plain.3, "{what}: half nodes");
                }
            }
        }
    }
}
