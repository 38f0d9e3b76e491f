//! BERT (Devlin et al. 2018): candle-transformers' `models::bert`, trainable at every opt
//! level.
//!
//! The same [`Config`] (field and serde names), the same parameter names as Hugging Face's
//! checkpoints (`embeddings.{word,position,token_type}_embeddings`, `embeddings.LayerNorm`,
//! `encoder.layer.{i}.attention.self.{query,key,value}`,
//! `encoder.layer.{i}.attention.output.{dense,LayerNorm}`,
//! `encoder.layer.{i}.intermediate.dense`, `encoder.layer.{i}.output.{dense,LayerNorm}`) and,
//! in f32, the same outputs. What differs is what training needs:
//!
//! - the layers are [`crate::nn`]'s, so the norms have a backward (candle-nn's fused layer norm
//!   does not, and nothing below it learns), the products autocast at O1, and inside a run
//!   each sub-layer, with its residual add and its layer norm, runs as one fused node (a
//!   post-norm [`crate::nn::Residual`]): the feed-forward always, the attention unless the
//!   mask is no prefix mask (a `(b, t)` mask of ones then zeros is taken as key lengths,
//!   [`crate::nn::SelfAttention::forward_masked`], inside the node);
//! - the padding mask is additive and finite ([`attention_bias`], [`crate::nn::MASKED`]) and
//!   is added to the scores in f32: candle-transformers multiplies `1 - mask` by `f32::MIN`
//!   in the model's type, which is `-inf` in f16 and bf16, and `0 * -inf` is NaN from the
//!   first step at O2 and O3.
//!
//! Dropout is the identity, as in candle-transformers. A checkpoint whose names carry a
//! `bert.` prefix (Hugging Face's task models) loads through `vb.pp("bert")`, which
//! [`BertForTokenClassification`] does. [`crate::AmpModel::forward`] takes one tensor: the
//! models' `Module` implementations take the token ids and mask the padding id
//! (`pad_token_id`), so a training loop runs them through the wrapper, inside the run.
//!
//! ```
//! use candle_amp::models::bert::{BertModel, Config, attention_bias};
//! use candle_amp::nn::key_padding_mask;
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let cfg = Config {
//!     vocab_size: 50,
//!     hidden_size: 16,
//!     num_hidden_layers: 2,
//!     num_attention_heads: 4,
//!     intermediate_size: 32,
//!     max_position_embeddings: 8,
//!     ..Config::default()
//! };
//! let (vm, dev) = (VarMap::new(), Device::Cpu);
//! let bert = BertModel::load(VarBuilder::from_varmap(&vm, DType::F32, &dev), &cfg)?;
//! let ids = Tensor::new(&[[5u32, 6, 7, 0], [8, 9, 0, 0]], &dev)?;
//! let types = ids.zeros_like()?;
//! let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 1, 0, 0]], &dev)?;
//! let h = bert.forward(&ids, &types, Some(&mask))?;
//! assert_eq!(h.dims(), [2, 4, 16]);
//! // The same mask from the lengths, in the additive form the attention takes.
//! let bias = key_padding_mask(&[3, 2], 4, &dev)?;
//! let flat = |t: Tensor| t.flatten_all()?.to_vec1::<f32>();
//! assert_eq!(flat(bias)?, flat(attention_bias(&mask)?)?);
//! # Ok(()) }
//! ```

use candle_core::{DType, Result, Tensor};
use candle_nn::{Module, ModuleT, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::AmpError;
use crate::nn::{self, Activation, Embedding, LayerNorm, Linear, Mlp, Residual, ResidualBody, SelfAttention};
use crate::precision::ops;
use crate::train::rng::Generator;

/// The feed-forward activation, named as candle-transformers' `bert::HiddenAct` (serde
/// `"gelu"`, `"geluapproximate"`, `"relu"`; Hugging Face's `"gelu_new"` and
/// `"gelu_pytorch_tanh"` read as the approximate form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HiddenAct {
    /// GELU in the erf form ([`crate::ops::gelu`]), BERT's own.
    #[default]
    Gelu,
    /// GELU in the tanh form. Not supported: [`BertModel::load`] returns
    /// [`AmpError::InvalidArgument`] (the library's layers have the erf form only).
    #[serde(alias = "gelu_new", alias = "gelu_pytorch_tanh")]
    GeluApproximate,
    /// `max(x, 0)`.
    Relu,
}

impl HiddenAct {
    /// The library's activation, or the typed error naming what is supported.
    fn activation(self) -> Result<Activation> {
        match self {
            HiddenAct::Gelu => Ok(Activation::Gelu),
            HiddenAct::Relu => Ok(Activation::Relu),
            HiddenAct::GeluApproximate => Err(AmpError::InvalidArgument {
                argument: "hidden_act",
                reason: "the tanh form of GELU (`gelu_new`, `gelu_pytorch_tanh`, `geluapproximate`) is not \
                         supported; use `gelu` (erf) or `relu`"
                    .into(),
            }
            .into()),
        }
    }
}

/// How positions are encoded: absolute (learned) embeddings only, as in candle-transformers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PositionEmbeddingType {
    /// A learned embedding per position (`embeddings.position_embeddings`).
    #[default]
    Absolute,
}

