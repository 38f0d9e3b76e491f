//! The CUDA embedding lookup without a GPU: `src/kernels/cuda/embed.cu`, unmodified, built with
//! g++ against the CPU grid emulator (`tests/cuda_emu/emu.h`) and launched as the library's
//! plan launches it. The forward against the table's rows, bit for bit (zeros for the ids'
//! padding value, NaN for other ids outside the table); the backward against candle's own
//! f32 `index_add` on the CPU (the same sequential f32 sum in the ids' order) rounded once to
//! the table's type, bit for bit, and against the f64 sum within the bound of an f32 running
//! sum, which a sum kept in the half type breaks; the same bits whatever the grid. Needs g++
//! (C++20). Under `CANDLE_AMP_TEST_DEVICE=cuda` the last test compares the library's CUDA op
//! (and `nn::Embedding` on CUDA) with the CPU path.

mod common;
#[path = "cuda_emu/mod.rs"]
mod cuda_emu;

use std::path::Path;

use candle_amp::testing::cuda_embed::{EmbedLaunch, EmbedPass, embed_plan, embed_plan_with};
use candle_core::{DType, Device, Tensor, Var};
use half::{bf16, f16};

use cuda_emu::{atol, decode, encode, eps, values};

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const ID_TYPES: [DType; 2] = [DType::U32, DType::I64];
/// `(vocab, width, n)`: one row of one value; a narrow table with a heavily repeated token; a
/// width over two blocks and one column; more rows than ids.
const SHAPES: [(usize, usize, usize); 4] = [(1, 1, 50), (13, 7, 600), (40, 257, 300), (300, 33, 90)];
/// Grids forced on the plan: one block walks every tile; a few share them.
const GRIDS: [u32; 2] = [1, 3];

/// An id as the kernels see it: a row, the ids' padding value, or another id outside the table.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Id {
    Row(usize),
    Padding,
    /// Past the table (`vocab + k`), or for i64 negative (`-1 - k`).
    Bad(u64),
}

fn id_bytes(ids: &[Id], vocab: usize, dt: DType) -> Vec<u8> {
    let mut b = Vec::new();
    for &id in ids {
        if dt == DType::U32 {
            let v = match id {
                Id::Row(r) => r as u32,
                Id::Padding => u32::MAX,
                // u32::MAX - 1 is the largest id that is not the padding value.
                Id::Bad(k) => (vocab as u64 + k).min(u64::from(u32::MAX - 1)) as u32,
            };
            b.extend(v.to_le_bytes());
        } else {
            let v = match id {
                Id::Row(r) => r as i64,
                Id::Padding => i64::MAX,
                Id::Bad(k) if k % 2 == 0 => vocab as i64 + k as i64,
                Id::Bad(1) => i64::MIN,
                Id::Bad(k) => -(k as i64),
            };
            b.extend(v.to_le_bytes());
        }
    }
    b
}

/// `n` ids over `vocab` rows, a third of them row `vocab / 2` (heavy repetition), with
/// `extra` padding and bad ids among them when asked.
fn make_ids(n: usize, vocab: usize, seed: u64, extra: bool) -> Vec<Id> {
    values(n, seed, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let u = (v + 1.0) / 2.0;
            if extra && i % 17 == 5 {
                Id::Padding
            } else if extra && i % 19 == 7 {
                Id::Bad((i % 5) as u64)
            } else if i % 3 == 1 {
                Id::Row(vocab / 2)
            } else {
                Id::Row(((u * vocab as f64) as usize).min(vocab - 1))
            }
        })
        .collect()
}

fn short(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::U32 => "u32",
        _ => "i64",
    }
}

fn file(dir: &Path, name: &str, b: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, b).unwrap();
    p.to_string_lossy().into_owned()
}

/// The forward's output bytes, as the plan launches the kernel.
fn emulate_fwd(p: &EmbedLaunch, table: &[u8], ids: &[u8], n: usize, vocab: usize, width: usize, tag: &str) -> Vec<u8> {
    let dir = cuda_emu::scratch("embed", tag);
    let args = vec![
        "fwd".to_string(),
        p.kernel.clone(),
        p.grid.to_string(),
        p.block.to_string(),
        n.to_string(),
        vocab.to_string(),
        width.to_string(),
        file(&dir, "table", table),
        file(&dir, "ids", ids),
        dir.join("out").to_string_lossy().into_owned(),
    ];
    cuda_emu::run("embed", &args);
    std::fs::read(dir.join("out")).unwrap()
}

