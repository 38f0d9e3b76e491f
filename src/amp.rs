//! The AMP handle and [`initialize`].
//!
//! An [`Amp`] owns a run's per-run state: its resolved [`Properties`], its
//! [`ParamStore`], its loss scalers and the gradient-reduction hook. Models and optimizers
//! made from it share that state; nothing is global.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::VarBuilder;

use crate::error::{AmpError, Result};
use crate::guard::ScaleLoss;
use crate::loss_scale::LossScale;
use crate::model::AmpModel;
use crate::opt_level::{AmpConfig, Properties};
use crate::optim::{AmpOptimizer, Optimizer};
use crate::scaler::{ScalerSlot, ScalerState};
use crate::store::{ParamStore, StorePolicy};

/// Stage 2 of the backward pipeline: a hook that sees the raw (scaled, working-type)
/// gradients before they are unscaled. Data-parallel training all-reduces them here. The
/// default is none.
pub trait GradReducer: Send + Sync {
    /// Reduces `grads` in place; `params` are the (name, working Var) pairs being trained.
    fn reduce(&self, grads: &mut GradStore, params: &[(String, Var)]) -> Result<()>;

    /// Combines this process's overflow flag with the other processes' so that every
    /// process skips the same steps. The default is the local flag.
    fn reduce_found_inf(&self, found_inf: bool) -> Result<bool> {
        Ok(found_inf)
    }
}

pub(crate) struct Shared {
    pub props: Properties,
    pub store: ParamStore,
    scalers: Mutex<Vec<ScalerSlot>>,
    pub reducer: Mutex<Option<Arc<dyn GradReducer>>>,
    pub next_opt_id: AtomicUsize,
}

impl Shared {
    pub fn scalers_mut(&self) -> MutexGuard<'_, Vec<ScalerSlot>> {
        self.scalers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The AMP handle: made once per run by [`initialize`] or [`Amp::new`], then used for every
/// [`scale_loss`](Amp::scale_loss). Cheap to clone (clones share the run).
#[derive(Clone)]
pub struct Amp {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Amp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amp")
            .field("opt_level", &self.shared.props.opt_level)
            .field("store", &self.shared.store)
            .finish()
    }
}

impl Amp {
    /// A new run on `device` with the given level or config. Checks the config the way
    /// Apex does (see [`AmpConfig::resolve`]).
    pub fn new(config: impl Into<AmpConfig>, device: &Device) -> Result<Self> {
        let props = config.into().resolve()?;
        let store = ParamStore::new(StorePolicy::from_properties(&props), props.seed, device);
        let scale = LossScale::from_properties(&props);
        let scalers = (0..props.num_losses).map(|_| ScalerSlot::new(scale)).collect();
        Ok(Self {
            shared: Arc::new(Shared {
                props,
                store,
                scalers: Mutex::new(scalers),
                reducer: Mutex::new(None),
                next_opt_id: AtomicUsize::new(0),
            }),
        })
    }

    /// The resolved properties.
    pub fn properties(&self) -> &Properties {
        &self.shared.props
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.shared.store
    }

    /// A `VarBuilder` over the store, requesting the model type. Use it to build models whose
    /// forward takes other arguments; wrap their inputs with [`AmpModel::cast_input`] or just
    /// build an [`AmpModel`] with [`model`](Amp::model).
    pub fn var_builder(&self) -> VarBuilder<'static> {
        self.shared.store.var_builder()
    }

    /// Builds a model from the store and wraps it. Several models may be built from one
    /// handle; their parameter names must not clash (use `vb.pp("gen")` etc.).
    pub fn model<M>(&self, build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<M>) -> Result<AmpModel<M>> {
        let inner = build(self.var_builder())?;
        Ok(AmpModel::new(inner, &self.shared.props))
    }

    /// An optimizer over every trainable parameter of the store (also ones built later).
    pub fn optimizer(&self, algo: impl Optimizer + 'static) -> AmpOptimizer {
        self.optimizer_for(algo, |_| true)
    }

    /// An optimizer over the trainable parameters whose names match `filter` (e.g. a GAN's
    /// generator: `|n| n.starts_with("gen.")`).
    pub fn optimizer_for(
        &self,
        algo: impl Optimizer + 'static,
        filter: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> AmpOptimizer {
        AmpOptimizer::new(self.shared.clone(), Box::new(algo), Arc::new(filter))
    }

    /// Installs the stage-2 gradient reducer (data parallel).
    pub fn set_grad_reducer(&self, reducer: Option<Arc<dyn GradReducer>>) {
        *self.shared.reducer.lock().unwrap_or_else(|p| p.into_inner()) = reducer;
    }

    pub(crate) fn check_loss_id(&self, id: usize) -> Result<()> {
        let n = self.shared.props.num_losses;
        if id >= n {
            return Err(AmpError::LossId { id, num_losses: n });
        }
        Ok(())
    }

    /// The current scale of loss scaler `loss_id`.
    pub fn loss_scale(&self, loss_id: usize) -> Result<f32> {
        self.check_loss_id(loss_id)?;
        Ok(self.shared.scalers_mut()[loss_id].state.scale.scale())
    }

    /// The state of every loss scaler (scale and skip counters), by loss id.
    pub fn scaler_states(&self) -> Vec<ScalerState> {
        self.shared.scalers_mut().iter().map(|s| s.state.clone()).collect()
    }

    /// Replaces the state of loss scaler `loss_id` (for resuming).
    pub fn set_scaler_state(&self, loss_id: usize, state: ScalerState) -> Result<()> {
        self.check_loss_id(loss_id)?;
        self.shared.scalers_mut()[loss_id].state = state;
        Ok(())
    }

    /// Opens a [`ScaleLoss`] guard for loss id 0 and one optimizer. See [`ScaleLoss`] for
    /// what it does.
    pub fn scale_loss<'a>(&'a self, loss: &Tensor, optimizer: &'a mut AmpOptimizer) -> Result<ScaleLoss<'a>> {
        ScaleLoss::new(self, loss, 0, vec![optimizer])
    }

    /// Opens a [`ScaleLoss`] guard with the scaler of `loss_id`.
    pub fn scale_loss_id<'a>(
        &'a self,
        loss: &Tensor,
        loss_id: usize,
        optimizer: &'a mut AmpOptimizer,
    ) -> Result<ScaleLoss<'a>> {
        ScaleLoss::new(self, loss, loss_id, vec![optimizer])
    }

    /// Opens a [`ScaleLoss`] guard for several optimizers at once (every optimizer owning
    /// parameters this loss reaches). An overflow skips the step of all of them.
    pub fn scale_loss_multi<'a>(
        &'a self,
        loss: &Tensor,
        loss_id: usize,
        optimizers: Vec<&'a mut AmpOptimizer>,
    ) -> Result<ScaleLoss<'a>> {
        ScaleLoss::new(self, loss, loss_id, optimizers)
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
    let amp = Amp::new(config, device)?;
    let model = amp.model(build)?;
    let opt = amp.optimizer(optimizer);
    Ok((model, opt, amp))
}
