//! `ckptune plan --emit` / `ckptune emit` against the trainers themselves: each snippet is
//! executed (python/tests/snippet_harness.py) with a plan the binary made for a tiny model, and
//! the modules that ran twice per step (forward and recompute) must be exactly the plan's. The
//! trainers come from python/requirements-trainers.txt, which scripts/setup installs at
//! `.trainers`. The FSDP2 snippet runs on two gloo ranks under torchrun. Also the refusals: a
//! snippet the trainer cannot express, a plan whose regex, names or shard section do not hold,
//! another format version — exit 2 and nothing written.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use common::{ckptune, edited, execute_snippet as execute, ok, read, refused, COMMON};
use serde_json::Value;

/// A plan for `model` whose budget lies halfway between checkpointing everything and nothing,
/// so the plan checkpoints a proper subset. Made once per model for the whole test binary.
struct Planned {
    _dir: tempfile::TempDir,
    /// The shape flags and the profile the plan was made with, to plan again.
    shape: Vec<String>,
    profile: PathBuf,
    plan: PathBuf,
    doc: Value,
}

fn make_plan(model: &str, shape: &[&str]) -> Planned {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let mut args = vec!["profile", model];
    args.extend(shape);
    args.extend(["--precision", "fp32", "-o", profile.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let c = &read(&profile)["configs"][0];
    let (none, all) = (c["peak_none"].as_i64().unwrap(), c["peak_all"].as_i64().unwrap());
    assert!(
        all < none,
        "{model}: checkpointing everything saves memory ({all} < {none})"
    );
    let budget = ((all + none) / 2).to_string();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", &budget, model];
    args.extend(shape);
    args.extend(["--precision", "fp32", "--profile", profile.to_str().unwrap()]);
    args.extend(["-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let doc = read(&plan);
    assert!(
        !doc["checkpoint"]["modules"].as_array().unwrap().is_empty(),
        "{model}: the budget forces checkpointing"
    );
    let shape = shape.iter().map(|a| a.to_string()).collect();
    Planned {
        _dir: dir,
        shape,
        profile,
        plan,
        doc,
    }
}

fn planned(model: &str) -> &'static Planned {
    static BERT: OnceLock<Planned> = OnceLock::new();
    static RESNET: OnceLock<Planned> = OnceLock::new();
    static LLAMA: OnceLock<Planned> = OnceLock::new();
    match model {
        "tiny-bert" => BERT.get_or_init(|| make_plan(model, &["--batch", "4", "--seq", "16"])),
        "tiny-resnet" => RESNET.get_or_init(|| make_plan(model, &["--batch", "8", "--image", "64"])),
        "tiny-llama" => LLAMA.get_or_init(|| make_plan(model, &["--batch", "2", "--seq", "16"])),
        _ => unreachable!("{model}"),
    }
}

/// `ckptune plan` again from the plan's profile, with `extra` flags; the output.
fn plan_again(p: &Planned, model: &str, budget: &str, extra: &[&str]) -> Output {
    let mut args = vec!["plan", "--budget", budget, model];
    args.extend(p.shape.iter().map(String::as_str));
    args.extend(["--precision", "fp32", "--profile", p.profile.to_str().unwrap()]);
    args.extend(extra);
    args.extend(COMMON);
    ckptune(&args)
}

fn modules(doc: &Value) -> Vec<String> {
    doc["checkpoint"]["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_owned())
        .collect()
}

/// The plan's candidate modules: blocks flagged as candidates, and groups.
fn candidates(doc: &Value) -> Vec<String> {
    let model = &doc["model"];
    let mut names: Vec<String> = model["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["candidate"].as_bool() == Some(true))
        .map(|b| b["name"].as_str().unwrap().to_owned())
        .collect();
    if let Some(groups) = model["groups"].as_array() {
        names.extend(groups.iter().map(|g| g["name"].as_str().unwrap().to_owned()));
    }
    names
}

fn emit(kind: &str, plan: &Path) -> String {
    let out = ok(&["emit", kind, plan.to_str().unwrap()]);
    String::from_utf8(out.stdout).unwrap()
}

/// Every watched candidate ran once per micro-step, the planned ones twice (their recompute).
fn assert_recomputed_exactly_the_plan(result: &Value, planned: &[String], watch: &[String]) {
    let micro = result["micro_steps"].as_u64().unwrap();
    for name in watch {
        let calls = result["calls"][name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name} not watched: {result}"));
        let expected = if planned.contains(name) { 2 * micro } else { micro };
        assert_eq!(
            calls, expected,
            "{name}: calls of its first child over {micro} micro-steps: {result}"
        );
    }
    assert_eq!(
        result["trained"],
        Value::Bool(true),
        "training changed the weights: {result}"
    );
}

#[test]
fn python_snippet_trains_the_reference_with_exactly_the_plan() {
    for model in ["tiny-bert", "tiny-resnet"] {
        let p = planned(model);
        let snippet = emit("python", &p.plan);
        let planned_modules = modules(&p.doc);
        // Derived from the plan: its regex and config are in the text.
        assert!(snippet.contains(&format!("{:?}", p.doc["checkpoint"]["regex"].as_str().unwrap())));
        let watch = candidates(&p.doc);
        let result = execute("python", &snippet, model, 2, &watch);
        assert_eq!(result["wrapped"], p.doc["checkpoint"]["modules"], "{model}");
        assert_eq!(result["autocast"], serde_json::json!(["None"]), "fp32: no autocast");
        assert_recomputed_exactly_the_plan(&result, &planned_modules, &watch);
    }
}

#[test]
fn plan_emit_prints_the_snippet_and_writes_the_plan() {
    let p = planned("tiny-bert");
    let dir = tempfile::tempdir().unwrap();
    // The same plan again (same profile, flags and budget), this time asking for the snippet.
    let out = dir.path().join("plan.json");
    let budget = p.doc["budget_bytes"].as_i64().unwrap().to_string();
    let run = plan_again(
        p,
        "tiny-bert",
        &budget,
        &["--emit", "python", "-o", out.to_str().unwrap()],
    );
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let printed = String::from_utf8(run.stdout).unwrap();
    assert!(out.exists(), "plan --emit still writes -o");
    // stdout is the snippet alone (a Python file), the same `emit` prints for the written plan.
    assert_eq!(printed, emit("python", &out));
    assert!(printed.starts_with("# Plain PyTorch training with the ckptune plan for tiny-bert"));
}

#[test]
fn hf_snippet_uses_transformers_per_layer_flags_for_layer_plans() {
    let p = planned("tiny-bert");
    let planned_modules = modules(&p.doc);
    let snippet = emit("hf", &p.plan);
    let watch = candidates(&p.doc);
    let result = execute("hf", &snippet, "tiny-bert", 2, &watch);
    let layers_only = planned_modules.iter().all(|m| m.starts_with("encoder.layer."));
    assert_eq!(
        result["route"],
        Value::from(if layers_only { "native" } else { "apply" }),
        "{snippet}"
    );
    if layers_only {
        // transformers' own flags are on exactly for the planned layers.
        for (name, on) in result["hf_flags"].as_object().unwrap() {
            if name.starts_with("encoder.layer.") && !name["encoder.layer.".len()..].contains('.') {
                assert_eq!(
                    on.as_bool().unwrap(),
                    planned_modules.contains(name),
                    "{name}: {result}"
                );
            }
        }
    }
    assert_recomputed_exactly_the_plan(&result, &planned_modules, &watch);
}

#[test]
fn hf_snippet_applies_plans_transformers_cannot_express() {
    // A ResNet stage is no transformers layer: the snippet wraps it with ckptune.apply.
    let p = planned("tiny-resnet");
    let snippet = emit("hf", &p.plan);
    assert!(snippet.contains("cannot express"), "{snippet}");
    let watch = candidates(&p.doc);
    let result = execute("hf", &snippet, "tiny-resnet", 2, &watch);
    assert_eq!(result["route"], "apply");
    assert_recomputed_exactly_the_plan(&result, &modules(&p.doc), &watch);
}

#[test]
fn lightning_snippet_checkpoints_the_plan_in_setup() {
    let p = planned("tiny-bert");
    let snippet = emit("lightning", &p.plan);
    let watch = candidates(&p.doc);
    let result = execute("lightning", &snippet, "tiny-bert", 2, &watch);
    assert_eq!(result["wrapped"], p.doc["checkpoint"]["modules"]);
    assert_eq!(result["precision"], "32-true");
    assert_eq!(result["set_to_none"], serde_json::json!([true]));
    // Gradients are freed right after each optimizer step, as the plan was measured, not after
    // the next step's forward as Lightning's own loop does.
    assert_eq!(result["grads_at_forward"], serde_json::json!([0, 0]), "{result}");
    assert_recomputed_exactly_the_plan(&result, &modules(&p.doc), &watch);

    // A plan that zeroes gradients in place: zeroed in place, kept through the next forward.
    let dir = tempfile::tempdir().unwrap();
    let zero = edited(dir.path(), "zero.json", &p.doc, |d| {
        d["config"]["set_to_none"] = false.into()
    });
    let snippet = emit("lightning", &zero);
    let result = execute("lightning", &snippet, "tiny-bert", 2, &watch);
    assert_eq!(result["set_to_none"], serde_json::json!([false]), "{snippet}");
    let n = result["parameters"].clone();
    assert_eq!(result["grads_at_forward"], serde_json::json!([0, n]), "{result}");
    assert_recomputed_exactly_the_plan(&result, &modules(&p.doc), &watch);
}

#[test]
fn torchtitan_snippet_wraps_the_plans_blocks_of_torchtitans_llama() {
    let p = planned("tiny-llama");
    let snippet = emit("torchtitan", &p.plan);
    let result = execute("torchtitan", &snippet, "tiny-llama", 1, &[]);
    let expected: Vec<String> = modules(&p.doc)
        .iter()
        .map(|m| {
            m.strip_prefix("model.")
                .unwrap()
                .replace(".self_attn", ".attention")
                .replace(".mlp", ".feed_forward")
                .replace("embed_tokens", "tok_embeddings")
        })
        .collect();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(result["wrapped"], serde_json::json!(expected_sorted), "{snippet}");
    let config = &p.doc["config"];
    let training = &result["training"];
    assert_eq!(training["local_batch_size"], config["micro_batch"]);
    assert_eq!(
        training["global_batch_size"].as_i64().unwrap(),
        config["micro_batch"].as_i64().unwrap() * config["grad_accum"].as_i64().unwrap()
    );
    assert_eq!(training["seq_len"], p.doc["shape"]["seq"]);
    assert_eq!(training["mixed_precision_param"], "float32");
}

/// A plan running one layer selective under `matmul` and the other under `attention`:
/// torchtitan's snippet (`CkptuneSelectivePlanAC`, a map from each selective module to its
/// policy) wraps exactly the plan's modules of torchtitan's Llama and runs its forward.
#[test]
fn torchtitan_snippet_runs_a_plan_mixing_selective_policies_per_layer() {
    let p = planned("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    let layers = ["model.layers.0", "model.layers.1"];
    let mixed = edited(dir.path(), "mixed.json", &read(&p.plan), |d| {
        d["checkpoint"]["regex"] = "^(?:model\\.layers\\.(?:0|1))$".into();
        d["checkpoint"]["modules"] = serde_json::json!(layers);
        d["checkpoint"]["selective"] = serde_json::json!([
            {"policy": "matmul", "modules": [layers[0]]},
            {"policy": "attention", "modules": [layers[1]]},
        ]);
        // The profile measured both policies on the layers, as `plan --selective` has it.
        let terms = |policy: &str| {
            serde_json::json!({"policy": policy, "kept": 0, "fwd_transient": 0, "cache": 0, "rec_transient": 0,
                "kept_recompute": 0, "bwd_transient": 0, "out_released": 0, "rec_seconds": 0.0})
        };
        for r in d["profile"]["regimes"].as_array_mut().unwrap() {
            for b in r["blocks"].as_array_mut().unwrap() {
                if layers.contains(&b["name"].as_str().unwrap()) {
                    b["selective"] = serde_json::json!([terms("matmul"), terms("attention")]);
                }
            }
        }
    });
    let snippet = emit("torchtitan", &mixed);
    assert!(
        snippet.contains(r#"selective={"layers.0": "matmul", "layers.1": "attention"}"#),
        "{snippet}"
    );
    let result = execute("torchtitan", &snippet, "tiny-llama", 1, &[]);
    assert_eq!(
        result["wrapped"],
        serde_json::json!(["layers.0", "layers.1"]),
        "{result}"
    );
    assert_eq!(result["ac"], "CkptuneSelectivePlanAC.Config", "{result}");
}

#[test]
fn torchtitan_refuses_a_model_it_has_no_counterpart_for_and_writes_nothing() {
    let p = planned("tiny-bert");
    let out = ckptune(&["emit", "torchtitan", p.plan.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tiny-bert is not a Llama-family model"), "{err}");
    assert!(out.stdout.is_empty());

    // plan --emit: the plan file is not written either.
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let out = plan_again(
        p,
        "tiny-bert",
        "1GiB",
        &["--emit", "torchtitan", "-o", plan.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!plan.exists(), "a refused --emit writes no plan");
}

#[test]
fn each_trainer_gets_its_own_option_when_the_plan_names_every_layer_or_none() {
    let p = planned("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    let every = edited(dir.path(), "every.json", &p.doc, |d| {
        d["checkpoint"]["regex"] = "^(?:model\\.layers\\.0|model\\.layers\\.1)$".into();
        d["checkpoint"]["modules"] = serde_json::json!(["model.layers.0", "model.layers.1"]);
    });
    let none = edited(dir.path(), "none.json", &p.doc, |d| {
        d["checkpoint"]["regex"] = "^[^\\s\\S]$".into();
        d["checkpoint"]["modules"] = serde_json::json!([]);
    });
    assert!(emit("torchtitan", &every).contains("ACTIVATION_CHECKPOINT = FullAC.Config()\n"));
    assert!(emit("torchtitan", &none).contains("ACTIVATION_CHECKPOINT = None\n"));
    let hf = emit("hf", &every);
    assert!(hf.contains("The plan checkpoints 2 of the 2 layers"), "{hf}");
    assert!(
        hf.contains("TrainingArguments(activation_checkpointing=True) would be the same"),
        "{hf}"
    );
    assert!(emit("hf", &none).contains("The plan checkpoints nothing"));
    // Executed on torchtitan's debug Llama (6 blocks): FullAC wraps every block, None none.
    let all = execute("torchtitan", &emit("torchtitan", &every), "tiny-llama", 1, &[]);
    let blocks: Vec<String> = (0..6).map(|i| format!("layers.{i}")).collect();
    assert_eq!(all["wrapped"], serde_json::json!(blocks));
    let nothing = execute("torchtitan", &emit("torchtitan", &none), "tiny-llama", 1, &[]);
    assert_eq!(nothing["wrapped"], serde_json::json!([]));
}

#[test]
fn bf16_plans_run_under_each_trainers_bf16_autocast() {
    // The plan's precision decides the trainer's: forwards run under CPU bf16 autocast. A plan
    // counting autocast's cache (`plan --emit hf`, `--autocast-cache`) and one that does not:
    // the python loop follows the plan, the Hugging Face Trainer keeps the cache on and
    // Lightning's bf16-mixed turns it off, each refusing the other plan.
    let p = planned("tiny-bert");
    let dir = tempfile::tempdir().unwrap();
    let on = edited(dir.path(), "bf16-cache.json", &p.doc, |d| {
        d["config"]["precision"] = "bf16".into();
        d["config"]["autocast_cache"] = true.into();
    });
    let off = edited(dir.path(), "bf16.json", &p.doc, |d| {
        d["config"]["precision"] = "bf16".into()
    });
    let watch = candidates(&p.doc);
    for (kind, plan, cache, other) in [
        ("python", &on, true, None),
        ("python", &off, false, None),
        ("hf", &on, true, Some(&off)),
        ("lightning", &off, false, Some(&on)),
    ] {
        let snippet = emit(kind, plan);
        let result = execute(kind, &snippet, "tiny-bert", 1, &watch);
        assert_eq!(
            result["autocast"],
            serde_json::json!(["torch.bfloat16"]),
            "{kind}: {result}"
        );
        assert_eq!(result["autocast_cache"], serde_json::json!([cache]), "{kind}: {result}");
        assert_recomputed_exactly_the_plan(&result, &modules(&p.doc), &watch);
        if let Some(other) = other {
            let out = ckptune(&["emit", kind, other.to_str().unwrap()]);
            assert_eq!(out.status.code(), Some(2), "{kind}");
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("--autocast-cache"),
                "{kind}"
            );
        }
    }
    assert!(emit("lightning", &off).contains("precision=\"bf16-mixed\""));
}

/// `doc` with a shard section as `plan --shard N` writes it: `units` wrapped with `fully_shard`,
/// every rank predicted at the plan's peak.
fn sharded(doc: &Value, ranks: i64, reshard_after_forward: bool, units: &[&str]) -> Value {
    let mut doc = doc.clone();
    let peak = doc["predicted"]["peak_bytes"].clone();
    doc["shard"] = serde_json::json!({
        "ranks": ranks,
        "reshard_after_forward": reshard_after_forward,
        "collective": "gloo",
        "units": units,
        "per_rank": (0..ranks)
            .map(|r| serde_json::json!({"rank": r, "peak_bytes": peak, "peak_moment": "reduce-scatter layer4"}))
            .collect::<Vec<_>>(),
    });
    doc
}

const RESNET_UNITS: [&str; 4] = ["layer1", "layer2", "layer3", "layer4"];

#[test]
fn fsdp2_snippet_shards_each_unit_then_the_root_after_checkpointing() {
    let p = planned("tiny-resnet");
    let dir = tempfile::tempdir().unwrap();
    for raf in [true, false] {
        let doc = sharded(&p.doc, 2, raf, &RESNET_UNITS);
        let plan = edited(dir.path(), "sharded.json", &doc, |_| {});
        let snippet = emit("fsdp2", &plan);
        let flag = if raf { "True" } else { "False" };
        // ckptune.apply first, then one fully_shard per unit in forward order with the plan's
        // reshard_after_forward, then the root.
        let mut at = snippet.find("wrapped = ckptune.apply(backbone, PLAN)").expect("apply");
        for unit in RESNET_UNITS {
            let call = format!(
                "    fully_shard(backbone.get_submodule(\"{unit}\"), mesh=mesh, reshard_after_forward={flag})\n"
            );
            let found = snippet[at..]
                .find(&call)
                .unwrap_or_else(|| panic!("{call} after {at}:\n{snippet}"));
            at += found;
        }
        assert!(snippet[at..].contains("fully_shard(root, mesh=mesh)\n"), "{snippet}");
        assert_eq!(
            snippet.matches("fully_shard(").count(),
            4 + 1,
            "the 4 units and the root:\n{snippet}"
        );
        assert!(
            snippet.contains("dist.init_process_group(backend=\"gloo\")"),
            "{snippet}"
        );
        assert!(snippet.contains("# Launch one process per rank: torchrun --nproc_per_node 2 train.py"));
        assert!(snippet.contains("RANKS = 2\n"));
        assert!(snippet.contains("micro-batch 8 per rank, 16 samples per micro-step over the 2 ranks"));
        // The plan's optimizer kwargs, as the python snippet passes them.
        assert!(snippet.contains("opt = cfg.optimizer_class(root.parameters(), lr=lr, **cfg.optimizer_kwargs)"));
        assert!(snippet.contains("(adamw with foreach=False)"), "{snippet}");
    }
    // NCCL: one GPU per rank, by torchrun's LOCAL_RANK.
    let nccl = edited(dir.path(), "nccl.json", &sharded(&p.doc, 8, true, &RESNET_UNITS), |d| {
        d["shard"]["collective"] = "nccl".into()
    });
    let snippet = emit("fsdp2", &nccl);
    assert!(
        snippet.contains("dist.init_process_group(backend=\"nccl\")"),
        "{snippet}"
    );
    assert!(snippet.contains("torch.cuda.set_device(device)"), "{snippet}");
    assert!(snippet.contains("torchrun --nproc_per_node 8 train.py"), "{snippet}");
}

#[test]
fn fsdp2_snippet_trains_on_two_gloo_ranks_under_torchrun() {
    // tiny-resnet as planned (some stages checkpointed), its four stages the units.
    let p = planned("tiny-resnet");
    let dir = tempfile::tempdir().unwrap();
    let plan = edited(
        dir.path(),
        "sharded.json",
        &sharded(&p.doc, 2, true, &RESNET_UNITS),
        |_| {},
    );
    let watch = candidates(&p.doc);
    let result = execute("fsdp2", &emit("fsdp2", &plan), "tiny-resnet", 2, &watch);
    let mut expected_calls: Vec<Value> = RESNET_UNITS.iter().map(|u| serde_json::json!([u, true])).collect();
    expected_calls.push(serde_json::json!(["<root>", null]));
    assert_ranks_trained_the_plan(&result, &p.doc, &watch, &expected_calls, "[\"None\"]");
}

#[test]
fn fsdp2_snippet_runs_a_loss_that_calls_submodules_under_bf16_autocast() {
    // tiny-bert's loss calls model.bert and model.classifier, never model: the root whose
    // forward is the loss still gathers the embeddings and the head. Layers kept unsharded
    // between forward and backward, bf16 autocast.
    let p = planned("tiny-bert");
    let dir = tempfile::tempdir().unwrap();
    let units = ["encoder.layer.0", "encoder.layer.1"];
    let plan = edited(dir.path(), "sharded.json", &sharded(&p.doc, 2, false, &units), |d| {
        d["config"]["precision"] = "bf16".into()
    });
    let watch = candidates(&p.doc);
    let result = execute("fsdp2", &emit("fsdp2", &plan), "tiny-bert", 1, &watch);
    let mut expected_calls: Vec<Value> = units.iter().map(|u| serde_json::json!([u, false])).collect();
    expected_calls.push(serde_json::json!(["<root>", null]));
    assert_ranks_trained_the_plan(&result, &p.doc, &watch, &expected_calls, "[\"torch.bfloat16\"]");
}

/// Both ranks: the fully_shard calls expected, the plan's modules wrapped and recomputed, gloo
/// over 2 ranks, parameters sharded and trained, the group destroyed, no process left.
fn assert_ranks_trained_the_plan(result: &Value, doc: &Value, watch: &[String], calls: &[Value], autocast: &str) {
    let ranks = result["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "{result}");
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["rank"], r, "{result}");
        assert_eq!(rank["world_size"], 2);
        assert_eq!(rank["backend"], "gloo");
        assert_eq!(rank["fully_shard"], Value::from(calls.to_vec()), "{result}");
        assert_eq!(rank["wrapped"], doc["checkpoint"]["modules"], "{result}");
        assert_eq!(rank["autocast"].to_string(), autocast, "{result}");
        assert_eq!(rank["sharded"], true, "{result}");
        assert_eq!(rank["process_group_destroyed"], true, "{result}");
        assert_recomputed_exactly_the_plan(rank, &modules(doc), watch);
    }
    assert_eq!(
        result["alive_after"],
        serde_json::json!([]),
        "no rank outlives the run: {result}"
    );
}

#[test]
fn fsdp2_refuses_a_plan_for_one_device_and_a_damaged_shard_section() {
    let p = planned("tiny-resnet");
    let out = ckptune(&["emit", "fsdp2", p.plan.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is for one device"), "{err}");
    assert!(err.contains("plan --shard N"), "{err}");
    assert!(out.stdout.is_empty());

    // plan --emit fsdp2 without --shard: the plan file is not written either.
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let budget = p.doc["budget_bytes"].as_i64().unwrap().to_string();
    let out = plan_again(
        p,
        "tiny-resnet",
        &budget,
        &["--emit", "fsdp2", "-o", plan.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("plan --shard N"));
    assert!(!plan.exists(), "a refused --emit writes no plan");

    // A shard section that does not hold is refused by every kind.
    let doc = sharded(&p.doc, 2, true, &RESNET_UNITS);
    let absent = edited(dir.path(), "absent.json", &doc, |d| {
        d["shard"]["units"][3] = "layer9".into()
    });
    let nested = edited(dir.path(), "nested.json", &doc, |d| {
        d["shard"]["units"][3] = "layer3.0".into()
    });
    let collective = edited(dir.path(), "mpi.json", &doc, |d| {
        d["shard"]["collective"] = "mpi".into()
    });
    for kind in ["fsdp2", "python"] {
        refused(
            &["emit", kind, absent.to_str().unwrap()],
            &[
                "shards layer9 but tiny-resnet has no module of that name",
                "plan --shard N",
            ],
        );
        refused(
            &["emit", kind, nested.to_str().unwrap()],
            &["layer3 and layer3.0, one inside the other"],
        );
        refused(
            &["emit", kind, collective.to_str().unwrap()],
            &["\"mpi\" (expected gloo or nccl)"],
        );
    }
}

#[test]
fn torchtitan_snippet_sets_the_data_parallel_shard_degree_of_a_sharded_plan() {
    let p = planned("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    let unsharded = emit("torchtitan", &p.plan);
    assert!(
        !unsharded.contains("parallelism"),
        "one device: no parallelism settings\n{unsharded}"
    );
    let units = ["model.layers.0", "model.layers.1"];
    for (raf, policy) in [(true, "always"), (false, "never")] {
        let plan = edited(dir.path(), "sharded.json", &sharded(&p.doc, 4, raf, &units), |_| {});
        let snippet = emit("torchtitan", &plan);
        // The blocks' checkpointing is the unsharded plan's, word for word.
        let ac = |s: &str| {
            s.lines()
                .find(|l| l.starts_with("ACTIVATION_CHECKPOINT = "))
                .unwrap()
                .to_owned()
        };
        assert_eq!(ac(&snippet), ac(&unsharded));
        assert!(
            snippet.contains(&format!("\"fsdp_reshard_after_forward\": \"{policy}\",\n")),
            "{snippet}"
        );
        if raf {
            continue; // executed once: torchtitan takes seconds to import
        }
        // Executed against torchtitan's own (slotted) config classes: the names exist.
        let result = execute("torchtitan", &snippet, "tiny-llama", 1, &[]);
        assert_eq!(
            result["parallelism"],
            serde_json::json!({"data_parallel_shard_degree": 4, "fsdp_reshard_after_forward": policy}),
            "{snippet}"
        );
        let config = &p.doc["config"];
        assert_eq!(result["training"]["local_batch_size"], config["micro_batch"]);
        assert_eq!(
            result["training"]["global_batch_size"].as_i64().unwrap(),
            4 * config["micro_batch"].as_i64().unwrap() * config["grad_accum"].as_i64().unwrap(),
            "the global batch is over the 4 ranks"
        );
    }
}

#[test]
fn bad_plans_are_refused_with_exit_2_by_emit_and_verify() {
    let p = planned("tiny-bert");
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let report_s = report.to_str().unwrap();

    let other = edited(dir.path(), "v2.json", &p.doc, |d| d["format"] = "ckptune.plan/2".into());
    let nothing = edited(dir.path(), "nothing.json", &p.doc, |d| {
        d["checkpoint"]["regex"] = "^(?:encoder\\.layer\\.9)$".into()
    });
    let differs = edited(dir.path(), "differs.json", &p.doc, |d| {
        d["checkpoint"]["regex"] = "^(?:pooler)$".into();
    });
    for kind in ["python", "fsdp2", "hf", "lightning", "torchtitan"] {
        refused(
            &["emit", kind, other.to_str().unwrap()],
            &["\"ckptune.plan/2\"", "expected \"ckptune.plan/1\""],
        );
        refused(
            &["emit", kind, nothing.to_str().unwrap()],
            &["matches no module of tiny-bert"],
        );
        refused(
            &["emit", kind, differs.to_str().unwrap()],
            &["matches pooler of tiny-bert", "the plan lists"],
        );
    }
    for plan in [&other, &nothing, &differs] {
        for extra in [&[][..], &["--pytorch"][..]] {
            let mut args = vec!["verify", plan.to_str().unwrap(), "-o", report_s, "--quiet"];
            args.extend(extra);
            refused(&args, &[]);
            assert!(!report.exists(), "a refused verify writes no report");
        }
    }
}

#[test]
fn verify_pytorch_refuses_a_model_whose_names_differ_from_the_plans() {
    // The plan's names are tiny-bert's; the reference it would run is tiny-gpt2's.
    let p = planned("tiny-bert");
    let dir = tempfile::tempdir().unwrap();
    let plan = edited(dir.path(), "gpt2.json", &p.doc, |d| {
        d["shape"]["model"] = "tiny-gpt2".into()
    });
    let report = dir.path().join("report.json");
    refused(
        &[
            "verify",
            plan.to_str().unwrap(),
            "--pytorch",
            "-o",
            report.to_str().unwrap(),
            "--quiet",
        ],
        &[
            "the PyTorch run refused the plan",
            "matches no module of this model",
            "wte, wpe",
        ],
    );
    assert!(!report.exists());
}

#[test]
fn verify_pytorch_reports_both_runs_and_fails_over_budget() {
    let p = planned("tiny-bert");
    let (out, r) = verify_pytorch(&p.plan);
    let text = String::from_utf8_lossy(&out.stdout);
    for row in ["predicted", "ckptune run", "PyTorch eager"] {
        assert!(text.contains(row), "{row} missing from:\n{text}");
    }
    assert_eq!(r["format"], "ckptune.verify-pytorch/1");
    assert_eq!(r["predicted"]["peak_bytes"], p.doc["predicted"]["peak_bytes"]);
    let torch = &r["pytorch"];
    // The PyTorch run followed the plan: its modules, precision, optimizer and batch.
    assert_eq!(torch["modules"], p.doc["checkpoint"]["modules"]);
    for key in ["precision", "optimizer", "micro_batch", "grad_accum", "set_to_none"] {
        assert_eq!(torch[key], p.doc["config"][key], "{key}");
    }
    assert_eq!(torch["optimizer_class"], "torch.optim.adamw.AdamW");
    let steps = torch["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4, "two warm-up and two timed steps");
    let timed_max = steps[2..]
        .iter()
        .map(|s| s["peak_bytes"].as_i64().unwrap())
        .max()
        .unwrap();
    assert_eq!(torch["peak_bytes"].as_i64().unwrap(), timed_max);
    let torch_peak = timed_max;
    assert_eq!(
        r["pytorch_peak_error_bytes"].as_i64().unwrap(),
        torch_peak - r["predicted"]["peak_bytes"].as_i64().unwrap()
    );
    assert_eq!(
        r["ckptune"]["mismatches"],
        serde_json::json!([]),
        "ckptune's run is byte-exact"
    );

    // The same plan with a budget one byte below PyTorch's peak: exit 1, naming PyTorch's peak.
    let dir = tempfile::tempdir().unwrap();
    let tight = edited(dir.path(), "tight.json", &p.doc, |d| {
        d["budget_bytes"] = (torch_peak - 1).into()
    });
    let out = ckptune(&[
        "verify",
        tight.to_str().unwrap(),
        "--pytorch",
        "--steps",
        "2",
        "--quiet",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("PyTorch's peak"), "{err}");
}

/// A plan whose loss is chunked is run in PyTorch with `ckptune.chunked_causal_lm_loss` (the
/// harness says which loss it ran), and the python snippet of the plan computes it the same way.
#[test]
fn a_chunked_loss_plan_runs_the_companions_loss_in_pytorch() {
    let p = make_plan("tiny-llama", &["--batch", "2", "--seq", "16", "--loss-chunks", "4"]);
    assert_eq!(p.doc["config"]["loss_chunks"], 4);
    let (_, r) = verify_pytorch(&p.plan);
    assert_eq!(r["pytorch"]["loss_chunks"], 4);
    assert_eq!(
        r["ckptune"]["mismatches"],
        serde_json::json!([]),
        "ckptune's run is the model's"
    );
    let snippet = emit("python", &p.plan);
    assert!(snippet.contains("ckptune.chunked_causal_lm_loss(hidden, model.get_output_embeddings().weight, labels, 4)"));
}

/// `verify --pytorch` of `plan` with two timed steps: its output and its report.
fn verify_pytorch(plan: &Path) -> (Output, Value) {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let out = ok(&[
        "verify",
        plan.to_str().unwrap(),
        "--pytorch",
        "--steps",
        "2",
        "-o",
        report.to_str().unwrap(),
        "--quiet",
    ]);
    (out, read(&report))
}
