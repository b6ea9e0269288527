//! Set-up shared by the runtime's tests: sessions on the toy chain, a quick profile, the
//! bitwise comparison of named tensors, and the venv's Python for PyTorch references. Each test
//! file uses what it needs.
#![allow(dead_code)]

pub mod terms;

use ckptune_models::toy::{toy, ToyConfig};
use ckptune_runtime::profile::{profile, ConfigProfile, ProfileSettings, RetimePolicy};
use ckptune_runtime::{Session, TrainConfig};
use tch::{Device, Tensor};

/// A session on the toy chain with seeded weights.
pub fn toy_session(toy_cfg: &ToyConfig, cfg: TrainConfig) -> Session {
    tch::manual_seed(42);
    Session::new(toy(toy_cfg, Device::Cpu), cfg, Device::Cpu).expect("session")
}

/// A profile with one timed repeat (memory needs no more), no re-timing and no progress bar.
pub fn quick_profile(s: &mut Session) -> ConfigProfile {
    profile(
        s,
        &ProfileSettings {
            repeats: 1,
            quiet: true,
            retime: RetimePolicy::never(),
            ..Default::default()
        },
    )
    .expect("profile")
}

/// Every subset of `n` blocks as masks.
pub fn subsets(n: usize) -> Vec<Vec<bool>> {
    (0..1u32 << n)
        .map(|m| (0..n).map(|i| m >> i & 1 == 1).collect())
        .collect()
}

/// Two lists of named tensors are equal bit for bit (undefined gradients match undefined).
pub fn assert_bitwise(what: &str, a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_eq!(a.len(), b.len(), "{what}: as many tensors");
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert_eq!(ta.defined(), tb.defined(), "{what}: {na} defined");
        if ta.defined() {
            assert!(ta.equal(tb), "{what}: {na} differs");
        }
    }
}

/// The venv's Python (`CKPTUNE_PYTHON`, set by .cargo/config.toml) running a PyTorch reference
/// script from `tests/fixtures/` with `args`; its standard output parsed as JSON.
pub fn python_reference(script: &str, args: &[String]) -> serde_json::Value {
    let py = std::env::var("CKPTUNE_PYTHON")
        .ok()
        .or_else(|| option_env!("CKPTUNE_PYTHON").map(str::to_string))
        .expect("CKPTUNE_PYTHON is not set: run `scripts/setup`, then the tests through cargo");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(script);
    let out = std::process::Command::new(py)
        .arg(&path)
        .args(args)
        .output()
        .expect("starting CKPTUNE_PYTHON");
    assert!(
        out.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script} prints JSON: {e}"))
}
