//! Rendering: each figure draws itself on any plotters backend; `write_figure` runs it twice,
//! into an SVG string and into an RGB bitmap it encodes as PNG, then writes both files.

use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use ckptune_solver::formats;

use ckptune_solver::formats::FormatError;

use super::draw::{FONT, FONT_BYTES, HEIGHT, WIDTH};
use super::raster::Raster;

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

pub(super) type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

pub(super) trait Figure {
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

pub(super) fn write_figure(fig: &impl Figure, svg_path: &Path, png_path: &Path) -> Result<(), PlotError> {
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
