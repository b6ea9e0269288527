//! How profiles are measured (`--measure`): for real (`run`); memory on the meta device with
//! times from real steps where the step fits in this machine's memory (`meta`, and `auto`'s
//! first choice); or memory on the meta device with times from the cost model over this CPU's
//! rates or a named GPU's (`estimate`, and `auto` where no real step can run here or the times
//! are for a GPU). Cached per config: an interrupted run resumes where it stopped.

use anyhow::{Context, Result};
use ckptune_runtime::profile::{profile, times_from_fake_step, ConfigProfile, ProfileSettings, RetimePolicy};
use ckptune_runtime::{cost, TrainConfig};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, CachedConfig, ModelJson, ProfileJson};
use ckptune_solver::rates::DeviceRates;

use super::args::Measure;
use super::error::{is_bad_input_error, message, UsageError};
use super::setup::{fnv1a, model_json, Setup};
use ckptune_models::ModelError;
use ckptune_runtime::RuntimeError;

mod contenders;
mod staged;
pub use contenders::Rank;

/// How a config's profile is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// Every step for real: memory and times.
    Run,
    /// Memory on the meta device, times from real steps A and B.
    MetaTimed,
    /// Memory on the meta device, times from the cost model over `Setup::rates_device`'s rates.
    Estimated,
}

impl How {
    /// Appended to the cache key: a profile measured one way is not another's.
    fn key(self, setup: &Setup) -> String {
        match self {
            How::Run => String::new(),
            How::MetaTimed => "|measure=meta+steps-ab".into(),
            // A profile offering selective checkpointing has its selective recomputes estimated
            // too; one cached before they were held the meta device's times for them. Keys
            // without the estimate's version were estimated by version 1.
            How::Estimated => format!(
                "|measure=meta+estimated{}:{}{}",
                cost::ESTIMATE_VERSION,
                rates_device(setup),
                if setup.selective.is_empty() { "" } else { "+selective" }
            ),
        }
    }

    fn describe(self, setup: &Setup) -> String {
        match self {
            How::Run => "memory and times from real steps".into(),
            How::MetaTimed => {
                "memory on the meta device, times from real steps with nothing and with every candidate checkpointed"
                    .into()
            }
            How::Estimated => format!(
                "memory on the meta device, times estimated by the cost model over {} (docs/cost-model.md)",
                match setup.gpu {
                    Some(g) => format!("the {}'s rates", g.name),
                    None => "this CPU's rates".into(),
                }
            ),
        }
    }
}

/// The device whose rates estimate times: `cuda:NAME` for `--target cuda:NAME`, else `cpu`.
fn rates_device(setup: &Setup) -> String {
    setup.gpu.map_or("cpu".into(), |g| format!("cuda:{}", g.key))
}

/// The rates `How::Estimated` times over: the GPU `--target` names (its table row), else this
/// CPU's at the setup's threads (calibrated once per CPU and thread count, then cached).
fn rates(setup: &Setup) -> Result<DeviceRates> {
    match setup.gpu {
        Some(g) => Ok(g.rates()),
        None => {
            let rates = cost::cpu_rates(setup.threads)?;
            if let Some(note) = cost::busy_calibration_note(&rates).filter(|_| !setup.quiet) {
                eprintln!("note: {note}");
            }
            Ok(rates)
        }
    }
}

/// Profiles every config of `setup` as `--measure` says.
pub fn measure_profile(setup: &Setup) -> Result<ProfileJson> {
    measure(setup, None)
}

/// As [`measure_profile`], for `plan`: where `--measure auto` times real steps, only the configs
/// that can win under the plan's budget are timed (`contenders`); `rank` is the plan's solve.
pub fn measure_profile_for_plan(setup: &Setup, rank: Rank<'_>) -> Result<ProfileJson> {
    measure(setup, Some(rank))
}