/// The backward's gradient bytes (in the table's type), as the plan launches the kernel.
fn emulate_bwd(p: &EmbedLaunch, ids: &[u8], g: &[u8], n: usize, vocab: usize, width: usize, tag: &str) -> Vec<u8> {
    let dir = cuda_emu::scratch("embed", tag);
    let args = vec![
        "bwd".to_string(),
        p.kernel.clone(),
        p.grid.to_string(),
        p.block.to_string(),
        n.to_string(),
        vocab.to_string(),
        width.to_string(),
        p.rows_per_tile.to_string(),
        p.row_tiles.to_string(),
        file(&dir, "ids", ids),
        file(&dir, "g", g),
        dir.join("out").to_string_lossy().into_owned(),
        dir.join("acc").to_string_lossy().into_owned(),
    ];
    cuda_emu::run("embed", &args);
    std::fs::read(dir.join("out")).unwrap()
}

fn plans(pass: EmbedPass, n: usize, vocab: usize, width: usize, dt: DType, it: DType) -> Vec<EmbedLaunch> {
    let mut v: Vec<EmbedLaunch> = GRIDS
        .iter()
        .map(|&g| embed_plan_with(pass, n, vocab, width, dt, it, g).unwrap())
        .collect();
    let full = embed_plan(pass, n, vocab, width, dt, it).unwrap();
    // The full grid too where the emulator runs it in moments.
    if full.grid <= 64 {
        v.push(full);
    }
    v
}

/// Every looked-up row is the table's row, bit for bit; the padding id's row is +0, every
/// other id outside the table gives NaN; at every grid, for every table and id type and width.
#[test]
fn forward_rows_are_the_table_rows_exactly() {
    for dt in TYPES {
        for it in ID_TYPES {
            for (s, &(vocab, width, n)) in SHAPES.iter().enumerate() {
                let size = if dt == DType::F32 { 4 } else { 2 };
                let (table, _) = encode(&values(vocab * width, 3 + s as u64, 2.0), dt);
                let ids = make_ids(n, vocab, 7 + s as u64, true);
                let ib = id_bytes(&ids, vocab, it);
                for p in plans(EmbedPass::Forward, n, vocab, width, dt, it) {
                    let what = format!("{dt:?} {it:?} {vocab}x{width} n={n} grid {}", p.grid);
                    let out = emulate_fwd(&p, &table, &ib, n, vocab, width, &format!("fwd{s}"));
                    assert_eq!(out.len(), n * width * size, "{what}");
                    for (j, id) in ids.iter().enumerate() {
                        let got = &out[j * width * size..(j + 1) * width * size];
                        match *id {
                            Id::Row(r) => {
                                assert_eq!(got, &table[r * width * size..(r + 1) * width * size], "{what}: id {j}")
                            }
                            Id::Padding => assert!(got.iter().all(|&b| b == 0), "{what}: padding id {j}"),
                            Id::Bad(_) => assert!(decode(got, dt).iter().all(|v| v.is_nan()), "{what}: bad id {j}"),
                        }
                    }
                }
            }
        }
    }
}

/// The gradients `g` for the ids: positive, larger on the repeated row's positions, so that
/// its sum comes near half f16's range (38400 on average of 600 / 3 terms up to 192).
fn grads(n: usize, width: usize, ids: &[Id], vocab: usize, seed: u64) -> Vec<f64> {
    let v = values(n * width, seed, 0.5);
    (0..n * width)
        .map(|k| match ids[k / width] {
            Id::Row(r) if r == vocab / 2 => 128.0 * (1.0 + v[k].abs()),
            _ => v[k] * 4.0,
        })
        .collect()
}

/// candle's own f32 `index_add` on the CPU over the in-range ids (a sequential f32 sum in
/// the ids' order), rounded once to `dt`: the bits the kernel must give.
fn candle_reference(ids: &[Id], held: &[f64], vocab: usize, width: usize, dt: DType) -> Vec<u8> {
    let (rows, picked): (Vec<u32>, Vec<f32>) = ids
        .iter()
        .enumerate()
        .filter_map(|(j, id)| match id {
            Id::Row(r) => Some((*r as u32, held[j * width..(j + 1) * width].to_vec())),
            _ => None,
        })
        .fold((Vec::new(), Vec::new()), |(mut r, mut p), (row, vals)| {
            r.push(row);
            p.extend(vals.iter().map(|&x| x as f32));
            (r, p)
        });
    let dev = Device::Cpu;
    let zeros = Tensor::zeros((vocab, width), DType::F32, &dev).unwrap();
    let sum = if rows.is_empty() {
        zeros
    } else {
        let m = rows.len();
        let idx = Tensor::from_vec(rows, m, &dev).unwrap();
        let src = Tensor::from_vec(picked, (m, width), &dev).unwrap();
        zeros.index_add(&idx, &src, 0).unwrap()
    };
    let sum = sum.to_dtype(dt).unwrap().flatten_all().unwrap();
    match dt {
        DType::F32 => sum
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => sum
            .to_vec1::<f16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        _ => sum
            .to_vec1::<bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    }
}

