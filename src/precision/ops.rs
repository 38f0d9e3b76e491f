//! Tensor operations that consult the autocast policy ([`crate::autocast`]).
//!
//! Under an enabled policy each function casts its floating arguments as its op name's
//! [`CastPolicy`] says (Apex's lists, [`crate::autocast::CAST_LISTS`]);
//! integer and f64 tensors are never cast; ops on no list run in their input's type.
//! Without a policy they behave like the candle op, except that reductions, normalisation
//! and softmax always accumulate in f32 (and return their input's type), losses always
//! return f32, and the binary ops, comparisons and joins promote operands of two float types
//! to f32 (PyTorch's type promotion; candle would refuse them).
//!
//! Raw tensor methods (`a.matmul(&b)`, `+`, `exp()`) cannot be intercepted: a model moves to
//! O1 by writing its maths with these functions and its layers with [`crate::nn`].

pub use candle_core::op::CmpOp;
use candle_core::{D, DType, Device, Result, Tensor};

use super::autocast::{self, CastPolicy, eligible};
use super::empty;
use super::observe::op as rec;
use crate::kernels;

fn widest(xs: &[&Tensor]) -> Option<DType> {
    let floats: Vec<DType> = xs.iter().map(|t| t.dtype()).filter(|d| eligible(*d)).collect();
    let first = *floats.first()?;
    if floats.iter().all(|d| *d == first) {
        return Some(first);
    }
    Some(DType::F32)
}

/// Casts `xs` for op `op` under the current policy; returns the tensors and whether an
/// enabled policy applied a Float policy (so outputs stay f32).
pub(super) fn prepare(op: &str, xs: &[&Tensor]) -> Result<(Vec<Tensor>, bool)> {
    let Some((ctx, force_f32)) = autocast::active_forced() else {
        return Ok((xs.iter().map(|t| (*t).clone()).collect(), false));
    };
    let policy = match ctx.policy(op) {
        // A layer kept in f32: what would run in half or promote runs in f32.
        Some(CastPolicy::Half | CastPolicy::Promote) if force_f32 => Some(CastPolicy::Float),
        p => p,
    };
    match policy {
        None => Ok((xs.iter().map(|t| (*t).clone()).collect(), false)),
        Some(CastPolicy::Half) => {
            ctx.note_half();
            Ok((
                xs.iter().map(|t| ctx.cast(t, ctx.half())).collect::<Result<_>>()?,
                false,
            ))
        }
        Some(CastPolicy::Float) => Ok((xs.iter().map(|t| ctx.cast(t, DType::F32)).collect::<Result<_>>()?, true)),
        Some(CastPolicy::Promote) => {
            let to = widest(xs);
            let out = xs
                .iter()
                .map(|t| match to {
                    Some(to) => ctx.cast(t, to),
                    None => Ok((*t).clone()),
                })
                .collect::<Result<_>>()?;
            Ok((out, false))
        }
        Some(CastPolicy::Banned(msg)) => {
            if xs.iter().any(|t| matches!(t.dtype(), DType::F16 | DType::BF16)) {
                return Err(candle_core::Error::Msg(format!("autocast refused `{op}`: {msg}")));
            }
            Ok((xs.iter().map(|t| ctx.cast(t, DType::F32)).collect::<Result<_>>()?, true))
        }
    }
}

/// Runs a user function under the policy registered for `name` (see
/// [`crate::Amp::register_op`]); unregistered names run unchanged.
pub fn call(name: &str, xs: &[&Tensor], f: impl FnOnce(&[Tensor]) -> Result<Tensor>) -> Result<Tensor> {
    if let Some(dev) = empty::applies(xs) {
        let host = empty::to_host(xs)?;
        let refs: Vec<&Tensor> = host.iter().collect();
        let _inside = empty::Inside::enter();
        return call(name, &refs, f)?.to_device(&dev);
    }
    let (xs, _) = prepare(name, xs)?;
    rec(name, f(&xs))
}

