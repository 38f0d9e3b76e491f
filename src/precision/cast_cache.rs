//! O1's cast cache: half casts of f32 parameters, served while the parameter is unchanged.
//!
//! Moved out of `autocast` (which owns the cast context that holds a cache): the write
//! generations every in-place write of a parameter bumps ([`invalidate`]), the cache itself
//! and the check a cached cast must pass before it is served ([`Source`]).
//!
//! What a cast is checked against depends on where the parameter lives. On the CPU (outside
//! the device path) the check adds a sampled fingerprint of the data, which catches writers
//! that do not bump the generation (a user's `Var::set`, a candle optimizer outside a run).
//! Elsewhere reading even a few values is a host synchronisation per lookup, which would cost
//! more than the cast it saves, so there the write generation alone decides, and only a run's
//! cache trusts it (every write the run makes to its parameters bumps it; a writer of its own
//! must call [`invalidate`]); a standalone scope's parameters may be written by anything, so
//! its context does not cache them unsampled (`autocast::CastContext::cast`). The forced device
//! path (`AmpConfig::device_path`, `CANDLE_AMP_FORCE_DEVICE_PATH=1`) checks CPU tensors as a
//! GPU's, so a machine without one tests that rule.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, RwLock};

use candle_core::{DType, Tensor, TensorId};

use crate::kernels::{self, fingerprint::sampled_fingerprint};

// ------------------------------------------------------------------------ write generations

/// The write generations of the tensors written in place since the table was last reset:
/// what the cast caches check before serving a cast.
struct Writes {
    /// The generation of every tensor not in `written`.
    floor: u64,
    written: HashMap<TensorId, u64>,
}

/// Where the table is reset (every cached cast is then re-made once), so that the ids of
/// dropped tensors do not accumulate in it.
const MAX_WRITTEN: usize = 1 << 16;

/// The next generation: unique and increasing, so a bumped tensor never matches an entry
/// cast before the bump.
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

static WRITES: LazyLock<RwLock<Writes>> = LazyLock::new(|| {
    RwLock::new(Writes {
        floor: 0,
        written: HashMap::new(),
    })
});

fn fresh_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, Ordering::Relaxed)
}

/// The write generation of the tensor `id` now.
fn write_generation(id: TensorId) -> u64 {
    // A poisoned lock means a panic while inserting; the table is still a valid map.
    let w = WRITES.read().unwrap_or_else(|p| p.into_inner());
    w.written.get(&id).copied().unwrap_or(w.floor)
}

/// Records that `t`'s values were written in place, so no cast cache serves a cast of its
/// old values again. Process-wide, cheap (a hash-map insert), and safe to call for any
/// tensor.
///
/// The crate calls it after each write it makes to a parameter: its optimizers' steps
/// ([`crate::optim::Sgd`], [`crate::optim::AdamW`]), [`crate::ParamStore::write_f32`] and the
/// loads and broadcasts that go through it. Call it yourself after writing a parameter in
/// place (`Var::set`, an in-place op) while autocast may hold a cast of it: the cache's own
/// check samples a few values only, so it sees a rewrite of the whole tensor but can miss a
/// change to a few elements.
///
/// ```
/// use candle_amp::{autocast, ops};
/// use candle_core::{DType, Device, Tensor, Var};
/// # fn main() -> candle_core::Result<()> {
/// let _scope = autocast::scope(DType::BF16);
/// let w = Var::ones((64, 64), DType::F32, &Device::Cpu)?;
/// let x = Tensor::ones((1, 64), DType::F32, &Device::Cpu)?;
/// let before = ops::matmul(&x, &w)?; // casts w (cached)
/// let mut v = vec![1f32; 64 * 64];
/// v[65] = 3.0;
/// w.set(&Tensor::from_vec(v, (64, 64), &Device::Cpu)?)?;
/// autocast::invalidate(&w);
/// let after = ops::matmul(&x, &w)?; // casts the new values
/// assert_eq!(after.to_dtype(DType::F32)?.to_vec2::<f32>()?[0][1], 66.0);
/// # let _ = before; Ok(()) }
/// ```
pub fn invalidate(t: &Tensor) {
    let mut w = WRITES.write().unwrap_or_else(|p| p.into_inner());
    let g = fresh_generation();
    w.written.insert(t.id(), g);
    if w.written.len() > MAX_WRITTEN {
        w.written.clear();
        w.floor = g;
    }
}

