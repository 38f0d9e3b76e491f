//! The Vision Transformer (Dosovitskiy et al. 2020) for image classification:
//! candle-transformers' `models::vit`, trainable at every opt level.
//!
//! The same [`Config`] (field and serde names), the same parameter names as Hugging Face's
//! `ViTForImageClassification` checkpoints
//! (`vit.embeddings.{cls_token,position_embeddings,patch_embeddings.projection}`,
//! `vit.encoder.layer.{i}.attention.attention.{query,key,value}`,
//! `vit.encoder.layer.{i}.attention.output.dense`, `vit.encoder.layer.{i}.intermediate.dense`,
//! `vit.encoder.layer.{i}.output.dense`, `vit.encoder.layer.{i}.layernorm_{before,after}`,
//! `vit.layernorm`, `classifier`) and, in f32, the same logits. What differs is what training
//! needs:
//!
//! - the layers are [`crate::nn`]'s: the norms have a backward (candle-nn's fused layer norm
//!   does not), the products autocast at O1, and each pre-norm sub-layer (norm, attention or
//!   MLP, residual add) runs as one fused node inside a run ([`crate::nn::Residual`]);
//! - the patch embedding is [`crate::nn::conv2d`], which runs bf16 convolutions on the CPU
//!   (where candle has none) in f32;
//! - `cls_token` and `position_embeddings` start as normal(0, 0.02) draws, as Hugging Face
//!   initialises them, where candle-transformers reads them with `vb.get` and a fresh run
//!   starts them at zero; a pretrained file overwrites them as any parameter.
//!
//! Dropout is the identity, as in candle-transformers.
//!
//! ```
//! use candle_amp::models::vit::{Config, Model};
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let cfg = Config {
//!     hidden_size: 16,
//!     num_hidden_layers: 2,
//!     num_attention_heads: 4,
//!     intermediate_size: 32,
//!     image_size: 8,
//!     patch_size: 4,
//!     ..Config::vit_base_patch16_224()
//! };
//! let (vm, dev) = (VarMap::new(), Device::Cpu);
//! let vit = Model::load(VarBuilder::from_varmap(&vm, DType::F32, &dev), &cfg, 10)?;
//! let images = Tensor::zeros((2, 3, 8, 8), DType::F32, &dev)?;
//! assert_eq!(vit.forward(&images)?.dims(), [2, 10]);
//! # Ok(()) }
//! ```

use candle_core::{Result, Tensor};
use candle_nn::{Init, Module, ModuleT, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::AmpError;
use crate::nn::{self, Activation, Conv2d, Dropout, LayerNorm, Linear, Mlp, Residual, SelfAttention};
use crate::precision::ops;
use crate::train::rng::Generator;

/// Hugging Face's initialisation of the class token and the position embeddings:
/// normal with standard deviation `initializer_range` (0.02).
const INIT: Init = Init::Randn { mean: 0.0, stdev: 0.02 };

/// The ViT configuration: candle-transformers' `vit::Config`, field for field, so a Hugging
/// Face `config.json` reads with `serde_json`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Config {
    /// Width of the token vectors.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer; must divide `hidden_size`.
    pub num_attention_heads: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// The MLP's activation: `gelu` (erf) or `relu`; the others are refused with
    /// [`AmpError::InvalidArgument`] (the library's layers have these two).
    pub hidden_act: candle_nn::Activation,
    /// Epsilon of every layer norm.
    pub layer_norm_eps: f64,
    /// Side of the (square) input images.
    pub image_size: usize,
    /// Side of the square patches; divides `image_size`.
    pub patch_size: usize,
    /// Input channels.
    pub num_channels: usize,
    /// Whether the query, key and value projections have biases.
    pub qkv_bias: bool,
}

impl Config {
    /// `google/vit-base-patch16-224`.
    pub fn vit_base_patch16_224() -> Self {
        Self {
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: candle_nn::Activation::Gelu,
            layer_norm_eps: 1e-12,
            image_size: 224,
            patch_size: 16,
            num_channels: 3,
            qkv_bias: true,
        }
    }

    /// The encoder of `microsoft/trocr-base-handwritten` (no query/key/value biases).
    pub fn microsoft_trocr_base_handwritten() -> Self {
        Self {
            image_size: 384,
            qkv_bias: false,
            ..Self::vit_base_patch16_224()
        }
    }

    /// Patches per image: `(image_size / patch_size)^2`.
    pub fn num_patches(&self) -> usize {
        let side = self.image_size / self.patch_size.max(1);
        side * side
    }

    /// The library's activation for `hidden_act`, or the typed error.
    fn activation(&self) -> Result<Activation> {
        match self.hidden_act {
            candle_nn::Activation::Gelu => Ok(Activation::Gelu),
            candle_nn::Activation::Relu => Ok(Activation::Relu),
            other => Err(AmpError::InvalidArgument {
                argument: "hidden_act",
                reason: format!("{other:?} is not supported; use `gelu` (erf) or `relu`"),
            }
            .into()),
        }
    }
}

/// `vit.embeddings.*`: the class token, the patch projection and the position embeddings.
#[derive(Debug, Clone)]
struct Embeddings {
    cls_token: Tensor,
    projection: Conv2d,
    position_embeddings: Tensor,
    num_patches: usize,
}

impl Embeddings {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let h = cfg.hidden_size;
        let conv = candle_nn::Conv2dConfig {
            stride: cfg.patch_size,
            ..Default::default()
        };
        let projection = nn::conv2d(
            cfg.num_channels,
            h,
            cfg.patch_size,
            conv,
            vb.pp("patch_embeddings").pp("projection"),
        )?;
        let num_patches = cfg.num_patches();
        Ok(Self {
            cls_token: vb.get_with_hints((1, 1, h), "cls_token", INIT)?,
            projection,
            position_embeddings: vb.get_with_hints((1, num_patches + 1, h), "position_embeddings", INIT)?,
            num_patches,
        })
    }

    /// `(b, c, h, w)` images to `(b, 1 + patches, hidden)` tokens.
    fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let (b, _, _, _) = images.dims4()?;
        let p = self.projection.forward(images)?;
        let (_, h, gh, gw) = p.dims4()?;
        if gh * gw != self.num_patches {
            return Err(AmpError::InvalidArgument {
                argument: "images",
                reason: format!(
                    "{:?} makes {gh}x{gw} patches; the position embeddings are for {} (image_size / patch_size squared)",
                    images.dims(),
                    self.num_patches
                ),
            }
            .into());
        }
        // (b, hidden, patches) to (b, patches, hidden) as one node.
        let n = gh * gw;
        let p = crate::kernels::elementwise::rearrange(&p, &[b, h, n], &[0, 2, 1], &[b, n, h])?;
        let cls = self.cls_token.broadcast_as((b, 1, h))?;
        let x = ops::cat(&[&cls, &p], 1)?;
        ops::add(&x, &self.position_embeddings)
    }
}

