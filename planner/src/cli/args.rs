//! The command line as the user types it (clap derive). Raw values are checked and turned
//! into a resolved setup in `cli::setup`, in one place.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Finds the fastest PyTorch training configuration that fits a memory budget: which modules
/// to activation-checkpoint (a regex over PyTorch module names), the precision, optimizer,
/// micro-batch and gradient accumulation — measured, solved exactly, and verified.
#[derive(Debug, Parser)]
#[command(name = "ckptune", version, about, max_term_width = 100)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the built-in models with their checkpoint candidates and parameter counts.
    Models {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Measure, per training config, what checkpointing each candidate block saves and costs.
    Profile(ProfileArgs),
    /// Measure real training steps for given checkpoint subsets (the ground truth).
    Sweep(SweepArgs),
    /// Find the fastest config and checkpoint set whose peak memory fits the budget.
    Plan(PlanArgs),
    /// Run a plan for real: measured vs predicted peak and step time (exit 1 if over budget).
    Verify(VerifyArgs),
    /// Train with a checkpoint regex or a plan applied; reports loss, step time and peak.
    Train(TrainArgs),
    /// Draw trade-off plots (SVG + PNG per config) from a profile or a sweep JSON file.
    Plot(PlotArgs),
    /// Print a plan as a ready snippet for a trainer (plain PyTorch, Hugging Face, Lightning,
    /// torchtitan).
    Emit(EmitArgs),
    /// Replay an allocation trace through a simulation of PyTorch's CUDA caching allocator:
    /// allocated and reserved peaks per marked span, the largest free block (exit 1 if it runs
    /// out of memory).
    SimulateAllocator(SimulateAllocatorArgs),
}

