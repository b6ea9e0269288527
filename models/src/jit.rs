//! TorchScript models (`torch.jit.script` / `torch.jit.trace` files) as chains: the top-level
//! children, in definition order, are the blocks. Only models whose forward is exactly the
//! composition of their children qualify; that is checked by running both on a sample input.

use std::path::Path;

use ckptune_kernels::jit::JitModule;
use tch::{nn, Kind, Tensor};

use crate::chain::{Batch, Block, BlockFailure, Chain, ChainBlock, Ctx, InputSpec, LossHead, TokenTargets};
use crate::error::{ModelError, Result};
use crate::options::{Granularity, ModelOptions};

struct JitBlock {
    module: JitModule,
}

impl Block for JitBlock {
    fn forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        self.try_forward(xs, ctx).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The chain was validated at load time by running every child on a sample batch; a failure
    /// now is a shape or dtype the sample did not cover, reported as libtorch does.
    fn try_forward(&self, xs: &Tensor, _ctx: &Ctx<'_>) -> std::result::Result<Tensor, BlockFailure> {
        self.module.forward(&[xs]).map_err(|e| BlockFailure {
            node: "forward".into(),
            target: "a TorchScript child module".into(),
            why: e.to_string(),
        })
    }
}

/// Cross entropy over the last dimension against integer targets (per sample or per token).
struct LastDimCrossEntropy;

impl LossHead for LastDimCrossEntropy {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Tensor {
        let classes = output.size().last().copied().unwrap_or(1);
        output
            .reshape([-1, classes])
            .to_kind(Kind::Float)
            .cross_entropy_for_logits(&batch.target.reshape([-1]))
    }
}

fn torch_err(op: &str) -> impl Fn(ckptune_kernels::KernelError) -> ModelError + '_ {
    move |e| ModelError::Torch {
        op: op.to_owned(),
        message: e.to_string(),
    }
}

fn collect_modules(prefix: &str, m: &JitModule, out: &mut Vec<String>) -> Result<()> {
    for (name, child) in m.named_children().map_err(torch_err("listing TorchScript children"))? {
        let q = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}.{name}")
        };
        out.push(q.clone());
        collect_modules(&q, &child, out)?;
    }
    Ok(())
}

/// Registers a tensor in the var store under its qualified PyTorch name (`layer1.0.conv1.weight`),
/// sharing storage with the TorchScript module, so optimizers and precision changes reach it.
fn register(vs: &nn::VarStore, name: &str, t: Tensor, trainable: bool) {
    let mut parts: Vec<&str> = name.split('.').collect();
    let leaf = parts.pop().unwrap_or(name);
    let mut p = vs.root();
    for part in parts {
        p = p.sub(part);
    }
    let _ = p.add(leaf, t, trainable);
}

