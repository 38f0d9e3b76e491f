//! Backpropagating a given gradient from a tensor: candle's `backward` starts from a scalar
//! with gradient one, so the driver needs a scalar whose backward hands `grad` to `x`.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// A scalar node over `x` whose backward gives `x` exactly `grad` (no product, no extra
/// buffer the size of `x`).
struct Seed {
    grad: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "candle-amp-recompute-seed"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> Result<Option<Tensor>> {
        // Strided for a half gradient: candle adds it into a fresh zeros_like (see
        // `kernels::graph_grad`).
        Ok(Some(crate::kernels::graph_grad::for_candle(self.grad.clone())?))
    }
}

/// Backpropagates `grad` (the gradient of the loss with respect to `x`, same shape and
/// type) through `x`'s graph and returns the gradients of the variables it reaches, and
/// only those: candle's store also keeps a gradient for every constant of the graph
/// (dropout masks, detached inputs), which the driver would otherwise hold for every
/// segment until the end of the backward.
pub(crate) fn backward_from(x: &Tensor, grad: &Tensor) -> Result<GradStore> {
    if x.shape() != grad.shape() || x.dtype() != grad.dtype() {
        candle_core::bail!(
            "recompute: a gradient of shape {:?} ({:?}) for a tensor of shape {:?} ({:?})",
            grad.dims(),
            grad.dtype(),
            x.dims(),
            x.dtype()
        )
    }
    let all = if x.device().is_cpu() {
        x.apply_op1(Seed { grad: grad.clone() })?.backward()?
    } else {
        // Other devices: the same gradient through a product and a sum (the custom op has
        // only a CPU forward).
        (x * grad.detach())?.sum_all()?.backward()?
    };
    let mut vars = GradStore::default();
    for node in x.sorted_nodes() {
        if let Some(g) = all.get(node).filter(|_| node.is_variable()) {
            vars.insert(node, g.clone());
        }
    }
    Ok(vars)
}
