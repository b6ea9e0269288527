//! The checkpoint regex: one pattern that selects exactly the chosen modules among a
//! model's qualified module names, read the same way by Rust's `regex` and Python's `re`.
//!
//! The pattern is `^(?:alt|alt|…)$` where each alternative is an escaped literal name, or
//! a literal parent followed by a group of literal children (`^encoder\.layer\.(?:0|1)$`),
//! which is shorter and still exact: with no wildcard anywhere and both ends anchored it
//! matches a name only if the name is spelled out. The anchors make Python's `re.match`
//! (anchored at the start only) agree with `re.fullmatch`; Python's `$` would also match
//! before a final newline, so names containing a newline are refused.

use std::collections::{HashMap, HashSet};

use regex::Regex;

/// Matches no string at all, the empty one included (PyTorch's root module is named "").
/// Both engines accept this form; lookaround (`(?!)`) would be rejected by Rust's `regex`.
pub const MATCH_NOTHING: &str = r"^[^\s\S]$";

#[derive(Debug, thiserror::Error)]
pub enum RegexError {
    #[error("building the checkpoint regex: chosen module {name:?} is not among the model's {count} modules")]
    UnknownModule { name: String, count: usize },
    #[error("building the checkpoint regex: module name {name:?} contains a newline, which Python's `$` would treat differently")]
    Newline { name: String },
    #[error("building the checkpoint regex: pattern {pattern:?} does not compile: {source}")]
    Compile { pattern: String, source: regex::Error },
    #[error("building the checkpoint regex: pattern {pattern:?} {} module {name:?}", if *.matched { "wrongly matches" } else { "misses" })]
    NotExact {
        pattern: String,
        name: String,
        matched: bool,
    },
}

/// An anchored regex matching exactly the names in `chosen` among `all_modules`.
///
/// Alternatives follow the model's module order. The result is verified against every
/// name in `all_modules` before it is returned.
pub fn checkpoint_regex(chosen: &[String], all_modules: &[String]) -> Result<String, RegexError> {
    if let Some(name) = all_modules.iter().chain(chosen).find(|n| n.contains('\n')) {
        return Err(RegexError::Newline { name: name.clone() });
    }
    let order: HashMap<&str, usize> = all_modules
        .iter()
        .enumerate()
        .rev()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let mut picked: Vec<&str> = Vec::with_capacity(chosen.len());
    for name in chosen {
        if !order.contains_key(name.as_str()) {
            return Err(RegexError::UnknownModule {
                name: name.clone(),
                count: all_modules.len(),
            });
        }
        picked.push(name);
    }
    picked.sort_by_key(|n| order[n]);
    picked.dedup();

    let pattern = if picked.is_empty() {
        MATCH_NOTHING.to_string()
    } else {
        format!("^(?:{})$", alternatives(&picked).join("|"))
    };
    verify(&pattern, &picked, all_modules)?;
    Ok(pattern)
}

/// One alternative per parent: siblings sharing a parent (`encoder.layer.0`,
/// `encoder.layer.1`) become `encoder\.layer\.(?:0|1)`; lone names stay literal.
fn alternatives(picked: &[&str]) -> Vec<String> {
    let parent = |n: &str| n.rsplit_once('.').map(|(p, c)| (p.to_string(), c.to_string()));
    let mut groups: Vec<(Option<String>, Vec<String>)> = Vec::new();
    let mut slot: HashMap<String, usize> = HashMap::new();
    for &name in picked {
        match parent(name) {
            Some((p, c)) => match slot.get(&p) {
                Some(&k) => groups[k].1.push(c),
                None => {
                    slot.insert(p.clone(), groups.len());
                    groups.push((Some(p), vec![c]));
                }
            },
            None => groups.push((None, vec![name.to_string()])),
        }
    }
    groups
        .into_iter()
        .map(|(p, children)| match (p, children.as_slice()) {
            (None, [name]) => regex::escape(name),
            (Some(p), [child]) => format!("{}\\.{}", regex::escape(&p), regex::escape(child)),
            (p, _) => {
                let kids: Vec<String> = children.iter().map(|c| regex::escape(c)).collect();
                let p = p.expect("only names with a parent are grouped");
                format!("{}\\.(?:{})", regex::escape(&p), kids.join("|"))
            }
        })
        .collect()
}

fn verify(pattern: &str, picked: &[&str], all_modules: &[String]) -> Result<(), RegexError> {
    let re = Regex::new(pattern).map_err(|source| RegexError::Compile {
        pattern: pattern.to_string(),
        source,
    })?;
    let want: HashSet<&str> = picked.iter().copied().collect();
    for name in all_modules {
        let matched = re.is_match(name);
        if matched != want.contains(name.as_str()) {
            return Err(RegexError::NotExact {
                pattern: pattern.to_string(),
                name: name.clone(),
                matched,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use expect_test::expect;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn prefix_names_stay_apart() {
        let all = names(&["", "layer1", "layer10", "layer1.0", "layer1x", "xlayer1"]);
        let re = checkpoint_regex(&names(&["layer1"]), &all).unwrap();
        expect![[r#"^(?:layer1)$"#]].assert_eq(&re);
        let re = checkpoint_regex(&names(&["layer10", "layer1.0"]), &all).unwrap();
        let r = Regex::new(&re).unwrap();
        let got: Vec<&String> = all.iter().filter(|n| r.is_match(n)).collect();
        assert_eq!(got, ["layer10", "layer1.0"]);
    }

    #[test]
    fn empty_selection_matches_nothing() {
        let all = names(&["", "layer1", "layer1.0", "layer1.0.conv1", "fc"]);
        let re = checkpoint_regex(&[], &all).unwrap();
        assert_eq!(re, MATCH_NOTHING);
        let r = Regex::new(&re).unwrap();
        assert!(!r.is_match("") && !r.is_match("layer1") && !r.is_match("\n"));
    }

    #[test]
    fn root_and_duplicates() {
        let all = names(&["", "a", "a.b"]);
        let re = checkpoint_regex(&names(&["", "a.b", "a.b"]), &all).unwrap();
        expect![[r#"^(?:|a\.b)$"#]].assert_eq(&re);
    }

    #[test]
    fn odd_characters_are_escaped() {
        let all = names(&["m", "m.a+b", "m.a(b)", "m.x-y#z", "m.a b"]);
        let chosen = names(&["m.a+b", "m.x-y#z", "m.a b"]);
        let re = checkpoint_regex(&chosen, &all).unwrap();
        let r = Regex::new(&re).unwrap();
        let got: Vec<String> = all.iter().filter(|n| r.is_match(n)).cloned().collect();
        assert_eq!(got, chosen);
    }

    #[test]
    fn errors_name_the_module() {
        let all = names(&["a", "b"]);
        let e = checkpoint_regex(&names(&["c"]), &all).unwrap_err().to_string();
        assert!(
            e.contains("chosen module \"c\" is not among the model's 2 modules"),
            "{e}"
        );
        let e = checkpoint_regex(&names(&["a"]), &names(&["a", "b\n"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"b\\n\" contains a newline"), "{e}");
    }
}
