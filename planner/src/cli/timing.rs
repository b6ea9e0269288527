//! What `plan`, `verify` and `profile` tell the reader about step times timed while the rest
//! of the machine was busy (docs/timing.md): one wording, so every command says the same.

use ckptune_solver::formats::ProfileJson;
use ckptune_solver::profile::Contention;

/// A sentence about `c`, the contention of the steps behind `what` ("the profile of
/// fp32/adamw/mb8x1"), when some estimate rests on contended samples or the load was not
/// recorded; `None` when every estimate is quiet.
pub fn contention_note(what: &str, c: &Contention) -> Option<String> {
    if !c.recorded() {
        return Some(unrecorded(what));
    }
    if c.unjudged() {
        return Some(format!(
            "{what}: the machine's load could not be judged for any of its {} timed steps (no /proc, or \
             steps too short for the CPU counters, which tick 100 times a second), so its step times were \
             not checked for contention",
            c.samples
        ));
    }
    c.contended().then(|| {
        format!(
            "{what} could not get quiet samples: {} of the {} timed steps behind its step times ran while \
             the rest of the machine took up to {:.2} cores (median {:.2}), after {} re-timings, so its step \
             times are a busy machine's; time again on a quiet machine",
            c.contended, c.samples, c.other_cores_max, c.other_cores_median, c.retimed
        )
    })
}

fn unrecorded(what: &str) -> String {
    format!(
        "{what} was measured before ckptune checked step times for contention: they may be a busy \
         machine's (profile again to check)"
    )
}

/// The notes for a profile: one per config whose timing could not get quiet samples, and one
/// naming the configs whose load was not recorded.
pub fn profile_notes(profile: &ProfileJson, source: &str) -> Vec<String> {
    let timed = || profile.configs.iter().filter(|c| !c.is_estimated());
    let unrecorded_labels: Vec<String> = timed()
        .filter(|c| !c.contention.recorded())
        .map(|c| c.config.label())
        .collect();
    let mut notes: Vec<String> = estimate_notes(profile, source);
    notes.extend(
        timed()
            .filter(|c| c.contention.recorded())
            .filter_map(|c| contention_note(&format!("{source} of {}", c.config.label()), &c.contention)),
    );
    if !unrecorded_labels.is_empty() {
        notes.push(unrecorded(&format!("{source} of {}", unrecorded_labels.join(", "))));
    }
    notes
}

/// One note per way the profile's times were estimated, naming the configs: their times are the
/// cost model's, not measurements.
fn estimate_notes(profile: &ProfileJson, source: &str) -> Vec<String> {
    let mut ways: Vec<(String, Vec<String>)> = Vec::new();
    for c in &profile.configs {
        let Some(e) = &c.estimated else { continue };
        let way = e.describe();
        match ways.iter_mut().find(|(w, _)| *w == way) {
            Some((_, labels)) => labels.push(c.config.label()),
            None => ways.push((way, vec![c.config.label()])),
        }
    }
    ways.into_iter()
        .map(|(way, labels)| {
            format!(
                "the step times of {source} of {} are {way}, not measured (docs/cost-model.md)",
                labels.join(", ")
            )
        })
        .collect()
}

/// `[lo, hi]` as `0.512–0.534 s`.
pub fn range_text(r: [f64; 2]) -> String {
    format!("{:.3}–{:.3} s", r[0], r[1])
}
