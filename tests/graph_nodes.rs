//! The half-precision graph nodes that keep a step out of candle's half element-wise code
//! (`ops::add`, `nn::Dropout`, `nn::split_heads`/`merge_heads`) and the strided gradients
//! every library op hands to candle: forward values and gradients equal candle's own ops
//! (`kernels::plain`) bit for bit, a broadcast argument's gradient equals an f64 sum
//! rounded once, on every tier this CPU has.

mod common;

use candle_amp::kernels;
use candle_amp::{self as amp, AmpConfig, OptLevel, nn as ann, ops};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::ModuleT;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-2f32..2.0)).collect()
}

fn tensor(dims: &[usize], seed: u64, dt: DType) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(values(n, seed), dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    common::flat(t).into_iter().map(f32::to_bits).collect()
}

/// Bit-identical, or the first difference.
fn same(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (bits(got), bits(want));
    assert_eq!(g.len(), w.len(), "{what}: lengths");
    if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
        panic!(
            "{what}: value {i} of {}: {} but {} wanted",
            g.len(),
            f32::from_bits(g[i]),
            f32::from_bits(w[i])
        );
    }
}

/// Lifts the forced tier when dropped (also when a case fails).
struct Unforce;

impl Drop for Unforce {
    fn drop(&mut self) {
        kernels::force_isa(None);
    }
}

/// `(b, t, d)` activations `a`, `r` (a residual) and a `(t, d)` broadcast `p`, through the
/// nodes, to an f32 loss weighted by `w`: the output, and the gradients of `a`, `r`, `p`.
fn run(dt: DType, w: &Tensor) -> (Tensor, [Tensor; 3]) {
    let (b, t, d, heads) = (3, 40, 48, 4);
    let a = Var::from_tensor(&tensor(&[b, t, d], 1, dt)).unwrap();
    let r = Var::from_tensor(&tensor(&[b, t, d], 2, dt)).unwrap();
    let p = Var::from_tensor(&tensor(&[t, d], 3, dt)).unwrap();
    let x = ops::add(a.as_tensor(), p.as_tensor()).unwrap();
    let q = ann::split_heads(&x, heads).unwrap();
    let k = ann::split_heads(r.as_tensor(), heads).unwrap();
    let sum = ops::add(&q, &k).unwrap();
    let y = ops::add(&ann::merge_heads(&sum).unwrap(), r.as_tensor()).unwrap();
    let loss = y.to_dtype(DType::F32).unwrap().mul(w).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let grads = [&a, &r, &p].map(|v| g.get(v.as_tensor()).unwrap().clone());
    (y, grads)
}

#[test]
fn the_nodes_equal_candles_ops_bit_for_bit_on_every_tier() {
    let _unforce = Unforce;
    let w = Tensor::from_vec(values(3 * 40 * 48, 9), (3, 40, 48), &Device::Cpu).unwrap();
    for dt in [DType::F16, DType::BF16] {
        let (want_y, want_g) = {
            let _plain = kernels::plain();
            run(dt, &w)
        };
        common::each_tier(|isa| {
            let (y, g) = run(dt, &w);
            same(&y, &want_y, &format!("{dt:?} {isa:?}: forward"));
            // a and r: exact sums of half gradients, alike on both paths.
            same(&g[0], &want_g[0], &format!("{dt:?} {isa:?}: a"));
            same(&g[1], &want_g[1], &format!("{dt:?} {isa:?}: r"));
            // p: the batch sum of a's gradient, in f64 and rounded once to half.
            let ga = g[0].to_dtype(DType::F64).unwrap();
            let want_p = ga.sum(0).unwrap().to_dtype(dt).unwrap();
            same(&g[2], &want_p, &format!("{dt:?} {isa:?}: p"));
        });
    }
}

#[test]
fn dropout_passes_the_gradient_through_its_mask() {
    let dev = Device::Cpu;
    for dt in [DType::F16, DType::BF16] {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).seed(3).verbosity(0), &dev).unwrap();
        let drop = ann::Dropout::new(0.25, amp.generator("dropout")).unwrap();
        // Every input 1: the output is the mask itself (0 or 1/0.75 in half).
        let x = Var::from_tensor(&Tensor::ones((64, 40), dt, &dev).unwrap()).unwrap();
        let y = drop.forward_t(x.as_tensor(), true).unwrap();
        let mask = y
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let kept = mask.iter().filter(|&&m| m != 0.0).count();
        assert!(kept > 1600 && kept < 2240, "{kept} of 2560 kept at p = 0.25");
        let w = Tensor::from_vec(values(64 * 40, 4), (64, 40), &dev).unwrap();
        let g = y
            .to_dtype(DType::F32)
            .unwrap()
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gx = g.get(x.as_tensor()).unwrap();
        // d/dx (x * m) . w = m * w: w reaches the node rounded to half (the cast's backward),
        // the product is rounded once.
        let w_half = w.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
        let want = (Tensor::from_vec(mask, (64, 40), &dev).unwrap() * w_half)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        // As candle accumulates it: onto a zero (so -0 becomes 0).
        let want = want.zeros_like().unwrap().add(&want).unwrap();
        same(gx, &want, &format!("{dt:?}"));
    }
}

#[test]
fn split_and_merge_heads_refuse_a_width_that_does_not_split() {
    let x = Tensor::zeros((2, 3, 10), DType::BF16, &Device::Cpu).unwrap();
    let e = ann::split_heads(&x, 4).unwrap_err().to_string();
    assert!(e.contains("width 10") && e.contains("4 heads"), "{e}");
    assert!(ann::split_heads(&x, 0).is_err());
    assert!(ann::merge_heads(&x).is_err());
    // An empty batch splits to an empty batch.
    let z = Tensor::zeros((0, 3, 8), DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(ann::split_heads(&z, 2).unwrap().dims(), [0, 2, 3, 4]);
}
