//! `nn::linear_cross_entropy`: the LM head and its loss as one node of the run. At O1, O2
//! and O3 in f16 and bf16, tied to the embedding and not, with and without bias, its loss
//! and gradients are checked against f64 arithmetic on the very values the run computed with
//! (the half hidden and working weights): within f32 rounding, since no logits and no
//! logits gradient are rounded to half (the hidden's gradient, handed to candle in half, within
//! the half type's rounding). The unfused path (`ops::cross_entropy(head.forward(h))`), which
//! rounds the logits to half, agrees with it within the half type's rounding. At O0 (the
//! plain ops) against f64 within f32 rounding. An empty batch gives what the unfused path
//! gives; bad targets give typed errors.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{Embedding, Linear, embedding, linear, linear_cross_entropy, linear_no_bias};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, HalfType, LossScaleSpec, OptLevel, ops};
use candle_core::{DType, Device, Module, Tensor, Var};
use common::{backward_capturing, grid, t2, vals};

const N: usize = 24;
const D: usize = 40;
const V: usize = 70;
const SCALE: f32 = 256.0;

struct Head {
    /// The embedding whose table the tied head uses (`tied`); else the input is the hidden.
    emb: Option<Embedding>,
    head: Linear,
    fused: AtomicBool,
    targets: Mutex<Tensor>,
}

impl Head {
    fn hidden(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.emb {
            Some(e) => e.forward(x),
            None => Ok(x.clone()),
        }
    }
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.hidden(x)?;
        let t = self.targets.lock().unwrap().clone();
        if self.fused.load(Ordering::Relaxed) {
            linear_cross_entropy(&h, &self.head, &t)
        } else {
            ops::cross_entropy(&self.head.forward(&h)?, &t)
        }
    }
}

/// One forward and backward: the loss, the master gradients (unscaled), the input's
/// gradient (scaled; untied only).
struct Seen {
    loss: f64,
    grads: BTreeMap<String, Vec<f64>>,
    gx: Option<Vec<f64>>,
    scale: f64,
    /// Tensors of `rows x V` values or more in the loss's graph (logits and their kin).
    wide: usize,
}

struct Case {
    level: OptLevel,
    half: HalfType,
    tied: bool,
    bias: bool,
    rows: usize,
    /// The hidden is data (no gradient): the node hangs off an anchor for the head's.
    data: bool,
}

/// The targets: rows' classes in `0..V`, one ignored (the type's maximum) where there are rows.
fn targets(rows: usize) -> Tensor {
    let mut t: Vec<u32> = (0..rows).map(|i| ((i * 37 + 5) % V) as u32).collect();
    if rows > 3 {
        t[3] = u32::MAX;
    }
    Tensor::new(t, &Device::Cpu).unwrap()
}

/// Runs the case fused and unfused; returns both, the hidden and the head's weight and bias
/// as the run computed with (f64 values), and the targets.
#[allow(clippy::type_complexity)]
fn run(c: &Case) -> (Seen, Seen, Vec<f64>, Vec<f64>, Option<Vec<f64>>, Vec<u32>) {
    let cfg = AmpConfig::new(c.level)
        .half(c.half)
        .loss_scale(LossScaleSpec::Static(SCALE))
        .verbosity(0)
        .seed(5);
    let (tied, bias) = (c.tied, c.bias);
    let (model, mut opt, amp) = amp::initialize(
        move |vb| {
            let (emb, head) = if tied {
                let e = embedding(V, D, vb.pp("emb"))?;
                let h = Linear::new(e.embeddings().clone(), None);
                (Some(e), h)
            } else if bias {
                (None, linear(D, V, vb.pp("head"))?)
            } else {
                (None, linear_no_bias(D, V, vb.pp("head"))?)
            };
            Ok(Head {
                emb,
                head,
                fused: AtomicBool::new(true),
                targets: Mutex::new(targets(0)),
            })
        },
        Sgd::new(SgdConfig::new(0.5)).unwrap(),
        cfg,
    )
    .unwrap();
    let t = targets(c.rows);
    *model.inner().targets.lock().unwrap() = t.clone();
    let dev = Device::Cpu;
    let xvar;
    let x: Tensor = if tied {
        let ids: Vec<u32> = (0..c.rows).map(|i| ((i * 11 + 2) % V) as u32).collect();
        Tensor::new(ids, &dev).unwrap()
    } else {
        xvar = Var::from_tensor(&t2(&grid(c.rows * D, 0.125, 24, 3), c.rows, D)).unwrap();
        if c.data {
            xvar.as_tensor().detach()
        } else {
            xvar.as_tensor().clone()
        }
    };
    let mut once = |fused: bool| -> Seen {
        model.inner().fused.store(fused, Ordering::Relaxed);
        let loss = model.forward(&x).unwrap();
        let wide = loss
            .sorted_nodes()
            .iter()
            .filter(|t| t.elem_count() >= c.rows.max(1) * V)
            .count();
        let (report, gx) = backward_capturing(&amp, &loss, &mut opt, &x);
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
        opt.zero_grad();
        Seen {
            loss: vals(&loss)[0],
            grads,
            gx: gx.as_ref().map(vals),
            scale: report.loss_scale as f64,
            wide,
        }
    };
    let fused = once(true);
    let plain = once(false);
    let m = model.inner();
    // The values the products ran on: the half working copies (cast by the policy at O1).
    let dt = if c.level == OptLevel::O0 {
        DType::F32
    } else {
        c.half.dtype()
    };
    let as_run = |t: &Tensor| vals(&t.to_dtype(dt).unwrap());
    let h = as_run(&m.hidden(&x).unwrap());
    let w = as_run(m.head.weight());
    let b = m.head.bias().map(as_run);
    let t = t.to_vec1::<u32>().unwrap();
    (fused, plain, h, w, b, t)
}

