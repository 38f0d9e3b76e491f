//! Every shape, every level: a property test over the public ops (`ops`), layers (`nn`) and
//! kernels (`kernels`), on random shapes that include zero-sized dimensions, broadcast batch
//! dimensions and non-contiguous inputs (transposed, narrowed, strided), at each opt level's
//! types (O0: f32; O1: f32 inputs under autocast; O2/O3: half inputs) and both half types.
//!
//! The property: nothing panics, and each result equals plain candle's f32 result on the same
//! (exactly representable) input values within the half type's tolerance, or both fail.
//! Where the op has a backward, the gradients of a weighted sum of the output with respect
//! to the inputs (through the view, to the storage it was cut from) agree too.
//!
//! Fixed seed and case count, so CI time is bounded (the count is printed).
//!
//! The groups of public ops and layers (attention, losses, reductions, cross entropy, `nn`
//! layers) run on `common::device()`. The groups that compare the CPU kernels' fast paths
//! with their fallbacks (products, linear, element-wise and activations, normalisation, the
//! fallback product) stay on the CPU: off it both sides are the fallback.
//!
//! `options` (in `shapes/`) covers the gated MLP (each activation, bias on and off) and
//! self-attention's options (grouped key/value heads, rotary embedding, key lengths) the
//! same way, against references written from candle's ops.
//!
//! `fast_paths` (in `shapes/`) compares every kernel's fast path with its own fallback
//! (`kernels::plain()`) on every instruction-set tier this CPU has, in f32, f16 and bf16,
//! with every argument laid out any way, broadcast included, and empty dimensions anywhere.

mod common;
#[path = "shapes/fast_paths.rs"]
mod fast_paths;
#[path = "shapes/options.rs"]
mod options;

use std::panic::{AssertUnwindSafe, catch_unwind};

use candle_amp::{autocast, kernels, nn as ann, ops};
use candle_core::{D, DType, Device, Tensor, Var};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Level {
    O0,
    O1,
    O2,
    O3,
}

/// How one case runs: the level's input type, the half type and whether autocast is on.
#[derive(Debug, Clone, Copy)]
struct Setting {
    level: Level,
    half: DType,
}

impl Setting {
    fn input_dtype(self) -> DType {
        match self.level {
            Level::O0 | Level::O1 => DType::F32,
            Level::O2 | Level::O3 => self.half,
        }
    }

    /// The type the op computes in: the half type wherever half is involved.
    fn tol(self) -> f32 {
        if self.level == Level::O0 {
            2e-5
        } else if self.half == DType::F16 {
            1e-2
        } else {
            5e-2
        }
    }

    fn run<T>(self, f: impl FnOnce() -> T) -> T {
        if self.level == Level::O1 {
            let _g = autocast::scope(self.half);
            f()
        } else {
            f()
        }
    }
}

fn setting() -> impl Strategy<Value = Setting> {
    (
        prop_oneof![Just(Level::O0), Just(Level::O1), Just(Level::O2), Just(Level::O3)],
        prop_oneof![Just(DType::F16), Just(DType::BF16)],
    )
        .prop_map(|(level, half)| Setting { level, half })
}

/// How an input is laid out: cut from a larger contiguous storage so that it is not itself
/// contiguous (except `Contiguous`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum View {
    Contiguous,
    /// Stored with its last two dims swapped, then transposed.
    Transposed,
    /// Stored with a larger first dim, then narrowed.
    Narrowed,
    /// Stored with a last dim twice as long, then narrowed there (a row stride).
    Strided,
}

fn view() -> impl Strategy<Value = View> {
    prop_oneof![
        Just(View::Contiguous),
        Just(View::Transposed),
        Just(View::Narrowed),
        Just(View::Strided)
    ]
}

/// Values that f16 and bf16 hold exactly (k/8 for |k| <= 16), so a half input equals its f32
/// reference bit for bit.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s % 33) as f32 - 16.0) / 8.0
        })
        .collect()
}

thread_local! {
    /// The device this thread's group builds its inputs on: the CPU unless the group calls
    /// [`on_test_device`] (each test runs on its own thread).
    static DEVICE: std::cell::RefCell<Device> = const { std::cell::RefCell::new(Device::Cpu) };
}

/// Makes this thread's group build its inputs on `common::device()`. On the CPU the ops
/// then treat empty inputs as they do on a GPU (a host run, see
/// `testing::emulate_empty_device`), so the CUDA path's guards are checked here too.
fn on_test_device() {
    let device = common::device();
    candle_amp::testing::emulate_empty_device(device.is_cpu());
    DEVICE.with(|d| *d.borrow_mut() = device);
}

