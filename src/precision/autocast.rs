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
//! * The cast cache holds half casts of f32 parameters (Vars). Each entry carries a
//!   fingerprint of the f32 data it was cast from and is used only while the data still has
//!   that fingerprint, so a weight changed in place (an optimizer step, `Var::set`) is never
//!   served stale. A run's cache is dropped when a `scale_loss` block ends (Apex); a
//!   standalone [`scope`]'s when the scope closes (PyTorch). Only CPU tensors are cached.
//! * The policy is per thread: a worker thread starts with no policy. To autocast on a
//!   worker, take [`current`] on the spawning thread and [`enter`](AutocastPolicy::enter) it
//!   on the worker (the cast cache is shared and thread-safe).
//! * [`CAST_LISTS`] is the data: each op name with its [`CastPolicy`] (Apex's lists). A run
//!   can register more names, or override built-in ones (`Amp::register_op`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use candle_core::{DType, Tensor, TensorId};

use super::cast_lists::builtin_policy;
pub use super::cast_lists::{CAST_LISTS, CastPolicy};
use crate::comm::Communicator;
use crate::kernels::{self, fingerprint::fingerprint};

/// Per-run autocast state: the cast cache, registrations and counters. Owned by an
/// [`crate::Amp`] handle (or a standalone [`scope`]) and shared with the thread-local policy.
pub(crate) struct CastContext {
    half: DType,
    verbosity: u8,
    cache: Mutex<HashMap<(TensorId, DType), (u64, Tensor)>>,
    registry: RwLock<HashMap<String, CastPolicy>>,
    half_ops: AtomicUsize,
    cache_hits: AtomicUsize,
    last_half_ops: AtomicUsize,
    warned_no_ops: AtomicBool,
    /// The process group batch norm synchronises over (data parallel), if switched on.
    sync: RwLock<Option<Arc<dyn Communicator>>>,
}

impl std::fmt::Debug for CastContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CastContext")
            .field("half", &self.half)
            .field("cached", &self.cache.lock().map(|c| c.len()).unwrap_or(0))
            .finish()
    }
}

impl CastContext {
    /// A context casting to `half`.
    pub(crate) fn new(half: DType, verbosity: u8) -> Self {
        Self {
            half,
            verbosity,
            cache: Mutex::new(HashMap::new()),
            registry: RwLock::new(HashMap::new()),
            half_ops: AtomicUsize::new(0),
            cache_hits: AtomicUsize::new(0),
            last_half_ops: AtomicUsize::new(0),
            warned_no_ops: AtomicBool::new(false),
            sync: RwLock::new(None),
        }
    }

    /// The half type.
    pub(crate) fn half(&self) -> DType {
        self.half
    }

    /// Makes `crate::nn::BatchNorm` compute training statistics over `group` (or locally).
    pub(crate) fn set_sync_group(&self, group: Option<Arc<dyn Communicator>>) {
        *self.sync.write().unwrap_or_else(|p| p.into_inner()) = group;
    }

    fn sync_group(&self) -> Option<Arc<dyn Communicator>> {
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
    /// are never cast). Casts of f32 parameters (Vars) on the CPU to half are cached, and a
    /// cached cast is used only while the parameter's data is unchanged (its fingerprint).
    pub(crate) fn cast(&self, t: &Tensor, to: DType) -> candle_core::Result<Tensor> {
        let from = t.dtype();
        if from == to || !eligible(from) {
            return Ok(t.clone());
        }
        let print = if t.is_variable() && from == DType::F32 && to != DType::F32 {
            fingerprint(t)
        } else {
            None
        };
        if let Some(print) = print {
            let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((p, cached)) = c.get(&(t.id(), to))
                && *p == print
            {
                self.cache_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(cached.clone());
            }
            let out = kernels::cast(t, to)?;
            c.insert((t.id(), to), (print, out.clone()));
            if self.verbosity >= 2 {
                log::debug!("autocast: cast parameter {:?} {from:?} -> {to:?} (cached)", t.shape());
            }
            return Ok(out);
        }
        if self.verbosity >= 2 {
            log::debug!("autocast: cast {:?} {from:?} -> {to:?}", t.shape());
        }
        kernels::cast(t, to)
    }

    /// Drops every cached cast (done when a step's `scale_loss` ends).
    pub(crate) fn clear_cache(&self) {
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Number of cached casts.
    pub(crate) fn cached(&self) -> usize {
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Casts served from the cache so far.
    pub(crate) fn cache_hits(&self) -> usize {
        self.cache_hits.load(Ordering::Relaxed)
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

    /// Ends a step: records its half-op count, clears the cache, and returns the count and,
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
        self.clear_cache();
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
        }
    }

    /// A transparent run scope over `context` (see the field).
    pub(crate) fn run_scope(context: Arc<CastContext>) -> Self {
        Self {
            enabled: false,
            context,
            transparent: true,
            phase: Phase::Normal,
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
    enter(AutocastPolicy::new(Arc::new(CastContext::new(half, 0))))
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
    SCOPES.with(|s| {
        s.borrow()
            .iter()
            .rev()
            .find(|(_, p)| !p.transparent)
            .filter(|(_, p)| p.enabled)
            .map(|(_, p)| p.context.clone())
    })
}

/// The batch-norm process group of the innermost open run that has one (data parallel with
/// synchronised batch norm).
pub(crate) fn sync_group() -> Option<Arc<dyn Communicator>> {
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
