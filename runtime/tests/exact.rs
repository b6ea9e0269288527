//! The runtime against exact references, on the toy chain: gradients with and without
//! checkpointing bit for bit, kept bytes against an analytic count, and the peak the profile
//! predicts against the measured peak of every checkpoint subset, to the byte.
//!
//! Every test holds the meter's process-wide lock: the counters see every allocation.

mod common;

use ckptune_kernels::{meter, rng};
use ckptune_models::toy::ToyConfig;
use ckptune_runtime::profile::measured_moments;
use ckptune_runtime::{OptimizerImpl, OptimizerKind, Precision, StepTrace, TrainConfig};
use ckptune_solver::model::{moments_at, peak_at};
use common::{assert_bitwise, quick_profile, subsets, toy_session};

#[test]
fn gradients_and_state_are_bitwise_equal_under_every_subset() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let toy_cfg = ToyConfig {
        width: 32,
        blocks: 4,
        batch_norm: true,
        dropout: 0.25,
        ..Default::default()
    };
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Bf16Pure] {
        let cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 8);
        let mut reference = toy_session(&toy_cfg, cfg.clone());
        tch::manual_seed(1);
        let rng0 = rng::cpu_state().unwrap();
        let batch = reference.make_batch();
        reference.micro_step(&batch, &[false; 4], None).unwrap();
        let grads = reference.named_grads();
        let state = reference.named_parameters();
        let rng_after = rng::cpu_state().unwrap();
        for mask in subsets(4).into_iter().skip(1) {
            let mut s = toy_session(&toy_cfg, cfg.clone());
            rng::set_cpu_state(&rng0).unwrap();
            let batch = s.make_batch();
            s.micro_step(&batch, &mask, None).unwrap();
            let what = format!("{precision} {mask:?}");
            assert_bitwise(&format!("{what} gradients"), &grads, &s.named_grads());
            // Parameters and BatchNorm statistics: the recompute must not update them twice.
            assert_bitwise(&format!("{what} state"), &state, &s.named_parameters());
            assert!(
                rng::cpu_state().unwrap().equal(&rng_after),
                "{what}: RNG stream continues as in a plain step"
            );
        }
    }
}

#[test]
fn whole_steps_with_and_without_checkpointing_train_identically() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let toy_cfg = ToyConfig {
        width: 32,
        blocks: 3,
        batch_norm: true,
        dropout: 0.1,
        ..Default::default()
    };
    let mut cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::Adam, 4);
    cfg.grad_accum = 2;
    let mut a = toy_session(&toy_cfg, cfg.clone());
    let mut b = toy_session(&toy_cfg, cfg);
    tch::manual_seed(3);
    let la: Vec<f64> = (0..3).map(|_| a.step(&[false; 3], None).unwrap().loss).collect();
    tch::manual_seed(3);
    let lb: Vec<f64> = (0..3)
        .map(|_| b.step(&[true, false, true], None).unwrap().loss)
        .collect();
    assert_eq!(la, lb);
    assert_bitwise("parameters after 3 steps", &a.named_parameters(), &b.named_parameters());
}

#[test]
fn kept_bytes_match_an_analytic_count() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let (width, batch) = (48i64, 16i64);
    let toy_cfg = ToyConfig {
        width,
        blocks: 3,
        ..Default::default()
    };
    let mut s = toy_session(&toy_cfg, TrainConfig::new(Precision::Fp32, OptimizerKind::Sgd, batch));
    let p = quick_profile(&mut s);
    let act = batch * width * 4;
    let rng_state = ckptune_runtime::exec::nbytes(&rng::cpu_state().unwrap());
    let r = &p.regimes[0];
    for b in &r.blocks {
        assert_eq!(b.kept_grad, act, "{}: the ReLU output", b.name);
        assert_eq!(b.fwd_transient_grad, 2 * act, "{}: addmm result + ReLU output", b.name);
        assert_eq!(b.kept_nograd, act + rng_state, "{}: output + RNG state", b.name);
        assert_eq!(
            b.kept_recompute,
            act + rng_state,
            "{}: recompute keeps what a plain forward keeps, and the forward's RNG state until \
             the block's backward (as torch.utils.checkpoint does)",
            b.name
        );
        assert_eq!(
            b.grad_in_bytes,
            if b.name == "layers.0" { 0 } else { act },
            "{}",
            b.name
        );
    }
    let (params, _) = s.param_and_buffer_bytes();
    assert_eq!(p.fixed.parameters, params);
    assert_eq!(p.fixed.parameters, 4 * (3 * (width * width + width) + width * 10 + 10));
    assert_eq!(p.fixed.optimizer_state, 0, "plain SGD has no state");
    assert_eq!(p.fixed.batch, batch * width * 4 + batch * 8);
}

