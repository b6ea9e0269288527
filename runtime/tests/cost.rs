//! The cost model over a fake (meta) step: an estimate for every block, consistent with its
//! parts, and over flat rates exactly the sum by hand over the step's trace. Nothing here is
//! timed: the rates are given, and a fake step computes nothing.

use ckptune_kernels::meter;
use ckptune_kernels::optrace::OpEvent;
use ckptune_kernels::sac::SacPolicy;
use ckptune_models::{builtin, Granularity, ModelOptions};
use ckptune_runtime::cost::{self, work};
use ckptune_runtime::exec::scope::{self, Phase};
use ckptune_runtime::profile::times_from_fake_step;
use ckptune_runtime::{OptimizerKind, Precision, RuntimeError, Session, TrainConfig};
use ckptune_solver::gpus::{gpu, GPU_OVERHEAD_SECONDS};
use ckptune_solver::rates::{BlockOverhead, Curve, DeviceRates, Dtype, Engine, HostIssue};
use tch::Device;

/// Flat rates of the size a CPU measures: 100 GFLOP/s products, 50 GFLOP/s convolutions,
/// 20 GB/s streaming into fresh memory and 40 GB/s in place, 2 µs per call.
fn flat() -> DeviceRates {
    DeviceRates {
        device: "cpu".into(),
        name: "flat".into(),
        measured: true,
        source: "test".into(),
        threads: Some(1),
        matmul: vec![Curve::flat(Dtype::Fp32, 1e11)],
        matmul_thin: Vec::new(),
        matmul_transposed: Vec::new(),
        conv: vec![Curve::flat(Dtype::Fp32, 5e10)],
        conv_shapes: Vec::new(),
        conv_backward: Vec::new(),
        conv_setup: Vec::new(),
        bandwidth: vec![Curve::flat(Dtype::Fp32, 2e10)],
        bandwidth_in_place: vec![Curve::flat(Dtype::Fp32, 4e10)],
        overhead_seconds: 2e-6,
        ops: Vec::new(),
        op_setup: Vec::new(),
        attention: None,
        block_overhead: None,
        host: None,
    }
}

fn fake(model: &str) -> Session {
    fake_with(model, false)
}

/// [`fake`], stepping the optimizer in backward where `in_backward` says.
fn fake_with(model: &str, in_backward: bool) -> Session {
    meter::install().expect("meter");
    let resnet = model.contains("resnet");
    let opts = ModelOptions {
        seq: (!resnet).then_some(16),
        image: resnet.then_some(32),
        granularity: Granularity::Layer,
        ..Default::default()
    };
    let mut cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 2);
    cfg.optimizer_in_backward = in_backward;
    tch::manual_seed(0);
    Session::new_fake(
        || builtin(model, &opts).map_err(|e| RuntimeError::Invalid(e.to_string())),
        cfg,
        Device::Cpu,
    )
    .expect("fake session")
}

/// The step by hand: each counted operator's FLOPs or bytes, whichever is slower, at the flat
/// rates (in place for a call that updates a tensor it was given), then its pass (a CPU's bias
/// copy, its casts) at the streaming rate, and 2 µs per call.
fn by_hand(events: &[ckptune_kernels::optrace::OpEvent]) -> f64 {
    let counted = work::counted(events, &mut work::traits);
    let calls = work::calls(events);
    let work: f64 = counted
        .iter()
        .map(|c| {
            let w = c.work;
            let e = &events[c.index];
            let in_place = calls.contains(&c.index) && work::updates_in_place(e, work::traits(&e.name).writes_input);
            let bytes = w.bytes / if in_place { 4e10 } else { 2e10 };
            let bound = match w.engine {
                Engine::Memory => bytes,
                Engine::Matmul => (w.flops / 1e11).max(bytes),
                Engine::Conv | Engine::ConvBackward => (w.flops / 5e10).max(bytes),
            };
            bound + w.pass_bytes / 2e10
        })
        .sum();
    work + 2e-6 * work::calls(events).len() as f64
}

