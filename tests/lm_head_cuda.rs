//! The LM head's chunked node for CUDA devices (`src/kernels/lm_head_chunked.rs`), without a
//! GPU: the node is written with device-generic tensor ops, so the testing switch
//! (`testing::chunked_lm_head_on_cpu`) runs it on the CPU device with chunks that split the
//! rows unevenly. Its loss and the hidden's, weight's and bias's gradients are checked against
//! f64 arithmetic on the values held (the logits are rounded to the hidden's type as the
//! plain path rounds them, so within a few roundings of that type) and against the plain ops
//! (`ops::cross_entropy(head.forward(h))`), at f32, f16 and bf16, with and without bias, with
//! ignored targets of each integer type. The per-chunk kernel (`amp_xent_rows` in `xent.cu`)
//! runs on the CPU grid emulator: bit for bit the forward and backward kernels' values with a
//! loss gradient of 1, and within f32 rounding of f64. Under `CANDLE_AMP_TEST_DEVICE=cuda` the
//! last test compares the node on CUDA with the CPU path.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use candle_amp::nn::{Linear, linear_cross_entropy};
use candle_amp::{AmpError, ops, testing};
use candle_core::{DType, Device, Module, Tensor, Var};

#[allow(dead_code)]
#[path = "../src/kernels/cuda/xent_plan.rs"]
mod plan;

/// Rows (over two leading dimensions), width and vocabulary of the head tests.
const SHAPE: (usize, usize) = (3, 7);
const D: usize = 16;
const V: usize = 37;

/// Seeded values in [-lo, lo).
fn values(n: usize, seed: u64, lo: f64) -> Vec<f32> {
    cuda_emu::values(n, seed, lo).iter().map(|v| *v as f32).collect()
}

