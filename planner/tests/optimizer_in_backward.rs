//! `--optimizer-step`: the optimizer step in backward as a config dimension. A plan made with
//! it records the choice, and verifying it runs the step in backward and matches every moment
//! of the model to the byte; both values let the solver choose among both kinds of config; what
//! cannot step in backward is refused (exit 2, naming why, nothing written).

mod common;

use common::{ckptune, execute_snippet, ok, read, refused, verify, COMMON};

/// The fp32 tiny GPT-2 (its lm_head tied to wte) at batch 2, sequence 16.
const GPT2: [&str; 7] = ["tiny-gpt2", "--batch", "2", "--seq", "16", "--precision", "fp32"];

#[test]
fn a_plan_in_backward_records_it_and_verifies_to_the_byte() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", "50%", "--optimizer-step", "in-backward"];
    args.extend(GPT2);
    args.extend(["-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    let text = String::from_utf8_lossy(&ok(&args).stdout).into_owned();
    assert!(
        text.contains("optimizer step in backward (ckptune.optimizer_in_backward)"),
        "{text}"
    );
    let doc = read(&plan);
    assert_eq!(doc["config"]["optimizer_in_backward"], true, "{}", doc["config"]);
    let r = verify(&plan, dir.path());
    assert_eq!(r["config"]["optimizer_in_backward"], true);
    assert_eq!(r["mismatches"], serde_json::json!([]), "{r}");
    assert_eq!(r["measured"]["peak_bytes"], doc["predicted"]["peak_bytes"]);
    // A trainer's snippet steps after backward: verifying the plan in it is refused.
    let p = plan.to_str().unwrap();
    refused(
        &["verify", "--pytorch", p, "--trainer", "hf", "--steps", "2", "--quiet"],
        &["--trainer hf", "steps the optimizer in backward", "--trainer eager"],
    );
}

#[test]
fn both_steps_are_configs_the_solver_chooses_among() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", "100%", "--optimizer-step", "after,in-backward"];
    args.extend(GPT2);
    args.extend(["-o", plan.to_str().unwrap(), "--measure", "meta"]);
    args.extend(COMMON);
    ok(&args);
    let doc = read(&plan);
    let alternatives = doc["alternatives"].as_array().unwrap();
    let in_backward = |a: &serde_json::Value| a["config"]["optimizer_in_backward"].as_bool().unwrap_or(false);
    assert_eq!(alternatives.len(), 2, "{alternatives:?}");
    assert!(alternatives.iter().any(in_backward) && !alternatives.iter().all(in_backward));
    // The chosen config is the fastest alternative that fits.
    let fastest = alternatives
        .iter()
        .filter(|a| a["feasible"] == true)
        .min_by(|a, b| {
            let s = |v: &serde_json::Value| v["predicted"]["step_seconds"].as_f64().unwrap();
            s(a).total_cmp(&s(b))
        })
        .unwrap();
    assert_eq!(fastest["config"], doc["config"]);
}

#[test]
fn what_cannot_step_in_backward_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let o = out.to_str().unwrap();
    let plan = |extra: &[&'static str]| {
        let mut args = vec![
            "plan",
            "--budget",
            "100%",
            "tiny-gpt2",
            "--seq",
            "8",
            "--batch",
            "2",
            "-o",
            o,
        ];
        args.extend(extra);
        args.extend(COMMON);
        args
    };
    for (extra, says) in [
        (
            &["--optimizer-step", "in-backward", "--global-batch", "4"][..],
            &["cannot step its optimizer in backward", "gradient accumulation 2"][..],
        ),
        (
            &["--optimizer-step", "in-backward", "--optimizer", "adamw8bit"],
            &["adamw8bit updates its parameters as one list"],
        ),
        (
            &["--optimizer-step", "in-backward", "--zero-grad-in-place"],
            &["set_to_none=false"],
        ),
        (
            &["--optimizer-step", "sideways"],
            &["--optimizer-step \"sideways\"", "in-backward"],
        ),
        (
            &["--optimizer-step", "in-backward", "--shard", "2"],
            &["--shard --optimizer-step in-backward"],
        ),
    ] {
        refused(&plan(extra), says);
        assert!(!out.exists(), "{extra:?}: nothing written");
    }
}

