//! The `scale_loss` guard and its backward pipeline.
//!
//! [`ScaleLoss`] holds the loss cast to f32 and multiplied by the current scale. Its
//! backward is a pipeline of named stages:
//!
//! 1. [`stage_backward`]: backward on the scaled loss (replaceable: see
//!    [`ScaleLoss::backward_with`] and [`ScaleLoss::backward_from_grads`] for other drivers,
//!    such as gradient checkpointing);
//! 2. [`stage_reduce`]: the [`GradReducer`](crate::GradReducer) hook over the raw gradients
//!    (a no-op unless one is installed; data parallel all-reduces here);
//! 3. [`stage_unscale`]: unscale into f32 master gradients and detect inf/NaN in the same
//!    pass;
//! 4. [`stage_accumulate`]: add them to each optimizer's master gradients, OR-ing the
//!    overflow flags, so several backward passes can precede one step.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::amp::Amp;
use crate::error::{AmpError, Result};
use crate::optim::AmpOptimizer;

/// What a backward through the guard found.
#[derive(Debug, Clone, PartialEq)]
pub struct BackwardReport {
    /// Whether the loss or any gradient was inf or NaN (the next step will be skipped).
    pub found_inf: bool,
    /// Parameters whose gradients were non-finite (`"<loss>"` for the loss itself).
    pub nonfinite: Vec<String>,
    /// The scale the loss was multiplied by.
    pub loss_scale: f32,
}

/// A scoped guard around one loss, made by [`Amp::scale_loss`].
///
/// When to use: once per loss per iteration, between the forward pass and
/// [`AmpOptimizer::step`]. What it does to state: nothing until
/// [`backward`](Self::backward), which adds unscaled f32 gradients to the optimizers' master
/// gradients and records overflow; the scale itself changes only when the optimizers step.
/// Misuse: opening it on an optimizer that has stepped without `zero_grad` is an
/// [`AmpError::CallOrder`](crate::AmpError::CallOrder); dropping it without a backward
/// leaves everything as it was.
///
/// It dereferences to the scaled loss (f32), for users who drive backward themselves.
pub struct ScaleLoss<'a> {
    amp: &'a Amp,
    optimizers: Vec<&'a mut AmpOptimizer>,
    loss_id: usize,
    scaled: Tensor,
    scale: f32,
    loss_nonfinite: bool,
}

impl std::fmt::Debug for ScaleLoss<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScaleLoss")
            .field("loss_id", &self.loss_id)
            .field("scale", &self.scale)
            .finish()
    }
}

impl std::ops::Deref for ScaleLoss<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.scaled
    }
}

/// Whether any element of `t` is inf or NaN. `t * 0` is NaN exactly where `t` is not finite
/// and 0 elsewhere, so its sum cannot overflow the way a plain sum of large values can.
pub fn has_nonfinite(t: &Tensor) -> Result<bool> {
    let t = t.to_dtype(DType::F32)?;
    Ok(t.affine(0.0, 0.0)?.sum_all()?.to_scalar::<f32>()?.is_nan())
}

impl<'a> ScaleLoss<'a> {
    pub(crate) fn new(
        amp: &'a Amp,
        loss: &Tensor,
        loss_id: usize,
        optimizers: Vec<&'a mut AmpOptimizer>,
    ) -> Result<Self> {
        amp.check_loss_id(loss_id)?;
        for o in &optimizers {
            if !o.belongs_to(&amp.shared) {
                return Err(AmpError::CallOrder(
                    "this optimizer was made by another AMP handle; use the handle that made it".into(),
                ));
            }
            o.check_can_backward()?;
        }
        let scale = amp.loss_scale(loss_id)?;
        // Scale in f32: an f16 loss times 65536 would already be inf.
        let loss32 = loss.to_dtype(DType::F32)?;
        let loss_nonfinite = amp.properties().enabled && has_nonfinite(&loss32)?;
        let scaled = loss32.affine(scale as f64, 0.0)?;
        Ok(Self {
            amp,
            optimizers,
            loss_id,
            scaled,
            scale,
            loss_nonfinite,
        })
    }

    /// The loss, in f32, times the scale.
    pub fn scaled_loss(&self) -> &Tensor {
        &self.scaled
    }

    /// The scale the loss was multiplied by.
    pub fn loss_scale(&self) -> f32 {
        self.scale
    }

    /// Runs the whole pipeline: backward on the scaled loss, reduce, unscale and check,
    /// accumulate.
    pub fn backward(self) -> Result<BackwardReport> {
        let grads = stage_backward(&self.scaled)?;
        self.backward_from_grads(grads)
    }

