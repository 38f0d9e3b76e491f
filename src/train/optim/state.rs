//! Serialisable optimizer state.
//!
//! State buffers are f32 tensors: an algorithm's moments stay where they live, and a
//! checkpoint writes them to safetensors without a host copy. As a serde value (for
//! [`crate::optim::AmpOptimizer::state_dict`] users who store state themselves) each buffer
//! is written as a [`TensorData`].

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{AmpError, Result};

/// An f32 tensor as plain data (shape and row-major values). serde_json writes finite f32
/// values in their shortest round-tripping form, so they survive a save/load round trip
/// exactly; inf and NaN are written as strings (NaN payloads are not kept).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorData {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Values, row-major.
    #[serde(with = "crate::serde_f32::vec")]
    pub data: Vec<f32>,
}

impl TensorData {
    /// Copies a tensor out (as f32).
    pub(crate) fn from_tensor(t: &Tensor) -> Result<Self> {
        Ok(Self {
            shape: t.dims().to_vec(),
            data: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        })
    }

    /// Builds the tensor on `device`.
    pub(crate) fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        let n: usize = self.shape.iter().product();
        if n != self.data.len() {
            return Err(AmpError::OptimizerState(format!(
                "tensor of shape {:?} needs {n} values, found {}",
                self.shape,
                self.data.len()
            )));
        }
        Ok(Tensor::from_vec(self.data.clone(), self.shape.clone(), device)?)
    }
}

/// Whether two tensors have the same shape and bit-identical f32 values (NaN equals NaN).
pub(crate) fn same_values(a: &Tensor, b: &Tensor) -> bool {
    let bits = |t: &Tensor| -> Option<Vec<u32>> {
        let v = t.to_dtype(DType::F32).ok()?.flatten_all().ok()?.to_vec1::<f32>().ok()?;
        Some(v.into_iter().map(f32::to_bits).collect())
    };
    a.dims() == b.dims() && a.dtype() == b.dtype() && bits(a).is_some() && bits(a) == bits(b)
}

/// serde for a map of buffers: each tensor as [`TensorData`].
mod buffers {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(m: &BTreeMap<String, Tensor>, s: S) -> std::result::Result<S::Ok, S::Error> {
        let data: BTreeMap<&String, TensorData> = m
            .iter()
            .map(|(k, t)| Ok((k, TensorData::from_tensor(t)?)))
            .collect::<Result<_>>()
            .map_err(serde::ser::Error::custom)?;
        data.serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> std::result::Result<BTreeMap<String, Tensor>, D::Error> {
        let data = BTreeMap::<String, TensorData>::deserialize(d)?;
        data.into_iter()
            .map(|(k, t)| Ok((k, t.to_tensor(&Device::Cpu)?)))
            .collect::<Result<_>>()
            .map_err(serde::de::Error::custom)
    }
}

/// The state an algorithm keeps for one parameter.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ParamState {
    /// Steps applied to this parameter.
    pub step: u64,
    /// Named f32 buffers ("exp_avg", "momentum_buffer", ...), each of the parameter's shape.
    #[serde(with = "buffers")]
    pub buffers: BTreeMap<String, Tensor>,
}

impl PartialEq for ParamState {
    /// Equal steps, buffer names, shapes and bit-identical values.
    fn eq(&self, other: &Self) -> bool {
        self.step == other.step
            && self.buffers.len() == other.buffers.len()
            && self
                .buffers
                .iter()
                .zip(&other.buffers)
                .all(|((ka, a), (kb, b))| ka == kb && same_values(a, b))
    }
}

/// An algorithm's whole state, keyed by parameter name.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct OptimizerState {
    /// The algorithm's name; loading into another algorithm is an error.
    pub kind: String,
    /// Per-parameter state.
    pub params: BTreeMap<String, ParamState>,
}

impl OptimizerState {
    /// Errors unless the state was saved by an algorithm called `kind`.
    pub fn expect_kind(&self, kind: &str) -> Result<()> {
        if self.kind != kind {
            return Err(AmpError::OptimizerState(format!(
                "state was saved by a `{}` optimizer and cannot load into `{kind}`; build the same optimizer kind",
                self.kind
            )));
        }
        Ok(())
    }
}