fn to_f32(t: &Tensor) -> Result<Tensor> {
    if eligible(t.dtype()) {
        kernels::cast(t, DType::F32)
    } else {
        Ok(t.clone())
    }
}

/// The result of an op computed in f32: kept in f32 under an autocast Float policy (`on`),
/// else returned in the input's type `orig` (f64 and integers were never cast).
fn back_to(y: Tensor, orig: DType, on: bool) -> Result<Tensor> {
    if on || !eligible(orig) {
        Ok(y)
    } else {
        kernels::cast(&y, orig)
    }
}

/// A Float-list op: computes `f` in f32; the result is f32 under autocast, else `orig`'s type.
fn float_op(op: &str, x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let orig = x.dtype();
    let (xs, on) = prepare(op, &[x])?;
    let y = f(&to_f32(&xs[0])?)?;
    rec(op, back_to(y, orig, on))
}

/// A Float-list pointwise op: in f32 under autocast, in the input's type otherwise.
fn pointwise_op(op: &str, x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let (xs, _) = prepare(op, &[x])?;
    rec(op, f(&xs[0]))
}

fn promote2(op: &str, a: &Tensor, b: &Tensor, f: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let (xs, _) = prepare(op, &[a, b])?;
    let xs = promoted(xs)?;
    rec(op, f(&xs[0], &xs[1]))
}

/// `xs` in f32 where they are of several float types; as they are otherwise. PyTorch's type
/// promotion, with or without a policy (f16 with bf16 meets in f32 too), so an f32 table
/// times a half activation keeps its precision.
fn promoted(xs: Vec<Tensor>) -> Result<Vec<Tensor>> {
    let mixed = xs.windows(2).any(|w| w[0].dtype() != w[1].dtype());
    if mixed && xs.iter().all(|t| eligible(t.dtype())) {
        return xs.iter().map(|t| kernels::cast(t, DType::F32)).collect();
    }
    Ok(xs)
}

/// The one type [`prepare`] would give operands of types `dts` for `op`, without casting
/// them (for kernels that cast as they read, `kernels::cuda::rows`): `None` where it would
/// cast them to half (the Half list, which notes its use) or refuse them, or where one is not
/// f32, f16 or bf16. Mixed float types give f32, as `promoted` casts them.
pub(super) fn prepared_type(op: &str, dts: &[DType]) -> Option<DType> {
    let first = *dts.first()?;
    if !dts.iter().all(|d| eligible(*d)) {
        return None;
    }
    let same = dts.iter().all(|d| *d == first).then_some(first);
    // Mixed float types promote to f32 (see `promoted`).
    let promoted = Some(same.unwrap_or(DType::F32));
    let Some((ctx, force_f32)) = autocast::active_forced() else {
        return promoted;
    };
    match ctx.policy(op) {
        None => promoted,
        // A layer kept in f32 computes Half and Promote ops in f32 too (see `prepare`).
        Some(CastPolicy::Float) => Some(DType::F32),
        Some(CastPolicy::Half | CastPolicy::Promote) if force_f32 => Some(DType::F32),
        Some(CastPolicy::Promote) => Some(same.unwrap_or(DType::F32)),
        Some(CastPolicy::Half | CastPolicy::Banned(_)) => None,
    }
}

// ---------------------------------------------------------------- half list

/// Matrix product (batched and broadcast like `Tensor::broadcast_matmul`), in half, through
/// [`kernels::matmul`] (f32 accumulation; batch entries in parallel). In bf16 on the AMX and
/// AVX-512 BF16 tiers, subnormals are flushed to zero
/// ([`kernels::bf16_products_flush_subnormals`]).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| matmul(&x[0], &x[1])) {
        return r;
    }
    let (xs, _) = prepare("matmul", &[a, b])?;
    rec("matmul", kernels::matmul(&xs[0], &xs[1]))
}

/// Batched matrix product (`(b, n, k) x (b, k, m)`), in half.
pub fn bmm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| bmm(&x[0], &x[1])) {
        return r;
    }
    let (xs, _) = prepare("bmm", &[a, b])?;
    rec("bmm", kernels::matmul(&xs[0], &xs[1]))
}

