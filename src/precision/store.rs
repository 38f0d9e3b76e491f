//! The parameter store: a `SimpleBackend` for candle's `VarBuilder` that owns every
//! parameter of a run, its f32 master where there is one, and the seeded generator that
//! initialises them.
//!
//! Each parameter is created the first time a layer asks for it, from the layer's `Init`
//! hint, with the store's own seeded generator (candle's CPU generator cannot be seeded), so
//! two runs with the same seed start bit-identical. Values are drawn in f64, rounded to f32
//! (the master), then cast to the working type: a half model starts from exactly the rounded
//! f32 model.
//!
//! What is created depends on [`StorePolicy`], which the opt level's properties decide:
//! * trainable parameters are built in the model type; with `master_weights` and a half model
//!   an f32 master Var is kept beside the half working Var;
//! * a parameter requested in f32 by a half model (our [`crate::nn::batch_norm`] does this)
//!   stays f32 when `keep_batchnorm_fp32` is set, and is half otherwise;
//! * buffers (names ending in `running_mean`, `running_var`, `num_batches_tracked`) are single
//!   f32 Vars that never get gradients.
//!
//! The store hands the working Var's tensor to the model itself (never a detached copy), so
//! [`ParamStore::write_f32`] is seen by the model. Parameters are read through [`Param`]'s
//! accessors: values change only through the store and the optimizers, which keep masters
//! and working copies in step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::error::{AmpError, Result};

/// Last name components that mark a buffer (a non-trainable f32 state such as batch-norm
/// running statistics).
pub(crate) const BUFFER_NAMES: [&str; 3] = ["running_mean", "running_var", "num_batches_tracked"];

/// Whether a parameter is trained or is a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// Gets gradients and is updated by an optimizer.
    Trainable,
    /// Never gets gradients (running statistics); always f32.
    Buffer,
}

/// Whether loading weights insists that names match exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// Missing and unexpected names are errors.
    Strict,
    /// Load the names both sides have; report the rest.
    Lenient,
}

/// What the store builds, derived from the run's properties
/// ([`crate::Properties`] makes it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StorePolicy {
    /// The type trainable parameters are built in (`None`: the type the layer asks for).
    pub model_dtype: Option<DType>,
    /// Keep an f32 master beside each half trainable parameter.
    pub master_weights: bool,
    /// Honour f32 requests in a half model (batch norm at O2).
    pub keep_f32_requests: bool,
}

impl StorePolicy {
    /// The dtype the VarBuilder requests by default.
    fn builder_dtype(&self) -> DType {
        self.model_dtype.unwrap_or(DType::F32)
    }

    fn working_dtype(&self, kind: ParamKind, requested: DType) -> DType {
        if kind == ParamKind::Buffer || !requested.is_float() {
            return if requested.is_float() { DType::F32 } else { requested };
        }
        match self.model_dtype {
            None => requested,
            Some(m) if requested == DType::F32 && m != DType::F32 && self.keep_f32_requests => DType::F32,
            Some(m) => m,
        }
    }
}

/// One parameter, read-only: its working value (what the model computes with) and, at O2,
/// its f32 master. Get it from [`ParamStore::param`] or [`ParamStore::params`].
#[derive(Debug, Clone)]
pub struct Param {
    name: String,
    kind: ParamKind,
    working: Var,
    master: Option<Var>,
    frozen: bool,
}

impl Param {
    /// The dotted name (`"fc1.weight"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Trainable or buffer.
    pub fn kind(&self) -> ParamKind {
        self.kind
    }

    /// The tensor the model computes with (half at O2 and O3). It is the model's own tensor:
    /// use it as a key into a `GradStore`; change values through
    /// [`ParamStore::write_f32`].
    pub fn working(&self) -> &Tensor {
        self.working.as_tensor()
    }

    /// The f32 master, where one is kept (O2).
    pub fn master(&self) -> Option<&Tensor> {
        self.master.as_ref().map(|m| m.as_tensor())
    }