/// BERT's configuration: candle-transformers' `bert::Config`, field for field, so a Hugging
/// Face `config.json` reads with `serde_json`. Dropout probabilities, `initializer_range`,
/// `use_cache` and `model_type` are read and not used (dropout is the identity; the layers
/// initialise as candle-nn's).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Config {
    /// Vocabulary size (rows of `embeddings.word_embeddings`).
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer; must divide `hidden_size`.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// The feed-forward activation.
    pub hidden_act: HiddenAct,
    /// Dropout probability of the hidden states (unused: dropout is the identity).
    pub hidden_dropout_prob: f64,
    /// Longest sequence (rows of `embeddings.position_embeddings`).
    pub max_position_embeddings: usize,
    /// Number of token types (rows of `embeddings.token_type_embeddings`).
    pub type_vocab_size: usize,
    /// Standard deviation of Hugging Face's initialisation (unused).
    pub initializer_range: f64,
    /// Epsilon of every layer norm.
    pub layer_norm_eps: f64,
    /// The padding token's id: what the `Module` implementations mask.
    pub pad_token_id: usize,
    /// How positions are encoded.
    #[serde(default)]
    pub position_embedding_type: PositionEmbeddingType,
    /// Hugging Face's decoding cache flag (unused).
    #[serde(default)]
    pub use_cache: bool,
    /// Dropout probability in front of a classifier (unused).
    pub classifier_dropout: Option<f64>,
    /// The model type (`"bert"`).
    pub model_type: Option<String>,
}

impl Default for Config {
    /// `bert-base-uncased`, as candle-transformers' default.
    fn default() -> Self {
        Self {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: HiddenAct::Gelu,
            hidden_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            initializer_range: 0.02,
            layer_norm_eps: 1e-12,
            pad_token_id: 0,
            position_embedding_type: PositionEmbeddingType::Absolute,
            use_cache: true,
            classifier_dropout: None,
            model_type: Some("bert".to_string()),
        }
    }
}

/// The additive attention bias for a 0/1 `attention_mask` (1: attend, 0: padding) of shape
/// `(b, t)` (one mask per sequence, over the keys) or `(b, t, t)` (per query and key), in
/// any dtype: f32 of shape `(b, 1, 1, t)` or `(b, 1, t, t)`, 0 where the mask is nonzero
/// and [`nn::MASKED`] where it is 0. Built in f32 from a comparison, so no `-inf` and no
/// `0 * -inf` can arise in any type; [`nn::scaled_dot_product_attention`] adds it to the
/// scores in f32. For a `(b, t)` mask of lengths it equals [`nn::key_padding_mask`].
pub fn attention_bias(attention_mask: &Tensor) -> Result<Tensor> {
    let m = match attention_mask.rank() {
        2 => attention_mask.unsqueeze(1)?.unsqueeze(1)?,
        3 => attention_mask.unsqueeze(1)?,
        r => {
            return Err(AmpError::InvalidArgument {
                argument: "attention_mask",
                reason: format!("a (batch, t) or (batch, t, t) 0/1 mask, got rank {r}"),
            }
            .into());
        }
    };
    let keep = m.to_dtype(DType::F32)?.ne(0f64)?.to_dtype(DType::F32)?;
    keep.affine(-(nn::MASKED as f64), nn::MASKED as f64)
}