#[test]
fn a_fake_step_gives_every_block_a_time_and_flat_rates_give_the_sum_by_hand() {
    // Operator traces read the process-wide meter: one test at a time.
    let _lock = meter::exclusive();
    for model in ["tiny-bert", "tiny-resnet"] {
        let mut s = fake(model);
        let units = s.chain.units();
        let (times, est) = times_from_fake_step(&mut s, &[], &flat(), &[]).expect("estimate");
        assert_eq!(est.traced_on, "meta");
        let all = times.seconds_all.median;
        let none = times.seconds_none.median;
        assert!(0.0 < none && none < all, "{model}: none {none} all {all}");
        assert_eq!(times.recompute_spread.len(), units);
        assert_eq!(est.blocks.len(), s.chain.blocks.len());
        for (b, e) in s.chain.blocks.iter().zip(&est.blocks) {
            assert!(e.forward > 0.0 && e.backward > 0.0, "{model} {}: {e:?}", b.name);
            if b.candidate {
                assert!(e.nograd_forward > 0.0, "{model} {}: {e:?}", b.name);
            }
        }
        let recompute: f64 = times.recompute_spread.iter().map(|r| r.median).sum();
        assert!((all - none - recompute).abs() <= 1e-12 * all, "{model}");
        // The same step traced again, summed by hand.
        let events = s.op_trace(&s.chain.every_candidate()).expect("trace");
        let hand = by_hand(&events);
        assert!(
            (all - hand).abs() <= 1e-9 * hand,
            "{model}: estimate {all} s, by hand {hand} s"
        );
        // The parts add up to the whole.
        let phases = cost::phase_seconds(&events, s.chain.blocks.len(), &flat());
        assert!((phases.total() - hand).abs() <= 1e-9 * hand, "{model}");
    }
}

/// The runtime's time around a block, where the rates have it, adds to each block's part of the
/// step by that part's figure and to nothing else: with every candidate checkpointed (as the
/// estimate traces), a candidate's forward gains the no-grad figure, a plain block's the grad
/// one, every recompute and backward theirs.
#[test]
fn the_runtimes_time_around_a_block_adds_to_each_blocks_parts_alone() {
    let _lock = meter::exclusive();
    for model in ["tiny-bert", "tiny-llama"] {
        let mut s = fake(model);
        let events = s.op_trace(&s.chain.every_candidate()).expect("trace");
        let n = s.chain.blocks.len();
        let o = BlockOverhead {
            forward: 1e-3,
            nograd_forward: 2e-3,
            recompute: 3e-3,
            backward: 4e-3,
        };
        let with = DeviceRates {
            block_overhead: Some(o),
            ..flat()
        };
        let (plain, more) = (
            cost::phase_seconds(&events, n, &flat()),
            cost::phase_seconds(&events, n, &with),
        );
        for (i, b) in s.chain.blocks.iter().enumerate() {
            let (forward, recompute) = if b.candidate {
                (o.nograd_forward, o.recompute)
            } else {
                (o.forward, 0.0)
            };
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12;
            assert!(close(more.forward[i] - plain.forward[i], forward), "{model} {}", b.name);
            assert!(
                close(more.recompute[i] - plain.recompute[i], recompute),
                "{model} {}",
                b.name
            );
            assert!(
                close(more.backward[i] - plain.backward[i], o.backward),
                "{model} {}",
                b.name
            );
        }
        assert_eq!(
            (more.loss, more.optimizer, more.other),
            (plain.loss, plain.optimizer, plain.other)
        );
    }
}

#[test]
fn an_optimizer_updating_its_state_in_place_streams_at_the_in_place_rate_and_fresh_outputs_do_not() {
    // Operator traces read the process-wide meter: one test at a time.
    let _lock = meter::exclusive();
    let mut s = fake("tiny-bert");
    let events = s.op_trace(&s.chain.every_candidate()).expect("trace");
    let seconds = cost::event_seconds(&events, &flat());
    let calls = work::calls(&events);
    let (mut in_place, mut fresh) = (Vec::new(), Vec::new());
    for c in work::counted(&events, &mut work::traits) {
        let e = &events[c.index];
        let called = calls.contains(&c.index);
        let overhead = if called { 2e-6 } else { 0.0 };
        let at = |rate: f64| (seconds[c.index] - overhead - c.work.bytes / rate).abs() <= 1e-15;
        match work::base(&e.name) {
            // AdamW's updates of its moments and the weights, each called by the step.
            "aten::lerp_" | "aten::addcmul_" | "aten::addcdiv_" | "aten::mul_" if called => {
                assert!(at(4e10), "{}: {} s for {} B", e.name, seconds[c.index], c.work.bytes);
                in_place.push(e.name.clone());
            }
            // Dropout's mask, written into the tensor `dropout` just allocated; a cast's copy.
            "aten::bernoulli_" | "aten::copy_" if !called => {
                assert!(at(2e10), "{}: {} s for {} B", e.name, seconds[c.index], c.work.bytes);
                fresh.push(e.name.clone());
            }
            // Fresh outputs, each called by the step or an autograd node.
            "aten::sqrt" | "aten::div" | "aten::gelu" if called => {
                assert!(at(2e10), "{}: {} s for {} B", e.name, seconds[c.index], c.work.bytes);
                fresh.push(e.name.clone());
            }
            _ => {}
        }
    }
    for op in ["aten::lerp_", "aten::addcmul_", "aten::addcdiv_", "aten::mul_"] {
        assert!(
            in_place.iter().any(|n| n.starts_with(op)),
            "{op} not seen: {in_place:?}"
        );
    }
    for op in ["aten::bernoulli_", "aten::sqrt", "aten::gelu"] {
        assert!(fresh.iter().any(|n| n.starts_with(op)), "{op} not seen: {fresh:?}");
    }
}

