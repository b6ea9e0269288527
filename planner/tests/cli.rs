//! Drives the real `ckptune` binary on tiny models through `models`, `plan`, `verify`, `sweep`
//! and `train`, and checks its output files and exit codes.

mod common;

use common::{ckptune, fixture, ok, plan_tiny_bert, profile_tiny_bert, read, refused, verify, COMMON};
use serde_json::Value;

#[test]
fn models_lists_reference_parameter_counts() {
    let out = ok(&["models", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let count =
        |name: &str| v.as_array().unwrap().iter().find(|m| m["name"] == name).unwrap()["reference_params"].clone();
    assert_eq!(count("resnet152"), 60_192_808);
    assert_eq!(count("bert-base-uncased"), 109_482_240);
    assert_eq!(count("gpt2"), 124_439_808);
    assert_eq!(count("mistral-7b-v0.1"), 7_241_732_096_i64);
}

#[test]
fn plan_fits_and_verifies_to_the_byte() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let p = profile_tiny_bert(&profile, &COMMON);
    assert_eq!(p["format"], "ckptune.profile/1");
    let c = &p["configs"][0];
    let (none, all) = (c["peak_none"].as_i64().unwrap(), c["peak_all"].as_i64().unwrap());
    assert!(all < none, "checkpointing everything saves memory ({all} < {none})");

    // A budget between the two peaks forces some checkpointing.
    let budget = (all + none) / 2;
    let plan = dir.path().join("plan.json");
    let b = budget.to_string();
    plan_tiny_bert(&b, &profile, &["-o", plan.to_str().unwrap(), "--verify"]);
    let v = read(&plan);
    assert_eq!(v["format"], "ckptune.plan/1");
    assert_eq!(v["budget_bytes"], budget);
    assert!(v["predicted"]["peak_bytes"].as_i64().unwrap() <= budget);
    assert!(!v["checkpoint"]["modules"].as_array().unwrap().is_empty());
    assert_eq!(v["solver"]["status"], "optimal");
    for key in ["precision", "optimizer", "micro_batch", "grad_accum", "set_to_none"] {
        assert!(!v["config"][key].is_null(), "config.{key}");
    }

    let r = verify(&plan, dir.path());
    assert_eq!(r["format"], "ckptune.verify/1");
    assert_eq!(r["within_budget"], true);
    assert_eq!(r["peak_error_bytes"], 0, "CPU prediction is byte-exact: {r}");
    assert_eq!(r["mismatches"].as_array().unwrap().len(), 0, "{r}");

    // The profile names its CPU; planning from one measured on another CPU says so.
    let cpu = p["device"]["cpu"].as_str().unwrap();
    assert!(!cpu.is_empty() && cpu != "unknown", "{cpu:?}");
    let mut other = p.clone();
    other["device"]["cpu"] = Value::from("Some Other CPU [avx512f]");
    let other_file = dir.path().join("other-cpu.json");
    std::fs::write(&other_file, serde_json::to_string(&other).unwrap()).unwrap();
    let out = plan_tiny_bert(&b, &other_file, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("was measured on CPU \"Some Other CPU [avx512f]\""),
        "{text}"
    );

    // A budget the un-checkpointed step fits: the plan checkpoints nothing, and says so next
    // to the never-matching regex rather than leaving the reader to decode it.
    let roomy = none.to_string();
    let out = plan_tiny_bert(&roomy, &profile, &["-o", plan.to_str().unwrap()]);
    let v = read(&plan);
    assert!(v["checkpoint"]["modules"].as_array().unwrap().is_empty(), "{v}");
    assert_eq!(v["predicted"]["peak_bytes"], none);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = format!(
        "checkpoint regex: {} (matches no module: nothing needs checkpointing)",
        v["checkpoint"]["regex"].as_str().unwrap()
    );
    assert!(text.contains(&line), "{text}");
}

#[test]
fn a_budget_share_lies_between_the_smallest_and_the_unconstrained_peak() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let p = profile_tiny_bert(&profile, &COMMON);
    let c = &p["configs"][0];
    let (none, all) = (c["peak_none"].as_i64().unwrap(), c["peak_all"].as_i64().unwrap());
    let plan = dir.path().join("plan.json");
    let plan_at = |share: &str| {
        let out = plan_tiny_bert(share, &profile, &["-o", plan.to_str().unwrap()]);
        (read(&plan), String::from_utf8_lossy(&out.stdout).into_owned())
    };

    let (v, text) = plan_at("50%");
    let s = &v["budget_share"];
    let (smallest, unconstrained) = (
        s["smallest_peak_bytes"].as_i64().unwrap(),
        s["unconstrained_peak_bytes"].as_i64().unwrap(),
    );
    assert_eq!(s["percent"], 50.0);
    assert!(s["config"].as_str().unwrap().starts_with("fp32/adamw/mb4x1"), "{s}");
    assert_eq!(
        unconstrained, none,
        "one config: the unconstrained plan checkpoints nothing"
    );
    assert!(smallest <= all && smallest < none, "{smallest} {all} {none}");
    assert_eq!(v["budget_bytes"], smallest + (unconstrained - smallest) / 2);
    assert!(!v["checkpoint"]["modules"].as_array().unwrap().is_empty(), "{v}");
    assert!(
        text.contains("50% of the way from the smallest peak checkpointing reaches"),
        "{text}"
    );
    let r = verify(&plan, dir.path());
    assert_eq!(r["peak_error_bytes"], 0, "{r}");
    assert_eq!(r["within_budget"], true, "{r}");

    // The ends: 0% is the smallest peak, 100% the unconstrained one with nothing checkpointed.
    let (v, _) = plan_at("0%");
    assert_eq!(v["budget_bytes"], smallest);
    assert_eq!(v["predicted"]["peak_bytes"], smallest);
    let (v, _) = plan_at("100%");
    assert_eq!(v["budget_bytes"], none);
    assert!(v["checkpoint"]["modules"].as_array().unwrap().is_empty(), "{v}");
}

