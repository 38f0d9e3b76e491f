//! Llama (Meta's LLaMA 1-3 and the models that share its layout), trainable at every opt
//! level, configured and named as candle-transformers' `models::llama`.
//!
//! A [`Config`] (the fields of a Hugging Face `config.json` that shape the network, with the
//! same serde names), [`Llama::load`] from a `VarBuilder` (fresh weights in a run, or a
//! pretrained safetensors file: the parameter names are the checkpoint's), and
//! [`Llama::forward`] from token ids to logits at every position, for training: causal
//! attention, no KV cache. Built from [`crate::nn`] and [`crate::ops`], so every parameter
//! gets a gradient (candle-nn's fused RMS norm has no backward), O1 autocasts it, and O2/O3
//! run it in half. The rotary tables are computed from `rope_theta` (and the llama-3
//! frequency scaling), never read from the `VarBuilder`: a fresh run does not make them
//! trainable parameters.
//!
//! ```
//! use candle_amp::{self as amp, models::llama};
//! use candle_core::{Device, Tensor};
//! # fn main() -> anyhow::Result<()> {
//! let cfg = llama::Config {
//!     hidden_size: 16,
//!     intermediate_size: 32,
//!     vocab_size: 10,
//!     num_hidden_layers: 1,
//!     num_attention_heads: 4,
//!     num_key_value_heads: Some(2),
//!     rms_norm_eps: 1e-5,
//!     rope_theta: 10_000.0,
//!     rope_scaling: None,
//!     max_position_embeddings: 32,
//!     tie_word_embeddings: true,
//! };
//! let (model, mut opt, amp) = amp::initialize(
//!     |vb| llama::Llama::load(vb, &cfg),
//!     amp::optim::AdamW::new(Default::default())?,
//!     amp::OptLevel::O2,
//! )?;
//! let ids = Tensor::new(&[[1u32, 2, 3, 4, 5]], &Device::Cpu)?;
//! let logits = model.forward(&ids.narrow(1, 0, 4)?)?;         // (batch, seq, vocab), f32
//! assert_eq!(logits.dims(), [1, 4, 10]);
//! let loss = amp::ops::cross_entropy(&logits, &ids.narrow(1, 1, 4)?)?;
//! amp.scale_loss(&loss, &mut opt)?.backward()?;
//! opt.step()?;
//! assert!(amp.store().param("lm_head.weight").is_none());     // tied to the embeddings
//! # Ok(()) }
//! ```

use std::sync::{Arc, Mutex};

use candle_core::{Device, Result, Tensor};
use candle_nn::{Module, VarBuilder};

use crate::nn as ann;

fn default_rope_theta() -> f32 {
    10_000.0
}

/// `null` reads as `false` (candle-transformers' `LlamaConfig` reads the field as an option).
fn null_as_false<'de, De: serde::Deserializer<'de>>(d: De) -> std::result::Result<bool, De::Error> {
    Ok(<Option<bool> as serde::Deserialize>::deserialize(d)?.unwrap_or(false))
}

/// A Llama model's shape: the fields of a Hugging Face `config.json` (and of
/// candle-transformers' `llama::LlamaConfig`) that training needs, with their names; other
/// fields of the file are ignored. Read one with `serde_json::from_str`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Config {
    /// The model width.
    pub hidden_size: usize,
    /// The feed-forward's inner width (SwiGLU: gate and up projections).
    pub intermediate_size: usize,
    /// The vocabulary size.
    pub vocab_size: usize,
    /// The number of decoder blocks.
    pub num_hidden_layers: usize,
    /// The number of query heads; the head width is `hidden_size / num_attention_heads`.
    pub num_attention_heads: usize,
    /// The number of key/value heads (grouped-query attention); `None`: one per query head.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// The RMS norms' epsilon.
    pub rms_norm_eps: f64,
    /// The rotary embedding's base (10000 when absent, as candle-transformers reads it).
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    /// The llama-3 frequency scaling, if any.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// The longest sequence the rotary tables cover.
    pub max_position_embeddings: usize,
    /// Whether the output head shares the embedding table (then there is no `lm_head`).
    #[serde(default, deserialize_with = "null_as_false")]
    pub tie_word_embeddings: bool,
}

/// The `rope_scaling` entry of a `config.json`. `rope_type` `"llama3"` (Llama 3.1's
/// frequency scaling, as candle-transformers computes it) and `"default"` (none) are
/// supported; any other type is refused by [`Config::validate`] with
/// [`ConfigError::UnsupportedRopeScaling`] rather than ignored.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeScaling {
    /// `"llama3"` or `"default"`.
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
    /// The older key for the type (`{"type": "linear", ...}`), read so that such a scaling
    /// is refused rather than silently ignored.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub legacy_type: Option<String>,
    /// How much the low frequencies are divided by.
    #[serde(default)]
    pub factor: Option<f32>,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
    #[serde(default)]
    pub low_freq_factor: Option<f32>,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
    #[serde(default)]
    pub high_freq_factor: Option<f32>,
    /// The context the model was pretrained with.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

