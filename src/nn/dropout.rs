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

impl ModuleT for Dropout {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if !train || self.p == 0.0 {
            return Ok(x.clone());
        }
        let keep = 1.0 - self.p;
        let scale = (1.0 / keep) as f32;
        let mask: Vec<f32> = {
            let mut rng = self.generator.lock();
            (0..x.elem_count())
                .map(|_| if rng.random::<f64>() < keep { scale } else { 0.0 })
                .collect()
        };
        let mask = crate::kernels::cast(&Tensor::from_vec(mask, x.shape(), x.device())?, x.dtype())?;
        // One node (for half tensors on the CPU) whose backward stays out of candle's half
        // element-wise code.
        crate::kernels::elementwise::mul_const(x, &mask)
    }
}
