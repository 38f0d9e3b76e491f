//! The opt-level table, overrides and Apex's rejections.

use candle_amp::{AmpConfig, AmpError, HalfType, LossScaleSpec, OptLevel};
use candle_core::DType;

#[test]
fn table_rows_resolve_to_apex_properties() {
    let p0 = AmpConfig::new(OptLevel::O0).resolve().unwrap();
    assert_eq!(p0.cast_model_type, Some(DType::F32));
    assert!(!p0.patch_functions && !p0.master_weights);
    assert_eq!(p0.loss_scale, LossScaleSpec::Static(1.0));

    let p1 = AmpConfig::new(OptLevel::O1).resolve().unwrap();
    assert_eq!(p1.cast_model_type, None);
    assert!(p1.patch_functions && !p1.master_weights);
    assert_eq!(p1.keep_batchnorm_fp32, None);
    assert_eq!(p1.loss_scale, LossScaleSpec::Dynamic);

    let p2 = AmpConfig::new(OptLevel::O2).resolve().unwrap();
    assert_eq!(p2.cast_model_type, Some(DType::F16));
    assert_eq!(p2.keep_batchnorm_fp32, Some(true));
    assert!(p2.master_weights);
    assert_eq!(p2.loss_scale, LossScaleSpec::Dynamic);
    assert_eq!(p2.output_dtype(), Some(DType::F32));

    let p3 = AmpConfig::new(OptLevel::O3).resolve().unwrap();
    assert_eq!(p3.cast_model_type, Some(DType::F16));
    assert_eq!(p3.keep_batchnorm_fp32, Some(false));
    assert!(!p3.master_weights);
    assert_eq!(p3.loss_scale, LossScaleSpec::Static(1.0));
}

#[test]
fn bf16_defaults_to_a_static_scale_unless_overridden() {
    let p = AmpConfig::new(OptLevel::O2).half(HalfType::Bf16).resolve().unwrap();
    assert_eq!(p.cast_model_type, Some(DType::BF16));
    assert_eq!(p.loss_scale, LossScaleSpec::Static(1.0));
    let p = AmpConfig::new(OptLevel::O2)
        .half(HalfType::Bf16)
        .loss_scale(LossScaleSpec::Dynamic)
        .resolve()
        .unwrap();
    assert_eq!(p.loss_scale, LossScaleSpec::Dynamic);
}

fn rejected(c: AmpConfig, property: &str) {
    match c.resolve() {
        Err(AmpError::InvalidOverride {
            property: p,
            level,
            reason,
        }) => {
            assert_eq!(p, property);
            assert!(!level.is_empty() && !reason.is_empty());
        }
        other => panic!("expected InvalidOverride({property}), got {other:?}"),
    }
}

#[test]
fn apex_rejections_name_the_property_and_level() {
    rejected(
        AmpConfig::new(OptLevel::O1).cast_model_type(Some(DType::F16)),
        "cast_model_type",
    );
    rejected(
        AmpConfig::new(OptLevel::O1).keep_batchnorm_fp32(true),
        "keep_batchnorm_fp32",
    );
    rejected(AmpConfig::new(OptLevel::O1).master_weights(true), "master_weights");
    for l in [OptLevel::O0, OptLevel::O2, OptLevel::O3] {
        rejected(AmpConfig::new(l).patch_functions(true), "patch_functions");
    }
    let e = AmpConfig::new(OptLevel::O1)
        .master_weights(false)
        .resolve()
        .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("master_weights") && msg.contains("O1"), "{msg}");
    // O1 with an explicit f32 model type (or no cast) is what O1 does anyway.
    AmpConfig::new(OptLevel::O1)
        .cast_model_type(Some(DType::F32))
        .resolve()
        .unwrap();
    AmpConfig::new(OptLevel::O1).cast_model_type(None).resolve().unwrap();
}

#[test]
fn out_of_range_values_are_rejected() {
    rejected(
        AmpConfig::new(OptLevel::O2).loss_scale(LossScaleSpec::Static(0.0)),
        "loss_scale",
    );
    rejected(
        AmpConfig::new(OptLevel::O2).loss_scale(LossScaleSpec::Static(f32::NAN)),
        "loss_scale",
    );
    rejected(AmpConfig::new(OptLevel::O2).num_losses(0), "num_losses");
    rejected(
        AmpConfig::new(OptLevel::O2).min_loss_scale(10.0).max_loss_scale(1.0),
        "min_loss_scale",
    );
    rejected(
        AmpConfig::new(OptLevel::O2).cast_model_type(Some(DType::U8)),
        "cast_model_type",
    );
    rejected(
        AmpConfig::new(OptLevel::O2).max_consecutive_skips(0),
        "max_consecutive_skips",
    );
    let d = candle_amp::DynamicParams {
        growth_factor: 1.0,
        ..Default::default()
    };
    rejected(AmpConfig::new(OptLevel::O2).dynamic(d), "growth_factor");
    let d = candle_amp::DynamicParams {
        backoff_factor: 1.0,
        ..Default::default()
    };
    rejected(AmpConfig::new(OptLevel::O2).dynamic(d), "backoff_factor");
}

#[test]
fn overrides_win_over_the_table() {
    let p = AmpConfig::new(OptLevel::O2)
        .keep_batchnorm_fp32(false)
        .master_weights(false)
        .loss_scale(LossScaleSpec::Static(128.0))
        .cast_model_outputs(DType::F16)
        .num_losses(3)
        .resolve()
        .unwrap();
    assert_eq!(p.keep_batchnorm_fp32, Some(false));
    assert!(!p.master_weights);
    assert_eq!(p.loss_scale, LossScaleSpec::Static(128.0));
    assert_eq!(p.output_dtype(), Some(DType::F16));
    assert_eq!(p.num_losses, 3);
    assert!(p.to_string().contains("loss_scale           128"));
}

#[test]
fn disabled_means_plain_candle() {
    let p = AmpConfig::new(OptLevel::O2).enabled(false).resolve().unwrap();
    assert_eq!(p.cast_model_type, None);
    assert!(!p.master_weights);
    assert_eq!(p.loss_scale, LossScaleSpec::Static(1.0));
}

#[test]
fn parsing_levels_half_types_and_scales() {
    assert_eq!("O2".parse::<OptLevel>().unwrap(), OptLevel::O2);
    assert_eq!("o3".parse::<OptLevel>().unwrap(), OptLevel::O3);
    for bad in ["02", "O4", "", "fast"] {
        match bad.parse::<OptLevel>() {
            Err(AmpError::Parse { what, .. }) => assert_eq!(what, "opt level"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert_eq!("bf16".parse::<HalfType>().unwrap(), HalfType::Bf16);
    assert!("f8".parse::<HalfType>().is_err());
    assert_eq!("dynamic".parse::<LossScaleSpec>().unwrap(), LossScaleSpec::Dynamic);
    assert_eq!("128.0".parse::<LossScaleSpec>().unwrap(), LossScaleSpec::Static(128.0));
    assert!("-1".parse::<LossScaleSpec>().is_err());
    assert!("inf".parse::<LossScaleSpec>().is_err());
}

#[test]
fn properties_round_trip_through_serde() {
    let p = AmpConfig::new(OptLevel::O2).half(HalfType::Bf16).resolve().unwrap();
    let s = serde_json::to_string(&p).unwrap();
    let q: candle_amp::Properties = serde_json::from_str(&s).unwrap();
    assert_eq!(p, q);
}