fn default_rope_type() -> String {
    "default".into()
}

/// A [`Config`] the model cannot be built from. [`Llama::load`] returns it inside
/// `candle_core::Error::WrappedContext` (whose box downcasts to it); its `Debug` reads as its
/// message, since candle prints that box with `{:?}`.
#[derive(Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A size that must be positive is 0.
    #[error("llama config: {0} must be at least 1")]
    Zero(&'static str),
    /// The heads do not divide the width, or the key/value heads the query heads.
    #[error(
        "llama config: {heads} attention heads must divide hidden_size {hidden}, and {kv_heads} key/value heads \
         must divide the attention heads"
    )]
    Heads {
        /// `hidden_size`.
        hidden: usize,
        /// `num_attention_heads`.
        heads: usize,
        /// `num_key_value_heads`.
        kv_heads: usize,
    },
    /// The head width is odd: rotary embeddings rotate pairs.
    #[error("llama config: the head width {0} is odd; rotary embeddings need an even one")]
    OddHeadDim(usize),
    /// A `rope_scaling` type other than `llama3` and `default`.
    #[error("llama config: rope_scaling type {0:?} is not supported (use \"llama3\" or \"default\")")]
    UnsupportedRopeScaling(String),
    /// A `llama3` scaling without one of its numbers, or with numbers it cannot use.
    #[error("llama config: the llama3 rope_scaling {0}")]
    BadRopeScaling(&'static str),
}

impl std::fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl From<ConfigError> for candle_core::Error {
    fn from(e: ConfigError) -> Self {
        candle_core::Error::WrappedContext {
            wrapped: Box::new(e),
            context: "Llama::load".into(),
        }
    }
}

/// The llama-3 scaling's numbers: factor, low and high frequency factors, original context.
type Llama3 = (f32, f32, f32, f32);

impl Config {
    /// The number of key/value heads (`num_attention_heads` when not given).
    pub fn num_key_value_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The width of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Checks the sizes and the rope scaling (what [`Llama::load`] checks first).
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads()),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        let (hidden, heads, kv_heads) = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads());
        if !hidden.is_multiple_of(heads) || !heads.is_multiple_of(kv_heads) {
            return Err(ConfigError::Heads {
                hidden,
                heads,
                kv_heads,
            });
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim(self.head_dim()));
        }
        self.llama3().map(|_| ())
    }

    /// The llama-3 scaling's numbers, `None` without scaling.
    fn llama3(&self) -> std::result::Result<Option<Llama3>, ConfigError> {
        let Some(s) = &self.rope_scaling else {
            return Ok(None);
        };
        let kind = match (s.rope_type.as_str(), &s.legacy_type) {
            ("default", Some(t)) => t.as_str(),
            (t, _) => t,
        };
        match kind {
            "default" => return Ok(None),
            "llama3" => {}
            other => return Err(ConfigError::UnsupportedRopeScaling(other.into())),
        }
        let need = |v: Option<f32>, what| v.ok_or(ConfigError::BadRopeScaling(what));
        let factor = need(s.factor, "needs factor")?;
        let low = need(s.low_freq_factor, "needs low_freq_factor")?;
        let high = need(s.high_freq_factor, "needs high_freq_factor")?;
        let original = s
            .original_max_position_embeddings
            .ok_or(ConfigError::BadRopeScaling("needs original_max_position_embeddings"))?;
        if !(factor > 0.0 && low > 0.0 && high > low && original > 0) {
            return Err(ConfigError::BadRopeScaling(
                "needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0",
            ));
        }
        Ok(Some((factor, low, high, original as f32)))
    }

    /// The rotary inverse frequencies, one per pair, in f32 as candle-transformers computes
    /// them (so the tables agree to the bit).
    fn inv_freq(&self) -> std::result::Result<Vec<f32>, ConfigError> {
        let hd = self.head_dim();
        let base = (0..hd)
            .step_by(2)
            .map(|i| 1f32 / self.rope_theta.powf(i as f32 / hd as f32));
        let Some((factor, low, high, original)) = self.llama3()? else {
            return Ok(base.collect());
        };
        let (low_wavelen, high_wavelen) = (original / low, original / high);
        Ok(base
            .map(|freq| {
                let wavelen = 2. * std::f32::consts::PI / freq;
                if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / factor
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    (1. - smooth) * freq / factor + smooth * freq
                }
            })
            .collect())
    }
}

