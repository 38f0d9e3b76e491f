//! A chain of linear layers as one fused module.

use candle_core::{Result, Tensor};
use candle_nn::Module;

use super::linear::{Activation, Linear};
use crate::kernels::wgrad::Act;
use crate::precision::fused;

/// [`Linear`] layers applied in turn, each with its own activation
/// ([`Linear::with_activation`]), as one fused module: Apex's `apex.mlp.MLP`, Transformer
/// Engine's `LayerNormMLP` without the norm.
///
/// Inside a run, with half values on the CPU, the whole chain is one node of candle's graph:
/// the tensors between the layers are never half tensors of the graph, whose backward would
/// accumulate each one's gradient in half (slowly on the CPU); each parameter's gradient goes
/// to the run in f32, as a single [`Linear`]'s does. The values and gradients are the same,
/// bit for bit, as running the layers one by one, which is what happens elsewhere: outside a
/// run, in f32 (O0), off the CPU, while the numerics doctor records the step or a layer is
/// kept in f32 (both work per named layer), and with GELU on the last layer under autocast
/// (O1, which returns GELU in f32; GELU on an inner layer fuses, with the same values as
/// the f32 GELU rounded for the next layer). No layers: the identity.
///
/// ```
/// use candle_amp::nn::{Activation, Linear, Mlp};
/// use candle_core::{Device, Module, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let up = Linear::new(Tensor::new(&[[1f32], [-1.]], &dev)?, None).with_activation(Activation::Relu);
/// let down = Linear::new(Tensor::new(&[[1f32, 1.]], &dev)?, None);
/// let mlp = Mlp::new(vec![up, down]);
/// let y = mlp.forward(&Tensor::new(&[[2f32], [-3.]], &dev)?)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[2.0], [3.0]]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// The chain of `layers`, first to last.
    pub fn new(layers: Vec<Linear>) -> Self {
        Self { layers }
    }

    /// The layers, first to last.
    pub fn layers(&self) -> &[Linear] {
        &self.layers
    }
}

impl Mlp {
    /// The layers as the fused chain takes them: weight, bias, activation.
    pub(crate) fn chain_spec(&self) -> Vec<(&Tensor, Option<&Tensor>, Option<Act>)> {
        self.layers
            .iter()
            .map(|l| {
                let act = l.activation().map(|a| match a {
                    Activation::Relu => Act::Relu,
                    Activation::Gelu => Act::Gelu,
                    Activation::GeluTanh => Act::GeluTanh,
                });
                (l.weight(), l.bias(), act)
            })
            .collect()
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = fused::linear_chain(x, &self.chain_spec())? {
            return Ok(y);
        }
        self.layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))
    }
}
