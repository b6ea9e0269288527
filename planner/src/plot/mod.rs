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
mod draw;
mod raster;
mod render;
mod tradeoff;

use std::path::Path;

use ckptune_solver::formats::FormatError;

use candidates::Candidates;
pub use draw::WHISKER_OPACITY;
use render::write_figure;
use tradeoff::Scatter;

/// Size of every figure in pixels (the SVG's size in user units, the PNG's exactly).
pub const WIDTH: u32 = 1200;
pub const HEIGHT: u32 = 800;

/// Opacity of the markers drawn in a plot area, and of nothing else in a figure (legend
/// swatches are opaque): the tests count points in the SVG by it.
pub const MARKER_OPACITY: f64 = 0.85;

/// The font family name the embedded font is registered under. Written verbatim into the SVG
/// as a CSS font list, so an SVG viewer uses DejaVu Sans where it has it (the layout was
/// measured with it) and its own sans-serif otherwise.
const FONT: &str = "DejaVu Sans, sans-serif";
static FONT_BYTES: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error(transparent)]
    Write(#[from] FormatError),
    #[error("drawing {path}: {message}")]
    Draw { path: String, message: String },
    #[error("encoding {path} as PNG: {message}")]
    Png { path: String, message: String },
    #[error("the embedded font planner/assets/DejaVuSans.ttf could not be loaded")]
    Font,
    #[error("nothing to plot for {what}: {why}")]
    Empty { what: String, why: String },
    #[error("cannot plot {what}: {label:?} has the value {value}")]
    NotFinite { what: String, label: String, value: f64 },
}

/// What a figure is about; shown in its title.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotMeta {
    pub model: String,
    pub micro_batch: i64,
    pub grad_accum: i64,
    /// Gradients freed after each optimizer step (PyTorch's `zero_grad(set_to_none=True)`).
    pub set_to_none: bool,
    pub precision: String,
    pub optimizer: String,
    /// The device as the reader should see it, e.g. `cpu, 2 threads`.
    pub device: String,
    /// Where the numbers come from, e.g. `measured: median of 3 steps per subset`.
    pub source: String,
}

impl PlotMeta {
    /// `<model>-<precision>-<optimizer>-mb<N>`, plus `-ga<K>` for gradient accumulation and
    /// `-zerograd` for gradients zeroed in place (so configs never share a name), with anything
    /// that is not safe in a file name replaced (a model may be named by its path).
    pub fn file_stem(&self) -> String {
        let mut s = format!(
            "{}-{}-{}-mb{}",
            self.model, self.precision, self.optimizer, self.micro_batch
        );
        if self.grad_accum != 1 {
            s.push_str(&format!("-ga{}", self.grad_accum));
        }
        if !self.set_to_none {
            s.push_str("-zerograd");
        }
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.+".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }

    fn config_line(&self) -> String {
        let batch = if self.grad_accum == 1 {
            format!("batch {}", self.micro_batch)
        } else {
            format!("batch {} × {} accumulated", self.micro_batch, self.grad_accum)
        };
        let grads = if self.set_to_none {
            ""
        } else {
            " · grads zeroed in place"
        };
        format!(
            "{batch} · {} · {}{grads} · {}",
            self.precision, self.optimizer, self.device
        )
    }
}

/// A position in the trade-off plane, in percent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tradeoff {
    /// `100 × (1 − t_none / t_subset)`: the share of throughput lost to recomputation.
    pub throughput_lost_pct: f64,
    /// `100 × (1 − peak_subset / peak_none)`: the share of peak memory saved.
    pub memory_saved_pct: f64,
}

/// One checkpoint subset: measured (filled marker), predicted (hollow marker), or both.
#[derive(Debug, Clone, PartialEq)]
pub struct TradeoffPoint {
    /// Legend text, e.g. from [`subset_label`].
    pub label: String,
    /// Whether nothing is checkpointed: the reference point, drawn in black.
    pub baseline: bool,
    pub measured: Option<Tradeoff>,
    pub predicted: Option<Tradeoff>,
    /// Throughput lost by the fastest and the slowest timed step, drawn as a whisker through
    /// the measured marker: on a shared machine one slow step can move a median far.
    pub throughput_lost_range_pct: Option<(f64, f64)>,
    /// Throughput lost as predicted from the profile's fastest and slowest samples, drawn as a
    /// whisker through the predicted marker.
    pub predicted_range_pct: Option<(f64, f64)>,
}

/// What checkpointing one candidate block alone saves and costs.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateBar {
    pub block: String,
    pub saved_bytes: i64,
    /// `saved_bytes` as a percentage of the peak with nothing checkpointed.
    pub saved_pct: f64,
    /// Recompute time, and its percentage of the step time with nothing checkpointed.
    pub cost_seconds: f64,
    pub cost_pct: f64,
    /// `cost_pct` from the fastest and the slowest timed step, drawn as a whisker.
    pub cost_range_pct: Option<(f64, f64)>,
}

/// How a candidate's saving was obtained, which decides how the chart words it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CandidateBasis {
    /// From a sweep: peak and step time of the block checkpointed alone against nothing.
    Measured,
    /// From a profile: the activation bytes the block stops keeping (its peak effect can be
    /// smaller, because the peak may move to another moment) and its recompute time.
    Profiled,
}

/// A legend label for a set of module names: names that differ only after their last dot are
/// grouped, and numeric runs shortened (`encoder.layer.{0–3,7}`), so a 12-layer subset stays
/// one line. Nothing checkpointed reads as such.
pub fn subset_label(modules: &[String]) -> String {
    if modules.is_empty() {
        return "nothing checkpointed".into();
    }
    // Groups in first-seen order, so the label follows the chain.
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for m in modules {
        let (prefix, last) = match m.rsplit_once('.') {
            Some((p, l)) => (p.to_owned(), l.to_owned()),
            None => (String::new(), m.clone()),
        };
        match groups.iter_mut().find(|(p, _)| *p == prefix && !p.is_empty()) {
            Some((_, v)) => v.push(last),
            None => groups.push((prefix, vec![last])),
        }
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|(prefix, lasts)| {
            if prefix.is_empty() {
                lasts.join(" + ")
            } else if lasts.len() == 1 {
                format!("{prefix}.{}", lasts[0])
            } else {
                format!("{prefix}.{{{}}}", compress_runs(&lasts))
            }
        })
        .collect();
    parts.join(" + ")
}

/// `0,1,2,3,7` → `0–3,7`; non-numeric items are kept as they are.
fn compress_runs(items: &[String]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let mut j = i;
        if let Ok(start) = items[i].parse::<u64>() {
            while j + 1 < items.len() && items[j + 1].parse::<u64>().ok() == Some(start + (j + 1 - i) as u64) {
                j += 1;
            }
        }
        out.push(match j - i {
            0 => items[i].clone(),
            1 => format!("{},{}", items[i], items[j]),
            _ => format!("{}–{}", items[i], items[j]),
        });
        i = j + 1;
    }
    out.join(",")
}

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
