//! The numerics doctor's picture: per-tensor amax and f16 underflow bars (the worst
//! activations first, as the report sorts them) and the loss scale over the steps.

use std::path::Path;

use anyhow::{Result, anyhow};
use candle_amp::doctor::{DoctorReport, TensorKind};
use plotters::prelude::*;

const BARS: usize = 24;
const BLUE: RGBColor = RGBColor(31, 119, 180);
const ORANGE: RGBColor = RGBColor(255, 127, 14);
const RED: RGBColor = RGBColor(214, 39, 40);

/// Draws `report` to `path`.
pub fn draw(path: &Path, title: &str, report: &DoctorReport) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let acts: Vec<_> = report
        .tensors
        .iter()
        .filter(|t| t.kind == TensorKind::Activation)
        .take(BARS)
        .collect();
    let names: Vec<String> = acts.iter().map(|t| t.name.clone()).collect();
    let n = acts.len().max(1);
    let root = SVGBackend::new(path, (1000, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (top, rest) = root.split_vertically(330);
    let (mid, bottom) = rest.split_vertically(300);
    let label = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 {
            names.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };

    // amax per activation, log scale, with f16's max.
    let amax_hi = acts.iter().map(|t| t.amax).fold(65504.0 * 4.0, f64::max);
    let amin_lo = acts.iter().map(|t| t.amax).filter(|v| *v > 0.0).fold(1e-3, f64::min) / 4.0;
    let mut c = ChartBuilder::on(&top)
        .caption(
            format!("{title}: largest magnitude per activation (line: f16 max 65504; red: inf/NaN)"),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(70)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..n as f64 - 0.5, (amin_lo..amax_hi).log_scale())
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_labels(n)
        .x_label_formatter(&label)
        .x_label_style(("sans-serif", 9).into_font().transform(FontTransform::Rotate90))
        .y_desc("amax (log)")
        .draw()
        .map_err(|e| err(&e))?;
    c.draw_series(acts.iter().enumerate().map(|(i, t)| {
        let color = if t.nonfinite > 0 { RED } else { BLUE };
        Rectangle::new(
            [(i as f64 - 0.35, amin_lo), (i as f64 + 0.35, t.amax.max(amin_lo))],
            color.filled(),
        )
    }))
    .map_err(|e| err(&e))?;
    c.draw_series(LineSeries::new(
        [(-0.5, 65504.0), (n as f64 - 0.5, 65504.0)],
        BLACK.stroke_width(1),
    ))
    .map_err(|e| err(&e))?;

    // f16 underflow per activation, with the doctor's threshold.
    let mut c = ChartBuilder::on(&mid)
        .caption(
            "share below f16's smallest normal 6.1e-5 (line: 5% threshold)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(70)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..100.0)
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_labels(n)
        .x_label_formatter(&label)
        .x_label_style(("sans-serif", 9).into_font().transform(FontTransform::Rotate90))
        .y_desc("underflow f16 (%)")
        .draw()
        .map_err(|e| err(&e))?;
    c.draw_series(acts.iter().enumerate().map(|(i, t)| {
        Rectangle::new(
            [(i as f64 - 0.35, 0.0), (i as f64 + 0.35, t.underflow_f16 * 100.0)],
            ORANGE.filled(),
        )
    }))
    .map_err(|e| err(&e))?;
    c.draw_series(LineSeries::new(
        [(-0.5, 5.0), (n as f64 - 0.5, 5.0)],
        BLACK.stroke_width(1),
    ))
    .map_err(|e| err(&e))?;

    // The loss scale over the steps, skipped steps marked.
    let pts: Vec<(f64, f64)> = report
        .loss_scale
        .iter()
        .map(|p| (p.step as f64, p.scale as f64))
        .collect();
    let last = pts.last().map_or(1.0, |p| p.0).max(1.0);
    let smax = pts.iter().map(|p| p.1).fold(2.0, f64::max) * 2.0;
    let smin = pts.iter().map(|p| p.1).filter(|v| *v > 0.0).fold(smax / 4.0, f64::min) / 2.0;
    let mut c = ChartBuilder::on(&bottom)
        .caption("loss scale over the steps (x: skipped step)", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..last, (smin..smax).log_scale())
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("step")
        .y_desc("scale (log)")
        .draw()
        .map_err(|e| err(&e))?;
    c.draw_series(LineSeries::new(pts.iter().copied(), BLUE.stroke_width(2)))
        .map_err(|e| err(&e))?;
    c.draw_series(
        report
            .loss_scale
            .iter()
            .filter(|p| p.skipped)
            .map(|p| Cross::new((p.step as f64, (p.scale as f64).max(smin)), 5, RED.stroke_width(2))),
    )
    .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