#[test]
fn verify_fails_loudly_over_budget() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let mut args = vec![
        "plan",
        "--budget",
        "1GiB",
        "tiny-resnet",
        "--image",
        "32",
        "--precision",
        "fp32",
        "-o",
        plan.to_str().unwrap(),
    ];
    args.extend(COMMON);
    ok(&args);
    // Shrink the recorded budget below what the plan needs.
    let mut v = read(&plan);
    v["budget_bytes"] = Value::from(v["predicted"]["peak_bytes"].as_i64().unwrap() - 1);
    std::fs::write(&plan, serde_json::to_string(&v).unwrap()).unwrap();
    let out = ckptune(&["verify", plan.to_str().unwrap(), "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("OVER BUDGET"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("verification failed"));
}

#[test]
fn infeasible_budget_fails_with_the_smallest_peak_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let mut args = vec![
        "plan",
        "--budget",
        "1KiB",
        "tiny-resnet",
        "--image",
        "32",
        "-o",
        plan.to_str().unwrap(),
    ];
    args.extend(COMMON);
    let out = ckptune(&args);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("smallest achievable peak"), "{err}");
    assert!(err.contains("checkpoint regex"), "{err}");
    assert!(err.contains("What else could help"), "{err}");
    assert!(!plan.exists(), "no plan file for an infeasible budget");
    // Scripts get the same as data.
    let mut args = vec!["plan", "--budget", "1KiB", "tiny-resnet", "--image", "32", "--json"];
    args.extend(COMMON);
    let out = ckptune(&args);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["format"], "ckptune.plan-failure/1");
    assert!(v["min_peak_bytes"].as_i64().unwrap() > 1024);
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let not_chain = fixture("tiny_not_chain.torchscript.pt");
    let ordered_dict = fixture("ordered_dict.pt");
    let pickled_module = fixture("pickled_module.pt");
    let t5_dir = tempfile::tempdir().unwrap();
    std::fs::write(t5_dir.path().join("config.json"), r#"{"model_type": "t5"}"#).unwrap();
    let t5 = t5_dir.path().to_str().unwrap().to_string();
    let torchscript = fixture("tiny_chain.torchscript.pt");
    for (args, needle) in [
        (vec!["plan", "--budget", "12 parsecs", "tiny-resnet"], "--budget"),
        (vec!["plan", "--budget", "1GiB", "resnet150"], "unknown model"),
        (
            vec!["plan", "--budget", "1GiB", "tiny-resnet", "--precision", "fp64"],
            "unknown precision",
        ),
        (
            vec!["plan", "--budget", "1GiB", "tiny-resnet", "--precision", "fp16"],
            "CUDA",
        ),
        (
            vec!["plan", "--budget", "1GiB", "/nonexistent/model.pt"],
            "does not exist",
        ),
        (
            vec!["train", "tiny-resnet", "--checkpoint", "conv1.*"],
            "not a candidate",
        ),
        (
            vec!["plan", "--budget", "1GiB", &not_chain],
            "not the composition of its top-level children",
        ),
        (
            vec!["plan", "--budget", "1GiB", &ordered_dict],
            "cannot infer the architecture",
        ),
        (
            vec!["plan", "--budget", "1GiB", &t5],
            "model_type \"t5\" is not supported",
        ),
        (
            vec!["plan", "--budget", "1GiB", &pickled_module],
            "torch.save(model.state_dict(), path)",
        ),
        // A child of a layer at layer granularity: not a unit there, and the fix is named.
        (
            vec!["train", "tiny-bert", "--checkpoint", r"encoder\.layer\.0\.attention"],
            "--granularity block or nested",
        ),
        // A layer and its child both.
        (
            vec![
                "train",
                "tiny-bert",
                "--granularity",
                "nested",
                "--checkpoint",
                r"encoder\.layer\.0(\.output)?",
            ],
            "never both checkpointed",
        ),
        (
            vec!["plan", "--budget", "1GiB", "tiny-bert", "--granularity", "sub"],
            "expected layer, block or nested",
        ),
        (
            vec!["plan", "--budget", "1GiB", &torchscript, "--granularity", "nested"],
            "top-level children",
        ),
    ] {
        refused(&args, &[needle]);
    }
}

