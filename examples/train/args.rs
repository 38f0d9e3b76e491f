//! The `train` example's command line: parsing, and the checks of flags against each other
//! (a usage error exits with status 2 before anything is read or trained).

use std::collections::HashSet;
use std::fmt;

use candle_amp as amp;

use crate::{SEQ, TRANSFORMER_LAYERS};

/// The models the example trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelKind {
    Mlp,
    Cnn,
    Transformer,
}

impl ModelKind {
    /// The name on the command line, in the table and in file names.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::Transformer => "transformer",
        }
    }

    fn parse(s: &str) -> Result<Self, UsageError> {
        match s {
            "mlp" => Ok(ModelKind::Mlp),
            "cnn" => Ok(ModelKind::Cnn),
            "transformer" => Ok(ModelKind::Transformer),
            _ => Err(UsageError(format!("unknown model {s:?}: use mlp, cnn or transformer"))),
        }
    }
}

/// The parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub models: Vec<ModelKind>,
    /// Whether `--model` was given (else the models that fit the data are chosen).
    pub models_given: bool,
    pub levels: Vec<amp::OptLevel>,
    pub half: amp::HalfType,
    pub data: Option<String>,
    pub steps: usize,
    pub seed: u64,
    pub json: bool,
    pub save: Option<String>,
    pub resume: Option<String>,
    pub report: Option<String>,
    pub doctor: Option<String>,
    /// `--checkpoint SEGMENTS` (the transformer's gradient checkpointing), if given.
    pub checkpoint: Option<usize>,
    /// `--ffn-chunk N` (the transformer's chunked feed-forward), if given.
    pub ffn_chunk: Option<usize>,
}

/// A command line the example cannot run: exits with status 2.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}; {}", self.0, synopsis())
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

/// The one-line usage, which a usage error repeats.
pub fn synopsis() -> &'static str {
    "usage: train [--model mlp|cnn|transformer]... [--opt-level O0|O1|O2|O3]... [--half f16|bf16] \
     [--data FILE.csv] [--steps N] [--seed N] [--json] [--save DIR] [--resume DIR] [--report DIR] \
     [--doctor DIR] [--checkpoint SEGMENTS] [--ffn-chunk N]"
}

/// A row of `--help`'s table: flag, value, default (`-`: unset), meaning.
type Row = (&'static str, &'static str, &'static str, &'static str);

/// Each flag's row (as printed, one line each).
#[rustfmt::skip]
const FLAGS: [Row; 14] = [
    ("--model", "mlp|cnn|transformer", "all three", "a model to train; repeat for several, each once"),
    ("--opt-level", "O0|O1|O2|O3", "all four", "a level to train at; repeat for several, each once"),
    ("--half", "f16|bf16", "f16", "the half type of O1-O3 (O0 computes in f32)"),
    ("--data", "FILE.csv", "the digits", "numbers, integer label last, no header (mlp and cnn)"),
    ("--steps", "N", "600", "steps per run (at least 1), counted from the start when resuming"),
    ("--seed", "N", "0", "picks the initial weights and the held-out split"),
    ("--json", "", "off", "one JSON object per run on stdout; the table to stderr"),
    ("--save", "DIR", "-", "a checkpoint per run at the end, in DIR/<model>-<level>-<half>/"),
    ("--resume", "DIR", "-", "continue each run from the checkpoint --save wrote there"),
    ("--report", "DIR", "-", "DIR/<model>.svg: the loss per step and the loss scale"),
    ("--doctor", "DIR", "-", "the numerics doctor's JSON and SVG per run, in DIR"),
    ("--checkpoint", "SEGMENTS", "-", "transformer: gradient checkpointing, segments of blocks"),
    ("--ffn-chunk", "N", "-", "transformer: the feed-forward on N positions at a time"),
    ("-h, --help", "", "", "print this help and exit"),
];

