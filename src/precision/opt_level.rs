//! Opt levels and their properties, kept as data.
//!
//! An [`OptLevel`] names a row of Apex's property table ([`LEVEL_TABLE`]); an [`AmpConfig`]
//! is that level plus the user's overrides; [`AmpConfig::resolve`] checks the overrides the
//! way Apex does and produces the [`Properties`] that the rest of the crate reads. No other
//! module branches on the opt level itself: they read properties.
//!
//! | level | cast_model_type | patch_functions | keep_batchnorm_fp32 | master_weights | loss_scale |
//! |---|---|---|---|---|---|
//! | O0 | f32 | no | - | no | static 1.0 |
//! | O1 | - | yes | - | - | dynamic |
//! | O2 | half | no | yes | yes | dynamic |
//! | O3 | half | no | no | no | static 1.0 |

use std::fmt;
use std::str::FromStr;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::store::{LoadMode, StorePolicy};
use crate::error::{AmpError, Result};
use crate::scaling::{DynamicParams, LossScale, LossScaleSpec};

/// One of Apex's four optimisation levels: a row of Apex's property table.
///
/// | level | cast_model_type | patch_functions | keep_batchnorm_fp32 | master_weights | loss_scale |
/// |---|---|---|---|---|---|
/// | O0 | f32 | no | - | no | static 1.0 |
/// | O1 | - | yes | - | - | dynamic |
/// | O2 | half | no | yes | yes | dynamic |
/// | O3 | half | no | no | no | static 1.0 |
///
/// "half" is f16, or bf16 with [`AmpConfig::half`]; with bf16 the default loss scale is
/// static 1.0 (bf16 has f32's range). Every property can be overridden with [`AmpConfig`];
/// what Apex rejects (O1 with a model cast, `patch_functions` off O1, ...) is an
/// [`AmpError::InvalidOverride`] naming the property and the level.
///
/// ```
/// use candle_amp::{AmpConfig, HalfType, LossScaleSpec, OptLevel};
/// use candle_core::DType;
///
/// let o2 = AmpConfig::new(OptLevel::O2).resolve()?;
/// assert_eq!(o2.cast_model_type, Some(DType::F16));
/// assert_eq!((o2.keep_batchnorm_fp32, o2.master_weights), (Some(true), true));
/// assert_eq!(o2.loss_scale, LossScaleSpec::Dynamic);
///
/// // bf16 needs no loss scaling by default; an explicit choice wins.
/// let bf16 = AmpConfig::new(OptLevel::O2).half(HalfType::Bf16).resolve()?;
/// assert_eq!(bf16.loss_scale, LossScaleSpec::Static(1.0));
///
/// // Overrides as in Apex, checked as Apex checks them.
/// let o2_bn_half = AmpConfig::new(OptLevel::O2).keep_batchnorm_fp32(false).resolve()?;
/// assert_eq!(o2_bn_half.keep_batchnorm_fp32, Some(false));
/// assert!(AmpConfig::new(OptLevel::O1).master_weights(true).resolve().is_err());
///
/// assert_eq!("O3".parse::<OptLevel>()?, OptLevel::O3);
/// # Ok::<(), candle_amp::AmpError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OptLevel {
    /// Pure f32: the accuracy baseline.
    O0,
    /// f32 weights, each op cast to the type that is safe for it (autocast).
    O1,
    /// Half weights with f32 master weights and f32 batch norm; dynamic loss scaling.
    O2,
    /// Pure half: the speed baseline.
    O3,
}

impl OptLevel {
    /// All levels, in order.
    pub const ALL: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];

    /// This level's row of the table.
    pub(crate) fn defaults(self) -> &'static LevelDefaults {
        &LEVEL_TABLE[self as usize]
    }
}

impl OptLevel {
    /// `"O0"`, `"O1"`, `"O2"` or `"O3"` (also its `Display`).
    pub(crate) fn name(self) -> &'static str {
        ["O0", "O1", "O2", "O3"][self as usize]
    }
}

