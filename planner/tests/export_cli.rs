//! `torch.export` programs (`.pt2`) through the real `ckptune` binary: the profile's prediction
//! equals the measured peak on every checkpoint subset, and bad programs exit 2 naming the node.

mod common;

use common::{fixture, ok, refused, COMMON};
use serde_json::Value;

#[test]
fn exported_resnet_sweep_is_byte_exact_on_every_subset() {
    let dir = tempfile::tempdir().unwrap();
    for (file, granularity, candidates) in [
        ("tiny_resnet.pt2", "layer", None),
        ("tiny_resnet.pt2", "block", None),
        ("tiny_resnet.pt2", "layer", Some(r"layer[23]|fc")),
        // Core ATen: functional batch norm, statistics written back as buffer mutations.
        ("tiny_resnet_core.pt2", "layer", None),
        // Token ids and their attention mask; every layer computes its bias from the mask.
        ("tiny_bert.pt2", "layer", None),
        // The mask computed inside `bert`, rotary cos/sin and a causal mask inside `model`, and
        // the same from transformers itself (models/fixtures/make_hf_export_fixtures.py).
        ("tiny_bert_hf.pt2", "layer", None),
        ("tiny_llama.pt2", "layer", None),
        ("hf_bert.pt2", "layer", None),
        ("hf_llama.pt2", "layer", None),
        ("hf_gpt2.pt2", "layer", None),
        // Its decoder layers' children: the residual sums read the layer input, not the norm's
        // no-op cast of it.
        ("hf_llama.pt2", "block", None),
    ] {
        let model = fixture(file);
        // fp32 here to keep the binary's sweeps short; runtime/tests/export.rs checks the exported
        // model's bf16 peaks and gradients in-process.
        for precision in ["fp32"] {
            let profile = dir
                .path()
                .join(format!("{file}-{granularity}-{precision}-profile.json"));
            let sweep = dir.path().join(format!("{file}-{granularity}-{precision}-sweep.json"));
            let mut shared = vec![
                model.as_str(),
                "--batch",
                "2",
                "--precision",
                precision,
                "--granularity",
                granularity,
            ];
            if let Some(c) = candidates {
                shared.extend(["--candidates", c]);
            }
            shared.extend(COMMON);
            let mut args = vec!["profile"];
            args.extend(&shared);
            args.extend(["-o", profile.to_str().unwrap()]);
            ok(&args);
            let mut args = vec!["sweep"];
            args.extend(&shared);
            args.extend([
                "--all-subsets",
                "--repeats",
                "1",
                "--profile",
                profile.to_str().unwrap(),
                "-o",
                sweep.to_str().unwrap(),
            ]);
            ok(&args);
            let s: Value = serde_json::from_str(&std::fs::read_to_string(&sweep).unwrap()).unwrap();
            let points = s["configs"][0]["points"].as_array().unwrap();
            let want = if granularity == "block" && file.contains("llama") {
                256
            } else if file.contains("bert") || file.contains("llama") || file.contains("gpt2") {
                4
            } else if candidates.is_some() {
                8
            } else {
                16
            };
            assert_eq!(points.len(), want, "{granularity} {candidates:?}: all subsets");
            for p in points {
                assert_eq!(
                    p["peak_bytes"], p["predicted_peak_bytes"],
                    "{file} {granularity} {candidates:?} {precision} {}",
                    p["regex"]
                );
            }
        }
    }
}

