//! `torch.export` programs of transformers models measured on the meta device (fake mode): a
//! program exported on the meta device (no weights) gives the profile its eager export (real
//! weights) gives in fake mode, and that profile is the CPU's, term for term. Fixtures from
//! `models/fixtures/make_meta_fixtures.py`.

mod common;

use std::path::PathBuf;

use ckptune_kernels::meter;
use ckptune_models::export::chain_from_export;
use ckptune_models::{Granularity, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, RuntimeError, Session, TrainConfig};
use common::quick_profile;
use common::terms::{memory_terms, report, Term};
use tch::Device;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/fixtures")
        .join(name)
}

/// The memory terms of a profile of `file`'s training step, measured on the meta device when
/// `fake`, else on the CPU.
fn terms(file: &str, granularity: Granularity, fake: bool) -> Vec<(String, Term, i64)> {
    let opts = ModelOptions {
        granularity,
        ..Default::default()
    };
    let cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 2);
    let build = || chain_from_export(&fixture(file), &opts).map_err(|e| RuntimeError::Invalid(e.to_string()));
    tch::manual_seed(0);
    let mut s = if fake {
        Session::new_fake(build, cfg, Device::Cpu)
    } else {
        build().and_then(|c| Session::new(c, cfg, Device::Cpu))
    }
    .unwrap_or_else(|e| panic!("{file}: {e}"));
    memory_terms(&quick_profile(&mut s))
}

/// Rows `(term, kind, a, b)` of two profiles' terms where they differ.
fn differences(a: &[(String, Term, i64)], b: &[(String, Term, i64)]) -> Vec<(String, Term, i64, i64)> {
    assert_eq!(a.len(), b.len(), "as many terms");
    a.iter()
        .zip(b)
        .map(|((name, kind, x), (other, _, y))| {
            assert_eq!(name, other);
            (name.clone(), *kind, *x, *y)
        })
        .filter(|(_, _, x, y)| x != y)
        .collect()
}

#[test]
fn a_meta_export_measures_as_its_eager_export_and_the_cpu() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    tch::set_num_threads(1);
    for name in ["bert", "gpt2", "llama"] {
        for granularity in [Granularity::Layer, Granularity::Nested] {
            let (eager, meta) = (format!("hf_{name}_eager.pt2"), format!("hf_{name}_meta.pt2"));
            let cpu = terms(&eager, granularity, false);
            let kept = cpu
                .iter()
                .filter(|(n, _, v)| n.ends_with(".kept_grad") && *v > 0)
                .count();
            assert!(kept > 0, "{name} {granularity:?}: no block keeps anything for backward");
            let eager_fake = terms(&eager, granularity, true);
            let meta_fake = terms(&meta, granularity, true);
            let differ = differences(&eager_fake, &meta_fake);
            assert!(
                differ.is_empty(),
                "{name} {granularity:?}: the meta export's profile differs from the eager export's \
                 (both on meta) in:\n{}",
                report(&differ)
            );
            let differ = differences(&cpu, &eager_fake);
            assert!(
                differ.is_empty(),
                "{name} {granularity:?}: on meta the eager export's profile differs from the CPU's in:\n{}",
                report(&differ)
            );
        }
    }
}

/// Blocks that hand on several tensors (`make_export_fixtures.py`'s `two_tensors.pt2`, each
/// layer handing on `(hidden, gate)`, and `mid_output.pt2`, a layer handing on auxiliary logits
/// only the loss reads) measure on the meta device as on the CPU, term for term.
#[test]
fn further_outputs_measure_on_meta_as_on_the_cpu() {
    let _lock = meter::exclusive();
    for file in ["two_tensors.pt2", "mid_output.pt2"] {
        let cpu = terms(file, Granularity::Layer, false);
        let fake = terms(file, Granularity::Layer, true);
        let differ = differences(&cpu, &fake);
        assert!(
            differ.is_empty(),
            "{file}: on meta the profile differs from the CPU's in:\n{}",
            report(&differ)
        );
    }
}

/// An operator without a meta kernel that only backward runs (GLU's `glu_backward`)
/// passes the load's forward trial; the fake step is then refused naming it, typed, while the
/// CPU runs the same program.
#[test]
fn a_backward_operator_without_a_meta_kernel_refuses_the_fake_step() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    let file = "meta_no_backward_kernel.pt2";
    let opts = ModelOptions::default();
    let cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::AdamW, 4);
    let build = || chain_from_export(&fixture(file), &opts).map_err(|e| RuntimeError::Invalid(e.to_string()));
    let mut real = Session::new(build().unwrap(), cfg.clone(), Device::Cpu).unwrap();
    quick_profile(&mut real);
    let mut fake = Session::new_fake(build, cfg, Device::Cpu).unwrap();
    let none = vec![false; fake.chain.units()];
    let e = fake.step(&none, None).unwrap_err();
    let RuntimeError::NotMeasurableOnMeta { why } = &e else {
        panic!("{e:?}");
    };
    assert!(why.starts_with("aten::glu_backward"), "{why}");
    let msg = e.to_string();
    assert!(
        msg.contains("--measure run") && !msg.contains("You may have run into"),
        "{msg}"
    );
}
