//! Hooks for the crate's own tests, hidden from the documentation: not part of the API.

use candle_core::Tensor;

use crate::amp::Amp;
use crate::error::Result;
use crate::train::optim::AmpOptimizer;

/// Every buffer a run keeps between calls, named: each parameter's working Var and f32
/// master, the cast cache's casts, and each optimizer's master gradients, spare
/// master-gradient buffers and algorithm state. Tests check that no two of them share
/// storage (candle's `clone`, `detach` and same-type `to_dtype` share it), since the
/// library writes most of them in place: see [`storage_key`](crate::kernels::storage_key).
pub fn live_buffers(amp: &Amp, optimizers: &[&AmpOptimizer]) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for p in amp.store().params() {
        out.push((format!("working.{}", p.name()), p.working().clone()));
        if let Some(m) = p.master() {
            out.push((format!("master.{}", p.name()), m.clone()));
        }
    }
    for (i, c) in amp.run.casts.cached_casts().into_iter().enumerate() {
        out.push((format!("cast_cache.{i}"), c));
    }
    for o in optimizers {
        out.extend(o.kept_buffers()?);
    }
    Ok(out)
}
