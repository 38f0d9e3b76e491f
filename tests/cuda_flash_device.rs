//! The CUDA attention kernels against the CPU path on a GPU (runs only with
//! `CANDLE_AMP_TEST_DEVICE=cuda`; `cuda_flash.rs` runs the same kernels on the CPU grid
//! emulator against an f64 reference): `nn::scaled_dot_product_attention` (the kernels: the
//! tensor-core ones for f16 and bf16 on compute capability 8.0+), which is what confirms that
//! the hardware's fragment layout is the documented one, and `nn::SelfAttention` with grouped
//! key/value heads, key lengths and a rotary embedding (the kernels reading the grouped heads
//! in place and masking the keys themselves) against the CPU's repeated heads and mask.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use candle_core::{DType, Tensor, Var};

use cuda_emu::values;

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// `nn::scaled_dot_product_attention` on CUDA (the flash kernels) against its CPU path (runs
/// only with `CANDLE_AMP_TEST_DEVICE=cuda`): the output and the gradients of q, k and v, at
/// head dimensions 64 and 128, 32 and 96 (kernels of their own) and 40 (48's, zero columns).
///
/// Tolerance: the two paths round differently (the CPU path rounds the scores and the
/// probabilities to the inputs' type where the kernels keep them in f32, and sums in another
/// order), so each value is compared with `2 * rtol * (|cpu| + max |cpu| over the tensor)`:
/// Transformer Engine's rtol for half types ([`common::te_rtol`]) and 1e-5 for f32 (TE's
/// 1.3e-6 is one rounding; a reordered sum of t products is several). Against an f64
/// reference on these inputs the CPU path stays under a fifth of that bound in every type.
///
/// On compute capability 8.0+ the f16 and bf16 cases run the tensor-core kernels, which round
/// P and dS to the half type before their products. The bound is kept: the CPU path rounds
/// its probabilities to the half type too, the two roundings are independent (their
/// difference is at most the sum of two errors each under a fifth of the bound), and a wrong
/// fragment layout gives errors of the size of the values themselves. The worst share of the
/// bound is printed per tensor (`--nocapture`) so that a GPU run shows the margin.
#[test]
fn cuda_attention_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_flash_loaded(&dev),
        "the CUDA attention kernels did not load (see the log's warning)"
    );
    // On compute capability 8.0+ the f16 and bf16 cases must run the tensor-core kernels (a
    // module that failed to load would fall back to the FMA kernels and test those instead).
    let tc = candle_amp::testing::cuda_flash_tensor_cores(&dev);
    assert_ne!(
        tc,
        Some(false),
        "the tensor-core attention kernels did not load (see the log's warning)"
    );
    println!(
        "tensor-core attention kernels: {}",
        if tc.is_some() { "used" } else { "not on this GPU" }
    );
    let cpu = candle_core::Device::Cpu;
    for (shape, causal, scale) in [
        ([2usize, 3, 70, 64], true, None),
        ([1, 2, 130, 128], false, Some(0.07)),
        ([1, 1, 1, 64], true, None),
        // Large enough for the plan's large tiles.
        ([4, 12, 256, 64], true, None),
        ([2, 8, 300, 128], false, None),
        // Head dimensions with kernels of their own besides 64 and 128 (a 256-wide model of 8
        // heads; 96), small and large grids, and one run on 48's kernels with zero columns.
        ([2, 3, 70, 32], true, None),
        ([4, 16, 256, 32], false, None),
        ([1, 2, 130, 96], true, Some(0.09)),
        ([2, 12, 300, 96], false, None),
        ([2, 3, 45, 40], true, None),
    ] {
        let n: usize = shape.iter().product();
        let data: Vec<Vec<f32>> = (0..4)
            .map(|s| values(n, 40 + s, 1.0).iter().map(|v| *v as f32).collect())
            .collect();
        for dt in TYPES {
            let run = |d: &candle_core::Device| {
                let vars: Vec<Var> = (0..3)
                    .map(|i| {
                        let x = Tensor::from_vec(data[i].clone(), &shape[..], d).unwrap();
                        Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap()
                    })
                    .collect();
                let w = Tensor::from_vec(data[3].clone(), &shape[..], d).unwrap();
                let o = candle_amp::nn::scaled_dot_product_attention(
                    vars[0].as_tensor(),
                    vars[1].as_tensor(),
                    vars[2].as_tensor(),
                    None,
                    causal,
                    scale,
                )
                .unwrap();
                assert_eq!(o.dtype(), dt);
                let loss = (o.to_dtype(DType::F32).unwrap() * &w).unwrap().sum_all().unwrap();
                let grads = loss.backward().unwrap();
                let f = |t: &Tensor| -> Vec<f32> {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_device(&cpu)
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                };
                let mut out = vec![f(&o)];
                out.extend(vars.iter().map(|v| f(grads.get(v.as_tensor()).unwrap())));
                out
            };
            let (c, g) = (run(&cpu), run(&dev));
            let rtol = if dt == DType::F32 { 1e-5 } else { common::te_rtol(dt) };
            for (name, (a, b)) in ["O", "dQ", "dK", "dV"].iter().zip(c.iter().zip(&g)) {
                let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                let mut worst = 0f32;
                for (x, y) in a.iter().zip(b) {
                    let bound = 2.0 * rtol * (x.abs() + amax);
                    assert!(
                        (x - y).abs() <= bound,
                        "{shape:?} causal {causal} {dt:?} {name}: cuda {y} vs cpu {x}"
                    );
                    worst = worst.max((x - y).abs() / bound.max(f32::MIN_POSITIVE));
                }
                println!(
                    "{shape:?} causal {causal} {dt:?} {name}: worst error / bound {:.0}%",
                    100.0 * worst
                );
            }
        }
        // Under autocast (O1): f32 inputs, the products in bf16 as `ops::matmul` casts them,
        // the output in bf16 (as the composed path's last product returns it).
        let run_o1 = |d: &candle_core::Device| -> Vec<f32> {
            let _s = candle_amp::autocast::scope(DType::BF16);
            let x: Vec<Tensor> = (0..3)
                .map(|i| Tensor::from_vec(data[i].clone(), &shape[..], d).unwrap())
                .collect();
            let o = candle_amp::nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], None, causal, scale).unwrap();
            assert_eq!(o.dtype(), DType::BF16);
            o.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_device(&cpu)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (a, b) = (run_o1(&cpu), run_o1(&dev));
        let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let rtol = common::te_rtol(DType::BF16);
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 2.0 * rtol * (x.abs() + amax),
                "{shape:?} causal {causal} autocast bf16 O: cuda {y} vs cpu {x}"
            );
        }
    }
}

