//! `nn::Residual`, pre-norm `x + dropout(body(norm(x)))` and post-norm
//! `norm(x + dropout(body(x)))`, with a layer norm or an RMS norm, as one node gives the same
//! output, the same input gradient and the same body parameter gradients as the unfused
//! layers (the norm, the body, `Dropout`, `ops::add`) with the same dropout mask, at every
//! level, in f16 and bf16, for self-attention bodies (plain; grouped-query with rotary tables
//! and key lengths given per call, Llama's and BERT's), MLP bodies (ReLU, GELU) and a SwiGLU
//! body, on every instruction-set tier the CPU has, on the CPU and the forced device path.
//! The norm's weight and bias gradients are the f32 sums the unfused norm rounds to the
//! parameter's type: rounding them gives the unfused ones exactly. The fusion takes effect:
//! the sub-layer leaves one half tensor in the loss's graph where the unfused layers leave
//! at least four. At O0 (the unfused layers) every gradient matches the same sub-layer in f64.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{
    Activation, Dropout, GateActivation, Mlp, NormPlacement, Residual, ResidualBody, ResidualNorm, SelfAttention,
    gated_mlp, layer_norm, linear, rms_norm, self_attention,
};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, Generator, HalfType, OptLevel};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use common::{backward_capturing, each_tier, f64_bits as bits, grid, half_nodes, vals};

/// `force_isa` is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const B: usize = 3;
const T: usize = 6;
const DM: usize = 16;
const SCALE: f64 = 64.0;
/// The rotary body: 4 query heads of width 4 over 2 key/value heads.
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = DM / HEADS;
/// Its key lengths (one per sequence; 5 and 2 pad the tail).
const LENGTHS: [usize; B] = [T, 2, 5];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Self-attention, 2 heads, causal, the module's own options.
    Attention,
    /// Grouped-query self-attention with rotary tables and key lengths given per call.
    Rotary,
    Relu,
    Gelu,
    /// SwiGLU, no biases (Llama's feed-forward).
    Gated,
}

const KINDS: [Kind; 5] = [Kind::Attention, Kind::Rotary, Kind::Relu, Kind::Gelu, Kind::Gated];

/// One sub-layer's shape: body, norm (RMS or layer), placement.
#[derive(Debug, Clone, Copy)]
struct Variant {
    kind: Kind,
    rms: bool,
    post: bool,
}

fn variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for kind in KINDS {
        for rms in [false, true] {
            for post in [false, true] {
                v.push(Variant { kind, rms, post });
            }
        }
    }
    v
}

impl Variant {
    /// The parameters: the body's and the norm's.
    fn n_params(&self) -> usize {
        let body = match self.kind {
            Kind::Attention | Kind::Rotary => 8,
            Kind::Relu | Kind::Gelu => 4,
            Kind::Gated => 3,
        };
        body + if self.rms { 1 } else { 2 }
    }
}

/// Rotary tables `(T, HD)` in f32, each row's halves equal (the `rotate_half` layout).
fn tables(dev: &Device) -> (Tensor, Tensor) {
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..T {
        let angles: Vec<f32> = (0..HD / 2)
            .map(|i| p as f32 / 10_000f32.powf(2.0 * i as f32 / HD as f32))
            .collect();
        for _ in 0..2 {
            c.extend(angles.iter().map(|a| a.cos()));
            s.extend(angles.iter().map(|a| a.sin()));
        }
    }
    let t = |v| Tensor::from_vec(v, (T, HD), dev).unwrap();
    (t(c), t(s))
}

