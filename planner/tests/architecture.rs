//! ARCHITECTURE.md's invariants, checked: dependencies point one way (the solver crate has no
//! libtorch anywhere below it; models and kernels know nothing of planning; the runtime
//! nothing of the binary), only `kernels/` has native code, and serde appears only in the
//! formats module and the profile types it serializes (and in the readers of other tools' JSON:
//! torch.export's graphs and Hugging Face configs); imports inside a crate form a tree, and no
//! command reaches into another; files and functions stay short enough to read whole.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

#[path = "architecture/imports.rs"]
mod imports;
#[path = "architecture/source.rs"]
mod source;

use source::{functions, rust_files};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every package each workspace crate depends on, transitively (normal dependencies, all
/// features of the workspace build).
fn dependency_closure() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Only this machine's platform: other platforms' crates are not downloaded, and the
    // check must not need the network.
    let rustc = Command::new("rustc").arg("-vV").output().expect("runs rustc -vV");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc -vV names the host");
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--offline",
            "--filter-platform",
            &host,
        ])
        .arg("--manifest-path")
        .arg(root().join("Cargo.toml"))
        .output()
        .expect("runs cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}{}",
        String::from_utf8_lossy(&out.stderr),
        dev_null_note()
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let name_of: BTreeMap<&str, &str> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    // Normal (non-dev, non-build) edges of the resolved graph.
    let mut edges: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let id = node["id"].as_str().unwrap();
        let deps = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null()))
            .map(|d| d["pkg"].as_str().unwrap())
            .collect();
        edges.insert(id, deps);
    }
    let mut closure = BTreeMap::new();
    for member in meta["workspace_members"].as_array().unwrap() {
        let start = member.as_str().unwrap();
        let mut seen = BTreeSet::new();
        let mut stack = vec![start];
        while let Some(id) = stack.pop() {
            for &d in edges.get(id).map(Vec::as_slice).unwrap_or_default() {
                if seen.insert(name_of[d].to_string()) {
                    stack.push(d);
                }
            }
        }
        closure.insert(name_of[start].to_string(), seen);
    }
    closure
}

/// cargo's rustc probe reads /dev/null; where that is a regular file holding text, rustc fails
/// on the text, which says nothing about this project.
fn dev_null_note() -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata("/dev/null") {
        Ok(m) if m.file_type().is_char_device() => "",
        _ => "\n/dev/null is not the null device on this machine, so rustc read its text; scripts/setup replaces it (as root)",
    }
}

#[test]
fn dependencies_point_one_way() {
    let deps = dependency_closure();
    let has = |krate: &str, dep: &str| deps[krate].contains(dep);
    for libtorch in ["tch", "torch-sys", "ckptune-kernels"] {
        assert!(
            !has("ckptune-solver", libtorch),
            "the solver crate depends on {libtorch}"
        );
    }
    for upper in ["ckptune", "ckptune-runtime", "ckptune-solver"] {
        assert!(!has("ckptune-models", upper), "models depends on {upper}");
        assert!(!has("ckptune-kernels", upper), "kernels depends on {upper}");
    }
    assert!(
        !has("ckptune-runtime", "ckptune"),
        "the runtime depends on the binary's crate"
    );
    // The runtime reads the solver crate's profile types, memory model, rates and formats (the
    // calibration cache), never the solver.
    let mut files = Vec::new();
    rust_files(&root().join("runtime/src"), &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(
            !text.contains("ckptune_solver::solver"),
            "{} uses the solver",
            f.display()
        );
    }
    assert!(has("ckptune", "ckptune-solver") && has("ckptune", "ckptune-runtime"));
}

#[test]
fn serde_lives_in_the_formats_module() {
    let mut files = Vec::new();
    for krate in [
        "planner/src",
        "planner/solver/src",
        "runtime/src",
        "models/src",
        "kernels/src",
    ] {
        rust_files(&root().join(krate), &mut files);
    }
    // ckptune's own documents are the formats module's; reading PyTorch's serialized programs
    // (torch.export's JSON graph) and a safetensors header (`shapes.rs`, fake mode) is the model
    // loader's, and it only reads.
    let allowed = |p: &Path| {
        let p = p.to_string_lossy();
        p.contains("planner/solver/src/formats/")
            || p.ends_with("planner/solver/src/profile.rs")
            || p.ends_with("planner/solver/src/rates.rs")
            || p.contains("models/src/export/")
            || p.ends_with("models/src/hf.rs")
            || p.ends_with("models/src/shapes.rs")
    };
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| !allowed(f))
        .filter(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.contains("serde::") || text.contains("serde_json::") || text.contains("use serde")
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(offenders.is_empty(), "serde outside the formats module: {offenders:?}");
}

