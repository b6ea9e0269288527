//! The cost model against measured times on this CPU (issue #31 item 3): for each model, the
//! estimate from a fake step's trace over this CPU's calibrated rates, and real steps of the
//! same config timed in interleaved rounds (every model once per round, so a busy spell of the
//! shared machine hits them all alike). Per block its no-grad forward (the recompute estimate,
//! pooled by work class as the profiler pools it), per step the times with nothing and with
//! everything checkpointed, as medians over the rounds; and whether the candidates rank in the
//! same order by bytes saved per second of recompute. Writes `results/cost/<cpu>/results.json`
//! and its `README.md` table:
//!
//!     cargo run --release -p ckptune-runtime --example cost_bench -- [--rounds 5] [--threads 2]
//!         [--models tiny-resnet,resnet18] [--out results/cost] [--rates FILE]
//!     cargo run --release -p ckptune-runtime --example cost_bench -- --diagnose MODEL
//!         [--precision bf16] [--seq N] [--batch N]
//!
//! `--diagnose MODEL` prints, for one real traced step of MODEL (any built-in model; batch 8,
//! sequence 128 or the benchmark's image size, fp32, unless the flags say), measured and
//! estimated seconds per operator name, largest gap first (what to improve in the model), with
//! the estimate over the meta step's trace beside them, and writes nothing;
//! with `CKPTUNE_DIAGNOSE_SCOPE=pooler` in the environment, also each scope whose name holds
//! that text (a block's forward, recompute and backward) call by call, and with
//! `CKPTUNE_DIAGNOSE_OP=scaled_dot_product_attention` the first call of that operator with every
//! event inside it (where a composite operator's time goes).
//! `--rates FILE` estimates every round over a cached calibration instead of calibrating.

use std::path::PathBuf;

use ckptune_kernels::meter;
use ckptune_models::{builtin, Granularity, ModelOptions};
use ckptune_runtime::cost;
use ckptune_runtime::profile::times_from_fake_step;
use ckptune_runtime::profile::{profile, ProfileSettings, RetimePolicy};
use ckptune_runtime::{OptimizerKind, Precision, RuntimeError, Session, StepTrace, TrainConfig};
use ckptune_solver::formats::{self, CachedRates};
use ckptune_solver::profile::Stats;
use ckptune_solver::rates::DeviceRates;
use serde_json::json;
use tch::Device;

// A folder of its own, so that cargo does not take it for an example.
#[path = "cost_bench/diagnose.rs"]
mod diagnose;
#[path = "cost_bench/kernel_time.rs"]
mod kernel_time;
#[path = "cost_bench/rates.rs"]
mod rates;

use kernel_time::KernelTime;

/// A model of the benchmark with its options and micro-batch.
struct Case {
    model: &'static str,
    seq: Option<i64>,
    image: Option<i64>,
    batch: i64,
    /// Each parameter's optimizer step in its gradient's hook (`--optimizer-step in-backward`).
    in_backward: bool,
    /// fp32, or bf16 autocast: a plan weighs the two against each other by their estimates
    /// (`contenders`), so both are compared with real steps.
    precision: Precision,
}

const CASES: [Case; 9] = [
    Case::images("tiny-resnet", 32),
    Case::images("resnet18", 224),
    Case::images("resnet50", 224),
    Case::tokens("bert-base-uncased", false),
    Case::tokens("gpt2", false),
    Case::tokens("tiny-llama", false),
    Case::tokens("bert-base-uncased", true),
    Case::images("resnet18", 224).bf16(),
    Case::tokens("bert-base-uncased", false).bf16(),
];

impl Case {
    /// An image model at batch 8.
    const fn images(model: &'static str, image: i64) -> Case {
        Case {
            model,
            seq: None,
            image: Some(image),
            batch: 8,
            in_backward: false,
            precision: Precision::Fp32,
        }
    }

    /// A language model at sequence 128, batch 8.
    const fn tokens(model: &'static str, in_backward: bool) -> Case {
        Case {
            model,
            seq: Some(128),
            image: None,
            batch: 8,
            in_backward,
            precision: Precision::Fp32,
        }
    }

