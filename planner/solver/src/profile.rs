//! What a profile holds: per config, the measured terms of every block and group in each
//! memory regime, the fixed bytes, the optimizer's peak and the step times. The runtime's
//! profiler fills these types, the memory model ([`crate::model`]) reads them, and the
//! planner's profile format serializes them as they are (feature `serde`), so no copy of them
//! exists anywhere else. Bytes are `i64` differences of allocator counters; the meaning of
//! every term is in `docs/memory-model.md`.

use crate::rates::DeviceRates;

/// A training config as every format names it: precision and optimizer by their CLI names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ConfigSpec {
    pub precision: String,
    pub optimizer: String,
    /// `torch.optim`'s implementation (`single`, `foreach`, `fused`) for the optimizers it has;
    /// absent for the others (lion, the 8-bit ones) and in documents written before the choice
    /// existed.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub optimizer_impl: Option<String>,
    pub micro_batch: i64,
    pub grad_accum: i64,
    pub set_to_none: bool,
    /// The loop keeps autocast's weight-cast cache on over one region around the forward and
    /// the loss, as the Hugging Face `Trainer` does (Lightning's `bf16-mixed` turns it off): the low-precision
    /// casts of weights then live until the loss is made (docs/memory-model.md, "Autocast's
    /// cache"). Only autocast precisions set it; absent (off) in documents written before it
    /// was a choice, whose loop passes `cache_enabled=False`.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "std::ops::Not::not"))]
    pub autocast_cache: bool,
    /// A language model's loss computed in this many chunks of tokens, each chunk's logits
    /// and their gradient freed before the next (ckptune's chunked loss); absent for the whole
    /// loss at once, as in documents written before the choice existed.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub loss_chunks: Option<i64>,
    /// Each parameter's optimizer update runs in backward, as soon as its gradient is
    /// accumulated, and the gradient is freed right after (torchtune's `optimizer_in_bwd`: one
    /// optimizer per parameter, stepped in a post-accumulate-grad hook), so parameter gradients
    /// never all exist at once. Absent (off: the step after backward) in documents written
    /// before it was a choice.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "std::ops::Not::not"))]
    pub optimizer_in_backward: bool,
}

impl ConfigSpec {
    /// Chunks of the loss: 1 when the loss is computed whole.
    pub fn chunks(&self) -> i64 {
        self.loss_chunks.unwrap_or(1)
    }

    /// The same config, where a document written before the implementations were a choice
    /// (`optimizer_impl` absent) stands for the single-tensor loop, the one it measured.
    pub fn same_as(&self, other: &ConfigSpec) -> bool {
        let imp = |c: &ConfigSpec| match c.optimizer_impl.as_deref() {
            None => "single".to_owned(),
            Some(i) => i.to_owned(),
        };
        ConfigSpec {
            optimizer_impl: None,
            loss_chunks: None,
            ..self.clone()
        } == ConfigSpec {
            optimizer_impl: None,
            loss_chunks: None,
            ..other.clone()
        } && imp(self) == imp(other)
            && self.chunks() == other.chunks()
    }

    /// The `torch.optim` keyword that selects the implementation (`foreach=False` for the
    /// single-tensor loop, `foreach=True`, `fused=True`), for the optimizers that have one.
    pub fn torch_optim_kwarg(&self) -> Option<(&'static str, bool)> {
        match self.optimizer_impl.as_deref()? {
            "single" => Some(("foreach", false)),
            "foreach" => Some(("foreach", true)),
            "fused" => Some(("fused", true)),
            _ => None,
        }
    }

    /// `adamw`, or `adamw-foreach`/`adamw-fused` for those implementations: the single-tensor
    /// loop is PyTorch's CPU default and goes unnamed.
    pub fn optimizer_label(&self) -> String {
        match self.optimizer_impl.as_deref() {
            None | Some("single") => self.optimizer.clone(),
            Some(i) => format!("{}-{i}", self.optimizer),
        }
    }

