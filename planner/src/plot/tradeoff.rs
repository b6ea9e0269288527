//! The trade-off scatter: memory saved against throughput lost per checkpoint subset, with the
//! Pareto front, whiskers and the side legend.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::axes::{axis_range, pct_label, Axis};
use super::data::{PlotMeta, Tradeoff, TradeoffPoint};
use super::draw::{
    draw_whisker, fit_text, font, marker, titled, Shape, BLUE, GREY, GRID, INK, PALETTE, SHAPES, WHISKER_OPACITY,
};
use super::draw::{MARKER_OPACITY, WIDTH};
use super::labels;
use super::render::{DrawResult, Figure};

pub(super) struct Scatter<'a> {
    pub(super) points: &'a [TradeoffPoint],
    pub(super) meta: &'a PlotMeta,
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
        let series = Series::of(self.points);
        let (xr, yr) = series.ranges();
        let x_end = xr.end;
        let mut chart = chart(&plot_area, xr, yr)?;

        let many = self.points.iter().filter(|p| !p.baseline).count() > MAX_LEGEND_ROWS;
        // The front and its labels follow the fuller set: a sweep's measurements, or a
        // profile's predictions (which cover each candidate, where it measured only the ends).
        let front_predicted = series.predicted.len() > series.measured.len();
        let main: &[(usize, Tradeoff)] = if front_predicted {
            &series.predicted
        } else {
            &series.measured
        };
        // The front first, so markers sit on top of it.
        let front = pareto(main);
        draw_front(&mut chart, &front, x_end)?;
        self.draw_points(&mut chart, &series, many)?;
        self.name_corners(&chart, &series, &front)?;

        let front_label = match (front.len() > 1, front_predicted) {
            (false, _) => None,
            (true, false) => Some("best measured saving for a loss"),
            (true, true) => Some("best predicted saving for a loss"),
        };
        self.draw_legend(
            &legend_area,
            many,
            !series.predicted.is_empty(),
            !series.whiskers.is_empty(),
            front_label,
        )
    }
}

/// The scatter's plot area with its percent axes.
type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<Axis, Axis>>;

/// What the scatter draws: each point's measured and predicted position (by point index),
/// and the whiskers through them.
struct Series {
    measured: Vec<(usize, Tradeoff)>,
    predicted: Vec<(usize, Tradeoff)>,
    /// (point, throughput lost range, memory saved).
    whiskers: Vec<(usize, (f64, f64), f64)>,
}

impl Series {
    fn of(points: &[TradeoffPoint]) -> Self {
        let measured: Vec<(usize, Tradeoff)> = points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.measured.map(|t| (i, t)))
            .collect();
        let predicted: Vec<(usize, Tradeoff)> = points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.predicted.map(|t| (i, t)))
            .collect();
        // Whiskers belong to drawn points: a measured range through its measured marker, a
        // predicted range through its predicted one.
        let whiskers: Vec<(usize, (f64, f64), f64)> = measured
            .iter()
            .filter_map(|(i, t)| {
                points[*i]
                    .throughput_lost_range_pct
                    .map(|r| (*i, r, t.memory_saved_pct))
            })
            .chain(
                predicted
                    .iter()
                    .filter_map(|(i, t)| points[*i].predicted_range_pct.map(|r| (*i, r, t.memory_saved_pct))),
            )
            .collect();
        Series {
            measured,
            predicted,
            whiskers,
        }
    }

    /// The axes' ranges: every point and whisker, padded; right and top get extra room for
    /// the Pareto labels.
    fn ranges(&self) -> (Range<f64>, Range<f64>) {
        let all = self.measured.iter().chain(&self.predicted).map(|(_, t)| *t);
        let (mut x0, mut x1, mut y0, mut y1) = (0f64, 0f64, 0f64, 0f64);
        for t in all {
            x0 = x0.min(t.throughput_lost_pct);
            x1 = x1.max(t.throughput_lost_pct);
            y0 = y0.min(t.memory_saved_pct);
            y1 = y1.max(t.memory_saved_pct);
        }
        for (_, (lo, hi), _) in &self.whiskers {
            x0 = x0.min(*lo);
            x1 = x1.max(*hi);
        }
        let xr = axis_range(x0, x1, 0.04, 1.0);
        let yr = axis_range(y0, y1, 0.06, 1.0);
        (
            xr.start..xr.end + 0.08 * (xr.end - xr.start),
            yr.start..yr.end + 0.04 * (yr.end - yr.start),
        )
    }
}

