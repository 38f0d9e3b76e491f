//! Memory savers beside mixed precision: gradient checkpointing (Chen et al., "Training
//! Deep Nets with Sublinear Memory Cost", 2016) and chunked position-wise layers (the
//! Reformer's chunked feed-forward).
//!
//! * [`Recompute`]: `checkpoint`, `checkpoint_sequential` and a training `chunked_forward`
//!   that keep only segment inputs in the forward, and the backward driver that recomputes
//!   the segments (for `ScaleLoss::backward_with` or `GradScaler`);
//! * [`chunked_forward`]: a layer applied slice by slice, for inference.

mod chunk;
mod seed;
mod tape;

pub use chunk::chunked_forward;
pub use tape::Recompute;
