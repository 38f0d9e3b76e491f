//! No two buffers of a run share storage, whatever the optimizer, level, half type and
//! path: candle's `clone`, `detach` and same-type `to_dtype` share it, and the library
//! writes master gradients, optimizer state and parameters in place, so two buffers over one
//! storage would change together (SGD's first momentum was once the master gradient itself,
//! which the next backward overwrote). Checked after every stage of a few accumulated,
//! clipped steps and a `GradScaler` step, together with what it protects: a `state_dict` taken earlier does not
//! change afterwards, and SGD's momentum follows PyTorch's `buf = g_1`, then
//! `buf = mu*buf + g_t`.
//!
//! On the CPU: the paths compared are the CPU's (fused passes, the tensor path with
//! `fused: false`, and the device path forced on the CPU).

mod common;

use candle_amp::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, GradScaler, HalfType, OptLevel, ops};
use candle_core::Tensor;
use common::{AmpTwoLinear, assert_no_shared_storage, batches, flat};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Algo {
    Sgd,
    SgdMomentum,
    AdamW,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    /// The fused CPU passes.
    Fused,
    /// The tensor-op update (`fused: false`) with the CPU's stage 3.
    Tensor,
    /// Everything on the device path, forced on the CPU.
    Device,
}

fn algo(a: Algo, fused: bool) -> Box<dyn Optimizer> {
    match a {
        Algo::Sgd => Box::new(
            Sgd::new(SgdConfig {
                fused,
                ..SgdConfig::new(0.05)
            })
            .unwrap(),
        ),
        Algo::SgdMomentum => Box::new(
            Sgd::new(SgdConfig {
                momentum: 0.9,
                fused,
                ..SgdConfig::new(0.05)
            })
            .unwrap(),
        ),
        Algo::AdamW => Box::new(
            AdamW::new(AdamWConfig {
                lr: 0.01,
                fused,
                ..Default::default()
            })
            .unwrap(),
        ),
    }
}

/// A deep copy of an optimizer's state, to compare with what the same `state_dict` value
/// holds later.
fn frozen(s: &amp::optim::AmpOptimizerState) -> serde_json::Value {
    serde_json::to_value(s).unwrap()
}

fn check(a: Algo, level: OptLevel, half: HalfType, path: Path) {
    let what = format!("{a:?} {level} {half:?} {path:?}");
    let config = AmpConfig::new(level)
        .half(half)
        .verbosity(0)
        .device_path(path == Path::Device);
    let amp = amp::Amp::new(config, &common::device()).unwrap();
    let model = amp.model(AmpTwoLinear::new).unwrap();
    let mut opt = amp.optimizer(AlgoBox(algo(a, path == Path::Fused))).unwrap();
    let data = batches(6, 41);
    let mut earlier: Vec<(amp::optim::AmpOptimizerState, serde_json::Value)> = Vec::new();
    for (step, pair) in data.chunks(2).enumerate() {
        for (i, (x, y)) in pair.iter().enumerate() {
            let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            assert_no_shared_storage(&amp, &[&opt], &format!("{what}: step {step}, backward {i}"));
        }
        opt.clip_grad_norm(10.0).unwrap();
        assert_no_shared_storage(&amp, &[&opt], &format!("{what}: step {step}, clipped"));
        opt.step().unwrap();
        assert_no_shared_storage(&amp, &[&opt], &format!("{what}: step {step}, stepped"));
        opt.zero_grad();
        assert_no_shared_storage(&amp, &[&opt], &format!("{what}: step {step}, zeroed"));
        let s = opt.state_dict().unwrap();
        let copy = frozen(&s);
        earlier.push((s, copy));
        for (k, (s, copy)) in earlier.iter().enumerate() {
            assert_eq!(
                &frozen(s),
                copy,
                "{what}: the state_dict of step {k} changed by step {step}"
            );
        }
    }
    // The PyTorch-style API over the same stages: a micro-batch, then the step.
    let mut scaler = GradScaler::new();
    let grads = |scaler: &GradScaler, i: usize| {
        let (x, y) = &data[i];
        let loss = ops::mse(&model.forward(x).unwrap(), y).unwrap();
        scaler.scale(&loss).unwrap().backward().unwrap()
    };
    let (g0, g1) = (grads(&scaler, 0), grads(&scaler, 1));
    scaler.accumulate(&mut opt, &g0).unwrap();
    assert_no_shared_storage(&amp, &[&opt], &format!("{what}: GradScaler, accumulated"));
    scaler.step(&mut opt, &g1).unwrap();
    assert_no_shared_storage(&amp, &[&opt], &format!("{what}: GradScaler, stepped"));
    scaler.update(None).unwrap();
    opt.zero_grad();
    assert_no_shared_storage(&amp, &[&opt], &format!("{what}: GradScaler, zeroed"));
    for (k, (s, copy)) in earlier.iter().enumerate() {
        assert_eq!(
            &frozen(s),
            copy,
            "{what}: the state_dict of step {k} changed by GradScaler's step"
        );
    }
}

