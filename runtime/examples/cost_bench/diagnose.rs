//! `cost_bench --diagnose`: one real traced step of a case, operator by operator, measured
//! against its estimate over that trace and over the meta step's.

use std::collections::BTreeMap;

use ckptune_kernels::optrace::{self, OpEvent};
use ckptune_runtime::cost::{self, work};
use ckptune_runtime::{RuntimeError, Session};
use ckptune_solver::rates::DeviceRates;
use tch::Device;

use super::kernel_time::KernelTime;
use super::{fake, Case};

/// Measured and estimated seconds per operator name over one real traced step of `case`.
pub fn diagnose(case: &Case, rates: &DeviceRates) -> Result<(), RuntimeError> {
    tch::manual_seed(0);
    let mut s = Session::new(case.build()?, case.config(), Device::Cpu)?;
    let all = s.chain.every_candidate();
    let (events, faults) = traced_step(&mut s, &all)?;
    let est = cost::event_seconds(&events, rates);
    let calls = work::calls(&events);
    let by_name = per_operator(&events, &est, &calls);
    // Per part of the step: the scopes' measured seconds against the estimate's.
    let phases = cost::phase_seconds(&events, s.chain.blocks.len(), rates);
    let mut scoped: BTreeMap<String, f64> = BTreeMap::new();
    for e in events.iter().filter(|e| e.scope) {
        let word = e.name.split(['#', ':']).nth(2).unwrap_or(&e.name).to_owned();
        *scoped.entry(word).or_default() += e.seconds;
    }
    let total = |v: &[f64]| v.iter().sum::<f64>();
    println!(
        "scopes measured {scoped:?}; estimated forward {:.4} recompute {:.4} backward {:.4} loss {:.4} optimizer {:.4} other {:.4}",
        total(&phases.forward),
        total(&phases.recompute),
        total(&phases.backward),
        phases.loss,
        phases.optimizer,
        phases.other
    );
    if let Some(f) = faults {
        // The kernel's time mapping and zeroing fresh pages: no operator's work, and not
        // estimated (docs/cost-model.md, "What is not modelled").
        println!(
            "page faults in the step: {} minor ({:.0} MiB of 4 KiB pages), {:.2} s of system time",
            f.minor_faults,
            f.minor_faults as f64 * 4096.0 / (1u64 << 20) as f64,
            f.system_seconds
        );
    }
    if let Ok(wanted) = std::env::var("CKPTUNE_DIAGNOSE_SCOPE") {
        scope_calls(&events, &est, &calls, &wanted);
    }
    if let Ok(wanted) = std::env::var("CKPTUNE_DIAGNOSE_OP") {
        op_parts(&events, &est, &wanted);
    }
    let mut rows: Vec<_> = by_name.into_iter().collect();
    rows.sort_by(|a, b| (b.1 .0 - b.1 .1).abs().total_cmp(&(a.1 .0 - a.1 .1).abs()));
    let (m, e): (f64, f64) = rows.iter().fold((0.0, 0.0), |(m, e), r| (m + r.1 .0, e + r.1 .1));
    drop(s);
    // What a plan estimates: the same step traced on the meta device. Where its calls differ
    // from the real step's (another kernel picked, a call missing), so does its estimate.
    let fake_calls = fake_estimates(case, rates)?;
    let f: f64 = fake_calls.values().map(|c| c.1).sum();
    println!(
        "{}: measured {m:.4} s, estimated {e:.4} s over calls, {f:.4} s over the meta step's",
        case.label()
    );
    for (name, (m, e, n)) in rows.iter().take(30) {
        let (_, f, k) = fake_calls.get(name).copied().unwrap_or_default();
        println!("{name:<70} {n:>6} calls  measured {m:>9.5} s  estimated {e:>9.5} s  meta {k:>6} calls {f:>9.5} s");
    }
    for (name, (_, f, k)) in fake_calls.iter().filter(|(n, _)| !rows.iter().any(|r| &r.0 == *n)) {
        println!("{name:<70} only on meta: {k:>6} calls {f:>9.5} s");
    }
    Ok(())
}

/// Per operator name over a fake (meta) step of `case` with every candidate checkpointed, as
/// [`per_operator`] tallies a real one (its measured seconds are the meta kernels', not work).
fn fake_estimates(case: &Case, rates: &DeviceRates) -> Result<BTreeMap<String, (f64, f64, usize)>, RuntimeError> {
    let mut f = fake(case)?;
    let all = f.chain.every_candidate();
    let events = f.op_trace(&all)?;
    let est = cost::event_seconds(&events, rates);
    Ok(per_operator(&events, &est, &work::calls(&events)))
}

