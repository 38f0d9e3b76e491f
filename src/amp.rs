//! The AMP handle and [`initialize`]: the top of the crate.
//!
//! An [`Amp`] owns a run's state ([`crate::train::run`]): its resolved [`Properties`], its
//! [`ParamStore`], its loss scalers and the gradient-reduction hook. Models and optimizers
//! made from it share that state; nothing is global.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{AmpError, CheckpointErrorKind, Result};
use crate::files::{map_safetensors, write_safetensors_atomic};
use crate::precision::autocast::{self, AutocastGuard, AutocastPolicy, CastPolicy};
use crate::precision::model::AmpModel;
use crate::precision::opt_level::{AmpConfig, Properties};
use crate::precision::store::{LoadMode, ParamKind, ParamStore};
use crate::scaling::scaler::ScalerState;
use crate::train::guard::ScaleLoss;
use crate::train::optim::{AmpOptimizer, Optimizer, TensorData};
use crate::train::reduce::GradReducer;
use crate::train::rng::Generator;
use crate::train::run::RunState;

/// The version of [`AmpState`] (and of checkpoints) this build writes and the newest it
/// reads. 2: tensors of checkpoints in safetensors only.
pub(crate) const STATE_FORMAT_VERSION: u32 = 2;

/// The run's state as a serde value: what [`Amp::state_dict`] returns. Weights are f32 (the
/// masters at O2), so nothing is lost whatever the level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AmpState {
    /// The format version it was written in (2 in this release).
    pub format_version: u32,
    /// The resolved properties of the run that saved it (informational: loading keeps the
    /// loading run's properties).
    pub properties: Properties,
    /// Every loss scaler's state and skip counters.
    pub scalers: Vec<ScalerState>,
    /// The parameter store's initialisation generator.
    pub store_rng: ChaCha8Rng,
    /// The run's named generators (data order, dropout, ...).
    pub generators: BTreeMap<String, ChaCha8Rng>,
    /// f32 weights and buffers by name (empty inside checkpoint directories, which keep them in
    /// safetensors).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, TensorData>,
    /// Layers kept in f32 ([`Amp::keep_layer_f32`], the numerics doctor's `apply` and its
    /// automatic fallback), by name, with who asked (`"user"`, `"doctor"`, `"auto"`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub f32_layers: BTreeMap<String, String>,
}

/// What [`Amp::load_weights`] did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadReport {
    /// Names loaded.
    pub loaded: Vec<String>,
    /// Model parameters the file does not have (left as initialised).
    pub missing: Vec<String>,
    /// Names in the file the model does not have (ignored).
    pub unexpected: Vec<String>,
}

fn mismatch(path: &str, what: &str, missing: &[String], unexpected: &[String], shapes: &[String]) -> AmpError {
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("missing from the {what}: {}", missing.join(", ")));
    }
    if !unexpected.is_empty() {
        parts.push(format!("not in the model: {}", unexpected.join(", ")));
    }
    if !shapes.is_empty() {
        parts.push(format!("shape mismatch: {}", shapes.join("; ")));
    }
    AmpError::checkpoint(
        path,
        CheckpointErrorKind::Mismatch,
        format!(
            "{} (is it from a different model? build the same architecture, or load pretrained weights leniently)",
            parts.join("; ")
        ),
    )
}

/// The AMP handle: made once per run by [`initialize`] or [`Amp::new`], then used for every
/// [`scale_loss`](Amp::scale_loss). Cheap to clone (clones share the run).
#[derive(Clone)]
pub struct Amp {
    pub(crate) run: Arc<RunState>,
}

impl std::fmt::Debug for Amp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amp")
            .field("opt_level", &self.run.props.opt_level)
            .field("store", &self.run.store)
            .finish()
    }
}

