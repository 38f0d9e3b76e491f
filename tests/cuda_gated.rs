//! The CUDA pointwise kernels without a GPU: `src/kernels/cuda/gated.cu` (a gated MLP's
//! product `act(g) * u` and an activation alone, forward and backward, for SiLU, GELU in both
//! forms and ReLU), unmodified, built with g++ against the CPU grid emulator
//! (`tests/cuda_emu/emu.h`) and launched as the library's plan launches them on a GPU, checked
//! against references computed here in f64 with llm.c's rule: every value within
//! `atol + |ref| * eps` of its type plus the f32 arithmetic's own error, bounded per
//! activation. ReLU's product is checked exactly against the CPU path's ops (the library's
//! `ops::relu` and candle's casts and `mul`, forward and backward). Needs g++ (C++20). The
//! library's CUDA paths against its CPU paths on a GPU: `tests/cuda_gated_device.rs`.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;

use candle_amp::testing::cuda_gated::{PointAct, act_plan, gated_plan};
use candle_core::{DType, Device, Tensor, Var};

use cuda_emu::{atol, cdf, decode, encode, eps, pdf, values};

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const ACTS: [PointAct; 4] = [PointAct::Silu, PointAct::Gelu, PointAct::GeluTanh, PointAct::Relu];
/// Lengths: one value, a partial block, a block and one past it, several blocks.
const SIZES: [usize; 5] = [1, 7, 256, 257, 3001];

fn run(args: &[String]) {
    cuda_emu::run("gated", args)
}

/// σ(z) and 1 - σ(z), each without cancellation.
fn sigmoid(z: f64) -> (f64, f64) {
    let e = (-z).exp();
    (1.0 / (1.0 + e), if e.is_infinite() { 1.0 } else { e / (1.0 + e) })
}
/// `2 √(2/π) (x + 0.044715 x³)`: the tanh form's argument, doubled.
fn two_v(x: f64) -> f64 {
    2.0 * (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)
}

/// The activation in f64 (GELU tanh as PyTorch writes it, `x/2 (1 + tanh v)`).
fn act64(act: PointAct, x: f64) -> f64 {
    match act {
        PointAct::Silu => x * sigmoid(x).0,
        PointAct::Gelu => x * cdf(x),
        PointAct::GeluTanh => 0.5 * x * (1.0 + (two_v(x) / 2.0).tanh()),
        _ => x.max(0.0),
    }
}

/// Its derivative in f64 (0 at 0 for ReLU, as PyTorch).
fn grad64(act: PointAct, x: f64) -> f64 {
    match act {
        PointAct::Silu => {
            let (s, r) = sigmoid(x);
            s * (1.0 + x * r)
        }
        PointAct::Gelu => cdf(x) + x * pdf(x),
        PointAct::GeluTanh => {
            let t = (two_v(x) / 2.0).tanh();
            let dv = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x);
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dv
        }
        _ => f64::from(u8::from(x > 0.0)),
    }
}

/// The absolute error of the kernel's f32 activation at `x` (held exactly): its libm calls
/// (expf, erfcf) within an ulp or two, its roundings, the rounding of its constants and of
/// the exponent's argument, which the exponential turns into relative error.
fn act_err(act: PointAct, x: f64) -> f64 {
    let y = act64(act, x).abs();
    match act {
        PointAct::Silu => y * 1e-6,
        PointAct::Gelu => y * 2e-6 + grad64(act, x).abs() * x.abs() * 6e-8,
        PointAct::GeluTanh => {
            let z = two_v(x);
            y * (sigmoid(z).1 * (z.abs() * 5e-7 + 2.4e-7) + 3e-7)
        }
        _ => 0.0,
    }
}

