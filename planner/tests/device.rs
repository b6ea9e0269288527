//! `--device`: `auto` (the default) measures on CUDA when a device is visible, else on the CPU,
//! and says which and why; `--device cuda` where none is visible is bad input (exit 2, nothing
//! written) naming what was looked for — the same reason `auto` gave.

mod common;

use common::{ok, read, refused};

const MODEL: [&str; 9] = [
    "tiny-bert",
    "--seq",
    "16",
    "--batch",
    "2",
    "--precision",
    "fp32",
    "--threads",
    "1",
];

#[test]
fn auto_says_what_it_chose_and_cuda_where_none_is_visible_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", "1GiB", "-o", plan.to_str().unwrap()];
    args.extend(MODEL);
    let out = ok(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let p = read(&plan);
    let notes: Vec<&str> = p["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    let note = notes
        .iter()
        .find(|n| n.starts_with("--device auto: "))
        .unwrap_or_else(|| panic!("no --device note in {notes:?}"));
    assert!(stderr.contains(note), "{stderr}");
    let on_cpu = note.contains("no CUDA device is visible");
    assert_eq!(p["device"]["device"] == "cpu", on_cpu, "{note}: {}", p["device"]);
    if on_cpu {
        // What auto looked for and did not find is why --device cuda is refused.
        let why = note
            .split_once(" (")
            .and_then(|(_, rest)| rest.split_once("), so"))
            .map(|(why, _)| why)
            .unwrap();
        let out = dir.path().join("cuda.json");
        let mut args = vec![
            "plan",
            "--budget",
            "1GiB",
            "--device",
            "cuda",
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend(MODEL);
        refused(
            &args,
            &["--device cuda: no CUDA device is visible", why, "--device cpu"],
        );
        assert!(!out.exists());
    }
    let mut args = vec!["profile", "--device", "tpu"];
    args.extend(MODEL);
    refused(&args, &["--device \"tpu\"", "auto, cpu or cuda"]);
}
