//! The built-in transformers with `--attention sdpa` against their plain-torch references with
//! transformers 5's SDPA path (`fixtures/reference.py`, `attn_implementation="sdpa"`; written
//! by `fixtures/sdpa_reference.py`): the same weights and batch give the same last hidden
//! state, loss and parameter gradients, with a padded batch (SDPA gets `sdpa_mask`'s boolean
//! mask) and an unpadded one (no mask; `is_causal` for a decoder, grouped-query attention
//! through `enable_gqa`).

mod common;

use std::collections::HashMap;

use ckptune_models::{builtin, Attention, Batch, Chain, Ctx, ModelOptions};
use common::{max_abs_diff, python};
use tch::Tensor;

/// fp32 through different kernels (the chain's linear layers are PyTorch's): rounding only.
const TOL: f64 = 1e-5;

/// The reference's step, written by `sdpa_reference.py` into a temporary folder.
fn reference(name: &str, padding: &str) -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let dir = tempfile::tempdir().unwrap();
    let out = python()
        .args(["sdpa_reference.py", name])
        .arg(dir.path())
        .arg(padding)
        .output()
        .expect("starting CKPTUNE_PYTHON");
    assert!(
        out.status.success(),
        "sdpa_reference.py {name} {padding} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |f: &str| -> HashMap<String, Tensor> {
        Tensor::read_safetensors(dir.path().join(f))
            .unwrap()
            .into_iter()
            .collect()
    };
    (read("weights.safetensors"), read("io.safetensors"))
}

/// The chain's blocks as one graph (no boundaries), as PyTorch runs the module; the outputs.
fn forward(chain: &Chain, input: &Tensor, ctx: &Ctx<'_>) -> Vec<Tensor> {
    let mut outs: Vec<Tensor> = Vec::new();
    for (i, block) in chain.blocks.iter().enumerate() {
        let skips: Vec<Tensor> = block.skips.iter().map(|&s| outs[s].shallow_clone()).collect();
        let x = if i == 0 { input } else { &outs[i - 1] };
        let out = block.block.forward(x, &ctx.with_skips(&skips));
        outs.push(out);
    }
    outs
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    let scale = b.abs().max().double_value(&[]).max(1.0);
    let diff = max_abs_diff(a, b);
    assert!(diff <= TOL * scale, "{what} differs by {diff} (largest value {scale})");
}

fn check(name: &str, padding: &str, hidden_block: impl Fn(&Chain) -> usize) {
    let (weights, io) = reference(name, padding);
    let opts = ModelOptions {
        seq: Some(8),
        attention: Some(Attention::Sdpa),
        ..Default::default()
    };
    let chain = builtin(name, &opts).unwrap();
    let mut vars = chain.vs.variables();
    for (var_name, var) in vars.iter_mut() {
        let w = weights
            .get(var_name)
            .unwrap_or_else(|| panic!("{name}: the reference has no parameter {var_name}"));
        tch::no_grad(|| var.copy_(w));
    }
    let target = if name.contains("bert") {
        io["labels"].shallow_clone()
    } else {
        io["input_ids"].shallow_clone()
    };
    let padded = padding == "padded";
    let batch = Batch {
        input: io["input_ids"].shallow_clone(),
        target,
        attention_mask: Some(io["attention_mask"].shallow_clone()),
        padded,
    };
    let mask = batch.attention_mask.as_ref().unwrap();
    let bias = chain.attention_bias(mask);
    let ctx = Ctx::new(Some(&bias), false).with_batch_mask(Some(mask), padded);
    let outs = forward(&chain, &batch.input, &ctx);
    let what = format!("{name} {padding}");
    assert_close(
        &format!("{what}: last_hidden_state"),
        &outs[hidden_block(&chain)],
        &io["last_hidden_state"],
    );
    let loss = if name.contains("bert") {
        // The chain's head always trains (dropout); the reference's step is in eval mode.
        let classifier = |p: &str| &vars[&format!("classifier.{p}")];
        outs.last()
            .unwrap()
            .linear(classifier("weight"), Some(classifier("bias")))
            .cross_entropy_for_logits(&batch.target)
    } else {
        chain.head.loss(outs.last().unwrap(), &batch)
    };
    assert_close(&format!("{what}: loss"), &loss.reshape([1]), &io["loss"]);
    loss.backward();
    for (var_name, var) in &vars {
        let expected = &io[&format!("grad.{var_name}")];
        assert_close(&format!("{what}: gradient of {var_name}"), &var.grad(), expected);
    }
}

#[test]
fn bert_under_sdpa_equals_the_reference() {
    // The last block is the pooler; the layers' output is the one before it.
    for padding in ["padded", "unpadded"] {
        check("tiny-bert", padding, |c| c.blocks.len() - 2);
    }
}

#[test]
fn decoders_under_sdpa_equal_the_reference() {
    for name in ["tiny-gpt2", "tiny-llama", "tiny-qwen2"] {
        for padding in ["padded", "unpadded"] {
            check(name, padding, |c| c.blocks.len() - 1);
        }
    }
}
