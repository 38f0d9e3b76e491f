//! `nn::SelfAttention`'s options: grouped-query attention (fewer key/value heads), a rotary
//! embedding (candle's `rope` layout, f32 tables) and key padding by lengths, alone and
//! together, causal or not. The fused node (inside a run, the products in half) gives the
//! unfused composition's output and gradients within the half type's rounding (the unfused
//! graph sums the grouped heads' gradients and the three input gradients in half; the fused
//! node in f32), both are checked against an f64 reference of the same function on the values
//! the layers computed with, and the fusion takes effect (one half node in the graph at O1).
//! At O0 the module runs the unfused composition: the same bits as the test's own.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{SelfAttention, key_padding_mask, linear, merge_heads, scaled_dot_product_attention, split_heads};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::{D, DType, Device, Module, Tensor, Var};
use common::{backward_capturing, grid, half_nodes, vals};

/// `force_isa` is process-wide elsewhere; the tests of this file run one at a time too.
static SERIAL: Mutex<()> = Mutex::new(());

const B: usize = 3;
const T: usize = 6;
const DM: usize = 16;
const HEADS: usize = 4;
const HD: usize = DM / HEADS;

/// One configuration: key/value heads, rotary embedding, key lengths, causal.
#[derive(Debug, Clone)]
struct Opts {
    kv: usize,
    rope: bool,
    lengths: Option<Vec<usize>>,
    causal: bool,
}

/// The rotary tables `(T + 2, HD)` in f32, each row's halves equal (Llama's layout).
fn tables(dev: &Device) -> (Tensor, Tensor) {
    let n = T + 2;
    let inv: Vec<f32> = (0..HD / 2)
        .map(|i| 1f32 / 10_000f32.powf(2.0 * i as f32 / HD as f32))
        .collect();
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..n {
        for _ in 0..2 {
            c.extend(inv.iter().map(|f| (p as f32 * f).cos()));
            s.extend(inv.iter().map(|f| (p as f32 * f).sin()));
        }
    }
    (
        Tensor::from_vec(c, (n, HD), dev).unwrap(),
        Tensor::from_vec(s, (n, HD), dev).unwrap(),
    )
}

struct Attn {
    attn: SelfAttention,
    opts: Opts,
    fused: AtomicBool,
}

/// `[-x2, x1]` over the last dimension.
fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    Tensor::cat(
        &[
            &x.narrow(D::Minus1, d / 2, d / 2)?.neg()?,
            &x.narrow(D::Minus1, 0, d / 2)?,
        ],
        D::Minus1,
    )
}

/// Each `(b, kv, t, d)` head repeated `n` times in place.
fn repeat_kv(x: Tensor, n: usize) -> candle_core::Result<Tensor> {
    let (b, kv, t, d) = x.dims4()?;
    Tensor::cat(&vec![&x; n], 2)?.reshape((b, kv * n, t, d))
}

impl Attn {
    /// The options as a user composes them from the public ops.
    fn unfused(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [q, k, v, o] = self.attn.projections();
        let (kv, heads) = (self.opts.kv, self.attn.heads());
        let (b, t, _) = x.dims3()?;
        let q = split_heads(&q.forward(x)?, heads)?;
        let k = split_heads(&k.forward(x)?, kv)?;
        let v = split_heads(&v.forward(x)?, kv)?;
        let (q, k) = match self.attn.rope() {
            Some((c, s)) => {
                let (c, s) = (c.narrow(0, 0, t)?, s.narrow(0, 0, t)?);
                let rope = |x: &Tensor| -> candle_core::Result<Tensor> {
                    let xw = x.to_dtype(DType::F32)?;
                    let y = amp::ops::add(&amp::ops::mul(&xw, &c)?, &amp::ops::mul(&rotate_half(&xw)?, &s)?)?;
                    y.to_dtype(x.dtype())
                };
                (rope(&q)?, rope(&k)?)
            }
            None => (q, k),
        };
        let (k, v) = if kv == heads {
            (k, v)
        } else {
            (repeat_kv(k, heads / kv)?, repeat_kv(v, heads / kv)?)
        };
        let lengths = self.opts.lengths.as_deref();
        let mask = lengths.map(|l| key_padding_mask(l, t, x.device())).transpose()?;
        let mut a = scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), self.opts.causal, None)?;
        if let Some(l) = lengths.filter(|l| l.contains(&0)) {
            let keep: Vec<f32> = l.iter().map(|&n| if n == 0 { 0.0 } else { 1.0 }).collect();
            a = a.broadcast_mul(&Tensor::from_vec(keep, (b, 1, 1, 1), x.device())?.to_dtype(a.dtype())?)?;
        }
        o.forward(&merge_heads(&a)?)
    }
}

