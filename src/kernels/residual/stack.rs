//! Consecutive residual sub-layers as one graph node.
//!
//! Between two [`Residual`] nodes the residual stream is a tensor of candle's graph, in half
//! at O2/O3, and candle's backward adds its gradient into a fresh `zeros_like` in half, in
//! candle's slow half element-wise code (about 7% of a small Llama's O2 f16 step on the
//! CPU, with the zeros' page faults). Here the sub-layers' nodes, each built exactly as it
//! would be alone on the previous one's output, run inside one node: the forward hands
//! candle the last output only, the backward runs the nodes' backwards in reverse, each
//! input gradient going straight to the node before, and returns the first input's
//! gradient. Values and gradients are those of the separate nodes bit for bit: at each
//! inner boundary the gradient is what candle's `zeros + g` would store (`-0` becomes `+0`,
//! a NaN is quieted), so that nothing downstream sees another sign of zero.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

use super::Residual;

/// The sub-layers' nodes, in order, the first built on the stack's input and each other on
/// the previous one's output.
struct Stack {
    layers: Vec<Residual>,
    /// Whether `layers[..i]` has a node that trains: node `i`'s input then takes a gradient
    /// even where the stack's input does not (`trains_before[i]`).
    trains_before: Vec<bool>,
    result: Mutex<Option<Tensor>>,
}

impl Stack {
    /// The first input's gradient (`x_grad`: wanted) after every parameter's gradient went
    /// to its sink; `g`: the last output's gradient.
    fn input_grad(&self, x_grad: bool, g: &Tensor) -> Result<Option<Tensor>> {
        let mut g = g.clone();
        for (i, layer) in self.layers.iter().enumerate().rev() {
            // Node `i`'s input is a graph edge of the separate nodes where it tracks a
            // gradient: the stack's input does, or a node before it trains.
            let want = x_grad || self.trains_before[i];
            if !want && !layer.trains {
                // Nothing before takes or gives a gradient either.
                return Ok(None);
            }
            let gx = layer.input_grad(layer.sum_dtype, want, &g)?;
            match (i, gx) {
                (0, gx) => return Ok(gx.filter(|_| x_grad)),
                (_, Some(gx)) => g = as_candle_sum(gx)?,
                (_, None) => return Ok(None),
            }
        }
        Ok(None)
    }
}

impl CustomOp1 for Stack {
    fn name(&self) -> &'static str {
        "amp-residual-stack"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        super::super::chain::hand_over(&self.result, "amp-residual-stack")
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.input_grad(true, g)?
            .map(super::super::graph_grad::for_candle)
            .transpose()
    }
}

/// The same node over `(x, anchor)` for an input outside any graph (see `wgrad::linear`).
impl CustomOp2 for Stack {
    fn name(&self) -> &'static str {
        "amp-residual-stack"
    }

    fn cpu_fwd(&self, _s1: &CpuStorage, _l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        super::super::chain::hand_over(&self.result, "amp-residual-stack")
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.input_grad(false, g)?;
        Ok((None, None))
    }
}

