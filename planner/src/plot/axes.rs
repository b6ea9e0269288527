//! The linear percent axis with ticks chosen here (so every label has the same decimals), its
//! tick labels and the padded range it spans.

use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};

/// A linear axis whose ticks are chosen here rather than by plotters, so that all tick labels
/// can carry the same number of decimals (plotters' own f64 axis would print `1.0%` and
/// `1.5%` next to `2%` with a trimmed formatter, or `7.0%` with a fixed one).
pub(super) struct Axis {
    pub(super) range: std::ops::Range<f64>,
    pub(super) ticks: Vec<f64>,
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
    pub(super) fn nice(range: std::ops::Range<f64>, target: usize) -> (Self, usize) {
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
pub(super) fn pct_label(decimals: usize) -> impl Fn(&f64) -> String {
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
pub(super) fn axis_range(lo: f64, hi: f64, pad: f64, min_span: f64) -> std::ops::Range<f64> {
    let lo = lo.min(0.0);
    let hi = hi.max(0.0).max(lo + min_span);
    let span = hi - lo;
    (lo - pad * span)..(hi + pad * span)
}