/// `x w^T + b` for `x` of any rank (as candle-nn's `Linear`), in half, as one fused op
/// ([`kernels::linear`]: one product each for the output and the two gradients, the bias
/// added and its gradient summed in f32). In bf16 on the AMX and AVX-512 BF16 tiers,
/// subnormals are flushed to zero ([`kernels::bf16_products_flush_subnormals`]).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x, w], &[b], |t, o| linear(&t[0], &t[1], o[0].as_ref())) {
        return r;
    }
    let mut args = vec![x, w];
    if let Some(b) = b {
        args.push(b);
    }
    let (xs, _) = prepare("linear", &args)?;
    rec("linear", kernels::linear(&xs[0], &xs[1], xs.get(2)))
}

/// candle's CPU backend has no bf16 convolution (its conv2d calls an f32/f16-only gemm), and
/// its f16 one (and the f16 backward's convolutions) runs f16 dot products value by value:
/// a ViT's patch embedding at O2 f16 took a fifth of the step on Zen 4, and made the half
/// level slower than O0. On the CPU both half types run the convolution in f32 (the products
/// exact, the sums in f32) and round the result once to the half type, as the bf16 one
/// always did. Casts are differentiable, so gradients flow.
fn conv_in_supported_dtype(
    x: &Tensor,
    w: &Tensor,
    f: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let half = x.dtype();
    if matches!(half, DType::BF16 | DType::F16) && matches!(x.device(), Device::Cpu) {
        f(&x.to_dtype(DType::F32)?, &w.to_dtype(DType::F32)?)?.to_dtype(half)
    } else {
        f(x, w)
    }
}

fn add_channel_bias(y: Tensor, b: Option<&Tensor>, rank: usize) -> Result<Tensor> {
    match b {
        None => Ok(y),
        Some(b) => {
            let mut shape = vec![1usize; rank];
            shape[1] = b.dims1()?;
            y.broadcast_add(&b.reshape(shape)?)
        }
    }
}

fn with_bias<'a>(x: &'a Tensor, w: &'a Tensor, b: Option<&'a Tensor>) -> Vec<&'a Tensor> {
    let mut v = vec![x, w];
    if let Some(b) = b {
        v.push(b);
    }
    v
}

/// 1-d convolution, in half. Computed as a 2-d convolution over a height of 1: candle
/// 0.11's own conv1d returns wrong kernel gradients (checked against finite differences in
/// `tests/layers.rs`).
pub fn conv1d(x: &Tensor, w: &Tensor, b: Option<&Tensor>, cfg: candle_nn::Conv1dConfig) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x, w], &[b], |t, o| conv1d(&t[0], &t[1], o[0].as_ref(), cfg)) {
        return r;
    }
    let (xs, _) = prepare("conv1d", &with_bias(x, w, b))?;
    let y = conv_in_supported_dtype(&xs[0], &xs[1], |x, w| {
        let x = x.unsqueeze(2)?.pad_with_zeros(3, cfg.padding, cfg.padding)?;
        x.conv2d(&w.unsqueeze(2)?, 0, cfg.stride, cfg.dilation, cfg.groups)?
            .squeeze(2)
    })?;
    rec("conv1d", add_channel_bias(y, xs.get(2), 3))
}

/// 2-d convolution, in half (bf16 on CPU computes in f32, see the module notes).
pub fn conv2d(x: &Tensor, w: &Tensor, b: Option<&Tensor>, cfg: candle_nn::Conv2dConfig) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x, w], &[b], |t, o| conv2d(&t[0], &t[1], o[0].as_ref(), cfg)) {
        return r;
    }
    let (xs, _) = prepare("conv2d", &with_bias(x, w, b))?;
    let y = conv_in_supported_dtype(&xs[0], &xs[1], |x, w| {
        x.conv2d(w, cfg.padding, cfg.stride, cfg.dilation, cfg.groups)
    })?;
    rec("conv2d", add_channel_bias(y, xs.get(2), 4))
}