/// The absolute error of the kernel's f32 derivative at `x` (where the derivative crosses
/// zero, SiLU's and GELU's near -1.28 and -0.75, the terms' errors count, not the sum's).
fn grad_err(act: PointAct, x: f64) -> f64 {
    let g = grad64(act, x).abs();
    match act {
        PointAct::Silu => {
            let (s, r) = sigmoid(x);
            s * ((x * r).abs() * 1e-6 + 1e-7) + g * 5e-7
        }
        PointAct::Gelu => (cdf(x) + (x * pdf(x)).abs()) * 2e-6 + (pdf(x) * (2.0 - x * x) * x).abs() * 6e-8,
        PointAct::GeluTanh => {
            let z = two_v(x);
            let (s, r) = sigmoid(z);
            let dv = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x);
            let t2 = (2.0 * x * s * r * dv).abs();
            s * (r * z.abs() * 5e-7 + 3e-7) + t2 * (z.abs() * 5e-7 + 1e-6) + g * 1.2e-7
        }
        _ => 0.0,
    }
}

/// Inputs: the tails (saturated exponentials), zeros of both signs, tiny values, SiLU's and
/// GELU's derivative zeros, then seeded values in [-5, 5).
fn inputs(n: usize, seed: u64) -> Vec<f64> {
    let mut v = vec![
        0.0,
        -0.0,
        30.0,
        -30.0,
        100.0,
        -100.0,
        1e-4,
        -1e-4,
        -1.278_464_5,
        -0.751_791_5,
    ];
    v.extend(values(n, seed, 5.0));
    v.truncate(n);
    v
}

/// `(t, a, p)` of every gated kernel: the activation in t or f32, the product in t or f32,
/// never narrower than the activation.
fn gated_types() -> Vec<(DType, DType, DType)> {
    let mut v = Vec::new();
    for t in TYPES {
        for (a, p) in [(t, t), (t, DType::F32), (DType::F32, DType::F32)] {
            if !v.contains(&(t, a, p)) {
                v.push((t, a, p));
            }
        }
    }
    v
}

/// The bytes of `v` in `dt`, written to `dir/name`; the values they hold.
fn put(dir: &Path, name: &str, v: &[f64], dt: DType) -> (String, Vec<f64>) {
    let (bytes, held) = encode(v, dt);
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    (p.to_str().unwrap().to_string(), held)
}

fn get(path: &str, dt: DType) -> Vec<f64> {
    decode(&std::fs::read(path).unwrap(), dt)
}

fn check(what: &str, got: f64, want: f64, bound: f64) {
    let err = (got - want).abs();
    assert!(err <= bound, "{what}: {got} vs {want} (error {err:e} > {bound:e})");
}

fn held(v: f64, dt: DType) -> f64 {
    encode(&[v], dt).1[0]
}

/// What one gated case held and returned, as f64: inputs `g`, `u` (t), `dy` (p); outputs
/// `y` (p), `dg`, `du` (t).
struct Gated {
    g: Vec<f64>,
    u: Vec<f64>,
    dy: Vec<f64>,
    y: Vec<f64>,
    dg: Vec<f64>,
    du: Vec<f64>,
}

/// One gated product, forward and backward, on the emulator.
fn gated_run(n: usize, act: PointAct, (t, a, p): (DType, DType, DType), seed: u64, dir: &Path) -> Gated {
    let plan = gated_plan(n, act, t, a, p).expect("a plan");
    let s = |v: &dyn ToString| v.to_string();
    let (gp, g) = put(dir, "g", &inputs(n, seed), t);
    let (up, u) = put(dir, "u", &values(n, seed + 1, 3.0), t);
    let (dyp, dy) = put(dir, "dy", &values(n, seed + 2, 2.0), p);
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let f = &plan.forward;
    run(&[
        s(&"gated_fwd"),
        s(&f.kernel),
        s(&f.grid),
        s(&f.block),
        s(&n),
        gp.clone(),
        up.clone(),
        path("y"),
    ]);
    let b = &plan.backward;
    run(&[
        s(&"gated_bwd"),
        s(&b.kernel),
        s(&b.grid),
        s(&b.block),
        s(&n),
        gp,
        up,
        dyp,
        path("dg"),
        path("du"),
    ]);
    Gated {
        g,
        u,
        dy,
        y: get(&path("y"), p),
        dg: get(&path("dg"), t),
        du: get(&path("du"), t),
    }
}

