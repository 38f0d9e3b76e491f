//! The library's typed error.
//!
//! Every error says what was wrong and what to do about it. Errors from candle itself are
//! wrapped in [`AmpError::Candle`] so that `?` works across both.

use candle_core::DType;

/// The result type of every fallible function in this crate.
pub type Result<T> = std::result::Result<T, AmpError>;

/// Everything that can go wrong in candle-amp.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// An opt-level property override that the level does not accept (Apex's rules), or a
    /// value out of range.
    #[error("invalid AMP property `{property}` at {level}: {reason}")]
    InvalidOverride {
        /// The property's name, as in the opt-level table.
        property: &'static str,
        /// The opt level it was applied to.
        level: String,
        /// Why it was rejected and what to do instead.
        reason: String,
    },

    /// A string that names no opt level, half type or loss scale.
    #[error("cannot parse {what} from {input:?}: {expected}")]
    Parse {
        /// What was being parsed ("opt level", "half type", "loss scale").
        what: &'static str,
        /// The text that was given.
        input: String,
        /// What would have been accepted.
        expected: &'static str,
    },

    /// The guard and optimizer were called in an order that would corrupt training.
    #[error("wrong call order: {0}")]
    CallOrder(String),

    /// A loss id outside `0..num_losses`.
    #[error(
        "loss id {id} is out of range: this AMP handle has {num_losses} loss scaler(s); pass `num_losses` to the config to get more"
    )]
    LossId {
        /// The id that was asked for.
        id: usize,
        /// How many scalers exist.
        num_losses: usize,
    },

    /// Gradients have been non-finite for `skips` optimizer steps in a row: training is not
    /// making progress and the loss scale cannot fix it.
    #[error(
        "gradients were non-finite for {skips} consecutive steps (loss scaler {loss_id}, loss scale {scale}); \
         non-finite gradients in: {params}. The forward pass or the loss itself produces inf/NaN: check the \
         inputs, lower the learning rate, or run at O0 to find the op that overflows"
    )]
    PersistentOverflow {
        /// The scaler that kept skipping.
        loss_id: usize,
        /// How many steps in a row were skipped.
        skips: u32,
        /// The scale at the last skip.
        scale: f32,
        /// Comma-separated names of the parameters whose gradients were non-finite at the last
        /// step (`"<loss>"` when the loss itself was non-finite).
        params: String,
    },

    /// A parameter was requested twice with different shapes, or a name is unknown.
    #[error("parameter `{name}`: {reason}")]
    Parameter {
        /// The dotted parameter name.
        name: String,
        /// What was wrong.
        reason: String,
    },

    /// Two optimizers of one run claim the same trainable parameter (each would update it).
    #[error("parameter `{param}` belongs to two optimizers: {detail}")]
    Ownership {
        /// The parameter both claim.
        param: String,
        /// Which optimizer owns it and what to do.
        detail: String,
    },

    /// A tensor had a dtype that the operation cannot take.
    #[error("unsupported dtype {dtype:?} for {op}: {hint}")]
    DType {
        /// The offending dtype.
        dtype: DType,
        /// The operation.
        op: &'static str,
        /// What to do instead.
        hint: &'static str,
    },

    /// Optimizer state that does not fit the optimizer it is loaded into.
    #[error("optimizer state: {0}")]
    OptimizerState(String),

    /// A checkpoint or weights file that cannot be used. Nothing was changed, on disk or in
    /// memory.
    #[error("checkpoint {path}: {kind}: {detail}")]
    Checkpoint {
        /// The file or directory.
        path: String,
        /// What kind of problem.
        kind: CheckpointErrorKind,
        /// The details and what to do.
        detail: String,
    },

    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Kinds of [`AmpError::Checkpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CheckpointErrorKind {
    /// No checkpoint exists there.
    NotFound,
    /// A file the manifest lists is missing.
    MissingFile,
    /// A file is shorter than the manifest says.
    Truncated,
    /// A checksum does not match, or a file cannot be parsed.
    Corrupt,
    /// Written by a newer format version than this build reads.
    NewerFormat,
    /// From a different model (names, shapes), another optimizer or scaler setup.
    Mismatch,
    /// The file system failed.
    Io,
}

impl std::fmt::Display for CheckpointErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            CheckpointErrorKind::NotFound => "not found",
            CheckpointErrorKind::MissingFile => "missing file",
            CheckpointErrorKind::Truncated => "truncated",
            CheckpointErrorKind::Corrupt => "corrupt",
            CheckpointErrorKind::NewerFormat => "newer format",
            CheckpointErrorKind::Mismatch => "does not match",
            CheckpointErrorKind::Io => "i/o error",
        };
        f.write_str(s)
    }
}

impl AmpError {
    /// A checkpoint error.
    pub fn checkpoint(path: impl AsRef<std::path::Path>, kind: CheckpointErrorKind, detail: impl Into<String>) -> Self {
        AmpError::Checkpoint {
            path: path.as_ref().display().to_string(),
            kind,
            detail: detail.into(),
        }
    }

    /// An I/O error as a checkpoint error (`NotFound` when the file is missing).
    pub fn io(path: impl AsRef<std::path::Path>, e: std::io::Error) -> Self {
        let kind = if e.kind() == std::io::ErrorKind::NotFound {
            CheckpointErrorKind::NotFound
        } else {
            CheckpointErrorKind::Io
        };
        Self::checkpoint(path, kind, e.to_string())
    }

    /// The checkpoint error kind, if this is one.
    pub fn checkpoint_kind(&self) -> Option<CheckpointErrorKind> {
        match self {
            AmpError::Checkpoint { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

impl From<AmpError> for candle_core::Error {
    fn from(e: AmpError) -> Self {
        match e {
            AmpError::Candle(c) => c,
            other => candle_core::Error::wrap(other),
        }
    }
}