/// `layers` (built by [`super::build`], the first on `x`, each other on the previous one's
/// [`Residual::output`]) applied to candle's graph as one node on `x`, returning the last
/// output: one node alone is applied as itself; none returns `x`.
pub(crate) fn stack(x: &Tensor, mut layers: Vec<Residual>) -> Result<Tensor> {
    if layers.len() <= 1 {
        return match layers.pop() {
            Some(node) => node.apply(x),
            None => Ok(x.clone()),
        };
    }
    let mut trains_before = Vec::with_capacity(layers.len());
    let mut trains = false;
    for l in &layers {
        trains_before.push(trains);
        trains |= l.trains;
    }
    let last = layers.last().map(Residual::output).transpose()?;
    // The inner outputs live on as the next nodes' inputs; only the last goes to candle.
    for l in &layers {
        l.result.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
    let node = Stack {
        layers,
        trains_before,
        result: Mutex::new(last),
    };
    let x = super::super::dense(x)?;
    super::super::wgrad::apply_node(&x, node, trains)
}

/// `g` as candle stores it after adding it into a zero tensor of its type (`0 + g`, in f32
/// for half types, rounded back): `-0` becomes `+0` and a signalling NaN is quieted; every
/// other value is itself. The same tensor where no value changes (the common case: one
/// read-only pass).
fn as_candle_sum(g: Tensor) -> Result<Tensor> {
    let g = super::super::dense(&g)?;
    let (st, l) = g.storage_and_layout();
    let (Storage::Cpu(cpu), Some((a, b))) = (&*st, l.contiguous_offsets()) else {
        candle_core::bail!("amp-residual-stack: an inner gradient is not a dense CPU tensor")
    };
    let fixed = match cpu {
        CpuStorage::F32(v) => fix(&v[a..b], |x: &f32| x.to_bits(), f32::from_bits, F32_BITS)
            .map(|v| Tensor::from_vec(v, g.shape(), g.device())),
        CpuStorage::F16(v) => fix(&v[a..b], |x: &f16| x.to_bits(), f16::from_bits, F16_BITS)
            .map(|v| Tensor::from_vec(v, g.shape(), g.device())),
        CpuStorage::BF16(v) => fix(&v[a..b], |x: &bf16| x.to_bits(), bf16::from_bits, BF16_BITS)
            .map(|v| Tensor::from_vec(v, g.shape(), g.device())),
        _ => None,
    };
    drop(st);
    match fixed {
        Some(t) => t,
        None => Ok(g),
    }
}

/// A float format's bits: the sign, the exponent (all ones: infinity or NaN) and the quiet
/// bit of a NaN.
#[derive(Clone, Copy)]
struct Bits {
    sign: u32,
    exp: u32,
    quiet: u32,
}

const F32_BITS: Bits = Bits {
    sign: 0x8000_0000,
    exp: 0x7f80_0000,
    quiet: 0x0040_0000,
};
const F16_BITS: Bits = Bits {
    sign: 0x8000,
    exp: 0x7c00,
    quiet: 0x0200,
};
const BF16_BITS: Bits = Bits {
    sign: 0x8000,
    exp: 0x7f80,
    quiet: 0x0040,
};

impl Bits {
    /// `0 + v` for `v`'s bits: `+0` for `-0`, the quiet bit set on a NaN.
    fn candle_sum(self, v: u32) -> u32 {
        if v == self.sign {
            0
        } else if v & !self.sign > self.exp {
            v | self.quiet
        } else {
            v
        }
    }
}

/// `src` with [`Bits::candle_sum`] applied, or `None` where that changes no value.
fn fix<T: Copy, B: Into<u32>, F: Fn(&T) -> B, G: Fn(B) -> T>(src: &[T], bits: F, from: G, f: Bits) -> Option<Vec<T>>
where
    u32: TryInto<B>,
{
    let changes = |x: &T| {
        let v: u32 = bits(x).into();
        f.candle_sum(v) != v
    };
    if !src.iter().any(changes) {
        return None;
    }
    let map = |x: &T| {
        let v: u32 = bits(x).into();
        // In range: the result keeps the format's width (only bits within it are set).
        match f.candle_sum(v).try_into() {
            Ok(b) => from(b),
            Err(_) => *x,
        }
    };
    Some(src.iter().map(map).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// What candle's backward stores for a gradient `g` of a half or f32 tensor: `0 + g`.
    fn candle(g: &Tensor) -> Tensor {
        (g.zeros_like().unwrap() + g).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        match t.dtype() {
            DType::F32 => t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect(),
            DType::F16 => t.to_vec1::<f16>().unwrap().iter().map(|x| x.to_bits().into()).collect(),
            _ => t
                .to_vec1::<bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits().into())
                .collect(),
        }
    }

    #[test]
    fn matches_candles_zero_plus_gradient_bit_for_bit() {
        let dev = candle_core::Device::Cpu;
        // -0, +0, a signalling NaN (f32 bits 0x7f80_0001), negative numbers, infinities.
        let vals = [
            -0.0f32,
            0.0,
            f32::from_bits(0x7fa0_0001),
            -1.5,
            2.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -1e-30,
        ];
        let x = Tensor::new(&vals[..], &dev).unwrap();
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let mut g = x.to_dtype(dt).unwrap();
            if dt == DType::F16 {
                // A signalling f16 NaN (the f32 conversion quiets it).
                let mut v = g.to_vec1::<f16>().unwrap();
                v[2] = f16::from_bits(0x7d01);
                g = Tensor::new(v, &dev).unwrap();
            } else if dt == DType::BF16 {
                let mut v = g.to_vec1::<bf16>().unwrap();
                v[2] = bf16::from_bits(0x7f81);
                g = Tensor::new(v, &dev).unwrap();
            }
            let ours = as_candle_sum(g.clone()).unwrap();
            assert_eq!(bits(&ours), bits(&candle(&g)), "{dt:?}");
            assert_eq!(bits(&ours)[0], 0, "{dt:?}: -0 becomes +0");
        }
        // Nothing to change: the same storage back.
        let g = Tensor::new(&[1f32, 2.], &dev).unwrap();
        assert_eq!(as_candle_sum(g.clone()).unwrap().id(), g.id());
    }
}
