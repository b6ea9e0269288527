//! Selective checkpointing (a checkpointed block whose forward keeps the outputs of the
//! operators its policy saves, `ckptune_kernels::sac`): gradients equal the plain step's bit for
//! bit on every transformer family of the zoo, in fp32 and bf16 autocast with dropout active,
//! with every candidate selective and with keep, selective and full
//! checkpointing mixed; and a selective block keeps more than a checkpointed one, and under the
//! matmul policy less than a plain one.

mod common;

use ckptune_kernels::meter;
use ckptune_kernels::sac::SacPolicy;
use ckptune_models::{builtin, ModelOptions};
use ckptune_runtime::exec::MicroTrace;
use ckptune_runtime::{OptimizerKind, Precision, Session, TrainConfig};
use common::assert_bitwise;
use tch::{Device, Tensor};

const FAMILIES: [&str; 4] = ["tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-qwen2"];

/// One micro-step of `model` with `mask` checkpointed, the blocks `selective` names running
/// selective; its gradients and trace.
fn run(
    model: &str,
    precision: Precision,
    mask: &dyn Fn(usize, bool) -> bool,
    selective: &dyn Fn(usize) -> Option<SacPolicy>,
) -> (Vec<(String, Tensor)>, MicroTrace) {
    tch::manual_seed(11);
    let opts = ModelOptions {
        seq: Some(16),
        ..Default::default()
    };
    let chain = builtin(model, &opts).unwrap();
    let cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 2);
    let mut s = Session::new(chain, cfg, Device::Cpu).unwrap();
    let m: Vec<bool> = s
        .chain
        .blocks
        .iter()
        .enumerate()
        .map(|(i, b)| mask(i, b.candidate))
        .collect();
    s.selective = (0..m.len()).map(selective).collect();
    tch::manual_seed(5);
    let batch = s.make_batch();
    let mut tr = MicroTrace::default();
    s.micro_step(&batch, &m, Some(&mut tr)).unwrap();
    (s.named_grads(), tr)
}

#[test]
fn selective_gradients_equal_plain_bit_for_bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in FAMILIES {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let (plain, _) = run(model, precision, &|_, _| false, &|_| None);
            for policy in SacPolicy::ALL {
                let what = format!("{model} {precision} {}", policy.name());
                let (all, _) = run(model, precision, &|_, c| c, &|_| Some(policy));
                assert_bitwise(&format!("{what}, every candidate selective"), &plain, &all);
                // Keep, selective and full in turn along the chain.
                let (mixed, _) = run(model, precision, &|i, c| c && i % 3 != 0, &|i| {
                    (i % 3 == 1).then_some(policy)
                });
                assert_bitwise(&format!("{what}, mixed"), &plain, &mixed);
            }
        }
    }
}

#[test]
fn a_selective_block_keeps_more_than_checkpointed_and_matmul_less_than_plain() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in FAMILIES {
        let kept = |tr: &MicroTrace, i: usize| tr.blocks[i].fwd_after - tr.blocks[i].fwd_before;
        let (_, plain) = run(model, Precision::Fp32, &|_, _| false, &|_| None);
        let (_, full) = run(model, Precision::Fp32, &|_, c| c, &|_| None);
        let (_, sel) = run(model, Precision::Fp32, &|_, c| c, &|_| Some(SacPolicy::Matmul));
        // Blocks where checkpointing saves memory (not a head whose plain output is smaller
        // than its checkpointed one): a selective one keeps at least a checkpointed one's
        // bytes, more where it has matrix products, and less than the plain block.
        let mut more = 0;
        for i in (0..plain.blocks.len()).filter(|&i| full.blocks[i].checkpointed) {
            let (p, f, s) = (kept(&plain, i), kept(&full, i), kept(&sel, i));
            if f < p {
                assert!(f <= s && s < p, "{model} block {i}: full {f} <= matmul {s} < plain {p}");
                more += usize::from(f < s);
            }
        }
        assert!(more > 0, "{model}: no selective block kept a matrix product's output");
    }
}