impl Amp {
    /// A new run on `device` with the given level or config. Checks the config the way
    /// Apex does (see [`AmpConfig::resolve`]).
    pub fn new(config: impl Into<AmpConfig>, device: &Device) -> Result<Self> {
        let config = config.into();
        let props = config.resolve()?;
        // Freed device memory stays in the pool between steps (`kernels::cuda::pool`).
        crate::kernels::cuda::pool::keep_freed_memory(device)?;
        let store = ParamStore::new(props.store_policy(), props.seed, device);
        Ok(Self {
            run: Arc::new(RunState::new(props, store).with_device_path(config.forces_device_path())),
        })
    }

    /// The run's autocast policy: enabled when the properties patch functions (O1), else
    /// disabled (ops run in their inputs' types).
    pub(crate) fn autocast_policy(&self) -> AutocastPolicy {
        AutocastPolicy {
            enabled: self.run.props.patch_functions,
            context: self.run.casts.clone(),
            transparent: false,
            phase: crate::precision::autocast::Phase::Normal,
            force_f32: false,
            in_layer: false,
        }
    }

    /// Enters the run's autocast policy on this thread until the guard drops. The model
    /// wrapper does this around `forward` at O1; open it yourself to keep autocast around
    /// code outside the model (our losses compute in f32 regardless).
    pub fn autocast(&self) -> AutocastGuard {
        autocast::enter(self.autocast_policy())
    }

    /// Registers (or overrides) the autocast policy of an op name for this run; call user
    /// functions through [`crate::ops::call`] under that name.
    pub fn register_op(&self, name: &str, policy: CastPolicy) {
        self.run.casts.register(name, policy);
    }

    /// The policy this run applies to an op name: its registration, else the built-in list
    /// ([`crate::autocast::CAST_LISTS`]); `None` for ops on no list.
    pub fn op_policy(&self, name: &str) -> Option<CastPolicy> {
        self.run.casts.policy(name)
    }

    /// Keeps the layer `name` (its VarBuilder path, e.g. `"blocks.0.ffn.up"`; see
    /// [`crate::nn::Linear::name`]) in f32 (`on`), or returns it to the run's policy. Under
    /// an f32 layer every op computes in f32: its inputs and weights are cast up (at O2/O3
    /// too) and its output is f32; at levels that do not autocast, the `candle_amp::nn`
    /// layers after it cast their input back to their weights' type, while raw tensor maths
    /// between its f32 output and half tensors must cast itself. Saved in
    /// [`state_dict`](Amp::state_dict) and checkpoints. Returns whether anything changed.
    ///
    /// ```
    /// use candle_amp as amp;
    /// use candle_core::{DType, Device, Tensor};
    /// # fn main() -> anyhow::Result<()> {
    /// let (model, _opt, amp) = amp::initialize(
    ///     |vb| amp::nn::linear(4, 2, vb.pp("fc")),
    ///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
    ///     amp::OptLevel::O1,
    /// )?;
    /// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    /// let _autocast = amp.autocast();
    /// assert_eq!(candle_nn::Module::forward(model.inner(), &x)?.dtype(), DType::F16);
    /// amp.keep_layer_f32("fc", true);
    /// assert_eq!(candle_nn::Module::forward(model.inner(), &x)?.dtype(), DType::F32);
    /// assert_eq!(amp.f32_layers(), vec!["fc".to_string()]);
    /// # Ok(()) }
    /// ```
    pub fn keep_layer_f32(&self, name: &str, on: bool) -> bool {
        self.run.casts.set_f32_layer(name, on.then_some("user"))
    }

    /// The layers kept in f32, by name.
    pub fn f32_layers(&self) -> Vec<String> {
        self.run.casts.f32_layers().into_keys().collect()
    }

    /// How many ops ran in half during the last completed `scale_loss` block (O1).
    pub fn autocast_ops(&self) -> usize {
        self.run.casts.last_step_half_ops()
    }

    /// The run's cast cache: (casts held now, casts served from the cache so far).
    pub fn cast_cache_stats(&self) -> (usize, usize) {
        (self.run.casts.cached(), self.run.casts.cache_hits())
    }

