//! The committed results still follow from their inputs: every plan in `results/<model>/plans/`
//! is solved again from the committed profile and must equal the committed plan field for
//! field (the solver's own wall time aside), and the committed trade-off plots are drawn again
//! from the committed sweeps and profiles, byte for byte. A change to the memory model, the
//! solver, the formats or the plots that alters a published number fails here.
//!
//! Nothing compared depends on the CPU these tests run on: the profiles are inputs, not
//! measured here, and the one thing the solving machine adds to a plan (a note that its
//! profile was measured on another CPU) is checked for what it must be and set aside.

mod common;

use std::path::{Path, PathBuf};

use ckptune::cli::setup::cpu_identity;
use common::{ok, read};
use serde_json::Value;

fn results() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../results")
}

const MODELS: [&str; 2] = ["resnet152", "bert-base-uncased"];

/// The `plan` arguments that made `plan` (from its recorded shape, config space and device).
fn plan_args(plan: &Value, profile: &Path) -> Vec<String> {
    let shape = &plan["shape"];
    let config = &plan["config"];
    let mut precisions: Vec<String> = Vec::new();
    for a in plan["alternatives"].as_array().unwrap() {
        let p = a["config"]["precision"].as_str().unwrap().to_owned();
        if !precisions.contains(&p) {
            precisions.push(p);
        }
    }
    let mut args: Vec<String> = vec![
        "plan".into(),
        "--budget".into(),
        plan["budget_bytes"].to_string(),
        shape["model"].as_str().unwrap().into(),
        "--batch".into(),
        config["micro_batch"].to_string(),
        "--precision".into(),
        precisions.join(","),
        "--optimizer".into(),
        config["optimizer"].as_str().unwrap().into(),
        "--granularity".into(),
        shape["granularity"].as_str().unwrap().into(),
        "--threads".into(),
        plan["device"]["threads"].to_string(),
        "--repeats".into(),
        shape["repeats"].to_string(),
        "--profile".into(),
        profile.to_string_lossy().into_owned(),
        "--quiet".into(),
        "--no-cache".into(),
    ];
    for (key, flag) in [("image", "--image"), ("seq", "--seq"), ("classes", "--classes")] {
        if let Some(v) = shape[key].as_i64() {
            args.extend([flag.to_owned(), v.to_string()]);
        }
    }
    args
}

/// Removes the note a plan solved on `host` carries when its profile was measured on another
/// CPU, after checking that it is there exactly when the CPUs differ.
fn set_aside_cpu_note(plan: &mut Value, host: &str) {
    let measured_on = plan["device"]["cpu"].as_str().unwrap().to_owned();
    let notes = plan["notes"].as_array_mut().unwrap();
    let before = notes.len();
    notes.retain(|n| !n.as_str().unwrap().contains(" was measured on CPU "));
    let expected = usize::from(!measured_on.is_empty() && measured_on != host);
    assert_eq!(
        before - notes.len(),
        expected,
        "a plan solved on {host:?} from a profile measured on {measured_on:?} must carry {expected} \
         note(s) about the CPU"
    );
}

#[test]
fn committed_plans_are_solved_again_to_the_same_plan() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for model in MODELS {
        let profile = results().join(model).join("profile.json");
        for entry in std::fs::read_dir(results().join(model).join("plans")).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !(name.starts_with("plan-") && name.ends_with(".json")) {
                continue;
            }
            let mut committed = read(&path);
            let out = dir.path().join(&name);
            let mut args = plan_args(&committed, &profile);
            args.extend(["-o".to_owned(), out.to_string_lossy().into_owned()]);
            ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
            let mut again = read(&out);
            set_aside_cpu_note(&mut again, &cpu_identity());
            for p in [&mut committed, &mut again] {
                p["solver"]["seconds"] = Value::from(0.0);
            }
            assert_eq!(again, committed, "{model}/{name} solved again differs");
            checked += 1;
        }
    }
    assert!(checked >= 6, "only {checked} committed plans found");
}

#[test]
fn committed_plots_are_drawn_again_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for model in MODELS {
        for (input, plots) in [("sweep.json", "plots"), ("profile.json", "plots/profile")] {
            let out = dir.path().join(model).join(plots);
            let input = results().join(model).join(input);
            ok(&["plot", input.to_str().unwrap(), "-o", out.to_str().unwrap()]);
            for entry in std::fs::read_dir(&out).unwrap() {
                let drawn = entry.unwrap().path();
                if drawn.extension().is_none_or(|e| e != "svg") {
                    continue;
                }
                let committed = results().join(model).join(plots).join(drawn.file_name().unwrap());
                assert!(
                    std::fs::read(&drawn).unwrap() == std::fs::read(&committed).unwrap(),
                    "{} drawn again differs from the committed one",
                    committed.display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 8, "only {checked} committed plots compared");
}