/// One `SelfAttention` case of [`self_attention_grads`]: batch 4, input width 96, 4 query heads
/// of `dh`, `kv` key/value heads, `t` positions, causal or not, the batch's key lengths.
struct AttnCase {
    dh: usize,
    t: usize,
    kv: usize,
    causal: bool,
    lengths: [usize; 4],
}

/// The output of `SelfAttention` (halves-layout rotary tables) over seeded inputs in `dt` on
/// `dev`, then the gradients of a weighted sum of it for the input and the four projection
/// weights, all as f32.
fn self_attention_grads(c: &AttnCase, dt: DType, dev: &candle_core::Device) -> Vec<Vec<f32>> {
    use candle_amp::nn::{Linear, SelfAttention};
    let (b, width, heads, dh) = (4usize, 96usize, 4usize, c.dh);
    let t = c.t;
    let var = |shape: &[usize], seed: u64, lo: f64| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = values(n, seed, lo).iter().map(|x| *x as f32).collect();
        let x = Tensor::from_vec(v, shape, dev).unwrap().to_dtype(dt).unwrap();
        Var::from_tensor(&x).unwrap()
    };
    let x = var(&[b, t, width], 70, 1.0);
    let ws = [
        var(&[heads * dh, width], 71, 0.2),
        var(&[c.kv * dh, width], 72, 0.2),
        var(&[c.kv * dh, width], 73, 0.2),
        var(&[width, heads * dh], 74, 0.1),
    ];
    // candle-transformers' Llama tables: angle p / 10000^(2i / dh), each row's halves equal.
    let angles: Vec<f32> = (0..t)
        .flat_map(|p| (0..dh).map(move |i| p as f32 / 10000f32.powf((2 * (i % (dh / 2))) as f32 / dh as f32)))
        .collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let (cos, sin) = (
        Tensor::from_vec(cos, (t, dh), dev).unwrap(),
        Tensor::from_vec(sin, (t, dh), dev).unwrap(),
    );
    let lin = |w: &Var| Linear::new(w.as_tensor().clone(), None);
    let attn = SelfAttention::new(lin(&ws[0]), lin(&ws[1]), lin(&ws[2]), lin(&ws[3]), heads, c.causal)
        .unwrap()
        .with_rope(&cos, &sin)
        .unwrap();
    assert_eq!(attn.kv_heads(), c.kv);
    let y = attn.forward_masked(x.as_tensor(), Some(&c.lengths)).unwrap();
    assert_eq!(y.dtype(), dt);
    let w: Vec<f32> = values(b * t * width, 75, 1.0).iter().map(|v| *v as f32).collect();
    let w = Tensor::from_vec(w, (b, t, width), dev).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &w).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let f = |t: &Tensor| -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_device(&candle_core::Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let mut out = vec![f(&y), f(grads.get(x.as_tensor()).unwrap())];
    out.extend(ws.iter().map(|v| f(grads.get(v.as_tensor()).unwrap())));
    out
}

