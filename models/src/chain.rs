//! The chain abstraction every model is expressed in: an ordered list of named blocks,
//! each a PyTorch module (or a fixed group of top-level modules) run as one link.
//!
//! The runtime executes chains block by block so that any subset of candidate blocks can be
//! activation-checkpointed; the planner reasons about the same blocks. Names are PyTorch
//! qualified module names (`layer1`, `encoder.layer.3`), so a checkpoint regex means the same
//! thing in PyTorch and here.

use tch::{nn, Device, Kind, Tensor};

/// Inputs that are not the chain's main activation and that no block differentiates:
/// the attention mask of a transformer, whether the step is a training step.
#[derive(Debug, Clone, Copy)]
pub struct Ctx<'a> {
    /// Additive attention bias from [`Chain::attention_bias`]: `[batch, 1, 1, seq]`, 0 where a
    /// token may be attended to and the dtype's minimum where not (Hugging Face's convention).
    pub attention_mask: Option<&'a Tensor>,
    /// Training mode: dropout active, BatchNorm uses and updates batch statistics.
    pub train: bool,
    /// The outputs of earlier blocks this block reads besides its input, in the order of its
    /// [`ChainBlock::skips`] (e.g. BERT's `output` reads the `attention` output for its
    /// residual sum). Empty for blocks without skips.
    pub skips: &'a [Tensor],
    /// The batch's raw `[batch, seq]` 0/1 attention mask, for blocks that compute their own
    /// bias from it (a `torch.export` program that takes the mask as an input).
    pub batch_mask: Option<&'a Tensor>,
    /// Whether the attention mask masks some token ([`Batch::padded`]). Hugging Face's SDPA
    /// path reads the mask's values to decide whether it needs a mask at all; a fake tensor has
    /// none, so the batch says it.
    pub padded: bool,
    /// The batch's input, for a block after the first that reads it as well (a `torch.export`
    /// program whose sequence classifier finds each sequence's last token from the token ids).
    /// It needs no gradient and lives through the step, so reading it again costs nothing.
    pub batch_input: Option<&'a Tensor>,
    /// What the chain's [`SharedInputs`] computed for this micro-batch (Llama's rotary pair and
    /// causal mask); empty when the chain has none or the caller computed none, and a block
    /// then computes its own.
    pub shared: &'a [Tensor],
}

impl<'a> Ctx<'a> {
    /// The context of a block that reads no earlier outputs; a mask given is taken to pad
    /// (numerically the same as not padding, where an explicit mask passes everything).
    pub fn new(attention_mask: Option<&'a Tensor>, train: bool) -> Self {
        Ctx {
            attention_mask,
            train,
            skips: &[],
            batch_mask: None,
            padded: attention_mask.is_some(),
            batch_input: None,
            shared: &[],
        }
    }

    /// The same context with the chain's shared inputs for this micro-batch
    /// ([`Chain::shared_inputs`]).
    pub fn with_shared(self, shared: &'a [Tensor]) -> Self {
        Ctx { shared, ..self }
    }

    /// The same context with the batch's input for blocks after the first that read it.
    pub fn with_batch_input(self, batch_input: &'a Tensor) -> Self {
        Ctx {
            batch_input: Some(batch_input),
            ..self
        }
    }

    /// The same context with the batch's raw attention mask and whether it pads.
    pub fn with_batch_mask(self, batch_mask: Option<&'a Tensor>, padded: bool) -> Self {
        Ctx {
            batch_mask,
            padded: padded && self.attention_mask.is_some(),
            ..self
        }
    }

    /// The same context with `skips` as the block's extra inputs.
    pub fn with_skips<'b>(&self, skips: &'b [Tensor]) -> Ctx<'b>
    where
        'a: 'b,
    {
        Ctx {
            attention_mask: self.attention_mask,
            train: self.train,
            skips,
            batch_mask: self.batch_mask,
            padded: self.padded,
            batch_input: self.batch_input,
            shared: self.shared,
        }
    }

    /// The `k`-th skip input; a block only asks for the skips its chain entry declares, so a
    /// missing one is a bug in the model's construction.
    pub fn skip(&self, k: usize) -> &'a Tensor {
        self.skips
            .get(k)
            .unwrap_or_else(|| panic!("block asked for skip input {k} but was given {}", self.skips.len()))
    }
}