/// Per operator name, each call's own measured seconds (the step's calls, and autograd's nodes,
/// less the calls inside them) and its estimate, summed, and the calls: under the name of the
/// operator that did the work inside it.
fn per_operator(events: &[OpEvent], est: &[f64], calls: &[usize]) -> BTreeMap<String, (f64, f64, usize)> {
    let mut by_name: BTreeMap<String, (f64, f64, usize)> = BTreeMap::new();
    for (k, &i) in calls.iter().enumerate() {
        let (own, estimated) = call_seconds(events, est, calls, k);
        let e = by_name.entry(events[i].name.clone()).or_default();
        e.0 += own;
        e.1 += estimated;
        e.2 += 1;
    }
    by_name
}

/// Call `calls[k]`'s own measured seconds and its estimate: an operator's whole time and the
/// estimate of everything inside it; an autograd node's time less the operators it called, each
/// of which is a call of its own, and its own overhead's estimate.
fn call_seconds(events: &[OpEvent], est: &[f64], calls: &[usize], k: usize) -> (f64, f64) {
    let i = calls[k];
    if work::is_operator(&events[i]) {
        return (events[i].seconds, est[i..events[i].end.max(i + 1)].iter().sum());
    }
    let inner: f64 = calls[k + 1..]
        .iter()
        .take_while(|&&j| j < events[i].end)
        .filter(|&&j| work::is_operator(&events[j]))
        .map(|&j| events[j].seconds)
        .sum();
    (events[i].seconds - inner, est[i])
}

/// Each scope whose name contains `wanted` (`forward#14`): its measured seconds against the
/// estimate of the calls inside it, call by call as [`call_seconds`] splits them, with their
/// inputs' shapes. Tracing slows each call a little, so small calls measure high here.
fn scope_calls(events: &[OpEvent], est: &[f64], calls: &[usize], wanted: &str) {
    for (s, e) in events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.scope && e.name.contains(wanted))
    {
        let inside: Vec<usize> = (0..calls.len()).filter(|&k| calls[k] > s && calls[k] < e.end).collect();
        let total: f64 = inside.iter().map(|&k| call_seconds(events, est, calls, k).1).sum();
        println!(
            "{}: measured {:.6} s, its calls estimated {total:.6} s",
            e.name, e.seconds
        );
        for k in inside {
            let (own, estimated) = call_seconds(events, est, calls, k);
            println!(
                "    {:<48} measured {own:>9.6} estimated {estimated:>9.6}  {}",
                events[calls[k]].name,
                input_shapes(&events[calls[k]])
            );
        }
    }
}

/// The first call whose name contains `wanted` (`scaled_dot_product_attention`), every event
/// inside it with its measured seconds (its whole time, parts included) and its own estimate,
/// indented by depth: where a composite operator's time goes.
fn op_parts(events: &[OpEvent], est: &[f64], wanted: &str) {
    let Some(i) = events
        .iter()
        .position(|e| work::is_operator(e) && e.name.contains(wanted))
    else {
        println!("no call of {wanted} in the step");
        return;
    };
    let end = events[i].end.max(i + 1);
    let total: f64 = est[i..end].iter().sum();
    println!(
        "{}: measured {:.6} s, estimated {total:.6} s",
        events[i].name, events[i].seconds
    );
    for (e, estimated) in events[i + 1..end].iter().zip(&est[i + 1..end]) {
        let indent = "  ".repeat(e.depth.saturating_sub(events[i].depth) as usize);
        println!(
            "  {indent}{:<44} measured {:>9.6} estimated {estimated:>9.6}  {}",
            e.name,
            e.seconds,
            input_shapes(e)
        );
    }
}

/// An event's tensor inputs, each as its kind and shape (`Float[8, 128]`).
fn input_shapes(e: &OpEvent) -> String {
    let shapes: Vec<String> = e.inputs.iter().flatten().map(|(t, d)| format!("{t:?}{d:?}")).collect();
    shapes.join(" ")
}

/// One step traced after three untraced ones, with what it cost the kernel. The benchmark
/// times settled steps; after a single step the optimizer's sqrt and division of BERT-base's
/// word embeddings still faulted in 89 MiB of fresh pages (0.26 s of system time, the two
/// operators at 0.25 s against 0.07 s estimated), and after three none (0.06 s).
fn traced_step(s: &mut Session, mask: &[bool]) -> Result<(Vec<OpEvent>, Option<KernelTime>), RuntimeError> {
    for _ in 0..3 {
        s.step(mask, None)?;
    }
    optrace::start()?;
    let (stepped, kernel) = KernelTime::of(|| s.step(mask, None));
    let events = optrace::stop()?;
    stepped?;
    Ok((events, kernel))
}
