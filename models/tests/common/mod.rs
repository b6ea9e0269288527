//! Helpers shared by the integration tests: fixture paths, the reference Python, and a
//! chain runner that uses the runtime's block-boundary scheme.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use ckptune_models::{Chain, Ctx};
use tch::{Kind, Tensor};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// The tensors of a fixture safetensors file by name.
pub fn tensors(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixture(name))
        .unwrap_or_else(|e| panic!("reading fixture {name}: {e}"))
        .into_iter()
        .collect()
}

/// The project's Python with torch (`CKPTUNE_PYTHON`, set by .cargo/config.toml).
pub fn python() -> Command {
    let python = std::env::var("CKPTUNE_PYTHON")
        .expect("CKPTUNE_PYTHON is not set: run the tests through cargo in the workspace (.cargo/config.toml sets it)");
    let mut cmd = Command::new(python);
    cmd.current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures"));
    cmd
}

/// Runs `python -c script` and panics with its stderr if it fails.
pub fn run_python(script: &str) -> String {
    let out = python().args(["-c", script]).output().expect("starting CKPTUNE_PYTHON");
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("python printed UTF-8")
}

/// `max |a - b|`.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// Runs the chain's blocks on `input` as the runtime does: each block's output becomes a
/// detached leaf (requiring grad when `grad` and floating) before the next block sees it.
/// Returns every block's output leaf.
pub fn run_blocks(
    chain: &Chain,
    input: &Tensor,
    attention_bias: Option<&Tensor>,
    train: bool,
    grad: bool,
) -> Vec<Tensor> {
    let ctx = Ctx::new(attention_bias, train);
    let mut h = input.shallow_clone();
    let mut outs: Vec<Tensor> = Vec::new();
    for block in &chain.blocks {
        let skips: Vec<Tensor> = block.skips.iter().map(|&s| outs[s].shallow_clone()).collect();
        let ctx = ctx.with_skips(&skips);
        let out = if grad {
            block.block.forward(&h, &ctx)
        } else {
            tch::no_grad(|| block.block.forward(&h, &ctx))
        };
        let leaf = out.detach();
        h = if grad && leaf.is_floating_point() {
            leaf.set_requires_grad(true)
        } else {
            leaf
        };
        outs.push(h.shallow_clone());
    }
    outs
}
