//! `ckptune plot` on synthetic sweeps and profiles: the files are valid SVG and PNG of the
//! promised size, with exactly one marker per point; bad input fails with exit code 2 and a
//! message naming the file and the problem.

mod common;

use std::path::Path;

use common::ckptune;

use ckptune::plot::{self, MARKER_OPACITY, WHISKER_OPACITY};
use ckptune_solver::formats::{
    self, BlockJson, DeviceJson, ModelJson, ProfileJson, SweepConfigJson, SweepJson, SweepPointJson,
};
use ckptune_solver::profile::{BlockProfile, ConfigProfile, ConfigSpec, Contention, FixedBytes, RegimeProfile, Stats};
use regex::Regex;

fn config() -> ConfigSpec {
    ConfigSpec {
        precision: "fp32".into(),
        optimizer: "adamw".into(),
        optimizer_impl: Some("single".into()),
        micro_batch: 4,
        grad_accum: 1,
        set_to_none: true,
        autocast_cache: false,
        loss_chunks: None,
        optimizer_in_backward: false,
    }
}

fn model(candidates: &[&str]) -> ModelJson {
    let mut blocks = vec![BlockJson {
        name: "stem".into(),
        candidate: false,
    }];
    blocks.extend(candidates.iter().map(|c| BlockJson {
        name: (*c).into(),
        candidate: true,
    }));
    blocks.push(BlockJson {
        name: "head".into(),
        candidate: false,
    });
    ModelJson {
        name: "toy".into(),
        params: 1000,
        reference_params: 1000,
        input: "4x8".into(),
        modules: blocks.iter().map(|b| b.name.clone()).collect(),
        blocks,
        groups: Vec::new(),
        parameters: Vec::new(),
        attention: None,
        prefix: None,
    }
}

fn device() -> DeviceJson {
    DeviceJson {
        device: "cpu".into(),
        threads: 1,
        memory: "exact CPU tensor bytes".into(),
        cpu: String::new(),
        measured: String::new(),
    }
}

fn stats(median: f64) -> Stats {
    Stats {
        median,
        min: median * 0.98,
        max: median * 1.03,
        n: 3,
    }
}

/// Every subset of `candidates`: checkpointing block k saves `(k + 1)` MB and costs
/// `(k + 1)` ms on a 100 MB, 100 ms step; with `predicted`, the even subsets also carry a
/// prediction 1% off.
fn sweep(candidates: &[&str], predicted: bool) -> SweepJson {
    let points = (0..1usize << candidates.len())
        .map(|mask| {
            let chosen: Vec<usize> = (0..candidates.len()).filter(|k| mask >> k & 1 == 1).collect();
            let peak = 100_000_000 - chosen.iter().map(|k| (*k as i64 + 1) * 1_000_000).sum::<i64>();
            let secs = 0.1 + chosen.iter().map(|k| (*k as f64 + 1.0) * 1e-3).sum::<f64>();
            let with_prediction = predicted && mask % 2 == 0;
            SweepPointJson {
                regex: chosen.iter().map(|k| candidates[*k]).collect::<Vec<_>>().join("|"),
                modules: chosen.iter().map(|k| candidates[*k].to_owned()).collect(),
                peak_bytes: peak,
                step_seconds: stats(secs),
                step_samples: vec![secs],
                loss: 2.3,
                predicted_peak_bytes: with_prediction.then_some(peak),
                predicted_step_seconds: with_prediction.then_some(secs * 1.01),
                predicted_step_range: with_prediction.then_some([secs * 0.99, secs * 1.04]),
                contention: Contention::default(),
                predicted_moment: with_prediction.then(|| "backward stem".into()),
            }
        })
        .collect();
    SweepJson {
        format: formats::SWEEP_FORMAT.into(),
        ckptune_version: "0.1.0".into(),
        model: model(candidates),
        device: device(),
        repeats: 3,
        configs: vec![SweepConfigJson {
            config: config(),
            points,
        }],
    }
}