/// The rotary tables `cos` and `sin`, `(positions, head_dim)` in f32 (each half repeated, the
/// `rotate_half` layout), computed for the longest sequence seen so far and kept.
#[derive(Debug, Clone)]
struct Rope {
    inv_freq: Vec<f32>,
    max_positions: usize,
    device: Device,
    tables: Arc<Mutex<Option<(Tensor, Tensor)>>>,
}

impl Rope {
    /// The tables for the first `t` positions.
    fn tables(&self, t: usize) -> Result<(Tensor, Tensor)> {
        if t > self.max_positions {
            candle_core::bail!(
                "llama: a sequence of {t} positions is longer than max_position_embeddings {}",
                self.max_positions
            )
        }
        let mut cached = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((c, s)) = cached.as_ref()
            && c.dim(0)? >= t
        {
            return Ok((c.narrow(0, 0, t)?, s.narrow(0, 0, t)?));
        }
        // Grown in powers of two, so that lengths that creep up rebuild them rarely.
        let n = t.next_power_of_two().min(self.max_positions);
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * 2 * half), Vec::with_capacity(n * 2 * half));
        for p in 0..n {
            // The angle rounded to f32 once, as candle-transformers' (positions x freqs) product.
            let angles: Vec<f32> = self.inv_freq.iter().map(|f| p as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
                sin.extend(angles.iter().map(|a| a.sin()));
            }
        }
        let c = Tensor::from_vec(cos, (n, 2 * half), &self.device)?;
        let s = Tensor::from_vec(sin, (n, 2 * half), &self.device)?;
        let out = (c.narrow(0, 0, t)?, s.narrow(0, 0, t)?);
        *cached = Some((c, s));
        Ok(out)
    }
}

/// Causal self-attention with rotary positions and grouped key/value heads: one
/// [`ann::SelfAttention`], its projections named `q_proj`, `k_proj`, `v_proj`, `o_proj`
/// under `vb`, the model's rotary tables passed per call.
fn attention(vb: VarBuilder, cfg: &Config) -> Result<ann::SelfAttention> {
    let (d, hd) = (cfg.hidden_size, cfg.head_dim());
    let (q, kv) = (hd * cfg.num_attention_heads, hd * cfg.num_key_value_heads());
    ann::SelfAttention::new(
        ann::linear_no_bias(d, q, vb.pp("q_proj"))?,
        ann::linear_no_bias(d, kv, vb.pp("k_proj"))?,
        ann::linear_no_bias(d, kv, vb.pp("v_proj"))?,
        ann::linear_no_bias(q, d, vb.pp("o_proj"))?,
        cfg.num_attention_heads,
        true,
    )?
    .with_kv_heads(cfg.num_key_value_heads())
}

/// A pre-norm decoder block: `x + attn(norm(x))`, then `x + mlp(norm(x))`, each sub-layer
/// one [`ann::Residual`] (one fused node in half on the CPU, RMS norm inside): the
/// attention with `input_layernorm`, the SwiGLU feed-forward `down(silu(gate(x)) * up(x))`
/// with `post_attention_layernorm`.
#[derive(Debug, Clone)]
struct Block {
    attn: ann::Residual,
    mlp: ann::Residual,
}

impl Block {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (d, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        // No dropout (p = 0 draws nothing from the generator).
        let none = || ann::Dropout::new(0.0, crate::train::rng::Generator::new(0, "llama"));
        let mlp = ann::gated_mlp(d, cfg.intermediate_size, ann::GateActivation::Silu, false, vb.pp("mlp"))?;
        Ok(Self {
            attn: ann::Residual::new(
                ann::rms_norm(d, eps, vb.pp("input_layernorm"))?,
                attention(vb.pp("self_attn"), cfg)?,
                none()?,
            ),
            mlp: ann::Residual::new(ann::rms_norm(d, eps, vb.pp("post_attention_layernorm"))?, mlp, none()?),
        })
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        // Both sub-layers as one node where they fuse (a block runner runs blocks one by one).
        ann::Residual::forward_stack(&[&self.attn, &self.mlp], x, true, Some((cos, sin)), None)
    }
}

/// The Llama decoder: token embeddings, [`Config::num_hidden_layers`] pre-norm blocks of
/// rotary causal self-attention and a SwiGLU feed-forward, a final RMS norm and the output
/// head (the embedding table when tied). See the [module](self) for an example.
#[derive(Clone)]
pub struct Llama {
    embed_tokens: ann::Embedding,
    layers: Vec<Block>,
    norm: ann::RmsNorm,
    lm_head: ann::Linear,
    rope: Rope,
    config: Config,
    /// How the blocks run (`None`: plainly); see [`super::BlockRunner`].
    runner: Option<super::BlockRunner>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("config", &self.config)
            .field("layers", &self.layers.len())
            .field("block_runner", &self.runner.is_some())
            .finish_non_exhaustive()
    }
}

