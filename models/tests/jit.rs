//! TorchScript chains: the fixture made by `fixtures/make_torchscript.py` loads as a chain of
//! its top-level children with PyTorch's names, and a model that is not a chain is refused.

use std::path::Path;

use ckptune_models::jit::chain_from_torchscript;
use ckptune_models::{Ctx, InputSpec, ModelError, ModelOptions};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

#[test]
fn scripted_sequential_is_a_chain_of_its_children() {
    let opts = ModelOptions {
        image: Some(16),
        ..Default::default()
    };
    let chain = chain_from_torchscript(&fixture("tiny_chain.torchscript.pt"), &opts).unwrap();
    let names: Vec<&str> = chain.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["stem", "block1", "block2", "pool", "flatten", "fc"]);
    assert!(chain.modules.contains(&"block1.bn".to_owned()), "{:?}", chain.modules);
    assert_eq!(
        chain.input,
        InputSpec::Image {
            channels: 3,
            size: 16,
            classes: 5
        }
    );
    // Parameters are registered under their PyTorch names and shared with the module.
    let vars = chain.vs.variables();
    assert!(vars.contains_key("block1.conv.weight"));
    assert!(vars.contains_key("block1.bn.running_mean"));
    assert_eq!(chain.param_count(), 3 * 4 * 9 + 4 + 2 * (4 * 4 * 9 + 8) + 4 * 5 + 5);
    // Running the blocks in order gives an output of the head's shape, with gradients.
    let batch = chain.make_batch(2, tch::Device::Cpu, 0);
    let ctx = Ctx::new(None, true);
    let mut h = batch.input.shallow_clone();
    for b in &chain.blocks {
        h = b.block.forward(&h, &ctx);
    }
    assert_eq!(h.size(), [2, 5]);
    chain.head.loss(&h, &batch).backward();
    assert!(vars["fc.weight"].grad().defined());
}

#[test]
fn a_model_with_a_skip_across_children_is_refused() {
    let err = chain_from_torchscript(&fixture("tiny_not_chain.torchscript.pt"), &ModelOptions::default()).unwrap_err();
    assert!(matches!(err, ModelError::NotAChain { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("not the composition of its top-level children"), "{msg}");
    assert!(
        msg.contains("torch.export") && msg.contains(".pt2"),
        "the fix is named: {msg}"
    );
    assert!(!msg.contains('\n'), "one line: {msg}");
}