impl fmt::Display for OptLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OptLevel {
    type Err = AmpError;
    /// Parses `"O0"`..`"O3"`, case-insensitively (Apex also accepts only these).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "O0" => Ok(OptLevel::O0),
            "O1" => Ok(OptLevel::O1),
            "O2" => Ok(OptLevel::O2),
            "O3" => Ok(OptLevel::O3),
            _ => Err(AmpError::Parse {
                what: "opt level",
                input: s.to_string(),
                expected: "one of O0, O1, O2, O3 (the letter O, not zero)",
            }),
        }
    }
}

/// The reduced-precision type used where a property says "half".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum HalfType {
    /// IEEE binary16: needs loss scaling (small gradients underflow).
    #[default]
    F16,
    /// bfloat16: f32's range, so a static scale of 1.0 is the default.
    Bf16,
}

impl HalfType {
    /// The candle dtype.
    pub fn dtype(self) -> DType {
        match self {
            HalfType::F16 => DType::F16,
            HalfType::Bf16 => DType::BF16,
        }
    }

    /// The lower-case name used on the command line and in JSON ("f16", "bf16"; also its
    /// `Display`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            HalfType::F16 => "f16",
            HalfType::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for HalfType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HalfType {
    type Err = AmpError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f16" | "fp16" | "float16" | "half" => Ok(HalfType::F16),
            "bf16" | "bfloat16" => Ok(HalfType::Bf16),
            _ => Err(AmpError::Parse {
                what: "half type",
                input: s.to_string(),
                expected: "f16 or bf16",
            }),
        }
    }
}

/// The model type of a level's table row: f32, the configured half type, or no cast.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum CastType {
    /// Do not cast the model (O1).
    NoCast,
    /// Cast to f32.
    F32,
    /// Cast to the configured [`HalfType`].
    Half,
}

impl CastType {
    fn resolve(self, half: HalfType) -> Option<DType> {
        match self {
            CastType::NoCast => None,
            CastType::F32 => Some(DType::F32),
            CastType::Half => Some(half.dtype()),
        }
    }
}

/// One row of the opt-level table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LevelDefaults {
    /// The level this row describes.
    pub level: OptLevel,
    /// The type the model's parameters are built in.
    pub cast_model_type: CastType,
    /// Whether ops are autocast per op (O1).
    pub patch_functions: bool,
    /// Whether batch norm stays f32 in a half model; `None` when it does not apply.
    pub keep_batchnorm_fp32: Option<bool>,
    /// Whether f32 master weights are kept beside half working weights; `None` when it does
    /// not apply.
    pub master_weights: Option<bool>,
    /// The default loss scaling.
    pub loss_scale: LossScaleSpec,
}

/// Apex's property table, one row per level, indexed by `OptLevel as usize`. The only place
/// the levels differ: everything else reads the resolved [`Properties`].
pub(crate) const LEVEL_TABLE: [LevelDefaults; 4] = [
    LevelDefaults {
        level: OptLevel::O0,
        cast_model_type: CastType::F32,
        patch_functions: false,
        keep_batchnorm_fp32: None,
        master_weights: Some(false),
        loss_scale: LossScaleSpec::Static(1.0),
    },
    LevelDefaults {
        level: OptLevel::O1,
        cast_model_type: CastType::NoCast,
        patch_functions: true,
        keep_batchnorm_fp32: None,
        master_weights: None,
        loss_scale: LossScaleSpec::Dynamic,
    },
    LevelDefaults {
        level: OptLevel::O2,
        cast_model_type: CastType::Half,
        patch_functions: false,
        keep_batchnorm_fp32: Some(true),
        master_weights: Some(true),
        loss_scale: LossScaleSpec::Dynamic,
    },
    LevelDefaults {
        level: OptLevel::O3,
        cast_model_type: CastType::Half,
        patch_functions: false,
        keep_batchnorm_fp32: Some(false),
        master_weights: Some(false),
        loss_scale: LossScaleSpec::Static(1.0),
    },
];