/// `embeddings.*`: word, position and token-type embeddings summed, then a layer norm.
#[derive(Debug, Clone)]
struct Embeddings {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
    max_positions: usize,
}

impl Embeddings {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        Ok(Self {
            word: nn::embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("word_embeddings"))?,
            position: nn::embedding(
                cfg.max_position_embeddings,
                cfg.hidden_size,
                vb.pp("position_embeddings"),
            )?,
            token_type: nn::embedding(cfg.type_vocab_size, cfg.hidden_size, vb.pp("token_type_embeddings"))?,
            norm: nn::layer_norm(cfg.hidden_size, cfg.layer_norm_eps, vb.pp("LayerNorm"))?,
            max_positions: cfg.max_position_embeddings,
        })
    }

    fn forward(&self, ids: &Tensor, types: &Tensor) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if t > self.max_positions {
            return Err(AmpError::InvalidArgument {
                argument: "input_ids",
                reason: format!("{t} positions, past max_position_embeddings {}", self.max_positions),
            }
            .into());
        }
        let positions = Tensor::arange(0u32, t as u32, ids.device())?;
        // candle-transformers' order: (word + type) + position, for the same rounding.
        let x = ops::add(&self.word.forward(ids)?, &self.token_type.forward(types)?)?;
        let x = ops::add(&x, &self.position.forward(&positions)?)?;
        self.norm.forward(&x)
    }
}

/// `encoder.layer.{i}.*`: a post-norm block, `h = norm(x + attn(x))`,
/// `y = norm(h + ffn(h))`, each sub-layer one post-norm [`Residual`] (one fused node in
/// half on the CPU, the key lengths inside).
#[derive(Debug, Clone)]
struct Layer {
    /// The attention sub-layer with `attention.output.LayerNorm`.
    attention: Residual,
    /// The feed-forward sub-layer with `output.LayerNorm`.
    ffn: Residual,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (sa, out) = (vb.pp("attention").pp("self"), vb.pp("attention").pp("output"));
        let attention = SelfAttention::new(
            nn::linear(h, h, sa.pp("query"))?,
            nn::linear(h, h, sa.pp("key"))?,
            nn::linear(h, h, sa.pp("value"))?,
            nn::linear(h, h, out.pp("dense"))?,
            cfg.num_attention_heads,
            false,
        )?;
        let up = nn::linear(h, i, vb.pp("intermediate").pp("dense"))?.with_activation(cfg.hidden_act.activation()?);
        let ffn = Mlp::new(vec![up, nn::linear(i, h, vb.pp("output").pp("dense"))?]);
        // Dropout is the identity (p = 0 draws nothing from the generator).
        let none = || nn::Dropout::new(0.0, Generator::new(0, "bert"));
        Ok(Self {
            attention: Residual::post_norm(
                nn::layer_norm(h, cfg.layer_norm_eps, out.pp("LayerNorm"))?,
                attention,
                none()?,
            ),
            ffn: Residual::post_norm(
                nn::layer_norm(h, cfg.layer_norm_eps, vb.pp("output").pp("LayerNorm"))?,
                ffn,
                none()?,
            ),
        })
    }

    /// The attention sub-layer: with key `lengths` (a prefix mask: padding by lengths inside
    /// the fused node), else with an additive `bias` ([`attention_bias`]: the unfused layers,
    /// for masks that are no prefix), else unmasked. The same values each way.
    fn attend(&self, x: &Tensor, bias: Option<&Tensor>, lengths: Option<&[usize]>) -> Result<Tensor> {
        let (Some(bias), None, ResidualBody::Attention(attn)) = (bias, lengths, self.attention.body()) else {
            return self.attention.forward_with(x, true, None, lengths);
        };
        let [q, k, v, o] = attn.projections();
        let heads = attn.heads();
        let split = |l: &Linear| nn::split_heads(&l.forward(x)?, heads);
        let a = nn::scaled_dot_product_attention(&split(q)?, &split(k)?, &split(v)?, Some(bias), false, None)?;
        let a = o.forward(&nn::merge_heads(&a)?)?;
        self.attention.norm().forward(&ops::add(x, &a)?)
    }

    fn forward(&self, x: &Tensor, bias: Option<&Tensor>, lengths: Option<&[usize]>) -> Result<Tensor> {
        if bias.is_none() {
            // Both sub-layers as one node where they fuse (a block runner runs blocks one by one).
            return Residual::forward_stack(&[&self.attention, &self.ffn], x, true, None, lengths);
        }
        self.ffn.forward_t(&self.attend(x, bias, lengths)?, true)
    }
}

