//! The `lm` example's command line (a usage error exits with status 2 before anything is
//! read or trained).

use std::collections::HashSet;
use std::fmt;

use candle_amp as amp;

/// The model sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Size {
    /// Width 64, 2 blocks, context 64: seconds per run even in a debug build.
    Tiny,
    /// Width 128, 4 blocks, context 128.
    Small,
}

impl Size {
    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Size::Tiny => "tiny",
            Size::Small => "small",
        }
    }
}

/// The parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub text: Option<String>,
    pub steps: usize,
    pub level: amp::OptLevel,
    pub half: amp::HalfType,
    pub size: Size,
    pub seed: u64,
    pub json: bool,
    pub save: Option<String>,
    pub resume: Option<String>,
    pub report: Option<String>,
    pub prompt: String,
    pub sample: usize,
    pub temperature: f64,
}

/// A command line the example cannot run: exits with status 2.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}; {}", self.0, usage())
    }
}

impl std::error::Error for UsageError {}

/// What the command line asks for.
#[derive(Debug)]
pub enum Parsed {
    /// `-h` / `--help`: print the usage and exit 0.
    Help,
    Run(Box<Args>),
}

/// The one-line usage.
pub fn usage() -> &'static str {
    "usage: lm [--text FILE] [--steps N] [--opt-level O0|O1|O2|O3] [--half f16|bf16] [--size tiny|small] \
     [--seed N] [--json] [--save DIR] [--resume DIR] [--report FILE.svg] [--prompt TEXT] [--sample BYTES] \
     [--temperature T]"
}

/// Parses the arguments (without the program name); a flag given twice is refused.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, UsageError> {
    let mut a = Args {
        text: None,
        steps: 300,
        level: amp::OptLevel::O2,
        half: amp::HalfType::Bf16,
        size: Size::Tiny,
        seed: 0,
        json: false,
        save: None,
        resume: None,
        report: None,
        prompt: "Phileas Fogg".into(),
        sample: 200,
        temperature: 0.8,
    };
    let mut seen = HashSet::new();
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Ok(Parsed::Help);
        }
        if flag.starts_with("--") && !seen.insert(flag.clone()) {
            return Err(UsageError(format!("{flag} is given twice")));
        }
        let mut value = || it.next().ok_or_else(|| UsageError(format!("{flag} needs a value")));
        let number = |v: String, what: &str| {
            v.parse::<usize>()
                .map_err(|_| UsageError(format!("{flag} takes {what}, not {v:?}")))
        };
        match flag.as_str() {
            "--text" => a.text = Some(value()?),
            "--steps" => a.steps = number(value()?, "a positive integer")?,
            "--opt-level" => a.level = value()?.parse().map_err(|e| UsageError(format!("--opt-level: {e}")))?,
            "--half" => a.half = value()?.parse().map_err(|e| UsageError(format!("--half: {e}")))?,
            "--size" => {
                a.size = match value()?.as_str() {
                    "tiny" => Size::Tiny,
                    "small" => Size::Small,
                    s => return Err(UsageError(format!("unknown size {s:?}: use tiny or small"))),
                }
            }
            "--seed" => {
                let v = value()?;
                a.seed = v
                    .parse()
                    .map_err(|_| UsageError(format!("--seed takes a non-negative integer, not {v:?}")))?;
            }
            "--json" => a.json = true,
            "--save" => a.save = Some(value()?),
            "--resume" => a.resume = Some(value()?),
            "--report" => a.report = Some(value()?),
            "--prompt" => a.prompt = value()?,
            "--sample" => a.sample = number(value()?, "a number of bytes")?,
            "--temperature" => {
                let v = value()?;
                a.temperature = v
                    .parse::<f64>()
                    .ok()
                    .filter(|t| t.is_finite() && *t >= 0.0)
                    .ok_or_else(|| UsageError(format!("--temperature takes a number >= 0 (0: greedy), not {v:?}")))?;
            }
            other => return Err(UsageError(format!("unknown argument {other:?}"))),
        }
    }
    if a.steps == 0 {
        return Err(UsageError("--steps must be at least 1".into()));
    }
    if a.prompt.is_empty() {
        return Err(UsageError("--prompt must not be empty".into()));
    }
    Ok(Parsed::Run(Box::new(a)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &str) -> Result<Args, UsageError> {
        match parse(args.split_whitespace().map(String::from))? {
            Parsed::Run(a) => Ok(*a),
            Parsed::Help => panic!("{args}: help"),
        }
    }

    #[test]
    fn defaults_flags_and_errors() {
        let a = run("").unwrap();
        assert_eq!(
            (a.steps, a.level, a.half, a.size),
            (300, amp::OptLevel::O2, amp::HalfType::Bf16, Size::Tiny)
        );
        let a = run("--steps 20 --opt-level O0 --half f16 --size small --seed 3 --json --temperature 0").unwrap();
        assert_eq!(
            (a.steps, a.level, a.half, a.size, a.seed),
            (20, amp::OptLevel::O0, amp::HalfType::F16, Size::Small, 3)
        );
        assert!(a.json && a.temperature == 0.0);
        assert!(matches!(parse(["--help".into()]), Ok(Parsed::Help)));
        assert_eq!(run("--steps 1 --steps 2").unwrap_err().0, "--steps is given twice");
        assert_eq!(run("--steps 0").unwrap_err().0, "--steps must be at least 1");
        assert!(run("--size huge").unwrap_err().0.contains("use tiny or small"));
        assert!(run("--temperature -1").unwrap_err().0.contains("--temperature"));
        assert!(run("--opt-level O4").unwrap_err().0.starts_with("--opt-level"));
        assert!(run("--frobnicate").unwrap_err().to_string().contains("usage: lm"));
    }
}
