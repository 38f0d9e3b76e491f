//! Loading and preparing a classification data set: numeric features, integer label last,
//! no header; a seeded shuffle, a held-out split, and standardisation.

use std::fmt;
use std::io::Read;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// The bundled UCI optical digits (1797 8x8 images, CC BY 4.0), gzip-compressed.
pub const DIGITS_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// A malformed data file.
#[derive(Debug)]
pub struct DataError {
    /// 1-based line number (0: the file as a whole).
    pub line: usize,
    /// What was wrong.
    pub msg: String,
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "data file: {}", self.msg)
        } else {
            write!(f, "data file line {}: {}", self.line, self.msg)
        }
    }
}

impl std::error::Error for DataError {}

/// Rows of features and labels.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Row-major features, `n * width`.
    pub x: Vec<f32>,
    /// Labels.
    pub y: Vec<u32>,
    /// Features per row.
    pub width: usize,
}

impl Dataset {
    /// Rows.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Number of classes: max label + 1.
    pub fn classes(&self) -> usize {
        self.y.iter().copied().max().map(|m| m as usize + 1).unwrap_or(0)
    }

    /// The labels below the largest that no row has: classes the model gets outputs for but
    /// never sees.
    pub fn empty_classes(&self) -> Vec<u32> {
        let mut seen = vec![false; self.classes()];
        for &l in &self.y {
            seen[l as usize] = true;
        }
        (0..seen.len() as u32).filter(|&c| !seen[c as usize]).collect()
    }

    /// A warning for stderr when some classes below the largest label have no row.
    pub fn empty_classes_warning(&self) -> Option<String> {
        let empty = self.empty_classes();
        if empty.is_empty() {
            return None;
        }
        let shown: Vec<String> = empty.iter().take(10).map(u32::to_string).collect();
        Some(format!(
            "the data's labels run to {} but no row has {}{}: the model gets {} outputs, {} never trained",
            self.classes() - 1,
            shown.join(", "),
            if empty.len() > 10 { ", ..." } else { "" },
            self.classes(),
            empty.len()
        ))
    }

    fn take(&self, idx: &[usize]) -> Dataset {
        let mut x = Vec::with_capacity(idx.len() * self.width);
        let mut y = Vec::with_capacity(idx.len());
        for &i in idx {
            x.extend_from_slice(&self.x[i * self.width..(i + 1) * self.width]);
            y.push(self.y[i]);
        }
        Dataset {
            x,
            y,
            width: self.width,
        }
    }
}

/// Parses CSV text: numeric features then an integer label on each line, no header. Blank
/// lines are skipped. Every row must have the same width.
///
/// The classifier has one output per class, the largest label plus one, so a label is
/// refused (at the line of its first row) when it would make more classes than the file has
/// rows: a typo'd label would otherwise train a model that is mostly empty classes, or ask
/// for terabytes of weights.
pub fn parse_csv(text: &str) -> Result<Dataset, DataError> {
    let mut x = Vec::new();
    let mut y = Vec::new();
    let mut width = None;
    // The largest label and the line it first appears on.
    let mut max_label: Option<(u32, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let ln = i + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() < 2 {
            return Err(DataError {
                line: ln,
                msg: format!("expected features and a label, found {} field(s)", fields.len()),
            });
        }
        let w = fields.len() - 1;
        match width {
            None => width = Some(w),
            Some(w0) if w0 != w => {
                return Err(DataError {
                    line: ln,
                    msg: format!("expected {w0} features as on earlier lines, found {w}"),
                });
            }
            _ => {}
        }
        for (j, f) in fields[..w].iter().enumerate() {
            let v: f32 = f.parse().map_err(|_| DataError {
                line: ln,
                msg: format!("feature {} is not a number: {f:?}", j + 1),
            })?;
            if !v.is_finite() {
                return Err(DataError {
                    line: ln,
                    msg: format!("feature {} is not finite: {f:?}", j + 1),
                });
            }
            x.push(v);
        }
        let lab = fields[w];
        let l: u32 = lab.parse().map_err(|_| DataError {
            line: ln,
            msg: format!("the label (last field) must be a non-negative integer, found {lab:?}"),
        })?;
        if max_label.is_none_or(|(m, _)| l > m) {
            max_label = Some((l, ln));
        }
        y.push(l);
    }
    let width = width.ok_or(DataError {
        line: 0,
        msg: "no rows".into(),
    })?;
    if let Some((m, ln)) = max_label
        && m as u64 + 1 > y.len() as u64
    {
        return Err(DataError {
            line: ln,
            msg: format!(
                "label {m} makes {} classes (labels are 0 to K-1 for K classes), more than the file's {} rows: \
                 number the classes from 0 without gaps",
                m as u64 + 1,
                y.len()
            ),
        });
    }
    Ok(Dataset { x, y, width })
}

/// Reads a data file (`.gz` is decompressed).
pub fn read_file(path: &str) -> Result<Dataset, DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError {
        line: 0,
        msg: format!("cannot read {path}: {e}"),
    })?;
    decode(&bytes, path.ends_with(".gz"))
}

/// The bundled digits data.
pub fn digits() -> Result<Dataset, DataError> {
    decode(DIGITS_GZ, true)
}

fn decode(bytes: &[u8], gz: bool) -> Result<Dataset, DataError> {
    let text = if gz {
        let mut s = String::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_string(&mut s)
            .map_err(|e| DataError {
                line: 0,
                msg: format!("not valid gzip text: {e}"),
            })?;
        s
    } else {
        String::from_utf8(bytes.to_vec()).map_err(|e| DataError {
            line: 0,
            msg: format!("not UTF-8 text: {e}"),
        })?
    };
    parse_csv(&text)
}

/// A seeded shuffle, then the last `held_out` fraction as the test split; features are
/// standardised with the training split's mean and standard deviation (a constant column
/// gets standard deviation 1, so it does not divide by zero).
pub fn split_standardise(d: &Dataset, held_out: f64, seed: u64) -> (Dataset, Dataset) {
    let mut idx: Vec<usize> = (0..d.len()).collect();
    idx.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let n_test = ((d.len() as f64) * held_out).round() as usize;
    let n_train = d.len() - n_test;
    let mut train = d.take(&idx[..n_train]);
    let mut test = d.take(&idx[n_train..]);
    let w = d.width;
    for j in 0..w {
        let col: Vec<f64> = (0..train.len()).map(|i| train.x[i * w + j] as f64).collect();
        let mean = col.iter().sum::<f64>() / col.len().max(1) as f64;
        let var = col.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / col.len().max(1) as f64;
        let std = if var > 1e-12 { var.sqrt() } else { 1.0 };
        for ds in [&mut train, &mut test] {
            for i in 0..ds.len() {
                let v = &mut ds.x[i * w + j];
                *v = ((*v as f64 - mean) / std) as f32;
            }
        }
    }
    (train, test)
}
