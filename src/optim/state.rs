//! Serialisable optimizer state.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

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
    pub fn from_tensor(t: &Tensor) -> Result<Self> {
        Ok(Self {
            shape: t.dims().to_vec(),
            data: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        })
    }

    /// Builds the tensor on `device`.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
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

/// The state an algorithm keeps for one parameter.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ParamState {
    /// Steps applied to this parameter.
    pub step: u64,
    /// Named buffers ("exp_avg", "momentum_buffer", ...).
    pub buffers: BTreeMap<String, TensorData>,
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
