//! `torch.export` programs run node by node: the exported tiny ResNet (models/fixtures,
//! made by make_export_fixtures.py from reference.py) cuts into the built-in's blocks, its
//! training step peaks at exactly the built-in's bytes under every checkpoint subset, and its
//! gradients with checkpointing equal the plain step's bit for bit.

use std::path::PathBuf;

use ckptune_kernels::meter;
use ckptune_models::export::chain_from_export;
use ckptune_models::{builtin, Chain, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, Session, TrainConfig};
use tch::Device;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/fixtures")
        .join(name)
}

fn exported(batch: Option<i64>) -> Chain {
    let opts = ModelOptions {
        batch,
        ..Default::default()
    };
    chain_from_export(&fixture("tiny_resnet.pt2"), &opts).unwrap()
}

fn session(chain: Chain, precision: Precision, batch: i64) -> Session {
    Session::new(
        chain,
        TrainConfig::new(precision, OptimizerKind::AdamW, batch),
        Device::Cpu,
    )
    .unwrap()
}

#[test]
fn exported_resnet_cuts_into_the_builtin_blocks() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = meter::exclusive();
    let ex = exported(None);
    let opts = ModelOptions {
        image: Some(32),
        ..Default::default()
    };
    let bi = builtin("tiny-resnet", &opts).unwrap();
    let names = |c: &Chain| -> Vec<(String, bool)> { c.blocks.iter().map(|b| (b.name.clone(), b.candidate)).collect() };
    assert_eq!(names(&ex), names(&bi));
    assert_eq!(ex.input, bi.input);
    let mut a: Vec<(String, Vec<i64>)> = ex.vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
    let mut b: Vec<(String, Vec<i64>)> = bi.vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "parameter and buffer names and shapes equal the built-in's");
}

/// Step peak above the step's start, for every subset of the four candidates.
fn peaks(chain: Chain, precision: Precision, batch: i64) -> Vec<i64> {
    let mut s = session(chain, precision, batch);
    let cands: Vec<usize> = (0..s.chain.blocks.len())
        .filter(|&i| s.chain.blocks[i].candidate)
        .collect();
    let n = s.chain.blocks.len();
    (0..1usize << cands.len())
        .map(|bits| {
            let mut mask = vec![false; n];
            for (k, &i) in cands.iter().enumerate() {
                mask[i] = bits >> k & 1 == 1;
            }
            s.step(&mask, None).unwrap(); // warm-up of this subset
            let r = s.step(&mask, None).unwrap();
            r.peak_bytes - r.start_bytes
        })
        .collect()
}

#[test]
fn exported_resnet_peaks_at_the_builtin_bytes_under_every_subset() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let opts = ModelOptions {
        image: Some(32),
        ..Default::default()
    };
    // fp32 only: in bf16 at 16 pixels the built-in tiny-resnet itself ends some runs with a NaN
    // loss (`ckptune profile tiny-resnet --image 16 --batch 2 --precision bf16`: 2 runs of 8 on
    // the development machine), which Session::step refuses; not a difference of the export.
    for (precision, batch) in [(Precision::Fp32, 4), (Precision::Fp32, 2)] {
        tch::manual_seed(0);
        let want = peaks(builtin("tiny-resnet", &opts).unwrap(), precision, batch);
        tch::manual_seed(0);
        let got = peaks(exported(Some(batch)), precision, batch);
        assert_eq!(got, want, "{precision} batch {batch}: exported vs built-in step peaks");
    }
}

