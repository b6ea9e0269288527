//! Nested candidates (a layer, or any of its children, never both) on each model family:
//! gradients bitwise equal to the plain step under checkpoint choices that mix whole layers
//! and children, and every moment of an instrumented step, for every allowed choice, equal
//! to the profile's prediction to the byte.
//!
//! Every test holds the meter's process-wide lock: the counters see every allocation.

mod common;

use ckptune_kernels::meter;
use ckptune_models::{builtin, resnet, Chain, Granularity, ModelOptions};
use ckptune_runtime::profile::measured_moments;
use ckptune_runtime::{select, OptimizerKind, Precision, Session, StepTrace, TrainConfig};
use ckptune_solver::model::{moments_at, peak_at};
use common::quick_profile;
use tch::Device;

/// Builds a fresh chain (sessions consume theirs).
type MakeChain = Box<dyn Fn() -> Chain>;

/// The families with nesting: BERT (`encoder.layer.N` over attention / intermediate /
/// output, with the residual skip), GPT-2 (`h.N` over ln_1, attn, residual, ln_2, mlp,
/// residual), Llama (`model.layers.N` over input_layernorm, self_attn, residual,
/// post_attention_layernorm, mlp, residual) and a ResNet with two residual blocks in its first
/// two stages.
fn models() -> Vec<(&'static str, MakeChain)> {
    let nested = |seq: Option<i64>, image: Option<i64>| ModelOptions {
        seq,
        image,
        granularity: Granularity::Nested,
        ..Default::default()
    };
    vec![
        (
            "tiny-bert",
            Box::new(move || builtin("tiny-bert", &nested(Some(16), None)).unwrap()),
        ),
        (
            "tiny-gpt2",
            Box::new(move || builtin("tiny-gpt2", &nested(Some(16), None)).unwrap()),
        ),
        (
            "tiny-llama",
            Box::new(move || builtin("tiny-llama", &nested(Some(16), None)).unwrap()),
        ),
        (
            "resnet-2211",
            Box::new(move || {
                let cfg = resnet::Config {
                    layers: [2, 2, 1, 1],
                    ..resnet::Config::tiny()
                };
                resnet::build("resnet-2211", &cfg, &nested(None, Some(32))).unwrap()
            }),
        ),
    ]
}

/// Every checkpoint mask over the chain's units that checkpoints only candidates and never a
/// group together with one of its blocks.
fn allowed_masks(chain: &Chain) -> Vec<Vec<bool>> {
    let units: Vec<usize> = (0..chain.units()).filter(|&i| chain.unit_candidate(i)).collect();
    let n = chain.blocks.len();
    let mut out = Vec::new();
    for m in 0..1u64 << units.len() {
        let mut x = vec![false; chain.units()];
        for (k, &u) in units.iter().enumerate() {
            x[u] = m >> k & 1 == 1;
        }
        let nested = chain
            .groups
            .iter()
            .enumerate()
            .any(|(g, grp)| x[n + g] && (grp.first..=grp.last).any(|k| x[k]));
        if !nested {
            out.push(x);
        }
    }
    out
}

fn session(make: &dyn Fn() -> Chain, precision: Precision) -> Session {
    session_with(make, TrainConfig::new(precision, OptimizerKind::AdamW, 2))
}

fn session_with(make: &dyn Fn() -> Chain, cfg: TrainConfig) -> Session {
    tch::manual_seed(3);
    Session::new(make(), cfg, Device::Cpu).unwrap()
}

#[test]
fn chains_validate_and_groups_cover_their_children() {
    // Building models draws from the global RNG, which the other tests seed.
    let _lock = meter::exclusive();
    for (name, make) in models() {
        let chain = make();
        chain.validate().unwrap();
        assert!(!chain.groups.is_empty(), "{name} has groups");
        for g in &chain.groups {
            for b in &chain.blocks[g.first..=g.last] {
                assert!(b.name.starts_with(&format!("{}.", g.name)) || b.name.starts_with(&format!("{} ", g.name)));
            }
        }
    }
}