impl Llama {
    /// Builds the model under `vb` with candle-transformers' parameter names
    /// (`model.embed_tokens`, `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
    /// `model.layers.{i}.mlp.{gate,up,down}_proj`, `model.layers.{i}.input_layernorm`,
    /// `model.layers.{i}.post_attention_layernorm`, `model.norm`, and `lm_head` unless the
    /// embeddings are tied) and candle-nn's initialisation. An invalid `cfg` is a
    /// [`ConfigError`], wrapped.
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let inv_freq = cfg.inv_freq()?;
        let m = vb.pp("model");
        let embed_tokens = ann::embedding(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Block::load(m.pp(format!("layers.{i}")), cfg))
            .collect::<Result<Vec<_>>>()?;
        let norm = ann::rms_norm(cfg.hidden_size, cfg.rms_norm_eps, m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            ann::Linear::new(embed_tokens.embeddings().clone(), None).with_name("lm_head")
        } else {
            ann::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
        };
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope: Rope {
                inv_freq,
                max_positions: cfg.max_position_embeddings,
                device: vb.device().clone(),
                tables: Arc::default(),
            },
            config: cfg.clone(),
            runner: None,
        })
    }

    /// Runs each decoder block through `runner` (gradient checkpointing per block: see
    /// [`super::BlockRunner`]); `None` runs them plainly.
    pub fn set_block_runner(&mut self, runner: Option<super::BlockRunner>) {
        self.runner = runner;
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The logits `(batch, seq, vocab)` for token ids `(batch, seq)` (an integer type), every
    /// position attending to itself and those before it. An error when `seq` exceeds
    /// `max_position_embeddings`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(&self.hidden(ids)?)
    }

    /// The final hidden states `(batch, seq, hidden_size)` (after `model.norm`, before the
    /// head) for token ids `(batch, seq)`.
    pub fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let (cos, sin) = self.rope.tables(t)?;
        let mut x = self.embed_tokens.forward(ids)?;
        let Some(run) = &self.runner else {
            // Every sub-layer in turn, consecutive fused ones as one node (no half residual
            // stream between them in candle's graph).
            let subs: Vec<&ann::Residual> = self.layers.iter().flat_map(|l| [&l.attn, &l.mlp]).collect();
            let x = ann::Residual::forward_stack(&subs, &x, true, Some((&cos, &sin)), None)?;
            return self.norm.forward(&x);
        };
        // Block by block through the runner (checkpointing per block).
        for (i, layer) in self.layers.iter().enumerate() {
            let (layer, cos, sin) = (layer.clone(), cos.clone(), sin.clone());
            x = run(i, Arc::new(move |x: &Tensor| layer.forward(x, &cos, &sin)), &x)?;
        }
        self.norm.forward(&x)
    }

    /// The mean next-token cross entropy of the logits for `ids` `(batch, seq)` against
    /// `targets` `(batch, seq)` (`u8`, `u32` or `i64`): the value of
    /// [`ops::cross_entropy`](crate::ops::cross_entropy)`(&self.forward(ids)?, targets)`,
    /// computed by [`nn::linear_cross_entropy`](crate::nn::linear_cross_entropy), so that
    /// inside a run ([`AmpModel::call`](crate::AmpModel::call)) at O1-O3 on the CPU the head
    /// and the loss are one node and no logits tensor is made (about 0.4x the head's
    /// unfused O2 bf16 time on Zen 4).
    ///
    /// ```
    /// use candle_amp::models::llama::{Config, Llama};
    /// use candle_amp::{Amp, OptLevel};
    /// use candle_core::{Device, Tensor};
    /// # fn main() -> anyhow::Result<()> {
    /// let cfg = Config { hidden_size: 8, intermediate_size: 16, vocab_size: 16, num_hidden_layers: 1,
    ///     num_attention_heads: 2, num_key_value_heads: Some(1), rms_norm_eps: 1e-5, rope_theta: 10_000.0,
    ///     rope_scaling: None, max_position_embeddings: 8, tie_word_embeddings: false };
    /// let run = Amp::new(OptLevel::O2, &Device::Cpu)?;
    /// let model = run.model(|vb| Llama::load(vb, &cfg))?;
    /// let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu)?;
    /// let next = Tensor::new(&[[2u32, 3, 4]], &Device::Cpu)?;
    /// let loss = model.call(|m| m.loss(&ids, &next))?;
    /// let plain = candle_amp::ops::cross_entropy(&model.forward(&ids)?, &next)?;
    /// let (a, b) = (loss.to_scalar::<f32>()?, plain.to_scalar::<f32>()?);
    /// assert!((a - b).abs() < 1e-2 * b, "{a} {b}"); // the plain path rounds the logits to half
    /// # Ok(()) }
    /// ```
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        ann::linear_cross_entropy(&self.hidden(ids)?, &self.lm_head, targets)
    }
}

impl Module for Llama {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Llama::forward(self, ids)
    }
}