    /// The run's generator called `name` (created, seeded from the run's seed and the name, on
    /// first use). Its state is part of [`state_dict`](Amp::state_dict) and checkpoints, so
    /// data order and dropout resume exactly.
    pub fn generator(&self, name: &str) -> Generator {
        self.run.generator(name)
    }

    /// The run's state: properties, loss scalers, generators and f32 weights. Optimizer state
    /// is separate ([`AmpOptimizer::state_dict`]). Refused on a rank of a ZeRO-sharded run
    /// ([`crate::error::DistErrorKind::Sharded`]), which holds its shard's masters only.
    pub fn state_dict(&self) -> Result<AmpState> {
        self.run.check_whole_state("Amp::state_dict")?;
        let mut state = self.state_dict_without_weights();
        state.weights = self
            .run
            .store
            .f32_values()?
            .iter()
            .map(|(k, t)| Ok((k.clone(), TensorData::from_tensor(t)?)))
            .collect::<Result<_>>()?;
        Ok(state)
    }

    /// The run's state but the weights (checkpoints keep those in safetensors).
    pub(crate) fn state_dict_without_weights(&self) -> AmpState {
        let generators = self.run.generator_states();
        AmpState {
            format_version: STATE_FORMAT_VERSION,
            properties: self.run.props.clone(),
            scalers: self.scaler_states(),
            store_rng: self.run.store.rng_state(),
            generators,
            weights: BTreeMap::new(),
            f32_layers: self.run.casts.f32_layers(),
        }
    }

    /// Checks that `state` fits this run without changing anything: format version, number
    /// of loss scalers, and (when it carries weights) names and shapes.
    pub(crate) fn check_state(&self, state: &AmpState, origin: &str) -> Result<()> {
        for (k, t) in &state.weights {
            if t.data.len() != t.shape.iter().product::<usize>() {
                return Err(AmpError::checkpoint(
                    origin,
                    CheckpointErrorKind::Corrupt,
                    format!("weight `{k}` has {} values for shape {:?}", t.data.len(), t.shape),
                ));
            }
        }
        let shapes = (!state.weights.is_empty()).then(|| {
            state
                .weights
                .iter()
                .map(|(k, t)| (k.clone(), t.shape.clone()))
                .collect::<Vec<_>>()
        });
        self.check_run_state(state, shapes.as_deref(), origin)
    }

    /// Checks the run state (format version, number of loss scalers) and, when given, the
    /// names and shapes of the weights that come with it.
    pub(crate) fn check_run_state(
        &self,
        state: &AmpState,
        weights: Option<&[(String, Vec<usize>)]>,
        origin: &str,
    ) -> Result<()> {
        if state.format_version > STATE_FORMAT_VERSION {
            return Err(AmpError::checkpoint(
                origin,
                CheckpointErrorKind::NewerFormat,
                format!(
                    "format version {} is newer than {STATE_FORMAT_VERSION}, the newest this build reads; upgrade candle-amp",
                    state.format_version
                ),
            ));
        }
        let n = self.run.props.num_losses;
        if state.scalers.len() != n {
            return Err(AmpError::checkpoint(
                origin,
                CheckpointErrorKind::Mismatch,
                format!(
                    "it has {} loss scaler(s) but this run has num_losses = {n}; initialize with the same num_losses",
                    state.scalers.len()
                ),
            ));
        }
        if let Some(w) = weights {
            let (missing, unexpected, shapes) = self.run.store.diff_names(w.iter().map(|(k, d)| (k, d.as_slice())));
            if !missing.is_empty() || !unexpected.is_empty() || !shapes.is_empty() {
                return Err(mismatch(origin, "checkpoint", &missing, &unexpected, &shapes));
            }
        }
        Ok(())
    }