/// An opt level plus overrides: what the user asks for. Build it with the setters, then
/// [`resolve`](AmpConfig::resolve) it (done by [`crate::initialize`]).
///
/// ```
/// use candle_amp as amp;
/// let props = amp::AmpConfig::new(amp::OptLevel::O2)
///     .half(amp::HalfType::Bf16)
///     .loss_scale(amp::LossScaleSpec::Dynamic)
///     .resolve()
///     .unwrap();
/// assert_eq!(props.cast_model_type, Some(candle_core::DType::BF16));
/// assert!(props.master_weights);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct AmpConfig {
    /// The level whose table row gives the defaults.
    pub opt_level: OptLevel,
    /// The half type (f16 by default).
    pub half: HalfType,
    /// Override of `cast_model_type` (`Some(None)` = do not cast).
    pub cast_model_type: Option<Option<DType>>,
    /// Override of `patch_functions`.
    pub patch_functions: Option<bool>,
    /// Override of `keep_batchnorm_fp32`.
    pub keep_batchnorm_fp32: Option<bool>,
    /// Override of `master_weights`.
    pub master_weights: Option<bool>,
    /// Override of `loss_scale`.
    pub loss_scale: Option<LossScaleSpec>,
    /// The dtype model outputs are cast to (default f32 when the model is cast).
    pub cast_model_outputs: Option<DType>,
    /// How many loss scalers (one per loss id).
    pub num_losses: usize,
    /// Floor of the dynamic scale (1.0; 0.0 reproduces PyTorch).
    pub min_loss_scale: f32,
    /// Ceiling of the dynamic scale (2^24; infinity reproduces PyTorch).
    pub max_loss_scale: f32,
    /// Dynamic scaling parameters.
    pub dynamic: DynamicParams,
    /// `false`: train exactly like plain candle (no casts, no scaling, no skipping).
    pub enabled: bool,
    /// 0 quiet, 1 print the resolved properties, 2 also log casts.
    pub verbosity: u8,
    /// Seed of the parameter store's random generator.
    pub seed: u64,
    /// Skipped steps in a row after which `step` returns [`AmpError::PersistentOverflow`].
    pub max_consecutive_skips: u32,
    /// Pretrained safetensors (f32, f16 or bf16) that [`crate::initialize`] loads after
    /// building the model.
    pub pretrained: Option<(std::path::PathBuf, LoadMode)>,
    /// Whether the CPU takes the device path (`None`: as the environment variable
    /// `CANDLE_AMP_FORCE_DEVICE_PATH` says, `1` or `true` forcing it). Off the CPU the device
    /// path is always taken: master gradients, optimizer state and overflow flags stay on
    /// the device as candle tensors, and the host reads one small vector of flags per
    /// backward, so each backward's report is the verdict ([`crate::Amp::host_syncs`] counts
    /// the reads; a step with one backward costs one). Forcing it on the CPU
    /// runs those same tensor ops there instead of the fused CPU kernels, so a machine
    /// without a GPU tests what a GPU runs (slower: it is a test switch).
    pub device_path: Option<bool>,
}

impl From<OptLevel> for AmpConfig {
    fn from(level: OptLevel) -> Self {
        AmpConfig::new(level)
    }
}

