//! The example's models.

use candle_core::{Result, Tensor};
use candle_nn::{Linear, Module, VarBuilder, linear};

/// An MLP `input -> hidden -> hidden -> classes` with ReLU.
#[derive(Debug, Clone)]
pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Mlp {
    /// Builds the MLP with parameters `fc1.*`, `fc2.*`, `fc3.*`.
    pub fn new(vb: VarBuilder, input: usize, hidden: usize, classes: usize) -> Result<Self> {
        Ok(Self {
            fc1: linear(input, hidden, vb.pp("fc1"))?,
            fc2: linear(hidden, hidden, vb.pp("fc2"))?,
            fc3: linear(hidden, classes, vb.pp("fc3"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward(x)?.relu()?;
        let h = self.fc2.forward(&h)?.relu()?;
        self.fc3.forward(&h)
    }
}
