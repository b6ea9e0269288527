//! Trade-off plots: memory saved against throughput lost per checkpoint subset, and what
//! checkpointing each candidate block saves and costs. Plain structs in, SVG + PNG files out;
//! no libtorch and no JSON (the `plot` command turns profiles and sweeps into these structs).
//!
//! Text is set in DejaVu Sans, embedded in the binary (`planner/assets/`), so a PNG renders the
//! same on a machine without fonts; the SVG names the same font and falls back to sans-serif.
//! Colours are Okabe–Ito, which stays distinguishable under the common colour-vision
//! deficiencies; where a plot has more subsets than colours, the marker shape varies too.

use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

mod raster;

use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::budget::format_size;
use crate::formats::{self, FormatError};
use raster::Raster;

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
static FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

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
            .chain(p.throughput_lost_range_pct.into_iter().flat_map(|(a, b)| [a, b]));
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

// ---------------------------------------------------------------------------------------------
// Rendering: each figure draws itself on any plotters backend; `write_figure` runs it twice.

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

trait Figure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB>;
}

/// Registers the embedded font once per process (plotters keeps a global font table).
fn register_font() -> Result<(), PlotError> {
    static LOADED: OnceLock<bool> = OnceLock::new();
    let ok = *LOADED.get_or_init(|| plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES).is_ok());
    if ok {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}

fn write_figure(fig: &impl Figure, svg_path: &Path, png_path: &Path) -> Result<(), PlotError> {
    register_font()?;
    let derr = |path: &Path, e: &dyn fmt::Display| PlotError::Draw {
        path: path.display().to_string(),
        message: e.to_string(),
    };

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        fig.draw(&root).map_err(|e| derr(svg_path, &e))?;
        root.present().map_err(|e| derr(svg_path, &e))?;
    }

    let mut rgb = vec![0u8; WIDTH as usize * HEIGHT as usize * 3];
    {
        let font = ab_glyph::FontRef::try_from_slice(FONT_BYTES).map_err(|_| PlotError::Font)?;
        let inner = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT));
        let root = Raster { inner, font }.into_drawing_area();
        fig.draw(&root).map_err(|e| derr(png_path, &e))?;
        root.present().map_err(|e| derr(png_path, &e))?;
    }
    let png = encode_png(&rgb).map_err(|e| PlotError::Png {
        path: png_path.display().to_string(),
        message: e.to_string(),
    })?;

    formats::write_bytes_atomic(svg_path, svg.as_bytes())?;
    formats::write_bytes_atomic(png_path, &png)?;
    Ok(())
}

fn encode_png(rgb: &[u8]) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, WIDTH, HEIGHT);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header()?;
    w.write_image_data(rgb)?;
    w.finish()?;
    Ok(out)
}

// Okabe & Ito (2008), "Color Universal Design". Black is kept for the reference point and
// yellow left out: it is too faint for a small marker on white.
const BLUE: RGBColor = RGBColor(0x00, 0x72, 0xB2);
const VERMILLION: RGBColor = RGBColor(0xD5, 0x5E, 0x00);
const GREEN: RGBColor = RGBColor(0x00, 0x9E, 0x73);
const PURPLE: RGBColor = RGBColor(0xCC, 0x79, 0xA7);
const ORANGE: RGBColor = RGBColor(0xE6, 0x9F, 0x00);
const SKY: RGBColor = RGBColor(0x56, 0xB4, 0xE9);
const INK: RGBColor = RGBColor(0x00, 0x00, 0x00);
const PALETTE: [RGBColor; 6] = [BLUE, VERMILLION, GREEN, PURPLE, ORANGE, SKY];
const GREY: RGBColor = RGBColor(0x60, 0x60, 0x60);
const GRID: RGBColor = RGBColor(0xDD, 0xDD, 0xDD);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Hexagon,
}
const SHAPES: [Shape; 6] = [
    Shape::Circle,
    Shape::Square,
    Shape::TriangleUp,
    Shape::Diamond,
    Shape::TriangleDown,
    Shape::Hexagon,
];

