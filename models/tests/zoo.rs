//! The built-in catalogue, constructor options, and what the runtime relies on from every
//! chain: blocks never write their input, a block re-run under the same RNG state gives the
//! same output, and a full training step reaches every parameter.

mod common;

use ckptune_models::zoo;
use ckptune_models::Family;
use ckptune_models::{builtin, Chain, Ctx, Granularity, InputSpec, ModelError, ModelOptions, TokenTargets};
use common::run_blocks;
use tch::{Device, Kind, Tensor};

/// libtorch's generator is process-wide and tests run on parallel threads: every test that draws
/// from it holds this lock, building a model (its weights' initialisation) included, so a test
/// that seeds it sees only its own draws.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rng() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn catalogue_lists_the_builtins() {
    let _rng = rng();
    let list = zoo::list();
    let names: Vec<&str> = list.iter().map(|m| m.name).collect();
    assert_eq!(
        names,
        [
            "resnet18",
            "resnet34",
            "resnet50",
            "resnet101",
            "resnet152",
            "bert-base-uncased",
            "bert-large-uncased",
            "gpt2",
            "gpt2-medium",
            "tinyllama-1.1b",
            "llama-3.2-1b",
            "qwen2.5-0.5b",
            "mistral-7b-v0.1",
            "tiny-resnet",
            "tiny-bert",
            "tiny-gpt2",
            "tiny-llama",
            "tiny-qwen2"
        ]
    );
    let by_name = |n: &str| list.iter().find(|m| m.name == n).unwrap();
    assert_eq!(
        by_name("resnet152").candidates,
        ["layer1", "layer2", "layer3", "layer4"]
    );
    assert_eq!(by_name("resnet152").family, Family::ResNet);
    let bert = by_name("bert-large-uncased");
    assert_eq!((bert.family, bert.candidates.len()), (Family::Bert, 26));
    assert_eq!(
        (bert.candidates[0].as_str(), bert.candidates[25].as_str()),
        ("embeddings", "pooler")
    );
    let gpt2 = by_name("gpt2");
    assert_eq!((gpt2.family, gpt2.candidates.len()), (Family::Gpt2, 13));
    assert_eq!(
        (gpt2.candidates[0].as_str(), gpt2.candidates[12].as_str()),
        ("h.0", "ln_f")
    );
    let llama = by_name("tinyllama-1.1b");
    assert_eq!((llama.family, llama.candidates.len()), (Family::Llama, 24));
    assert_eq!(
        (llama.candidates[0].as_str(), llama.candidates[23].as_str()),
        ("model.embed_tokens", "model.norm")
    );
}

#[test]
fn block_names_per_family() {
    let _rng = rng();
    let chain = builtin("tiny-resnet", &ModelOptions::default()).unwrap();
    let names: Vec<&str> = chain.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "conv1+bn1+relu+maxpool",
            "layer1",
            "layer2",
            "layer3",
            "layer4",
            "avgpool+fc"
        ]
    );
    let chain = builtin("tiny-bert", &ModelOptions::default()).unwrap();
    let names: Vec<&str> = chain.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["embeddings", "encoder.layer.0", "encoder.layer.1", "pooler"]);
    let chain = builtin("tiny-gpt2", &ModelOptions::default()).unwrap();
    let names: Vec<&str> = chain.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["wte+wpe+drop", "h.0", "h.1", "ln_f"]);
    assert_eq!(
        chain.input,
        InputSpec::Tokens {
            seq: 16,
            vocab: 100,
            targets: TokenTargets::PerToken
        }
    );
}

