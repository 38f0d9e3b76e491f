//! The loss-scale value type: exact trajectories (PyTorch's and DeepSpeed's rules), and only
//! valid scales can be made.

use candle_amp::{AmpError, DynamicParams, LossScale};

fn dynamic(scale: f32, interval: u32, growth: f32, backoff: f32, min: f32, max: f32, hysteresis: u32) -> LossScale {
    let p = DynamicParams {
        init_scale: scale,
        growth_interval: interval,
        growth_factor: growth,
        backoff_factor: backoff,
        hysteresis,
        consecutive_hysteresis: false,
    };
    LossScale::dynamic(&p, min, max).unwrap()
}

fn tracker(s: &LossScale) -> u32 {
    assert!(s.is_dynamic());
    s.growth_tracker()
}

#[test]
fn pytorch_update_scale_trajectory() {
    // test_grad_scaling_update_scale: scale 4, growth 2, backoff 0.25, interval 2.
    let mut s = dynamic(4.0, 2, 2.0, 0.25, 0.0, f32::INFINITY, 1);
    s.adjust(true);
    assert_eq!((tracker(&s), s.scale()), (1, 4.0));
    s.adjust(true);
    assert_eq!((tracker(&s), s.scale()), (0, 8.0));
    s.adjust(false);
    assert_eq!((tracker(&s), s.scale()), (0, 2.0));
}

#[test]
fn growth_never_makes_the_scale_infinite() {
    let mut s = dynamic(1e38, 1, 16.0, 0.5, 0.0, f32::INFINITY, 1);
    for _ in 0..10 {
        s.adjust(true);
        assert!(s.scale().is_finite());
    }
    assert_eq!(s.scale(), 1e38);
}

#[test]
fn growth_stops_at_the_ceiling() {
    let mut s = dynamic(65536.0, 1, 2.0, 0.5, 1.0, 16_777_216.0, 1);
    for _ in 0..20 {
        s.adjust(true);
    }
    assert_eq!(s.scale(), 16_777_216.0);
}

#[test]
fn growth_exactly_after_the_interval_with_counter_wrapping() {
    let mut s = dynamic(1.0, 3, 2.0, 0.5, 0.0, f32::INFINITY, 1);
    let mut seen = Vec::new();
    for _ in 0..9 {
        s.adjust(true);
        seen.push(s.scale());
    }
    assert_eq!(seen, vec![1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0]);
}

#[test]
fn backoff_is_floored_at_min_over_many_overflows() {
    let mut s = dynamic(65536.0, 2000, 2.0, 0.5, 1.0, 16_777_216.0, 1);
    for _ in 0..100 {
        s.adjust(false);
    }
    assert_eq!(s.scale(), 1.0);
    assert_eq!(s.bounds(), (1.0, 16_777_216.0));
    // With a floor of 0 (PyTorch) the scale collapses to 0.
    let mut p = dynamic(65536.0, 2000, 2.0, 0.5, 0.0, f32::INFINITY, 1);
    for _ in 0..200 {
        p.adjust(false);
    }
    assert_eq!(p.scale(), 0.0);
}

#[test]
fn hysteresis_delays_backoff() {
    // h - 1 overflows leave the scale unchanged; h + k overflows back off k + 1 times.
    for h in 1..5u32 {
        for k in 0..4u32 {
            let mut s = dynamic(1024.0, 100, 2.0, 0.5, 0.0, f32::INFINITY, h);
            for _ in 0..h - 1 {
                s.adjust(false);
            }
            assert_eq!(s.scale(), 1024.0, "h={h}");
            for _ in 0..k + 1 {
                s.adjust(false);
            }
            assert_eq!(s.scale(), 1024.0 / 2f32.powi(k as i32 + 1), "h={h} k={k}");
        }
    }
}

#[test]
fn growth_restores_the_hysteresis_budget() {
    let mut s = dynamic(1024.0, 2, 2.0, 0.5, 0.0, f32::INFINITY, 2);
    s.adjust(false); // uses the budget, scale stays
    assert_eq!(s.scale(), 1024.0);
    s.adjust(true);
    s.adjust(true); // growth: 2048, budget restored
    assert_eq!(s.scale(), 2048.0);
    s.adjust(false); // tolerated again
    assert_eq!(s.scale(), 2048.0);
    s.adjust(false); // now backs off
    assert_eq!(s.scale(), 1024.0);
}

#[test]
fn interval_plus_k_clean_steps_grow_one_plus_k_over_interval_times() {
    for interval in 1..5u32 {
        for k in 0..7u32 {
            let mut s = dynamic(1.0, interval, 2.0, 0.5, 0.0, f32::INFINITY, 1);
            for _ in 0..interval + k {
                s.adjust(true);
            }
            assert_eq!(s.scale(), 2f32.powi((1 + k / interval) as i32));
        }
    }
}

#[test]
fn a_static_scale_never_changes() {
    let mut s = LossScale::fixed(128.0).unwrap();
    assert!(!s.adjust(false));
    assert!(!s.adjust(true));
    assert_eq!(s.scale(), 128.0);
    assert!(!s.is_dynamic() && s.params().is_none());
}

#[test]
fn only_valid_scales_can_be_made() {
    for bad in [0.0, -1.0, f32::INFINITY, f32::NAN] {
        assert!(matches!(
            LossScale::fixed(bad),
            Err(AmpError::InvalidArgument { argument: "scale", .. })
        ));
    }
    let ok = DynamicParams::default();
    let cases = [
        (DynamicParams { init_scale: 0.0, ..ok }, "init_scale"),
        (
            DynamicParams {
                growth_factor: 1.0,
                ..ok
            },
            "growth_factor",
        ),
        (
            DynamicParams {
                backoff_factor: 1.0,
                ..ok
            },
            "backoff_factor",
        ),
        (
            DynamicParams {
                growth_interval: 0,
                ..ok
            },
            "growth_interval",
        ),
        (DynamicParams { hysteresis: 0, ..ok }, "hysteresis"),
    ];
    for (p, name) in cases {
        match LossScale::dynamic(&p, 0.0, 1.0) {
            Err(AmpError::InvalidArgument { argument, .. }) => assert_eq!(argument, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(LossScale::dynamic(&ok, 2.0, 1.0).is_err(), "an inverted range");
    assert!(LossScale::dynamic(&ok, f32::NAN, 1.0).is_err());
    // The first scale is brought into the bounds; the settings read back.
    let s = LossScale::dynamic(&ok, 1.0, 1024.0).unwrap();
    assert_eq!(s.scale(), 1024.0);
    assert_eq!(s.params(), Some(ok));
    assert_eq!(s.hysteresis_left(), 1);
}
