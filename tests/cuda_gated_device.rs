//! The library's CUDA paths through `src/kernels/cuda/gated.cu` against its CPU paths, under
//! `CANDLE_AMP_TEST_DEVICE=cuda` (on the CPU these tests return at once; the kernels
//! themselves are checked without a GPU in `tests/cuda_gated.rs`): `nn::GatedMlp` for each
//! activation (the product kernel between the projections) and GELU's tanh form, values and
//! gradients.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use candle_core::{DType, Device, Module, Tensor, Var};

use cuda_emu::values;

/// Seeded values in [-5, 5) after the tails and zeros.
fn inputs(n: usize, seed: u64) -> Vec<f64> {
    let mut v = vec![0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 1e-4, -1e-4];
    v.extend(values(n, seed, 5.0));
    v.truncate(n);
    v
}

/// Values of `t` on the host as f32.
fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `b` against `a` within `rt` relative to the larger of the value and a tenth of the
/// result's largest (sums of products cancel), and 1e-5 absolute.
fn close(what: &str, a: &[f32], b: &[f32], rt: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let m = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 + rt * x.abs().max(0.1 * m),
            "{what}[{i}]: {y} (CUDA) vs {x} (CPU)"
        );
    }
}

fn var(v: &[f64], shape: &[usize], dt: DType, dev: &Device) -> Var {
    let t = Tensor::from_vec(v.iter().map(|x| *x as f32).collect::<Vec<_>>(), shape, dev).unwrap();
    Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap()
}

/// `loss = Σ y * c` (in f32) backward: the gradients of `vars`, each in its own type.
fn grads_of(y: &Tensor, cv: &[f64], vars: &[&Var]) -> Vec<Vec<f32>> {
    let c = Tensor::from_vec(cv.iter().map(|v| *v as f32).collect::<Vec<_>>(), y.shape(), y.device()).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * c).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    vars.iter()
        .map(|v| {
            let t = g.get(v.as_tensor()).unwrap();
            assert_eq!(t.dtype(), v.dtype());
            host(t)
        })
        .collect()
}

/// `nn::GatedMlp` on CUDA (gate and up products, then the product kernel, then down) against
/// the CPU path (the unfused ops outside a run): the output and the gradients of the input,
/// the weights and the biases, for SiLU, GELU and ReLU, in f32, f16 and bf16 and at O1-style
/// autocast (f32 parameters; GELU's activation and the product in f32 there).
#[test]
fn cuda_gated_mlp_matches_the_cpu_path() {
    use candle_amp::nn::{GateActivation, GatedMlp, Linear};
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_gated_loaded(&dev),
        "the CUDA pointwise kernels did not load (see the log's warning)"
    );
    let (batch, rows, d, hidden) = (3, 13, 64, 171);
    let xv = values(batch * rows * d, 1, 2.0);
    let wv: Vec<Vec<f64>> = (0..3).map(|i| values(hidden * d, 2 + i, 0.2)).collect();
    let bv: Vec<Vec<f64>> = (0..3).map(|i| values(hidden.max(d), 5 + i, 0.5)).collect();
    let cv = values(batch * rows * d, 9, 1.0);
    for act in [GateActivation::Silu, GateActivation::Gelu, GateActivation::Relu] {
        for (dt, autocast) in [
            (DType::F32, None),
            (DType::F16, None),
            (DType::BF16, None),
            (DType::F32, Some(DType::F16)),
            (DType::F32, Some(DType::BF16)),
        ] {
            let run = |dv: &Device| {
                let x = var(&xv, &[batch, rows, d], dt, dv);
                let shapes = [[hidden, d], [hidden, d], [d, hidden]];
                let ws: Vec<Var> = (0..3).map(|i| var(&wv[i], &shapes[i], dt, dv)).collect();
                let bs: Vec<Var> = (0..3)
                    .map(|i| var(&bv[i][..shapes[i][0]], &shapes[i][..1], dt, dv))
                    .collect();
                let lin = |i: usize| Linear::new(ws[i].as_tensor().clone(), Some(bs[i].as_tensor().clone()));
                let mlp = GatedMlp::new(lin(0), lin(1), lin(2), act);
                let y = {
                    let _s = autocast.map(candle_amp::autocast::scope);
                    mlp.forward(x.as_tensor()).unwrap()
                };
                assert_eq!(y.dtype(), autocast.unwrap_or(dt));
                let mut vars = vec![&x];
                vars.extend(ws.iter().chain(&bs));
                let mut out = vec![host(&y)];
                out.extend(grads_of(&y, &cv, &vars));
                out
            };
            let (c, gpu) = (run(&Device::Cpu), run(&dev));
            let rt = 2.0 * common::tol(autocast.unwrap_or(dt));
            let names = ["y", "dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down"];
            for (name, (a, b)) in names.iter().zip(c.iter().zip(&gpu)) {
                close(&format!("{act:?} {dt:?} autocast {autocast:?} {name}"), a, b, rt);
            }
        }
    }
}

/// SiLU and GELU in both forms on CUDA (one kernel each way) against the CPU path, through
/// `kernels::{silu, gelu, gelu_tanh}` and `ops::{silu, gelu, gelu_tanh}` (f32 under
/// autocast): values and gradients, the tails included.
#[test]
fn cuda_activations_match_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(candle_amp::testing::cuda_gated_loaded(&dev));
    type F = fn(&Tensor) -> candle_core::Result<Tensor>;
    let acts: [(&str, F, F); 3] = [
        ("gelu_tanh", candle_amp::kernels::gelu_tanh, candle_amp::ops::gelu_tanh),
        ("gelu", candle_amp::kernels::gelu, candle_amp::ops::gelu),
        ("silu", candle_amp::kernels::silu, candle_amp::ops::silu),
    ];
    let n = 5000;
    let xv = inputs(n, 3);
    let cv = values(n, 4, 1.0);
    for (name, kernel, op) in acts {
        for (dt, autocast) in [
            (DType::F32, None),
            (DType::F16, None),
            (DType::BF16, None),
            (DType::F16, Some(DType::F16)),
            (DType::BF16, Some(DType::BF16)),
        ] {
            let run = |dv: &Device| {
                let x = var(&xv, &[n], dt, dv);
                let y = match autocast {
                    Some(h) => {
                        let _s = candle_amp::autocast::scope(h);
                        op(x.as_tensor()).unwrap()
                    }
                    None => kernel(x.as_tensor()).unwrap(),
                };
                let mut out = vec![host(&y)];
                out.extend(grads_of(&y, &cv, &[&x]));
                (y.dtype(), out)
            };
            let ((ct, c), (gt, gpu)) = (run(&Device::Cpu), run(&dev));
            assert_eq!(ct, gt, "{name} {dt:?} autocast {autocast:?}: the output's type");
            let rt = 2.0 * common::te_rtol(ct);
            for (part, (a, b)) in ["y", "dx"].iter().zip(c.iter().zip(&gpu)) {
                close(&format!("{name} {dt:?} autocast {autocast:?} {part}"), a, b, rt);
            }
        }
    }
}
