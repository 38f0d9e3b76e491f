//! The run's shared state: what one [`crate::Amp`] handle, its models and its optimizers
//! have in common. Nothing is global: two handles share nothing.
//!
//! The handle, the guard, the optimizers and `GradScaler` all depend on this module, not on
//! each other.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;

use super::reduce::{GradReducer, StepReducer};
use super::rng::Generator;
use crate::error::{AmpError, Result};
use crate::precision::autocast::CastContext;
use crate::precision::opt_level::Properties;
use crate::precision::stash::GradStash;
pub(crate) use crate::precision::stash::merge_grads;
use crate::precision::store::ParamStore;
use crate::scaling::scaler::{ScalerSlot, ScalerState};

/// Which trainable parameters an optimizer owns, by name.
pub(crate) type Filter = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Properties, parameters, loss scalers, the reducer, the optimizers' claims, generators and
/// the cast context of one run.
pub(crate) struct RunState {
    pub props: Properties,
    pub store: ParamStore,
    scalers: Mutex<Vec<ScalerSlot>>,
    reducer: Mutex<Option<Arc<dyn GradReducer>>>,
    step_reducer: Mutex<Option<Arc<dyn StepReducer>>>,
    /// The live optimizers' claims (which trainable parameters each owns), by optimizer id.
    claims: Mutex<BTreeMap<usize, Filter>>,
    generators: Mutex<BTreeMap<String, Generator>>,
    /// The cast context, which also holds the run's gradient stash: parameter gradients
    /// that recomputed segments (`recompute`) and the library's layers (`nn::Linear`)
    /// produced during a backward outside candle's `GradStore`, waiting for the guard's
    /// stages.
    pub casts: Arc<CastContext>,
    /// Whether the first backward's check for trained parameters without a gradient ran.
    unused_checked: std::sync::atomic::AtomicBool,
    /// Whether the CPU takes the device path too (`AmpConfig::device_path`).
    force_device_path: bool,
    /// Host reads of device values on the step path (the device path's synchronisations).
    host_syncs: std::sync::atomic::AtomicU64,
    /// Set when a sharded step failed part-way in a way it could not undo (the rank and
    /// why): the weights mix two steps, so every later step is refused.
    diverged: Mutex<Option<(usize, String)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a panic elsewhere; the data is still consistent per entry.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a diverged run's errors tell the user to do.
const RESUME: &str = "start a new run (Amp, model, optimizers and communicator) and resume it from the last checkpoint";

/// The error that refuses `call` on a diverged run.
fn diverged_error(rank: usize, why: &str, call: &str) -> AmpError {
    AmpError::Distributed {
        rank,
        kind: crate::error::DistErrorKind::Diverged,
        detail: format!(
            "{call} is refused: an earlier sharded step failed part-way and could not be undone ({why}), so \
             this rank's weights mix two steps; {RESUME}"
        ),
    }
}

impl RunState {
    /// A run at `props` over `store`.
    pub(crate) fn new(props: Properties, store: ParamStore) -> Self {
        let scale = props.initial_loss_scale();
        let scalers = (0..props.num_losses).map(|_| ScalerSlot::new(scale)).collect();
        let params = store.clone();
        let stash = GradStash::new(Box::new(move |t| params.trains_tensor(t)));
        let casts = Arc::new(CastContext::for_run(props.half.dtype(), props.verbosity, stash));
        Self {
            props,
            store,
            scalers: Mutex::new(scalers),
            reducer: Mutex::new(None),
            step_reducer: Mutex::new(None),
            claims: Mutex::new(BTreeMap::new()),
            generators: Mutex::new(BTreeMap::new()),
            casts,
            unused_checked: std::sync::atomic::AtomicBool::new(false),
            force_device_path: false,
            host_syncs: std::sync::atomic::AtomicU64::new(0),
            diverged: Mutex::new(None),
        }
    }

    /// The run with the device path forced on the CPU too (or not).
    pub(crate) fn with_device_path(mut self, forced: bool) -> Self {
        self.force_device_path = forced;
        // The cast cache checks parameters as a GPU's too (no data read).
        self.casts.check_as_device(forced);
        self
    }

    /// Whether gradients, optimizer state and overflow flags stay on the device, read on
    /// the host once per backward: always off the CPU, on the CPU when forced.
    pub(crate) fn device_path(&self) -> bool {
        self.force_device_path || !self.store.device().is_cpu()
    }

    /// Counts one host read of device values on the step path.
    pub(crate) fn count_host_sync(&self) {
        self.count_host_syncs(1);
    }