    /// The same case under bf16 autocast.
    const fn bf16(self) -> Case {
        Case {
            precision: Precision::Bf16,
            ..self
        }
    }

    fn label(&self) -> String {
        let shape = match (self.seq, self.image) {
            (Some(s), _) => format!("{} seq {s} batch {}", self.model, self.batch),
            (_, Some(i)) => format!("{} {i}px batch {}", self.model, self.batch),
            _ => format!("{} batch {}", self.model, self.batch),
        };
        let precision = match self.precision {
            Precision::Fp32 => String::new(),
            p => format!(", {} autocast", p.name()),
        };
        let in_backward = if self.in_backward {
            ", optimizer step in backward"
        } else {
            ""
        };
        shape + &precision + in_backward
    }

    /// Whether `other` is this case under another precision.
    fn differs_only_in_precision(&self, other: &Case) -> bool {
        (self.model, self.seq, self.image, self.batch, self.in_backward)
            == (other.model, other.seq, other.image, other.batch, other.in_backward)
            && self.precision != other.precision
    }

    fn build(&self) -> Result<ckptune_models::Chain, RuntimeError> {
        let opts = ModelOptions {
            seq: self.seq,
            image: self.image,
            granularity: Granularity::Layer,
            ..Default::default()
        };
        builtin(self.model, &opts).map_err(|e| RuntimeError::Invalid(e.to_string()))
    }

    fn config(&self) -> TrainConfig {
        let mut cfg = TrainConfig::new(self.precision, OptimizerKind::AdamW, self.batch);
        cfg.optimizer_in_backward = self.in_backward;
        cfg
    }
}

/// What the cost model says of one case, round by round (each round over that round's
/// calibration), and what a fake profile says of its memory.
struct Estimated {
    candidates: Vec<usize>,
    names: Vec<String>,
    /// Per block: bytes checkpointing it saves (kept in grad mode less kept under no-grad).
    saved: Vec<i64>,
    class: Vec<usize>,
    /// Per block, per round.
    nograd_forward: Vec<Vec<f64>>,
    none: Vec<f64>,
    all: Vec<f64>,
}

/// A fake session of `case`. Fake mode is on for its thread while it lives: it must be dropped
/// before a real step runs.
fn fake(case: &Case) -> Result<Session, RuntimeError> {
    tch::manual_seed(0);
    Session::new_fake(|| case.build(), case.config(), Device::Cpu)
}

impl Estimated {
    fn new(case: &Case) -> Result<Estimated, RuntimeError> {
        let mut fake = fake(case)?;
        let memory = profile(
            &mut fake,
            &ProfileSettings {
                repeats: 1,
                quiet: true,
                retime: RetimePolicy::never(),
                ..Default::default()
            },
        )?;
        let chain = &fake.chain;
        let regime = &memory.regimes[0];
        Ok(Estimated {
            candidates: (0..chain.blocks.len()).filter(|&i| chain.blocks[i].candidate).collect(),
            names: chain.blocks.iter().map(|b| b.name.clone()).collect(),
            saved: regime.blocks.iter().map(|b| b.kept_grad - b.kept_nograd).collect(),
            class: memory.recompute_class.clone(),
            nograd_forward: vec![Vec::new(); chain.blocks.len()],
            none: Vec::new(),
            all: Vec::new(),
        })
    }

    /// One round's estimate, over that round's rates, from a fresh fake session's step.
    fn round(&mut self, case: &Case, rates: &DeviceRates) -> Result<(), RuntimeError> {
        let (times, est) = times_from_fake_step(&mut fake(case)?, &self.class, rates, &[])?;
        self.none.push(times.seconds_none.median);
        self.all.push(times.seconds_all.median);
        for (f, b) in self.nograd_forward.iter_mut().zip(&est.blocks) {
            f.push(b.nograd_forward);
        }
        Ok(())
    }
}

/// Real steps of one case: samples of step A (nothing checkpointed), step B (every candidate)
/// and each block's no-grad forward in B, each a median over the round's repeats.
struct Measured {
    session: Session,
    /// Pairs of steps A and B per round: enough for about half a second of short steps, whose
    /// single samples are noisy; one for steps of seconds.
    repeats: usize,
    none: Vec<f64>,
    all: Vec<f64>,
    /// The system CPU seconds of the steps of `none` and `all`, per round the median over its
    /// repeats: mostly page faults, which no estimate holds.
    none_system: Vec<f64>,
    all_system: Vec<f64>,
    forward: Vec<Vec<f64>>,
}