    /// `bf16/adamw/mb8x1`, with `/zero` when gradients are zeroed in place, `/cache` when the
    /// loop keeps autocast's cache on, `/loss4` when the loss runs in 4 chunks and `/in-bwd`
    /// when the optimizer steps in backward.
    pub fn label(&self) -> String {
        format!(
            "{}/{}/mb{}x{}{}{}{}{}",
            self.precision,
            self.optimizer_label(),
            self.micro_batch,
            self.grad_accum,
            if self.set_to_none { "" } else { "/zero" },
            if self.autocast_cache { "/cache" } else { "" },
            match self.chunks() {
                1 => String::new(),
                n => format!("/loss{n}"),
            },
            if self.optimizer_in_backward { "/in-bwd" } else { "" }
        )
    }
}

/// Per-block terms for one memory regime (bytes are deltas; seconds per micro-step).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BlockProfile {
    pub name: String,
    pub candidate: bool,
    /// Kept after a grad-mode forward (output and saved activations), and the forward's peak
    /// above its start.
    pub kept_grad: i64,
    pub fwd_transient_grad: i64,
    /// Kept after a no-grad forward (output and the RNG state), and its peak above its start.
    pub kept_nograd: i64,
    pub fwd_transient_nograd: i64,
    /// Gradient bytes alive when this block's backward starts (its output's gradient, the
    /// parameter gradients accumulated so far, the loss head's), above what earlier blocks keep.
    pub carry: i64,
    /// Plain block: peak of its VJP above the VJP's start.
    pub bwd_transient: i64,
    /// Checkpointed block: recompute peak above the backward base, kept after recompute, and
    /// its VJP's peak above the VJP's start.
    pub rec_transient: i64,
    pub kept_recompute: i64,
    pub bwd_transient_ckpt: i64,
    /// Output bytes and input-gradient bytes (informational; computed from shapes).
    pub grad_in_bytes: i64,
    pub fwd_seconds: f64,
    pub fwd_nograd_seconds: f64,
    pub bwd_seconds: f64,
    pub rec_seconds: f64,
    /// Bytes of its output the block's backward frees as it starts (0 when its own graph saved
    /// the output), plain and checkpointed: a hook at the start of the block's backward (FSDP's
    /// pre-backward) sees the level before the VJP less these. Absent in profiles from before
    /// ckptune measured them.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub out_released: Option<i64>,
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub out_released_ckpt: Option<i64>,
    /// Bytes of low-precision weight casts only autocast's cache holds after the block's
    /// grad-mode and no-grad forward (what closing the block's own autocast region frees): a
    /// loop that keeps the cache on over the whole forward keeps them until the loss is made.
    /// Absent in profiles from before ckptune measured them.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub cache_grad: Option<i64>,
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub cache_nograd: Option<i64>,
    /// The block run selective under each policy the profile measured (`--selective`), in the
    /// order the flag named them; empty when none (written as one object for one policy, as
    /// before the flag could name several).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Vec::is_empty", with = "crate::formats::one_or_many")
    )]
    pub selective: Vec<SelectiveProfile>,
}

/// A block run selective under `policy` (its forward keeps the outputs of the operators the
/// policy saves; its recompute computes the rest), from the step with every candidate
/// selective: the checkpointed block's terms, measured that way.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SelectiveProfile {
    /// `matmul` (torchtitan's op policy) or `attention` (Megatron's attention core).
    pub policy: String,
    pub kept: i64,
    pub fwd_transient: i64,
    /// What only autocast's cache held when the forward's region closed.
    pub cache: i64,
    pub rec_transient: i64,
    pub kept_recompute: i64,
    pub bwd_transient: i64,
    pub out_released: i64,
    /// Bytes of the block's output its selective cache keeps where a plain next block would let
    /// go of it (the policy saves the operator that made it): held until this block's backward
    /// whatever the next block does (docs/memory-model.md, "Selective checkpointing").
    #[cfg_attr(feature = "serde", serde(default))]
    pub held_output: i64,
    pub rec_seconds: f64,
}

