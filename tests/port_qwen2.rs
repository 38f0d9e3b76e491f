//! A model that is not in `candle_amp::models` ported as `docs/porting.md` says:
//! candle-transformers 0.11.1's Qwen2 (`models::qwen2`), rewritten with the library's layers
//! and ops, the same parameter names, and every trap of the original removed:
//!
//! - `candle_nn`'s `RmsNorm` has no backward: `nn::rms_norm`;
//! - `candle_nn::Linear` cannot take O1's casts: `nn::linear` / `nn::linear_no_bias`;
//! - the f32 `-inf` causal mask built per call: `nn::scaled_dot_product_attention(.., causal)`,
//!   which computes the mask in f32 inside the op, never as a half `-inf` tensor;
//! - `softmax_last_dim` has no backward: the same attention op;
//! - the rotary tables in the activations' type: kept in f32, computed (never read with
//!   `vb.get`, which would make them trainable zeros in a fresh run), applied with `ops`.
//!
//! The port must give candle-transformers' hidden states for the same weights (f32, within
//! 1e-5 relative) and train at every level with every parameter receiving a gradient.

mod common;

use candle_amp::optim::{AdamW, AdamWConfig};
use candle_amp::{AmpConfig, HalfType, OptLevel, nn as ann, ops};
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::qwen2;

/// The rotary embedding: f32 tables computed from the config (not parameters).
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(cfg: &qwen2::Config, dev: &Device) -> Result<Self> {
        let dim = cfg.hidden_size / cfg.num_attention_heads;
        let inv: Vec<f32> = (0..dim)
            .step_by(2)
            .map(|i| 1f32 / cfg.rope_theta.powf(i as f64 / dim as f64) as f32)
            .collect();
        let n = inv.len();
        let inv = Tensor::from_vec(inv, (1, n), dev)?;
        let t = Tensor::arange(0u32, cfg.max_position_embeddings as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_position_embeddings, 1))?;
        let f = t.matmul(&inv)?;
        // Both halves of a head use the same angles (candle's `rope` layout).
        let (cos, sin) = (f.cos()?, f.sin()?);
        Ok(Self {
            cos: Tensor::cat(&[&cos, &cos], 1)?,
            sin: Tensor::cat(&[&sin, &sin], 1)?,
        })
    }

    /// `x * cos + rotate_half(x) * sin` over `(b, h, t, d)`, in f32, back in `x`'s type.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (t, d) = (x.dim(2)?, x.dim(3)?);
        let (cos, sin) = (self.cos.narrow(0, 0, t)?, self.sin.narrow(0, 0, t)?);
        let x1 = x.narrow(D::Minus1, 0, d / 2)?;
        let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        // Mixed types promote to f32: the angles keep their precision in half runs.
        let y = ops::add(&ops::mul(x, &cos)?, &ops::mul(&rotated, &sin)?)?;
        y.to_dtype(x.dtype())
    }
}

struct Layer {
    q: ann::Linear,
    k: ann::Linear,
    v: ann::Linear,
    o: ann::Linear,
    gate: ann::Linear,
    up: ann::Linear,
    down: ann::Linear,
    input_layernorm: ann::RmsNorm,
    post_attention_layernorm: ann::RmsNorm,
    heads: usize,
    kv_heads: usize,
}

impl Layer {
    fn load(cfg: &qwen2::Config, vb: VarBuilder) -> Result<Self> {
        let (d, hd) = (cfg.hidden_size, cfg.hidden_size / cfg.num_attention_heads);
        let (a, m) = (vb.pp("self_attn"), vb.pp("mlp"));
        let kv = cfg.num_key_value_heads * hd;
        Ok(Self {
            // Qwen2's query, key and value projections have a bias; the output has none.
            q: ann::linear(d, d, a.pp("q_proj"))?,
            k: ann::linear(d, kv, a.pp("k_proj"))?,
            v: ann::linear(d, kv, a.pp("v_proj"))?,
            o: ann::linear_no_bias(d, d, a.pp("o_proj"))?,
            gate: ann::linear_no_bias(d, cfg.intermediate_size, m.pp("gate_proj"))?,
            up: ann::linear_no_bias(d, cfg.intermediate_size, m.pp("up_proj"))?,
            down: ann::linear_no_bias(cfg.intermediate_size, d, m.pp("down_proj"))?,
            input_layernorm: ann::rms_norm(d, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            post_attention_layernorm: ann::rms_norm(d, cfg.rms_norm_eps, vb.pp("post_attention_layernorm"))?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
        })
    }

    fn forward(&self, x: &Tensor, rope: &Rope) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let hd = d / self.heads;
        let h = self.input_layernorm.forward(x)?;
        let split = |y: Tensor, n: usize| y.reshape((b, t, n, hd))?.transpose(1, 2);
        let q = rope.apply(&split(self.q.forward(&h)?, self.heads)?)?;
        let k = rope.apply(&split(self.k.forward(&h)?, self.kv_heads)?)?;
        let v = split(self.v.forward(&h)?, self.kv_heads)?;
        // Grouped-query attention: each key/value head serves `heads / kv_heads` query heads.
        let repeat = |y: Tensor| -> Result<Tensor> {
            let n = self.heads / self.kv_heads;
            if n == 1 {
                return Ok(y);
            }
            Tensor::cat(&vec![&y; n], 2)?.reshape((b, self.heads, t, hd))
        };
        let a = ann::scaled_dot_product_attention(&q, &repeat(k)?, &repeat(v)?, None, true, None)?;
        let a = a.transpose(1, 2)?.reshape((b, t, d))?;
        let x = ops::add(x, &self.o.forward(&a)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        let gated = ops::mul(&ops::silu(&self.gate.forward(&h)?)?, &self.up.forward(&h)?)?;
        ops::add(&x, &self.down.forward(&gated)?)
    }
}

/// Qwen2 with its language-model head (untied here).
struct Qwen2 {
    embed_tokens: ann::Embedding,
    layers: Vec<Layer>,
    norm: ann::RmsNorm,
    lm_head: ann::Linear,
    rope: Rope,
}

impl Qwen2 {
    fn load(cfg: &qwen2::Config, vb: VarBuilder) -> Result<Self> {
        let m = vb.pp("model");
        Ok(Self {
            embed_tokens: ann::embedding(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?,
            layers: (0..cfg.num_hidden_layers)
                .map(|i| Layer::load(cfg, m.pp("layers").pp(i)))
                .collect::<Result<_>>()?,
            norm: ann::rms_norm(cfg.hidden_size, cfg.rms_norm_eps, m.pp("norm"))?,
            lm_head: ann::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?,
            rope: Rope::new(cfg, vb.device())?,
        })
    }

    /// The final norm's output, `(b, t, hidden)`: what candle-transformers' `Model` returns.
    fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        let mut x = self.embed_tokens.forward(ids)?;
        for l in &self.layers {
            x = l.forward(&x, &self.rope)?;
        }
        self.norm.forward(&x)
    }
}

impl Module for Qwen2 {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(&self.hidden(ids)?)
    }
}

