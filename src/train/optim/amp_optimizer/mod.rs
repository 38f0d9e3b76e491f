//! [`AmpOptimizer`]: an [`Optimizer`] driven over the parameter store, with parameter groups,
//! f32 master gradients, step skipping and call-order checks.
//!
//! The type and its bookkeeping live here; the backward stages in `backward`, the step in
//! `step`, the device path (state and overflow flags kept on the parameters' device, one
//! host read per backward) in `device`, the saved state in `saved`, the undoing of a sharded
//! step whose all-gather failed in `undo`.

mod backward;
mod device;
mod saved;
mod step;
mod undo;

pub(crate) use backward::Unscaled;
pub(crate) use device::{flag as device_flag, read_flags as read_device_flags, read_values as read_device_values};

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::{GroupHyper, Optimizer, OptimizerState};
use crate::error::{AmpError, CallOrderKind, Result};
use crate::precision::store::{Param, ParamKind};
use crate::train::run::{Filter, RunState};

/// What [`AmpOptimizer::step`] did, so that schedulers can react to skipped steps.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// The parameters were updated.
    Stepped {
        /// The loss scale after the step.
        loss_scale: f32,
    },
    /// A gradient (or the loss) was inf or NaN: nothing was updated and the step was not
    /// counted by the optimizer.
    Skipped {
        /// The scale of the scaler that overflowed, after its backoff (before it, while other
        /// optimizers of the same block have still to step).
        loss_scale: f32,
        /// Parameters whose gradients were non-finite (`"<loss>"`: the loss itself).
        nonfinite: Vec<String>,
    },
}

impl StepOutcome {
    /// Whether the step was skipped.
    pub fn is_skipped(&self) -> bool {
        matches!(self, StepOutcome::Skipped { .. })
    }

    /// The loss scale after the step.
    pub fn loss_scale(&self) -> f32 {
        match self {
            StepOutcome::Stepped { loss_scale } | StepOutcome::Skipped { loss_scale, .. } => *loss_scale,
        }
    }
}

/// A parameter group as seen from outside: its name, hyper-parameters and members.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// The group's name.
    pub name: String,
    /// Its learning rate and weight decay.
    pub hyper: GroupHyper,
    /// Names of its trainable parameters.
    pub params: Vec<String>,
}

/// Optimizer ids are unique in the process, so one `GradScaler` can serve optimizers of
/// several AMP handles.
static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

/// Which loss scaler a backward's gradients were scaled by: one of the run's, or an outside
/// one (the PyTorch-style `GradScaler`, which owns its scale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Round {
    /// The run's scaler of this loss id.
    Loss(usize),
    /// A `GradScaler`.
    External,
}

fn check_hyper(group: usize, property: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        return Ok(());
    }
    Err(AmpError::Group {
        group,
        reason: format!("{property} must be finite and >= 0, got {v}"),
    })
}

struct GroupSpec {
    name: String,
    filter: Filter,
    hyper: GroupHyper,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// No gradients since the last `zero_grad` (or ever).
    Clean,
    /// Gradients accumulated, not yet stepped.
    HasGrads,
    /// Stepped; `zero_grad` must come before the next backward.
    Stepped,
}

/// The serialisable state of an [`AmpOptimizer`]: its algorithm's state, its groups'
/// hyper-parameters and its step counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AmpOptimizerState {
    /// The algorithm's state.
    pub algorithm: OptimizerState,
    /// Group names and hyper-parameters, in order.
    pub groups: Vec<(String, GroupHyper)>,
    /// Steps taken.
    pub steps: u64,
    /// Steps skipped.
    pub skipped_steps: u64,
    /// Steps skipped in a row.
    pub consecutive_skips: u32,
}