    /// Restores everything of `state` but the weights: scalers, generators.
    pub(crate) fn restore_run_state(&self, state: &AmpState) {
        {
            let mut scalers = self.run.scalers_mut();
            for (slot, saved) in scalers.iter_mut().zip(&state.scalers) {
                slot.state.restore_from(saved);
            }
        }
        self.run.store.set_rng_state(state.store_rng.clone());
        for (name, rng) in &state.generators {
            self.generator(name).restore(rng.clone());
        }
        for name in self.run.casts.f32_layers().keys() {
            self.run.casts.set_f32_layer(name, None);
        }
        for (name, origin) in &state.f32_layers {
            self.run.casts.set_f32_layer(name, Some(origin));
        }
        if state.properties.opt_level != self.run.props.opt_level || state.properties.half != self.run.props.half {
            log::info!(
                "loaded state saved at {} {} into a run at {} {}",
                state.properties.opt_level,
                state.properties.half,
                self.run.props.opt_level,
                self.run.props.half
            );
        }
    }

    /// Restores [`state_dict`](Amp::state_dict)'s output, at any opt level: the f32 weights
    /// always load (into masters and, cast, into working weights); each loss scaler keeps this
    /// run's settings (floor, ceiling, factors, interval, hysteresis) and takes the saved
    /// progress: where both the saved and this run's scaler are dynamic, the scale (clamped
    /// into this run's floor and ceiling), the growth tracker and the hysteresis left, and
    /// always the step and skip counters (Apex restores `loss_scale` and `unskipped`); the
    /// generators load. Everything is checked before anything changes.
    pub fn load_state_dict(&self, state: &AmpState) -> Result<()> {
        self.check_state(state, "the state dict")?;
        let dev = self.run.store.device().clone();
        for (k, t) in &state.weights {
            self.run.store.write_f32(k, &t.to_tensor(&dev)?)?;
        }
        self.restore_run_state(state);
        Ok(())
    }

    /// Loads pretrained weights from a safetensors file in f32, f16 or bf16 (converted to
    /// f32 masters). The file is memory-mapped and read one tensor at a time. Shape
    /// mismatches are always errors; with [`LoadMode::Strict`] missing and unexpected names
    /// are too. Nothing is written unless the whole file fits.
    pub fn load_weights(&self, path: impl AsRef<Path>, mode: LoadMode) -> Result<LoadReport> {
        let path = path.as_ref();
        let file = map_safetensors(&[path.to_path_buf()])?;
        let views = file.tensors();
        let dims: BTreeMap<String, Vec<usize>> = views.iter().map(|(k, v)| (k.clone(), v.shape().to_vec())).collect();
        let (missing, unexpected, shapes) = self.run.store.diff_names(dims.iter().map(|(k, d)| (k, d.as_slice())));
        let strict_fail = mode == LoadMode::Strict && (!missing.is_empty() || !unexpected.is_empty());
        if strict_fail || !shapes.is_empty() {
            return Err(mismatch(
                &path.display().to_string(),
                "file",
                &missing,
                &unexpected,
                &shapes,
            ));
        }
        if let Some((k, v)) = views
            .iter()
            .find(|(k, v)| !unexpected.contains(k) && !DType::try_from(v.dtype()).is_ok_and(|d| d.is_float()))
        {
            return Err(AmpError::checkpoint(
                path,
                CheckpointErrorKind::Mismatch,
                format!("`{k}` has dtype {:?}; weights must be f32, f16 or bf16", v.dtype()),
            ));
        }
        let mut loaded = Vec::new();
        for name in dims.keys() {
            if unexpected.contains(name) {
                continue;
            }
            let t = file
                .load(name, self.run.store.device())
                .map_err(|e| AmpError::checkpoint(path, CheckpointErrorKind::Corrupt, format!("`{name}`: {e}")))?;
            self.run.store.write_f32(name, &t.to_dtype(DType::F32)?)?;
            loaded.push(name.clone());
        }
        Ok(LoadReport {
            loaded,
            missing,
            unexpected,
        })
    }

