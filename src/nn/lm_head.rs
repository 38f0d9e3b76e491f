//! A language model's head and its loss in one call, without a half logits tensor.

use candle_core::{DType, Module, Result, Tensor};

use super::Linear;
use crate::error::AmpError;
use crate::kernels::lm_head::{self, Head, IGNORED};
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
/// the three products of a forward and backward even when no backward follows. Elsewhere
/// (outside a run, all in f32 at O0, off the CPU, a head with an activation, a recorded
/// step or a layer kept in f32) it is the plain composition above. The two agree within
/// f32 rounding: the fused node accumulates the loss and gradients in another order and
/// rounds the logits and their gradient to half nowhere.
///
/// Errors (typed, [`AmpError::InvalidArgument`] on `targets`): targets not of an integer
/// type, not one per row, or (on the CPU) outside `0..vocab` and not the ignored value.
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
    let flat = targets.flatten_all()?;
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
    Ok(Some(idx.into()))
}

fn in_range(v: i64, vocab: usize) -> Result<u32> {
    if v < 0 || v as u64 >= vocab as u64 {
        return Err(bad_targets(format!(
            "class indices in 0..{vocab} (or the type's maximum, ignored), got {v}"
        )));
    }
    Ok(v as u32)
}
