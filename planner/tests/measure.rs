//! `--measure`: memory measured on the meta device equals the CPU's term for term (oneDNN's
//! scratch learned from the one real step that times it, or no step at all where the cost model
//! estimates the times), and a model whose step this machine cannot hold is planned from the
//! meta device with estimated times, labelled so, while running it is refused before anything
//! runs, with exit 2 and nothing written.

mod common;

use std::path::Path;

use common::{ok, read, refused, COMMON};
use serde_json::Value;

/// A profile's configs with every time and count of steps taken out: what measuring on the meta
/// device must reproduce exactly.
fn memory_of(profile: &Value) -> Vec<Value> {
    profile["configs"]
        .as_array()
        .expect("configs")
        .iter()
        .map(strip_times)
        .collect()
}

/// A config's profile with every time and count of steps taken out.
fn strip_times(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| {
                    !["seconds", "spread", "contention", "wall", "steps_run", "estimated"]
                        .iter()
                        .any(|t| k.contains(t))
                })
                .map(|(k, v)| (k.clone(), strip_times(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(strip_times).collect()),
        other => other.clone(),
    }
}

fn profile(dir: &Path, name: &str, model: &[&str], measure: &str) -> Value {
    let out = dir.join(format!("{name}-{measure}.json"));
    let mut args = vec!["profile"];
    args.extend(model);
    // SGD: a tiny model under bf16 AdamW can diverge within a profile's steps.
    args.extend([
        "--precision",
        "fp32,bf16",
        "--optimizer",
        "sgd",
        "--measure",
        measure,
        "-o",
        out.to_str().unwrap(),
    ]);
    args.extend(COMMON);
    ok(&args);
    read(&out)
}

/// A model with oneDNN's convolution scratch and one with matmuls, as names and `profile`'s
/// arguments. Batch 8 at 64 px: batch norm over 16 values in the last stage (batch 4 at 32 px
/// normalizes 4 values, which bf16 can drive to NaN within the extra steps a busy machine
/// re-times).
const TINY_MODELS: [(&str, &[&str]); 2] = [
    ("tiny-resnet", &["tiny-resnet", "--batch", "8", "--image", "64"]),
    ("tiny-bert", &["tiny-bert", "--batch", "4", "--seq", "16"]),
];

#[test]
fn memory_on_the_meta_device_equals_the_cpus_term_for_term() {
    let dir = tempfile::tempdir().unwrap();
    for (name, model) in TINY_MODELS {
        let run = profile(dir.path(), name, model, "run");
        let auto = profile(dir.path(), name, model, "auto");
        assert_eq!(memory_of(&auto), memory_of(&run), "{name}");
        let measured = auto["device"]["measured"].as_str().unwrap_or_default();
        assert!(measured.contains("meta device"), "{name}: {measured}");
        assert!(run["device"]["measured"]
            .as_str()
            .unwrap_or_default()
            .contains("real steps"));
        // Times come from the one real step: positive, for every config.
        for c in auto["configs"].as_array().unwrap() {
            assert!(c["seconds_none"]["median"].as_f64().unwrap() > 0.0, "{name}: {c}");
        }
    }
}

/// A plan whose fastest choice checkpoints nothing times its config from a first step A, and
/// learns oneDNN's scratch from that step's operators (a plain step's, not a step B's): its
/// profile's memory still equals the real steps' term for term, bf16 (matmul scratch) and a
/// ResNet (convolution scratch) included.
#[test]
fn a_plan_timed_from_a_first_step_a_keeps_the_memory_exact() {
    let dir = tempfile::tempdir().unwrap();
    for (name, model) in TINY_MODELS {
        for precision in ["fp32", "bf16"] {
            let opts = [
                "--precision",
                precision,
                "--optimizer",
                "sgd",
                "--threads",
                "1",
                "--no-cache",
            ];
            let run_out = dir.path().join(format!("{name}-{precision}-run.json"));
            let mut args = vec!["profile"];
            args.extend(model);
            args.extend(opts);
            args.extend(["--measure", "run", "--quiet", "-o", run_out.to_str().unwrap()]);
            ok(&args);
            let plan_out = dir.path().join(format!("{name}-{precision}-plan.json"));
            let mut args = vec!["plan", "--budget", "100GiB"];
            args.extend(model);
            args.extend(opts);
            args.extend(["--measure", "auto", "--json", "-o", plan_out.to_str().unwrap()]);
            let stderr = String::from_utf8_lossy(&ok(&args).stderr).into_owned();
            let what = format!("{name} {precision}");
            assert!(
                stderr.contains("its fastest choice checkpoints nothing, so only its steps with nothing checkpointed"),
                "{what}: {stderr}"
            );
            let plan = read(&plan_out);
            assert_eq!(strip_times(&plan["profile"]), memory_of(&read(&run_out))[0], "{what}");
            assert_eq!(plan["predicted"]["throughput_loss"], 0.0, "{what}");
        }
    }
}