/// An optimizer under AMP. Made by [`crate::initialize`] or [`crate::Amp::optimizer`].
///
/// Typical use, once per iteration: a backward inside [`crate::Amp::scale_loss`], then
/// [`step`](Self::step), then [`zero_grad`](Self::zero_grad). The optimizer keeps the
/// unscaled f32 gradients of its parameters (the master gradients), accumulated over every
/// backward since the last `zero_grad`, and whether any of them overflowed.
///
/// Misuse is a typed [`AmpError::CallOrder`], never a panic: stepping without a backward
/// since the last step or `zero_grad`, or running a backward after a step without
/// `zero_grad` in between (it would mix old and new gradients).
pub struct AmpOptimizer {
    id: usize,
    run: Arc<RunState>,
    algo: Box<dyn Optimizer>,
    /// Which trainable parameters this optimizer owns; groups choose among these only.
    claim: Filter,
    /// Store parameters already checked against other optimizers' claims.
    checked: usize,
    groups: Vec<GroupSpec>,
    grads: BTreeMap<String, Tensor>,
    /// Master-gradient buffers of earlier steps, kept by `zero_grad` for the next backward to
    /// unscale into (PyTorch's `set_to_none=False`): no parameter-sized allocation per step.
    spare: BTreeMap<String, Tensor>,
    stage: Stage,
    found_inf: BTreeMap<Round, bool>,
    nonfinite: BTreeSet<String>,
    micro_batches: u32,
    /// Whether this step's gradients went through the run's step reducer already.
    reduced: bool,
    steps: u64,
    skipped: u64,
    consecutive_skips: u32,
}

impl Drop for AmpOptimizer {
    /// An optimizer dropped with gradients pending must not leave a scaler waiting for it,
    /// and its parameters may be claimed by another optimizer afterwards.
    fn drop(&mut self) {
        self.withdraw_all();
        self.run.claims_mut().remove(&self.id);
    }
}

impl std::fmt::Debug for AmpOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmpOptimizer")
            .field("id", &self.id)
            .field("algorithm", &self.algo.name())
            .field("groups", &self.groups.iter().map(|g| &g.name).collect::<Vec<_>>())
            .field("stage", &self.stage)
            .field("steps", &self.steps)
            .field("skipped", &self.skipped)
            .finish()
    }
}

