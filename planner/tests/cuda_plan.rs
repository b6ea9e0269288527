//! `plan --target cuda:NAME` from the meta device: the plan is judged on the caching
//! allocator's simulated reserved peak plus the CUDA context. Its numbers are the simulator's
//! on the plan's own trace (written with `--alloc-trace` and replayed by `simulate-allocator`,
//! the exact reference), the recommended setting is the candidate with the lowest reserved
//! peak or `expandable_segments:True` within `EXPANDABLE_MARGIN_PERCENT` of it, and a budget the
//! plan's tensors fit but its reserved memory does not is tightened until reserved + context
//! fit.

mod common;

use std::path::Path;

use ckptune_solver::caching_allocator::EXPANDABLE_MARGIN_PERCENT;
use common::{ok, read, refused};
use serde_json::Value;

const MODEL: [&str; 7] = ["resnet18", "--batch", "32", "--image", "128", "--precision", "fp32"];

fn plan(dir: &Path, name: &str, budget: &str) -> (Value, String) {
    let out = dir.join(format!("{name}.json"));
    let trace = dir.join(format!("{name}.trace.json"));
    let mut args = vec!["plan", "--budget", budget];
    args.extend(MODEL);
    args.extend(["--optimizer", "adamw", "--threads", "1", "--target", "cuda:h100", "-o"]);
    args.push(out.to_str().unwrap());
    args.extend(["--alloc-trace", trace.to_str().unwrap()]);
    let printed = String::from_utf8_lossy(&ok(&args).stdout).into_owned();
    // Its numbers are the GPU's: the header says so before the table.
    assert!(
        printed.starts_with("resnet18 for cuda:h100, measured on cpu (1 thread), budget "),
        "{printed}"
    );
    (read(&out), trace.to_string_lossy().into_owned())
}

fn int(v: &Value) -> i64 {
    v.as_i64().unwrap_or_else(|| panic!("not an integer: {v}"))
}

/// The peaks `simulate-allocator` gives the trace under `conf`: the highest over its spans.
fn simulated(trace: &str, conf: &str) -> (i64, i64) {
    let out = ok(&["simulate-allocator", trace, "--alloc-conf", conf, "--json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let spans = doc["spans"].as_array().unwrap();
    let peak = |key: &str| spans.iter().map(|s| int(&s[key])).max().unwrap();
    (peak("peak_allocated_bytes"), peak("peak_reserved_bytes"))
}

/// The plan's figures against the simulator run on its trace, setting by setting.
fn check_against_the_simulator(p: &Value, trace: &str) {
    let c = &p["cuda_memory"];
    let candidates = c["candidates"].as_array().unwrap();
    assert!(candidates.len() >= 2, "{c}");
    for k in candidates {
        let conf = k["alloc_conf"].as_str().unwrap();
        let (allocated, reserved) = simulated(trace, conf);
        assert_eq!(allocated, int(&k["allocated_peak_bytes"]), "{conf}");
        assert_eq!(reserved, int(&k["reserved_peak_bytes"]), "{conf}");
    }
    let lowest = candidates.iter().map(|k| int(&k["reserved_peak_bytes"])).min().unwrap();
    let expandable = candidates
        .iter()
        .find(|k| k["alloc_conf"] == "expandable_segments:True")
        .map(|k| int(&k["reserved_peak_bytes"]))
        .unwrap();
    let recommended = if expandable * 100 <= lowest * (100 + EXPANDABLE_MARGIN_PERCENT as i64) {
        expandable
    } else {
        lowest
    };
    assert_eq!(int(&c["predicted_reserved_peak_bytes"]), recommended, "{c}");
    let chosen = candidates.iter().find(|k| k["alloc_conf"] == c["alloc_conf"]).unwrap();
    assert_eq!(int(&chosen["reserved_peak_bytes"]), recommended, "{c}");
    assert_eq!(
        (int(&c["predicted_allocated_peak_bytes"]), recommended),
        simulated(trace, c["alloc_conf"].as_str().unwrap())
    );
    // The trace holds the step's tensors and the two cuBLAS workspaces.
    let workspaces: i64 = c["workspace_bytes"].as_array().unwrap().iter().map(int).sum();
    assert!(int(&c["predicted_allocated_peak_bytes"]) >= int(&p["predicted"]["peak_bytes"]) + workspaces);
    assert_eq!(int(&p["reserve_bytes"]), int(&c["context_bytes"]));
    assert_eq!(
        int(&p["margin_bytes"]),
        int(&p["budget_bytes"]) - int(&c["context_bytes"]) - recommended
    );
}

#[test]
fn a_plan_whose_tensors_fit_but_whose_reserved_memory_does_not_is_tightened() {
    let dir = tempfile::tempdir().unwrap();
    let (free, trace) = plan(dir.path(), "free", "1TiB");
    check_against_the_simulator(&free, &trace);
    let c = &free["cuda_memory"];
    let context = int(&c["context_bytes"]);
    let (allocated, reserved) = (
        int(&c["predicted_allocated_peak_bytes"]),
        int(&c["predicted_reserved_peak_bytes"]),
    );
    assert!(
        reserved > allocated,
        "the unconstrained step must fragment for this test: {c}"
    );

    // A budget the unconstrained plan's tensors fit, workspaces included, but not what the
    // allocator reserves for them: halfway between.
    let budget = (context + (allocated + reserved) / 2).to_string();
    let (tight, trace) = plan(dir.path(), "tight", &budget);
    check_against_the_simulator(&tight, &trace);
    let t = &tight["cuda_memory"];
    let rounds = t["rounds"].as_array().unwrap();
    assert!(rounds.len() >= 2, "{t}");
    let first = &rounds[0];
    assert_eq!(first["regex"], free["checkpoint"]["regex"], "{t}");
    assert!(
        int(&first["allocated_peak_bytes"]) + context <= int(&tight["budget_bytes"]),
        "{t}"
    );
    assert!(
        int(&first["reserved_peak_bytes"]) + context > int(&tight["budget_bytes"]),
        "{t}"
    );
    let last = rounds.last().unwrap();
    assert_eq!(last["regex"], tight["checkpoint"]["regex"]);
    assert_eq!(
        int(&last["reserved_peak_bytes"]),
        int(&t["predicted_reserved_peak_bytes"])
    );
    assert!(
        int(&t["predicted_reserved_peak_bytes"]) + context <= int(&tight["budget_bytes"]),
        "{t}"
    );
    assert!(int(&tight["margin_bytes"]) >= 0);
}

#[test]
fn an_allocation_trace_needs_a_simulated_cuda_plan() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let mut args = vec!["plan", "--budget", "1TiB"];
    args.extend(MODEL);
    args.extend(["--alloc-trace", trace.to_str().unwrap()]);
    refused(&args, &["--alloc-trace", "--target cuda"]);
    args.extend(["--target", "cuda", "--reserve", "1GiB"]);
    refused(&args, &["--alloc-trace", "--reserve"]);
    assert!(!trace.exists());
}

/// A model only a real run measures (a value read in its forward) cannot be recorded on the
/// meta device: its CUDA plan keeps the fixed reserve and says why.
#[test]
fn a_step_the_meta_device_cannot_record_keeps_the_fixed_reserve() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let model = common::fixture("meta_item.pt2");
    ok(&[
        "plan",
        "--budget",
        "4GiB",
        &model,
        "--batch",
        "4",
        "--precision",
        "fp32",
        "--measure",
        "run",
        "--threads",
        "1",
        "--target",
        "cuda",
        "-o",
        out.to_str().unwrap(),
    ]);
    let p = read(&out);
    assert!(p.get("cuda_memory").is_none(), "{p}");
    let budget = int(&p["budget_bytes"]);
    assert_eq!(int(&p["reserve_bytes"]), (1 << 30) + budget / 10);
    let notes = p["notes"].to_string();
    assert!(notes.contains("could not be recorded on the meta device"), "{notes}");
    assert!(notes.contains("kept in reserve"), "{notes}");
}

