//! `nn::Residual::forward_stack`: consecutive residual sub-layers run as one graph node give,
//! bit for bit, what calling each sub-layer's `forward_with` in turn gives (the output, every
//! parameter's f32 gradient, the input's gradient, zero signs included), at every level, in
//! f16 and bf16, with dropout on, for pre-norm stacks (grouped-query attention with rotary
//! tables and key lengths, a SwiGLU body: Llama's blocks) and post-norm stacks (attention
//! with key lengths, MLP bodies: BERT's), and for a stack with a sub-layer whose node does
//! not apply in the middle (it runs on its own between the others). The stacking takes
//! effect: at O2/O3 the residual stream between fused sub-layers leaves no half tensor in
//! the loss's graph. Llama and BERT without a block runner (stacked) equal the same models
//! run block by block through a runner that just calls each block.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_amp::models::{BlockFn, BlockRunner, bert, llama};
use candle_amp::nn::{
    Activation, Dropout, GateActivation, Mlp, Residual, ResidualBody, ResidualNorm, SelfAttention, gated_mlp,
    layer_norm, linear, rms_norm,
};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, Generator, HalfType, OptLevel};
use candle_core::{DType, Device, Module, Tensor, Var};
use common::{backward_capturing, f64_bits as bits, grid, half_nodes};

const B: usize = 3;
const T: usize = 6;
const DM: usize = 16;
const SCALE: f64 = 64.0;
/// Grouped-query attention: 4 query heads of width 4 over 2 key/value heads.
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = DM / HEADS;
/// Key lengths (one per sequence; 5 and 2 pad the tail).
const LENGTHS: [usize; B] = [T, 2, 5];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Grouped-query causal self-attention (takes the rotary tables when given).
    Gqa,
    /// Plain self-attention, 2 heads, not causal.
    Attention,
    /// `down(relu(up(x)))`.
    Relu,
    /// `down(gelu(up(x)))`.
    Gelu,
    /// `gelu(down(up(x)))`: GELU on the last layer, which no fused node takes.
    GeluLast,
    /// SwiGLU without biases.
    Gated,
    /// `down(relu(up(x)))` with a layer norm that keeps the mean (an RMS norm plus a bias),
    /// which the fused node does not take: the sub-layer runs unfused at every level.
    NoMean,
}

/// A stack: its sub-layers' bodies, the norm, the placement, and whether the attention
/// bodies take rotary tables and key lengths.
#[derive(Debug, Clone, Copy)]
struct Shape {
    kinds: &'static [Kind],
    rms: bool,
    post: bool,
    rope: bool,
    lengths: bool,
}

const SHAPES: [Shape; 4] = [
    // Llama's two blocks.
    Shape {
        kinds: &[Kind::Gqa, Kind::Gated, Kind::Gqa, Kind::Gated],
        rms: true,
        post: false,
        rope: true,
        lengths: true,
    },
    // BERT's two blocks.
    Shape {
        kinds: &[Kind::Attention, Kind::Gelu, Kind::Attention, Kind::Relu],
        rms: false,
        post: true,
        rope: false,
        lengths: true,
    },
    // Pre-norm with a layer norm, sub-layers without a fused node between others (GELU last:
    // under autocast only).
    Shape {
        kinds: &[
            Kind::Relu,
            Kind::Gated,
            Kind::GeluLast,
            Kind::NoMean,
            Kind::Attention,
            Kind::Relu,
        ],
        rms: false,
        post: false,
        rope: false,
        lengths: false,
    },
    // Post-norm with an RMS norm, the same, one unfused sub-layer first.
    Shape {
        kinds: &[
            Kind::NoMean,
            Kind::Gqa,
            Kind::GeluLast,
            Kind::Gated,
            Kind::NoMean,
            Kind::Gqa,
        ],
        rms: true,
        post: true,
        rope: false,
        lengths: true,
    },
];

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

