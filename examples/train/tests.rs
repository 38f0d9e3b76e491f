//! The example's own logic: the CSV loader's label bound, where runs are saved and resumed
//! from, and what a resumed run reports (`cargo test --example train`).

use super::*;

fn args(line: &str) -> Args {
    match args::parse(line.split_whitespace().map(String::from)).unwrap() {
        Parsed::Run(a) => *a,
        Parsed::Help => unreachable!(),
    }
}

/// A fresh directory under the system's temporary one.
fn temp_dir(name: &str) -> String {
    let d = std::env::temp_dir().join(format!("candle-amp-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d.to_str().unwrap().to_string()
}

#[test]
fn a_label_that_makes_more_classes_than_rows_is_refused_at_its_line() {
    let e = data::parse_csv("1,0\n2,1\n3,100000\n4,1\n5,0\n").unwrap_err();
    assert_eq!(e.line, 3);
    assert!(
        e.to_string().contains(
            "label 100000 makes 100001 classes (labels are 0 to K-1 for K classes), more than the file's 5 rows"
        ),
        "{e}"
    );
    // A label that would ask for terabytes of weights; the first line with the largest label.
    let e = data::parse_csv("1,4000000000\n2,1\n3,4000000000\n").unwrap_err();
    assert_eq!(e.line, 1);
    assert!(e.to_string().contains("4000000001 classes"), "{e}");
    // As many classes as rows is allowed, and classes no row has are reported.
    let d = data::parse_csv("1,0\n2,3\n3,1\n4,0\n").unwrap();
    assert_eq!(d.classes(), 4);
    assert_eq!(d.empty_classes(), vec![2]);
    assert_eq!(
        d.empty_classes_warning().unwrap(),
        "the data's labels run to 3 but no row has 2: the model gets 4 outputs, 1 never trained"
    );
    assert_eq!(data::digits().unwrap().empty_classes(), Vec::<u32>::new());
}

#[test]
fn o0_runs_are_named_f32_and_old_half_named_o0_checkpoints_still_resume() {
    use amp::{HalfType::*, OptLevel::*};
    let root = temp_dir("names");
    let name = |d: amp::checkpoint::CheckpointDir| d.root().file_name().unwrap().to_str().unwrap().to_string();
    assert_eq!(name(run_dir(&root, ModelKind::Mlp, O0, F16)), "mlp-O0-f32");
    assert_eq!(name(run_dir(&root, ModelKind::Mlp, O0, Bf16)), "mlp-O0-f32");
    assert_eq!(name(run_dir(&root, ModelKind::Cnn, O2, Bf16)), "cnn-O2-bf16");
    // Nothing there: the new name (its load says "not found").
    assert_eq!(name(resume::resume_dir(&root, ModelKind::Mlp, O0, Bf16)), "mlp-O0-f32");
    std::fs::create_dir_all(std::path::Path::new(&root).join("mlp-O0-f16")).unwrap();
    assert_eq!(name(resume::resume_dir(&root, ModelKind::Mlp, O0, Bf16)), "mlp-O0-f16");
    std::fs::create_dir_all(std::path::Path::new(&root).join("mlp-O0-bf16")).unwrap();
    assert_eq!(name(resume::resume_dir(&root, ModelKind::Mlp, O0, Bf16)), "mlp-O0-bf16");
    std::fs::create_dir_all(std::path::Path::new(&root).join("mlp-O0-f32")).unwrap();
    assert_eq!(name(resume::resume_dir(&root, ModelKind::Mlp, O0, Bf16)), "mlp-O0-f32");
    // Other levels have no fallback.
    assert_eq!(name(resume::resume_dir(&root, ModelKind::Mlp, O1, Bf16)), "mlp-O1-bf16");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn resuming_checks_the_seed_and_a_run_already_at_steps_reports_the_saved_run() {
    let root = temp_dir("resume");
    let task = make_task(ModelKind::Mlp, Some(&data::digits().unwrap()), &args("")).unwrap();
    let level = amp::OptLevel::O1;
    let straight = train_one(
        ModelKind::Mlp,
        &task,
        level,
        &args(&format!("--steps 3 --save {root}")),
        None,
    )
    .unwrap();

    // Already at --steps: nothing trained, the saved run's results, step time and op count.
    let a = args(&format!("--steps 3 --resume {root}"));
    let r = load_resumed(&root, ModelKind::Mlp, level, &a).unwrap();
    assert_eq!(r.progress.seed, Some(0));
    assert_eq!(r.progress.times.len(), 3);
    let again = train_one(ModelKind::Mlp, &task, level, &a, Some(r)).unwrap();
    assert_eq!(again.progress.losses, straight.progress.losses);
    assert_eq!(again.final_loss.to_bits(), straight.final_loss.to_bits());
    assert_eq!(again.eval_loss.to_bits(), straight.eval_loss.to_bits());
    assert_eq!(again.accuracy, straight.accuracy);
    assert_eq!(again.step_ms, straight.step_ms);
    assert!(straight.step_ms.is_some_and(|t| t > 0.0));
    assert!(straight.autocast_ops > 0);
    assert_eq!(again.autocast_ops, straight.autocast_ops);

    // Another seed picks other weights and another held-out split: refused, naming the seed.
    let e = load_resumed(
        &root,
        ModelKind::Mlp,
        level,
        &args(&format!("--steps 4 --seed 7 --resume {root}")),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("was trained with --seed 0"), "{e}");
    assert!(e.to_string().contains("resume with --seed 0"), "{e}");
    // Fewer steps than saved.
    let e = load_resumed(
        &root,
        ModelKind::Mlp,
        level,
        &args(&format!("--steps 2 --resume {root}")),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("at step 3, beyond --steps 2"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_run_cut_in_two_equals_the_run_straight_through_but_for_step_time() {
    let root = temp_dir("cut");
    let task = make_task(ModelKind::Mlp, Some(&data::digits().unwrap()), &args("")).unwrap();
    let level = amp::OptLevel::O0;
    let straight = train_one(ModelKind::Mlp, &task, level, &args("--steps 3"), None).unwrap();
    train_one(
        ModelKind::Mlp,
        &task,
        level,
        &args(&format!("--steps 2 --save {root}")),
        None,
    )
    .unwrap();
    // Saved under the f32 name, resumed with another --half: O0 does not depend on it.
    assert!(std::path::Path::new(&root).join("mlp-O0-f32").is_dir());
    let a = args(&format!("--steps 3 --half bf16 --resume {root}"));
    let r = load_resumed(&root, ModelKind::Mlp, level, &a).unwrap();
    let resumed = train_one(ModelKind::Mlp, &task, level, &a, Some(r)).unwrap();
    assert_eq!(resumed.progress.losses, straight.progress.losses);
    assert_eq!(resumed.final_loss.to_bits(), straight.final_loss.to_bits());
    assert_eq!(resumed.eval_loss.to_bits(), straight.eval_loss.to_bits());
    // The step time is the median over all three steps, the saved two included.
    assert_eq!(resumed.progress.times.len(), 3);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn step_times_read_back_from_json_exactly() {
    // What the checkpoint keeps: every time must parse back to the same f64.
    for ns in (0..20_000u64).map(|i| i * 7_919_333 + 13) {
        let t = super::step_time_ms(std::time::Duration::from_nanos(ns));
        let back: f64 = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back.to_bits(), t.to_bits(), "{ns} ns");
    }
}