#[test]
fn block_granularity_cuts_resnets_into_residual_blocks() {
    let _rng = rng();
    let opts = ModelOptions {
        granularity: Granularity::Block,
        ..Default::default()
    };
    let chain = builtin("resnet152", &opts).unwrap();
    let candidates = chain.candidates();
    assert_eq!(candidates.len(), 3 + 8 + 36 + 3);
    assert_eq!(&candidates[..4], ["layer1.0", "layer1.1", "layer1.2", "layer2.0"]);
    assert_eq!(candidates[candidates.len() - 1], "layer4.2");
    assert!(candidates.contains(&"layer3.35"));
    assert_eq!(chain.blocks.first().unwrap().name, "conv1+bn1+relu+maxpool");
    assert_eq!(chain.blocks.last().unwrap().name, "avgpool+fc");
    // Spot checks of the regex universe.
    for m in [
        "layer1.0.relu",
        "layer1.0.downsample",
        "layer1.0.downsample.0",
        "layer3.35.bn3",
        "fc",
    ] {
        assert!(chain.modules.iter().any(|x| x == m), "{m}");
    }
    assert!(!chain.modules.iter().any(|x| x == "layer1.1.downsample"));
}

#[test]
fn options_are_checked() {
    let _rng = rng();
    let e = builtin("resnet-50", &ModelOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::UnknownModel { .. }));
    assert!(
        e.to_string()
            .starts_with("unknown model \"resnet-50\"; known models: resnet18, resnet34, resnet50,"),
        "{e}"
    );

    let cases = [
        (
            "resnet18",
            ModelOptions {
                seq: Some(128),
                ..Default::default()
            },
            "option seq = 128 does not apply to resnet18",
        ),
        (
            "bert-base-uncased",
            ModelOptions {
                image: Some(224),
                ..Default::default()
            },
            "option image = 224",
        ),
        (
            "gpt2",
            ModelOptions {
                classes: Some(3),
                ..Default::default()
            },
            "option classes = 3 does not apply to gpt2",
        ),
        (
            "bert-base-uncased",
            ModelOptions {
                seq: Some(513),
                ..Default::default()
            },
            "must be in 1..=512",
        ),
        (
            "tiny-gpt2",
            ModelOptions {
                seq: Some(0),
                ..Default::default()
            },
            "option seq = 0",
        ),
        (
            "tiny-resnet",
            ModelOptions {
                kind: Kind::Int64,
                ..Default::default()
            },
            "option kind = Int64",
        ),
        (
            "tiny-bert",
            ModelOptions {
                heads: Some(3),
                ..Default::default()
            },
            "not a multiple of the number of attention heads (3)",
        ),
        (
            "tiny-resnet",
            ModelOptions {
                classes: Some(0),
                ..Default::default()
            },
            "num_classes 0",
        ),
    ];
    for (name, opts, says) in cases {
        let e = builtin(name, &opts).unwrap_err();
        assert!(e.to_string().contains(says), "{name}: {e}");
    }
}