fn config() -> qwen2::Config {
    qwen2::Config {
        vocab_size: 32,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 16,
        sliding_window: 16,
        max_window_layers: 2,
        tie_word_embeddings: false,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        use_sliding_window: false,
        hidden_act: candle_nn::Activation::Silu,
    }
}

fn ids(b: usize, t: usize, vocab: usize, dev: &Device) -> Tensor {
    let v: Vec<u32> = (0..b * t).map(|i| ((i * 7 + i / t * 3) % vocab) as u32).collect();
    Tensor::from_vec(v, (b, t), dev).unwrap()
}

/// The same f32 weights give candle-transformers' hidden states (its norms and softmax are
/// forward-only but exact, so this checks names, layout, rotary embedding, GQA and mask).
#[test]
fn the_port_gives_candle_transformers_hidden_states() {
    let dev = Device::Cpu;
    let cfg = config();
    let vm = VarMap::new();
    let ours = Qwen2::load(&cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
    // Non-trivial norm weights and biases (their inits are ones and zeros).
    for (name, var) in vm.data().lock().unwrap().iter() {
        if name.contains("norm") || name.ends_with("bias") {
            let r = Tensor::randn(0f32, 0.3, var.shape(), &dev).unwrap();
            var.set(&(r + if name.contains("norm") { 1.0 } else { 0.0 }).unwrap())
                .unwrap();
        }
    }
    let mut theirs = qwen2::Model::new(&cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
    let x = ids(2, 9, cfg.vocab_size, &dev);
    let want = theirs.forward(&x, 0, None).unwrap();
    let got = ours.hidden(&x).unwrap();
    assert_eq!(got.dims(), want.dims());
    let (g, w) = (common::flat(&got), common::flat(&want));
    let max = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * max,
            "hidden[{i}]: {a} vs candle-transformers' {b}"
        );
    }
}

/// Next-token training on a repeating sequence at each level: every parameter gets a
/// gradient (no "received no gradient" warning), no step is skipped, the loss falls.
#[test]
fn the_port_trains_at_every_level() {
    let cfg = config();
    let dev = common::device();
    let seq = ids(4, 13, cfg.vocab_size, &dev);
    let (x, y) = (seq.narrow(1, 0, 12).unwrap(), seq.narrow(1, 1, 12).unwrap());
    for (level, half) in [
        (OptLevel::O0, HalfType::F16),
        (OptLevel::O1, HalfType::Bf16),
        (OptLevel::O2, HalfType::F16),
        (OptLevel::O2, HalfType::Bf16),
        (OptLevel::O3, HalfType::Bf16),
    ] {
        let opt = AdamW::new(AdamWConfig {
            lr: 3e-3,
            ..Default::default()
        })
        .unwrap();
        let (model, mut opt, amp) = common::initialize(
            |vb| Qwen2::load(&cfg, vb),
            opt,
            AmpConfig::new(level).half(half).seed(3),
        )
        .unwrap();
        let mut losses = Vec::new();
        for step in 0..30 {
            let logits = model.forward(&x).unwrap();
            let loss = ops::cross_entropy(&logits.flatten_to(1).unwrap(), &y.flatten_all().unwrap()).unwrap();
            losses.push(loss.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap());
            let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            if step == 0 {
                assert!(report.warnings.is_empty(), "{level} {half:?}: {:?}", report.warnings);
            }
            opt.step().unwrap();
            opt.zero_grad();
        }
        assert_eq!(opt.skipped_steps(), 0, "{level} {half:?}");
        let (first, last) = (losses[0], *losses.last().unwrap());
        assert!(last < 0.5 * first, "{level} {half:?}: loss {first} -> {last}");
    }
}
