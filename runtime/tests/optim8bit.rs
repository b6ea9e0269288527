//! 8-bit AdamW in the runtime: a toy chain trains with it through `Session`, tracking fp32
//! AdamW; its optimizer state is the exact byte count the block-wise format implies, on the
//! meter as in `optimizer_state_bytes`; and the profiler still predicts every checkpoint
//! subset's peak to the byte.
//!
//! Every test holds the meter's process-wide lock: the counters see every allocation.

mod common;

use ckptune_kernels::meter;
use ckptune_models::toy::ToyConfig;
use ckptune_runtime::exec::StepTrace;
use ckptune_runtime::{OptimizerKind, Precision, TrainConfig};
use ckptune_solver::model::peak_at;
use common::{quick_profile, toy_session};

/// Trains on one fixed batch (so the loss can fall; `Session::step` draws a fresh random batch
/// each step) for `steps` optimizer steps, checkpointing every other block.
fn losses(toy_cfg: &ToyConfig, cfg: TrainConfig, steps: usize) -> Vec<f64> {
    let mut s = toy_session(toy_cfg, cfg);
    let mask: Vec<bool> = (0..toy_cfg.blocks).map(|i| i % 2 == 1).collect();
    let batch = s.make_batch();
    (0..steps)
        .map(|_| {
            let loss = s.micro_step(&batch, &mask, None).unwrap();
            assert!(s.optimizer_step(None).unwrap());
            loss
        })
        .collect()
}

#[test]
fn toy_chain_trains_with_adamw8bit_and_tracks_fp32_adamw() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let toy_cfg = ToyConfig::default(); // width 64: each block's 64×64 weight is 8-bit
    let steps = 60;
    let l8 = losses(
        &toy_cfg,
        TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW8bit, 32),
        steps,
    );
    let l32 = losses(
        &toy_cfg,
        TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 32),
        steps,
    );
    let gap = l8.iter().zip(&l32).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!(
        "toy, fixed batch of 32: adamw8bit {:.4} -> {:.4}, adamw {:.4} -> {:.4} in {steps} steps; largest gap {gap:.4}",
        l8[0],
        l8[steps - 1],
        l32[0],
        l32[steps - 1]
    );
    assert_eq!(l8[0], l32[0], "same model, same batch");
    assert!(l8[steps - 1] < 0.5 * l8[0], "adamw8bit lowers the loss: {l8:?}");
    // Measured: the curves stay within a few hundredths of a nat of each other.
    assert!(gap < 0.05 * l32[0], "adamw8bit tracks adamw: largest gap {gap}");
}

#[test]
fn bf16_pure_parameters_train_with_adamw8bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let l = losses(
        &ToyConfig::default(),
        TrainConfig::new(Precision::Bf16Pure, OptimizerKind::AdamW8bit, 32),
        30,
    );
    assert!(l[29] < 0.7 * l[0], "bf16 parameters, f32 update, 8-bit state: {l:?}");
}

/// 8-bit block-wise state for tensors of 4096 elements or more: 2 bytes per element (two 8-bit
/// codes) + 2 × 4 bytes per 2048-element block (two f32 absmax); smaller tensors 2 × 4 bytes per
/// element.
fn expected_state_bytes(numels: &[i64]) -> i64 {
    numels
        .iter()
        .map(|&n| {
            if n < 4096 {
                8 * n
            } else {
                2 * n + 8 * n.div_euclid(2048) + 8 * i64::from(n % 2048 != 0)
            }
        })
        .sum()
}

#[test]
fn optimizer_state_bytes_equal_the_exact_count() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for (width, blocks) in [(64, 4), (100, 3)] {
        let toy_cfg = ToyConfig {
            width,
            blocks,
            ..Default::default()
        };
        let mut s = toy_session(&toy_cfg, TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW8bit, 8));
        assert_eq!(s.optimizer_state_bytes(), 0, "state is allocated by the first step");
        // Per block a width×width weight and a bias; the head a 10×width weight and a bias.
        let mut numels = vec![];
        for _ in 0..blocks {
            numels.extend([width * width, width]);
        }
        numels.extend([10 * width, 10]);
        let expected = expected_state_bytes(&numels);
        let batch = s.make_batch();
        s.micro_step(&batch, &vec![false; blocks], None).unwrap();
        let grads = s.grad_bytes();
        let mut trace = StepTrace::default();
        s.optimizer_step(Some(&mut trace)).unwrap();
        assert_eq!(s.optimizer_state_bytes(), expected, "width {width}");
        // On the meter: the first step allocates exactly the state (and nothing transient),
        // then zero_grad(set_to_none) frees the gradients.
        assert_eq!(trace.opt_peak - trace.opt_before, expected, "width {width}: meter peak");
        assert_eq!(
            trace.opt_after - trace.opt_before,
            expected - grads,
            "width {width}: meter after"
        );
        let adamw: i64 = numels.iter().map(|n| 8 * n).sum();
        eprintln!("toy width {width}: adamw8bit state {expected} B, adamw {adamw} B");
        // A steady-state step allocates nothing beyond the gradients it frees.
        s.micro_step(&batch, &vec![false; blocks], None).unwrap();
        s.optimizer_step(Some(&mut trace)).unwrap();
        assert_eq!(
            trace.opt_peak, trace.opt_before,
            "width {width}: no optimizer transient"
        );
        assert_eq!(s.optimizer_state_bytes(), expected);
    }
    // width 64: four 8-bit 64×64 weights (8192 + 16 B each), 32-bit biases and head.
    assert_eq!(
        expected_state_bytes(&[4096, 64, 4096, 64, 4096, 64, 4096, 64, 640, 10]),
        4 * (2 * 4096 + 2 * 2 * 4) + 4 * 64 * 8 + 640 * 8 + 10 * 8
    );
}

#[test]
fn profile_predicts_every_subset_s_peak_with_adamw8bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let toy_cfg = ToyConfig {
        width: 64,
        blocks: 3,
        batch_norm: true,
        ..Default::default()
    };
    let mut s = toy_session(
        &toy_cfg,
        TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW8bit, 16),
    );
    let p = quick_profile(&mut s);
    for m in 0..1u32 << toy_cfg.blocks {
        let mask: Vec<bool> = (0..toy_cfg.blocks).map(|i| m >> i & 1 == 1).collect();
        s.step(&mask, None).unwrap();
        let measured = s.step(&mask, None).unwrap().peak_bytes;
        let (predicted, moment) = peak_at(&p, &mask);
        assert_eq!(predicted, measured, "{mask:?}: predicted at {moment}");
    }
}

#[test]
fn optimizer_names_round_trip() {
    for o in OptimizerKind::ALL {
        assert_eq!(o.name().parse::<OptimizerKind>().unwrap(), o);
        assert_eq!(o.to_string(), o.name());
    }
    assert_eq!("AdamW8bit".parse::<OptimizerKind>().unwrap(), OptimizerKind::AdamW8bit);
    assert_eq!(OptimizerKind::AdamW8bit.family(), "adam");
    assert_eq!(OptimizerKind::Adam8bit.family(), "adam");
    assert!(OptimizerKind::AdamW8bit.is_8bit() && !OptimizerKind::AdamW.is_8bit());
    let e = "adamw4bit".parse::<OptimizerKind>().unwrap_err().to_string();
    assert!(e.contains("adam8bit, adamw8bit"), "{e}");
}
