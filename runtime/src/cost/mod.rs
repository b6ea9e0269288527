//! The cost model's runtime half (docs/cost-model.md): what each operator of a trace does
//! ([`work`]), this CPU's rates from a calibration run cached per CPU and thread count
//! ([`cpu_rates`]), and a trace's time per part of the step over any device's rates
//! ([`phase_seconds`]). The rates themselves, and the GPU table, are the solver's
//! (`ckptune_solver::rates`): plain numbers, no libtorch.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use ckptune_kernels::optrace::OpEvent;
use ckptune_kernels::sac::SacPolicy;
use ckptune_solver::formats::{self, CachedRates};
use ckptune_solver::rates::{BlockOverhead, DeviceRates, HostIssue};

use crate::error::{Result, RuntimeError};
use crate::exec::scope::{self, Phase};
use crate::load::{CpuCounters, Load, QUIET_CORES};

mod block_overhead;
mod calibrate;
mod overhead;
mod probes;
mod setup;
mod timed;
pub mod work;

pub use calibrate::{calibrate, BUDGET_SECONDS, CALIBRATION_VERSION};

/// Bumped whenever an estimate from the same rates and trace changes (what an operator's work
/// is, which phase a time falls in, how a selective recompute is derived): a profile cached
/// with estimated times names it, so one estimated by other code is estimated again, where
/// comparing its rates alone would take it (a GPU's table keys only its name). Version 2: the
/// runtime's time around a block, skinny products, a selective recompute on the full
/// checkpoint's basis. Version 3: a GPU's host issuing the operators (`DeviceRates::host`).
/// Version 4: an operator's dtype is its largest floating-point tensor's, never an index's.
pub const ESTIMATE_VERSION: u32 = 4;

/// The CPU's model name and the vector extensions libtorch's kernels dispatch on, from
/// `/proc/cpuinfo` ("unknown" where it cannot be read): what kernels, their memory and their
/// speed depend on.
pub fn cpu_identity() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
    };
    let Some(model) = field("model name") else {
        return "unknown".into();
    };
    let flags = field("flags").unwrap_or_default();
    let simd: Vec<&str> = flags
        .split_whitespace()
        .filter(|f| f.starts_with("avx") || f.starts_with("amx") || f.starts_with("fma"))
        .collect();
    format!("{model} [{}]", simd.join(" "))
}

/// Where calibrations are cached: `$XDG_CACHE_HOME/ckptune/rates`, else `~/.cache/ckptune/rates`.
fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ckptune")
        .join("rates")
}

/// This CPU's rates with `threads` intra-op threads: the cached calibration of this CPU
/// ([`cpu_identity`]) and thread count, else a calibration run ([`calibrate`], at most about
/// [`BUDGET_SECONDS`]) whose result is cached. A cached calibration the rest of the machine
/// contended ([`calibration_was_busy`]) is used while the machine is still busy and measured
/// again once it is quiet. A cache that cannot be written is not an error.
pub fn cpu_rates(threads: i32) -> Result<DeviceRates> {
    if threads < 1 {
        return Err(RuntimeError::Invalid(format!(
            "calibrating the CPU's rates: {threads} threads; at least 1 is needed"
        )));
    }
    let identity = cpu_identity();
    let key = format!("{identity} | threads {threads} | calibration {CALIBRATION_VERSION}");
    // One file per thread count; the key inside says which CPU it was measured on (a home
    // shared by several machines recalibrates when it moves between them).
    let file = cache_dir().join(format!("cpu-{threads}-threads.json"));
    let cached = formats::read_tagged::<CachedRates>(&file, formats::RATES_FORMAT)
        .ok()
        .filter(|c| c.key == key && c.rates.check().is_ok());
    if let Some(c) = &cached {
        if !calibration_was_busy(c.other_cores) || !machine_is_quiet() {
            return Ok(c.rates.clone());
        }
    }
    let before = CpuCounters::read();
    let mut rates = calibrate(threads, &identity)?;
    let other_cores = before
        .zip(CpuCounters::read())
        .map(|(b, a)| busy_cores(&b.until(&a, threads as usize)));
    rates
        .check()
        .map_err(|e| RuntimeError::Invalid(format!("calibrating the CPU's rates: {e}")))?;
    if calibration_was_busy(other_cores) {
        // A busy recalibration replaces a busy cache only where it was quieter.
        if let Some(c) = cached.filter(|c| c.other_cores <= other_cores) {
            return Ok(c.rates);
        }
        rates.source += &format!(
            "; {BUSY_CALIBRATION} ({:.1} cores), so the rates may be low (measured again when the machine is quiet)",
            other_cores.unwrap_or(0.0)
        );
    }
    let doc = CachedRates {
        format: formats::RATES_FORMAT.into(),
        key,
        rates: rates.clone(),
        other_cores,
    };
    let _ = formats::write_atomic(&file, &doc);
    Ok(rates)
}