#[test]
fn bad_programs_exit_2_naming_the_node_and_the_fix() {
    let static_mlp = fixture("tiny_mlp_static.pt2");
    let custom = fixture("custom_op.pt2");
    let cond = fixture("cond.pt2");
    let meta = fixture("hf_bert_meta.pt2");
    let moe = fixture("moe_nonzero.pt2");
    let llama = fixture("hf_llama.pt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let plan = plan.to_str().unwrap();
    for (args, needles) in [
        (
            vec!["plan", "--budget", "1GiB", &static_mlp, "--batch", "8"],
            vec!["static batch of 2", r#"torch.export.Dim("batch")"#],
        ),
        (
            vec!["plan", "--budget", "1GiB", &custom],
            vec!["node twice", "torch.ops.ckptune_test.twice.default", "TORCH_LIBRARY"],
        ),
        (
            vec!["plan", "--budget", "1GiB", &cond],
            vec!["torch.ops.higher_order.cond", "data-dependent control flow"],
        ),
        (
            vec!["plan", "--budget", "1GiB", &meta, "--measure", "run", "--output", plan],
            vec![
                "exported on the meta device",
                "holds no weights",
                "--measure auto or estimate",
            ],
        ),
        (
            vec!["plan", "--budget", "1GiB", &meta, "--measure", "meta", "--output", plan],
            vec![
                "exported on the meta device",
                "no real step can time it",
                "--measure auto or estimate",
            ],
        ),
        (
            vec!["plan", "--budget", "90%", &meta, "--verify", "--output", plan],
            vec![
                "exported on the meta device",
                "holds no weights",
                "exported with its weights",
            ],
        ),
        (
            vec!["plan", "--budget", "1GiB", &moe, "--output", plan],
            vec!["node nonzero", "depends on tensor values"],
        ),
        (
            vec![
                "plan",
                "--budget",
                "1GiB",
                &llama,
                "--precision",
                "bf16-pure",
                "--output",
                plan,
            ],
            vec![
                "--precision bf16-pure",
                "traced with fp32 parameters",
                "model.to(torch.bfloat16)",
            ],
        ),
        (
            vec!["plan", "--budget", "1GiB", "/nonexistent/model.pt2"],
            vec!["does not exist"],
        ),
    ] {
        let err = refused(&args, &needles);
        assert!(
            !err.contains("Exception raised from"),
            "{args:?}: a C++ traceback: {err}"
        );
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
}

/// Every export fixture, profiled under what a step may do differently from the load-time trial
/// (fp32 at the exported batch): bf16 parameters, autocast, another batch, a step on the meta
/// device. Each profiles or is refused with exit 2 and a message, never a panic (exit 101) or a
/// C++ traceback; a node that fails in the step is named with its block, its operator and what
/// to do (`fixed_dtype.pt2` fails so under bf16 parameters, `hf_bert_eager.pt2` too).
#[test]
fn every_export_fixture_fails_only_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("profile.json");
    let out = out.to_str().unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/fixtures");
    let mut programs: Vec<String> = std::fs::read_dir(&fixtures)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pt2"))
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    programs.sort();
    assert!(programs.len() > 20, "{programs:?}");
    let mut step_failures = Vec::new();
    for program in &programs {
        for setting in [
            ["--precision", "bf16-pure"],
            ["--precision", "bf16"],
            ["--batch", "3"],
            ["--measure", "meta"],
        ] {
            let mut args = vec!["profile", program.as_str(), "--repeats", "1", "-o", out];
            args.extend(setting);
            args.extend(COMMON);
            let run = common::ckptune(&args);
            let err = String::from_utf8_lossy(&run.stderr).into_owned();
            match run.status.code() {
                Some(0) => {}
                Some(2) => {
                    assert!(err.starts_with("error: "), "{args:?}: {err}");
                    for bad in ["panicked", "Exception raised from", "RUST_BACKTRACE"] {
                        assert!(!err.contains(bad), "{args:?}: {err}");
                    }
                    // A node that fails in the step, forward or backward, is named with its
                    // block and operator.
                    let in_step = ["the program ran on a sample batch", ") fails ("];
                    if in_step.iter().any(|s| err.contains(s)) {
                        for needle in [": block ", "node ", "torch.ops."] {
                            assert!(err.contains(needle), "{args:?}: {needle:?} not in {err}");
                        }
                        step_failures.push((program.rsplit('/').next().unwrap().to_string(), setting, err));
                    }
                }
                code => panic!("{args:?} exited {code:?}: {err}"),
            }
        }
    }
    let fixed = step_failures
        .iter()
        .find(|(p, s, _)| p == "fixed_dtype.pt2" && s[1] == "bf16-pure")
        .map(|(_, _, err)| err)
        .expect("fixed_dtype.pt2 fails in a bf16-pure step");
    for needle in [
        "block mix",
        "node matmul",
        "torch.ops.aten.matmul.default",
        "same dtype",
        "plan another --precision",
    ] {
        assert!(fixed.contains(needle), "{needle:?} not in {fixed}");
    }
}

/// A node whose backward fails (an operator without a derivative; an in-place write of a tensor
/// an earlier node saved for backward), which the load-time forward trial cannot see, fails the
/// step with exit 2 naming its block, the node, its operator and what to do, whether the block
/// runs plain or checkpointed (its backward after a recompute), measured for real or on the meta
/// device, and writes nothing.
#[test]
fn a_node_whose_backward_fails_exits_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.json");
    let out = out.to_str().unwrap();
    for (file, node, target) in [
        (
            "no_derivative.pt2",
            "node special_zeta",
            "torch.ops.aten.special_zeta.other_scalar",
        ),
        ("writes_saved.pt2", "node mul_", "torch.ops.aten.mul_.Tensor"),
    ] {
        let model = fixture(file);
        for measure in ["run", "meta"] {
            for checkpoint in ["", "mid"] {
                let mut args = vec![
                    "sweep",
                    model.as_str(),
                    "--measure",
                    measure,
                    "--checkpoint",
                    checkpoint,
                    "--repeats",
                    "1",
                    "-o",
                    out,
                ];
                args.extend(COMMON);
                let err = refused(
                    &args,
                    &[
                        "block mid",
                        node,
                        target,
                        "the backward of",
                        "register_autograd",
                        "x.clone()",
                    ],
                );
                for bad in ["Exception raised from", "Hint:"] {
                    assert!(!err.contains(bad), "{args:?}: {err}");
                }
            }
        }
        let args = ["plan", "--budget", "1GiB", model.as_str(), "--output", out];
        refused(&args, &["block mid", node, target]);
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
}

#[test]
fn exported_residual_stack_sweeps_byte_exact_with_nested_groups_and_dropout() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny_stack.pt2");
    // Layer granularity: all 8 subsets. Nested: a layer or its children (fc1, act, fc2, drop;
    // the residual sum is glue inside the group), chosen subsets of the 17^3.
    let nested = [
        "",
        r"layers\.0",
        r"layers\.1",
        r"layers\.0|layers\.2",
        r"layers\.1\.fc1",
        r"layers\.1\.(fc1|fc2)",
        r"layers\.1\.drop",
        r"layers\.0|layers\.1\.act|layers\.2\.fc2",
        r"layers\.\d\.(fc1|act|fc2|drop)",
    ];
    for (granularity, checkpoints) in [("layer", &[][..]), ("nested", &nested[..])] {
        for precision in ["fp32", "bf16"] {
            let profile = dir.path().join(format!("{granularity}-{precision}-profile.json"));
            let sweep = dir.path().join(format!("{granularity}-{precision}-sweep.json"));
            let mut shared = vec![
                model.as_str(),
                "--batch",
                "4",
                "--precision",
                precision,
                "--granularity",
                granularity,
            ];
            shared.extend(COMMON);
            let mut args = vec!["profile"];
            args.extend(&shared);
            args.extend(["-o", profile.to_str().unwrap()]);
            ok(&args);
            let mut args = vec!["sweep"];
            args.extend(&shared);
            if checkpoints.is_empty() {
                args.push("--all-subsets");
            }
            for c in checkpoints {
                args.extend(["--checkpoint", c]);
            }
            args.extend([
                "--repeats",
                "1",
                "--profile",
                profile.to_str().unwrap(),
                "-o",
                sweep.to_str().unwrap(),
            ]);
            ok(&args);
            let s: Value = serde_json::from_str(&std::fs::read_to_string(&sweep).unwrap()).unwrap();
            let points = s["configs"][0]["points"].as_array().unwrap();
            let want = if checkpoints.is_empty() { 8 } else { checkpoints.len() };
            assert_eq!(points.len(), want, "{granularity}: every subset measured");
            for p in points {
                assert_eq!(
                    p["peak_bytes"], p["predicted_peak_bytes"],
                    "{granularity} {precision} {}",
                    p["regex"]
                );
            }
        }
    }
}

/// Profiles `file`, sweeps `checkpoints` (every subset when empty) and asserts every point's
/// predicted peak equals its measured one.
fn sweep_is_exact(file: &str, granularity: &str, precision: &str, checkpoints: &[&str]) {
    sweep_is_exact_with(file, granularity, precision, checkpoints, &[]);
}

/// [`sweep_is_exact`] with `extra` arguments to both commands.
fn sweep_is_exact_with(file: &str, granularity: &str, precision: &str, checkpoints: &[&str], extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture(file);
    let profile = dir.path().join("profile.json");
    let sweep = dir.path().join("sweep.json");
    let mut shared = vec![
        model.as_str(),
        "--batch",
        "4",
        "--precision",
        precision,
        "--granularity",
        granularity,
    ];
    shared.extend(COMMON);
    shared.extend(extra);
    let mut args = vec!["profile"];
    args.extend(&shared);
    args.extend(["-o", profile.to_str().unwrap()]);
    ok(&args);
    let mut args = vec!["sweep"];
    args.extend(&shared);
    if checkpoints.is_empty() {
        args.push("--all-subsets");
    }
    for c in checkpoints {
        args.extend(["--checkpoint", c]);
    }
    args.extend([
        "--repeats",
        "1",
        "--profile",
        profile.to_str().unwrap(),
        "-o",
        sweep.to_str().unwrap(),
    ]);
    ok(&args);
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&sweep).unwrap()).unwrap();
    let points = s["configs"][0]["points"].as_array().unwrap();
    assert!(!points.is_empty());
    if !checkpoints.is_empty() {
        assert_eq!(points.len(), checkpoints.len());
    }
    for p in points {
        assert_eq!(
            p["peak_bytes"], p["predicted_peak_bytes"],
            "{file} {granularity} {precision} {}",
            p["regex"]
        );
    }
}