/// 1-d transposed convolution, in half.
pub fn conv_transpose1d(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    cfg: candle_nn::ConvTranspose1dConfig,
) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x, w], &[b], |t, o| conv_transpose1d(&t[0], &t[1], o[0].as_ref(), cfg)) {
        return r;
    }
    let (xs, _) = prepare("conv_transpose1d", &with_bias(x, w, b))?;
    let y = conv_in_supported_dtype(&xs[0], &xs[1], |x, w| {
        x.conv_transpose1d(w, cfg.padding, cfg.output_padding, cfg.stride, cfg.dilation, cfg.groups)
    })?;
    rec("conv_transpose1d", add_channel_bias(y, xs.get(2), 3))
}

/// 2-d transposed convolution, in half.
pub fn conv_transpose2d(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    cfg: candle_nn::ConvTranspose2dConfig,
) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x, w], &[b], |t, o| conv_transpose2d(&t[0], &t[1], o[0].as_ref(), cfg)) {
        return r;
    }
    let (xs, _) = prepare("conv_transpose2d", &with_bias(x, w, b))?;
    let y = conv_in_supported_dtype(&xs[0], &xs[1], |x, w| {
        x.conv_transpose2d(w, cfg.padding, cfg.output_padding, cfg.stride, cfg.dilation)
    })?;
    rec("conv_transpose2d", add_channel_bias(y, xs.get(2), 4))
}

/// PReLU with one slope per channel (dimension 1) or a single slope, in half.
pub fn prelu(x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x, alpha], |x| prelu(&x[0], &x[1])) {
        return r;
    }
    let (xs, _) = prepare("prelu", &[x, alpha])?;
    let (x, a) = (&xs[0], &xs[1]);
    let a = if a.elem_count() == 1 || x.rank() < 2 {
        a.clone()
    } else {
        let mut shape = vec![1usize; x.rank()];
        shape[1] = a.elem_count();
        a.reshape(shape)?
    };
    let neg = x.minimum(0.0)?.broadcast_mul(&a)?;
    rec("prelu", x.relu()? + neg)
}

// ---------------------------------------------------------------- float list

/// `exp`, in f32 under autocast.
pub fn exp(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| exp(&x[0])) {
        return r;
    }
    pointwise_op("exp", x, |x| x.exp())
}

/// Natural logarithm, in f32 under autocast.
pub fn log(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| log(&x[0])) {
        return r;
    }
    pointwise_op("log", x, |x| x.log())
}

/// `x^e`, in f32 under autocast.
pub fn pow(x: &Tensor, e: f64) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| pow(&x[0], e)) {
        return r;
    }
    pointwise_op("pow", x, |x| x.powf(e))
}

/// `1/x`, in f32 under autocast.
pub fn reciprocal(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| reciprocal(&x[0])) {
        return r;
    }
    pointwise_op("reciprocal", x, |x| x.recip())
}

/// `1/sqrt(x)`, in f32 under autocast.
pub fn rsqrt(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| rsqrt(&x[0])) {
        return r;
    }
    pointwise_op("rsqrt", x, |x| x.sqrt()?.recip())
}

/// ReLU, in its input's type (on no cast list), as one op with a one-pass backward
/// ([`kernels::relu`]). Its gradient at `x == 0` is 0, as PyTorch's (candle's `relu`
/// passes it).
pub fn relu(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| relu(&x[0])) {
        return r;
    }
    kernels::relu(x)
}

/// GELU (erf form), in f32 under autocast.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| gelu(&x[0])) {
        return r;
    }
    pointwise_op("gelu", x, kernels::gelu)
}

/// GELU in the tanh form (PyTorch's `gelu(x, approximate="tanh")`, candle's `gelu`), in f32
/// under autocast (the policy of `"gelu"`, as PyTorch's autocast, which has one op for both
/// forms). One op with a one-pass backward ([`kernels::gelu_tanh`]).
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| gelu_tanh(&x[0])) {
        return r;
    }
    pointwise_op("gelu", x, kernels::gelu_tanh)
}

