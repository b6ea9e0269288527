//! The planner's linear moments (chain_model, what the solver optimizes) equal the runtime's
//! own prediction from the same profile for every checkpoint subset, in every regime; and the
//! solver's plan, run for real, peaks exactly where predicted.

use ckptune::chain_model::peak_of;
use ckptune::cli::setup::config_json;
use ckptune::formats::{profile_from_json, profile_to_json};
use ckptune::plan_cli::problem;
use ckptune::solver;
use ckptune_kernels::meter;
use ckptune_models::toy::{toy, ToyConfig};
use ckptune_runtime::profile::{profile, ProfileSettings};
use ckptune_runtime::{OptimizerKind, Precision, Session, TrainConfig};
use tch::Device;

#[test]
fn planner_moments_equal_runtime_prediction_and_plans_hold() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let toy_cfg = ToyConfig {
        width: 96,
        blocks: 5,
        batch_norm: true,
        dropout: 0.1,
        ..Default::default()
    };
    let mut configs = Vec::new();
    for (precision, accum, set_to_none) in [
        (Precision::Fp32, 1, true),
        (Precision::Bf16, 1, true),
        (Precision::Fp32, 2, true),
        (Precision::Fp32, 2, false),
    ] {
        let mut c = TrainConfig::new(precision, OptimizerKind::AdamW, 16);
        c.grad_accum = accum;
        c.set_to_none = set_to_none;
        configs.push(c);
    }
    for cfg in configs {
        tch::manual_seed(9);
        let mut s = Session::new(toy(&toy_cfg, Device::Cpu), cfg.clone(), Device::Cpu).unwrap();
        let p = profile(
            &mut s,
            &ProfileSettings {
                repeats: 1,
                quiet: true,
            },
        )
        .unwrap();
        let json = profile_to_json(config_json(&cfg), &p);
        assert_eq!(profile_from_json(&json), p, "JSON round trip");
        let prob = problem(cfg.label(), &json);
        let n = toy_cfg.blocks;
        for m in 0..1u32 << n {
            let x: Vec<bool> = (0..n).map(|i| m >> i & 1 == 1).collect();
            let (planner_peak, _) = peak_of(&prob.moments, &x).unwrap();
            assert_eq!(planner_peak, p.predict_peak(&x).0, "{} {x:?}", cfg.label());
        }
        // Every feasible budget between the extremes: the solver's choice, run for real, peaks
        // at exactly the predicted bytes, within the budget.
        for k in 0..4 {
            let budget = p.peak_all + (p.peak_none - p.peak_all) * k / 3;
            let sol = solver::solve_config(&prob, budget).unwrap();
            assert_eq!(sol.status, solver::SolveStatus::Optimal);
            s.step(&sol.x, None).unwrap();
            let measured = s.step(&sol.x, None).unwrap().peak_bytes;
            assert_eq!(measured, sol.peak, "{} budget {budget}", cfg.label());
            assert!(measured <= budget);
        }
    }
}
