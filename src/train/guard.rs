//! The `scale_loss` guard and its backward pipeline.
//!
//! [`ScaleLoss`] holds the loss cast to f32 and multiplied by the current scale. Its
//! backward is a pipeline of named stages, the same for the PyTorch-style
//! [`GradScaler`](crate::GradScaler):
//!
//! 1. backward on the scaled loss (replaceable: see
//!    [`ScaleLoss::backward_with`] and [`ScaleLoss::backward_from_grads`] for other drivers,
//!    such as gradient checkpointing);
//! 2. reduce: the [`GradReducer`](crate::GradReducer) hook over the raw gradients (a no-op
//!    unless one is installed; data parallel all-reduces here);
//! 3. unscale: check each raw gradient for inf/NaN and unscale it into the optimizer's f32
//!    master-gradient buffer in one pass, adding it to the gradient already there when
//!    micro-batches accumulate (the sum is checked in the same pass; the overflow flag is
//!    then combined through the reducer). The buffers live across steps: no
//!    parameter-sized allocation per step after the first;
//! 4. accumulate: record the new gradients and OR the overflow flags, so several backward
//!    passes can precede one step.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use std::sync::Arc;

use super::optim::{AmpOptimizer, Round, Unscaled};
use super::run::{RunState, merge_grads};
use crate::error::{AmpError, CallOrderKind, Result};
use crate::kernels::unscale::nonfinite;
use crate::precision::recording::{BackwardInfo, TensorKind};

/// The name the numerics doctor gives loss `id`'s value.
fn loss_name(id: usize) -> String {
    if id == 0 { "loss".into() } else { format!("loss{id}") }
}

/// What a backward through the guard (or [`crate::GradScaler::accumulate`]) found.
#[derive(Debug, Clone, PartialEq)]
pub struct BackwardReport {
    /// Whether the loss or any gradient was inf or NaN (the next step will be skipped).
    /// Always the verdict, on both paths: the CPU path checks on the host; the device path
    /// ([`crate::Amp::device_path`]) reads this backward's flags in one host transfer
    /// (counted in [`crate::Amp::host_syncs`]), as Apex's `scale_loss` reads its overflow
    /// buffer once per backward.
    pub found_inf: bool,
    /// Parameters whose gradients were non-finite (`"<loss>"` for the loss itself); when
    /// micro-batches accumulate, those whose sum so far is (two finite gradients can
    /// overflow together). Complete on both paths, like `found_inf`.
    pub nonfinite: Vec<String>,
    /// The scale the loss was multiplied by.
    pub loss_scale: f32,
    /// At O1: how many ops ran in half precision in this `scale_loss` block (`None` at the
    /// other levels and on the `GradScaler` path).
    pub autocast_ops: Option<usize>,
    /// Always `false`, kept for compatibility. It once said that the device path had left
    /// the overflow check on the device until the step, with `found_inf` reading `false`
    /// meanwhile; the device path now reads each backward's flags (see `found_inf`), so no
    /// report is ever provisional.
    pub deferred: bool,
    /// Things the user should know, once per run: in the run's first backward, the trained
    /// parameters (trainable, not frozen) that received no gradient, by name; at O1, a block
    /// in which no op autocast (the model is built from `candle_nn` layers and raw tensor
    /// maths, so it computes in f32 as at O0). Also logged through `log`.
    pub warnings: Vec<String>,
}

