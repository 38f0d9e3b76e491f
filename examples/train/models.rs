//! The example's models, written with `candle_amp::nn` and `candle_amp::ops` so that O1
//! autocasts them (with `candle_nn` layers O1 would compute in f32, as O0).

use candle_amp::Generator;
use candle_amp::nn::{self as ann, Activation};
use candle_amp::ops;
use candle_amp::recompute::{Recompute, chunked_forward};
use candle_core::{Result, Tensor};
use candle_nn::{Module, ModuleT, VarBuilder};

/// An MLP `input -> hidden -> hidden -> classes` with ReLU.
#[derive(Debug, Clone)]
pub struct Mlp(ann::Mlp);

impl Mlp {
    /// Builds the MLP with parameters `fc1.*`, `fc2.*`, `fc3.*`.
    pub fn new(vb: VarBuilder, input: usize, hidden: usize, classes: usize) -> Result<Self> {
        Self::deep(vb, input, hidden, 2, classes)
    }

    /// `layers` hidden layers of width `hidden` (`fc1` to `fc{layers}`), then `fc{layers+1}`
    /// to the classes; [`new`](Self::new) is 2.
    pub fn deep(vb: VarBuilder, input: usize, hidden: usize, layers: usize, classes: usize) -> Result<Self> {
        // The activations run inside the layers (`with_activation`) and the layers as one
        // fused module (`nn::Mlp`): no half tensor between them is an edge of candle's graph.
        let mut all = Vec::with_capacity(layers + 1);
        for i in 0..layers {
            let from = if i == 0 { input } else { hidden };
            all.push(ann::linear(from, hidden, vb.pp(format!("fc{}", i + 1)))?.with_activation(Activation::Relu));
        }
        all.push(ann::linear(hidden, classes, vb.pp(format!("fc{}", layers + 1)))?);
        Ok(Self(ann::Mlp::new(all)))
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

/// A small CNN with batch norm for `side x side` single-channel images (the digits are 8x8):
/// two conv-bn-relu-maxpool blocks and a linear classifier.
#[derive(Debug, Clone)]
pub struct Cnn {
    c1: ann::Conv2d,
    b1: ann::BatchNorm,
    c2: ann::Conv2d,
    b2: ann::BatchNorm,
    fc: ann::Linear,
    side: usize,
}

impl Cnn {
    /// Builds the CNN.
    pub fn new(vb: VarBuilder, side: usize, classes: usize) -> Result<Self> {
        let cfg = candle_nn::Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        Ok(Self {
            c1: ann::conv2d(1, 16, 3, cfg, vb.pp("c1"))?,
            b1: ann::batch_norm(16, 1e-5, vb.pp("b1"))?,
            c2: ann::conv2d(16, 32, 3, cfg, vb.pp("c2"))?,
            b2: ann::batch_norm(32, 1e-5, vb.pp("b2"))?,
            fc: ann::linear(32 * (side / 4) * (side / 4), classes, vb.pp("fc"))?,
            side,
        })
    }
}

impl ModuleT for Cnn {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let b = x.dim(0)?;
        let x = x.reshape((b, 1, self.side, self.side))?;
        let h = self.b1.forward_t(&self.c1.forward(&x)?, train)?.relu()?.max_pool2d(2)?;
        let h = self.b2.forward_t(&self.c2.forward(&h)?, train)?.relu()?.max_pool2d(2)?;
        self.fc.forward(&h.flatten_from(1)?)
    }
}

/// Transformer sizes.
#[derive(Debug, Clone, Copy)]
pub struct TransformerConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Context length.
    pub context: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// Dropout probability.
    pub dropout: f64,
    /// Gradient checkpointing: the blocks run in this many segments, every one but the last
    /// keeping only its input (0: off). Needs the model built with a `Recompute`.
    pub checkpoint: usize,
    /// The feed-forward runs on slices of this many positions (0: whole sequences); in
    /// training each slice is recomputed in the backward when the model has a `Recompute`.
    pub ffn_chunk: usize,
    /// The output head's width is the vocabulary rounded up to a multiple of this (1: no
    /// padding), and the logits are the first `vocab` columns: cuBLAS's fast GEMMs want
    /// aligned dimensions, and GPT-2's 50257 falls to a slow kernel on a GPU (llm.c pads it
    /// to 50304). The padding columns never reach the loss, so their rows get no gradient.
    pub vocab_pad: usize,
}

/// A block's position-wise feed-forward: layer norm, up projection, GELU, down projection.
#[derive(Debug, Clone)]
struct Ffn {
    ln2: ann::LayerNorm,
    /// Up projection with GELU, then down projection, as one fused module (`nn::Mlp`).
    mlp: ann::Mlp,
}

impl Module for Ffn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.mlp.forward(&self.ln2.forward(x)?)
    }
}