/// Tensors a model computes once per micro-batch from the batch's shape alone and hands to
/// every block that reads them, as its PyTorch forward computes them once before its layers
/// (Llama's `LlamaModel.forward`: the rotary `(cos, sin)` and the causal mask). The runtime
/// computes them with the attention bias, before the first block, and frees them with it after
/// the micro-step's backward; a layer graph that saves them saves these, not copies of its own.
pub trait SharedInputs: Send {
    /// The tensors for `seq` positions in `kind` on `device`; `bias` is the chain's additive
    /// attention bias and `padded` whether the batch pads (as in [`Ctx`]).
    fn compute(&self, seq: i64, kind: Kind, device: Device, bias: Option<&Tensor>, padded: bool) -> Vec<Tensor>;
}

/// One link of the chain. `forward` must be a pure function of its input, its parameters,
/// the context and the global RNG state (dropout): the runtime re-runs it for recompute and
/// relies on getting bitwise the same result after restoring the RNG state.
pub trait Block: Send {
    fn forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Tensor;

    /// [`Block::forward`], with a failure as an error naming the node at fault. The runtime
    /// calls this one. A block ckptune built (a zoo model) fails only by a bug, so it keeps the
    /// default; a block that runs the user's graph (a `torch.export` program) can meet inputs
    /// its operators reject (a dtype or batch the program was not traced with) and reports them.
    fn try_forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Result<Tensor, BlockFailure> {
        Ok(self.forward(xs, ctx))
    }

    /// [`Block::try_forward`] for a block that hands on several tensors: its output, then the
    /// further outputs later blocks ([`ChainBlock::extra_reads`]) or the loss
    /// ([`LossHead::extra_reads`]) read, by slot (slot `s` is element `s - 1`). The runtime
    /// calls this one; a block that hands on one tensor keeps the default.
    fn try_forward_all(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Result<(Tensor, Vec<Tensor>), BlockFailure> {
        self.try_forward(xs, ctx).map(|out| (out, Vec::new()))
    }

    /// The node whose backward fails, when the block's backward failed: the block runs again on
    /// `xs` (a leaf that requires grad) and `ctx`, and after each node the backward of what
    /// has run so far, until one fails; `None` if none does or the block cannot tell. An engine
    /// error names no node (it names an autograd function, `SigmoidBackward0`, or a derivative,
    /// `'zeta'`), so the block finds it. Only a block that runs the user's graph needs this: a
    /// block ckptune built has a derivative for every operator it calls.
    fn locate_backward_failure(&self, _xs: &Tensor, _ctx: &Ctx<'_>) -> Option<BlockFailure> {
        None
    }
}

/// A node of a block's graph that failed on the tensors the step gave it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node {node} ({target}): {why}")]
pub struct BlockFailure {
    /// The node's name in the program's graph (`relu_`, `linear_3`).
    pub node: String,
    /// Its operator as the program names it (`torch.ops.aten.relu_.default`).
    pub target: String,
    /// libtorch's (or the interpreter's) words.
    pub why: String,
}

/// A block with its PyTorch name.
pub struct ChainBlock {
    /// PyTorch qualified module name of the block (`layer1`, `encoder.layer.3`), or for a
    /// fixed group of top-level modules that is not one module, their names joined with `+`
    /// (`conv1+bn1+relu+maxpool`); such groups are never candidates.
    pub name: String,
    /// Whether the block may be checkpointed (it is exactly one PyTorch module).
    pub candidate: bool,
    /// Indices of earlier blocks whose outputs this block reads besides its own input (the
    /// previous block's output): skip connections inside a layer, such as the residual that
    /// BERT's `output` adds to the `attention` output. They reach `forward` as [`Ctx::skips`].
    pub skips: Vec<usize>,
    /// Further outputs of earlier blocks this block reads, `(block, slot)` with `slot >= 1`
    /// (a block that hands on several tensors, [`Block::try_forward_all`]): they reach
    /// `forward` after the skips' outputs in [`Ctx::skips`].
    pub extra_reads: Vec<(usize, usize)>,
    pub block: Box<dyn Block>,
}

impl ChainBlock {
    /// A block that reads only its input.
    pub fn new(name: impl Into<String>, candidate: bool, block: Box<dyn Block>) -> Self {
        ChainBlock {
            name: name.into(),
            candidate,
            skips: Vec::new(),
            extra_reads: Vec::new(),
            block,
        }
    }

