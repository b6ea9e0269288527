//! Shared drawing helpers: the Okabe–Ito palette, marker shapes, the text style, titles,
//! whiskers and text cut to fit.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Size of every figure in pixels (the SVG's size in user units, the PNG's exactly).
pub const WIDTH: u32 = 1200;
pub const HEIGHT: u32 = 800;

/// Opacity of the markers drawn in a plot area, and of nothing else in a figure (legend
/// swatches are opaque): the tests count points in the SVG by it.
pub const MARKER_OPACITY: f64 = 0.85;

/// The font family name the embedded font is registered under. Written verbatim into the SVG
/// as a CSS font list, so an SVG viewer uses DejaVu Sans where it has it (the layout was
/// measured with it) and its own sans-serif otherwise.
pub(super) const FONT: &str = "DejaVu Sans, sans-serif";
pub(super) static FONT_BYTES: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

// Okabe & Ito (2008), "Color Universal Design". Black is kept for the reference point and
// yellow left out: it is too faint for a small marker on white.
pub(super) const BLUE: RGBColor = RGBColor(0x00, 0x72, 0xB2);
pub(super) const VERMILLION: RGBColor = RGBColor(0xD5, 0x5E, 0x00);
const GREEN: RGBColor = RGBColor(0x00, 0x9E, 0x73);
const PURPLE: RGBColor = RGBColor(0xCC, 0x79, 0xA7);
const ORANGE: RGBColor = RGBColor(0xE6, 0x9F, 0x00);
const SKY: RGBColor = RGBColor(0x56, 0xB4, 0xE9);
pub(super) const INK: RGBColor = RGBColor(0x00, 0x00, 0x00);
pub(super) const PALETTE: [RGBColor; 6] = [BLUE, VERMILLION, GREEN, PURPLE, ORANGE, SKY];
pub(super) const GREY: RGBColor = RGBColor(0x60, 0x60, 0x60);
pub(super) const GRID: RGBColor = RGBColor(0xDD, 0xDD, 0xDD);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Hexagon,
}
pub(super) const SHAPES: [Shape; 6] = [
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
pub(super) fn marker<'a, C, DB>(at: C, shape: Shape, r: f64, style: ShapeStyle, hollow: bool) -> DynElement<'a, DB, C>
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

pub(super) fn font(size: f64) -> TextStyle<'static> {
    TextStyle::from((FONT, size).into_font()).color(&INK)
}

/// Cuts `text` with an ellipsis until it fits `max_px` in `style`.
pub(super) fn fit_text<DB: DrawingBackend>(
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
pub(super) fn titled<DB: DrawingBackend>(
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

/// Opacity of whiskers: visible, but quieter than the markers they belong to.
pub const WHISKER_OPACITY: f64 = 0.6;

/// A horizontal whisker from `from` to `to` with short end caps, in any coordinate system.
pub(super) fn draw_whisker<DB: DrawingBackend, CT: CoordTranslate>(
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