/// The plot area's chart over `xr` × `yr`, its grid, ticks and axis titles drawn.
fn chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    xr: Range<f64>,
    yr: Range<f64>,
) -> Result<Chart<'a, DB>, DrawingAreaErrorKind<DB::ErrorType>> {
    let (x_axis, x_dec) = Axis::nice(xr, 8);
    let (y_axis, y_dec) = Axis::nice(yr, 8);
    let (xfmt, yfmt) = (pct_label(x_dec), pct_label(y_dec));
    let mut chart = ChartBuilder::on(area)
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
    Ok(chart)
}

/// The Pareto front as a dashed staircase: each corner's saving holds until the next corner's
/// loss, the last to the right edge `x_end`.
fn draw_front<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    front: &[(usize, Tradeoff)],
    x_end: f64,
) -> DrawResult<DB> {
    if front.len() <= 1 {
        return Ok(());
    }
    let mut path: Vec<(f64, f64)> = Vec::new();
    for (_, t) in front {
        if let Some(&(_, y)) = path.last() {
            path.push((t.throughput_lost_pct, y));
        }
        path.push((t.throughput_lost_pct, t.memory_saved_pct));
    }
    if let Some(&(_, y)) = path.last() {
        path.push((x_end, y));
    }
    chart.draw_series(DashedLineSeries::new(path, 6, 5, GREY.mix(0.7).stroke_width(2)))?;
    Ok(())
}

impl Scatter<'_> {
    /// Whiskers, then hollow predicted markers, then filled measured ones on top.
    fn draw_points<DB: DrawingBackend>(
        &self,
        chart: &mut Chart<'_, DB>,
        series: &Series,
        many: bool,
    ) -> DrawResult<DB> {
        let r = 7.0;
        for (i, (lo, hi), y) in &series.whiskers {
            let (c, _) = self.style_of(*i, many);
            draw_whisker(chart.plotting_area(), (*lo, *y), (*hi, *y), c.mix(WHISKER_OPACITY))?;
        }
        for (i, t) in &series.predicted {
            let (c, s) = self.style_of(*i, many);
            let at = (t.throughput_lost_pct, t.memory_saved_pct);
            chart
                .plotting_area()
                .draw(&marker(at, s, r + 4.0, c.mix(MARKER_OPACITY).stroke_width(2), true))?;
        }
        for (i, t) in &series.measured {
            let (c, s) = self.style_of(*i, many);
            let at = (t.throughput_lost_pct, t.memory_saved_pct);
            chart
                .plotting_area()
                .draw(&marker(at, s, r, c.mix(MARKER_OPACITY).into(), false))?;
        }
        Ok(())
    }

    /// Names the corners of the front (not the reference point): they are the subsets worth
    /// reading off the plot. Each label goes beside its marker where it covers no marker and
    /// no label before it ([`labels::place`]); one with no such place is left out.
    fn name_corners<DB: DrawingBackend>(
        &self,
        chart: &Chart<'_, DB>,
        series: &Series,
        front: &[(usize, Tradeoff)],
    ) -> DrawResult<DB> {
        let style = font(15.0);
        let area = chart.plotting_area();
        let pixel = |t: &Tradeoff| chart.backend_coord(&(t.throughput_lost_pct, t.memory_saved_pct));
        let named: Vec<&(usize, Tradeoff)> = front.iter().filter(|(i, _)| !self.points[*i].baseline).collect();
        let anchors: Vec<(i32, i32)> = named.iter().map(|(_, t)| pixel(t)).collect();
        let sizes: Vec<(i32, i32)> = named
            .iter()
            .map(|(i, _)| {
                let (w, h) = area
                    .estimate_text_size(&self.points[*i].label, &style)
                    .unwrap_or((0, 0));
                (w as i32, h as i32)
            })
            .collect();
        let markers: Vec<(i32, i32)> = series
            .measured
            .iter()
            .chain(&series.predicted)
            .map(|(_, t)| pixel(t))
            .collect();
        let (xs, ys) = area.get_pixel_range();
        let bounds = labels::Rect {
            left: xs.start,
            top: ys.start,
            right: xs.end,
            bottom: ys.end,
        };
        // The largest marker drawn: a hollow predicted one, radius 11 and its stroke.
        let placed = labels::place(&anchors, &sizes, &markers, 12, bounds);
        for (((i, t), (x, y)), at) in named.iter().zip(&anchors).zip(placed) {
            let Some((left, top)) = at else { continue };
            area.draw(
                &(EmptyElement::at((t.throughput_lost_pct, t.memory_saved_pct))
                    + Text::new(
                        self.points[*i].label.clone(),
                        (left - x, top - y),
                        style.pos(Pos::new(HPos::Left, VPos::Top)),
                    )),
            )?;
        }
        Ok(())
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
        if self.points.iter().any(|p| p.measured.is_some()) {
            area.draw(&marker((18, y), Shape::Circle, 7.0, GREY.into(), false))?;
            area.draw(&Text::new("filled: measured", (36, y), text.clone()))?;
            y += row;
        }
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
