//! A block's input under bf16 autocast is cast as PyTorch casts the previous layer's output:
//! autocast's cache holds the casts of a block's weights and nothing of its input (PyTorch's
//! side of it is pinned in python/tests/test_eager.py).

mod common;

use ckptune_kernels::meter;
use ckptune_models::{builtin, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, Session, TrainConfig};
use common::quick_profile;
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
