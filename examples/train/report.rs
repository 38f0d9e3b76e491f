//! The training report: an SVG per model with the loss per step for each opt level and the
//! loss scale over the steps, skipped steps marked.

use std::path::Path;

use anyhow::{Result, anyhow};
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

/// Draws the report to `path`.
pub fn draw(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (900, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (top, bottom) = root.split_vertically(420);
    let steps = series.iter().map(|s| s.losses.len()).max().unwrap_or(1).max(2);
    let finite = |v: &f64| v.is_finite() && *v > 0.0;
    let lmax = series
        .iter()
        .flat_map(|s| s.losses.iter())
        .copied()
        .filter(finite)
        .fold(1e-6f64, f64::max);
    let lmin = series
        .iter()
        .flat_map(|s| s.losses.iter())
        .copied()
        .filter(finite)
        .fold(lmax, f64::min);

    let mut c = ChartBuilder::on(&top)
        .caption(format!("{title}: training loss per step"), ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0..steps, (lmin * 0.9..lmax * 1.1).log_scale())
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("step")
        .y_desc("loss (log)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        c.draw_series(LineSeries::new(
            s.losses
                .iter()
                .enumerate()
                .filter(|(_, v)| finite(v))
                .map(|(k, v)| (k, *v)),
            color.stroke_width(1),
        ))
        .map_err(|e| err(&e))?
        .label(s.label.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;

    let smax = series
        .iter()
        .flat_map(|s| s.scales.iter())
        .map(|v| *v as f64)
        .filter(finite)
        .fold(2.0f64, f64::max);
    let smin = series
        .iter()
        .flat_map(|s| s.scales.iter())
        .map(|v| *v as f64)
        .filter(finite)
        .fold(smax, f64::min);
    let mut c = ChartBuilder::on(&bottom)
        .caption("loss scale (x: skipped step)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0..steps, (smin * 0.5..smax * 2.0).log_scale())
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("step")
        .y_desc("scale (log)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        c.draw_series(LineSeries::new(
            s.scales
                .iter()
                .enumerate()
                .filter(|(_, v)| finite(&(**v as f64)))
                .map(|(k, v)| (k, *v as f64)),
            color.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label(s.label.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        c.draw_series(
            s.skipped
                .iter()
                .enumerate()
                .filter(|(_, sk)| **sk)
                .map(|(k, _)| Cross::new((k, (s.scales[k] as f64).max(smin)), 5, color.stroke_width(2))),
        )
        .map_err(|e| err(&e))?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
