//! Every kernel's fast path against its own fallback (`kernels::plain()`), on every
//! instruction-set tier this CPU has (`kernels::force_isa`), in f32, f16 and bf16, with every
//! argument laid out any way (contiguous, transposed, narrowed, row-strided, element-strided,
//! broadcast) and empty dimensions anywhere, last ones included.
//!
//! The property (`docs/getting-started.md`'s promise, "Every shape"): the two paths agree. Both give a result, equal within
//! the type's rounding (the fast path rounds once, the fallback per op), with gradients equal
//! too; or both fail. A fallback that panics (candle's) leaves nothing to compare.
//!
//! The tier is process-wide: while this group runs, the other groups' fast paths run on the
//! tiers it forces, which they are indifferent to (they compare with f32 candle within
//! tolerance, and their values are never subnormal, where the bf16 tiers differ).

use candle_amp::kernels::{self, Isa};
use candle_amp::ops;
use candle_core::{DType, Tensor, Var};
use proptest::prelude::*;

use super::{CASES, dev, dim, guarded, runner, values};

/// How an argument is laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    Contiguous,
    /// Stored with its last two dims swapped, then transposed (rank >= 2).
    Transposed,
    /// Stored with a larger first dim, then narrowed (an offset; at rank >= 2 a gap).
    Narrowed,
    /// Stored with a last dim twice as long, then narrowed there (a row stride, rank >= 2).
    RowStrided,
    /// Every other element of a larger storage (stride 2 in the last dim, any rank >= 1).
    Stepped,
    /// Stored with the first dim 1, then broadcast (stride 0).
    Broadcast,
}

fn layout() -> impl Strategy<Value = Layout> {
    prop_oneof![
        Just(Layout::Contiguous),
        Just(Layout::Transposed),
        Just(Layout::Narrowed),
        Just(Layout::RowStrided),
        Just(Layout::Stepped),
        Just(Layout::Broadcast),
    ]
}

/// One argument: the Var its values live in (gradients are taken there) and the view.
struct Arg {
    base: Var,
    view: Tensor,
}

/// `shape` laid out as `l`, of type `dt`, with `seed`'s values (exact in every type).
fn arg(shape: &[usize], l: Layout, dt: DType, seed: u64) -> Arg {
    let r = shape.len();
    let l = match l {
        _ if r == 0 => Layout::Contiguous,
        Layout::Transposed | Layout::RowStrided if r < 2 => Layout::Stepped,
        l => l,
    };
    let mut stored = shape.to_vec();
    match l {
        Layout::Contiguous => {}
        Layout::Transposed => stored.swap(r - 2, r - 1),
        Layout::Narrowed => stored[0] += 2,
        Layout::RowStrided => stored[r - 1] *= 2,
        Layout::Stepped => stored.push(2),
        Layout::Broadcast => stored[0] = 1,
    }
    let n: usize = stored.iter().product();
    let t = Tensor::from_vec(values(n, seed), stored.as_slice(), &dev())
        .and_then(|t| t.to_dtype(dt))
        .unwrap();
    let base = Var::from_tensor(&t).unwrap();
    let b = base.as_tensor();
    let view = match l {
        Layout::Contiguous => Ok(b.clone()),
        Layout::Transposed => b.transpose(r - 2, r - 1),
        Layout::Narrowed => b.narrow(0, 1, shape[0]),
        Layout::RowStrided => b.narrow(r - 1, 0, shape[r - 1]),
        Layout::Stepped => b.narrow(r, 1, 1).and_then(|t| t.squeeze(r)),
        Layout::Broadcast => b.broadcast_as(shape),
    }
    .unwrap();
    assert_eq!(view.dims(), shape);
    Arg { base, view }
}

/// An argument's shape, layout and type.
type Spec = (Vec<usize>, Layout, DType);

/// Tolerance for results of type `dt` (relative to the largest value plus one).
fn tol(dt: DType) -> f32 {
    match dt {
        DType::F32 => 2e-5,
        DType::F16 => 1e-2,
        _ => 5e-2,
    }
}

