//! Optimizers: our object-safe [`Optimizer`] trait, its implementations ([`Sgd`],
//! [`AdamW`], the [`CandleOptimizer`] adapter), and the [`AmpOptimizer`] that drives one
//! over the parameter store with loss scaling, parameter groups and step skipping.
//!
//! An algorithm sees f32 parameters and f32 unscaled gradients only, whatever the model's
//! type: its arithmetic and state are f32 even at O3 (candle's AdamW on f16 Vars divides
//! 0/0 because eps underflows). Its state is keyed by parameter name and serialisable.

mod adamw;
mod amp_optimizer;
mod candle_adapter;
pub(crate) mod fused;
mod sgd;
mod state;

pub use adamw::{AdamW, AdamWConfig};
pub use amp_optimizer::{AmpOptimizer, AmpOptimizerState, ParamGroup, StepOutcome};
pub(crate) use amp_optimizer::{Round, Unscaled};
pub(crate) use amp_optimizer::{device_flag, read_device_flags, read_device_values};
pub use candle_adapter::CandleOptimizer;
pub use sgd::{Sgd, SgdConfig};
pub(crate) use state::same_values;
pub use state::{OptimizerState, ParamState, TensorData};

use std::borrow::Cow;
use std::collections::BTreeMap;

use candle_core::{Tensor, Var};

use crate::error::Result;

/// One parameter's state as f32 values, borrowed where the algorithm owns them (what a
/// checkpoint writes without a copy).
#[derive(Debug)]
pub struct ParamBuffers<'a> {
    /// The parameter's name.
    pub param: String,
    /// Steps applied to the parameter.
    pub step: u64,
    /// The buffers' shape (the parameter's).
    pub shape: Vec<usize>,
    /// Each buffer's name ("exp_avg", ...) and values, row-major.
    pub buffers: Vec<(String, Cow<'a, [f32]>)>,
}

/// The buffers of owned per-parameter slots, borrowed where they are on the host (copied
/// from the device otherwise).
pub(crate) fn slot_buffers(state: &BTreeMap<String, fused::Slots>) -> Result<Vec<ParamBuffers<'_>>> {
    state
        .iter()
        .map(|(param, st)| {
            Ok(ParamBuffers {
                param: param.clone(),
                step: st.step,
                shape: st.shape.clone(),
                buffers: st
                    .bufs
                    .iter()
                    .map(|(k, v)| Ok((k.to_string(), v.values()?)))
                    .collect::<Result<_>>()?,
            })
        })
        .collect()
}

/// The default [`Optimizer::step`]: every new value (and its cast to the working type)
/// computed with [`Optimizer::update`] first, shapes, types, devices and storage checked,
/// then all written.
pub fn default_step<O: Optimizer + ?Sized>(opt: &mut O, params: &[ParamUpdate<'_>]) -> Result<()> {
    let mut new = Vec::with_capacity(params.len());
    for p in params {
        let v = opt.update(p)?;
        let fits = v.dims() == p.var.dims()
            && v.dtype() == p.var.dtype()
            && v.device().same_device(p.var.device())
            && p.var.as_tensor().is_contiguous()
            && p.working.is_none_or(|w| w.as_tensor().is_contiguous());
        if !fits {
            return Err(crate::error::AmpError::OptimizerState(format!(
                "the {} update of `{}` has shape {:?}, type {:?} and device {:?}, the parameter {:?}, {:?} and \
                 {:?} (and must be contiguous): return a value of the parameter's shape, type and device",
                opt.name(),
                p.name,
                v.dims(),
                v.dtype(),
                v.device().location(),
                p.var.dims(),
                p.var.dtype(),
                p.var.device().location()
            )));
        }
        // `Var::set` refuses a value over the Var's own storage (an identity update returns
        // the parameter itself): such a value is written from a copy, so that no write below
        // can refuse after earlier ones were made.
        let v = crate::kernels::apart_from(&v, &[p.var.as_tensor()])?;
        let w = match p.working {
            Some(w) => Some(crate::kernels::apart_from(
                &crate::kernels::cast(&v, w.dtype())?,
                &[w.as_tensor()],
            )?),
            None => None,
        };
        new.push((v, w));
    }
    // Every value exists, fits and has storage of its own: the writes below cannot fail
    // part-way.
    for (p, (v, w)) in params.iter().zip(new) {
        p.var.set(&v)?;
        if let (Some(wv), Some(w)) = (p.working, w) {
            wv.set(&w)?;
        }
    }
    Ok(())
}

/// Hyper-parameters that vary per parameter group.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupHyper {
    /// Learning rate.
    pub lr: f64,
    /// Weight decay (L2 for SGD, decoupled for AdamW).
    pub weight_decay: f64,
}