/// A sequential sum of `terms` kept in `dt` (what candle's `index_add` does in a half table).
fn half_sum(terms: &[f64], dt: DType) -> f64 {
    let round = |x: f64| match dt {
        DType::F16 => f16::from_f64(x).to_f64(),
        _ => bf16::from_f64(x).to_f64(),
    };
    terms.iter().fold(0.0, |s, &t| round(s + t))
}

/// The table's gradient: candle's f32 `index_add` rounded once, bit for bit, at every grid;
/// within the f32 running-sum bound of the f64 sum (which the heavy row's sum kept in f16 or
/// bf16 breaks); rows no id names are zero; padding and bad ids add nothing.
#[test]
fn backward_sums_each_row_in_f32_in_the_ids_order() {
    for dt in TYPES {
        for it in ID_TYPES {
            for (s, &(vocab, width, n)) in SHAPES.iter().enumerate() {
                let ids = make_ids(n, vocab, 21 + s as u64, true);
                let (gb, held) = encode(&grads(n, width, &ids, vocab, 5 + s as u64), dt);
                let ib = id_bytes(&ids, vocab, it);
                let want_bits = candle_reference(&ids, &held, vocab, width, dt);
                // The f64 sum, the sum of magnitudes and the terms per value.
                let mut want = vec![0f64; vocab * width];
                let mut abs = vec![0f64; vocab * width];
                let mut terms = vec![Vec::new(); vocab * width];
                for (j, id) in ids.iter().enumerate() {
                    if let Id::Row(r) = *id {
                        for c in 0..width {
                            want[r * width + c] += held[j * width + c];
                            abs[r * width + c] += held[j * width + c].abs();
                            terms[r * width + c].push(held[j * width + c]);
                        }
                    }
                }
                let bound = |k: usize| {
                    let f32_bound = terms[k].len() as f64 * 2f64.powi(-24) * abs[k];
                    f32_bound + eps(dt) * (want[k].abs() + f32_bound) + atol(dt)
                };
                let mut first: Option<Vec<u8>> = None;
                for p in plans(EmbedPass::Backward, n, vocab, width, dt, it) {
                    let what = format!("{dt:?} {it:?} {vocab}x{width} n={n} grid {}", p.grid);
                    let out = emulate_bwd(&p, &ib, &gb, n, vocab, width, &format!("bwd{s}"));
                    assert!(out == want_bits, "{what}: not candle's f32 index_add rounded once");
                    let got = decode(&out, dt);
                    for k in 0..vocab * width {
                        assert!(
                            (got[k] - want[k]).abs() <= bound(k),
                            "{what}: row {} column {}: {} vs {} (bound {:e})",
                            k / width,
                            k % width,
                            got[k],
                            want[k],
                            bound(k)
                        );
                        if terms[k].is_empty() {
                            assert_eq!(got[k].to_bits(), 0, "{what}: row {} named by no id", k / width);
                        }
                    }
                    // The same bits whatever the grid.
                    if let Some(f) = &first {
                        assert!(*f == out, "{what}: other bits than at another grid");
                    }
                    first = Some(out);
                }
                // The heavy row summed in the half type: outside the bound somewhere.
                if dt != DType::F32 && n >= 300 {
                    let heavy = vocab / 2;
                    let broken = (0..width).any(|c| {
                        let k = heavy * width + c;
                        (half_sum(&terms[k], dt) - want[k]).abs() > bound(k)
                    });
                    assert!(broken, "{dt:?} {vocab}x{width}: a half running sum met the bound");
                }
            }
        }
    }
}

/// The plans name the kernels, keep the backward's tiles covering the table exactly once,
/// and refuse what the kernels cannot run.
#[test]
fn embed_plans_name_the_kernels_and_refuse_what_they_cannot_run() {
    let p = embed_plan(EmbedPass::Forward, 10, 5, 3, DType::BF16, DType::I64).unwrap();
    assert_eq!(p.kernel, "amp_embed_fwd_bf16_i64");
    assert_eq!((p.grid, p.block), (1, 256));
    for dt in TYPES {
        for it in ID_TYPES {
            for (vocab, width) in [(1, 1), (7, 31), (50_257, 768), (128_256, 4096), (3, 257), (100_000, 1)] {
                let b = embed_plan(EmbedPass::Backward, 4096, vocab, width, dt, it).unwrap();
                assert_eq!(b.kernel, format!("amp_embed_bwd_{}_{}", short(dt), short(it)));
                assert!(b.block.is_multiple_of(32) && (32..=128).contains(&b.block), "{b:?}");
                let (rpt, tiles) = (b.rows_per_tile as usize, b.row_tiles as usize);
                assert!(rpt * tiles >= vocab && (tiles - 1) * rpt < vocab, "{vocab}: {b:?}");
                let items = tiles * width.div_ceil(b.block as usize);
                assert!(b.grid >= 1 && b.grid as usize <= items.min(8192), "{b:?}");
                assert_eq!(
                    embed_plan_with(EmbedPass::Backward, 4096, vocab, width, dt, it, 0)
                        .unwrap()
                        .grid,
                    1
                );
            }
        }
    }
    let no = |n, v, w, dt, it| embed_plan(EmbedPass::Backward, n, v, w, dt, it).is_none();
    assert!(no(0, 5, 3, DType::F32, DType::U32), "no ids");
    assert!(no(4, 0, 3, DType::F32, DType::U32), "no rows");
    assert!(no(4, 5, 0, DType::F32, DType::U32), "no columns");
    assert!(no(4, 5, 3, DType::F64, DType::U32), "f64 table");
    assert!(no(4, 5, 3, DType::F32, DType::U8), "u8 ids");
    assert!(no(4, 5, 3, DType::F32, DType::F32), "float ids");
    assert!(no(1 << 20, 5, 1 << 12, DType::F32, DType::U32), "n * width past i32");
    assert!(
        no(4, 1 << 20, 1 << 12, DType::F32, DType::U32),
        "vocab * width past i32"
    );
}

