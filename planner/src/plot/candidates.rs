//! The per-candidate chart: for each candidate block, the memory its checkpointing saves and the
//! recompute time it costs, as paired horizontal bars.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use ckptune_solver::budget::format_size;

use super::axes::{pct_label, Axis};
use super::data::{CandidateBar, CandidateBasis, PlotMeta};
use super::draw::WIDTH;
use super::draw::{draw_whisker, font, titled, BLUE, GREY, GRID, INK, VERMILLION, WHISKER_OPACITY};
use super::render::{DrawResult, Figure};

pub(super) struct Candidates<'a> {
    pub(super) bars: &'a [CandidateBar],
    pub(super) basis: CandidateBasis,
    pub(super) meta: &'a PlotMeta,
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
            CandidateBasis::Estimated => (
                "what checkpointing each candidate frees and costs (time predicted)",
                "activation memory freed (% of the peak with nothing checkpointed)",
                "recompute time, predicted (% of the predicted step with nothing checkpointed)",
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