/// Terms of a group (a module over a run of blocks) checkpointed as a whole, from the step
/// with every group checkpointed (step C). Bytes are above the group's forward start, or in
/// backward above its base: what earlier blocks keep plus `carry`.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct GroupProfile {
    pub name: String,
    pub first: usize,
    pub last: usize,
    /// Kept after the group's no-grad forward (its last block's output).
    pub kept: i64,
    /// Per block of the group, in order: forward peak above the group's start.
    pub fwd_transient: Vec<i64>,
    /// Gradient bytes alive when the group's recompute starts, above what earlier blocks keep.
    pub carry: i64,
    /// Per block: recompute peak and VJP peak above the group's backward base.
    pub rec_transient: Vec<i64>,
    pub bwd_transient: Vec<i64>,
    /// Run fused (nothing in it checkpointed: one graph, as PyTorch runs the module): kept
    /// after its forward, forward peak per block above its start, carry, and the peak of its
    /// single VJP above the VJP's start.
    pub fused_kept: i64,
    pub fused_fwd_transient: Vec<i64>,
    pub fused_carry: i64,
    pub fused_bwd_transient: i64,
}

impl BlockProfile {
    /// The block's work, its position aside: every byte term but `carry` (which holds the
    /// gradients of the blocks after it). Blocks with equal keys and equal parameters compute
    /// the same thing, so their recompute times differ only by noise.
    pub fn work_key(&self) -> Vec<i64> {
        vec![
            self.candidate as i64,
            self.kept_grad,
            self.fwd_transient_grad,
            self.kept_nograd,
            self.fwd_transient_nograd,
            self.bwd_transient,
            self.rec_transient,
            self.kept_recompute,
            self.bwd_transient_ckpt,
            self.grad_in_bytes,
            self.out_released.unwrap_or(-1),
            self.out_released_ckpt.unwrap_or(-1),
            self.cache_grad.unwrap_or(-1),
            self.cache_nograd.unwrap_or(-1),
        ]
    }
}

impl GroupProfile {
    /// As [`BlockProfile::work_key`], for a group: its length and every byte term but the
    /// carries.
    pub fn work_key(&self) -> Vec<i64> {
        let mut key = vec![
            (self.last - self.first) as i64,
            self.kept,
            self.fused_kept,
            self.fused_bwd_transient,
        ];
        for v in [
            &self.fwd_transient,
            &self.rec_transient,
            &self.bwd_transient,
            &self.fused_fwd_transient,
        ] {
            key.push(v.len() as i64);
            key.extend_from_slice(v);
        }
        key
    }
}

/// The terms of one micro-step regime: the first micro-step of an optimizer step allocates
/// parameter gradients (with `set_to_none`); later micro-steps accumulate into existing ones.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RegimeProfile {
    pub label: String,
    /// Level at the micro-step's start.
    pub fixed: i64,
    /// Loss forward+backward peak above the level the chain leaves.
    pub loss_transient: i64,
    /// The loss head's forward alone: its peak, and what it leaves with backward's seed made,
    /// above the level the chain leaves; and the level when backward is done (the loss and the
    /// seed still alive) above `fixed`. What FSDP's root hooks see (`plan --shard`); absent in
    /// profiles from before ckptune measured them.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub loss_forward_transient: Option<i64>,
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub loss_kept: Option<i64>,
    /// The loss's backward alone (from backward's seed on): its peak above the level the chain
    /// leaves. A loop that keeps autocast's cache on frees the casts between the loss's forward
    /// and backward, so the two are separate moments there. Absent in older profiles.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub loss_backward_transient: Option<i64>,
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub after_backward: Option<i64>,
    pub blocks: Vec<BlockProfile>,
    /// The chain's groups (empty when it has none).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub groups: Vec<GroupProfile>,
}

/// Bytes of the step's fixed state, by category.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct FixedBytes {
    pub parameters: i64,
    pub buffers: i64,
    pub gradients: i64,
    pub optimizer_state: i64,
    /// Always 0 today: no config keeps fp32 master copies of low-precision parameters.
    pub master_weights: i64,
    pub batch: i64,
    /// Level at step start minus the categories above (tensors the process held before,
    /// e.g. the loaded model's originals): counted, never guessed.
    pub other: i64,
}

/// Median, min and max of repeated measurements.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stats {
    pub fn of(xs: &[f64]) -> Stats {
        if xs.is_empty() {
            return Stats::default();
        }
        let mut v = xs.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 {
            v[mid]
        } else {
            0.5 * (v[mid - 1] + v[mid])
        };
        Stats {
            median,
            min: v[0],
            max: v[v.len() - 1],
            n: v.len(),
        }
    }
}