/// The targets of `rows` rows as `dt`, rows 2 and 9 ignored (the type's maximum).
fn targets(rows: usize, dt: DType, dev: &Device) -> (Tensor, Vec<u32>) {
    let mut t: Vec<u32> = (0..rows).map(|i| ((i * 13 + 4) % V) as u32).collect();
    for i in [2, 9] {
        t[i] = u32::MAX;
    }
    let shape = (SHAPE.0, SHAPE.1);
    let tensor = match dt {
        DType::U8 => {
            let v: Vec<u8> = t
                .iter()
                .map(|&x| if x == u32::MAX { u8::MAX } else { x as u8 })
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        DType::I64 => {
            let v: Vec<i64> = t
                .iter()
                .map(|&x| if x == u32::MAX { i64::MAX } else { x as i64 })
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        _ => Tensor::from_vec(t.clone(), shape, dev),
    };
    (tensor.unwrap(), t)
}

/// What one path gave: the loss, the gradients of h, w and b (for a loss gradient of 0.75),
/// and how many tensors of `rows x V` values or more its graph holds.
struct Got {
    loss: f64,
    grads: [Vec<f64>; 3],
    wide: usize,
}

/// The head's loss on `dev` by the node (`chunk`: rows per chunk; forced onto the CPU) or by
/// the plain ops (`None`).
fn run(dt: DType, bias: bool, tdt: DType, chunk: Option<usize>, dev: &Device) -> Got {
    let rows = SHAPE.0 * SHAPE.1;
    let var = |v: Vec<f32>, shape: &[usize]| {
        Var::from_tensor(&Tensor::from_vec(v, shape, dev).unwrap().to_dtype(dt).unwrap()).unwrap()
    };
    let h = var(values(rows * D, 3, 2.0), &[SHAPE.0, SHAPE.1, D]);
    let w = var(values(V * D, 4, 1.0), &[V, D]);
    let b = var(values(V, 5, 1.0), &[V]);
    let head = Linear::new(w.as_tensor().clone(), bias.then(|| b.as_tensor().clone()));
    let (t, _) = targets(rows, tdt, dev);
    testing::chunked_lm_head_on_cpu(chunk);
    let loss = if chunk.is_some() {
        linear_cross_entropy(h.as_tensor(), &head, &t).unwrap()
    } else {
        ops::cross_entropy(&head.forward(h.as_tensor()).unwrap(), &t).unwrap()
    };
    testing::chunked_lm_head_on_cpu(None);
    assert_eq!((loss.dtype(), loss.dims()), (DType::F32, &[][..]));
    let wide = loss
        .sorted_nodes()
        .iter()
        .filter(|x| x.elem_count() >= rows * V)
        .count();
    let g = (&loss * 0.75).unwrap().backward().unwrap();
    let grad = |v: &Var| {
        let x = g.get(v.as_tensor()).unwrap();
        assert_eq!((x.dtype(), x.dims()), (dt, v.dims()), "a gradient's type and shape");
        common::vals(x)
    };
    Got {
        loss: common::vals(&loss)[0],
        grads: [grad(&h), grad(&w), if bias { grad(&b) } else { Vec::new() }],
        wide,
    }
}

/// f64 loss and gradients (times `g`) of `mean xent(h w^T + b, t)` over the held values.
fn reference(dt: DType, bias: bool, t: &[u32], g: f64) -> (f64, [Vec<f64>; 3]) {
    let held = |v: Vec<f32>| common::vals(&Tensor::new(v, &Device::Cpu).unwrap().to_dtype(dt).unwrap());
    let n = t.len();
    let (h, w, b) = (
        held(values(n * D, 3, 2.0)),
        held(values(V * D, 4, 1.0)),
        held(values(V, 5, 1.0)),
    );
    let (mut loss, mut dh, mut dw, mut db) = (0.0, vec![0.0; n * D], vec![0.0; V * D], vec![0.0; V]);
    for (i, &ti) in t.iter().enumerate() {
        if ti == u32::MAX {
            continue;
        }
        let z: Vec<f64> = (0..V)
            .map(|j| (0..D).map(|k| h[i * D + k] * w[j * D + k]).sum::<f64>() + if bias { b[j] } else { 0.0 })
            .collect();
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        loss += (lse - z[ti as usize]) / n as f64;
        for j in 0..V {
            let d = ((z[j] - lse).exp() - f64::from(j == ti as usize)) / n as f64 * g;
            db[j] += d;
            for k in 0..D {
                dh[i * D + k] += d * w[j * D + k];
                dw[j * D + k] += d * h[i * D + k];
            }
        }
    }
    (loss, [dh, dw, if bias { db } else { Vec::new() }])
}

/// `max |a - b| <= rel * max |b|`.
fn close(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let worst = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= rel * scale,
        "{what}: max |diff| {worst:.3e} > {rel:.1e} x {scale:.3e}"
    );
}

/// Half a unit in the last place of `dt`, relative.
fn eps(dt: DType) -> f64 {
    cuda_emu::eps(dt)
}

/// The node on the CPU device, chunks of 1, 5, 8 and all 21 rows (two of them uneven), against
/// f64 and against the plain ops, in each float type, with and without bias, the targets of
/// each integer type with two rows ignored. The logits of both paths are rounded to the
/// hidden's type (so the loss is good to about `eps * max |z|`, |z| up to 8 here), the
/// gradient at them too, and each product; the weight's and bias's sums over chunks are f32.
#[test]
fn chunked_node_matches_f64_and_the_plain_ops() {
    let rows = SHAPE.0 * SHAPE.1;
    let (_, t) = targets(rows, DType::U32, &Device::Cpu);
    let cpu = Device::Cpu;
    for (k, dt) in [DType::F32, DType::F16, DType::BF16].into_iter().enumerate() {
        for bias in [false, true] {
            let tdt = [DType::U32, DType::I64, DType::U8][(k + usize::from(bias)) % 3];
            let plain = run(dt, bias, tdt, None, &cpu);
            assert!(plain.wide > 0, "the plain path makes the logits");
            let (loss, grads) = reference(dt, bias, &t, 0.75);
            // The logits rounded to the type (|z| <= 8), then f32's arithmetic.
            let loss_tol = 8.0 * eps(dt) + 1e-6;
            let grad_rel = 6.0 * eps(dt) + 1e-6;
            for chunk in [1, 5, 8, rows] {
                let what = format!("{dt:?} bias {bias} targets {tdt:?} chunks of {chunk}");
                let got = run(dt, bias, tdt, Some(chunk), &cpu);
                assert_eq!(got.wide, 0, "{what}: the node makes no N x V tensor of the graph");
                assert!(
                    (got.loss - loss).abs() <= loss_tol,
                    "{what}: loss {} vs f64 {loss}",
                    got.loss
                );
                // The plain path on the CPU adds the bias before its one rounding of the
                // logits, the node (as candle's ops on a GPU) after: apart by that rounding.
                assert!(
                    (got.loss - plain.loss).abs() <= loss_tol,
                    "{what}: loss {} vs plain {}",
                    got.loss,
                    plain.loss
                );
                for (i, name) in ["dh", "dw", "db"].into_iter().enumerate() {
                    close(&got.grads[i], &grads[i], grad_rel, &format!("{what}: {name} vs f64"));
                    close(
                        &got.grads[i],
                        &plain.grads[i],
                        grad_rel,
                        &format!("{what}: {name} vs plain"),
                    );
                }
            }
        }
    }
}

/// A hidden that takes no gradient (data): the weight's and bias's gradients still come, and
/// equal those of a hidden that takes one; a head whose parameters take none gives the loss
/// alone. Bad targets are typed errors on this path too.
#[test]
fn chunked_node_without_some_gradients_and_bad_targets() {
    let dev = Device::Cpu;
    let rows = SHAPE.0 * SHAPE.1;
    let hv = values(rows * D, 3, 2.0);
    let h = Tensor::from_vec(hv, (SHAPE.0, SHAPE.1, D), &dev).unwrap();
    let w = Var::from_tensor(&Tensor::from_vec(values(V * D, 4, 1.0), (V, D), &dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::from_vec(values(V, 5, 1.0), V, &dev).unwrap()).unwrap();
    let head = Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
    let (t, _) = targets(rows, DType::U32, &dev);
    testing::chunked_lm_head_on_cpu(Some(4));
    let loss = linear_cross_entropy(&h, &head, &t).unwrap();
    let frozen = Linear::new(w.as_tensor().detach(), Some(b.as_tensor().detach()));
    let alone = linear_cross_entropy(&h, &frozen, &t).unwrap();
    let bad = Tensor::new(&[[0u32, 1, 2, 3, 4, 5, V as u32]; 3], &dev).unwrap();
    let err = linear_cross_entropy(&h, &head, &bad).unwrap_err();
    testing::chunked_lm_head_on_cpu(None);
    assert!(!alone.track_op(), "no gradient wanted: no node of the graph");
    assert_eq!(common::vals(&alone), common::vals(&loss));
    let g = (&loss * 0.75).unwrap().backward().unwrap();
    let got = run(DType::F32, true, DType::U32, Some(4), &dev);
    assert_eq!(common::vals(g.get(w.as_tensor()).unwrap()), got.grads[1]);
    assert_eq!(common::vals(g.get(b.as_tensor()).unwrap()), got.grads[2]);
    let e = AmpError::from(err);
    assert!(
        matches!(
            e,
            AmpError::InvalidArgument {
                argument: "targets",
                ..
            }
        ),
        "a typed error on the targets, got {e:?}"
    );
}

/// Runs `amp_xent_rows` and the forward + backward kernels (loss gradient 1, `inv_rows` = 1/n)
/// on the emulator for `rows` rows of `cols` logits of `dt`, `n` rows in the mean: the rows'
/// log-probabilities and gradients of both.
fn emulate_rows(x: &[u8], t: &[u8], (rows, cols, n): (usize, usize, usize), dt: DType, tdt: DType) -> [Vec<u8>; 4] {
    let p = plan::xent_plan(rows, cols, dt, tdt).expect("a plan");
    assert_eq!((p.rows.grid, p.rows.block), (p.forward.grid, p.forward.block));
    let dir = cuda_emu::scratch("xent", &format!("rows-{rows}x{cols}-{dt:?}-{tdt:?}"));
    let path = |f: &str| dir.join(f).to_str().unwrap().to_string();
    std::fs::write(path("x"), x).unwrap();
    std::fs::write(path("t"), t).unwrap();
    std::fs::write(path("g"), 1f32.to_le_bytes()).unwrap();
    let inv_n = ((1.0 / n as f64) as f32).to_string();
    let s = |v: &dyn ToString| v.to_string();
    let (grid, block) = (s(&p.rows.grid), s(&p.rows.block));
    let (r, c) = (s(&rows), s(&cols));
    let run = |a: &[String]| cuda_emu::run("xent", a);
    run(&[
        s(&"rows"),
        p.rows.kernel.clone(),
        grid.clone(),
        block.clone(),
        r.clone(),
        c.clone(),
        inv_n.clone(),
    ]
    .into_iter()
    .chain([path("x"), path("t"), path("logp"), path("dx")])
    .collect::<Vec<_>>());
    run(&[
        s(&"fwd"),
        p.forward.kernel.clone(),
        grid.clone(),
        block.clone(),
        s(&1),
        s(&32),
        r.clone(),
        c.clone(),
    ]
    .into_iter()
    .chain([
        s(&-1f32),
        path("x"),
        path("t"),
        path("logp2"),
        path("stats"),
        path("loss"),
    ])
    .collect::<Vec<_>>());
    run(&[s(&"bwd"), p.backward.kernel.clone(), grid, block, r, c, inv_n]
        .into_iter()
        .chain([path("x"), path("t"), path("stats"), path("g"), path("dx2")])
        .collect::<Vec<_>>());
    let rd = |f: &str| std::fs::read(path(f)).unwrap();
    [rd("logp"), rd("dx"), rd("logp2"), rd("dx2")]
}

/// `amp_xent_rows` on the emulator: each type, each target type, an ignored row and one out of
/// range (NaN on its row only), 1000 classes and GPT-2's 50257 (f32, the emulator's thread
/// per CUDA thread is slow), `n` (the batch's rows) past the chunk's. Bit for bit the values
/// of the forward and backward kernels (which `tests/cuda_xent.rs` checks against f64), and
/// within f32 rounding of f64 here too.
#[test]
fn rows_kernel_matches_the_forward_and_backward_kernels() {
    for (rows, cols, dt, tdt) in [
        (6, 1000, DType::F32, DType::U32),
        (6, 1000, DType::F16, DType::I64),
        (6, 1000, DType::BF16, DType::U8),
        (3, 50257, DType::F32, DType::I64),
    ] {
        let what = format!("{rows}x{cols} {dt:?} {tdt:?}");
        let n = 4 * rows + 1;
        let (xb, x) = cuda_emu::encode(&cuda_emu::values(rows * cols, 7, 4.0), dt);
        let mut t: Vec<i64> = (0..rows).map(|i| ((i * 97 + 3) % cols.min(255)) as i64).collect();
        let (ignored, bad) = match tdt {
            DType::U8 => (u8::MAX as i64, 254),
            DType::U32 => (u32::MAX as i64, cols as i64),
            _ => (i64::MAX, -1),
        };
        t[1] = ignored;
        if rows > 3 {
            t[4] = bad;
        }
        let tb: Vec<u8> = match tdt {
            DType::U8 => t.iter().map(|v| *v as u8).collect(),
            DType::U32 => t.iter().flat_map(|v| (*v as u32).to_le_bytes()).collect(),
            _ => t.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let block = plan::xent_plan(rows, cols, dt, tdt).unwrap().rows.block as usize;
        let [logp, dx, logp2, dx2] = emulate_rows(&xb, &tb, (rows, cols, n), dt, tdt);
        assert_eq!(logp, logp2, "{what}: log-probabilities bit for bit");
        assert_eq!(dx, dx2, "{what}: gradient bit for bit");
        let (lp, d) = (cuda_emu::f32s(&logp), cuda_emu::decode(&dx, dt));
        for r in 0..rows {
            let (row, drow) = (&x[r * cols..(r + 1) * cols], &d[r * cols..(r + 1) * cols]);
            if rows > 3 && r == 4 && !(tdt == DType::U8 && cols > 254) {
                assert!(lp[r].is_nan() && drow.iter().all(|v| v.is_nan()), "{what}: row {r} NaN");
                continue;
            }
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
            let ign = r == 1;
            let want = if ign { 0.0 } else { row[t[r] as usize] - m - s.ln() };
            assert!(
                (lp[r] - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{what}: logp[{r}] {} vs {want}",
                lp[r]
            );
            for (j, (&v, &got)) in row.iter().zip(drow).enumerate() {
                let p = (v - m).exp() / s;
                let want = if ign {
                    0.0
                } else {
                    (p - f64::from(j as i64 == t[r])) / n as f64
                };
                // As `tests/cuda_xent.rs` bounds the backward: the f32 softmax good to the row
                // sum's error (plus the exponential's argument rounded), the onehot
                // subtraction, 1/n and the product each rounded once in f32, then the type's.
                let rerr = 6e-8 * (26.0 + (cols / block) as f64);
                let f32_err = (p * (rerr + 6e-8 * (v - m).abs()) + 6e-8) / n as f64 + 4.0 * 6e-8 * want.abs();
                let tol = cuda_emu::atol(dt) + want.abs() * eps(dt) + f32_err * (1.0 + eps(dt)) + 1e-30;
                assert!((got - want).abs() <= tol, "{what}: dx[{r}, {j}] {got} vs {want}");
            }
        }
    }
}

/// The node on CUDA (runs only with `CANDLE_AMP_TEST_DEVICE=cuda`) against the CPU path (the
/// plain ops on the CPU), with the chunk split unevenly and whole: the loss and the
/// gradients in each type, within Transformer Engine's tolerances.
#[test]
fn cuda_node_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        testing::cuda_xent_loaded(&dev),
        "the CUDA cross-entropy kernels did not load"
    );
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for bias in [false, true] {
            let cpu = run(dt, bias, DType::I64, None, &Device::Cpu);
            for chunk in [5, 64] {
                let what = format!("{dt:?} bias {bias} chunks of {chunk}");
                // The switch's row count holds on every device (its CPU part does not matter).
                let got = run(dt, bias, DType::I64, Some(chunk), &dev);
                assert_eq!(got.wide, 0, "{what}: the node ran");
                let rt = common::te_rtol(dt).max(1e-5) as f64;
                assert!(
                    (got.loss - cpu.loss).abs() <= 2.0 * rt * cpu.loss.abs().max(1.0),
                    "{what}: loss"
                );
                for i in 0..3 {
                    close(&got.grads[i], &cpu.grads[i], 4.0 * rt, &format!("{what}: grad {i}"));
                }
            }
        }
    }
}