fn measure(setup: &Setup, rank: Option<Rank<'_>>) -> Result<ProfileJson> {
    tch::set_num_threads(setup.threads);
    ckptune_kernels::meter::install()?;
    if let (Some(g), Measure::Run | Measure::Meta) = (setup.gpu, setup.measure) {
        return Err(UsageError(format!(
            "--target cuda:{} estimates step times for that GPU with the cost model, and --measure {} \
             times real steps on this CPU; drop one of them (--measure auto or estimate, with the target)",
            g.key,
            if setup.measure == Measure::Run { "run" } else { "meta" }
        ))
        .into());
    }
    let (how, mut unlearned) = match setup.measure {
        Measure::Run => (How::Run, Vec::new()),
        _ => decide(setup)?,
    };
    unlearned.resize(setup.configs.len(), None);
    let unestimated = setup.selective.iter().find(|p| !p.saves_by_name());
    if let (How::Estimated, Some(policy)) = (how, unestimated) {
        return Err(UsageError(format!(
            "--selective {}: the cost model cannot estimate the {} policy's recompute (which calls it \
             keeps depends on each call's shapes, not its operator), and this profile's times are \
             estimated ({}); use --selective matmul, or plan a step that fits here without \
             --target cuda:NAME or --measure estimate",
            setup.selective_names(),
            policy.name(),
            how.describe(setup)
        ))
        .into());
    }
    let (model, configs) = match rank {
        Some(rank) if how == How::MetaTimed && setup.measure == Measure::Auto => {
            timed_where_they_can_win(setup, unlearned, rank)?
        }
        _ => {
            let rates = match how {
                How::Estimated => Some(rates(setup)?),
                _ => None,
            };
            each_config(setup, how, unlearned, rates.as_ref())?
        }
    };
    Ok(profile_json(setup, how, model, configs))
}

/// Every config of `setup` measured `how` (cached or measured now, from its meta profile
/// `unlearned` where `decide` measured one), and the model they share.
fn each_config(
    setup: &Setup,
    how: How,
    unlearned: Vec<Option<ConfigProfile>>,
    rates: Option<&DeviceRates>,
) -> Result<(ModelJson, Vec<ConfigProfile>)> {
    let mut model = None;
    let mut configs = Vec::with_capacity(setup.configs.len());
    for (cfg, unlearned) in setup.configs.iter().zip(unlearned) {
        let (mj, p) = cached_or_measured(setup, cfg, how, unlearned, rates)?;
        model.get_or_insert(mj);
        configs.push(p);
    }
    Ok((model.context("no config was profiled")?, configs))
}

/// `plan`'s `--measure auto`: memory from the meta device (`unlearned`, per config, where
/// `decide` measured it) and times from the cost model over this CPU's rates for every config,
/// then from real steps for those that can win (`contenders`), each only as far as the plan
/// needs (`staged`) and cached as it is measured; notes which were not timed and why, and
/// brings their estimates to the pace of the steps timed (`contenders::Timing::paces`).
fn timed_where_they_can_win(
    setup: &Setup,
    unlearned: Vec<Option<ConfigProfile>>,
    rank: Rank<'_>,
) -> Result<(ModelJson, Vec<ConfigProfile>)> {
    let (model, configs) = each_config(setup, How::Estimated, unlearned.clone(), Some(&rates(setup)?))?;
    let configs = std::cell::RefCell::new(configs);
    // The plan's ranks with config `c`'s profile replaced by `p`.
    let rank_with = |replaced: Option<(usize, &ConfigProfile)>| {
        let mut profiles = configs.borrow().clone();
        if let Some((c, p)) = replaced {
            profiles[c] = p.clone();
        }
        rank(&profile_json(setup, How::MetaTimed, model.clone(), profiles))
    };
    let timing = contenders::time_until_none_can_win(
        setup.configs.len(),
        || rank_with(None),
        |c, fastest| {
            let needs_checkpointed = |p: &ConfigProfile| {
                let rank = rank_with(Some((c, p)))?[c];
                Ok(contenders::needs_checkpointed(rank, p.seconds_none.median, fastest))
            };
            let stages = staged::Stages {
                fastest,
                needs_checkpointed: &needs_checkpointed,
                estimate_needs_checkpointed: needs_checkpointed(&configs.borrow()[c])?,
            };
            match staged::staged_profile(setup, &setup.configs[c], unlearned[c].clone(), &stages)? {
                staged::Staged::Measured(m) => {
                    if m.kinds == staged::Kinds::Plain && !setup.quiet {
                        eprintln!(
                            "note: {}: its fastest choice checkpoints nothing, so only its steps with nothing \
                             checkpointed were timed (its recompute estimates come from its first step)",
                            setup.configs[c].label()
                        );
                    }
                    configs.borrow_mut()[c] = m.profile;
                    Ok(contenders::State::Timed)
                }
                staged::Staged::RuledOut(plain) => Ok(contenders::State::RuledOut(plain)),
            }
        },
    )?;
    let labels: Vec<String> = setup.configs.iter().map(|c| c.label()).collect();
    let mut configs = configs.into_inner();
    let plain: Vec<f64> = configs.iter().map(|p| p.seconds_none.median).collect();
    for (p, pace) in configs.iter_mut().zip(timing.paces(&plain, &labels)) {
        if let Some((factor, why)) = pace {
            p.to_pace(factor, why);
        }
    }
    if !setup.quiet {
        let solved = rank(&profile_json(setup, How::MetaTimed, model.clone(), configs.clone()))?;
        let fits: Vec<bool> = solved.iter().map(Option::is_some).collect();
        for note in contenders::untimed_notes(&labels, &timing, &fits) {
            eprintln!("note: {note}");
        }
    }
    Ok((model, configs))
}