#[test]
fn options_shape_the_model() {
    let _rng = rng();
    let opts = ModelOptions {
        image: Some(64),
        classes: Some(7),
        kind: Kind::BFloat16,
        ..Default::default()
    };
    let chain = builtin("resnet18", &opts).unwrap();
    assert_eq!(
        chain.input,
        InputSpec::Image {
            channels: 3,
            size: 64,
            classes: 7
        }
    );
    let vars = chain.vs.variables();
    assert_eq!(vars["fc.weight"].size(), [7, 512]);
    assert_eq!(vars["fc.weight"].kind(), Kind::BFloat16);
    assert_eq!(vars["bn1.running_var"].kind(), Kind::BFloat16);
    assert_eq!(vars["bn1.num_batches_tracked"].kind(), Kind::Int64);
    assert_eq!(chain.reference_params, 11_689_512 - 1000 * 513 + 7 * 513);

    let chain = builtin(
        "tiny-bert",
        &ModelOptions {
            seq: Some(32),
            classes: Some(5),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        chain.input,
        InputSpec::Tokens {
            seq: 32,
            vocab: 100,
            targets: TokenTargets::Classes(5)
        }
    );
}

/// Runs one training step the way the runtime does (detached leaves at block boundaries,
/// backward block by block, last to first) and returns the loss.
fn training_step(chain: &Chain, seed: i64) -> f64 {
    let batch = chain.make_batch(2, Device::Cpu, seed);
    let bias = batch.attention_mask.as_ref().map(|m| chain.attention_bias(m));
    let ctx = Ctx::new(bias.as_ref(), true);
    // inputs[k + 1] is the leaf of block k's output, read by block k + 1 and by skips.
    let mut inputs = vec![batch.input.shallow_clone()];
    let mut outputs = vec![];
    for block in &chain.blocks {
        let input = inputs.last().unwrap();
        let skips: Vec<Tensor> = block.skips.iter().map(|&s| inputs[s + 1].shallow_clone()).collect();
        let out = block.block.forward(input, &ctx.with_skips(&skips));
        inputs.push(out.detach().set_requires_grad(true));
        outputs.push(out);
    }
    let loss = chain.head.loss(inputs.last().unwrap(), &batch);
    loss.backward();
    for (i, out) in outputs.iter().enumerate().rev() {
        let grad = inputs[i + 1].grad();
        assert!(
            grad.defined(),
            "{}: no gradient reached the output of {}",
            chain.name,
            chain.blocks[i].name
        );
        (out * grad).sum(Kind::Float).backward();
    }
    loss.double_value(&[])
}

#[test]
fn a_training_step_reaches_every_parameter() {
    let _rng = rng();
    tch::set_num_threads(2);
    for (name, granularity) in ["tiny-resnet", "tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-qwen2"]
        .into_iter()
        .flat_map(|n| [(n, Granularity::Layer), (n, Granularity::Nested)])
    {
        let opts = ModelOptions {
            granularity,
            ..ModelOptions::default()
        };
        let chain = builtin(name, &opts).unwrap();
        let loss = training_step(&chain, 7);
        assert!(loss.is_finite() && loss > 0.0, "{name}: loss {loss}");
        for (key, t) in chain.vs.variables() {
            if t.requires_grad() {
                let g = t.grad();
                assert!(g.defined(), "{name}: {key} got no gradient");
                assert!(
                    g.isfinite().all().int64_value(&[]) == 1,
                    "{name}: {key} has a non-finite gradient"
                );
            }
        }
        if name == "tiny-resnet" {
            let nbt = chain.vs.variables()["layer2.0.bn1.num_batches_tracked"].int64_value(&[]);
            assert_eq!(nbt, 1, "BatchNorm counts training batches");
        }
    }
}

#[test]
fn blocks_leave_their_input_alone_and_recompute_identically() {
    let _rng = rng();
    tch::set_num_threads(2);
    for (name, granularity) in ["tiny-resnet", "tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-qwen2"]
        .into_iter()
        .flat_map(|n| [(n, Granularity::Layer), (n, Granularity::Nested)])
    {
        let opts = ModelOptions {
            granularity,
            ..ModelOptions::default()
        };
        let chain = builtin(name, &opts).unwrap();
        let batch = chain.make_batch(2, Device::Cpu, 3);
        let bias = batch.attention_mask.as_ref().map(|m| chain.attention_bias(m));
        let inputs = run_blocks(&chain, &batch.input, bias.as_ref(), true, true);
        for (i, block) in chain.blocks.iter().enumerate() {
            let skips: Vec<Tensor> = block.skips.iter().map(|&s| inputs[s].shallow_clone()).collect();
            let ctx = Ctx::new(bias.as_ref(), true);
            let ctx = ctx.with_skips(&skips);
            let input = if i == 0 {
                batch.input.shallow_clone()
            } else {
                inputs[i - 1].shallow_clone()
            };
            let before = input.copy();
            tch::manual_seed(11);
            let first = block.block.forward(&input, &ctx);
            tch::manual_seed(11);
            let again = block.block.forward(&input, &ctx);
            assert!(input.equal(&before), "{name}: {} wrote to its input", block.name);
            assert!(
                first.equal(&again),
                "{name}: {} is not a pure function of input and RNG state",
                block.name
            );
        }
    }
}

#[test]
fn eval_mode_is_deterministic_and_dropout_free() {
    let _rng = rng();
    let chain = builtin("tiny-bert", &ModelOptions::default()).unwrap();
    let batch = chain.make_batch(2, Device::Cpu, 5);
    let bias = chain.attention_bias(batch.attention_mask.as_ref().unwrap());
    let a = run_blocks(&chain, &batch.input, Some(&bias), false, false);
    let b = run_blocks(&chain, &batch.input, Some(&bias), false, false);
    assert!(a.last().unwrap().equal(b.last().unwrap()));
}