    /// Saves the weights for inference in the half type (buffers such as batch-norm
    /// statistics stay f32), cast from the f32 values, as safetensors.
    pub fn export_half(&self, path: impl AsRef<Path>) -> Result<()> {
        let half = self.run.props.half.dtype();
        let mut out = HashMap::new();
        for p in self.run.store.params() {
            let v = p.f32_value()?;
            let v = if p.kind() == ParamKind::Trainable {
                v.to_dtype(half)?
            } else {
                v
            };
            out.insert(p.name().to_string(), v);
        }
        // Written beside the target and renamed over it: a crash never leaves half a file.
        write_safetensors_atomic(&out, path.as_ref())
    }

    /// The resolved properties.
    pub(crate) fn run(&self) -> &Arc<RunState> {
        &self.run
    }

    /// The resolved properties.
    pub fn properties(&self) -> &Properties {
        &self.run.props
    }

    /// Whether this run takes the device path: master gradients, optimizer state and
    /// overflow flags kept on the parameters' device as tensors, the overflow verdict read on
    /// the host once per backward (one host read per step with one backward; the step itself
    /// reads nothing more). Always off the CPU; on the CPU when forced
    /// ([`AmpConfig::device_path`], `CANDLE_AMP_FORCE_DEVICE_PATH=1`).
    pub fn device_path(&self) -> bool {
        self.run.device_path()
    }

    /// How many times this run's step path has read device values on the host (each a
    /// synchronisation with the device's queue), counted on the device path only: one per
    /// backward through [`Amp::scale_loss`] or [`crate::GradScaler`] (its overflow flags, so
    /// its report is the verdict; the step reuses them and reads nothing more: one read per
    /// step with one backward, k with k micro-batches), plus one for each
    /// [`AmpOptimizer::clip_grad_norm`] (its returned norm), a step reducer's output check,
    /// and one per step an attached
    /// [`crate::doctor::Doctor`] observes (all its statistics together). The CPU path reads nothing
    /// from a device, so it counts 0.
    ///
    /// Under [`crate::distributed::DataParallel`] a step adds one read (the reduced layout,
    /// overflow flags and averages' checks, read together after the sum). Over a
    /// communicator that sums tensors in device memory (NCCL) that is all; over one that
    /// does not ([`Communicator::reduces_in_device_memory`](crate::distributed::Communicator::reduces_in_device_memory)
    /// false: MPI, `LocalGroup`), each tensor sum reads its vector on the host once, and
    /// each is counted: one per gradient bucket of the step
    /// ([`DataParallel::collectives`](crate::distributed::DataParallel::collectives) counts
    /// them) and, with [`sync_batch_norm`](crate::distributed::DataParallel::sync_batch_norm),
    /// two per training forward of each batch-norm layer (its per-channel sums; a
    /// checkpointed segment's recomputation runs them again) and one per its backward. So a
    /// step of one forward, one backward and `AmpOptimizer::step` over MPI counts
    /// `1 + 1 + buckets + 3 * batch-norm layers`.
    ///
    /// ```
    /// use candle_amp as amp;
    /// # fn main() -> anyhow::Result<()> {
    /// let config = amp::AmpConfig::new(amp::OptLevel::O2).device_path(true).verbosity(0);
    /// let (model, mut opt, amp) = amp::initialize_on(
    ///     |vb| amp::nn::linear(2, 1, vb.pp("fc")),
    ///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
    ///     config,
    ///     &candle_core::Device::Cpu,
    /// )?;
    /// let x = candle_core::Tensor::ones((3, 2), candle_core::DType::F32, &candle_core::Device::Cpu)?;
    /// for _ in 0..3 {
    ///     let loss = amp::ops::mse(&model.forward(&x)?, &x.narrow(1, 0, 1)?)?;
    ///     amp.scale_loss(&loss, &mut opt)?.backward()?;
    ///     opt.step()?;
    ///     opt.zero_grad();
    /// }
    /// assert!(amp.device_path());
    /// assert_eq!(amp.host_syncs(), 3); // one per backward: one per step here
    /// # Ok(()) }
    /// ```
    pub fn host_syncs(&self) -> u64 {
        self.run.host_syncs()
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.run.store
    }