/// The device this thread's group builds its inputs on.
fn dev() -> Device {
    DEVICE.with(|d| d.borrow().clone())
}

/// An input: the storage it is cut from (a Var, for gradients) and the view itself.
struct Input {
    base: Var,
    view: Tensor,
}

/// Builds `shape` laid out as `v`, of `dtype`, from `seed`'s values, on `device`; the same
/// seed, shape and view give the same values in any type. The values are made and cast on
/// the CPU and then moved: candle's own cast of an empty tensor fails on CUDA (a launch of
/// no blocks), and these are the inputs, not the ops under test.
fn input(shape: &[usize], v: View, dtype: DType, seed: u64, device: &Device) -> Input {
    let r = shape.len();
    let v = if r < 2 && v == View::Transposed {
        View::Contiguous
    } else {
        v
    };
    let v = if r == 0 { View::Contiguous } else { v };
    let mut stored = shape.to_vec();
    match v {
        View::Contiguous => {}
        View::Transposed => stored.swap(r - 2, r - 1),
        View::Narrowed => stored[0] += 2,
        View::Strided => stored[r - 1] *= 2,
    }
    let n: usize = stored.iter().product();
    let t = Tensor::from_vec(values(n, seed), stored.as_slice(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap();
    let base = Var::from_tensor(&t).unwrap();
    let view = match v {
        View::Contiguous => base.as_tensor().clone(),
        View::Transposed => base.as_tensor().transpose(r - 2, r - 1).unwrap(),
        View::Narrowed => base.as_tensor().narrow(0, 1, shape[0]).unwrap(),
        View::Strided => base.as_tensor().narrow(r - 1, 0, shape[r - 1]).unwrap(),
    };
    Input { base, view }
}

type Out = std::result::Result<Tensor, String>;

/// Runs `f` with the kernels off on this thread: the path every kernel takes off the CPU.
fn plain<T>(f: impl FnOnce() -> T) -> T {
    let _p = kernels::plain();
    f()
}

/// Runs `f` and turns an error or a panic into `Err` (a panic is marked as such).
fn guarded(f: impl FnOnce() -> Out) -> std::result::Result<Out, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// The values as f32 on the host (moved first: casting an empty CUDA tensor fails in candle).
fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn close(what: &str, got: &Tensor, want: &Tensor, tol: f32) -> std::result::Result<(), TestCaseError> {
    prop_assert_eq!(got.dims(), want.dims(), "{}: shapes", what);
    let (g, w) = (f32s(got), f32s(want));
    let scale = 1.0 + w.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = if b.is_nan() {
            a.is_nan()
        } else if b.is_infinite() {
            a == b
        } else {
            (a - b).abs() <= tol * scale
        };
        prop_assert!(
            ok,
            "{}: element {} is {} where plain f32 candle gives {} (tol {})",
            what,
            i,
            a,
            b,
            tol * scale
        );
    }
    Ok(())
}

/// The gradients of `sum(out * c)` with respect to every input's storage, flattened into
/// one vector (zeros for an input the output does not depend on).
fn input_grads(out: &Tensor, c: &Tensor, inputs: &[Input]) -> Out {
    let e = |e: candle_core::Error| e.to_string();
    // On the host (see `f32s`): the device op's gradient comes back through `to_device`.
    let host = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32));
    let l = (host(out).map_err(e)? * c).and_then(|t| t.sum_all()).map_err(e)?;
    let g = l.backward().map_err(e)?;
    let mut parts = Vec::with_capacity(inputs.len());
    for x in inputs {
        let gi = match g.get(x.base.as_tensor()) {
            Some(t) => host(t).map_err(e)?,
            None => Tensor::zeros(x.base.shape(), DType::F32, &Device::Cpu).map_err(e)?,
        };
        parts.push(gi.flatten_all().map_err(e)?);
    }
    Tensor::cat(&parts, 0).map_err(e)
}