impl Module for Attn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused.load(Ordering::Relaxed) {
            self.attn.forward_masked(x, self.opts.lengths.as_deref())
        } else {
            self.unfused(x)
        }
    }
}

/// The largest `|got / scale - want|` over the largest `|want|`.
fn rel_err(got: &[f64], want: &[f64], scale: f64) -> f64 {
    rel_err_floor(got, want, scale, 1e-30)
}

/// [`rel_err`] with the largest `|want|` taken as at least `floor` (the key bias's gradient is
/// 0 in exact arithmetic without a rotation: softmax ignores a row's constant shift).
fn rel_err_floor(got: &[f64], want: &[f64], scale: f64, floor: f64) -> f64 {
    let top = want.iter().fold(0f64, |a, v| a.max(v.abs())).max(floor);
    got.iter()
        .zip(want)
        .fold(0f64, |a, (g, w)| a.max((g / scale - w).abs()))
        / top
}

/// Output, scaled input gradient, master gradients, loss scale, half graph nodes.
type Seen = (Vec<f64>, Vec<f64>, BTreeMap<String, Vec<f64>>, f64, usize);

/// The f64 reference: output, input gradient and parameter gradients of `sum(y * r)`.
fn reference(m: &Attn, dt: DType, x: &Tensor, r: &Tensor) -> (Vec<f64>, Vec<f64>, BTreeMap<String, Vec<f64>>) {
    let dev = Device::Cpu;
    let r64 = |t: &Tensor| Var::from_tensor(&t.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap()).unwrap();
    let x64 = r64(x);
    let names = ["q", "k", "v", "o"];
    let params: Vec<(Var, Var)> = m
        .attn
        .projections()
        .iter()
        .map(|l| (r64(l.weight()), r64(l.bias().unwrap())))
        .collect();
    let lin = |i: usize, h: &Tensor| {
        let (w, b) = &params[i];
        h.broadcast_matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap()
    };
    let split = |h: Tensor, n: usize| {
        h.reshape((B, T, n, HD))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let kv = m.opts.kv;
    let (mut q, mut k, v) = (
        split(lin(0, x64.as_tensor()), HEADS),
        split(lin(1, x64.as_tensor()), kv),
        split(lin(2, x64.as_tensor()), kv),
    );
    if m.opts.rope {
        let (c, s) = tables(&dev);
        let (c, s) = (
            c.narrow(0, 0, T).unwrap().to_dtype(DType::F64).unwrap(),
            s.narrow(0, 0, T).unwrap().to_dtype(DType::F64).unwrap(),
        );
        let rope =
            |x: &Tensor| (x.broadcast_mul(&c).unwrap() + rotate_half(x).unwrap().broadcast_mul(&s).unwrap()).unwrap();
        (q, k) = (rope(&q), rope(&k));
    }
    let (k, v) = (repeat_kv(k, HEADS / kv).unwrap(), repeat_kv(v, HEADS / kv).unwrap());
    let mut s = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap() / (HD as f64).sqrt()).unwrap();
    // A finite mask, so that a row with no live key is uniform (then zeroed) rather than NaN.
    let lengths = m.opts.lengths.clone().unwrap_or(vec![T; B]);
    let mask: Vec<f64> = (0..B * T * T)
        .map(|i| {
            let (bi, qi, ki) = (i / (T * T), i / T % T, i % T);
            if ki >= lengths[bi] || (m.opts.causal && ki > qi) {
                -1e30
            } else {
                0.0
            }
        })
        .collect();
    s = s
        .broadcast_add(&Tensor::from_vec(mask, (B, 1, T, T), &dev).unwrap())
        .unwrap();
    let p = candle_nn::ops::softmax(&s, D::Minus1).unwrap();
    let keep: Vec<f64> = lengths.iter().map(|&n| if n == 0 { 0.0 } else { 1.0 }).collect();
    let a = p
        .matmul(&v)
        .unwrap()
        .broadcast_mul(&Tensor::from_vec(keep, (B, 1, 1, 1), &dev).unwrap())
        .unwrap();
    let a = a
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((B, T, DM))
        .unwrap();
    let y = lin(3, &a);
    let loss = (&y * r.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let mut grads = BTreeMap::new();
    for (n, (w, b)) in names.iter().zip(&params) {
        grads.insert(format!("{n}.weight"), vals(g.get(w.as_tensor()).unwrap()));
        grads.insert(format!("{n}.bias"), vals(g.get(b.as_tensor()).unwrap()));
    }
    (vals(&y), vals(g.get(x64.as_tensor()).unwrap()), grads)
}

fn check(level: OptLevel, half: HalfType, opts: &Opts, device_path: bool) {
    let what = format!("{level:?} {half:?} {opts:?} device_path={device_path}");
    let cfg = AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        .loss_scale(amp::LossScaleSpec::Static(64.0))
        .seed(11);
    let o = opts.clone();
    let (model, mut opt, amp) = amp::initialize(
        move |vb| {
            let kvw = o.kv * HD;
            let mut attn = SelfAttention::new(
                linear(DM, DM, vb.pp("q"))?,
                linear(DM, kvw, vb.pp("k"))?,
                linear(DM, kvw, vb.pp("v"))?,
                linear(DM, DM, vb.pp("o"))?,
                HEADS,
                o.causal,
            )?
            .with_kv_heads(o.kv)?;
            if o.rope {
                let (c, s) = tables(vb.device());
                attn = attn.with_rope(&c, &s)?;
            }
            Ok(Attn {
                attn,
                opts: o,
                fused: AtomicBool::new(true),
            })
        },
        Sgd::new(SgdConfig::new(0.5)).unwrap(),
        cfg,
    )
    .unwrap();
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap()).unwrap();
    let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 6), (B, T, DM), &dev).unwrap();
    let mut once = |fused: bool| -> Seen {
        model.inner().fused.store(fused, Ordering::Relaxed);
        let input = x.as_tensor().affine(1.0, 0.0).unwrap();
        let y = model.forward(&input).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&amp, &loss, &mut opt, x.as_tensor());
        assert!(!report.found_inf, "{what} fused={fused}");
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
        opt.zero_grad();
        (vals(&y), vals(&gx.unwrap()), grads, report.loss_scale as f64, nodes)
    };
    let fused = once(true);
    let plain = once(false);
    assert_eq!(fused.2.len(), 8, "{what}: parameter gradients");
    let m = model.inner();
    if level == OptLevel::O0 {
        // Unfused both ways: the module's composition is the test's, bit for bit.
        assert_eq!(fused.0, plain.0, "{what}: output");
        assert_eq!(fused.1, plain.1, "{what}: input gradient");
        assert_eq!(fused.2, plain.2, "{what}: parameter gradients");
        let (y, gx, gp) = reference(m, DType::F32, x.as_tensor(), &r);
        assert!(rel_err(&fused.0, &y, 1.0) < 1e-5, "{what}: O0 output vs f64");
        assert!(
            rel_err(&fused.1, &gx, fused.3) < 1e-5,
            "{what}: O0 input gradient vs f64"
        );
        let floor = param_floor(&gp);
        for (k, g) in &gp {
            assert!(
                rel_err_floor(&fused.2[k], g, 1.0, floor) < 1e-5,
                "{what}: O0 {k} vs f64"
            );
        }
        return;
    }
    let want = if level == OptLevel::O1 { 1 } else { 2 };
    assert_eq!(fused.4, want, "{what}: half graph nodes (unfused {})", plain.4);
    let dt = half.dtype();
    let (y, gx, gp) = reference(m, dt, x.as_tensor(), &r);
    let bound = if dt == DType::BF16 { 5e-2 } else { 8e-3 };
    let (ef, ep) = (rel_err(&fused.0, &y, 1.0), rel_err(&plain.0, &y, 1.0));
    assert!(
        ef < bound && ep < bound,
        "{what}: output vs f64: fused {ef}, unfused {ep}"
    );
    assert!(
        rel_err(&fused.0, &plain.0, 1.0) < bound,
        "{what}: output fused vs unfused"
    );
    let (ef, ep) = (rel_err(&fused.1, &gx, fused.3), rel_err(&plain.1, &gx, plain.3));
    assert!(ef < bound, "{what}: input gradient vs f64: fused {ef}, unfused {ep}");
    assert!(
        ef <= ep * 2.0 + 1e-3,
        "{what}: input gradient vs f64: fused {ef}, unfused {ep}"
    );
    let floor = param_floor(&gp);
    for (k, g) in &gp {
        let (ef, ep) = (
            rel_err_floor(&fused.2[k], g, 1.0, floor),
            rel_err_floor(&plain.2[k], g, 1.0, floor),
        );
        assert!(ef < bound, "{what}: {k} vs f64: fused {ef}, unfused {ep}");
        // Not where the exact gradient is below the floor (the key bias's: rounding noise).
        let top = g.iter().fold(0f64, |a, v| a.max(v.abs()));
        assert!(
            top < floor || ef <= ep * 2.0 + 1e-3,
            "{what}: {k} vs f64: fused {ef}, unfused {ep}"
        );
    }
}

