//! The checkpoint regex over the zoo's own module names (each model's list has one source, its
//! `Config::module_names`, which the plans are made against): exact, and meaning the same thing
//! to Python's `re` as to us: for many random selections, `re.match` and `re.fullmatch` select
//! exactly the chosen module names.

use std::io::Write;
use std::process::{Command, Stdio};

use ckptune_models::{bert, resnet};
use ckptune_solver::regex_emit::checkpoint_regex;
use expect_test::expect;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use regex::Regex;
use serde_json::json;

/// Reads `[[pattern, [names…]], …]` from stdin; prints, per case, the names `re.match`
/// selects and the names `re.fullmatch` selects.
const SCRIPT: &str = r#"
import json, re, sys
cases = json.load(sys.stdin)
out = []
for pattern, names in cases:
    r = re.compile(pattern)
    out.append([[n for n in names if r.match(n)], [n for n in names if r.fullmatch(n)]])
json.dump(out, sys.stdout)
"#;

/// `.cargo/config.toml` sets CKPTUNE_PYTHON to the venv's interpreter as an absolute path.
fn python() -> String {
    std::env::var("CKPTUNE_PYTHON")
        .ok()
        .or_else(|| option_env!("CKPTUNE_PYTHON").map(str::to_string))
        .expect("CKPTUNE_PYTHON is not set: run `scripts/setup`, then run the tests through cargo (.cargo/config.toml sets it)")
}

fn run_python(cases: &serde_json::Value) -> Vec<(Vec<String>, Vec<String>)> {
    let py = python();
    let mut child = Command::new(&py)
        .arg("-c")
        .arg(SCRIPT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run the Python interpreter {py:?} ({e}); run `scripts/setup` to create it"));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(cases.to_string().as_bytes())
        .expect("writing cases to Python");
    let out = child.wait_with_output().expect("waiting for Python");
    assert!(out.status.success(), "Python failed: {}", out.status);
    serde_json::from_slice(&out.stdout).expect("Python's answer is JSON")
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn resnet_stages_and_blocks() {
    let all = resnet::Config::resnet101().module_names();
    let re = checkpoint_regex(&names(&["layer1", "layer3.0", "layer3.1", "layer3.22"]), &all).unwrap();
    expect![[r#"^(?:layer1|layer3\.(?:0|1|22))$"#]].assert_eq(&re);
    let r = Regex::new(&re).unwrap();
    assert!(r.is_match("layer3.22") && !r.is_match("layer3.2") && !r.is_match("layer1.0"));
    let re = checkpoint_regex(&names(&["layer4.0.downsample.0", "fc"]), &all).unwrap();
    expect![[r#"^(?:layer4\.0\.downsample\.0|fc)$"#]].assert_eq(&re);
}

#[test]
fn bert_layers() {
    let all = bert::Config::bert_base_uncased().module_names();
    let chosen: Vec<String> = (0..12).step_by(2).map(|l| format!("encoder.layer.{l}")).collect();
    let re = checkpoint_regex(&chosen, &all).unwrap();
    expect![[r#"^(?:encoder\.layer\.(?:0|2|4|6|8|10))$"#]].assert_eq(&re);
    let re = checkpoint_regex(&names(&["encoder.layer.11.output.LayerNorm", "pooler"]), &all).unwrap();
    expect![[r#"^(?:encoder\.layer\.11\.output\.LayerNorm|pooler)$"#]].assert_eq(&re);
}

#[test]
fn python_re_selects_exactly_the_chosen_modules() {
    let families = [
        resnet::Config::resnet50().module_names(),
        resnet::Config::resnet152().module_names(),
        bert::Config::bert_base_uncased().module_names(),
        bert::Config::bert_large_uncased().module_names(),
        // Prefix traps: `layer1` must not select `layer10`, `layer1.0` or `layer1x`.
        [
            "",
            "layer1",
            "layer10",
            "layer1.0",
            "layer1x",
            "layer1.0.a+b",
            "x.layer1",
            "a b",
            "m.x-y#z",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    ];
    let mut rng = StdRng::seed_from_u64(42);
    let mut cases = Vec::new();
    let mut chosen_sets = Vec::new();
    for all in &families {
        for _ in 0..60 {
            // Sparse, dense and empty selections.
            let p = [0.0, 0.02, 0.2, 0.7, 1.0][rng.random_range(0..5)];
            let chosen: Vec<String> = all.iter().filter(|_| rng.random_bool(p)).cloned().collect();
            let pattern = checkpoint_regex(&chosen, all).unwrap();
            cases.push(json!([pattern, all]));
            chosen_sets.push(chosen);
        }
    }
    let answers = run_python(&serde_json::Value::Array(cases.clone()));
    assert_eq!(answers.len(), cases.len());
    for ((case, chosen), (by_match, by_fullmatch)) in cases.iter().zip(&chosen_sets).zip(answers) {
        assert_eq!(&by_match, chosen, "re.match with {}", case[0]);
        assert_eq!(&by_fullmatch, chosen, "re.fullmatch with {}", case[0]);
    }
}
