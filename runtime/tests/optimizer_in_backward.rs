//! The optimizer step in backward (`TrainConfig::optimizer_in_backward`): each parameter
//! updated in its post-accumulate-grad hook as soon as its gradient is complete, the gradient
//! freed there. The weights after every step equal the step after backward's bit for bit
//! (adam, adamw and sgd-momentum in each `torch.optim` implementation, lion; a tied embedding
//! included), on plain and checkpointed steps; one profile of the mode predicts every moment of
//! every checkpoint subset, and the peak, to the byte; what cannot run so is refused, naming why.

mod common;

use ckptune_kernels::meter;
use ckptune_models::{builtin, Granularity, ModelOptions};
use ckptune_runtime::profile::measured_moments;
use ckptune_runtime::{OptimizerImpl, OptimizerKind, Precision, Session, StepTrace, TrainConfig};
use ckptune_solver::model::{moments_at, peak_at};
use common::{assert_bitwise, quick_profile, subsets};
use tch::Device;

fn session(model: &str, cfg: TrainConfig) -> Session {
    nested_session(model, cfg, Granularity::Layer)
}

fn nested_session(model: &str, cfg: TrainConfig, granularity: Granularity) -> Session {
    tch::manual_seed(7);
    let opts = ModelOptions {
        seq: (!model.contains("resnet")).then_some(16),
        granularity,
        ..Default::default()
    };
    Session::new(builtin(model, &opts).unwrap(), cfg, Device::Cpu).unwrap()
}

/// The parameters after three steps with every candidate checkpointed on the second.
fn weights_after_steps(model: &str, cfg: TrainConfig) -> Vec<(String, tch::Tensor)> {
    let mut s = session(model, cfg);
    let n = s.chain.units();
    let all: Vec<bool> = (0..n).map(|i| s.chain.unit_candidate(i)).collect();
    for mask in [vec![false; n], all, vec![false; n]] {
        s.step(&mask, None).unwrap();
        assert_eq!(s.grad_bytes(), 0, "{model}: a gradient outlived the step");
    }
    s.named_parameters()
}

#[test]
fn weights_equal_the_step_after_backward_bit_for_bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let optimizers = [
        (OptimizerKind::AdamW, OptimizerImpl::Single),
        (OptimizerKind::AdamW, OptimizerImpl::Foreach),
        (OptimizerKind::AdamW, OptimizerImpl::Fused),
        (OptimizerKind::Adam, OptimizerImpl::Single),
        (OptimizerKind::SgdMomentum, OptimizerImpl::Single),
        (OptimizerKind::SgdMomentum, OptimizerImpl::Foreach),
        (OptimizerKind::SgdMomentum, OptimizerImpl::Fused),
        (OptimizerKind::Lion, OptimizerImpl::Single),
    ];
    // tiny-gpt2 ties lm_head to wte: the loss head adds to it first, the embedding completes it.
    for model in ["tiny-gpt2", "tiny-bert", "tiny-resnet"] {
        for (kind, imp) in optimizers {
            let mut cfg = TrainConfig::new(Precision::Fp32, kind, 2);
            cfg.optimizer_impl = imp;
            let after = weights_after_steps(model, cfg.clone());
            cfg.optimizer_in_backward = true;
            let in_bwd = weights_after_steps(model, cfg.clone());
            assert_bitwise(&format!("{model} {}", cfg.label()), &after, &in_bwd);
        }
    }
    let mut cfg = TrainConfig::new(Precision::Bf16, OptimizerKind::AdamW, 2);
    let after = weights_after_steps("tiny-llama", cfg.clone());
    cfg.optimizer_in_backward = true;
    assert_bitwise("tiny-llama bf16", &after, &weights_after_steps("tiny-llama", cfg));
}