    /// Runs the pipeline with another stage 1: `driver` gets the scaled loss and returns the
    /// raw gradients of the working parameters (e.g. recomputing checkpointed segments).
    pub fn backward_with(
        self,
        driver: impl FnOnce(&Tensor) -> candle_core::Result<GradStore>,
    ) -> Result<BackwardReport> {
        let grads = driver(&self.scaled)?;
        self.backward_from_grads(grads)
    }

    /// Runs stages 2 to 4 on raw gradients obtained elsewhere (they must be gradients of
    /// [`scaled_loss`](Self::scaled_loss), keyed by the working Vars).
    pub fn backward_from_grads(self, mut grads: GradStore) -> Result<BackwardReport> {
        let check = self.amp.properties().enabled;
        let owned: Vec<Vec<(String, Var)>> = self.optimizers.iter().map(|o| o.trained_vars()).collect();
        let all: Vec<(String, Var)> = owned.iter().flatten().cloned().collect();
        stage_reduce(self.amp, &mut grads, &all)?;
        let inv = (1.0f64 / self.scale as f64) as f32;
        let mut found_inf = self.loss_nonfinite;
        let mut nonfinite = Vec::new();
        if self.loss_nonfinite {
            nonfinite.push("<loss>".to_string());
        }
        let mut per_opt = Vec::with_capacity(owned.len());
        for params in &owned {
            let u = stage_unscale(&grads, params, inv, check)?;
            found_inf |= u.found_inf;
            nonfinite.extend(u.nonfinite.iter().cloned());
            per_opt.push(u.grads);
        }
        if let Some(r) = self
            .amp
            .shared
            .reducer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            found_inf = r.reduce_found_inf(found_inf)?;
        }
        nonfinite.sort();
        nonfinite.dedup();
        let loss_id = self.loss_id;
        let amp = self.amp;
        for (opt, g) in self.optimizers.into_iter().zip(per_opt) {
            stage_accumulate(opt, loss_id, g, found_inf, nonfinite.clone())?;
        }
        // The block is over: its casts are dropped (weights change at the step).
        amp.shared.casts.end_step(amp.properties().patch_functions);
        Ok(BackwardReport {
            found_inf,
            nonfinite,
            loss_scale: self.scale,
        })
    }
}

/// Stage 1: backward on the scaled loss.
pub fn stage_backward(scaled_loss: &Tensor) -> Result<GradStore> {
    Ok(scaled_loss.backward()?)
}

/// Stage 2: the installed [`GradReducer`](crate::GradReducer), if any.
pub fn stage_reduce(amp: &Amp, grads: &mut GradStore, params: &[(String, Var)]) -> Result<()> {
    let reducer = amp.shared.reducer.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(r) = reducer {
        r.reduce(grads, params)?;
    }
    Ok(())
}

/// Stage 3's output for one optimizer.
#[derive(Debug)]
pub struct Unscaled {
    /// Unscaled f32 gradients by parameter name (parameters without a gradient are absent).
    pub grads: Vec<(String, Tensor)>,
    /// Whether any was non-finite.
    pub found_inf: bool,
    /// Which.
    pub nonfinite: Vec<String>,
}

/// Unscales one raw gradient into f32: `g * inv`, in f32, as PyTorch does (skipped when
/// `inv` is 1).
fn unscale(raw: &Tensor, inv: f32) -> Result<Tensor> {
    let g = raw.to_dtype(DType::F32)?;
    Ok(if inv == 1.0 { g } else { g.affine(inv as f64, 0.0)? })
}

/// Unscales one raw gradient into f32 and reports whether the result has an inf or NaN.
pub fn unscale_check(raw: &Tensor, inv: f32) -> Result<(Tensor, bool)> {
    let g = unscale(raw, inv)?;
    let bad = has_nonfinite(&g)?;
    Ok((g, bad))
}

/// Stage 3: unscale into f32 and detect inf/NaN (skipped when `check` is false, i.e. AMP
/// disabled).
pub fn stage_unscale(grads: &GradStore, params: &[(String, Var)], inv: f32, check: bool) -> Result<Unscaled> {
    let mut out = Unscaled {
        grads: Vec::new(),
        found_inf: false,
        nonfinite: Vec::new(),
    };
    for (name, var) in params {
        let Some(raw) = grads.get(var.as_tensor()) else {
            continue;
        };
        let g = unscale(raw, inv)?;
        let bad = check && has_nonfinite(&g)?;
        if bad {
            out.found_inf = true;
            out.nonfinite.push(name.clone());
        }
        out.grads.push((name.clone(), g));
    }
    Ok(out)
}

/// Stage 4: accumulate into the optimizer's master gradients.
pub fn stage_accumulate(
    opt: &mut AmpOptimizer,
    loss_id: usize,
    grads: Vec<(String, Tensor)>,
    found_inf: bool,
    nonfinite: Vec<String>,
) -> Result<()> {
    opt.accumulate(loss_id, grads, found_inf, nonfinite)
}
