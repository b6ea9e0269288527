//! The trainer snippets `--emit` writes, as snapshots: each trainer's snippet for committed plans
//! of several kinds (layers only, modules inside layers, nothing checkpointed, sharded), compared
//! with `planner/tests/snapshots/`, so that any change to the generated code shows in a diff.
//! `UPDATE_EXPECT=1 cargo test -p ckptune --test snippets` writes the snapshots again. The
//! snippets themselves are executed by `tests/emit.rs`.

use std::path::{Path, PathBuf};

use ckptune::cli::args::EmitKind;
use ckptune::cli::snippets::snippet;
use ckptune_solver::formats::{self, CudaMemoryJson, PlanJson, SelectiveJson};
use ckptune_solver::profile::SelectiveProfile;
use expect_test::expect_file;

/// `path` relative to this crate: `../results/...` for a plan committed with its results, or
/// `tests/fixtures/plans/...` for one kept as the snapshots' input (results re-run under new
/// budgets and file names; these BERT-base plans, from `scripts/results` and
/// `scripts/results_nested`, and TinyLlama-1.1B's with five layers checkpointed, from
/// `scripts/results_tinyllama` under eager attention, checkpoint what their snapshots are named
/// for).
fn in_crate(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn plan(path: &str) -> PlanJson {
    formats::read_tagged(&in_crate(path), formats::PLAN_FORMAT).unwrap()
}

/// The plan at `path` as `plan --emit KIND` makes it: for the trainers that keep autocast's cache
/// on, with the cache counted.
fn plan_for(path: &str, kind: EmitKind) -> PlanJson {
    let mut p = plan(path);
    if kind == EmitKind::Hf {
        p.config.autocast_cache = p.config.precision == "bf16";
    }
    p
}

/// `name` rendered for `kind`, against its snapshot.
fn check(name: &str, plan_path: &str, kind: EmitKind) {
    let p = plan_for(plan_path, kind);
    let text = snippet(&p, kind).unwrap_or_else(|e| panic!("{name}: {e}"));
    expect_file![format!("snapshots/{name}.py")].assert_eq(&text);
}

const BERT_EMBEDDINGS: &str = "tests/fixtures/plans/bert-embeddings.json";
const BERT_LAYERS: &str = "tests/fixtures/plans/bert-layers.json";
const BERT_NOTHING: &str = "tests/fixtures/plans/bert-nothing.json";
const BERT_NESTED: &str = "tests/fixtures/plans/bert-nested.json";
const TINYLLAMA: &str = "tests/fixtures/plans/tinyllama-1.1b-5-layers.json";
const RESNET152: &str = "../results/resnet152/plans/plan-1096590090.json";
const BERT_SHARDED: &str = "../results/fsdp/avx512-bf16/bert-base-n2.plan.json";
const RESNET50_SHARDED: &str = "../results/fsdp/avx512-bf16/resnet50-n4.plan.json";
const TINYLLAMA_LOSS16: &str = "../results/loss-chunks/plan-16.json";

/// A plan whose loss is chunked: `--emit python` computes it with the companion, the trainers
/// that compute the loss from the logits say they do not.
#[test]
fn a_chunked_loss_is_emitted_or_declined() {
    check("python-tinyllama-loss16", TINYLLAMA_LOSS16, EmitKind::Python);
    check("hf-tinyllama-loss16", TINYLLAMA_LOSS16, EmitKind::Hf);
}

#[test]
fn plain_pytorch() {
    check("python-bert-embeddings", BERT_EMBEDDINGS, EmitKind::Python);
    check("python-resnet152", RESNET152, EmitKind::Python);
    check("python-bert-sharded", BERT_SHARDED, EmitKind::Python);
}

#[test]
fn fsdp2() {
    check("fsdp2-bert-sharded", BERT_SHARDED, EmitKind::Fsdp2);
    check("fsdp2-resnet50-sharded", RESNET50_SHARDED, EmitKind::Fsdp2);
}

#[test]
fn hugging_face() {
    check("hf-bert-layers", BERT_LAYERS, EmitKind::Hf);
    check("hf-bert-embeddings", BERT_EMBEDDINGS, EmitKind::Hf);
    check("hf-bert-nested", BERT_NESTED, EmitKind::Hf);
    check("hf-bert-nothing", BERT_NOTHING, EmitKind::Hf);
    check("hf-tinyllama", TINYLLAMA, EmitKind::Hf);
}

/// A mixed-precision plan made for the other autocast loop than the trainer's is refused,
/// saying how to plan for it: the Hugging Face Trainer keeps autocast's cache on, Lightning
/// turns it off.
#[test]
fn a_bf16_plan_for_the_other_autocast_cache_is_refused() {
    let e = snippet(&plan(BERT_LAYERS), EmitKind::Hf).unwrap_err().to_string();
    assert!(e.contains("cache_enabled=False"), "{e}");
    assert!(e.contains("ckptune plan --emit hf"), "{e}");
    assert!(e.contains("--autocast-cache"), "{e}");
    let mut cached = plan(BERT_LAYERS);
    cached.config.autocast_cache = true;
    let e = snippet(&cached, EmitKind::Lightning).unwrap_err().to_string();
    assert!(e.contains("turns the cache off"), "{e}");
    assert!(e.contains("re-plan without --autocast-cache"), "{e}");
    // fp32 has no autocast, so no cache to count.
    assert!(snippet(&plan(TINYLLAMA), EmitKind::Hf).is_ok());
}

/// A plan that records its attention (every transformer plan since `--attention`) names it.
#[test]
fn a_plan_with_an_attention_names_it() {
    let mut p = plan(TINYLLAMA);
    p.shape.attention = Some("sdpa".into());
    let text = snippet(&p, EmitKind::Hf).unwrap();
    expect_file!["snapshots/hf-tinyllama-sdpa.py"].assert_eq(&text);
}

#[test]
fn lightning() {
    check("lightning-bert-embeddings", BERT_EMBEDDINGS, EmitKind::Lightning);
    check("lightning-resnet152", RESNET152, EmitKind::Lightning);
}

#[test]
fn torchtitan() {
    check("torchtitan-tinyllama", TINYLLAMA, EmitKind::Torchtitan);
}

/// The TinyLlama plan with two of its five modules run selective, each under the policy
/// `selective` gives it (`plan --selective`), the profile holding their selective terms as such a
/// plan's does (their values do not reach a snippet).
fn selective_plan(kind: EmitKind, selective: [(&str, &str); 2]) -> PlanJson {
    let mut p = plan_for(TINYLLAMA, kind);
    for b in p.profile.regimes.iter_mut().flat_map(|r| &mut r.blocks) {
        if let Some((_, policy)) = selective.iter().find(|(m, _)| *m == b.name) {
            b.selective = vec![SelectiveProfile {
                policy: policy.to_string(),
                kept: 0,
                fwd_transient: 0,
                cache: 0,
                rec_transient: 0,
                kept_recompute: 0,
                bwd_transient: 0,
                out_released: 0,
                held_output: 0,
                rec_seconds: 0.0,
            }];
        }
    }
    for (m, policy) in selective {
        match p.checkpoint.selective.iter_mut().find(|s| s.policy == policy) {
            Some(s) => s.modules.push(m.into()),
            None => p.checkpoint.selective.push(SelectiveJson {
                policy: policy.into(),
                modules: vec![m.into()],
            }),
        }
    }
    p
}

/// Selective modules travel in the companion's `PLAN` (python, hf through `ckptune.apply` rather
/// than transformers' whole-layer flag, lightning), and torchtitan wraps them with ckptune's
/// policy, saying why its own SelectiveAC is not the plan; a plan mixing the two policies
/// carries each module's.
#[test]
fn a_selective_plan_carries_its_selective_modules() {
    let one = [("model.layers.9", "matmul"), ("model.layers.13", "matmul")];
    let mixed = [("model.layers.9", "matmul"), ("model.layers.13", "attention")];
    for (name, kind, selective) in [
        ("python-tinyllama-selective", EmitKind::Python, one),
        ("hf-tinyllama-selective", EmitKind::Hf, one),
        ("lightning-tinyllama-selective", EmitKind::Lightning, one),
        ("torchtitan-tinyllama-selective", EmitKind::Torchtitan, one),
        ("python-tinyllama-mixed", EmitKind::Python, mixed),
        ("hf-tinyllama-mixed", EmitKind::Hf, mixed),
        ("torchtitan-tinyllama-mixed", EmitKind::Torchtitan, mixed),
    ] {
        let text = snippet(&selective_plan(kind, selective), kind).unwrap_or_else(|e| panic!("{name}: {e}"));
        expect_file![format!("snapshots/{name}.py")].assert_eq(&text);
    }
}

/// How a CUDA plan was judged, as `plan --target cuda` records it, recommending `conf`.
fn cuda_memory(conf: &str) -> CudaMemoryJson {
    CudaMemoryJson {
        gpu: "h100".into(),
        context_bytes: 512 << 20,
        workspace_bytes: vec![32 << 20; 2],
        traced_on: "meta".into(),
        trace_events: 1000,
        alloc_conf: conf.into(),
        predicted_allocated_peak_bytes: 1_100_000_000,
        predicted_reserved_peak_bytes: 1_300_000_000,
        candidates: Vec::new(),
        rounds: Vec::new(),
    }
}

/// A CUDA plan sets the allocator setting its reserved peak was simulated with, before the
/// snippet imports torch; PyTorch's default is left unset.
#[test]
fn a_cuda_plan_sets_its_allocator_setting() {
    for (name, path, kind, conf) in [
        (
            "python-resnet152-cuda",
            RESNET152,
            EmitKind::Python,
            "expandable_segments:True",
        ),
        (
            "hf-bert-layers-cuda",
            BERT_LAYERS,
            EmitKind::Hf,
            "roundup_power2_divisions:4",
        ),
        ("lightning-resnet152-cuda-default", RESNET152, EmitKind::Lightning, ""),
    ] {
        let mut p = plan_for(path, kind);
        p.cuda_memory = Some(cuda_memory(conf));
        let text = snippet(&p, kind).unwrap_or_else(|e| panic!("{name}: {e}"));
        expect_file![format!("snapshots/{name}.py")].assert_eq(&text);
        let set = text.find("os.environ[\"PYTORCH_CUDA_ALLOC_CONF\"]");
        match conf {
            "" => assert_eq!(set, None, "{name}"),
            _ => assert!(
                set.unwrap() < text.find("import torch").unwrap(),
                "{name}: set after torch is imported"
            ),
        }
    }
}

/// A plan that steps the optimizer in backward: `--emit python` builds
/// `ckptune.optimizer_in_backward` and a loop without `opt.step()`; the trainers, which step
/// after backward, say they do not express it.
#[test]
fn a_step_in_backward_is_emitted_or_declined() {
    for (name, kind) in [
        ("python-tinyllama-in-backward", EmitKind::Python),
        ("hf-tinyllama-in-backward", EmitKind::Hf),
        ("lightning-tinyllama-in-backward", EmitKind::Lightning),
        ("torchtitan-tinyllama-in-backward", EmitKind::Torchtitan),
    ] {
        let mut p = plan_for(TINYLLAMA, kind);
        p.config.optimizer_in_backward = true;
        let text = snippet(&p, kind).unwrap_or_else(|e| panic!("{name}: {e}"));
        expect_file![format!("snapshots/{name}.py")].assert_eq(&text);
    }
}