/// The norm and the body of `v` under `vb`.
fn parts(v: Variant, vb: &VarBuilder) -> candle_core::Result<(ResidualNorm, ResidualBody)> {
    let norm: ResidualNorm = if v.rms {
        rms_norm(DM, 1e-5, vb.pp("ln"))?.into()
    } else {
        layer_norm(DM, 1e-5, vb.pp("ln"))?.into()
    };
    let mlp = |act| -> candle_core::Result<ResidualBody> {
        Ok(Mlp::new(vec![
            linear(DM, 2 * DM, vb.pp("up"))?.with_activation(act),
            linear(2 * DM, DM, vb.pp("down"))?,
        ])
        .into())
    };
    let body = match v.kind {
        Kind::Attention => self_attention(DM, 2, true, vb.clone())?.into(),
        Kind::Rotary => SelfAttention::new(
            linear(DM, DM, vb.pp("q"))?,
            linear(DM, KV_HEADS * HD, vb.pp("k"))?,
            linear(DM, KV_HEADS * HD, vb.pp("v"))?,
            linear(DM, DM, vb.pp("o"))?,
            HEADS,
            true,
        )?
        .into(),
        Kind::Relu => mlp(Activation::Relu)?,
        Kind::Gelu => mlp(Activation::Gelu)?,
        Kind::Gated => gated_mlp(DM, 2 * DM, GateActivation::Silu, false, vb.pp("mlp"))?.into(),
    };
    Ok((norm, body))
}

/// The fused module, and the same layers run one by one as a user would write them.
struct Sub {
    res: Residual,
    norm: ResidualNorm,
    body: ResidualBody,
    drop: Dropout,
    rng: Generator,
    /// The rotary body's per-call tables.
    rope: Option<(Tensor, Tensor)>,
    fused: AtomicBool,
}

impl Sub {
    fn new(v: Variant, vb: &VarBuilder, rng: &Generator, p: f64) -> candle_core::Result<Self> {
        let (norm, body) = parts(v, vb)?;
        let drop = Dropout::new(p, rng.clone())?;
        let res = match v.post {
            false => Residual::new(norm.clone(), body.clone(), drop.clone()),
            true => Residual::post_norm(norm.clone(), body.clone(), drop.clone()),
        };
        assert_eq!(res.placement() == NormPlacement::Post, v.post);
        Ok(Sub {
            res,
            norm,
            body,
            drop,
            rng: rng.clone(),
            rope: (v.kind == Kind::Rotary).then(|| tables(vb.device())),
            fused: AtomicBool::new(true),
        })
    }

    fn lengths(&self, x: &Tensor) -> Option<Vec<usize>> {
        self.rope.as_ref().map(|_| LENGTHS[..x.dim(0).unwrap()].to_vec())
    }
}

impl Module for Sub {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let rope = self.rope.as_ref().map(|(c, s)| (c, s));
        let lengths = self.lengths(x);
        if self.fused.load(Ordering::Relaxed) {
            return self.res.forward_with(x, true, rope, lengths.as_deref());
        }
        let body = |h: &Tensor| {
            let y = match &self.body {
                ResidualBody::Attention(a) => a.forward_with(h, rope, lengths.as_deref())?,
                b => b.forward(h)?,
            };
            self.drop.forward_t(&y, true)
        };
        match self.res.placement() {
            NormPlacement::Pre => amp::ops::add(x, &body(&self.norm.forward(x)?)?),
            NormPlacement::Post => self.norm.forward(&amp::ops::add(x, &body(x)?)?),
        }
    }
}

/// Values equal as numbers (a zero's sign may differ: candle adds a gradient into zeros).
fn same(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| f64::from_bits(*x) == f64::from_bits(*y))
}

fn round_scaled(g: &[u64], dt: DType) -> Vec<u64> {
    let v: Vec<f32> = g.iter().map(|b| (f64::from_bits(*b) * SCALE) as f32).collect();
    let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
    let r = (t.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap() / SCALE).unwrap();
    bits(&r)
}

fn run_cfg(level: OptLevel, half: HalfType, device_path: bool) -> AmpConfig {
    AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        .loss_scale(amp::LossScaleSpec::Static(SCALE as f32))
        .seed(5)
}

/// The input (a variable, so its gradient can be read) and the loss's weights.
fn inputs(dev: &Device) -> (Var, Tensor) {
    let x = Var::from_tensor(&Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), dev).unwrap()).unwrap();
    let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 6), (B, T, DM), dev).unwrap();
    (x, r)
}

