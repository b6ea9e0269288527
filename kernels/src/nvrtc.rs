//! NVRTC: compiles ckptune's CUDA sources to PTX at run time, finding `libnvrtc` without
//! `LD_LIBRARY_PATH`.
//!
//! cudarc loads libnvrtc by soname (`libnvrtc.so.13`, …) with `dlopen`, which searches only
//! `LD_LIBRARY_PATH`, the executable's RUNPATH and the ld.so cache. The libnvrtc ckptune expects
//! is the one the PyPI package `nvidia-cuda-nvrtc` (a torch dependency) installs next to torch in
//! site-packages, where none of those look. So [`locate`] first `dlopen`s it by absolute path
//! (relative to the libtorch directory `build.rs` saw) and keeps it loaded: glibc answers a later
//! `dlopen` by soname with an already-loaded object whose `DT_SONAME` matches, so cudarc's own
//! lookup then finds it. libnvrtc in turn `dlopen`s `libnvrtc-builtins.so.<major>.<minor>` by
//! soname when it compiles, so that library is pre-loaded the same way (verified: without it,
//! compiling fails with "failed to open libnvrtc-builtins").

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::KernelError;

/// Set at build time by `build.rs`: the libtorch directory (site-packages/torch for a PyPI
/// install), whose sibling `nvidia/` holds the CUDA libraries torch was built with.
const LIBTORCH_DIR: &str = env!("CKPTUNE_LIBTORCH_DIR");

/// An explicit libnvrtc to use instead of the search (a path to `libnvrtc.so.*`).
pub const ENV_OVERRIDE: &str = "CKPTUNE_NVRTC";

/// Where libnvrtc was found and which version it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nvrtc {
    /// The file loaded by absolute path; `None` when cudarc's soname search found it (an
    /// `LD_LIBRARY_PATH` or system install).
    pub path: Option<PathBuf>,
    pub version: (i32, i32),
}

/// The libnvrtc files tried, in order: `$CKPTUNE_NVRTC`, the PyPI packages next to libtorch
/// (CUDA 13 layout, then CUDA 12's), a system CUDA toolkit.
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(ENV_OVERRIDE) {
        out.push(PathBuf::from(p));
    }
    // build.rs canonicalized the directory, so its parent is site-packages itself.
    let torch = Path::new(LIBTORCH_DIR);
    let site = torch.parent().unwrap_or(torch);
    out.push(site.join("nvidia/cu13/lib/libnvrtc.so.13"));
    out.push(site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
    for dir in ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"] {
        out.push(Path::new(dir).join("libnvrtc.so"));
    }
    out
}

/// Finds and loads libnvrtc once per process; later calls return the same answer. The error
/// lists every place looked at.
pub fn locate() -> Result<&'static Nvrtc, KernelError> {
    static FOUND: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
    FOUND.get_or_init(find).as_ref().map_err(|message| KernelError::Nvrtc {
        op: "locating libnvrtc",
        message: message.clone(),
    })
}

fn find() -> Result<Nvrtc, String> {
    let mut tried = Vec::new();
    for path in candidates() {
        if !path.is_file() {
            tried.push(format!("{} (absent)", path.display()));
            continue;
        }
        match preload(&path) {
            Ok(()) => {
                let version = version()?;
                return Ok(Nvrtc {
                    path: Some(path),
                    version,
                });
            }
            Err(e) => tried.push(format!("{} ({e})", path.display())),
        }
    }
    // SAFETY: only tries to dlopen libnvrtc by its sonames; no NVRTC call is made.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(Nvrtc {
            path: None,
            version: version()?,
        });
    }
    tried.push("libnvrtc.so* by soname (LD_LIBRARY_PATH, ld.so cache): not found".into());
    Err(format!(
        "no usable libnvrtc; looked at: {}. Install the PyPI package nvidia-cuda-nvrtc (a torch \
         dependency) or set {ENV_OVERRIDE} to a libnvrtc.so",
        tried.join("; ")
    ))
}

/// NVRTC's version, once the library is known to load (cudarc panics if it does not).
fn version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loaded (pre-loaded by path or found by cudarc's probe), so cudarc's
    // symbol lookup succeeds; the out-pointers are valid locals.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    status.result().map_err(|e| format!("nvrtcVersion failed: {e:?}"))?;
    Ok((major, minor))
}

// glibc's dynamic loader (in libc proper since glibc 2.34, which every supported distribution
// ships; libtorch itself links against it too).
extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}
const RTLD_NOW: c_int = 0x2;
const RTLD_GLOBAL: c_int = 0x100;

/// Loads `lib` and then its builtins companion from the same directory, both for the life of the
/// process (the handles are deliberately never closed, as cudarc never closes its own).
fn preload(lib: &Path) -> Result<(), String> {
    dl_open(lib)?;
    let dir = lib.parent().unwrap_or(Path::new("."));
    let mut builtins: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("listing {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                // `.alt` is NVIDIA's alternative build for a different C++ runtime; libnvrtc
                // asks for the plain one.
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so.") && !n.contains(".alt"))
        })
        .collect();
    builtins.sort();
    for b in &builtins {
        dl_open(b)?;
    }
    Ok(())
}

fn dl_open(path: &Path) -> Result<(), String> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| "path holds a NUL byte".to_owned())?;
    // SAFETY: `c` is a valid NUL-terminated path. RTLD_GLOBAL makes the symbols visible to the
    // later soname lookups; loading runs the library's initializers, which for libnvrtc only set
    // up its own state.
    let handle = unsafe { dlopen(c.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
        let msg = unsafe { dlerror() };
        let msg = if msg.is_null() {
            "dlopen failed".to_owned()
        } else {
            unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
        };
        return Err(msg);
    }
    Ok(())
}

/// Compiles CUDA C++ `src` (named `name` in messages) to PTX. `options` are NVRTC flags, e.g.
/// `--fmad=false`. Errors carry NVRTC's log.
pub fn compile(name: &str, src: &str, options: &[&str]) -> Result<Ptx, KernelError> {
    const OP: &str = "compiling a CUDA kernel with NVRTC";
    locate()?;
    if src.contains('\0') || name.contains('\0') {
        return Err(KernelError::Invalid {
            op: OP,
            message: format!("source {name:?} holds a NUL byte"),
        });
    }
    let opts = CompileOptions {
        name: Some(name.to_owned()),
        options: options.iter().map(|o| (*o).to_owned()).collect(),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| KernelError::Nvrtc {
        op: OP,
        message: match e {
            CompileError::CompileError { nvrtc, options, log } => format!(
                "{name}: {nvrtc:?} with options {options:?}:\n{}",
                log.to_string_lossy().trim()
            ),
            other => format!("{name}: {other}"),
        },
    })
}