/// What a busy calibration's `source` says ([`cpu_rates`]).
pub const BUSY_CALIBRATION: &str = "the rest of the machine kept cores busy while these rates were calibrated";

/// Where `rates` come from a calibration the rest of the machine kept busy ([`cpu_rates`]): a
/// note for the user saying so and what to expect.
pub fn busy_calibration_note(rates: &DeviceRates) -> Option<String> {
    rates.source.contains(BUSY_CALIBRATION).then(|| {
        "this CPU's rates were calibrated while the rest of the machine kept cores busy, so the \
         estimated times may be too long; they are calibrated again when the machine is quiet"
            .to_owned()
    })
}

/// Cores the rest of the machine kept busy over `load`, less the counters' rounding.
fn busy_cores(load: &Load) -> f64 {
    (load.other_cores() - load.resolution_cores()).max(0.0)
}

/// Whether a calibration ran while the rest of the machine kept more than [`QUIET_CORES`]
/// busy. Stricter than a timed step's rule, which leaves the CPUs its threads do not use to
/// others: the rates stand for a step alone on the machine, and another busy core shares the
/// memory bandwidth and, where two CPUs are one core's hyperthreads, the core. On the
/// 2-core machine of results/cost/, a 1-thread calibration cached while other builds ran gave
/// half the products' rate and a third to a half of the bandwidth of the benchmark's rounds,
/// and estimated BERT-base's step at 7.9 s where it measures 4.1 s
/// (results/cost/optimizer-in-backward/). Unknown load (no `/proc`) is not busy.
pub fn calibration_was_busy(other_cores: Option<f64>) -> bool {
    other_cores.is_some_and(|c| c > QUIET_CORES)
}

/// Whether the rest of the machine keeps no more than [`QUIET_CORES`] busy now (over a
/// 200 ms window; unknown: quiet).
fn machine_is_quiet() -> bool {
    crate::load::free_cpus(std::time::Duration::from_millis(200)).is_none_or(|(_, other)| other <= QUIET_CORES)
}

/// A step's estimated seconds by part: per block its forward (under no-grad where the block
/// was checkpointed), its recompute and its VJP, summed over micro-steps; the loss head, the
/// optimizer, and what ran outside every scope (the batch, the step's bookkeeping).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PhaseSeconds {
    pub forward: Vec<f64>,
    pub recompute: Vec<f64>,
    pub backward: Vec<f64>,
    pub loss: f64,
    pub optimizer: f64,
    pub other: f64,
}

impl PhaseSeconds {
    /// Each part the longer of these seconds (the device's) and the host's time to issue the
    /// part's operators, counted in `operators` ([`HostIssue`]; a block's forward that is
    /// recomputed later in the step runs under checkpointing).
    fn issued_by(self, operators: &PhaseSeconds, host: HostIssue) -> PhaseSeconds {
        let per = host.op_seconds;
        let longer =
            |device: &[f64], ops: &[f64]| -> Vec<f64> { device.iter().zip(ops).map(|(d, n)| d.max(n * per)).collect() };
        let forward = (self.forward.iter().zip(&operators.forward).zip(&operators.recompute))
            .map(|((d, n), recomputed)| {
                let per = if *recomputed > 0.0 {
                    host.checkpoint_op_seconds
                } else {
                    per
                };
                d.max(n * per)
            })
            .collect();
        PhaseSeconds {
            forward,
            recompute: longer(&self.recompute, &operators.recompute),
            backward: longer(&self.backward, &operators.backward),
            loss: self.loss.max(operators.loss * per),
            optimizer: self.optimizer.max(operators.optimizer * per),
            other: self.other.max(operators.other * per),
        }
    }