thread_local! {
    /// Cases checked by the test running on this thread.
    static CASES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// One op checked against its reference: `ours` on the setting's inputs on the test device,
/// `reference` on f32 inputs on the CPU with the kernels off (plain candle) and no autocast:
/// the CPU's behaviour, empty tensors included, is what every device must give. Gradients with respect to
/// every input's storage are compared where both sides give an output.
fn check(
    what: &str,
    s: Setting,
    shapes: &[(Vec<usize>, View)],
    seed: u64,
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> std::result::Result<(), TestCaseError> {
    CASES.with(|c| c.set(c.get() + 1));
    let what = format!("{what} {s:?} {shapes:?}");
    let make = |dt, device: &Device| -> Vec<Input> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, (sh, v))| input(sh, *v, dt, seed + i as u64, device))
            .collect()
    };
    let (mine, refs) = (make(s.input_dtype(), &dev()), make(DType::F32, &Device::Cpu));
    let views = |xs: &[Input]| xs.iter().map(|x| x.view.clone()).collect::<Vec<_>>();
    let got = guarded(|| s.run(|| f(&views(&mine)).map_err(|e| e.to_string())));
    let want = guarded(|| {
        let _plain = kernels::plain();
        autocast::disabled(|| reference(&views(&refs)).map_err(|e| e.to_string()))
    });
    let got = match got {
        Ok(g) => g,
        Err(p) => return Err(TestCaseError::fail(format!("{what}: panicked: {p}"))),
    };
    let (got, want) = match (got, want) {
        (Ok(g), Ok(Ok(w))) => (g, w),
        (Err(_), Ok(Err(_))) | (Err(_), Err(_)) => return Ok(()),
        // Where plain candle panics, a typed error or a result is better: nothing to compare.
        (Ok(_), Err(_)) => return Ok(()),
        (Ok(g), Ok(Err(e))) => {
            return Err(TestCaseError::fail(format!(
                "{what}: gives shape {:?} where plain candle fails: {e}",
                g.dims()
            )));
        }
        (Err(e), Ok(Ok(w))) => {
            return Err(TestCaseError::fail(format!(
                "{what}: fails ({e}) where plain candle gives shape {:?}",
                w.dims()
            )));
        }
    };
    close(&what, &got, &want, s.tol())?;
    // Gradients of sum(out * c) for fixed c.
    let c = Tensor::from_vec(values(want.elem_count(), seed ^ 0xC0FFEE), want.shape(), &Device::Cpu).unwrap();
    let g_got = guarded(|| input_grads(&got, &c, &mine));
    let g_want = guarded(|| {
        let _plain = kernels::plain();
        input_grads(&want, &c, &refs)
    });
    match (g_got, g_want) {
        (Err(p), _) => Err(TestCaseError::fail(format!("{what}: backward panicked: {p}"))),
        (Ok(Ok(g)), Ok(Ok(w))) => close(&format!("{what} gradient"), &g, &w, 2.0 * s.tol()),
        (Ok(Err(e)), Ok(Ok(_))) => Err(TestCaseError::fail(format!(
            "{what}: backward fails ({e}) where plain candle's works"
        ))),
        _ => Ok(()),
    }
}

/// A dimension, zero one time in six.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 5 => 1usize..5]
}

/// Batch dims for the two operands of a broadcasting product: none, equal, or one side 1.
fn batch_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop_oneof![
        Just((vec![], vec![])),
        dim().prop_map(|b| (vec![b], vec![b])),
        dim().prop_map(|b| (vec![1], vec![b])),
        dim().prop_map(|b| (vec![b], vec![1])),
        (dim(), dim()).prop_map(|(a, b)| (vec![a, 1], vec![1, b])),
        dim().prop_map(|b| (vec![b], vec![])),
        dim().prop_map(|b| (vec![], vec![b])),
    ]
}

