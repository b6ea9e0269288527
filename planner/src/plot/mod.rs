//! Trade-off plots: memory saved against throughput lost per checkpoint subset, and what
//! checkpointing each candidate block saves and costs. Plain structs in, SVG + PNG files out;
//! no libtorch and no JSON (the `plot` command turns profiles and sweeps into these structs).
//!
//! Text is set in DejaVu Sans, embedded in the binary (`planner/assets/`), so a PNG renders the
//! same on a machine without fonts; the SVG names the same font and falls back to sans-serif.
//! Colours are Okabe–Ito, which stays distinguishable under the common colour-vision
//! deficiencies; where a plot has more subsets than colours, the marker shape varies too.

mod axes;
mod candidates;
mod data;
mod draw;
mod labels;
mod raster;
mod render;
mod tradeoff;

use std::path::Path;

use candidates::Candidates;
pub use data::{subset_label, CandidateBar, CandidateBasis, PlotMeta, Tradeoff, TradeoffPoint};
pub use draw::{HEIGHT, MARKER_OPACITY, WHISKER_OPACITY, WIDTH};
use render::write_figure;
pub use render::PlotError;
use tradeoff::Scatter;

/// Draws memory saved (y) against throughput lost (x), one marker per subset, and writes it
/// as SVG and PNG. Measured points are filled, predicted ones hollow and a little larger, so a
/// prediction that hits its measurement rings it. The dashed staircase is the best saving
/// reachable for a given throughput loss (the Pareto front), its corners labelled.
pub fn scatter(points: &[TradeoffPoint], meta: &PlotMeta, svg_path: &Path, png_path: &Path) -> Result<(), PlotError> {
    for p in points {
        let values = [p.measured, p.predicted]
            .into_iter()
            .flatten()
            .flat_map(|t| [t.throughput_lost_pct, t.memory_saved_pct])
            .chain(
                [p.throughput_lost_range_pct, p.predicted_range_pct]
                    .into_iter()
                    .flatten()
                    .flat_map(|(a, b)| [a, b]),
            );
        check_finite(svg_path, &p.label, values)?;
    }
    if points.iter().all(|p| p.measured.is_none() && p.predicted.is_none()) {
        return Err(PlotError::Empty {
            what: svg_path.display().to_string(),
            why: "no subset has a measured or a predicted trade-off".into(),
        });
    }
    write_figure(&Scatter { points, meta }, svg_path, png_path)
}

/// Draws, per candidate block, the memory its checkpointing saves and the recompute time it
/// costs, as paired horizontal bars in chain order, and writes it as SVG and PNG.
pub fn candidates_chart(
    bars: &[CandidateBar],
    basis: CandidateBasis,
    meta: &PlotMeta,
    svg_path: &Path,
    png_path: &Path,
) -> Result<(), PlotError> {
    for b in bars {
        let range = b.cost_range_pct.into_iter().flat_map(|(lo, hi)| [lo, hi]);
        check_finite(
            svg_path,
            &b.block,
            [b.saved_pct, b.cost_pct, b.cost_seconds].into_iter().chain(range),
        )?;
    }
    if bars.is_empty() {
        return Err(PlotError::Empty {
            what: svg_path.display().to_string(),
            why: "no candidate blocks".into(),
        });
    }
    write_figure(&Candidates { bars, basis, meta }, svg_path, png_path)
}

/// A NaN or an infinity has no place on an axis (and would make the tick count unbounded).
fn check_finite(path: &Path, label: &str, values: impl IntoIterator<Item = f64>) -> Result<(), PlotError> {
    match values.into_iter().find(|v| !v.is_finite()) {
        Some(v) => Err(PlotError::NotFinite {
            what: path.display().to_string(),
            label: label.to_owned(),
            value: v,
        }),
        None => Ok(()),
    }
}