    /// Whether optimizers skip it ([`ParamStore::set_frozen`]).
    pub fn is_frozen(&self) -> bool {
        self.frozen
    }

    /// The parameter's value in f32: the master if there is one, else the working value
    /// (cast). It may share storage with the live parameter: `copy()` it to keep it.
    pub fn f32_value(&self) -> Result<Tensor> {
        match &self.master {
            Some(m) => Ok(m.as_tensor().clone()),
            None => Ok(self.working.as_tensor().to_dtype(DType::F32)?),
        }
    }

    /// The working Var.
    pub(crate) fn working_var(&self) -> &Var {
        &self.working
    }

    /// The persistent f32 Var holding this parameter, if one exists (the master, or the
    /// working Var when it is f32).
    pub(crate) fn f32_var(&self) -> Option<&Var> {
        match &self.master {
            Some(m) => Some(m),
            None if self.working.dtype() == DType::F32 => Some(&self.working),
            None => None,
        }
    }

    /// Whether the parameter trains (trainable and not frozen).
    pub(crate) fn trains(&self) -> bool {
        self.kind == ParamKind::Trainable && !self.frozen
    }
}

struct Inner {
    params: Vec<Param>,
    index: HashMap<String, usize>,
    /// Each parameter by its working tensor's id (for the layers, see [`ParamStore::trains_tensor`]).
    ids: HashMap<candle_core::TensorId, usize>,
    rng: ChaCha8Rng,
    policy: StorePolicy,
}

/// The run's parameters. Cheap to clone (shared).
#[derive(Clone)]
pub struct ParamStore {
    inner: Arc<Mutex<Inner>>,
    device: Device,
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.lock();
        f.debug_struct("ParamStore")
            .field("params", &g.params.len())
            .field("policy", &g.policy)
            .finish()
    }
}

