//! The calibration's measurements: what each keeps, and what a time limit cuts.

use super::*;
use crate::cost::work;
use ckptune_kernels::meter;

/// Every test here runs libtorch's operators: one at a time, and only once the meter is the
/// CPU allocator. A session (the runtime's time around a block) installs it, and memory
/// another thread allocated before that and frees after it goes to the wrong deleter.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    let lock = meter::exclusive();
    meter::install().unwrap();
    lock
}

/// A calibration's state with no time limit, its convolutions' setups and overhead per call
/// measured.
fn unlimited() -> Run {
    let mut run = Run {
        t0: Instant::now(),
        budget: f64::INFINITY,
        threads: tch::get_num_threads(),
        overhead: 0.0,
        conv_setup: Vec::new(),
        op_setup: Vec::new(),
    };
    run.setups().unwrap();
    run.overhead().unwrap();
    run
}

#[test]
fn a_convolution_through_onednn_and_the_slow_kernels_cost_a_setup_per_call_beyond_an_adds() {
    let _alone = alone();
    let run = unlimited();
    let measured: Vec<(&str, bool)> = run.conv_setup.iter().map(|s| (s.dtype.as_str(), s.backward)).collect();
    assert_eq!(
        measured,
        [("fp32", false), ("fp32", true), ("bf16", false), ("bf16", true)]
    );
    // oneDNN builds its primitive's descriptors on every call: 45 µs forward and 82-93 µs backward
    // on the Intel Xeon of results/cost/, where an add of as few elements takes about one.
    for backward in [false, true] {
        let s = ConvSetup::seconds(&run.conv_setup, Dtype::Fp32, backward);
        assert!(s > 2e-6 && s < 1e-2, "backward {backward}: {s} s");
    }
    // Every probe's operators have one, none negative; batch norm's forward, which computes
    // each channel's statistics and updates the running ones, costs more than an add.
    let ops: Vec<&str> = run.op_setup.iter().map(|s| s.op.as_str()).collect();
    let probed: Vec<&str> = PROBES.iter().flat_map(|p| p.ops.iter().copied()).collect();
    assert_eq!(ops, probed);
    assert!(
        run.op_setup.iter().all(|s| s.seconds >= 0.0 && s.seconds < 1e-2),
        "{:?}",
        run.op_setup
    );
    assert!(OpSetup::seconds(&run.op_setup, "aten::native_batch_norm") > 0.0);
}

#[test]
fn a_calibration_out_of_time_still_has_every_rate_an_estimate_needs() {
    let _alone = alone();
    // As on a machine so busy that the time limit passes before the first curve.
    let rates = measure(1, "test", 0.0).unwrap();
    rates.check().unwrap();
    for curves in [
        &rates.matmul,
        &rates.conv,
        &rates.conv_backward,
        &rates.bandwidth,
        &rates.bandwidth_in_place,
    ] {
        assert!(curves.iter().all(|c| c.points.len() == 1), "{curves:?}");
    }
    // What the limit cuts falls back to the generic rates, and the skinny products to the
    // square ones; the runtime's time around a block is always measured (a few
    // milliseconds of toy steps).
    assert!(rates.block_overhead.is_some());
    assert!(rates.matmul_thin.is_empty());
    assert!(rates.matmul_transposed.is_empty());
    // Each convolution curve's one point is a shape of its own: fp32 and bf16 forward,
    // fp32 backward; bf16's backward, cut, falls back to its forward.
    assert_eq!(rates.conv_shapes.len(), 3, "{:?}", rates.conv_shapes);
    // The setups come before the limit can cut anything, as the overhead does.
    assert_eq!(rates.conv_setup.len(), 4, "{:?}", rates.conv_setup);
    let probed: usize = PROBES.iter().map(|p| p.ops.len()).sum();
    assert_eq!(rates.op_setup.len(), probed, "{:?}", rates.op_setup);
    assert!(rates.ops.is_empty());
    assert!(rates.attention.is_none());
}

#[test]
fn products_of_a_transposed_operand_are_measured_at_every_side_or_not_kept() {
    let _alone = alone();
    let curves = transposed_products(&unlimited()).unwrap();
    let dtypes: Vec<&str> = curves.iter().map(|c| c.dtype.as_str()).collect();
    assert_eq!(dtypes, ["fp32", "bf16"]);
    for c in &curves {
        let sides: Vec<f64> = c.points.iter().map(|p| p[0]).collect();
        assert_eq!(sides, MATMUL_SIDES.map(|n| n as f64), "{c:?}");
        assert!(c.points.iter().all(|p| p[1] > 0.0 && p[1].is_finite()), "{c:?}");
    }
    let mut cut = unlimited();
    cut.budget = 0.0;
    assert!(transposed_products(&cut).unwrap().is_empty());
}

#[test]
fn bf16_convolutions_backward_is_measured_at_every_shape_or_not_kept() {
    let _alone = alone();
    let (curve, shapes) = bf16_conv_backward(&unlimited()).unwrap();
    assert_eq!(curve.map(|c| c.dtype), Some("bf16".to_string()));
    assert_eq!(shapes.len(), CONVS.len());
    assert!(shapes
        .iter()
        .all(|s| s.backward && s.dtype == "bf16" && s.flops_per_second > 0.0));
    // Each with its kernel's pixels, in CONVS's order.
    let kernels: Vec<f64> = shapes.iter().map(|s| s.kernel).collect();
    let expected: Vec<f64> = CONVS.iter().map(|c| (c.4 * c.4) as f64).collect();
    assert_eq!(kernels, expected);
    let mut cut = unlimited();
    cut.budget = 0.0;
    let (curve, shapes) = bf16_conv_backward(&cut).unwrap();
    assert!(curve.is_none() && shapes.is_empty());
}

