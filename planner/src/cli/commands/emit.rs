//! `ckptune plan --emit KIND` and `ckptune emit KIND plan.json`: the plan as a ready snippet
//! for a trainer — plain PyTorch, PyTorch FSDP2 on N ranks (`plan --shard N`), Hugging Face
//! `Trainer`, Lightning, torchtitan. Every value in
//! a snippet comes from the plan (its checkpoint regex and modules, its config, its shape); the
//! code around them says how each trainer expresses that, and where a trainer's own
//! checkpointing option cannot express the plan, the snippet says so and uses the companion.
//!
//! Before anything is rendered the plan is checked (`check_plan`): its regex must match exactly
//! the modules it lists among the model's modules, so a hand-edited or stale plan is bad input
//! (exit 2) rather than a snippet that checkpoints something else.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::Result;
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, PlanJson, RankPredictionJson, ShardJson};
use clap::ValueEnum;

use crate::cli::args::EmitArgs;
use crate::cli::error::UsageError;
use crate::cli::output::{group_digits, outln};

/// The trainers `--emit` writes snippets for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EmitKind {
    /// Plain PyTorch: `ckptune.apply` and a `ckptune.training_config` loop.
    Python,
    /// Plain PyTorch FSDP2 on the plan's N ranks under torchrun (plans made with `plan --shard
    /// N`): `ckptune.apply`, `fully_shard` on every unit and then the root, the same loop.
    Fsdp2,
    /// Hugging Face `Trainer`: its per-layer checkpointing flags when the plan names only
    /// layers, else `ckptune.apply` before the `Trainer`.
    Hf,
    /// Lightning: a callback that applies the plan in `setup`, the plan's precision string.
    Lightning,
    /// torchtitan: its `activation_checkpoint` config (Llama-family plans only).
    Torchtitan,
}

/// `ckptune emit KIND plan.json`: the snippet for a plan written earlier.
pub fn emit_cmd(a: EmitArgs) -> Result<ExitCode> {
    let plan: PlanJson = formats::read_tagged(&a.plan, formats::PLAN_FORMAT)?;
    let text = snippet(&plan, a.kind)?;
    outln!("{}", text.trim_end());
    Ok(ExitCode::SUCCESS)
}

/// Checks that the plan means what it says, then renders the snippet.
pub fn snippet(plan: &PlanJson, kind: EmitKind) -> Result<String, UsageError> {
    check_plan(plan)?;
    if let Some(shard) = &plan.shard {
        check_shard(plan, shard)?;
    }
    let facts = Facts::of(plan);
    Ok(match kind {
        EmitKind::Python => python(plan, &facts),
        EmitKind::Fsdp2 => fsdp2(plan, &facts)?,
        EmitKind::Hf => hf(plan, &facts),
        EmitKind::Lightning => lightning(plan, &facts),
        EmitKind::Torchtitan => torchtitan(plan, &facts)?,
    })
}

/// Of `names`, those the plan's model has no module of.
fn unknown_modules<'a>(model: &ckptune_solver::formats::ModelJson, names: &'a [String]) -> Vec<&'a str> {
    names
        .iter()
        .filter(|n| !model.modules.contains(n))
        .map(String::as_str)
        .collect()
}

/// The plan's regex matches exactly its listed modules among the model's module names (full
/// match, as PyTorch users and `ckptune.apply` read it). A plan whose regex matches nothing,
/// whose modules the model lacks, or whose two fields disagree is refused, naming the values.
pub fn check_plan(plan: &PlanJson) -> Result<(), UsageError> {
    let pattern = &plan.checkpoint.regex;
    let re = regex::Regex::new(&format!("^(?:{pattern})$")).map_err(|e| {
        UsageError(format!(
            "the plan's checkpoint regex {pattern:?} is not a valid regex: {e}"
        ))
    })?;
    let model = &plan.model;
    let missing = unknown_modules(model, &plan.checkpoint.modules);
    if !missing.is_empty() {
        return Err(UsageError(format!(
            "the plan checkpoints {} but {} has no module of that name; re-plan with this ckptune",
            missing.join(", "),
            model.name
        )));
    }
    let matched: Vec<&str> = model
        .modules
        .iter()
        .filter(|m| re.is_match(m))
        .map(String::as_str)
        .collect();
    let mut listed: Vec<&str> = plan.checkpoint.modules.iter().map(String::as_str).collect();
    listed.sort_unstable();
    let mut found = matched.clone();
    found.sort_unstable();
    if found != listed {
        let what = if matched.is_empty() {
            "matches no module".to_string()
        } else {
            format!("matches {}", matched.join(", "))
        };
        return Err(UsageError(format!(
            "the plan's checkpoint regex {pattern} {what} of {}, but the plan lists {}; the plan was \
             edited or is damaged: re-plan with this ckptune",
            model.name,
            if listed.is_empty() {
                "no module".to_string()
            } else {
                plan.checkpoint.modules.join(", ")
            }
        )));
    }
    Ok(())
}