impl ParamStore {
    /// An empty store on `device` whose generator is seeded with `seed`.
    pub(crate) fn new(policy: StorePolicy, seed: u64, device: &Device) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                params: Vec::new(),
                index: HashMap::new(),
                ids: HashMap::new(),
                rng: ChaCha8Rng::seed_from_u64(seed),
                policy,
            })),
            device: device.clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock means a panic elsewhere; the data is still consistent per entry.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The device parameters live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A `VarBuilder` backed by this store, requesting the model type.
    pub(crate) fn var_builder(&self) -> VarBuilder<'static> {
        let dtype = self.lock().policy.builder_dtype();
        VarBuilder::from_backend(Box::new(self.clone()), dtype, self.device.clone())
    }

    /// A snapshot of every parameter, in creation order.
    pub fn params(&self) -> Vec<Param> {
        self.lock().params.clone()
    }

    /// One parameter by name.
    pub fn param(&self, name: &str) -> Option<Param> {
        let g = self.lock();
        g.index.get(name).map(|&i| g.params[i].clone())
    }

    /// Names of the trainable parameters, in creation order.
    pub fn trainable_names(&self) -> Vec<String> {
        self.lock()
            .params
            .iter()
            .filter(|p| p.kind == ParamKind::Trainable)
            .map(|p| p.name.clone())
            .collect()
    }

    /// A copy of the initialisation generator's state.
    pub(crate) fn rng_state(&self) -> ChaCha8Rng {
        self.lock().rng.clone()
    }

    /// Restores the initialisation generator's state.
    pub(crate) fn set_rng_state(&self, rng: ChaCha8Rng) {
        self.lock().rng = rng;
    }

    /// Every parameter and buffer as f32 (masters where kept), by name.
    pub fn f32_values(&self) -> Result<std::collections::BTreeMap<String, Tensor>> {
        self.params()
            .iter()
            .map(|p| Ok((p.name.clone(), p.f32_value()?)))
            .collect()
    }

    /// Checks `values` against the store: names missing from `values`, names the store does
    /// not have, and shape mismatches. Returns (missing, unexpected, mismatched shapes).
    pub(crate) fn diff_names<'a>(
        &self,
        values: impl IntoIterator<Item = (&'a String, &'a [usize])>,
    ) -> (Vec<String>, Vec<String>, Vec<String>) {
        let params = self.params();
        let by_name: HashMap<&str, &[usize]> = params.iter().map(|p| (p.name.as_str(), p.working.dims())).collect();
        let mut seen = std::collections::BTreeSet::new();
        let (mut unexpected, mut shapes) = (Vec::new(), Vec::new());
        for (name, dims) in values {
            seen.insert(name.clone());
            match by_name.get(name.as_str()) {
                None => unexpected.push(name.clone()),
                Some(model) if *model != dims => {
                    shapes.push(format!("{name}: checkpoint {:?}, model {:?}", dims, model))
                }
                Some(_) => {}
            }
        }
        let missing = params
            .iter()
            .filter(|p| !seen.contains(&p.name))
            .map(|p| p.name.clone())
            .collect();
        (missing, unexpected, shapes)
    }

    /// Whether `t` is one of this store's working tensors and trains (trainable, not
    /// frozen): `Some(true)` or `Some(false)`; `None` for a tensor that is not the store's.
    pub(crate) fn trains_tensor(&self, t: &Tensor) -> Option<bool> {
        let g = self.lock();
        g.ids.get(&t.id()).map(|&i| g.params[i].trains())
    }

    /// Freezes (or unfreezes) every trainable parameter whose name matches; returns how many
    /// changed. Frozen parameters keep their values: optimizers skip them.
    pub fn set_frozen(&self, pred: impl Fn(&str) -> bool, frozen: bool) -> usize {
        let mut g = self.lock();
        let mut n = 0;
        for p in g.params.iter_mut() {
            if p.kind == ParamKind::Trainable && pred(&p.name) && p.frozen != frozen {
                p.frozen = frozen;
                n += 1;
            }
        }
        n
    }

    /// The bytes of the f32 masters this process holds (O2: one per trainable half
    /// parameter; on a rank of a ZeRO-sharded run, its own shard's only).
    pub fn master_bytes(&self) -> usize {
        self.lock()
            .params
            .iter()
            .filter_map(|p| p.master.as_ref())
            .map(|m| m.elem_count() * m.dtype().size_in_bytes())
            .sum()
    }

    /// Frees a parameter's f32 master: a rank of a ZeRO-sharded run keeps the masters of its
    /// own shard only, and receives the other parameters' working values from their owners.
    /// The parameter then reads as its working value ([`Param::f32_value`]). Returns whether
    /// there was one.
    pub(crate) fn drop_master(&self, name: &str) -> bool {
        let mut g = self.lock();
        let Some(&i) = g.index.get(name) else { return false };
        g.params[i].master.take().is_some()
    }

    /// Writes an f32 value into a parameter: into its master, and cast into its working Var.
    /// Autocast's cached casts of the parameter are invalidated
    /// ([`crate::autocast::invalidate`]). `value` may be on any device (a checkpoint is read
    /// on the host): it is copied to the parameter's.
    pub fn write_f32(&self, name: &str, value: &Tensor) -> Result<()> {
        let p = self.param(name).ok_or_else(|| AmpError::Parameter {
            name: name.to_string(),
            reason: "no such parameter in the store".into(),
        })?;
        if value.dims() != p.working.dims() {
            return Err(AmpError::Parameter {
                name: name.to_string(),
                reason: format!(
                    "value has shape {:?}, the parameter has {:?}",
                    value.dims(),
                    p.working.dims()
                ),
            });
        }
        // `Var::set` copies within one device only: a value read from a file (on the host)
        // for a run on a GPU would fail with a device mismatch.
        let v32 = value.to_dtype(DType::F32)?.to_device(p.working.device())?;
        // Each write is invalidated even when it fails: it may have written part of the values.
        if let Some(m) = &p.master {
            let written = m.set(&v32);
            super::autocast::invalidate(m);
            written?;
        }
        let written = p.working.set(&v32.to_dtype(p.working.dtype())?);
        super::autocast::invalidate(&p.working);
        written?;
        Ok(())
    }

    fn init_values(rng: &mut ChaCha8Rng, shape: &Shape, init: Init) -> Vec<f32> {
        let n = shape.elem_count();
        let uniform = |rng: &mut ChaCha8Rng, lo: f64, up: f64| -> Vec<f32> {
            (0..n).map(|_| (lo + (up - lo) * rng.random::<f64>()) as f32).collect()
        };
        let normal = |rng: &mut ChaCha8Rng, mean: f64, std: f64| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    let z: f64 = StandardNormal.sample(rng);
                    (mean + std * z) as f32
                })
                .collect()
        };
        match init {
            Init::Const(v) => vec![v as f32; n],
            Init::Uniform { lo, up } => uniform(rng, lo, up),
            Init::Randn { mean, stdev } => normal(rng, mean, stdev),
            Init::Kaiming {
                dist,
                fan,
                non_linearity,
            } => {
                let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
                match dist {
                    candle_nn::init::NormalOrUniform::Uniform => {
                        let b = 3f64.sqrt() * std;
                        uniform(rng, -b, b)
                    }
                    candle_nn::init::NormalOrUniform::Normal => normal(rng, 0.0, std),
                }
            }
        }
    }

    /// Returns the named parameter, creating it from `init` if it does not exist yet.
    pub(crate) fn get_or_create(&self, shape: &Shape, name: &str, init: Init, requested: DType) -> Result<Tensor> {
        let mut g = self.lock();
        if let Some(&i) = g.index.get(name) {
            let p = &g.params[i];
            if p.working.shape() != shape {
                return Err(AmpError::Parameter {
                    name: name.to_string(),
                    reason: format!(
                        "requested with shape {:?} but it exists with shape {:?}; two layers share this name",
                        shape.dims(),
                        p.working.dims()
                    ),
                });
            }
            return Ok(p.working.as_tensor().clone());
        }
        let last = name.rsplit('.').next().unwrap_or(name);
        let kind = if BUFFER_NAMES.contains(&last) || !requested.is_float() {
            ParamKind::Buffer
        } else {
            ParamKind::Trainable
        };
        let policy = g.policy;
        let wdt = policy.working_dtype(kind, requested);
        let values = Self::init_values(&mut g.rng, shape, init);
        let t32 = Tensor::from_vec(values, shape.clone(), &self.device)?;
        let keep_master = kind == ParamKind::Trainable && policy.master_weights && wdt != DType::F32;
        let master = if keep_master {
            Some(Var::from_tensor(&t32)?)
        } else {
            None
        };
        let working = Var::from_tensor(&t32.to_dtype(wdt)?)?;
        let out = working.as_tensor().clone();
        let idx = g.params.len();
        g.params.push(Param {
            name: name.to_string(),
            kind,
            working,
            master,
            frozen: false,
        });
        g.index.insert(name.to_string(), idx);
        g.ids.insert(out.id(), idx);
        Ok(out)
    }
}

impl SimpleBackend for ParamStore {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        if !dev.same_device(&self.device) {
            candle_core::bail!(
                "parameter `{name}` requested on {dev:?} but the AMP store lives on {:?}",
                self.device
            )
        }
        Ok(self.get_or_create(&s, name, h, dtype)?)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        match self.param(name) {
            Some(p) => Ok(p.working.as_tensor().clone()),
            None => candle_core::bail!(
                "parameter `{name}` is not in the AMP store: build it with a shape (vb.get) before get_unchecked"
            ),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.lock().index.contains_key(name)
    }
}