fn sub_layer(kind: Kind, s: Shape, vb: &VarBuilder, rng: &Generator) -> candle_core::Result<Residual> {
    let norm: ResidualNorm = if kind == Kind::NoMean {
        let c = candle_nn::LayerNormConfig {
            eps: 1e-5,
            remove_mean: false,
            affine: true,
        };
        layer_norm(DM, c, vb.pp("ln"))?.into()
    } else if s.rms {
        rms_norm(DM, 1e-5, vb.pp("ln"))?.into()
    } else {
        layer_norm(DM, 1e-5, vb.pp("ln"))?.into()
    };
    let mlp = |first: Option<Activation>, last: Option<Activation>| -> candle_core::Result<ResidualBody> {
        let mut up = linear(DM, 2 * DM, vb.pp("up"))?;
        let mut down = linear(2 * DM, DM, vb.pp("down"))?;
        if let Some(a) = first {
            up = up.with_activation(a);
        }
        if let Some(a) = last {
            down = down.with_activation(a);
        }
        Ok(Mlp::new(vec![up, down]).into())
    };
    let body: ResidualBody = match kind {
        Kind::Gqa => SelfAttention::new(
            linear(DM, DM, vb.pp("q"))?,
            linear(DM, KV_HEADS * HD, vb.pp("k"))?,
            linear(DM, KV_HEADS * HD, vb.pp("v"))?,
            linear(DM, DM, vb.pp("o"))?,
            HEADS,
            true,
        )?
        .into(),
        Kind::Attention => amp::nn::self_attention(DM, 2, false, vb.clone())?.into(),
        Kind::Relu | Kind::NoMean => mlp(Some(Activation::Relu), None)?,
        Kind::Gelu => mlp(Some(Activation::Gelu), None)?,
        Kind::GeluLast => mlp(None, Some(Activation::Gelu))?,
        Kind::Gated => gated_mlp(DM, 2 * DM, GateActivation::Silu, false, vb.pp("mlp"))?.into(),
    };
    let drop = Dropout::new(0.25, rng.clone())?;
    Ok(match s.post {
        false => Residual::new(norm, body, drop),
        true => Residual::post_norm(norm, body, drop),
    })
}

use candle_nn::VarBuilder;

/// The sub-layers of a shape, with the per-call options; `stacked` picks the path.
struct Stack {
    layers: Vec<Residual>,
    rope: Option<(Tensor, Tensor)>,
    lengths: Option<Vec<usize>>,
    stacked: std::sync::atomic::AtomicBool,
}

impl Module for Stack {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let rope = self.rope.as_ref().map(|(c, s)| (c, s));
        let lengths = self.lengths.as_deref();
        if self.stacked.load(std::sync::atomic::Ordering::Relaxed) {
            let refs: Vec<&Residual> = self.layers.iter().collect();
            return Residual::forward_stack(&refs, x, true, rope, lengths);
        }
        let mut x = x.clone();
        for l in &self.layers {
            x = match l.body() {
                ResidualBody::Attention(_) => l.forward_with(&x, true, rope, lengths)?,
                _ => l.forward_with(&x, true, None, None)?,
            };
        }
        Ok(x)
    }
}

/// Output, input gradient, f32 parameter gradients (all as f64 bits), half graph nodes.
type Seen = (Vec<u64>, Option<Vec<u64>>, BTreeMap<String, Vec<u64>>, usize);

/// Which sub-layers' parameters are frozen: none, the first's (the stack's first node
/// trains nothing), all but the last's.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Frozen {
    None,
    First,
    AllButLast,
}

