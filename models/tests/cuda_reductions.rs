//! CUDA's reductions in fake steps traced for a GPU (csrc/cuda_reductions.cpp) against every
//! allocation an H200 made for 395 of them (kernels/tests/fixtures/reduce_scratch_h200.json,
//! from scripts/gpu_reduce_probe.py): `sum` over dimensions or all of them in fp32, bf16 and
//! fp16, `mean` in fp32, over contiguous, transposed and channels-last inputs, with the output, the
//! staging buffer and the semaphores each reduction that splits across blocks allocates, and
//! their frees, in the GPU's order.

use ckptune_kernels::alloc_log::{history, Recording};
use ckptune_kernels::fake::{FakeMode, GpuGeometry};
use ckptune_kernels::meter;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

fn kind(name: &str) -> Kind {
    match name {
        "float32" => Kind::Float,
        "bfloat16" => Kind::BFloat16,
        "float16" => Kind::Half,
        other => panic!("dtype {other}"),
    }
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
}

/// The case's input, laid out as the probe made it.
fn input(case: &Value) -> Tensor {
    let shape = ints(&case["shape"]);
    let k = kind(case["dtype"].as_str().unwrap());
    match case["layout"].as_str().unwrap() {
        "transposed" => Tensor::empty([shape[1], shape[0]], (k, Device::Cpu)).tr(),
        "channels_last" => {
            let (c, h, w) = (shape[1], shape[2], shape[3]);
            Tensor::empty_strided(shape.as_slice(), [h * w * c, 1, w * c, c].as_slice(), (k, Device::Cpu))
        }
        _ => Tensor::empty(shape.as_slice(), (k, Device::Cpu)),
    }
}

/// The case's reduction of `x`, as the probe called it.
fn reduce(case: &Value, x: &Tensor) -> Tensor {
    let out = case["out_dtype"].as_str().map(kind);
    let mean = case["op"] == "mean";
    match case["dims"].as_array() {
        None if mean => x.mean(out),
        None => x.sum(out),
        Some(_) => {
            let dims = ints(&case["dims"]);
            let keep = case["keepdim"].as_bool().unwrap();
            if mean {
                x.mean_dim(dims.as_slice(), keep, out)
            } else {
                x.sum_dim_intlist(dims.as_slice(), keep, out)
            }
        }
    }
}

/// `mean` in fake mode runs the CPU's decomposition, a sum and then a division by the count as
/// a wrapped scalar (an 8-byte integer tensor and its cast to the input's type, allocated and
/// freed), which CUDA's single mean kernel does not make: that scalar pair is taken out of the
/// comparison, and must be there.
fn without_cpu_scalar(mut got: Vec<(&'static str, u64)>) -> Vec<(&'static str, u64)> {
    let at = got
        .windows(4)
        .position(|w| {
            w[0] == ("alloc", 8)
                && w[1].0 == "alloc"
                && w[1].1 <= 8
                && w[2] == ("free_completed", w[1].1)
                && w[3] == ("free_completed", 8)
        })
        .expect("mean's wrapped scalar on the CPU");
    got.drain(at..at + 4);
    got
}

#[test]
fn reductions_allocate_what_the_gpu_did() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kernels/tests/fixtures/reduce_scratch_h200.json"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let gpu = GpuGeometry {
        multiprocessors: doc["multi_processor_count"].as_u64().unwrap() as u32,
        threads_per_multiprocessor: doc["max_threads_per_multi_processor"].as_u64().unwrap() as u32,
    };
    let _lock = meter::exclusive();
    let _fake = FakeMode::enter_for(Some(gpu)).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    let mut split = 0;
    for case in cases {
        // A bf16 or fp16 `mean`, and a `sum` into another dtype, run in fake mode as the CPU
        // runs them, on an f32 copy of the input that CUDA's kernels do not make: not a
        // comparison of the scratch (the models take means of f32 values: RMSNorm casts first).
        if (case["op"] == "mean" && case["dtype"] != "float32") || !case["out_dtype"].is_null() {
            continue;
        }
        let x = input(case);
        let rec = Recording::start().unwrap();
        let y = reduce(case, &x);
        let mut got = history(&rec.finish().events);
        if case["op"] == "mean" {
            got = without_cpu_scalar(got);
        }
        drop((x, y));
        let expected: Vec<(&str, u64)> = case["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_str().unwrap(), e[1].as_u64().unwrap()))
            .collect();
        assert_eq!(got, expected, "{case}");
        split += usize::from(expected.len() > 1);
    }
    assert!(
        split > 100,
        "the fixture's reductions that split across blocks: {split}"
    );
}

/// A 0-d tensor summed over its dimension 0 (as `x.sum(0)` allows): nothing to split, and no
/// dimension to wrap the index by.
#[test]
fn a_scalar_reduced_over_dimension_zero_takes_no_scratch() {
    let _lock = meter::exclusive();
    let gpu = GpuGeometry {
        multiprocessors: 132,
        threads_per_multiprocessor: 2048,
    };
    let _fake = FakeMode::enter_for(Some(gpu)).unwrap();
    let x = Tensor::empty([0i64; 0].as_slice(), (Kind::Float, Device::Cpu));
    let rec = Recording::start().unwrap();
    let y = x.sum_dim_intlist([0i64].as_slice(), false, None::<Kind>);
    assert_eq!(history(&rec.finish().events), [("alloc", 4)]);
    drop(y);
}

#[test]
fn fake_steps_for_the_cpu_allocate_no_reduction_scratch() {
    let _lock = meter::exclusive();
    let _fake = FakeMode::enter().unwrap();
    let x = Tensor::empty([8192, 768], (Kind::Float, Device::Cpu));
    let rec = Recording::start().unwrap();
    let y = x.sum_dim_intlist([0i64].as_slice(), false, None::<Kind>);
    assert_eq!(history(&rec.finish().events), [("alloc", 3072)]);
    drop(y);
}