/// One profile of the mode predicts every moment of every subset of candidates, and the
/// step's peak, to the byte.
#[test]
fn predicted_moments_equal_measured_on_every_subset() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let layer = Granularity::Layer;
    for (model, granularity, precision, kind, imp) in [
        (
            "tiny-bert",
            layer,
            Precision::Fp32,
            OptimizerKind::AdamW,
            OptimizerImpl::Single,
        ),
        (
            "tiny-gpt2",
            layer,
            Precision::Fp32,
            OptimizerKind::AdamW,
            OptimizerImpl::Foreach,
        ),
        (
            "tiny-llama",
            layer,
            Precision::Bf16,
            OptimizerKind::AdamW,
            OptimizerImpl::Single,
        ),
        (
            "tiny-resnet",
            layer,
            Precision::Fp32,
            OptimizerKind::SgdMomentum,
            OptimizerImpl::Single,
        ),
        // A layer checkpointed whole, run as its children, or fused (its parameters stepped
        // inside its one VJP).
        (
            "tiny-bert",
            Granularity::Nested,
            Precision::Fp32,
            OptimizerKind::AdamW,
            OptimizerImpl::Single,
        ),
    ] {
        let mut cfg = TrainConfig::new(precision, kind, 2);
        cfg.optimizer_impl = imp;
        cfg.optimizer_in_backward = true;
        let mut s = nested_session(model, cfg, granularity);
        let p = quick_profile(&mut s);
        assert!(p.config.optimizer_in_backward, "{model}: the profile records the mode");
        let candidates: Vec<usize> = (0..s.chain.units()).filter(|&i| s.chain.unit_candidate(i)).collect();
        for sub in subsets(candidates.len()) {
            let mut mask = vec![false; s.chain.units()];
            for (k, &on) in sub.iter().enumerate() {
                mask[candidates[k]] = on;
            }
            if s.chain.nested_conflict(&mask).is_some() {
                continue;
            }
            let mut trace = StepTrace::default();
            let peak = s.step(&mask, Some(&mut trace)).unwrap().peak_bytes;
            let what = format!("{model} {granularity:?} {precision} in backward, mask {mask:?}");
            let seen = measured_moments(&trace, &s.chain, p.regimes.len());
            assert_eq!(moments_at(&p, &mask), seen, "{what}: moments");
            assert_eq!(peak_at(&p, &mask).0, peak, "{what}: peak");
        }
    }
}

/// Stepping in backward lowers the peak of a step whose optimizer step is its peak: no
/// moment holds every parameter gradient at once.
#[test]
fn no_moment_holds_every_gradient() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let mut cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 1);
    let after = quick_profile(&mut session("tiny-bert", cfg.clone()));
    cfg.optimizer_in_backward = true;
    let in_bwd = quick_profile(&mut session("tiny-bert", cfg));
    let grads: i64 = session("tiny-bert", TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 1))
        .param_and_buffer_bytes()
        .0;
    // The step after backward holds every gradient at its optimizer moment; in backward it
    // holds none by then.
    assert!(
        after.optimizer_peak - after.regimes[0].fixed >= grads,
        "after: {after:?}"
    );
    assert!(
        in_bwd.optimizer_peak - in_bwd.regimes[0].fixed < grads,
        "in backward: {in_bwd:?}"
    );
}

#[test]
fn what_cannot_step_in_backward_is_refused_naming_why() {
    let base = || {
        let mut c = TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 2);
        c.optimizer_in_backward = true;
        c
    };
    let mut accum = base();
    accum.grad_accum = 2;
    let mut eight = base();
    eight.optimizer = OptimizerKind::AdamW8bit;
    let mut zero = base();
    zero.set_to_none = false;
    for (cfg, why) in [
        (accum, "gradient accumulation 2"),
        (eight, "adamw8bit updates its parameters as one list"),
        (zero, "set_to_none=false"),
    ] {
        let err = cfg.validate(Device::Cpu).unwrap_err().to_string();
        assert!(
            err.contains("optimizer step in backward cannot run") && err.contains(why),
            "{err}"
        );
    }
    assert!(base().validate(Device::Cpu).is_ok());
}