/// The profile document of `configs`, measured `how`.
fn profile_json(setup: &Setup, how: How, model: ModelJson, configs: Vec<ConfigProfile>) -> ProfileJson {
    let mut device = setup.device_json();
    device.measured = how.describe(setup);
    ProfileJson {
        format: formats::PROFILE_FORMAT.into(),
        ckptune_version: env!("CARGO_PKG_VERSION").into(),
        model,
        device,
        repeats: setup.repeats,
        configs,
    }
}

/// `auto`, `meta` and `estimate`: memory on the meta device; times from real steps where every
/// config's step fits in the memory this machine has available, else from the cost model
/// (`meta` refuses instead); from the cost model always for `estimate`, a GPU `--target` and a
/// program without weights. Said either way. Where the meta device cannot run the model, `auto`
/// measures every step for real and the others say why not. Also returns, per config, the meta
/// profile it measured (none where a cached profile said enough), which the measurement then
/// starts from.
fn decide(setup: &Setup) -> Result<(How, Vec<Option<ConfigProfile>>)> {
    let mut largest = 0;
    let mut unlearned = Vec::with_capacity(setup.configs.len());
    for cfg in &setup.configs {
        let cached = [How::MetaTimed, How::Estimated]
            .into_iter()
            .find_map(|how| read_cache(setup, &(setup.cache_key(cfg) + &how.key(setup))))
            .map(|c| c.profile)
            .or_else(|| staged::cached_plain(setup, cfg));
        if let Some(cached) = cached {
            largest = largest.max(cached.peak_all);
            unlearned.push(None);
            continue;
        }
        match meta_profile(setup, cfg) {
            Ok((_, p)) => {
                largest = largest.max(p.peak_all);
                unlearned.push(Some(p));
            }
            // What the meta device cannot run (an operator without a meta kernel, a
            // TorchScript module's storages) is run for real, as `--measure run` would; a bad
            // file fails there with its own error.
            Err(e) if setup.measure != Measure::Auto || !meta_cannot_run(&e) => return Err(e),
            Err(e) => {
                if !setup.quiet {
                    let why = message(&e);
                    eprintln!(
                        "note: {} cannot be measured on the meta device ({}); measuring every step for real",
                        setup.model,
                        why.lines().next().unwrap_or_default()
                    );
                }
                return Ok((How::Run, Vec::new()));
            }
        }
    }
    let (how, why) = choose(setup, with_process_overhead(largest))?;
    if !setup.quiet {
        eprintln!("note: measuring {}: {} ({why})", setup.model, how.describe(setup));
    }
    Ok((how, unlearned))
}

/// How `decide` times a model whose largest step needs `needed` bytes here, and why.
fn choose(setup: &Setup, needed: i64) -> Result<(How, String)> {
    let weightless = ckptune_models::load::needs_meta(&setup.model);
    if setup.measure == Measure::Estimate {
        return Ok((How::Estimated, "--measure estimate".into()));
    }
    if let Some(g) = setup.gpu {
        return Ok((How::Estimated, format!("the times are for --target cuda:{}", g.key)));
    }
    if weightless && setup.measure == Measure::Meta {
        return Err(UsageError(format!(
            "{} was exported on the meta device and has no weights, so no real step can time it \
             (--measure meta); estimate its times with the cost model (--measure auto or estimate)",
            setup.model
        ))
        .into());
    }
    if weightless {
        return Ok((
            How::Estimated,
            "the program was exported on the meta device and has no weights to run".into(),
        ));
    }
    let available = available_memory();
    let size = |b: i64| format_size(b as u64);
    match available {
        Some(free) if needed <= free => Ok((
            How::MetaTimed,
            format!(
                "its step needs {} and {} is available here; --measure run runs every step for real",
                size(needed),
                size(free)
            ),
        )),
        _ if setup.measure == Measure::Meta => Err(UsageError(format!(
            "{} needs about {} to run a step, and --measure meta times real steps: {}; estimate its \
             times with the cost model (--measure auto or estimate), or time it on a machine with that \
             much memory available",
            setup.model,
            size(needed),
            available.map_or("this machine's available memory cannot be read".into(), |a| format!(
                "{} is available here",
                size(a)
            ))
        ))
        .into()),
        Some(free) => Ok((
            How::Estimated,
            format!(
                "its step needs {}, more than the {} available here",
                size(needed),
                size(free)
            ),
        )),
        None => Ok((
            How::Estimated,
            "this machine's available memory cannot be read, so no step is run here".into(),
        )),
    }
}