/// The key lengths of a `(b, t)` 0/1 mask on the CPU whose every row is ones then zeros, with
/// at least one 1 (what [`nn::SelfAttention::forward_masked`] takes, the fused node's mask);
/// `None` for any other mask (the additive bias then runs). A fully padded row stays with the
/// bias, whose finite mask leaves that row's softmax unmasked, where the lengths give zeros.
fn prefix_lengths(mask: &Tensor) -> Result<Option<Vec<usize>>> {
    if mask.rank() != 2 || !mask.device().is_cpu() || mask.elem_count() == 0 {
        return Ok(None);
    }
    let rows = mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut lengths = Vec::with_capacity(rows.len());
    for r in &rows {
        let n = r.iter().take_while(|&&m| m != 0.0).count();
        if n == 0 || r[n..].iter().any(|&m| m != 0.0) {
            return Ok(None);
        }
        lengths.push(n);
    }
    Ok(Some(lengths))
}

/// The BERT encoder: embeddings and `num_hidden_layers` post-norm blocks, returning the
/// hidden states `(b, t, hidden_size)` (candle-transformers' `bert::BertModel`).
#[derive(Clone)]
pub struct BertModel {
    embeddings: Embeddings,
    layers: Vec<Layer>,
    pad_token_id: u32,
    /// How the layers run (`None`: plainly); see [`super::BlockRunner`].
    runner: Option<super::BlockRunner>,
}

impl std::fmt::Debug for BertModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BertModel")
            .field("layers", &self.layers.len())
            .field("pad_token_id", &self.pad_token_id)
            .field("block_runner", &self.runner.is_some())
            .finish_non_exhaustive()
    }
}

impl BertModel {
    /// Builds the model under `vb` with the checkpoint's names (`embeddings.*`,
    /// `encoder.layer.{i}.*`); use `vb.pp("bert")` for a checkpoint whose names start with
    /// `bert.`. An [`AmpError::InvalidArgument`] for an unsupported `hidden_act`, and an
    /// error when `num_attention_heads` does not divide `hidden_size`.
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let embeddings = Embeddings::load(vb.pp("embeddings"), cfg)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(vb.pp(format!("encoder.layer.{i}")), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embeddings,
            layers,
            pad_token_id: cfg.pad_token_id as u32,
            runner: None,
        })
    }

    /// Runs each encoder layer through `runner` (gradient checkpointing per layer: see
    /// [`super::BlockRunner`]); `None` runs them plainly.
    pub fn set_block_runner(&mut self, runner: Option<super::BlockRunner>) {
        self.runner = runner;
    }

    /// The hidden states `(b, t, hidden_size)` of `input_ids` `(b, t)` with `token_type_ids`
    /// `(b, t)` (integer tensors). `attention_mask`: 1 where a key may be attended to, 0 on
    /// padding, `(b, t)` or `(b, t, t)`, any dtype (see [`attention_bias`]); `None` attends
    /// everywhere. Padded keys get exactly 0 attention; padded positions still get hidden
    /// states (attending to the real tokens), as in candle-transformers.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let lengths = attention_mask.map(prefix_lengths).transpose()?.flatten();
        // The additive bias only where the lengths do not say it all.
        let bias = match lengths {
            Some(_) => None,
            None => attention_mask.map(attention_bias).transpose()?,
        };
        let mut x = self.embeddings.forward(input_ids, token_type_ids)?;
        if self.runner.is_none() && bias.is_none() {
            // Every sub-layer in turn, consecutive fused ones as one node (no half residual
            // stream between them in candle's graph); the additive bias runs block by block.
            let subs: Vec<&Residual> = self.layers.iter().flat_map(|l| [&l.attention, &l.ffn]).collect();
            return Residual::forward_stack(&subs, &x, true, None, lengths.as_deref());
        }
        for (i, layer) in self.layers.iter().enumerate() {
            x = match &self.runner {
                None => layer.forward(&x, bias.as_ref(), lengths.as_deref())?,
                Some(run) => {
                    let (layer, bias, lengths) = (layer.clone(), bias.clone(), lengths.clone());
                    let block = move |x: &Tensor| layer.forward(x, bias.as_ref(), lengths.as_deref());
                    run(i, std::sync::Arc::new(block), &x)?
                }
            };
        }
        Ok(x)
    }

    /// [`forward`](Self::forward) with token type 0 everywhere and the mask
    /// `input_ids != pad_token_id`: what the `Module` implementations run.
    fn forward_padded(&self, input_ids: &Tensor) -> Result<Tensor> {
        let mask = input_ids.to_dtype(DType::U32)?.ne(self.pad_token_id)?;
        self.forward(input_ids, &input_ids.zeros_like()?, Some(&mask))
    }
}