/// A tenth of the largest parameter gradient: the scale errors are measured against.
fn param_floor(gp: &BTreeMap<String, Vec<f64>>) -> f64 {
    0.1 * gp.values().flatten().fold(0f64, |a, v| a.max(v.abs()))
}

fn configs() -> Vec<Opts> {
    let o = |kv, rope, lengths: Option<&[usize]>, causal| Opts {
        kv,
        rope,
        lengths: lengths.map(<[usize]>::to_vec),
        causal,
    };
    vec![
        o(2, false, None, true),
        o(1, false, None, false),
        o(HEADS, true, None, true),
        o(HEADS, false, Some(&[6, 3, 1]), false),
        o(HEADS, false, Some(&[6, 3, 1]), true),
        o(2, true, Some(&[5, 2, 6]), true),
        // A sequence with no live key (length 0): an attention output of zeros, both ways.
        o(1, true, Some(&[0, 4, 9]), false),
    ]
}

#[test]
fn options_fused_match_the_unfused_composition_and_f64() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for opts in configs() {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2] {
            for half in [HalfType::F16, HalfType::Bf16] {
                check(level, half, &opts, false);
            }
        }
    }
    // The forced device path takes the same node.
    check(OptLevel::O2, HalfType::Bf16, &configs()[5], true);
}

