//! The synthetic tasks of `--model bert` and `--model vit`: their model sizes, batches
//! drawn from a generator (the run's "data" stream, so a checkpoint carries the data order),
//! a fixed held-out set, the loss and the accuracy.
//!
//! * BERT, token classification with padding: sequences of `context / 2` to `context` tokens
//!   (ids 1 to 63) padded with id 0 (the model masks it); each real token's tag says whether
//!   it and whether the sequence's first token are high (32 or more): half of it is the
//!   token's own, the other half needs attention to the first position. The loss and
//!   accuracy are over the real tokens only.
//! * ViT, image classification: 3-channel images with noise, one quadrant lit in channel 0 or
//!   1; the class (8) is the quadrant and the channel.

use anyhow::Result;
use candle_amp::models::{bert, vit};
use candle_core::{D, DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::args::Size;

/// BERT's vocabulary: id 0 is padding.
pub const BERT_VOCAB: u32 = 64;
/// BERT's tags.
pub const BERT_TAGS: usize = 4;
/// ViT's classes: four quadrants times two channels.
pub const VIT_CLASSES: usize = 8;

/// The tiny and small BERT encoders (GELU, post-norm, learned positions).
pub fn bert_config(size: Size) -> bert::Config {
    let (hidden, layers, context) = match size {
        Size::Tiny => (64, 2, 32),
        Size::Small => (128, 4, 64),
    };
    bert::Config {
        vocab_size: BERT_VOCAB as usize,
        hidden_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        intermediate_size: 4 * hidden,
        max_position_embeddings: context,
        pad_token_id: 0,
        ..bert::Config::default()
    }
}

/// The tiny (16x16 images) and small (32x32) ViTs, patches of 4.
pub fn vit_config(size: Size) -> vit::Config {
    let (hidden, layers, image) = match size {
        Size::Tiny => (64, 2, 16),
        Size::Small => (128, 4, 32),
    };
    vit::Config {
        hidden_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        intermediate_size: 4 * hidden,
        image_size: image,
        patch_size: 4,
        ..vit::Config::vit_base_patch16_224()
    }
}

/// A batch: the model's input and the targets (BERT: `(n, t)` tags, `BERT_TAGS` on padding;
/// ViT: `(n)` classes).
pub struct Batch {
    pub input: Tensor,
    pub target: Tensor,
}

/// A real token's tag: 2 when it is high (32 or more), plus 1 when the first token is.
fn tag(token: u32, first: u32) -> u32 {
    let high = |t: u32| (t >= BERT_VOCAB / 2) as u32;
    2 * high(token) + high(first)
}

/// `n` padded sequences of `context` tokens and their tags.
pub fn bert_batch(n: usize, context: usize, rng: &mut impl Rng) -> Result<Batch> {
    let (mut ids, mut tags) = (Vec::with_capacity(n * context), Vec::with_capacity(n * context));
    for _ in 0..n {
        let len = rng.random_range(context / 2..=context).max(1);
        let row: Vec<u32> = (0..context)
            .map(|j| if j < len { rng.random_range(1..BERT_VOCAB) } else { 0 })
            .collect();
        tags.extend(
            row.iter()
                .map(|&t| if t == 0 { BERT_TAGS as u32 } else { tag(t, row[0]) }),
        );
        ids.extend(row);
    }
    let dev = Device::Cpu;
    Ok(Batch {
        input: Tensor::from_vec(ids, (n, context), &dev)?,
        target: Tensor::from_vec(tags, (n, context), &dev)?,
    })
}

/// `n` noisy images of `side` x `side` and their classes.
pub fn vit_batch(n: usize, side: usize, rng: &mut impl Rng) -> Result<Batch> {
    let (mut px, mut labels) = (Vec::with_capacity(n * 3 * side * side), Vec::with_capacity(n));
    let half = side / 2;
    for _ in 0..n {
        let class = rng.random_range(0..VIT_CLASSES as u32);
        let (quadrant, channel) = (class as usize % 4, class as usize / 4);
        labels.push(class);
        for c in 0..3 {
            for y in 0..side {
                for x in 0..side {
                    let lit = c == channel && (y / half) * 2 + x / half == quadrant;
                    px.push(if lit { 1.0 } else { 0.0 } + rng.random_range(-0.5f32..0.5));
                }
            }
        }
    }
    let dev = Device::Cpu;
    Ok(Batch {
        input: Tensor::from_vec(px, (n, 3, side, side), &dev)?,
        target: Tensor::new(labels.as_slice(), &dev)?,
    })
}

/// The held-out set: `n` samples from a generator of its own (the same every run).
pub fn held_out(bert: bool, n: usize, extent: usize) -> Result<Batch> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x0004_e1d0);
    if bert {
        bert_batch(n, extent, &mut rng)
    } else {
        vit_batch(n, extent, &mut rng)
    }
}

