//! The training report: an SVG per model with the loss per step for each opt level and the
//! loss scale over the steps, skipped steps marked.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::coord::ranged1d::AsRangedCoord;
use plotters::prelude::*;

/// One opt level's history.
pub struct Series {
    /// The legend label.
    pub label: String,
    /// Training loss per step.
    pub losses: Vec<f64>,
    /// Loss scale after each step.
    pub scales: Vec<f32>,
    /// Whether each step was skipped.
    pub skipped: Vec<bool>,
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
];

/// Values a log axis can show.
fn plottable(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// A log-axis tick label: at most 3 decimals, no trailing zeros (plotters would print float
/// noise such as 0.60000000001).
fn tick(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The smallest and largest plottable value (at least `floor` for the largest).
fn range(values: impl Iterator<Item = f64> + Clone, floor: f64) -> (f64, f64) {
    let max = values.clone().filter(|v| plottable(*v)).fold(floor, f64::max);
    let min = values.filter(|v| plottable(*v)).fold(max, f64::min);
    (min, max)
}

type LogChart<'a> = ChartContext<
    'a,
    SVGBackend<'a>,
    Cartesian2d<<std::ops::Range<usize> as AsRangedCoord>::CoordDescType, LogCoord<f64>>,
>;

/// One panel: a log-scale line per series (`values` picks the series' values), a legend.
#[allow(clippy::too_many_arguments)]
fn panel<'a>(
    area: &DrawingArea<SVGBackend<'a>, Shift>,
    caption: (&str, u32),
    y_desc: &str,
    steps: usize,
    y: std::ops::Range<f64>,
    width: u32,
    series: &[Series],
    values: impl Fn(&Series) -> Vec<f64>,
) -> Result<LogChart<'a>> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", caption.0);
    let mut c = ChartBuilder::on(area)
        .caption(caption.0, ("sans-serif", caption.1))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0..steps, y.log_scale())
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .y_label_formatter(&|v| tick(*v))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<(usize, f64)> = values(s)
            .into_iter()
            .enumerate()
            .filter(|(_, v)| plottable(*v))
            .collect();
        c.draw_series(LineSeries::new(points, color.stroke_width(width)))
            .map_err(|e| err(&e))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    Ok(c)
}

/// Draws the report to `path`.
pub fn draw(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (900, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (top, bottom) = root.split_vertically(420);
    let steps = series.iter().map(|s| s.losses.len()).max().unwrap_or(1).max(2);

    let (lmin, lmax) = range(series.iter().flat_map(|s| s.losses.iter().copied()), 1e-6);
    let caption = format!("{title}: training loss per step");
    panel(
        &top,
        (&caption, 20),
        "loss (log)",
        steps,
        lmin * 0.9..lmax * 1.1,
        1,
        series,
        |s| s.losses.clone(),
    )?;

    let scales = |s: &Series| s.scales.iter().map(|v| *v as f64).collect::<Vec<f64>>();
    let (smin, smax) = range(series.iter().flat_map(|s| s.scales.iter().map(|v| *v as f64)), 2.0);
    let caption = ("loss scale (x: skipped step)", 18);
    let mut c = panel(
        &bottom,
        caption,
        "scale (log)",
        steps,
        smin * 0.5..smax * 2.0,
        2,
        series,
        scales,
    )?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let marks = s.skipped.iter().enumerate().filter(|(_, sk)| **sk);
        c.draw_series(marks.map(|(k, _)| Cross::new((k, (s.scales[k] as f64).max(smin)), 5, color.stroke_width(2))))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