fn runner() -> TestRunner {
    let cases = std::env::var("CANDLE_AMP_SHAPE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    )
}

fn report(name: &str, before: usize) {
    eprintln!("shapes: {name}: {} op checks passed", CASES.with(|c| c.get()) - before);
}

/// The broadcasting product: `ops::matmul` and `kernels::matmul` against candle's
/// `broadcast_matmul`.
#[test]
fn products_broadcast_zero_sizes_and_views() {
    let before = CASES.with(|c| c.get());
    let strat = (
        setting(),
        batch_pair(),
        dim(),
        dim(),
        dim(),
        view(),
        view(),
        any::<u32>(),
    );
    runner()
        .run(&strat, |(s, (ba, bb), m, k, n, va, vb, seed)| {
            let sa: Vec<usize> = ba.iter().copied().chain([m, k]).collect();
            let sb: Vec<usize> = bb.iter().copied().chain([k, n]).collect();
            let shapes = [(sa, va), (sb, vb)];
            let reference = |x: &[Tensor]| x[0].broadcast_matmul(&x[1]);
            check(
                "ops::matmul",
                s,
                &shapes,
                seed as u64,
                |x| ops::matmul(&x[0], &x[1]),
                reference,
            )?;
            check(
                "kernels::matmul",
                s,
                &shapes,
                seed as u64,
                |x| kernels::matmul(&x[0], &x[1]),
                reference,
            )?;
            // The fallback (kernels off, as off the CPU) keeps the same contract.
            check(
                "kernels::matmul (plain)",
                s,
                &shapes,
                seed as u64,
                |x| plain(|| kernels::matmul(&x[0], &x[1])),
                reference,
            )
        })
        .unwrap();
    report("products", before);
}

/// The fused linear (op, kernel and layer) against `x w^T + b`.
#[test]
fn linear_with_and_without_bias() {
    let before = CASES.with(|c| c.get());
    let strat = (
        setting(),
        prop::collection::vec(dim(), 0..3),
        dim(),
        dim(),
        view(),
        view(),
        any::<bool>(),
        any::<u32>(),
    );
    runner()
        .run(&strat, |(s, lead, k, n, vx, vw, bias, seed)| {
            let sx: Vec<usize> = lead.iter().copied().chain([k]).collect();
            let mut shapes = vec![(sx, vx), (vec![n, k], vw)];
            if bias {
                shapes.push((vec![n], View::Contiguous));
            }
            // PyTorch's `F.linear`: a 1-d input is one row.
            let reference = |x: &[Tensor]| {
                let one = x[0].rank() == 1;
                let xs = if one { x[0].unsqueeze(0)? } else { x[0].clone() };
                let y = xs.broadcast_matmul(&x[1].t()?)?;
                let y = if one { y.squeeze(0)? } else { y };
                match x.get(2) {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            };
            let seed = seed as u64;
            check(
                "ops::linear",
                s,
                &shapes,
                seed,
                |x| ops::linear(&x[0], &x[1], x.get(2)),
                reference,
            )?;
            check(
                "kernels::linear",
                s,
                &shapes,
                seed,
                |x| kernels::linear(&x[0], &x[1], x.get(2)),
                reference,
            )?;
            check(
                "kernels::linear (plain)",
                s,
                &shapes,
                seed,
                |x| plain(|| kernels::linear(&x[0], &x[1], x.get(2))),
                reference,
            )?;
            check(
                "nn::Linear",
                s,
                &shapes,
                seed,
                |x| candle_nn::Module::forward(&ann::Linear::new(x[1].clone(), x.get(2).cloned()), &x[0]),
                reference,
            )
        })
        .unwrap();
    report("linear", before);
}

/// Shapes of rank 0 to 3 with a zero now and then.
fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(dim(), 0..4)
}

/// Element-wise ops, activations and casts.
#[test]
fn element_wise_ops_and_activations() {
    let before = CASES.with(|c| c.get());
    let strat = (setting(), shape(), view(), any::<u32>());
    runner()
        .run(&strat, |(s, sh, v, seed)| {
            let shapes = [(sh.clone(), v)];
            let seed = seed as u64;
            // PyTorch's ReLU: gradient 0 at 0 (candle's own relu passes it through there).
            let relu_ref = |x: &[Tensor]| x[0].broadcast_mul(&x[0].gt(0f64)?.to_dtype(x[0].dtype())?);
            check("ops::relu", s, &shapes, seed, |x| ops::relu(&x[0]), relu_ref)?;
            check("kernels::relu", s, &shapes, seed, |x| kernels::relu(&x[0]), relu_ref)?;
            check("ops::gelu", s, &shapes, seed, |x| ops::gelu(&x[0]), |x| x[0].gelu_erf())?;
            check(
                "kernels::gelu",
                s,
                &shapes,
                seed,
                |x| kernels::gelu(&x[0]),
                |x| x[0].gelu_erf(),
            )?;
            check(
                "kernels::relu (plain)",
                s,
                &shapes,
                seed,
                |x| plain(|| kernels::relu(&x[0])),
                relu_ref,
            )?;
            check(
                "kernels::gelu (plain)",
                s,
                &shapes,
                seed,
                |x| plain(|| kernels::gelu(&x[0])),
                |x| x[0].gelu_erf(),
            )?;
            check("ops::exp", s, &shapes, seed, |x| ops::exp(&x[0]), |x| x[0].exp())?;
            check(
                "ops::sum_all",
                s,
                &shapes,
                seed,
                |x| ops::sum_all(&x[0]),
                |x| x[0].sum_all(),
            )?;
            for dt in [DType::F32, DType::F16, DType::BF16] {
                check(
                    "kernels::cast",
                    s,
                    &shapes,
                    seed,
                    |x| kernels::cast(&x[0], dt),
                    |x| x[0].to_dtype(dt),
                )?;
            }
            // A broadcast partner: the same shape with the first dim 1.
            if !sh.is_empty() {
                let mut other = sh.clone();
                other[0] = 1;
                let pair = [(sh.clone(), v), (other, View::Contiguous)];
                check(
                    "ops::add",
                    s,
                    &pair,
                    seed,
                    |x| ops::add(&x[0], &x[1]),
                    |x| x[0].broadcast_add(&x[1]),
                )?;
                check(
                    "ops::mul",
                    s,
                    &pair,
                    seed,
                    |x| ops::mul(&x[0], &x[1]),
                    |x| x[0].broadcast_mul(&x[1]),
                )?;
            }
            Ok(())
        })
        .unwrap();
    report("element-wise", before);
}

/// Softmax and log-softmax over the last dim, by hand in f32 for the reference.
fn softmax_ref(x: &Tensor) -> candle_core::Result<Tensor> {
    // PyTorch's softmax of an empty tensor is the empty tensor (candle's reduce fails).
    if x.elem_count() == 0 {
        return x.zeros_like();
    }
    let m = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

fn layer_norm_ref(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, rms: bool) -> candle_core::Result<Tensor> {
    let x = if rms {
        x.clone()
    } else {
        x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?
    };
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    let mut y = x.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
    if let Some(w) = w {
        y = y.broadcast_mul(w)?;
    }
    if let Some(b) = b {
        y = y.broadcast_add(b)?;
    }
    Ok(y)
}

/// Normalisation and softmax over the last dim, any leading dims, zero sizes included.
#[test]
fn normalisation_and_softmax() {
    let before = CASES.with(|c| c.get());
    let strat = (
        setting(),
        prop::collection::vec(dim(), 0..3),
        1usize..6,
        view(),
        any::<u32>(),
    );
    runner()
        .run(&strat, |(s, lead, d, v, seed)| {
            let sx: Vec<usize> = lead.iter().copied().chain([d]).collect();
            let seed = seed as u64;
            let one = [(sx.clone(), v)];
            let r = sx.len() - 1;
            check(
                "ops::softmax",
                s,
                &one,
                seed,
                |x| ops::softmax(&x[0], r),
                |x| softmax_ref(&x[0]),
            )?;
            check(
                "ops::log_softmax",
                s,
                &one,
                seed,
                |x| ops::log_softmax(&x[0], r),
                |x| softmax_ref(&x[0])?.log(),
            )?;
            let affine = [(sx, v), (vec![d], View::Contiguous), (vec![d], View::Contiguous)];
            let ln_ref = |x: &[Tensor]| layer_norm_ref(&x[0], Some(&x[1]), Some(&x[2]), false);
            check(
                "ops::layer_norm",
                s,
                &affine,
                seed,
                |x| ops::layer_norm(&x[0], Some(&x[1]), Some(&x[2]), 1e-5),
                ln_ref,
            )?;
            check(
                "kernels::layer_norm",
                s,
                &affine,
                seed,
                |x| kernels::layer_norm(&x[0], Some(&x[1]), Some(&x[2]), 1e-5),
                ln_ref,
            )?;
            check(
                "kernels::layer_norm (plain)",
                s,
                &affine,
                seed,
                |x| plain(|| kernels::layer_norm(&x[0], Some(&x[1]), Some(&x[2]), 1e-5)),
                ln_ref,
            )?;
            let rms_ref = |x: &[Tensor]| layer_norm_ref(&x[0], Some(&x[1]), None, true);
            check(
                "ops::rms_norm",
                s,
                &affine[..2],
                seed,
                |x| ops::rms_norm(&x[0], Some(&x[1]), 1e-5),
                rms_ref,
            )?;
            check(
                "kernels::rms_norm",
                s,
                &affine[..2],
                seed,
                |x| kernels::rms_norm(&x[0], Some(&x[1]), 1e-5),
                rms_ref,
            )
        })
        .unwrap();
    report("normalisation", before);
}

fn attention_ref(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> candle_core::Result<Tensor> {
    let d = q.dim(D::Minus1)?;
    let mut s = (q.broadcast_matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
    if causal {
        let t = q.dim(D::Minus2)?;
        s = s.broadcast_add(&ann::causal_mask(t, q.device())?)?;
    }
    softmax_ref(&s)?.broadcast_matmul(v)
}

/// Attention with any sequence lengths (zero included), causal or not.
#[test]
fn attention_any_sequence_length() {
    on_test_device();
    let before = CASES.with(|c| c.get());
    let strat = (
        setting(),
        dim(),
        dim(),
        dim(),
        1usize..4,
        1usize..4,
        any::<bool>(),
        view(),
        any::<u32>(),
    );
    runner()
        .run(&strat, |(s, b, t, src, d, dv, causal, vq, seed)| {
            // Causal attention needs a square score matrix.
            let src = if causal { t } else { src };
            let shapes = [
                (vec![b, t, d], vq),
                (vec![b, src, d], View::Contiguous),
                (vec![b, src, dv], View::Transposed),
            ];
            check(
                "nn::scaled_dot_product_attention",
                s,
                &shapes,
                seed as u64,
                |x| ann::scaled_dot_product_attention(&x[0], &x[1], &x[2], None, causal, None),
                |x| attention_ref(&x[0], &x[1], &x[2], causal),
            )
        })
        .unwrap();
    report("attention", before);
}

/// Losses over batches of any size (an empty batch's mean is NaN on both sides).
#[test]
fn losses_any_batch() {
    on_test_device();
    let before = CASES.with(|c| c.get());
    let strat = (setting(), dim(), 1usize..5, view(), any::<u32>());
    runner()
        .run(&strat, |(s, n, c, v, seed)| {
            let shapes = [(vec![n, c], v), (vec![n, c], View::Contiguous)];
            let seed = seed as u64;
            check(
                "ops::mse",
                s,
                &shapes,
                seed,
                |x| ops::mse(&x[0], &x[1]),
                |x| (&x[0] - &x[1])?.sqr()?.mean_all(),
            )?;
            check(
                "ops::l1",
                s,
                &shapes,
                seed,
                |x| ops::l1(&x[0], &x[1]),
                |x| (&x[0] - &x[1])?.abs()?.mean_all(),
            )
        })
        .unwrap();
    report("losses", before);
}

/// Reductions, element-wise maths, comparisons and joins of `ops`, at any rank.
#[test]
fn reductions_maths_and_joins() {
    on_test_device();
    let before = CASES.with(|c| c.get());
    let strat = (setting(), prop::collection::vec(dim(), 1..4), view(), any::<u32>());
    runner()
        .run(&strat, |(s, sh, v, seed)| {
            let one = [(sh.clone(), v)];
            let two = [(sh.clone(), v), (sh.clone(), View::Contiguous)];
            let seed = seed as u64;
            let last = sh.len() - 1;
            check("ops::log", s, &one, seed, |x| ops::log(&x[0]), |x| x[0].log())?;
            check("ops::pow", s, &one, seed, |x| ops::pow(&x[0], 2.0), |x| x[0].powf(2.0))?;
            check(
                "ops::reciprocal",
                s,
                &one,
                seed,
                |x| ops::reciprocal(&x[0]),
                |x| x[0].recip(),
            )?;
            check(
                "ops::rsqrt",
                s,
                &one,
                seed,
                |x| ops::rsqrt(&x[0]),
                |x| x[0].sqrt()?.recip(),
            )?;
            check(
                "ops::sum_keepdim",
                s,
                &one,
                seed,
                |x| ops::sum_keepdim(&x[0], last),
                |x| x[0].sum_keepdim(last),
            )?;
            check(
                "ops::mean_keepdim",
                s,
                &one,
                seed,
                |x| ops::mean_keepdim(&x[0], 0),
                |x| x[0].mean_keepdim(0),
            )?;
            check(
                "ops::mean_all",
                s,
                &one,
                seed,
                |x| ops::mean_all(&x[0]),
                |x| x[0].mean_all(),
            )?;
            check(
                "ops::var_keepdim",
                s,
                &one,
                seed,
                |x| ops::var_keepdim(&x[0], last),
                |x| {
                    // PyTorch: NaN over an empty dim (candle panics in debug, gives 0 in release).
                    if x[0].dim(last)? == 0 {
                        let mut d = x[0].dims().to_vec();
                        d[last] = 1;
                        return Tensor::full(f32::NAN, d, x[0].device());
                    }
                    x[0].var_keepdim(last)
                },
            )?;
            check(
                "ops::norm",
                s,
                &one,
                seed,
                |x| ops::norm(&x[0]),
                |x| x[0].sqr()?.sum_all()?.sqrt(),
            )?;
            check(
                "ops::cumsum",
                s,
                &one,
                seed,
                |x| ops::cumsum(&x[0], last),
                |x| x[0].cumsum(last),
            )?;
            check(
                "ops::sub",
                s,
                &two,
                seed,
                |x| ops::sub(&x[0], &x[1]),
                |x| x[0].broadcast_sub(&x[1]),
            )?;
            check(
                "ops::div",
                s,
                &two,
                seed,
                |x| ops::div(&x[0], &x[1]),
                |x| x[0].broadcast_div(&x[1]),
            )?;
            check(
                "ops::cmp",
                s,
                &two,
                seed,
                |x| ops::cmp(&x[0], &x[1], ops::CmpOp::Lt),
                |x| x[0].lt(&x[1]),
            )?;
            check(
                "ops::where_cond",
                s,
                &two,
                seed,
                |x| ops::where_cond(&x[0].ge(0f64)?, &x[0], &x[1]),
                |x| x[0].ge(0f64)?.where_cond(&x[0], &x[1]),
            )?;
            check(
                "ops::cat",
                s,
                &two,
                seed,
                |x| ops::cat(&[&x[0], &x[1]], last),
                |x| Tensor::cat(&[&x[0], &x[1]], last),
            )?;
            check(
                "ops::stack",
                s,
                &two,
                seed,
                |x| ops::stack(&[&x[0], &x[1]], 0),
                |x| Tensor::stack(&[&x[0], &x[1]], 0),
            )?;
            check(
                "ops::smooth_l1",
                s,
                &two,
                seed,
                |x| ops::smooth_l1(&x[0], &x[1], 1.0),
                |x| {
                    let d = (&x[0] - &x[1])?.abs()?;
                    d.lt(1.0)?.where_cond(&(d.sqr()? * 0.5)?, &(&d - 0.5)?)?.mean_all()
                },
            )?;
            check(
                "ops::binary_cross_entropy_with_logits",
                s,
                &two,
                seed,
                |x| ops::binary_cross_entropy_with_logits(&x[0], &x[1]),
                |x| {
                    let (z, y) = (&x[0], &x[1]);
                    ((z.relu()? - (z * y)?)? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)?.mean_all()
                },
            )?;
            Ok(())
        })
        .unwrap();
    report("reductions", before);
}

/// Cross entropy over any batch (class indices from the inputs' values).
#[test]
fn cross_entropy_any_batch() {
    on_test_device();
    let before = CASES.with(|c| c.get());
    let strat = (setting(), dim(), 1usize..5, view(), any::<u32>());
    runner()
        .run(&strat, |(s, n, c, v, seed)| {
            let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7 + seed) % c as u32).collect();
            let t = Tensor::new(targets.as_slice(), &dev()).unwrap();
            let t_host = t.to_device(&Device::Cpu).unwrap();
            check(
                "ops::cross_entropy",
                s,
                &[(vec![n, c], v)],
                seed as u64,
                |x| ops::cross_entropy(&x[0], &t),
                |x| {
                    let ls = softmax_ref(&x[0])?.log()?;
                    ls.gather(&t_host.unsqueeze(1)?, 1)?.sum_all()? * (-1.0 / n as f64)
                },
            )
        })
        .unwrap();
    report("cross entropy", before);
}

/// Builds one `candle_nn` layer (f32, on the CPU: the reference) and its `candle_amp::nn`
/// counterpart over the same values (one VarMap), the latter in `dtype` (the level's
/// parameter type) on the test device.
fn layer_pair<A, B>(
    dtype: DType,
    amp_layer: impl FnOnce(candle_nn::VarBuilder) -> candle_core::Result<A>,
    nn_layer: impl FnOnce(candle_nn::VarBuilder) -> candle_core::Result<B>,
) -> (A, B) {
    let vm = candle_nn::VarMap::new();
    let b = nn_layer(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu).pp("l")).unwrap();
    let converted: std::collections::HashMap<String, Tensor> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_tensor().to_dtype(dtype).unwrap().to_device(&dev()).unwrap(),
            )
        })
        .collect();
    let a = amp_layer(candle_nn::VarBuilder::from_tensors(converted, dtype, &dev()).pp("l")).unwrap();
    (a, b)
}