/// `vit.encoder.layer.{i}.*`: two pre-norm residual sub-layers.
#[derive(Debug, Clone)]
struct Layer {
    attention: Residual,
    mlp: Residual,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let qkv = |name: &str| {
            let vb = vb.pp("attention").pp("attention").pp(name);
            if cfg.qkv_bias {
                nn::linear(h, h, vb)
            } else {
                nn::linear_no_bias(h, h, vb)
            }
        };
        let attention = SelfAttention::new(
            qkv("query")?,
            qkv("key")?,
            qkv("value")?,
            nn::linear(h, h, vb.pp("attention").pp("output").pp("dense"))?,
            cfg.num_attention_heads,
            false,
        )?;
        let mlp = Mlp::new(vec![
            nn::linear(h, i, vb.pp("intermediate").pp("dense"))?.with_activation(cfg.activation()?),
            nn::linear(i, h, vb.pp("output").pp("dense"))?,
        ]);
        let norm = |name: &str| nn::layer_norm(h, cfg.layer_norm_eps, vb.pp(name));
        // Dropout is the identity (p = 0 draws nothing from the generator).
        let none = || Dropout::new(0.0, Generator::new(0, "vit"));
        Ok(Self {
            attention: Residual::new(norm("layernorm_before")?, attention, none()?),
            mlp: Residual::new(norm("layernorm_after")?, mlp, none()?),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.mlp.forward_t(&self.attention.forward_t(x, true)?, true)
    }
}

/// A ViT image classifier (candle-transformers' `vit::Model`, Hugging Face's
/// `ViTForImageClassification`): images `(b, num_channels, image_size, image_size)` to
/// logits `(b, num_labels)`, read from the class token after the final layer norm.
#[derive(Clone)]
pub struct Model {
    embeddings: Embeddings,
    layers: Vec<Layer>,
    layernorm: LayerNorm,
    classifier: Linear,
    /// How the layers run (`None`: plainly); see [`super::BlockRunner`].
    runner: Option<super::BlockRunner>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("layers", &self.layers.len())
            .field("block_runner", &self.runner.is_some())
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Builds the model under `vb` with the checkpoint's names (`vit.*`, `classifier`). An
    /// [`AmpError::InvalidArgument`] for an unsupported `hidden_act` or a `patch_size` that
    /// is 0, and an error when `num_attention_heads` does not divide `hidden_size`.
    pub fn load(vb: VarBuilder, cfg: &Config, num_labels: usize) -> Result<Self> {
        if cfg.patch_size == 0 {
            return Err(AmpError::InvalidArgument {
                argument: "patch_size",
                reason: "must be at least 1".into(),
            }
            .into());
        }
        let v = vb.pp("vit");
        let embeddings = Embeddings::load(v.pp("embeddings"), cfg)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(v.pp(format!("encoder.layer.{i}")), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embeddings,
            layers,
            layernorm: nn::layer_norm(cfg.hidden_size, cfg.layer_norm_eps, v.pp("layernorm"))?,
            classifier: nn::linear(cfg.hidden_size, num_labels, vb.pp("classifier"))?,
            runner: None,
        })
    }

    /// Runs each encoder layer through `runner` (gradient checkpointing per layer: see
    /// [`super::BlockRunner`]); `None` runs them plainly.
    pub fn set_block_runner(&mut self, runner: Option<super::BlockRunner>) {
        self.runner = runner;
    }
}

impl Module for Model {
    /// The logits `(b, num_labels)` of `images` `(b, num_channels, image_size, image_size)`.
    fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let mut x = self.embeddings.forward(images)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = match &self.runner {
                None => layer.forward(&x)?,
                Some(run) => {
                    let layer = layer.clone();
                    run(i, std::sync::Arc::new(move |x: &Tensor| layer.forward(x)), &x)?
                }
            };
        }
        let cls = x.narrow(1, 0, 1)?.squeeze(1)?;
        self.classifier.forward(&self.layernorm.forward(&cls)?)
    }
}