/// What one forward and backward leaves: output, input gradient, master gradients, the
/// half graph nodes.
type Seen = (Vec<u64>, Option<Vec<u64>>, BTreeMap<String, Vec<u64>>, usize);

fn check(level: OptLevel, half: HalfType, v: Variant, device_path: bool, data: bool, what: &str) {
    let run = amp::Amp::new(run_cfg(level, half, device_path), &Device::Cpu).unwrap();
    let rng = run.generator("dropout");
    let model = run.model(|vb| Sub::new(v, &vb, &rng, 0.25)).unwrap();
    let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
    // The norm's scale and shift away from 1 and 0, so their gradients matter.
    let (x, r) = inputs(&Device::Cpu);
    let state = rng.snapshot();
    let mut once = |fused: bool| -> Seen {
        let m = model.inner();
        m.fused.store(fused, Ordering::Relaxed);
        m.rng.restore(state.clone());
        let input = if data {
            x.as_tensor().detach()
        } else {
            x.as_tensor().affine(1.0, 0.0).unwrap()
        };
        // The residual stream in the level's activation type (half at O2/O3), as after an
        // embedding.
        let input = if matches!(level, OptLevel::O2 | OptLevel::O3) {
            input.to_dtype(half.dtype()).unwrap()
        } else {
            input
        };
        let y = model.forward(&input).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&run, &loss, &mut opt, x.as_tensor());
        let gx = gx.as_ref().map(bits);
        assert!(!report.found_inf, "{what} fused={fused}");
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
        opt.zero_grad();
        (bits(&y), gx, grads, nodes)
    };
    let fused = once(true);
    let plain = once(false);
    assert!(same(&fused.0, &plain.0), "{what}: output");
    assert_eq!(fused.1.is_some(), !data, "{what}: input gradient present");
    if let (Some(a), Some(b)) = (&fused.1, &plain.1) {
        assert!(same(a, b), "{what}: input gradient");
        assert!(
            a.iter().any(|v| f64::from_bits(*v) != 0.0),
            "{what}: a zero input gradient"
        );
    }
    assert_eq!(
        fused.2.keys().collect::<Vec<_>>(),
        plain.2.keys().collect::<Vec<_>>(),
        "{what}"
    );
    assert_eq!(fused.2.len(), v.n_params(), "{what}: parameter gradients");
    let mut fused_at_all = false;
    for (k, g) in &fused.2 {
        let p = &plain.2[k];
        if k.starts_with("ln.") && level != OptLevel::O0 && level != OptLevel::O1 {
            // f32 here; the unfused norm rounds the (scaled) sum to the parameter's half type.
            assert!(same(&round_scaled(g, half.dtype()), p), "{what}: {k} rounded");
            fused_at_all |= !same(g, p);
        } else {
            assert!(same(g, p), "{what}: {k}");
        }
    }
    if level == OptLevel::O0 {
        assert_eq!(fused.3, plain.3, "{what}: O0 runs unfused");
        return;
    }
    // O2/O3: the input and the output are the only half tensors of the graph (the output
    // alone for an input without a gradient); O1: none (the stream is f32).
    let want = match (level, data) {
        (OptLevel::O1, _) => 0,
        (_, true) => 1,
        _ => 2,
    };
    assert_eq!(fused.3, want, "{what}: half graph nodes (unfused {})", plain.3);
    assert!(plain.3 >= want + 2, "{what}: unfused half nodes {}", plain.3);
    // At O2/O3 the norm's gradients are f32 sums, not their half roundings, somewhere.
    assert!(
        fused_at_all || level == OptLevel::O1,
        "{what}: the norm's gradients were rounded"
    );
}

fn everywhere(pick: impl Fn(&Variant) -> bool) {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    each_tier(|isa| {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            for half in [HalfType::F16, HalfType::Bf16] {
                for v in variants().into_iter().filter(&pick) {
                    for (device_path, data) in [(false, false), (true, false), (false, true)] {
                        let what = format!("{level:?} {half:?} {v:?} {isa:?} device_path={device_path} data={data}");
                        check(level, half, v, device_path, data, &what);
                    }
                }
            }
        }
    });
}

