//! Stochastic gradient descent with momentum, Nesterov momentum and weight decay
//! (PyTorch's `torch.optim.SGD` update rule), in f32.

use std::collections::BTreeMap;

use candle_core::Tensor;

use super::{GroupHyper, Optimizer, OptimizerState, ParamState, ParamUpdate};
use crate::error::{AmpError, Result};

/// SGD settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 = plain SGD).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
}

impl SgdConfig {
    /// Plain SGD with this learning rate.
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// SGD. For each parameter `p` with gradient `g`:
/// `d = g + wd*p`; with momentum `buf = momentum*buf + (1-dampening)*d` (`buf = d` at the
/// first step) and `d = g + momentum*buf` (Nesterov, with `g` here meaning `d`) or `d = buf`;
/// then `p -= lr*d`.
#[derive(Debug, Clone)]
pub struct Sgd {
    config: SgdConfig,
    state: BTreeMap<String, (u64, Option<Tensor>)>,
}

impl Sgd {
    /// A new SGD; state is created per parameter at its first update.
    pub fn new(config: SgdConfig) -> Result<Self> {
        if config.nesterov && (config.momentum <= 0.0 || config.dampening != 0.0) {
            return Err(AmpError::OptimizerState(
                "Nesterov momentum needs momentum > 0 and dampening 0".into(),
            ));
        }
        let bad = |v: f64| v.is_nan() || v < 0.0;
        if bad(config.lr) || bad(config.momentum) || bad(config.weight_decay) {
            return Err(AmpError::OptimizerState(format!(
                "SGD needs lr, momentum and weight_decay >= 0, got {config:?}"
            )));
        }
        Ok(Self {
            config,
            state: BTreeMap::new(),
        })
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
    }

    fn defaults(&self) -> GroupHyper {
        GroupHyper {
            lr: self.config.lr,
            weight_decay: self.config.weight_decay,
        }
    }

    fn update(&mut self, p: &ParamUpdate<'_>) -> Result<Tensor> {
        let c = self.config;
        let param = p.var.as_tensor();
        let mut d = p.grad.clone();
        if p.hyper.weight_decay != 0.0 {
            d = (d + (param * p.hyper.weight_decay)?)?;
        }
        let entry = self.state.entry(p.name.to_string()).or_insert((0, None));
        entry.0 += 1;
        if c.momentum != 0.0 {
            let buf = match &entry.1 {
                None => d.clone(),
                Some(b) => ((b.to_device(param.device())? * c.momentum)? + (&d * (1.0 - c.dampening))?)?,
            };
            // Detached: state must never keep a step's graph alive.
            entry.1 = Some(buf.detach());
            d = if c.nesterov { (d + (buf * c.momentum)?)? } else { buf };
        }
        Ok(param.sub(&(d * p.hyper.lr)?)?.detach())
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let mut params = BTreeMap::new();
        for (name, (step, buf)) in &self.state {
            let mut buffers = BTreeMap::new();
            if let Some(b) = buf {
                // Replaced, never written in place: sharing it is a snapshot.
                buffers.insert("momentum_buffer".to_string(), b.clone());
            }
            params.insert(name.clone(), ParamState { step: *step, buffers });
        }
        Ok(OptimizerState {
            kind: self.name().into(),
            params,
        })
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        state.expect_kind(self.name())?;
        let mut new = BTreeMap::new();
        for (name, ps) in &state.params {
            let buf = match ps.buffers.get("momentum_buffer") {
                Some(b) => Some(b.to_dtype(candle_core::DType::F32)?.detach()),
                None => None,
            };
            new.insert(name.clone(), (ps.step, buf));
        }
        self.state = new;
        Ok(())
    }
}