/// How busy the rest of the machine was while a config's steps were timed (docs/timing.md).
/// A sample is contended when the rest of the machine took more CPU than the step's threads
/// leave free; contended samples are re-timed, and the estimates use the quiet ones.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Contention {
    /// Timed samples behind the estimates. 0: not recorded (a profile from before ckptune
    /// checked for contention).
    pub samples: usize,
    /// Of those, how many ran contended: a kind of step with no quiet sample left its
    /// contended ones in (its estimate is a busy machine's).
    pub contended: usize,
    /// Samples whose load could not be judged: no reading (no `/proc`), or a step too short
    /// for the counters to resolve one busy core.
    pub unchecked: usize,
    /// Steps run again because their timing was contended.
    pub retimed: usize,
    /// CPU the rest of the machine took during the samples behind the estimates, in cores
    /// (CPU seconds per second): the median and the highest.
    pub other_cores_median: f64,
    pub other_cores_max: f64,
}

impl Contention {
    /// Whether the load was checked at all.
    pub fn recorded(&self) -> bool {
        self.samples > 0
    }

    pub fn unrecorded(&self) -> bool {
        !self.recorded()
    }

    /// Some estimate rests on contended samples: no quiet sample could be had.
    pub fn contended(&self) -> bool {
        self.contended > 0
    }

    /// Every sample escaped judgement: nothing is known about the load.
    pub fn unjudged(&self) -> bool {
        self.recorded() && self.unchecked == self.samples
    }
}

/// Everything measured for one config. Fields are in the order of the profile format.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ConfigProfile {
    pub config: ConfigSpec,
    pub fixed: FixedBytes,
    pub regimes: Vec<RegimeProfile>,
    /// Absolute level at the optimizer step's peak.
    pub optimizer_peak: i64,
    /// Measured whole-step peaks (absolute) with nothing and with everything checkpointed.
    pub peak_none: i64,
    pub peak_all: i64,
    /// Step times (whole optimizer step, all micro-steps) with nothing / everything checkpointed,
    /// over the quiet samples (docs/timing.md); estimates use the median.
    pub seconds_none: Stats,
    pub seconds_all: Stats,
    /// Extra seconds per optimizer step if the block (then, after the blocks, the group) is
    /// checkpointed: its no-grad forward, once per micro-step (the median of `recompute_spread`).
    pub recompute_seconds: Vec<f64>,
    pub steps_run: usize,
    pub wall_seconds: f64,
    /// The samples behind `recompute_seconds`, per unit (empty in profiles from before
    /// ckptune recorded it).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub recompute_spread: Vec<Stats>,
    /// Per unit, the first unit doing the same work (equal terms, equal parameter shapes; itself
    /// when none before it does): units of one class share one estimate, the median of all
    /// their samples, so identical layers cost the same and noise cannot pick between them
    /// (docs/timing.md). Empty in profiles from before ckptune pooled them.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub recompute_class: Vec<usize>,
    /// How busy the rest of the machine was while the steps were timed (left out of documents
    /// when not recorded, so older profiles and the plans made from them read back unchanged).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Contention::unrecorded"))]
    pub contention: Contention,
    /// Set when the times above come from the cost model rather than timed steps
    /// (docs/cost-model.md): the rates they were estimated over. Absent for measured times, so
    /// measured profiles and the plans made from them read back unchanged.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub estimated: Option<Estimate>,
    /// Measured on a CUDA device: the caching allocator's reserved peaks of the steps whose
    /// allocated peaks are `peak_none` and `peak_all`. Absent for other devices.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub reserved: Option<ReservedPeaks>,
}

/// `torch.cuda.max_memory_reserved()` of a profile's steps with nothing and with everything
/// checkpointed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ReservedPeaks {
    pub none: i64,
    pub all: i64,
}