    /// Counts `n` host reads of device values on the step path.
    pub(crate) fn count_host_syncs(&self, n: u64) {
        self.host_syncs.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Host reads of device values on the step path so far.
    pub(crate) fn host_syncs(&self) -> u64 {
        self.host_syncs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True the first time it is called in this run, false after: the first backward
    /// checks which trained parameters got no gradient (a warning, once per run).
    pub(crate) fn first_backward(&self) -> bool {
        !self.unused_checked.swap(true, std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn stash(&self) -> &GradStash {
        self.casts
            .stash()
            .expect("a run's cast context has a stash (CastContext::for_run)")
    }

    /// Adds gradients a recomputed segment produced to the ones waiting for the stages.
    pub(crate) fn stash_recomputed(&self, grads: GradStore) -> candle_core::Result<()> {
        self.stash().stash(grads)
    }

    pub(crate) fn scalers_mut(&self) -> MutexGuard<'_, Vec<ScalerSlot>> {
        lock(&self.scalers)
    }

    pub(crate) fn claims_mut(&self) -> MutexGuard<'_, BTreeMap<usize, Filter>> {
        lock(&self.claims)
    }

    /// The installed stage-2 reducer, if any.
    pub(crate) fn reducer(&self) -> Option<Arc<dyn GradReducer>> {
        lock(&self.reducer).clone()
    }

    pub(crate) fn set_reducer(&self, reducer: Option<Arc<dyn GradReducer>>) {
        *lock(&self.reducer) = reducer;
    }

    /// The installed once-per-step reducer, if any.
    pub(crate) fn step_reducer(&self) -> Option<Arc<dyn StepReducer>> {
        lock(&self.step_reducer).clone()
    }

    /// Refuses `call` on a rank that holds only a shard of the run's masters and optimizer
    /// state (ZeRO): what it would return or save would lack the other ranks' shards.
    pub(crate) fn check_whole_state(&self, call: &str) -> Result<()> {
        match self.step_reducer().and_then(|r| r.shard_rank()) {
            None => Ok(()),
            Some(rank) => Err(crate::error::AmpError::Distributed {
                rank,
                kind: crate::error::DistErrorKind::Sharded,
                detail: format!(
                    "{call} needs every parameter's f32 master and optimizer state, and this rank of a ZeRO-sharded \
                     run holds its own shard only: save checkpoints with DataParallel::save_checkpoint, called on \
                     every rank, which writes each rank's shard"
                ),
            }),
        }
    }

    /// Marks the run as diverged ([`DistErrorKind::Diverged`](crate::error::DistErrorKind)):
    /// rank `rank`'s state mixes two steps, for the reason `why` (the first reason is kept
    /// for the later refusals). Returns the error for the call that failed.
    pub(crate) fn set_diverged(&self, rank: usize, why: String) -> AmpError {
        let detail =
            format!("{why}; this rank's weights now mix two steps, and the run refuses every later step: {RESUME}");
        lock(&self.diverged).get_or_insert((rank, why));
        AmpError::Distributed {
            rank,
            kind: crate::error::DistErrorKind::Diverged,
            detail,
        }
    }

    /// Refuses `call` once the run has diverged: its weights mix two steps, so whatever it
    /// computed, applied or saved from here would be wrong.
    pub(crate) fn check_not_diverged(&self, call: &str) -> Result<()> {
        match &*lock(&self.diverged) {
            None => Ok(()),
            Some((rank, why)) => Err(diverged_error(*rank, why, call)),
        }
    }

    pub(crate) fn set_step_reducer(&self, reducer: Option<Arc<dyn StepReducer>>) {
        *lock(&self.step_reducer) = reducer;
    }

    /// The generator called `name`, created from the run's seed and the name on first use.
    pub(crate) fn generator(&self, name: &str) -> Generator {
        lock(&self.generators)
            .entry(name.to_string())
            .or_insert_with(|| Generator::new(self.props.seed, name))
            .clone()
    }

    /// Every generator's state, by name.
    pub(crate) fn generator_states(&self) -> BTreeMap<String, rand_chacha::ChaCha8Rng> {
        lock(&self.generators)
            .iter()
            .map(|(k, g)| (k.clone(), g.snapshot()))
            .collect()
    }

    pub(crate) fn check_loss_id(&self, id: usize) -> Result<()> {
        let n = self.props.num_losses;
        if id >= n {
            return Err(AmpError::LossId { id, num_losses: n });
        }
        Ok(())
    }

    /// The current scale of loss scaler `loss_id`.
    pub(crate) fn loss_scale(&self, loss_id: usize) -> Result<f32> {
        self.check_loss_id(loss_id)?;
        Ok(self.scalers_mut()[loss_id].state.scale.scale())
    }

    /// Every loss scaler's state.
    pub(crate) fn scaler_states(&self) -> Vec<ScalerState> {
        self.scalers_mut().iter().map(|s| s.state.clone()).collect()
    }
}
