//! The thread-local autocast policy.
//!
//! Rust cannot monkey-patch candle, so O1's per-op casting works through a thread-local
//! policy that the functions in [`crate::ops`] and the layers in [`crate::nn`] consult. The
//! policy is the crate's one global; it refers to a cast context owned by the run (the
//! [`crate::Amp`] handle) or by a standalone [`scope`], which holds the cast cache, the user's
//! registrations and the counters.
//!
//! * [`scope`] (PyTorch's `autocast`), `amp.autocast()` (the run's policy) and
//!   [`AutocastPolicy::enter`] open a scope and return a guard that closes it when dropped;
//!   scopes nest; [`disable`] opens a disabled scope inside an enabled one; [`disabled`] is
//!   the closure form. Each thread keeps a stack of open scopes and the
//!   policy in effect is the most recently opened one still open, so guards dropped out of
//!   order still leave exactly the scopes that are open in effect.
//! * The cast cache holds half casts of f32 parameters (Vars), keyed by tensor id. Each entry
//!   records the parameter's write generation when it was cast, and on the CPU a sampled
//!   fingerprint of its data, and is served only while they are unchanged. Every write this
//!   crate makes to a parameter (our optimizers' steps, [`crate::ParamStore::write_f32`] and
//!   the load paths through it) bumps the generation ([`invalidate`]); on the CPU the
//!   fingerprint (a few sampled values, see `kernels::fingerprint`) also catches writers we do
//!   not see that rewrite the data (a candle optimizer outside a run, loading values with
//!   `Var::set`). On other devices (and on the forced device path) sampling would cost a host
//!   synchronisation per lookup, so the generation alone decides there, for a run's
//!   parameters only (every write the run makes bumps it; call [`invalidate`] after writing
//!   one yourself); a standalone [`scope`] casts such parameters at every use, since any
//!   writer (a candle optimizer) may change them unseen. A writer that may change only a few
//!   values must call [`invalidate`] on the CPU too. A lookup costs a hash-map probe (and on the CPU the sampled
//!   fingerprint), whatever the size; the cast itself runs with no lock held (two threads
//!   may both cast on a miss; one result is kept). Entries live across steps while their
//!   weight is unchanged (a frozen weight is cast once); a run's entries not used during a
//!   `scale_loss` block are dropped when it ends, and any cache is swept when it grows, so
//!   casts of dropped tensors do not accumulate. A standalone [`scope`]'s cache goes when the
//!   scope closes. Strided views are not cached.
//! * The policy is per thread: a worker thread starts with no policy. To autocast on a
//!   worker, take [`current`] on the spawning thread and [`enter`](AutocastPolicy::enter) it
//!   on the worker (the cast cache is shared and thread-safe).
//! * [`CAST_LISTS`] is the data: each op name with its [`CastPolicy`] (Apex's lists). A run
//!   can register more names, or override built-in ones (`Amp::register_op`).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use candle_core::{DType, Tensor};

use super::cast_cache::ParamCasts;
pub use super::cast_cache::{invalidate, invalidate_all};
use super::cast_lists::builtin_policy;
pub use super::cast_lists::{CAST_LISTS, CastPolicy};
use super::recording::Observer;
use super::stash::GradStash;
use crate::comm::Communicator;
use crate::kernels;

/// The process group synchronised batch norm reduces its statistics over, and how.
#[derive(Debug, Clone)]
pub(crate) struct SyncGroup {
    /// The group (data parallel's communicator, counting its host reads in the run).
    pub comm: Arc<dyn Communicator>,
    /// Whether the run takes the device path: the statistics are then summed as device
    /// tensors (`Communicator::all_reduce_sum_tensor`), never read on the host by the layer.
    pub device_path: bool,
}

