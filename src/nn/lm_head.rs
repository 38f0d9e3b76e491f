//! A language model's head and its loss in one call, without a half logits tensor.

use candle_core::{DType, Module, Result, Tensor};

use super::Linear;
use crate::error::AmpError;
use crate::kernels::lm_head::{self, Head, IGNORED};
use crate::kernels::lm_head_chunked;
use crate::precision::autocast;
use crate::precision::ops;

/// The mean cross entropy of `head(hidden)` against integer `targets`: the same value and
/// gradients as [`crate::ops::cross_entropy`]`(&head.forward(hidden)?, targets)` (PyTorch's
/// `cross_entropy(linear(h, w, b), t)`, mean over the rows; a target equal to its type's
/// maximum ignored: loss and gradient 0 for its row, still counted in the mean), for a head
/// without activation. `hidden` is `(..., d)`, `targets` the leading dims' values (`u8`, `u32`
/// or `i64`, any shape with one value per row). Tied to the embedding: the head is
/// `Linear::new(embedding.embeddings().clone(), None)`, and the table's gradient is the sum
/// of both uses.
///
/// Inside a run, where the head's parameters are the run's and the product runs in half (O1,
/// O2, O3, on the CPU), the head and the loss are one node (Liger's and Transformer Engine's
/// fused linear cross entropy, llm.c's fused classifier): the logits are computed in f32 a
/// chunk of rows at a time, reduced to the loss and turned into the gradient at the logits
/// right away, so no `N x vocab` tensor (half logits, their f32 copy, their half gradient) is
/// ever made; the forward computes the hidden's and the weight's gradients (f32
/// accumulations), which the backward scales by the loss's gradient, sending the weight's
/// and bias's to the run in f32 as [`Linear`] does. The forward of that node therefore costs
/// the three products of a forward and backward even when no backward follows.
///
/// On a CUDA device (inside a run or not, at any level, the head and the hidden of one float
/// type after the policy's casts), the head and the loss are one node too, over row chunks of
/// at most 32 Mi logits: each chunk's logits come from candle's matmul (cuBLAS) in the
/// hidden's type as the plain path's do, one kernel turns them into the rows'
/// log-probabilities and the gradient at the logits (f32 arithmetic, stored in the logits'
/// type), and the chunk's share of the hidden's, weight's and bias's gradients follows from
/// two more products, the weight's and bias's summed over the chunks in f32. The backward
/// scales those by the loss's gradient and returns them through candle's graph in the
/// parameters' own types. So the `N x vocab` logits and their gradient never exist whole
/// (at GPT-2's vocabulary and 8192 tokens, 0.8 GB each in half). The targets are copied to
/// the host once to be checked (one host read per call).
///
/// Elsewhere (outside a run, all in f32 at O0 on the CPU, another device, a head with an
/// activation, a recorded step or a layer kept in f32) it is the plain composition above.
/// The fused nodes and the plain path agree within rounding: the nodes accumulate the loss
/// and gradients in another order; the CPU node rounds the logits and their gradient to
/// half nowhere, the CUDA node rounds them as the plain path does but sums the weight's
/// gradient in f32.
///
/// Errors (typed, [`AmpError::InvalidArgument`] on `targets`): targets not of an integer
/// type, not one per row, or (on the CPU, and on CUDA where the node runs) outside `0..vocab`
/// and not the ignored value.
///
/// ```
/// use candle_amp::nn::{Linear, linear_cross_entropy};
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let head = Linear::new(Tensor::new(&[[1f32, 0.], [0., 1.], [1., 1.]], &dev)?, None);
/// let h = Tensor::new(&[[0.5f32, -1.], [2., 0.]], &dev)?;
/// let t = Tensor::new(&[2u32, 0], &dev)?;
/// let loss = linear_cross_entropy(&h, &head, &t)?.to_scalar::<f32>()?;
/// let plain = candle_amp::ops::cross_entropy(&h.matmul(&head.weight().t()?)?, &t)?;
/// assert!((loss - plain.to_scalar::<f32>()?).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn linear_cross_entropy(hidden: &Tensor, head: &Linear, targets: &Tensor) -> Result<Tensor> {
    let w = head.weight();
    let d = hidden.dims().last().copied().unwrap_or(0);
    let rows = hidden.dims()[..hidden.rank().saturating_sub(1)]
        .iter()
        .product::<usize>();
    let vocab = w.dims().first().copied().unwrap_or(0);
    let checked = check_targets(targets, hidden.rank(), rows, vocab)?;
    let plain = || ops::cross_entropy(&head.forward(hidden)?, targets);
    // On CUDA the chunked node whether or not a run holds the head: candle's graph carries
    // its gradients (no stash needed), and the full logits cost the same memory anywhere.
    let on_device = hidden.device().is_cuda() || lm_head_chunked::forced();
    if on_device
        && head.activation().is_none()
        && autocast::hooked_context().is_none()
        && crate::kernels::enabled()
        && rows > 0
        && d > 0
        && vocab > 0
    {
        return chunked(hidden, head, targets, checked, (rows, d, vocab));
    }
    let (Some(t), None) = (checked, head.activation()) else {
        return plain();
    };
    if autocast::hooked_context().is_some() || !hidden.device().is_cpu() || hidden.rank() == 0 {
        return plain();
    }
    let Some(stash) = autocast::run_stash() else {
        return plain();
    };
    let half = |dt: DType| matches!(dt, DType::F16 | DType::BF16);
    // All in f32 (O0): candle's accumulation is f32 already, as for `Linear`. Types that
    // differ outside autocast: the plain path's promotion rules.
    let in_half = autocast::is_enabled() || (half(hidden.dtype()) && hidden.dtype() == w.dtype());
    if !in_half {
        return plain();
    }
    let key = |p: &Tensor| stash.trains(p).map(|t| t.then(|| p.clone()));
    let Some(w_key) = key(w) else {
        return plain();
    };
    let b_key = match head.bias() {
        Some(b) => match key(b) {
            Some(k) => k,
            None => return plain(),
        },
        None => None,
    };
    let mut args = vec![hidden, w];
    args.extend(head.bias());
    ops::call("linear", &args, |xs| {
        let h2 = xs[0].reshape((rows, d))?;
        let parts = Head {
            w: &xs[1],
            b: xs.get(2),
            w_key: w_key.as_ref(),
            b_key: b_key.as_ref(),
        };
        match lm_head::linear_cross_entropy(&h2, parts, t, stash)? {
            Some(loss) => Ok(loss),
            // Types the node does not take (after the policy's casts): the plain ops.
            None => ops::cross_entropy(&crate::kernels::linear(&xs[0], &xs[1], xs.get(2))?, targets),
        }
    })
}