/// The rows of `--help`'s table, with the ranges the parser enforces (from the constants it
/// checks against) after the memory savers' meanings.
fn flags() -> Vec<[String; 4]> {
    let range = |flag: &str| match flag {
        "--checkpoint" => format!(" (1 to {TRANSFORMER_LAYERS})"),
        "--ffn-chunk" => format!(" (1 to {})", 2 * SEQ),
        _ => String::new(),
    };
    FLAGS
        .iter()
        .map(|r| [r.0.into(), r.1.into(), r.2.into(), format!("{}{}", r.3, range(r.0))])
        .collect()
}

/// What `--help` prints: the one-line usage, then the flags as a table (flag, value, default,
/// meaning), one line per flag.
pub fn usage() -> String {
    let head = ["flag", "value", "default", "meaning"].map(String::from);
    let rows = flags();
    let width = |i: usize| rows.iter().chain([&head]).map(|r| r[i].len()).max().unwrap_or(0);
    let (w0, w1, w2) = (width(0), width(1), width(2));
    let rule = ["-".repeat(w0), "-".repeat(w1), "-".repeat(w2), "-".repeat(7)];
    let mut out = format!("{}\n", synopsis());
    for r in [&head, &rule].into_iter().chain(&rows) {
        out += &format!("\n  {:w0$}  {:w1$}  {:w2$}  {}", r[0], r[1], r[2], r[3]);
    }
    out
}

/// Parses the arguments (without the program name). A flag given twice is refused: a
/// repeated `--model` or `--opt-level` value would train the same run twice, and a second
/// `--steps` or `--half` would silently override the first.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, UsageError> {
    let mut a = Args {
        models: Vec::new(),
        models_given: false,
        levels: Vec::new(),
        half: amp::HalfType::F16,
        data: None,
        steps: 600,
        seed: 0,
        json: false,
        save: None,
        resume: None,
        report: None,
        doctor: None,
        checkpoint: None,
        ffn_chunk: None,
    };
    let mut seen = HashSet::new();
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Ok(Parsed::Help);
        }
        let repeatable = flag == "--model" || flag == "--opt-level";
        if !repeatable && flag.starts_with("--") && !seen.insert(flag.clone()) {
            return Err(UsageError(format!("{flag} is given twice")));
        }
        let mut value = || it.next().ok_or_else(|| UsageError(format!("{flag} needs a value")));
        let number = |v: String, what: &str| {
            v.parse::<usize>()
                .map_err(|_| UsageError(format!("{flag} takes {what}, not {v:?}")))
        };
        match flag.as_str() {
            "--model" => {
                let m = ModelKind::parse(&value()?)?;
                if a.models.contains(&m) {
                    return Err(UsageError(format!("--model {} is given twice", m.name())));
                }
                a.models.push(m);
            }
            "--opt-level" => {
                let v = value()?;
                let l: amp::OptLevel = v.parse().map_err(|e| UsageError(format!("--opt-level: {e}")))?;
                if a.levels.contains(&l) {
                    return Err(UsageError(format!("--opt-level {l} is given twice")));
                }
                a.levels.push(l);
            }
            "--half" => a.half = value()?.parse().map_err(|e| UsageError(format!("--half: {e}")))?,
            "--data" => a.data = Some(value()?),
            "--steps" => a.steps = number(value()?, "a positive integer")?,
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
            "--doctor" => a.doctor = Some(value()?),
            "--checkpoint" => a.checkpoint = Some(number(value()?, "a number of segments")?),
            "--ffn-chunk" => a.ffn_chunk = Some(number(value()?, "a number of positions")?),
            other => return Err(UsageError(format!("unknown argument {other:?}"))),
        }
    }
    if a.steps == 0 {
        return Err(UsageError("--steps must be at least 1".into()));
    }
    if let Some(s) = a.checkpoint
        && !(1..=TRANSFORMER_LAYERS).contains(&s)
    {
        return Err(UsageError(format!(
            "--checkpoint {s}: the transformer has {TRANSFORMER_LAYERS} blocks, so use 1 to {TRANSFORMER_LAYERS} segments"
        )));
    }
    let context = 2 * SEQ;
    if let Some(n) = a.ffn_chunk
        && !(1..=context).contains(&n)
    {
        return Err(UsageError(format!(
            "--ffn-chunk {n}: the transformer's context is {context} positions, so use 1 to {context}"
        )));
    }
    a.models_given = !a.models.is_empty();
    if a.models.is_empty() {
        a.models = vec![ModelKind::Mlp, ModelKind::Cnn, ModelKind::Transformer];
    }
    if a.levels.is_empty() {
        a.levels = amp::OptLevel::ALL.to_vec();
    }
    Ok(Parsed::Run(Box::new(a)))
}

