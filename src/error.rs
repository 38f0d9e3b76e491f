//! The library's typed error.
//!
//! Every error says what was wrong and what to do about it. Errors from candle itself are
//! wrapped in [`AmpError::Candle`] so that `?` works across both.
//!
//! Our errors also travel through candle: a custom op, a `Module`, or the parameter store
//! behind a `VarBuilder` must return `candle_core::Error`. Such an `AmpError` is carried
//! inside the candle error (boxed as a `std::error::Error`, which can be downcast, in
//! candle's `WrappedContext` variant), and converting the candle error back into an
//! `AmpError` returns the original variant, through any backtrace, context or path candle
//! wrapped around it (their text is prefixed to the variant's detail where it has one).

/// The result type of every fallible function in this crate.
pub type Result<T> = std::result::Result<T, AmpError>;

/// Everything that can go wrong in candle-amp.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// An [`crate::AmpConfig`] property that the level does not accept (Apex's rules), or a
    /// property value out of range.
    #[error("invalid AMP property `{property}` at {level}: {reason}")]
    InvalidOverride {
        /// The property's name, as in the opt-level table.
        property: &'static str,
        /// The opt level it was applied to (`"O0"`..`"O3"`).
        level: &'static str,
        /// Why it was rejected and what to do instead.
        reason: String,
    },

    /// An argument out of range: a `GradScaler` or loss-scale parameter, a clipping norm, a
    /// new scale.
    #[error("invalid argument `{argument}`: {reason}")]
    InvalidArgument {
        /// The argument's name.
        argument: &'static str,
        /// What is required.
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

    /// The guard, an optimizer or a `GradScaler` was called in an order that would corrupt
    /// training. Nothing was changed.
    #[error("wrong call order: {call}: {detail}")]
    CallOrder {
        /// The call that was refused (`"step"`, `"scale_loss"`, `"unscale"`, ...).
        call: &'static str,
        /// What state made it wrong.
        kind: CallOrderKind,
        /// The state and what to call first.
        detail: String,
    },

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
         inputs, lower the learning rate, or run at O0 to find the op that overflows (a model ported from \
         candle-transformers: an f32::MIN or -inf mask in half is the usual cause, see docs/porting.md)"
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

    /// An optimizer parameter group that does not exist, or a group setting out of range.
    #[error("parameter group {group}: {reason}")]
    Group {
        /// The group's index.
        group: usize,
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

    /// Data-parallel training failed on this rank: the ranks disagree (model, opt level,
    /// buffer lengths), another rank never answered, or the backend failed. Every rank of the
    /// group gets an error; none is left waiting.
    #[error("data parallel, rank {rank}: {kind}: {detail}")]
    Distributed {
        /// The rank that reports it.
        rank: usize,
        /// What kind of problem.
        kind: DistErrorKind,
        /// The details and what to do.
        detail: String,
    },

    /// An error from candle. (An `AmpError` that travelled through candle comes back as
    /// itself, never as this.)
    #[error(transparent)]
    Candle(candle_core::Error),
}

/// Kinds of [`AmpError::Distributed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DistErrorKind {
    /// The ranks disagree: parameter names or shapes, opt level, half type, or the
    /// collective or buffer length they called with.
    Mismatch,
    /// Another rank did not reach a collective within the timeout (it failed or stopped).
    Timeout,
    /// The communication backend failed (or the group failed earlier).
    Backend,
    /// Another rank of a `LocalGroup` panicked before a collective it was part of: the
    /// collective can never complete, so it fails at once instead of waiting out the
    /// timeout.
    PeerFailed,
    /// The program was not started by a launcher (`mpirun`).
    NotLaunched,
    /// The call needs the whole f32 master weights or optimizer state, which a rank of a
    /// ZeRO-sharded run holds only a shard of.
    Sharded,
    /// A sharded step failed after this rank had written some of the other ranks' updated
    /// weights (a rank stopped between two rounds of the all-gather): the ranks' states no
    /// longer belong to one step, so the run refuses every later step, clip, unscale, loss
    /// scaling and save with this kind. Resume from the last checkpoint in a new run.
    Diverged,
}

impl std::fmt::Display for DistErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DistErrorKind::Mismatch => "ranks disagree",
            DistErrorKind::Timeout => "timed out",
            DistErrorKind::Backend => "backend error",
            DistErrorKind::PeerFailed => "another rank panicked",
            DistErrorKind::NotLaunched => "not launched",
            DistErrorKind::Sharded => "state is sharded",
            DistErrorKind::Diverged => "ranks diverged; resume from the last checkpoint",
        })
    }
}

/// What made a call out of order ([`AmpError::CallOrder`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallOrderKind {
    /// `step` with no backward since the last `zero_grad` (or ever).
    NoGradients,
    /// `step` again before `zero_grad` and a new backward.
    AlreadyStepped,
    /// A backward (or `GradScaler` call) after `step` without `zero_grad` in between: the new
    /// gradients would be added to the ones already applied.
    NotZeroed,
    /// An optimizer used with an AMP handle that did not make it.
    ForeignOptimizer,
    /// `GradScaler`: `unscale` or `accumulate` after `unscale` on this optimizer before
    /// `update`.
    AlreadyUnscaled,
    /// `GradScaler`: `update` with no inf check recorded since the last one.
    NothingRecorded,
    /// A backward after the step's gradients were already averaged across processes (by
    /// `clip_grad_norm` or `GradScaler::unscale` under data parallel): step first.
    AlreadyReduced,
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
    /// Written by an older format version that this build no longer reads (version 1 kept
    /// optimizer state in JSON).
    OldFormat,
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
            CheckpointErrorKind::OldFormat => "older format",
            CheckpointErrorKind::Mismatch => "does not match",
            CheckpointErrorKind::Io => "i/o error",
        };
        f.write_str(s)
    }
}

