//! The Python companion (`python/`) against the real binary: in the plain-PyTorch reference
//! model, a plan written by `ckptune plan` wraps exactly the modules it names; and the package
//! installs from the checkout with the venv's pip, offline.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{ok, read, COMMON};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The venv `scripts/setup` links into the checkout: the Python with torch.
fn python() -> Command {
    Command::new(root().join(".venv/bin/python"))
}

fn succeeded(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `python -c APPLY plan.json reference.py`: applies the plan to the reference tiny-BERT and
/// prints the wrapped names as JSON.
const APPLY: &str = r#"
import importlib.util, json, sys
import ckptune
spec = importlib.util.spec_from_file_location("reference", sys.argv[2])
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
model, prefix = reference.build("tiny-bert")
# Plan names are the backbone's: ckptune drops a task wrapper's prefix (`bert.`).
backbone = model.get_submodule(prefix.rstrip("."))
print(json.dumps(ckptune.apply(backbone, sys.argv[1])))
"#;

#[test]
fn a_plan_wraps_the_modules_it_names_in_the_reference_model() {
    let dir = tempfile::tempdir().unwrap();
    let shape = ["tiny-bert", "--batch", "4", "--seq", "16", "--precision", "fp32"];
    let profile = dir.path().join("profile.json");
    let mut args = vec!["profile"];
    args.extend(shape);
    args.extend(["-o", profile.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let c = &read(&profile)["configs"][0];
    let (none, all) = (c["peak_none"].as_i64().unwrap(), c["peak_all"].as_i64().unwrap());
    assert!(all < none, "checkpointing everything saves memory ({all} < {none})");

    // A budget between the two peaks forces some checkpointing.
    let budget = ((all + none) / 2).to_string();
    let plan = dir.path().join("plan.json");
    let mut args = vec!["plan", "--budget", &budget];
    args.extend(shape);
    args.extend(["--profile", profile.to_str().unwrap(), "-o", plan.to_str().unwrap()]);
    args.extend(COMMON);
    ok(&args);
    let planned = read(&plan)["checkpoint"]["modules"].clone();
    assert!(
        !planned.as_array().unwrap().is_empty(),
        "the budget forces checkpointing: {planned}"
    );

    let out = python()
        .args(["-c", APPLY])
        .arg(&plan)
        .arg(root().join("models/fixtures/reference.py"))
        .env("PYTHONPATH", root().join("python"))
        .output()
        .expect("runs the venv's python");
    let wrapped: Value = serde_json::from_str(&succeeded("ckptune.apply", out)).expect("JSON names");
    assert_eq!(wrapped, planned);
}

#[test]
fn the_package_installs_from_the_checkout_offline() {
    let target = tempfile::tempdir().unwrap();
    // --no-index: nothing may come from the network; --no-build-isolation: the venv's
    // setuptools builds it.
    let out = python()
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
        ])
        .args(["--no-deps", "--no-build-isolation", "--target"])
        .arg(target.path())
        .arg(root().join("python"))
        .output()
        .expect("runs the venv's pip");
    succeeded("pip install python/", out);

    // Run from the target, so the checkout's python/ cannot be what gets imported.
    let out = python()
        .args(["-c", "import ckptune; print(ckptune.__file__); print(ckptune.FORMAT)"])
        .current_dir(target.path())
        .env("PYTHONPATH", target.path())
        .output()
        .expect("runs the venv's python");
    let text = succeeded("import ckptune", out);
    let mut lines = text.lines();
    let file = Path::new(lines.next().unwrap()).canonicalize().unwrap();
    assert!(file.starts_with(target.path().canonicalize().unwrap()), "{file:?}");
    assert_eq!(lines.next(), Some("ckptune.plan/1"));
}
