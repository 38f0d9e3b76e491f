//! A resumed run's state is on the run's device: a checkpoint is read on the host, and
//! restoring it (weights, f32 masters, optimizer state) puts every tensor where the run's
//! parameters live, on the CPU path and the device path alike. Under
//! `CANDLE_AMP_TEST_DEVICE=cuda` this is the GPU resume that failed with `device mismatch in
//! copy, lhs: Cpu, rhs: Cuda`; on the CPU it checks the same path with the device path
//! forced (optimizer state as tensors).

mod common;

use candle_amp::checkpoint::CheckpointDir;
use candle_amp::optim::{AdamW, AdamWConfig};
use candle_amp::{self as amp, AmpConfig, OptLevel};
use candle_core::Tensor;
use common::{AmpTwoLinear, batches, f32_bits};

fn run(level: OptLevel, device_path: bool) -> (amp::AmpModel<AmpTwoLinear>, amp::AmpOptimizer, amp::Amp) {
    let config = AmpConfig::new(level).seed(5).verbosity(0).device_path(device_path);
    let opt = AdamW::new(AdamWConfig::default()).unwrap();
    common::initialize(AmpTwoLinear::new, opt, config).unwrap()
}

fn step(model: &amp::AmpModel<AmpTwoLinear>, opt: &mut amp::AmpOptimizer, amp: &amp::Amp, i: usize) {
    let (x, y) = &batches(i + 1, 21)[i];
    let out = model.forward(x).unwrap().to_dtype(candle_core::DType::F32).unwrap();
    let loss = candle_nn::loss::mse(&out, y).unwrap();
    amp.scale_loss(&loss, opt).unwrap().backward().unwrap();
    opt.step().unwrap();
    opt.zero_grad();
}

/// Every live buffer of the run (parameters, masters, optimizer state and gradients) is on
/// the device of the run's parameters.
fn assert_on_run_device(amp: &amp::Amp, opt: &amp::AmpOptimizer, what: &str) {
    let dev = amp.store().device();
    let buffers: Vec<(String, Tensor)> = amp::testing::live_buffers(amp, &[opt]).unwrap();
    for (name, t) in &buffers {
        // The host path keeps optimizer state in host buffers (listed as CPU tensors): only
        // the device path's state lives on the parameters' device.
        if name.contains(".state.") && !amp.device_path() {
            continue;
        }
        assert!(
            t.device().same_device(dev),
            "{what}: `{name}` is on {:?}, the run on {dev:?}",
            t.device()
        );
    }
}

#[test]
fn a_restored_run_holds_its_state_on_its_own_device_and_continues_as_the_saved_one() {
    for level in [OptLevel::O0, OptLevel::O2] {
        for device_path in [false, true] {
            let what = format!("{level} device_path={device_path}");
            let dir = std::env::temp_dir().join(format!(
                "candle-amp-resume-device-{}-{level}-{device_path}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let (model, mut opt, amp) = run(level, device_path);
            for i in 0..3 {
                step(&model, &mut opt, &amp, i);
            }
            CheckpointDir::new(&dir, 1)
                .save(&amp, &[&opt], 3, serde_json::Value::Null)
                .unwrap();
            let (r_model, mut r_opt, r_amp) = run(level, device_path);
            CheckpointDir::new(&dir, 1)
                .load()
                .unwrap()
                .restore(&r_amp, &mut [&mut r_opt])
                .unwrap();
            assert_on_run_device(&r_amp, &r_opt, &format!("{what}: restored"));
            assert_eq!(
                f32_bits(r_amp.store()),
                f32_bits(amp.store()),
                "{what}: the saved weights"
            );
            // Both continue alike (the same device, the same kernels: bit for bit).
            for i in 3..5 {
                step(&model, &mut opt, &amp, i);
                step(&r_model, &mut r_opt, &r_amp, i);
            }
            assert_on_run_device(&r_amp, &r_opt, &format!("{what}: after two steps"));
            assert_eq!(f32_bits(r_amp.store()), f32_bits(amp.store()), "{what}: two steps on");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
