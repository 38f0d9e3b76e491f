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

use std::sync::Arc;

use candle_core::{Result, Tensor};

/// One block of a model as a function of its input (the block and what it needs besides
/// its input, such as Llama's rotary tables, cloned in).
pub type BlockFn = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// How a model runs its blocks: called as `runner(i, block, x)` for block `i` on its input
/// `x`, it returns the block's output. The default runs `block(x)`; a runner that hands the
/// block to `recompute::Recompute::checkpoint_fn` checkpoints the model per block:
///
/// ```
/// use std::sync::Arc;
/// use candle_amp::{self as amp, models::llama, recompute::Recompute};
/// use candle_core::{Device, Tensor};
/// # fn main() -> anyhow::Result<()> {
/// let cfg = llama::Config {
///     hidden_size: 16, intermediate_size: 32, vocab_size: 10, num_hidden_layers: 2,
///     num_attention_heads: 4, num_key_value_heads: Some(2), rms_norm_eps: 1e-5,
///     rope_theta: 10_000.0, rope_scaling: None, max_position_embeddings: 32,
///     tie_word_embeddings: false,
/// };
/// let (mut model, mut opt, amp) = amp::initialize(
///     |vb| llama::Llama::load(vb, &cfg),
///     amp::optim::AdamW::new(Default::default())?,
///     amp::OptLevel::O2,
/// )?;
/// let rc = Recompute::new(&amp);
/// let per_block = rc.clone();
/// model.inner_mut().set_block_runner(Some(Arc::new(move |_, block, x| {
///     Ok(per_block.checkpoint_fn(move |x| block(x), x, true)?)
/// })));
/// let ids = Tensor::new(&[[1u32, 2, 3, 4, 5]], &Device::Cpu)?;
/// let logits = model.forward(&ids.narrow(1, 0, 4)?)?;
/// let loss = amp::ops::cross_entropy(&logits, &ids.narrow(1, 1, 4)?)?;
/// amp.scale_loss(&loss, &mut opt)?.backward_with(|l| rc.backward(l))?;
/// assert_eq!(opt.master_grads().len(), amp.store().params().len()); // every block's too
/// opt.step()?;
/// # Ok(()) }
/// ```
pub type BlockRunner = Arc<dyn Fn(usize, BlockFn, &Tensor) -> Result<Tensor> + Send + Sync>;