/// A Llama config at 70B's size: its step needs terabytes, more than any machine that runs
/// these tests has.
fn huge_llama(dir: &Path) -> String {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn times_estimated_by_the_cost_model_keep_the_memory_exact_and_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let model = &["tiny-bert", "--batch", "4", "--seq", "16"][..];
    let run = profile(dir.path(), "tiny-bert", model, "run");
    let estimate = profile(dir.path(), "tiny-bert", model, "estimate");
    let (run_memory, estimate_memory) = (memory_of(&run), memory_of(&estimate));
    // fp32: to the byte. bf16: oneDNN's matmul scratch, which only a real step shows the meta
    // device, is missing from the backward's transients, and nothing else.
    assert_eq!(estimate_memory[0], run_memory[0]);
    let peak = |p: &Value| p["configs"][1]["peak_none"].as_i64().unwrap();
    let missing = peak(&run) - peak(&estimate);
    assert!(
        (0..=64 << 10).contains(&missing),
        "bf16 peak {missing} B below the run's"
    );
    assert_eq!(estimate_memory[1]["fixed"], run_memory[1]["fixed"]);
    assert_eq!(estimate_memory[1]["optimizer_peak"], run_memory[1]["optimizer_peak"]);
    let kept = |m: &Value| {
        let blocks = m["regimes"][0]["blocks"].as_array().unwrap().clone();
        blocks
            .iter()
            .map(|b| (b["kept_grad"].clone(), b["kept_nograd"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(kept(&estimate_memory[1]), kept(&run_memory[1]));
    let measured = estimate["device"]["measured"].as_str().unwrap_or_default();
    assert!(measured.contains("cost model over this CPU's rates"), "{measured}");
    for c in estimate["configs"].as_array().unwrap() {
        // No step was timed: every time is the model's, over this CPU's rates.
        assert!(c.get("contention").is_none(), "{c}");
        assert_eq!(c["estimated"]["rates"]["device"], "cpu", "{c}");
        assert_eq!(c["estimated"]["traced_on"], "meta", "{c}");
        let (none, all) = (
            c["seconds_none"]["median"].as_f64().unwrap(),
            c["seconds_all"]["median"].as_f64().unwrap(),
        );
        assert!(0.0 < none && none < all, "{c}");
        assert!(run["configs"][0].get("estimated").is_none());
    }
}

#[test]
fn a_step_this_machine_cannot_hold_is_planned_with_estimated_times_and_never_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = huge_llama(dir.path());
    let out = dir.path().join("profile.json");
    let shape = ["--seq", "4096", "--batch", "1", "--precision", "fp32"];
    let mut args = vec![
        "profile",
        model.as_str(),
        "--measure",
        "run",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend(shape);
    args.extend(COMMON);
    refused(&args, &["for real needs about", "available here", "--measure auto"]);
    assert!(!out.exists());

    let mut args = vec!["train", model.as_str(), "--steps", "1"];
    args.extend(shape);
    args.extend(COMMON);
    refused(&args, &["needs about", "available here"]);

    let plan = dir.path().join("plan.json");
    let plan_args = |extra: &[&'static str]| {
        let mut args = vec!["plan", "--budget", "2TiB", model.as_str(), "-o", plan.to_str().unwrap()];
        args.extend(shape);
        args.extend(COMMON);
        args.extend(extra);
        args
    };
    // Real steps cannot time it here, and --measure meta asks for them.
    refused(
        &plan_args(&["--measure", "meta"]),
        &[
            "needs about",
            "--measure meta times real steps",
            "--measure auto or estimate",
        ],
    );
    assert!(!plan.exists());
    // Nor can a GPU's times come from this CPU's steps.
    refused(
        &plan_args(&["--target", "cuda:h100", "--measure", "run"]),
        &["--target cuda:h100", "drop one of them"],
    );
    refused(
        &plan_args(&["--target", "cuda:h99"]),
        &["no rates for a GPU called", "h100"],
    );
    assert!(!plan.exists());

    // Planned for an H100 from the meta device, every time labelled as the cost model's.
    ok(&plan_args(&["--target", "cuda:h100"]));
    let p = read(&plan);
    let how = p["predicted"]["step_seconds_estimated"].as_str().unwrap_or_default();
    assert!(how.contains("cost model over cuda:h100"), "{p}");
    assert!(p["predicted"].get("step_seconds_range").is_none(), "{p}");
    assert_eq!(p["profile"]["estimated"]["rates"]["device"], "cuda:h100");
    assert!(p["profile"].get("contention").is_none(), "{p}");
    assert!(p["notes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n.as_str().unwrap().contains("not measured")));
    for a in p["alternatives"].as_array().unwrap() {
        assert!(a["predicted"]["step_seconds_estimated"].is_string(), "{a}");
    }
}

/// `plan --measure auto` times for real only the configs that can win: a config whose fastest
/// estimated step within the budget is over 1.25x the cost model's estimate of the fastest
/// measured config keeps its estimate, brought to the measured steps' pace and labelled, and
/// is never the plan (its scaled step is over 1.25x the fastest measured one); a config that
/// cannot fit is never timed. Which configs
/// those are depends on this CPU, so the test holds the rule, not a choice; `--measure meta`
/// times every config.
#[test]
fn plan_times_only_the_configs_that_can_win() {
    let dir = tempfile::tempdir().unwrap();
    for (budget, measure) in [("100GiB", "auto"), ("0%", "auto"), ("100GiB", "meta")] {
        let out = dir
            .path()
            .join(format!("plan-{measure}-{}.json", budget.replace('%', "pct")));
        let mut args = vec![
            "plan",
            "--budget",
            budget,
            "tiny-bert",
            "--measure",
            measure,
            "--threads",
            "1",
        ];
        args.extend(["--no-cache", "--json", "-o", out.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&ok(&args).stderr).into_owned();
        let plan = read(&out);
        // With nothing to checkpoint (the whole budget), `auto` times the chosen config's steps
        // with nothing checkpointed only; a budget that forces checkpointing times both kinds.
        let chosen = format!("note: {}/", plan["config"]["precision"].as_str().unwrap());
        let plain_only = stderr.lines().any(|l| {
            l.starts_with(&chosen)
                && l.contains("its fastest choice checkpoints nothing, so only its steps with nothing checkpointed")
        });
        assert_eq!(
            plain_only,
            (budget, measure) == ("100GiB", "auto"),
            "{budget} --measure {measure}: {stderr}"
        );
        let alternatives = plan["alternatives"].as_array().unwrap();
        let estimated = |a: &Value| !a["predicted"]["step_seconds_estimated"].is_null();
        let seconds = |a: &Value| a["predicted"]["step_seconds"].as_f64().unwrap();
        assert!(
            plan["predicted"]["step_seconds_estimated"].is_null(),
            "{budget}: the plan's step was timed"
        );
        let fastest = alternatives
            .iter()
            .filter(|a| !estimated(a) && a["feasible"] == true)
            .map(seconds)
            .fold(f64::INFINITY, f64::min);
        assert_eq!(
            plan["predicted"]["step_seconds"].as_f64(),
            Some(fastest),
            "{budget}: the fastest timed config"
        );
        for a in alternatives.iter().filter(|a| estimated(a)) {
            assert_eq!(measure, "auto", "--measure meta times every config");
            let config = a["config"]["precision"].as_str().unwrap();
            // Its estimate is brought to the pace of the steps timed, and says so.
            let label = a["predicted"]["step_seconds_estimated"].as_str().unwrap();
            assert!(
                label.contains("scaled by") && label.contains("measured step took"),
                "{label}"
            );
            if a["feasible"] == true {
                assert!(
                    seconds(a) > 1.25 * fastest,
                    "{budget}: {config} may win and was not timed"
                );
                assert!(
                    stderr.contains("not timed for real, as the cost model puts them over")
                        && stderr.contains("1.25x its estimate of the fastest measured config"),
                    "{stderr}"
                );
            } else {
                assert!(
                    stderr.contains("not timed for real, as no checkpoint set fits"),
                    "{stderr}"
                );
            }
            assert!(
                stderr.contains(&format!("{config}/")),
                "{budget}: {config} not named in {stderr}"
            );
        }
    }
}

/// Flat CPU rates at `scale` times 100 GFLOP/s, 50 GFLOP/s and 20 GB/s, cached where
/// `cost::cpu_rates` reads them under `xdg` for one thread: what a calibration leaves there.
fn cache_rates(xdg: &Path, scale: f64) -> ckptune_solver::rates::DeviceRates {
    use ckptune_runtime::cost::{cpu_identity, CALIBRATION_VERSION};
    use ckptune_solver::formats::{self, CachedRates};
    use ckptune_solver::rates::{Curve, DeviceRates, Dtype};
    let rates = DeviceRates {
        device: "cpu".into(),
        name: cpu_identity(),
        measured: true,
        source: format!("test rates x{scale}"),
        threads: Some(1),
        matmul: vec![Curve::flat(Dtype::Fp32, 1e11 * scale)],
        matmul_thin: Vec::new(),
        matmul_transposed: Vec::new(),
        conv: vec![Curve::flat(Dtype::Fp32, 5e10 * scale)],
        conv_shapes: Vec::new(),
        conv_backward: Vec::new(),
        conv_setup: Vec::new(),
        bandwidth: vec![Curve::flat(Dtype::Fp32, 2e10 * scale)],
        bandwidth_in_place: Vec::new(),
        overhead_seconds: 2e-6 / scale,
        ops: Vec::new(),
        op_setup: Vec::new(),
        attention: None,
        block_overhead: None,
        host: None,
    };
    let doc = CachedRates {
        format: formats::RATES_FORMAT.into(),
        key: format!("{} | threads 1 | calibration {CALIBRATION_VERSION}", cpu_identity()),
        rates: rates.clone(),
        other_cores: Some(0.0),
    };
    formats::write_atomic(&xdg.join("ckptune/rates/cpu-1-threads.json"), &doc).unwrap();
    rates
}

#[test]
fn a_cached_estimate_is_estimated_again_over_rates_calibrated_since() {
    let dir = tempfile::tempdir().unwrap();
    let (xdg, profiles) = (dir.path().join("xdg"), dir.path().join("profiles"));
    let estimate = |name: &str| {
        let out = dir.path().join(name);
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_ckptune"))
            .args([
                "profile",
                "tiny-bert",
                "--batch",
                "4",
                "--seq",
                "16",
                "--precision",
                "fp32",
            ])
            .args([
                "--optimizer",
                "sgd",
                "--measure",
                "estimate",
                "--threads",
                "1",
                "--quiet",
            ])
            .arg("-o")
            .arg(&out)
            .env("XDG_CACHE_HOME", &xdg)
            .env("CKPTUNE_CACHE", &profiles)
            .status()
            .expect("runs ckptune");
        assert!(status.success(), "{name}");
        let p = read(&out);
        let c = &p["configs"][0];
        (
            c["seconds_all"]["median"].as_f64().unwrap(),
            c["estimated"]["rates"].clone(),
        )
    };
    let slow = serde_json::to_value(cache_rates(&xdg, 1.0)).unwrap();
    let (first, rates) = estimate("first.json");
    assert_eq!(rates, slow);
    // Cached: the same profile back.
    assert_eq!(estimate("cached.json"), (first, slow));
    // Calibrated again, twice as fast at everything: estimated again, in half the time.
    let fast = serde_json::to_value(cache_rates(&xdg, 2.0)).unwrap();
    let (second, rates) = estimate("second.json");
    assert_eq!(rates, fast);
    assert!(
        (second - first / 2.0).abs() <= 1e-9 * first,
        "{first} s, then {second} s"
    );
}