/// The f64 loss and gradients (loss, dh, dw, db) of `mean xent(h w^T + b, t)`.
fn reference(h: &[f64], w: &[f64], b: Option<&[f64]>, t: &[u32]) -> (f64, Vec<f64>, Vec<f64>, Vec<f64>) {
    let n = t.len();
    let (mut loss, mut dh, mut dw, mut db) = (0.0, vec![0.0; n * D], vec![0.0; V * D], vec![0.0; V]);
    for (i, &ti) in t.iter().enumerate() {
        if ti == u32::MAX {
            continue;
        }
        let z: Vec<f64> = (0..V)
            .map(|j| (0..D).map(|k| h[i * D + k] * w[j * D + k]).sum::<f64>() + b.map_or(0.0, |b| b[j]))
            .collect();
        let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss += (lse - z[ti as usize]) / n as f64;
        for j in 0..V {
            let g = ((z[j] - lse).exp() - if j == ti as usize { 1.0 } else { 0.0 }) / n as f64;
            db[j] += g;
            for k in 0..D {
                dh[i * D + k] += g * w[j * D + k];
                dw[j * D + k] += g * h[i * D + k];
            }
        }
    }
    (loss, dh, dw, db)
}

/// `max |a - b| <= rel * max |b|` (plus a floor for all-zero references).
fn close(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let worst = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(worst <= rel * scale, "{what}: max diff {worst:e} > {rel:e} * {scale:e}");
}

/// The half type's relative rounding (unit roundoff times a few).
fn half_tol(half: HalfType) -> f64 {
    match half {
        HalfType::F16 => 4e-3,
        _ => 3e-2,
    }
}