/// Profiles a config, then measures every subset for real and compares with the prediction.
fn check_exact(toy_cfg: &ToyConfig, cfg: TrainConfig) {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let label = cfg.label();
    let mut s = toy_session(toy_cfg, cfg);
    let p = quick_profile(&mut s);
    assert_eq!(
        peak_at(&p, &vec![false; toy_cfg.blocks]).0,
        p.peak_none,
        "{label}: nothing checkpointed"
    );
    assert_eq!(
        peak_at(&p, &vec![true; toy_cfg.blocks]).0,
        p.peak_all,
        "{label}: everything checkpointed"
    );
    for mask in subsets(toy_cfg.blocks) {
        s.step(&mask, None).unwrap(); // warm-up of this subset
        let measured = s.step(&mask, None).unwrap().peak_bytes;
        let (predicted, moment) = peak_at(&p, &mask);
        assert_eq!(predicted, measured, "{label} {mask:?}: predicted at {moment}");
        // Not only the peak: every moment of the step, as an instrumented step sees it.
        let mut trace = StepTrace::default();
        let traced = s.step(&mask, Some(&mut trace)).unwrap().peak_bytes;
        let seen = measured_moments(&trace, &s.chain, p.regimes.len());
        assert_eq!(moments_at(&p, &mask), seen, "{label} {mask:?}: moments");
        // Every allocation of the step lies in some moment's window: none peaks in a gap.
        let highest = seen.iter().map(|(_, v)| *v).max().unwrap();
        assert_eq!(
            traced, highest,
            "{label} {mask:?}: the step peaked outside every moment"
        );
    }
}

#[test]
fn predicted_peak_is_byte_exact_fp32() {
    let toy_cfg = ToyConfig {
        width: 64,
        blocks: 4,
        batch_norm: true,
        dropout: 0.2,
        ..Default::default()
    };
    check_exact(&toy_cfg, TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 16));
}

#[test]
fn predicted_peak_is_byte_exact_bf16() {
    let toy_cfg = ToyConfig {
        width: 64,
        blocks: 4,
        batch_norm: true,
        dropout: 0.2,
        ..Default::default()
    };
    check_exact(&toy_cfg, TrainConfig::new(Precision::Bf16, OptimizerKind::AdamW, 16));
}

#[test]
fn predicted_peak_is_byte_exact_bf16_with_autocast_cache() {
    let toy_cfg = ToyConfig {
        width: 64,
        blocks: 4,
        batch_norm: true,
        dropout: 0.2,
        ..Default::default()
    };
    let mut cfg = TrainConfig::new(Precision::Bf16, OptimizerKind::AdamW, 16);
    cfg.autocast_cache = true;
    check_exact(&toy_cfg, cfg.clone());
    cfg.grad_accum = 2;
    check_exact(&toy_cfg, cfg);
}

#[test]
fn predicted_peak_is_byte_exact_with_accumulation_and_zeroed_grads() {
    let toy_cfg = ToyConfig {
        width: 64,
        blocks: 4,
        batch_norm: true,
        dropout: 0.0,
        ..Default::default()
    };
    let mut cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::SgdMomentum, 8);
    cfg.grad_accum = 3;
    check_exact(&toy_cfg, cfg.clone());
    cfg.set_to_none = false;
    check_exact(&toy_cfg, cfg);
}

#[test]
fn predicted_peak_is_byte_exact_for_every_torch_optim_implementation() {
    // Wide layers and a batch of 2: the optimizer step is the step's peak, which is where the
    // implementations differ (two temporaries of the largest parameter, one of every parameter,
    // or none).
    let toy_cfg = ToyConfig {
        width: 256,
        blocks: 3,
        batch_norm: true,
        dropout: 0.0,
        ..Default::default()
    };
    for kind in [OptimizerKind::AdamW, OptimizerKind::SgdMomentum] {
        for imp in OptimizerImpl::ALL {
            let mut cfg = TrainConfig::new(Precision::Fp32, kind, 2);
            cfg.optimizer_impl = imp;
            check_exact(&toy_cfg, cfg.clone());
            if kind == OptimizerKind::AdamW && imp != OptimizerImpl::Fused {
                let _lock = meter::exclusive();
                let p = quick_profile(&mut toy_session(&toy_cfg, cfg.clone()));
                let (_, moment) = peak_at(&p, &vec![false; toy_cfg.blocks]);
                assert_eq!(moment, "optimizer step", "{}: the case this test is for", cfg.label());
            }
        }
    }
}