/// Checks the flags against the models that will train (after `--data` chose them): a flag
/// that no model uses is a usage error; one that some models ignore is a warning, returned
/// for stderr.
pub fn check_models(a: &Args) -> Result<Vec<String>, UsageError> {
    let transformer = a.models.contains(&ModelKind::Transformer);
    let mut warnings = Vec::new();
    for (flag, given) in [
        ("--checkpoint", a.checkpoint.is_some()),
        ("--ffn-chunk", a.ffn_chunk.is_some()),
    ] {
        if given && !transformer {
            return Err(UsageError(format!(
                "{flag} applies to the transformer only, and it is not among the models trained ({})",
                names(&a.models)
            )));
        }
    }
    if let Some(path) = &a.data {
        if a.models.iter().all(|&m| m == ModelKind::Transformer) {
            return Err(UsageError(format!(
                "--data {path}: the transformer learns a generated sequence task and reads no data; \
                 add --model mlp or --model cnn, or leave out --data"
            )));
        }
        if transformer {
            warnings.push(format!(
                "--data {path}: the transformer does not read it (it learns a generated sequence task); it is for {}",
                names(
                    &a.models
                        .iter()
                        .copied()
                        .filter(|&m| m != ModelKind::Transformer)
                        .collect::<Vec<_>>()
                )
            ));
        }
    }
    Ok(warnings)
}