/// SiLU (swish) `x * sigmoid(x)`, in its input's type: on no cast list, as in PyTorch's
/// autocast (a policy registered for `"silu"` applies). One op with a one-pass backward
/// ([`kernels::silu`]).
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| silu(&x[0])) {
        return r;
    }
    pointwise_op("silu", x, kernels::silu)
}

/// Sum over `dim`, kept; accumulated in f32.
pub fn sum_keepdim(x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| sum_keepdim(&x[0], dim)) {
        return r;
    }
    float_op("sum", x, |x| x.sum_keepdim(dim))
}

/// Sum of all elements; accumulated in f32.
pub fn sum_all(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| sum_all(&x[0])) {
        return r;
    }
    float_op("sum", x, |x| x.sum_all())
}

/// Mean over `dim`, kept; accumulated in f32.
pub fn mean_keepdim(x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| mean_keepdim(&x[0], dim)) {
        return r;
    }
    float_op("mean", x, |x| x.mean_keepdim(dim))
}

/// Mean of all elements; accumulated in f32.
pub fn mean_all(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| mean_all(&x[0])) {
        return r;
    }
    float_op("mean", x, |x| x.mean_all())
}

/// Unbiased variance over `dim`, kept; accumulated in f32. Over fewer than two elements it
/// is NaN, as in PyTorch (candle's own `var_keepdim` panics on an empty dim).
pub fn var_keepdim(x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| var_keepdim(&x[0], dim)) {
        return r;
    }
    float_op("var", x, |x| {
        if x.dim(dim)? > 0 {
            return x.var_keepdim(dim);
        }
        let mut dims = x.dims().to_vec();
        dims[dim] = 1;
        Tensor::full(f32::NAN, dims, x.device())?.to_dtype(x.dtype())
    })
}

/// The L2 norm of all elements; accumulated in f32.
pub fn norm(x: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| norm(&x[0])) {
        return r;
    }
    float_op("norm", x, |x| x.sqr()?.sum_all()?.sqrt())
}

/// Cumulative sum over `dim`; accumulated in f32.
pub fn cumsum(x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| cumsum(&x[0], dim)) {
        return r;
    }
    float_op("cumsum", x, |x| x.cumsum(dim))
}

fn softmax_f32(x: &Tensor, dim: usize) -> Result<Tensor> {
    // An empty tensor's softmax is empty (PyTorch's; candle's reduce fails).
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    // On CUDA over the last dimension: the fused kernel (one pass each way) where it loads.
    if x.device().is_cuda() && dim + 1 == x.rank() {
        return kernels::scaled_softmax(x, 1.0, false, x.dtype());
    }
    let m = x.max_keepdim(dim)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(dim)?)
}

fn log_softmax_f32(x: &Tensor, dim: usize) -> Result<Tensor> {
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    let m = x.max_keepdim(dim)?.detach();
    let shifted = x.broadcast_sub(&m)?;
    shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(dim)?.log()?)
}

/// Softmax over `dim`, differentiable, accumulated in f32 (candle's fused
/// `softmax_last_dim` has no backward).
pub fn softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| softmax(&x[0], dim)) {
        return r;
    }
    float_op("softmax", x, |x| softmax_f32(x, dim))
}

/// Log-softmax over `dim`, differentiable, in f32.
pub fn log_softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[x], |x| log_softmax(&x[0], dim)) {
        return r;
    }
    float_op("log_softmax", x, |x| log_softmax_f32(x, dim))
}

/// Layer normalisation over the last dimension, differentiable, statistics and the affine
/// transform in f32 (candle's fused `layer_norm` has no backward), as one op
/// ([`kernels::layer_norm`]). The result is f32 under autocast (the Float list), else the
/// input's type; `w` and `b` may be of another float type than `x`.
pub fn layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x], &[w, b], |t, o| {
        layer_norm(&t[0], o[0].as_ref(), o[1].as_ref(), eps)
    }) {
        return r;
    }
    let (xs, _) = prepare("layer_norm", &[x])?;
    rec("layer_norm", kernels::layer_norm(&xs[0], w, b, eps))
}