/// Per-run autocast state: the cast cache, registrations and counters. Owned by an
/// [`crate::Amp`] handle (or a standalone [`scope`]) and shared with the thread-local policy.
pub(crate) struct CastContext {
    half: DType,
    verbosity: u8,
    cache: ParamCasts,
    /// Whether parameters' casts are checked without reading their data, as on a GPU (the
    /// run takes the device path, or a standalone scope is under the forced device path).
    unsampled: AtomicBool,
    registry: RwLock<HashMap<String, CastPolicy>>,
    half_ops: AtomicUsize,
    last_half_ops: AtomicUsize,
    warned_no_ops: AtomicBool,
    /// The process group batch norm synchronises over (data parallel), if switched on.
    sync: RwLock<Option<SyncGroup>>,
    /// What the layer and op hooks (`precision::observe`) have to do: `HOOK_OBSERVER` when an
    /// observer is installed, `HOOK_F32_LAYERS` when some layer is kept in f32. Zero (the
    /// usual case) costs the hooks one branch.
    hooks: AtomicU8,
    /// The numerics doctor's recorder, if one is attached.
    observer: RwLock<Option<Arc<dyn Observer>>>,
    /// Layers (by VarBuilder path) that run in f32 whatever the level, with who asked for it.
    f32_layers: RwLock<BTreeMap<String, String>>,
    /// A run's stash of parameter gradients outside candle's graph (`None` for a standalone
    /// scope: its layers keep their parameters in the graph).
    stash: Option<Arc<GradStash>>,
}

/// `CastContext::hooks`: an observer is installed.
const HOOK_OBSERVER: u8 = 1;
/// `CastContext::hooks`: some layer is kept in f32.
const HOOK_F32_LAYERS: u8 = 2;

impl std::fmt::Debug for CastContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CastContext")
            .field("half", &self.half)
            .field("cached", &self.cached())
            .finish()
    }
}

impl CastContext {
    /// A context casting to `half`.
    pub(crate) fn new(half: DType, verbosity: u8) -> Self {
        Self {
            half,
            verbosity,
            cache: ParamCasts::new(),
            unsampled: AtomicBool::new(false),
            registry: RwLock::new(HashMap::new()),
            half_ops: AtomicUsize::new(0),
            last_half_ops: AtomicUsize::new(0),
            warned_no_ops: AtomicBool::new(false),
            sync: RwLock::new(None),
            hooks: AtomicU8::new(0),
            observer: RwLock::new(None),
            f32_layers: RwLock::new(BTreeMap::new()),
            stash: None,
        }
    }

    /// The context of a run with its gradient stash: the library's layers built from the
    /// run's parameters send their gradients there ([`GradStash`]).
    pub(crate) fn for_run(half: DType, verbosity: u8, stash: GradStash) -> Self {
        Self {
            stash: Some(Arc::new(stash)),
            ..Self::new(half, verbosity)
        }
    }

    /// The run's gradient stash (`None` for a standalone scope).
    pub(crate) fn stash(&self) -> Option<&Arc<GradStash>> {
        self.stash.as_ref()
    }

    /// Whether any layer or op hook has work to do (an observer or an f32 layer).
    #[inline]
    pub(crate) fn hooked(&self) -> bool {
        self.hooks.load(Ordering::Relaxed) != 0
    }

    /// Installs (or removes) the observer the layer, op and guard hooks report to.
    pub(crate) fn set_observer(&self, observer: Option<Arc<dyn Observer>>) {
        let on = observer.is_some();
        *self.observer.write().unwrap_or_else(|p| p.into_inner()) = observer;
        if on {
            self.hooks.fetch_or(HOOK_OBSERVER, Ordering::Relaxed);
        } else {
            self.hooks.fetch_and(!HOOK_OBSERVER, Ordering::Relaxed);
        }
    }

