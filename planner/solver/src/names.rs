//! The module names closest to one a user wrote, for errors that refuse a name or a regex
//! (`layer5` → `layer4`, `encoder\.layer\.12` → `encoder.layer.1`, …), as the Python
//! companion's `difflib.get_close_matches` suggests them.

/// Up to `n` of `names` most like `wanted`, best first, each at least 60% alike (difflib's
/// default cutoff). `wanted` may be a regex: its anchors, groups and escapes are dropped first,
/// so `^(?:encoder\.layer\.12)$` is compared as `encoder.layer.12`.
pub fn closest<'a>(wanted: &str, names: &'a [String], n: usize) -> Vec<&'a str> {
    let text = literal_text(wanted);
    let mut scored: Vec<(f64, usize)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| (similarity(&text, name), i))
        .filter(|&(s, _)| s >= 0.6)
        .collect();
    // Most alike first; equally alike names keep the model's order.
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    scored.into_iter().take(n).map(|(_, i)| names[i].as_str()).collect()
}

/// `regex` without the syntax a name never contains: `^`, `$`, `(?:`, `(`, `)` and the
/// backslash of an escape (`\.` is `.`).
fn literal_text(regex: &str) -> String {
    let body = regex.replace("(?:", "");
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        match c {
            '^' | '$' | '(' | ')' => {}
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

/// 1 − edit distance / the longer length: 1 for equal strings, 0 for nothing in common.
fn similarity(a: &str, b: &str) -> f64 {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let longer = a.len().max(b.len());
    if longer == 0 {
        return 1.0;
    }
    1.0 - levenshtein(&a, &b) as f64 / longer as f64
}

/// Insertions, deletions and substitutions turning `a` into `b` (one row of the table at a time).
fn levenshtein(a: &[char], b: &[char]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn edit_distance_against_hand_counts() {
        let d = |a: &str, b: &str| levenshtein(&a.chars().collect::<Vec<_>>(), &b.chars().collect::<Vec<_>>());
        assert_eq!(d("", ""), 0);
        assert_eq!(d("abc", ""), 3);
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("layer5", "layer4"), 1);
        assert_eq!(d("flaw", "lawn"), 2);
    }

    #[test]
    fn suggests_the_names_a_typo_came_from() {
        let model = names(&["conv1", "layer1", "layer2", "layer3", "layer4", "fc"]);
        assert_eq!(closest("layer5", &model, 3), ["layer1", "layer2", "layer3"]);
        assert_eq!(closest("^(?:layer4)$", &model, 3), ["layer4", "layer1", "layer2"]);
        assert!(closest("^nomatch$", &model, 3).is_empty());
        let bert = names(&["encoder.layer.0", "encoder.layer.1", "encoder.layer.11"]);
        assert_eq!(closest(r"encoder\.layer\.12", &bert, 1), ["encoder.layer.1"]);
    }
}
