//! The run's stash of parameter gradients that do not come through candle's `GradStore`:
//! those of checkpointed segments (`recompute`, recomputed during the backward) and the f32
//! weight and bias gradients of the library's layers (`nn::Linear`, which keep their
//! parameters out of candle's graph: see `kernels::wgrad`). The backward pipeline merges
//! them into the backward's gradients before it unscales (`train::guard::run_stages`).
//!
//! It lives with the run's cast context, so a layer reaches it through the thread's scope
//! (`autocast::run_stash`) without a handle.
//!
//! **Whose gradients they are.** A stashed gradient belongs to the backward that produced
//! it, as the rest of that backward's gradients are in the `GradStore` it returned. A
//! scaled loss (the guard's, `GradScaler::scale`'s) carries a marker ([`mark`]): a
//! one-value variable whose node, the first the backward reaches, names the backward on
//! its thread, so every gradient stashed while it runs is filed under it, and the returned
//! `GradStore` holds the marker's gradient, so the call it is handed to finds its stashed
//! gradients ([`GradStash::peek`], [`GradStash::consume`]) and no other call does. The
//! optimizer's `zero_grad` drops its own parameters' stashed gradients of every backward
//! ([`GradStash::clear`]), as PyTorch's clears their `.grad`. A thread-local, not a field:
//! candle runs a backward's nodes on the calling thread, and the nodes that stash (a
//! layer's, a checkpoint's) know the run but not which backward is running them.

use std::cell::Cell;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, TensorId, Var};

use crate::kernels::wgrad::GradSink;

/// Whether a tensor is one of the run's parameters and trains (`None`: not the run's).
pub(crate) type Trains = Box<dyn Fn(&Tensor) -> Option<bool> + Send + Sync>;

/// Which backward a stashed gradient came from: a scaled loss's marker, or `None` for a
/// backward of a tensor without one (a plain `loss.backward()`).
pub(crate) type Tag = Option<TensorId>;

thread_local! {
    /// The marker of the backward this thread runs (set by its first node, [`Mark`]).
    static BACKWARD: Cell<Tag> = const { Cell::new(None) };
}

/// Files the gradients stashed from now on under no marked backward: called where a new
/// scaled loss is made and where a backward's gradients are handed over, so a later
/// unmarked backward is not taken for the last marked one.
pub(crate) fn end_backward() {
    BACKWARD.with(|b| b.set(None));
}

/// The marker's node: a zero of the loss's type made from the marker (a one-value `u8`
/// variable, so that no parameter's gradient looks like its), whose backward names the
/// running backward after the marker and gives the marker a zero gradient, so the returned
/// `GradStore` says which backward it is.
struct Mark(DType);

impl CustomOp1 for Mark {
    fn name(&self) -> &'static str {
        "candle-amp-backward-mark"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        Ok((s.device().zeros_impl(l.shape(), self.0)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        Ok((s.device().zeros_impl(l.shape(), self.0)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        BACKWARD.with(|b| b.set(Some(arg.id())));
        Ok(Some(arg.zeros_like()?))
    }
}

/// `loss` plus a zero made by a fresh marker (the same values: `x + 0` is `x`, inf and NaN
/// included). Its backward files the gradients stashed while it runs under the marker,
/// and its `GradStore` holds the marker's gradient. The marker's node runs second in the
/// backward, before every node of `loss`'s graph (candle visits a node's operands left to
/// right and runs the nodes in the reverse order).
pub(crate) fn mark(loss: &Tensor) -> candle_core::Result<Tensor> {
    end_backward();
    let marker = Var::zeros((), DType::U8, loss.device())?;
    let zero = marker.as_tensor().apply_op1(Mark(loss.dtype()))?;
    loss.broadcast_add(&zero)
}

/// Copies `from`'s markers' gradients into `into`, so `into` names the same backwards.
pub(crate) fn copy_markers(from: &GradStore, into: &mut GradStore) {
    for id in from.get_ids() {
        if let Some(g) = from.get_id(*id).filter(|g| g.dtype() == DType::U8) {
            into.insert_id(*id, g.clone());
        }
    }
}

/// Whether `grads` came from a marked backward: it holds a marker's `u8` gradient.
fn has_marker(grads: &GradStore) -> bool {
    grads
        .get_ids()
        .any(|id| grads.get_id(*id).is_some_and(|g| g.dtype() == DType::U8))
}

/// The waiting gradients of one run, by the backward that produced them, and the run's
/// parameters (to tell which tensors a layer may send here).
pub(crate) struct GradStash {
    trains: Trains,
    grads: Mutex<Vec<(Tag, GradStore)>>,
    /// Told of every gradient added while a backward runs (data parallel's overlap).
    hook: Mutex<Option<Arc<dyn ReadyHook>>>,
}

/// Sees each parameter's waiting gradient as it grows during a backward: data parallel
/// starts a bucket's all-reduce once every gradient in it is complete
/// (`distributed::DataParallel::set_overlap`).
pub(crate) trait ReadyHook: Send + Sync {
    /// Parameter `id`'s waiting gradient is now `sum` (every contribution of this backward
    /// so far).
    fn grad_added(&self, id: TensorId, sum: &Tensor);
}

impl std::fmt::Debug for GradStash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradStash").finish_non_exhaustive()
    }
}

fn is_empty(g: &GradStore) -> bool {
    g.get_ids().next().is_none()
}

impl GradStash {
    /// An empty stash for the parameters `trains` tells (the run's `ParamStore::trains_tensor`).
    pub(crate) fn new(trains: Trains) -> Self {
        Self {
            trains,
            grads: Mutex::new(Vec::new()),
            hook: Mutex::new(None),
        }
    }

