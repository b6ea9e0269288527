//! `plan --selective` end to end on the built-in tiny Llama: the profile measures every candidate
//! selective (and the cache keeps the two kinds of profile apart), a budget the profile forces
//! makes the solver run layers selective, the plan names them with their policy and prints each
//! candidate's state, its step time counts their selective recomputes, `verify` runs them
//! selective and matches every moment to the byte, and `verify --pytorch` runs them selective
//! through `ckptune.apply`, PyTorch's peak as far from the prediction as with the same modules
//! checkpointed whole; for each policy, `attention` with SDPA and with eager attention.
//! `profile`'s table shows each layer selective beside checkpointed, its recompute estimated
//! where the cost model times the profile. With both policies offered (`--selective` alone), one
//! profile measures each layer under each, the solver's plan names each selective module's
//! policy, and a plan running one layer under each policy is run by `verify` to the byte and by
//! `verify --pytorch` with each module under its own policy. Refusals: an unknown policy, one
//! named twice, nested candidates, a profile without a named policy's step S.

mod common;

use std::path::{Path, PathBuf};

use ckptune_solver::budget::format_size;
use common::{ckptune, edited, ok, read, refused, selective_made_cheap, COMMON};
use serde_json::Value;

const MODEL: [&str; 7] = ["tiny-llama", "--batch", "2", "--seq", "16", "--precision", "fp32"];

/// For the `attention` policy: a sequence other than the head dimension (16), so only the
/// scores are `[..., s, s]`, and long enough that running a layer selective keeps less than
/// keeping it.
const ATTENTION_MODEL: [&str; 7] = ["tiny-llama", "--batch", "2", "--seq", "64", "--precision", "fp32"];

/// bf16 tiny BERT at a sequence other than its head dimension (16) and hidden size (32), so that
/// only the scores have the score shape: its layers save only bf16 casts of their f32 input.
const BERT_BF16: [&str; 7] = ["tiny-bert", "--batch", "2", "--seq", "12", "--precision", "bf16"];

fn profile(path: &Path, flags: &[&str]) -> Value {
    profile_of(&MODEL, path, flags)
}

fn profile_of(model: &[&str], path: &Path, flags: &[&str]) -> Value {
    let mut args = vec!["profile"];
    args.extend(model);
    args.extend(["-o", path.to_str().unwrap(), "--threads", "1", "--quiet"]);
    args.extend(flags);
    ok(&args);
    read(path)
}

fn candidates(config: &Value) -> Vec<&Value> {
    config["regimes"][0]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["candidate"] == true)
        .collect()
}

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_owned())
        .collect()
}

/// `verify` (with `extra` flags) of `plan`: its report.
fn verify(plan: &Path, dir: &Path, extra: &[&str]) -> Value {
    let report = dir.join("verify.json");
    let mut args = vec![
        "verify",
        plan.to_str().unwrap(),
        "-o",
        report.to_str().unwrap(),
        "--quiet",
    ];
    args.extend(extra);
    ok(&args);
    read(&report)
}

#[test]
fn the_profile_measures_every_candidate_selective_and_the_cache_keeps_them_apart() {
    let dir = tempfile::tempdir().unwrap();
    // Cached (no --no-cache): the plain profile after the selective one must not be it.
    let sel = profile(&dir.path().join("sel.json"), &["--selective", "matmul"]);
    let plain = profile(&dir.path().join("plain.json"), &[]);
    for b in candidates(&sel["configs"][0]) {
        assert_eq!(b["selective"]["policy"], "matmul", "{}", b["name"]);
    }
    for b in candidates(&plain["configs"][0]) {
        assert!(b.get("selective").is_none_or(Value::is_null), "{}", b["name"]);
    }
}

