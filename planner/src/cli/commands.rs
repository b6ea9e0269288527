//! One function per subcommand.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use ckptune_runtime::profile::{profile, ProfileSettings};
use ckptune_runtime::{Session, TrainConfig};

use super::args::{Cli, Command, ProfileArgs, SweepArgs};
use super::setup::{config_json, model_json, Setup};
use super::UsageError;
use crate::budget::format_size;
use crate::formats::{self, ConfigProfileJson, ProfileJson, StatsJson, SweepConfigJson, SweepJson, SweepPointJson};
use ckptune_runtime::Precision;

pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Models { json } => models(json),
        Command::Profile(a) => profile_cmd(a),
        Command::Sweep(a) => sweep_cmd(a),
        Command::Plan(a) => crate::plan_cli::plan_cmd(a),
        Command::Verify(a) => super::run_cmds::verify_cmd(a),
        Command::Train(a) => super::run_cmds::train_cmd(a),
        Command::Plot(a) => super::plot_cmd::plot_cmd(a),
    }
}

fn models(json: bool) -> Result<ExitCode> {
    let list = ckptune_models::list();
    if json {
        let v: Vec<serde_json::Value> = list
            .iter()
            .map(|m| {
                serde_json::json!({
                    "name": m.name, "family": format!("{:?}", m.family),
                    "reference_params": m.reference_params, "candidates": m.candidates,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<20} {:<8} {:>14}  candidates", "model", "family", "parameters");
    for m in list {
        let c = &m.candidates;
        let shown = if c.len() > 6 {
            format!("{}, {}, … {} ({} blocks)", c[0], c[1], c[c.len() - 1], c.len())
        } else {
            c.join(", ")
        };
        println!(
            "{:<20} {:<8} {:>14}  {}",
            m.name,
            format!("{:?}", m.family),
            group_digits(m.reference_params),
            shown
        );
    }
    println!(
        "\nCandidates above are layers (--granularity layer, the default). --granularity nested adds each \
         layer's children,\nany of which a plan may checkpoint instead of the whole layer: residual blocks \
         (layer3.17), BERT's\nencoder.layer.N.attention / .intermediate / .output, GPT-2's h.N.attn / h.N.mlp; \
         --granularity block offers only the children."
    );
    Ok(ExitCode::SUCCESS)
}

pub fn group_digits(n: i64) -> String {
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Profiles every config of `setup`, reusing cached profiles; each finished config is cached
/// at once, so an interrupted run resumes where it stopped.
pub fn measure_profile(setup: &Setup) -> Result<ProfileJson> {
    tch::set_num_threads(setup.threads);
    ckptune_kernels::meter::install()?;
    let mut model = None;
    let mut configs = Vec::new();
    for cfg in &setup.configs {
        let key = setup.cache_key(cfg);
        let cache_file = setup
            .cache_dir
            .as_ref()
            .map(|d| d.join(format!("{:016x}.json", fnv1a(&key))));
        if let Some(f) = &cache_file {
            if let Ok(cached) = formats::read_tagged::<CachedConfig>(f, CACHE_FORMAT) {
                if cached.key == key {
                    model.get_or_insert(cached.model);
                    configs.push(cached.profile);
                    continue;
                }
            }
        }
        let chain = setup.chain()?;
        let mj = model_json(&chain);
        let mut session = Session::new(chain, cfg.clone(), setup.device)
            .map_err(|e| anyhow::Error::new(UsageError(e.to_string())))?;
        let p = profile(
            &mut session,
            &ProfileSettings {
                repeats: setup.repeats,
                quiet: setup.quiet,
            },
        )
        .with_context(|| format!("profiling {} under {}", setup.model, cfg.label()))?;
        let pj = formats::profile_to_json(config_json(cfg), &p);
        if let Some(f) = &cache_file {
            formats::write_atomic(
                f,
                &CachedConfig {
                    format: CACHE_FORMAT.into(),
                    key,
                    model: mj.clone(),
                    profile: pj.clone(),
                },
            )?;
        }
        model.get_or_insert(mj);
        configs.push(pj);
    }
    Ok(ProfileJson {
        format: formats::PROFILE_FORMAT.into(),
        ckptune_version: env!("CARGO_PKG_VERSION").into(),
        model: model.context("no config was profiled")?,
        device: setup.device_json(),
        repeats: setup.repeats,
        configs,
    })
}

const CACHE_FORMAT: &str = "ckptune.profile-cache/1";

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct CachedConfig {
    format: String,
    key: String,
    model: formats::ModelJson,
    profile: ConfigProfileJson,
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn profile_cmd(a: ProfileArgs) -> Result<ExitCode> {
    let setup = Setup::resolve(&a.model, &[Precision::Fp32])?;
    let p = measure_profile(&setup)?;
    if let Some(out) = &a.output {
        formats::write_atomic(out, &p)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print_profile(&p);
        if let Some(out) = &a.output {
            println!("wrote {}", out.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_profile(p: &ProfileJson) {
    println!(
        "{} ({} parameters), {} with {} threads",
        p.model.name,
        group_digits(p.model.params),
        p.device.device,
        p.device.threads
    );
    for c in &p.configs {
        let cfg = &c.config;
        println!(
            "\n{} / {} / micro-batch {} × {} / {}: peak {} with nothing checkpointed, {} with everything; \
             step {:.3} s (median of {}, {:.3}–{:.3})",
            cfg.precision,
            cfg.optimizer,
            cfg.micro_batch,
            cfg.grad_accum,
            if cfg.set_to_none { "set_to_none" } else { "zeroed grads" },
            format_size(c.peak_none as u64),
            format_size(c.peak_all as u64),
            c.seconds_none.median,
            c.seconds_none.n,
            c.seconds_none.min,
            c.seconds_none.max
        );
        println!(
            "  fixed: parameters {}, buffers {}, optimizer state {}, gradients {}, batch {}",
            format_size(c.fixed.parameters as u64),
            format_size(c.fixed.buffers as u64),
            format_size(c.fixed.optimizer_state as u64),
            format_size(c.fixed.gradients as u64),
            format_size(c.fixed.batch as u64)
        );
        println!(
            "  {:<28} {:>12} {:>12} {:>12} {:>10}",
            "block", "kept", "if ckpt", "saves", "recompute"
        );
        for (b, rec) in c.regimes[0].blocks.iter().zip(&c.recompute_seconds) {
            if !b.candidate {
                println!("  {:<28} {:>12}", b.name, format_size(b.kept_grad.max(0) as u64));
                continue;
            }
            println!(
                "  {:<28} {:>12} {:>12} {:>12} {:>8.1}ms",
                b.name,
                format_size(b.kept_grad.max(0) as u64),
                format_size(b.kept_nograd.max(0) as u64),
                format_size((b.kept_grad - b.kept_nograd).max(0) as u64),
                rec * 1e3
            );
        }
        let n = c.regimes[0].blocks.len();
        // Groups: kept when run plain (fused, one graph) and when checkpointed whole.
        for (g, grp) in c.regimes[0].groups.iter().enumerate() {
            let rec = c.recompute_seconds.get(n + g).copied().unwrap_or(0.0);
            println!(
                "  {:<28} {:>12} {:>12} {:>12} {:>8.1}ms",
                grp.name,
                format_size(grp.fused_kept.max(0) as u64),
                format_size(grp.kept.max(0) as u64),
                format_size((grp.fused_kept - grp.kept).max(0) as u64),
                rec * 1e3
            );
        }
    }
}

/// Every allowed choice of candidates (blocks and groups, never a group with one of its
/// blocks), as masks over the chain's units.
fn all_subsets(chain: &ckptune_models::Chain) -> Result<Vec<Vec<bool>>> {
    let idx: Vec<usize> = (0..chain.units()).filter(|&i| chain.unit_candidate(i)).collect();
    if idx.len() > 10 {
        return Err(UsageError(format!(
            "--all-subsets: {} candidates would be up to {} subsets; pass --checkpoint regexes instead",
            idx.len(),
            1u64 << idx.len().min(63)
        ))
        .into());
    }
    Ok((0..1u32 << idx.len())
        .map(|m| {
            let mut mask = vec![false; chain.units()];
            for (k, &i) in idx.iter().enumerate() {
                mask[i] = m >> k & 1 == 1;
            }
            mask
        })
        .filter(|mask| chain.nested_conflict(mask).is_none())
        .collect())
}

fn names_of(chain: &ckptune_models::Chain, mask: &[bool]) -> Vec<String> {
    chain.names_of(mask)
}

/// Regex selecting exactly `names` among the model's modules.
pub fn regex_for(chain: &ckptune_models::Chain, names: &[String]) -> Result<String> {
    crate::regex_emit::checkpoint_regex(names, &chain.modules).map_err(|e| anyhow::anyhow!("{e}"))
}

pub fn sweep_session(setup: &Setup, cfg: &TrainConfig) -> Result<Session> {
    let chain = setup.chain()?;
    Session::new(chain, cfg.clone(), setup.device).map_err(|e| UsageError(e.to_string()).into())
}

fn sweep_cmd(a: SweepArgs) -> Result<ExitCode> {
    let setup = Setup::resolve(&a.model, &[Precision::Fp32])?;
    if a.checkpoints.is_empty() && !a.all_subsets {
        bail!(UsageError(
            "sweep needs --checkpoint REGEX (repeatable) or --all-subsets".into()
        ));
    }
    tch::set_num_threads(setup.threads);
    ckptune_kernels::meter::install()?;
    let prof: Option<ProfileJson> = a
        .profile
        .as_deref()
        .map(|p| formats::read_tagged(p, formats::PROFILE_FORMAT))
        .transpose()?;
    let mut model = None;
    let mut configs = Vec::new();
    for cfg in &setup.configs {
        let mut s = sweep_session(&setup, cfg)?;
        let mut masks = Vec::new();
        for re in &a.checkpoints {
            masks.push(s.select(re).map_err(|e| UsageError(e.to_string()))?);
        }
        if a.all_subsets {
            for m in all_subsets(&s.chain)? {
                if !masks.contains(&m) {
                    masks.push(m);
                }
            }
        }
        let cp = prof.as_ref().and_then(|p| {
            p.configs
                .iter()
                .find(|c| c.config == config_json(cfg))
                .map(formats::profile_from_json)
        });
        let points = sweep(&mut s, &masks, setup.repeats, setup.quiet, cp.as_ref())?;
        model.get_or_insert_with(|| model_json(&s.chain));
        configs.push(SweepConfigJson {
            config: config_json(cfg),
            points,
        });
    }
    let out = SweepJson {
        format: formats::SWEEP_FORMAT.into(),
        ckptune_version: env!("CARGO_PKG_VERSION").into(),
        model: model.context("no config swept")?,
        device: setup.device_json(),
        repeats: setup.repeats,
        configs,
    };
    if let Some(o) = &a.output {
        formats::write_atomic(o, &out)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_sweep(&out);
    }
    Ok(ExitCode::SUCCESS)
}

/// Measures each mask: one warm-up step, then `repeats` timed steps; the peak is the first
/// timed step's (identical across repeats on CPU, which the sweep checks).
pub fn sweep(
    s: &mut Session,
    masks: &[Vec<bool>],
    repeats: usize,
    quiet: bool,
    prof: Option<&ckptune_runtime::profile::ConfigProfile>,
) -> Result<Vec<SweepPointJson>> {
    let pb = ckptune_runtime::profile::progress_bar(
        (masks.len() * (repeats + 1)) as u64,
        &format!("sweeping {}", s.cfg.label()),
        quiet,
    );
    let mut points = Vec::new();
    for mask in masks {
        s.step(mask, None)?;
        pb.inc(1);
        let mut secs = Vec::new();
        let mut peaks = Vec::new();
        let mut loss = 0.0;
        for _ in 0..repeats {
            let r = s.step(mask, None)?;
            pb.inc(1);
            secs.push(r.seconds);
            peaks.push(r.peak_bytes);
            loss = r.loss;
        }
        if s.device == tch::Device::Cpu && peaks.iter().any(|p| *p != peaks[0]) {
            bail!(
                "sweep of {} {:?}: the peak differed between identical steps ({peaks:?})",
                s.chain.name,
                mask
            );
        }
        let names = names_of(&s.chain, mask);
        let stats = ckptune_runtime::profile::Stats::of(&secs);
        let pred = prof.map(|p| p.predict_peak(mask));
        points.push(SweepPointJson {
            regex: regex_for(&s.chain, &names)?,
            modules: names,
            peak_bytes: peaks[0],
            step_seconds: StatsJson::from(&stats),
            step_samples: secs.clone(),
            loss,
            predicted_peak_bytes: pred.as_ref().map(|p| p.0),
            predicted_step_seconds: prof.map(|p| p.predict_seconds(mask)),
            predicted_moment: pred.map(|p| p.1),
        });
    }
    pb.finish_and_clear();
    Ok(points)
}

fn print_sweep(s: &SweepJson) {
    for c in &s.configs {
        let cfg = &c.config;
        println!(
            "{} / {} / micro-batch {} × {}:",
            cfg.precision, cfg.optimizer, cfg.micro_batch, cfg.grad_accum
        );
        println!(
            "  {:<40} {:>12} {:>12} {:>10} {:>10}",
            "checkpointed", "peak", "predicted", "step s", "predicted"
        );
        for p in &c.points {
            let what = if p.modules.is_empty() {
                "(nothing)".to_owned()
            } else {
                p.modules.join(",")
            };
            println!(
                "  {:<40} {:>12} {:>12} {:>10.3} {:>10}",
                what,
                format_size(p.peak_bytes as u64),
                p.predicted_peak_bytes
                    .map(|b| format_size(b as u64))
                    .unwrap_or_else(|| "-".into()),
                p.step_seconds.median,
                p.predicted_step_seconds
                    .map(|t| format!("{t:.3}"))
                    .unwrap_or_else(|| "-".into())
            );
        }
    }
}
