//! Linear and embedding layers.

use candle_core::{Result, Tensor};
use candle_nn::{Module, VarBuilder};

use crate::precision::ops;

/// A linear layer `x w^T + b` that runs in half under autocast.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// A layer from its weight `(out, in)` and optional bias `(out,)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::linear(x, &self.weight, self.bias.as_ref())
    }
}

/// Builds a [`Linear`] as `candle_nn::linear` does (names `weight`, `bias`; same init).
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), l.bias().cloned()))
}

/// Builds a [`Linear`] without bias, as `candle_nn::linear_no_bias` does.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), None))
}

/// An embedding table. Lookups are on no cast list: they return the table's type.
#[derive(Debug, Clone)]
pub struct Embedding {
    embeddings: Tensor,
    hidden: usize,
}

impl Embedding {
    /// The table `(vocab, hidden)`.
    pub fn embeddings(&self) -> &Tensor {
        &self.embeddings
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut shape = ids.dims().to_vec();
        shape.push(self.hidden);
        self.embeddings.index_select(&ids.flatten_all()?, 0)?.reshape(shape)
    }
}

/// Builds an [`Embedding`] as `candle_nn::embedding` does (name `weight`, normal init).
pub fn embedding(vocab: usize, hidden: usize, vb: VarBuilder) -> Result<Embedding> {
    let e = candle_nn::embedding(vocab, hidden, vb)?;
    Ok(Embedding {
        embeddings: e.embeddings().clone(),
        hidden,
    })
}
