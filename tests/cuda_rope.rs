//! The CUDA rotary embedding without a GPU: `src/kernels/cuda/rope.cu`, unmodified, built with
//! g++ against the CPU grid emulator (`tests/cuda_emu/emu.h`) and launched as the library's
//! plan launches them, checked bit for bit against the CPU path: the composed f32 candle ops
//! that `nn::SelfAttention` runs without the kernels (cast to f32, broadcast products, the
//! halves' `narrow`/`neg`/`cat` or the pairs' `reshape`/`narrow`/`stack`, the sum, cast back),
//! forward and, through candle's autograd, backward; in f32 also candle-nn's own `rope` and
//! `rope_i`. Needs g++ (C++20). Under `CANDLE_AMP_TEST_DEVICE=cuda` the last test compares the
//! library's CUDA op with the same CPU path.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;

use candle_amp::testing::cuda_rope::{RopeLaunch, RopePass, rope_plan, rope_plan_with};
use candle_core::{D, DType, Device, Tensor, Var};

use cuda_emu::{decode, values};

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
/// `(b, h, t, d, table rows)`: one value pair; positions not a multiple of any block, tables
/// longer than `t`; a Llama head; a wide head over more pairs than one block.
const SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (1, 1, 1, 2, 1),
    (2, 3, 7, 6, 9),
    (1, 2, 37, 64, 40),
    (2, 2, 33, 128, 100),
    (3, 1, 5, 514, 8),
];

/// The tables' layout: candle's `rope` (`(t, d)`, the halves) or `rope_i` (`(t, d / 2)`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    Halves,
    Pairs,
}

fn width(layout: Layout, d: usize) -> usize {
    match layout {
        Layout::Halves => d,
        Layout::Pairs => d / 2,
    }
}

/// `x` `(b, h, t, d)` rotated as `nn::SelfAttention`'s composed path does it (f32 arithmetic,
/// the result in `x`'s type), tables `(t, w)`, with candle's ops: differentiable.
fn composed(x: &Tensor, cos: &Tensor, sin: &Tensor, layout: Layout) -> Tensor {
    let xw = x.to_dtype(DType::F32).unwrap();
    let y = match layout {
        Layout::Halves => {
            let d = xw.dim(D::Minus1).unwrap();
            let (x1, x2) = (
                xw.narrow(D::Minus1, 0, d / 2).unwrap(),
                xw.narrow(D::Minus1, d / 2, d / 2).unwrap(),
            );
            let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
            (xw.broadcast_mul(cos).unwrap() + rot.broadcast_mul(sin).unwrap()).unwrap()
        }
        Layout::Pairs => {
            let (b, h, t, d) = xw.dims4().unwrap();
            let p = xw.reshape((b, h, t, d / 2, 2)).unwrap();
            let x0 = p.narrow(4, 0, 1).unwrap().squeeze(4).unwrap();
            let x1 = p.narrow(4, 1, 1).unwrap().squeeze(4).unwrap();
            let y0 = (x0.broadcast_mul(cos).unwrap() - x1.broadcast_mul(sin).unwrap()).unwrap();
            let y1 = (x0.broadcast_mul(sin).unwrap() + x1.broadcast_mul(cos).unwrap()).unwrap();
            Tensor::stack(&[&y0, &y1], 4).unwrap().reshape((b, h, t, d)).unwrap()
        }
    };
    y.to_dtype(x.dtype()).unwrap()
}