fn check(level: OptLevel, half: HalfType, s: Shape, data: bool, frozen: Frozen, what: &str) {
    let dev = Device::Cpu;
    let cfg = AmpConfig::new(level)
        .half(half)
        .verbosity(0)
        .loss_scale(amp::LossScaleSpec::Static(SCALE as f32))
        .seed(5);
    let run = amp::Amp::new(cfg, &dev).unwrap();
    let rng = run.generator("dropout");
    let model = run
        .model(|vb| {
            let layers = s
                .kinds
                .iter()
                .enumerate()
                .map(|(i, k)| sub_layer(*k, s, &vb.pp(format!("l{i}")), &rng))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Stack {
                layers,
                rope: s.rope.then(|| tables(&dev)),
                lengths: s.lengths.then(|| LENGTHS.to_vec()),
                stacked: true.into(),
            })
        })
        .unwrap();
    // Norm scales of both signs (and shifts away from 0), so that a zero gradient's sign
    // can change on the way back.
    for (i, p) in run.store().params().iter().enumerate() {
        if p.name().contains(".ln.") {
            let v: Vec<f32> = grid(DM, 0.25, 6, 20 + i as u64)
                .into_iter()
                .map(|v| if v == 0.0 { 1.25 } else { v })
                .collect();
            run.store().write_f32(p.name(), &Tensor::new(v, &dev).unwrap()).unwrap();
        }
    }
    let last = format!("l{}.", s.kinds.len() - 1);
    run.store().set_frozen(
        |n| match frozen {
            Frozen::None => false,
            Frozen::First => n.starts_with("l0."),
            Frozen::AllButLast => !n.starts_with(&last),
        },
        true,
    );
    let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.5)).unwrap()).unwrap();
    let x = Var::from_tensor(&Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap()).unwrap();
    let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 6), (B, T, DM), &dev).unwrap();
    let state = rng.snapshot();
    let mut once = |stacked: bool| -> Seen {
        model
            .inner()
            .stacked
            .store(stacked, std::sync::atomic::Ordering::Relaxed);
        rng.restore(state.clone());
        let input = match data {
            true => x.as_tensor().detach(),
            false => x.as_tensor().affine(1.0, 0.0).unwrap(),
        };
        // The residual stream in the level's activation type, as after an embedding.
        let input = match level {
            OptLevel::O2 | OptLevel::O3 => input.to_dtype(half.dtype()).unwrap(),
            _ => input,
        };
        let y = model.forward(&input).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&run, &loss, &mut opt, x.as_tensor());
        assert!(!report.found_inf, "{what} stacked={stacked}");
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
        opt.zero_grad();
        (bits(&y), gx.as_ref().map(bits), grads, nodes)
    };
    let (stacked, plain) = (once(true), once(false));
    // Raw bits: a zero's sign too.
    assert_eq!(stacked.0, plain.0, "{what}: output");
    assert_eq!(stacked.1.is_some(), !data, "{what}: input gradient present");
    assert_eq!(stacked.1, plain.1, "{what}: input gradient");
    if let Some(g) = &stacked.1 {
        assert!(
            g.iter().any(|v| f64::from_bits(*v) != 0.0),
            "{what}: a zero input gradient"
        );
    }
    assert_eq!(
        stacked.2.keys().collect::<Vec<_>>(),
        plain.2.keys().collect::<Vec<_>>(),
        "{what}"
    );
    let params = run.store().params().iter().filter(|p| !p.is_frozen()).count();
    assert_eq!(stacked.2.len(), params, "{what}: a parameter without a gradient");
    for (k, g) in &stacked.2 {
        assert_eq!(g, &plain.2[k], "{what}: {k}");
        assert!(g.iter().any(|v| f64::from_bits(*v) != 0.0), "{what}: {k} is zero");
    }
    // O2/O3: the stack leaves no half tensor between its fused sub-layers (one fewer per
    // boundary inside each run of them; with frozen layers, where the separate nodes leave
    // one); elsewhere nothing changes.
    if matches!(level, OptLevel::O2 | OptLevel::O3) && frozen != Frozen::None {
        assert!(stacked.3 <= plain.3, "{what}: half nodes {} vs {}", stacked.3, plain.3);
    } else if matches!(level, OptLevel::O2 | OptLevel::O3) {
        let fused_runs: Vec<usize> = s
            .kinds
            .split(|k| *k == Kind::NoMean)
            .map(|run| run.len())
            .filter(|n| *n > 0)
            .collect();
        let saved: usize = fused_runs.iter().map(|n| n - 1).sum();
        assert_eq!(
            plain.3 - stacked.3,
            saved,
            "{what}: half nodes {} vs {}",
            stacked.3,
            plain.3
        );
    } else {
        assert_eq!(plain.3, stacked.3, "{what}: half nodes");
    }
}