/// Bad options are refused with an error, not a panic; the tables must cover the sequence.
#[test]
fn bad_options_are_errors() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    let l = |r: usize, c: usize| candle_amp::nn::Linear::new(Tensor::ones((r, c), DType::F32, &dev).unwrap(), None);
    // k of 2 heads of width 4 for 4 query heads.
    let attn = SelfAttention::new(l(16, 16), l(8, 16), l(8, 16), l(16, 16), 4, true).unwrap();
    assert_eq!(attn.kv_heads(), 2);
    assert!(attn.clone().with_kv_heads(4).is_err());
    // 3 key/value heads do not divide 4.
    assert!(SelfAttention::new(l(16, 16), l(12, 16), l(12, 16), l(16, 16), 4, true).is_err());
    let (c, s) = tables(&dev);
    assert!(attn.clone().with_rope(&c.narrow(1, 0, 2).unwrap(), &s).is_err());
    let attn = attn.with_rope(&c, &s).unwrap();
    let x = Tensor::zeros((2, T + 3, 16), DType::F32, &dev).unwrap();
    assert!(attn.forward(&x).is_err(), "tables shorter than the sequence");
    let x = Tensor::zeros((2, T, 16), DType::F32, &dev).unwrap();
    assert!(attn.forward_masked(&x, Some(&[1])).is_err(), "one length per sequence");
    assert_eq!(attn.forward_masked(&x, Some(&[1, 9])).unwrap().dims(), [2, T, 16]);
}

/// The half tensors of the loss's graph for `forward` at O1 (where only fused nodes' outputs
/// and a few edges are half), with the kernels on and inside `kernels::plain()`.
fn half_nodes_fused_and_plain<M: Module + 'static>(
    build: impl FnOnce(candle_nn::VarBuilder) -> candle_core::Result<M>,
    input: &Tensor,
) -> (usize, usize) {
    let cfg = AmpConfig::new(OptLevel::O1).half(HalfType::Bf16).verbosity(0).seed(3);
    let (model, _opt, _amp) = amp::initialize(build, Sgd::new(SgdConfig::new(0.1)).unwrap(), cfg).unwrap();
    let count = || {
        let y = model.forward(input).unwrap();
        half_nodes(&y.to_dtype(DType::F32).unwrap().sum_all().unwrap())
    };
    let fused = count();
    let _plain = amp::kernels::plain();
    (fused, count())
}

