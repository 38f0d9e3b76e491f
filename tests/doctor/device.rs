//! The doctor on the device path: statistics computed with tensor ops on the device and
//! read in one transfer per observed step, counted in `Amp::host_syncs`.

use candle_amp::doctor::{Doctor, DoctorConfig, TensorReport};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel, nn as ann, ops};
use candle_core::{Device, Tensor};
use candle_nn::{Module, VarBuilder};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

struct Mlp {
    fc1: ann::Linear,
    fc2: ann::Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&ops::relu(&self.fc1.forward(x)?)?)
    }
}

fn mlp(vb: VarBuilder) -> candle_core::Result<Mlp> {
    Ok(Mlp {
        fc1: ann::linear(16, 32, vb.pp("fc1"))?,
        fc2: ann::linear(32, 4, vb.pp("fc2"))?,
    })
}

/// `steps` steps at `level` with the doctor (if `doctor`) observing every step; returns the
/// report's tensors, the host reads after each step and the final weights' bits.
fn run(level: OptLevel, device_path: bool, doctor: bool, steps: usize) -> (Vec<TensorReport>, Vec<u64>, Vec<Vec<u32>>) {
    let cfg = AmpConfig::new(level)
        .half(HalfType::F16)
        .verbosity(0)
        .seed(9)
        .device_path(device_path);
    let (model, mut opt, amp) = amp::initialize(
        mlp,
        amp::optim::AdamW::new(amp::optim::AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        })
        .unwrap(),
        cfg,
    )
    .unwrap();
    let doc = doctor.then(|| {
        Doctor::attach(
            &amp,
            DoctorConfig {
                every: 1,
                ..Default::default()
            },
        )
        .unwrap()
    });
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut syncs = Vec::new();
    for _ in 0..steps {
        // Inputs over many binades (some underflow f16 in the first layer's output).
        let x: Vec<f32> = (0..8 * 16)
            .map(|_| rng.random_range(-1f32..1.0) * 10f32.powi(rng.random_range(-7..2)))
            .collect();
        let y: Vec<u32> = (0..8).map(|_| rng.random_range(0..4)).collect();
        let x = Tensor::from_vec(x, (8, 16), &Device::Cpu).unwrap();
        let y = Tensor::new(y.as_slice(), &Device::Cpu).unwrap();
        let loss = ops::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        syncs.push(amp.host_syncs());
    }
    let weights = opt
        .master_params()
        .unwrap()
        .values()
        .map(|t| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        })
        .collect();
    (doc.map(|d| d.report().tensors).unwrap_or_default(), syncs, weights)
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    a == b || (a - b).abs() <= rel * a.abs().max(b.abs())
}

#[test]
fn on_the_device_path_the_doctor_reads_once_per_step_and_sees_what_the_cpu_path_sees() {
    for level in [OptLevel::O1, OptLevel::O2] {
        let (dev, syncs, _) = run(level, true, true, 3);
        // One read for the step's flags, one for the doctor's statistics.
        assert_eq!(syncs, vec![2, 4, 6], "{level}");
        let (_, plain_syncs, _) = run(level, true, false, 3);
        assert_eq!(plain_syncs, vec![1, 2, 3], "{level}");
        let (cpu, cpu_syncs, _) = run(level, false, true, 3);
        assert_eq!(cpu_syncs, vec![0, 0, 0], "{level}");
        assert_eq!(dev.len(), cpu.len(), "{level}");
        assert!(dev.len() >= 12, "{level}: {} tensors", dev.len());
        for (d, c) in dev.iter().zip(&cpu) {
            let what = format!("{level} {} {:?}", c.name, c.kind);
            assert_eq!(
                (&d.name, d.kind, &d.dtype, d.observations, d.elements, d.nonfinite),
                (&c.name, c.kind, &c.dtype, c.observations, c.elements, c.nonfinite),
                "{what}"
            );
            for (x, y, f) in [
                (d.amax, c.amax, "amax"),
                (d.amin_nonzero, c.amin_nonzero, "amin_nonzero"),
                (d.mean_abs, c.mean_abs, "mean_abs"),
                (d.range_binades, c.range_binades, "range_binades"),
            ] {
                assert!(close(x, y, 1e-5), "{what}: {f} {x} vs {y}");
            }
            // Fractions: the same elements, up to one that f32 rounding moved across a limit.
            let one = 1.0 / d.elements.max(1) as f64 + 1e-12;
            for (x, y, f) in [
                (d.zero_frac, c.zero_frac, "zero_frac"),
                (d.underflow_f16, c.underflow_f16, "underflow_f16"),
                (d.underflow_bf16, c.underflow_bf16, "underflow_bf16"),
                (d.overflow_f16, c.overflow_f16, "overflow_f16"),
            ] {
                assert!((x - y).abs() <= one, "{what}: {f} {x} vs {y}");
            }
        }
        // Recording changes no value: the same weights, bit for bit, with and without it.
        assert_eq!(run(level, false, true, 3).2, run(level, false, false, 3).2, "{level}");
    }
}