    /// A `VarBuilder` over the store, requesting the model type. Use it to build models whose
    /// forward takes other arguments; wrap their inputs with [`AmpModel::cast_input`] or just
    /// build an [`AmpModel`] with [`model`](Amp::model).
    pub fn var_builder(&self) -> VarBuilder<'static> {
        self.run.store.var_builder()
    }

    /// Builds a model from the store and wraps it. Several models may be built from one
    /// handle; their parameter names must not clash (use `vb.pp("gen")` etc.).
    pub fn model<M>(&self, build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<M>) -> Result<AmpModel<M>> {
        let inner = build(self.var_builder())?;
        // At O1 the forward runs in the run's autocast policy; at the other levels in a
        // transparent run scope, which only makes the run's context (its batch-norm process
        // group) reachable from the layers.
        let policy = if self.run.props.patch_functions {
            self.autocast_policy()
        } else {
            AutocastPolicy::run_scope(self.run.casts.clone())
        };
        Ok(AmpModel::new(inner, &self.run.props, policy))
    }

    /// An optimizer over every trainable parameter of the store (also ones built later).
    /// An [`AmpError::Ownership`] if another live optimizer of this run already trains one of
    /// them.
    pub fn optimizer(&self, algo: impl Optimizer + 'static) -> Result<AmpOptimizer> {
        self.optimizer_for(algo, |_| true)
    }

    /// An optimizer over the trainable parameters whose names match `filter` (e.g. a GAN's
    /// generator: `|n| n.starts_with("gen.")`). Two live optimizers of one run may not claim
    /// the same parameter: that is an [`AmpError::Ownership`] naming it (a parameter built
    /// later and claimed by both is refused at the first backward that reaches it).
    pub fn optimizer_for(
        &self,
        algo: impl Optimizer + 'static,
        filter: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Result<AmpOptimizer> {
        AmpOptimizer::new(self.run.clone(), Box::new(algo), Arc::new(filter))
    }

    /// Installs the stage-2 gradient reducer (data parallel); both the guard and
    /// [`crate::GradScaler`] run it.
    pub fn set_grad_reducer(&self, reducer: Option<Arc<dyn GradReducer>>) {
        self.run.set_reducer(reducer);
    }

    /// Installs the once-per-step reducer (see `distributed::StepReducer`; what
    /// `distributed::DataParallel::new` installs), or removes it with `None`. The optimizers run it
    /// once per step before anything reads the gradients, and check its output for inf/NaN
    /// unless it says it checked them itself (`StepGrads::checked`).
    pub fn set_step_reducer(&self, reducer: Option<Arc<dyn crate::train::reduce::StepReducer>>) {
        self.run.set_step_reducer(reducer);
    }

    /// The current scale of loss scaler `loss_id`.
    pub fn loss_scale(&self, loss_id: usize) -> Result<f32> {
        self.run.loss_scale(loss_id)
    }

    /// The state of every loss scaler (scale and skip counters), by loss id.
    pub fn scaler_states(&self) -> Vec<ScalerState> {
        self.run.scaler_states()
    }

    /// Opens a [`ScaleLoss`] guard for loss id 0 and one optimizer. See [`ScaleLoss`] for
    /// what it does. A loss that is inf or NaN, or an overflowing gradient, makes the next
    /// `step` a skip (weights and optimizer state untouched) and backs the scale off:
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
    /// let loss = (amp::ops::mse(&model.forward(&x)?, &x.narrow(1, 0, 1)?)? * f64::INFINITY)?;
    /// let report = amp.scale_loss(&loss, &mut opt)?.backward()?;
    /// assert!(report.found_inf && report.nonfinite.contains(&"<loss>".to_string()));
    /// let outcome = opt.step()?;
    /// assert!(outcome.is_skipped());
    /// assert_eq!(amp.loss_scale(0)?, 32768.0);                 // 65536 backed off once
    /// opt.zero_grad();
    /// # Ok(()) }
    /// ```
    pub fn scale_loss<'a>(&'a self, loss: &Tensor, optimizer: &'a mut AmpOptimizer) -> Result<ScaleLoss<'a>> {
        self.run.check_not_diverged("Amp::scale_loss")?;
        ScaleLoss::new(&self.run, loss, 0, vec![optimizer])
    }

    /// Opens a [`ScaleLoss`] guard with the scaler of `loss_id`.
    pub fn scale_loss_id<'a>(
        &'a self,
        loss: &Tensor,
        loss_id: usize,
        optimizer: &'a mut AmpOptimizer,
    ) -> Result<ScaleLoss<'a>> {
        self.run.check_not_diverged("Amp::scale_loss_id")?;
        ScaleLoss::new(&self.run, loss, loss_id, vec![optimizer])
    }

    /// Opens a [`ScaleLoss`] guard for several optimizers at once (every optimizer owning
    /// parameters this loss reaches). An overflow skips the step of all of them.
    pub fn scale_loss_multi<'a>(
        &'a self,
        loss: &Tensor,
        loss_id: usize,
        optimizers: Vec<&'a mut AmpOptimizer>,
    ) -> Result<ScaleLoss<'a>> {
        self.run.check_not_diverged("Amp::scale_loss_multi")?;
        ScaleLoss::new(&self.run, loss, loss_id, optimizers)
    }
}