/// The values as f32, in row-major order (copied first: an empty view may start past the
/// end of its storage, which `to_vec1` would slice).
fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.force_contiguous())
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .unwrap()
}

fn close(what: &str, got: &Tensor, want: &Tensor, tol: f32) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.dims(), want.dims(), "{}: shapes", what);
    prop_assert_eq!(got.dtype(), want.dtype(), "{}: types", what);
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
        prop_assert!(ok, "{}: element {} is {} where the fallback gives {}", what, i, a, b);
    }
    Ok(())
}

/// The gradients of `sum(out * c)` at each argument's Var (all dtypes f32, flattened and
/// joined; zeros where the output does not depend on one).
fn grads(out: &Tensor, c: &Tensor, args: &[Arg]) -> std::result::Result<Vec<Tensor>, String> {
    let e = |e: candle_core::Error| e.to_string();
    let l = (out.to_dtype(DType::F32).map_err(e)? * c)
        .and_then(|t| t.sum_all())
        .map_err(e)?;
    let g = l.backward().map_err(e)?;
    args.iter()
        .map(|a| match g.get(a.base.as_tensor()) {
            Some(t) => Ok(t.clone()),
            None => a.base.zeros_like().map_err(e),
        })
        .collect()
}

/// `f` on the fast path and inside `kernels::plain()`, on the same arguments: the same result
/// (shape, type, values) and the same gradients at every argument, or both fail.
fn agree(
    what: &str,
    isa: Isa,
    specs: &[Spec],
    seed: u64,
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> Result<(), TestCaseError> {
    CASES.with(|c| c.set(c.get() + 1));
    let what = format!("{what} {isa:?} {specs:?}");
    let args: Vec<Arg> = specs
        .iter()
        .enumerate()
        .map(|(i, (s, l, dt))| arg(s, *l, *dt, seed + i as u64))
        .collect();
    let views: Vec<Tensor> = args.iter().map(|a| a.view.clone()).collect();
    let fast = match guarded(|| f(&views).map_err(|e| e.to_string())) {
        Ok(r) => r,
        Err(p) => return Err(TestCaseError::fail(format!("{what}: panicked: {p}"))),
    };
    let slow = quietly(|| {
        let _p = kernels::plain();
        f(&views).map_err(|e| e.to_string())
    });
    let (fast, slow) = match (fast, slow) {
        (Ok(a), Ok(Ok(b))) => (a, b),
        (Err(_), Ok(Err(_))) | (_, Err(_)) => {
            ALIKE.with(|a| a.set((a.get().0 + 1, a.get().1)));
            return Ok(());
        }
        (Ok(a), Ok(Err(e))) => {
            return Err(TestCaseError::fail(format!(
                "{what}: gives shape {:?} where the fallback fails: {e}",
                a.dims()
            )));
        }
        (Err(e), Ok(Ok(b))) => {
            return Err(TestCaseError::fail(format!(
                "{what}: fails ({e}) where the fallback gives shape {:?}",
                b.dims()
            )));
        }
    };
    // The least precise type involved bounds the difference (a bf16 input with f32 norm
    // weights: the fallback's weight gradient went through bf16).
    let loose = specs.iter().map(|s| tol(s.2)).fold(tol(slow.dtype()), f32::max);
    close(&what, &fast, &slow, loose)?;
    let c = Tensor::from_vec(values(slow.elem_count(), seed ^ 0xC0FFEE), slow.shape(), &dev()).unwrap();
    let g_fast = quietly(|| grads(&fast, &c, &args));
    let g_slow = quietly(|| {
        let _p = kernels::plain();
        grads(&slow, &c, &args)
    });
    // A panic in the fast path's backward fails, unless candle's own backward panics there too
    // (an op that returns its input, as a cast to the same type, has candle's graph only).
    let (g_fast, g_slow) = match (g_fast, g_slow) {
        (Ok(g), Ok(w)) => (g, w),
        (Err(p), Ok(_)) => {
            let p = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            return Err(TestCaseError::fail(format!("{what}: backward panicked: {p:?}")));
        }
        (_, Err(_)) => {
            ALIKE.with(|a| a.set((a.get().0, a.get().1 + 1)));
            return Ok(());
        }
    };
    match (g_fast, g_slow) {
        (Ok(g), Ok(w)) => {
            for (i, ((g, w), a)) in g.iter().zip(&w).zip(&args).enumerate() {
                // A gradient comes back in its argument's type on both paths.
                prop_assert_eq!(g.dtype(), a.base.dtype(), "{} gradient {}: type", what, i);
                close(&format!("{what} gradient {i}"), g, w, 2.0 * loose)?;
            }
            Ok(())
        }
        (Err(e), Ok(_)) => Err(TestCaseError::fail(format!(
            "{what}: backward fails ({e}) where the fallback's works"
        ))),
        (Ok(_), Err(e)) => Err(TestCaseError::fail(format!(
            "{what}: backward works where the fallback's fails ({e})"
        ))),
        (Err(_), Err(_)) => {
            ALIKE.with(|a| a.set((a.get().0, a.get().1 + 1)));
            Ok(())
        }
    }
}

thread_local! {
    /// Checks where both paths failed alike (nothing to compare), by stage.
    static ALIKE: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
    /// Set while [`quietly`] runs on this thread.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, catching a panic without printing it: for candle's fallback, which panics on
/// some empty views (thousands of expected messages otherwise). Panics on other threads, and
/// outside `quietly`, print as before.
fn quietly<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(|q| q.get()) {
                prev(info)
            }
        }))
    });
    QUIET.with(|q| q.set(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(false));
    r
}