/// RMS normalisation over the last dimension, differentiable, statistics in f32, as one op
/// ([`kernels::rms_norm`]); result types as [`layer_norm`].
pub fn rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x], &[w], |t, o| rms_norm(&t[0], o[0].as_ref(), eps)) {
        return r;
    }
    let (xs, _) = prepare("rms_norm", &[x])?;
    rec("rms_norm", kernels::rms_norm(&xs[0], w, eps))
}

/// Group normalisation of `(N, C, ...)` input into `groups` groups, statistics in f32, with
/// per-channel affine parameters.
pub fn group_norm(x: &Tensor, groups: usize, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if let Some(r) = empty::on_host_with(&[x], &[w, b], |t, o| {
        group_norm(&t[0], groups, o[0].as_ref(), o[1].as_ref(), eps)
    }) {
        return r;
    }
    let orig = x.dtype();
    let dims = x.dims().to_vec();
    if dims.len() < 2 || !dims[1].is_multiple_of(groups) {
        candle_core::bail!("group_norm: input {dims:?} must have rank >= 2 and channels divisible by {groups}")
    }
    let (xs, on) = prepare("group_norm", &[x])?;
    let x32 = to_f32(&xs[0])?.reshape((dims[0], groups, ()))?;
    let mean = x32.mean_keepdim(2)?;
    let c = x32.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(2)?;
    let y = c.broadcast_div(&(var + eps)?.sqrt()?)?.reshape(dims.as_slice())?;
    let y = back_to(y, orig, on)?;
    let mut cshape = vec![1usize; dims.len()];
    cshape[1] = dims[1];
    let y = match w {
        Some(w) => y.broadcast_mul(&w.to_dtype(y.dtype())?.reshape(cshape.as_slice())?)?,
        None => y,
    };
    rec(
        "group_norm",
        match b {
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?.reshape(cshape.as_slice())?),
            None => Ok(y),
        },
    )
}

// ---------------------------------------------------------------- losses (always f32)

fn loss_inputs(op: &str, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let (xs, _) = prepare(op, xs)?;
    xs.iter().map(to_f32).collect()
}

/// Mean negative log-likelihood of `log_probs` `(N, C)` at integer `targets` `(N,)`.
pub fn nll(log_probs: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[log_probs, targets], |x| nll(&x[0], &x[1])) {
        return r;
    }
    let xs = loss_inputs("nll", &[log_probs])?;
    let n = targets.dim(0)?;
    let picked = xs[0].gather(&targets.unsqueeze(1)?, 1)?;
    picked.sum_all()? * (-1.0 / n as f64)
}

/// Cross entropy of logits `(..., C)` against integer targets `(...)`, any rank (flattened),
/// in the stable log-sum-exp form, in f32. A target equal to its type's maximum is ignored
/// (candle's rule: loss and gradient 0 for that row, still counted in the mean). On CUDA it
/// is one fused kernel over the logits in their own type (no f32 copy of them), and a target
/// outside `0..C` gives its row a NaN loss, which the overflow check catches (the step is
/// skipped and the report names `"<loss>"`), instead of the CPU's error: telling it on the
/// host would cost a read of the targets per call.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[logits, targets], |x| cross_entropy(&x[0], &x[1])) {
        return r;
    }
    let (xs, _) = prepare("cross_entropy", &[logits])?;
    // On CUDA: one fused kernel over the logits in their own type (`kernels::cuda::xent`).
    #[cfg(feature = "cuda")]
    if let Some(loss) = kernels::cuda::xent::cross_entropy(&xs[0], targets)? {
        return Ok(loss);
    }
    let xs = xs.iter().map(to_f32).collect::<Result<Vec<_>>>()?;
    let c = xs[0].dim(D::Minus1)?;
    let flat = xs[0].reshape(((), c))?;
    let t = targets.flatten_all()?;
    if t.dim(0)? != flat.dim(0)? {
        candle_core::bail!(
            "cross_entropy: {:?} logits need {} targets, got {:?}",
            logits.shape(),
            flat.dim(0)?,
            targets.shape()
        )
    }
    nll(&log_softmax_f32(&flat, 1)?, &t)
}

