//! The three models of `candle_amp::models` on small learnable tasks, shared by
//! `tests/models_recompute.rs`, `tests/models_recompute_blocks.rs`,
//! `tests/models_recompute_memory.rs` and `tests/models_dist.rs`: a model built in a run, its
//! optimizer, its batches (whole, or one rank's rows) and its loss.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_amp::models::{bert, llama, vit};
use candle_amp::{self as amp, Amp};
use candle_core::{DType, Device, Tensor};
use candle_nn::ModuleT;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Which model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Bert,
    Vit,
}

pub const ARCHS: [Arch; 3] = [Arch::Llama, Arch::Bert, Arch::Vit];

/// A model's forward as a function of its input (token ids or images), shareable with a
/// checkpointed segment (which runs it again in the backward).
pub type Forward = Arc<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// Llama: 2 blocks, grouped-query attention (4 heads, 2 key/value heads), tied embeddings.
pub fn llama_cfg() -> llama::Config {
    llama::Config {
        hidden_size: 32,
        intermediate_size: 48,
        vocab_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: true,
    }
}

/// BERT: 2 post-norm layers, 3 tags, id 0 is padding.
pub fn bert_cfg() -> bert::Config {
    bert::Config {
        vocab_size: 24,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 32,
        max_position_embeddings: 12,
        layer_norm_eps: 1e-12,
        ..bert::Config::default()
    }
}

/// ViT: 8x8 images in 4x4 patches, 2 layers, 4 classes.
pub fn vit_cfg() -> vit::Config {
    vit::Config {
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 32,
        image_size: 8,
        patch_size: 4,
        layer_norm_eps: 1e-12,
        ..vit::Config::vit_base_patch16_224()
    }
}

/// Builds `arch` in `amp`'s run (before its optimizer) and returns its forward.
pub fn build(arch: Arch, amp: &Amp) -> Forward {
    fn share<M: ModuleT + Send + Sync + 'static>(m: amp::AmpModel<M>) -> Forward {
        let m = Arc::new(m);
        Arc::new(move |x: &Tensor| m.forward(x))
    }
    match arch {
        Arch::Llama => share(amp.model(|vb| llama::Llama::load(vb, &llama_cfg())).unwrap()),
        Arch::Bert => share(
            amp.model(|vb| bert::BertForTokenClassification::load(vb, &bert_cfg(), 3))
                .unwrap(),
        ),
        Arch::Vit => share(amp.model(|vb| vit::Model::load(vb, &vit_cfg(), 4)).unwrap()),
    }
}

/// One batch: the model's input and what the loss compares its output with.
#[derive(Clone)]
pub struct Batch {
    pub input: Tensor,
    pub target: Tensor,
}

impl Batch {
    /// Rows `[rank * n / world, (rank + 1) * n / world)`: one rank's share.
    pub fn shard(&self, rank: usize, world: usize) -> Batch {
        let n = self.input.dim(0).unwrap() / world;
        Batch {
            input: self.input.narrow(0, rank * n, n).unwrap(),
            target: self.target.narrow(0, rank * n, n).unwrap(),
        }
    }
}

/// The optimizer the tasks train with: AdamW at lr 1e-2 under `amp`.
pub fn adamw(amp: &Amp) -> candle_amp::optim::AmpOptimizer {
    let cfg = candle_amp::optim::AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    amp.optimizer(candle_amp::optim::AdamW::new(cfg).unwrap()).unwrap()
}