impl Measured {
    fn new(case: &Case) -> Result<Measured, RuntimeError> {
        tch::manual_seed(0);
        let mut session = Session::new(case.build()?, case.config(), Device::Cpu)?;
        let (none, all) = masks(&session);
        // Warm-up: optimizer state, lazily allocated gradients, oneDNN's primitive caches.
        session.step(&none, None)?;
        session.step(&all, None)?;
        let pair = session.step(&none, None)?.seconds + session.step(&all, None)?.seconds;
        let blocks = session.chain.blocks.len();
        Ok(Measured {
            session,
            repeats: (0.5 / pair.max(1e-6)).ceil().clamp(1.0, 50.0) as usize,
            none: Vec::new(),
            all: Vec::new(),
            none_system: Vec::new(),
            all_system: Vec::new(),
            forward: vec![Vec::new(); blocks],
        })
    }

    /// One round: pairs of step A then step B, timed. Short steps first run one pair untimed:
    /// the first step after the round's calibration finds cold caches (tiny-ResNet's took 22 ms
    /// where the next took 6-11 ms), which a step of seconds does not notice.
    fn round(&mut self) -> Result<(), RuntimeError> {
        let (none, all) = masks(&self.session);
        if self.repeats > 1 {
            self.session.step(&none, None)?;
            self.session.step(&all, None)?;
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let (mut a_system, mut b_system) = (Vec::new(), Vec::new());
        let system = |k: Option<KernelTime>| k.map_or(0.0, |k| k.system_seconds);
        let mut forward = vec![Vec::new(); self.forward.len()];
        for _ in 0..self.repeats {
            let (step, kernel) = KernelTime::of(|| self.session.step(&none, None));
            a.push(step?.seconds);
            a_system.push(system(kernel));
            let mut trace = StepTrace::default();
            let (step, kernel) = KernelTime::of(|| self.session.step(&all, Some(&mut trace)));
            b.push(step?.seconds);
            b_system.push(system(kernel));
            for (i, f) in forward.iter_mut().enumerate() {
                f.push(trace.micro.iter().map(|m| m.blocks[i].fwd_seconds).sum());
            }
        }
        self.none.push(median(&a));
        self.all.push(median(&b));
        self.none_system.push(median(&a_system));
        self.all_system.push(median(&b_system));
        for (f, samples) in self.forward.iter_mut().zip(&forward) {
            f.push(median(samples));
        }
        Ok(())
    }
}

fn masks(s: &Session) -> (Vec<bool>, Vec<bool>) {
    (vec![false; s.chain.units()], s.chain.every_candidate())
}

fn median(xs: &[f64]) -> f64 {
    Stats::of(xs).median
}

/// Bytes saved per second of recompute, per block.
fn value(saved: &[i64], seconds: &[f64], i: usize) -> f64 {
    saved[i] as f64 / seconds[i].max(1e-12)
}

/// How the candidates rank by bytes saved per second of recompute, estimated against
/// measured: over the pairs the estimate orders (blocks of one work class tie in the estimate,
/// and only noise orders them when measured), Kendall's tau and whether no pair is reversed.
fn ranking(candidates: &[usize], saved: &[i64], estimated: &[f64], measured: &[f64]) -> (f64, bool) {
    let (mut agree, mut pairs) = (0i64, 0i64);
    for (k, &a) in candidates.iter().enumerate() {
        for &b in &candidates[k + 1..] {
            let e = value(saved, estimated, a) - value(saved, estimated, b);
            if e.abs() <= 1e-9 * value(saved, estimated, a).abs() {
                continue;
            }
            let m = value(saved, measured, a) - value(saved, measured, b);
            pairs += 1;
            agree += if (e > 0.0) == (m > 0.0) { 1 } else { -1 };
        }
    }
    if pairs == 0 {
        (1.0, true)
    } else {
        (agree as f64 / pairs as f64, agree == pairs)
    }
}

/// Per round, each block's measured no-grad forward as the profiler pools it: the median of
/// its work class's samples in that round.
fn pooled(est: &Estimated, m: &Measured) -> Vec<Vec<f64>> {
    let n = est.names.len();
    (0..n)
        .map(|i| {
            (0..m.none.len())
                .map(|r| {
                    let class: Vec<f64> = (0..n)
                        .filter(|&j| est.class.get(j) == est.class.get(i))
                        .map(|j| m.forward[j][r])
                        .collect();
                    median(&class)
                })
                .collect()
        })
        .collect()
}

/// Per round, estimated over measured, less one.
fn round_errors(est: &[f64], measured: &[f64]) -> Vec<f64> {
    est.iter().zip(measured).map(|(e, m)| e / m - 1.0).collect()
}

/// The median over rounds of estimated over measured, less one.
fn error(est: &[f64], measured: &[f64]) -> f64 {
    median(&round_errors(est, measured))
}

/// The comparison of one case.
fn compare(case: &Case, est: &Estimated, m: &Measured) -> serde_json::Value {
    let measured = pooled(est, m);
    let blocks: Vec<serde_json::Value> = est
        .candidates
        .iter()
        .map(|&i| {
            json!({
                "block": est.names[i],
                "estimated_s": median(&est.nograd_forward[i]),
                "measured_s": median(&measured[i]),
                "error": error(&est.nograd_forward[i], &measured[i]),
                "error_by_round": round_errors(&est.nograd_forward[i], &measured[i]),
                "saved_bytes": est.saved[i],
            })
        })
        .collect();
    let errors: Vec<f64> = blocks
        .iter()
        .map(|b| b["error"].as_f64().unwrap_or(0.0).abs())
        .collect();
    let medians = |v: &[Vec<f64>]| -> Vec<f64> { v.iter().map(|x| median(x)).collect() };
    let (tau, same) = ranking(
        &est.candidates,
        &est.saved,
        &medians(&est.nograd_forward),
        &medians(&measured),
    );
    // Each round's error too: on a shared machine the rounds' spread says how far one round's
    // verdict can be trusted.
    // And against the step less its system time: what the kernel charged for faults, which
    // the host prices (docs/cost-model.md), apart from the operators' own work.
    let step = |e: &[f64], m: &[f64], system: &[f64]| {
        let user: Vec<f64> = m.iter().zip(system).map(|(m, s)| m - s).collect();
        json!({
            "estimated_s": median(e),
            "measured_s": median(m),
            "error": error(e, m),
            "error_by_round": round_errors(e, m),
            "system_s": median(system),
            "error_less_system": error(e, &user),
            "error_less_system_by_round": round_errors(e, &user),
        })
    };
    json!({
        "case": case.label(),
        "rounds": m.none.len(),
        "step_none": step(&est.none, &m.none, &m.none_system),
        "step_all": step(&est.all, &m.all, &m.all_system),
        "block_error_median": median(&errors),
        "block_error_max": errors.iter().copied().fold(0.0, f64::max),
        "blocks_within_15pct": errors.iter().filter(|&&e| e <= 0.15).count(),
        "candidates": est.candidates.len(),
        "same_ranking": same,
        "kendall_tau": tau,
        "blocks": blocks,
    })
}

/// Per pair of cases that differ only in precision (fp32 first): the step with nothing
/// checkpointed, bf16 over fp32, estimated against measured, round by round. A plan leaves a
/// config untimed by its estimate (`contenders`): how differently the model errs on two configs
/// of one model says how far that can be trusted, and in this ratio the machine's speed at the
/// time cancels.
fn precision_pairs(cases: &[&Case], est: &[Estimated], m: &[Measured]) -> Vec<serde_json::Value> {
    let mut pairs = Vec::new();
    for (a, ca) in cases.iter().enumerate().filter(|(_, c)| c.precision == Precision::Fp32) {
        for (b, cb) in cases
            .iter()
            .enumerate()
            .filter(|(_, c)| ca.differs_only_in_precision(c))
        {
            let ratio = |x: &[f64], y: &[f64]| -> Vec<f64> { x.iter().zip(y).map(|(p, q)| p / q).collect() };
            let (e, r) = (ratio(&est[b].none, &est[a].none), ratio(&m[b].none, &m[a].none));
            pairs.push(json!({
                "fp32": ca.label(),
                "other": cb.label(),
                "estimated_ratio": median(&e),
                "measured_ratio": median(&r),
                "error": error(&e, &r),
                "error_by_round": round_errors(&e, &r),
            }));
        }
    }
    pairs
}

fn pct(v: &serde_json::Value) -> String {
    format!("{:+.1}%", v.as_f64().unwrap_or(f64::NAN) * 100.0)
}

/// The smallest and largest of `values`.
fn span(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
        (lo.min(v), hi.max(v))
    })
}