/// Vertices of a marker of about equal visual weight for every shape, around (0, 0).
fn marker_vertices(shape: Shape, r: f64) -> Vec<(i32, i32)> {
    let regular = |n: usize, radius: f64, phase_deg: f64| -> Vec<(i32, i32)> {
        (0..n)
            .map(|k| {
                let a = (phase_deg + 360.0 * k as f64 / n as f64).to_radians();
                ((radius * a.cos()).round() as i32, (radius * a.sin()).round() as i32)
            })
            .collect()
    };
    match shape {
        Shape::Circle => regular(24, r, 0.0),
        // Polygons with fewer corners get a larger radius, so that all shapes look as heavy.
        Shape::Square => regular(4, r * 1.2, 45.0),
        Shape::TriangleUp => regular(3, r * 1.35, -90.0),
        Shape::Diamond => regular(4, r * 1.3, 0.0),
        Shape::TriangleDown => regular(3, r * 1.35, 90.0),
        Shape::Hexagon => regular(6, r * 1.1, 0.0),
    }
}

/// A marker centred on `at` (in the coordinates of the area it is drawn on): filled, or an
/// outline in `style`'s width.
fn marker<'a, C, DB>(at: C, shape: Shape, r: f64, style: ShapeStyle, hollow: bool) -> DynElement<'a, DB, C>
where
    C: Clone + 'a,
    DB: DrawingBackend + 'a,
{
    let v = marker_vertices(shape, r);
    if hollow {
        let mut closed = v.clone();
        closed.push(v[0]);
        (EmptyElement::at(at) + PathElement::new(closed, style)).into_dyn()
    } else {
        (EmptyElement::at(at) + Polygon::new(v, style.filled())).into_dyn()
    }
}

fn font(size: f64) -> TextStyle<'static> {
    TextStyle::from((FONT, size).into_font()).color(&INK)
}

/// A linear axis whose ticks are chosen here rather than by plotters, so that all tick labels
/// can carry the same number of decimals (plotters' own f64 axis would print `1.0%` and
/// `1.5%` next to `2%` with a trimmed formatter, or `7.0%` with a fixed one).
struct Axis {
    range: std::ops::Range<f64>,
    ticks: Vec<f64>,
}

impl Ranged for Axis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let span = self.range.end - self.range.start;
        let f = if span > 0.0 { (v - self.range.start) / span } else { 0.5 };
        limit.0 + ((limit.1 - limit.0) as f64 * f).round() as i32
    }
    fn key_points<H: KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        self.ticks.clone()
    }
    fn range(&self) -> std::ops::Range<f64> {
        self.range.clone()
    }
}

impl ValueFormatter<f64> for Axis {
    fn format(v: &f64) -> String {
        format!("{v}")
    }
}

impl Axis {
    /// About `target` ticks at multiples of 1, 2 or 5 × 10^k inside `range`, and the decimals
    /// that step needs.
    fn nice(range: std::ops::Range<f64>, target: usize) -> (Self, usize) {
        let span = (range.end - range.start).max(f64::MIN_POSITIVE);
        let raw = span / target.max(1) as f64;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * mag)
            .find(|s| *s >= raw * (1.0 - 1e-9))
            .unwrap_or(10.0 * mag);
        let decimals = (-(step.log10() + 1e-9).floor()).max(0.0) as usize;
        let first = (range.start / step).ceil() as i64;
        let last = (range.end / step).floor() as i64;
        let ticks = (first..=last).map(|k| k as f64 * step).collect();
        (Self { range, ticks }, decimals)
    }
}

/// Tick labels in percent with a fixed number of decimals.
fn pct_label(decimals: usize) -> impl Fn(&f64) -> String {
    move |v: &f64| {
        // Avoid "-0%" from a tick that is zero up to rounding.
        let v = if v.abs() < 0.5 * 10f64.powi(-(decimals as i32)) {
            0.0
        } else {
            *v
        };
        format!("{v:.decimals$}%")
    }
}