    /// What the block reads from earlier blocks besides its input, as `(block, slot)` in the
    /// order of [`Ctx::skips`]: its skips' outputs (slot 0), then the further outputs it reads.
    pub fn skip_reads(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.skips
            .iter()
            .map(|&s| (s, 0))
            .chain(self.extra_reads.iter().copied())
    }
}

/// A candidate module made of a contiguous run of chain blocks (`encoder.layer.3` over its
/// `attention`, `intermediate` and `output`; `layer3` over `layer3.0` … `layer3.35`).
/// Checkpointing it is `torch.utils.checkpoint` of that module: only its input is kept and
/// the whole run is recomputed in backward. A group and any block inside it are never both
/// checkpointed (nesting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainGroup {
    /// PyTorch qualified module name.
    pub name: String,
    /// First and last block of the run (inclusive), `first < last`.
    pub first: usize,
    pub last: usize,
}

impl std::fmt::Debug for ChainBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainBlock")
            .field("name", &self.name)
            .field("candidate", &self.candidate)
            .finish()
    }
}

/// Turns the chain's final output and the batch's targets into a scalar loss.
pub trait LossHead: Send {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Tensor;

    /// Earlier blocks whose outputs the loss reads besides the last block's, in the order
    /// [`LossHead::loss_over`] takes them: a program with several outputs (BertModel's
    /// `last_hidden_state` and `pooler_output`). None of them is the last block, nor a block
    /// inside a group other than its last ([`Chain::validate`]).
    fn reads(&self) -> &[usize] {
        &[]
    }

    /// Further outputs `(block, slot)` (`slot >= 1`, see [`Block::try_forward_all`]) the loss
    /// reads, after the [`LossHead::reads`] ones in [`LossHead::loss_over`]'s `reads`: an output
    /// made mid-network by a block that hands on another tensor (Inception v3's auxiliary
    /// logits), or by the last block besides its output.
    fn extra_reads(&self) -> &[(usize, usize)] {
        &[]
    }

    /// Everything the loss reads besides the last block's output, as `(block, slot)` in the
    /// order [`LossHead::loss_over`] takes them.
    fn all_reads(&self) -> Vec<(usize, usize)> {
        let reads = self.reads().iter().map(|&k| (k, 0));
        reads.chain(self.extra_reads().iter().copied()).collect()
    }

    /// The loss of the last block's output and of the outputs [`LossHead::all_reads`] names.
    fn loss_over(&self, output: &Tensor, reads: &[Tensor], batch: &Batch) -> Tensor {
        debug_assert!(
            reads.is_empty(),
            "a head that reads earlier outputs implements loss_over"
        );
        self.loss(output, batch)
    }

    /// A language model's head, which the loss can also be computed from in chunks of tokens.
    fn causal_lm(&self) -> Option<&dyn LmHead> {
        None
    }
}

