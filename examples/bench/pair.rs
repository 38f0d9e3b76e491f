//! Profiling aid (`BENCH_PAIR=MODEL:LEVEL:HALF`, MODEL `mlp`, `example`, `memory` or `mid`):
//! the configuration and O0 step by step in turn, in one process, and the median of the
//! per-pair ratios. On a shared machine whose speed drifts by tens of percent within
//! minutes, a ratio of neighbouring steps is steadier than a ratio of two medians taken
//! minutes apart; the order within a pair alternates, so neither side always runs warm.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_amp::{HalfType, OptLevel};
use candle_core::Tensor;

use crate::measure::{self, MlpRun, TransformerRun};

/// One side of the pair.
enum Run<'a> {
    Mlp(MlpRun<'a>),
    Transformer(TransformerRun),
}

impl Run<'_> {
    fn step_s(&mut self) -> Result<f64> {
        let t = Instant::now();
        match self {
            Run::Mlp(r) => r.step()?,
            Run::Transformer(r) => {
                r.step(false)?;
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `which` against O0 for `pairs` pairs after one warm-up step each; prints the
/// medians and the median ratio to stderr.
pub fn paired(which: &str, pairs: usize, hidden: usize, data: &[(Tensor, Tensor)], quick: bool) -> Result<()> {
    let mut it = which.splitn(3, ':');
    let (model, level, half) = (
        it.next().context("BENCH_PAIR=MODEL:LEVEL:HALF")?,
        it.next().context("BENCH_PAIR=MODEL:LEVEL:HALF")?.parse::<OptLevel>()?,
        it.next().context("BENCH_PAIR=MODEL:LEVEL:HALF")?.parse::<HalfType>()?,
    );
    let make = |level: OptLevel| -> Result<Run<'_>> {
        if model == "mlp" {
            return Ok(Run::Mlp(MlpRun::new(level, half, hidden, data)?));
        }
        let Some((_, c, batch)) = measure::transformers(quick).into_iter().find(|(n, ..)| *n == model) else {
            bail!("BENCH_PAIR: MODEL is mlp, example, memory or mid")
        };
        Ok(Run::Transformer(TransformerRun::new(level, half, c, batch, pairs + 1)?))
    };
    let (mut base, mut other) = (make(OptLevel::O0)?, make(level)?);
    base.step_s()?;
    other.step_s()?;
    let (mut b, mut o, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..pairs {
        let (tb, to) = if i % 2 == 0 {
            let tb = base.step_s()?;
            (tb, other.step_s()?)
        } else {
            let to = other.step_s()?;
            (base.step_s()?, to)
        };
        b.push(tb);
        o.push(to);
        r.push(to / tb);
    }
    eprintln!(
        "pair {which}: O0 {:.2} ms, {level:?} {half:?} {:.2} ms, median ratio {:.3}",
        median(b) * 1e3,
        median(o) * 1e3,
        median(r)
    );
    Ok(())
}