/// A scoped guard around one loss, made by [`crate::Amp::scale_loss`].
///
/// When to use: once per loss per iteration, between the forward pass and
/// [`AmpOptimizer::step`]. What it does to state: nothing until
/// [`backward`](Self::backward), which adds unscaled f32 gradients to the optimizers' master
/// gradients and records overflow; the scale itself changes only when the optimizers step.
/// Misuse: opening it on an optimizer that has stepped without `zero_grad` is an
/// [`AmpError::CallOrder`]; dropping it without a backward
/// leaves everything as it was.
///
/// Gradients outside candle's `GradStore` (the run's fused layers and checkpointed segments
/// write their parameters' f32 gradients aside) belong to the backward that produced them,
/// on both APIs: [`loss`](Self::loss) carries a marker whose gradient that backward's
/// `GradStore` holds, so the guard's backward (or
/// [`backward_from_grads`](Self::backward_from_grads) given that store) applies exactly
/// them, each to its owning optimizer. What no call takes waits until the owning
/// optimizer's [`AmpOptimizer::zero_grad`], which drops it; it never joins another
/// backward's step.
///
/// [`loss`](Self::loss) is the scaled loss (f32), for users who drive backward themselves.
///
/// ```
/// use candle_amp as amp;
/// # fn main() -> anyhow::Result<()> {
/// let (model, mut opt, amp) = amp::initialize(
///     |vb| amp::nn::linear(2, 1, vb.pp("fc")),
///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
///     amp::OptLevel::O2,
/// )?;
/// let x = candle_core::Tensor::ones((3, 2), candle_core::DType::F32, &candle_core::Device::Cpu)?;
/// let loss = amp::ops::mse(&model.forward(&x)?, &x.narrow(1, 0, 1)?)?;
/// let guard = amp.scale_loss(&loss, &mut opt)?;
/// assert_eq!(guard.loss_scale(), 65536.0);                // O2's initial dynamic scale
/// assert_eq!(guard.loss().dtype(), candle_core::DType::F32); // the scaled loss is f32
/// let report = guard.backward()?;
/// assert!(!report.found_inf);
/// assert_eq!(opt.master_grads().len(), 2);                // unscaled f32 gradients
/// opt.step()?;
/// opt.zero_grad();
/// # Ok(()) }
/// ```
pub struct ScaleLoss<'a> {
    run: &'a Arc<RunState>,
    optimizers: Vec<&'a mut AmpOptimizer>,
    loss_id: usize,
    scaled: Tensor,
    scale: f32,
    loss_nonfinite: bool,
    /// The device path's flag of the loss (read with the backward's other flags).
    loss_flag: Option<Tensor>,
    /// Open while the doctor records this step: the parameters' gradients in f32 before
    /// they are rounded to half (`kernels::capture`).
    capture: Option<crate::kernels::capture::Capture>,
}

impl std::fmt::Debug for ScaleLoss<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScaleLoss")
            .field("loss_id", &self.loss_id)
            .field("scale", &self.scale)
            .finish()
    }
}

impl<'a> ScaleLoss<'a> {
    pub(crate) fn new(
        run: &'a Arc<RunState>,
        loss: &Tensor,
        loss_id: usize,
        optimizers: Vec<&'a mut AmpOptimizer>,
    ) -> Result<Self> {
        run.check_loss_id(loss_id)?;
        for o in &optimizers {
            if !o.belongs_to(run) {
                return Err(AmpError::call_order(
                    "scale_loss",
                    CallOrderKind::ForeignOptimizer,
                    "this optimizer was made by another AMP handle; use the handle that made it",
                ));
            }
            o.check_can_backward("scale_loss")?;
        }
        let scale = run.loss_scale(loss_id)?;
        // Scale in f32: an f16 loss times 65536 would already be inf.
        let loss32 = loss.to_dtype(DType::F32)?;
        // On the device path the loss is checked on the device, read with the step's flags.
        let (loss_nonfinite, loss_flag) = match (run.props.enabled, run.device_path()) {
            (false, _) => (false, None),
            (true, false) => (nonfinite(&loss32)?, None),
            (true, true) => (false, Some(crate::train::optim::device_flag(&loss32)?)),
        };
        let mut capture = None;
        if let Some(o) = run.casts.recording_observer() {
            o.record(&loss_name(loss_id), TensorKind::Loss, &loss32, 1.0);
            capture = Some(crate::kernels::capture::Capture::open());
        }
        // Marked, so that the gradients the run's layers stash during its backward are this
        // backward's (`precision::stash`).
        let scaled = crate::precision::stash::mark(&loss32.affine(scale as f64, 0.0)?)?;
        Ok(Self {
            run,
            optimizers,
            loss_id,
            scaled,
            scale,
            loss_nonfinite,
            loss_flag,
            capture,
        })
    }

    /// The scale the loss was multiplied by.
    pub fn loss_scale(&self) -> f32 {
        self.scale
    }