macro_rules! setter {
    ($(#[$m:meta])* $name:ident: $ty:ty => $field:ident = Some) => {
        $(#[$m])*
        pub fn $name(mut self, v: $ty) -> Self {
            self.$field = Some(v);
            self
        }
    };
    ($(#[$m:meta])* $name:ident: $ty:ty => $field:ident = |v| v) => {
        $(#[$m])*
        pub fn $name(mut self, v: $ty) -> Self {
            self.$field = v;
            self
        }
    };
}

impl AmpConfig {
    /// The level's defaults with no overrides.
    pub fn new(opt_level: OptLevel) -> Self {
        Self {
            opt_level,
            half: HalfType::F16,
            cast_model_type: None,
            patch_functions: None,
            keep_batchnorm_fp32: None,
            master_weights: None,
            loss_scale: None,
            cast_model_outputs: None,
            num_losses: 1,
            min_loss_scale: 1.0,
            max_loss_scale: 16_777_216.0,
            dynamic: DynamicParams::default(),
            enabled: true,
            verbosity: 1,
            seed: 0,
            max_consecutive_skips: 100,
            pretrained: None,
            device_path: None,
        }
    }

    /// Forces the device path on the CPU (`true`) or keeps the CPU's fused kernels
    /// (`false`) whatever `CANDLE_AMP_FORCE_DEVICE_PATH` says; see
    /// [`device_path`](Self::device_path).
    pub fn device_path(mut self, forced: bool) -> Self {
        self.device_path = Some(forced);
        self
    }

    /// Whether the CPU takes the device path: [`device_path`](Self::device_path) if set,
    /// else `CANDLE_AMP_FORCE_DEVICE_PATH` (`1` or `true`).
    pub fn forces_device_path(&self) -> bool {
        self.device_path
            .unwrap_or_else(super::cast_cache::device_path_forced_by_env)
    }

    /// Starts from pretrained weights (see [`crate::Amp::load_weights`]).
    pub fn pretrained(mut self, path: impl Into<std::path::PathBuf>, mode: LoadMode) -> Self {
        self.pretrained = Some((path.into(), mode));
        self
    }

    setter!(/// Sets the half type.
        half: HalfType => half = |v| v);
    setter!(/// Overrides `cast_model_type` (`None` = do not cast the model).
        cast_model_type: Option<DType> => cast_model_type = Some);
    setter!(/// Overrides `patch_functions` (only O1 accepts `true`).
        patch_functions: bool => patch_functions = Some);
    setter!(/// Overrides `keep_batchnorm_fp32` (O1 rejects it).
        keep_batchnorm_fp32: bool => keep_batchnorm_fp32 = Some);
    setter!(/// Overrides `master_weights` (O1 rejects it).
        master_weights: bool => master_weights = Some);
    setter!(/// Overrides `loss_scale`.
        loss_scale: LossScaleSpec => loss_scale = Some);
    setter!(/// Sets the dtype of model outputs.
        cast_model_outputs: DType => cast_model_outputs = Some);
    setter!(/// Sets the number of loss scalers.
        num_losses: usize => num_losses = |v| v);
    setter!(/// Sets the floor of the dynamic scale.
        min_loss_scale: f32 => min_loss_scale = |v| v);
    setter!(/// Sets the ceiling of the dynamic scale.
        max_loss_scale: f32 => max_loss_scale = |v| v);
    setter!(/// Sets the dynamic scaling parameters.
        dynamic: DynamicParams => dynamic = |v| v);
    setter!(/// Enables or disables AMP altogether.
        enabled: bool => enabled = |v| v);
    setter!(/// Sets the verbosity.
        verbosity: u8 => verbosity = |v| v);
    setter!(/// Sets the parameter store's seed.
        seed: u64 => seed = |v| v);
    setter!(/// Sets the skipped-steps-in-a-row limit.
        max_consecutive_skips: u32 => max_consecutive_skips = |v| v);

    fn invalid(&self, property: &'static str, reason: impl Into<String>) -> AmpError {
        AmpError::InvalidOverride {
            property,
            level: self.opt_level.name(),
            reason: reason.into(),
        }
    }

    /// Applies the overrides to the level's table row, rejecting what Apex rejects (O1 with a
    /// model cast, with `keep_batchnorm_fp32` or with `master_weights`; `patch_functions` at
    /// any level but O1) and values out of range.
    pub fn resolve(&self) -> Result<Properties> {
        let d = self.opt_level.defaults();
        let is_o1 = self.opt_level == OptLevel::O1;
        if is_o1 {
            if let Some(Some(t)) = self.cast_model_type
                && t != DType::F32
            {
                return Err(self.invalid(
                    "cast_model_type",
                    "O1 keeps the model in f32 and casts per op; use O2 or O3 to cast the model",
                ));
            }
            if self.keep_batchnorm_fp32.is_some() {
                return Err(self.invalid(
                    "keep_batchnorm_fp32",
                    "O1 does not cast the model, so batch norm already follows its input; remove the override",
                ));
            }
            if self.master_weights.is_some() {
                return Err(self.invalid(
                    "master_weights",
                    "O1 keeps f32 weights, so there are no master weights to keep; remove the override or use O2",
                ));
            }
        } else if self.patch_functions == Some(true) {
            return Err(self.invalid(
                "patch_functions",
                "per-op casting is O1's job; use O1 or drop the override",
            ));
        }
        let cast_model_type = match self.cast_model_type {
            Some(t) => t,
            None => d.cast_model_type.resolve(self.half),
        };
        if let Some(t) = cast_model_type
            && !t.is_float()
        {
            return Err(self.invalid(
                "cast_model_type",
                format!("{t:?} is not a floating type; use f32, f16 or bf16"),
            ));
        }
        if let Some(t) = self.cast_model_outputs
            && !t.is_float()
        {
            return Err(self.invalid(
                "cast_model_outputs",
                format!("{t:?} is not a floating type; use f32, f16 or bf16"),
            ));
        }
        // bf16 has f32's range: no scaling unless asked for (an explicit override wins).
        let loss_scale = match (self.loss_scale, self.half) {
            (Some(s), _) => s,
            (None, HalfType::Bf16) => LossScaleSpec::Static(1.0),
            (None, HalfType::F16) => d.loss_scale,
        };
        if let LossScaleSpec::Static(s) = loss_scale
            && !(s.is_finite() && s > 0.0)
        {
            return Err(self.invalid("loss_scale", format!("a static scale must be finite and > 0, got {s}")));
        }
        if self.num_losses == 0 {
            return Err(self.invalid("num_losses", "at least one loss scaler is needed"));
        }
        if self.min_loss_scale.is_nan()
            || self.max_loss_scale.is_nan()
            || self.min_loss_scale < 0.0
            || self.min_loss_scale > self.max_loss_scale
        {
            return Err(self.invalid(
                "min_loss_scale",
                format!(
                    "need 0 <= min_loss_scale <= max_loss_scale, got {} and {}",
                    self.min_loss_scale, self.max_loss_scale
                ),
            ));
        }
        if let Some((property, reason)) = self.dynamic.problem() {
            return Err(self.invalid(property, reason));
        }
        if self.max_consecutive_skips == 0 {
            return Err(self.invalid("max_consecutive_skips", "must be at least 1"));
        }
        if self.verbosity > 2 {
            return Err(self.invalid("verbosity", "0, 1 or 2"));
        }
        let props = if self.enabled {
            Properties {
                enabled: true,
                opt_level: self.opt_level,
                half: self.half,
                cast_model_type,
                patch_functions: self.patch_functions.unwrap_or(d.patch_functions),
                keep_batchnorm_fp32: self.keep_batchnorm_fp32.or(d.keep_batchnorm_fp32),
                master_weights: self.master_weights.or(d.master_weights).unwrap_or(false),
                loss_scale,
                cast_model_outputs: self.cast_model_outputs,
                num_losses: self.num_losses,
                min_loss_scale: self.min_loss_scale,
                max_loss_scale: self.max_loss_scale,
                dynamic: self.dynamic,
                verbosity: self.verbosity,
                seed: self.seed,
                max_consecutive_skips: self.max_consecutive_skips,
            }
        } else {
            // Disabled: plain candle. No casts, no scaling, no skipping.
            Properties {
                enabled: false,
                opt_level: self.opt_level,
                half: self.half,
                cast_model_type: None,
                patch_functions: false,
                keep_batchnorm_fp32: None,
                master_weights: false,
                loss_scale: LossScaleSpec::Static(1.0),
                cast_model_outputs: None,
                num_losses: self.num_losses,
                min_loss_scale: self.min_loss_scale,
                max_loss_scale: self.max_loss_scale,
                dynamic: self.dynamic,
                verbosity: self.verbosity,
                seed: self.seed,
                max_consecutive_skips: u32::MAX,
            }
        };
        if props.verbosity >= 1 {
            log::info!("{props}");
        }
        Ok(props)
    }
}

/// The resolved properties of a run: the level's table row with the overrides applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Properties {
    /// `false`: plain candle.
    pub enabled: bool,
    /// The level the defaults came from.
    pub opt_level: OptLevel,
    /// The half type.
    pub half: HalfType,
    /// The dtype the model's parameters are built in (`None`: as the model asks, i.e. f32).
    #[serde(with = "opt_dtype")]
    pub cast_model_type: Option<DType>,
    /// Whether ops autocast (O1).
    pub patch_functions: bool,
    /// Whether batch norm stays f32 in a half model.
    pub keep_batchnorm_fp32: Option<bool>,
    /// Whether f32 masters are kept beside half working weights.
    pub master_weights: bool,
    /// Static or dynamic scaling.
    pub loss_scale: LossScaleSpec,
    /// The dtype model outputs are cast to.
    #[serde(with = "opt_dtype")]
    pub cast_model_outputs: Option<DType>,
    /// Number of loss scalers.
    pub num_losses: usize,
    /// Floor of the dynamic scale.
    #[serde(with = "crate::serde_f32")]
    pub min_loss_scale: f32,
    /// Ceiling of the dynamic scale.
    #[serde(with = "crate::serde_f32")]
    pub max_loss_scale: f32,
    /// Dynamic scaling parameters.
    pub dynamic: DynamicParams,
    /// Verbosity.
    pub verbosity: u8,
    /// The store's seed.
    pub seed: u64,
    /// Skipped steps in a row before [`AmpError::PersistentOverflow`].
    pub max_consecutive_skips: u32,
}

impl Properties {
    /// The dtype model outputs are cast to: `cast_model_outputs`, or f32 when the model is
    /// cast, or none.
    pub fn output_dtype(&self) -> Option<DType> {
        self.cast_model_outputs.or(self.cast_model_type.map(|_| DType::F32))
    }

    /// What the parameter store builds at these properties.
    pub(crate) fn store_policy(&self) -> StorePolicy {
        StorePolicy {
            model_dtype: self.cast_model_type,
            master_weights: self.master_weights,
            keep_f32_requests: self.keep_batchnorm_fp32.unwrap_or(false),
        }
    }

    /// The loss scale each of the run's scalers starts from.
    pub(crate) fn initial_loss_scale(&self) -> LossScale {
        LossScale::from_spec(self.loss_scale, &self.dynamic, self.min_loss_scale, self.max_loss_scale)
    }

    /// The resolved properties as a small text table, as Apex prints at verbosity 1 (also
    /// the `Display` of [`Properties`]).
    fn table(&self) -> String {
        let dt = |d: Option<DType>| {
            d.map(|d| format!("{d:?}").to_lowercase())
                .unwrap_or_else(|| "none".into())
        };
        let ob = |b: Option<bool>| b.map(|b| b.to_string()).unwrap_or_else(|| "none".into());
        let rows = [
            ("opt_level", self.opt_level.to_string()),
            ("enabled", self.enabled.to_string()),
            ("half", self.half.to_string()),
            ("cast_model_type", dt(self.cast_model_type)),
            ("patch_functions", self.patch_functions.to_string()),
            ("keep_batchnorm_fp32", ob(self.keep_batchnorm_fp32)),
            ("master_weights", self.master_weights.to_string()),
            ("loss_scale", self.loss_scale.to_string()),
            ("cast_model_outputs", dt(self.output_dtype())),
            ("num_losses", self.num_losses.to_string()),
            ("min_loss_scale", self.min_loss_scale.to_string()),
            ("max_loss_scale", self.max_loss_scale.to_string()),
        ];
        let mut s = String::from("AMP properties:\n");
        for (k, v) in rows {
            s.push_str(&format!("  {k:<20} {v}\n"));
        }
        s
    }
}

impl fmt::Display for Properties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.table())
    }
}

/// serde for `Option<DType>` as a lower-case name.
mod opt_dtype {
    use candle_core::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(d: &Option<DType>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(d.as_str()),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DType>, D::Error> {
        let o: Option<String> = Option::deserialize(d)?;
        match o {
            None => Ok(None),
            Some(s) => s
                .parse::<DType>()
                .map(Some)
                .map_err(|e| serde::de::Error::custom(format!("{e}"))),
        }
    }
}
