//! `verify --pytorch --trainer hf|lightning`: the plan run by the Hugging Face `Trainer` and by
//! Lightning through the snippets `ckptune emit` writes, on tiny-bert and tiny-resnet, each peak
//! compared with the documented loop's and the bytes the run explains, a plan running layers
//! selective under each policy included; and the refusals.

mod common;

use std::path::{Path, PathBuf};

use common::{ckptune, edited, ok, read, refused, selective_made_cheap, COMMON};
use serde_json::Value;

/// A plan of `model` under the budget halfway between checkpointing nothing and everything.
fn plan(dir: &Path, model: &str, shape: &[&str], extra: &[&str]) -> PathBuf {
    let profile = dir.join(format!("profile-{model}.json"));
    let mut args = vec!["profile", model];
    args.extend(shape);
    args.extend(extra);
    args.extend(["-o", profile.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let c = &read(&profile)["configs"][0];
    let (none, all) = (c["peak_none"].as_i64().unwrap(), c["peak_all"].as_i64().unwrap());
    let budget = ((all + none) / 2).to_string();
    let out = dir.join(format!("plan-{model}.json"));
    let mut args = vec!["plan", "--budget", &budget, model];
    args.extend(shape);
    args.extend(extra);
    args.extend(["--profile", profile.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    out
}

/// The report of `verify --pytorch --trainer`; exit 1 exactly when a peak is over the budget (the
/// HF Trainer's prefetched batch can be: tiny-resnet's images are an eighth of its peak).
fn verify(plan: &Path, trainer: &str) -> Value {
    let report = plan.with_extension(format!("{trainer}.verify.json"));
    let out = ckptune(&[
        "verify",
        "--pytorch",
        plan.to_str().unwrap(),
        "--trainer",
        trainer,
        "--steps",
        "2",
        "--json",
        "-o",
        report.to_str().unwrap(),
    ]);
    let doc = read(&report);
    let over = !doc["pytorch_within_budget"].as_bool().unwrap()
        || !doc["ckptune"]["within_budget"].as_bool().unwrap()
        || !doc["trainer"]["within_budget"].as_bool().unwrap();
    assert_eq!(
        out.status.code(),
        Some(if over { 1 } else { 0 }),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    doc
}

/// The trainer's peak is the documented loop's plus what the run explains plus what it does not,
/// and the modules that recompute are the plan's.
fn check(report: &Value, plan: &Path) -> i64 {
    let t = &report["trainer"];
    let run = &t["run"];
    let eager = report["pytorch"]["peak_bytes"].as_i64().unwrap();
    let explained: i64 = run["explained"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["bytes"].as_i64().unwrap())
        .sum();
    let unexplained = t["unexplained_bytes"].as_i64().unwrap();
    assert_eq!(run["peak_bytes"].as_i64().unwrap(), eager + explained + unexplained);
    assert_eq!(
        t["peak_error_bytes"].as_i64().unwrap(),
        run["peak_bytes"].as_i64().unwrap() - report["predicted"]["peak_bytes"].as_i64().unwrap()
    );
    assert_eq!(run["modules"], read(plan)["checkpoint"]["modules"], "{run}");
    assert_eq!(run["selective"], read(plan)["checkpoint"]["selective"], "{run}");
    unexplained
}

#[test]
fn lightning_peaks_at_the_documented_loops_bytes_plus_what_it_explains() {
    let dir = tempfile::tempdir().unwrap();
    for (model, shape) in [
        ("tiny-bert", ["--batch", "4", "--seq", "16"]),
        ("tiny-resnet", ["--batch", "8", "--image", "64"]),
    ] {
        let p = plan(dir.path(), model, &shape, &["--precision", "fp32"]);
        let report = verify(&p, "lightning");
        assert_eq!(check(&report, &p), 0, "{model}: every byte explained");
    }
}

#[test]
fn hf_trainer_peaks_at_the_documented_loops_bytes_plus_the_prefetched_batch() {
    let dir = tempfile::tempdir().unwrap();
    for (model, shape, batch_bytes) in [
        // ids, mask (int64, 4 × 16) and labels (int64, 4)
        ("tiny-bert", ["--batch", "4", "--seq", "16"], 4 * 16 * 8 * 2 + 4 * 8),
        // images (fp32, 8 × 3 × 64 × 64) and labels (int64, 8)
        (
            "tiny-resnet",
            ["--batch", "8", "--image", "64"],
            8 * 3 * 64 * 64 * 4 + 8 * 8,
        ),
    ] {
        let p = plan(dir.path(), model, &shape, &["--precision", "fp32"]);
        let report = verify(&p, "hf");
        assert_eq!(
            report["trainer"]["run"]["explained"][0]["bytes"].as_i64(),
            Some(batch_bytes)
        );
        // The loss accelerate's backward divides by its accumulation steps and runs on: one f32.
        let copy = report["trainer"]["run"]["explained"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["why"].as_str().unwrap().contains("Accelerator.backward"));
        assert_eq!(copy.map(|e| e["bytes"].as_i64()), Some(Some(4)), "{model}");
        assert_eq!(check(&report, &p), 0, "{model}: every byte explained");
    }
}

/// tiny-bert's plan forced to run a layer selective under `policy` (its layers' selective recomputes
/// made nearly free, the budget one byte below the peak with nothing checkpointed), at sequence 24 (not
/// the head dimension, 16, so only the scores are `[..., s, s]`).
fn selective_plan(dir: &Path, policy: &str) -> PathBuf {
    let shape = ["tiny-bert", "--batch", "4", "--seq", "24", "--precision", "fp32"];
    let profile = dir.join(format!("profile-{policy}.json"));
    let mut args = vec!["profile"];
    args.extend(shape);
    args.extend(["--selective", policy, "-o", profile.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let cheap = selective_made_cheap(dir, &format!("cheap-{policy}.json"), &read(&profile), "encoder.layer.");
    let budget = (read(&cheap)["configs"][0]["peak_none"].as_i64().unwrap() - 1).to_string();
    let out = dir.join(format!("plan-{policy}.json"));
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(shape);
    args.extend([
        "--selective",
        policy,
        "--profile",
        cheap.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    args.extend(COMMON);
    ok(&args);
    assert!(read(&out)["checkpoint"]["selective"]["modules"]
        .as_array()
        .is_some_and(|m| !m.is_empty()));
    out
}

/// Each trainer runs the plan's selective layers selective (read back from the wrapped modules):
/// Lightning at the documented loop's bytes plus what it explains, the HF Trainer with the same
/// unexplained bookkeeping as with those layers checkpointed whole.
#[test]
fn trainers_run_selective_layers_as_the_documented_loop_does() {
    let dir = tempfile::tempdir().unwrap();
    for policy in ["matmul", "attention"] {
        let p = selective_plan(dir.path(), policy);
        assert_eq!(check(&verify(&p, "lightning"), &p), 0, "{policy}: every byte explained");
        let selective = check(&verify(&p, "hf"), &p);
        let whole = edited(dir.path(), &format!("whole-{policy}.json"), &read(&p), |d| {
            d["checkpoint"].as_object_mut().unwrap().remove("selective");
        });
        assert_eq!(selective, check(&verify(&whole, "hf"), &whole), "{policy}");
    }
}

/// A plan mixing the policies per layer (`encoder.layer.0` under `matmul`, `encoder.layer.1`
/// under `attention`, from one profile measuring both) runs each layer under its own policy in
/// either trainer (read back from the wrapped modules): Lightning at the documented loop's bytes
/// plus what it explains, the HF Trainer with the same unexplained bookkeeping as with the layers
/// checkpointed whole.
#[test]
fn trainers_run_each_layer_of_a_mixed_plan_under_its_own_policy() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(
        dir.path(),
        "tiny-bert",
        &["--batch", "4", "--seq", "24"],
        &["--precision", "fp32", "--selective", "matmul,attention"],
    );
    let mixed = edited(dir.path(), "mixed.json", &read(&p), |d| {
        let ck = &mut d["checkpoint"];
        ck["modules"] = serde_json::json!(["encoder.layer.0", "encoder.layer.1"]);
        ck["regex"] = "^(?:encoder\\.layer\\.(?:0|1))$".into();
        ck["selective"] = serde_json::json!([
            {"policy": "matmul", "modules": ["encoder.layer.0"]},
            {"policy": "attention", "modules": ["encoder.layer.1"]},
        ]);
    });
    assert_eq!(check(&verify(&mixed, "lightning"), &mixed), 0, "every byte explained");
    let selective = check(&verify(&mixed, "hf"), &mixed);
    let whole = edited(dir.path(), "whole.json", &read(&mixed), |d| {
        d["checkpoint"].as_object_mut().unwrap().remove("selective");
    });
    assert_eq!(selective, check(&verify(&whole, "hf"), &whole));
}

#[test]
fn verify_trainer_refuses_a_plan_its_snippet_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(
        dir.path(),
        "tiny-bert",
        &["--batch", "4", "--seq", "16"],
        &["--precision", "bf16", "--autocast-cache"],
    );
    refused(
        &["verify", "--pytorch", p.to_str().unwrap(), "--trainer", "lightning"],
        &["--trainer lightning", "autocast's cache", "re-plan"],
    );
}