fn check(c: &Case) {
    let what = format!(
        "{:?} {:?} tied {} bias {} rows {} data {}",
        c.level, c.half, c.tied, c.bias, c.rows, c.data
    );
    let (fused, plain, h, w, b, t) = run(c);
    let (loss, dh, dw, db) = reference(&h, &w, b.as_deref(), &t);
    // Fused (O1..O3): no logits in the graph (the embedding table, V x D, may be: tied).
    if c.level != OptLevel::O0 {
        assert!(
            plain.wide > fused.wide,
            "{what}: {} wide tensors fused, {} plain",
            fused.wide,
            plain.wide
        );
        let weights = if c.tied { 2 } else { 1 };
        assert!(fused.wide <= weights, "{what}: {} wide tensors fused", fused.wide);
    } else {
        assert_eq!(plain.wide, fused.wide, "{what}: O0 runs the plain ops");
    }
    let wname = if c.tied { "emb.weight" } else { "head.weight" };
    // The fused node (O1..O3) and the plain f32 ops (O0) compute in f32 from the same values.
    let f32_tol = 2e-5;
    let ht = half_tol(c.half);
    // At O3 the gradients the optimizer sees are the working type's.
    let grad_tol = if c.level == OptLevel::O3 { ht } else { f32_tol };
    assert!(
        (fused.loss - loss).abs() <= f32_tol * loss.abs(),
        "{what}: loss {} vs f64 {loss}",
        fused.loss
    );
    if !c.tied {
        close(&fused.grads[wname], &dw, grad_tol, &format!("{what}: fused dw"));
        if let Some(gb) = fused.grads.get("head.bias") {
            close(gb, &db, grad_tol, &format!("{what}: fused db"));
        }
        if c.data {
            assert!(
                fused.gx.is_none() && plain.gx.is_none(),
                "{what}: data takes no gradient"
            );
        } else {
            let gx = fused.gx.as_ref().expect("the hidden's gradient");
            let want: Vec<f64> = dh.iter().map(|v| v * fused.scale).collect();
            let hidden_tol = if c.level == OptLevel::O0 { f32_tol } else { ht };
            close(gx, &want, hidden_tol, &format!("{what}: fused dh"));
        }
    }
    // The unfused path rounds the logits (and their gradient) to half: agreement within that.
    let tol = if c.level == OptLevel::O0 { f32_tol } else { ht };
    assert!(
        (plain.loss - fused.loss).abs() <= tol * loss.abs(),
        "{what}: loss {} vs {}",
        plain.loss,
        fused.loss
    );
    assert_eq!(
        plain.grads.keys().collect::<Vec<_>>(),
        fused.grads.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (k, g) in &fused.grads {
        close(&plain.grads[k], g, tol, &format!("{what}: {k}"));
    }
    if let (Some(a), Some(b)) = (&plain.gx, &fused.gx) {
        close(a, b, tol, &format!("{what}: dh"));
    }
}

#[test]
fn fused_head_matches_f64_and_the_unfused_path_at_every_level() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            for (tied, bias) in [(false, false), (false, true), (true, false)] {
                check(&Case {
                    level,
                    half,
                    tied,
                    bias,
                    rows: N,
                    data: false,
                });
            }
        }
    }
}

#[test]
fn more_rows_than_one_chunk() {
    // 1 << 20 logits per chunk at most: a vocabulary of 70 takes 14979 rows per chunk.
    check(&Case {
        level: OptLevel::O2,
        half: HalfType::Bf16,
        tied: false,
        bias: true,
        rows: 15_000,
        data: false,
    });
}

#[test]
fn a_hidden_without_gradient_still_trains_the_head() {
    for level in [OptLevel::O1, OptLevel::O2] {
        check(&Case {
            level,
            half: HalfType::F16,
            tied: false,
            bias: true,
            rows: N,
            data: true,
        });
    }
}

#[test]
fn an_empty_batch_gives_what_the_unfused_path_gives() {
    for level in [OptLevel::O0, OptLevel::O2] {
        for tied in [false, true] {
            let (fused, plain, ..) = run(&Case {
                level,
                half: HalfType::Bf16,
                tied,
                bias: !tied,
                rows: 0,
                data: false,
            });
            assert_eq!(fused.loss.is_nan(), plain.loss.is_nan(), "{level:?} tied {tied}");
            if !plain.loss.is_nan() {
                assert_eq!(fused.loss, plain.loss);
            }
            assert_eq!(
                fused.grads.keys().collect::<Vec<_>>(),
                plain.grads.keys().collect::<Vec<_>>()
            );
            for (k, g) in &fused.grads {
                assert_eq!(g, &plain.grads[k], "{level:?} {k}");
            }
        }
    }
}

#[test]
fn bad_targets_are_typed_errors() {
    let dev = Device::Cpu;
    let head = Linear::new(Tensor::ones((V, D), DType::F32, &dev).unwrap(), None);
    let h = Tensor::ones((4, D), DType::F32, &dev).unwrap();
    let bad = [
        Tensor::new(&[0u32, 1, V as u32, 2], &dev).unwrap(),
        Tensor::new(&[0i64, -1, 2, 3], &dev).unwrap(),
        Tensor::new(&[0f32, 1., 2., 3.], &dev).unwrap(),
        Tensor::new(&[0u32, 1, 2], &dev).unwrap(),
    ];
    for t in &bad {
        let e = AmpError::from(linear_cross_entropy(&h, &head, t).unwrap_err());
        assert!(
            matches!(
                e,
                AmpError::InvalidArgument {
                    argument: "targets",
                    ..
                }
            ),
            "{t}: {e}"
        );
    }
    // A u8 target at its maximum is ignored, not out of range.
    let t = Tensor::new(&[0u8, 255, 2, 3], &dev).unwrap();
    let fused = linear_cross_entropy(&h, &head, &t).unwrap().to_scalar::<f32>().unwrap();
    let plain = ops::cross_entropy(&head.forward(&h).unwrap(), &t)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(fused, plain);
}