/// A plan's PyTorch run (`verify --pytorch`, eager with `ckptune.optimizer_in_backward`) and
/// ckptune's, side by side: the report after `plan` with `flags`.
fn verify_pytorch(dir: &std::path::Path, budget: &str, model: &[&str], flags: &[&str]) -> serde_json::Value {
    let plan = dir.join("plan.json");
    let mut args = vec!["plan", "--budget", budget, "--batch", "2", "--precision", "fp32"];
    args.extend(model);
    args.extend(flags);
    args.extend(["-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let report = dir.join("torch.json");
    let out = ckptune(&[
        "verify",
        "--pytorch",
        plan.to_str().unwrap(),
        "--steps",
        "3",
        "-o",
        report.to_str().unwrap(),
        "--quiet",
    ]);
    // Exit 1 says a peak is over the budget; at 0% the budget is the prediction, and PyTorch's
    // peak may exceed it by the known limits. The report is written either way.
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    read(&report)
}

#[test]
fn pytorch_stepping_in_backward_peaks_at_the_prediction() {
    let dir = tempfile::tempdir().unwrap();
    // The tiny ResNet: PyTorch's peak is the prediction to the byte, with nothing and with
    // layers checkpointed (budget 0%), for AdamW and SGD with momentum.
    let resnet = ["tiny-resnet", "--image", "32"];
    for budget in ["100%", "0%"] {
        for optimizer in ["adamw", "sgd-momentum"] {
            let r = verify_pytorch(
                dir.path(),
                budget,
                &resnet,
                &["--optimizer", optimizer, "--optimizer-step", "in-backward"],
            );
            let what = format!("tiny-resnet {budget} {optimizer}");
            assert_eq!(r["pytorch"]["optimizer_in_backward"], true, "{what}");
            assert_eq!(r["ckptune"]["mismatches"], serde_json::json!([]), "{what}");
            assert_eq!(r["pytorch_peak_error_bytes"], 0, "{what}: {}", r["pytorch"]);
        }
    }
    // PyTorch's distance from the prediction, stepping after backward or in it.
    let gap = |model: &[&str], budget: &str, step: &str| {
        let r = verify_pytorch(dir.path(), budget, model, &["--optimizer-step", step]);
        assert_eq!(
            r["ckptune"]["mismatches"],
            serde_json::json!([]),
            "{model:?} {budget} {step}"
        );
        r["pytorch_peak_error_bytes"].as_i64().unwrap()
    };
    // The tiny BERT, with nothing and with layers checkpointed: the distance it has stepping
    // after backward (README's known limits: its additive mask, a checkpointed layer's wrapped
    // numbers), nothing more.
    let bert = ["tiny-bert", "--seq", "16"];
    for budget in ["100%", "0%"] {
        assert_eq!(
            gap(&bert, budget, "in-backward"),
            gap(&bert, budget, "after"),
            "tiny-bert {budget}"
        );
    }
    // The tiny Llama: PyTorch's peak is in lm_head's hook, after lm_head's matmul backward freed
    // the final norm's [batch 2, 16 tokens, hidden 32] f32 output, which the runtime's block
    // boundary keeps until model.norm's backward (docs/memory-model.md).
    let llama = ["tiny-llama", "--seq", "16"];
    let norm_output = 2 * 16 * 32 * 4;
    assert_eq!(
        gap(&llama, "100%", "in-backward"),
        gap(&llama, "100%", "after") - norm_output
    );
}

/// SmolLM2-135M's shape in miniature: a Llama config.json with tied embeddings whose loss is the
/// peak (vocabulary 8,192 at 2 x 128 tokens, two layers).
const TIED_LLAMA: &str = r#"{"model_type": "llama", "vocab_size": 8192, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rope_theta": 100000, "tie_word_embeddings": true}"#;

/// `LlamaModel.forward` makes the rotary pair and the causal mask once, and a checkpointed
/// layer keeps them as its inputs through the loss. The runtime holds those same tensors
/// through the micro-step (`models::chain::SharedInputs`), so PyTorch is never above the
/// prediction. It is below it by exactly what only ckptune holds at the loss: the additive
/// attention bias (`[batch, 1, 1, seq]` f32, which the reference's SDPA path never makes), and
/// `position_ids` (`[1, seq]` i64, freed by PyTorch when its forward returns). With no layer
/// checkpointed, also the SDPA mask (`[batch, 1, seq, seq]` bool), which no layer's graph keeps.
#[test]
fn a_tied_llama_peaking_at_its_loss_is_not_under_predicted() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("tied-llama");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("config.json"), TIED_LLAMA).unwrap();
    let model = [folder.to_str().unwrap(), "--seq", "128"];
    let (batch, seq) = (2, 128);
    let only_ckptune = batch * seq * 4 + seq * 8;
    for step in ["in-backward", "after"] {
        for (budget, checkpointed, mask) in [("0%", true, 0), ("100%", false, batch * seq * seq)] {
            let flags = ["--optimizer", "adamw", "--optimizer-step", step];
            let r = verify_pytorch(dir.path(), budget, &model, &flags);
            let what = format!("{step} {budget}");
            assert_eq!(r["ckptune"]["mismatches"], serde_json::json!([]), "{what}");
            assert_eq!(r["ckptune"]["peak_moment"], "first micro-step: loss", "{what}");
            let modules = r["ckptune"]["modules"].as_array().unwrap();
            assert_eq!(
                modules.iter().any(|m| m == "model.layers.0") && modules.iter().any(|m| m == "model.layers.1"),
                checkpointed,
                "{what}: {modules:?}"
            );
            assert_eq!(
                r["pytorch_peak_error_bytes"],
                -(only_ckptune + mask),
                "{what}: {}",
                r["pytorch"]
            );
        }
    }
}