    /// The installed observer, if any.
    pub(crate) fn observer(&self) -> Option<Arc<dyn Observer>> {
        if self.hooks.load(Ordering::Relaxed) & HOOK_OBSERVER == 0 {
            return None;
        }
        self.observer.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The installed observer when it records the current step.
    pub(crate) fn recording_observer(&self) -> Option<Arc<dyn Observer>> {
        self.observer().filter(|o| o.recording())
    }

    /// Keeps the layer `name` in f32 (`Some(origin)`: who asked, e.g. `"user"`, `"doctor"`,
    /// `"auto"`) or returns it to the run's policy (`None`). Returns whether anything changed.
    pub(crate) fn set_f32_layer(&self, name: &str, origin: Option<&str>) -> bool {
        let mut m = self.f32_layers.write().unwrap_or_else(|p| p.into_inner());
        let changed = match origin {
            Some(o) => m.insert(name.to_string(), o.to_string()).as_deref() != Some(o),
            None => m.remove(name).is_some(),
        };
        if m.is_empty() {
            self.hooks.fetch_and(!HOOK_F32_LAYERS, Ordering::Relaxed);
        } else {
            self.hooks.fetch_or(HOOK_F32_LAYERS, Ordering::Relaxed);
        }
        changed
    }

    /// The layers kept in f32, with who asked for each.
    pub(crate) fn f32_layers(&self) -> BTreeMap<String, String> {
        self.f32_layers.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether some layer is kept in f32.
    pub(crate) fn has_f32_layers(&self) -> bool {
        self.hooks.load(Ordering::Relaxed) & HOOK_F32_LAYERS != 0
    }

    /// Whether the layer `name` is kept in f32.
    pub(crate) fn is_f32_layer(&self, name: &str) -> bool {
        self.has_f32_layers()
            && self
                .f32_layers
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(name)
    }

    /// The half type.
    pub(crate) fn half(&self) -> DType {
        self.half
    }

    /// Makes `crate::nn::BatchNorm` compute training statistics over `group` (or locally).
    pub(crate) fn set_sync_group(&self, group: Option<SyncGroup>) {
        *self.sync.write().unwrap_or_else(|p| p.into_inner()) = group;
    }

    fn sync_group(&self) -> Option<SyncGroup> {
        self.sync.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Registers (or overrides) an op name's policy for this run: a user function called
    /// through [`crate::ops::call`] under that name is cast accordingly.
    pub(crate) fn register(&self, op: &str, policy: CastPolicy) {
        self.registry
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(op.to_string(), policy);
    }

    /// The policy of an op: the run's registration, else the built-in list.
    pub(crate) fn policy(&self, op: &str) -> Option<CastPolicy> {
        let r = self.registry.read().unwrap_or_else(|p| p.into_inner());
        r.get(op).copied().or_else(|| builtin_policy(op))
    }

    /// Casts `t` to `to` if it is a floating tensor other than f64 (integer and f64 tensors
    /// are never cast). Casts of f32 parameters (Vars) to half are cached, and a cached cast
    /// is used only while the parameter is unchanged (its write generation, and on the CPU
    /// its sampled fingerprint).
    pub(crate) fn cast(&self, t: &Tensor, to: DType) -> candle_core::Result<Tensor> {
        let from = t.dtype();
        if from == to || !eligible(from) {
            return Ok(t.clone());
        }
        if t.is_variable()
            && from == DType::F32
            && to != DType::F32
            && let Some(out) = self.cast_param(t, to)?
        {
            return Ok(out);
        }
        if self.verbosity >= 2 {
            log::debug!("autocast: cast {:?} {from:?} -> {to:?}", t.shape());
        }
        kernels::cast(t, to)
    }

    /// The cached cast of an f32 parameter, made and cached on a miss; `None` where the
    /// tensor cannot be cached (a strided view; unsampled, outside a run). Its data is
    /// sampled for the check only on the CPU outside the device path
    /// (`precision::cast_cache`).
    fn cast_param(&self, t: &Tensor, to: DType) -> candle_core::Result<Option<Tensor>> {
        let sample = t.device().is_cpu() && !self.unsampled.load(Ordering::Relaxed);
        // Unsampled, a cast is only as good as the write generations: a run's parameters are
        // written through the crate (its optimizers bump them after any algorithm, candle's
        // too; its store and loads), a standalone scope's by anything (a candle optimizer),
        // so a standalone scope casts them at every use.
        if !sample && self.stash.is_none() {
            return Ok(None);
        }
        let out = self.cache.cast(t, to, sample)?;
        if self.verbosity >= 2 && out.is_some() {
            log::debug!("autocast: cast parameter {:?} F32 -> {to:?} (cached)", t.shape());
        }
        Ok(out)
    }

    /// Checks parameters' casts as a GPU's (write generations only, no data read) on the CPU
    /// too: what the device path does, so that forcing it tests the rule a GPU follows.
    pub(crate) fn check_as_device(&self, on: bool) {
        self.unsampled.store(on, Ordering::Relaxed);
    }

    /// The cached casts themselves (for [`crate::testing::live_buffers`]).
    pub(crate) fn cached_casts(&self) -> Vec<Tensor> {
        self.cache.casts()
    }

    /// Number of cached casts.
    pub(crate) fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Casts served from the cache so far.
    pub(crate) fn cache_hits(&self) -> usize {
        self.cache.hits()
    }

    pub(crate) fn note_half(&self) {
        // A recomputed segment repeats ops already counted in its first forward.
        if matches!(phase(), Phase::Recompute | Phase::SliceRepeat) {
            return;
        }
        self.half_ops.fetch_add(1, Ordering::Relaxed);
    }

    /// Ops that ran in half in the last completed step.
    pub(crate) fn last_step_half_ops(&self) -> usize {
        self.last_half_ops.load(Ordering::Relaxed)
    }

    /// Ends a step: records its half-op count, sweeps the cache, and returns the count and,
    /// once per context, a warning if an autocasting run ran no autocast op at all (also
    /// logged).
    pub(crate) fn end_step(&self, expect_ops: bool) -> (usize, Option<String>) {
        let n = self.half_ops.swap(0, Ordering::Relaxed);
        self.last_half_ops.store(n, Ordering::Relaxed);
        let mut warning = None;
        if expect_ops && n == 0 && !self.warned_no_ops.swap(true, Ordering::Relaxed) {
            let w = "O1 step ran no autocast op: the model computes in f32 as at O0. Build it with candle_amp::nn \
                     layers and write its tensor maths with candle_amp::ops instead of candle_nn and raw tensor methods"
                .to_string();
            log::warn!("{w}");
            warning = Some(w);
        }
        self.cache.sweep();
        (n, warning)
    }
}

/// Whether autocast may cast a tensor of this dtype (floating, not f64).
pub(crate) fn eligible(dt: DType) -> bool {
    matches!(dt, DType::F16 | DType::BF16 | DType::F32)
}

/// A thread's autocast policy: on or off, and the run's (or scope's) cast context. Take it
/// with [`current`] on one thread and [`enter`](Self::enter) it on a worker.
#[derive(Debug, Clone)]
pub struct AutocastPolicy {
    pub(crate) enabled: bool,
    pub(crate) context: Arc<CastContext>,
    /// A run scope that leaves autocast as the scopes below it set it: it only makes the
    /// run's context (its batch-norm process group) reachable. `AmpModel` enters one at the
    /// levels that do not autocast.
    pub(crate) transparent: bool,
    /// What gradient checkpointing is doing on this thread (a transparent marker scope).
    pub(crate) phase: Phase,
    /// A layer kept in f32: every op under this scope computes in f32 (Half-list ops too),
    /// whatever the level.
    pub(crate) force_f32: bool,
    /// A transparent marker: the thread is inside a named layer's forward, so the ops it
    /// calls are not recorded separately (the layer's output is).
    pub(crate) in_layer: bool,
}

/// What gradient checkpointing (`recompute`) is doing on a thread, carried by a transparent
/// marker scope so that no second global is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Nothing.
    Normal,
    /// The first forward of a checkpointed segment: nested checkpoints run plainly.
    SegmentForward,
    /// A segment recomputed during the backward: nested checkpoints run plainly, batch norm
    /// leaves its running statistics alone (they were updated by the first forward) and
    /// half ops are not counted twice.
    Recompute,
    /// The second and later slices of a chunked layer: the same op sites as the first, so
    /// their half ops are not counted again; nested checkpoints run plainly.
    SliceRepeat,
}

impl AutocastPolicy {
    /// An enabled policy over `context`.
    pub(crate) fn new(context: Arc<CastContext>) -> Self {
        Self {
            enabled: true,
            context,
            transparent: false,
            phase: Phase::Normal,
            force_f32: false,
            in_layer: false,
        }
    }

    /// A transparent run scope over `context` (see the field).
    pub(crate) fn run_scope(context: Arc<CastContext>) -> Self {
        Self {
            enabled: false,
            context,
            transparent: true,
            phase: Phase::Normal,
            force_f32: false,
            in_layer: false,
        }
    }

    /// The half type this policy casts to.
    pub fn half(&self) -> DType {
        self.context.half()
    }

    /// Enters this policy on the current thread (e.g. a worker thread) until the guard
    /// drops.
    pub fn enter(&self) -> AutocastGuard {
        enter(self.clone())
    }
}

thread_local! {
    /// This thread's open scopes, oldest first, each with its guard's id.
    static SCOPES: RefCell<Vec<(u64, AutocastPolicy)>> = const { RefCell::new(Vec::new()) };
    static NEXT_SCOPE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Closes its scope when dropped: the scope leaves this thread's stack wherever it is in it,
/// and the most recently opened scope still open takes effect. Not `Send`: a scope belongs to
/// its thread.
#[must_use = "the scope ends when the guard is dropped"]
#[derive(Debug)]
pub struct AutocastGuard {
    id: Option<u64>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        // `try_with`: the thread-local may already be gone while the thread exits.
        let removed = SCOPES.try_with(|s| {
            let mut s = s.borrow_mut();
            s.iter().rposition(|(i, _)| *i == id).map(|k| s.remove(k))
        });
        // The policy (and the context it keeps alive) is dropped outside the borrow.
        drop(removed);
    }
}

/// Enters `policy` on this thread until the guard drops.
pub(crate) fn enter(policy: AutocastPolicy) -> AutocastGuard {
    let id = NEXT_SCOPE.with(|n| {
        let id = n.get();
        n.set(id + 1);
        id
    });
    SCOPES.with(|s| s.borrow_mut().push((id, policy)));
    AutocastGuard {
        id: Some(id),
        _not_send: PhantomData,
    }
}

/// A standalone autocast scope casting to `half` (PyTorch's `autocast`), with a cast cache
/// that lives as long as the scope and never serves a cast of changed data.
///
/// ```
/// use candle_amp::{autocast, ops};
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu)?;
/// let w = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// {
///     let _scope = autocast::scope(DType::BF16);
///     assert_eq!(ops::matmul(&x, &w)?.dtype(), DType::BF16);     // half list
///     assert_eq!(ops::softmax(&x, 1)?.dtype(), DType::F32);      // f32 list
///     let _off = autocast::disable();
///     assert_eq!(ops::matmul(&x, &w)?.dtype(), DType::F32);      // disabled inside
/// }
/// assert!(!autocast::is_enabled());
/// # Ok(()) }
/// ```
pub fn scope(half: DType) -> AutocastGuard {
    let context = CastContext::new(half, 0);
    // Under the forced device path the CPU checks casts as a GPU does (no data read).
    context.check_as_device(super::cast_cache::device_path_forced_by_env());
    enter(AutocastPolicy::new(Arc::new(context)))
}

/// PyTorch's default autocast type for a device: bf16 on CPU, f16 on CUDA.
pub fn default_dtype(device: &candle_core::Device) -> DType {
    if device.is_cuda() { DType::F16 } else { DType::BF16 }
}

/// Disables autocast on this thread until the guard drops (inside an enabled scope).
pub fn disable() -> AutocastGuard {
    let cur = current();
    match cur {
        Some(p) => enter(AutocastPolicy {
            enabled: false,
            context: p.context,
            transparent: false,
            phase: Phase::Normal,
            force_f32: false,
            in_layer: false,
        }),
        None => AutocastGuard {
            id: None,
            _not_send: PhantomData,
        },
    }
}

/// Runs `f` with autocast disabled.
pub fn disabled<R>(f: impl FnOnce() -> R) -> R {
    let _g = disable();
    f()
}

/// This thread's policy, if a scope is open.
pub fn current() -> Option<AutocastPolicy> {
    SCOPES.with(|s| {
        s.borrow()
            .iter()
            .rev()
            .find(|(_, p)| !p.transparent)
            .map(|(_, p)| p.clone())
    })
}

/// The context of this thread's policy when autocast is enabled.
pub(crate) fn active() -> Option<Arc<CastContext>> {
    active_forced().map(|(c, _)| c)
}

/// The context of this thread's policy when autocast is enabled, and whether the scope
/// forces f32 (a layer kept in f32).
pub(crate) fn active_forced() -> Option<(Arc<CastContext>, bool)> {
    SCOPES.with(|s| {
        s.borrow()
            .iter()
            .rev()
            .find(|(_, p)| !p.transparent)
            .filter(|(_, p)| p.enabled)
            .map(|(_, p)| (p.context.clone(), p.force_f32))
    })
}

/// The innermost open scope's context when its hooks have work to do (an observer, an f32
/// layer): a thread-local read and one branch otherwise.
#[inline]
pub(crate) fn hooked_context() -> Option<Arc<CastContext>> {
    SCOPES.with(|s| {
        s.borrow()
            .last()
            .filter(|(_, p)| p.context.hooked())
            .map(|(_, p)| p.context.clone())
    })
}

/// The gradient stash of the innermost open scope's context, where that context is a run's
/// (any scope: the model wrapper's transparent one at the levels that do not autocast too).
pub(crate) fn run_stash() -> Option<Arc<GradStash>> {
    SCOPES.with(|s| s.borrow().last().and_then(|(_, p)| p.context.stash().cloned()))
}

/// Whether this thread is inside a named layer's forward (see `AutocastPolicy::in_layer`).
pub(crate) fn in_layer() -> bool {
    SCOPES.with(|s| s.borrow().iter().any(|(_, p)| p.in_layer))
}

/// Enters a named layer's scope over `context`: a transparent marker, or with `force_f32`
/// an enabled policy under which every op computes in f32 (a layer kept in f32).
pub(crate) fn enter_layer(context: Arc<CastContext>, force_f32: bool) -> AutocastGuard {
    enter(AutocastPolicy {
        enabled: force_f32,
        context,
        transparent: !force_f32,
        phase: Phase::Normal,
        force_f32,
        in_layer: true,
    })
}

/// The batch-norm process group of the innermost open run that has one (data parallel with
/// synchronised batch norm).
pub(crate) fn sync_group() -> Option<SyncGroup> {
    SCOPES.with(|s| s.borrow().iter().rev().find_map(|(_, p)| p.context.sync_group()))
}

/// Every scope open on this thread, oldest first: what a recomputation re-enters so that it
/// runs under the policy the first forward ran under.
pub(crate) fn open_scopes() -> Vec<AutocastPolicy> {
    SCOPES.with(|s| s.borrow().iter().map(|(_, p)| p.clone()).collect())
}

/// Marks this thread as being in `phase` until the guard drops.
pub(crate) fn enter_phase(phase: Phase) -> AutocastGuard {
    let context = SCOPES
        .with(|s| s.borrow().last().map(|(_, p)| p.context.clone()))
        .unwrap_or_else(|| Arc::new(CastContext::new(DType::F16, 0)));
    enter(AutocastPolicy {
        enabled: false,
        context,
        transparent: true,
        phase,
        force_f32: false,
        in_layer: false,
    })
}

/// The innermost checkpointing phase on this thread.
pub(crate) fn phase() -> Phase {
    SCOPES.with(|s| {
        s.borrow()
            .iter()
            .rev()
            .map(|(_, p)| p.phase)
            .find(|p| *p != Phase::Normal)
            .unwrap_or(Phase::Normal)
    })
}

/// Whether autocast is enabled on this thread.
pub fn is_enabled() -> bool {
    active().is_some()
}
