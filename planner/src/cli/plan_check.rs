//! What a plan must mean before a command acts on it (`emit`, `plan --emit`, `verify`): its
//! regex matches exactly the modules it lists among the model's, and a shard section names
//! distinct modules, none inside another. A hand-edited or stale plan is bad input (exit 2)
//! rather than a snippet or a run that checkpoints something else.

use ckptune_solver::formats::{ModelJson, PlanJson, ShardJson};

use crate::cli::error::UsageError;

/// Of `names`, those the plan's model has no module of.
fn unknown_modules<'a>(model: &ModelJson, names: &'a [String]) -> Vec<&'a str> {
    names
        .iter()
        .filter(|n| !model.modules.contains(n))
        .map(String::as_str)
        .collect()
}

/// The plan's regex matches exactly its listed modules among the model's module names (full
/// match, as PyTorch users and `ckptune.apply` read it). A plan whose regex matches nothing,
/// whose modules the model lacks, or whose two fields disagree is refused, naming the values.
pub fn check_plan(plan: &PlanJson) -> Result<(), UsageError> {
    let pattern = &plan.checkpoint.regex;
    let re = regex::Regex::new(&format!("^(?:{pattern})$")).map_err(|e| {
        UsageError(format!(
            "the plan's checkpoint regex {pattern:?} is not a valid regex: {e}"
        ))
    })?;
    let model = &plan.model;
    let missing = unknown_modules(model, &plan.checkpoint.modules);
    if !missing.is_empty() {
        return Err(UsageError(format!(
            "the plan checkpoints {} but {} has no module of that name; re-plan with this ckptune",
            missing.join(", "),
            model.name
        )));
    }
    let matched: Vec<&str> = model
        .modules
        .iter()
        .filter(|m| re.is_match(m))
        .map(String::as_str)
        .collect();
    let mut listed: Vec<&str> = plan.checkpoint.modules.iter().map(String::as_str).collect();
    listed.sort_unstable();
    let mut found = matched.clone();
    found.sort_unstable();
    if found != listed {
        let what = if matched.is_empty() {
            "matches no module".to_string()
        } else {
            format!("matches {}", matched.join(", "))
        };
        return Err(UsageError(format!(
            "the plan's checkpoint regex {pattern} {what} of {}, but the plan lists {}; the plan was \
             edited or is damaged: re-plan with this ckptune",
            model.name,
            if listed.is_empty() {
                "no module".to_string()
            } else {
                plan.checkpoint.modules.join(", ")
            }
        )));
    }
    check_selective(plan)
}

/// The plan's selective modules (`checkpoint.selective`) are among its checkpointed modules,
/// each under one policy, and its profile measured each of them selective under its policy
/// (what its prediction rests on).
fn check_selective(plan: &PlanJson) -> Result<(), UsageError> {
    let damaged = |what: String| {
        UsageError(format!(
            "the plan {what}; the plan was edited or is damaged: re-plan with this ckptune"
        ))
    };
    let mut seen: Vec<&String> = Vec::new();
    for sel in &plan.checkpoint.selective {
        if let Some(m) = sel.modules.iter().find(|m| !plan.checkpoint.modules.contains(m)) {
            return Err(damaged(format!("runs {m} selective but does not checkpoint it")));
        }
        if let Some(m) = sel.modules.iter().find(|m| seen.contains(m)) {
            return Err(damaged(format!("runs {m} selective under two policies")));
        }
        seen.extend(&sel.modules);
        let measured = |m: &String| {
            plan.profile.regimes.first().is_some_and(|r| {
                r.blocks
                    .iter()
                    .any(|b| &b.name == m && b.selective.iter().any(|s| s.policy == sel.policy))
            })
        };
        if let Some(m) = sel.modules.iter().find(|m| !measured(m)) {
            return Err(damaged(format!(
                "runs {m} selective under policy {:?}, which its profile did not measure",
                sel.policy
            )));
        }
    }
    Ok(())
}

/// A sharded plan's `shard` section means what it says: at least one rank, a collective the
/// snippets know, and units that are distinct modules of the model, none inside another
/// (`fully_shard` on both would nest them; ckptune models one level of units under the root).
pub fn check_shard(plan: &PlanJson, shard: &ShardJson) -> Result<(), UsageError> {
    let damaged = |what: String| {
        UsageError(format!(
            "the plan's shard section {what}; the plan was edited or is damaged: re-plan with \
             `ckptune plan --shard N`"
        ))
    };
    if shard.ranks < 1 {
        return Err(damaged(format!("has {} ranks", shard.ranks)));
    }
    if !matches!(shard.collective.as_str(), "gloo" | "nccl") {
        return Err(damaged(format!(
            "names the collective {:?} (expected gloo or nccl)",
            shard.collective
        )));
    }
    let model = &plan.model;
    let missing = unknown_modules(model, &shard.units);
    if !missing.is_empty() {
        return Err(damaged(format!(
            "shards {} but {} has no module of that name",
            missing.join(", "),
            model.name
        )));
    }
    for (i, a) in shard.units.iter().enumerate() {
        for b in &shard.units[i + 1..] {
            if a == b {
                return Err(damaged(format!("lists the unit {a} twice")));
            }
            if a.starts_with(&format!("{b}.")) || b.starts_with(&format!("{a}.")) {
                return Err(damaged(format!("lists the units {a} and {b}, one inside the other")));
            }
        }
    }
    Ok(())
}
