//! Models given as files rather than built-in names, planned and verified by the real binary: a
//! Hugging Face folder with only its config.json, and a state dict that cannot say its head
//! count.

mod common;

use common::{fixture, ok, read, refused, verify, COMMON};

/// A Hugging Face folder with only its config.json is a MODEL: planned with seeded random
/// weights, and the plan verifies to the byte (the model is rebuilt from the folder).
#[test]
fn a_hugging_face_config_alone_plans_and_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen2");
    std::fs::create_dir(&model).unwrap();
    let config = r#"{"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": true}"#;
    std::fs::write(model.join("config.json"), config).unwrap();
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