/// How a config's times were estimated: the cost model over an operator trace of its steps.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Estimate {
    /// Where the operators were counted: `meta` (a fake step, nothing computed) or the device
    /// of a real step (`cpu`).
    pub traced_on: String,
    /// The rates the operators' work was timed at; `rates.device` is the device the times are
    /// for.
    pub rates: DeviceRates,
    /// Per block, its estimated times (empty where not recorded).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub blocks: Vec<BlockEstimate>,
    /// Set where the times were brought to the pace of real steps measured beside them
    /// ([`ConfigProfile::to_pace`]); absent for the cost model's own times.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub pace: Option<Pace>,
}

/// The factor a config's estimated times were scaled by, and why: `plan --measure auto` times
/// some configs for real and brings the others' estimates to the pace those steps set, so that
/// an estimate never undercuts a measurement by the machine's speed of the moment.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Pace {
    pub factor: f64,
    pub why: String,
}

/// One block's estimated seconds per optimizer step (all micro-steps).
#[derive(Debug, Clone, PartialEq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BlockEstimate {
    /// Its forward in grad mode (as a plain step runs it, and as its recompute does).
    pub forward: f64,
    /// Its forward under no-grad: what checkpointing it adds (its `recompute_seconds`); 0 for
    /// a block that is not a candidate.
    pub nograd_forward: f64,
    /// Its VJP.
    pub backward: f64,
    /// Its recompute run selective (a profile offering selective checkpointing): only the
    /// operators its policy does not save, as [`SelectiveProfile::rec_seconds`] holds it; one
    /// per policy, in the order of [`BlockProfile::selective`].
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Vec::is_empty", with = "crate::formats::one_or_many")
    )]
    pub selective_recompute: Vec<f64>,
}

impl ConfigProfile {
    /// How far the caching allocator's reserved bytes rose above the allocated peak in the
    /// measured steps (the larger of the two), when the profile was measured on CUDA.
    pub fn reserved_excess(&self) -> Option<i64> {
        self.reserved
            .map(|r| (r.none - self.peak_none).max(r.all - self.peak_all).max(0))
    }

    /// Whether the times are the cost model's estimate, not measurements.
    pub fn is_estimated(&self) -> bool {
        self.estimated.is_some()
    }

    /// Brings estimated times to the pace real steps set: every time the profile holds
    /// (steps, recomputes, blocks' passes, selective recomputes) times `factor`, and the
    /// estimate records it. A plan over the result is the same choice at `factor` times the
    /// step, as every time the solve adds scales alike. Measured times are left alone.
    pub fn to_pace(&mut self, factor: f64, why: String) {
        let Some(estimate) = self.estimated.as_mut() else {
            return;
        };
        estimate.pace = Some(Pace { factor, why });
        for b in &mut estimate.blocks {
            for t in [&mut b.forward, &mut b.nograd_forward, &mut b.backward] {
                *t *= factor;
            }
            b.selective_recompute.iter_mut().for_each(|t| *t *= factor);
        }
        for s in [&mut self.seconds_none, &mut self.seconds_all]
            .into_iter()
            .chain(&mut self.recompute_spread)
        {
            s.median *= factor;
            s.min *= factor;
            s.max *= factor;
        }
        self.recompute_seconds.iter_mut().for_each(|t| *t *= factor);
        for b in self.regimes.iter_mut().flat_map(|r| &mut r.blocks) {
            for t in [
                &mut b.fwd_seconds,
                &mut b.fwd_nograd_seconds,
                &mut b.bwd_seconds,
                &mut b.rec_seconds,
            ] {
                *t *= factor;
            }
            b.selective.iter_mut().for_each(|s| s.rec_seconds *= factor);
        }
    }
}

impl Estimate {
    /// How the times were estimated, for plans, plots and notes: "estimated by the cost model
    /// over cuda:h100 (NVIDIA H100 SXM5 80GB)".
    pub fn describe(&self) -> String {
        // A CPU's name carries its vector extensions, which the profile's device names already.
        let name = self.rates.name.split(" [").next().unwrap_or_default();
        let paced = self
            .pace
            .as_ref()
            .map_or(String::new(), |p| format!(", scaled by {:.2} as {}", p.factor, p.why));
        format!("estimated by the cost model over {} ({name}){paced}", self.rates.device)
    }
}