impl AmpError {
    /// A call-order error.
    pub(crate) fn call_order(call: &'static str, kind: CallOrderKind, detail: impl Into<String>) -> Self {
        AmpError::CallOrder {
            call,
            kind,
            detail: detail.into(),
        }
    }

    /// A checkpoint error.
    pub(crate) fn checkpoint(
        path: impl AsRef<std::path::Path>,
        kind: CheckpointErrorKind,
        detail: impl Into<String>,
    ) -> Self {
        AmpError::Checkpoint {
            path: path.as_ref().display().to_string(),
            kind,
            detail: detail.into(),
        }
    }

    /// An I/O error as a checkpoint error (`NotFound` when the file is missing).
    pub(crate) fn io(path: impl AsRef<std::path::Path>, e: std::io::Error) -> Self {
        let kind = if e.kind() == std::io::ErrorKind::NotFound {
            CheckpointErrorKind::NotFound
        } else {
            CheckpointErrorKind::Io
        };
        Self::checkpoint(path, kind, e.to_string())
    }

    /// The call-order kind, if this is a call-order error.
    pub fn call_order_kind(&self) -> Option<CallOrderKind> {
        match self {
            AmpError::CallOrder { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// The checkpoint error kind, if this is one.
    pub fn checkpoint_kind(&self) -> Option<CheckpointErrorKind> {
        match self {
            AmpError::Checkpoint { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// The context string that marks a candle error made from an `AmpError` by
/// `From<AmpError> for candle_core::Error` (no other context to add on the way back).
const CARRIED: &str = "raised by candle-amp";

/// An `AmpError` inside a candle error. candle's `Wrapped` variant boxes a `dyn Display`,
/// which cannot be downcast; `WrappedContext` boxes a `dyn Error`, which can. candle shows
/// that box with `{:?}`, hence a `Debug` that reads like the message.
struct Carried(AmpError);

impl std::fmt::Debug for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::fmt::Display for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for Carried {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl AmpError {
    /// Prefixes `context` to the free-text detail of the variants that have one; the others
    /// are returned unchanged (their fields are all structured).
    fn with_context(mut self, context: &str) -> Self {
        let text = match &mut self {
            AmpError::InvalidOverride { reason, .. }
            | AmpError::InvalidArgument { reason, .. }
            | AmpError::Parameter { reason, .. }
            | AmpError::Group { reason, .. } => reason,
            AmpError::CallOrder { detail, .. }
            | AmpError::Ownership { detail, .. }
            | AmpError::Checkpoint { detail, .. }
            | AmpError::Distributed { detail, .. } => detail,
            AmpError::OptimizerState(detail) => detail,
            _ => return self,
        };
        *text = format!("{context}: {text}");
        self
    }
}

/// Whether a candle error carries an `AmpError`, under any of candle's wrappers.
fn carries_ours(e: &candle_core::Error) -> bool {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => carries_ours(inner),
        E::WrappedContext { wrapped, .. } => wrapped.is::<Carried>() || wrapped.is::<AmpError>(),
        _ => false,
    }
}

/// The `AmpError` a candle error carries, with the context candle added around it; the
/// candle error itself, untouched, when it carries none.
fn take_ours(e: candle_core::Error) -> std::result::Result<AmpError, candle_core::Error> {
    use candle_core::Error as E;
    if !carries_ours(&e) {
        return Err(e);
    }
    match e {
        E::WithBacktrace { inner, .. } => take_ours(*inner),
        E::Context { inner, context } => take_ours(*inner).map(|a| a.with_context(&context.to_string())),
        E::WithPath { inner, path } => take_ours(*inner).map(|a| a.with_context(&path.display().to_string())),
        E::WrappedContext { wrapped, context } => {
            let ours = match wrapped.downcast::<Carried>() {
                Ok(c) => c.0,
                // `carries_ours` checked: it is one or the other.
                Err(other) => *other.downcast::<AmpError>().map_err(|w| E::WrappedContext {
                    wrapped: w,
                    context: context.clone(),
                })?,
            };
            Ok(if context == CARRIED {
                ours
            } else {
                ours.with_context(&context)
            })
        }
        other => Err(other),
    }
}

impl From<candle_core::Error> for AmpError {
    /// An `AmpError` that travelled through candle comes back as itself (see the module
    /// documentation); any other candle error becomes [`AmpError::Candle`].
    fn from(e: candle_core::Error) -> Self {
        take_ours(e).unwrap_or_else(AmpError::Candle)
    }
}

impl From<AmpError> for candle_core::Error {
    /// Carries the error through candle so that converting back gives the same variant; a
    /// candle error we wrapped is handed back as it was.
    fn from(e: AmpError) -> Self {
        match e {
            AmpError::Candle(c) => c,
            other => candle_core::Error::WrappedContext {
                wrapped: Box::new(Carried(other)),
                context: CARRIED.into(),
            }
            .bt(),
        }
    }
}