/// On a GPU: the library's CUDA op and `nn::Embedding` on CUDA against the CPU path: the same
/// rows bit for bit; the table's gradient equal to candle's f32 `index_add` on the CPU
/// rounded once to the table's type (for an f32 table: candle's CPU `index_select` backward).
/// Skipped on the CPU.
#[test]
fn cuda_embedding_matches_the_cpu_path() {
    let dev = common::device();
    if !dev.is_cuda() {
        return;
    }
    assert!(
        candle_amp::testing::cuda_embed_loaded(&dev),
        "the embedding kernels did not load"
    );
    let (vocab, width, n) = (50, 96, 4000);
    let ids: Vec<Id> = make_ids(n, vocab, 99, false);
    let rows: Vec<u32> = ids
        .iter()
        .map(|id| match id {
            Id::Row(r) => *r as u32,
            _ => unreachable!(),
        })
        .collect();
    for dt in TYPES {
        for it in ID_TYPES {
            let what = format!("{dt:?} {it:?}");
            let table0 = Tensor::from_vec(
                values(vocab * width, 1, 1.0)
                    .iter()
                    .map(|&v| v as f32)
                    .collect::<Vec<_>>(),
                (vocab, width),
                &Device::Cpu,
            )
            .unwrap()
            .to_dtype(dt)
            .unwrap();
            let ids_cpu = Tensor::from_vec(rows.clone(), (40, n / 40), &Device::Cpu)
                .unwrap()
                .to_dtype(it)
                .unwrap();
            let (_, held) = encode(&grads(n, width, &ids, vocab, 3), dt);
            let g_cpu = Tensor::from_vec(
                held.iter().map(|&v| v as f32).collect::<Vec<_>>(),
                (40, n / 40, width),
                &Device::Cpu,
            )
            .unwrap()
            .to_dtype(dt)
            .unwrap();
            let table = Var::from_tensor(&table0.to_device(&dev).unwrap()).unwrap();
            let y = candle_amp::testing::cuda_embedding(&ids_cpu.to_device(&dev).unwrap(), table.as_tensor())
                .unwrap()
                .expect("the op applies");
            let y_want = table0.index_select(&ids_cpu.flatten_all().unwrap(), 0).unwrap();
            let same = y
                .flatten_all()
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let want = y_want.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(
                same.to_vec1::<f32>().unwrap(),
                want.to_vec1::<f32>().unwrap(),
                "{what}: rows"
            );
            let loss = (y * g_cpu.to_device(&dev).unwrap()).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let got = grads.get(table.as_tensor()).expect("a table gradient");
            assert_eq!(got.dtype(), dt, "{what}");
            let got_bits = got.to_device(&Device::Cpu).unwrap();
            let want_bits = candle_reference(&ids, &held, vocab, width, dt);
            let got_bytes: Vec<u8> = match dt {
                DType::F32 => got_bits
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                DType::F16 => got_bits
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f16>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                _ => got_bits
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<bf16>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            };
            assert!(got_bytes == want_bits, "{what}: the table's gradient");
        }
    }
    // Through `nn::Embedding` on CUDA: the hook takes the kernel, the rows are the table's.
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let e = candle_amp::nn::embedding(vocab, width, vb.pp("wte")).unwrap();
    let ids_dev = Tensor::from_vec(rows.clone(), n, &dev).unwrap();
    let y = candle_core::Module::forward(&e, &ids_dev).unwrap();
    let want = e.embeddings().index_select(&ids_dev, 0).unwrap();
    let diff = (y - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0, "nn::Embedding on CUDA");
}