/// The smallest and largest of a JSON array of errors (`error_by_round`), as `-9% to +3%`.
fn round_span(v: &serde_json::Value) -> String {
    let by_round: Vec<f64> = v
        .as_array()
        .map(|v| v.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    let (lo, hi) = span(&by_round);
    format!("{:+.0}% to {:+.0}%", lo * 100.0, hi * 100.0)
}

/// The README's table of the cases; `calibrated` says what the rounds' calibrations did.
fn readme(
    a: &Args,
    cpu: &str,
    load: (f64, f64),
    calibrated: &str,
    rows: &[serde_json::Value],
    pairs: &[serde_json::Value],
) -> String {
    let (rounds, threads) = (a.rounds, a.threads);
    let command: Vec<String> = std::env::args().skip(1).collect();
    let rates = match &a.rates {
        Some(f) => format!(
            "every round estimates over the cached calibration `{}` (not calibrated afresh)",
            f.display()
        ),
        None => format!("every round calibrates the rates afresh ({calibrated})"),
    };
    let mut s = format!(
        "# Cost model against measured times\n\n\
         CPU: {cpu}, {threads} intra-op thread(s).\n\n\
         Written by `cargo run{} -p ckptune-runtime --example cost_bench -- {}`. Estimated: a fake (meta) step's operator trace over this CPU's rates; \
         measured: real steps of the same config (AdamW, layer granularity, fp32 where the case names no autocast), per round the median of pairs of steps (nothing, then everything checkpointed) repeated for about half a second after one untimed pair, or one pair where a step takes seconds. The machine has 2 cores \
         shared with other builds (1-minute load average {:.1} to {:.1} at the rounds' starts), so {rates}, \
         then estimates and times every case: {rounds} rounds, each error the median \
         over rounds of estimated / measured − 1, a step's followed by the smallest and largest round's. Per block: the no-grad forward (the recompute estimate), \
         pooled by work class as the profiler pools it. Targets: 15% per block, 10% per step \
         (docs/cost-model.md).\n\n\
         | case | step, none ckpt (est / measured) | step, all ckpt (est / measured) | blocks within 15% | median / max block error | same ranking (Kendall τ over pairs the estimate orders) |\n\
         |---|---|---|---|---|---|\n",
        // A debug build's steps pay its slower Rust between the operators.
        if cfg!(debug_assertions) { " (debug build)" } else { " --release" },
        command.join(" "),
        load.0,
        load.1
    );
    for r in rows {
        let step = |k: &str| {
            format!(
                "{:.3} / {:.3} s ({}; rounds {})",
                r[k]["estimated_s"].as_f64().unwrap_or(0.0),
                r[k]["measured_s"].as_f64().unwrap_or(0.0),
                pct(&r[k]["error"]),
                round_span(&r[k]["error_by_round"]),
            )
        };
        s += &format!(
            "| {} | {} | {} | {} of {} | {:.1}% / {:.1}% | {} ({:.2}) |\n",
            r["case"].as_str().unwrap_or(""),
            step("step_none"),
            step("step_all"),
            r["blocks_within_15pct"],
            r["candidates"],
            r["block_error_median"].as_f64().unwrap_or(0.0) * 100.0,
            r["block_error_max"].as_f64().unwrap_or(0.0) * 100.0,
            if r["same_ranking"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            },
            r["kendall_tau"].as_f64().unwrap_or(0.0),
        );
    }
    s += &system_table(rows);
    if !pairs.is_empty() {
        s += "\nPrecisions against each other, as a plan weighs its configs by their estimates: the step with \
              nothing checkpointed, bf16 over fp32, estimated against measured in the same round (how \
              differently the model errs on two configs of one model; the machine's speed cancels).\n\n\
              | cases | bf16 / fp32, est / measured | error (rounds) |\n|---|---|---|\n";
    }
    for p in pairs {
        s += &format!(
            "| {} against {} | {:.3} / {:.3} | {} ({}) |\n",
            p["other"].as_str().unwrap_or(""),
            p["fp32"].as_str().unwrap_or(""),
            p["estimated_ratio"].as_f64().unwrap_or(0.0),
            p["measured_ratio"].as_f64().unwrap_or(0.0),
            pct(&p["error"]),
            round_span(&p["error_by_round"]),
        );
    }
    s += "\nPer block figures are in `results.json`.\n";
    s
}

/// The README's table of each step's system time and the step errors with it taken out.
fn system_table(rows: &[serde_json::Value]) -> String {
    let mut s = "\nThe kernel's share: each step's system CPU time (the median over a round's steps, then \
                 over rounds), mostly minor page faults, whose price the host sets and no estimate holds \
                 (docs/cost-model.md, \"What is not modelled\"), and each step's error against the step less \
                 that time.\n\n\
                 | case | system time, none / all ckpt | error less system time, none ckpt (rounds) | all ckpt (rounds) |\n\
                 |---|---|---|---|\n"
        .to_string();
    for r in rows {
        let less = |k: &str| {
            format!(
                "{} ({})",
                pct(&r[k]["error_less_system"]),
                round_span(&r[k]["error_less_system_by_round"])
            )
        };
        s += &format!(
            "| {} | {:.3} / {:.3} s | {} | {} |\n",
            r["case"].as_str().unwrap_or(""),
            r["step_none"]["system_s"].as_f64().unwrap_or(0.0),
            r["step_all"]["system_s"].as_f64().unwrap_or(0.0),
            less("step_none"),
            less("step_all"),
        );
    }
    s
}

struct Args {
    rounds: usize,
    threads: i32,
    models: Option<Vec<String>>,
    out: PathBuf,
    diagnose: Option<String>,
    /// The precision, sequence and micro-batch of the case `--diagnose` traces.
    precision: Precision,
    seq: Option<i64>,
    batch: Option<i64>,
    /// A cached calibration (`ckptune.cpu-rates/1`) every round estimates over instead of
    /// calibrating: what a plan estimated over that cache.
    rates: Option<PathBuf>,
}

const USAGE: &str = "usage: cost_bench [--rounds N] [--threads N] [--models A,B] [--out DIR] [--rates FILE]\n       \
                     cost_bench --diagnose MODEL [--precision fp32|bf16] [--seq N] [--batch N] [--threads N]";

/// `value` of the flag `flag` as a `T`, or what is wrong with it.
fn parsed<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value.parse().map_err(|e| format!("{flag} {value:?}: {e}"))
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        rounds: 5,
        threads: 2,
        models: None,
        out: PathBuf::from("results/cost"),
        diagnose: None,
        precision: Precision::Fp32,
        seq: None,
        batch: None,
        rates: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for w in argv.chunks(2) {
        let (flag, v) = (w[0].as_str(), w.get(1).map_or("", String::as_str));
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if v.is_empty() {
            return Err(format!("{flag} needs a value"));
        }
        match flag {
            "--rounds" => a.rounds = parsed(flag, v)?,
            "--threads" => a.threads = parsed(flag, v)?,
            "--models" => a.models = Some(v.split(',').map(str::to_owned).collect()),
            "--out" => a.out = PathBuf::from(v),
            "--diagnose" => a.diagnose = Some(v.to_owned()),
            "--seq" => a.seq = Some(parsed(flag, v)?),
            "--batch" => a.batch = Some(parsed(flag, v)?),
            "--precision" => a.precision = parsed(flag, v)?,
            "--rates" => a.rates = Some(PathBuf::from(v)),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

fn slug(s: &str) -> String {
    let name = s.split(" [").next().unwrap_or(s).to_lowercase();
    let words: Vec<String> = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty() && *w != "r" && *w != "tm")
        .map(str::to_owned)
        .collect();
    words.join("-")
}

/// The case `--diagnose MODEL` traces: any built-in model, an image model at its benchmark
/// case's size, a language model at sequence 128; batch 8 and fp32 unless the arguments say.
fn diagnosed(a: &Args, model: &str) -> Case {
    let image = CASES.iter().find(|c| c.model == model).and_then(|c| c.image);
    // One case per process: leaking its name is what a `&'static str` costs here.
    let name: &'static str = Box::leak(model.to_owned().into_boxed_str());
    let mut case = match image {
        Some(side) => Case::images(name, side),
        None => Case::tokens(name, false),
    };
    case.precision = a.precision;
    case.seq = a.seq.or(case.seq);
    case.batch = a.batch.unwrap_or(case.batch);
    case
}

fn main() -> Result<(), RuntimeError> {
    let a = args().unwrap_or_else(|e| {
        eprintln!("cost_bench: {e}\n{USAGE}");
        std::process::exit(2)
    });
    tch::set_num_threads(a.threads);
    meter::install()?;
    if let Some(model) = &a.diagnose {
        return diagnose::diagnose(&diagnosed(&a, model), &cost::cpu_rates(a.threads)?);
    }
    let cases: Vec<&Case> = CASES
        .iter()
        .filter(|c| a.models.as_ref().is_none_or(|m| m.iter().any(|n| n == c.model)))
        .collect();
    let mut estimated = Vec::new();
    let mut measured = Vec::new();
    for c in &cases {
        eprintln!("tracing and warming up {}", c.label());
        estimated.push(Estimated::new(c)?);
        measured.push(Measured::new(c)?);
    }
    // Each round calibrates, then estimates and measures every case: the rates and the steps
    // they are compared with see the same machine.
    let identity = cost::cpu_identity();
    let mut rates = Vec::new();
    let mut loads = Vec::new();
    let mut calibration_seconds = Vec::new();
    for r in 0..a.rounds {
        eprintln!("round {} of {}", r + 1, a.rounds);
        loads.push(load_average());
        let round_rates = match &a.rates {
            Some(f) => {
                formats::read_tagged::<CachedRates>(f, formats::RATES_FORMAT)
                    .map_err(|e| RuntimeError::Invalid(format!("reading {}: {e}", f.display())))?
                    .rates
            }
            None => {
                let t = std::time::Instant::now();
                let rates = cost::calibrate(a.threads, &identity)?;
                calibration_seconds.push(t.elapsed().as_secs_f64());
                rates
            }
        };
        for ((c, e), m) in cases.iter().zip(estimated.iter_mut()).zip(measured.iter_mut()) {
            e.round(c, &round_rates)?;
            m.round()?;
        }
        rates.push(round_rates);
    }
    let rows: Vec<serde_json::Value> = cases
        .iter()
        .zip(&estimated)
        .zip(&measured)
        .map(|((c, e), m)| compare(c, e, m))
        .collect();
    let pairs = precision_pairs(&cases, &estimated, &measured);
    let dir = a.out.join(slug(&identity));
    std::fs::create_dir_all(&dir).map_err(|e| RuntimeError::Invalid(format!("creating {}: {e}", dir.display())))?;
    let doc = json!({
        "cpu": identity,
        "threads": a.threads,
        "rounds": a.rounds,
        "load_average_by_round": loads,
        "calibration_seconds_by_round": calibration_seconds,
        "rates_by_round": rates.iter().map(rates::rates_json).collect::<Vec<_>>(),
        "cases": rows,
        "precision_pairs": pairs,
    });
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| RuntimeError::Invalid(format!("writing {}: {e}", p.display())))
    };
    write(
        "results.json",
        serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n",
    )?;
    let text = readme(
        &a,
        &identity,
        span(&loads),
        &rates::calibrated(&calibration_seconds, &rates),
        &rows,
        &pairs,
    );
    print!("{text}");
    write("README.md", text)
}

/// The 1-minute load average (0 where /proc cannot be read).
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next().and_then(|w| w.parse().ok()))
        .unwrap_or(0.0)
}
