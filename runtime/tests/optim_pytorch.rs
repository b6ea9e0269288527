//! ckptune's optimizers are `torch.optim`'s: for SGD, SGD with momentum, Adam and AdamW, in each
//! implementation (single-tensor loop, foreach, fused) and for f32 and bf16 parameters, three
//! steps on the same parameters and gradients allocate the same CPU bytes at their peak, keep
//! the same bytes, and leave the parameters bit for bit equal to PyTorch's own steps
//! (`fixtures/optim_pytorch.py`, run with the venv's torch under the same counting allocator).

mod common;

use ckptune_kernels::meter;
use ckptune_runtime::optim;
use ckptune_runtime::{OptimizerImpl, OptimizerKind};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

/// Must equal the fixture's SHAPES and STEPS.
const SHAPES: [&[i64]; 4] = [&[40, 24], &[24], &[64, 40], &[5]];
const STEPS: usize = 3;

/// `(arange(n) * scale + shift + k).reshape(shape).to(kind)`, the fixture's `ramp`.
fn ramp(k: usize, scale: f64, shift: f64, shape: &[i64], kind: Kind) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * scale + shift + k as f64)
        .reshape(shape)
        .to_kind(kind)
}

fn bits(t: &Tensor, kind: Kind) -> Vec<i64> {
    let int = if kind == Kind::BFloat16 { Kind::Int16 } else { Kind::Int };
    let flat = t
        .detach()
        .contiguous()
        .view_dtype(int)
        .flatten(0, -1)
        .to_kind(Kind::Int64);
    Vec::<i64>::try_from(&flat).expect("bits as i64")
}

#[test]
fn every_torch_optim_step_allocates_and_computes_what_pytorch_does() {
    let reference: Vec<Value> = match common::python_reference("optim_pytorch.py", &[]) {
        Value::Array(rows) => rows,
        other => panic!("optim_pytorch.py prints a list, not {other}"),
    };

    let _guard = meter::exclusive();
    meter::install().expect("meter");
    tch::set_num_threads(1);
    let mut compared = 0;
    let mut failures = Vec::new();
    for r in &reference {
        let kind: OptimizerKind = r["optimizer"].as_str().unwrap().parse().unwrap();
        let imp: OptimizerImpl = r["impl"].as_str().unwrap().parse().unwrap();
        let dtype = match r["dtype"].as_str().unwrap() {
            "float32" => Kind::Float,
            "bfloat16" => Kind::BFloat16,
            other => panic!("unexpected dtype {other}"),
        };
        let what = format!("{kind} {imp} {dtype:?}");
        let params: Vec<Tensor> = SHAPES
            .iter()
            .enumerate()
            .map(|(k, s)| ramp(k, 0.37, 0.0, s, dtype).sin().set_requires_grad(true))
            .collect();
        for (k, p) in params.iter().enumerate() {
            let want: Vec<i64> = r["initial"][k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect();
            assert!(
                bits(p, dtype) == want,
                "{what}: initial parameter {k} is not the fixture's"
            );
        }
        let mut opt = optim::build(kind, imp, params.iter().map(Tensor::shallow_clone).collect(), 1e-3);
        let steps = r["steps"].as_array().unwrap();
        assert_eq!(steps.len(), STEPS);
        for (step, theirs) in steps.iter().enumerate() {
            for (k, (p, s)) in params.iter().zip(SHAPES).enumerate() {
                // `p.grad = g`: backward from the leaf itself with `g` as its gradient.
                let g = ramp(k, 0.11, step as f64, s, dtype).cos();
                ckptune_kernels::autograd::backward(p.shallow_clone(), g).expect("setting a gradient");
            }
            let start = meter::current();
            meter::reset_peak();
            opt.step().unwrap_or_else(|e| panic!("{what}: step {step}: {e}"));
            let (peak, kept) = (meter::peak() - start, meter::current() - start);
            let want = (
                theirs["peak_above_start"].as_i64().unwrap(),
                theirs["kept"].as_i64().unwrap(),
            );
            if (peak, kept) != want {
                failures.push(format!(
                    "{what}: step {step}: (peak above start, kept) bytes {:?}, torch.optim's {want:?}",
                    (peak, kept)
                ));
            }
            for (k, p) in params.iter().enumerate() {
                let want: Vec<i64> = theirs["params"][k]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_i64().unwrap())
                    .collect();
                if bits(p, dtype) != want {
                    failures.push(format!(
                        "{what}: step {step}: parameter {k} differs from torch.optim's bits"
                    ));
                }
            }
            opt.zero_grad(true).expect("zero_grad");
        }
        compared += 1;
    }
    assert_eq!(compared, 24);
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