/// An axis range that contains `lo..hi` and 0, with `pad` of the span around, so markers on
/// the extremes (the reference point sits at 0, 0) are not cut by the frame.
fn axis_range(lo: f64, hi: f64, pad: f64, min_span: f64) -> std::ops::Range<f64> {
    let lo = lo.min(0.0);
    let hi = hi.max(0.0).max(lo + min_span);
    let span = hi - lo;
    (lo - pad * span)..(hi + pad * span)
}

/// Cuts `text` with an ellipsis until it fits `max_px` in `style`.
fn fit_text<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    text: &str,
    style: &TextStyle<'_>,
    max_px: u32,
) -> String {
    let width = |s: &str| area.estimate_text_size(s, style).map(|(w, _)| w).unwrap_or(0);
    if width(text) <= max_px {
        return text.to_owned();
    }
    let mut chars: Vec<char> = text.chars().collect();
    while !chars.is_empty() {
        chars.pop();
        let s: String = chars.iter().collect::<String>() + "…";
        if width(&s) <= max_px {
            return s;
        }
    }
    "…".into()
}

/// Title and subtitle across the top; returns the area below them.
fn titled<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    subtitle: &str,
) -> Result<DrawingArea<DB, Shift>, DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let (head, body) = root.split_vertically(78);
    let (w, _) = head.dim_in_pixel();
    let centre = Pos::new(HPos::Center, VPos::Top);
    head.draw(&Text::new(title.to_owned(), (w as i32 / 2, 14), font(26.0).pos(centre)))?;
    head.draw(&Text::new(
        subtitle.to_owned(),
        (w as i32 / 2, 48),
        font(17.0).color(&GREY).pos(centre),
    ))?;
    Ok(body)
}

struct Scatter<'a> {
    points: &'a [TradeoffPoint],
    meta: &'a PlotMeta,
}

/// Legend rows the scatter's side panel holds; beyond that, subsets share one style and only
/// the Pareto corners are named (a legend of 64 look-alike swatches would help nobody).
const MAX_LEGEND_ROWS: usize = 24;

impl Scatter<'_> {
    /// Colour and shape of point `i`: the reference point black, the others cycling through
    /// the palette, then through shapes.
    fn style_of(&self, i: usize, many: bool) -> (RGBColor, Shape) {
        if self.points[i].baseline {
            return (INK, Shape::Circle);
        }
        if many {
            return (BLUE, Shape::Circle);
        }
        let k = self.points[..i].iter().filter(|p| !p.baseline).count();
        (PALETTE[k % PALETTE.len()], SHAPES[(k / PALETTE.len()) % SHAPES.len()])
    }
}

/// Opacity of whiskers: visible, but quieter than the markers they belong to.
const WHISKER_OPACITY: f64 = 0.6;