/// Whether measuring on the meta device failed for want of the meta device (an operator it
/// cannot run, a libtorch failure such as a TorchScript module's storages) rather than for a
/// bad file or flag, which fails the same way for real.
fn meta_cannot_run(e: &anyhow::Error) -> bool {
    let meta_node = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<ModelError>(),
            Some(ModelError::NotMeasurableOnMeta { .. } | ModelError::TorchScriptOnMeta { .. })
        ) || matches!(
            c.downcast_ref::<RuntimeError>(),
            Some(RuntimeError::NotMeasurableOnMeta { .. })
        )
    });
    meta_node || !is_bad_input_error(e)
}

/// The cached profile of `cfg` measured `how`, else a new one (cached at once), from its meta
/// profile `unlearned` where `decide` measured it.
fn cached_or_measured(
    setup: &Setup,
    cfg: &TrainConfig,
    how: How,
    unlearned: Option<ConfigProfile>,
    rates: Option<&DeviceRates>,
) -> Result<(ModelJson, ConfigProfile)> {
    let key = setup.cache_key(cfg) + &how.key(setup);
    // Estimated times hold only over the rates they were estimated over: a CPU calibrated again
    // (quiet after busy, or a newer calibration) estimates the profile again.
    let stale = |p: &ConfigProfile| how == How::Estimated && p.estimated.as_ref().map(|e| &e.rates) != rates;
    if let Some(cached) = read_cache(setup, &key).filter(|c| !stale(&c.profile)) {
        if !cached.profile.contention.contended() {
            return Ok((cached.model, cached.profile));
        }
        if !setup.quiet {
            eprintln!(
                "note: the cached profile of {} under {} was timed on a busy machine ({} of {} \
                 samples contended); profiling it again",
                setup.model,
                cfg.label(),
                cached.profile.contention.contended,
                cached.profile.contention.samples
            );
        }
    }
    let (mj, p) = match (how, rates) {
        (How::Run, _) => {
            // Judged on the meta device first where it can be (a step it cannot run is run
            // as asked).
            if let Ok((_, meta)) = meta_profile(setup, cfg) {
                check_fits_here(
                    meta.peak_none,
                    &format!("running {} under {} for real", setup.model, cfg.label()),
                    "measure it on the meta device with --measure auto",
                )?;
            }
            real_profile(setup, cfg)?
        }
        (How::MetaTimed, _) => staged::full_profile(setup, cfg, unlearned)?,
        (How::Estimated, Some(rates)) => estimated_profile(setup, cfg, unlearned, rates)?,
        (How::Estimated, None) => anyhow::bail!("estimating {}: no rates to estimate over", cfg.label()),
    };
    write_cache(setup, &key, &mj, &p)?;
    Ok((mj, p))
}

/// Caches `profile` under `key`, where the setup caches.
fn write_cache(setup: &Setup, key: &str, model: &ModelJson, profile: &ConfigProfile) -> Result<()> {
    if let Some(f) = cache_file(setup, key) {
        formats::write_atomic(
            &f,
            &CachedConfig {
                format: formats::CACHE_FORMAT.into(),
                key: key.into(),
                model: model.clone(),
                profile: profile.clone(),
            },
        )?;
    }
    Ok(())
}

/// Every step for real.
fn real_profile(setup: &Setup, cfg: &TrainConfig) -> Result<(ModelJson, ConfigProfile)> {
    let mut session = setup.session(cfg)?;
    let mj = model_json(&session.chain);
    let p = profile(
        &mut session,
        &ProfileSettings {
            repeats: setup.repeats,
            quiet: setup.quiet,
            selective: setup.selective.clone(),
            ..Default::default()
        },
    )
    .with_context(|| format!("profiling {} under {}", setup.model, cfg.label()))?;
    Ok((mj, p))
}