/// A sharded plan's `shard` section means what it says: at least one rank, a collective the
/// snippets know, and units that are distinct modules of the model, none inside another
/// (`fully_shard` on both would nest them; ckptune models one level of units under the root).
fn check_shard(plan: &PlanJson, shard: &ShardJson) -> Result<(), UsageError> {
    let damaged = |what: String| {
        UsageError(format!(
            "the plan's shard section {what}; the plan was edited or is damaged: re-plan with \
             `ckptune plan --shard N`"
        ))
    };
    if shard.ranks < 1 {
        return Err(damaged(format!("has {} ranks", shard.ranks)));
    }
    if !matches!(shard.collective.as_str(), "gloo" | "nccl") {
        return Err(damaged(format!(
            "names the collective {:?} (expected gloo or nccl)",
            shard.collective
        )));
    }
    let model = &plan.model;
    let missing = unknown_modules(model, &shard.units);
    if !missing.is_empty() {
        return Err(damaged(format!(
            "shards {} but {} has no module of that name",
            missing.join(", "),
            model.name
        )));
    }
    for (i, a) in shard.units.iter().enumerate() {
        for b in &shard.units[i + 1..] {
            if a == b {
                return Err(damaged(format!("lists the unit {a} twice")));
            }
            if a.starts_with(&format!("{b}.")) || b.starts_with(&format!("{a}.")) {
                return Err(damaged(format!("lists the units {a} and {b}, one inside the other")));
            }
        }
    }
    Ok(())
}

/// What the snippets need to know about the model beyond the plan's fields: where a task
/// model keeps the backbone the plan's names are relative to, and which modules are layers.
struct Facts {
    /// The submodule of the usual task model (`BertForSequenceClassification`,
    /// `GPT2LMHeadModel`, `LlamaForCausalLM`, a torchvision ResNet) whose names the plan uses.
    backbone: &'static str,
    /// What that task model is, for the comment.
    task_model: &'static str,
    /// The repeated layers (`encoder.layer.N`, `h.N`, `model.layers.N`): Hugging Face's
    /// `GradientCheckpointingLayer`s.
    layers: Vec<String>,
}

impl Facts {
    fn of(plan: &PlanJson) -> Facts {
        let has = |name: &str| plan.model.modules.iter().any(|m| m == name);
        let numbered = |prefix: &str| -> Vec<String> {
            plan.model
                .modules
                .iter()
                .filter(|m| {
                    m.strip_prefix(prefix)
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                })
                .cloned()
                .collect()
        };
        // The families as ckptune loads them: their backbone's names without the task
        // model's prefix (BERT, GPT-2) or with the model's own (Llama's `model.`).
        if has("embeddings") && has("encoder.layer.0") {
            Facts {
                backbone: "bert",
                task_model: "a Hugging Face BertForSequenceClassification",
                layers: numbered("encoder.layer."),
            }
        } else if has("wte") && has("h.0") {
            Facts {
                backbone: "transformer",
                task_model: "a Hugging Face GPT2LMHeadModel",
                layers: numbered("h."),
            }
        } else if has("model.embed_tokens") && has("model.layers.0") {
            Facts {
                backbone: "",
                task_model: "a Hugging Face LlamaForCausalLM (Mistral, Qwen2)",
                layers: numbered("model.layers."),
            }
        } else {
            Facts {
                backbone: "",
                task_model: "the model ckptune planned (a torchvision ResNet, your exported module)",
                layers: Vec::new(),
            }
        }
    }

    /// Whether every checkpointed module is a layer (and at least one is checkpointed).
    fn only_layers(&self, plan: &PlanJson) -> bool {
        !plan.checkpoint.modules.is_empty() && plan.checkpoint.modules.iter().all(|m| self.layers.contains(m))
    }
}

/// A document part as a Python literal (see `formats::python_literal`).
fn py<T: formats::Document>(value: &T) -> String {
    // Plain strings, lists and the plan's own config always serialize.
    formats::python_literal(value).unwrap_or_else(|_| "None".into())
}

fn py_str(s: &str) -> String {
    py(&s)
}

/// `PLAN = {...}`: the fields the companion reads (format, checkpoint, config), as the plan has
/// them; the config as serialized, so fields added to it (`optimizer_impl`) travel unchanged.
fn plan_literal(plan: &PlanJson) -> String {
    // Regex first, as the plan file has it (a JSON map here would sort the keys).
    let checkpoint = format!(
        "{{\"regex\": {}, \"modules\": {}}}",
        py_str(&plan.checkpoint.regex),
        py(&plan.checkpoint.modules)
    );
    format!(
        "PLAN = {{\n    \"format\": {},\n    \"checkpoint\": {},\n    \"config\": {},\n}}\n",
        py_str(formats::PLAN_FORMAT),
        checkpoint,
        py(&plan.config)
    )
}