impl Module for BertModel {
    /// The hidden states of `input_ids` `(b, t)`, with token type 0 and the positions whose id
    /// is `pad_token_id` masked: one tensor in, as [`crate::AmpModel::forward`] takes.
    fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.forward_padded(input_ids)
    }
}

/// BERT with a per-token classifier (Hugging Face's `BertForTokenClassification`, for
/// tagging): names `bert.*` and `classifier`, logits `(b, t, num_labels)`.
///
/// ```
/// use candle_amp::models::bert::{BertForTokenClassification, Config};
/// use candle_amp::{self as amp, nn::loss};
/// use candle_core::{Device, Tensor};
/// # fn main() -> anyhow::Result<()> {
/// let cfg = Config { vocab_size: 20, hidden_size: 8, num_hidden_layers: 1, num_attention_heads: 2,
///                    intermediate_size: 16, max_position_embeddings: 4, ..Config::default() };
/// let (model, mut opt, amp) = amp::initialize(
///     |vb| BertForTokenClassification::load(vb, &cfg, 3),
///     amp::optim::AdamW::new(Default::default())?,
///     amp::OptLevel::O2,
/// )?;
/// let ids = Tensor::new(&[[3u32, 4, 5, 0], [6, 7, 0, 0]], &Device::Cpu)?; // 0 is padding
/// let logits = model.forward(&ids)?;                                      // (2, 4, 3), f32
/// assert_eq!(logits.dims(), [2, 4, 3]);
/// // One tag per token (a real loss would leave the padded positions out).
/// let tags = Tensor::new(&[1u32, 2, 0, 0, 1, 1, 0, 0], &Device::Cpu)?;
/// let loss = loss::cross_entropy(&logits.flatten_to(1)?, &tags)?;
/// amp.scale_loss(&loss, &mut opt)?.backward()?;
/// opt.step()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct BertForTokenClassification {
    bert: BertModel,
    classifier: Linear,
}

impl BertForTokenClassification {
    /// Builds the encoder under `vb.pp("bert")` and the classifier `(num_labels, hidden)` under
    /// `vb.pp("classifier")`, Hugging Face's names.
    pub fn load(vb: VarBuilder, cfg: &Config, num_labels: usize) -> Result<Self> {
        Ok(Self {
            bert: BertModel::load(vb.pp("bert"), cfg)?,
            classifier: nn::linear(cfg.hidden_size, num_labels, vb.pp("classifier"))?,
        })
    }

    /// The encoder.
    pub fn bert(&self) -> &BertModel {
        &self.bert
    }

    /// The encoder, mutably (for [`BertModel::set_block_runner`]).
    pub fn bert_mut(&mut self) -> &mut BertModel {
        &mut self.bert
    }

    /// The logits `(b, t, num_labels)`; the arguments are [`BertModel::forward`]'s.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.classifier
            .forward(&self.bert.forward(input_ids, token_type_ids, attention_mask)?)
    }
}

impl Module for BertForTokenClassification {
    /// The logits of `input_ids` `(b, t)`, with token type 0 and the positions whose id is
    /// `pad_token_id` masked (see [`BertModel`]'s `Module` implementation).
    fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.classifier.forward(&self.bert.forward_padded(input_ids)?)
    }
}
