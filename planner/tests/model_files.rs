//! Models given as files rather than built-in names, planned and verified by the real binary: a
//! Hugging Face folder with only its config.json (in PyTorch too, for the Llama family), and a
//! state dict that cannot say its head count.

mod common;

use common::{edited, fixture, ok, read, refused, verify, COMMON};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A Hugging Face folder `dir/name` holding only `config`, as its config.json.
fn hf_folder(dir: &Path, name: &str, config: &str) -> PathBuf {
    let folder = dir.join(name);
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("config.json"), config).unwrap();
    folder
}

/// A Hugging Face folder with only its config.json is a MODEL: planned with seeded random
/// weights, and the plan verifies to the byte (the model is rebuilt from the folder).
#[test]
fn a_hugging_face_config_alone_plans_and_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let config = r#"{"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": true}"#;
    let model = hf_folder(dir.path(), "qwen2", config);
    let plan = dir.path().join("plan.json");
    let mut args = vec![
        "plan",
        "--budget",
        "1GiB",
        model.to_str().unwrap(),
        "--seq",
        "8",
        "--batch",
        "2",
        "--precision",
        "fp32",
        "--verify",
        "-o",
        plan.to_str().unwrap(),
    ];
    args.extend(COMMON);
    ok(&args);
    let v = read(&plan);
    assert_eq!(v["format"], "ckptune.plan/1");
    let notes = v["notes"].to_string();
    assert!(
        notes.contains("seeded random weights"),
        "the plan says its weights are random: {notes}"
    );
    let r = verify(&plan, dir.path());
    assert_eq!(r["peak_error_bytes"], 0, "{r}");
}

/// A state dict whose head size is not 64 names the flag that fixes it; with `--heads` it plans,
/// the plan records the heads, and `verify` rebuilds the same model from the plan.
#[test]
fn heads_are_given_for_a_state_dict_that_cannot_say() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny_bert.safetensors");
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", "1GiB", model.as_str(), "--seq", "8", "--batch", "2"];
    args.extend(["--precision", "fp32", "-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    refused(&args, &["--heads"]);
    assert!(!plan.exists(), "nothing is written for bad input");
    args.extend(["--heads", "2"]);
    ok(&args);
    let v = read(&plan);
    assert_eq!(v["shape"]["heads"], 2, "{}", v["shape"]);
    let r = verify(&plan, dir.path());
    assert_eq!(r["peak_error_bytes"], 0, "{r}");
}

/// `verify --pytorch` of a plan made for a Llama-family config.json runs the reference Llama
/// built from its fields: for the built-in tiny Llama's own fields, the same ckptune and PyTorch
/// peaks as the built-in name's plan with the same layer checkpointed. A config.json of another
/// family is refused (exit 2), naming the families it builds.
#[test]
fn a_llama_config_json_verifies_in_pytorch_as_its_built_in_twin() {
    let dir = tempfile::tempdir().unwrap();
    // models/fixtures/reference.py's tiny-llama, field for field.
    let config = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": false}"#;
    let model = hf_folder(dir.path(), "tiny", config);
    let run = |name: &str, tag: &str| -> Value {
        let plan = dir.path().join(format!("{tag}.json"));
        let mut args = vec!["plan", "--budget", "1GiB", name, "--seq", "16", "--batch", "2"];
        args.extend(["--precision", "fp32", "-o", plan.to_str().unwrap()]);
        args.extend(COMMON);
        ok(&args);
        let one = edited(dir.path(), &format!("{tag}-layer.json"), &read(&plan), |d| {
            d["checkpoint"]["regex"] = "^(?:model\\.layers\\.1)$".into();
            d["checkpoint"]["modules"] = serde_json::json!(["model.layers.1"]);
        });
        let report = dir.path().join(format!("{tag}-verify.json"));
        ok(&[
            "verify",
            one.to_str().unwrap(),
            "--pytorch",
            "--steps",
            "3",
            "--quiet",
            "-o",
            report.to_str().unwrap(),
        ]);
        read(&report)
    };
    let built_in = run("tiny-llama", "built-in");
    let from_config = run(model.to_str().unwrap(), "config");
    assert_eq!(
        from_config["ckptune"]["mismatches"],
        serde_json::json!([]),
        "{from_config}"
    );
    for side in ["ckptune", "pytorch"] {
        let peak = |r: &Value| {
            let v = &r[side];
            v["measured"]["peak_bytes"]
                .as_i64()
                .or(v["peak_bytes"].as_i64())
                .unwrap()
        };
        assert_eq!(peak(&from_config), peak(&built_in), "{side}: {from_config}\n{built_in}");
    }
    assert_eq!(from_config["pytorch"]["modules"], serde_json::json!(["model.layers.1"]));

    let config = r#"{"model_type": "bert", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 48, "max_position_embeddings": 32}"#;
    let bert = hf_folder(dir.path(), "bert", config);
    let plan = dir.path().join("bert-plan.json");
    let mut args = vec!["plan", "--budget", "1GiB", bert.to_str().unwrap(), "--seq", "8"];
    args.extend(["--batch", "2", "--precision", "fp32", "-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    refused(
        &["verify", plan.to_str().unwrap(), "--pytorch", "--quiet"],
        &["model_type 'bert'", "llama, mistral, qwen2"],
    );
}