#[test]
fn a_fresh_output_streams_from_operands_beyond_the_l2() {
    let _alone = alone();
    // 128 KiB a pair: 128 of them span 16 MiB, so each call reads what the L2 lost.
    assert_eq!(operand_pairs(16 << 10, Dtype::Fp32, BEYOND_L2).unwrap().len(), 128);
    assert_eq!(operand_pairs(16 << 10, Dtype::Bf16, BEYOND_L2).unwrap().len(), 256);
    // A pair beyond the span alone: two, taken in turn.
    assert_eq!(operand_pairs(4 << 20, Dtype::Fp32, BEYOND_L2).unwrap().len(), 2);
    // A few elements: at most OPERAND_PAIRS, the call's overhead being its time.
    assert_eq!(operand_pairs(64, Dtype::Fp32, BEYOND_L2).unwrap().len(), OPERAND_PAIRS);
}

#[test]
fn the_slow_kernels_are_measured_on_bf16_inputs_too() {
    let _alone = alone();
    let run = unlimited();
    let streaming = vec![Curve::flat(Dtype::Fp32, 1e10), Curve::flat(Dtype::Bf16, 1e10)];
    let generic = generic_rates(1, "test", streaming, run.overhead);
    for p in &PROBES {
        let mut ops = Vec::new();
        run.probe(p, Dtype::Bf16, &generic, &mut ops).unwrap();
        // Each rate is bf16's (softmax's output keeps its input's dtype, as under
        // autocast), and the forward's kernel, timed on its own, always has one.
        assert!(
            ops.iter().all(|r| r.dtype == "bf16" && r.bytes_per_second > 0.0),
            "{ops:?}"
        );
        assert!(ops.iter().any(|r| r.op == p.ops[0]), "{}: {ops:?}", p.ops[0]);
    }
}

#[test]
fn attention_is_costed_per_score_at_each_head_size() {
    let _alone = alone();
    let run = unlimited();
    // Streaming so fast that no call is bound by its bytes.
    let generic = generic_rates(1, "test", vec![Curve::flat(Dtype::Fp32, 1e13)], run.overhead);
    let a = run.attention(&generic).unwrap().expect("this CPU runs fused attention");
    // Sorted by head size for the curve, whatever order they were measured in; each cost
    // positive (a curve read in log space).
    for by_head in [&a.forward_seconds_per_score, &a.backward_seconds_per_score] {
        let heads: Vec<f64> = by_head.points.iter().map(|p| p[0]).collect();
        assert_eq!(heads, [16.0, 64.0, 128.0]);
        assert!(
            by_head.points.iter().all(|p| p[1] > 0.0 && p[1].is_finite()),
            "{by_head:?}"
        );
    }
    // Over these rates, the calibration's own backward at head size 16 is estimated at its
    // products plus head size 16's cost per score: the call's head size picks the point.
    let rates = DeviceRates {
        attention: Some(a.clone()),
        ..generic.clone()
    };
    let [b, h, l] = ATTENTION_SHAPE;
    let x = randn(&[b, h, l, 16], Dtype::Fp32).unwrap();
    let [_, (_, traced)] = forward_backward(&x, &|x| attention_call(x, false)).unwrap();
    let (_, work) = traced
        .counted
        .iter()
        .find(|(n, _)| n == ATTENTION_OPS[1])
        .expect("the backward's kernel");
    let w = work.work;
    let products = generic.work_seconds(&Work {
        flops: w.attention.unwrap().full_flops,
        bytes: 0.0,
        attention: None,
        ..w
    });
    let at_16 = a.backward_seconds_per_score.points[0][1];
    let expected = products + at_16 * w.attention.unwrap().scores;
    let estimated = rates.op_seconds(work::base(ATTENTION_OPS[1]), &w);
    assert!(
        (estimated - expected).abs() <= 1e-12 * expected,
        "{estimated} against {expected}"
    );
}

#[test]
fn a_bool_reduction_along_rows_is_timed_at_its_own_rate_or_not_kept() {
    let _alone = alone();
    let rate = unlimited().row_reduction().unwrap().expect("measured with time left");
    assert_eq!((rate.op.as_str(), rate.dtype.as_str()), ("aten::all", "fp32"));
    assert!(
        rate.bytes_per_second.is_finite() && rate.bytes_per_second > 0.0,
        "{rate:?}"
    );
    // An estimate of the same call takes that rate: its bytes (the bool rows read, one bool per
    // row written) over it.
    let rows = Tensor::zeros(ROWS_SHAPE, (Kind::Bool, Device::Cpu));
    let traced = traced(&mut || rows.f_all_dim(-1, true).map_err(torch("all"))).unwrap();
    // The kernel first fills its output with `true` (counted on its own, at an add's rate).
    let names: Vec<&str> = traced.counted.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, ["aten::fill_", "aten::all"]);
    let (name, all) = &traced.counted[1];
    let elements = ROWS_SHAPE.iter().product::<i64>() as f64;
    assert_eq!(all.work.bytes, elements + elements / 128.0);
    let rates = DeviceRates {
        ops: vec![rate.clone()],
        ..generic_rates(1, "test", Vec::new(), 0.0)
    };
    let seconds = rates.op_seconds(name, &all.work);
    assert!(
        (seconds - all.work.bytes / rate.bytes_per_second).abs() < 1e-12,
        "{seconds}"
    );
    // A calibration out of time keeps none.
    let mut cut = unlimited();
    cut.budget = 0.0;
    assert!(cut.row_reduction().unwrap().is_none());
}
