//! Build script shared by the crates that link libtorch through `ckptune-kernels`: gives their
//! tests, examples and binaries an rpath to libtorch, so nothing needs `LD_LIBRARY_PATH`.
//! (`cargo:rustc-link-arg` only reaches the targets of the package whose build script emits it,
//! hence one copy per package, all from this file.)

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_CKPTUNE_SHIM_LIBTORCH_LIB");
    match std::env::var("DEP_CKPTUNE_SHIM_LIBTORCH_LIB") {
        Ok(lib) => println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}"),
        Err(_) => {
            eprintln!("error: ckptune-kernels did not export its libtorch lib directory; run `scripts/setup`");
            std::process::exit(1);
        }
    }
}