/// Loads a TorchScript file whose top-level children form a chain.
pub fn chain_from_torchscript(path: &Path, opts: &ModelOptions) -> Result<Chain> {
    if ckptune_kernels::fake::active() {
        return Err(ModelError::TorchScriptOnMeta {
            path: path.to_path_buf(),
        });
    }
    let shown = path.display().to_string();
    opts.reject(
        &shown,
        "attention",
        opts.attention.map(|a| a.hf_name()),
        "a TorchScript model's attention is the one it was scripted with",
    )?;
    if opts.granularity != Granularity::Layer {
        return Err(ModelError::InvalidOption {
            model: shown,
            option: "granularity",
            value: format!("{:?}", opts.granularity).to_lowercase(),
            why: "a TorchScript model's candidates are its top-level children; use --granularity layer".into(),
        });
    }
    let bad = |reason: String| ModelError::NotAChain {
        path: path.to_path_buf(),
        reason,
    };
    let root = JitModule::load(path).map_err(|e| bad(e.to_string()))?;
    root.set_train(true).map_err(torch_err("setting train mode"))?;
    let children = root
        .named_children()
        .map_err(torch_err("listing TorchScript children"))?;
    if children.len() < 2 {
        return Err(bad(format!(
            "a TorchScript model must have at least two top-level child modules to form a chain of \
             blocks; {shown} has {}. Supported: models whose forward applies their children in order \
             (e.g. nn.Sequential, or a scripted model with that structure)",
            children.len()
        )));
    }
    let params = root
        .named_parameters()
        .map_err(torch_err("reading TorchScript parameters"))?;
    let buffers = root.named_buffers().map_err(torch_err("reading TorchScript buffers"))?;
    let input = infer_input(&params, opts).ok_or_else(|| {
        bad(
            "cannot tell the input shape: the first parameter is neither a conv weight [out, in, k, k], \
             an embedding [vocab, dim] nor a linear weight [out, in]"
                .into(),
        )
    })?;
    let vs = nn::VarStore::new(opts.device);
    let reference_params: i64 = params.iter().map(|(_, t)| t.numel() as i64).sum();
    for (n, t) in params {
        register(&vs, &n, t, true);
    }
    for (n, t) in buffers {
        register(&vs, &n, t, false);
    }
    let mut modules = Vec::new();
    collect_modules("", &root, &mut modules)?;
    let blocks: Vec<ChainBlock> = children
        .into_iter()
        .map(|(name, module)| ChainBlock::new(name, true, Box::new(JitBlock { module })))
        .collect();

    let mut chain = Chain {
        name: path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| shown.clone()),
        vs,
        blocks,
        groups: Vec::new(),
        head: Box::new(LastDimCrossEntropy),
        modules,
        input,
        reference_params,
        attention: None,
        shared: None,
    };
    // Check that the children compose to the model's own forward on a sample batch (eval mode,
    // so dropout and batch statistics do not differ between the two runs).
    let batch = chain.make_batch(2, opts.device, 0);
    root.set_train(false).map_err(torch_err("setting eval mode"))?;
    let whole = root.forward(&[&batch.input]).map_err(|e| {
        bad(format!(
            "running its forward on a sample input {:?} failed: {e}",
            batch.input.size()
        ))
    })?;
    let mut h = batch.input.shallow_clone();
    for b in &chain.blocks {
        h = tch::no_grad(|| chained_forward(b, &h)).map_err(|e| {
            bad(format!(
                "its children do not form a chain: child {} fails on the previous child's output: {e}",
                b.name
            ))
        })?;
    }
    root.set_train(true).map_err(torch_err("setting train mode"))?;
    if h.size() != whole.size() || !h.allclose(&whole, 1e-5, 1e-6, false) {
        return Err(bad(format!(
            "its forward is not the composition of its top-level children ({}): it does more \
             between them (e.g. a flatten or a skip connection); export it instead with \
             torch.export.save(torch.export.export(model.train(), (batch,)), \"model.pt2\") and pass \
             the .pt2, which ckptune runs node by node",
            chain
                .blocks
                .iter()
                .map(|b| b.name.as_str())
                .collect::<Vec<_>>()
                .join(" → ")
        )));
    }
    if let InputSpec::Tokens { targets, .. } = &mut chain.input {
        *targets = if whole.dim() == 3 {
            TokenTargets::PerToken
        } else {
            TokenTargets::Classes(classes_of(&whole))
        };
    } else if let InputSpec::Image { classes, .. }
    | InputSpec::Features { classes, .. }
    | InputSpec::Tensor { classes, .. } = &mut chain.input
    {
        *classes = classes_of(&whole);
    }
    Ok(chain)
}

fn classes_of(out: &Tensor) -> i64 {
    out.size().last().copied().unwrap_or(1)
}

fn chained_forward(b: &ChainBlock, h: &Tensor) -> std::result::Result<Tensor, String> {
    b.block.try_forward(h, &Ctx::new(None, false)).map_err(|e| e.why)
}

fn infer_input(params: &[(String, Tensor)], opts: &ModelOptions) -> Option<InputSpec> {
    let (name, first) = params.first()?;
    let size = first.size();
    match size.as_slice() {
        [_, c, _, _] => Some(InputSpec::Image {
            channels: *c,
            size: opts.image.unwrap_or(224),
            classes: 1,
        }),
        [vocab, _] if name.contains("emb") || name.contains("wte") => Some(InputSpec::Tokens {
            seq: opts.seq.unwrap_or(128),
            vocab: *vocab,
            targets: TokenTargets::PerToken,
        }),
        [_, features] => Some(InputSpec::Features {
            features: *features,
            classes: 1,
        }),
        _ => None,
    }
}
