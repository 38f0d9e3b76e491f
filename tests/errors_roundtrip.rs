//! Typed errors survive a trip through candle: an `AmpError` raised inside candle-facing code
//! (a custom op, the parameter store behind a `VarBuilder`) comes back as itself, not as
//! `AmpError::Candle`.
//!
//! The builder test runs on `common::device()`; the others stay on the CPU: one's ranks are
//! `LocalGroup` threads, the other's custom op has only a CPU forward (the error's trip
//! through candle is the same on every device).

mod common;

use std::time::Duration;

use candle_amp::distributed::DataParallel;
use candle_amp::nn::batch_norm;
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, AmpError, CheckpointErrorKind, DistErrorKind, OptLevel};
use candle_core::{DType, Device, Tensor};
use candle_nn::ModuleT;
use common::on_ranks;

#[test]
fn a_sync_batch_norm_timeout_is_a_typed_distributed_error() {
    let out = on_ranks(2, Duration::from_millis(300), |c| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).seed(1), &Device::Cpu).unwrap();
        let model = amp.model(|vb| batch_norm(4, 1e-5, vb.pp("bn"))).unwrap();
        let rank = c.rank();
        let dp = DataParallel::new(&amp, c, Default::default()).unwrap();
        dp.sync_batch_norm(&amp, true).unwrap();
        if rank == 1 {
            return None; // joins the group, then never runs the forward
        }
        let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu).unwrap();
        Some(AmpError::from(model.forward_t(&x, true).unwrap_err()))
    });
    match &out[0] {
        Some(AmpError::Distributed {
            rank: 0,
            kind: DistErrorKind::Timeout,
            detail,
        }) => assert!(detail.contains("never called it"), "{detail}"),
        other => panic!("expected a Distributed timeout, got {other:?}"),
    }
}

#[test]
fn a_parameter_error_inside_the_builder_keeps_its_variant() {
    let res = common::initialize(
        |vb| {
            // Two layers under one name with different shapes: the store refuses the second.
            vb.get((2, 2), "w")?;
            vb.get((3, 3), "w")
        },
        Sgd::new(SgdConfig::new(0.1)).unwrap(),
        OptLevel::O2,
    );
    match res.err() {
        Some(AmpError::Parameter { name, reason }) => {
            assert_eq!(name, "w");
            assert!(reason.contains("two layers share this name"), "{reason}");
        }
        other => panic!("expected AmpError::Parameter, got {other:?}"),
    }
}

/// One of candle's ways of wrapping an error.
type Wrap = fn(candle_core::Error) -> candle_core::Error;

#[test]
fn our_errors_come_back_through_every_candle_wrapper() {
    let original = || AmpError::InvalidArgument {
        argument: "segments",
        reason: "0 segments".into(),
    };
    let wrappers: [(&str, Wrap); 4] = [
        ("plain", |e| e),
        ("backtrace", |e| e.bt()),
        ("context", |e| e.context("building the encoder")),
        ("path", |e| e.with_path("/tmp/model.safetensors")),
    ];
    for (what, wrap) in wrappers {
        let back = AmpError::from(wrap(candle_core::Error::from(original())));
        match &back {
            AmpError::InvalidArgument { argument, reason } => {
                assert_eq!(*argument, "segments", "{what}");
                assert!(reason.contains("0 segments"), "{what}: {reason}");
            }
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    // candle's context is kept in the message of a variant that has one.
    let back = AmpError::from(candle_core::Error::from(original()).context("building the encoder"));
    assert!(back.to_string().contains("building the encoder"), "{back}");
    // A candle error of candle's own stays `Candle`; our error's message reads as it did.
    let e = candle_core::Error::Msg("shape mismatch".into());
    assert!(matches!(AmpError::from(e), AmpError::Candle(_)));
    let c = candle_core::Error::from(AmpError::Checkpoint {
        path: "/tmp/ckpt".into(),
        kind: CheckpointErrorKind::NotFound,
        detail: "no checkpoint has been saved here".into(),
    });
    assert!(c.to_string().contains("no checkpoint"), "{c}");
    assert_eq!(AmpError::from(c).checkpoint_kind(), Some(CheckpointErrorKind::NotFound));
}

/// A custom op whose forward fails with one of our errors, as synchronised batch norm's
/// does when a collective times out.
struct FailingOp;

impl candle_core::CustomOp1 for FailingOp {
    fn name(&self) -> &'static str {
        "failing"
    }

    fn cpu_fwd(
        &self,
        _s: &candle_core::CpuStorage,
        _l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let e = AmpError::Distributed {
            rank: 3,
            kind: DistErrorKind::Timeout,
            detail: "all_reduce_sum waited".into(),
        };
        Err(candle_core::Error::from(e).context("synchronised batch norm"))
    }
}

#[test]
fn an_error_raised_inside_a_custom_op_comes_back_typed() {
    let x = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    match AmpError::from(x.apply_op1(FailingOp).unwrap_err()) {
        AmpError::Distributed {
            rank: 3,
            kind: DistErrorKind::Timeout,
            detail,
        } => assert_eq!(detail, "synchronised batch norm: all_reduce_sum waited"),
        other => panic!("expected a Distributed timeout, got {other:?}"),
    }
}