#[test]
fn the_profile_table_shows_each_layer_selective_beside_checkpointed_and_estimates_its_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("est.json");
    let mut args = vec!["profile"];
    args.extend(MODEL);
    args.extend(["-o", path.to_str().unwrap(), "--threads", "1", "--no-cache"]);
    args.extend([
        "--selective",
        "matmul",
        "--measure",
        "estimate",
        "--target",
        "cuda:h100",
    ]);
    let out = ok(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    let doc = read(&path);
    let config = &doc["configs"][0];
    assert!(text.contains("if matmul"), "{text}");
    // Signed, as the table prints a block that keeps less than nothing (docs/memory-model.md).
    let size = |v: &Value| match u64::try_from(v.as_i64().unwrap()) {
        Ok(b) => format_size(b),
        Err(_) => format!("-{}", format_size(v.as_i64().unwrap().unsigned_abs())),
    };
    let ms = |v: &Value| format!("{:.1}ms", v.as_f64().unwrap() * 1e3);
    let estimates = config["estimated"]["blocks"].as_array().unwrap();
    let blocks = config["regimes"][0]["blocks"].as_array().unwrap();
    for (i, b) in blocks.iter().enumerate().filter(|(_, b)| b["candidate"] == true) {
        let s = &b["selective"];
        // The estimate's selective recompute is the profile's.
        assert_eq!(estimates[i]["selective_recompute"], s["rec_seconds"], "{}", b["name"]);
        let kept = b["kept_grad"].as_i64().unwrap();
        let row = [
            size(&b["kept_grad"]),
            size(&b["kept_nograd"]),
            size(&Value::from(kept - b["kept_nograd"].as_i64().unwrap())),
            ms(&config["recompute_seconds"][i]),
            size(&s["kept"]),
            size(&Value::from(kept - s["kept"].as_i64().unwrap())),
            ms(&s["rec_seconds"]),
        ];
        let name = b["name"].as_str().unwrap();
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}: {text}"));
        // Sizes print as a number and a unit: compare word by word.
        let printed: Vec<&str> = line.split_whitespace().skip(1).collect();
        let expected: Vec<&str> = row.iter().flat_map(|r| r.split_whitespace()).collect();
        assert_eq!(printed, expected, "{line}");
    }
}

#[test]
fn a_forced_selective_plan_runs_selective_and_matches_the_model_to_the_byte() {
    forced_selective_plan(&MODEL, "matmul", &[]);
}

#[test]
fn a_forced_attention_core_plan_runs_selective_and_matches_the_model_to_the_byte() {
    forced_selective_plan(&ATTENTION_MODEL, "attention", &[]);
    forced_selective_plan(&ATTENTION_MODEL, "attention", &["--attention", "eager"]);
}