#[test]
fn regex_selects_layers_or_children_but_never_both() {
    let _lock = meter::exclusive();
    let chain = models().remove(0).1();
    let s = Session::new(
        chain,
        TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 2),
        Device::Cpu,
    )
    .unwrap();
    let x = select(&s.chain, r"encoder\.layer\.0|encoder\.layer\.1\.(attention|output)").unwrap();
    let on: Vec<&str> = (0..x.len()).filter(|&i| x[i]).map(|i| s.chain.unit_name(i)).collect();
    assert_eq!(
        on,
        ["encoder.layer.1.attention", "encoder.layer.1.output", "encoder.layer.0"]
    );
    let err = select(&s.chain, r"encoder\.layer\.1(\.intermediate)?")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("encoder.layer.1") && err.contains("child encoder.layer.1.intermediate"),
        "{err}"
    );
}

#[test]
fn nested_checkpointing_equals_plain_bit_for_bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for (name, make) in models() {
        let masks = allowed_masks(&make());
        for precision in [Precision::Fp32, Precision::Bf16] {
            let grads = |x: &[bool]| {
                let mut s = session(&*make, precision);
                tch::manual_seed(5);
                let batch = s.make_batch();
                s.micro_step(&batch, x, None).unwrap();
                (s.named_grads(), s.named_parameters())
            };
            let (g0, p0) = grads(&masks[0]);
            // Every group on, and a spread of mixed choices.
            let n = make().blocks.len();
            let mut picks: Vec<&Vec<bool>> = masks.iter().step_by(masks.len() / 7 + 1).collect();
            let all_groups = masks.iter().find(|x| x[n..].iter().all(|&g| g)).unwrap();
            picks.push(all_groups);
            for x in picks {
                let (g, p) = grads(x);
                // Bitwise also for Llama, whose layer input has three readers and whose
                // children cast their inputs more than once: a split run sums its input's
                // gradient in the fused graph's order (sink::backward_edges), and the
                // boundaries inside a layer are non-leaf aliases, whose casts autocast does not
                // cache.
                for ((na, a), (_, b)) in g0.iter().chain(&p0).zip(g.iter().chain(&p)) {
                    assert_eq!(a.defined(), b.defined(), "{name} {precision} {na}");
                    if a.defined() {
                        assert!(a.equal(b), "{name} {precision} {x:?}: {na} differs");
                    }
                }
            }
        }
    }
}

#[test]
fn every_allowed_choice_peaks_exactly_as_predicted() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for (name, make) in models() {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let mut s = session(&*make, precision);
            let p = quick_profile(&mut s);
            assert_eq!(p.recompute_seconds.len(), s.chain.units());
            let masks = allowed_masks(&s.chain);
            assert!(masks.len() >= 25, "{name}: {} choices", masks.len());
            for x in masks {
                let mut trace = StepTrace::default();
                let report = s.step(&x, Some(&mut trace)).unwrap();
                let measured = measured_moments(&trace, &s.chain, p.regimes.len());
                let predicted = moments_at(&p, &x);
                assert_eq!(measured, predicted, "{name} {precision} {x:?}");
                assert_eq!(report.peak_bytes, peak_at(&p, &x).0, "{name} {precision} {x:?}");
            }
        }
    }
}

/// A loop that keeps autocast's cache on (the Hugging Face Trainer's): the casts of
/// checkpointed and fused groups' weights and of plain blocks' biases live until the loss is
/// made, on every allowed choice exactly as the model adds them.
#[test]
fn every_allowed_choice_peaks_exactly_as_predicted_with_autocast_cache() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for (name, make) in models() {
        let mut cfg = TrainConfig::new(Precision::Bf16, OptimizerKind::AdamW, 2);
        cfg.autocast_cache = true;
        let mut s = session_with(&*make, cfg);
        let p = quick_profile(&mut s);
        assert!(
            s.hold_casts,
            "{name}: the profiler hands the session back holding casts"
        );
        let casts: i64 = p.regimes[0].blocks.iter().filter_map(|b| b.cache_nograd).sum();
        assert!(casts > 0, "{name}: a no-grad bf16 forward caches weight casts");
        for x in allowed_masks(&s.chain) {
            let mut trace = StepTrace::default();
            let report = s.step(&x, Some(&mut trace)).unwrap();
            let measured = measured_moments(&trace, &s.chain, p.regimes.len());
            assert_eq!(measured, moments_at(&p, &x), "{name} {x:?}");
            assert_eq!(report.peak_bytes, peak_at(&p, &x).0, "{name} {x:?}");
        }
    }
}