#[test]
fn exported_bert_with_its_mask_sweeps_byte_exact_nested() {
    let subsets = [
        "",
        r"encoder\.layer\.0",
        r"encoder\.layer\.1\.attention",
        r"encoder\.layer\.\d\.(attention|output)",
        r"encoder\.layer\.0|encoder\.layer\.1\.intermediate",
    ];
    for precision in ["fp32", "bf16"] {
        sweep_is_exact("tiny_bert.pt2", "nested", precision, &subsets);
    }
}

/// A layer that writes its input in place (`nn.ReLU(inplace=True)` as a layer of its own, as
/// torchvision's AlexNet, VGG and SqueezeNet `features` have it) runs as PyTorch runs it, and
/// the profile predicts its peak exactly under every subset, the `relu_` layers' included.
#[test]
fn exported_inplace_relu_layers_sweep_byte_exact_on_every_subset() {
    sweep_is_exact("inplace_relu.pt2", "layer", "fp32", &[]);
}

/// A symbolic size torch.export hoists ahead of the first layer (`sym_size(x, 0)`, read by
/// stochastic depth in later layers, as in torchvision's ConvNeXt and EfficientNet) is no block
/// of its own: the model plans, exactly under every subset.
#[test]
fn exported_symbolic_size_sweeps_byte_exact_on_every_subset() {
    sweep_is_exact("sym_size.pt2", "layer", "fp32", &[]);
}