/// The comment every snippet opens with: what was planned, for what, with what prediction.
fn header(plan: &PlanJson, trainer: &str) -> String {
    let c = &plan.config;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# {trainer} with the ckptune plan for {} (ckptune {}).",
        plan.model.name, plan.ckptune_version
    );
    let modules = if plan.checkpoint.modules.is_empty() {
        "nothing".to_string()
    } else {
        plan.checkpoint.modules.join(", ")
    };
    let _ = writeln!(s, "#   checkpoint: {modules} (regex {})", plan.checkpoint.regex);
    let _ = writeln!(
        s,
        "#   config {}: precision {}, optimizer {}, micro-batch {}, gradient accumulation {}, set_to_none {}",
        c.label(),
        c.precision,
        c.optimizer,
        c.micro_batch,
        c.grad_accum,
        c.set_to_none
    );
    let mut shape = Vec::new();
    if let Some(i) = plan.shape.image {
        shape.push(format!("images {i}x{i}"));
    }
    if let Some(q) = plan.shape.seq {
        shape.push(format!("sequences of {q} tokens"));
    }
    if !shape.is_empty() {
        let _ = writeln!(s, "#   inputs: {}", shape.join(", "));
    }
    let _ = writeln!(
        s,
        "#   predicted peak {} ({} B) of the budget {} ({} B), measured on {}, threads: {}",
        format_size(plan.predicted.peak_bytes.max(0) as u64),
        group_digits(plan.predicted.peak_bytes),
        format_size(plan.budget_bytes.max(0) as u64),
        group_digits(plan.budget_bytes),
        plan.device.device,
        plan.device.threads
    );
    if let Some(shard) = &plan.shard {
        s.push_str(&shard_header(shard, c.micro_batch));
    }
    s
}

/// The header's lines for a sharded plan: the ranks, the units, each rank's predicted peak.
fn shard_header(shard: &ShardJson, micro_batch: i64) -> String {
    let mut s = String::new();
    let units = if shard.units.is_empty() {
        "on the root only (every parameter)".to_string()
    } else {
        format!(
            "on {} (reshard_after_forward={}), then on the root (every other parameter)",
            unit_list(&shard.units),
            py_bool(shard.reshard_after_forward)
        )
    };
    let _ = writeln!(
        s,
        "#   sharded over {n} ranks with FSDP2 ({}): fully_shard {units}; micro-batch {micro_batch} per rank, \
         {} samples per micro-step over the {n} ranks",
        shard.collective,
        micro_batch * shard.ranks,
        n = shard.ranks,
    );
    // Ranks with the same prediction in one entry: `ranks 0–2 …; rank 3 …`.
    let mut groups: Vec<(i64, i64, &RankPredictionJson)> = Vec::new();
    for r in &shard.per_rank {
        match groups.last_mut() {
            Some((_, last, g)) if g.peak_bytes == r.peak_bytes && g.peak_moment == r.peak_moment => *last = r.rank,
            _ => groups.push((r.rank, r.rank, r)),
        }
    }
    let entries: Vec<String> = groups
        .iter()
        .map(|(first, last, r)| {
            let who = if first == last {
                format!("rank {first}")
            } else {
                format!("ranks {first}–{last}")
            };
            format!(
                "{who} {} ({} B) at {}",
                format_size(r.peak_bytes.max(0) as u64),
                group_digits(r.peak_bytes),
                r.peak_moment
            )
        })
        .collect();
    if !entries.is_empty() {
        let _ = writeln!(s, "#   predicted peak per rank: {}", entries.join("; "));
    }
    s
}

/// For the one-process snippets of a sharded plan: what they leave out.
fn one_process_note(plan: &PlanJson) -> &'static str {
    if plan.shard.is_some() {
        "# This snippet trains on one process, without the plan's sharding: `ckptune emit fsdp2` writes that.\n"
    } else {
        ""
    }
}