/// One parameter to update in a step.
#[derive(Debug)]
pub struct ParamUpdate<'a> {
    /// The parameter's dotted name (the key of its optimizer state).
    pub name: &'a str,
    /// The parameter as an f32 Var, updated in place by the step.
    pub var: &'a Var,
    /// The half working copy the model computes with, when it is a separate Var (O2's
    /// masters, O3): a step writes the new value into it too, in the same commit.
    pub working: Option<&'a Var>,
    /// Its unscaled f32 gradient: the optimizer's master-gradient buffer, which later
    /// backward passes write in place. An algorithm that keeps it (or a value that may be it,
    /// such as `grad.clone()` or a same-type `to_dtype`) past the step must keep a copy
    /// (`Tensor::copy`), or its state changes with the next backward.
    pub grad: &'a Tensor,
    /// Its group's hyper-parameters.
    pub hyper: GroupHyper,
    /// `false` when the parameter has no f32 Var (O3, no masters): `var` is then a temporary
    /// f32 copy, or the half working Var itself when the algorithm said it does not read
    /// the copy ([`Optimizer::reads_f32_copies`]); either way it must not be kept between
    /// steps.
    pub persistent: bool,
}

/// An optimization algorithm over f32 parameters. Object-safe, so an [`AmpOptimizer`] can
/// hold any of them.
///
/// Implement [`update`](Optimizer::update) for an element-wise algorithm; override
/// [`step`](Optimizer::step) to see all parameters at once (fused kernels, adapters).
pub trait Optimizer: Send {
    /// A short name ("sgd", "adamw").
    fn name(&self) -> &'static str;

    /// The hyper-parameters new groups start from.
    fn defaults(&self) -> GroupHyper;

    /// The new f32 value of one parameter. Called once per parameter that has a gradient.
    fn update(&mut self, param: &ParamUpdate<'_>) -> Result<Tensor>;

    /// Updates every parameter that has a gradient, all or nothing: either every parameter
    /// (and its working copy) is written, or an error is returned and no Var was written.
    /// On an error the caller ([`AmpOptimizer`]) restores the algorithm's state from a
    /// [`state_dict`](Optimizer::state_dict) taken before the step, so a retried step applies
    /// once. The default computes every new value (and its cast to the working type) with
    /// [`update`](Optimizer::update) first, checks shapes, types and devices, copies a value
    /// that shares the parameter's storage (which `Var::set` would refuse), then writes them
    /// all; an override must keep the same contract.
    fn step(&mut self, params: &[ParamUpdate<'_>]) -> Result<()> {
        default_step(self, params)
    }

    /// Whether [`step`](Optimizer::step) would read the f32 values of `params` whose Var is
    /// not persistent (O3, no masters). When it returns false, such parameters come to
    /// `step` with `var` set to the half working Var itself (`persistent: false`, `working`
    /// the same Var), and `step` must update them through `working` without reading `var`
    /// as f32; when true (the default), `var` is a temporary f32 copy. Our fused optimizers
    /// return false where their in-place pass applies, which saves two parameter-sized
    /// copies per parameter per step at O3.
    fn reads_f32_copies(&self, params: &[ParamUpdate<'_>]) -> bool {
        let _ = params;
        true
    }

    /// What [`AmpOptimizer`] restores if [`step`](Optimizer::step) over `params` fails: by
    /// default a [`state_dict`](Optimizer::state_dict) taken before the step (`None`: the
    /// algorithm cannot report its state and its own step says how far it is atomic). An
    /// algorithm whose step checks everything before it writes anything may return `None`
    /// and save the copy (our fused CPU passes do: a snapshot of host buffers would copy all
    /// of the state every step).
    fn step_snapshot(&self, params: &[ParamUpdate<'_>]) -> Option<OptimizerState> {
        let _ = params;
        self.state_dict().ok()
    }

    /// The algorithm's state (moments, step counters), for checkpoints: a snapshot that
    /// later steps do not change (share buffers only if steps replace them rather than
    /// writing them in place).
    fn state_dict(&self) -> Result<OptimizerState>;

    /// The state with buffers that may share storage with the live ones, valid until the
    /// next step: what a checkpoint writes out at once, without a copy. The default is
    /// [`state_dict`](Optimizer::state_dict).
    fn state_view(&self) -> Result<OptimizerState> {
        self.state_dict()
    }

    /// Every parameter's state as f32 values, for a checkpoint writer: borrowed where the
    /// algorithm owns them (no copy), valid until the next step. The default copies them out
    /// of [`state_view`](Optimizer::state_view).
    fn buffers(&self) -> Result<Vec<ParamBuffers<'_>>> {
        let mut out = Vec::new();
        for (param, ps) in self.state_view()?.params {
            let mut shape = Vec::new();
            let mut buffers = Vec::new();
            for (name, t) in ps.buffers {
                shape = t.dims().to_vec();
                buffers.push((
                    name,
                    Cow::Owned(t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?),
                ));
            }
            out.push(ParamBuffers {
                param,
                step: ps.step,
                shape,
                buffers,
            });
        }
        Ok(out)
    }

    /// Restores state produced by [`state_dict`](Optimizer::state_dict).
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()>;

    /// [`load_state_dict`](Optimizer::load_state_dict) taking the state by value, so an
    /// implementation can free each saved buffer as it takes it in (restoring a checkpoint
    /// then needs about one parameter's state beyond the restored run, not a second copy of
    /// all of it). The default calls `load_state_dict`.
    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        self.load_state_dict(&state)
    }

    /// Checks, without changing anything, that `state` would load: by default that it was
    /// saved by an algorithm of the same name. Implementations add their own checks (required
    /// buffers) so that a checkpoint fails before anything is restored.
    fn check_state(&self, state: &OptimizerState) -> Result<()> {
        state.expect_kind(self.name())
    }
}