/// `plan --target cuda` of tiny BERT under `budget`, measured `measure`, written to `out`.
fn tiny_bert_for_a_gpu(budget: &str, measure: &str, out: &Path) -> std::process::Output {
    let args = [
        "plan",
        "--budget",
        budget,
        "tiny-bert",
        "--batch",
        "4",
        "--seq",
        "32",
        "--precision",
        "fp32",
        "--optimizer",
        "adamw",
        "--threads",
        "1",
        "--measure",
        measure,
        "--target",
        "cuda",
        "--no-cache",
        "-o",
    ];
    let mut args = args.to_vec();
    args.push(out.to_str().unwrap());
    common::ckptune(&args)
}

/// A budget barely above the context and workspaces: tightening takes the planning budget below
/// zero, and the plan fails as any plan that does not fit (exit 1, saying so), not as bad input.
#[test]
fn a_budget_that_only_holds_the_context_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    // The unnamed GPU's context (734,855,168 B) and two 32 MiB workspaces, plus 1 MB.
    let budget = (734_855_168u64 + 2 * 32 * 1024 * 1024 + 1_000_000).to_string();
    let run = tiny_bert_for_a_gpu(&budget, "estimate", &out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("fits the budget") || stderr.contains("fit the budget"),
        "{stderr}"
    );
    assert!(!out.exists());
}

/// With times from real steps (`--measure auto`), a plan for a GPU keeps the meta device's
/// memory, traced with CUDA's kernels: the CPU's step is timed, never measured for the GPU's
/// bytes. Tiny BERT's dropout and attention run other kernels on the CPU (so the two steps do
/// not line up operator for operator); its unconstrained peak must equal the one measured with
/// nothing run for real (`--measure estimate`).
#[test]
fn a_plan_for_a_gpu_timed_on_real_steps_keeps_the_gpus_memory() {
    let dir = tempfile::tempdir().unwrap();
    let peak = |measure: &str| {
        let out = dir.path().join(format!("{measure}.json"));
        let run = tiny_bert_for_a_gpu("1TiB", measure, &out);
        let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
        assert!(run.status.success(), "{stderr}");
        assert!(!stderr.contains("does not line up"), "{stderr}");
        int(&read(&out)["predicted"]["peak_bytes"])
    };
    assert_eq!(peak("auto"), peak("estimate"));
}