#[test]
fn a_gpu_of_the_table_does_the_work_faster_than_flat_cpu_rates_and_is_labelled_unmeasured() {
    // Operator traces read the process-wide meter: one test at a time.
    let _lock = meter::exclusive();
    let mut s = fake("tiny-bert");
    // The device's side alone (the host that issues the operators is the next test's).
    let h100 = DeviceRates {
        host: None,
        ..gpu("h100").expect("h100").rates()
    };
    let (gpu_times, est) = times_from_fake_step(&mut s, &[], &h100, &[]).expect("estimate");
    // The same per-call overhead on both: the GPU's work is what is faster.
    let cpu = DeviceRates {
        overhead_seconds: GPU_OVERHEAD_SECONDS,
        ..flat()
    };
    let (cpu_times, _) = times_from_fake_step(&mut s, &[], &cpu, &[]).expect("estimate");
    assert!(!est.rates.measured && est.rates.device == "cuda:h100");
    assert!(gpu_times.seconds_all.median > 0.0);
    assert!(gpu_times.seconds_all.median < cpu_times.seconds_all.median);
}

#[test]
fn a_gpu_part_takes_the_longer_of_its_device_time_and_its_hosts_issue() {
    // Operator traces read the process-wide meter: one test at a time.
    let _lock = meter::exclusive();
    for model in ["tiny-bert", "tiny-resnet"] {
        let mut s = fake(model);
        let n = s.chain.blocks.len();
        let events = s.op_trace(&s.chain.every_candidate()).expect("trace");
        let h100 = gpu("h100").expect("h100").rates();
        let device = cost::phase_seconds(
            &events,
            n,
            &DeviceRates {
                host: None,
                ..h100.clone()
            },
        );
        let ops = operators_by_part(&events, n);
        for (per, checkpoint) in [(0.0, 0.0), (1e-6, 3e-6), (5e-6, 16e-6), (1.0, 3.0)] {
            let host = HostIssue {
                op_seconds: per,
                checkpoint_op_seconds: checkpoint,
            };
            let got = cost::phase_seconds(
                &events,
                n,
                &DeviceRates {
                    host: Some(host),
                    ..h100.clone()
                },
            );
            let longer = |d: &[f64], k: &[f64]| -> Vec<f64> { d.iter().zip(k).map(|(d, k)| d.max(k * per)).collect() };
            // Every candidate is checkpointed in this step: its forward is issued under
            // checkpointing, a block that is not (tiny ResNet's stem) as any other part.
            let forward: Vec<f64> = (0..n)
                .map(|b| {
                    let per = if s.chain.blocks[b].candidate { checkpoint } else { per };
                    device.forward[b].max(ops.forward[b] * per)
                })
                .collect();
            assert_eq!(got.forward, forward, "{model}");
            assert_eq!(got.recompute, longer(&device.recompute, &ops.recompute), "{model}");
            assert_eq!(got.backward, longer(&device.backward, &ops.backward), "{model}");
            assert_eq!(got.optimizer, device.optimizer.max(ops.optimizer * per), "{model}");
            assert_eq!(got.loss, device.loss.max(ops.loss * per), "{model}");
            assert_eq!(got.other, device.other.max(ops.other * per), "{model}");
        }
        // Nothing is free to issue: every block's backward issues operators.
        assert!(ops.backward.iter().all(|&k| k > 0.0), "{model}: {:?}", ops.backward);
    }
}

