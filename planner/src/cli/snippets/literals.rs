//! Plan values as Python literals and comment text: strings, booleans, the `PLAN` dict the
//! companion reads, lists of module names.

use ckptune_solver::formats::{self, PlanJson};

/// A document part as a Python literal (see `formats::python_literal`).
pub(super) fn py<T: formats::Document>(value: &T) -> String {
    // Plain strings, lists and the plan's own config always serialize.
    formats::python_literal(value).unwrap_or_else(|_| "None".into())
}

pub(super) fn py_str(s: &str) -> String {
    py(&s)
}

/// `PLAN = {...}`: the fields the companion reads (format, the model's backbone prefix,
/// checkpoint with its selective modules, config), as the plan has them; the config as serialized, so fields added to it
/// (`optimizer_impl`) travel unchanged.
pub(super) fn plan_literal(plan: &PlanJson) -> String {
    // Regex first, as the plan file has it (a JSON map here would sort the keys).
    // One policy's modules as one dict, several as a list of them, as the plan file has them.
    let groups: Vec<String> = plan
        .checkpoint
        .selective
        .iter()
        .map(|s| format!("{{\"policy\": {}, \"modules\": {}}}", py_str(&s.policy), py(&s.modules)))
        .collect();
    let selective = match groups.as_slice() {
        [] => String::new(),
        [one] => format!(", \"selective\": {one}"),
        many => format!(", \"selective\": [{}]", many.join(", ")),
    };
    let checkpoint = format!(
        "{{\"regex\": {}, \"modules\": {}{selective}}}",
        py_str(&plan.checkpoint.regex),
        py(&plan.checkpoint.modules)
    );
    let prefix = match plan.model.backbone() {
        "" => String::new(),
        b => format!("{b}."),
    };
    format!(
        "PLAN = {{\n    \"format\": {},\n    \"model\": {{\"prefix\": {}}},\n    \"checkpoint\": {},\n    \"config\": {},\n}}\n",
        py_str(formats::PLAN_FORMAT),
        py_str(&prefix),
        checkpoint,
        py(&plan.config)
    )
}

/// Module names for a comment: all of them, or the first two and the last of a long list.
pub(super) fn unit_list(units: &[String]) -> String {
    match units {
        [first, second, .., last] if units.len() > 6 => {
            format!("{first}, {second}, …, {last} ({} units)", units.len())
        }
        _ => units.join(", "),
    }
}

pub(super) fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// What a selective policy keeps and recomputes, for a snippet's comments.
pub(super) fn policy_text(policy: &str) -> &'static str {
    match policy {
        "attention" => "the attention core and pointwise operators recomputed, the rest kept",
        _ => "matmul and attention outputs kept, the rest recomputed",
    }
}
