//! Compiles the C++ shim (`csrc/`) against the same libtorch headers and C++ ABI as torch-sys,
//! and gives every binary of the workspace an rpath to libtorch so nothing needs
//! `LD_LIBRARY_PATH`.

use std::env;
use std::path::{Path, PathBuf};

const FIX: &str = "run `scripts/setup` (it installs torch==2.13.0 from PyPI and links it as \
                   .libtorch, which .cargo/config.toml points LIBTORCH at)";

/// The shim's sources in `csrc/`, compiled on every build.
const SOURCES: [&str; 12] = [
    "shim.cpp",
    "meter.cpp",
    "fake.cpp",
    "meta_kernels.cpp",
    "optrace.cpp",
    "cpu_extras.cpp",
    "meta_conv.cpp",
    "meta_elementwise.cpp",
    "meta_attention.cpp",
    "learned_scratch.cpp",
    "sac.cpp",
    "cuda_reductions.cpp",
];

/// The headers they include.
const HEADERS: [&str; 6] = [
    "common.h",
    "meta_kernels.h",
    "cpu_extras.h",
    "meter.h",
    "shape_code.h",
    "sac.h",
];

fn main() {
    for f in SOURCES.iter().chain(&HEADERS) {
        println!("cargo:rerun-if-changed=csrc/{f}");
    }
    println!("cargo:rerun-if-changed=csrc/cuda_shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");

    // torch-sys (links = "tch") exports the lib dir it linked against; use the same one.
    let lib = match env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(lib) => PathBuf::from(lib),
        Err(_) => fail("torch-sys did not report its libtorch lib directory (DEP_TCH_LIBTORCH_LIB)"),
    };
    // .../torch/lib -> .../torch, where include/ lives for a PyPI torch package.
    let root = env::var("LIBTORCH")
        .map(PathBuf::from)
        .unwrap_or_else(|_| lib.parent().map(Path::to_path_buf).unwrap_or_default());
    // The PyPI CUDA packages (libnvrtc among them) sit next to torch in site-packages;
    // `nvrtc.rs` looks for them relative to this directory at run time.
    let root_abs = root.canonicalize().unwrap_or_else(|_| root.clone());
    println!("cargo:rustc-env=CKPTUNE_LIBTORCH_DIR={}", root_abs.display());
    let includes = [root.join("include"), root.join("include/torch/csrc/api/include")];
    if !includes[0].join("torch/script.h").exists() {
        fail(&format!("libtorch headers not found under {}", includes[0].display()));
    }
    // torch-sys compiles with LIBTORCH_CXX11_ABI (default 1); a mismatch links but crashes.
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());

    structured_ops(&root);

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .includes(&includes)
        .include(env::var("OUT_DIR").unwrap_or_default())
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        // As libtorch itself is built: its headers' debug-only assertions stay out.
        .define("NDEBUG", None)
        // libtorch's headers are not warning-clean under -Wall; our own code is small.
        .warnings(false)
        .files(SOURCES.iter().map(|f| format!("csrc/{f}")));

    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // The CUDA runtime headers come with the PyPI wheel's nvidia-cuda-runtime package next
        // to torch in site-packages; its `crt/` sub-headers ship only with triton's bundled
        // CUDA headers (also a torch dependency), searched second.
        let cuda_include = root.join("../nvidia/cu13/include");
        let crt_include = root.join("../triton/backends/nvidia/include");
        for (dir, header) in [
            (&cuda_include, "cuda_runtime_api.h"),
            (&crt_include, "crt/host_config.h"),
        ] {
            if !dir.join(header).exists() {
                fail(&format!(
                    "feature `cuda`: CUDA header {header} not found in {} (expected from torch's PyPI dependencies)",
                    dir.display()
                ));
            }
        }
        build
            .include(cuda_include)
            .include(crt_include)
            .file("csrc/cuda_shim.cpp");
        println!("cargo:rustc-link-lib=c10_cuda");
    }
    build.compile("ckptune_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in ["torch_cpu", "torch", "c10"] {
        println!("cargo:rustc-link-lib={l}");
    }
    // rustc-link-arg from a library's build script reaches only this package's own targets, so
    // the path is also exported (cargo:libtorch_lib -> DEP_CKPTUNE_SHIM_LIBTORCH_LIB) for the
    // other crates' build scripts to emit the same rpath.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:libtorch_lib={}", lib.display());
}

/// Writes `structured_ops.inc`: the names (`add.Tensor`, `mm`) of the operators whose meta
/// kernel is a structured kernel's shape function, as libtorch's own `native_functions.yaml`
/// lists them. Fake mode (`csrc/fake.cpp`) hands those its fake tensors, which report the CPU, so
/// that their shape functions make the temporaries the CPU kernels make (TensorIterator's dtype
/// promotions); other meta kernels get meta aliases.
fn structured_ops(root: &Path) {
    let yaml = root.join("../torchgen/packaged/ATen/native/native_functions.yaml");
    println!("cargo:rerun-if-changed={}", yaml.display());
    let text = std::fs::read_to_string(&yaml)
        .unwrap_or_else(|e| fail(&format!("reading {} (torchgen ships with torch): {e}", yaml.display())));
    let mut names = Vec::new();
    let mut current: Option<&str> = None;
    for line in text.lines() {
        if let Some(func) = line.strip_prefix("- func: ") {
            current = func.split('(').next();
        } else if line.starts_with("  structured: True") || line.starts_with("  structured_delegate:") {
            if let Some(name) = current.take() {
                names.push(format!("\"{name}\",\n"));
            }
        }
    }
    if names.len() < 100 {
        fail(&format!(
            "{} lists only {} structured operators",
            yaml.display(),
            names.len()
        ));
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap_or_default()).join("structured_ops.inc");
    if let Err(e) = std::fs::write(&out, names.concat()) {
        fail(&format!("writing {}: {e}", out.display()));
    }
}

fn fail(what: &str) -> ! {
    eprintln!("error: ckptune-kernels: {what}; {FIX}");
    std::process::exit(1);
}