    /// The whole step.
    pub fn total(&self) -> f64 {
        let blocks: f64 = [&self.forward, &self.recompute, &self.backward]
            .iter()
            .flat_map(|v| v.iter())
            .sum();
        blocks + self.loss + self.optimizer + self.other
    }
}

/// Per event of a trace, the seconds the cost model gives it over `rates`: each counted
/// operator's work ([`work::counted`]), the per-call overhead on each call ([`work::calls`]),
/// and on each block's scope the runtime's own time around the block, where the rates have it.
/// A call that updates a tensor in place ([`work::updates_in_place`]: an optimizer's `lerp_`,
/// `addcmul_`) streams at the in-place rate, as it writes memory already touched; one inside
/// another operator does not, as its destination is commonly the output its caller just
/// allocated.
pub fn event_seconds(events: &[OpEvent], rates: &DeviceRates) -> Vec<f64> {
    event_seconds_except(events, rates, &[])
}

/// [`event_seconds`], the calls flagged in `replayed` ([`replayed`]) doing no work: each pays
/// its call's overhead only.
fn event_seconds_except(events: &[OpEvent], rates: &DeviceRates, replayed: &[bool]) -> Vec<f64> {
    let mut known: HashMap<String, work::Traits> = HashMap::new();
    let mut traits = |name: &str| *known.entry(name.to_owned()).or_insert_with(|| work::traits(name));
    let mut seconds = vec![0.0; events.len()];
    let calls = work::calls(events);
    let mut is_call = vec![false; events.len()];
    for &i in &calls {
        is_call[i] = true;
    }
    for c in work::counted_except(events, replayed, &mut traits) {
        let e = &events[c.index];
        seconds[c.index] += if is_call[c.index] && work::updates_in_place(e, traits(&e.name).writes_input) {
            rates.in_place_seconds(&c.work)
        } else {
            rates.op_seconds(work::base(&e.name), &c.work)
        };
    }
    for i in calls {
        seconds[i] += rates.overhead_seconds;
    }
    if let Some(o) = &rates.block_overhead {
        around_blocks(events, o, &mut seconds);
    }
    seconds
}

/// Adds the runtime's own time around each block ([`BlockOverhead`]) to the block's scope event,
/// by the part of the step the scope covers: a block's forward is its no-grad one where the
/// block is recomputed later in the trace.
fn around_blocks(events: &[OpEvent], o: &BlockOverhead, seconds: &mut [f64]) {
    let scopes: Vec<(usize, ScopeName)> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.scope)
        .filter_map(|(i, e)| Some((i, scope::parse(&e.name)?)))
        .collect();
    let recomputed: HashSet<usize> = scopes
        .iter()
        .filter_map(|&(_, s)| match s {
            (Phase::Recompute, b) => b,
            _ => None,
        })
        .collect();
    for (i, s) in scopes {
        seconds[i] += match s {
            (Phase::Forward, Some(b)) if recomputed.contains(&b) => o.nograd_forward,
            (Phase::Forward, Some(_)) => o.forward,
            (Phase::Recompute, Some(_)) => o.recompute,
            (Phase::Backward, Some(_)) => o.backward,
            _ => 0.0,
        };
    }
}

/// What a scope of the step covers: its phase and, for a block's, the block.
type ScopeName = (Phase, Option<usize>);

/// A trace of a step of a chain of `blocks` blocks, timed over `rates` and summed by the
/// scope each event ran in (`exec::scope`).
pub fn phase_seconds(events: &[OpEvent], blocks: usize, rates: &DeviceRates) -> PhaseSeconds {
    issued(events, blocks, rates, &event_seconds(events, rates))
}

/// `seconds` (per event, the device's) by phase ([`by_phase`]); where `rates` has a host that
/// issues the operators ahead of the device ([`HostIssue`]), each part the longer of the
/// device's seconds and the host's for the operators in it, nested ones included (each passes
/// the dispatcher: `linear`'s `t` and `addmm`, autocast's casts).
fn issued(events: &[OpEvent], blocks: usize, rates: &DeviceRates, seconds: &[f64]) -> PhaseSeconds {
    let device = by_phase(events, blocks, seconds);
    let Some(host) = rates.host else {
        return device;
    };
    let operators: Vec<f64> = events
        .iter()
        .map(|e| f64::from(u8::from(work::is_operator(e))))
        .collect();
    device.issued_by(&by_phase(events, blocks, &operators), host)
}