/// Per part of the step, the operators of `events` (any depth) in it, by the innermost scope
/// open at each: a count by hand against the cost model's.
fn operators_by_part(events: &[OpEvent], blocks: usize) -> cost::PhaseSeconds {
    let mut out = cost::PhaseSeconds {
        forward: vec![0.0; blocks],
        recompute: vec![0.0; blocks],
        backward: vec![0.0; blocks],
        ..Default::default()
    };
    for i in (0..events.len()).filter(|&i| work::is_operator(&events[i])) {
        let scope = (0..i)
            .rev()
            .find(|&j| events[j].scope && events[j].end > i && scope::parse(&events[j].name).is_some())
            .and_then(|j| scope::parse(&events[j].name));
        match scope {
            Some((Phase::Forward, Some(b))) => out.forward[b] += 1.0,
            Some((Phase::Recompute, Some(b))) => out.recompute[b] += 1.0,
            Some((Phase::Backward, Some(b))) => out.backward[b] += 1.0,
            Some((Phase::Loss, _)) => out.loss += 1.0,
            Some((Phase::Optimizer, _)) => out.optimizer += 1.0,
            _ => out.other += 1.0,
        }
    }
    out
}

/// Per block, the seconds at [`flat`] rates of the counted operators of `events` that ran in
/// the block's recompute scope and that `policy` saves.
fn saved_in_recompute(events: &[OpEvent], blocks: usize, policy: SacPolicy) -> Vec<f64> {
    let seconds = cost::event_seconds(events, &flat());
    let mut out = vec![0.0; blocks];
    for c in work::counted(events, &mut work::traits) {
        let e = &events[c.index];
        if policy.saves(&e.name) != Some(true) {
            continue;
        }
        // The innermost block scope open at the operator.
        let scope = (0..c.index)
            .rev()
            .find(|&j| {
                events[j].scope
                    && events[j].end > c.index
                    && scope::parse(&events[j].name).is_some_and(|(_, b)| b.is_some())
            })
            .and_then(|j| scope::parse(&events[j].name));
        if let Some((Phase::Recompute, Some(b))) = scope {
            out[b] += seconds[c.index] - flat().overhead_seconds * f64::from(u8::from(is_call(events, c.index)));
        }
    }
    out
}

/// Whether event `i` pays a call's overhead ([`work::calls`]).
fn is_call(events: &[OpEvent], i: usize) -> bool {
    work::calls(events).contains(&i)
}

#[test]
fn a_selective_recompute_is_the_full_recompute_less_the_work_of_what_its_policy_saves() {
    // Operator traces read the process-wide meter: one test at a time.
    let _lock = meter::exclusive();
    // With the runtime's time around a block too, which differs between a recompute and a
    // no-grad forward: a block whose policy saves nothing still costs its full checkpoint.
    let around = DeviceRates {
        block_overhead: Some(BlockOverhead {
            forward: 1e-3,
            nograd_forward: 2e-3,
            recompute: 3e-3,
            backward: 4e-3,
        }),
        ..flat()
    };
    for (model, rates) in ["tiny-bert", "tiny-llama"]
        .into_iter()
        .flat_map(|m| [(m, flat()), (m, around.clone())])
    {
        let mut s = fake(model);
        let n = s.chain.blocks.len();
        let policy = SacPolicy::Matmul;
        let (times, est) = times_from_fake_step(&mut s, &[], &rates, &[policy]).expect("estimate");
        // The reference: step B (every candidate checkpointed in full), the full checkpoint's
        // recompute estimate (its no-grad forward) less the work of the operators the policy
        // saves in its recompute. Step S's replayed calls still pay a call's overhead, as B's
        // calls of them do.
        let events = s.op_trace(&s.chain.every_candidate()).expect("trace");
        let full = cost::phase_seconds(&events, n, &rates).forward;
        let saved = saved_in_recompute(&events, n, policy);
        let selective = times.selective_seconds.first().expect("selective seconds");
        // Layers' products are saved; a block without any (embeddings) recomputes everything.
        assert!(saved.iter().filter(|&&s| s > 0.0).count() >= 2, "{model}: {saved:?}");
        for (i, b) in s.chain.blocks.iter().enumerate() {
            let e = &est.blocks[i];
            if !b.candidate {
                assert!(e.selective_recompute.is_empty(), "{model} {}", b.name);
                continue;
            }
            assert_eq!(e.nograd_forward, full[i], "{model} {}", b.name);
            let reference = full[i] - saved[i];
            let got = *e
                .selective_recompute
                .first()
                .expect("a candidate's selective recompute");
            assert!(
                (got - reference).abs() <= 1e-9 * full[i],
                "{model} {}: selective {got} s, full {} s less saved {} s",
                b.name,
                full[i],
                saved[i]
            );
            assert_eq!(selective[i], got, "{model} {}", b.name);
        }
    }
}

