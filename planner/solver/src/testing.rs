//! Generators of realistic problems for tests and the solver benchmark (feature `testing`).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::chain_model::{config_problem, BlockTerms, StepTerms};
use crate::problem::ConfigProblem;

/// A realistic configuration of `n_blocks` blocks built from random [`BlockTerms`] through
/// the formulas of docs/memory-model.md, for tests and the benchmark command. Even seeds give a
/// ResNet-like chain (activations halve and parameters quadruple over four stages, blocks
/// within a stage identical to the byte, as measured profiles are), odd seeds a BERT-like
/// one (identical layers between an embedding and a head). Some seeds use bf16 autocast
/// terms (no-grad forwards keep weight casts). Recompute times vary by a few percent per
/// block, as measured times do.
pub fn synthetic_problem(n_blocks: usize, seed: u64) -> ConfigProblem {
    let step = synthetic_step(n_blocks, seed);
    config_problem(format!("synthetic-{n_blocks}-seed{seed}"), &step)
}

fn synthetic_step(n: usize, seed: u64) -> StepTerms {
    let mut rng = StdRng::seed_from_u64(seed);
    let resnet = seed.is_multiple_of(2);
    let bf16 = rng.random_bool(0.5);
    let mut blocks = Vec::with_capacity(n);
    // Terms of the current "stage"; blocks repeat them until the stage changes.
    let mut proto: Option<(usize, BlockTerms)> = None;
    // Index of the block within its stage, for names like `layer3.7`.
    let mut within = 0;
    let act0: i64 = if resnet { 205_520_896 } else { 67_108_864 };
    for i in 0..n {
        let stage = if resnet {
            i * 4 / n.max(1)
        } else {
            usize::from(i > 0) + usize::from(i + 1 == n && n > 2)
        };
        let fresh = match &proto {
            Some((s, _)) => *s != stage || (!resnet && stage != 1),
            None => true,
        };
        if fresh {
            let out = (act0 >> if resnet { stage } else { 0 }) / 64 * 64;
            let out = (out as f64 * rng.random_range(0.9..1.1)) as i64 / 64 * 64;
            let g = if resnet {
                (280_000.0 * 4f64.powi(stage as i32) * rng.random_range(0.8..1.2)) as i64 * 4
            } else {
                (12_600_000.0 * rng.random_range(0.95..1.05)) as i64 * 4
            };
            let kg = (out as f64 * rng.random_range(3.0..12.0)) as i64;
            let kng = if bf16 {
                out + (g as f64 / 2.0 * rng.random_range(0.5..1.0)) as i64
            } else {
                out
            };
            let fg = kg + (out as f64 * rng.random_range(0.3..1.5)) as i64;
            let fng = (out as f64 * rng.random_range(1.0..2.5)) as i64;
            let krec = kg;
            let frec = fg - kg + (out as f64 * rng.random_range(0.0..0.5)) as i64;
            let bta = g + (out as f64 * rng.random_range(1.0..3.0)) as i64;
            let btb = (bta as f64 * rng.random_range(0.9..1.1)) as i64;
            let t = rng.random_range(0.002..0.01);
            proto = Some((
                stage,
                BlockTerms {
                    name: String::new(),
                    candidate: true,
                    kg,
                    fg,
                    kng,
                    fng,
                    out,
                    gout: out,
                    krec,
                    frec,
                    bta,
                    btb,
                    g,
                    recompute_seconds: t,
                    sel: Vec::new(),
                },
            ));
        }
        let (_, p) = proto.as_ref().expect("set above");
        let mut b = p.clone();
        within = if fresh { 0 } else { within + 1 };
        b.name = match (resnet, stage) {
            (true, s) => format!("layer{}.{within}", s + 1),
            (false, 0) => "embeddings".to_string(),
            (false, 1) => format!("encoder.layer.{within}"),
            (false, _) => "cls".to_string(),
        };
        b.recompute_seconds = p.recompute_seconds * rng.random_range(0.97..1.03);
        blocks.push(b);
    }
    let grads: i64 = blocks.iter().map(|b| b.g).sum();
    let fwd: f64 = blocks.iter().map(|b| b.recompute_seconds).sum();
    StepTerms {
        // Parameters + Adam's two moments + the batch.
        fixed: 3 * grads + act0 / 4,
        lk: 4096,
        lf: 1 << 20,
        lb: 1 << 20,
        otmp: grads / 8,
        base_seconds: 3.0 * fwd + 0.01,
        blocks,
        groups: Vec::new(),
    }
}
