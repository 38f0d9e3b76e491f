//! The GPU bench's Llama row: `candle_amp::models::llama` at GPT-2 small's size (12 blocks,
//! width 768, 12 heads and 12 key/value heads, context 1024, SwiGLU hidden 2048, the
//! vocabulary GPT-2's 50257 padded to 50304 as llm.c pads it), or a tiny stand-in with
//! grouped-query attention for CPUs and CI, trained on random tokens as the transformer row
//! is.

use anyhow::Result;
use candle_amp::models::llama::Config;
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use super::GpuModel;

/// The Llama configuration for `model`'s size.
pub fn config(model: GpuModel) -> Config {
    let (vocab, context, hidden, heads, kv_heads, layers, ffn) = match model {
        GpuModel::Gpt2 => (50304, 1024, 768, 12, 12, 12, 2048),
        GpuModel::Tiny => (256, 32, 64, 4, 2, 2, 128),
    };
    Config {
        hidden_size: hidden,
        intermediate_size: ffn,
        vocab_size: vocab,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: context,
        tie_word_embeddings: false,
    }
}

/// The row's description in the JSON.
pub fn describe(c: &Config, batch: usize) -> Value {
    json!({
        "layers": c.num_hidden_layers,
        "d_model": c.hidden_size,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads(),
        "ffn": format!("SwiGLU {}", c.intermediate_size),
        "context": c.max_position_embeddings,
        "vocab": c.vocab_size,
        "tied_head": c.tie_word_embeddings,
        "batch": batch,
    })
}

/// Two batches of random token sequences over the whole context, with their next tokens
/// as targets (the content does not change the work).
pub fn token_batches(c: &Config, batch: usize, dev: &Device) -> Result<Vec<(Tensor, Tensor)>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
    let t = c.max_position_embeddings;
    (0..2)
        .map(|_| {
            let s: Vec<u32> = (0..batch * (t + 1))
                .map(|_| rng.random_range(0..c.vocab_size as u32))
                .collect();
            let seq = Tensor::from_vec(s, (batch, t + 1), dev)?;
            Ok((seq.narrow(1, 0, t)?.contiguous()?, seq.narrow(1, 1, t)?.contiguous()?))
        })
        .collect()
}