/// The composed path's output and `x`'s gradient for the output gradient `c` (f32, rounded to
/// `x`'s type on its way in, as the cast's backward rounds it): `(x, y, g, dx)` as bit
/// patterns widened to u32 (f32 bits, or the 16-bit patterns), `x` and `g` as `x`'s type holds
/// them (the kernels' inputs).
fn reference(
    x: &[f64],
    tables: (&[f32], &[f32]),
    c: &[f64],
    shape: [usize; 4],
    layout: Layout,
    dt: DType,
) -> [Vec<u32>; 4] {
    let [_, _, t, d] = shape;
    let w = width(layout, d);
    let dev = Device::Cpu;
    let xv = Tensor::from_vec(x.iter().map(|v| *v as f32).collect::<Vec<_>>(), &shape[..], &dev).unwrap();
    let xv = Var::from_tensor(&xv.to_dtype(dt).unwrap()).unwrap();
    let table = |v: &[f32]| Tensor::from_vec(v[..t * w].to_vec(), (t, w), &dev).unwrap();
    let y = composed(xv.as_tensor(), &table(tables.0), &table(tables.1), layout);
    assert_eq!(y.dtype(), dt);
    let ct = Tensor::from_vec(c.iter().map(|v| *v as f32).collect::<Vec<_>>(), &shape[..], &dev).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &ct).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let dx = grads.get(xv.as_tensor()).unwrap();
    assert_eq!(dx.dtype(), dt);
    [
        bits(xv.as_tensor()),
        bits(&y),
        bits(&ct.to_dtype(dt).unwrap()),
        bits(dx),
    ]
}

/// A tensor's values as their bit patterns.
fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t.to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        _ => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
    }
}

/// Bit patterns as the raw little-endian file of `dt`, and back.
fn to_bytes(b: &[u32], dt: DType) -> Vec<u8> {
    match dt {
        DType::F32 => b.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => b.iter().flat_map(|v| (*v as u16).to_le_bytes()).collect(),
    }
}
fn from_bytes(b: &[u8], dt: DType) -> Vec<u32> {
    match dt {
        DType::F32 => b.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect(),
        _ => b
            .chunks(2)
            .map(|c| u16::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
    }
}

fn f32_file(dir: &Path, name: &str, v: &[f32]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    p.to_str().unwrap().to_string()
}

/// One launch on the emulator over `input` (`rows` rows of `d`, `t` positions, as bit patterns
/// of `dt`); the output's bit patterns.
fn emulate(
    l: &RopeLaunch,
    (rows, t, d): (usize, usize, usize),
    input: &[u32],
    tables: [&str; 2],
    dt: DType,
    dir: &Path,
) -> Vec<u32> {
    let (xin, out) = (dir.join("in"), dir.join("out"));
    std::fs::write(&xin, to_bytes(input, dt)).unwrap();
    let s = |v: &dyn ToString| v.to_string();
    let p = |p: &Path| p.to_str().unwrap().to_string();
    cuda_emu::run(
        "rope",
        &[
            s(&l.kernel),
            s(&l.grid),
            s(&l.block),
            s(&rows),
            s(&t),
            s(&d),
            p(&xin),
            s(&tables[0]),
            s(&tables[1]),
            p(&out),
        ],
    );
    from_bytes(&std::fs::read(out).unwrap(), dt)
}

/// The first index where two bit patterns differ, shown as values of `dt`.
fn same_bits(what: &str, got: &[u32], want: &[u32], dt: DType) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let v = |b: u32| decode(&to_bytes(&[b], dt), dt)[0];
        panic!(
            "{what}[{i}]: {} ({:#x}) vs {} ({:#x})",
            v(got[i]),
            got[i],
            v(want[i]),
            want[i]
        );
    }
}

/// Seeded tables `(rows, w)` as f32: angles' cosines and sines where `real` (each row's halves
/// equal in the halves layout, as real tables are), else independent values (a mixed-up
/// index shows).
fn tables(rows: usize, w: usize, layout: Layout, real: bool, seed: u64) -> (Vec<f32>, Vec<f32>) {
    if !real {
        let c = values(rows * w, seed, 1.0).iter().map(|v| *v as f32).collect();
        let s = values(rows * w, seed + 1, 1.0).iter().map(|v| *v as f32).collect();
        return (c, s);
    }
    let n = if layout == Layout::Halves { w / 2 } else { w };
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..rows {
        let row: Vec<f64> = (0..n)
            .map(|i| p as f64 / 10000f64.powf(2.0 * i as f64 / (2 * n) as f64))
            .collect();
        let reps = if layout == Layout::Halves { 2 } else { 1 };
        for _ in 0..reps {
            c.extend(row.iter().map(|a| a.cos() as f32));
            s.extend(row.iter().map(|a| a.sin() as f32));
        }
    }
    (c, s)
}