fn everywhere(pick: impl Fn(&Shape) -> bool) {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            for s in SHAPES.iter().filter(|s| pick(s)) {
                for data in [false, true] {
                    for frozen in [Frozen::None, Frozen::First, Frozen::AllButLast] {
                        let what = format!("{level:?} {half:?} {s:?} data={data} frozen={frozen:?}");
                        check(level, half, *s, data, frozen, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn pre_norm_stacks_equal_the_sub_layers_one_by_one_bit_for_bit() {
    everywhere(|s| !s.post);
}

#[test]
fn post_norm_stacks_equal_the_sub_layers_one_by_one_bit_for_bit() {
    everywhere(|s| s.post);
}

/// No layers: the input back; outside a run: the unfused layers, each on the previous one's
/// output.
#[test]
fn empty_stacks_and_outside_a_run() {
    let dev = Device::Cpu;
    let run = amp::Amp::new(OptLevel::O0, &dev).unwrap();
    let rng = run.generator("dropout");
    let vm = candle_nn::VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let x = Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap();
    let y = Residual::forward_stack(&[], &x, true, None, None).unwrap();
    assert_eq!(y.id(), x.id());
    let s = SHAPES[0];
    let layers: Vec<Residual> = s
        .kinds
        .iter()
        .enumerate()
        .map(|(i, k)| sub_layer(*k, s, &vb.pp(format!("l{i}")), &rng).unwrap())
        .collect();
    let (c, sn) = tables(&dev);
    let state = rng.snapshot();
    let refs: Vec<&Residual> = layers.iter().collect();
    let got = Residual::forward_stack(&refs, &x, true, Some((&c, &sn)), Some(&LENGTHS)).unwrap();
    rng.restore(state);
    let mut want = x.clone();
    for l in &layers {
        want = match l.body() {
            ResidualBody::Attention(_) => l.forward_with(&want, true, Some((&c, &sn)), Some(&LENGTHS)).unwrap(),
            _ => l.forward_with(&want, true, None, None).unwrap(),
        };
    }
    assert_eq!(bits(&got), bits(&want));
}

/// f32 bits of a tensor's values.
fn f32_bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

/// Two training steps' losses and f32 gradients (bits) of Llama or BERT at `level`, without
/// a runner (stacked) or through one that calls each block as it is.
fn model_trace(
    llama_model: bool,
    level: OptLevel,
    half: HalfType,
    runner: bool,
) -> Vec<(u32, BTreeMap<String, Vec<u32>>)> {
    let dev = Device::Cpu;
    let run = amp::Amp::new(AmpConfig::new(level).half(half).seed(3).verbosity(0), &dev).unwrap();
    let runner: Option<BlockRunner> =
        runner.then(|| Arc::new(|_: usize, block: BlockFn, x: &Tensor| block(x)) as BlockRunner);
    let tokens = |seed| {
        let t = Tensor::from_vec(grid(2 * 7, 1.0, 7, seed), (2, 7), &dev).unwrap();
        (t + 8.0).unwrap().to_dtype(DType::U32).unwrap()
    };
    let (ids, targets) = (tokens(11), tokens(12));
    let forward: Box<dyn Fn() -> Tensor> = if llama_model {
        let cfg = llama::Config {
            hidden_size: 32,
            intermediate_size: 48,
            vocab_size: 16,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 16,
            tie_word_embeddings: false,
        };
        let mut m = run.model(|vb| llama::Llama::load(vb, &cfg)).unwrap();
        m.inner_mut().set_block_runner(runner);
        let (ids, targets) = (ids.clone(), targets.clone());
        Box::new(move || m.call(|m| m.loss(&ids, &targets)).unwrap())
    } else {
        let cfg = bert::Config {
            vocab_size: 16,
            hidden_size: 16,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            intermediate_size: 32,
            max_position_embeddings: 12,
            ..bert::Config::default()
        };
        let mut m = run.model(|vb| bert::BertModel::load(vb, &cfg)).unwrap();
        m.inner_mut().set_block_runner(runner);
        // Padding by lengths (the fused path): rows of 7 and 4 real tokens.
        let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]], &dev).unwrap();
        let (ids, r) = (
            ids.clone(),
            Tensor::from_vec(grid(2 * 7 * 16, 1.0 / 64.0, 8, 6), (2, 7, 16), &dev).unwrap(),
        );
        Box::new(move || {
            let h = m.call(|m| m.forward(&ids, &ids.zeros_like()?, Some(&mask))).unwrap();
            (h.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap()
        })
    };
    let mut opt = run.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
    let mut out = Vec::new();
    for _ in 0..2 {
        let loss = forward();
        let l = loss.to_scalar::<f32>().unwrap().to_bits();
        run.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        out.push((
            l,
            opt.master_grads()
                .iter()
                .map(|(k, g)| (k.clone(), f32_bits(g)))
                .collect(),
        ));
        opt.step().unwrap();
        opt.zero_grad();
    }
    out
}

#[test]
fn llama_and_bert_stacked_equal_block_by_block() {
    for llama_model in [true, false] {
        for (level, half) in [
            (OptLevel::O0, HalfType::Bf16),
            (OptLevel::O1, HalfType::F16),
            (OptLevel::O2, HalfType::Bf16),
            (OptLevel::O2, HalfType::F16),
            (OptLevel::O3, HalfType::Bf16),
        ] {
            let what = format!("llama={llama_model} {level:?} {half:?}");
            let stacked = model_trace(llama_model, level, half, false);
            let blocks = model_trace(llama_model, level, half, true);
            assert_eq!(stacked, blocks, "{what}");
            assert!(stacked[0].1.len() > 10, "{what}: gradients");
        }
    }
}
