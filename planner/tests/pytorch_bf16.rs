//! A bf16 BERT plan against PyTorch eager (scripts/bench/eager.py: the reference model,
//! `torch.utils.checkpoint`, autocast's cache on and off), every byte of the difference named:
//! the block input casts as PyTorch's layer input does (a layer checkpointed or not, recomputed
//! or not), and the runtime lets go of a layer's f32 input once the layer's forward is done when
//! it saved only casts of it, as PyTorch frees the previous layer's output, so what is left is
//! the attention mask each side holds (docs/memory-model.md, "Autocast's cache").

mod common;

use std::process::Command;

use common::{ok, read, root};
use serde_json::Value;

// tiny-bert's config (models/src/bert.rs) and the shape the test runs.
const HIDDEN: i64 = 32;
const BATCH: i64 = 2;
const SEQ: i64 = 16;

/// PyTorch eager's peak for the checkpoint set `regex` (a full match), its run's JSON.
fn eager(dir: &std::path::Path, regex: &str, cache: bool, tag: &str) -> Value {
    let out = dir.join(format!("eager-{tag}.json"));
    let (batch, seq) = (BATCH.to_string(), SEQ.to_string());
    let mut args = vec![
        "scripts/bench/eager.py",
        "tiny-bert",
        "--checkpoint",
        regex,
        "--batch",
        &batch,
        "--seq",
        &seq,
        "--precision",
        "bf16",
        "--optimizer",
        "sgd-momentum",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--threads",
        "1",
        "-o",
        out.to_str().unwrap(),
    ];
    if !cache {
        args.push("--no-autocast-cache");
    }
    let run = Command::new(root().join(".venv/bin/python"))
        .args(&args)
        .current_dir(root())
        .output()
        .expect("runs the venv's python");
    assert!(
        run.status.success(),
        "eager.py: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    read(&out)
}

/// PyTorch's peak less the prediction at the predicted moment, the backward or the recompute
/// of `encoder.layer.{at}`: ckptune holds the SDPA bool mask (`[batch, 1, seq, seq]`, a shared
/// input made once per micro-batch) and its additive f32 mask throughout the micro-step; the
/// reference holds the bool mask only while a checkpointed layer at or below the moment keeps
/// it as an input, and no additive mask. The f32 input of a plain layer, which it saves only
/// casts of, is freed after the layer's forward on both sides: no term.
fn named_difference(at: usize, checkpointed: &[usize]) -> i64 {
    let bool_mask_only_ckptune_holds = if checkpointed.iter().any(|&j| j <= at) {
        0
    } else {
        BATCH * SEQ * SEQ
    };
    let additive_mask = BATCH * SEQ * 4;
    -bool_mask_only_ckptune_holds - additive_mask
}

/// With the loop's cache off, the bias casts of the query, key, value and attention output
/// projections that a recompute's peak in ckptune holds and PyTorch's does not: ckptune's
/// per-block autocast region caches within the block whatever the loop does (the casts die with
/// the region), where PyTorch with the cache off frees each after its projection.
fn held_bias_casts(cache: bool, recompute: bool) -> i64 {
    if cache || !recompute {
        0
    } else {
        4 * HIDDEN * 2
    }
}

#[test]
fn a_bf16_bert_plan_differs_from_pytorch_by_the_attention_mask_only() {
    let dir = tempfile::tempdir().unwrap();
    let sets: [(&str, &[usize]); 3] = [("", &[]), ("encoder\\.layer\\.0", &[0]), ("encoder\\.layer\\.1", &[1])];
    for cache in [false, true] {
        let profile = dir.path().join(format!("profile-{cache}.json"));
        let sweep = dir.path().join(format!("sweep-{cache}.json"));
        let (batch, seq) = (BATCH.to_string(), SEQ.to_string());
        let mut common = vec!["tiny-bert", "--batch", &batch, "--seq", &seq, "--precision", "bf16"];
        common.extend(["--optimizer", "sgd-momentum", "--threads", "1", "--quiet", "--no-cache"]);
        if cache {
            common.push("--autocast-cache");
        }
        let mut args = vec!["profile"];
        args.extend(&common);
        args.extend(["-o", profile.to_str().unwrap()]);
        ok(&args);
        let mut args = vec!["sweep"];
        args.extend(&common);
        for (regex, _) in sets {
            args.extend(["--checkpoint", regex]);
        }
        args.extend(["--profile", profile.to_str().unwrap(), "-o", sweep.to_str().unwrap()]);
        ok(&args);
        let points = read(&sweep)["configs"][0]["points"].clone();
        for (i, (regex, checkpointed)) in sets.iter().enumerate() {
            let p = &points[i];
            let predicted = p["predicted_peak_bytes"].as_i64().unwrap();
            assert_eq!(p["peak_bytes"].as_i64().unwrap(), predicted, "{regex}: ckptune's run");
            let moment = p["predicted_moment"].as_str().unwrap();
            let recompute = moment.contains(": recompute ");
            let at = ["backward", "recompute"]
                .iter()
                .find_map(|kind| moment.strip_prefix(&format!("first micro-step: {kind} encoder.layer.")))
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("{regex}, cache {cache}: peak at {moment}, not in a layer's backward"));
            let full = if regex.is_empty() {
                String::new()
            } else {
                format!("^(?:{regex})$")
            };
            let torch = eager(dir.path(), &full, cache, &format!("{i}-{cache}"));
            assert_eq!(torch["attention"], "sdpa");
            assert_eq!(
                torch["peak_bytes"].as_i64().unwrap() - predicted,
                named_difference(at, checkpointed) - held_bias_casts(cache, recompute),
                "{regex}, autocast cache {cache}: PyTorch's peak less the prediction at {moment}"
            );
        }
    }
}