/// A horizontal whisker from `from` to `to` with short end caps, in any coordinate system.
fn draw_whisker<DB: DrawingBackend, CT: CoordTranslate>(
    area: &DrawingArea<DB, CT>,
    from: CT::From,
    to: CT::From,
    color: RGBAColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    CT::From: Clone + 'static,
{
    let style = color.stroke_width(1);
    area.draw(&PathElement::new(vec![from.clone(), to.clone()], style))?;
    for end in [from, to] {
        area.draw(&(EmptyElement::at(end) + PathElement::new(vec![(0, -4), (0, 4)], style)))?;
    }
    Ok(())
}

/// The corners of the best saving reachable for at most a given loss: the points no other
/// point beats on both axes, by increasing loss (and so increasing saving).
fn pareto(points: &[(usize, Tradeoff)]) -> Vec<(usize, Tradeoff)> {
    let mut order: Vec<&(usize, Tradeoff)> = points.iter().collect();
    order.sort_by(|a, b| {
        a.1.throughput_lost_pct
            .total_cmp(&b.1.throughput_lost_pct)
            .then(b.1.memory_saved_pct.total_cmp(&a.1.memory_saved_pct))
    });
    let mut best = f64::NEG_INFINITY;
    let mut front = Vec::new();
    for &(i, t) in order {
        if t.memory_saved_pct > best + 1e-9 {
            best = t.memory_saved_pct;
            front.push((i, t));
        }
    }
    front
}

impl Figure for Scatter<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let m = self.meta;
        let body = titled(
            root,
            &format!(
                "{}: memory saved vs. throughput lost by activation checkpointing",
                m.model
            ),
            &format!("{} — {}", m.config_line(), m.source),
        )?;
        let (plot_area, legend_area) = body.split_horizontally(WIDTH as i32 - 300);

        let measured: Vec<(usize, Tradeoff)> = self
            .points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.measured.map(|t| (i, t)))
            .collect();
        let predicted: Vec<(usize, Tradeoff)> = self
            .points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.predicted.map(|t| (i, t)))
            .collect();
        // Whiskers belong to measured points; only those are drawn, so only those count.
        let whiskers: Vec<(usize, (f64, f64), f64)> = measured
            .iter()
            .filter_map(|(i, t)| {
                self.points[*i]
                    .throughput_lost_range_pct
                    .map(|r| (*i, r, t.memory_saved_pct))
            })
            .collect();
        let all = measured.iter().chain(&predicted).map(|(_, t)| *t);
        let (mut x0, mut x1, mut y0, mut y1) = (0f64, 0f64, 0f64, 0f64);
        for t in all {
            x0 = x0.min(t.throughput_lost_pct);
            x1 = x1.max(t.throughput_lost_pct);
            y0 = y0.min(t.memory_saved_pct);
            y1 = y1.max(t.memory_saved_pct);
        }
        for (_, (lo, hi), _) in &whiskers {
            x0 = x0.min(*lo);
            x1 = x1.max(*hi);
        }
        // Right and top get extra room for the Pareto labels.
        let xr = axis_range(x0, x1, 0.04, 1.0);
        let yr = axis_range(y0, y1, 0.06, 1.0);
        let (xr, yr) = (
            xr.start..xr.end + 0.08 * (xr.end - xr.start),
            yr.start..yr.end + 0.04 * (yr.end - yr.start),
        );
        let (x_axis, x_dec) = Axis::nice(xr.clone(), 8);
        let (y_axis, y_dec) = Axis::nice(yr.clone(), 8);
        let (xfmt, yfmt) = (pct_label(x_dec), pct_label(y_dec));

        let mut chart = ChartBuilder::on(&plot_area)
            .margin_left(12)
            .margin_right(24)
            .margin_top(10)
            .margin_bottom(8)
            .x_label_area_size(64)
            .y_label_area_size(84)
            .build_cartesian_2d(x_axis, y_axis)?;
        chart
            .configure_mesh()
            .x_desc("throughput lost (% of the step rate with nothing checkpointed)")
            .y_desc("memory saved (% of the peak with nothing checkpointed)")
            .x_label_formatter(&xfmt)
            .y_label_formatter(&yfmt)
            .label_style(font(16.0))
            .axis_desc_style(font(18.0))
            .bold_line_style(GRID.stroke_width(1))
            .light_line_style(WHITE.mix(0.0))
            .axis_style(GREY.stroke_width(1))
            .draw()?;

        let many = self.points.iter().filter(|p| !p.baseline).count() > MAX_LEGEND_ROWS;
        let r = 7.0;
        // The front and its labels follow the fuller set: a sweep's measurements, or a
        // profile's predictions (which cover each candidate, where it measured only the ends).
        let front_predicted = predicted.len() > measured.len();
        let main: &[(usize, Tradeoff)] = if front_predicted { &predicted } else { &measured };

        // The front first, so markers sit on top of it.
        let front = pareto(main);
        if front.len() > 1 {
            // A staircase: each corner's saving holds until the next corner's loss.
            let mut path: Vec<(f64, f64)> = Vec::new();
            for (_, t) in &front {
                if let Some(&(_, y)) = path.last() {
                    path.push((t.throughput_lost_pct, y));
                }
                path.push((t.throughput_lost_pct, t.memory_saved_pct));
            }
            if let Some(&(_, y)) = path.last() {
                path.push((xr.end, y));
            }
            chart.draw_series(DashedLineSeries::new(path, 6, 5, GREY.mix(0.7).stroke_width(2)))?;
        }

        for (i, (lo, hi), y) in &whiskers {
            let (c, _) = self.style_of(*i, many);
            draw_whisker(chart.plotting_area(), (*lo, *y), (*hi, *y), c.mix(WHISKER_OPACITY))?;
        }
        for (i, t) in &predicted {
            let (c, s) = self.style_of(*i, many);
            let at = (t.throughput_lost_pct, t.memory_saved_pct);
            chart
                .plotting_area()
                .draw(&marker(at, s, r + 4.0, c.mix(MARKER_OPACITY).stroke_width(2), true))?;
        }
        for (i, t) in &measured {
            let (c, s) = self.style_of(*i, many);
            let at = (t.throughput_lost_pct, t.memory_saved_pct);
            chart
                .plotting_area()
                .draw(&marker(at, s, r, c.mix(MARKER_OPACITY).into(), false))?;
        }

        // Name the corners of the front (not the reference point): they are the subsets worth
        // reading off the plot. Labels go right of the marker, or left near the right edge.
        let label_style = font(15.0);
        let plot_w = chart.plotting_area().dim_in_pixel().0 as i32;
        for (i, t) in front.iter().filter(|(i, _)| !self.points[*i].baseline) {
            let at = (t.throughput_lost_pct, t.memory_saved_pct);
            let (px, _) = chart.backend_coord(&at);
            let left_of_edge = px - plot_area.get_base_pixel().0 > plot_w * 3 / 4;
            // Clear of the marker, hollow predicted ones (radius r + 4) included.
            let (dx, anchor) = if left_of_edge {
                (-15, HPos::Right)
            } else {
                (15, HPos::Left)
            };
            chart.plotting_area().draw(
                &(EmptyElement::at(at)
                    + Text::new(
                        self.points[*i].label.clone(),
                        (dx, -13),
                        label_style.pos(Pos::new(anchor, VPos::Bottom)),
                    )),
            )?;
        }

        let front_label = match (front.len() > 1, front_predicted) {
            (false, _) => None,
            (true, false) => Some("best measured saving for a loss"),
            (true, true) => Some("best predicted saving for a loss"),
        };
        self.draw_legend(
            &legend_area,
            many,
            !predicted.is_empty(),
            !whiskers.is_empty(),
            front_label,
        )
    }
}