fn names(models: &[ModelKind]) -> String {
    models.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
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

    fn err(args: &str) -> String {
        run(args).expect_err(args).0
    }

    #[test]
    fn defaults_and_help() {
        let a = run("").unwrap();
        assert_eq!(a.models, [ModelKind::Mlp, ModelKind::Cnn, ModelKind::Transformer]);
        assert!(!a.models_given);
        assert_eq!(a.levels, amp::OptLevel::ALL);
        assert_eq!((a.steps, a.seed, a.checkpoint, a.ffn_chunk), (600, 0, None, None));
        assert!(matches!(
            parse(["--steps".into(), "5".into(), "--help".into()]),
            Ok(Parsed::Help)
        ));
        assert!(matches!(parse(["-h".into()]), Ok(Parsed::Help)));
    }

    #[test]
    fn help_is_a_table_of_every_flag_with_the_parsers_defaults() {
        let h = usage();
        assert!(h.starts_with("usage: train "));
        let lines: Vec<&str> = h.lines().collect();
        assert_eq!(lines[1], "");
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            ["flag", "value", "default", "meaning"]
        );
        // One line per flag, each flag of the usage line among them, and no other.
        let synopsis_flags: Vec<&str> = synopsis()
            .split('[')
            .skip(1)
            .map(|s| s.split([' ', ']']).next().unwrap())
            .collect();
        let rows = flags();
        assert_eq!(lines.len(), 4 + rows.len());
        let row_flags: Vec<&str> = rows
            .iter()
            .map(|r| r[0].as_str())
            .filter(|f| !f.starts_with("-h"))
            .collect();
        assert_eq!(row_flags, synopsis_flags);
        for (line, r) in lines[4..].iter().zip(&rows) {
            assert!(
                line.trim_start().starts_with(r[0].as_str()) && line.ends_with(r[3].as_str()),
                "{line}"
            );
        }
        // The defaults shown are the parser's; the ranges shown are the ones it enforces.
        let default = |flag: &str| rows.iter().find(|r| r[0] == flag).unwrap()[2].clone();
        let a = run("").unwrap();
        assert_eq!(default("--steps"), a.steps.to_string());
        assert_eq!(default("--seed"), a.seed.to_string());
        assert_eq!(default("--half"), a.half.to_string());
        assert_eq!((a.models.len(), a.levels.len()), (3, 4));
        assert!(h.contains(&format!("(1 to {TRANSFORMER_LAYERS})")) && h.contains(&format!("(1 to {})", 2 * SEQ)));
        assert!(run(&format!("--checkpoint {TRANSFORMER_LAYERS} --ffn-chunk {}", 2 * SEQ)).is_ok());
    }

    #[test]
    fn repeated_flags_are_refused() {
        assert_eq!(err("--model mlp --model cnn --model mlp"), "--model mlp is given twice");
        assert_eq!(err("--opt-level O1 --opt-level o1"), "--opt-level O1 is given twice");
        assert_eq!(err("--steps 5 --steps 6"), "--steps is given twice");
        assert_eq!(err("--half f16 --half bf16"), "--half is given twice");
        assert_eq!(err("--json --json"), "--json is given twice");
        let a = run("--model mlp --model transformer --opt-level O2 --opt-level O0").unwrap();
        assert_eq!(a.models, [ModelKind::Mlp, ModelKind::Transformer]);
        assert_eq!(a.levels, [amp::OptLevel::O2, amp::OptLevel::O0]);
        assert!(a.models_given);
    }

    #[test]
    fn memory_saver_ranges() {
        let a = run("--checkpoint 2 --ffn-chunk 16").unwrap();
        assert_eq!((a.checkpoint, a.ffn_chunk), (Some(2), Some(16)));
        assert!(err("--ffn-chunk 17").contains("context is 16 positions, so use 1 to 16"));
        assert!(err("--ffn-chunk 0").contains("use 1 to 16"));
        assert!(err("--checkpoint 3").contains("use 1 to 2 segments"));
        assert!(err("--checkpoint 0").contains("use 1 to 2 segments"));
        assert!(err("--ffn-chunk x").contains("takes a number of positions"));
        assert_eq!(err("--steps 0"), "--steps must be at least 1");
        assert!(err("--model rnn").contains("unknown model"));
        assert!(err("--frobnicate").contains("unknown argument"));
        assert!(err("--steps").contains("needs a value"));
        // The message carries the usage line.
        assert!(run("--frobnicate").unwrap_err().to_string().contains("usage: train"));
    }

    #[test]
    fn flags_no_model_uses_are_refused() {
        let check = |args: &str| check_models(&run(args).unwrap());
        assert!(
            check("--model mlp --checkpoint 1")
                .unwrap_err()
                .0
                .contains("--checkpoint applies to the transformer only")
        );
        assert!(
            check("--model mlp --model cnn --ffn-chunk 4")
                .unwrap_err()
                .0
                .contains("--ffn-chunk applies to the transformer only")
        );
        assert_eq!(check("--checkpoint 1 --ffn-chunk 4").unwrap(), Vec::<String>::new());
        assert!(
            check("--model transformer --data f.csv")
                .unwrap_err()
                .0
                .contains("reads no data")
        );
        let w = check("--model mlp --model transformer --data f.csv").unwrap();
        assert_eq!(w.len(), 1);
        assert!(
            w[0].contains("the transformer does not read it") && w[0].ends_with("it is for mlp"),
            "{w:?}"
        );
        assert_eq!(check("--model cnn --data f.csv").unwrap(), Vec::<String>::new());
    }
}
