//! An adapter that runs any `candle_nn::Optimizer` under AMP, over f32 parameters.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

use super::{GroupHyper, Optimizer, OptimizerState, ParamUpdate};
use crate::error::{AmpError, Result};

/// Wraps a `candle_nn::Optimizer` (e.g. `candle_nn::SGD`, `candle_nn::AdamW`).
///
/// candle's optimizers are built over Vars, so the wrapped optimizer is built at the first
/// step over the f32 Vars that have gradients: the f32 masters at O2, the model's own Vars at
/// O0 and O1. At O3 there are no f32 Vars and the adapter returns a typed error. candle's
/// optimizers have one learning rate and their own weight decay: the adapter passes the
/// first group's learning rate and ignores groups' weight decay. candle keeps
/// its optimizer state private, so [`state_dict`](Optimizer::state_dict) is an error: use
/// [`super::AdamW`] or [`super::Sgd`] for runs that checkpoint. For the same reason its step
/// is not all or nothing: candle's optimizer writes each Var as it goes.
pub struct CandleOptimizer<O: candle_nn::Optimizer> {
    config: Option<O::Config>,
    inner: Option<O>,
    /// The Vars the wrapped optimizer was built over: a set, looked up once per parameter
    /// per step.
    vars: std::collections::HashSet<TensorId>,
    defaults: GroupHyper,
}

impl<O: candle_nn::Optimizer> CandleOptimizer<O> {
    /// An adapter that will build `O` from `config` at the first step. `lr` is the learning
    /// rate groups start from (set it to the one in `config`).
    pub fn new(config: O::Config, lr: f64) -> Self {
        Self {
            config: Some(config),
            inner: None,
            vars: Default::default(),
            defaults: GroupHyper { lr, weight_decay: 0.0 },
        }
    }
}

impl<O: candle_nn::Optimizer + Send> Optimizer for CandleOptimizer<O>
where
    O::Config: Send,
{
    fn name(&self) -> &'static str {
        "candle"
    }

    fn defaults(&self) -> GroupHyper {
        self.defaults
    }

    fn update(&mut self, _param: &ParamUpdate<'_>) -> Result<Tensor> {
        Err(AmpError::OptimizerState(
            "the candle optimizer adapter updates all parameters at once; call step".into(),
        ))
    }

    fn step(&mut self, params: &[ParamUpdate<'_>]) -> Result<()> {
        if let Some(p) = params.iter().find(|p| !p.persistent) {
            return Err(AmpError::OptimizerState(format!(
                "parameter `{}` has no f32 Var (O3 keeps no masters); candle optimizers need f32 Vars: \
                 use O0, O1 or O2, or candle_amp::optim::AdamW/Sgd",
                p.name
            )));
        }
        if self.inner.is_none() {
            let config = self
                .config
                .take()
                .ok_or_else(|| AmpError::OptimizerState("the candle optimizer could not be built".into()))?;
            let vars: Vec<Var> = params.iter().map(|p| p.var.clone()).collect();
            self.vars = vars.iter().map(|v| v.id()).collect();
            self.inner = Some(O::new(vars, config)?);
        }
        let mut gs = GradStore::default();
        for p in params {
            if !self.vars.contains(&p.var.id()) {
                return Err(AmpError::OptimizerState(format!(
                    "parameter `{}` got its first gradient after the candle optimizer was built; \
                     candle optimizers cannot add parameters: use candle_amp::optim::AdamW/Sgd",
                    p.name
                )));
            }
            gs.insert(p.var.as_tensor(), p.grad.clone());
        }
        let Some(inner) = self.inner.as_mut() else {
            return Err(AmpError::OptimizerState("the candle optimizer was not built".into()));
        };
        if let Some(p) = params.first() {
            inner.set_learning_rate(p.hyper.lr);
        }
        inner.step(&gs)?;
        // candle's optimizer wrote the f32 Vars; the half working copies follow.
        for p in params {
            if let Some(w) = p.working {
                w.set(&p.var.as_tensor().to_dtype(w.dtype())?)?;
            }
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        Err(AmpError::OptimizerState(
            "candle optimizers keep their state private, so it cannot be saved; use candle_amp::optim::AdamW or Sgd"
                .into(),
        ))
    }

    fn load_state_dict(&mut self, _state: &OptimizerState) -> Result<()> {
        Err(AmpError::OptimizerState(
            "candle optimizers keep their state private, so it cannot be loaded; use candle_amp::optim::AdamW or Sgd"
                .into(),
        ))
    }
}