/// Memory on the meta device and times from the cost model over `rates`: one more fake step
/// with every candidate checkpointed is traced, and its operators' work is timed over the rates.
/// Nothing runs for real.
fn estimated_profile(
    setup: &Setup,
    cfg: &TrainConfig,
    unlearned: Option<ConfigProfile>,
    rates: &DeviceRates,
) -> Result<(ModelJson, ConfigProfile)> {
    let mut p = given_or_meta(setup, cfg, unlearned)?;
    let mut session = setup.fake_session(cfg)?;
    let mj = model_json(&session.chain);
    let (times, estimate) = times_from_fake_step(&mut session, &p.recompute_class, rates, &setup.selective)
        .with_context(|| format!("estimating the times of {} under {}", setup.model, cfg.label()))?;
    times.apply(&mut p);
    p.estimated = Some(estimate);
    Ok((mj, p))
}

/// `given`, `decide`'s meta profile of `cfg`, else one measured now.
fn given_or_meta(setup: &Setup, cfg: &TrainConfig, given: Option<ConfigProfile>) -> Result<ConfigProfile> {
    match given {
        Some(p) => Ok(p),
        None => Ok(meta_profile(setup, cfg)?.1),
    }
}

/// The memory terms of `cfg`, from steps on the meta device (their times mean nothing).
fn meta_profile(setup: &Setup, cfg: &TrainConfig) -> Result<(ModelJson, ConfigProfile)> {
    let mut session = setup.fake_session(cfg)?;
    let mj = model_json(&session.chain);
    let p = profile(
        &mut session,
        &ProfileSettings {
            repeats: 1,
            quiet: true,
            retime: RetimePolicy::never(),
            selective: setup.selective.clone(),
        },
    )
    .with_context(|| format!("measuring {} under {} on the meta device", setup.model, cfg.label()))?;
    Ok((mj, p))
}

fn cache_file(setup: &Setup, key: &str) -> Option<std::path::PathBuf> {
    setup
        .cache_dir
        .as_ref()
        .map(|d| d.join(format!("{:016x}.json", fnv1a(key))))
}

fn read_cache(setup: &Setup, key: &str) -> Option<CachedConfig> {
    let f = cache_file(setup, key)?;
    let cached = formats::read_tagged::<CachedConfig>(&f, formats::CACHE_FORMAT).ok()?;
    (cached.key == key).then_some(cached)
}

/// What a process running a step whose tensors peak at `tensor_bytes` needs: the process's own
/// memory (libtorch, the model's code, the allocator's slack) on top.
pub fn with_process_overhead(tensor_bytes: i64) -> i64 {
    tensor_bytes + tensor_bytes / 10 + (512 << 20)
}

/// Refuses to run a step whose tensors peak at `tensor_bytes` where this machine has not the
/// memory for it: the kernel's OOM killer would end the process without a word. `what` names
/// the run; `instead` says what to do.
pub fn check_fits_here(tensor_bytes: i64, what: &str, instead: &str) -> Result<()> {
    let needed = with_process_overhead(tensor_bytes);
    match available_memory() {
        Some(free) if needed > free => Err(UsageError(format!(
            "{what} needs about {} of memory and {} is available here; {instead}",
            format_size(needed as u64),
            format_size(free as u64)
        ))
        .into()),
        _ => Ok(()),
    }
}

/// Refuses to train `cfg` for real with the modules `regex` names checkpointed where one step,
/// measured on the meta device first, would not fit in this machine's memory. A model the meta
/// device cannot run is run as asked.
pub fn check_step_fits(setup: &Setup, cfg: &TrainConfig, regex: &str) -> Result<()> {
    let Ok(mut fake) = setup.fake_session(cfg) else {
        return Ok(());
    };
    let mask = if regex.is_empty() {
        vec![false; fake.chain.units()]
    } else {
        fake.select(regex)?
    };
    let Ok(step) = fake.step(&mask, None) else {
        return Ok(());
    };
    check_fits_here(
        step.peak_bytes,
        &format!("training {} under {}", setup.model, cfg.label()),
        "checkpoint more (ckptune plan --budget finds what fits) or train where there is more memory",
    )
}

/// `MemAvailable` of /proc/meminfo, in bytes.
pub fn available_memory() -> Option<i64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: i64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
