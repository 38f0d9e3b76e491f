//! The `lm` example's command line (a usage error exits with status 2 before anything is
//! read or trained).

use std::collections::HashSet;
use std::fmt;

use candle_amp as amp;

/// Which model the example trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Model {
    /// `models::llama`, a byte-level language model on a text.
    Llama,
    /// `models::bert`, token classification of padded synthetic sequences.
    Bert,
    /// `models::vit`, classification of synthetic images.
    Vit,
}

impl Model {
    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Model::Llama => "llama",
            Model::Bert => "bert",
            Model::Vit => "vit",
        }
    }
}

/// The model sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Size {
    /// Width 64, 2 blocks (Llama: context 64; BERT: 32 tokens; ViT: 16x16 images):
    /// seconds per run even in a debug build.
    Tiny,
    /// Width 128, 4 blocks (Llama: context 128; BERT: 64 tokens; ViT: 32x32 images).
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
    pub model: Model,
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
    "usage: lm [--model llama|bert|vit] [--text FILE] [--steps N] [--opt-level O0|O1|O2|O3] [--half f16|bf16] \
     [--size tiny|small] [--seed N] [--json] [--save DIR] [--resume DIR] [--report FILE.svg] [--prompt TEXT] \
     [--sample BYTES] [--temperature T]"
}

/// A row of the help table: flag, value, default, meaning.
type Row = (&'static str, &'static str, &'static str, &'static str);

/// Each flag: its name, its value, its default and what it does.
const FLAGS: [Row; 15] = [
    (
        "--model",
        "llama|bert|vit",
        "llama",
        "the model: Llama on a text, BERT or ViT on a synthetic task",
    ),
    (
        "--text",
        "FILE",
        "the bundled book",
        "the text Llama learns (its last tenth held out)",
    ),
    (
        "--steps",
        "N",
        "300",
        "optimizer steps, counted from the start when resuming",
    ),
    ("--opt-level", "O0|O1|O2|O3", "O2", "the opt level"),
    (
        "--half",
        "f16|bf16",
        "bf16",
        "the half type (O0 computes in f32 whatever it says)",
    ),
    (
        "--size",
        "tiny|small",
        "tiny",
        "tiny: width 64, 2 blocks; small: width 128, 4 blocks",
    ),
    ("--seed", "N", "0", "the run's seed (weights, data order, sampling)"),
    ("--json", "", "off", "one JSON object on stdout; progress on stderr"),
    ("--save", "DIR", "-", "write a checkpoint to DIR at the end"),
    (
        "--resume",
        "DIR",
        "-",
        "continue from DIR's checkpoint (same model, size, seed, level, half)",
    ),
    (
        "--report",
        "FILE.svg",
        "-",
        "draw the training loss per step and the loss scale",
    ),
    ("--prompt", "TEXT", "Phileas Fogg", "Llama: the start of the sample"),
    ("--sample", "BYTES", "200", "Llama: bytes generated after the prompt"),
    (
        "--temperature",
        "T",
        "0.8",
        "Llama: the sampling temperature (0: greedy)",
    ),
    ("-h, --help", "", "", "print this help and exit"),
];

/// The flags that only the Llama language model uses.
const LLAMA_ONLY: [&str; 4] = ["--text", "--prompt", "--sample", "--temperature"];

/// `--help`: the usage line, then the flags as a table (flag, value, default, meaning).
pub fn help() -> String {
    let head: Row = ("flag", "value", "default", "meaning");
    let w = |f: fn(&Row) -> &'static str| FLAGS.iter().map(f).chain([f(&head)]).map(str::len).max().unwrap_or(0);
    let (w0, w1, w2) = (w(|r| r.0), w(|r| r.1), w(|r| r.2));
    let mut out = format!("{}\n\n", usage());
    for (i, r) in [head].iter().chain(&FLAGS).enumerate() {
        out += &format!("  {:w0$}  {:w1$}  {:w2$}  {}\n", r.0, r.1, r.2, r.3);
        if i == 0 {
            out += &format!(
                "  {}  {}  {}  {}\n",
                "-".repeat(w0),
                "-".repeat(w1),
                "-".repeat(w2),
                "-".repeat(7)
            );
        }
    }
    out
}

/// Parses the arguments (without the program name); a flag given twice is refused.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, UsageError> {
    let mut a = Args {
        model: Model::Llama,
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
            "--model" => {
                a.model = match value()?.as_str() {
                    "llama" => Model::Llama,
                    "bert" => Model::Bert,
                    "vit" => Model::Vit,
                    m => return Err(UsageError(format!("unknown model {m:?}: use llama, bert or vit"))),
                }
            }
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
    if a.model != Model::Llama
        && let Some(flag) = LLAMA_ONLY.iter().find(|f| seen.contains(**f))
    {
        return Err(UsageError(format!(
            "{flag} applies to --model llama only (not {})",
            a.model.name()
        )));
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

    #[test]
    fn model_choice_and_llama_only_flags() {
        assert_eq!(run("").unwrap().model, Model::Llama);
        assert_eq!(run("--model bert").unwrap().model, Model::Bert);
        assert_eq!(run("--model vit --steps 5").unwrap().model, Model::Vit);
        assert!(run("--model gpt").unwrap_err().0.contains("use llama, bert or vit"));
        for flag in ["--text x", "--prompt x", "--sample 3", "--temperature 0"] {
            let e = run(&format!("--model vit {flag}")).unwrap_err().0;
            assert_eq!(
                e,
                format!(
                    "{} applies to --model llama only (not vit)",
                    flag.split(' ').next().unwrap()
                )
            );
            assert!(run(&format!("--model llama {flag}")).is_ok());
        }
    }

    #[test]
    fn help_starts_with_the_usage_and_lists_every_flag_with_its_default() {
        let h = help();
        assert!(h.starts_with("usage: lm "));
        let lines: Vec<&str> = h.lines().collect();
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            ["flag", "value", "default", "meaning"]
        );
        // Every flag of the usage line has a row, and the defaults are the parser's.
        for flag in usage().split('[').skip(1).map(|s| s.split([' ', ']']).next().unwrap()) {
            assert!(
                lines.iter().any(|l| l.trim_start().starts_with(flag)),
                "{flag} has no row"
            );
        }
        let row = |flag: &str| FLAGS.iter().find(|r| r.0 == flag).unwrap().2;
        let a = run("").unwrap();
        assert_eq!(row("--steps"), a.steps.to_string());
        assert_eq!(row("--opt-level"), a.level.to_string());
        assert_eq!(row("--half"), a.half.to_string());
        assert_eq!(row("--size"), a.size.name());
        assert_eq!(row("--model"), a.model.name());
        assert_eq!(row("--seed"), a.seed.to_string());
        assert_eq!(row("--prompt"), a.prompt);
        assert_eq!(row("--sample"), a.sample.to_string());
        assert_eq!(row("--temperature"), a.temperature.to_string());
    }
}