/// Mean squared error, in f32.
pub fn mse(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| mse(&x[0], &x[1])) {
        return r;
    }
    let xs = loss_inputs("mse", &[a, b])?;
    xs[0].broadcast_sub(&xs[1])?.sqr()?.mean_all()
}

/// Mean absolute error, in f32.
pub fn l1(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| l1(&x[0], &x[1])) {
        return r;
    }
    let xs = loss_inputs("l1", &[a, b])?;
    xs[0].broadcast_sub(&xs[1])?.abs()?.mean_all()
}

/// Smooth L1 (Huber with threshold `beta`, as PyTorch's `smooth_l1_loss`), in f32.
pub fn smooth_l1(a: &Tensor, b: &Tensor, beta: f64) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| smooth_l1(&x[0], &x[1], beta)) {
        return r;
    }
    let xs = loss_inputs("smooth_l1", &[a, b])?;
    let d = xs[0].broadcast_sub(&xs[1])?.abs()?;
    if beta == 0.0 {
        return d.mean_all();
    }
    let quad = (d.sqr()? * (0.5 / beta))?;
    let lin = (&d - 0.5 * beta)?;
    d.lt(beta)?.where_cond(&quad, &lin)?.mean_all()
}

/// KL divergence `sum target * (log target - input) / N` of log-probabilities `input`
/// against probabilities `target` (PyTorch's `reduction="batchmean"`), in f32.
pub fn kl_div(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[input, target], |x| kl_div(&x[0], &x[1])) {
        return r;
    }
    let xs = loss_inputs("kl_div", &[input, target])?;
    let n = xs[0].dim(0)? as f64;
    let t = &xs[1];
    // 0 * log 0 = 0: clamp before the log.
    let terms = (t * (t.clamp(1e-38f32, f32::MAX)?.log()? - &xs[0])?)?;
    terms.sum_all()? / n
}

/// Binary cross entropy on logits, in the stable form
/// `max(x, 0) - x*y + log(1 + exp(-|x|))`, in f32.
pub fn binary_cross_entropy_with_logits(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[logits, targets], |x| binary_cross_entropy_with_logits(&x[0], &x[1])) {
        return r;
    }
    let xs = loss_inputs("binary_cross_entropy_with_logits", &[logits, targets])?;
    let (x, y) = (&xs[0], &xs[1]);
    let l = ((x.relu()? - (x * y)?)? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
    l.mean_all()
}

/// Binary cross entropy on probabilities, PyTorch's `binary_cross_entropy`. Under autocast
/// it is banned on half input (use [`binary_cross_entropy_with_logits`]). In f32, as PyTorch
/// does: each log is clamped at -100 (so `p = 0` or `p = 1` gives a finite loss), and the
/// gradient with respect to `p` is `(p - y) / max(p (1 - p), 1e-12)` (finite at `p = 0` and
/// `p = 1`, where the chain rule through the clamp would give `0 * inf = NaN`); with respect
/// to `y` it is `log(1 - p) - log(p)`, both clamped.
pub fn binary_cross_entropy(probs: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[probs, targets], |x| binary_cross_entropy(&x[0], &x[1])) {
        return r;
    }
    let xs = loss_inputs("binary_cross_entropy", &[probs, targets])?;
    let (p, y) = (&xs[0], &xs[1]);
    let (pd, yd) = (p.detach(), y.detach());
    let lp = pd.log()?.clamp(-100f32, f32::MAX)?;
    let l1p = (1.0 - &pd)?.log()?.clamp(-100f32, f32::MAX)?;
    let value = ((&yd * &lp)? + ((1.0 - &yd)? * &l1p)?)?.neg()?;
    // The value is computed detached; the gradients enter through `(p - p) * dp`, which is
    // exactly 0 in value and has derivative `dp` (PyTorch's hand-written backward).
    let dp = ((&pd - &yd)? / (&pd * (1.0 - &pd)?)?.clamp(1e-12f32, f32::MAX)?)?;
    let dy = (&l1p - &lp)?;
    let l = ((value + ((p - &pd)? * dp)?)? + ((y - &yd)? * dy)?)?;
    l.mean_all()
}