/// [`phase_seconds`] of a step whose blocks ran selective as `selective` says (per block, its
/// policy): the operators a selective block's recompute takes from its forward's cache do no
/// work ([`replayed`]), so each such block's `recompute` is the operators its policy recomputes.
pub fn selective_phase_seconds(
    events: &[OpEvent],
    selective: &[Option<SacPolicy>],
    rates: &DeviceRates,
) -> PhaseSeconds {
    let replayed = replayed(events, selective);
    issued(
        events,
        selective.len(),
        rates,
        &event_seconds_except(events, rates, &replayed),
    )
}

/// Per event of a step's trace, whether a selective block's recompute answered it from its
/// forward's cache: an operator the block's policy saves (`SacPolicy::saves`, the recompute's
/// own test), called in the block's recompute scope from no operator that reaches the
/// dispatcher's kernels itself (the policy sees only those: what runs inside one is its
/// business, and a decomposition such as `linear` reaches them through its parts).
pub fn replayed(events: &[OpEvent], selective: &[Option<SacPolicy>]) -> Vec<bool> {
    let mut saves: HashMap<(SacPolicy, &str), bool> = HashMap::new();
    let mut traits: HashMap<&str, work::Traits> = HashMap::new();
    let mut out = vec![false; events.len()];
    // Open scopes and operators at each event: (its end, the block whose selective recompute it
    // is, whether it is an operator that reaches the kernels).
    let mut open: Vec<(usize, Option<usize>, bool)> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        while open.last().is_some_and(|&(end, _, _)| end <= i) {
            open.pop();
        }
        let end = e.end.max(i + 1);
        if e.scope {
            let block = match scope::parse(&e.name) {
                Some((Phase::Recompute, Some(b))) => Some(b),
                _ => None,
            };
            open.push((end, block, false));
            continue;
        }
        let inside_kernel = open.iter().any(|&(_, _, kernel)| kernel);
        let block = open.iter().rev().find_map(|&(_, b, _)| b);
        let policy = block.and_then(|b| selective.get(b).copied().flatten());
        if let (Some(p), false, true) = (policy, inside_kernel, work::is_operator(e)) {
            // A policy whose test a name cannot answer (`attention`) is never estimated: `plan`
            // and `profile` refuse it (`SacPolicy::saves_by_name`); here it saves nothing.
            out[i] = *saves
                .entry((p, e.name.as_str()))
                .or_insert_with(|| p.saves(&e.name).unwrap_or(false));
        }
        let kernel = work::is_operator(e)
            && !traits
                .entry(e.name.as_str())
                .or_insert_with(|| work::traits(&e.name))
                .decomposition;
        open.push((end, None, kernel));
    }
    out
}

/// `seconds` (per event) summed by the scope each event ran in, for a chain of `blocks` blocks.
fn by_phase(events: &[OpEvent], blocks: usize, seconds: &[f64]) -> PhaseSeconds {
    let mut out = PhaseSeconds {
        forward: vec![0.0; blocks],
        recompute: vec![0.0; blocks],
        backward: vec![0.0; blocks],
        ..PhaseSeconds::default()
    };
    // The scopes open at each event, innermost last: (its end, what it is).
    let mut open: Vec<(usize, Option<ScopeName>)> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        while open.last().is_some_and(|&(end, _)| end <= i) {
            open.pop();
        }
        if e.scope {
            // A scope's own seconds (the runtime's time around a block) are its phase's.
            open.push((e.end.max(i + 1), scope::parse(&e.name)));
        }
        let s = seconds[i];
        match open.iter().rev().find_map(|(_, what)| *what) {
            Some((Phase::Forward, Some(b))) if b < blocks => out.forward[b] += s,
            Some((Phase::Recompute, Some(b))) if b < blocks => out.recompute[b] += s,
            Some((Phase::Backward, Some(b))) if b < blocks => out.backward[b] += s,
            Some((Phase::Loss, _)) => out.loss += s,
            Some((Phase::Optimizer, _)) => out.optimizer += s,
            _ => out.other += s,
        }
    }
    out
}