/// Like [`invalidate`] for every tensor: no cast cached before this call is served again.
pub fn invalidate_all() {
    let mut w = WRITES.write().unwrap_or_else(|p| p.into_inner());
    w.written.clear();
    w.floor = fresh_generation();
}

// ------------------------------------------------------------------------ the cast cache

/// A cached cast, with what it was cast from (the source's write generation and sampled
/// fingerprint) and whether it was used since the last sweep.
struct Cached {
    source: Source,
    cast: Tensor,
    used: bool,
}

/// The smallest size at which a cache is swept when an entry is inserted.
const MIN_SWEEP: usize = 256;

/// Casts by (source tensor, target type). Entries go when a sweep finds them unused since
/// the previous one: at the end of each step (a run's cache) and whenever the cache has
/// doubled since the last sweep, so casts of dropped tensors (which keep the f32 source
/// alive through their graph) cannot accumulate.
struct CastCache {
    entries: HashMap<(TensorId, DType), Cached>,
    sweep_at: usize,
}

impl CastCache {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
            sweep_at: MIN_SWEEP,
        }
    }

    /// The cast of `key` if it was made from data of this generation and fingerprint.
    fn get(&mut self, key: (TensorId, DType), source: Source) -> Option<Tensor> {
        let e = self.entries.get_mut(&key)?;
        if e.source != source {
            return None;
        }
        e.used = true;
        Some(e.cast.clone())
    }

    /// Inserts a cast unless a racing thread already inserted one of a later generation;
    /// returns what it displaced, for the caller to drop outside the lock.
    fn insert(&mut self, key: (TensorId, DType), entry: Cached) -> Vec<Cached> {
        let mut gone = if self.entries.len() >= self.sweep_at {
            self.sweep()
        } else {
            Vec::new()
        };
        match self.entries.get(&key) {
            Some(e) if e.source.generation > entry.source.generation => gone.push(entry),
            _ => gone.extend(self.entries.insert(key, entry)),
        }
        gone
    }

    /// Removes (and returns) the entries not used since the last sweep, and clears the marks.
    fn sweep(&mut self) -> Vec<Cached> {
        let keys: Vec<_> = self.entries.iter().filter(|(_, e)| !e.used).map(|(k, _)| *k).collect();
        let gone = keys.iter().filter_map(|k| self.entries.remove(k)).collect();
        self.entries.values_mut().for_each(|e| e.used = false);
        self.sweep_at = (2 * self.entries.len()).max(MIN_SWEEP);
        gone
    }
}

// ------------------------------------------------------------------------ the check

/// Whether `CANDLE_AMP_FORCE_DEVICE_PATH` (`1`, `true` or `yes`) forces the device path on
/// the CPU. Here, on the floor's lowest module, so that both `opt_level` (a run's default)
/// and `autocast` (a standalone scope's check) read it without a cycle through the store.
pub(crate) fn device_path_forced_by_env() -> bool {
    std::env::var("CANDLE_AMP_FORCE_DEVICE_PATH")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}

/// What a cached cast of a parameter was made from, compared before it is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Source {
    /// The parameter's write generation when it was read.
    generation: u64,
    /// Its sampled fingerprint, or 0 where the data is not sampled (see the module docs).
    print: u64,
}

/// The check of parameter `t`'s data now, or `None` where its cast is not cached (a strided
/// view). `sample`: whether the fingerprint is read (a CPU tensor outside the device path);
/// without it no value of `t` is read, so a lookup costs no device synchronisation.
pub(super) fn source_of(t: &Tensor, sample: bool) -> Option<Source> {
    // The generation is read before the data: a write that completes after this read
    // bumps it, so a cast of data that was being written is never served.
    let generation = write_generation(t.id());
    let print = match sample {
        true => sampled_fingerprint(t)?,
        false if t.is_contiguous() => 0,
        false => return None,
    };
    Some(Source { generation, print })
}

