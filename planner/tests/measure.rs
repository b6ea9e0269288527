//! `--measure`: memory measured on the meta device equals the CPU's term for term (oneDNN's
//! scratch learned from the one real step that times it), and a model whose step this machine
//! cannot hold is refused before anything runs, with exit 2 and nothing written.

mod common;

use std::path::Path;

use common::{ckptune, ok, read, refused, COMMON};
use serde_json::Value;

/// A profile's configs with every time and count of steps taken out: what measuring on the meta
/// device must reproduce exactly.
fn memory_of(profile: &Value) -> Vec<Value> {
    fn strip(v: &Value) -> Value {
        match v {
            Value::Object(m) => Value::Object(
                m.iter()
                    .filter(|(k, _)| {
                        !["seconds", "spread", "contention", "wall", "steps_run"]
                            .iter()
                            .any(|t| k.contains(t))
                    })
                    .map(|(k, v)| (k.clone(), strip(v)))
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.iter().map(strip).collect()),
            other => other.clone(),
        }
    }
    profile["configs"]
        .as_array()
        .expect("configs")
        .iter()
        .map(strip)
        .collect()
}

fn profile(dir: &Path, name: &str, model: &[&str], measure: &str) -> Value {
    let out = dir.join(format!("{name}-{measure}.json"));
    let mut args = vec!["profile"];
    args.extend(model);
    // SGD: a tiny model under bf16 AdamW can diverge within a profile's steps.
    args.extend([
        "--precision",
        "fp32,bf16",
        "--optimizer",
        "sgd",
        "--measure",
        measure,
        "-o",
        out.to_str().unwrap(),
    ]);
    args.extend(COMMON);
    ok(&args);
    read(&out)
}

#[test]
fn memory_on_the_meta_device_equals_the_cpus_term_for_term() {
    let dir = tempfile::tempdir().unwrap();
    for (name, model) in [
        ("tiny-resnet", &["tiny-resnet", "--batch", "4"][..]),
        ("tiny-bert", &["tiny-bert", "--batch", "4", "--seq", "16"][..]),
    ] {
        let run = profile(dir.path(), name, model, "run");
        let auto = profile(dir.path(), name, model, "auto");
        assert_eq!(memory_of(&auto), memory_of(&run), "{name}");
        let measured = auto["device"]["measured"].as_str().unwrap_or_default();
        assert!(measured.contains("meta device"), "{name}: {measured}");
        assert!(run["device"]["measured"]
            .as_str()
            .unwrap_or_default()
            .contains("real steps"));
        // Times come from the one real step: positive, for every config.
        for c in auto["configs"].as_array().unwrap() {
            assert!(c["seconds_none"]["median"].as_f64().unwrap() > 0.0, "{name}: {c}");
        }
    }
}

/// A Llama config at 70B's size: its step needs terabytes, more than any machine that runs
/// these tests has.
fn huge_llama(dir: &Path) -> String {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn a_step_this_machine_cannot_hold_is_refused_before_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let model = huge_llama(dir.path());
    let out = dir.path().join("profile.json");
    let shape = ["--seq", "4096", "--batch", "1", "--precision", "fp32"];
    let mut args = vec![
        "profile",
        model.as_str(),
        "--measure",
        "run",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend(shape);
    args.extend(COMMON);
    refused(&args, &["for real needs about", "available here", "--measure meta"]);
    assert!(!out.exists());

    let mut args = vec!["train", model.as_str(), "--steps", "1"];
    args.extend(shape);
    args.extend(COMMON);
    refused(&args, &["needs about", "available here"]);

    let plan = dir.path().join("plan.json");
    let mut args = vec![
        "plan",
        "--budget",
        "80GiB",
        model.as_str(),
        "-o",
        plan.to_str().unwrap(),
    ];
    args.extend(shape);
    args.extend(COMMON);
    let out = ckptune(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("needs about") && !err.contains("panicked"), "{err}");
    assert!(!plan.exists());
}