/// `nn::SelfAttention` with grouped key/value heads (4 query heads over 2, 1 or 4, of 64, 32 or
/// 96), key lengths (0, 1, the sequence and values between) and a rotary embedding on CUDA, where the flash
/// kernels read the grouped heads in place and mask the keys themselves, against the CPU path
/// (heads repeated, an additive mask, zeros for a length of 0): the output and the gradients of
/// the input and of the four projections. Runs only with `CANDLE_AMP_TEST_DEVICE=cuda`.
///
/// Tolerance: `2 * rtol * (|cpu| + max |cpu|)` as [`cuda_attention_matches_the_cpu_path`]'s,
/// with rtol 1e-5 for f32 and twice Transformer Engine's for half types: here a chain of ops
/// (three projections, the rotation, the attention, the output projection and their
/// backward) rounds to the half type, and the CPU path alone, against its own f32 run on these
/// inputs, reaches 43% (f16) and 20% (bf16) of the single-op bound, under a quarter of this
/// one; a wrong group or mask gives errors of the size of the values. A length of 0 must give
/// exactly zero rows on both sides (the CPU path multiplies them by 0). The worst share of the
/// bound is printed per tensor (`--nocapture`).
#[test]
fn cuda_self_attention_with_groups_and_lengths_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_flash_loaded(&dev),
        "the CUDA attention kernels did not load (see the log's warning)"
    );
    let cases = [
        AttnCase {
            dh: 64,
            t: 37,
            kv: 2,
            causal: true,
            lengths: [0, 1, 37, 20],
        },
        AttnCase {
            dh: 64,
            t: 130,
            kv: 1,
            causal: false,
            lengths: [130, 0, 64, 1],
        },
        AttnCase {
            dh: 64,
            t: 70,
            kv: 4,
            causal: true,
            lengths: [3, 70, 0, 69],
        },
        // Head dimensions 32 and 96 (their own kernels), grouped and with lengths.
        AttnCase {
            dh: 32,
            t: 70,
            kv: 2,
            causal: true,
            lengths: [70, 0, 33, 1],
        },
        AttnCase {
            dh: 96,
            t: 45,
            kv: 1,
            causal: false,
            lengths: [2, 45, 0, 30],
        },
    ];
    for c in &cases {
        for dt in TYPES {
            let (a, g) = (
                self_attention_grads(c, dt, &candle_core::Device::Cpu),
                self_attention_grads(c, dt, &dev),
            );
            let rtol = if dt == DType::F32 {
                1e-5
            } else {
                2.0 * common::te_rtol(dt)
            };
            let names = ["O", "dx", "dWq", "dWk", "dWv", "dWo"];
            for (name, (x, y)) in names.iter().zip(a.iter().zip(&g)) {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let mut worst = 0f32;
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    let bound = 2.0 * rtol * (p.abs() + amax);
                    assert!(
                        (p - q).abs() <= bound,
                        "dh {} t {} kv {} causal {} {dt:?} {name}[{i}]: cuda {q} vs cpu {p}",
                        c.dh,
                        c.t,
                        c.kv,
                        c.causal
                    );
                    worst = worst.max((p - q).abs() / bound.max(f32::MIN_POSITIVE));
                }
                println!(
                    "dh {} t {} kv {} causal {} {dt:?} {name}: worst error / bound {:.0}%",
                    c.dh,
                    c.t,
                    c.kv,
                    c.causal,
                    100.0 * worst
                );
            }
            // The sequence of length 0: its output rows are exactly 0 (before the output
            // projection, which has no bias here).
            let (t, width) = (c.t, 96);
            for (s, &n) in c.lengths.iter().enumerate() {
                if n == 0 {
                    let rows = &g[0][s * t * width..(s + 1) * t * width];
                    assert!(rows.iter().all(|v| *v == 0.0), "t {} {dt:?}: sequence {s}", c.t);
                }
            }
        }
    }
}