/// A tensor computed from a layer's own parameter and read by every later layer (T5's relative
/// position bias) is recomputed by each layer that reads it, as a side value: the model plans,
/// exactly under every subset.
#[test]
fn exported_parameter_bias_read_by_every_layer_sweeps_byte_exact_on_every_subset() {
    sweep_is_exact("position_bias.pt2", "layer", "fp32", &[]);
}

/// Programs with several outputs (BertModel's last hidden state and pooler output; an auxiliary
/// classifier's logits, as GoogLeNet's in training mode, from a block no later block reads):
/// the loss reads every floating-point output, and the profile predicts the peak exactly under
/// every subset, in fp32 and bf16, the pooled program at nested granularity too. So does a head
/// that reads the token ids again after the layers (`last_token.pt2`, a decoder's sequence
/// classifier), and a program on log-mel features (`audio_features.pt2`, Whisper's input).
#[test]
fn exported_programs_with_several_outputs_or_reading_the_input_again_sweep_byte_exact() {
    for precision in ["fp32", "bf16"] {
        sweep_is_exact("pooled_outputs.pt2", "layer", precision, &[]);
        sweep_is_exact("aux_outputs.pt2", "layer", precision, &[]);
        sweep_is_exact("last_token.pt2", "layer", precision, &[]);
        sweep_is_exact("audio_features.pt2", "layer", precision, &[]);
    }
    sweep_is_exact("pooled_outputs.pt2", "nested", "fp32", &[]);
}

/// Blocks that hand on several tensors (each layer of `two_tensors.pt2` hands on
/// `(hidden, gate)`; `mid_output.pt2`'s `layers.1` hands on auxiliary logits only the loss
/// reads, as Inception v3's `AuxLogits`): the profile predicts the peak exactly under every
/// subset, in fp32 and bf16.
#[test]
fn exported_blocks_handing_on_several_tensors_sweep_byte_exact() {
    for precision in ["fp32", "bf16"] {
        sweep_is_exact("two_tensors.pt2", "layer", precision, &[]);
        sweep_is_exact("mid_output.pt2", "layer", precision, &[]);
    }
}