/// `GPT2Model.forward` makes the padded batch's SDPA mask once and hands it to every block, so a
/// checkpointed layer keeps it as its input through the loss; the GPT-2 chain holds it through
/// the micro-step as a shared input, so PyTorch is not above the prediction (it was, by the
/// mask, where each attention made its own). It is below it by at most what only ckptune holds:
/// the additive attention bias, and with no layer checkpointed the mask.
#[test]
fn a_gpt2_under_sdpa_with_its_layers_checkpointed_is_not_under_predicted() {
    let dir = tempfile::tempdir().unwrap();
    let model = ["tiny-gpt2", "--seq", "32"];
    let (batch, seq) = (2, 32);
    let bias = batch * seq * 4;
    for (budget, checkpointed, mask) in [("0%", true, 0), ("100%", false, batch * seq * seq)] {
        let r = verify_pytorch(dir.path(), budget, &model, &["--optimizer", "adamw"]);
        assert_eq!(r["ckptune"]["mismatches"], serde_json::json!([]), "{budget}");
        let modules = r["ckptune"]["modules"].as_array().unwrap();
        assert_eq!(
            modules.iter().any(|m| m == "h.0"),
            checkpointed,
            "{budget}: {modules:?}"
        );
        let error = r["pytorch_peak_error_bytes"].as_i64().unwrap();
        assert!(
            error <= 0 && error >= -(bias + mask),
            "{budget}: PyTorch {error} B from the prediction: {}",
            r["pytorch"]
        );
    }
}

/// The plan's python snippet trains the reference with `ckptune.optimizer_in_backward` (one
/// optimizer per parameter, no `opt.step()`): every candidate runs once per step and the plan's
/// modules twice (their recompute), and the weights change.
#[test]
fn the_python_snippet_steps_in_backward() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let bert = ["tiny-bert", "--batch", "2", "--seq", "16", "--precision", "fp32"];
    let mut args = vec!["plan", "--budget", "50%", "--optimizer-step", "in-backward"];
    args.extend(bert);
    args.extend(["-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let doc = read(&plan);
    let snippet = String::from_utf8(ok(&["emit", "python", plan.to_str().unwrap()]).stdout).unwrap();
    assert!(
        snippet.contains("opt = ckptune.optimizer_in_backward(model.parameters()"),
        "{snippet}"
    );
    assert!(!snippet.contains("opt.step()\n"), "{snippet}");
    let names = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_owned())
            .collect()
    };
    let planned = names(&doc["checkpoint"]["modules"]);
    assert!(!planned.is_empty(), "the budget checkpoints something");
    let watch: Vec<String> = doc["model"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["candidate"] == true)
        .map(|b| b["name"].as_str().unwrap().to_owned())
        .collect();
    let result = execute_snippet("python", &snippet, "tiny-bert", 2, &watch);
    let micro = result["micro_steps"].as_u64().unwrap();
    for name in &watch {
        let expected = if planned.contains(name) { 2 * micro } else { micro };
        assert_eq!(result["calls"][name].as_u64(), Some(expected), "{name}: {result}");
    }
    assert_eq!(result["trained"], true, "{result}");
}

/// Asked for both steps, a micro-batch that needs gradient accumulation is planned stepping
/// after backward only, and the plan's notes say which config was left out and why.
#[test]
fn configs_that_cannot_step_in_backward_are_left_out_with_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", "100%", "--optimizer-step", "after,in-backward"];
    args.extend([
        "tiny-bert",
        "--seq",
        "8",
        "--batch",
        "2,4",
        "--global-batch",
        "4",
        "--precision",
        "fp32",
    ]);
    args.extend(["-o", plan.to_str().unwrap(), "--measure", "meta"]);
    args.extend(COMMON);
    ok(&args);
    let doc = read(&plan);
    let labels: Vec<(i64, bool)> = doc["alternatives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let c = &a["config"];
            (c["grad_accum"].as_i64().unwrap(), c["optimizer_in_backward"] == true)
        })
        .collect();
    assert_eq!(labels.len(), 3, "{labels:?}");
    assert!(!labels.contains(&(2, true)), "{labels:?}");
    let notes = doc["notes"].to_string();
    assert!(
        notes.contains("1 config(s) cannot step the optimizer in backward and were left out"),
        "{notes}"
    );
}
