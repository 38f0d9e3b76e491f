//! Chunked application of a position-wise layer (the Reformer's chunked feed-forward).

use candle_core::{Module, Tensor};

use crate::error::{AmpError, Result};
use crate::precision::autocast::{self, Phase};

/// Checks the arguments of a chunked forward.
pub(crate) fn check_chunking(x: &Tensor, chunk_size: usize, dim: usize) -> Result<()> {
    if dim >= x.rank() {
        return Err(AmpError::InvalidArgument {
            argument: "dim",
            reason: format!("dimension {dim} of a tensor of rank {} ({:?})", x.rank(), x.dims()),
        });
    }
    if chunk_size == 0 {
        return Err(AmpError::InvalidArgument {
            argument: "chunk_size",
            reason: "slices must hold at least one position".into(),
        });
    }
    Ok(())
}

/// `x` cut along `dim` into slices of `size` (the last may be shorter).
pub(crate) fn pieces(x: &Tensor, dim: usize, size: usize) -> candle_core::Result<Vec<Tensor>> {
    let n = x.dim(dim)?;
    (0..n)
        .step_by(size.max(1))
        .map(|start| x.narrow(dim, start, size.min(n - start)))
        .collect()
}

/// `f` on each slice of `x` (`size` positions along `dim`), concatenated. Later slices
/// repeat the first one's op sites, so autocast counts their half ops once.
pub(crate) fn map_slices(
    x: &Tensor,
    dim: usize,
    size: usize,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let outs = pieces(x, dim, size)?
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let _repeat = (i > 0).then(|| autocast::enter_phase(Phase::SliceRepeat));
            f(p)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&outs, dim)
}

/// [`map_slices`] outside the graph: each slice's intermediates are freed before the next
/// slice runs (candle records a graph whenever a parameter is a variable, evaluation
/// included, so keeping it would keep every slice's).
pub(crate) fn map_slices_detached(
    x: &Tensor,
    dim: usize,
    size: usize,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    map_slices(&x.detach(), dim, size, |p| f(p).map(|o| o.detach()))
}

/// Applies `module` to slices of `input` of `chunk_size` positions along `dim` and
/// concatenates the results, for inference: the same output as `module.forward(input)` for
/// a layer that is position-wise along `dim` (a transformer's feed-forward along the
/// sequence), with the intermediates of one slice at a time.
///
/// The result is outside candle's graph (detached): no gradient flows through it. candle
/// records a graph whenever a parameter is a variable, in evaluation too, and that graph
/// would keep every slice's intermediates, saving nothing. In training use
/// [`Recompute::chunked_forward`](super::Recompute::chunked_forward), which keeps the
/// gradients and recomputes each slice in the backward.
///
/// A `chunk_size` of 0 or a `dim` beyond the input's rank is an
/// [`AmpError::InvalidArgument`].
///
/// ```
/// use candle_amp::recompute::chunked_forward;
/// use candle_core::{DType, Device, Module, Tensor};
/// # fn main() -> anyhow::Result<()> {
/// let w = Tensor::randn(0f32, 1.0, (16, 16), &Device::Cpu)?;
/// let ffn = move |x: &Tensor| x.broadcast_matmul(&w)?.relu();
/// let x = Tensor::randn(0f32, 1.0, (2, 10, 16), &Device::Cpu)?;
/// let whole = ffn.forward(&x)?;
/// let sliced = chunked_forward(&ffn, 4, 1, &x)?; // slices of 4, 4 and 2 positions
/// let diff = (whole - sliced)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// # Ok(()) }
/// ```
pub fn chunked_forward<M: Module>(module: &M, chunk_size: usize, dim: usize, input: &Tensor) -> Result<Tensor> {
    check_chunking(input, chunk_size, dim)?;
    Ok(map_slices_detached(input, dim, chunk_size, |p| module.forward(p))?)
}