#[test]
fn exported_resnet_checkpointed_gradients_equal_plain_bit_for_bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for precision in [Precision::Fp32, Precision::Bf16] {
        let grads = |all: bool| {
            let mut s = session(exported(Some(2)), precision, 2);
            let mask: Vec<bool> = s.chain.blocks.iter().map(|b| all && b.candidate).collect();
            tch::manual_seed(5);
            let batch = s.make_batch();
            s.micro_step(&batch, &mask, None).unwrap();
            let buffers: Vec<(String, tch::Tensor)> = s
                .chain
                .vs
                .variables()
                .into_iter()
                .filter(|(_, t)| !t.requires_grad())
                .collect();
            (s.named_grads(), buffers)
        };
        let (plain, plain_buf) = grads(false);
        let (ckpt, ckpt_buf) = grads(true);
        assert_eq!(plain.len(), ckpt.len());
        assert!(!plain.is_empty());
        for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
            assert!(a.defined(), "{precision}: {n} got no gradient");
            assert!(a.equal(b), "{precision}: gradient of {n} differs");
        }
        let mut pb = plain_buf;
        let mut cb = ckpt_buf;
        pb.sort_by(|a, b| a.0.cmp(&b.0));
        cb.sort_by(|a, b| a.0.cmp(&b.0));
        for ((n, a), (_, b)) in pb.iter().zip(&cb) {
            assert!(a.equal(b), "{precision}: buffer {n} differs after a checkpointed step");
        }
    }
}

#[test]
fn exported_stack_with_dropout_checkpoints_bitwise_at_every_level() {
    // Nested groups, skips into groups, dropout replayed under recompute: gradients with the
    // children checkpointed, and with the layers (groups) checkpointed, equal the plain step's.
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let opts = ModelOptions {
        granularity: ckptune_models::Granularity::Nested,
        ..Default::default()
    };
    for precision in [Precision::Fp32, Precision::Bf16] {
        let grads = |which: u8| {
            let chain = chain_from_export(&fixture("tiny_stack.pt2"), &opts).unwrap();
            let mut s = session(chain, precision, 4);
            let n = s.chain.blocks.len();
            let mut mask = vec![false; s.chain.units()];
            for (i, m) in mask.iter_mut().enumerate() {
                *m = match which {
                    1 => i < n && s.chain.blocks[i].candidate,
                    2 => i >= n,
                    _ => false,
                };
            }
            tch::manual_seed(5);
            let batch = s.make_batch();
            tch::manual_seed(9);
            s.micro_step(&batch, &mask, None).unwrap();
            s.named_grads()
        };
        let plain = grads(0);
        assert!(!plain.is_empty());
        for which in [1, 2] {
            let ckpt = grads(which);
            assert_eq!(plain.len(), ckpt.len());
            for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
                assert!(a.defined(), "{precision}: {n} got no gradient");
                assert!(a.equal(b), "{precision} mask {which}: gradient of {n} differs");
            }
        }
    }
}

#[test]
fn exported_transformers_checkpoint_bitwise() {
    // Values every layer reads but no layer makes (a mask from the batch or from the sizes,
    // rotary cos/sin) are computed by each block that reads them; dropout replays under
    // recompute. Layers, and the layers' children, checkpointed.
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    use ckptune_models::Granularity::{Layer, Nested};
    for (file, granularity) in [
        ("tiny_bert.pt2", Layer),
        ("tiny_bert.pt2", Nested),
        ("tiny_bert_hf.pt2", Nested),
        ("tiny_llama.pt2", Layer),
        ("tiny_llama.pt2", Nested),
        ("hf_bert.pt2", Nested),
        ("hf_bert_mask.pt2", Layer),
        ("hf_llama.pt2", Layer),
        ("hf_llama.pt2", Nested),
        ("hf_gpt2.pt2", Nested),
    ] {
        let opts = ModelOptions {
            granularity,
            ..Default::default()
        };
        for precision in [Precision::Fp32, Precision::Bf16] {
            let grads = |all: bool| {
                let chain = chain_from_export(&fixture(file), &opts).unwrap();
                let mut s = session(chain, precision, 4);
                let mask: Vec<bool> = (0..s.chain.units())
                    .map(|i| all && i < s.chain.blocks.len() && s.chain.blocks[i].candidate)
                    .collect();
                tch::manual_seed(5);
                let batch = s.make_batch();
                tch::manual_seed(9);
                s.micro_step(&batch, &mask, None).unwrap();
                s.named_grads()
            };
            let plain = grads(false);
            let ckpt = grads(true);
            assert!(!plain.is_empty());
            for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
                // Every parameter trains: a tied pair (GPT-2's wte and lm_head) is one.
                assert!(a.defined() && b.defined(), "{file}: {n} got no gradient");
                {
                    assert!(
                        a.equal(b),
                        "{file} {granularity:?} {precision}: gradient of {n} differs"
                    );
                }
            }
        }
    }
}
