//! AdamW (decoupled weight decay), in f32, with its moments in our own serialisable state.

use std::collections::BTreeMap;

use candle_core::Tensor;

use super::{GroupHyper, Optimizer, OptimizerState, ParamState, ParamUpdate};
use crate::error::{AmpError, Result};

/// AdamW settings (candle-nn's and PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (1e-3).
    pub lr: f64,
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Denominator epsilon (1e-8; fine in f32, where the arithmetic happens).
    pub eps: f64,
    /// Decoupled weight decay (0.01).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

struct Moments {
    step: u64,
    m: Tensor,
    v: Tensor,
}

/// AdamW. Per parameter, with its own step counter `t` (parameters that got no gradient do
/// not advance, as in PyTorch):
/// `m = b1*m + (1-b1)*g`, `v = b2*v + (1-b2)*g^2`,
/// `p = p*(1 - lr*wd) - lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)`,
/// the same operations in the same order as candle-nn's `AdamW`.
pub struct AdamW {
    config: AdamWConfig,
    state: BTreeMap<String, Moments>,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("params", &self.state.len())
            .finish()
    }
}

impl AdamW {
    /// A new AdamW; moments are created per parameter at its first update.
    pub fn new(config: AdamWConfig) -> Result<Self> {
        let c = config;
        let ok = c.lr >= 0.0
            && (0.0..1.0).contains(&c.beta1)
            && (0.0..1.0).contains(&c.beta2)
            && c.eps > 0.0
            && c.weight_decay >= 0.0;
        if !ok {
            return Err(AmpError::OptimizerState(format!(
                "AdamW needs lr >= 0, betas in [0, 1), eps > 0 and weight_decay >= 0, got {c:?}"
            )));
        }
        Ok(Self {
            config,
            state: BTreeMap::new(),
        })
    }
}

impl Optimizer for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn defaults(&self) -> GroupHyper {
        GroupHyper {
            lr: self.config.lr,
            weight_decay: self.config.weight_decay,
        }
    }

    fn update(&mut self, p: &ParamUpdate<'_>) -> Result<Tensor> {
        let c = self.config;
        let theta = p.var.as_tensor();
        let g = p.grad;
        let st = match self.state.entry(p.name.to_string()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(Moments {
                step: 0,
                m: theta.zeros_like()?,
                v: theta.zeros_like()?,
            }),
        };
        if !st.m.device().same_device(theta.device()) {
            st.m = st.m.to_device(theta.device())?;
            st.v = st.v.to_device(theta.device())?;
        }
        st.step += 1;
        let t = st.step as f64;
        let (lr, wd) = (p.hyper.lr, p.hyper.weight_decay);
        let next_m = ((&st.m * c.beta1)? + (g * (1.0 - c.beta1))?)?;
        let next_v = ((&st.v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
        let m_hat = (&next_m * (1.0 / (1.0 - c.beta1.powf(t))))?;
        let v_hat = (&next_v * (1.0 / (1.0 - c.beta2.powf(t))))?;
        let next_theta = (theta * (1f64 - lr * wd))?;
        let adjusted = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
        let next_theta = (next_theta - (adjusted * lr)?)?;
        // Detached: state must never keep a step's graph alive.
        st.m = next_m.detach();
        st.v = next_v.detach();
        Ok(next_theta.detach())
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let mut params = BTreeMap::new();
        for (name, st) in &self.state {
            let mut buffers = BTreeMap::new();
            // The moments are replaced, never written in place, so sharing them is a snapshot.
            buffers.insert("exp_avg".to_string(), st.m.clone());
            buffers.insert("exp_avg_sq".to_string(), st.v.clone());
            params.insert(name.clone(), ParamState { step: st.step, buffers });
        }
        Ok(OptimizerState {
            kind: self.name().into(),
            params,
        })
    }

    fn check_state(&self, state: &OptimizerState) -> Result<()> {
        state.expect_kind(self.name())?;
        for (name, ps) in &state.params {
            for k in ["exp_avg", "exp_avg_sq"] {
                if !ps.buffers.contains_key(k) {
                    return Err(AmpError::OptimizerState(format!(
                        "parameter `{name}` has no `{k}` buffer"
                    )));
                }
            }
        }
        Ok(())
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        self.check_state(state)?;
        let mut new = BTreeMap::new();
        for (name, ps) in &state.params {
            let get = |k: &str| {
                ps.buffers
                    .get(k)
                    .ok_or_else(|| AmpError::OptimizerState(format!("parameter `{name}` has no `{k}` buffer")))
            };
            new.insert(
                name.clone(),
                Moments {
                    step: ps.step,
                    m: get("exp_avg")?.to_dtype(candle_core::DType::F32)?.detach(),
                    v: get("exp_avg_sq")?.to_dtype(candle_core::DType::F32)?.detach(),
                },
            );
        }
        self.state = new;
        Ok(())
    }
}