/// Every type, layout and shape, forward and backward, on the emulator as the plan launches
/// it and with a grid of one and of three blocks (each thread many pairs): the composed path's
/// bits.
#[test]
fn rope_kernels_equal_the_composed_ops_bit_for_bit() {
    let dir = cuda_emu::scratch("rope", "composed");
    for (k, &(b, h, t, d, ct)) in SHAPES.iter().enumerate() {
        let shape = [b, h, t, d];
        let (rows, n) = (b * h * t, b * h * t * d);
        for layout in [Layout::Halves, Layout::Pairs] {
            let w = width(layout, d);
            for real in [false, true] {
                let seed = 100 * k as u64 + u64::from(real);
                let (c, s) = tables(ct, w, layout, real, seed);
                let files = [f32_file(&dir, "cos", &c), f32_file(&dir, "sin", &s)];
                let (x, g) = (values(n, seed + 2, 3.0), values(n, seed + 3, 2.0));
                for dt in TYPES {
                    let what = format!("{shape:?} tables {ct}x{w} {layout:?} real {real} {dt:?}");
                    let [xb, y, gb, dx] = reference(&x, (&c, &s), &g, shape, layout, dt);
                    for max_grid in [u32::MAX, 1, 3] {
                        for (pass, input, want) in [(RopePass::Forward, &xb, &y), (RopePass::Backward, &gb, &dx)] {
                            let l = rope_plan_with(pass, rows, t, d, w, dt, max_grid).expect("a plan");
                            assert_eq!(l.halves, layout == Layout::Halves);
                            let got = emulate(&l, (rows, t, d), input, [&files[0], &files[1]], dt, &dir);
                            same_bits(&format!("{what} {pass:?} grid {}", l.grid), &got, want, dt);
                        }
                    }
                }
            }
        }
    }
}

/// In f32, the forward is candle-nn's own `rope` (tables `(t, d / 2)` for both halves) and
/// `rope_i`, bit for bit: code nobody here wrote.
#[test]
fn rope_kernels_equal_candle_nn_in_f32() {
    let dir = cuda_emu::scratch("rope", "candle_nn");
    let dev = Device::Cpu;
    for (k, &(b, h, t, d, ct)) in SHAPES.iter().enumerate() {
        let (rows, n) = (b * h * t, b * h * t * d);
        let x = values(n, 7 + k as u64, 3.0)
            .iter()
            .map(|v| *v as f32)
            .collect::<Vec<_>>();
        let xt = Tensor::from_vec(x.clone(), (b, h, t, d), &dev).unwrap();
        let xb: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
        for layout in [Layout::Halves, Layout::Pairs] {
            let w = width(layout, d);
            let (c, s) = tables(ct, w, layout, true, 0);
            let files = [f32_file(&dir, "cos", &c), f32_file(&dir, "sin", &s)];
            let l = rope_plan(RopePass::Forward, rows, t, d, w, DType::F32).unwrap();
            let got = emulate(&l, (rows, t, d), &xb, [&files[0], &files[1]], DType::F32, &dir);
            // candle-nn's tables: `(rows, d / 2)`, the halves layout's first half of each row.
            let half = |v: &[f32]| {
                let v: Vec<f32> = v.chunks(w).flat_map(|r| r[..d / 2].to_vec()).collect();
                Tensor::from_vec(v, (ct, d / 2), &dev).unwrap()
            };
            let want = match layout {
                Layout::Halves => candle_nn::rotary_emb::rope(&xt, &half(&c), &half(&s)).unwrap(),
                Layout::Pairs => candle_nn::rotary_emb::rope_i(&xt, &half(&c), &half(&s)).unwrap(),
            };
            same_bits(
                &format!("{:?} {layout:?}", (b, h, t, d)),
                &got,
                &bits(&want),
                DType::F32,
            );
        }
    }
}