/// Each counted operator's name and work, in a canonical order: what a step does, wherever it
/// runs it.
fn work_done(events: &[OpEvent]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = work::counted(events, &mut work::traits)
        .iter()
        .map(|c| (events[c.index].name.clone(), format!("{:?}", c.work)))
        .collect();
    out.sort();
    out
}

#[test]
fn the_optimizer_step_in_backward_does_the_work_of_the_step_after_it() {
    // Operator traces read the process-wide meter: one test at a time.
    let _lock = meter::exclusive();
    for model in ["tiny-bert", "tiny-llama"] {
        let (mut after, mut in_bwd) = (fake_with(model, false), fake_with(model, true));
        let all = after.chain.every_candidate();
        let (a, b) = (
            after.op_trace(&all).expect("trace"),
            in_bwd.op_trace(&all).expect("trace"),
        );
        // The same operators with the same FLOPs and bytes, each parameter's AdamW step in its
        // gradient's hook instead of one loop after backward: counted once either way.
        assert_eq!(work_done(&a), work_done(&b), "{model}");
        assert_eq!(work::calls(&a).len(), work::calls(&b).len(), "{model}");
        let (ta, _) = times_from_fake_step(&mut after, &[], &flat(), &[]).expect("estimate");
        let (tb, _) = times_from_fake_step(&mut in_bwd, &[], &flat(), &[]).expect("estimate");
        let (sa, sb) = (ta.seconds_all.median, tb.seconds_all.median);
        assert!(
            (sa - sb).abs() <= 1e-12 * sa,
            "{model}: after {sa} s, in backward {sb} s"
        );
    }
}

#[test]
fn a_calibration_is_busy_when_others_kept_more_than_a_quarter_core() {
    use ckptune_runtime::load::QUIET_CORES;
    // Unknown load (no /proc) and background daemons are quiet; one busy process is not, even
    // where the calibration's threads left its CPU free.
    assert!(!cost::calibration_was_busy(None));
    assert!(!cost::calibration_was_busy(Some(0.0)));
    assert!(!cost::calibration_was_busy(Some(QUIET_CORES)));
    assert!(cost::calibration_was_busy(Some(QUIET_CORES + 0.01)));
    assert!(cost::calibration_was_busy(Some(1.0)));
    // A busy calibration's rates say so, and a plan notes it.
    assert_eq!(cost::busy_calibration_note(&flat()), None);
    let busy = DeviceRates {
        source: format!("calibration run; {} (1.2 cores)", cost::BUSY_CALIBRATION),
        ..flat()
    };
    assert!(cost::busy_calibration_note(&busy).is_some_and(|n| n.contains("calibrated again")));
}

#[test]
fn the_calls_counted_as_replayed_are_those_the_cache_answers() {
    // Operator traces read the process-wide meter: one test at a time.
    let _lock = meter::exclusive();
    let mut s = fake("tiny-llama");
    let policy = SacPolicy::Matmul;
    let all = s.chain.every_candidate();
    let selective: Vec<_> = all.iter().map(|&c| c.then_some(policy)).collect();
    s.selective = selective.clone();
    let events = s.op_trace(&all).expect("trace");
    let replayed = cost::replayed(&events, &selective);
    // The cache answers a call without running it: nothing allocated. Each output the forward
    // saved (an allocation there) is taken once.
    let mut saved_in_forward = 0;
    for (i, e) in events.iter().enumerate() {
        let block_scope = (0..i)
            .rev()
            .find(|&j| {
                events[j].scope && events[j].end > i && scope::parse(&events[j].name).is_some_and(|(_, b)| b.is_some())
            })
            .and_then(|j| scope::parse(&events[j].name));
        if replayed[i] {
            assert!(matches!(block_scope, Some((Phase::Recompute, _))), "{}", e.name);
            assert_eq!((e.enter, e.peak), (e.exit, e.exit), "{} allocated in a replay", e.name);
        } else if matches!(block_scope, Some((Phase::Forward, _))) && policy.saves(&e.name) == Some(true) {
            assert!(e.peak > e.enter, "{} in a forward allocated nothing", e.name);
            saved_in_forward += 1;
        }
    }
    let count = replayed.iter().filter(|&&r| r).count();
    assert!(count > 0);
    assert_eq!(count, saved_in_forward);
}
