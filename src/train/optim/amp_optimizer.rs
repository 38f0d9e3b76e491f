//! [`AmpOptimizer`]: an [`Optimizer`] driven over the parameter store, with parameter groups,
//! f32 master gradients, step skipping and call-order checks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::{GroupHyper, Optimizer, OptimizerState, ParamUpdate};
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
    /// (as PyTorch accumulates into `.grad`): `copy()` one to keep its values.
    pub fn master_grads(&self) -> &BTreeMap<String, Tensor> {
        &self.grads
    }

    /// The f32 values of this optimizer's parameters (the masters at O2), by name.
    pub fn master_params(&self) -> Result<BTreeMap<String, Tensor>> {
        self.owned()
            .into_iter()
            .map(|(_, p)| Ok((p.name().to_string(), p.f32_value()?)))
            .collect()
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

    /// Stage 3 of the backward pipeline for this optimizer's parameters: checks each raw
    /// gradient and unscales it into its f32 master gradient in one pass. Where the
    /// parameter already has a master gradient this step (accumulation), the unscaled value
    /// is added to it in place and the sum is checked in the same pass (two finite
    /// gradients can overflow together); otherwise it is written into a buffer kept from an
    /// earlier step, or into a new one the first time. Returns the new master gradients
    /// for [`accumulate`](Self::accumulate), and what was non-finite.
    pub(crate) fn unscale_into(
        &mut self,
        grads: &candle_core::backprop::GradStore,
        params: &[(String, Var)],
        scale: f32,
        check: bool,
    ) -> Result<crate::train::guard::Unscaled> {
        use crate::kernels::unscale::{unscale_check, unscale_check_into};
        let mut out = crate::train::guard::Unscaled {
            grads: Vec::new(),
            found_inf: false,
            nonfinite: Vec::new(),
        };
        let in_place = |buf: &Tensor, raw: &Tensor| {
            crate::kernels::enabled()
                && buf.device().is_cpu()
                && raw.device().is_cpu()
                && buf.dtype() == DType::F32
                && buf.is_contiguous()
                && buf.shape() == raw.shape()
        };
        for (name, var) in params {
            let Some(raw) = grads.get(var.as_tensor()) else {
                continue;
            };
            let raw = raw.detach();
            let bad = match self.grads.get(name) {
                Some(live) if in_place(live, &raw) => unscale_check_into(&raw, scale, live, true)?,
                Some(live) => {
                    // Another device (or the kernels off): unscale, then add, checked.
                    let (g, bad) = unscale_check(&raw, scale, check)?;
                    let (sum, sum_bad) = crate::kernels::unscale::add_check(live, &g, check)?;
                    out.grads.push((name.clone(), sum));
                    bad || sum_bad
                }
                None => match self.spare.remove(name) {
                    Some(buf) if in_place(&buf, &raw) => {
                        let bad = unscale_check_into(&raw, scale, &buf, false)?;
                        out.grads.push((name.clone(), buf));
                        bad
                    }
                    _ => {
                        let (g, bad) = unscale_check(&raw, scale, check)?;
                        out.grads.push((name.clone(), g));
                        bad
                    }
                },
            };
            if check && bad {
                out.found_inf = true;
                out.nonfinite.push(name.clone());
            }
        }
        Ok(out)
    }

    /// Stage 4 of the backward pipeline: adds one backward's unscaled gradients (already
    /// detached f32) and OR-s its overflow flag into the round's.
    pub(crate) fn accumulate(
        &mut self,
        round: Round,
        grads: Vec<(String, Tensor)>,
        found_inf: bool,
        nonfinite: Vec<String>,
    ) -> Result<()> {
        self.check_can_backward("backward")?;
        if let Round::Loss(loss_id) = round {
            let n = self.run.props.num_losses;
            if loss_id >= n {
                return Err(AmpError::LossId {
                    id: loss_id,
                    num_losses: n,
                });
            }
        }
        // Gradients accumulated in place (and their sums checked) by `unscale_into`; these
        // are the parameters' first gradients this step, or sums made off the CPU.
        self.grads.extend(grads);
        *self.found_inf.entry(round).or_insert(false) |= found_inf;
        self.nonfinite.extend(nonfinite);
        self.micro_batches += 1;
        self.stage = Stage::HasGrads;
        if let Round::Loss(loss_id) = round {
            self.run.scalers_mut()[loss_id].enlist(self.id);
        }
        Ok(())
    }

    /// The (name, working Var) pairs of the parameters this optimizer trains. Checks
    /// parameters built since the last call against other optimizers' claims.
    pub(crate) fn trained_vars(&mut self) -> Result<Vec<(String, Var)>> {
        self.check_claims()?;
        Ok(self
            .owned()
            .into_iter()
            .filter(|(_, p)| p.trains())
            .map(|(_, p)| (p.name().to_string(), p.working_var().clone()))
            .collect())
    }

    /// Whether the gradients scaled by an outside `GradScaler` overflowed.
    pub(crate) fn external_found_inf(&self) -> bool {
        self.found_inf.get(&Round::External).copied().unwrap_or(false)
    }

    /// Applies the master gradients, or records a skip, without any loss-scaler bookkeeping
    /// (the PyTorch-style [`crate::GradScaler`] owns its scale). All or nothing: on an error
    /// nothing was applied and the gradients stay for a retry.
    pub(crate) fn step_external(&mut self, skip: bool) -> Result<()> {
        if skip {
            self.skipped += 1;
        } else {
            if self.stage == Stage::HasGrads {
                self.apply()?;
            }
            self.steps += 1;
        }
        self.clear_grads();
        Ok(())
    }

    /// Runs the run's step reducer (data parallel) over this step's gradients, once: the
    /// first of `step`, `clip_grad_norm` and `GradScaler::unscale` does it. Every process
    /// then holds the same gradients and the same overflow flags. Nothing changes on an error.
    pub(crate) fn reduce_step(&mut self) -> Result<()> {
        if self.reduced || self.stage != Stage::HasGrads {
            return Ok(());
        }
        let Some(reducer) = self.run.step_reducer() else {
            return Ok(());
        };
        let mut params: Vec<(String, Vec<usize>)> = self
            .owned()
            .into_iter()
            .map(|(_, p)| (p.name().to_string(), p.working().dims().to_vec()))
            .collect();
        params.sort();
        // One flag per scaling round, in a fixed order: the run's losses, then GradScaler's.
        let n = self.run.props.num_losses;
        let mut flags: Vec<bool> = (0..n)
            .map(|i| self.found_inf.get(&Round::Loss(i)).copied().unwrap_or(false))
            .chain([self.found_inf.get(&Round::External).copied().unwrap_or(false)])
            .collect();
        let mut grads = self.grads.clone();
        let mut nonfinite = Vec::new();
        let mut checked = false;
        reducer.reduce_step(crate::train::reduce::StepGrads {
            params,
            grads: &mut grads,
            found_inf: &mut flags,
            nonfinite: &mut nonfinite,
            checked: &mut checked,
        })?;
        // What the optimizer applies is the reduced gradient: check it (after the reducer's
        // sum) unless the reducer checked it in its own pass. The reduced values are the
        // same on every process, so every process reaches the same verdict.
        if self.run.props.enabled && !checked {
            for (name, g) in &grads {
                if crate::kernels::unscale::nonfinite(g)? {
                    nonfinite.push(name.clone());
                }
            }
        }
        if !self.run.props.enabled {
            nonfinite.clear();
        }
        self.grads = grads;
        let any = flags.iter().any(|&b| b);
        for (i, inf) in flags.into_iter().enumerate() {
            let round = if i < n { Round::Loss(i) } else { Round::External };
            if let Some(f) = self.found_inf.get_mut(&round) {
                *f = inf;
            }
        }
        // Another process overflowed in a round this one did not run, or the reduced
        // gradients themselves are not finite: skip here too.
        if (any && !self.found_inf.values().any(|&b| b)) || !nonfinite.is_empty() {
            self.found_inf.values_mut().for_each(|f| *f = true);
        }
        self.nonfinite.extend(nonfinite);
        self.reduced = true;
        Ok(())
    }

    fn clear_grads(&mut self) {
        // The buffers stay for the next backward to unscale into.
        let grads = std::mem::take(&mut self.grads);
        self.spare.extend(grads);
        self.found_inf.clear();
        self.nonfinite.clear();
        self.micro_batches = 0;
        self.reduced = false;
        self.stage = Stage::Clean;
    }

    /// Clips the accumulated master gradients to a total L2 norm of `max_norm` (PyTorch's
    /// `clip_grad_norm_` on unscaled gradients) and returns the norm before clipping. When a
    /// gradient is non-finite the norm is returned as is and nothing is clipped (the step
    /// will be skipped). Call between the backward and `step`.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f32> {
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(AmpError::InvalidArgument {
                argument: "max_norm",
                reason: format!("clip_grad_norm needs a finite max_norm >= 0, got {max_norm}"),
            });
        }
        if self.stage != Stage::HasGrads {
            let kind = if self.stage == Stage::Stepped {
                CallOrderKind::AlreadyStepped
            } else {
                CallOrderKind::NoGradients
            };
            return Err(AmpError::call_order(
                "clip_grad_norm",
                kind,
                "there are no gradients to clip: call it after backward and before step",
            ));
        }
        // Clip the step's gradients, not this process's share of them.
        self.reduce_step()?;
        let mut total = 0f64;
        for g in self.grads.values() {
            // In f64: squares of large finite f32 gradients would overflow f32.
            total += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        let norm = total.sqrt();
        if !norm.is_finite() {
            return Ok(norm as f32);
        }
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        if coef < 1.0 {
            for g in self.grads.values_mut() {
                *g = (&*g * coef)?;
            }
        }
        Ok(norm as f32)
    }

    /// Applies the accumulated gradients, or skips the step if any of them (or a loss) was
    /// non-finite. Either way the loss scalers used since the last `zero_grad` are adjusted
    /// once. After `max_consecutive_skips` skips in a row returns
    /// [`AmpError::PersistentOverflow`] naming the parameters with non-finite gradients (the
    /// weights are still untouched).
    pub fn step(&mut self) -> Result<StepOutcome> {
        match self.stage {
            Stage::HasGrads => {}
            Stage::Clean => {
                return Err(AmpError::call_order(
                    "step",
                    CallOrderKind::NoGradients,
                    "no gradients since the last zero_grad: run a backward inside scale_loss before step",
                ));
            }
            Stage::Stepped => {
                return Err(AmpError::call_order(
                    "step",
                    CallOrderKind::AlreadyStepped,
                    "this optimizer has already stepped: call zero_grad() and run a new backward before stepping again",
                ));
            }
        }
        self.reduce_step()?;
        let overflow = self.found_inf();
        if !overflow {
            self.apply()?;
        }
        self.stage = Stage::Stepped;
        // Report the scaler that overflowed (or the first one used).
        let loss_id = |r: &Round| match r {
            Round::Loss(id) => Some(*id),
            Round::External => None,
        };
        let first_id = self
            .found_inf
            .iter()
            .find(|(_, inf)| **inf)
            .or(self.found_inf.iter().next())
            .and_then(|(r, _)| loss_id(r))
            .unwrap_or(0);
        let scale = {
            let mut scalers = self.run.scalers_mut();
            for (round, &inf) in &self.found_inf {
                // Gradients scaled by a GradScaler have no scaler of this run to report to.
                if let Some(id) = loss_id(round)
                    && let Some(s) = scalers.get_mut(id)
                {
                    s.report(self.id, inf, id);
                }
            }
            scalers.get(first_id).map_or(1.0, |s| s.state.scale.scale())
        };
        if !overflow {
            self.steps += 1;
            self.consecutive_skips = 0;
            return Ok(StepOutcome::Stepped { loss_scale: scale });
        }
        self.skipped = self.skipped.saturating_add(1);
        self.consecutive_skips = self.consecutive_skips.saturating_add(1);
        let nonfinite: Vec<String> = self.nonfinite.iter().cloned().collect();
        if self.consecutive_skips >= self.run.props.max_consecutive_skips {
            return Err(AmpError::PersistentOverflow {
                loss_id: first_id,
                skips: self.consecutive_skips,
                scale,
                params: if nonfinite.is_empty() {
                    "(none recorded)".into()
                } else {
                    nonfinite.join(", ")
                },
            });
        }
        Ok(StepOutcome::Skipped {
            loss_scale: scale,
            nonfinite,
        })
    }

    /// Applies the master gradients through the algorithm, all or nothing: the algorithm
    /// writes nothing unless every update succeeded (see [`Optimizer::step`]), and on an
    /// error its state is restored from a snapshot taken before, so a retried step applies
    /// exactly once.
    fn apply(&mut self) -> Result<()> {
        struct Item {
            name: String,
            var: Var,
            working: Option<Var>,
            grad: Tensor,
            hyper: GroupHyper,
            persistent: bool,
        }
        // A parameter without an f32 Var (O3) is first offered as its half working Var: an
        // algorithm that updates it in place (the fused CPU passes) never reads an f32 copy,
        // so none is made. Only one that reads the values gets throwaway f32 copies.
        let build = |copies: bool| -> Result<Vec<Item>> {
            let mut items = Vec::new();
            for (g, p) in self.owned() {
                if !p.trains() {
                    continue;
                }
                let Some(grad) = self.grads.get(p.name()) else { continue };
                let (var, working, persistent) = match p.f32_var() {
                    Some(v) => {
                        let working = (p.working().id() != v.id()).then(|| p.working_var().clone());
                        (v.clone(), working, true)
                    }
                    None if copies => (Var::from_tensor(&p.f32_value()?)?, Some(p.working_var().clone()), false),
                    None => (p.working_var().clone(), Some(p.working_var().clone()), false),
                };
                items.push(Item {
                    name: p.name().to_string(),
                    var,
                    working,
                    grad: grad.clone(),
                    hyper: self.groups[g].hyper,
                    persistent,
                });
            }
            Ok(items)
        };
        fn view(items: &[Item]) -> Vec<ParamUpdate<'_>> {
            items
                .iter()
                .map(|i| ParamUpdate {
                    name: &i.name,
                    var: &i.var,
                    working: i.working.as_ref(),
                    grad: &i.grad,
                    hyper: i.hyper,
                    persistent: i.persistent,
                })
                .collect()
        }
        let mut items = build(false)?;
        if items.iter().any(|i| !i.persistent) && self.algo.reads_f32_copies(&view(&items)) {
            items = build(true)?;
        }
        let updates = view(&items);
        // An algorithm that cannot report its state (candle's, through the adapter) cannot be
        // rolled back; its own step says how far it is atomic.
        let snapshot = self.algo.state_dict().ok();
        let stepped = self.algo.step(&updates);
        // Whatever the algorithm (ours bump their own writes; a user's or candle's does not
        // know of the cast cache), no cast of a value from before this step is served again.
        for u in &updates {
            crate::precision::autocast::invalidate(u.var.as_tensor());
            if let Some(w) = u.working {
                crate::precision::autocast::invalidate(w.as_tensor());
            }
        }
        match stepped {
            Ok(()) => Ok(()),
            Err(e) => {
                if let Some(snapshot) = snapshot
                    && let Err(r) = self.algo.load_state_dict(&snapshot)
                {
                    log::error!("could not restore the optimizer state after a failed step: {r}");
                }
                Err(e)
            }
        }
    }

    /// Drops the accumulated gradients and overflow flags; the next backward starts afresh.
    /// The f32 buffers that held them are kept and the next backward unscales into them
    /// (PyTorch's `zero_grad(set_to_none=False)` without the zero fill: a first gradient
    /// overwrites, later ones add), so a step allocates no parameter-sized memory of ours.
    /// [`zero_grad_set_to_none`](Self::zero_grad_set_to_none) frees them instead.
    pub fn zero_grad(&mut self) {
        self.withdraw_all();
        self.clear_grads();
    }

    /// [`zero_grad`](Self::zero_grad) that also frees the master-gradient buffers
    /// (PyTorch's `set_to_none=True`): memory between steps drops by one f32 copy of the
    /// trained parameters, and the next backward allocates them again.
    pub fn zero_grad_set_to_none(&mut self) {
        self.zero_grad();
        self.spare.clear();
    }

    /// The optimizer's state: algorithm state, groups' hyper-parameters, counters. A
    /// snapshot: later steps do not change it.
    pub fn state_dict(&self) -> Result<AmpOptimizerState> {
        self.state_with(self.algo.state_dict()?)
    }

    /// Groups and counters, without the algorithm's per-parameter state (see
    /// [`param_buffers`](Self::param_buffers)).
    pub(crate) fn state_meta(&self) -> Result<AmpOptimizerState> {
        self.state_with(OptimizerState {
            kind: self.algo.name().into(),
            params: BTreeMap::new(),
        })
    }

    /// The algorithm's per-parameter state, borrowed where it owns f32 buffers (valid until
    /// the next step): what a checkpoint streams to disk without a copy.
    pub(crate) fn param_buffers(&self) -> Result<Vec<super::ParamBuffers<'_>>> {
        self.algo.buffers()
    }

    fn state_with(&self, algorithm: OptimizerState) -> Result<AmpOptimizerState> {
        Ok(AmpOptimizerState {
            algorithm,
            groups: self.groups.iter().map(|g| (g.name.clone(), g.hyper)).collect(),
            steps: self.steps,
            skipped_steps: self.skipped,
            consecutive_skips: self.consecutive_skips,
        })
    }

    /// Checks that `state` fits this optimizer (same algorithm, same group names in the same
    /// order) without changing anything.
    pub(crate) fn check_state(&self, state: &AmpOptimizerState) -> Result<()> {
        self.algo.check_state(&state.algorithm)?;
        // Saved buffers must have their parameter's shape.
        for (name, ps) in &state.algorithm.params {
            if let Some(p) = self.run.store.param(name) {
                for (k, b) in &ps.buffers {
                    if b.dims() != p.working().dims() || !b.dtype().is_float() {
                        return Err(AmpError::OptimizerState(format!(
                            "buffer `{k}` of `{name}` has shape {:?} and type {:?} but the parameter has shape {:?}",
                            b.dims(),
                            b.dtype(),
                            p.working().dims()
                        )));
                    }
                }
            }
        }
        for (g, (_, h)) in state.groups.iter().enumerate() {
            check_hyper(g, "lr", h.lr)?;
            check_hyper(g, "weight_decay", h.weight_decay)?;
        }
        let names: Vec<&String> = self.groups.iter().map(|g| &g.name).collect();
        let saved: Vec<&String> = state.groups.iter().map(|(n, _)| n).collect();
        if names != saved {
            return Err(AmpError::OptimizerState(format!(
                "the state has groups {saved:?} but this optimizer has {names:?}; add the same groups before loading"
            )));
        }
        state.algorithm.expect_kind(self.algo.name())
    }

    /// Restores [`state_dict`](Self::state_dict)'s output. The groups must have the same
    /// names in the same order (add them before loading). Gradients accumulated so far are
    /// dropped.
    pub fn load_state_dict(&mut self, state: &AmpOptimizerState) -> Result<()> {
        // Cloning shares the tensors' storage: no copy.
        self.load_state(state.clone())
    }

    /// [`load_state_dict`](Self::load_state_dict) by value: the algorithm frees each saved
    /// buffer as it takes it in ([`Optimizer::load_state`]).
    pub(crate) fn load_state(&mut self, state: AmpOptimizerState) -> Result<()> {
        self.check_state(&state)?;
        let AmpOptimizerState {
            algorithm,
            groups,
            steps,
            skipped_steps,
            consecutive_skips,
        } = state;
        self.algo.load_state(algorithm)?;
        self.zero_grad();
        for (g, (_, h)) in self.groups.iter_mut().zip(&groups) {
            g.hyper = *h;
        }
        self.steps = steps;
        self.skipped = skipped_steps;
        self.consecutive_skips = consecutive_skips;
        Ok(())
    }
}