/// A run's (or a standalone scope's) cache of parameter casts, with its hit counter.
pub(super) struct ParamCasts {
    cache: Mutex<CastCache>,
    hits: AtomicUsize,
}

impl ParamCasts {
    pub(super) fn new() -> Self {
        Self {
            cache: Mutex::new(CastCache::new()),
            hits: AtomicUsize::new(0),
        }
    }

    /// The cached cast of the f32 parameter `t` to `to`, made and cached on a miss; `None`
    /// where the tensor cannot be cached (see [`source_of`]).
    pub(super) fn cast(&self, t: &Tensor, to: DType, sample: bool) -> candle_core::Result<Option<Tensor>> {
        let Some(source) = source_of(t, sample) else {
            return Ok(None);
        };
        let key = (t.id(), to);
        let hit = self.lock().get(key, source);
        if let Some(hit) = hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(hit));
        }
        // No lock is held across the cast: it goes parallel on rayon for large tensors, and a
        // worker waiting in it may run another task that casts through this context.
        let out = kernels::cast(t, to)?;
        let entry = Cached {
            source,
            cast: out.clone(),
            used: true,
        };
        let displaced = self.lock().insert(key, entry);
        // Dropped outside the lock (a displaced cast may free a whole graph).
        drop(displaced);
        Ok(Some(out))
    }

    fn lock(&self) -> MutexGuard<'_, CastCache> {
        // A poisoned lock means a panic elsewhere; the map is still consistent.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the cached casts not used since the last sweep (done when a step's
    /// `scale_loss` ends: a weight the step did not use, or that was dropped, goes).
    pub(super) fn sweep(&self) {
        let gone = self.lock().sweep();
        drop(gone);
    }

    /// The cached casts themselves (for [`crate::testing::live_buffers`]).
    pub(super) fn casts(&self) -> Vec<Tensor> {
        self.lock().entries.values().map(|e| e.cast.clone()).collect()
    }

    /// Number of cached casts.
    pub(super) fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Casts served from the cache so far.
    pub(super) fn hits(&self) -> usize {
        self.hits.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn var() -> Var {
        Var::from_vec((0..64).map(|i| i as f32).collect::<Vec<_>>(), (8, 8), &Device::Cpu).unwrap()
    }

    /// A GPU's parameters are checked without reading their data (issue 38: the fingerprint
    /// exists for CPU storage only, so no device tensor was ever cached): the check must
    /// exist, stay equal while nothing is written, and change with the write generation.
    #[test]
    fn unsampled_parameters_are_cached_by_write_generation() {
        let w = var();
        let a = source_of(w.as_tensor(), false).expect("a contiguous parameter is cached unsampled");
        assert_eq!(source_of(w.as_tensor(), false), Some(a), "unchanged: served");
        invalidate(w.as_tensor());
        assert_ne!(source_of(w.as_tensor(), false), Some(a), "written: not served");
        let t = w.as_tensor().t().unwrap();
        assert_eq!(source_of(&t, false), None, "a strided view is not cached");
        assert!(source_of(w.as_tensor(), true).is_some(), "sampled on the CPU");
    }

    #[test]
    fn the_unsampled_cache_hits_until_the_parameter_is_invalidated() {
        let casts = ParamCasts::new();
        let w = var();
        let first = casts.cast(w.as_tensor(), DType::F16, false).unwrap().unwrap();
        let again = casts.cast(w.as_tensor(), DType::F16, false).unwrap().unwrap();
        assert_eq!((casts.len(), casts.hits()), (1, 1));
        assert_eq!(
            kernels::storage_key(&first),
            kernels::storage_key(&again),
            "the cached cast"
        );
        invalidate(w.as_tensor());
        let _ = casts.cast(w.as_tensor(), DType::F16, false).unwrap().unwrap();
        assert_eq!((casts.len(), casts.hits()), (1, 1), "cast again after the write");
    }
}
