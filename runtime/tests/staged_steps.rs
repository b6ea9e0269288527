//! `StagedSteps`, the timing `plan --measure auto` runs in stages: a session whose first step
//! is a step A (`FirstStep::Plain`) traces a plain step's operators and, without steps B, takes
//! its times with every candidate checkpointed from that step's forwards; one whose first step
//! is a step B traces the no-grad forwards.

mod common;

use ckptune_kernels::meter;
use ckptune_models::toy::ToyConfig;
use ckptune_runtime::profile::{FirstStep, ProfileSettings, RetimePolicy, StagedSteps};
use ckptune_runtime::{OptimizerKind, Precision, TrainConfig};

const REPEATS: usize = 3;

fn settings() -> ProfileSettings {
    ProfileSettings {
        repeats: REPEATS,
        quiet: true,
        retime: RetimePolicy::never(),
        ..Default::default()
    }
}

/// The operators a first step of `kind` traced, by name, in order.
fn first_ops(kind: FirstStep) -> Vec<String> {
    let _lock = meter::exclusive();
    let mut s = common::toy_session(
        &ToyConfig::default(),
        TrainConfig::new(Precision::Fp32, OptimizerKind::Sgd, 4),
    );
    let classes: Vec<usize> = (0..s.chain.units()).collect();
    let (steps, ops) = StagedSteps::start(&mut s, &classes, &settings(), kind).unwrap();
    assert_eq!(steps.first_kind(), kind);
    ops.iter().filter(|o| !o.scope).map(|o| o.name.clone()).collect()
}

#[test]
fn a_first_step_a_traces_no_recompute() {
    let plain = first_ops(FirstStep::Plain);
    let checkpointed = first_ops(FirstStep::Checkpointed);
    // A step B runs each candidate's forward twice (no-grad, then recomputed with grad): its
    // trace holds a plain step's operators and more.
    assert!(
        checkpointed.len() > plain.len(),
        "{} vs {} operators",
        checkpointed.len(),
        plain.len()
    );
    let count = |ops: &[String], name: &str| ops.iter().filter(|o| o.as_str() == name).count();
    let linear = "aten::addmm";
    assert!(count(&checkpointed, linear) > count(&plain, linear), "{plain:?}");
}

#[test]
fn without_steps_b_a_first_step_a_gives_the_checkpointed_times_from_its_forwards() {
    let _lock = meter::exclusive();
    let mut s = common::toy_session(
        &ToyConfig::default(),
        TrainConfig::new(Precision::Fp32, OptimizerKind::Sgd, 4),
    );
    let candidate: Vec<bool> = s.chain.blocks.iter().map(|b| b.candidate).collect();
    // Each unit its own class: its recompute estimate is its own forward, unpooled.
    let classes: Vec<usize> = (0..s.chain.units()).collect();
    let (mut steps, _) = StagedSteps::start(&mut s, &classes, &settings(), FirstStep::Plain).unwrap();
    steps.time(true, false).unwrap();
    assert!(!steps.checkpointed_timed());
    let t = steps.times();
    // The toy's steps are milliseconds: the first step is a warm-up, not one of the steps A.
    // A step whose kernel time says it still grew the heap is set aside and run again (at most
    // two of a kind, `one_step::MAX_WARMING`): a busy host can mark one of these.
    assert_eq!(t.seconds_none.n, REPEATS);
    assert!(
        (1 + REPEATS..=1 + REPEATS + 2).contains(&t.steps_run),
        "{} steps run",
        t.steps_run
    );
    assert_eq!(t.seconds_all.n, 1);
    let forwards: Vec<f64> = (0..candidate.len())
        .filter(|&i| candidate[i])
        .map(|i| {
            let spread = &t.recompute_spread[i];
            assert_eq!(spread.n, 1, "block {i}: one forward, the first step's");
            assert!(spread.median > 0.0, "block {i}");
            spread.median
        })
        .collect();
    assert!(!forwards.is_empty());
    let expected = t.seconds_none.median + forwards.iter().sum::<f64>();
    assert!(
        (t.seconds_all.median - expected).abs() <= 1e-12 * expected,
        "{} vs {expected}",
        t.seconds_all.median
    );
}
