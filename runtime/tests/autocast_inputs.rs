//! A block's input under bf16 autocast is cast as PyTorch casts the previous layer's output:
//! autocast's cache holds the casts of a block's weights and nothing of its input (PyTorch's
//! side of it is pinned in python/tests/test_eager.py), and the f32 input is let go of where
//! only its casts were saved.

mod common;

use ckptune_kernels::meter;
use ckptune_models::{builtin, ModelOptions};
use ckptune_runtime::profile::measured_moments;
use ckptune_runtime::{OptimizerKind, Precision, Session, StepTrace, TrainConfig};
use ckptune_solver::model::{moments_at, peak_at};
use common::{quick_profile, subsets};
use tch::Device;

/// With the cache on, what a BERT layer's no-grad forward leaves in autocast's cache is the bf16
/// cast of each of its linear layers' weight and bias (LayerNorm runs in f32), counted from the
/// layer's parameters: the query, key and value projections cast the layer's input each (it is
/// no leaf autocast caches), and none of those casts outlives its projection.
#[test]
fn a_layers_cache_holds_its_weight_casts_and_not_its_input() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    tch::manual_seed(11);
    let opts = ModelOptions {
        seq: Some(16),
        ..Default::default()
    };
    let mut cfg = TrainConfig::new(Precision::Bf16, OptimizerKind::Sgd, 2);
    cfg.autocast_cache = true;
    let mut s = Session::new(builtin("tiny-bert", &opts).unwrap(), cfg, Device::Cpu).unwrap();
    let p = quick_profile(&mut s);
    let vars = s.chain.vs.variables();
    let mut layers = 0;
    for (b, block) in s.chain.blocks.iter().zip(&p.regimes[0].blocks) {
        if !b.name.starts_with("encoder.layer.") {
            continue;
        }
        let prefix = format!("{}.", b.name);
        let casts: i64 = vars
            .iter()
            .filter(|(name, _)| name.starts_with(&prefix) && !name.contains("LayerNorm"))
            .map(|(_, t)| t.numel() as i64 * 2)
            .sum();
        assert_eq!(
            block.cache_nograd,
            Some(casts),
            "{}: casts only the cache holds",
            b.name
        );
        layers += 1;
    }
    assert_eq!(layers, 2, "tiny-bert's encoder layers");
}

/// bf16 BERT's layers keep only the bf16 casts of their f32 input, so the runtime lets go of a
/// plain layer's input once its forward is done and a checkpointed layer's once its backward is
/// (docs/memory-model.md, "When a boundary's tensor dies"; planner/tests/pytorch_bf16.rs compares
/// the peaks with PyTorch eager): on every subset of tiny BERT's blocks, with autocast's cache
/// off and on, every moment and the peak are the profile's prediction to the byte.
#[test]
fn let_go_layer_inputs_are_predicted_to_the_byte_on_every_subset() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let opts = ModelOptions {
        seq: Some(16),
        ..Default::default()
    };
    for cache in [false, true] {
        tch::manual_seed(11);
        let mut cfg = TrainConfig::new(Precision::Bf16, OptimizerKind::Sgd, 2);
        cfg.autocast_cache = cache;
        let mut s = Session::new(builtin("tiny-bert", &opts).unwrap(), cfg, Device::Cpu).unwrap();
        let p = quick_profile(&mut s);
        // The pooler casts the first token's f32 state, a view of its input: with its input let
        // go of, its plain forward frees more than it keeps.
        let pooler = p.regimes[0].blocks.last().unwrap();
        assert!(
            pooler.kept_grad < 0,
            "cache {cache}: the pooler keeps {} B",
            pooler.kept_grad
        );
        for mask in subsets(s.chain.blocks.len()) {
            let mut trace = StepTrace::default();
            let report = s.step(&mask, Some(&mut trace)).unwrap();
            let seen = measured_moments(&trace, &s.chain, p.regimes.len());
            assert_eq!(moments_at(&p, &mask), seen, "cache {cache} {mask:?}: moments");
            assert_eq!(peak_at(&p, &mask).0, report.peak_bytes, "cache {cache} {mask:?}: peak");
        }
    }
}
