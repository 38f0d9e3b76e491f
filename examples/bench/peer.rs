//! The PyTorch comparison: runs `benches/peers/torch_amp.py` (`--torch`) or reads what it
//! printed (`--torch FILE`), and checks that it measured the bench's own models.

use std::fmt;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::measure;

/// The environment variable naming a Python venv with torch (its `bin/python3` runs the
/// script); without it, `python3` on `PATH`.
pub const VENV_VAR: &str = "CANDLE_AMP_TORCH_VENV";

/// The exit status `torch_amp.py` ends with when `import torch` fails.
const NO_TORCH_STATUS: i32 = 3;

/// Why `--torch` has no PyTorch figures: the bench says so and goes on without them.
#[derive(Debug)]
pub enum TorchUnavailable {
    /// The Python interpreter could not be started.
    NoPython { python: String, error: std::io::Error },
    /// The interpreter runs but has no `torch` module.
    NoTorch { python: String },
    /// The script failed for another reason (its stderr is above).
    Failed {
        python: String,
        status: std::process::ExitStatus,
    },
    /// The script's last stdout line is not the JSON object the bench expects.
    BadOutput(anyhow::Error),
}

impl fmt::Display for TorchUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoPython { python, error } => write!(
                f,
                "cannot start {python} ({error}); set {VENV_VAR} to a venv with torch or put python3 on PATH"
            ),
            Self::NoTorch { python } => write!(
                f,
                "{python} has no torch module; `pip install torch` into a venv and set {VENV_VAR} to it"
            ),
            Self::Failed { python, status } => {
                write!(
                    f,
                    "{python} benches/peers/torch_amp.py failed ({status}; its stderr is above)"
                )
            }
            Self::BadOutput(e) => write!(f, "{e:#}"),
        }
    }
}

impl std::error::Error for TorchUnavailable {}

/// Runs `torch_amp.py` with this run's thread count (and `--quick` sizes), progress on
/// stderr, and returns its checked JSON object.
pub fn run_torch(threads: usize, quick: bool) -> Result<Value, TorchUnavailable> {
    let python = match std::env::var_os(VENV_VAR) {
        Some(v) => std::path::Path::new(&v)
            .join("bin")
            .join("python3")
            .display()
            .to_string(),
        None => "python3".to_string(),
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/peers/torch_amp.py");
    eprintln!("PyTorch ({python} {script}, {threads} threads) ...");
    let mut cmd = Command::new(&python);
    cmd.arg(script).arg("--threads").arg(threads.to_string());
    if quick {
        cmd.arg("--quick");
    }
    // The script's progress and errors go to our stderr as they come (minutes of them).
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|error| TorchUnavailable::NoPython {
            python: python.clone(),
            error,
        })?;
    if out.status.code() == Some(NO_TORCH_STATUS) {
        return Err(TorchUnavailable::NoTorch { python });
    }
    if !out.status.success() {
        return Err(TorchUnavailable::Failed {
            python,
            status: out.status,
        });
    }
    check(&String::from_utf8_lossy(&out.stdout), threads, quick).map_err(TorchUnavailable::BadOutput)
}

/// The PyTorch figures `benches/peers/torch_amp.py` printed (its last stdout line, or the
/// whole file as one JSON object), checked before anything is measured.
pub fn read_torch(path: &str, threads: usize, quick: bool) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--torch: cannot read {path}"))?;
    check(&text, threads, quick).with_context(|| format!("--torch {path}"))
}

/// The last non-empty line of `text` as the script's JSON object: the MLP figures, the
/// thread count, and under `models` each model's sizes (which must be this run's) and
/// step times. Output of an older script without `models` gives the MLP ratios only.
fn check(text: &str, threads: usize, quick: bool) -> Result<Value> {
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let v: Value = serde_json::from_str(line).context("the output must end with the JSON line torch_amp.py prints")?;
    for k in ["fp32_step_ms", "autocast_bf16_step_ms"] {
        if !v[k].as_f64().is_some_and(|x| x > 0.0) {
            bail!("no positive {k:?}; run benches/peers/torch_amp.py again");
        }
    }
    if v["threads"].as_u64() != Some(threads as u64) {
        bail!(
            "measured with {} threads, this run uses {threads}; pass the same --threads to both",
            v["threads"]
        );
    }
    if let Some(models) = v["models"].as_object() {
        for (name, c, batch) in measure::transformers(quick) {
            let m = models
                .get(name)
                .with_context(|| format!("no {name:?} transformer under \"models\""))?;
            let want = [
                ("layers", c.layers),
                ("d_model", c.d_model),
                ("heads", c.heads),
                ("context", c.context),
                ("vocab", c.vocab),
                ("batch", batch),
            ];
            for (k, n) in want {
                if m[k].as_u64() != Some(n as u64) {
                    bail!(
                        "its {name} transformer has {k} {}, this run's has {n} (--quick on one side only?)",
                        m[k]
                    );
                }
            }
        }
        let (hidden, batch) = measure::mlp_size(quick);
        let mlp = &models.get("mlp").context("no \"mlp\" under \"models\"")?;
        if mlp["hidden"].as_u64() != Some(hidden as u64) || mlp["batch"].as_u64() != Some(batch as u64) {
            bail!(
                "its MLP has hidden {} and batch {}, this run's {hidden} and {batch} (--quick on one side only?)",
                mlp["hidden"],
                mlp["batch"]
            );
        }
        for (name, m) in models {
            for k in ["fp32_step_ms", "autocast_bf16_step_ms"] {
                if !m[k].as_f64().is_some_and(|x| x > 0.0) {
                    bail!("no positive {k:?} for {name}");
                }
            }
        }
    }
    Ok(v)
}
