//! Prints, for the operators named on the command line, what each call of them allocates in a
//! real CPU step of the built-in models: its inputs' shapes, the bytes it keeps and its peak
//! above its start (a meta kernel must allocate the same).

use std::collections::BTreeSet;

use ckptune_kernels::optrace;
use ckptune_models::{builtin, Attention, Granularity, ModelOptions};
use ckptune_runtime::{OptimizerImpl, OptimizerKind, Precision, Session, TrainConfig};
use tch::Device;

/// The built-in models the steps run, transformers with each attention implementation.
const MODELS: [(&str, Option<Attention>); 7] = [
    ("tiny-resnet", None),
    ("tiny-bert", None),
    ("tiny-bert", Some(Attention::Sdpa)),
    ("tiny-gpt2", None),
    ("tiny-gpt2", Some(Attention::Sdpa)),
    ("tiny-llama", None),
    ("tiny-llama", Some(Attention::Sdpa)),
];

fn main() {
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    tch::set_num_threads(1);
    ckptune_kernels::meter::install().unwrap();
    let mut seen = BTreeSet::new();
    for (model, attention) in MODELS {
        for precision in [Precision::Fp32, Precision::Bf16, Precision::Bf16Pure] {
            for imp in [OptimizerImpl::Single, OptimizerImpl::Fused] {
                let resnet = model.contains("resnet");
                let opts = ModelOptions {
                    seq: (!resnet).then_some(8),
                    image: resnet.then_some(32),
                    attention,
                    granularity: Granularity::Layer,
                    ..Default::default()
                };
                let mut cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 2);
                cfg.optimizer_impl = imp;
                let mut s = Session::new(builtin(model, &opts).unwrap(), cfg, Device::Cpu).unwrap();
                let none = vec![false; s.chain.units()];
                s.step(&none, None).unwrap();
                optrace::start().unwrap();
                s.step(&none, None).unwrap();
                for e in optrace::stop().unwrap() {
                    if !wanted.iter().any(|w| e.name.starts_with(w.as_str())) {
                        continue;
                    }
                    let line = format!(
                        "{:<36} {:?} keeps {} peak {}",
                        e.name,
                        e.inputs
                            .iter()
                            .map(|i| i.as_ref().map(|(k, s)| format!("{k:?}{s:?}")).unwrap_or("-".into()))
                            .collect::<Vec<_>>(),
                        e.exit - e.enter,
                        e.peak - e.enter
                    );
                    if seen.insert(line.clone()) {
                        println!("{model} {precision}: {line}");
                    }
                }
            }
        }
    }
}
