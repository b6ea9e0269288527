//! Where the scatter's corner labels go: beside their marker, clear of every marker and of the
//! labels placed before them, inside the plot. Pure pixel geometry, so it is tested without
//! drawing.

/// A box in pixels: left, top, right, bottom.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Rect {
    pub(super) left: i32,
    pub(super) top: i32,
    pub(super) right: i32,
    pub(super) bottom: i32,
}

impl Rect {
    fn overlaps(&self, o: &Rect) -> bool {
        self.left < o.right && o.left < self.right && self.top < o.bottom && o.top < self.bottom
    }

    fn inside(&self, o: &Rect) -> bool {
        self.left >= o.left && self.right <= o.right && self.top >= o.top && self.bottom <= o.bottom
    }

    /// The square around a marker of radius `r` at `at`.
    pub(super) fn around(at: (i32, i32), r: i32) -> Rect {
        Rect {
            left: at.0 - r,
            top: at.1 - r,
            right: at.0 + r,
            bottom: at.1 + r,
        }
    }
}

/// Pixels between a marker's centre and its label, clear of a hollow predicted marker.
const GAP: i32 = 15;

/// The top-left corner of each label, `None` where no place beside its marker is free. Label
/// `i` of `sizes[i]` (width, height) belongs to the marker at `anchors[i]`; the places tried
/// are above right, below right, above left and below left (left first in the plot's right
/// quarter, where a label would run out of it), the first that stays in `bounds` and overlaps
/// neither a marker in `markers` (radius `r`) nor a label already placed. Labels are placed in
/// the order given, so the more important come first.
pub(super) fn place(
    anchors: &[(i32, i32)],
    sizes: &[(i32, i32)],
    markers: &[(i32, i32)],
    r: i32,
    bounds: Rect,
) -> Vec<Option<(i32, i32)>> {
    let obstacles: Vec<Rect> = markers.iter().map(|&m| Rect::around(m, r)).collect();
    let mut placed: Vec<Rect> = Vec::new();
    let mut out = Vec::with_capacity(anchors.len());
    for (&(x, y), &(w, h)) in anchors.iter().zip(sizes) {
        let right = [(x + GAP, y - GAP - h), (x + GAP, y + GAP)];
        let left = [(x - GAP - w, y - GAP - h), (x - GAP - w, y + GAP)];
        let near_right_edge = x - bounds.left > (bounds.right - bounds.left) * 3 / 4;
        let tries = if near_right_edge {
            [left, right].concat()
        } else {
            [right, left].concat()
        };
        let free = tries.into_iter().find(|&(l, t)| {
            let b = Rect {
                left: l,
                top: t,
                right: l + w,
                bottom: t + h,
            };
            b.inside(&bounds) && !obstacles.iter().chain(&placed).any(|o| o.overlaps(&b))
        });
        if let Some((l, t)) = free {
            placed.push(Rect {
                left: l,
                top: t,
                right: l + w,
                bottom: t + h,
            });
        }
        out.push(free);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Rect = Rect {
        left: 0,
        top: 0,
        right: 800,
        bottom: 600,
    };

    fn boxes(placed: &[Option<(i32, i32)>], sizes: &[(i32, i32)]) -> Vec<Rect> {
        placed
            .iter()
            .zip(sizes)
            .filter_map(|(p, &(w, h))| {
                p.map(|(l, t)| Rect {
                    left: l,
                    top: t,
                    right: l + w,
                    bottom: t + h,
                })
            })
            .collect()
    }

    #[test]
    fn a_lone_label_goes_above_right_of_its_marker() {
        let placed = place(&[(100, 300)], &[(80, 16)], &[(100, 300)], 8, BOUNDS);
        assert_eq!(placed, vec![Some((115, 269))]);
    }

    #[test]
    fn labels_of_markers_close_together_clear_each_other_and_every_marker() {
        // The corners near the origin of a plan's scatter: two markers 25 px apart.
        let anchors = [(148, 560), (124, 590), (700, 100)];
        let sizes = [(110, 16), (85, 16), (120, 16)];
        let placed = place(&anchors, &sizes, &anchors, 11, BOUNDS);
        assert!(placed.iter().all(Option::is_some), "{placed:?}");
        let b = boxes(&placed, &sizes);
        for (i, x) in b.iter().enumerate() {
            for m in &anchors {
                assert!(
                    !x.overlaps(&Rect::around(*m, 11)),
                    "label {i} {x:?} covers the marker at {m:?}"
                );
            }
            for y in &b[i + 1..] {
                assert!(!x.overlaps(y), "{x:?} and {y:?} overlap");
            }
            assert!(x.inside(&BOUNDS));
        }
        // The last marker is in the plot's right quarter: its label reads leftwards.
        assert!(b[2].right <= 700);
    }

    #[test]
    fn a_label_with_no_free_place_is_left_out() {
        // A label as wide as the plot fits on neither side of a marker in its middle.
        let placed = place(&[(400, 300)], &[(790, 16)], &[(400, 300)], 8, BOUNDS);
        assert_eq!(placed, vec![None]);
    }
}
