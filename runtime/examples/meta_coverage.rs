//! Lists the operators the built-in models' training steps run on the CPU that have no kernel
//! for the meta device (what fake mode needs from `kernels/csrc/meta_kernels.cpp`).

use std::collections::BTreeSet;

use ckptune_kernels::optrace;
use ckptune_models::{builtin, Attention, Granularity, ModelOptions};
use ckptune_runtime::{OptimizerImpl, OptimizerKind, Precision, Session, TrainConfig};
use tch::Device;

/// The built-in models the steps run, transformers with each attention implementation.
const MODELS: [(&str, Option<Attention>); 9] = [
    ("tiny-resnet", None),
    ("tiny-bert", None),
    ("tiny-bert", Some(Attention::Sdpa)),
    ("tiny-gpt2", None),
    ("tiny-gpt2", Some(Attention::Sdpa)),
    ("tiny-llama", None),
    ("tiny-llama", Some(Attention::Sdpa)),
    ("tiny-qwen2", None),
    ("tiny-qwen2", Some(Attention::Sdpa)),
];

fn main() {
    tch::set_num_threads(1);
    ckptune_kernels::meter::install().unwrap();
    let mut ops = BTreeSet::new();
    for (model, attention) in MODELS {
        for precision in [Precision::Fp32, Precision::Bf16, Precision::Bf16Pure] {
            for (opt, imp) in [
                (OptimizerKind::AdamW, OptimizerImpl::Single),
                (OptimizerKind::AdamW, OptimizerImpl::Foreach),
                (OptimizerKind::AdamW, OptimizerImpl::Fused),
                (OptimizerKind::SgdMomentum, OptimizerImpl::Single),
                (OptimizerKind::Lion, OptimizerImpl::Single),
                (OptimizerKind::AdamW8bit, OptimizerImpl::Single),
            ] {
                let resnet = model.contains("resnet");
                let opts = ModelOptions {
                    seq: (!resnet).then_some(8),
                    image: resnet.then_some(32),
                    attention,
                    granularity: Granularity::Nested,
                    ..Default::default()
                };
                let mut cfg = TrainConfig::new(precision, opt, 2);
                cfg.optimizer_impl = imp;
                let mut s = Session::new(builtin(model, &opts).unwrap(), cfg, Device::Cpu).unwrap();
                let units = s.chain.units();
                let mask: Vec<bool> = (0..units).map(|i| s.chain.unit_candidate(i) && i % 2 == 0).collect();
                let mask = if s.chain.nested_conflict(&mask).is_some() {
                    vec![false; units]
                } else {
                    mask
                };
                optrace::start().unwrap();
                s.step(&vec![false; units], None).unwrap();
                s.step(&mask, None).unwrap();
                for e in optrace::stop().unwrap() {
                    ops.insert(e.name);
                }
            }
        }
    }
    for op in ops {
        if let Some(false) = optrace::has_meta_kernel(&op) {
            println!("{op}");
        }
    }
}