/// `models::llama` (grouped heads, rotary tables) and `models::bert` (a padding mask of
/// lengths) take the fused attention: per layer it saves the dozen half edges of the unfused
/// attention.
#[test]
fn llama_and_bert_attention_is_one_node() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    let cfg = amp::models::llama::Config {
        hidden_size: 32,
        intermediate_size: 48,
        vocab_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
    };
    let ids = Tensor::new(&[[1u32, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], &dev).unwrap();
    let (fused, plain) = half_nodes_fused_and_plain(move |vb| amp::models::llama::Llama::load(vb, &cfg), &ids);
    assert!(
        fused + 2 * 10 <= plain,
        "llama: half nodes fused {fused}, plain {plain}"
    );
    let cfg = amp::models::bert::Config {
        vocab_size: 50,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 32,
        max_position_embeddings: 8,
        ..Default::default()
    };
    // Padding id 0 at the ends: a prefix mask, taken as key lengths.
    let ids = Tensor::new(&[[5u32, 6, 7, 0], [8, 9, 0, 0]], &dev).unwrap();
    let (fused, plain) = half_nodes_fused_and_plain(move |vb| amp::models::bert::BertModel::load(vb, &cfg), &ids);
    assert!(fused + 2 * 10 <= plain, "bert: half nodes fused {fused}, plain {plain}");
}

/// `nn::Residual` with a grouped, rotary attention body: its fused node (norm + attention +
/// add) gives the unfused layers' output and gradients (everything under `kernels::plain()`)
/// within the half type's rounding, and the body's options are applied (not dropped).
#[test]
fn residual_with_grouped_rotary_attention() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    let run = amp::Amp::new(
        AmpConfig::new(OptLevel::O2)
            .half(HalfType::F16)
            .verbosity(0)
            .loss_scale(amp::LossScaleSpec::Static(64.0))
            .seed(2),
        &dev,
    )
    .unwrap();
    let rng = run.generator("dropout");
    let model = run
        .model(|vb| {
            let (c, s) = tables(vb.device());
            let attn = SelfAttention::new(
                linear(DM, DM, vb.pp("q"))?,
                linear(DM, 2 * HD, vb.pp("k"))?,
                linear(DM, 2 * HD, vb.pp("v"))?,
                linear(DM, DM, vb.pp("o"))?,
                HEADS,
                true,
            )?
            .with_rope(&c, &s)?;
            let norm = candle_amp::nn::layer_norm(DM, 1e-5, vb.pp("ln"))?;
            Ok(candle_amp::nn::Residual::new(
                norm,
                attn,
                candle_amp::nn::Dropout::new(0.0, rng)?,
            ))
        })
        .unwrap();
    let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
    let x = Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap();
    let x = x.to_dtype(DType::F16).unwrap();
    let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 6), (B, T, DM), &dev).unwrap();
    let mut once = |plain: bool| {
        let _p = plain.then(amp::kernels::plain);
        let y = model.forward(&x).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        run.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        let grads: BTreeMap<String, Vec<f64>> = opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
        opt.zero_grad();
        (vals(&y), grads, nodes)
    };
    let (fused, plain) = (once(false), once(true));
    assert!(
        fused.2 + 10 <= plain.2,
        "half nodes fused {}, plain {}",
        fused.2,
        plain.2
    );
    assert!(rel_err(&fused.0, &plain.0, 1.0) < 8e-3, "output");
    let floor = param_floor(&plain.1);
    assert_eq!(fused.1.len(), 10);
    for (k, g) in &plain.1 {
        let e = rel_err_floor(&fused.1[k], g, 1.0, floor);
        assert!(e < 2e-2, "{k}: {e}");
    }
}

/// This process's CPU seconds (user + system, `/proc/self/stat`; 0 where unreadable): on a
/// machine shared with other work, less disturbed than the wall clock.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line: 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds per call of `f` over `n` calls after two warm-ups.
fn cpu_secs_per_call(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    f();
    let start = cpu_secs();
    for _ in 0..n {
        f();
    }
    (cpu_secs() - start) / n as f64
}