/// What the chunked loss needs of a language model's head (`crate::causal_lm`).
pub trait LmHead {
    /// The head's weight, `[vocab, hidden]`.
    fn weight(&self) -> &Tensor;
    /// One label per token, flattened as the logits are, -100 where no token follows.
    fn shift_labels(&self, batch: &Batch) -> Tensor;
    /// The summed cross entropy of `rows` (`[tokens, hidden]`) against `labels` (`[tokens]`).
    fn chunk_loss(&self, rows: &Tensor, labels: &Tensor) -> Tensor;
}

/// What a batch of the model's input looks like.
#[derive(Debug, Clone, PartialEq)]
pub enum InputSpec {
    /// `[batch, channels, size, size]` f32 images, integer class targets in `0..classes`.
    Image { channels: i64, size: i64, classes: i64 },
    /// `[batch, features]` f32 vectors, integer class targets in `0..classes` (toy chains).
    Features { features: i64, classes: i64 },
    /// `[batch, sizes..]` f32 tensors of another shape (a `torch.export` program's log-mel
    /// features `[batch, mel, frames]`, non-square images), integer class targets in
    /// `0..classes`.
    Tensor { sizes: Vec<i64>, classes: i64 },
    /// `[batch, seq]` i64 token ids in `0..vocab`, an attention mask, and integer targets:
    /// per sequence in `0..classes` (classification) or per token in `0..vocab` (language model).
    Tokens {
        seq: i64,
        vocab: i64,
        targets: TokenTargets,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenTargets {
    /// One class per sequence.
    Classes(i64),
    /// Next-token / masked-token ids, one per position.
    PerToken,
}

/// One training batch.
#[derive(Debug)]
pub struct Batch {
    pub input: Tensor,
    pub target: Tensor,
    /// For token models: `[batch, seq]` i64 with 1 for real tokens and 0 for padding.
    pub attention_mask: Option<Tensor>,
    /// Whether `attention_mask` has a 0, said by whoever made the batch (a fake batch has no
    /// values to read).
    pub padded: bool,
}

/// A model as a chain of blocks plus a loss head, with its parameters in `vs`.
pub struct Chain {
    /// Model name as the CLI knows it (`resnet18`, `bert-base-uncased`).
    pub name: String,
    /// Parameters and buffers; variable names equal the reference `state_dict` keys.
    pub vs: nn::VarStore,
    pub blocks: Vec<ChainBlock>,
    /// Candidate modules spanning several blocks, in order of their first block; disjoint.
    /// A checkpoint choice is a mask over `blocks` followed by `groups`.
    pub groups: Vec<ChainGroup>,
    pub head: Box<dyn LossHead>,
    /// Every qualified module name of the reference PyTorch model in `named_modules()` order,
    /// sub-modules included (the root "" excluded): the universe a checkpoint regex is
    /// checked against.
    pub modules: Vec<String>,
    pub input: InputSpec,
    /// Parameters of the reference model proper (e.g. `BertModel`), excluding any head that
    /// was added only to have a loss.
    pub reference_params: i64,
    /// The attention implementation of a transformer ckptune built (`--attention`); `None` for
    /// models without attention and for programs whose attention is already in their graph.
    pub attention: Option<crate::options::Attention>,
    /// What every block shares per micro-batch ([`SharedInputs`]); `None` for most models.
    pub shared: Option<Box<dyn SharedInputs>>,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain")
            .field("name", &self.name)
            .field("blocks", &self.blocks)
            .field("groups", &self.groups)
            .field("input", &self.input)
            .finish()
    }
}

impl Chain {
    /// Names of everything that may be checkpointed: candidate blocks in execution order,
    /// then groups; the order of a checkpoint mask.
    pub fn candidates(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        // A module called several times is a block per call, one candidate.
        for name in (self.blocks.iter().filter(|b| b.candidate).map(|b| b.name.as_str()))
            .chain(self.groups.iter().map(|g| g.name.as_str()))
        {
            if !out.contains(&name) {
                out.push(name);
            }
        }
        out
    }

    /// Length of a checkpoint mask: one entry per block, then one per group.
    pub fn units(&self) -> usize {
        self.blocks.len() + self.groups.len()
    }

