//! Trainable transformer models built from the library's layers: [`llama`], [`bert`] and
//! [`vit`], configured like candle-transformers' and with the same parameter names, so a
//! safetensors file that candle-transformers loads loads here
//! ([`crate::AmpConfig::pretrained`]) and fine-tunes at every opt level.
//!
//! candle-transformers' own models cannot train as they are (candle-nn's fused norms have no
//! backward, so nothing below a norm learns) and break in half precision (f32 masks,
//! `f32::MIN` fills, bf16 convolutions on the CPU); these are the same architectures written
//! with [`crate::nn`] and [`crate::ops`], whose layers take the fused paths at every level.
//! `docs/porting.md` shows the traps and how to port another model.
//!
//! This floor sits above [`crate::nn`] and the precision floor and imports nothing above
//! them.

pub mod bert;
pub mod llama;
pub mod vit;
