//! Dropout with masks from a seeded generator the run owns.

use candle_core::{Result, Tensor};
use candle_nn::ModuleT;
use rand::Rng;

use crate::train::rng::Generator;

/// Inverted dropout: in training, zeroes each element with probability `p` and scales the
/// rest by `1/(1-p)`; in evaluation, the identity. Masks come from a [`Generator`] (e.g.
/// `amp.generator("dropout")`), so runs reproduce and resume exactly; candle's CPU generator
/// cannot be seeded.
#[derive(Debug, Clone)]
pub struct Dropout {
    p: f64,
    generator: Generator,
}

impl Dropout {
    /// A dropout layer with drop probability `p` in `[0, 1)`.
    pub fn new(p: f64, generator: Generator) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            candle_core::bail!("dropout probability must be in [0, 1), got {p}")
        }
        Ok(Self { p, generator })
    }
}

impl Dropout {
    /// The mask for an input of `shape` (f32: 0 or `1/(1-p)` per element), drawn from the
    /// generator; `None` in evaluation or with `p = 0` (the identity).
    pub(crate) fn mask(
        &self,
        shape: &candle_core::Shape,
        device: &candle_core::Device,
        train: bool,
    ) -> Result<Option<Tensor>> {
        if !train || self.p == 0.0 {
            return Ok(None);
        }
        let keep = 1.0 - self.p;
        let scale = (1.0 / keep) as f32;
        let mask: Vec<f32> = {
            let mut rng = self.generator.lock();
            (0..shape.elem_count())
                .map(|_| if rng.random::<f64>() < keep { scale } else { 0.0 })
                .collect()
        };
        Ok(Some(Tensor::from_vec(mask, shape, device)?))
    }

    /// `x` times `mask` (from [`Self::mask`]) cast to `x`'s type.
    pub(crate) fn apply(x: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let Some(mask) = mask else { return Ok(x.clone()) };
        let mask = crate::kernels::cast(mask, x.dtype())?;
        // One node (for half tensors on the CPU) whose backward stays out of candle's half
        // element-wise code.
        crate::kernels::elementwise::mul_const(x, &mask)
    }
}

impl ModuleT for Dropout {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mask = self.mask(x.shape(), x.device(), train)?;
        Self::apply(x, mask.as_ref())
    }
}