impl Scatter<'_> {
    fn draw_legend<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        many: bool,
        any_predicted: bool,
        any_whisker: bool,
        front: Option<&str>,
    ) -> DrawResult<DB> {
        let (w, _) = area.dim_in_pixel();
        let text = font(15.0).pos(Pos::new(HPos::Left, VPos::Center));
        let head = font(16.0).pos(Pos::new(HPos::Left, VPos::Center));
        let row = 25;
        let mut y = 24;
        area.draw(&Text::new("checkpointed", (8, y), head.clone()))?;
        y += row;
        let text_w = w.saturating_sub(44);
        let mut entries: Vec<usize> = Vec::new();
        if many {
            entries.extend(self.points.iter().position(|p| p.baseline));
        } else {
            entries.extend(0..self.points.len());
        }
        for i in entries {
            let (c, s) = self.style_of(i, many);
            area.draw(&marker((18, y), s, 7.0, c.into(), false))?;
            area.draw(&Text::new(
                fit_text(area, &self.points[i].label, &text, text_w),
                (36, y),
                text.clone(),
            ))?;
            y += row;
        }
        if many {
            let n = self.points.iter().filter(|p| !p.baseline).count();
            let (c, s) = self.style_of(self.points.iter().position(|p| !p.baseline).unwrap_or(0), true);
            area.draw(&marker((18, y), s, 7.0, c.into(), false))?;
            area.draw(&Text::new(
                format!("{n} subsets; front corners named"),
                (36, y),
                text.clone(),
            ))?;
            y += row;
        }
        y += row / 2;
        area.draw(&marker((18, y), Shape::Circle, 7.0, GREY.into(), false))?;
        area.draw(&Text::new("filled: measured", (36, y), text.clone()))?;
        y += row;
        if any_predicted {
            area.draw(&marker((18, y), Shape::Circle, 11.0, GREY.stroke_width(2), true))?;
            area.draw(&Text::new("hollow: predicted from profile", (36, y), text.clone()))?;
            y += row;
        }
        if any_whisker {
            draw_whisker(area, (6, y), (30, y), GREY.into())?;
            area.draw(&Text::new("fastest to slowest timed step", (36, y), text.clone()))?;
            y += row;
        }
        if let Some(label) = front {
            area.draw(&PathElement::new(vec![(4, y), (12, y)], GREY.stroke_width(2)))?;
            area.draw(&PathElement::new(vec![(20, y), (28, y)], GREY.stroke_width(2)))?;
            area.draw(&Text::new(label, (36, y), text.clone()))?;
        }
        Ok(())
    }
}