    /// The checkpoint mask of every candidate block (groups not checkpointed as a whole).
    pub fn every_candidate(&self) -> Vec<bool> {
        (0..self.units())
            .map(|u| self.blocks.get(u).is_some_and(|b| b.candidate))
            .collect()
    }

    /// Name of mask entry `i` (a block, or a group after the blocks).
    pub fn unit_name(&self, i: usize) -> &str {
        match self.blocks.get(i) {
            Some(b) => &b.name,
            None => &self.groups[i - self.blocks.len()].name,
        }
    }

    /// Whether mask entry `i` may be checkpointed.
    pub fn unit_candidate(&self, i: usize) -> bool {
        self.blocks.get(i).map_or(i < self.units(), |b| b.candidate)
    }

    /// A checkpointed group with a checkpointed block inside it, if `mask` (over
    /// [`Chain::units`]) has one: `(group, block)`.
    pub fn nested_conflict(&self, mask: &[bool]) -> Option<(usize, usize)> {
        let n = self.blocks.len();
        self.groups.iter().enumerate().find_map(|(g, grp)| {
            if mask.get(n + g) != Some(&true) {
                return None;
            }
            (grp.first..=grp.last).find(|&k| mask[k]).map(|k| (g, k))
        })
    }

    /// Names of the units `mask` checkpoints, in execution order (a group where its first
    /// block runs).
    pub fn names_of(&self, mask: &[bool]) -> Vec<String> {
        let n = self.blocks.len();
        let mut out = Vec::new();
        for (j, b) in self.blocks.iter().enumerate() {
            for (g, grp) in self.groups.iter().enumerate() {
                if grp.first == j && mask.get(n + g) == Some(&true) {
                    out.push(grp.name.clone());
                }
            }
            if mask.get(j) == Some(&true) {
                out.push(b.name.clone());
            }
        }
        out
    }