/// A boxed algorithm as an `Optimizer` (the test picks one at run time).
struct AlgoBox(Box<dyn Optimizer>);

impl Optimizer for AlgoBox {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn defaults(&self) -> amp::optim::GroupHyper {
        self.0.defaults()
    }
    fn update(&mut self, p: &amp::optim::ParamUpdate<'_>) -> amp::Result<Tensor> {
        self.0.update(p)
    }
    fn step(&mut self, params: &[amp::optim::ParamUpdate<'_>]) -> amp::Result<()> {
        self.0.step(params)
    }
    fn reads_f32_copies(&self, params: &[amp::optim::ParamUpdate<'_>]) -> bool {
        self.0.reads_f32_copies(params)
    }
    fn step_snapshot(&self, params: &[amp::optim::ParamUpdate<'_>]) -> Option<amp::optim::OptimizerState> {
        self.0.step_snapshot(params)
    }
    fn state_dict(&self) -> amp::Result<amp::optim::OptimizerState> {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, state: &amp::optim::OptimizerState) -> amp::Result<()> {
        self.0.load_state_dict(state)
    }
}

#[test]
fn no_two_live_buffers_share_storage_after_any_stage() {
    for a in [Algo::Sgd, Algo::SgdMomentum, Algo::AdamW] {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            for half in [HalfType::F16, HalfType::Bf16] {
                for path in [Path::Fused, Path::Tensor, Path::Device] {
                    check(a, level, half, path);
                }
            }
        }
    }
}

/// SGD with momentum on the tensor path, against PyTorch's rule written out: `buf = g_1`,
/// then `buf = mu*buf + g_t`, `p -= lr*buf`. The gradient of `sum(w * c_t)` is `c_t`.
#[test]
fn sgd_momentum_on_the_tensor_path_follows_pytorch() {
    for fused in [false, true] {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).verbosity(0), &common::device()).unwrap();
        let w = amp
            .var_builder()
            .get_with_hints((3,), "w", candle_nn::Init::Const(1.0))
            .unwrap();
        let (lr, mu) = (0.5f32, 0.9f32);
        let mut opt = amp
            .optimizer(
                Sgd::new(SgdConfig {
                    momentum: mu as f64,
                    fused,
                    ..SgdConfig::new(lr as f64)
                })
                .unwrap(),
            )
            .unwrap();
        let grads = [[1f32, -2., 4.], [8., 16., -32.], [0.25, 0.5, 1.]];
        let (mut p, mut buf) = (vec![1f32; 3], vec![0f32; 3]);
        let mut after_first = None;
        for (t, g) in grads.iter().enumerate() {
            let c = Tensor::new(g, &common::device()).unwrap();
            let loss = (&w * &c).unwrap().sum_all().unwrap();
            amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            for i in 0..3 {
                buf[i] = if t == 0 { g[i] } else { mu * buf[i] + g[i] };
                p[i] -= lr * buf[i];
            }
            let state = opt.state_dict().unwrap();
            let mom = flat(&state.algorithm.params["w"].buffers["momentum_buffer"]);
            // Bit for bit with the CPU kernels; a device's may fuse the multiply-adds.
            let rtol = common::exact_or_te(candle_core::DType::F32);
            common::assert_close(&mom, &buf, rtol, &format!("fused={fused}: the momentum after step {t}"));
            common::assert_close(
                &flat(&amp.store().param("w").unwrap().f32_value().unwrap()),
                &p,
                rtol,
                &format!("fused={fused}: step {t}"),
            );
            if t == 0 {
                after_first = Some((state, buf.clone()));
            }
        }
        // The snapshot of step 1 still holds step 1's momentum.
        let (state, first) = after_first.unwrap();
        assert_eq!(
            flat(&state.algorithm.params["w"].buffers["momentum_buffer"]),
            first,
            "fused={fused}"
        );
    }
}