    /// The scaled loss: the loss in f32 times [`loss_scale`](Self::loss_scale), for a user
    /// who drives the backward through [`backward_with`](Self::backward_with) or
    /// [`backward_from_grads`](Self::backward_from_grads) (gradients of this tensor).
    pub fn loss(&self) -> &Tensor {
        &self.scaled
    }

    /// Runs the whole pipeline: backward on the scaled loss, reduce, unscale and check,
    /// accumulate.
    pub fn backward(mut self) -> Result<BackwardReport> {
        let _unwind = Unwind(self.run);
        self.begin_backward()?;
        let grads = match stage_backward(&self.scaled) {
            Ok(g) => g,
            Err(e) => return Err(self.failed(e)),
        };
        self.backward_from_grads(grads)
    }

    /// Runs the pipeline with another stage 1: `driver` gets the scaled loss and returns the
    /// raw gradients of the working parameters (e.g. recomputing checkpointed segments).
    pub fn backward_with(
        mut self,
        driver: impl FnOnce(&Tensor) -> candle_core::Result<GradStore>,
    ) -> Result<BackwardReport> {
        let _unwind = Unwind(self.run);
        self.begin_backward()?;
        let grads = match driver(&self.scaled) {
            Ok(g) => g,
            Err(e) => return Err(self.failed(e.into())),
        };
        self.backward_from_grads(grads)
    }

    /// Tells the run's step reducer that a backward starts (data parallel's overlap sends
    /// gradients while it runs), with each parameter's master gradient so far.
    fn begin_backward(&mut self) -> Result<()> {
        let Some(reducer) = self.run.step_reducer() else {
            return Ok(());
        };
        let mut params = Vec::new();
        for o in self.optimizers.iter_mut() {
            for (name, var) in o.trained_vars()? {
                let acc = o.live_grad(&name);
                params.push((name, var, acc));
            }
        }
        reducer.begin_backward(crate::train::reduce::BackwardStart {
            scale: self.scale,
            params: &params,
        })
    }

    /// A backward that failed before its gradients reached the pipeline: the step reducer
    /// forgets it.
    fn failed(&self, e: AmpError) -> AmpError {
        if let Some(reducer) = self.run.step_reducer() {
            reducer.end_backward(false);
        }
        e
    }

    /// Runs stages 2 to 4 on raw gradients obtained elsewhere (they must be gradients of the
    /// scaled loss, [`loss`](Self::loss), keyed by the working Vars).
    pub fn backward_from_grads(self, grads: GradStore) -> Result<BackwardReport> {
        let ScaleLoss {
            run,
            mut optimizers,
            loss_id,
            scale,
            loss_nonfinite,
            loss_flag,
            capture,
            ..
        } = self;
        let check = run.props.enabled;
        let pre_round = capture.as_ref().map(|c| c.take()).unwrap_or_default();
        drop(capture);
        let report = run_stages(
            run,
            grads,
            &mut optimizers,
            Round::Loss(loss_id),
            scale,
            (loss_nonfinite, loss_flag),
            check,
            &pre_round,
        );
        // The block is over: casts not used in it are swept (those used stay cached until their
        // weight's write generation changes at the step).
        let o1 = run.props.patch_functions;
        let (ops, warning) = run.casts.end_step(o1);
        let mut report = report?;
        if o1 {
            report.autocast_ops = Some(ops);
        }
        report.warnings.extend(warning);
        Ok(report)
    }
}

/// Tells the step reducer that a backward ended without going in when it unwinds from a
/// panic (a panicking layer, a user's driver), so that nothing of it is used later.
struct Unwind<'a>(&'a RunState);

impl Drop for Unwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Some(r) = self.0.step_reducer()
        {
            r.end_backward(false);
        }
    }
}

