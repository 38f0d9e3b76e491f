//! The run's stash of parameter gradients that do not come through candle's `GradStore`:
//! those of checkpointed segments (`recompute`, recomputed during the backward) and the f32
//! weight and bias gradients of the library's layers (`nn::Linear`, which keep their
//! parameters out of candle's graph: see `kernels::wgrad`). The backward pipeline merges
//! them into the backward's gradients before it unscales (`train::guard::run_stages`).
//!
//! It lives with the run's cast context, so a layer reaches it through the thread's scope
//! (`autocast::run_stash`) without a handle.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId, Var};

use crate::kernels::wgrad::GradSink;

/// Whether a tensor is one of the run's parameters and trains (`None`: not the run's).
pub(crate) type Trains = Box<dyn Fn(&Tensor) -> Option<bool> + Send + Sync>;

/// The waiting gradients of one run, and the run's parameters (to tell which tensors a
/// layer may send here).
pub(crate) struct GradStash {
    trains: Trains,
    grads: Mutex<GradStore>,
    /// Told of every gradient added while a backward runs (data parallel's overlap).
    hook: Mutex<Option<Arc<dyn ReadyHook>>>,
}

/// Sees each parameter's waiting gradient as it grows during a backward: data parallel
/// starts a bucket's all-reduce once every gradient in it is complete
/// (`distributed::DataParallel::set_overlap`).
pub(crate) trait ReadyHook: Send + Sync {
    /// Parameter `id`'s waiting gradient is now `sum` (every contribution so far).
    fn grad_added(&self, id: TensorId, sum: &Tensor);
}

impl std::fmt::Debug for GradStash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradStash").finish_non_exhaustive()
    }
}

impl GradStash {
    /// An empty stash for the parameters `trains` tells (the run's `ParamStore::trains_tensor`).
    pub(crate) fn new(trains: Trains) -> Self {
        Self {
            trains,
            grads: Mutex::new(GradStore::default()),
            hook: Mutex::new(None),
        }
    }

    /// Installs (or with `None` removes) the hook told of every added gradient.
    pub(crate) fn set_hook(&self, hook: Option<Arc<dyn ReadyHook>>) {
        *self.hook.lock().unwrap_or_else(|p| p.into_inner()) = hook;
    }

    fn lock(&self) -> MutexGuard<'_, GradStore> {
        // A poisoned lock means a panic elsewhere; the data is still consistent per entry.
        self.grads.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `t` is one of the run's parameters (its working tensor) and trains (`None`:
    /// not the run's).
    pub(crate) fn trains(&self, t: &Tensor) -> Option<bool> {
        (self.trains)(t)
    }

    /// Adds `grads` to the waiting ones.
    pub(crate) fn stash(&self, grads: GradStore) -> candle_core::Result<()> {
        let hook = self.hook.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some(hook) = hook else {
            return merge_grads(&mut self.lock(), grads, false);
        };
        let ids: Vec<TensorId> = grads.get_ids().copied().collect();
        let sums: Vec<(TensorId, Tensor)> = {
            let mut st = self.lock();
            merge_grads(&mut st, grads, false)?;
            ids.into_iter()
                .filter_map(|id| st.get_id(id).map(|g| (id, g.clone())))
                .collect()
        };
        // Outside the lock: the hook may take a while (it unscales into a bucket).
        for (id, sum) in &sums {
            hook.grad_added(*id, sum);
        }
        Ok(())
    }

    /// Takes the waiting gradients of `vars` (all of them with `None`).
    pub(crate) fn take(&self, vars: Option<&[(String, Var)]>) -> GradStore {
        let mut st = self.lock();
        match vars {
            None => std::mem::take(&mut *st),
            Some(vars) => {
                let mut out = GradStore::default();
                for (_, v) in vars {
                    if let Some(g) = st.remove(v.as_tensor()) {
                        out.insert(v.as_tensor(), g);
                    }
                }
                out
            }
        }
    }
}

impl GradSink for GradStash {
    fn add(&self, param: &Tensor, grad: Tensor) -> candle_core::Result<()> {
        let mut one = GradStore::default();
        one.insert(param, grad);
        self.stash(one)
    }
}

/// Adds `from`'s gradients to `into`'s (candle's `GradStore::extend`, but across types: a
/// gradient summed in f32 meets a half one in f32). `widen`: `from`'s half gradients join in
/// f32.
pub(crate) fn merge_grads(into: &mut GradStore, from: GradStore, widen: bool) -> candle_core::Result<()> {
    let ids: Vec<_> = from.get_ids().copied().collect();
    for id in ids {
        let Some(g) = from.get_id(id) else { continue };
        let g = if widen && matches!(g.dtype(), DType::F16 | DType::BF16) {
            g.to_dtype(DType::F32)?
        } else {
            g.clone()
        };
        let sum = match into.get_id(id) {
            Some(e) if e.dtype() == g.dtype() => e.add(&g)?.detach(),
            Some(e) => e.to_dtype(DType::F32)?.add(&g.to_dtype(DType::F32)?)?.detach(),
            None => g,
        };
        into.insert_id(id, sum);
    }
    Ok(())
}