/// One gated case against f64: y = act(g) u, dg = dy u act'(g), du = dy act(g), each within
/// the roundings the kernel makes (the activation to `a`, the product and its gradients to
/// `p`, the gradients to `t`) and the activation's f32 error. Where the activation is half
/// and the product f32, the product of two exact values: y / u is a value of `a`, exactly.
fn gated_case(n: usize, act: PointAct, types: (DType, DType, DType), seed: u64, dir: &Path) {
    let (t, a, p) = types;
    let what = format!("{} n {n} {t:?} {a:?} {p:?}", act.name());
    let r = gated_run(n, act, types, seed, dir);
    // P's own rounding where it is not t's (f32 after f32 arithmetic: at most half an ulp).
    let p_eps = if p == t { 0.0 } else { eps(p) };
    for i in 0..n {
        let (g, u, dy) = (r.g[i], r.u[i], r.dy[i]);
        let (av, gv) = (act64(act, g), grad64(act, g));
        let a_err = (atol(a) + av.abs() * eps(a) + act_err(act, g)) * 1.01;
        let want = av * u;
        let bound = (atol(p) + want.abs() * eps(p)) * 1.01 + u.abs() * a_err;
        check(&format!("{what} y[{i}] (g {g})"), r.y[i], want, bound);
        if a != DType::F32 && p == DType::F32 && u != 0.0 {
            let q = r.y[i] / u;
            assert_eq!(held(q, a), q, "{what} y[{i}]: the activation is not rounded to {a:?}");
        }
        let want = dy * av;
        let bound = (atol(t) + want.abs() * (eps(t) + p_eps)) * 1.01 + dy.abs() * a_err;
        check(&format!("{what} du[{i}] (g {g})"), r.du[i], want, bound);
        let da = dy * u;
        let a_eps = if a == p { 0.0 } else { eps(p) };
        let da_err = (atol(a) + da.abs() * (eps(a) + a_eps)) * 1.01;
        let want = da * gv;
        let bound = (atol(t) + want.abs() * eps(t)) * 1.01 + gv.abs() * da_err + da.abs() * grad_err(act, g) * 1.01;
        check(&format!("{what} dg[{i}] (g {g})"), r.dg[i], want, bound);
    }
}

#[test]
fn gated_products_forward_and_backward_on_the_emulator() {
    let dir = cuda_emu::scratch("gated", "gated");
    for (k, &n) in SIZES.iter().enumerate() {
        for (j, act) in ACTS.into_iter().enumerate() {
            for (m, types) in gated_types().into_iter().enumerate() {
                gated_case(n, act, types, (100 * k + 10 * j + m) as u64, &dir);
            }
        }
    }
}