/// Stages 2 to 4 over one backward's raw gradients, for both APIs (the guard and
/// `GradScaler`): the run's reducer (stage 2), unscale and check every optimizer's gradients
/// (stage 3; the overflow flag combined through the reducer), and accumulate them into the
/// optimizers (stage 4). All or nothing: everything that can fail (the call-order checks,
/// the unscaling, the reducer's calls to other processes, the device flags' sums) runs
/// before the first write into an optimizer, so a failed backward leaves every optimizer's
/// master gradients, flags and counters as they were, and can be retried.
/// `loss` is the loss's check: whether it was found non-finite on the host, and on the
/// device path its flag on the device instead. `pre_round`: the gradients kept in f32 before
/// rounding (`kernels::capture`), by tensor id, for the doctor.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_stages(
    run: &RunState,
    grads: GradStore,
    optimizers: &mut [&mut AmpOptimizer],
    round: Round,
    scale: f32,
    loss: (bool, Option<Tensor>),
    check: bool,
    pre_round: &std::collections::HashMap<candle_core::TensorId, Tensor>,
) -> Result<BackwardReport> {
    let out = stages(run, grads, optimizers, round, scale, loss, check, pre_round);
    if out.is_err()
        && let Some(r) = run.step_reducer()
    {
        r.end_backward(false);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn stages(
    run: &RunState,
    mut grads: GradStore,
    optimizers: &mut [&mut AmpOptimizer],
    round: Round,
    scale: f32,
    loss: (bool, Option<Tensor>),
    check: bool,
    pre_round: &std::collections::HashMap<candle_core::TensorId, Tensor>,
) -> Result<BackwardReport> {
    let (loss_nonfinite, loss_flag) = loss;
    for o in optimizers.iter() {
        o.check_accumulate(round)?;
    }
    let owned: Vec<Vec<(String, Var)>> = optimizers.iter_mut().map(|o| o.trained_vars()).collect::<Result<_>>()?;
    let all: Vec<(String, Var)> = owned.iter().flatten().cloned().collect();
    // The parameter gradients this backward stashed (checkpointed segments recomputed during
    // it, the library's layers), taken from the stash only once the stages commit.
    let backwards = crate::precision::stash::GradStash::backwards_of(&grads);
    merge_grads(&mut grads, run.stash().peek(&backwards, Some(&all))?, false)?;
    // The complete raw gradients: an overlapping step reducer sends what is still unsent.
    let step_reducer = run.step_reducer();
    if let Some(r) = &step_reducer {
        r.flush_backward(&grads, &all)?;
    }
    let reducer = run.reducer();
    if let Some(r) = &reducer {
        r.reduce(&mut grads, &all)?;
    }
    let unused = unused_names(&grads, &all);
    let mut found_inf = loss_nonfinite;
    let mut nonfinite = Vec::new();
    if loss_nonfinite {
        nonfinite.push("<loss>".to_string());
    }
    // With a reducer the verdict is combined across processes before anything is written,
    // so stage 3 checks the sums it will make in place without making them yet.
    let verdict_first = reducer.is_some();
    let mut per_opt = Vec::with_capacity(owned.len());
    for (opt, params) in optimizers.iter().zip(&owned) {
        per_opt.push(opt.unscale_into(&grads, params, scale, check, verdict_first)?);
    }
    // The device path: this backward's flags (the loss's, each new master gradient's) read
    // in one host transfer before anything is written, so the report is the verdict (Apex
    // reads its overflow buffer once per backward too) and a failed read changes nothing.
    if loss_flag.is_some() || per_opt.iter().any(|u| !u.device_flags.is_empty()) {
        found_inf |= read_backward_flags(run, loss_flag.as_ref(), &mut per_opt, &mut nonfinite)?;
    }
    for u in &per_opt {
        found_inf |= u.found_inf;
        nonfinite.extend(u.nonfinite.iter().cloned());
    }
    if let Some(r) = &reducer {
        found_inf = r.reduce_found_inf(found_inf)?;
    }
    // The writes. First the sums made in place (checked now where the verdict did not have
    // to come first), then the commits with the block's verdict, which cannot fail.
    for (opt, u) in optimizers.iter().zip(per_opt.iter_mut()) {
        opt.add_in_place(u)?;
        found_inf |= u.found_inf;
        nonfinite.extend(u.nonfinite.iter().cloned());
    }
    if let Some(r) = &step_reducer {
        r.end_backward(true);
    }
    run.stash().consume(&backwards, Some(&all));
    nonfinite.sort();
    nonfinite.dedup();
    for (opt, u) in optimizers.iter_mut().zip(per_opt) {
        opt.commit(round, u, found_inf, nonfinite.clone());
    }
    // The run's first backward is its first that succeeds.
    let first = run.first_backward();
    let warnings = match unused {
        Some(names) if first => vec![unused_warning(&names)],
        _ => Vec::new(),
    };
    // The numerics doctor (if attached) reads the raw, still scaled gradients (stage 3 only
    // read them), then the weights and master gradients: only for a backward that went in.
    let observer = run.casts.observer();
    if let Some(o) = &observer {
        if o.recording() {
            o.begin_gradients(match round {
                Round::Loss(id) => Some(id),
                Round::External => None,
            });
            for (name, v) in &all {
                if let Some(g) = grads.get(v.as_tensor()) {
                    o.record_grad(name, g, pre_round.get(&v.as_tensor().id()));
                }
            }
            for (name, v) in &all {
                o.record(name, TensorKind::Weight, v.as_tensor(), 1.0);
            }
            // The master gradients of the parameters this backward reached (another loss's
            // parameters are that loss's).
            let reached: std::collections::HashSet<&str> = all
                .iter()
                .filter(|(_, v)| grads.get(v.as_tensor()).is_some())
                .map(|(n, _)| n.as_str())
                .collect();
            for (name, g) in optimizers.iter().flat_map(|opt| opt.master_grads()) {
                if reached.contains(name.as_str()) {
                    o.record(name, TensorKind::MasterGrad, g, scale);
                }
            }
        }
        o.end_backward(&BackwardInfo { scale, found_inf });
    }
    Ok(BackwardReport {
        found_inf,
        nonfinite,
        loss_scale: scale,
        autocast_ops: None,
        deferred: false,
        warnings,
    })
}

/// Reads one backward's device flags in one counted host transfer: the loss's (`"<loss>"`
/// goes into `nonfinite` when set) and every optimizer's master gradients' (recorded in
/// each [`Unscaled`] as the CPU path records them). Returns whether
/// the loss was non-finite.
fn read_backward_flags(
    run: &RunState,
    loss_flag: Option<&Tensor>,
    per_opt: &mut [Unscaled],
    nonfinite: &mut Vec<String>,
) -> Result<bool> {
    let mut flags: Vec<Tensor> = loss_flag.into_iter().cloned().collect();
    flags.extend(
        per_opt
            .iter()
            .flat_map(|u| u.device_flags.iter().map(|(_, f)| f.clone())),
    );
    let set = crate::train::optim::read_device_flags(run, &flags)?;
    let (loss_set, mut rest) = set.split_at(usize::from(loss_flag.is_some()));
    for u in per_opt.iter_mut() {
        let (mine, after) = rest.split_at(u.device_flags.len().min(rest.len()));
        u.resolve(mine);
        rest = after;
    }
    let loss_bad = loss_set.first() == Some(&true);
    if loss_bad {
        nonfinite.push("<loss>".to_string());
    }
    Ok(loss_bad)
}

/// The trained parameters that got no gradient from a backward (a layer whose op has no
/// backward, such as candle-nn's fused `layer_norm`, or a branch the loss does not reach):
/// they would silently never change. Frozen parameters are not trained, so not listed.
fn unused_names(grads: &GradStore, params: &[(String, Var)]) -> Option<Vec<String>> {
    let unused: Vec<String> = params
        .iter()
        .filter(|(_, v)| grads.get(v.as_tensor()).is_none())
        .map(|(n, _)| n.clone())
        .collect();
    (!unused.is_empty()).then_some(unused)
}

/// The warning for [`unused_names`], logged through `log` too.
fn unused_warning(unused: &[String]) -> String {
    let w = format!(
        "{} trained parameter(s) received no gradient in the first backward and will not change: {}. \
         Check that the loss depends on them through ops with a backward (candle_nn's fused layer_norm, \
         rms_norm and softmax_last_dim have none: use candle_amp::nn / candle_amp::ops), or freeze them; \
         docs/porting.md lists the traps of ported models",
        unused.len(),
        unused.join(", ")
    );
    log::warn!("{w}");
    w
}

/// Stage 1: backward on the scaled loss.
pub(crate) fn stage_backward(scaled_loss: &Tensor) -> Result<GradStore> {
    Ok(scaled_loss.backward()?)
}