#[test]
fn training_with_and_without_checkpointing_gives_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let run = |regex: Option<&str>, name: &str| {
        let out = dir.path().join(name);
        let mut args = vec![
            "train",
            "tiny-gpt2",
            "--seq",
            "16",
            "--batch",
            "2",
            "--steps",
            "3",
            "-o",
            out.to_str().unwrap(),
        ];
        if let Some(r) = regex {
            args.extend(["--checkpoint", r]);
        }
        args.extend(COMMON);
        ok(&args);
        read(&out)["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    let plain = run(None, "plain.json");
    let ckpt = run(Some(r"^(?:h\.0|h\.1)$"), "ckpt.json");
    assert_eq!(plain.len(), 3);
    assert_eq!(plain, ckpt, "bitwise-identical training");
    // Batches are fresh random tokens each step, so the loss need not fall; it must be real.
    assert!(plain.iter().all(|l| l.is_finite() && *l > 0.0), "{plain:?}");
}

#[test]
fn sweep_predictions_are_byte_exact_on_every_subset() {
    let dir = tempfile::tempdir().unwrap();
    for (model, granularity) in [
        (["tiny-bert", "--seq"], "layer"),
        (["tiny-gpt2", "--seq"], "layer"),
        (["tiny-llama", "--seq"], "layer"),
        // A layer, its self_attn, its mlp, or both children, per layer (100 choices).
        (["tiny-llama", "--seq"], "nested"),
        (["tiny-resnet", "--image"], "layer"),
        // Every allowed choice of layers and their children (324), through the binary.
        (["tiny-bert", "--seq"], "nested"),
    ] {
        let size = if model[0] == "tiny-resnet" { "32" } else { "16" };
        let stem = format!("{}-{granularity}", model[0]);
        let profile = dir.path().join(format!("{stem}-profile.json"));
        let sweep = dir.path().join(format!("{stem}-sweep.json"));
        for precision in ["fp32", "bf16"] {
            let mut args = vec![
                "profile",
                model[0],
                model[1],
                size,
                "--batch",
                "2",
                "--precision",
                precision,
                "--granularity",
                granularity,
            ];
            args.extend(["-o", profile.to_str().unwrap()]);
            args.extend(COMMON);
            ok(&args);
            let mut args = vec![
                "sweep",
                model[0],
                model[1],
                size,
                "--batch",
                "2",
                "--precision",
                precision,
                "--granularity",
                granularity,
                "--all-subsets",
            ];
            args.extend([
                "--repeats",
                "1",
                "--profile",
                profile.to_str().unwrap(),
                "-o",
                sweep.to_str().unwrap(),
            ]);
            args.extend(COMMON);
            ok(&args);
            let s = read(&sweep);
            assert_eq!(s["format"], "ckptune.sweep/1");
            let points = s["configs"][0]["points"].as_array().unwrap();
            let want = match (model[0], granularity) {
                ("tiny-bert", "nested") => 324,
                ("tiny-llama", "nested") => 100,
                _ => 8,
            };
            assert!(points.len() >= want, "{}: all subsets", model[0]);
            for p in points {
                assert_eq!(
                    p["peak_bytes"], p["predicted_peak_bytes"],
                    "{} {precision} {}",
                    model[0], p["regex"]
                );
            }
        }
    }
}

#[test]
fn allow_8bit_picks_the_8bit_optimizer_when_only_it_fits_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let shape = ["resnet18", "--image", "32", "--batch", "2", "--precision", "fp32"];
    let mut args = vec!["profile"];
    args.extend(shape);
    args.extend(["--optimizer", "adamw,adamw8bit", "-o", profile.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let p = read(&profile);
    let peak = |opt: &str| {
        p["configs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["config"]["optimizer"] == opt)
            .unwrap()["peak_all"]
            .as_i64()
            .unwrap()
    };
    // State: 2 × 4 bytes per parameter for adamw, about a quarter of that for adamw8bit.
    assert!(
        peak("adamw8bit") < peak("adamw") - 60_000_000,
        "{} vs {}",
        peak("adamw8bit"),
        peak("adamw")
    );
    let budget = ((peak("adamw8bit") + peak("adamw")) / 2).to_string();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(shape);
    args.extend([
        "--allow-8bit",
        "--profile",
        profile.to_str().unwrap(),
        "-o",
        plan.to_str().unwrap(),
    ]);
    args.extend(COMMON);
    ok(&args);
    let v = read(&plan);
    assert_eq!(v["config"]["optimizer"], "adamw8bit");
    let notes = v["notes"].as_array().unwrap();
    assert!(
        notes.iter().any(|n| n.as_str().unwrap().contains("chosen over adamw")),
        "{notes:?}"
    );
    // Without --allow-8bit nothing fits.
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(shape);
    args.extend(["--profile", profile.to_str().unwrap()]);
    args.extend(COMMON);
    assert_eq!(ckptune(&args).status.code(), Some(1));
}

/// `--optimizer-impl`: torch.optim's implementations differ at the optimizer step, the peak of a
/// small-batch ResNet-18 step. foreach holds a temporary per parameter at once (46.8 MB), the
/// single-tensor loop two of the largest parameter and the previous one's (28 MB); under a budget between the two the plan
/// takes the single-tensor loop, says so in the config the user copies, and verifies to the
/// byte.
#[test]
fn optimizer_implementations_are_planned_and_verified() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let shape = [
        "resnet18",
        "--image",
        "32",
        "--batch",
        "2",
        "--precision",
        "fp32",
        "--optimizer",
        "adamw",
    ];
    let mut args = vec!["profile"];
    args.extend(shape);
    args.extend([
        "--optimizer-impl",
        "single,foreach,fused",
        "-o",
        profile.to_str().unwrap(),
    ]);
    args.extend(COMMON);
    ok(&args);
    let p = read(&profile);
    let config = |imp: &str| {
        p["configs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["config"]["optimizer_impl"] == imp)
            .unwrap_or_else(|| panic!("no {imp} config in the profile"))
            .clone()
    };
    let (single, foreach, fused) = (config("single"), config("foreach"), config("fused"));
    let peak = |c: &Value| c["peak_all"].as_i64().unwrap();
    let largest = 512 * 512 * 9 * 4; // layer4's 3×3 convolutions
    assert!(
        peak(&foreach) > peak(&single) + 15_000_000,
        "foreach {} vs single {}",
        peak(&foreach),
        peak(&single)
    );
    assert!(
        peak(&single) > peak(&fused) + largest,
        "single {} vs fused {}",
        peak(&single),
        peak(&fused)
    );

    let budget = ((peak(&single) + peak(&foreach)) / 2).to_string();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(shape);
    args.extend([
        "--optimizer-impl",
        "single,foreach",
        "--profile",
        profile.to_str().unwrap(),
        "--verify",
        "-o",
        plan.to_str().unwrap(),
    ]);
    args.extend(COMMON);
    let out = ok(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    let v = read(&plan);
    assert_eq!(v["config"]["optimizer_impl"], "single", "{text}");
    assert!(text.contains("optimizer adamw (foreach=False)"), "{text}");
    assert!(
        text.contains("fp32/adamw-foreach/mb2x1"),
        "the foreach alternative is listed: {text}"
    );

    // Only foreach allowed: nothing fits.
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(shape);
    args.extend(["--optimizer-impl", "foreach", "--profile", profile.to_str().unwrap()]);
    args.extend(COMMON);
    assert_eq!(ckptune(&args).status.code(), Some(1));

    // An implementation torch.optim lacks, or one for an optimizer with a single one, is exit 2.
    for bad in [
        vec!["--optimizer-impl", "vectorized"],
        vec!["--optimizer", "lion", "--optimizer-impl", "fused"],
    ] {
        let mut args = vec!["profile", "tiny-bert", "--batch", "2", "--seq", "8"];
        args.extend(bad.iter().copied());
        args.extend(COMMON);
        refused(&args, &[]);
    }
}