#[test]
fn pre_norm_with_a_layer_norm_matches_the_unfused_layers_everywhere() {
    everywhere(|v| !v.rms && !v.post);
}

#[test]
fn pre_norm_with_an_rms_norm_matches_the_unfused_layers_everywhere() {
    everywhere(|v| v.rms && !v.post);
}

#[test]
fn post_norm_matches_the_unfused_layers_everywhere() {
    everywhere(|v| v.post);
}

/// At O0 (f32, the unfused layers) the input's and every parameter's gradient equal the same
/// sub-layer's in f64 (outside a run, the same weights, input and dropout mask) within f32
/// rounding: 1e-4 of the largest magnitude of each.
#[test]
fn gradients_at_o0_match_the_same_sub_layer_in_f64() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    for v in variants() {
        let what = format!("{v:?}");
        let run = amp::Amp::new(run_cfg(OptLevel::O0, HalfType::Bf16, false), &dev).unwrap();
        let rng = run.generator("dropout");
        // p = 0.5: the mask's 2 is exact in every type.
        let model = run.model(|vb| Sub::new(v, &vb, &rng, 0.5)).unwrap();
        let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
        let (x, r) = inputs(&dev);
        let state = rng.snapshot();
        let y = model.forward(&x.as_tensor().affine(1.0, 0.0).unwrap()).unwrap();
        let loss = (&y * &r).unwrap().sum_all().unwrap();
        let (_, gx) = backward_capturing(&run, &loss, &mut opt, x.as_tensor());
        let mut got: BTreeMap<String, Vec<f64>> =
            opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
        got.insert("x".into(), vals(&(gx.unwrap() / SCALE).unwrap()));
        // The same sub-layer in f64, outside any run.
        let vm = VarMap::new();
        {
            let mut data = vm.data().lock().unwrap();
            for p in run.store().params() {
                let t = p.f32_value().unwrap().to_dtype(DType::F64).unwrap();
                data.insert(p.name().to_string(), Var::from_tensor(&t).unwrap());
            }
        }
        let sub64 = Sub::new(v, &VarBuilder::from_varmap(&vm, DType::F64, &dev), &rng, 0.5).unwrap();
        rng.restore(state);
        let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        let y64 = sub64.forward(x64.as_tensor()).unwrap();
        assert_eq!(y64.dtype(), DType::F64, "{what}");
        let g64 = (&y64 * r.to_dtype(DType::F64).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut want: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for (k, var) in vm.data().lock().unwrap().iter() {
            want.insert(k.clone(), vals(g64.get(var).unwrap()));
        }
        want.insert("x".into(), vals(g64.get(x64.as_tensor()).unwrap()));
        assert_eq!(got.len(), v.n_params() + 1, "{what}");
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{what}"
        );
        let largest = |g: &[f64]| g.iter().fold(0f64, |m, x| m.max(x.abs()));
        let global = want.values().map(|g| largest(g)).fold(0f64, f64::max);
        for (k, a) in &got {
            let b = &want[k];
            let scale = largest(b);
            // The key bias's gradient is 0 in exact arithmetic (the softmax ignores a shift
            // shared by a row's scores): f32 leaves rounding noise, measured against the
            // largest gradient of all.
            let scale = if k == "k.bias" { global * 0.1 } else { scale };
            assert!(scale > 0.0, "{what}: {k}: a zero gradient");
            let err = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= 1e-4 * scale, "{what}: {k} off by {err} (largest {scale})");
        }
    }
}