/// Lifts the forced tier when dropped (also when a case fails).
struct Unforce;

impl Drop for Unforce {
    fn drop(&mut self) {
        kernels::force_isa(None);
    }
}

/// One case's draw: shapes and layouts for every op.
#[derive(Debug, Clone)]
struct Draw {
    /// Products: batch dims of each side, then m, k, n.
    batch: (Vec<usize>, Vec<usize>),
    mkn: (usize, usize, usize),
    /// linear: lead dims of x; whether there is a bias, and whether it has one value
    /// (broadcast to the n outputs) instead of n.
    lead: Vec<usize>,
    bias: (bool, bool),
    /// Norms: whether the weight and bias are present, and f32 (O2 masters) or the input's
    /// type.
    affine: (bool, bool, bool),
    /// Softmax: causal (square last dims), and the output type f32 or the input's.
    causal: bool,
    wide_out: bool,
    layouts: [Layout; 3],
    seed: u64,
}

fn draw() -> impl Strategy<Value = Draw> {
    (
        super::batch_pair(),
        (dim(), dim(), dim()),
        prop::collection::vec(dim(), 0..3),
        (any::<bool>(), any::<bool>()),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        (any::<bool>(), any::<bool>()),
        [layout(), layout(), layout()],
        any::<u32>(),
    )
        .prop_map(
            |(batch, mkn, lead, bias, affine, (causal, wide_out), layouts, seed)| Draw {
                batch,
                mkn,
                lead,
                bias,
                affine,
                causal,
                wide_out,
                layouts,
                seed: seed as u64,
            },
        )
}