/// Checks that `svg` is one well-formed `<svg>` element of the figure's size (every tag
/// closed, in order) and returns its self-closing tags as (name, attributes).
fn parse_svg(svg: &str) -> Vec<(String, String)> {
    let tag = Regex::new(r"<(/?)([a-zA-Z]+)([^>]*?)(/?)>").unwrap();
    let mut open: Vec<String> = Vec::new();
    let mut leaves = Vec::new();
    let mut roots = 0;
    for c in tag.captures_iter(svg) {
        let (closing, name, attrs, selfclose) = (&c[1] == "/", c[2].to_owned(), c[3].to_owned(), &c[4] == "/");
        if closing {
            assert_eq!(open.pop().as_deref(), Some(name.as_str()), "unbalanced </{name}>");
        } else if selfclose {
            assert!(!open.is_empty(), "<{name}/> outside the root");
            leaves.push((name, attrs));
        } else {
            if open.is_empty() {
                roots += 1;
                assert_eq!(name, "svg", "the root element");
                assert!(attrs.contains(&format!("width=\"{}\"", plot::WIDTH)), "{attrs}");
                assert!(attrs.contains(&format!("height=\"{}\"", plot::HEIGHT)), "{attrs}");
            }
            open.push(name);
        }
    }
    assert!(open.is_empty(), "unclosed elements {open:?}");
    assert_eq!(roots, 1);
    assert!(svg.trim_start().starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    leaves
}

/// Filled and hollow plot markers: polygons and polylines with the markers' opacity.
fn count_markers(svg: &str) -> (usize, usize) {
    let opacity = format!("opacity=\"{MARKER_OPACITY}\"");
    let leaves = parse_svg(svg);
    let count = |kind: &str| leaves.iter().filter(|(n, a)| n == kind && a.contains(&opacity)).count();
    (count("polygon"), count("polyline"))
}

/// The strings drawn as text, unescaped as far as the tests need.
fn texts(svg: &str) -> Vec<String> {
    let re = Regex::new(r"<text[^>]*>\s*([^<]*?)\s*</text>").unwrap();
    re.captures_iter(svg)
        .map(|c| {
            c[1].replace("&apos;", "'")
                .replace("&quot;", "\"")
                .replace("&amp;", "&")
        })
        .collect()
}

/// Decodes the whole PNG; returns its size.
fn png_size(path: &Path) -> (u32, u32) {
    let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
    let mut reader = decoder
        .read_info()
        .unwrap_or_else(|e| panic!("{} is not a PNG: {e}", path.display()));
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader
        .next_frame(&mut buf)
        .unwrap_or_else(|e| panic!("{} does not decode: {e}", path.display()));
    (info.width, info.height)
}

fn write_sweep(dir: &Path, s: &SweepJson) -> String {
    let path = dir.join("sweep.json");
    formats::write_atomic(&path, s).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn sweep_plots_one_marker_per_subset_as_svg_and_png() {
    let dir = tempfile::tempdir().unwrap();
    let s = sweep(&["a", "b", "c"], true);
    let input = write_sweep(dir.path(), &s);
    let out = dir.path().join("plots");
    let run = ckptune(&["plot", &input, "-o", out.to_str().unwrap()]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    let stem = out.join("toy-fp32-adamw-mb4");
    for kind in ["tradeoff", "candidates"] {
        for ext in ["svg", "png"] {
            assert!(
                Path::new(&format!("{}-{kind}.{ext}", stem.display())).is_file(),
                "{kind}.{ext} written"
            );
        }
    }
    let svg = std::fs::read_to_string(format!("{}-tradeoff.svg", stem.display())).unwrap();
    // 8 subsets measured (the empty one included), the 4 with an even mask also predicted.
    assert_eq!(count_markers(&svg), (8, 4));
    // Each subset is in the legend, by its module names.
    let t = texts(&svg);
    for label in ["nothing checkpointed", "a", "b + c", "a + b + c"] {
        assert!(t.iter().any(|s| s == label), "legend has {label:?}: {t:?}");
    }
    assert!(
        t.iter().any(|s| s.starts_with("toy: memory saved vs. throughput lost")),
        "title: {t:?}"
    );
    assert_eq!(
        png_size(Path::new(&format!("{}-tradeoff.png", stem.display()))),
        (plot::WIDTH, plot::HEIGHT)
    );

    // The candidates chart has one bar pair per block checkpointed alone, named on the axis.
    let svg = std::fs::read_to_string(format!("{}-candidates.svg", stem.display())).unwrap();
    parse_svg(&svg);
    let t = texts(&svg);
    for block in ["a", "b", "c"] {
        assert!(t.iter().any(|s| s == block), "{block} labelled: {t:?}");
    }
    assert_eq!(
        png_size(Path::new(&format!("{}-candidates.png", stem.display()))),
        (plot::WIDTH, plot::HEIGHT)
    );
}

#[test]
fn many_subsets_still_get_one_marker_each() {
    // 2^6 = 64 subsets: more than the legend holds, so they share a style; still 64 markers.
    let dir = tempfile::tempdir().unwrap();
    let s = sweep(&["a", "b", "c", "d", "e", "f"], false);
    ckptune::cli::commands::plot::plot_sweep(&s, dir.path()).unwrap();
    let svg = std::fs::read_to_string(dir.path().join("toy-fp32-adamw-mb4-tradeoff.svg")).unwrap();
    assert_eq!(count_markers(&svg), (64, 0));
}

#[test]
fn sweep_without_the_empty_subset_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = sweep(&["a", "b"], false);
    s.configs[0].points.retain(|p| !p.modules.is_empty());
    let input = write_sweep(dir.path(), &s);
    let out = dir.path().join("plots");
    let run = ckptune(&["plot", &input, "-o", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "bad input: {err}");
    assert!(err.contains(&input), "names the file: {err}");
    assert!(
        err.contains("toy under fp32 / adamw / micro-batch 4"),
        "names the config: {err}"
    );
    assert!(
        err.contains("no subset with nothing checkpointed"),
        "says what is missing: {err}"
    );
    assert!(err.contains("--checkpoint ''"), "says how to fix it: {err}");
    assert!(!out.join("toy-fp32-adamw-mb4-tradeoff.svg").exists(), "writes nothing");
}

#[test]
fn unknown_format_tags_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, r#"{"format": "ckptune.plan/1", "budget": 1}"#).unwrap();
    let run = ckptune(&["plot", plan.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{err}");
    assert!(
        err.contains(plan.to_str().unwrap()) && err.contains("\"ckptune.plan/1\""),
        "{err}"
    );
    assert!(
        err.contains("ckptune.profile/1") && err.contains("ckptune.sweep/1"),
        "lists what it reads: {err}"
    );

    let untagged = dir.path().join("data.json");
    std::fs::write(&untagged, r#"{"points": []}"#).unwrap();
    let err = ckptune::cli::commands::plot::plot_file(&untagged, dir.path()).unwrap_err();
    assert!(format!("{err:#}").contains("has no \"format\" tag"), "{err:#}");

    // Another version of a known kind: the version check's message, with its hint.
    let mut future = serde_json::to_value(sweep(&["a"], false)).unwrap();
    future["format"] = "ckptune.sweep/2".into();
    let newer = dir.path().join("newer.json");
    std::fs::write(&newer, future.to_string()).unwrap();
    let err = format!(
        "{:#}",
        ckptune::cli::commands::plot::plot_file(&newer, dir.path()).unwrap_err()
    );
    assert!(
        err.contains("\"ckptune.sweep/2\"") && err.contains("regenerate it"),
        "{err}"
    );
}

fn block(name: &str, candidate: bool, kept: i64) -> BlockProfile {
    BlockProfile {
        name: name.into(),
        candidate,
        kept_grad: kept,
        fwd_transient_grad: 1000,
        kept_nograd: if candidate { 1000 } else { kept },
        fwd_transient_nograd: 1000,
        carry: 1000,
        bwd_transient: 2000,
        rec_transient: 1000,
        kept_recompute: kept,
        bwd_transient_ckpt: 2000,
        grad_in_bytes: 1000,
        fwd_seconds: 0.01,
        fwd_nograd_seconds: 0.008,
        bwd_seconds: 0.02,
        rec_seconds: 0.009,
        out_released: None,
        out_released_ckpt: None,
        cache_grad: None,
        cache_nograd: None,
        selective: Vec::new(),
    }
}

#[test]
fn profile_plots_predicted_singles_and_the_candidates() {
    let blocks = vec![
        block("stem", false, 5000),
        block("a", true, 40_000),
        block("b", true, 20_000),
        block("head", false, 100),
    ];
    let c = ConfigProfile {
        config: config(),
        fixed: FixedBytes {
            parameters: 10_000,
            buffers: 0,
            gradients: 10_000,
            optimizer_state: 20_000,
            master_weights: 0,
            batch: 1000,
            other: 0,
        },
        regimes: vec![RegimeProfile {
            label: "first micro-step".into(),
            fixed: 31_000,
            loss_transient: 500,
            loss_forward_transient: None,
            loss_kept: None,
            loss_backward_transient: None,
            after_backward: None,
            blocks,
            groups: Vec::new(),
        }],
        optimizer_peak: 60_000,
        peak_none: 100_000,
        peak_all: 60_000,
        seconds_none: stats(0.1),
        seconds_all: stats(0.12),
        recompute_seconds: vec![0.0, 0.009, 0.006, 0.0],
        steps_run: 8,
        wall_seconds: 1.0,
        recompute_spread: vec![Stats::default(), stats(0.009), stats(0.006), Stats::default()],
        recompute_class: Vec::new(),
        contention: Contention::default(),
        estimated: None,
        reserved: None,
    };
    let p = ProfileJson {
        format: formats::PROFILE_FORMAT.into(),
        ckptune_version: "0.1.0".into(),
        model: model(&["a", "b"]),
        device: device(),
        repeats: 3,
        configs: vec![c],
    };
    let dir = tempfile::tempdir().unwrap();
    let written = ckptune::cli::commands::plot::plot_profile(&p, dir.path()).unwrap();
    assert_eq!(written.len(), 4);
    let svg = std::fs::read_to_string(dir.path().join("toy-fp32-adamw-mb4-tradeoff.svg")).unwrap();
    // Measured: nothing and everything checkpointed; predicted: those and each candidate alone.
    assert_eq!(count_markers(&svg), (2, 4));
    // Each prediction carries the spread of the profile's samples: a whisker (a line and two
    // caps) through each hollow marker.
    let whisker = format!("opacity=\"{WHISKER_OPACITY}\"");
    let whiskers = parse_svg(&svg)
        .iter()
        .filter(|(n, a)| n == "polyline" && a.contains(&whisker))
        .count();
    assert_eq!(whiskers, 3 * 4);
    assert_eq!(
        png_size(&dir.path().join("toy-fp32-adamw-mb4-candidates.png")),
        (plot::WIDTH, plot::HEIGHT)
    );
}

#[test]
fn subset_labels_group_numbered_modules() {
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(plot::subset_label(&[]), "nothing checkpointed");
    assert_eq!(plot::subset_label(&names(&["layer1", "layer3"])), "layer1 + layer3");
    assert_eq!(
        plot::subset_label(&names(&[
            "encoder.layer.0",
            "encoder.layer.1",
            "encoder.layer.2",
            "encoder.layer.7"
        ])),
        "encoder.layer.{0–2,7}"
    );
    assert_eq!(
        plot::subset_label(&names(&["layer1.0", "layer1.1", "layer3.4"])),
        "layer1.{0,1} + layer3.4"
    );
}

#[test]
fn non_finite_values_are_refused_and_file_names_are_safe() {
    let meta = plot::PlotMeta {
        model: "runs/my model.pt".into(),
        micro_batch: 2,
        grad_accum: 4,
        set_to_none: false,
        precision: "bf16".into(),
        optimizer: "adamw".into(),
        device: "cpu (1 thread)".into(),
        source: "test".into(),
    };
    assert_eq!(meta.file_stem(), "my_model.pt-bf16-adamw-mb2-ga4-zerograd");
    let named = |model: &str| {
        plot::PlotMeta {
            model: model.into(),
            ..meta.clone()
        }
        .file_stem()
    };
    assert_eq!(
        named("configs/llama-3.1-8b/config.json"),
        "llama-3.1-8b-bf16-adamw-mb2-ga4-zerograd"
    );
    assert_eq!(named("configs/qwen2.5-7b/"), "qwen2.5-7b-bf16-adamw-mb2-ga4-zerograd");
    assert_eq!(named("resnet18"), "resnet18-bf16-adamw-mb2-ga4-zerograd");

    let dir = tempfile::tempdir().unwrap();
    let (svg, png) = (dir.path().join("x.svg"), dir.path().join("x.png"));
    let nan = plot::TradeoffPoint {
        label: "layer1".into(),
        baseline: false,
        measured: Some(plot::Tradeoff {
            throughput_lost_pct: f64::NAN,
            memory_saved_pct: 3.0,
        }),
        predicted: None,
        throughput_lost_range_pct: None,
        predicted_range_pct: None,
    };
    let err = plot::scatter(&[nan], &meta, &svg, &png).unwrap_err().to_string();
    assert!(
        err.contains("x.svg") && err.contains("\"layer1\"") && err.contains("NaN"),
        "{err}"
    );
    assert!(!svg.exists() && !png.exists());
}
