//! The model wrapper: casts inputs to the model type and outputs to f32.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Tensor};
use candle_nn::ModuleT;

use super::autocast::{AutocastGuard, AutocastPolicy};
use super::opt_level::Properties;

/// A model built by [`crate::initialize`] or [`crate::Amp::model`].
///
/// [`forward`](Self::forward) casts floating inputs to the model type (integer inputs such as
/// token ids are never cast), runs the model in training or evaluation mode (see
/// [`train`](Self::train)/[`eval`](Self::eval); training by default, as in PyTorch), and
/// casts floating outputs to `cast_model_outputs`, or to f32 when the model is cast. At O1
/// the run's autocast policy is entered around the model's forward.
///
/// It implements `ModuleT`; candle's blanket `impl<M: Module> ModuleT for M` means it cannot
/// also implement `Module`, hence the inherent `forward`. A model whose forward takes other
/// arguments can call [`cast_input`](Self::cast_input) and [`cast_output`](Self::cast_output)
/// around its own call on [`inner`](Self::inner).
///
/// ```
/// use candle_amp as amp;
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> anyhow::Result<()> {
/// let (model, _opt, amp) = amp::initialize(
///     |vb| amp::nn::linear(4, 2, vb.pp("fc")),
///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
///     amp::OptLevel::O2,
/// )?;
/// let w = amp.store().param("fc.weight").unwrap();
/// assert_eq!(w.working().dtype(), DType::F16);                    // the model computes in f16
/// assert_eq!(w.master().map(|m| m.dtype()), Some(DType::F32));    // f32 master weights
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// assert_eq!(model.input_dtype(), Some(DType::F16));                   // inputs are cast to f16
/// assert_eq!(model.forward(&x)?.dtype(), DType::F32);                  // outputs come back in f32
/// model.eval();                                                         // evaluation mode
/// assert!(!model.is_training());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AmpModel<M> {
    inner: M,
    input_dtype: Option<DType>,
    output_dtype: Option<DType>,
    training: AtomicBool,
    /// The run's policy: enabled at O1, a transparent run scope at the other levels.
    policy: AutocastPolicy,
}

impl<M> AmpModel<M> {
    pub(crate) fn new(inner: M, props: &Properties, policy: AutocastPolicy) -> Self {
        Self {
            inner,
            input_dtype: props.cast_model_type,
            output_dtype: props.output_dtype(),
            training: AtomicBool::new(true),
            policy,
        }
    }

    /// Enters the run's autocast policy (O1) on this thread until the guard drops; `None`
    /// at levels that do not autocast.
    pub fn autocast(&self) -> Option<AutocastGuard> {
        (!self.policy.transparent).then(|| self.policy.enter())
    }

    /// Runs `f` on the wrapped model inside the run's scope, as [`forward`](Self::forward)
    /// runs the model's `forward`: for a model's other entry points, such as
    /// [`Llama::loss`](crate::models::llama::Llama::loss) (the head fused with the loss).
    /// Autocast at O1; at every level the run's fused nodes apply inside (called through
    /// [`inner`](Self::inner) instead, the same method computes the same values but unfused,
    /// as outside a run). Inputs and outputs are not cast: `f` gets and returns what it
    /// is given.
    ///
    /// ```
    /// use candle_amp::{Amp, OptLevel, ops};
    /// use candle_core::{DType, Device, Tensor};
    /// # fn main() -> anyhow::Result<()> {
    /// let run = Amp::new(OptLevel::O1, &Device::Cpu)?;
    /// let model = run.model(|vb| vb.get((2, 2), "w"))?;
    /// let x = Tensor::ones((1, 2), DType::F32, &Device::Cpu)?;
    /// // In the run's scope, O1's autocast runs the product in half...
    /// let y = model.call(|w| ops::matmul(&x, &w.t()?))?;
    /// assert_eq!(y.dtype(), DType::F16);
    /// // ...outside it, in f32.
    /// assert_eq!(ops::matmul(&x, &model.inner().t()?)?.dtype(), DType::F32);
    /// # Ok(()) }
    /// ```
    pub fn call<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        let _scope = self.policy.enter();
        f(&self.inner)
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The wrapped model, mutably.
    pub fn inner_mut(&mut self) -> &mut M {
        &mut self.inner
    }

    /// Unwraps the model.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The dtype floating inputs are cast to, if any.
    pub fn input_dtype(&self) -> Option<DType> {
        self.input_dtype
    }

    /// Switches [`forward`](Self::forward) to training mode (batch statistics, dropout).
    pub fn train(&self) {
        self.training.store(true, Ordering::Relaxed);
    }

    /// Switches [`forward`](Self::forward) to evaluation mode (running statistics).
    pub fn eval(&self) {
        self.training.store(false, Ordering::Relaxed);
    }

    /// Whether [`forward`](Self::forward) runs in training mode.
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }

    /// Casts a floating input to the model type; other inputs pass through.
    pub fn cast_input(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        cast_float(x, self.input_dtype)
    }

    /// Casts a floating output to the output type; other outputs pass through.
    pub fn cast_output(&self, y: &Tensor) -> candle_core::Result<Tensor> {
        cast_float(y, self.output_dtype)
    }
}

fn cast_float(x: &Tensor, to: Option<DType>) -> candle_core::Result<Tensor> {
    match to {
        Some(dt) if x.dtype().is_float() && x.dtype() != dt => crate::kernels::cast(x, dt),
        _ => Ok(x.clone()),
    }
}

impl<M: ModuleT> AmpModel<M> {
    /// Runs the model in the mode set by [`train`](Self::train)/[`eval`](Self::eval).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_t(x, self.is_training())
    }
}

impl<M: ModuleT> ModuleT for AmpModel<M> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let x = self.cast_input(xs)?;
        // The run's scope: autocast at O1; elsewhere only the run's context (batch norm's
        // process group under data parallel).
        let _scope = self.policy.enter();
        let y = self.inner.forward_t(&x, train)?;
        self.cast_output(&y)
    }
}