/// Sets up mixed precision for a model and its optimizer, Apex-style, on the CPU.
///
/// `build` makes the model from a `VarBuilder` backed by the run's parameter store (so the
/// store decides each parameter's type and keeps f32 masters); `optimizer` is the algorithm,
/// which creates its state per parameter as it first sees it; `config` is an [`OptLevel`]
/// or an [`AmpConfig`] with overrides. Returns the wrapped model, the optimizer over all its
/// trainable parameters, and the AMP handle.
///
/// ```
/// use candle_amp as amp;
/// use candle_core::{Device, Tensor};
/// use candle_nn::Module;
///
/// # fn main() -> anyhow::Result<()> {
/// let (model, mut opt, amp) = amp::initialize(
///     |vb| candle_nn::linear(4, 1, vb.pp("fc")),
///     amp::optim::AdamW::new(Default::default())?,
///     amp::OptLevel::O2,
/// )?;
/// let x = Tensor::ones((8, 4), candle_core::DType::F32, &Device::Cpu)?;
/// for _ in 0..3 {
///     let loss = model.forward(&x)?.sqr()?.mean_all()?;
///     amp.scale_loss(&loss, &mut opt)?.backward()?;
///     opt.step()?;
///     opt.zero_grad();
/// }
/// assert_eq!(opt.steps(), 3);
/// # Ok(()) }
/// ```
///
/// [`OptLevel`]: crate::OptLevel
pub fn initialize<M>(
    build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<M>,
    optimizer: impl Optimizer + 'static,
    config: impl Into<AmpConfig>,
) -> Result<(AmpModel<M>, AmpOptimizer, Amp)> {
    initialize_on(build, optimizer, config, &Device::Cpu)
}

/// [`initialize`] on a given device.
pub fn initialize_on<M>(
    build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<M>,
    optimizer: impl Optimizer + 'static,
    config: impl Into<AmpConfig>,
    device: &Device,
) -> Result<(AmpModel<M>, AmpOptimizer, Amp)> {
    let config = config.into();
    let pretrained = config.pretrained.clone();
    let amp = Amp::new(config, device)?;
    let model = amp.model(build)?;
    if let Some((path, mode)) = pretrained {
        let report = amp.load_weights(&path, mode)?;
        if !report.missing.is_empty() || !report.unexpected.is_empty() {
            log::warn!(
                "pretrained weights {}: missing {:?}, unexpected {:?}",
                path.display(),
                report.missing,
                report.unexpected
            );
        }
    }
    let opt = amp.optimizer(optimizer)?;
    Ok((model, opt, amp))
}
