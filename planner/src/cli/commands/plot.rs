//! `ckptune plot`: turns a profile or a sweep into trade-off plots, an SVG and a PNG per
//! config and chart. The arithmetic from measurements to percentages lives here; drawing is
//! `crate::plot`'s.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};

use ckptune_solver::formats::{self, DeviceJson, ProfileJson, SweepConfigJson, SweepJson};
use ckptune_solver::model::{peak_at, seconds_at, seconds_range_at};
use ckptune_solver::profile::ConfigSpec;

use crate::cli::args::PlotArgs;
use crate::cli::error::UsageError;
use crate::cli::output::outln;
use crate::plot::{self, CandidateBar, CandidateBasis, PlotMeta, Tradeoff, TradeoffPoint};

pub fn plot_cmd(a: PlotArgs) -> Result<ExitCode> {
    let dir = match &a.output {
        Some(d) => d.clone(),
        None => match a.input.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        },
    };
    for f in plot_file(&a.input, &dir)? {
        outln!("wrote {}", f.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Plots a `ckptune.profile/1` or `ckptune.sweep/1` file, told apart by its `format` tag, into
/// `out_dir`; returns the files written.
pub fn plot_file(input: &Path, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let shown = input.display();
    let tag = formats::read_format_tag(input, "ckptune.profile or ckptune.sweep")?;
    let tag = tag.as_str();
    // Dispatch on the kind only: `read_tagged` then rejects other versions of that kind
    // with its own message.
    let written = match tag.split('/').next() {
        Some("ckptune.profile") => {
            let p: ProfileJson = formats::read_tagged(input, formats::PROFILE_FORMAT)?;
            plot_profile(&p, out_dir)
        }
        Some("ckptune.sweep") => {
            let s: SweepJson = formats::read_tagged(input, formats::SWEEP_FORMAT)?;
            plot_sweep(&s, out_dir)
        }
        _ => {
            let found = if tag.is_empty() {
                "no \"format\" tag".to_owned()
            } else {
                format!("format {tag:?}")
            };
            return Err(UsageError(format!(
                "{shown} has {found}; `ckptune plot` reads {} (from `ckptune profile -o`) or {} \
                 (from `ckptune sweep -o`)",
                formats::PROFILE_FORMAT,
                formats::SWEEP_FORMAT
            ))
            .into());
        }
    };
    written.with_context(|| format!("plotting {shown}"))
}

fn meta(model: &str, device: &DeviceJson, c: &ConfigSpec, source: String) -> PlotMeta {
    PlotMeta {
        model: model.to_owned(),
        micro_batch: c.micro_batch,
        grad_accum: c.grad_accum,
        set_to_none: c.set_to_none,
        precision: c.precision.clone(),
        optimizer: c.optimizer_label(),
        device: device.label(),
        source,
    }
}

fn config_name(model: &str, c: &ConfigSpec) -> String {
    format!(
        "{model} under {} / {} / micro-batch {} × {}",
        c.precision,
        c.optimizer_label(),
        c.micro_batch,
        c.grad_accum
    )
}

/// Paths of one chart: `DIR/<stem>-<kind>.{svg,png}`.
fn chart_paths(out_dir: &Path, meta: &PlotMeta, kind: &str) -> (PathBuf, PathBuf) {
    let stem = format!("{}-{kind}", meta.file_stem());
    (out_dir.join(format!("{stem}.svg")), out_dir.join(format!("{stem}.png")))
}

/// Memory saved, in percent: `100 × (1 − peak / peak_none)`.
fn saved_pct(peak_none: f64, peak: f64) -> f64 {
    100.0 * (1.0 - peak / peak_none)
}

/// Throughput lost, in percent: `100 × (1 − t_none / t)` (steps per second fall by that share).
fn lost_pct(t_none: f64, t: f64) -> f64 {
    100.0 * (1.0 - t_none / t)
}

/// The trade-off scatter of every measured subset and, where the sweep has one, the
/// candidates chart of the subsets that checkpoint a single block.
pub fn plot_sweep(s: &SweepJson, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for c in &s.configs {
        let name = config_name(&s.model.name, &c.config);
        let (points, bars) = sweep_series(s, c).map_err(|e| UsageError(format!("the sweep of {name} {e}")))?;
        let source = format!("sweep: median of {} timed steps per subset", s.repeats);
        let m = meta(&s.model.name, &s.device, &c.config, source);
        let (svg, png) = chart_paths(out_dir, &m, "tradeoff");
        plot::scatter(&points, &m, &svg, &png).with_context(|| format!("plotting {name}"))?;
        written.extend([svg, png]);
        if bars.is_empty() {
            eprintln!(
                "note: the sweep of {name} checkpoints no block alone, so there is no candidates chart \
                 (sweep with --all-subsets or one --checkpoint per block for it)"
            );
            continue;
        }
        let (svg, png) = chart_paths(out_dir, &m, "candidates");
        plot::candidates_chart(&bars, CandidateBasis::Measured, &m, &svg, &png)
            .with_context(|| format!("plotting {name}"))?;
        written.extend([svg, png]);
    }
    Ok(written)
}

/// Percentages relative to the subset with nothing checkpointed. Errors complete the
/// sentence "the sweep of MODEL under CONFIG …".
fn sweep_series(s: &SweepJson, c: &SweepConfigJson) -> Result<(Vec<TradeoffPoint>, Vec<CandidateBar>), String> {
    let base = c.points.iter().find(|p| p.modules.is_empty()).ok_or_else(|| {
        "has no subset with nothing checkpointed (`modules: []`), which every percentage is relative to; \
         sweep again with `--checkpoint ''` added"
            .to_owned()
    })?;
    let (p0, t0) = (base.peak_bytes as f64, base.step_seconds.median);
    if p0 <= 0.0 || t0.is_nan() || t0 <= 0.0 {
        return Err(format!(
            "has an unusable reference (nothing checkpointed): peak {} bytes, median step {t0} s",
            base.peak_bytes
        ));
    }
    let pred_base = base.predicted_peak_bytes.zip(base.predicted_step_seconds);
    let mut points = Vec::new();
    for p in &c.points {
        let t = p.step_seconds.median;
        if p.peak_bytes <= 0 || t.is_nan() || t <= 0.0 {
            return Err(format!(
                "has an unusable point for {:?}: peak {} bytes, median step {t} s",
                p.regex, p.peak_bytes
            ));
        }
        let predicted = match (pred_base, p.predicted_peak_bytes, p.predicted_step_seconds) {
            (Some((pp0, pt0)), Some(pp), Some(pt)) if pp0 > 0 && pt0 > 0.0 && pt > 0.0 => Some(Tradeoff {
                throughput_lost_pct: lost_pct(pt0, pt),
                memory_saved_pct: saved_pct(pp0 as f64, pp as f64),
            }),
            _ => None,
        };
        // The predicted spread, relative to the predicted median with nothing checkpointed.
        let predicted_range_pct = match (predicted, pred_base, p.predicted_step_range) {
            (Some(_), Some((_, pt0)), Some([lo, hi])) if lo > 0.0 => Some((lost_pct(pt0, lo), lost_pct(pt0, hi))),
            _ => None,
        };
        points.push(TradeoffPoint {
            label: plot::subset_label(&p.modules),
            baseline: p.modules.is_empty(),
            measured: Some(Tradeoff {
                throughput_lost_pct: lost_pct(t0, t),
                memory_saved_pct: saved_pct(p0, p.peak_bytes as f64),
            }),
            predicted,
            throughput_lost_range_pct: Some((lost_pct(t0, p.step_seconds.min), lost_pct(t0, p.step_seconds.max))),
            predicted_range_pct,
        });
    }
    // Single-block subsets, in chain order.
    let bars = s
        .model
        .blocks
        .iter()
        .filter_map(|b| c.points.iter().find(|p| p.modules.len() == 1 && p.modules[0] == b.name))
        .map(|p| {
            let t = p.step_seconds.median;
            CandidateBar {
                block: p.modules[0].clone(),
                saved_bytes: base.peak_bytes - p.peak_bytes,
                saved_pct: saved_pct(p0, p.peak_bytes as f64),
                cost_seconds: t - t0,
                cost_pct: 100.0 * (t - t0) / t0,
                cost_range_pct: Some((
                    100.0 * (p.step_seconds.min - t0) / t0,
                    100.0 * (p.step_seconds.max - t0) / t0,
                )),
            }
        })
        .collect();
    Ok((points, bars))
}

/// From a profile: the candidates chart from its per-block terms, and a trade-off scatter
/// predicted for nothing, each candidate alone, and all candidates — the two ends measured
/// too, since the profile ran them.
pub fn plot_profile(p: &ProfileJson, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for c in &p.configs {
        let name = config_name(&p.model.name, &c.config);
        let source = match &c.estimated {
            Some(e) => format!(
                "times predicted by the cost model over {}, no step timed",
                e.rates.device
            ),
            None => format!("profile: {} timed steps per measurement", p.repeats),
        };
        let mut m = meta(&p.model.name, &p.device, &c.config, source);
        if c.is_estimated() {
            // No step ran here: the device only traced the step's memory.
            m.device = format!("traced on {}", p.device.device);
        }
        let Some(regime) = c.regimes.first() else {
            return Err(UsageError(format!("the profile of {name} has no measured regime")).into());
        };
        let t0 = c.seconds_none.median;
        if c.peak_none <= 0 || t0.is_nan() || t0 <= 0.0 {
            return Err(UsageError(format!(
                "the profile of {name} has an unusable reference: peak {} bytes, median step {t0} s",
                c.peak_none
            ))
            .into());
        }
        let n = regime.blocks.len();
        let units = n + regime.groups.len();
        if c.recompute_seconds.len() != units {
            return Err(UsageError(format!(
                "the profile of {name} has {} recompute times for {n} blocks and {} groups",
                c.recompute_seconds.len(),
                regime.groups.len()
            ))
            .into());
        }

        // Per candidate (blocks, then groups): the bytes it keeps plain minus checkpointed.
        let bar = |label: &str, saved: i64, u: usize| CandidateBar {
            block: label.to_owned(),
            saved_bytes: saved,
            saved_pct: 100.0 * saved as f64 / c.peak_none as f64,
            cost_seconds: c.recompute_seconds[u],
            cost_pct: 100.0 * c.recompute_seconds[u] / t0,
            // The fastest and slowest recompute sample (profiles before ckptune kept them: none).
            cost_range_pct: c
                .recompute_spread
                .get(u)
                .filter(|_| !c.is_estimated())
                .map(|s| (100.0 * s.min / t0, 100.0 * s.max / t0)),
        };
        // In execution order, a group just before its blocks. A block saves what it keeps plain
        // minus checkpointed; a group what it keeps run plain (fused) minus checkpointed.
        let spans: Vec<(usize, usize)> = regime.groups.iter().map(|g| (g.first, g.last)).collect();
        let bars: Vec<CandidateBar> = ckptune_solver::chain_model::solver_order(n, &spans)
            .into_iter()
            .filter_map(|u| match regime.blocks.get(u) {
                Some(b) if b.candidate => Some(bar(&b.name, b.kept_grad - b.kept_nograd, u)),
                Some(_) => None,
                None => regime.groups.get(u - n).map(|g| bar(&g.name, g.fused_kept - g.kept, u)),
            })
            .collect();

        let none = vec![false; units];
        let (pp0, pt0) = (peak_at(c, &none).0 as f64, seconds_at(c, &none));
        let predict = |mask: &[bool]| Tradeoff {
            throughput_lost_pct: lost_pct(pt0, seconds_at(c, mask)),
            memory_saved_pct: saved_pct(pp0, peak_at(c, mask).0 as f64),
        };
        // The spread the profile's samples allow, relative to the median with nothing
        // checkpointed (the whisker of the reference itself shows that median's own spread).
        // An estimate has no samples to spread over.
        let spread = |mask: &[bool]| {
            seconds_range_at(c, mask)
                .filter(|_| !c.is_estimated())
                .map(|(lo, hi)| (lost_pct(pt0, lo), lost_pct(pt0, hi)))
        };
        let mut points = vec![TradeoffPoint {
            label: plot::subset_label(&[]),
            baseline: true,
            // The reference; an estimated profile measured no step to put there.
            measured: (!c.is_estimated()).then_some(Tradeoff {
                throughput_lost_pct: 0.0,
                memory_saved_pct: 0.0,
            }),
            predicted: Some(predict(&none)),
            throughput_lost_range_pct: None,
            predicted_range_pct: spread(&none),
        }];
        let names: Vec<&str> = regime
            .blocks
            .iter()
            .map(|b| b.name.as_str())
            .chain(regime.groups.iter().map(|g| g.name.as_str()))
            .collect();
        let candidate = |i: usize| regime.blocks.get(i).is_none_or(|b| b.candidate);
        for i in (0..units).filter(|&i| candidate(i)) {
            let mut mask = none.clone();
            mask[i] = true;
            points.push(TradeoffPoint {
                label: names[i].to_owned(),
                baseline: false,
                measured: None,
                predicted: Some(predict(&mask)),
                throughput_lost_range_pct: None,
                predicted_range_pct: spread(&mask),
            });
        }
        let all: Vec<bool> = (0..units).map(|i| i < n && candidate(i)).collect();
        if all.iter().filter(|x| **x).count() > 1 {
            let timed = !c.is_estimated() && c.peak_all > 0 && c.seconds_all.median > 0.0;
            let measured = timed.then(|| Tradeoff {
                throughput_lost_pct: lost_pct(t0, c.seconds_all.median),
                memory_saved_pct: saved_pct(c.peak_none as f64, c.peak_all as f64),
            });
            points.push(TradeoffPoint {
                label: "all candidates".into(),
                baseline: false,
                measured,
                predicted: Some(predict(&all)),
                throughput_lost_range_pct: None,
                predicted_range_pct: spread(&all),
            });
        }

        let (svg, png) = chart_paths(out_dir, &m, "tradeoff");
        plot::scatter(&points, &m, &svg, &png).with_context(|| format!("plotting {name}"))?;
        written.extend([svg, png]);
        let (svg, png) = chart_paths(out_dir, &m, "candidates");
        let basis = match c.is_estimated() {
            true => CandidateBasis::Estimated,
            false => CandidateBasis::Profiled,
        };
        plot::candidates_chart(&bars, basis, &m, &svg, &png).with_context(|| format!("plotting {name}"))?;
        written.extend([svg, png]);
    }
    Ok(written)
}
