//! Gradients with every candidate checkpointed equal the plain step's bit for bit on each model
//! family of the zoo (tiny configurations: same code paths as the full-size models), in fp32
//! and bf16 autocast, with dropout active.

use ckptune_kernels::meter;
use ckptune_models::{builtin, Granularity, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, Session, TrainConfig};
use tch::Device;

fn grads(model: &str, opts: &ModelOptions, precision: Precision, all: bool) -> Vec<(String, tch::Tensor)> {
    tch::manual_seed(11);
    let chain = builtin(model, opts).unwrap();
    let mut s = Session::new(chain, TrainConfig::new(precision, OptimizerKind::AdamW, 2), Device::Cpu).unwrap();
    let mask: Vec<bool> = s.chain.blocks.iter().map(|b| all && b.candidate).collect();
    tch::manual_seed(5);
    let batch = s.make_batch();
    s.micro_step(&batch, &mask, None).unwrap();
    s.named_grads()
}

#[test]
fn every_family_checkpointed_equals_plain_bit_for_bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for (model, opts) in [
        (
            "tiny-resnet",
            ModelOptions {
                image: Some(32),
                ..Default::default()
            },
        ),
        (
            "tiny-bert",
            ModelOptions {
                seq: Some(16),
                ..Default::default()
            },
        ),
        (
            "tiny-gpt2",
            ModelOptions {
                seq: Some(16),
                ..Default::default()
            },
        ),
        (
            "tiny-llama",
            ModelOptions {
                seq: Some(16),
                granularity: Granularity::Block,
                ..Default::default()
            },
        ),
        (
            "tiny-qwen2",
            ModelOptions {
                seq: Some(16),
                ..Default::default()
            },
        ),
    ] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let plain = grads(model, &opts, precision, false);
            let ckpt = grads(model, &opts, precision, true);
            assert_eq!(plain.len(), ckpt.len());
            for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
                assert_eq!(a.defined(), b.defined(), "{model} {precision} {n}");
                if a.defined() {
                    assert!(a.equal(b), "{model} {precision}: gradient of {n} differs");
                }
            }
        }
    }
}