/// A quick ratio, not a test: a Llama-shaped attention (width 256, 8 heads, 4 key/value
/// heads, rotary tables, 128 positions, batch 8) forward + backward at O0 and O2 bf16, fused
/// and unfused (the module's options composed from the public ops, the kernels on), and a two-layer `models::llama` training step. Run alone in release on one
/// thread: `RAYON_NUM_THREADS=1 cargo test --release --test fused_attention_options --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn ratio_llama_shaped_attention() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    const D: usize = 256;
    const H: usize = 8;
    const KV: usize = 4;
    const TT: usize = 128;
    const BB: usize = 8;
    let hd = D / H;
    let dev = Device::Cpu;
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1f32 / 10_000f32.powf(2.0 * i as f32 / hd as f32))
        .collect();
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..TT {
        for _ in 0..2 {
            c.extend(inv.iter().map(|f| (p as f32 * f).cos()));
            s.extend(inv.iter().map(|f| (p as f32 * f).sin()));
        }
    }
    let cos = Tensor::from_vec(c, (TT, hd), &dev).unwrap();
    let sin = Tensor::from_vec(s, (TT, hd), &dev).unwrap();
    let x = Tensor::from_vec(grid(BB * TT * D, 1.0 / 16.0, 16, 5), (BB, TT, D), &dev).unwrap();
    let r = Tensor::from_vec(grid(BB * TT * D, 1.0 / 64.0, 8, 6), (BB, TT, D), &dev).unwrap();
    println!("isa {:?}", amp::kernels::detected_isa());
    let mut base = 0.0;
    for (level, fused) in [(OptLevel::O0, false), (OptLevel::O2, false), (OptLevel::O2, true)] {
        let (cos, sin) = (cos.clone(), sin.clone());
        let cfg = AmpConfig::new(level).half(HalfType::Bf16).verbosity(0).seed(1);
        let (model, mut opt, amp) = amp::initialize(
            move |vb| {
                let attn = SelfAttention::new(
                    candle_amp::nn::linear_no_bias(D, D, vb.pp("q"))?,
                    candle_amp::nn::linear_no_bias(D, KV * hd, vb.pp("k"))?,
                    candle_amp::nn::linear_no_bias(D, KV * hd, vb.pp("v"))?,
                    candle_amp::nn::linear_no_bias(D, D, vb.pp("o"))?,
                    H,
                    true,
                )?
                .with_kv_heads(KV)?
                .with_rope(&cos, &sin)?;
                Ok(Attn {
                    attn,
                    opts: Opts {
                        kv: KV,
                        rope: true,
                        lengths: None,
                        causal: true,
                    },
                    fused: AtomicBool::new(fused),
                })
            },
            Sgd::new(SgdConfig::new(0.0)).unwrap(),
            cfg,
        )
        .unwrap();
        let step = || {
            let y = model.forward(&x).unwrap();
            let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            opt.zero_grad();
        };
        let _ = &model;
        let secs = cpu_secs_per_call(30, step);
        if level == OptLevel::O0 {
            base = secs;
        }
        println!(
            "attention {level:?} {}: {:.1} ms CPU fwd+bwd ({:.2}x O0)",
            if fused { "fused" } else { "unfused" },
            secs * 1e3,
            secs / base
        );
    }
    let cfg = amp::models::llama::Config {
        hidden_size: D,
        intermediate_size: 688,
        vocab_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: H,
        num_key_value_heads: Some(KV),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: TT + 1,
        tie_word_embeddings: false,
    };
    let ids: Vec<u32> = (0..BB * (TT + 1)).map(|i| (i * 7919 % 512) as u32).collect();
    let ids = Tensor::from_vec(ids, (BB, TT + 1), &dev).unwrap();
    for level in [OptLevel::O0, OptLevel::O2] {
        let cfg_l = cfg.clone();
        let acfg = AmpConfig::new(level).half(HalfType::Bf16).verbosity(0).seed(1);
        let (model, mut opt, amp) = amp::initialize(
            move |vb| amp::models::llama::Llama::load(vb, &cfg_l),
            amp::optim::AdamW::new(Default::default()).unwrap(),
            acfg,
        )
        .unwrap();
        let step = || {
            let logits = model.forward(&ids.narrow(1, 0, TT).unwrap()).unwrap();
            let loss = amp::ops::cross_entropy(&logits, &ids.narrow(1, 1, TT).unwrap()).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        };
        let secs = cpu_secs_per_call(10, step);
        if level == OptLevel::O0 {
            base = secs;
        }
        println!(
            "llama 2 layers step {level:?}: {:.1} ms CPU ({:.2}x O0)",
            secs * 1e3,
            secs / base
        );
    }
}
