//! `candle_amp::nn::Embedding`'s table gradient: at every level the f32 gradient the optimizer
//! sees is the sum of the looked-up rows' gradients to f32 accuracy, for tokens repeated
//! hundreds of times in a batch (where a half sum loses the small terms: bf16 keeps 8 bits);
//! at O2 and O3 it never passes through candle's `GradStore` in half. Bad ids are typed
//! errors at every level.

mod common;

use candle_amp::nn::{Embedding, embedding};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, HalfType, OptLevel};
use candle_core::{DType, Device, Module, Tensor};
use common::vals;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const VOCAB: usize = 12;
const WIDTH: usize = 8;
const ROWS: usize = 3000;
const LEVELS: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];
const HALVES: [HalfType; 2] = [HalfType::F16, HalfType::Bf16];

struct Emb {
    e: Embedding,
}

impl Module for Emb {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.e.forward(ids)
    }
}

fn init(level: OptLevel, half: HalfType) -> (amp::AmpModel<Emb>, amp::optim::AmpOptimizer, amp::Amp) {
    amp::initialize(
        |vb| {
            Ok(Emb {
                e: embedding(VOCAB, WIDTH, vb.pp("wte"))?,
            })
        },
        Sgd::new(SgdConfig::new(0.1)).unwrap(),
        AmpConfig::new(level).half(half).verbosity(0).seed(5),
    )
    .unwrap()
}

/// Ids that repeat: most rows hit tokens 0-3 (about 700 times each), a few the rest; token
/// `VOCAB - 1` never occurs (its gradient must be exactly 0).
fn ids() -> Vec<u32> {
    (0..ROWS)
        .map(|i| {
            if i % 10 == 9 {
                (4 + i / 10 % 7) as u32
            } else {
                (i % 4) as u32
            }
        })
        .collect()
}

/// The table's gradient against the f64 sum of the gradients that reach the lookup (`r`
/// rounded to the type the table computes in: the loss scale is a power of two, so scaling
/// and unscaling are exact), within the bound of an f32 running sum of those terms; and at
/// O2 and O3 no table gradient in candle's `GradStore`.
#[test]
fn the_table_gradient_is_the_f32_sum_of_the_rows_gradients() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // Full-mantissa values below 0.5, so that times f16's initial scale 2^16 none overflows.
    let r: Vec<f32> = (0..ROWS * WIDTH).map(|_| rng.random_range(-0.45f32..0.45)).collect();
    let rt = Tensor::from_vec(r.clone(), (ROWS, WIDTH), &Device::Cpu).unwrap();
    let idv = ids();
    for level in LEVELS {
        for half in HALVES {
            for id_type in [DType::U32, DType::I64, DType::U8] {
                let what = format!("{level:?} {half:?} ids {id_type:?}");
                let (model, mut opt, amp) = init(level, half);
                let table = model.inner().e.embeddings().clone();
                let dt = table.dtype();
                let ids = Tensor::from_vec(idv.clone(), ROWS, &Device::Cpu)
                    .unwrap()
                    .to_dtype(id_type)
                    .unwrap();
                let y = model.forward(&ids).unwrap();
                assert_eq!(y.dims(), [ROWS, WIDTH], "{what}");
                // The rows looked up are the table's, exactly.
                let tv = vals(&table);
                let yv = vals(&y);
                for (i, &id) in idv.iter().enumerate().step_by(97) {
                    let row = id as usize * WIDTH;
                    assert_eq!(yv[i * WIDTH..(i + 1) * WIDTH], tv[row..row + WIDTH], "{what}");
                }
                let loss = (y.to_dtype(DType::F32).unwrap() * &rt).unwrap().sum_all().unwrap();
                let mut in_store = None;
                let report = amp
                    .scale_loss(&loss, &mut opt)
                    .unwrap()
                    .backward_with(|l| {
                        let g = l.backward()?;
                        in_store = Some(g.get(&table).map(|g| g.dtype()));
                        Ok(g)
                    })
                    .unwrap();
                assert!(!report.found_inf, "{what}");
                // At O1 a lookup alone runs no autocast op, which the run says.
                if level != OptLevel::O1 {
                    assert!(report.warnings.is_empty(), "{what}: {:?}", report.warnings);
                }
                if matches!(level, OptLevel::O2 | OptLevel::O3) {
                    assert_eq!(in_store, Some(None), "{what}: a half table gradient in the GradStore");
                }
                let got = vals(&opt.master_grads()["wte.weight"]);
                let mut want = vec![0f64; VOCAB * WIDTH];
                let mut abs = vec![0f64; VOCAB * WIDTH];
                let mut count = [0usize; VOCAB];
                let held = vals(&rt.to_dtype(dt).unwrap());
                for (i, &id) in idv.iter().enumerate() {
                    count[id as usize] += 1;
                    for j in 0..WIDTH {
                        want[id as usize * WIDTH + j] += held[i * WIDTH + j];
                        abs[id as usize * WIDTH + j] += held[i * WIDTH + j].abs();
                    }
                }
                for k in 0..VOCAB * WIDTH {
                    // A running f32 sum of n terms errs by at most n * 2^-24 * sum |terms|.
                    let bound = count[k / WIDTH] as f64 * 2f64.powi(-24) * abs[k];
                    assert!(
                        (got[k] - want[k]).abs() <= bound,
                        "{what}: token {} column {}: {} vs {} (bound {bound:e})",
                        k / WIDTH,
                        k % WIDTH,
                        got[k],
                        want[k]
                    );
                }
                assert!(got[(VOCAB - 1) * WIDTH..].iter().all(|g| *g == 0.0), "{what}");
            }
        }
    }
}

/// Ids of a float type, negative or past the table are `InvalidArgument` naming `ids`, at
/// every level, inside and outside a run's backward; the table is untouched.
#[test]
fn bad_ids_are_typed_errors() {
    for level in LEVELS {
        let (model, _opt, _amp) = init(level, HalfType::Bf16);
        let before = vals(model.inner().e.embeddings());
        let cases = [
            Tensor::new(&[1i64, -1], &Device::Cpu).unwrap(),
            Tensor::new(&[0u32, VOCAB as u32], &Device::Cpu).unwrap(),
            Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap(),
        ];
        for ids in cases {
            let amp_err = AmpError::from(model.forward(&ids).expect_err("a bad id"));
            assert!(
                matches!(amp_err, AmpError::InvalidArgument { argument: "ids", .. }),
                "{level:?}: {amp_err}"
            );
        }
        assert_eq!(vals(model.inner().e.embeddings()), before);
    }
}