/// The CUDA node (`kernels::lm_head_chunked`; on the CPU under the testing switch) after the
/// policy's casts, the targets' values checked on the host; the plain ops where it does not
/// apply to the cast operands.
fn chunked(
    hidden: &Tensor,
    head: &Linear,
    targets: &Tensor,
    checked: Option<lm_head::Targets>,
    (rows, d, vocab): (usize, usize, usize),
) -> Result<Tensor> {
    let mut args = vec![hidden, head.weight()];
    args.extend(head.bias());
    ops::call("linear", &args, |xs| {
        let h2 = xs[0].reshape((rows, d))?;
        if !lm_head_chunked::applies(&h2, &xs[1], xs.get(2)) {
            return ops::cross_entropy(&crate::kernels::linear(&xs[0], &xs[1], xs.get(2))?, targets);
        }
        let t = match checked {
            Some(t) => t,
            None => target_values(targets, vocab)?,
        };
        lm_head_chunked::linear_cross_entropy(&h2, &xs[1], xs.get(2), &t)
    })
}

fn bad_targets(reason: String) -> candle_core::Error {
    AmpError::InvalidArgument {
        argument: "targets",
        reason,
    }
    .into()
}

/// The targets' type and count checked; on the CPU their values too, returned as row
/// indices (`IGNORED` for a type's maximum). `None`: off the CPU (the plain path's rules).
fn check_targets(targets: &Tensor, rank: usize, rows: usize, vocab: usize) -> Result<Option<lm_head::Targets>> {
    if !matches!(targets.dtype(), DType::U8 | DType::U32 | DType::I64) {
        return Err(bad_targets(format!(
            "class indices of type u8, u32 or i64, got {:?}",
            targets.dtype()
        )));
    }
    if rank == 0 || targets.elem_count() != rows {
        return Err(bad_targets(format!(
            "one class index per row of the hidden ({rows} rows), got shape {:?}",
            targets.shape()
        )));
    }
    if !targets.device().is_cpu() {
        return Ok(None);
    }
    target_values(targets, vocab).map(Some)
}

/// The targets' values (on any device: copied to the host once) as row indices, checked to
/// be in `0..vocab` or the type's maximum (`IGNORED`).
fn target_values(targets: &Tensor, vocab: usize) -> Result<lm_head::Targets> {
    let flat = targets.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
    let idx: Vec<u32> = match targets.dtype() {
        DType::U8 => flat
            .to_vec1::<u8>()?
            .into_iter()
            .map(|v| {
                if v == u8::MAX {
                    Ok(IGNORED)
                } else {
                    in_range(v as i64, vocab)
                }
            })
            .collect::<Result<_>>()?,
        DType::U32 => flat
            .to_vec1::<u32>()?
            .into_iter()
            .map(|v| {
                if v == u32::MAX {
                    Ok(IGNORED)
                } else {
                    in_range(v as i64, vocab)
                }
            })
            .collect::<Result<_>>()?,
        _ => flat
            .to_vec1::<i64>()?
            .into_iter()
            .map(|v| if v == i64::MAX { Ok(IGNORED) } else { in_range(v, vocab) })
            .collect::<Result<_>>()?,
    };
    Ok(idx.into())
}

fn in_range(v: i64, vocab: usize) -> Result<u32> {
    if v < 0 || v as u64 >= vocab as u64 {
        return Err(bad_targets(format!(
            "class indices in 0..{vocab} (or the type's maximum, ignored), got {v}"
        )));
    }
    Ok(v as u32)
}