/// Every `nn` layer on batches of any size, zero included, at each level's types, against
/// `candle_nn`'s layer (f32) over the same parameters: same values within tolerance, or
/// both fail. (Layers without a candle-nn counterpart with a backward are compared on the
/// forward only, through `check`'s gradient step, which skips when the reference has none.)
#[test]
fn layers_on_any_batch() {
    use candle_nn::{Module, ModuleT};
    on_test_device();
    let before = CASES.with(|c| c.get());
    let strat = (setting(), dim(), 1usize..4, any::<u32>());
    runner()
        .run(&strat, |(s, n, c, seed)| {
            let seed = seed as u64;
            // Images: (n, c, 4, 4). bf16 conv2d is not supported by candle on the CPU.
            let img = [(vec![n, c, 4, 4], View::Contiguous)];
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| ann::conv2d(c, 2, 3, Default::default(), vb),
                |vb| candle_nn::conv2d(c, 2, 3, Default::default(), vb),
            );
            if s.half == DType::F16 || s.level == Level::O0 {
                check("nn::conv2d", s, &img, seed, |x| a.forward(&x[0]), |x| b.forward(&x[0]))?;
            }
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| ann::batch_norm(c, 1e-5, vb),
                |vb| candle_nn::batch_norm(c, 1e-5, vb),
            );
            check(
                "nn::batch_norm (eval)",
                s,
                &img,
                seed,
                |x| a.forward_t(&x[0], false),
                |x| b.forward_t(&x[0], false),
            )?;
            let seq = [(vec![n, 3, c], View::Strided)];
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| ann::layer_norm(c, 1e-5, vb),
                |vb| candle_nn::layer_norm(c, 1e-5, vb),
            );
            check(
                "nn::layer_norm",
                s,
                &seq,
                seed,
                |x| a.forward(&x[0]),
                |x| b.forward(&x[0]),
            )?;
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| ann::rms_norm(c, 1e-5, vb),
                |vb| candle_nn::rms_norm(c, 1e-5, vb),
            );
            check(
                "nn::rms_norm",
                s,
                &seq,
                seed,
                |x| a.forward(&x[0]),
                |x| b.forward(&x[0]),
            )?;
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| ann::linear(c, 3, vb),
                |vb| candle_nn::linear(c, 3, vb),
            );
            check("nn::linear", s, &seq, seed, |x| a.forward(&x[0]), |x| b.forward(&x[0]))?;
            // The fused forms: a layer with its activation, and a chain of layers.
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| Ok(ann::linear(c, 3, vb)?.with_activation(ann::Activation::Gelu)),
                |vb| candle_nn::linear(c, 3, vb),
            );
            check(
                "nn::Linear::with_activation",
                s,
                &seq,
                seed,
                |x| a.forward(&x[0]),
                |x| b.forward(&x[0])?.gelu_erf(),
            )?;
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| {
                    Ok(ann::Mlp::new(vec![
                        ann::linear(c, 4, vb.pp("up"))?.with_activation(ann::Activation::Gelu),
                        ann::linear(4, 3, vb.pp("down"))?,
                    ]))
                },
                |vb| {
                    Ok((
                        candle_nn::linear(c, 4, vb.pp("up"))?,
                        candle_nn::linear(4, 3, vb.pp("down"))?,
                    ))
                },
            );
            check(
                "nn::Mlp",
                s,
                &seq,
                seed,
                |x| a.forward(&x[0]),
                // candle-nn's Linear cannot reshape an empty batch of rank 3; the fallback
                // product (under the reference's `plain`) is candle's broadcast matmul.
                |x| {
                    let h = kernels::linear(&x[0], b.0.weight(), b.0.bias())?.gelu_erf()?;
                    kernels::linear(&h, b.1.weight(), b.1.bias())
                },
            )?;
            // Embedding: n indices.
            let ids = Tensor::new((0..n as u32).map(|i| i % 5).collect::<Vec<_>>().as_slice(), &dev()).unwrap();
            let (a, b) = layer_pair(
                s.input_dtype(),
                |vb| ann::embedding(5, c, vb),
                |vb| candle_nn::embedding(5, c, vb),
            );
            let ea = s.run(|| a.forward(&ids));
            let eb = b.forward(&ids.to_device(&Device::Cpu).unwrap());
            match (ea, eb) {
                (Ok(x), Ok(y)) => close("nn::embedding", &x, &y, s.tol())?,
                (Err(_), Err(_)) => {}
                (x, y) => prop_assert!(
                    false,
                    "nn::embedding: {:?} vs {:?}",
                    x.map(|t| t.dims().to_vec()),
                    y.map(|t| t.dims().to_vec())
                ),
            }
            Ok(())
        })
        .unwrap();
    report("layers", before);
}

/// The fallback broadcasts batch dims like the fast path: (1, 2, 3) x (3, 3, 4).
#[test]
fn fallback_product_broadcasts_like_the_fast_path() {
    let a = Tensor::ones((1, 2, 3), DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::ones((3, 3, 4), DType::F32, &Device::Cpu).unwrap();
    let fast = kernels::matmul(&a, &b).unwrap();
    let slow = plain(|| kernels::matmul(&a, &b)).unwrap();
    assert_eq!(fast.dims(), [3, 2, 4]);
    assert_eq!(f32s(&fast), f32s(&slow));
    assert!(f32s(&fast).iter().all(|&v| v == 3.0));
}