#[derive(Debug, Clone)]
struct Block {
    /// `x + dropout(attn(ln1(x)))`: the norm, the causal self-attention (from the
    /// projections to the output projection), the dropout and the add one fused module
    /// (`nn::Residual` over `nn::SelfAttention`).
    attn: ann::Residual,
    /// `x + dropout(mlp(ln2(x)))`, one fused module too.
    ffn: ann::Residual,
    /// The same norm and MLP for the chunked feed-forward (a memory saver).
    ffn_parts: Ffn,
    drop: ann::Dropout,
    ffn_chunk: usize,
    recompute: Option<Recompute>,
}

impl Block {
    fn new(vb: VarBuilder, c: &TransformerConfig, drop: Generator, recompute: Option<Recompute>) -> Result<Self> {
        let d = c.d_model;
        let drop = ann::Dropout::new(c.dropout, drop)?;
        let ffn_parts = Ffn {
            ln2: ann::layer_norm(d, 1e-5, vb.pp("ln2"))?,
            mlp: ann::Mlp::new(vec![
                ann::linear(d, 4 * d, vb.pp("up"))?.with_activation(Activation::Gelu),
                ann::linear(4 * d, d, vb.pp("down"))?,
            ]),
        };
        Ok(Self {
            attn: ann::Residual::new(
                ann::layer_norm(d, 1e-5, vb.pp("ln1"))?,
                ann::self_attention(d, c.heads, true, vb.clone())?,
                drop.clone(),
            ),
            ffn: ann::Residual::new(ffn_parts.ln2.clone(), ffn_parts.mlp.clone(), drop.clone()),
            ffn_parts,
            drop,
            ffn_chunk: c.ffn_chunk,
            recompute,
        })
    }

    fn run(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let x = self.attn.forward_t(x, train)?;
        // Dropout stays outside the slices, so its mask is drawn as in the plain forward.
        let h = match (&self.recompute, self.ffn_chunk) {
            (_, 0) => return self.ffn.forward_t(&x, train),
            (Some(rc), n) => rc.chunked_forward(&self.ffn_parts, n, 1, &x, train)?,
            // Plain chunking is for inference (its result is outside the graph).
            (None, n) if !train => chunked_forward(&self.ffn_parts, n, 1, &x)?,
            (None, _) => return self.ffn.forward_t(&x, train),
        };
        ops::add(&x, &self.drop.forward_t(&h, train)?)
    }
}

impl ModuleT for Block {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.run(x, train)
    }
}

/// A small decoder-only transformer: token and learned position embeddings, pre-norm
/// blocks of causal multi-head attention and a GELU MLP with dropout, a final layer norm
/// and a linear head.
#[derive(Debug, Clone)]
pub struct Transformer {
    tok: ann::Embedding,
    pos: Tensor,
    blocks: Vec<Block>,
    ln: ann::LayerNorm,
    head: ann::Linear,
    /// The logits' width (the head may be wider: `TransformerConfig::vocab_pad`).
    vocab: usize,
    checkpoint: usize,
    recompute: Option<Recompute>,
}

impl Transformer {
    /// Builds the transformer; dropout masks come from `drop`. `recompute` records the
    /// checkpointed segments and feed-forward slices (`c.checkpoint`, `c.ffn_chunk`); the
    /// training loop must then run the backward through it.
    pub fn new(vb: VarBuilder, c: TransformerConfig, drop: Generator, recompute: Option<Recompute>) -> Result<Self> {
        if c.checkpoint > 0 && recompute.is_none() {
            candle_core::bail!("checkpointing needs the model built with a Recompute");
        }
        let pos = vb.get_with_hints(
            (c.context, c.d_model),
            "pos",
            candle_nn::Init::Randn { mean: 0.0, stdev: 0.02 },
        )?;
        let blocks = (0..c.layers)
            .map(|i| Block::new(vb.pp(format!("block{i}")), &c, drop.clone(), recompute.clone()))
            .collect::<Result<_>>()?;
        Ok(Self {
            tok: ann::embedding(c.vocab, c.d_model, vb.pp("tok"))?,
            pos,
            blocks,
            ln: ann::layer_norm(c.d_model, 1e-5, vb.pp("ln"))?,
            head: ann::linear(c.d_model, c.vocab.next_multiple_of(c.vocab_pad.max(1)), vb.pp("head"))?,
            vocab: c.vocab,
            checkpoint: c.checkpoint,
            recompute,
        })
    }
}

impl ModuleT for Transformer {
    fn forward_t(&self, ids: &Tensor, train: bool) -> Result<Tensor> {
        let t = ids.dim(1)?;
        let mut x = ops::add(&self.tok.forward(ids)?, &self.pos.narrow(0, 0, t)?)?;
        match (&self.recompute, self.checkpoint) {
            (Some(rc), n) if n > 0 => x = rc.checkpoint_sequential(&self.blocks, n, &x, train)?,
            _ => {
                for b in &self.blocks {
                    x = b.forward_t(&x, train)?;
                }
            }
        }
        let logits = self.head.forward(&self.ln.forward(&x)?)?;
        if logits.dim(candle_core::D::Minus1)? == self.vocab {
            return Ok(logits);
        }
        logits.narrow(candle_core::D::Minus1, 0, self.vocab)
    }
}
