//! The text the model learns, as bytes: the bundled book or a file, a training and a
//! held-out part, and batches of windows.

use std::io::Read;

use anyhow::{Context, Result, bail};
use candle_core::{Device, Tensor};
use rand::Rng;

/// Jules Verne, "Around the World in 80 Days", Project Gutenberg EBook #103 (public domain
/// in the USA; see data/README.md), gzip-compressed, with Project Gutenberg's header and
/// licence.
pub const EIGHTY_DAYS_GZ: &[u8] = include_bytes!("../../data/eighty-days.txt.gz");

/// The book's text between Project Gutenberg's start marker and its closing line (the
/// header, the licence and the trademark text are not the book).
fn gutenberg_body(text: &[u8]) -> &[u8] {
    let find = |from: usize, needle: &[u8]| {
        text[from..]
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + from)
    };
    let start = find(0, b"*** START OF")
        .and_then(|s| find(s, b"\n"))
        .map_or(0, |e| e + 1);
    // The book's last line is followed by "End of Project Gutenberg's ..." and the marker.
    let end = find(start, b"End of Project Gutenberg")
        .or_else(|| find(start, b"*** END OF"))
        .unwrap_or(text.len());
    &text[start..end]
}

/// The bytes to learn: `path`'s, or the bundled book's body.
pub fn load(path: Option<&str>) -> Result<Vec<u8>> {
    match path {
        Some(p) => std::fs::read(p).with_context(|| format!("--text {p}: cannot read it")),
        None => {
            let mut all = Vec::new();
            flate2::read::GzDecoder::new(EIGHTY_DAYS_GZ)
                .read_to_end(&mut all)
                .context("decompressing the bundled text")?;
            Ok(gutenberg_body(&all).to_vec())
        }
    }
}

/// The text split into a training part (the first 90%) and a held-out part.
pub struct Text {
    pub train: Vec<u8>,
    pub held_out: Vec<u8>,
}

impl Text {
    /// Splits `bytes`; each part must hold a window of `context + 1` bytes.
    pub fn split(bytes: Vec<u8>, context: usize, what: &str) -> Result<Self> {
        let cut = bytes.len() * 9 / 10;
        if bytes.len() - cut < context + 1 {
            bail!(
                "{what} has {} bytes: too short for a held-out tenth of at least {} bytes (the model's context + 1)",
                bytes.len(),
                context + 1
            );
        }
        let held_out = bytes[cut..].to_vec();
        let mut train = bytes;
        train.truncate(cut);
        Ok(Self { train, held_out })
    }
}

/// `starts.len()` windows of `bytes` as inputs `(n, context)` and their next bytes as
/// targets.
pub fn windows(bytes: &[u8], starts: &[usize], context: usize) -> Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(starts.len() * context);
    let mut y = Vec::with_capacity(starts.len() * context);
    for &s in starts {
        x.extend(bytes[s..s + context].iter().map(|b| *b as u32));
        y.extend(bytes[s + 1..s + context + 1].iter().map(|b| *b as u32));
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(x, (starts.len(), context), &dev)?,
        Tensor::from_vec(y, (starts.len(), context), &dev)?,
    ))
}

/// A training batch of `n` windows at random offsets drawn from `rng`.
pub fn batch(bytes: &[u8], n: usize, context: usize, rng: &mut impl Rng) -> Result<(Tensor, Tensor)> {
    let starts: Vec<usize> = (0..n).map(|_| rng.random_range(0..bytes.len() - context)).collect();
    windows(bytes, &starts, context)
}

/// Up to `n` windows spread evenly over the held-out bytes (the same every run).
pub fn held_out(bytes: &[u8], n: usize, context: usize) -> Result<(Tensor, Tensor)> {
    let room = bytes.len() - context - 1;
    let n = n.min(room + 1).max(1);
    let starts: Vec<usize> = (0..n).map(|i| i * room / (n - 1).max(1)).collect();
    windows(bytes, &starts, context)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_book_is_its_body() {
        let body = load(None).unwrap();
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("Phileas Fogg"));
        assert!(
            !text.contains("Project Gutenberg"),
            "the header and licence are left out"
        );
        assert!(body.len() > 300_000);
    }

    #[test]
    fn windows_and_targets_are_shifted_by_one() {
        let bytes: Vec<u8> = (0..50).collect();
        let (x, y) = windows(&bytes, &[0, 10], 4).unwrap();
        assert_eq!(x.to_vec2::<u32>().unwrap(), [[0, 1, 2, 3], [10, 11, 12, 13]]);
        assert_eq!(y.to_vec2::<u32>().unwrap(), [[1, 2, 3, 4], [11, 12, 13, 14]]);
        let (x, _) = held_out(&bytes, 3, 4).unwrap();
        assert_eq!(x.dims(), [3, 4]);
        assert!(Text::split(bytes, 4, "t").is_ok());
        assert!(Text::split(vec![0; 20], 4, "t").is_err());
    }
}
