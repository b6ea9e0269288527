//! A step's allocation trace, recorded by the meter's allocation log, against the meter and
//! the profile: the running sum of the second step's events reaches exactly the step's peak
//! the meter measured and the memory model predicts, on the CPU and on the meta device, with
//! nothing and with every candidate checkpointed.

mod common;

use ckptune_kernels::alloc_log::{AllocEvent, Recording};
use ckptune_kernels::meter;
use ckptune_models::{builtin, Attention, ModelOptions};
use ckptune_runtime::alloc_trace::{record_steps, trace_events, STEP_MARK, WARM_UP_MARK};
use ckptune_runtime::{OptimizerKind, Precision, RuntimeError, Session, TrainConfig};
use ckptune_solver::caching_allocator::TraceEvent;
use ckptune_solver::model::peak_at;
use common::quick_profile;
use tch::Device;

fn session(model: &str, fake: bool) -> Session {
    let resnet = model.contains("resnet");
    let opts = ModelOptions {
        seq: (!resnet).then_some(16),
        image: resnet.then_some(32),
        attention: (!resnet).then_some(Attention::Eager),
        ..Default::default()
    };
    let cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 2);
    let build = || builtin(model, &opts).map_err(|e| RuntimeError::Invalid(e.to_string()));
    tch::manual_seed(0);
    if fake {
        Session::new_fake(build, cfg, Device::Cpu).unwrap()
    } else {
        Session::new(build().unwrap(), cfg, Device::Cpu).unwrap()
    }
}

#[test]
fn the_traces_running_sum_reaches_the_measured_and_predicted_peak() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    tch::set_num_threads(1);
    for model in ["tiny-resnet", "tiny-bert"] {
        for fake in [false, true] {
            for all in [false, true] {
                let label = format!("{model} fake={fake} all={all}");
                let before = meter::current();
                let rec = Recording::start().unwrap();
                let mut s = session(model, fake);
                let mask = if all {
                    s.chain.every_candidate()
                } else {
                    vec![false; s.chain.units()]
                };
                let (log, report) = record_steps(&mut s, &mask, rec).unwrap();
                let levels = log.levels();
                let at = log.mark(STEP_MARK).unwrap();
                assert!(log.mark(WARM_UP_MARK).unwrap() < at, "{label}");
                assert_eq!(
                    before + levels[at],
                    report.start_bytes,
                    "{label}: level at the step's start"
                );
                let peak = before + levels[at..].iter().max().unwrap();
                assert_eq!(peak, report.peak_bytes, "{label}: the trace's peak against the meter's");
                assert_eq!(log.freed_from_before, 0, "{label}");
                let profile = quick_profile(&mut s);
                assert_eq!(peak, peak_at(&profile, &mask).0, "{label}: against the model");
                // The simulation's events: the same allocations and frees, and the marks.
                let events = trace_events(&log, &[512]);
                assert_eq!(events.len(), log.events.len() + 1, "{label}");
                let allocs = |f: &dyn Fn(&TraceEvent) -> bool| events.iter().filter(|e| f(e)).count();
                let logged = log
                    .events
                    .iter()
                    .filter(|e| matches!(e, AllocEvent::Alloc { .. }))
                    .count();
                assert_eq!(
                    allocs(&|e| matches!(e, TraceEvent::Alloc { .. })),
                    logged + 1,
                    "{label}"
                );
            }
        }
    }
}

#[test]
fn one_recording_at_a_time() {
    let _lock = meter::exclusive();
    let first = Recording::start().unwrap();
    assert!(Recording::start().is_err());
    drop(first);
    let again = Recording::start().unwrap();
    assert!(again.finish().events.is_empty());
}

/// The sizes a recording allocated and which of its allocations each free released (by the
/// order they were made in, as ids differ between recordings), in order: what a GPU plan's
/// simulation of the caching allocator replays.
fn sequence(events: &[AllocEvent]) -> Vec<(bool, u64)> {
    let mut made = std::collections::HashMap::new();
    events
        .iter()
        .filter_map(|e| match e {
            AllocEvent::Alloc { id, bytes } => {
                made.insert(*id, made.len() as u64);
                Some((true, *bytes))
            }
            AllocEvent::Free { id } => Some((false, made.get(id).copied().unwrap_or(u64::MAX))),
            AllocEvent::Mark(_) => None,
        })
        .collect()
}

#[test]
fn a_bf16_pure_step_allocates_the_same_way_in_every_session() {
    // Casting to bf16 allocates a copy of each parameter: walked in the var store's HashMap
    // order, every session (every process) recorded another sequence, and a GPU plan's reserved
    // peak and checkpoint set changed from one run of the same command to the next.
    let _lock = meter::exclusive();
    meter::install().unwrap();
    let opts = ModelOptions {
        seq: Some(16),
        attention: Some(Attention::Eager),
        ..Default::default()
    };
    let record = || {
        let cfg = TrainConfig::new(Precision::Bf16Pure, OptimizerKind::AdamW, 2);
        let build = || builtin("tiny-llama", &opts).map_err(|e| RuntimeError::Invalid(e.to_string()));
        tch::manual_seed(0);
        let rec = Recording::start().unwrap();
        let mut s = Session::new_fake(build, cfg, Device::Cpu).unwrap();
        let mask = s.chain.every_candidate();
        let (log, _) = record_steps(&mut s, &mask, rec).unwrap();
        sequence(&log.events)
    };
    let first = record();
    assert!(first.len() > 100, "{} events", first.len());
    for _ in 0..3 {
        assert_eq!(record(), first);
    }
}
