//! A real CPU session holds freed host memory for its life (kernels' `host_memory`: its steps
//! reuse their pages instead of faulting fresh ones in); a fake one, which allocates nothing,
//! does not. One test, so that no other session of this binary holds while it looks.

use ckptune_kernels::host_memory::HostMemoryHold;
use ckptune_models::{builtin, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, RuntimeError, Session, TrainConfig};
use tch::Device;

#[test]
fn a_real_cpu_session_holds_freed_memory_for_its_life() {
    let opts = ModelOptions {
        image: Some(32),
        ..Default::default()
    };
    let build = || builtin("tiny-resnet", &opts).map_err(|e| RuntimeError::Invalid(e.to_string()));
    let cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 2);
    assert!(!HostMemoryHold::held());

    let mut real = Session::new(build().unwrap(), cfg.clone(), Device::Cpu).unwrap();
    let none = vec![false; real.chain.blocks.len()];
    real.step(&none, None).unwrap();
    assert!(
        HostMemoryHold::held(),
        "a real CPU session's steps run with freed memory held"
    );
    drop(real);
    assert!(!HostMemoryHold::held(), "the hold ends with the last real session");

    let fake = Session::new_fake(build, cfg, Device::Cpu).unwrap();
    assert!(!HostMemoryHold::held(), "a fake session allocates nothing to hold");
    drop(fake);
}