/// Every kernel of one case, at one tier and one type.
fn case(d: &Draw, isa: Isa, dt: DType) -> Result<(), TestCaseError> {
    let [la, lb, lc] = d.layouts;
    let seed = d.seed;
    let (m, k, n) = d.mkn;
    let with = |mut dims: Vec<usize>, tail: &[usize]| {
        dims.extend_from_slice(tail);
        dims
    };
    // Products: both sides.
    let (sa, sb) = (with(d.batch.0.clone(), &[m, k]), with(d.batch.1.clone(), &[k, n]));
    let specs = [(sa, la, dt), (sb, lb, dt)];
    agree("kernels::matmul", isa, &specs, seed, |x| kernels::matmul(&x[0], &x[1]))?;
    agree("ops::matmul", isa, &specs, seed, |x| ops::matmul(&x[0], &x[1]))?;
    // linear: x, weight and bias, each laid out its own way.
    let mut specs = vec![(with(d.lead.clone(), &[k]), la, dt), (vec![n, k], lb, dt)];
    if d.bias.0 {
        specs.push((vec![if d.bias.1 { 1 } else { n }], lc, dt));
    }
    agree("kernels::linear", isa, &specs, seed, |x| {
        kernels::linear(&x[0], &x[1], x.get(2))
    })?;
    agree("ops::linear", isa, &specs, seed, |x| {
        ops::linear(&x[0], &x[1], x.get(2))
    })?;
    // Element-wise: any rank, any layout.
    let sx = with(d.lead.clone(), &[m, n]);
    let one = [(sx.clone(), la, dt)];
    agree("kernels::relu", isa, &one, seed, |x| kernels::relu(&x[0]))?;
    agree("ops::relu", isa, &one, seed, |x| ops::relu(&x[0]))?;
    agree("kernels::gelu", isa, &one, seed, |x| kernels::gelu(&x[0]))?;
    agree("ops::gelu", isa, &one, seed, |x| ops::gelu(&x[0]))?;
    for to in [DType::F32, DType::F16, DType::BF16] {
        agree("kernels::cast", isa, &one, seed, |x| kernels::cast(&x[0], to))?;
    }
    // Norms: the last dim may be empty; weight and bias of either type, any layout.
    let (has_w, has_b, masters) = d.affine;
    let pt = if masters { DType::F32 } else { dt };
    let mut specs = vec![(sx.clone(), la, dt)];
    if has_w {
        specs.push((vec![n], lb, pt));
    }
    if has_b {
        specs.push((vec![n], lc, pt));
    }
    let (w, b) = (has_w.then_some(1), has_b.then_some(1 + has_w as usize));
    agree("kernels::layer_norm", isa, &specs, seed, |x| {
        kernels::layer_norm(&x[0], w.map(|i| &x[i]), b.map(|i| &x[i]), 1e-5)
    })?;
    agree("ops::layer_norm", isa, &specs, seed, |x| {
        ops::layer_norm(&x[0], w.map(|i| &x[i]), b.map(|i| &x[i]), 1e-5)
    })?;
    let rms = &specs[..1 + has_w as usize];
    agree("kernels::rms_norm", isa, rms, seed, |x| {
        kernels::rms_norm(&x[0], w.map(|i| &x[i]), 1e-5)
    })?;
    agree("ops::rms_norm", isa, rms, seed, |x| {
        ops::rms_norm(&x[0], w.map(|i| &x[i]), 1e-5)
    })?;
    // Softmax, plain or causal (square trailing dims), into f32 or the input's type.
    let out = if d.wide_out { DType::F32 } else { dt };
    let ss = if d.causal { with(d.lead.clone(), &[n, n]) } else { sx };
    agree("kernels::scaled_softmax", isa, &[(ss, la, dt)], seed, |x| {
        kernels::scaled_softmax(&x[0], 0.5, d.causal, out)
    })
}

/// Every kernel's fast path equals its fallback, on every tier this CPU has and in every
/// type.
#[test]
fn fast_paths_equal_their_fallbacks_on_every_tier() {
    let before = CASES.with(|c| c.get());
    let tiers: Vec<Isa> = Isa::ALL.into_iter().filter(|i| *i <= kernels::detected_isa()).collect();
    runner()
        .run(&draw(), |d| {
            let _unforce = Unforce;
            for &isa in &tiers {
                kernels::force_isa(Some(isa));
                for dt in [DType::F32, DType::F16, DType::BF16] {
                    case(&d, isa, dt)?;
                }
            }
            Ok(())
        })
        .unwrap();
    let (fwd, bwd) = ALIKE.with(|a| a.get());
    eprintln!(
        "shapes: fast paths: {} op checks passed ({} tiers; both paths failed alike in {fwd} \
         forwards and {bwd} backwards)",
        CASES.with(|c| c.get()) - before,
        tiers.len()
    );
}
