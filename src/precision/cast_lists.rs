//! Apex's cast lists, as data: which ops run in half, which in f32, which promote mixed
//! arguments, which are refused on half input. [`crate::autocast`] consults them; a run can
//! register more names or override these (`Amp::register_op`).

/// How an op's floating arguments are cast under autocast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CastPolicy {
    /// Run in the half type (matmul, convolutions, linear).
    Half,
    /// Run in f32 (pointwise ops that overflow in half, reductions, norms, softmax, losses).
    Float,
    /// Mixed half and f32 arguments all run in the widest type.
    Promote,
    /// Refused on half input; the message says what to use instead.
    Banned(&'static str),
}

const BCE_BANNED: &str = "binary_cross_entropy on half-precision probabilities is unsafe (the sigmoid before it \
saturates in half); use candle_amp::ops::binary_cross_entropy_with_logits on the logits instead";

/// Apex's cast lists, as data: op name and policy. Ops not listed run in their input's type
/// (relu, batch norm, embedding, reshapes, ...).
pub const CAST_LISTS: &[(&str, CastPolicy)] = &[
    // Half: the ops tensor cores are for.
    ("matmul", CastPolicy::Half),
    ("bmm", CastPolicy::Half),
    ("linear", CastPolicy::Half),
    ("conv1d", CastPolicy::Half),
    ("conv2d", CastPolicy::Half),
    ("conv_transpose1d", CastPolicy::Half),
    ("conv_transpose2d", CastPolicy::Half),
    ("prelu", CastPolicy::Half),
    // Float: overflow-prone pointwise ops, reductions, normalisation, softmax, losses.
    ("exp", CastPolicy::Float),
    ("log", CastPolicy::Float),
    ("pow", CastPolicy::Float),
    ("reciprocal", CastPolicy::Float),
    ("rsqrt", CastPolicy::Float),
    ("sum", CastPolicy::Float),
    ("mean", CastPolicy::Float),
    ("var", CastPolicy::Float),
    ("norm", CastPolicy::Float),
    ("cumsum", CastPolicy::Float),
    ("softmax", CastPolicy::Float),
    ("log_softmax", CastPolicy::Float),
    ("gelu", CastPolicy::Float),
    ("layer_norm", CastPolicy::Float),
    ("group_norm", CastPolicy::Float),
    ("rms_norm", CastPolicy::Float),
    ("cross_entropy", CastPolicy::Float),
    ("nll", CastPolicy::Float),
    ("mse", CastPolicy::Float),
    ("l1", CastPolicy::Float),
    ("smooth_l1", CastPolicy::Float),
    ("kl_div", CastPolicy::Float),
    ("binary_cross_entropy_with_logits", CastPolicy::Float),
    // Promote: mixed arguments run in the widest type.
    ("add", CastPolicy::Promote),
    ("sub", CastPolicy::Promote),
    ("mul", CastPolicy::Promote),
    ("div", CastPolicy::Promote),
    ("eq", CastPolicy::Promote),
    ("ne", CastPolicy::Promote),
    ("lt", CastPolicy::Promote),
    ("le", CastPolicy::Promote),
    ("gt", CastPolicy::Promote),
    ("ge", CastPolicy::Promote),
    ("where", CastPolicy::Promote),
    ("cat", CastPolicy::Promote),
    ("stack", CastPolicy::Promote),
    // Banned.
    ("binary_cross_entropy", CastPolicy::Banned(BCE_BANNED)),
];

/// The built-in policy of an op name, if it is on a list.
pub(crate) fn builtin_policy(op: &str) -> Option<CastPolicy> {
    CAST_LISTS.iter().find(|(n, _)| *n == op).map(|(_, p)| *p)
}
