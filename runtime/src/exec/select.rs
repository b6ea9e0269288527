//! A checkpoint regex as a mask over a chain's units, refusing what cannot be honoured.

use ckptune_models::Chain;
use ckptune_solver::names::closest;
use ckptune_solver::regex_emit::MATCH_NOTHING;

use crate::error::{Result, RuntimeError};

/// Which blocks and groups of `chain` a checkpoint regex selects, as a mask over
/// [`Chain::units`]. The regex is applied to each name as a full match (Python's
/// `re.fullmatch` of the emitted anchored regexes); a match on a non-candidate block, or on a
/// group and one of its blocks, is an error, since it cannot be honoured.
pub fn select(chain: &Chain, pattern: &str) -> Result<Vec<bool>> {
    let full = format!("^(?:{pattern})$");
    let re = regex::Regex::new(&full).map_err(|e| RuntimeError::Regex {
        pattern: pattern.to_owned(),
        message: e.to_string(),
    })?;
    let mask = (0..chain.units())
        .map(|i| {
            let name = chain.unit_name(i);
            let hit = re.is_match(name);
            if hit && !chain.unit_candidate(i) {
                Err(RuntimeError::NotCandidate {
                    pattern: pattern.to_owned(),
                    name: name.to_owned(),
                    model: chain.name.clone(),
                    candidates: chain.candidates().join(", "),
                })
            } else {
                Ok(hit)
            }
        })
        .collect::<Result<Vec<bool>>>()?;
    if !mask.contains(&true) {
        // A regex naming modules that exist but are not units of this chain (sub-modules at
        // layer granularity) would silently checkpoint nothing, and so would a mistyped one.
        // Only the empty regex and the one plans emit for "checkpoint nothing" say that.
        let modules: Vec<&str> = chain
            .modules
            .iter()
            .filter(|m| re.is_match(m))
            .map(|m| m.as_str())
            .collect();
        if !modules.is_empty() {
            return Err(RuntimeError::Selection(format!(
                "checkpoint regex {pattern:?} matches {} of {}, which this chain does not run as a checkpoint \
                 unit; candidates: {} (--granularity block or nested makes the modules inside layers candidates)",
                modules.join(", "),
                chain.name,
                chain.candidates().join(", ")
            )));
        }
        if !pattern.is_empty() && pattern != MATCH_NOTHING {
            let close = closest(pattern, &chain.modules, 3);
            return Err(RuntimeError::Selection(format!(
                "checkpoint regex {pattern:?} matches no module of {}, so it would checkpoint nothing{}; \
                 candidates: {} (to checkpoint nothing on purpose, pass an empty regex)",
                chain.name,
                if close.is_empty() {
                    String::new()
                } else {
                    format!(" (closest module names: {})", close.join(", "))
                },
                chain.candidates().join(", ")
            )));
        }
    }
    if let Some((g, k)) = chain.nested_conflict(&mask) {
        return Err(RuntimeError::Selection(format!(
            "checkpoint regex {pattern:?} selects both {} and its child {} of {}; a module and its child \
             are never both checkpointed (the child's recompute would run inside the parent's): select one",
            chain.groups[g].name, chain.blocks[k].name, chain.name
        )));
    }
    Ok(mask)
}