/// `steps` batches of `rows` samples for `arch`, seeded, on `dev`.
///
/// - Llama: next-token prediction where each token is the last plus 1 or 2 (mod 16).
/// - BERT: sequences of 8 padded to lengths 2..8 (id 0), each real token tagged with
///   `(token + first token) % 3`; padded positions have target 3 (left out of the loss).
/// - ViT: noisy images whose class is the bright quadrant.
pub fn batches(arch: Arch, rows: usize, steps: usize, seed: u64, dev: &Device) -> Vec<Batch> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..steps)
        .map(|_| match arch {
            Arch::Llama => {
                let t = 16;
                let mut v = Vec::with_capacity(rows * (t + 1));
                for _ in 0..rows {
                    let mut x = rng.random_range(0..16u32);
                    for _ in 0..=t {
                        v.push(x);
                        x = (x + 1 + rng.random_range(0..2)) % 16;
                    }
                }
                let all = Tensor::from_vec(v, (rows, t + 1), dev).unwrap();
                Batch {
                    input: all.narrow(1, 0, t).unwrap(),
                    target: all.narrow(1, 1, t).unwrap(),
                }
            }
            Arch::Bert => {
                let t = 8;
                let (mut ids, mut tags) = (Vec::new(), Vec::new());
                for _ in 0..rows {
                    let n = rng.random_range(2..=t);
                    let row: Vec<u32> = (0..t)
                        .map(|j| if j < n { rng.random_range(1..24) } else { 0 })
                        .collect();
                    tags.extend(row.iter().map(|&id| if id == 0 { 3 } else { (id + row[0]) % 3 }));
                    ids.extend(row);
                }
                Batch {
                    input: Tensor::from_vec(ids, (rows, t), dev).unwrap(),
                    target: Tensor::from_vec(tags, (rows, t), dev).unwrap(),
                }
            }
            Arch::Vit => {
                let (mut px, mut labels) = (Vec::new(), Vec::new());
                for _ in 0..rows {
                    let q = rng.random_range(0..4u32);
                    labels.push(q);
                    for _ in 0..3 {
                        for y in 0..8 {
                            for x in 0..8 {
                                let lit = (y / 4) * 2 + x / 4 == q;
                                px.push(if lit { 1.0 } else { 0.0 } + rng.random_range(-0.3f32..0.3));
                            }
                        }
                    }
                }
                Batch {
                    input: Tensor::from_vec(px, (rows, 3, 8, 8), dev).unwrap(),
                    target: Tensor::new(labels.as_slice(), dev).unwrap(),
                }
            }
        })
        .collect()
}

/// The mean cross entropy of the model's output for `b` (BERT: over the real tokens only).
pub fn loss(arch: Arch, out: &Tensor, b: &Batch) -> Tensor {
    let out = out.to_dtype(DType::F32).unwrap();
    match arch {
        Arch::Llama | Arch::Vit => amp::ops::cross_entropy(&out, &b.target).unwrap(),
        Arch::Bert => {
            let tags: Vec<u32> = b.target.flatten_all().unwrap().to_vec1().unwrap();
            let real: Vec<u32> = (0..tags.len() as u32).filter(|&i| tags[i as usize] != 3).collect();
            let real = Tensor::new(real.as_slice(), out.device()).unwrap();
            let picked = out.flatten_to(1).unwrap().index_select(&real, 0).unwrap();
            let tags = b.target.flatten_all().unwrap().index_select(&real, 0).unwrap();
            amp::nn::loss::cross_entropy(&picked, &tags).unwrap()
        }
    }
}

/// A tensor's values as f32 bits.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Every parameter's f32 value (the master at O2) as bits, by name.
pub fn f32_state(amp: &Amp) -> BTreeMap<String, Vec<u32>> {
    amp.store()
        .f32_values()
        .unwrap()
        .iter()
        .map(|(n, t)| (n.clone(), bits(t)))
        .collect()
}

/// Every parameter's working copy (what the model computes with) as f32 bits, by name.
pub fn working_state(amp: &Amp) -> BTreeMap<String, Vec<u32>> {
    amp.store()
        .params()
        .iter()
        .map(|p| (p.name().to_string(), bits(p.working())))
        .collect()
}

/// The largest elementwise difference between two equal-shaped bit maps read as f32,
/// relative to the largest magnitude of `b`'s tensor.
pub fn max_rel_diff(a: &BTreeMap<String, Vec<u32>>, b: &BTreeMap<String, Vec<u32>>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .map(|(n, x)| {
            let y = &b[n];
            let scale = y.iter().map(|&v| f32::from_bits(v).abs()).fold(1e-6, f32::max);
            x.iter()
                .zip(y)
                .map(|(&p, &q)| (f32::from_bits(p) - f32::from_bits(q)).abs() / scale)
                .fold(0.0, f32::max)
        })
        .fold(0.0, f32::max)
}