struct Candidates<'a> {
    bars: &'a [CandidateBar],
    basis: CandidateBasis,
    meta: &'a PlotMeta,
}

impl Figure for Candidates<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let m = self.meta;
        let (what, saved_desc, cost_desc) = match self.basis {
            CandidateBasis::Measured => (
                "each candidate checkpointed alone (measured)",
                "peak memory saved (% of the peak with nothing checkpointed)",
                "step time added (% of the step with nothing checkpointed)",
            ),
            CandidateBasis::Profiled => (
                "what checkpointing each candidate frees and costs (profiled)",
                "activation memory freed (% of the peak with nothing checkpointed)",
                "recompute time (% of the step with nothing checkpointed)",
            ),
        };
        let body = titled(
            root,
            &format!("{}: {what}", m.model),
            &format!("{} — {}", m.config_line(), m.source),
        )?;
        let (legend_strip, plot_area) = body.split_vertically(40);

        // The legend has its own strip above the bars, so it never covers one.
        let text = font(16.0).pos(Pos::new(HPos::Left, VPos::Center));
        let widths: Vec<i32> = [saved_desc, cost_desc]
            .iter()
            .map(|l| {
                legend_strip
                    .estimate_text_size(l, &text)
                    .map(|(w, _)| w as i32)
                    .unwrap_or(400)
            })
            .collect();
        let total = widths.iter().map(|w| w + 30).sum::<i32>() + 40;
        let mut x = ((WIDTH as i32 - total) / 2).max(8);
        for ((c, label), w) in [(BLUE, saved_desc), (VERMILLION, cost_desc)].into_iter().zip(widths) {
            legend_strip.draw(&Rectangle::new([(x, 12), (x + 22, 28)], c.filled()))?;
            legend_strip.draw(&Text::new(label, (x + 30, 20), text.clone()))?;
            x += 30 + w + 40;
        }

        let n = self.bars.len();
        let values = |b: &CandidateBar| {
            let (lo, hi) = b.cost_range_pct.unwrap_or((b.cost_pct, b.cost_pct));
            [b.saved_pct, b.cost_pct, lo, hi]
        };
        let lo = self.bars.iter().flat_map(values).fold(0.0, f64::min);
        let hi = self.bars.iter().flat_map(values).fold(0.0, f64::max);
        // Room on the right for the value printed at the end of the longest bar.
        let span = (hi - lo).max(1.0);
        let xr = (lo - if lo < 0.0 { 0.05 * span } else { 0.0 })..(hi + 0.32 * span);
        let (x_axis, x_dec) = Axis::nice(xr, 8);
        let xfmt = pct_label(x_dec);
        // Rows top to bottom in chain order: row i spans n-i-1..n-i, its name at the centre.
        let rows = Axis {
            range: 0.0..n as f64,
            ticks: (0..n).map(|i| i as f64 + 0.5).collect(),
        };
        let row_of = |v: f64| n as f64 - 0.5 - v;
        let names: Vec<&str> = self.bars.iter().map(|b| b.block.as_str()).collect();
        let yfmt = |v: &f64| {
            let i = row_of(*v).round();
            if i >= 0.0 && (i as usize) < n {
                names[i as usize].to_owned()
            } else {
                String::new()
            }
        };
        let label_style = font(if n > 24 { 12.0 } else { 16.0 });
        let label_w = names
            .iter()
            .filter_map(|s| plot_area.estimate_text_size(s, &label_style).ok())
            .map(|(w, _)| w)
            .max()
            .unwrap_or(60);

        let mut chart = ChartBuilder::on(&plot_area)
            .margin_left(12)
            .margin_right(28)
            .margin_top(8)
            .margin_bottom(8)
            .x_label_area_size(64)
            .y_label_area_size(label_w + 24)
            .build_cartesian_2d(x_axis, rows)?;
        chart
            .configure_mesh()
            .x_desc(if self.bars.iter().any(|b| b.cost_range_pct.is_some()) {
                "percent of the run with nothing checkpointed (whiskers: fastest to slowest timed step)"
            } else {
                "percent of the run with nothing checkpointed"
            })
            .x_label_formatter(&xfmt)
            .y_label_formatter(&yfmt)
            .x_label_style(font(16.0))
            .y_label_style(label_style)
            .axis_desc_style(font(18.0))
            .bold_line_style(GRID.stroke_width(1))
            .light_line_style(WHITE.mix(0.0))
            .axis_style(GREY.stroke_width(1))
            .disable_y_mesh()
            .draw()?;

        // Two bars per row, saving above cost, each at most 36 px thick so that a chart of
        // three candidates does not look like a wall; values at the bar ends when readable.
        let row_px = chart.plotting_area().dim_in_pixel().1 as f64 / n as f64;
        let thick = (0.38f64).min(36.0 / row_px);
        let gap = 0.03;
        let value_font = (thick * row_px * 0.75).min(15.0);
        let value_style = font(value_font).pos(Pos::new(HPos::Left, VPos::Center));
        for (i, b) in self.bars.iter().enumerate() {
            let mid = n as f64 - i as f64 - 0.5;
            let (saved_y, cost_y) = ((mid + gap)..(mid + gap + thick), (mid - gap - thick)..(mid - gap));
            chart.draw_series([
                Rectangle::new([(0.0, saved_y.end), (b.saved_pct, saved_y.start)], BLUE.filled()),
                Rectangle::new([(0.0, cost_y.end), (b.cost_pct, cost_y.start)], VERMILLION.filled()),
            ])?;
            if let Some((lo, hi)) = b.cost_range_pct {
                let y = (cost_y.start + cost_y.end) / 2.0;
                draw_whisker(chart.plotting_area(), (lo, y), (hi, y), INK.mix(WHISKER_OPACITY))?;
            }
            if value_font >= 10.0 {
                let saved = format!("{:.1}% ({})", b.saved_pct, signed_size(b.saved_bytes));
                let cost = format!("{:.1}% ({:.1} ms)", b.cost_pct, b.cost_seconds * 1e3);
                // Past the whisker too, so the text never sits on it.
                let cost_end = b.cost_range_pct.map_or(b.cost_pct, |r| r.1.max(b.cost_pct));
                for (v, y, s) in [(b.saved_pct, saved_y, saved), (cost_end, cost_y, cost)] {
                    let at = (v.max(0.0), (y.start + y.end) / 2.0);
                    chart
                        .plotting_area()
                        .draw(&(EmptyElement::at(at) + Text::new(s, (6, 0), value_style.clone())))?;
                }
            }
        }
        Ok(())
    }
}

/// A byte count that may be negative (a measured "saving" that made the peak larger).
fn signed_size(bytes: i64) -> String {
    if bytes < 0 {
        format!("−{}", format_size(bytes.unsigned_abs()))
    } else {
        format_size(bytes as u64)
    }
}