impl AmpOptimizer {
    /// An optimizer over the trainable parameters `claim` selects. Two optimizers of one run
    /// may not claim the same trainable parameter (each would update it): that is an
    /// [`AmpError::Ownership`] naming the parameter, as PyTorch refuses a parameter in two
    /// groups.
    pub(crate) fn new(run: Arc<RunState>, algo: Box<dyn Optimizer>, claim: Filter) -> Result<Self> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let hyper = algo.defaults();
        let mut opt = Self {
            id,
            run,
            algo,
            claim: claim.clone(),
            checked: 0,
            groups: vec![GroupSpec {
                name: "default".into(),
                filter: claim,
                hyper,
            }],
            grads: BTreeMap::new(),
            spare: BTreeMap::new(),
            stage: Stage::Clean,
            found_inf: BTreeMap::new(),
            nonfinite: BTreeSet::new(),
            micro_batches: 0,
            reduced: false,
            steps: 0,
            skipped: 0,
            consecutive_skips: 0,
        };
        opt.check_claims()?;
        opt.run.claims_mut().insert(opt.id, opt.claim.clone());
        Ok(opt)
    }

    /// Checks the store's parameters not checked yet (new ones are built lazily) against the
    /// other live optimizers' claims.
    fn check_claims(&mut self) -> Result<()> {
        let params = self.run.store.params();
        if params.len() == self.checked {
            return Ok(());
        }
        let claims = self.run.claims_mut();
        for p in &params[self.checked..] {
            if p.kind() != ParamKind::Trainable || !(self.claim)(p.name()) {
                continue;
            }
            if let Some((other, _)) = claims.iter().find(|(id, f)| **id != self.id && f(p.name())) {
                return Err(AmpError::Ownership {
                    param: p.name().to_string(),
                    detail: format!(
                        "optimizer {other} of this run already trains it; give each optimizer a filter that \
                         selects disjoint parameters (amp.optimizer_for(algo, |name| ...)), or drop the other one"
                    ),
                });
            }
        }
        drop(claims);
        self.checked = params.len();
        Ok(())
    }

    /// The optimizer's id, unique in the process.
    pub(crate) fn id(&self) -> usize {
        self.id
    }

    /// The group of a parameter this optimizer owns: the last group whose filter selects it
    /// (the default group selects every owned parameter). `None` for parameters it does not
    /// own, whatever a group's filter says.
    fn group_of(&self, name: &str) -> Option<usize> {
        if !(self.claim)(name) {
            return None;
        }
        self.groups.iter().rposition(|g| (g.filter)(name))
    }

    /// The trainable parameters this optimizer owns (frozen ones included), with their group.
    pub(crate) fn owned(&self) -> Vec<(usize, Param)> {
        self.run
            .store
            .params()
            .into_iter()
            .filter(|p| p.kind() == ParamKind::Trainable)
            .filter_map(|p| self.group_of(p.name()).map(|g| (g, p)))
            .collect()
    }

    /// The groups, with their current members (parameters built after a group was added
    /// join it too).
    pub fn groups(&self) -> Vec<ParamGroup> {
        let mut out: Vec<ParamGroup> = self
            .groups
            .iter()
            .map(|g| ParamGroup {
                name: g.name.clone(),
                hyper: g.hyper,
                params: Vec::new(),
            })
            .collect();
        for (g, p) in self.owned() {
            out[g].params.push(p.name().to_string());
        }
        out
    }

    /// Names of the parameters this optimizer updates (owned, trainable, not frozen).
    pub fn param_names(&self) -> Vec<String> {
        self.owned()
            .into_iter()
            .filter(|(_, p)| p.trains())
            .map(|(_, p)| p.name().to_string())
            .collect()
    }

    /// Adds a parameter group: every parameter of this optimizer whose name matches `filter`
    /// moves to it from an earlier group. Later groups win. A group never selects parameters
    /// outside this optimizer (another optimizer's, say). `lr`/`weight_decay` default to the algorithm's. Returns the
    /// group's index. Allowed at any time between steps; state of moved parameters is kept.
    ///
    /// ```
    /// # use candle_amp as amp;
    /// # let (_m, mut opt, _amp) = amp::initialize(|vb| candle_nn::linear(2, 2, vb.pp("fc")),
    /// #     amp::optim::AdamW::new(Default::default()).unwrap(), amp::OptLevel::O0).unwrap();
    /// let g = opt.add_param_group("no_decay", |n| n.ends_with("bias"), None, Some(0.0));
    /// assert_eq!(opt.groups()[g].params, vec!["fc.bias".to_string()]);
    /// ```
    pub fn add_param_group(
        &mut self,
        name: &str,
        filter: impl Fn(&str) -> bool + Send + Sync + 'static,
        lr: Option<f64>,
        weight_decay: Option<f64>,
    ) -> usize {
        let d = self.algo.defaults();
        self.groups.push(GroupSpec {
            name: name.to_string(),
            filter: Arc::new(filter),
            hyper: GroupHyper {
                lr: lr.unwrap_or(d.lr),
                weight_decay: weight_decay.unwrap_or(d.weight_decay),
            },
        });
        self.groups.len() - 1
    }

    fn no_group(&self, group: usize) -> AmpError {
        AmpError::Group {
            group,
            reason: format!(
                "this optimizer has {} group(s), numbered from 0 (add_param_group returns the number)",
                self.groups.len()
            ),
        }
    }

    fn group_mut(&mut self, group: usize) -> Result<&mut GroupSpec> {
        let e = self.no_group(group);
        self.groups.get_mut(group).ok_or(e)
    }

    /// The learning rate of a group.
    pub fn lr(&self, group: usize) -> Result<f64> {
        self.groups
            .get(group)
            .map(|g| g.hyper.lr)
            .ok_or_else(|| self.no_group(group))
    }

    /// Sets the learning rate of a group.
    pub fn set_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        check_hyper(group, "lr", lr)?;
        self.group_mut(group)?.hyper.lr = lr;
        Ok(())
    }

    /// Sets the learning rate of every group.
    pub fn set_lr_all(&mut self, lr: f64) -> Result<()> {
        for g in 0..self.groups.len() {
            check_hyper(g, "lr", lr)?;
        }
        for g in &mut self.groups {
            g.hyper.lr = lr;
        }
        Ok(())
    }

    /// Sets the weight decay of a group.
    pub fn set_weight_decay(&mut self, group: usize, wd: f64) -> Result<()> {
        check_hyper(group, "weight_decay", wd)?;
        self.group_mut(group)?.hyper.weight_decay = wd;
        Ok(())
    }

    /// The accumulated unscaled f32 gradients, by parameter name (empty after `zero_grad`).
    /// The tensors are the optimizer's buffers, which later backward passes write in place
    /// (as PyTorch accumulates into `.grad`): `copy()` one to keep its values. Under data
    /// parallel they are the averages once the step's reduction has run; on a rank of a
    /// ZeRO-sharded run, only its own shard's from then on.
    pub fn master_grads(&self) -> &BTreeMap<String, Tensor> {
        &self.grads
    }

    /// The f32 values of this optimizer's parameters (the masters at O2), by name. Where a
    /// parameter has an f32 Var these are the live values, which steps write in place
    /// (PyTorch's `master_params` are the parameters themselves): `copy()` one to keep it.
    /// Refused on a rank of a ZeRO-sharded run ([`crate::error::DistErrorKind::Sharded`]),
    /// which keeps the masters of its own shard only.
    pub fn master_params(&self) -> Result<BTreeMap<String, Tensor>> {
        self.run.check_whole_state("AmpOptimizer::master_params")?;
        self.owned()
            .into_iter()
            .map(|(_, p)| Ok((p.name().to_string(), p.f32_value()?)))
            .collect()
    }

    /// The bytes of the algorithm's per-parameter state this process holds (AdamW: two f32
    /// moments per trained element; plain SGD: none). On a rank of a ZeRO-sharded run, its
    /// own shard's only.
    pub fn state_bytes(&self) -> Result<usize> {
        Ok(self
            .algo
            .state_view()?
            .params
            .values()
            .flat_map(|ps| ps.buffers.values())
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum())
    }

    /// Every tensor this optimizer keeps between calls, named: the master gradients, the
    /// spare buffers the next backward unscales into, and the algorithm's state (its
    /// `state_dict`: device tensors as they are kept, host buffers as copies, which share
    /// nothing). For [`crate::testing::live_buffers`].
    pub(crate) fn kept_buffers(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out: Vec<(String, Tensor)> = Vec::new();
        out.extend(
            self.grads
                .iter()
                .map(|(n, t)| (format!("opt{}.grad.{n}", self.id), t.clone())),
        );
        out.extend(
            self.spare
                .iter()
                .map(|(n, t)| (format!("opt{}.spare.{n}", self.id), t.clone())),
        );
        for (n, ps) in self.algo.state_dict()?.params {
            for (k, t) in ps.buffers {
                out.push((format!("opt{}.state.{n}.{k}", self.id), t));
            }
        }
        Ok(out)
    }

    /// Steps taken (not skipped).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Steps skipped because of overflow.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// Whether gradients accumulated since the last `zero_grad` contain inf or NaN.
    ///
    /// Known on the host on both paths, so asking reads nothing: on the device path
    /// ([`crate::Amp::device_path`]) each backward read its flags when it ran (one counted
    /// host read, [`crate::Amp::host_syncs`]).
    pub fn found_inf(&self) -> bool {
        self.found_inf.values().any(|&b| b)
    }

    /// Parameters whose accumulated gradients are non-finite.
    pub(crate) fn nonfinite_names(&self) -> Vec<String> {
        self.nonfinite.iter().cloned().collect()
    }

    /// Backward passes accumulated since the last `zero_grad`.
    pub fn micro_batches(&self) -> u32 {
        self.micro_batches
    }

    /// Whether this optimizer belongs to `run`.
    pub(crate) fn belongs_to(&self, run: &Arc<RunState>) -> bool {
        Arc::ptr_eq(&self.run, run)
    }

    /// The run this optimizer belongs to.
    pub(crate) fn run(&self) -> &Arc<RunState> {
        &self.run
    }

    /// Withdraws from every scaler round this optimizer is enlisted in.
    fn withdraw_all(&mut self) {
        if !self.found_inf.is_empty() && self.stage == Stage::HasGrads {
            let mut scalers = self.run.scalers_mut();
            for round in self.found_inf.keys() {
                if let Round::Loss(loss_id) = *round
                    && let Some(s) = scalers.get_mut(loss_id)
                {
                    s.withdraw(self.id, loss_id);
                }
            }
        }
    }

    /// Refuses gradients after a step without `zero_grad`; `call` names the caller.
    pub(crate) fn check_can_backward(&self, call: &'static str) -> Result<()> {
        if self.reduced && self.stage == Stage::HasGrads {
            return Err(AmpError::call_order(
                call,
                CallOrderKind::AlreadyReduced,
                "this step's gradients were already averaged across processes (clip_grad_norm or \
                 GradScaler::unscale ran): a further backward would be added to the average; step() first",
            ));
        }
        if self.stage == Stage::Stepped {
            return Err(AmpError::call_order(
                call,
                CallOrderKind::NotZeroed,
                "this optimizer has stepped and its gradients were not zeroed: the new gradients would be \
                 added to the ones already applied; call zero_grad() after step()",
            ));
        }
        Ok(())
    }
}