#[test]
fn rope_plans_name_the_kernels_and_refuse_what_they_cannot_run() {
    let l = rope_plan(RopePass::Backward, 6, 3, 8, 4, DType::BF16).unwrap();
    assert_eq!((l.kernel.as_str(), l.halves), ("amp_rope_pairs_bwd_bf16", false));
    let l = rope_plan(RopePass::Forward, 6, 3, 8, 8, DType::F16).unwrap();
    assert_eq!(
        (l.kernel.as_str(), l.grid, l.block),
        ("amp_rope_halves_fwd_f16", 1, 256)
    );
    // Large: capped, the threads' pairs in a grid-stride loop.
    let big = rope_plan(RopePass::Forward, 8 * 32 * 4096, 4096, 128, 128, DType::F32).unwrap();
    assert_eq!(big.grid, 8192);
    assert_eq!(
        rope_plan_with(RopePass::Forward, 6, 3, 8, 8, DType::F32, 0)
            .unwrap()
            .grid,
        1
    );
    // No kernel: the composed ops run.
    for (rows, t, d, w, dt) in [
        (0, 3, 8, 8, DType::F32),
        (6, 3, 0, 0, DType::F32),
        (6, 3, 7, 7, DType::F32),
        (6, 3, 8, 6, DType::F32),
        (7, 3, 8, 8, DType::F32),
        (6, 3, 8, 8, DType::F64),
        (1 << 24, 1 << 24, 256, 256, DType::F32),
    ] {
        assert!(
            rope_plan(RopePass::Forward, rows, t, d, w, dt).is_none(),
            "{rows} {t} {d} {w} {dt:?}"
        );
    }
}

// ------------------------------------------------------------------------------ GPU vs CPU

/// The library's CUDA op (forward, and `x`'s gradient through candle's autograd) against the
/// composed ops on the CPU, bit for bit, for every type and both layouts, with tables longer
/// than the positions; a table that tracks a gradient leaves the composed ops to run.
#[test]
fn cuda_rope_matches_the_cpu_path() {
    let dev = common::device();
    if dev.is_cpu() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_rope_loaded(&dev),
        "the CUDA rotary-embedding kernels did not load (see the log's warning)"
    );
    for (k, &(b, h, t, d, ct)) in SHAPES.iter().enumerate() {
        let shape = [b, h, t, d];
        let n = b * h * t * d;
        for layout in [Layout::Halves, Layout::Pairs] {
            let w = width(layout, d);
            let (c, s) = tables(ct, w, layout, false, k as u64);
            let (x, g) = (values(n, k as u64 + 2, 3.0), values(n, k as u64 + 3, 2.0));
            let table = |v: &[f32]| Tensor::from_vec(v.to_vec(), (ct, w), &dev).unwrap();
            for dt in TYPES {
                let what = format!("{shape:?} {layout:?} {dt:?}");
                let want = reference(&x, (&c, &s), &g, shape, layout, dt);
                let xf = Tensor::from_vec(x.iter().map(|v| *v as f32).collect::<Vec<_>>(), &shape[..], &dev).unwrap();
                let xv = Var::from_tensor(&xf.to_dtype(dt).unwrap()).unwrap();
                let y = candle_amp::testing::cuda_rope(xv.as_tensor(), &table(&c), &table(&s))
                    .unwrap()
                    .expect("the kernels apply");
                assert_eq!(y.dtype(), dt);
                let gt = Tensor::from_vec(g.iter().map(|v| *v as f32).collect::<Vec<_>>(), &shape[..], &dev).unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * gt).unwrap().sum_all().unwrap();
                let dx = loss.backward().unwrap().get(xv.as_tensor()).unwrap().clone();
                let host = |t: &Tensor| bits(&t.to_device(&Device::Cpu).unwrap());
                same_bits(&format!("{what} y"), &host(&y), &want[1], dt);
                same_bits(&format!("{what} dx"), &host(&dx), &want[3], dt);
            }
            let tracked = Var::from_tensor(&table(&c)).unwrap();
            let x = Tensor::zeros(&shape[..], DType::F32, &dev).unwrap();
            assert!(
                candle_amp::testing::cuda_rope(&x, tracked.as_tensor(), &table(&s))
                    .unwrap()
                    .is_none()
            );
        }
    }
}