/// A module called several times (`layer` three times in a row, as ALBERT's shared layer group;
/// `act` twice, apart) is one candidate whose calls are blocks of their own: `--all-subsets`
/// sweeps every subset of the candidate names (each call of a chosen module checkpointed, as
/// `torch.utils.checkpoint` on the module does), predicted to the byte at layer and block
/// granularity and with `act` named by `--candidates`; a plan that must checkpoint names `layer`
/// once and verifies to the byte.
#[test]
fn exported_shared_layer_is_one_candidate_checkpointed_per_call() {
    for precision in ["fp32", "bf16"] {
        sweep_is_exact("shared_layer.pt2", "layer", precision, &[]);
    }
    sweep_is_exact("shared_layer.pt2", "block", "fp32", &[]);
    sweep_is_exact_with(
        "shared_layer.pt2",
        "layer",
        "fp32",
        &[],
        &["--candidates", "inp|act|layer|head"],
    );
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("shared_layer.pt2");
    let (profile, plan) = (dir.path().join("profile.json"), dir.path().join("plan.json"));
    let mut shared = vec![model.as_str(), "--batch", "512", "--precision", "fp32"];
    shared.extend(COMMON);
    let mut args = vec!["profile"];
    args.extend(&shared);
    args.extend(["-o", profile.to_str().unwrap()]);
    ok(&args);
    let p: Value = serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    let layer_blocks = p["model"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["name"] == "layer")
        .count();
    assert_eq!(layer_blocks, 3, "one block per call");
    // Between the smallest peak and the peak with nothing checkpointed: something must be.
    let c = &p["configs"][0];
    let (all, none) = (c["peak_all"].as_i64().unwrap(), c["peak_none"].as_i64().unwrap());
    assert!(all < none, "checkpointing lowers the peak: {all} vs {none}");
    let budget = (all + (none - all) / 3).to_string();
    let mut args = vec!["plan", "--budget", budget.as_str()];
    args.extend(&shared);
    args.extend([
        "--profile",
        profile.to_str().unwrap(),
        "--verify",
        "-o",
        plan.to_str().unwrap(),
    ]);
    ok(&args);
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let modules: Vec<&str> = plan["checkpoint"]["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    assert!(modules.contains(&"layer"), "{modules:?}");
    let mut unique = modules.clone();
    unique.dedup();
    assert_eq!(unique, modules, "each module named once");
    // FSDP2 on a module called several times is not modelled: refused, naming it.
    let shard = dir.path().join("shard.json");
    let mut args = vec![
        "plan",
        "--budget",
        budget.as_str(),
        "--shard",
        "2",
        "--shard-units",
        "layer",
    ];
    args.extend(&shared);
    args.extend(["--profile", profile.to_str().unwrap(), "-o", shard.to_str().unwrap()]);
    refused(&args, &["unit \"layer\"", "calls several times", "--shard-units"]);
    assert!(!shard.exists());
}

/// A profile cached for one choice of candidates is not reused for another: `--candidates`
/// is part of the cache key.
#[test]
fn cached_profiles_are_keyed_on_the_candidates() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let model = fixture("tiny_resnet.pt2");
    let profile = |candidates: Option<&str>, out: &str| -> Vec<String> {
        let out = dir.path().join(out);
        let mut args = vec![
            "profile",
            model.as_str(),
            "--batch",
            "2",
            "--precision",
            "fp32",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--quiet",
            "--cache-dir",
            cache.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ];
        if let Some(c) = candidates {
            args.extend(["--candidates", c]);
        }
        ok(&args);
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        v["model"]["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["candidate"] == true)
            .map(|b| b["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(profile(None, "layers.json"), ["layer1", "layer2", "layer3", "layer4"]);
    assert_eq!(
        profile(Some(r"layer[23]|fc"), "chosen.json"),
        ["layer2", "layer3", "fc"]
    );
}

/// A program exported on the meta device plans as its twin exported with weights does: the same
/// memory (the peak and the checkpoint set under a byte budget), with times from the cost model,
/// said so.
#[test]
fn a_program_exported_on_the_meta_device_plans_with_estimated_times() {
    let dir = tempfile::tempdir().unwrap();
    let plan_of = |file: &str| {
        let out = dir.path().join(format!("{file}.json"));
        let mut args = vec![
            "plan",
            "--budget",
            "90%",
            "--measure",
            "estimate",
            "-o",
            out.to_str().unwrap(),
        ];
        let model = fixture(file);
        args.push(&model);
        args.extend(["--precision", "fp32", "--batch", "2"]);
        args.extend(COMMON);
        ok(&args);
        common::read(&out)
    };
    // The meta fixtures were exported with eager attention, as their twins `hf_*_eager.pt2`.
    let (meta, real) = (plan_of("hf_bert_meta.pt2"), plan_of("hf_bert_eager.pt2"));
    for key in ["budget_bytes", "checkpoint"] {
        assert_eq!(meta[key], real[key], "{key}");
    }
    assert_eq!(meta["predicted"]["peak_bytes"], real["predicted"]["peak_bytes"]);
    let how = meta["predicted"]["step_seconds_estimated"].as_str().unwrap_or_default();
    assert!(how.contains("cost model over cpu"), "{meta}");
}

/// A cast that torch.export traced as a no-op (`.to(torch.float32)` of an fp32 tensor, guarded
/// by `_assert_tensor_metadata`) is a cast under bf16 autocast, where its input is bf16 (Qwen3's
/// `q_norm` of a projection): the step runs as eager PyTorch's does, every moment of the real
/// step matches the meta device's prediction, and the plan says which casts it cannot follow.
/// bf16 parameters stay refused.
#[test]
fn a_cast_traced_as_a_no_op_casts_under_autocast() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let model = fixture("upcast_norm.pt2");
    let shared = ["--budget", "1MiB", model.as_str(), "--batch", "2", "--precision"];
    let mut args = vec!["plan"];
    args.extend(shared);
    args.extend(["bf16", "--verify", "-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    let out = String::from_utf8_lossy(&ok(&args).stdout).into_owned();
    // Its whole step is under 5 KiB: the peak is the model's alone, no generator state beside the
    // batch.
    for needle in [
        "error 0 B",
        "every moment of the step matched the model to the byte",
        "fixes the dtypes of its casts",
        "x.to(input_dtype)",
    ] {
        assert!(out.contains(needle), "{needle:?} not in {out}");
    }
    let mut args = vec!["plan"];
    args.extend(shared);
    args.push("fp32");
    args.extend(COMMON);
    let fp32 = String::from_utf8_lossy(&ok(&args).stdout).into_owned();
    assert!(!fp32.contains("fixes the dtypes"), "{fp32}");
    let mut args = vec!["plan"];
    args.extend(shared);
    args.push("bf16-pure");
    args.extend(COMMON);
    refused(&args, &["--precision bf16-pure", "_assert_tensor_metadata"]);
}

/// A fill value traced as fp32's minimum (`torch.finfo(x.dtype).min` of an fp32 tensor, as
/// DeBERTa masks its scores) fills a bf16 tensor under autocast with bf16's minimum, as eager
/// PyTorch reads it from that tensor (`masked_fill` refuses fp32's): the step runs and every
/// moment of the real step matches the meta device's prediction.
#[test]
fn a_fill_value_traced_as_fp32s_minimum_fits_bf16_under_autocast() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let model = fixture("masked_min.pt2");
    let mut args = vec!["plan", "--budget", "1MiB", model.as_str(), "--batch", "2"];
    args.extend(["--precision", "bf16", "--verify", "-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    let out = String::from_utf8_lossy(&ok(&args).stdout).into_owned();
    for needle in ["error 0 B", "every moment of the step matched the model to the byte"] {
        assert!(out.contains(needle), "{needle:?} not in {out}");
    }
}

/// A selective block whose recompute calls other operators than its forward (attention over a
/// learned bias: its mask needs a gradient only when computed with grad, and the CPU then takes
/// the math kernel, not the flash one) exits 2 naming the block and what to do, run or on the
/// meta device, and writes nothing; whole blocks checkpointed, it plans.
#[test]
fn a_selective_block_whose_recompute_strays_from_its_forward_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let model = fixture("learned_bias.pt2");
    let shared = [
        "--budget",
        "1MiB",
        model.as_str(),
        "--batch",
        "2",
        "-o",
        out.to_str().unwrap(),
    ];
    for measure in ["run", "meta"] {
        let mut args = vec!["plan"];
        args.extend(shared);
        args.extend(["--selective", "--measure", measure]);
        args.extend(COMMON);
        refused(
            &args,
            &[
                "block attn cannot run selective",
                "node scaled_dot_product_attention",
                "Plan without --selective",
            ],
        );
        assert!(!out.exists(), "nothing written");
    }
    let mut args = vec!["plan"];
    args.extend(shared);
    args.extend(COMMON);
    ok(&args);
}