    /// Checks what the runtime relies on: skips point backwards; groups are ordered,
    /// disjoint runs of at least two blocks; no block outside a group, nor the loss, reads a
    /// block inside it other than its last (a checkpointed group keeps only its output), and no
    /// block inside a group reads a block before the group's input.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let n = self.blocks.len();
        for (i, b) in self.blocks.iter().enumerate() {
            if let Some((s, _)) = b.skip_reads().find(|&(s, _)| s >= i) {
                return Err(format!(
                    "block {} (#{i}) reads block #{s} as a skip; skips must come from earlier blocks",
                    b.name
                ));
            }
        }
        if let Some(&k) = self.head.reads().iter().find(|&&k| k + 1 >= n) {
            return Err(format!(
                "the loss reads block #{k} as an earlier output; the chain has {n} blocks and passes the last one's directly"
            ));
        }
        if let Some(&(k, s)) = self.head.extra_reads().iter().find(|&&(k, s)| k >= n || s == 0) {
            return Err(format!(
                "the loss reads output {s} of block #{k} as a further output; the chain has {n} blocks and \
                 further outputs are numbered from 1"
            ));
        }
        let mut prev_last: Option<usize> = None;
        for g in &self.groups {
            let loss_reads = self.head.all_reads();
            if let Some(&(k, _)) = loss_reads.iter().find(|&&(k, _)| (g.first..g.last).contains(&k)) {
                return Err(format!(
                    "the loss reads the output of block {} inside group {} (a checkpointed group keeps \
                     only its last block's output): choose candidates without {} with --candidates REGEX",
                    self.blocks[k].name, g.name, g.name
                ));
            }
            if g.first >= g.last || g.last >= n || prev_last.is_some_and(|p| g.first <= p) {
                return Err(format!(
                    "group {} spans blocks {}..={} of {n}; groups must be ordered, disjoint runs of 2 or more",
                    g.name, g.first, g.last
                ));
            }
            prev_last = Some(g.last);
            for (i, b) in self.blocks.iter().enumerate() {
                let inside = (g.first..=g.last).contains(&i);
                for (s, _) in b.skip_reads() {
                    let reads_inner = (g.first..g.last).contains(&s);
                    if (!inside && reads_inner) || (inside && s + 1 < g.first) {
                        return Err(format!(
                            "block {} reads block {} across the boundary of group {} (a checkpointed group \
                             keeps only its last block's outputs and reads only its input's): choose candidates \
                             without {} with --candidates REGEX, or --granularity layer",
                            b.name, self.blocks[s].name, g.name, g.name
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs the chain's forward block by block (skips included) and returns every block's
    /// output. With `grad`, outputs carry autograd history from the input.
    pub fn forward_all(&self, input: &Tensor, attention_bias: Option<&Tensor>, train: bool) -> Vec<Tensor> {
        let handed = self.forward_handed(input, attention_bias, train);
        handed.into_iter().map(|mut h| h.swap_remove(0)).collect()
    }

    /// [`Chain::forward_all`] with every tensor each block hands on: per block, its output and
    /// then its further outputs (slot `s` at index `s`).
    pub fn forward_handed(&self, input: &Tensor, attention_bias: Option<&Tensor>, train: bool) -> Vec<Vec<Tensor>> {
        let shared = self.shared_inputs(input, attention_bias, attention_bias.is_some());
        let ctx = Ctx::new(attention_bias, train).with_shared(&shared);
        let mut outs: Vec<Vec<Tensor>> = Vec::with_capacity(self.blocks.len());
        for (i, b) in self.blocks.iter().enumerate() {
            let x = if i == 0 { input } else { &outs[i - 1][0] };
            let skips: Vec<Tensor> = b.skip_reads().map(|(k, s)| outs[k][s].shallow_clone()).collect();
            let (out, more) = b
                .block
                .try_forward_all(x, &ctx.with_skips(&skips))
                .unwrap_or_else(|e| panic!("block {}: {e}", b.name));
            outs.push(std::iter::once(out).chain(more).collect());
        }
        outs
    }

    /// A deterministic random batch of `batch` samples for this model's input. Uses the global
    /// CPU generator seeded with `seed` and restores the generator afterwards, so making a batch
    /// does not change the dropout masks a training step draws; the state is held outside any
    /// tensor, so that a step's measured peak holds the batch alone, as the user's loop does.
    pub fn make_batch(&self, batch: i64, device: Device, seed: i64) -> Batch {
        let saved = ckptune_kernels::rng::CpuSnapshot::take().ok();
        tch::manual_seed(seed);
        let out = match &self.input {
            InputSpec::Image {
                channels,
                size,
                classes,
            } => Batch {
                input: Tensor::randn([batch, *channels, *size, *size], (Kind::Float, device)),
                target: Tensor::randint(*classes, [batch], (Kind::Int64, device)),
                attention_mask: None,
                padded: false,
            },
            InputSpec::Features { features, classes } => Batch {
                input: Tensor::randn([batch, *features], (Kind::Float, device)),
                target: Tensor::randint(*classes, [batch], (Kind::Int64, device)),
                attention_mask: None,
                padded: false,
            },
            InputSpec::Tensor { sizes, classes } => Batch {
                input: Tensor::randn([&[batch][..], sizes].concat(), (Kind::Float, device)),
                target: Tensor::randint(*classes, [batch], (Kind::Int64, device)),
                attention_mask: None,
                padded: false,
            },
            InputSpec::Tokens { seq, vocab, targets } => {
                let input = Tensor::randint(*vocab, [batch, *seq], (Kind::Int64, device));
                let target = match targets {
                    TokenTargets::Classes(c) => Tensor::randint(*c, [batch], (Kind::Int64, device)),
                    TokenTargets::PerToken => Tensor::randint(*vocab, [batch, *seq], (Kind::Int64, device)),
                };
                // Every other sequence has its last quarter padded, so masking is exercised.
                let mask = Tensor::ones([batch, *seq], (Kind::Int64, device));
                let pad = *seq / 4;
                if pad > 0 {
                    for b in (1..batch).step_by(2) {
                        let _ = mask.get(b).narrow(0, *seq - pad, pad).fill_(0);
                    }
                }
                Batch {
                    input,
                    target,
                    attention_mask: Some(mask),
                    padded: pad > 0 && batch > 1,
                }
            }
        };
        if let Some(state) = saved {
            // Restoring a state just read cannot fail; if it did, batches would merely share
            // the generator with dropout, which is still deterministic.
            let _ = state.restore();
        }
        out
    }

    /// The additive attention bias for a `[batch, seq]` 0/1 mask, computed once per step as
    /// Hugging Face's `get_extended_attention_mask`: `(1 - mask) * finfo(dtype).min` shaped
    /// `[batch, 1, 1, seq]`, in the parameters' float dtype.
    pub fn attention_bias(&self, mask: &Tensor) -> Tensor {
        let kind = self.param_kind();
        let ones = mask.ones_like();
        ((ones - mask).to_kind(kind) * crate::layers::finfo_min(kind))
            .unsqueeze(1)
            .unsqueeze(1)
    }

    /// The chain's [`SharedInputs`] for a micro-batch whose token ids (or images) are `input`,
    /// in the parameters' dtype: empty for a chain without them.
    pub fn shared_inputs(&self, input: &Tensor, bias: Option<&Tensor>, padded: bool) -> Vec<Tensor> {
        match &self.shared {
            Some(s) => s.compute(input.size()[1], self.param_kind(), input.device(), bias, padded),
            None => Vec::new(),
        }
    }

    /// The dtype of the floating-point parameters (f32 unless converted, e.g. to bf16).
    pub fn param_kind(&self) -> Kind {
        self.vs
            .trainable_variables()
            .first()
            .map(|t| t.kind())
            .filter(|k| matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16))
            .unwrap_or(Kind::Float)
    }

    /// Trainable parameters in PyTorch's `model.parameters()` order (module registration order,
    /// as `modules` lists them; a module's own parameters in creation order, weight before
    /// bias) with their names, shapes and element sizes. The builders create some modules
    /// out of that order (a ResNet block's shortcut first), so creation order alone is not it.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<i64>, i64)> {
        self.variables_in_module_order()
            .into_iter()
            .filter(|(_, _, trainable)| *trainable)
            .map(|(name, t, _)| (name, t.size(), t.kind().elt_size_in_bytes() as i64))
            .collect()
    }

    /// Every variable of the var store with its name and whether it is trainable (a parameter,
    /// not a buffer), by the place of its module in `modules`, a module's parameters in creation
    /// order before its buffers by name. The var store itself is a `HashMap`, whose order
    /// changes from one process to the next: what walks it in order (casting every variable to
    /// bf16 allocates as it goes) must walk this instead, or the same plan records another
    /// allocation trace in every run.
    pub fn variables_in_module_order(&self) -> Vec<(String, Tensor, bool)> {
        let trainable = self.vs.trainable_variables();
        let created = |t: &Tensor| {
            trainable
                .iter()
                .position(|v| ckptune_kernels::fake::same_tensor(v, t))
                .unwrap_or(usize::MAX)
        };
        let owner = |name: &str| {
            let module = name.rsplit_once('.').map_or("", |(m, _)| m);
            self.modules.iter().position(|m| m == module).unwrap_or(usize::MAX)
        };
        let mut out: Vec<(usize, usize, String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .map(|(name, t)| (owner(&name), created(&t), name, t))
            .collect();
        out.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
        out.into_iter()
            .map(|(_, created, name, t)| (name, t, created != usize::MAX))
            .collect()
    }

    /// Total number of parameter elements (trainable variables) in the var store.
    pub fn param_count(&self) -> i64 {
        self.vs.trainable_variables().iter().map(|t| t.numel() as i64).sum()
    }
}