/// The values of `v` (held in `dt`) as a CPU tensor of `dt`.
fn cpu_tensor(v: &[f64], dt: DType) -> Tensor {
    let t = Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap();
    t.to_dtype(dt).unwrap()
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// ReLU's product is exact arithmetic rounded where the unfused ops round: the kernels give
/// the CPU path's values exactly, forward and backward (the library's `ops::relu`, then
/// candle's casts to the activation's and the product's types and its `mul`; the gradients
/// through candle's backward of them), zeros of both signs among the gate's values. Equal as
/// values: the CPU's half ReLU turns -0 into +0, its f32 one and PyTorch's (and the kernel)
/// keep -0, so a zero's sign may differ.
#[test]
fn the_relu_product_is_the_cpu_paths_exactly() {
    let dir = cuda_emu::scratch("gated", "relu");
    for (m, (t, a, p)) in gated_types().into_iter().enumerate() {
        let r = gated_run(3001, PointAct::Relu, (t, a, p), 7 + m as u64, &dir);
        let (g, u) = (
            Var::from_tensor(&cpu_tensor(&r.g, t)).unwrap(),
            Var::from_tensor(&cpu_tensor(&r.u, t)).unwrap(),
        );
        let act = candle_amp::ops::relu(g.as_tensor()).unwrap().to_dtype(a).unwrap();
        let y = (act.to_dtype(p).unwrap() * u.as_tensor().to_dtype(p).unwrap()).unwrap();
        let dy = cpu_tensor(&r.dy, DType::F32);
        let grads = (y.to_dtype(DType::F32).unwrap() * dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let what = format!("{t:?} {a:?} {p:?}");
        assert_eq!(as_f64(&y), r.y, "{what}: y");
        assert_eq!(as_f64(grads.get(g.as_tensor()).unwrap()), r.dg, "{what}: dg");
        assert_eq!(as_f64(grads.get(u.as_tensor()).unwrap()), r.du, "{what}: du");
    }
}

/// One activation, forward and backward, on the emulator against f64 (ReLU exactly).
fn act_case(n: usize, act: PointAct, t: DType, seed: u64, dir: &Path) {
    let plan = act_plan(n, act, t).expect("a plan");
    let what = format!("{} n {n} {t:?}", act.name());
    let s = |v: &dyn ToString| v.to_string();
    let (xp, x) = put(dir, "x", &inputs(n, seed), t);
    let (dyp, dy) = put(dir, "dy", &values(n, seed + 1, 2.0), t);
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let (f, b) = (&plan.forward, &plan.backward);
    run(&[
        s(&"act_fwd"),
        s(&f.kernel),
        s(&f.grid),
        s(&f.block),
        s(&n),
        xp.clone(),
        path("y"),
    ]);
    run(&[
        s(&"act_bwd"),
        s(&b.kernel),
        s(&b.grid),
        s(&b.block),
        s(&n),
        xp,
        dyp,
        path("dx"),
    ]);
    let (y, dx) = (get(&path("y"), t), get(&path("dx"), t));
    for i in 0..n {
        let want = act64(act, x[i]);
        let bound = (atol(t) + want.abs() * eps(t) + act_err(act, x[i])) * 1.01;
        check(&format!("{what} y[{i}] (x {})", x[i]), y[i], want, bound);
        let want = dy[i] * grad64(act, x[i]);
        let bound = (atol(t) + want.abs() * eps(t) + dy[i].abs() * grad_err(act, x[i])) * 1.01;
        check(&format!("{what} dx[{i}] (x {})", x[i]), dx[i], want, bound);
        if act == PointAct::Relu {
            assert_eq!(y[i].to_bits(), want_relu(x[i]).to_bits(), "{what} y[{i}]");
            assert_eq!(dx[i], if x[i] > 0.0 { dy[i] } else { 0.0 }, "{what} dx[{i}]");
        }
    }
}

/// `max(x, 0)` with -0 kept, as PyTorch's `relu`.
fn want_relu(x: f64) -> f64 {
    if x < 0.0 { 0.0 } else { x }
}

#[test]
fn activations_forward_and_backward_on_the_emulator() {
    let dir = cuda_emu::scratch("gated", "act");
    for (k, &n) in SIZES.iter().enumerate() {
        for (j, act) in ACTS.into_iter().enumerate() {
            for (m, t) in TYPES.into_iter().enumerate() {
                act_case(n, act, t, (100 * k + 10 * j + m) as u64, &dir);
            }
        }
    }
}

/// A NaN gate or input stays NaN through every activation and product (the loss scaler must
/// see an overflow), in every type.
#[test]
fn nan_stays_nan() {
    let dir = cuda_emu::scratch("gated", "nan");
    let s = |v: &dyn ToString| v.to_string();
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    for act in ACTS {
        for t in TYPES {
            let (xp, _) = put(&dir, "x", &[f64::NAN, 1.0], t);
            let (up, _) = put(&dir, "u", &[2.0, 2.0], t);
            let a = act_plan(2, act, t).unwrap();
            let f = &a.forward;
            run(&[
                s(&"act_fwd"),
                s(&f.kernel),
                s(&f.grid),
                s(&f.block),
                s(&2),
                xp.clone(),
                path("y"),
            ]);
            let g = gated_plan(2, act, t, t, t).unwrap();
            let f = &g.forward;
            run(&[
                s(&"gated_fwd"),
                s(&f.kernel),
                s(&f.grid),
                s(&f.block),
                s(&2),
                xp,
                up,
                path("p"),
            ]);
            for out in ["y", "p"] {
                let v = get(&path(out), t);
                assert!(v[0].is_nan() && v[1].is_finite(), "{} {t:?} {out}: {v:?}", act.name());
            }
        }
    }
}

/// Past the grid's cap (4096 blocks of 256) each thread takes several values: every one is
/// written and right.
#[test]
fn a_tensor_past_the_grid_cap_is_covered() {
    let dir = cuda_emu::scratch("gated", "large");
    let n = 4096 * 256 * 2 + 13;
    let plan = act_plan(n, PointAct::GeluTanh, DType::BF16).unwrap();
    assert_eq!((plan.forward.grid, plan.forward.block), (4096, 256));
    act_case(n, PointAct::GeluTanh, DType::BF16, 1, &dir);
    gated_case(n, PointAct::Silu, (DType::BF16, DType::BF16, DType::BF16), 2, &dir);
}

#[test]
fn plans_name_their_kernels_and_refuse_what_has_none() {
    for n in [1, 255, 256, 257, 1 << 20, (1 << 20) + 1, 1 << 31] {
        let p = gated_plan(n, PointAct::GeluTanh, DType::F16, DType::F32, DType::F32).unwrap();
        assert_eq!(p.forward.kernel, "amp_gated_fwd_gelu_tanh_f16_f32_f32");
        assert_eq!(p.backward.kernel, "amp_gated_bwd_gelu_tanh_f16_f32_f32");
        let (grid, block) = (p.forward.grid as usize, p.forward.block as usize);
        assert_eq!((p.backward.grid, p.backward.block), (p.forward.grid, p.forward.block));
        // Every value has a thread, or the grid is at its cap and the threads loop.
        assert!(grid * block >= n || grid == 4096, "{n}: {grid} x {block}");
        assert!(grid * block < n + block, "{n}: a block with nothing to do");
        let a = act_plan(n, PointAct::Silu, DType::BF16).unwrap();
        assert_eq!(
            (a.forward.kernel.as_str(), a.backward.kernel.as_str()),
            ("amp_act_fwd_silu_bf16", "amp_act_bwd_silu_bf16")
        );
        assert_eq!((a.forward.grid, a.forward.block), (p.forward.grid, p.forward.block));
    }
    // Empty tensors and types without a kernel: the unfused ops run.
    assert!(gated_plan(0, PointAct::Silu, DType::F32, DType::F32, DType::F32).is_none());
    assert!(act_plan(0, PointAct::GeluTanh, DType::F16).is_none());
    assert!(act_plan(5, PointAct::GeluTanh, DType::F64).is_none());
    assert!(gated_plan(5, PointAct::Relu, DType::F16, DType::BF16, DType::F32).is_none());
    assert!(gated_plan(5, PointAct::Relu, DType::F16, DType::F16, DType::BF16).is_none());
    assert!(gated_plan(5, PointAct::Relu, DType::F16, DType::F32, DType::F16).is_none());
    assert!(gated_plan(5, PointAct::Relu, DType::F64, DType::F64, DType::F64).is_none());
}