/// What to train and how it may be trained.
#[derive(Debug, Args, Clone)]
pub struct ModelArgs {
    /// A built-in model name (see `ckptune models`), or a path to a state dict
    /// (`.safetensors`, or a `.pt`/`.pth`/`.bin` written by torch.save), a Hugging Face
    /// folder or its config.json, a TorchScript `.pt`, or a torch.export program (`.pt2`, from
    /// `torch.export.save`).
    pub model: String,
    /// Micro-batch size (samples per forward/backward). Several comma-separated sizes let
    /// the planner choose. Default: 8 for vision models, 4 for language models.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<i64>,
    /// Samples per optimizer step; micro-batches are accumulated to reach it. Default: the
    /// largest --batch.
    #[arg(long)]
    pub global_batch: Option<i64>,
    /// Image side in pixels (vision models; default 224).
    #[arg(long)]
    pub image: Option<i64>,
    /// Sequence length in tokens (language models; default 128 for BERT, 1024 for GPT-2).
    #[arg(long)]
    pub seq: Option<i64>,
    /// Output classes of the classification head.
    #[arg(long)]
    pub classes: Option<i64>,
    /// Entry of a torch.save dict holding the state dict (`model`, `state_dict`, …); by default
    /// the top level, or the first of state_dict, model_state_dict, model, module, net.
    #[arg(long)]
    pub state_dict_key: Option<String>,
    /// Attention heads of a transformer read from a state dict, whose weights do not record
    /// them (the default there is hidden / 64, true of released BERT, GPT-2 and Llama models);
    /// a Hugging Face folder's config.json says it instead.
    #[arg(long)]
    pub heads: Option<i64>,
    /// Attention implementation of a transformer, Hugging Face's `attn_implementation`: `sdpa`
    /// (`scaled_dot_product_attention`, transformers' default and so ckptune's) or `eager`
    /// (the `[batch, heads, seq, seq]` scores kept for backward). A config.json that names one
    /// is followed unless this is given.
    #[arg(long)]
    pub attention: Option<String>,
    /// Candidate granularity: `layer` (ResNet stages, transformer layers), `block` (the
    /// modules inside them: `layer3.17`, `encoder.layer.3.attention`, `h.5.mlp`) or `nested`
    /// (both: a layer or any of its children, never both).
    #[arg(long, default_value = "layer")]
    pub granularity: String,
    /// For a torch.export program (`.pt2`): the candidate modules, a regex matched against whole
    /// module names (`layer[1-4]`, `encoder\.layer\.\d+`), instead of --granularity's rule.
    #[arg(long)]
    pub candidates: Option<String>,
    /// Precisions to consider, comma-separated: fp32, bf16 (autocast), fp16 (CUDA only),
    /// bf16-pure. Default: fp32 and bf16 for `plan`, fp32 otherwise.
    #[arg(long, value_delimiter = ',')]
    pub precision: Vec<String>,
    /// Optimizers to consider, comma-separated: sgd, sgd-momentum, adam, adamw, lion,
    /// adam8bit, adamw8bit (8-bit block-wise moments, a quarter of Adam's state).
    #[arg(long, value_delimiter = ',', default_value = "adamw")]
    pub optimizer: Vec<String>,
    /// torch.optim implementations to consider for sgd, sgd-momentum, adam and adamw,
    /// comma-separated: single (`foreach=False`), foreach, fused. They differ in the optimizer
    /// step's temporaries. Default: PyTorch's own default for the device (single on CPU,
    /// foreach on CUDA), so the plan holds in a loop that does not set them.
    #[arg(long, value_delimiter = ',')]
    pub optimizer_impl: Vec<String>,
    /// Also consider the 8-bit variant of each Adam-family optimizer given (adamw → adamw8bit).
    #[arg(long)]
    pub allow_8bit: bool,
    /// Zero gradients in place instead of freeing them after each optimizer step.
    #[arg(long)]
    pub zero_grad_in_place: bool,
    /// The training loop keeps autocast's weight-cast cache on over its forward and loss, as the
    /// Hugging Face Trainer does (`plan --emit hf` implies it): the peak then counts the bf16
    /// casts of the weights until the loss is made. Without it the loop passes
    /// `torch.autocast(..., cache_enabled=False)`, as Lightning's bf16-mixed does. Applies to the
    /// autocast precisions (bf16, fp16).
    #[arg(long)]
    pub autocast_cache: bool,
    /// A language model's loss in this many chunks of tokens, each chunk's logits and their
    /// gradient freed before the next (`ckptune.chunked_causal_lm_loss` in the training loop).
    /// Several comma-separated counts let the planner choose; 1 computes the loss whole.
    /// Default: 1. GPT-2 and the Llama family only.
    #[arg(long, value_delimiter = ',')]
    pub loss_chunks: Vec<i64>,
    /// When the optimizer steps, comma-separated to let the planner choose: `after` (after
    /// backward, `opt.step()` in the loop; the default) or `in-backward` (each parameter updated
    /// as soon as its gradient is complete, in a post-accumulate-grad hook, its gradient freed
    /// there: `ckptune.optimizer_in_backward` in the loop), so parameter gradients never all
    /// exist at once. Not with gradient accumulation, fp16, the 8-bit optimizers,
    /// --zero-grad-in-place or --shard.
    #[arg(long, value_delimiter = ',')]
    pub optimizer_step: Vec<String>,
    /// auto (CUDA when a device is visible, else the CPU; the output says which), cpu or cuda
    /// (exit 2 when no CUDA device is visible, naming what was looked for).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Intra-op threads (profile and run must use the same count for exact memory). Default:
    /// the CPUs this process may use, less those the rest of the machine keeps busy when the
    /// command starts (docs/timing.md).
    #[arg(long)]
    pub threads: Option<i32>,
    /// How the step is measured: `run` trains it here for real (memory and times); `meta`
    /// measures memory on the meta device (exact, nothing allocated) and times real steps with
    /// nothing and with every candidate checkpointed (each block's recompute from the latter),
    /// refusing a model whose step does not fit in this machine's available memory; `estimate`
    /// measures memory on the meta device and estimates times with the cost model
    /// (docs/cost-model.md: this CPU's calibrated rates, or the GPU `--target cuda:NAME`
    /// names), running nothing; `auto` is `meta`, `estimate` where the step does not fit here,
    /// the program has no weights or `--target` names a GPU, or `run` where the meta device
    /// cannot run the model, and says which it did.
    #[arg(long, value_enum, default_value_t = Measure::Auto)]
    pub measure: Measure,
    /// Timed repeats per measured step.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Where profiles are cached (default: $CKPTUNE_CACHE, else ~/.cache/ckptune/profiles).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Re-measure even if a cached profile exists.
    #[arg(long)]
    pub no_cache: bool,
    /// No progress bars.
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Debug, Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Write the profile JSON here.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Print the profile JSON on stdout instead of a summary.
    #[arg(long)]
    pub json: bool,
    /// `cuda:NAME` (h100, h200, a100-80gb, l40s, rtx4090, ...): estimate the step times for that
    /// GPU with the cost model instead of timing them on this CPU; `cpu` (default) for this one.
    #[arg(long)]
    pub target: Option<String>,
    #[command(flatten)]
    pub selective: SelectiveArgs,
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Checkpoint regexes (full match over block names); one measured subset each. `''`
    /// measures nothing checkpointed.
    #[arg(long = "checkpoint")]
    pub checkpoints: Vec<String>,
    /// Also measure every subset of the candidates (only for ≤ 10 candidates).
    #[arg(long)]
    pub all_subsets: bool,
    /// A profile of the same model and configs: each point gets its predicted peak and time.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Memory budget: 12GiB, 12G (=GiB), 12000MB (decimal), 1.5TiB, or bytes.
    #[arg(long)]
    pub budget: String,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Plan from this profile instead of measuring.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    #[command(flatten)]
    pub selective: SelectiveArgs,