    /// Installs (or with `None` removes) the hook told of every added gradient.
    pub(crate) fn set_hook(&self, hook: Option<Arc<dyn ReadyHook>>) {
        *self.hook.lock().unwrap_or_else(|p| p.into_inner()) = hook;
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(Tag, GradStore)>> {
        // A poisoned lock means a panic elsewhere; the data is still consistent per entry.
        self.grads.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `t` is one of the run's parameters (its working tensor) and trains (`None`:
    /// not the run's).
    pub(crate) fn trains(&self, t: &Tensor) -> Option<bool> {
        (self.trains)(t)
    }

    /// Adds `grads` to the waiting ones of the backward this thread runs.
    pub(crate) fn stash(&self, grads: GradStore) -> candle_core::Result<()> {
        let tag = BACKWARD.with(|b| b.get());
        let hook = self.hook.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let ids: Vec<TensorId> = grads.get_ids().copied().collect();
        let sums: Vec<(TensorId, Tensor)> = {
            let mut st = self.lock();
            let i = match st.iter().position(|(t, _)| *t == tag) {
                Some(i) => i,
                None => {
                    st.push((tag, GradStore::default()));
                    st.len() - 1
                }
            };
            let entry = &mut st[i].1;
            merge_grads(entry, grads, false)?;
            match hook {
                None => return Ok(()),
                Some(_) => ids
                    .into_iter()
                    .filter_map(|id| entry.get_id(id).map(|g| (id, g.clone())))
                    .collect(),
            }
        };
        // Outside the lock: the hook may take a while (it unscales into a bucket).
        if let Some(hook) = hook {
            for (id, sum) in &sums {
                hook.grad_added(*id, sum);
            }
        }
        Ok(())
    }

    /// The backwards whose gradients `grads` are: the markers it holds a gradient for;
    /// the unmarked backwards (`None`) when it holds no marker's.
    pub(crate) fn backwards_of(grads: &GradStore) -> Vec<Tag> {
        if !has_marker(grads) {
            return vec![None];
        }
        grads
            .get_ids()
            .filter(|id| grads.get_id(**id).is_some_and(|g| g.dtype() == DType::U8))
            .map(|id| Some(*id))
            .collect()
    }

    /// The waiting gradients of `vars` (all with `None`) that the backwards `tags` stashed
    /// ([`backwards_of`](Self::backwards_of)), summed, and left waiting: a stage that fails
    /// after this took nothing; [`consume`](Self::consume) removes them once the stages
    /// commit.
    pub(crate) fn peek(&self, tags: &[Tag], vars: Option<&[(String, Var)]>) -> candle_core::Result<GradStore> {
        let st = self.lock();
        let mut out = GradStore::default();
        for (tag, store) in st.iter() {
            if !tags.contains(tag) {
                continue;
            }
            let mut part = GradStore::default();
            match vars {
                None => {
                    for id in store.get_ids() {
                        if let Some(g) = store.get_id(*id) {
                            part.insert_id(*id, g.clone());
                        }
                    }
                }
                Some(vars) => {
                    for (_, v) in vars {
                        if let Some(g) = store.get(v.as_tensor()) {
                            part.insert(v.as_tensor(), g.clone());
                        }
                    }
                }
            }
            merge_grads(&mut out, part, false)?;
        }
        Ok(out)
    }

    /// Removes what [`peek`](Self::peek) with the same arguments returned.
    pub(crate) fn consume(&self, tags: &[Tag], vars: Option<&[(String, Var)]>) {
        let mut st = self.lock();
        for (tag, store) in st.iter_mut() {
            if !tags.contains(tag) {
                continue;
            }
            match vars {
                None => *store = GradStore::default(),
                Some(vars) => {
                    for (_, v) in vars {
                        store.remove(v.as_tensor());
                    }
                }
            }
        }
        st.retain(|(_, s)| !is_empty(s));
        drop(st);
        end_backward();
    }

    /// Takes the waiting gradients of `vars` that the backward which returned `grads`
    /// stashed ([`peek`](Self::peek) then [`consume`](Self::consume)).
    pub(crate) fn take(&self, grads: &GradStore, vars: Option<&[(String, Var)]>) -> candle_core::Result<GradStore> {
        let tags = Self::backwards_of(grads);
        let out = self.peek(&tags, vars)?;
        self.consume(&tags, vars);
        Ok(out)
    }

    /// Drops the waiting gradients of `params` (working tensors) from every backward: an
    /// optimizer's `zero_grad`.
    pub(crate) fn clear<'t>(&self, params: impl IntoIterator<Item = &'t Tensor>) {
        let params: Vec<&Tensor> = params.into_iter().collect();
        let mut st = self.lock();
        for (_, store) in st.iter_mut() {
            for p in &params {
                store.remove(p);
            }
        }
        st.retain(|(_, s)| !is_empty(s));
    }

    /// How many backwards have gradients waiting (tests: memory stays bounded).
    pub(crate) fn waiting_backwards(&self) -> usize {
        self.lock().len()
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