/// BERT's logits and tags at the real (unpadded) positions: `(real, BERT_TAGS)` and
/// `(real)`.
fn real_positions(logits: &Tensor, tags: &Tensor) -> Result<(Tensor, Tensor)> {
    let flat: Vec<u32> = tags.flatten_all()?.to_vec1()?;
    let real: Vec<u32> = (0..flat.len() as u32)
        .filter(|&i| flat[i as usize] != BERT_TAGS as u32)
        .collect();
    let real = Tensor::new(real.as_slice(), logits.device())?;
    Ok((
        logits.flatten_to(1)?.index_select(&real, 0)?,
        tags.flatten_all()?.index_select(&real, 0)?,
    ))
}

/// The mean cross entropy (in f32) of `logits` for `b`; BERT's over the real tokens only.
pub fn loss(bert: bool, logits: &Tensor, b: &Batch) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let (logits, target) = if bert {
        real_positions(&logits, &b.target)?
    } else {
        (logits, b.target.clone())
    };
    Ok(candle_amp::ops::cross_entropy(&logits, &target)?)
}

/// The share of samples (ViT) or real tokens (BERT) whose largest logit is the target.
pub fn accuracy(bert: bool, logits: &Tensor, b: &Batch) -> Result<f64> {
    let logits = logits.to_dtype(DType::F32)?;
    let (logits, target) = if bert {
        real_positions(&logits, &b.target)?
    } else {
        (logits, b.target.clone())
    };
    let hits = logits.argmax(D::Minus1)?.eq(&target)?.to_dtype(DType::F32)?.sum_all()?;
    Ok(hits.to_scalar::<f32>()? as f64 / target.elem_count().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bert_batches_pad_with_zero_and_tag_padding_apart() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let b = bert_batch(16, 8, &mut rng).unwrap();
        let ids = b.input.to_vec2::<u32>().unwrap();
        let tags = b.target.to_vec2::<u32>().unwrap();
        for (row, t) in ids.iter().zip(&tags) {
            let len = row.iter().take_while(|&&i| i != 0).count();
            assert!((4..=8).contains(&len), "{row:?}");
            assert!(row[len..].iter().all(|&i| i == 0), "padding only at the end: {row:?}");
            for j in 0..8 {
                let high = |t: u32| (t >= 32) as u32;
                let want = if j < len { 2 * high(row[j]) + high(row[0]) } else { 4 };
                assert_eq!(t[j], want);
            }
        }
    }

    #[test]
    fn vit_images_light_the_quadrant_and_channel_of_their_class() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        let b = vit_batch(16, 8, &mut rng).unwrap();
        let labels = b.target.to_vec1::<u32>().unwrap();
        for (i, &class) in labels.iter().enumerate() {
            // The mean of each channel's quadrant: above 0.5 exactly where the class says.
            let img = b.input.get(i).unwrap();
            for c in 0..3 {
                for q in 0..4 {
                    let (y, x) = ((q / 2) * 4, (q % 2) * 4);
                    let m = img
                        .get(c)
                        .unwrap()
                        .narrow(0, y, 4)
                        .unwrap()
                        .narrow(1, x, 4)
                        .unwrap()
                        .mean_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap();
                    let lit = c == class as usize / 4 && q == class as usize % 4;
                    assert_eq!(
                        m > 0.5,
                        lit,
                        "image {i} class {class}: channel {c} quadrant {q} mean {m}"
                    );
                }
            }
        }
    }

    #[test]
    fn loss_and_accuracy_skip_bert_padding() {
        // Two sequences of 3, the second padded after 1 token: 4 real tokens.
        let b = Batch {
            input: Tensor::new(&[[1u32, 2, 3], [5, 0, 0]], &Device::Cpu).unwrap(),
            target: Tensor::new(&[[2u32, 3, 0], [2, 4, 4]], &Device::Cpu).unwrap(),
        };
        // Logits that pick tag 2 everywhere: right on 2 of the 4 real tokens.
        let mut v = vec![0f32; 2 * 3 * 4];
        for p in 0..6 {
            v[p * 4 + 2] = 10.0;
        }
        let logits = Tensor::from_vec(v, (2, 3, 4), &Device::Cpu).unwrap();
        assert_eq!(accuracy(true, &logits, &b).unwrap(), 0.5);
        // Padding's "tag" 4 is out of range: a loss over it would fail; over the real tokens
        // it is the mean of two near-zero and two near-10 terms.
        let l = loss(true, &logits, &b).unwrap().to_scalar::<f32>().unwrap();
        assert!((l - 5.0).abs() < 1e-3, "{l}");
    }
}