/// An empty batch inside a run at O2 gives what the unfused layers give (an empty output of
/// the same type, zero gradients for the same parameters), for every variant.
#[test]
fn empty_batches_give_what_the_unfused_layers_give() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    for v in variants() {
        let what = format!("{v:?}");
        let run = amp::Amp::new(run_cfg(OptLevel::O2, HalfType::Bf16, false), &dev).unwrap();
        let rng = run.generator("dropout");
        let model = run.model(|vb| Sub::new(v, &vb, &rng, 0.25)).unwrap();
        let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
        let x = Tensor::zeros((0, T, DM), DType::BF16, &dev).unwrap();
        let mut once = |fused: bool| {
            model.inner().fused.store(fused, Ordering::Relaxed);
            let y = model.forward(&x).unwrap();
            let loss = y.to_dtype(DType::F32).unwrap().sum_all().unwrap();
            run.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            let grads: BTreeMap<String, Vec<f64>> =
                opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
            opt.zero_grad();
            (y.dims().to_vec(), y.dtype(), grads)
        };
        let (fused, plain) = (once(true), once(false));
        assert_eq!(fused.0, [0, T, DM], "{what}");
        assert_eq!((&fused.0, fused.1), (&plain.0, plain.1), "{what}");
        assert_eq!(fused.2, plain.2, "{what}");
        assert!(fused.2.values().flatten().all(|g| *g == 0.0), "{what}");
    }
}

/// Outside a run the sub-layer is the unfused function; evaluation draws no mask; a body
/// that changes the shape, and per-call attention options for another body, are typed
/// errors; an empty batch gives an empty result.
#[test]
fn outside_a_run_and_edge_cases() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    let run = amp::Amp::new(OptLevel::O0, &dev).unwrap();
    let rng = run.generator("dropout");
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let norm = layer_norm(8, 1e-5, vb.pp("ln")).unwrap();
    let mlp = Mlp::new(vec![linear(8, 8, vb.pp("l")).unwrap()]);
    let drop = Dropout::new(0.5, rng.clone()).unwrap();
    let res = Residual::new(norm.clone(), mlp.clone(), drop.clone());
    assert_eq!(res.placement(), NormPlacement::Pre);
    let x = Tensor::from_vec(grid(2 * 5 * 8, 0.125, 8, 9), (2, 5, 8), &dev).unwrap();
    let state = rng.snapshot();
    let fused = res.forward_t(&x, true).unwrap();
    rng.restore(state.clone());
    let plain = amp::ops::add(
        &x,
        &drop
            .forward_t(&mlp.forward(&norm.forward(&x).unwrap()).unwrap(), true)
            .unwrap(),
    )
    .unwrap();
    assert!(same(&bits(&fused), &bits(&plain)));
    // Evaluation: no dropout, and the generator is not touched.
    rng.restore(state.clone());
    let eval = res.forward_t(&x, false).unwrap();
    let want = amp::ops::add(&x, &mlp.forward(&norm.forward(&x).unwrap()).unwrap()).unwrap();
    assert!(same(&bits(&eval), &bits(&want)));
    assert_eq!(rng.snapshot(), state);
    // Post-norm in evaluation: the norm of the sum.
    let post = Residual::post_norm(norm.clone(), mlp.clone(), drop.clone());
    let want = norm
        .forward(&amp::ops::add(&x, &mlp.forward(&x).unwrap()).unwrap())
        .unwrap();
    assert!(same(&bits(&post.forward_t(&x, false).unwrap()), &bits(&want)));
    let empty = Tensor::zeros((0, 5, 8), DType::F32, &dev).unwrap();
    assert_eq!(res.forward_t(&empty, true).unwrap().dims(), [0, 5, 8]);
    assert_eq!(post.forward_t(&empty, true).unwrap().dims(), [0, 5, 8]);
    let (c, s) = (
        Tensor::ones((5, 8), DType::F32, &dev).unwrap(),
        Tensor::zeros((5, 8), DType::F32, &dev).unwrap(),
    );
    let err = AmpError::from(res.forward_with(&x, true, Some((&c, &s)), None).unwrap_err());
    assert!(matches!(err, AmpError::InvalidArgument { .. }), "{err}");
    let err = res.forward_with(&x, true, None, Some(&[1, 2])).unwrap_err().to_string();
    assert!(err.contains("self-attention body only"), "{err}");
    let wide = Residual::new(norm, Mlp::new(vec![linear(8, 4, vb.pp("w")).unwrap()]), drop);
    let err = wide.forward_t(&x, true).unwrap_err().to_string();
    assert!(err.contains("input's shape"), "{err}");
}
