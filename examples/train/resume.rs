//! Saving and resuming the `train` example's runs: where each run's checkpoint lives, what
//! the example keeps in it beside the library's state, and the checks a resumed run passes
//! before any training.

use anyhow::{Context, Result, bail};
use candle_amp as amp;
use candle_amp::checkpoint::{Checkpoint, CheckpointDir};

use crate::args::{Args, ModelKind};

/// What the example keeps in a checkpoint beside the library's state.
#[derive(serde::Serialize, serde::Deserialize, Default, Clone)]
pub struct Progress {
    /// Training loss of every step so far.
    pub losses: Vec<f64>,
    /// Loss scale after every step.
    pub scales: Vec<f32>,
    /// Whether each step was skipped.
    pub skipped: Vec<bool>,
    /// Rows of the current epoch not yet used (digits tasks).
    pub order: Vec<usize>,
    /// The `--seed` the run was started with (it picks the initial weights and the held-out
    /// split, so a resumed run must keep it); absent in checkpoints of older versions.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Every step's time in milliseconds (absent in checkpoints of older versions).
    #[serde(default)]
    pub times: Vec<f64>,
    /// Ops that ran in half in the last step (O1), for a resumed run that trains no more.
    #[serde(default)]
    pub autocast_ops: Option<usize>,
}

/// A run's checkpoint, loaded and checked against the command line before any training.
pub struct Resumed {
    pub ck: Checkpoint,
    pub progress: Progress,
}

/// The type a level's run is named by in file names: f32 at O0, whatever `--half` says (its
/// training does not depend on it), else the half type.
fn run_type(level: amp::OptLevel, half: amp::HalfType) -> String {
    if level == amp::OptLevel::O0 {
        "f32".into()
    } else {
        half.to_string()
    }
}

/// Where a run's checkpoint is saved: `ROOT/<model>-<level>-<type>` (`run_type`).
pub fn run_dir(root: &str, kind: ModelKind, level: amp::OptLevel, half: amp::HalfType) -> CheckpointDir {
    let name = format!("{}-{level}-{}", kind.name(), run_type(level, half));
    CheckpointDir::new(std::path::Path::new(root).join(name), 1)
}

/// Where to resume a run from: `run_dir`, or for O0 a directory named with a half type, as
/// earlier versions saved O0 (the one `--half` names first).
pub fn resume_dir(root: &str, kind: ModelKind, level: amp::OptLevel, half: amp::HalfType) -> CheckpointDir {
    let dir = run_dir(root, kind, level, half);
    if level != amp::OptLevel::O0 || dir.root().exists() {
        return dir;
    }
    let other = match half {
        amp::HalfType::F16 => amp::HalfType::Bf16,
        amp::HalfType::Bf16 => amp::HalfType::F16,
    };
    [half, other]
        .into_iter()
        .map(|h| {
            CheckpointDir::new(
                std::path::Path::new(root).join(format!("{}-{level}-{h}", kind.name())),
                1,
            )
        })
        .find(|d| d.root().exists())
        .unwrap_or(dir)
}

/// Loads a run's checkpoint and checks it against the command line: the same seed, a step
/// within `--steps`, its progress consistent.
pub fn load_resumed(root: &str, kind: ModelKind, level: amp::OptLevel, a: &Args) -> Result<Resumed> {
    let dir = resume_dir(root, kind, level, a.half);
    let shown = dir.root().display();
    let ck = dir
        .load()
        .with_context(|| format!("resuming {} {level} from {shown}", kind.name()))?;
    let mut progress: Progress =
        serde_json::from_value(ck.extra().clone()).with_context(|| format!("{shown}: the example's progress"))?;
    // The losses are f32 values; serde_json's float parsing can be an ulp off in f64, so they
    // are rounded back, and a resumed run's `final_loss` equals the straight run's exactly.
    for l in &mut progress.losses {
        *l = *l as f32 as f64;
    }
    let start = ck.step() as usize;
    if start > a.steps {
        bail!(
            "the checkpoint in {shown} is at step {start}, beyond --steps {}",
            a.steps
        );
    }
    if progress.losses.len() != start {
        bail!(
            "the checkpoint in {shown} is inconsistent: {} losses for step {start}",
            progress.losses.len()
        );
    }
    if let Some(seed) = progress.seed
        && seed != a.seed
    {
        bail!(
            "the checkpoint in {shown} was trained with --seed {seed} (the seed picks the initial weights and the \
             held-out split): resume with --seed {seed}"
        );
    }
    Ok(Resumed { ck, progress })
}
