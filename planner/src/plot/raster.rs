//! The PNG backend: plotters' bitmap backend with text set by ab_glyph directly.
//!
//! plotters 0.3.7 draws ab_glyph text dropping each glyph's left side bearing, so a `1` (whose
//! outline starts well right of its origin) is drawn too far left and `13.8` reads `1 3.8`.
//! This wrapper places every glyph at its true bounds; everything else goes to the bitmap
//! backend unchanged. Widths are the sum of advances and kerning, as plotters measures them,
//! so the layout plotters computed still fits.

use ab_glyph::{point, Font, FontRef, PxScale, ScaleFont};
use plotters::backend::{BitMapBackend, DrawingBackend};
use plotters::style::text_anchor::{HPos, VPos};
use plotters_backend::{BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind};

pub(super) struct Raster<'a> {
    pub(super) inner: BitMapBackend<'a>,
    pub(super) font: FontRef<'static>,
}

type Res<'a> = Result<(), DrawingErrorKind<<BitMapBackend<'a> as DrawingBackend>::ErrorType>>;

impl<'a> DrawingBackend for Raster<'a> {
    type ErrorType = <BitMapBackend<'a> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }
    fn ensure_prepared(&mut self) -> Res<'a> {
        self.inner.ensure_prepared()
    }
    fn present(&mut self) -> Res<'a> {
        self.inner.present()
    }
    fn draw_pixel(&mut self, point: BackendCoord, color: BackendColor) -> Res<'a> {
        self.inner.draw_pixel(point, color)
    }
    fn draw_line<S: BackendStyle>(&mut self, from: BackendCoord, to: BackendCoord, style: &S) -> Res<'a> {
        self.inner.draw_line(from, to, style)
    }
    fn draw_rect<S: BackendStyle>(&mut self, ul: BackendCoord, br: BackendCoord, style: &S, fill: bool) -> Res<'a> {
        self.inner.draw_rect(ul, br, style, fill)
    }
    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(&mut self, path: I, style: &S) -> Res<'a> {
        self.inner.draw_path(path, style)
    }
    fn draw_circle<S: BackendStyle>(&mut self, center: BackendCoord, radius: u32, style: &S, fill: bool) -> Res<'a> {
        self.inner.draw_circle(center, radius, style, fill)
    }
    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(&mut self, vert: I, style: &S) -> Res<'a> {
        self.inner.fill_polygon(vert, style)
    }
    fn blit_bitmap(&mut self, pos: BackendCoord, (w, h): (u32, u32), src: &[u8]) -> Res<'a> {
        self.inner.blit_bitmap(pos, (w, h), src)
    }

    fn draw_text<S: BackendTextStyle>(&mut self, text: &str, style: &S, pos: BackendCoord) -> Res<'a> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        // The same scale plotters' ab_glyph layout uses, so measured widths match.
        let scale = PxScale::from(style.size() as f32);
        let font = self.font.as_scaled(scale);
        let (ascent, descent) = (font.ascent(), font.descent());

        // Lay the line out in its own frame: top at y = 0, baseline at y = ascent.
        let mut glyphs = Vec::new();
        let mut caret = 0.0f32;
        let mut prev = None;
        for ch in text.chars() {
            let id = font.glyph_id(ch);
            if let Some(p) = prev {
                caret += font.kern(p, id);
            }
            glyphs.push(id.with_scale_and_position(scale, point(caret, ascent)));
            caret += font.h_advance(id);
            prev = Some(id);
        }
        let (width, height) = (caret.round() as i32, (ascent - descent).round() as i32);
        let dx = match style.anchor().h_pos {
            HPos::Left => 0,
            HPos::Center => -width / 2,
            HPos::Right => -width,
        };
        let dy = match style.anchor().v_pos {
            VPos::Top => 0,
            VPos::Center => -height / 2,
            VPos::Bottom => -height,
        };

        let transform = style.transform();
        let (w, h) = self.get_size();
        let mut result = Ok(());
        for g in glyphs {
            let Some(outline) = self.font.outline_glyph(g) else {
                continue;
            };
            let b = outline.px_bounds();
            outline.draw(|x, y, coverage| {
                if result.is_err() || coverage <= 0.0 {
                    return;
                }
                let (gx, gy) = (b.min.x as i32 + x as i32 + dx, b.min.y as i32 + y as i32 + dy);
                let (tx, ty) = transform.transform(gx, gy);
                let (px, py) = (pos.0 + tx, pos.1 + ty);
                if px >= 0 && py >= 0 && (px as u32) < w && (py as u32) < h {
                    let c = BackendColor {
                        alpha: color.alpha * coverage.min(1.0) as f64,
                        rgb: color.rgb,
                    };
                    result = self.inner.draw_pixel((px, py), c);
                }
            });
        }
        result
    }
}