    /// Write the plan JSON here (nothing is written if no plan fits).
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Print the plan JSON on stdout instead of a summary.
    #[arg(long)]
    pub json: bool,
    /// Run the plan right after planning; if the measured peak exceeds the budget, plan again
    /// with the measured excess taken off the budget, until a verified plan fits.
    #[arg(long)]
    pub verify: bool,
    /// The device the plan is for, when it differs from the one measured on. A CUDA plan made
    /// from a CPU profile is judged on reserved memory: the chosen plan's step trace (recorded
    /// on the meta device) replayed through the simulation of PyTorch's CUDA caching allocator,
    /// plus the CUDA context (docs/cuda-allocator.md, "Planning for a GPU"). `cuda:NAME` (h100,
    /// h200, a100-80gb, l40s, rtx4090, ...) also estimates the step times for that GPU with the
    /// cost model (docs/cost-model.md).
    #[arg(long)]
    pub target: Option<String>,
    /// Plan for N ranks running PyTorch FSDP2: every unit and then the root wrapped with
    /// `fully_shard`, each rank's step modelled (its shards, the all-gathered layers, the
    /// reduce-scatter buffers, activations of its own micro-batch: --batch is per rank), and
    /// `reshard_after_forward` chosen next to the checkpoint set. The budget is per rank. N a
    /// power of two; fp32, AdamW or SGD with momentum (single-tensor), one micro-step per
    /// optimizer step (docs/fsdp.md, section 11). Verify with `verify --pytorch`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
    pub shard: Option<i64>,
    /// The modules `--shard` wraps with `fully_shard` (a full match over the chain's blocks);
    /// default: every candidate layer whose name ends in its index (`layer3`,
    /// `encoder.layer.11`, `h.5`).
    #[arg(long, value_name = "REGEX", requires = "shard")]
    pub shard_units: Option<String>,
    /// Memory kept out of the budget for the CUDA context, library workspaces and allocator
    /// fragmentation when planning a CUDA budget from a CPU profile, instead of simulating the
    /// caching allocator (default for sharded plans: 1 GiB + 10% of the budget).
    #[arg(long)]
    pub reserve: Option<String>,
    /// With a CUDA target: write the chosen plan's step trace (`ckptune.alloc-trace/1`, under
    /// the recommended PYTORCH_CUDA_ALLOC_CONF), for `ckptune simulate-allocator` or
    /// `scripts/gpu_check --traces`.
    #[arg(long, value_name = "PATH")]
    pub alloc_trace: Option<PathBuf>,
    /// Print the plan as a ready snippet for this trainer instead of the summary (the plan is
    /// still written with -o): python, fsdp2 (with --shard N: FSDP2 on N ranks under torchrun),
    /// hf, lightning or torchtitan.
    #[arg(long, value_enum, conflicts_with = "json")]
    pub emit: Option<EmitKind>,
}

