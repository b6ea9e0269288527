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

/// Nested candidates on BERT and GPT-2: the planner's moments (blocks, then groups) equal the
/// runtime's prediction for every allowed choice; plans solved in the solver's order map back
/// to a regex that selects exactly the chosen units, and run at exactly the predicted peak.
#[test]
fn nested_plans_equal_runtime_prediction_and_hold() {
    use ckptune::formats::{DeviceJson, ProfileJson, PROFILE_FORMAT};
    use ckptune::plan_cli::{plan_from_profile, ShapeJson};
    use ckptune_models::{builtin, Granularity, ModelOptions};

    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in ["tiny-bert", "tiny-gpt2", "tiny-llama"] {
        let opts = ModelOptions {
            seq: Some(16),
            granularity: Granularity::Nested,
            ..Default::default()
        };
        let cfg = TrainConfig::new(Precision::Bf16, OptimizerKind::AdamW, 4);
        tch::manual_seed(9);
        let chain = builtin(model, &opts).unwrap();
        let model_json = ckptune::cli::setup::model_json(&chain);
        let mut s = Session::new(chain, cfg.clone(), Device::Cpu).unwrap();
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
        let units = s.chain.units();
        let groups: Vec<(usize, usize)> = s.chain.groups.iter().map(|g| (g.first, g.last)).collect();
        assert_eq!(prob.candidate.len(), units + groups.len());
        let cands: Vec<usize> = (0..units).filter(|&i| s.chain.unit_candidate(i)).collect();
        let mut allowed = 0;
        for m in 0..1u32 << cands.len() {
            let mut x = vec![false; units];
            for (k, &i) in cands.iter().enumerate() {
                x[i] = m >> k & 1 == 1;
            }
            if s.chain.nested_conflict(&x).is_some() {
                continue;
            }
            allowed += 1;
            let full = ckptune::chain_model::with_fused(&x, s.chain.blocks.len(), &groups);
            assert_eq!(
                peak_of(&prob.moments, &full).unwrap().0,
                p.predict_peak(&x).0,
                "{model} {x:?}"
            );
        }
        assert!(allowed >= 50, "{model}: {allowed}");

        let profile_json = ProfileJson {
            format: PROFILE_FORMAT.into(),
            ckptune_version: "test".into(),
            model: model_json,
            device: DeviceJson {
                device: "cpu".into(),
                threads: 1,
                memory: "exact".into(),
                cpu: String::new(),
            },
            repeats: 1,
            configs: vec![json.clone()],
        };
        let shape = ShapeJson {
            model: model.into(),
            image: None,
            seq: Some(16),
            classes: None,
            granularity: "nested".into(),
            repeats: 1,
        };
        let mut used_group = false;
        for k in 0..6 {
            let budget = p.peak_all.min(p.peak_none) + (p.peak_none - p.peak_all.min(p.peak_none)) * k / 5;
            let Ok(plan) = plan_from_profile(&profile_json, budget, shape.clone()) else {
                continue;
            };
            let x = s.select(&plan.checkpoint.regex).unwrap();
            assert_eq!(s.chain.names_of(&x), plan.checkpoint.modules, "{model} budget {budget}");
            used_group |= x[s.chain.blocks.len()..].iter().any(|&g| g);
            s.step(&x, None).unwrap();
            let measured = s.step(&x, None).unwrap().peak_bytes;
            assert_eq!(measured, plan.predicted.peak_bytes, "{model} budget {budget}");
            assert!(measured <= budget);
        }
        eprintln!("{model}: a plan checkpointed a whole layer: {used_group}");
    }
}