#[test]
fn only_kernels_has_native_code() {
    let mut files = Vec::new();
    for dir in ["planner", "runtime", "models"] {
        collect_native(&root().join(dir), &mut files);
    }
    assert!(files.is_empty(), "native sources outside kernels/: {files:?}");
    let mut kernels = Vec::new();
    collect_native(&root().join("kernels"), &mut kernels);
    assert!(!kernels.is_empty(), "kernels/ has the shim");
}

fn collect_native(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect_native(&path, out);
        } else if ["cpp", "cc", "c", "cu", "h", "hpp"]
            .iter()
            .any(|e| path.extension().is_some_and(|x| x == *e))
        {
            out.push(path);
        }
    }
}

/// The crates whose source files must import one another as a tree.
const CRATES: [&str; 5] = [
    "models/src",
    "runtime/src",
    "planner/src",
    "planner/solver/src",
    "kernels/src",
];

#[test]
fn imports_form_a_tree_in_every_crate() {
    let mut circles = Vec::new();
    for krate in CRATES {
        for c in imports::graph(&root().join(krate)).circles() {
            circles.push(format!("{krate}:\n    {}", c.join("\n    ")));
        }
    }
    assert!(
        circles.is_empty(),
        "import circles (a piece two files share belongs in a file of its own, below both):\n{}",
        circles.join("\n")
    );
}

#[test]
fn no_command_imports_another() {
    let g = imports::graph(&root().join("planner/src"));
    // The command a module belongs to: `verify` for `cli::commands::verify::shard`.
    let command = |m: &str| {
        m.strip_prefix("cli::commands::")
            .map(|rest| rest.split("::").next().unwrap().to_owned())
    };
    let crossing: Vec<String> = g
        .edges
        .iter()
        .filter_map(|(from, to)| command(from).map(|c| (from, c, to)))
        .flat_map(|(from, c, to)| {
            to.iter()
                .filter(move |t| command(t).is_some_and(|d| d != c))
                .map(move |t| format!("{from} → {t}"))
        })
        .collect();
    assert!(
        crossing.is_empty(),
        "commands reaching into each other (shared logic lives beside them, in cli/): {crossing:?}"
    );
}

/// Lines a source file may have, and a function.
const FILE_LINES: usize = 800;
const FUNCTION_LINES: usize = 150;

#[test]
fn files_and_functions_can_be_read_whole() {
    let mut files = Vec::new();
    for dir in ["planner", "runtime", "models", "kernels"] {
        rust_files(&root().join(dir), &mut files);
    }
    let mut long = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let name = f.strip_prefix(root()).unwrap_or(f).display().to_string();
        let lines = text.lines().count();
        if lines > FILE_LINES {
            long.push(format!("{name}: {lines} lines"));
        }
        for func in functions(&text) {
            if func.lines > FUNCTION_LINES && !func.kept_whole {
                long.push(format!("{name}:{} fn {}: {} lines", func.line, func.name, func.lines));
            }
        }
    }
    assert!(
        long.is_empty(),
        "files over {FILE_LINES} lines or functions over {FUNCTION_LINES} (split them at their seams, or say \
         in a comment above the function why it stays whole):\n  {}",
        long.join("\n  ")
    );
}

/// Every repository path ARCHITECTURE.md and the docs it points to name in backticks or links
/// (those starting at a top-level folder: `runtime/src/exec/`, `docs/export.md`) exists, so
/// the map cannot point a newcomer at a file that was moved or removed.
#[test]
fn the_map_names_only_files_that_exist() {
    let tops = [
        "kernels/", "models/", "runtime/", "planner/", "python/", "scripts/", "docs/",
    ];
    let docs = [
        "ARCHITECTURE.md",
        "docs/memory-model.md",
        "docs/meta-device.md",
        "docs/export.md",
    ];
    let mut missing = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(root().join(doc)).unwrap();
        for path in named_paths(&text) {
            if tops.iter().any(|t| path.starts_with(t)) && !root().join(&path).exists() {
                missing.push(format!("{doc}: {path}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "paths that do not exist:\n  {}",
        missing.join("\n  ")
    );
}

/// The path-like words of a markdown text: backticked spans and link targets, cut at the first
/// character no path of this repository has (`exec.rs::step`, `fake.rs`)`).
fn named_paths(text: &str) -> Vec<String> {
    let backticked = text.split('`').skip(1).step_by(2);
    let linked = text.split("](").skip(1).filter_map(|s| s.split(')').next());
    backticked
        .chain(linked)
        .map(|s| {
            s.split(|c: char| !(c.is_alphanumeric() || "/._-".contains(c)))
                .next()
                .unwrap_or("")
        })
        .filter(|s| s.contains('/') && !s.contains("//"))
        .map(str::to_string)
        .collect()
}
