//! The digits MLP: O0 equals a plain candle f32 loop from the same initial weights, and O2
//! (f16 and bf16) reaches O0's held-out accuracy within 1.5 points.
//!
//! On `common::device()`. O0 equals the plain loop bit for bit with the CPU kernels, which
//! round as candle's ops do; elsewhere (a GPU, the forced device path) within f32 rounding.

mod common;
#[path = "../examples/train/data.rs"]
#[allow(dead_code)]
mod data;
#[path = "../examples/train/models.rs"]
#[allow(dead_code)]
mod models;

use candle_amp::optim::{AdamW, AdamWConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::{DType, Tensor};
use candle_nn::{Module, Optimizer as _};
use common::*;
use data::Dataset;
use models::{Cnn, Mlp};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

const BATCH: usize = 128;

fn batch_order(n: usize, steps: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order = Vec::new();
    (0..steps)
        .map(|_| {
            if order.len() < BATCH {
                let mut p: Vec<usize> = (0..n).collect();
                p.shuffle(&mut rng);
                order.extend(p);
            }
            order.drain(..BATCH).collect()
        })
        .collect()
}

fn tensors(d: &Dataset, idx: &[usize]) -> (Tensor, Tensor) {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for &i in idx {
        x.extend_from_slice(&d.x[i * d.width..(i + 1) * d.width]);
        y.push(d.y[i]);
    }
    (
        Tensor::from_vec(x, (idx.len(), d.width), &common::device()).unwrap(),
        Tensor::from_vec(y, idx.len(), &common::device()).unwrap(),
    )
}

fn adamw() -> AdamW {
    AdamW::new(AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.01,
        ..Default::default()
    })
    .unwrap()
}

fn prepared() -> (Dataset, Dataset, usize) {
    let ds = data::digits().unwrap();
    assert_eq!(ds.len(), 1797);
    assert_eq!(ds.width, 64);
    let classes = ds.classes();
    let (train, test) = data::split_standardise(&ds, 0.2, 0);
    (train, test, classes)
}

fn accuracy(model: &impl Fn(&Tensor) -> Tensor, test: &Dataset) -> f64 {
    let all: Vec<usize> = (0..test.len()).collect();
    let (x, _) = tensors(test, &all);
    let pred = model(&x).argmax(1).unwrap().to_vec1::<u32>().unwrap();
    pred.iter().zip(&test.y).filter(|(p, t)| p == t).count() as f64 / test.len() as f64
}

#[test]
fn o0_matches_a_plain_candle_f32_loop() {
    let (train, _test, classes) = prepared();
    let steps = 60;
    let (model, mut opt, amp) = common::initialize(|vb| Mlp::new(vb, 64, 256, classes), adamw(), OptLevel::O0).unwrap();
    let vm = f32_copy(amp.store());
    let plain = Mlp::new(vb_of(&vm), 64, 256, classes).unwrap();
    let mut c = candle_nn::AdamW::new(
        vm.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 1e-3,
            weight_decay: 0.01,
            ..Default::default()
        },
    )
    .unwrap();
    for idx in batch_order(train.len(), steps, 1) {
        let (x, y) = tensors(&train, &idx);
        let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        let closs = candle_nn::loss::cross_entropy(&plain.forward(&x).unwrap(), &y).unwrap();
        common::assert_close(
            &[loss.to_scalar::<f32>().unwrap()],
            &[closs.to_scalar::<f32>().unwrap()],
            cross_tol(DType::F32),
            "loss",
        );
        c.step(&closs.backward().unwrap()).unwrap();
    }
    let d = max_rel_diff(&store_values(amp.store()), &varmap_values(&vm), 1e-3);
    assert!(d <= cpu_or_tol(1e-6, DType::F32), "O0 differs from plain candle by {d}");
}

#[test]
fn mlp_o1_and_o2_accuracy_is_within_one_and_a_half_points_of_o0() {
    let (train, test, classes) = prepared();
    let steps = 600;
    let order = batch_order(train.len(), steps, 1);
    let run = |cfg: AmpConfig| train_and_score(|vb| Mlp::new(vb, 64, 256, classes), cfg, &train, &test, &order);
    let a0 = run(AmpConfig::new(OptLevel::O0));
    assert!(a0 > 0.9, "O0 accuracy {a0}");
    for half in [HalfType::F16, HalfType::Bf16] {
        for level in [OptLevel::O1, OptLevel::O2] {
            let a = run(AmpConfig::new(level).half(half));
            assert!((a - a0).abs() <= 0.015, "{level} {half}: {a} vs O0 {a0}");
        }
    }
}

#[test]
fn cnn_o1_and_o2_accuracy_is_within_one_and_a_half_points_of_o0() {
    let (train, test, classes) = prepared();
    let steps = 250;
    let order = batch_order(train.len(), steps, 2);
    let run = |cfg: AmpConfig| train_and_score(|vb| Cnn::new(vb, 8, classes), cfg, &train, &test, &order);
    let a0 = run(AmpConfig::new(OptLevel::O0));
    assert!(a0 > 0.85, "O0 accuracy {a0}");
    for (level, half) in [
        (OptLevel::O1, HalfType::F16),
        (OptLevel::O2, HalfType::F16),
        (OptLevel::O2, HalfType::Bf16),
    ] {
        let a = run(AmpConfig::new(level).half(half));
        assert!((a - a0).abs() <= 0.015, "{level} {half}: {a} vs O0 {a0}");
    }
}

/// Trains a model on the given batches and returns its held-out accuracy. At O1 it also
/// checks that the model autocast.
fn train_and_score<M: candle_nn::ModuleT>(
    build: impl FnOnce(candle_nn::VarBuilder<'static>) -> candle_core::Result<M>,
    cfg: AmpConfig,
    train: &Dataset,
    test: &Dataset,
    order: &[Vec<usize>],
) -> f64 {
    let (model, mut opt, amp) = common::initialize(build, adamw(), cfg).unwrap();
    for idx in order {
        let (x, y) = tensors(train, idx);
        let loss = amp::ops::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    if amp.properties().opt_level == OptLevel::O1 {
        assert!(amp.autocast_ops() >= 3, "the model autocasts at O1");
    }
    model.eval();
    accuracy(&|x| model.forward(x).unwrap(), test)
}

#[test]
fn malformed_data_files_name_the_line() {
    let e = data::parse_csv("1,2,3\n4,5,6\n7,x,9\n").unwrap_err();
    assert_eq!(e.line, 3);
    assert!(
        e.to_string().contains("line 3") && e.to_string().contains("\"x\""),
        "{e}"
    );
    let e = data::parse_csv("1,2,3\n4,5\n").unwrap_err();
    assert_eq!(e.line, 2);
    let e = data::parse_csv("1,2,3\n\n4,5,-1\n").unwrap_err();
    assert_eq!(e.line, 3, "negative label");
    let e = data::parse_csv("1,2,3.5\n").unwrap_err();
    assert!(e.to_string().contains("label"));
    assert_eq!(data::parse_csv("").unwrap_err().line, 0);
    // A constant column standardises to zeros, not NaN.
    let d = data::parse_csv("1,5,0\n2,5,1\n3,5,0\n4,5,1\n5,5,0\n").unwrap();
    let (tr, te) = data::split_standardise(&d, 0.2, 0);
    assert!(tr.x.iter().chain(&te.x).all(|v| v.is_finite()));
    assert!(tr.x.iter().skip(1).step_by(2).all(|v| *v == 0.0));
}