/// Module names for a comment: all of them, or the first two and the last of a long list.
fn unit_list(units: &[String]) -> String {
    match units {
        [first, second, .., last] if units.len() > 6 => {
            format!("{first}, {second}, …, {last} ({} units)", units.len())
        }
        _ => units.join(", "),
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

fn backbone_comment(f: &Facts) -> String {
    if f.backbone.is_empty() {
        format!(
            "# The module whose names the plan uses: {}, whole (\"\" is the model itself).\n",
            f.task_model
        )
    } else {
        let layer = f.layers.first().map(String::as_str).unwrap_or("…");
        format!(
            "# The submodule whose names the plan uses. ckptune plans the backbone, so for\n\
             # {}, the plan's `{layer}` is `{}.{layer}`;\n\
             # use \"\" if your model is the backbone itself.\n",
            f.task_model, f.backbone
        )
    }
}

fn python(plan: &PlanJson, f: &Facts) -> String {
    let mut s = header(plan, "Plain PyTorch training");
    s.push_str(one_process_note(plan));
    s.push_str("# Needs the ckptune companion (`pip install ./python` from a ckptune checkout) and torch.\n");
    s.push_str("import torch\n\nimport ckptune\n\n");
    s.push_str(&plan_literal(plan));
    s.push_str(&backbone_comment(f));
    let _ = writeln!(s, "BACKBONE = {}\n\n", py_str(f.backbone));
    let _ = write!(
        s,
        r#"def train(model, loader, loss_fn, lr=1e-3, device="cpu"):
    """Trains `model` as the plan was measured: the plan's modules checkpointed, its precision,
    optimizer, accumulation and zero_grad. `loader` yields batches of {mb} samples;
    `loss_fn(model, batch)` returns the loss (with inputs in the parameters' dtype for bf16-pure).
    Returns the names `ckptune.apply` wrapped."""
    wrapped = ckptune.apply(model.get_submodule(BACKBONE), PLAN)
    cfg = ckptune.training_config(PLAN)
    model.to(device=device, dtype=cfg.param_dtype).train()
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
    scaler = torch.amp.GradScaler(device) if cfg.grad_scaler else None
{loop}"#,
        mb = plan.config.micro_batch,
        loop = training_loop("device", "loss_fn(model, batch)")
    );
    s
}

/// The loop of every plain-PyTorch snippet, one step per batch: `device_type` names the
/// autocast device, `loss` computes one micro-batch's loss.
fn training_loop(device_type: &str, loss: &str) -> String {
    format!(
        r#"    for step, batch in enumerate(loader):
        # cache_enabled=False: autocast's cache would keep checkpointed layers' casts of their
        # weights until this region ends, which the plan does not count (results/pytorch-peaks).
        with torch.autocast({device_type}, dtype=cfg.autocast_dtype, enabled=cfg.autocast_dtype is not None,
                            cache_enabled=False):
            loss = {loss} / cfg.grad_accum
        (scaler.scale(loss) if scaler else loss).backward()
        if (step + 1) % cfg.grad_accum == 0:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=cfg.set_to_none)
    return wrapped
"#
    )
}

/// `--emit fsdp2`: the `python` snippet's loop on N ranks, each a torchrun process, the model
/// sharded as the plan was modelled (docs/fsdp.md, python/ckptune_harness/fsdp/): the plan's modules
/// checkpointed by `ckptune.apply`, `fully_shard` on every unit with the plan's
/// `reshard_after_forward`, then on a root whose forward is the loss.
fn fsdp2(plan: &PlanJson, f: &Facts) -> Result<String, UsageError> {
    let shard = plan.shard.as_ref().ok_or_else(|| {
        UsageError(format!(
            "--emit fsdp2: the plan for {} is for one device (it has no shard section); plan for N \
             ranks with `ckptune plan --shard N`, or use --emit python",
            plan.model.name
        ))
    })?;
    let c = &plan.config;
    let n = shard.ranks;
    let mut s = header(plan, "Plain PyTorch FSDP2 training");
    let _ = writeln!(
        s,
        "# Launch one process per rank: torchrun --nproc_per_node {n} train.py\n\
         # Needs torch with torch.distributed.fsdp.fully_shard (2.6 or later) and the ckptune companion\n\
         # (`pip install ./python` from a ckptune checkout)."
    );
    s.push_str("import os\n\nimport torch\nimport torch.distributed as dist\n");
    s.push_str("from torch.distributed.device_mesh import init_device_mesh\n");
    s.push_str("from torch.distributed.fsdp import fully_shard\n\nimport ckptune\n\n");
    s.push_str(&plan_literal(plan));
    s.push_str(&backbone_comment(f));
    let _ = writeln!(s, "BACKBONE = {}", py_str(f.backbone));
    let _ = writeln!(s, "RANKS = {n}\n\n");
    s.push_str(
        r#"class LossRoot(torch.nn.Module):
    """FSDP's root: the model, with the loss as its forward. The root's parameters (all but the
    units') are all-gathered in its pre-forward and stay unsharded until its backward, so the
    whole step runs inside it, as ckptune modelled it; a loss that calls submodules (BERT's
    `model.bert`, then `model.classifier`) would otherwise bypass the root's hooks."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


"#,
    );
    // The device and process group follow the plan's collective: the plan counted gloo's
    // temporaries for a CPU target and none for NCCL's.
    let init = if shard.collective == "nccl" {
        "    \"\"\"Joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,\n\
         \x20   LOCAL_RANK) with NCCL, the plan's collective, one GPU per rank; returns this rank's device.\"\"\"\n\
         \x20   device = torch.device(\"cuda\", int(os.environ[\"LOCAL_RANK\"]))\n\
         \x20   torch.cuda.set_device(device)\n\
         \x20   dist.init_process_group(backend=\"nccl\")\n"
    } else {
        "    \"\"\"Joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)\n\
         \x20   with gloo, the plan's collective, on the CPU; returns this rank's device.\"\"\"\n\
         \x20   device = torch.device(\"cpu\")\n\
         \x20   dist.init_process_group(backend=\"gloo\")\n"
    };
    let _ = write!(
        s,
        r#"def init_distributed():
{init}    if dist.get_world_size() != RANKS:
        raise RuntimeError(f"the plan is for {{RANKS}} ranks, this run has {{dist.get_world_size()}}: launch it with "
                           f"torchrun --nproc_per_node {{RANKS}}, or plan again with --shard {{dist.get_world_size()}}")
    return device


"#
    );
    let mut calls = String::new();
    for unit in &shard.units {
        let _ = writeln!(
            calls,
            "    fully_shard(backbone.get_submodule({}), mesh=mesh, reshard_after_forward={})",
            py_str(unit),
            py_bool(shard.reshard_after_forward)
        );
    }
    let units_doc = match (shard.units.len(), shard.reshard_after_forward) {
        (0, _) => "The plan has no units: the root holds every parameter.".to_string(),
        (k, true) => format!(
            "Each of the {k} units frees its gathered parameters after its forward\n    \
             (reshard_after_forward=True) and gathers them again for its backward."
        ),
        (k, false) => format!(
            "Each of the {k} units keeps its gathered parameters from its forward to its\n    \
             backward (reshard_after_forward=False)."
        ),
    };
    let _ = write!(
        s,
        r#"def shard(model, loss_fn, device):
    """The plan on this rank's `model`: ckptune.apply checkpoints the plan's modules, fully_shard
    makes each unit an FSDP unit, then the root takes every other parameter and, as FSDP does by
    default, keeps them unsharded from its forward to its backward.
    {units_doc}
    Returns the root, whose forward is the loss, and the names ckptune.apply wrapped."""
    backbone = model.get_submodule(BACKBONE)
    wrapped = ckptune.apply(backbone, PLAN)
    cfg = ckptune.training_config(PLAN)
    model.to(device=device, dtype=cfg.param_dtype)
    mesh = init_device_mesh(device.type, (RANKS,))
{calls}    root = LossRoot(model, loss_fn)
    fully_shard(root, mesh=mesh)
    return root, wrapped


"#
    );
    let optimizer = match c.torch_optim_kwarg() {
        Some((key, on)) => format!("{} with {key}={}", c.optimizer, py_bool(on)),
        None => c.optimizer.clone(),
    };
    let _ = write!(
        s,
        r#"def train(model, loader, loss_fn, device, lr=1e-3):
    """Trains `model` on this rank as the plan was measured: the plan's modules checkpointed, the
    model sharded over the {n} ranks, its precision, optimizer, accumulation and zero_grad. Every
    rank builds `model` with the same initial weights (FSDP shards one model); `loader` yields this
    rank's own batches of {mb} samples (a DistributedSampler splits a dataset); `loss_fn(model,
    batch)` returns the loss. Returns the names `ckptune.apply` wrapped."""
    root, wrapped = shard(model, loss_fn, device)
    cfg = ckptune.training_config(PLAN)
    root.train()
    # The plan's optimizer ({optimizer}) on this rank's shards.
    opt = cfg.optimizer_class(root.parameters(), lr=lr, **cfg.optimizer_kwargs)
    scaler = torch.amp.GradScaler(device.type) if cfg.grad_scaler else None
{loop}

def build(rank):
    """Yours: (model, loader, loss_fn) for this rank, as `train` takes them."""
    raise NotImplementedError("build(rank): return your model, this rank's loader and loss_fn")


def main(build=build):
    """One rank's run: joins the process group, trains what build(rank) returns, leaves the group."""
    device = init_distributed()
    try:
        model, loader, loss_fn = build(dist.get_rank())
        wrapped = train(model, loader, loss_fn, device)
        dist.barrier()  # no rank leaves the group while a peer still needs it
        return wrapped
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
"#,
        mb = c.micro_batch,
        loop = training_loop("device.type", "root(batch)"),
    );
    Ok(s)
}

fn autocast_flags(precision: &str) -> (&'static str, &'static str) {
    // (bf16, fp16) TrainingArguments flags: HF's mixed precision is autocast, as ckptune's.
    match precision {
        "bf16" => ("True", "False"),
        "fp16" => ("False", "True"),
        _ => ("False", "False"),
    }
}

fn hf(plan: &PlanJson, f: &Facts) -> String {
    let mut s = header(plan, "Hugging Face Trainer");
    s.push_str(one_process_note(plan));
    let native = f.only_layers(plan);
    let n = plan.checkpoint.modules.len();
    s.push_str("# Needs transformers (with accelerate) and the ckptune companion (`pip install ./python`).\n");
    if native {
        let _ = writeln!(
            s,
            "# The plan checkpoints {n} of the {} layers, each a transformers GradientCheckpointingLayer, so\n\
             # transformers' own per-layer flag expresses it exactly: activation checkpointing is enabled\n\
             # (non-reentrant, as ckptune measured) and then switched off on the layers the plan keeps.",
            f.layers.len()
        );
        if n == f.layers.len() {
            s.push_str(
                "# It names every layer, so TrainingArguments(activation_checkpointing=True) would be the same.\n",
            );
        } else {
            s.push_str(
                "# TrainingArguments(activation_checkpointing=True) (gradient_checkpointing_enable()) would\n\
                 # checkpoint every layer and recompute more than the plan needs, so it stays False here.\n",
            );
        }
    } else if plan.checkpoint.modules.is_empty() {
        s.push_str("# The plan checkpoints nothing: activation checkpointing stays off.\n");
    } else {
        s.push_str(
            "# The plan checkpoints modules that are not whole layers (or not only layers), which\n\
             # transformers' activation checkpointing cannot express (it checkpoints every layer, or\n\
             # every n-th): ckptune.apply wraps exactly the plan's modules before the Trainer is built,\n\
             # and TrainingArguments(activation_checkpointing=False) keeps transformers from adding more.\n",
        );
    }
    s.push_str("import torch\nfrom transformers import Trainer, TrainingArguments\n");
    if native {
        s.push_str("from transformers.modeling_layers import GradientCheckpointingLayer\n");
    }
    s.push_str("\nimport ckptune\n\n");
    s.push_str(&plan_literal(plan));
    s.push_str(&backbone_comment(f));
    let _ = writeln!(s, "BACKBONE = {}\n\n", py_str(f.backbone));
    if native {
        s.push_str(
            r#"def checkpoint_plan(model):
    """Transformers' per-layer checkpointing on exactly the plan's layers; returns their names."""
    backbone = model.get_submodule(BACKBONE)
    planned = PLAN["checkpoint"]["modules"]
    layers = {name: m for name, m in backbone.named_modules() if isinstance(m, GradientCheckpointingLayer)}
    missing = [name for name in planned if name not in layers]
    if missing:
        raise ValueError(f"not transformers checkpointing layers of this model: {missing}; its layers are "
                         f"{list(layers)[:4]}...; use ckptune.apply(model.get_submodule(BACKBONE), PLAN)")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for name, layer in layers.items():
        layer.gradient_checkpointing = name in planned
    return [name for name in layers if name in planned]


"#,
        );
    } else {
        s.push_str(
            r#"def checkpoint_plan(model):
    """ckptune.apply on the plan's modules; returns their names."""
    return ckptune.apply(model.get_submodule(BACKBONE), PLAN)


"#,
        );
    }
    let (bf16, fp16) = autocast_flags(&plan.config.precision);
    let mut zero = String::new();
    if !plan.config.set_to_none {
        zero.push_str(
            "    # The plan zeroes gradients in place (set_to_none=False); Trainer frees them after each\n\
             \x20   # step (model.zero_grad()), which keeps no more gradient bytes alive than the plan.\n",
        );
    }
    let _ = write!(
        s,
        r#"def make_trainer(model, train_dataset, lr=1e-3, output_dir="ckptune-trainer", trainer_kwargs=None, **training_args):
    """A Trainer with the plan applied: its modules checkpointed, its micro-batch ({mb}) and
    accumulation ({ga}), precision and optimizer. Extra TrainingArguments pass through. Trainer
    clips gradients by default (max_grad_norm=1.0), which the plan did not measure: its norms add
    a few bytes per parameter tensor before the optimizer step; max_grad_norm=0 is the plan's step."""
    checkpoint_plan(model)
    cfg = ckptune.training_config(PLAN)
    model.to(cfg.param_dtype)
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
{zero}    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size={mb},
        gradient_accumulation_steps={ga},
        bf16={bf16},
        fp16={fp16},
        activation_checkpointing=False,
        **training_args,
    )
    return Trainer(model=model, args=args, train_dataset=train_dataset, optimizers=(opt, None),
                   **(trainer_kwargs or {{}}))
"#,
        mb = plan.config.micro_batch,
        ga = plan.config.grad_accum,
    );
    s
}

fn lightning(plan: &PlanJson, f: &Facts) -> String {
    let mut s = header(plan, "Lightning");
    s.push_str(one_process_note(plan));
    let precision = match plan.config.precision.as_str() {
        "bf16" => "bf16-mixed",
        "fp16" => "16-mixed",
        "bf16-pure" => "bf16-true",
        _ => "32-true",
    };
    s.push_str(
        "# Needs lightning and the ckptune companion (`pip install ./python`).\n\
         # A callback applies the plan in `setup`, which Lightning runs before `configure_model`,\n\
         # `configure_optimizers` and any strategy's wrapping. FSDPStrategy(activation_checkpointing_policy=\n\
         # {LayerClass}) checkpoints every instance of the classes given, so it expresses a plan only\n\
         # when the plan names every layer of those classes; the callback is exact for any plan.\n",
    );
    s.push_str("import lightning.pytorch as L\n\nimport ckptune\n\n");
    s.push_str(&plan_literal(plan));
    let prefix = if f.backbone.is_empty() {
        "model".to_string()
    } else {
        format!("model.{}", f.backbone)
    };
    let whose = if f.backbone.is_empty() {
        format!("{}, whose names ckptune planned", f.task_model)
    } else {
        format!("{}, whose backbone `{}` ckptune planned", f.task_model, f.backbone)
    };
    let _ = writeln!(
        s,
        "# The plan's modules from your LightningModule. This assumes it keeps the network as\n\
         # `self.model`: {whose}.\n\
         # If yours differs, ckptune.apply's refusal names the path to use.\n\
         BACKBONE = {}\n\n",
        py_str(&prefix)
    );
    s.push_str(
        r#"class CkptunePlan(L.Callback):
    """Checkpoints the plan's modules of the LightningModule's `backbone` submodule when fitting starts."""

    def __init__(self, backbone=BACKBONE):
        self.backbone = backbone
        self.wrapped = None

    def setup(self, trainer, pl_module, stage):
        if stage == "fit" and self.wrapped is None:
            self.wrapped = ckptune.apply(pl_module.get_submodule(self.backbone), PLAN)


class CkptuneOptimization:
    """Mix into your LightningModule (`class Net(CkptuneOptimization, L.LightningModule)`): the plan's
    optimizer (class, foreach/fused) with learning rate `self.lr`, and gradients zeroed right after
    the optimizer step, as the plan was measured. (Lightning's own loop zeroes them after the next
    step's forward, so the last step's gradients would live through that forward.)"""

    lr = 1e-3

    def configure_optimizers(self):
        cfg = ckptune.training_config(PLAN)
        return cfg.optimizer_class(self.parameters(), lr=self.lr, **cfg.optimizer_kwargs)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        optimizer.zero_grad(set_to_none=ckptune.training_config(PLAN).set_to_none)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        pass  # done in optimizer_step
"#,
    );
    let _ = write!(
        s,
        r#"

def make_trainer(**trainer_args):
    """A Trainer with the plan's precision and accumulation; feed it batches of {mb} samples."""
    return L.Trainer(precision={precision}, accumulate_grad_batches={ga}, callbacks=[CkptunePlan()],
                     **trainer_args)
"#,
        mb = plan.config.micro_batch,
        ga = plan.config.grad_accum,
        precision = py_str(precision),
    );
    s
}

/// torchtitan's Llama 3 module names for ckptune's (Hugging Face's) Llama names.
fn torchtitan_name(name: &str) -> Option<String> {
    let map_child = |rest: &str| match rest {
        "self_attn" => Some("attention"),
        "mlp" => Some("feed_forward"),
        _ => None,
    };
    match name {
        "model.embed_tokens" => return Some("tok_embeddings".into()),
        "model.norm" => return Some("norm".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (index, child) = match rest.split_once('.') {
        Some((i, c)) => (i, Some(c)),
        None => (rest, None),
    };
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match child {
        None => Some(format!("layers.{index}")),
        Some(c) => map_child(c).map(|t| format!("layers.{index}.{t}")),
    }
}

fn torchtitan(plan: &PlanJson, f: &Facts) -> Result<String, UsageError> {
    if f.layers.is_empty() || !f.layers[0].starts_with("model.layers.") {
        return Err(UsageError(format!(
            "--emit torchtitan: torchtitan trains its own decoder implementations (Llama 3, Qwen3, \
             DeepSeek-V3, …), and {} is not a Llama-family model; use --emit python, hf or lightning",
            plan.model.name
        )));
    }
    let mut names = Vec::new();
    for m in &plan.checkpoint.modules {
        names.push(torchtitan_name(m).ok_or_else(|| {
            UsageError(format!(
                "--emit torchtitan: torchtitan's Llama has no module that corresponds to {m} (it has \
                 tok_embeddings, layers.N with attention and feed_forward, norm, output); use --emit python"
            ))
        })?);
    }
    let c = &plan.config;
    let mut s = header(plan, "torchtitan");
    s.push_str(
        "# Needs torchtitan. torchtitan applies activation checkpointing per transformer block of its own\n\
         # model (`layers.N`) through `Trainer.Config(activation_checkpoint=...)`: FullAC (every block\n\
         # recomputed whole), SelectiveAC (per-op, every block), MemoryBudgetAC (compiler) or None. None\n\
         # of them checkpoints a subset of blocks or modules, so a plan naming one is expressed by a\n\
         # FullAC subclass that wraps just those modules with the same wrapper FullAC uses.\n\
         # torchtitan's Llama is not the Hugging Face Llama ckptune measured (flex attention, fused\n\
         # qkv): the plan's choice of modules carries over, its predicted bytes do not; measure there.\n",
    );
    let layers_all: Vec<String> = f.layers.iter().filter_map(|l| torchtitan_name(l)).collect();
    let mut sorted = names.clone();
    sorted.sort();
    let mut all_sorted = layers_all.clone();
    all_sorted.sort();
    let ac = if names.is_empty() {
        s.push_str("# The plan checkpoints nothing.\n");
        "None".to_string()
    } else if sorted == all_sorted {
        s.push_str("# The plan checkpoints every block: FullAC is exactly that.\n");
        "FullAC.Config()".to_string()
    } else {
        format!("CkptunePlanAC.Config(modules={})", py(&names))
    };
    s.push_str("from dataclasses import dataclass, field\n\n");
    s.push_str("from torchtitan.distributed.activation_checkpoint import FullAC\n\n\n");
    s.push_str(
        r#"class CkptunePlanAC(FullAC):
    """FullAC's checkpoint wrapper on the listed modules of torchtitan's model only."""

    @dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        modules: list[str] = field(default_factory=list)
        """torchtitan module names to checkpoint (`layers.3`, `layers.5.feed_forward`)."""

    def apply(self, model):
        for fqn in self.config.modules:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            parent.register_module(child, self._wrap_block(parent.get_submodule(child), base_fqn=fqn))


"#,
    );
    let _ = writeln!(
        s,
        "# In your config_registry function: Trainer.Config(..., activation_checkpoint=ACTIVATION_CHECKPOINT)\n\
         ACTIVATION_CHECKPOINT = {ac}\n"
    );
    let (dtype, mp) = match c.precision.as_str() {
        "bf16-pure" => ("bfloat16", "float32"),
        "bf16" => ("float32", "bfloat16"),
        _ => ("float32", "float32"),
    };
    let (ranks, over) = match &plan.shard {
        None => (1, "on one data-parallel rank: x the DP degree".to_owned()),
        Some(shard) => (shard.ranks, format!("over the {} data-parallel ranks", shard.ranks)),
    };
    let mut training = format!(
        "    \"local_batch_size\": {mb},\n    \"global_batch_size\": {gb},  # {over}\n",
        mb = c.micro_batch,
        gb = c.micro_batch * c.grad_accum * ranks
    );
    if let Some(q) = plan.shape.seq {
        let _ = writeln!(training, "    \"seq_len\": {q},");
    }
    let _ = writeln!(training, "    \"dtype\": {},", py_str(dtype));
    let _ = writeln!(training, "    \"mixed_precision_param\": {},", py_str(mp));
    let _ = writeln!(
        s,
        "# TrainingConfig fields (torchtitan.config.TrainingConfig) for the plan's batch and precision.\n\
         TRAINING = {{\n{training}}}\n"
    );
    // `optimizer_impl` (single, foreach, fused) as the plan's config names it, when it does.
    let impl_kwargs = match c.torch_optim_kwarg() {
        Some((key, on)) => format!("{{\"{key}\": {}}}", py_bool(on)),
        None => "{}".to_owned(),
    };
    let _ = writeln!(
        s,
        "# The plan's optimizer is {}; torchtitan's default_adamw(lr=..., **OPTIMIZER_KWARGS) builds AdamW with\n\
         # the implementation the plan measured (other optimizers: ParamGroupConfig(optimizer_name=...)).\n\
         OPTIMIZER_KWARGS = {impl_kwargs}\n",
        c.optimizer
    );
    let Some(shard) = &plan.shard else {
        s.push_str(
            r#"

def apply_plan(config):
    """Sets the plan's activation checkpointing, batch and precision on a torchtitan Trainer.Config."""
    config.activation_checkpoint = ACTIVATION_CHECKPOINT
    for name, value in TRAINING.items():
        setattr(config.training, name, value)
    return config
"#,
        );
        return Ok(s);
    };
    let plan_units = if shard.units.is_empty() {
        "none (the root holds every parameter)".to_string()
    } else {
        let mapped: Vec<String> = shard
            .units
            .iter()
            .map(|u| torchtitan_name(u).unwrap_or_else(|| u.clone()))
            .collect();
        unit_list(&mapped)
    };
    let _ = write!(
        s,
        "# ParallelismConfig fields (torchtitan.config.ParallelismConfig) for the plan's sharding: FSDP2 over\n\
         # {n} ranks, reshard_after_forward={raf} for every unit (\"always\"/\"never\"; torchtitan's \"default\"\n\
         # keeps norm and output gathered). torchtitan wraps tok_embeddings, every block layers.N, and norm\n\
         # with output as its units; the plan's units were {plan_units}, its root the rest.\n\
         {mixed}PARALLELISM = {{\n    \"data_parallel_shard_degree\": {n},\n    \"fsdp_reshard_after_forward\": {policy},\n}}\n",
        n = shard.ranks,
        raf = py_bool(shard.reshard_after_forward),
        policy = py_str(if shard.reshard_after_forward { "always" } else { "never" }),
        mixed = if c.precision == "bf16" {
            "# Under FSDP torchtitan casts through MixedPrecisionPolicy (mixed_precision_param: bf16\n\
             # all-gathers), where the plan counted fp32 parameters under autocast.\n"
        } else {
            ""
        },
    );
    s.push_str(
        r#"

def apply_plan(config):
    """Sets the plan's activation checkpointing, batch, precision and sharding on a torchtitan
    Trainer.Config."""
    config.activation_checkpoint = ACTIVATION_CHECKPOINT
    for name, value in TRAINING.items():
        setattr(config.training, name, value)
    for name, value in PARALLELISM.items():
        setattr(config.parallelism, name, value)
    return config
"#,
    );
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchtitan_names() {
        assert_eq!(torchtitan_name("model.layers.3").as_deref(), Some("layers.3"));
        assert_eq!(
            torchtitan_name("model.layers.12.mlp").as_deref(),
            Some("layers.12.feed_forward")
        );
        assert_eq!(
            torchtitan_name("model.layers.0.self_attn").as_deref(),
            Some("layers.0.attention")
        );
        assert_eq!(torchtitan_name("model.embed_tokens").as_deref(), Some("tok_embeddings"));
        assert_eq!(torchtitan_name("model.layers.0.input_layernorm"), None);
        assert_eq!(torchtitan_name("model.layers.x"), None);
        assert_eq!(torchtitan_name("layer1"), None);
    }

    #[test]
    fn shard_header_groups_ranks_with_the_same_prediction() {
        let rank = |rank, peak_bytes, moment: &str| RankPredictionJson {
            rank,
            peak_bytes,
            peak_moment: moment.into(),
        };
        let units: Vec<String> = (0..12).map(|i| format!("model.layers.{i}")).collect();
        let shard = ShardJson {
            ranks: 4,
            reshard_after_forward: false,
            collective: "nccl".into(),
            units,
            per_rank: vec![
                rank(0, 2048, "forward layer4"),
                rank(1, 2048, "forward layer4"),
                rank(2, 2048, "forward layer4"),
                rank(3, 1024, "optimizer"),
            ],
        };
        assert_eq!(
            shard_header(&shard, 2),
            "#   sharded over 4 ranks with FSDP2 (nccl): fully_shard on model.layers.0, model.layers.1, …, \
             model.layers.11 (12 units) (reshard_after_forward=False), then on the root (every other \
             parameter); micro-batch 2 per rank, 8 samples per micro-step over the 4 ranks\n\
             #   predicted peak per rank: ranks 0–2 2.00 KiB (2,048 B) at forward layer4; rank 3 1.00 KiB \
             (1,024 B) at optimizer\n"
        );
    }
}