#[derive(Debug, Args)]
pub struct EmitArgs {
    /// The trainer: python (plain PyTorch), fsdp2 (plain PyTorch FSDP2 on the N ranks of a plan
    /// made with `plan --shard N`), hf (Hugging Face Trainer), lightning, torchtitan.
    #[arg(value_enum)]
    pub kind: EmitKind,
    /// A plan written by `ckptune plan -o`.
    pub plan: PathBuf,
}

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// A plan written by `ckptune plan -o`.
    pub plan: PathBuf,
    /// Timed steps (after one warm-up step).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Write the verify report JSON here.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
    #[arg(long, short)]
    pub quiet: bool,
    /// Also run the plan in PyTorch eager on the built-in model's plain-torch reference
    /// (models/fixtures/reference.py) with the same counting allocator, and compare: exit 1 if
    /// PyTorch's peak exceeds the budget. A sharded plan (`plan --shard N`) runs instead with
    /// PyTorch FSDP2 on its N ranks, one CPU process each (`python -m ckptune_harness.fsdp`): exit 1 if
    /// any rank's peak exceeds the budget.
    #[arg(long)]
    pub pytorch: bool,
    /// The Python with torch that runs `--pytorch` (default: $CKPTUNE_PYTHON, else the venv
    /// `scripts/setup` links at .venv in this checkout).
    #[arg(long, requires = "pytorch")]
    pub python: Option<PathBuf>,
    /// The ranks a sharded plan (`plan --shard N`) is verified on: its FSDP2 run on N processes
    /// replaces the single-process runs. Optional (a sharded plan runs on its own ranks); when
    /// given it must be the plan's.
    #[arg(long, value_name = "N", requires = "pytorch", value_parser = clap::value_parser!(i64).range(1..))]
    pub shard: Option<i64>,
    /// The rendezvous port of a sharded run's process group on 127.0.0.1 (default: a free one
    /// the OS picks).
    #[arg(long, requires = "pytorch", value_parser = clap::value_parser!(u16).range(1..))]
    pub port: Option<u16>,
    /// With --pytorch, also run the plan in the trainer a snippet targets, through the snippet
    /// `ckptune emit TRAINER` writes (`hf`: the Hugging Face Trainer, `lightning`: Lightning), on the
    /// same reference, batches, optimizer and precision, and compare its peak too (exit 1 if it is
    /// over the budget). `eager` runs the documented loop alone. The trainers come from `.trainers`
    /// (scripts/setup) or the Python's own packages.
    #[arg(long, value_enum, default_value = "eager", requires = "pytorch")]
    pub trainer: VerifyTrainer,
}

/// The loops `verify --pytorch` runs a plan in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VerifyTrainer {
    /// The documented loop (`ckptune.training_config`), as `--emit python` writes it.
    Eager,
    /// The Hugging Face `Trainer`, through `ckptune emit hf`.
    Hf,
    /// Lightning, through `ckptune emit lightning`.
    Lightning,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Checkpoint the blocks whose names this regex fully matches (as the plan's regex).
    #[arg(long, conflicts_with = "plan")]
    pub checkpoint: Option<String>,
    /// Train with a plan's regex and config (overrides --precision/--optimizer/--batch).
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Write per-step results as JSON here.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// A profile (`ckptune profile -o`) or a sweep (`ckptune sweep -o`) JSON file.
    pub input: PathBuf,
    /// Directory for the plots (default: the input file's directory). Each config gives
    /// <model>-<precision>-<optimizer>-mb<N>-{tradeoff,candidates}.{svg,png}.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct SimulateAllocatorArgs {
    /// An allocation trace (`ckptune.alloc-trace/1` JSON: events in order, marks naming the
    /// moments of the step).
    pub trace: PathBuf,
    /// The PYTORCH_CUDA_ALLOC_CONF to simulate instead of the trace's own ("" for PyTorch's
    /// defaults), e.g. `expandable_segments:True` or `max_split_size_mb:128`.
    #[arg(long)]
    pub alloc_conf: Option<String>,
    /// What cudaMalloc can hand out (80GiB, 12G, 12000MB, bytes) instead of the trace's
    /// capacity; without either the device never runs out.
    #[arg(long)]
    pub capacity: Option<String>,
    /// Also give the statistics after every event (allocated, reserved, active, requested,
    /// segments, largest free block).
    #[arg(long)]
    pub every_event: bool,
    /// Write the replay JSON (`ckptune.alloc-replay/1`) here.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Print the replay JSON on stdout instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// How a profile is measured (`--measure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Measure {
    Auto,
    Meta,
    Run,
    Estimate,
}

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

/// `--selective`, which `profile` and `plan` share.
#[derive(Debug, Args)]
pub struct SelectiveArgs {
    /// Also offer each candidate layer selective activation checkpointing under these policies,
    /// comma-separated, choices beside keeping it and checkpointing it whole that the planner
    /// makes per layer: `matmul` (torchtitan's `op` policy) keeps the outputs of matrix products
    /// and attention kernels and recomputes the cheap operators between them; `attention`
    /// (Megatron's selective recompute) recomputes the attention core (the operators on
    /// `[..., s, s]` scores and the attention kernels) and the pointwise operators, and keeps
    /// the rest. `--selective` alone offers both. The profile measures one more step per policy
    /// with every candidate selective; the plan names the selective modules under each policy
    /// (`checkpoint.selective`) and `ckptune.apply` runs each under `torch.utils.checkpoint`
    /// with `context_fn=partial(create_selective_checkpoint_contexts, policy)`. Not with
    /// `--granularity nested` or `--shard`.
    #[arg(
        long,
        value_name = "POLICIES",
        value_delimiter = ',',
        num_args = 0..=1,
        default_missing_value = "matmul,attention"
    )]
    pub selective: Vec<String>,
}