// ---------------------------------------------------------------- promote list

/// `a + b` (broadcasting), mixed types promoted.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| add(&x[0], &x[1])) {
        return r;
    }
    // On CUDA: the promotion's cast and the add as one kernel (kernels/cuda/rows.cu).
    if kernels::enabled()
        && !a.device().is_cpu()
        && let Some(out) = prepared_type("add", &[a.dtype(), b.dtype()])
        && let Some(y) = kernels::cuda::rows::add_cast(a, b, out)?
    {
        return rec("add", Ok(y));
    }
    // Half tensors on the CPU: one node in f32 arithmetic (the same rounding as candle's).
    promote2("add", a, b, kernels::elementwise::add)
}

/// `a - b` (broadcasting), mixed types promoted.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| sub(&x[0], &x[1])) {
        return r;
    }
    promote2("sub", a, b, |a, b| a.broadcast_sub(b))
}

/// `a * b` (broadcasting), mixed types promoted.
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| mul(&x[0], &x[1])) {
        return r;
    }
    promote2("mul", a, b, |a, b| a.broadcast_mul(b))
}

/// `a / b` (broadcasting), mixed types promoted.
pub fn div(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| div(&x[0], &x[1])) {
        return r;
    }
    promote2("div", a, b, |a, b| a.broadcast_div(b))
}

/// Element-wise comparison `a op b` (broadcasting) as a u8 mask, mixed types promoted
/// (Apex's `eq`, `ne`, `lt`, `le`, `gt`, `ge`; `op` is candle's [`CmpOp`]).
pub fn cmp(a: &Tensor, b: &Tensor, op: CmpOp) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[a, b], |x| cmp(&x[0], &x[1], op)) {
        return r;
    }
    let name = match op {
        CmpOp::Eq => "eq",
        CmpOp::Ne => "ne",
        CmpOp::Lt => "lt",
        CmpOp::Le => "le",
        CmpOp::Gt => "gt",
        CmpOp::Ge => "ge",
    };
    promote2(name, a, b, |a, b| match op {
        CmpOp::Eq => a.broadcast_eq(b),
        CmpOp::Ne => a.broadcast_ne(b),
        CmpOp::Lt => a.broadcast_lt(b),
        CmpOp::Le => a.broadcast_le(b),
        CmpOp::Gt => a.broadcast_gt(b),
        CmpOp::Ge => a.broadcast_ge(b),
    })
}

/// `mask ? on_true : on_false`, the two values promoted.
pub fn where_cond(mask: &Tensor, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
    if let Some(r) = empty::on_host(&[mask, on_true, on_false], |x| where_cond(&x[0], &x[1], &x[2])) {
        return r;
    }
    promote2("where", on_true, on_false, |t, f| mask.where_cond(t, f))
}

/// Concatenation along `dim`, mixed types promoted.
pub fn cat(xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(xs, |x| {
        let refs: Vec<&Tensor> = x.iter().collect();
        cat(&refs, dim)
    }) {
        return r;
    }
    let (xs, _) = prepare("cat", xs)?;
    let xs = promoted(xs)?;
    rec("cat", Tensor::cat(&xs, dim))
}

/// Stacking along a new `dim`, mixed types promoted.
pub fn stack(xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    if let Some(r) = empty::on_host(xs, |x| {
        let refs: Vec<&Tensor> = x.iter().collect();
        stack(&refs, dim)
    }) {
        return r;
    }
    let (xs, _) = prepare("stack", xs)?;
    let xs = promoted(xs)?;
    rec("stack", Tensor::stack(&xs, dim))
}