/// bf16 BERT under `attention`: a layer's cache keeps its output (the policy saves its last layer
/// norm), which the next block, plain, would let go of after its forward (it saves only bf16
/// casts of it). The profile measures those bytes, the model counts them where a plain block
/// follows a selective one, ckptune's run (a fresh session that only ever runs the plan, as
/// `verify` is) matches every moment, and PyTorch, whose cache keeps the same tensor, peaks below
/// ckptune's run by the additive attention mask alone, which only ckptune holds
/// (planner/tests/pytorch_bf16.rs names it).
#[test]
fn a_plain_block_after_a_selective_one_holds_its_cached_output_in_both_runtimes() {
    let dir = tempfile::tempdir().unwrap();
    let prof_path = dir.path().join("profile.json");
    let prof = profile_of(&BERT_BF16, &prof_path, &["--selective", "attention", "--no-cache"]);
    let (batch, seq, hidden) = (2, 12, 32);
    for b in prof["configs"][0]["regimes"][0]["blocks"].as_array().unwrap() {
        let layer = b["name"].as_str().unwrap().starts_with("encoder.layer.");
        let held = b["selective"]["held_output"].as_i64().unwrap();
        assert_eq!(held, if layer { batch * seq * hidden * 4 } else { 0 }, "{}", b["name"]);
    }
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", "1GiB"];
    args.extend(BERT_BF16);
    args.extend(["--profile", prof_path.to_str().unwrap(), "--selective", "attention"]);
    args.extend(["-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let doc = read(&plan);
    // Layer 0 selective with layer 1 plain after it, in both runtimes; layer 1 selective with
    // the pooler plain after it, in ckptune's (its peak, at layer 1's recompute, would add the
    // bias casts ckptune's per-block autocast region holds there, pytorch_bf16.rs).
    for (layer, pytorch) in [("encoder.layer.0", true), ("encoder.layer.1", false)] {
        let forced = edited(dir.path(), "forced.json", &doc, |d| {
            let ck = &mut d["checkpoint"];
            ck["modules"] = serde_json::json!([layer]);
            ck["regex"] = format!("^(?:{})$", layer.replace('.', "\\.")).into();
            ck["selective"] = serde_json::json!({"policy": "attention", "modules": [layer]});
        });
        if !pytorch {
            let r = verify(&forced, dir.path(), &[]);
            assert_eq!(r["mismatches"], serde_json::json!([]), "{layer}: {r}");
            continue;
        }
        let r = verify(&forced, dir.path(), &["--pytorch", "--steps", "2"]);
        assert_eq!(r["pytorch"]["selective"]["modules"], serde_json::json!([layer]), "{r}");
        assert_eq!(r["ckptune"]["mismatches"], serde_json::json!([]), "{layer}: {r}");
        let ckptune = r["ckptune"]["measured"]["peak_bytes"].as_i64().unwrap();
        let torch = r["pytorch"]["peak_bytes"].as_i64().unwrap();
        let additive_mask = batch * seq * 4;
        assert_eq!(
            torch - ckptune,
            -additive_mask,
            "{layer}: PyTorch's peak less ckptune's: {r}"
        );
    }
}

/// `doc` with `modules` checkpointed, each run selective under `attention` when `selective`,
/// checkpointed whole otherwise, written to `name` in `dir`.
fn checkpointing(dir: &Path, name: &str, doc: &Value, modules: &[&str], selective: bool) -> PathBuf {
    edited(dir, name, doc, |d| {
        let alternatives: Vec<String> = modules.iter().map(|m| m.replace('.', "\\.")).collect();
        let ck = d["checkpoint"].as_object_mut().unwrap();
        ck.insert("regex".into(), format!("^(?:{})$", alternatives.join("|")).into());
        ck.insert("modules".into(), serde_json::json!(modules));
        ck.remove("selective");
        if selective {
            ck.insert(
                "selective".into(),
                serde_json::json!({"policy": "attention", "modules": modules}),
            );
        }
    })
}

/// A plan of `model` (with `extra` flags) forced to run layers selective under `policy`, checked
/// against the model's text, step time and moments, and run in PyTorch.
fn forced_selective_plan(model: &[&str], policy: &str, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let prof_path = dir.path().join("profile.json");
    let mut flags = vec!["--selective", policy, "--no-cache"];
    flags.extend(extra);
    let prof = profile_of(model, &prof_path, &flags);
    // Forced: the layers' selective recomputes nearly free, so the fastest plan under a budget one
    // byte below the peak with nothing checkpointed runs a layer selective.
    let cheap = selective_made_cheap(dir.path(), "cheap.json", &prof, ".layers.");
    let c = &read(&cheap)["configs"][0];
    let budget = (c["peak_none"].as_i64().unwrap() - 1).to_string();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(model);
    args.extend(extra);
    args.extend(["--profile", cheap.to_str().unwrap(), "--selective", policy]);
    args.extend(["-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    let text = String::from_utf8_lossy(&ok(&args).stdout).into_owned();
    let doc = read(&plan);
    let ck = &doc["checkpoint"];
    let (modules, selective) = (names(&ck["modules"]), names(&ck["selective"]["modules"]));
    assert_eq!(ck["selective"]["policy"], policy);
    assert!(
        selective.iter().any(|m| m.starts_with("model.layers.")),
        "the budget forces a selective layer: {ck}"
    );
    assert!(selective.iter().all(|m| modules.contains(m)), "{ck}");
    // Each candidate's state, in the text.
    let states: Vec<String> = candidates(c)
        .iter()
        .map(|b| {
            let name = b["name"].as_str().unwrap();
            let state = if selective.iter().any(|m| m == name) {
                format!("selective ({policy})")
            } else if modules.iter().any(|m| m == name) {
                "full".into()
            } else {
                "keep".into()
            };
            format!("{name} {state}")
        })
        .collect();
    assert!(
        text.contains(&format!("per candidate:    {}", states.join(", "))),
        "{text}"
    );
    // The step time: nothing checkpointed, plus each full recompute, plus each selective one.
    let blocks = c["regimes"][0]["blocks"].as_array().unwrap();
    let mut expected = c["seconds_none"]["median"].as_f64().unwrap();
    for (i, b) in blocks.iter().enumerate() {
        let name = b["name"].as_str().unwrap().to_owned();
        if selective.contains(&name) {
            expected += b["selective"]["rec_seconds"].as_f64().unwrap();
        } else if modules.contains(&name) {
            expected += c["recompute_seconds"][i].as_f64().unwrap();
        }
    }
    let predicted = doc["predicted"]["step_seconds"].as_f64().unwrap();
    assert!(
        (predicted - expected).abs() <= 1e-12 * expected,
        "{predicted} vs {expected}"
    );

    // ckptune's runtime runs them selective: every moment as the model says.
    let r = verify(&plan, dir.path(), &[]);
    assert_eq!(r["mismatches"], serde_json::json!([]), "{r}");
    assert_eq!(r["measured"]["peak_bytes"], doc["predicted"]["peak_bytes"]);

    // PyTorch runs them selective through ckptune.apply (the harness reads each wrapped
    // module's policy back from the module), and the report states its peak against the
    // prediction.
    let torch = verify(&plan, dir.path(), &["--pytorch", "--steps", "2"]);
    assert_eq!(torch["pytorch"]["modules"], ck["modules"]);
    assert_eq!(torch["pytorch"]["selective"], ck["selective"]);
    assert_eq!(torch["ckptune"]["mismatches"], serde_json::json!([]));
    assert_eq!(
        torch["pytorch_peak_error_bytes"].as_i64().unwrap(),
        torch["pytorch"]["peak_bytes"].as_i64().unwrap() - doc["predicted"]["peak_bytes"].as_i64().unwrap()
    );
    // Running them selective moves PyTorch's peak from ckptune's by exactly what checkpointing
    // them whole does (PyTorch's own differences from the model, README's known limits): with
    // its recompute stopped early (PyTorch's default, not ckptune.apply's), the layer's last
    // matmul output stayed cached through its backward, 4,096 B more here.
    let whole = edited(dir.path(), "whole.json", &doc, |d| {
        d["checkpoint"].as_object_mut().unwrap().remove("selective");
    });
    let whole_run = verify(&whole, dir.path(), &["--pytorch", "--steps", "2"]);
    assert_eq!(whole_run["ckptune"]["mismatches"], serde_json::json!([]));
    let gap = |r: &Value| {
        r["pytorch"]["peak_bytes"].as_i64().unwrap() - r["ckptune"]["measured"]["peak_bytes"].as_i64().unwrap()
    };
    assert_eq!(gap(&torch), gap(&whole_run), "{torch}\n{whole_run}");
}

#[test]
fn selective_flags_and_profiles_that_cannot_plan_it_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["profile"];
    args.extend(MODEL);
    args.extend(["--selective", "op"]);
    refused(&args, &["--selective \"op\"", "matmul"]);
    let mut args = vec!["profile"];
    args.extend(MODEL);
    args.extend(["--selective", "matmul,matmul"]);
    refused(&args, &["names matmul twice"]);
    let mut args = vec!["plan", "--budget", "1GiB"];
    args.extend(MODEL);
    args.extend(["--selective", "matmul", "--granularity", "nested"]);
    refused(&args, &["--granularity nested"]);
    let plain = dir.path().join("plain.json");
    profile(&plain, &["--no-cache"]);
    let mut args = vec!["plan", "--budget", "1GiB"];
    args.extend(MODEL);
    args.extend(["--profile", plain.to_str().unwrap(), "--selective", "matmul"]);
    refused(&args, &["was not measured with every candidate selective"]);
    // A profile measured under one policy cannot plan with both.
    let matmul = dir.path().join("matmul.json");
    profile(&matmul, &["--no-cache", "--selective", "matmul"]);
    let mut args = vec!["plan", "--budget", "1GiB"];
    args.extend(MODEL);
    args.extend(["--profile", matmul.to_str().unwrap(), "--selective", "matmul,attention"]);
    refused(&args, &["not measured with every candidate selective under attention"]);
    // The cost model tells the calls a recompute takes from the cache by operator name, which
    // the attention policy's per-call test does not go by.
    let mut args = vec!["plan", "--budget", "1GiB"];
    args.extend(MODEL);
    args.extend(["--selective", "attention", "--measure", "estimate", "--no-cache"]);
    refused(
        &args,
        &["--selective attention", "cannot estimate", "--selective matmul"],
    );
    let out = ckptune(&["plan", "--help"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("--selective [<POLICIES>]"));
}

/// `--selective` alone offers both policies: one profile measures every candidate under each (in
/// `matmul`, `attention` order), the solver's plan names each selective module under one of
/// them, and a plan running the first layer under `matmul` and the second under `attention`
/// (edited from it, as a solver mixing them per layer writes it) runs in ckptune to the byte and in
/// PyTorch with each module under its own policy, PyTorch's peak as far from ckptune's as with
/// every layer under the first layer's policy.
#[test]
fn a_plan_mixing_policies_per_layer_runs_each_layer_under_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let prof = profile_of(
        &ATTENTION_MODEL,
        &dir.path().join("profile.json"),
        &["--selective", "--no-cache"],
    );
    let c = &prof["configs"][0];
    for b in candidates(c) {
        let policies: Vec<&Value> = b["selective"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| &s["policy"])
            .collect();
        assert_eq!(policies, ["matmul", "attention"], "{}", b["name"]);
    }
    let cheap = selective_made_cheap(dir.path(), "cheap.json", &prof, ".layers.");
    let budget = (read(&cheap)["configs"][0]["peak_none"].as_i64().unwrap() - 1).to_string();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(ATTENTION_MODEL);
    args.extend(["--profile", cheap.to_str().unwrap(), "--selective", "matmul,attention"]);
    args.extend(["-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    let text = String::from_utf8_lossy(&ok(&args).stdout).into_owned();
    let doc = read(&plan);
    let ck = &doc["checkpoint"];
    // One policy used: one object, as plans with one policy always were.
    let sel = &ck["selective"];
    assert!(
        ["matmul", "attention"].contains(&sel["policy"].as_str().unwrap()),
        "{ck}"
    );
    assert!(
        names(&sel["modules"]).iter().any(|m| m.starts_with("model.layers.")),
        "{ck}"
    );
    assert!(
        text.contains(&format!("selective ({})", sel["policy"].as_str().unwrap())),
        "{text}"
    );
    let r = verify(&plan, dir.path(), &[]);
    assert_eq!(r["mismatches"], serde_json::json!([]), "{r}");
    assert_eq!(r["measured"]["peak_bytes"], doc["predicted"]["peak_bytes"]);

    let layers = ["model.layers.0", "model.layers.1"];
    let mixed = edited(dir.path(), "mixed.json", &doc, |d| {
        d["checkpoint"]["regex"] = "^(?:model\\.layers\\.(?:0|1))$".into();
        d["checkpoint"]["modules"] = serde_json::json!(layers);
        d["checkpoint"]["selective"] = serde_json::json!([
            {"policy": "matmul", "modules": [layers[0]]},
            {"policy": "attention", "modules": [layers[1]]},
        ]);
    });
    let r = verify(&mixed, dir.path(), &[]);
    assert_eq!(r["mismatches"], serde_json::json!([]), "{r}");
    assert_eq!(r["selective"], read(&mixed)["checkpoint"]["selective"]);
    let torch = verify(&mixed, dir.path(), &["--pytorch", "--steps", "2"]);
    assert_eq!(torch["ckptune"]["mismatches"], serde_json::json!([]));
    assert_eq!(torch["pytorch"]["selective"], read(&mixed)["checkpoint"]["selective"]);
    // The step peaks in the second layer's backward. Whatever the first layer's policy, PyTorch's
    // peak is below ckptune's by exactly what only ckptune holds there: the additive attention
    // bias (`[batch, 1, 1, seq]` f32; the reference's SDPA path builds only the bool mask) and
    // `position_ids` (`[1, seq]` i64, which PyTorch frees when its forward returns). The rotary
    // pair and the SDPA mask are the model's shared inputs in both, which a checkpointed or
    // selective layer keeps as its inputs, whatever it recomputes.
    let matmul = edited(dir.path(), "matmul.json", &read(&mixed), |d| {
        d["checkpoint"]["selective"] = serde_json::json!({"policy": "matmul", "modules": layers});
    });
    let matmul_run = verify(&matmul, dir.path(), &["--pytorch", "--steps", "2"]);
    assert_eq!(
        torch["ckptune"]["peak_moment"],
        "first micro-step: backward model.layers.1"
    );
    assert_eq!(matmul_run["ckptune"]["peak_moment"], torch["ckptune"]["peak_moment"]);
    let gap = |r: &Value| {
        r["pytorch"]["peak_bytes"].as_i64().unwrap() - r["ckptune"]["measured"]["peak_bytes"].as_i64().unwrap()
    };
    let (batch, seq) = (2, 64);
    let only_ckptune = batch * seq * 4 + seq * 8;
    assert_eq!(gap(&torch), -only_ckptune, "{torch}");
    assert_eq!(gap(&matmul_run), -only_ckptune, "{matmul_run}");
    // The first layer under `attention`, or checkpointed whole, leaves the same difference.
    for (name, selective) in [
        (
            "attention.json",
            serde_json::json!({"policy": "attention", "modules": layers}),
        ),
        (
            "full.json",
            serde_json::json!({"policy": "attention", "modules": [layers[1]]}),
        ),
    ] {
        let plan = edited(dir.path(), name, &read(&mixed), |d| {
            d["checkpoint"]["selective"] = selective.clone();
        });
        let run = verify(&plan, dir.path(), &["--pytorch", "--steps", "2"]);
        assert_eq!(run["ckptune"]["mismatches"], serde_json::json!([]), "{name}");
        assert_eq!(gap(&run), -only_ckptune, "{name}: {run}");
    }
}

/// BERT under SDPA builds its `[batch, 1, seq, seq]` bool mask once, and each checkpointed or
/// selective layer keeps it in PyTorch as its input; the runtime holds that mask through the
/// micro-step too (the chain's shared inputs). With every layer under `attention` or checkpointed
/// whole, PyTorch's peak is below ckptune's run by exactly ckptune's additive
/// `[batch, 1, 1, seq]` f32 mask, which the reference's SDPA path never makes.
#[test]
fn bert_layers_under_attention_or_whole_differ_from_pytorch_by_the_additive_mask_alone() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.json");
    let (batch, seq) = (4, 32);
    // The budget of nothing checkpointed, which either run is under.
    let mut args = vec!["plan", "--budget", "100%", "tiny-bert", "--batch", "4", "--seq", "32"];
    args.extend([
        "--precision",
        "fp32",
        "--selective",
        "attention",
        "-o",
        base.to_str().unwrap(),
    ]);
    args.extend(COMMON);
    ok(&args);
    let layers = ["encoder.layer.0", "encoder.layer.1"];
    for (name, selective) in [("attention.json", true), ("whole.json", false)] {
        let plan = checkpointing(dir.path(), name, &read(&base), &layers, selective);
        let r = verify(&plan, dir.path(), &["--pytorch", "--steps", "2"]);
        assert_eq!(r["ckptune"]["mismatches"], serde_json::json!([]), "{name}");
        let gap =
            r["pytorch"]["peak_bytes"].as_i64().unwrap() - r["ckptune"]["measured"]["peak_bytes"].as_i64().unwrap();
        assert_eq!(gap, -(batch * seq * 4), "{name}: {r}");
    }
}

/// BERT under eager attention, a layer selective under `attention` or checkpointed whole, against
/// PyTorch, every byte itemized (BERT-base at batch 2, sequence 512, `encoder.layer.11`: docs/
/// memory-model.md, "Where exactness needs care"). The reference builds the same additive mask as
/// ckptune here, so two mechanisms are left:
/// - the attention's scaling, `scores / sqrt(head_size)`, is `div.Tensor` by an 8-byte wrapped
///   number its backward saves, which a checkpoint's forward keeps until the layer's backward
///   (saved-tensor hooks skip wrapped numbers) and ckptune's checkpointed or selective forward
///   keeps too (`kernels::numbers`): where the step peaks in a recompute, the two runs hold the
///   same numbers (PyTorch was 8 B above per such layer before ckptune kept them);
/// - where it peaks in a layer's VJP, at `output.dense`'s weight gradient, PyTorch is one bias
///   gradient below (hidden 32 × 4 B): the checkpoint, whole or selective, frees the input it
///   unpacked for the Linear's backward before the bias gradient's `sum`, where ckptune's
///   recompute, a plain graph, holds it (python/tests/test_eager.py measures it alone).
#[test]
fn bert_eager_layers_under_attention_or_whole_differ_from_pytorch_by_a_bias_gradient_at_most() {
    let dir = tempfile::tempdir().unwrap();
    let hidden = 32;
    let bias = hidden * 4;
    let layers = |ls: &[usize]| -> Vec<String> { ls.iter().map(|l| format!("encoder.layer.{l}")).collect() };
    // (batch, layers, selective, ckptune's peak moment, PyTorch's peak less ckptune's)
    let cases: [(&str, &[usize], bool, &str, i64); 4] = [
        ("4", &[0, 1], true, "recompute encoder.layer.1", 0),
        ("4", &[0, 1], false, "recompute encoder.layer.0", 0),
        ("2", &[0, 1], true, "backward encoder.layer.1", -bias),
        ("2", &[1], false, "backward encoder.layer.1", -bias),
    ];
    for batch in ["2", "4"] {
        // Sequence 12: neither the head dimension (16) nor the hidden size, so only the scores
        // have the score shape.
        let base = dir.path().join(format!("base-{batch}.json"));
        // A budget every case is under (a selective layer can peak above nothing checkpointed).
        let mut args = vec!["plan", "--budget", "1GiB", "tiny-bert", "--batch", batch, "--seq", "12"];
        args.extend([
            "--precision",
            "fp32",
            "--attention",
            "eager",
            "--selective",
            "attention",
        ]);
        args.extend(["-o", base.to_str().unwrap()]);
        args.extend(COMMON);
        ok(&args);
        for &(_, ls, selective, moment, gap) in cases.iter().filter(|c| c.0 == batch) {
            let modules = layers(ls);
            let modules: Vec<&str> = modules.iter().map(String::as_str).collect();
            let name = format!("b{batch}-{ls:?}-{}", if selective { "attention" } else { "whole" });
            let plan = checkpointing(dir.path(), "plan.json", &read(&base), &modules, selective);
            let r = verify(&plan, dir.path(), &["--pytorch", "--steps", "2"]);
            assert_eq!(r["ckptune"]["mismatches"], serde_json::json!([]), "{name}: {r}");
            assert_eq!(
                r["ckptune"]["peak_moment"],
                format!("first micro-step: {moment}"),
                "{name}: {r}"
            );
            let torch = r["pytorch"]["peak_bytes"].as_i64().unwrap();
            let ckptune = r["ckptune"]["measured"]["peak_bytes"].as_i64().unwrap();
            assert_eq!(torch - ckptune, gap, "{name}: PyTorch's peak less ckptune's: {r}");
        }
    }
}
