//! Rates against times worked by hand: curves, each engine's rate, the checks.

use super::*;
use crate::gpus::gpu;

#[test]
fn curves_interpolate_in_log_log_and_hold_flat_beyond_their_ends() {
    let c = Curve {
        dtype: "fp32".into(),
        points: vec![[10.0, 1.0], [1000.0, 100.0]],
    };
    assert_eq!(c.at(1.0), Some(1.0));
    assert_eq!(c.at(1e6), Some(100.0));
    // Halfway in log size: the geometric mean of the rates.
    assert!((c.at(100.0).unwrap() - 10.0).abs() < 1e-9);
    assert_eq!(
        Curve {
            dtype: "fp32".into(),
            points: vec![]
        }
        .at(5.0),
        None
    );
}

#[test]
fn time_is_the_slower_of_flops_and_bytes_plus_the_overhead() {
    let r = DeviceRates {
        device: "cpu".into(),
        name: "test".into(),
        measured: true,
        source: String::new(),
        threads: Some(1),
        matmul: vec![Curve::flat(Dtype::Fp32, 1e9)],
        matmul_thin: vec![Curve::flat(Dtype::Fp32, 1e8)],
        matmul_transposed: Vec::new(),
        conv: vec![Curve::flat(Dtype::Fp32, 5e8)],
        conv_shapes: Vec::new(),
        conv_backward: vec![Curve::flat(Dtype::Fp32, 2.5e8)],
        conv_setup: Vec::new(),
        bandwidth: vec![Curve::flat(Dtype::Fp32, 1e9), Curve::flat(Dtype::Bf16, 2e9)],
        bandwidth_in_place: vec![Curve::flat(Dtype::Fp32, 4e9)],
        overhead_seconds: 1e-6,
        ops: vec![OpRate {
            op: "aten::gelu".into(),
            dtype: "fp32".into(),
            bytes_per_second: 1e8,
        }],
        op_setup: Vec::new(),
        attention: None,
        block_overhead: None,
        host: None,
    };
    let work = |engine, dtype, flops, bytes| Work {
        engine,
        dtype,
        flops,
        bytes,
        size: 64.0,
        thin: 0.0,
        attention: None,
        shape: [0.0; 3],
        lhs_transposed: false,
        kernel: 0.0,
        pass_bytes: 0.0,
        setup: Setup::None,
    };
    let t = r.seconds(&work(Engine::Matmul, Dtype::Fp32, 2e6, 1e3));
    assert!((t - (2e-3 + 1e-6)).abs() < 1e-12, "{t}");
    // A skinny product at the slower of its mean dimension's rate and its thin one's; a
    // product with no thin dimension (a convolution) at the mean dimension's.
    let takes = |r: &DeviceRates, w: Work, seconds: f64| (r.seconds(&w) - (seconds + 1e-6)).abs() < 1e-12;
    let matmul = work(Engine::Matmul, Dtype::Fp32, 2e6, 1e3);
    let skinny = Work { thin: 8.0, ..matmul };
    assert!(takes(&r, skinny, 2e-2));
    // A product of a transposed operand at its own curve where its dtype has one, else at
    // the square one.
    let transposed = Work {
        lhs_transposed: true,
        ..matmul
    };
    assert!(takes(&r, transposed, 2e-3));
    let mut refined = r.clone();
    refined.matmul_thin = vec![Curve::flat(Dtype::Fp32, 1e10)];
    refined.matmul_transposed = vec![Curve::flat(Dtype::Fp32, 5e8)];
    assert!(takes(&refined, skinny, 2e-3));
    assert!(takes(&refined, transposed, 4e-3));
    let bf16 = Work {
        dtype: Dtype::Bf16,
        ..transposed
    };
    assert_eq!(refined.seconds(&bf16), r.seconds(&bf16));
    let t = r.seconds(&work(Engine::Conv, Dtype::Fp32, 1e6, 1e3));
    assert!((t - (2e-3 + 1e-6)).abs() < 1e-12, "{t}");
    // A convolution's backward at its own rate where its dtype has one, else the forward's.
    let t = r.seconds(&work(Engine::ConvBackward, Dtype::Fp32, 1e6, 1e3));
    assert!((t - (4e-3 + 1e-6)).abs() < 1e-12, "{t}");
    let t = r.seconds(&work(Engine::ConvBackward, Dtype::Bf16, 1e6, 1e3));
    assert!((t - (2e-3 + 1e-6)).abs() < 1e-12, "{t}");
    // Memory-bound: bytes win; bf16 has its own bandwidth, fp16 falls back to fp32's.
    let t = r.seconds(&work(Engine::Matmul, Dtype::Bf16, 1e3, 4e6));
    assert!((t - (2e-3 + 1e-6)).abs() < 1e-12, "{t}");
    let t = r.seconds(&work(Engine::Memory, Dtype::Fp16, 1e12, 4e6));
    assert!((t - (4e-3 + 1e-6)).abs() < 1e-12, "{t}");
    // An operator with its own rate streams at it; a dtype without its own rate takes
    // fp32's per element (1e6 bf16 bytes are 2e6 fp32 bytes), never the streaming rate.
    let gelu = work(Engine::Memory, Dtype::Fp32, 0.0, 1e6);
    assert!((r.op_seconds("aten::gelu", &gelu) - 1e-2).abs() < 1e-12);
    assert!((r.op_seconds("aten::add", &gelu) - 1e-3).abs() < 1e-12);
    let bf16 = work(Engine::Memory, Dtype::Bf16, 0.0, 1e6);
    assert!((r.op_seconds("aten::gelu", &bf16) - 2e-2).abs() < 1e-12);
    assert!((r.op_seconds("aten::add", &bf16) - 5e-4).abs() < 1e-12);
    let own_bf16 = DeviceRates {
        ops: [
            r.ops.clone(),
            vec![OpRate {
                op: "aten::gelu".into(),
                dtype: "bf16".into(),
                bytes_per_second: 4e8,
            }],
        ]
        .concat(),
        ..r.clone()
    };
    assert!((own_bf16.op_seconds("aten::gelu", &bf16) - 2.5e-3).abs() < 1e-12);
    assert!((own_bf16.op_seconds("aten::gelu", &gelu) - 1e-2).abs() < 1e-12);
    // An own rate faster than the tensor's bytes stream (measured where its tensors fit a
    // cache) is held to the streaming rate: 1e6 bf16 bytes take 5e-4 s at 2e9 B/s, not 1e-4.
    let fast = DeviceRates {
        ops: vec![OpRate {
            op: "aten::sqrt".into(),
            dtype: "bf16".into(),
            bytes_per_second: 1e10,
        }],
        ..r.clone()
    };
    assert!((fast.op_seconds("aten::sqrt", &bf16) - 5e-4).abs() < 1e-12);
    // In place: at its own streaming rate, bf16 at fp32's where it has none; a product is
    // timed as any product, and a device without the curve streams at `bandwidth`.
    assert!((r.in_place_seconds(&gelu) - 2.5e-4).abs() < 1e-12);
    assert!((r.in_place_seconds(&bf16) - 2.5e-4).abs() < 1e-12);
    let product = work(Engine::Matmul, Dtype::Fp32, 2e6, 1e3);
    assert!((r.in_place_seconds(&product) - 2e-3).abs() < 1e-12);
    let without = DeviceRates {
        bandwidth_in_place: Vec::new(),
        ..r.clone()
    };
    assert!((without.in_place_seconds(&gelu) - 1e-3).abs() < 1e-12);
    assert_eq!(r.check(), Ok(()));
    // A separate pass follows the work on a CPU, at its dtype's streaming rate, whichever rate
    // times the work; a GPU of the table fuses it.
    let pass = |w: Work| Work { pass_bytes: 2e6, ..w };
    let t = r.seconds(&pass(product));
    assert!((t - (2e-3 + 2e-3 + 1e-6)).abs() < 1e-12, "{t}");
    assert!((r.op_seconds("aten::gelu", &pass(gelu)) - (1e-2 + 2e-3)).abs() < 1e-12);
    assert!((r.op_seconds("aten::add", &pass(bf16)) - (5e-4 + 1e-3)).abs() < 1e-12);
    assert!((r.in_place_seconds(&pass(gelu)) - (2.5e-4 + 2e-3)).abs() < 1e-12);
    let gpu = DeviceRates {
        device: "cuda:h100".into(),
        ..r.clone()
    };
    assert_eq!(gpu.seconds(&pass(product)), r.seconds(&product));
    assert_eq!(
        gpu.op_seconds("aten::add", &pass(bf16)),
        r.op_seconds("aten::add", &bf16)
    );
}

/// Work of `flops` on `engine` whose (implicit) product is `mkn` and whose size is that
/// product's cube root, with a kernel of `kernel` pixels and one byte: a convolution's, or any
/// product's.
pub(crate) fn conv_work(engine: Engine, dtype: Dtype, flops: f64, mkn: [f64; 3], kernel: f64) -> Work {
    Work {
        engine,
        dtype,
        flops,
        bytes: 1.0,
        size: (mkn[0] * mkn[1] * mkn[2]).cbrt(),
        thin: 0.0,
        attention: None,
        shape: mkn,
        lhs_transposed: false,
        kernel,
        pass_bytes: 0.0,
        setup: Setup::None,
    }
}

#[test]
fn a_convolution_of_measured_channels_takes_their_rate_from_their_rows_up_and_any_other_the_curve() {
    let shape = |dtype: Dtype, backward: bool, mkn: [f64; 3], rate: f64| ConvShape {
        dtype: dtype.name().into(),
        backward,
        shape: mkn,
        kernel: 0.0,
        flops_per_second: rate,
    };
    let (stage2, stage4) = ([6272.0, 1152.0, 128.0], [392.0, 4608.0, 512.0]);
    let r = DeviceRates {
        conv: vec![Curve::flat(Dtype::Fp32, 1e9), Curve::flat(Dtype::Bf16, 2e9)],
        conv_backward: vec![Curve::flat(Dtype::Fp32, 5e8)],
        conv_setup: Vec::new(),
        conv_shapes: vec![
            shape(Dtype::Bf16, false, stage2, 4e9),
            shape(Dtype::Fp32, false, stage2, 1.5e9),
            shape(Dtype::Fp32, true, stage2, 1e8),
        ],
        bandwidth: vec![Curve::flat(Dtype::Fp32, 1e15)],
        ..gpu("a100-80gb").unwrap().rates()
    };
    let conv = |engine, dtype, mkn| conv_work(engine, dtype, 4e9, mkn, 0.0);
    let at = |w: &Work, seconds: f64| (r.work_seconds(w) - seconds).abs() < 1e-12;
    // Two shapes of one size: the measured one at its rate, the other at the curve's.
    assert!(at(&conv(Engine::Conv, Dtype::Bf16, stage2), 1.0));
    assert!(at(&conv(Engine::Conv, Dtype::Bf16, stage4), 2.0));
    // The measured channels at four times the batch keep its rate; at half, the curve's.
    let [m, k, n] = stage2;
    assert!(at(&conv(Engine::Conv, Dtype::Bf16, [4.0 * m, k, n]), 1.0));
    assert!(at(&conv(Engine::Conv, Dtype::Bf16, [m / 2.0, k, n]), 2.0));
    assert!(at(&conv(Engine::Conv, Dtype::Fp32, stage2), 4e9 / 1.5e9));
    // fp32's backward at its own shape; bf16's (no backward measured) at its forward's.
    assert!(at(&conv(Engine::ConvBackward, Dtype::Fp32, stage2), 40.0));
    assert!(at(&conv(Engine::ConvBackward, Dtype::Fp32, stage4), 8.0));
    assert!(at(&conv(Engine::ConvBackward, Dtype::Bf16, stage2), 1.0));
    assert_eq!(r.check(), Ok(()));
    let bad = DeviceRates {
        conv_shapes: vec![shape(Dtype::Fp32, false, stage2, 0.0)],
        ..r.clone()
    };
    assert!(bad.check().unwrap_err().contains("convolution"));
}

#[test]
fn an_unmeasured_convolution_takes_the_curve_of_the_measured_shapes_of_its_kernel() {
    let shape = |mkn: [f64; 3], kernel: f64, rate: f64| ConvShape {
        dtype: "bf16".into(),
        backward: false,
        shape: mkn,
        kernel,
        flops_per_second: rate,
    };
    // ResNet's calibration shapes: a small 3×3, two 3×3 stages of one size, two 1×1s of another.
    let shapes = vec![
        shape([2048.0, 144.0, 16.0], 9.0, 1e8),
        shape([6272.0, 1152.0, 128.0], 9.0, 6e8),
        shape([392.0, 4608.0, 512.0], 9.0, 5e8),
        shape([6272.0, 512.0, 128.0], 1.0, 2e8),
        shape([25088.0, 256.0, 64.0], 1.0, 1e8),
    ];
    let mixed = Curve::of_shapes(Dtype::Bf16, shapes.iter()).unwrap();
    let r = DeviceRates {
        conv: vec![Curve::flat(Dtype::Fp32, 1e9), mixed.clone()],
        conv_shapes: shapes.clone(),
        ..gpu("a100-80gb").unwrap().rates()
    };
    let conv = |mkn, kernel| conv_work(Engine::Conv, Dtype::Bf16, 1e9, mkn, kernel);
    let rate = |w: &Work| w.flops / r.work_seconds(w);
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
    // A stride-2 3×3 (ResNet-18's layer3 entry) lies between the 1×1s' size and the stages':
    // the 3×3 shapes' curve times it, not the 1×1s' rate the mixed curve gives there.
    let entry = conv([1568.0, 1152.0, 256.0], 9.0);
    let three = Curve::of_shapes(Dtype::Bf16, shapes.iter().filter(|s| s.kernel == 9.0)).unwrap();
    assert_eq!(three.points.len(), 2, "the two stages are one size, at the slower");
    assert!(close(rate(&entry), three.at(entry.size).unwrap()));
    assert!(rate(&entry) > 2.0 * mixed.at(entry.size).unwrap());
    // A 1×1 of another size: the 1×1s' slower rate, their only size.
    assert!(close(rate(&conv([6272.0, 256.0, 512.0], 1.0)), 1e8));
    // A measured shape keeps its own rate; a kernel never measured, or shapes without their
    // kernel (a cache from before it was recorded), take the mixed curve.
    assert!(close(rate(&conv([6272.0, 1152.0, 128.0], 9.0)), 6e8));
    let five = conv([1568.0, 3200.0, 256.0], 25.0);
    assert!(close(rate(&five), mixed.at(five.size).unwrap()));
    let unrecorded = DeviceRates {
        conv_shapes: shapes
            .iter()
            .map(|s| ConvShape {
                kernel: 0.0,
                ..s.clone()
            })
            .collect(),
        ..r.clone()
    };
    assert!(close(
        entry.flops / unrecorded.work_seconds(&entry),
        mixed.at(entry.size).unwrap()
    ));
}

#[test]
fn measured_attention_adds_its_scores_and_takes_the_causal_share_at_its_length() {
    let mut r = gpu("a100-80gb").unwrap().rates();
    r.matmul = vec![Curve::flat(Dtype::Fp32, 1e9)];
    r.bandwidth = vec![Curve::flat(Dtype::Fp32, 1e12)];
    let attention_at = |causal, backward, head| Work {
        engine: Engine::Matmul,
        dtype: Dtype::Fp32,
        flops: if causal { 1e6 } else { 2e6 },
        bytes: 1e3,
        size: 64.0,
        thin: 0.0,
        shape: [0.0; 3],
        lhs_transposed: false,
        kernel: 0.0,
        pass_bytes: 0.0,
        setup: Setup::None,
        attention: Some(AttentionWork {
            scores: 1e4,
            full_flops: 2e6,
            causal,
            length: 100.0,
            head,
            backward,
        }),
    };
    let attention = |causal, backward| attention_at(causal, backward, 64.0);
    // Without measured attention rates (a GPU of the table): its FLOPs alone.
    assert!((r.op_seconds("x", &attention(true, false)) - 1e-3).abs() < 1e-12);
    let by_head = |at_64: f64| Curve {
        dtype: "fp32".into(),
        points: vec![[16.0, at_64 / 2.0], [64.0, at_64]],
    };
    r.attention = Some(AttentionRates {
        forward_seconds_per_score: by_head(1e-7),
        backward_seconds_per_score: by_head(3e-7),
        causal_share: Curve {
            dtype: "fp32".into(),
            points: vec![[10.0, 1.0], [1000.0, 0.25]],
        },
    });
    // 2 ms of products over the full scores, plus 1 ms (forward) or 3 ms (backward) of scores.
    assert!((r.op_seconds("x", &attention(false, false)) - 3e-3).abs() < 1e-12);
    assert!((r.op_seconds("x", &attention(false, true)) - 5e-3).abs() < 1e-12);
    // Causal at length 100, halfway in log length: the share is 0.5.
    assert!((r.op_seconds("x", &attention(true, true)) - 2.5e-3).abs() < 1e-12);
    // At head size 16 a score costs half (0.5 ms forward); halfway in log head size between
    // 16 and 64 (32), 1/√2 of head 64's; beyond the measured heads, the nearest one's.
    assert!((r.op_seconds("x", &attention_at(false, false, 16.0)) - 2.5e-3).abs() < 1e-12);
    let halfway = 2e-3 + 1e-3 / 2f64.sqrt();
    assert!((r.op_seconds("x", &attention_at(false, false, 32.0)) - halfway).abs() < 1e-12);
    assert!((r.op_seconds("x", &attention_at(false, true, 128.0)) - 5e-3).abs() < 1e-12);
}

#[test]
fn incomplete_rates_are_refused_naming_what_is_missing() {
    let mut r = gpu("a100-80gb").unwrap().rates();
    r.conv.clear();
    assert!(r.check().unwrap_err().contains("no fp32 conv rate"));
    let mut r = gpu("a100-80gb").unwrap().rates();
    r.bandwidth[0].points = vec![[2.0, 1.0], [1.0, 2.0]];
    assert!(r.check().unwrap_err().contains("do not increase"));
    let mut r = gpu("a100-80gb").unwrap().rates();
    r.matmul[0].points[0][1] = f64::NAN;
    assert!(r.check().unwrap_err().contains("must be positive"));
}

#[test]
fn a_convolutions_setup_is_timed_per_call_where_it_applies_at_the_calibrations_threads() {
    let setup = |dtype: Dtype, backward, seconds| ConvSetup {
        dtype: dtype.name().into(),
        backward,
        seconds,
    };
    let cpu = DeviceRates {
        conv_setup: vec![setup(Dtype::Fp32, false, 4e-5), setup(Dtype::Fp32, true, 9e-5)],
        ..gpu("h100").unwrap().rates()
    };
    let cpu = DeviceRates {
        device: "cpu".into(),
        threads: Some(1),
        ..cpu
    };
    let forward = conv_work(Engine::Conv, Dtype::Fp32, 1e6, [8.0, 8.0, 8.0], 9.0);
    let backward = conv_work(Engine::ConvBackward, Dtype::Fp32, 1e6, [8.0, 8.0, 8.0], 9.0);
    let with = |w: Work, setup: Setup| Work { setup, ..w };
    let added = |r: &DeviceRates, w: Work, setup: Setup| r.seconds(&with(w, setup)) - r.seconds(&w);
    assert!((added(&cpu, forward, Setup::Always) - 4e-5).abs() < 1e-15);
    assert!((added(&cpu, backward, Setup::Always) - 9e-5).abs() < 1e-15);
    // A bf16 convolution without a setup of its own takes fp32's.
    let bf16 = Work {
        dtype: Dtype::Bf16,
        ..forward
    };
    assert!((added(&cpu, bf16, Setup::Always) - 4e-5).abs() < 1e-15);
    // An unstrided 1×1 convolution pays it only where the calibration ran threaded.
    assert_eq!(added(&cpu, forward, Setup::Threaded), 0.0);
    let threaded = DeviceRates {
        threads: Some(2),
        ..cpu.clone()
    };
    assert!((added(&threaded, forward, Setup::Threaded) - 4e-5).abs() < 1e-15);
    assert_eq!(added(&cpu, forward, Setup::None), 0.0);
    // Through op_seconds and work_seconds alike; a GPU of the table measured none.
    assert_eq!(
        cpu.op_seconds("aten::conv2d", &with(forward, Setup::Always)),
        cpu.work_seconds(&with(forward, Setup::Always))
    );
    let h100 = gpu("h100").unwrap().rates();
    assert_eq!(h100.seconds(&with(forward, Setup::Always)), h100.seconds(&forward));
    assert_eq!(cpu.check(), Ok(()));
    let negative = DeviceRates {
        conv_setup: vec![setup(Dtype::Fp32, true, -1e-6)],
        ..cpu.clone()
    };
    assert!(negative.check().unwrap_err().contains("convolution backward's setup"));
}

#[test]
fn a_slow_kernels_setup_is_timed_per_call_of_that_operator_alone() {
    let setups = vec![OpSetup {
        op: "aten::native_batch_norm".into(),
        seconds: 4e-6,
    }];
    let cpu = DeviceRates {
        device: "cpu".into(),
        threads: Some(1),
        op_setup: setups,
        ..gpu("h100").unwrap().rates()
    };
    let none = DeviceRates {
        op_setup: Vec::new(),
        ..cpu.clone()
    };
    let work = conv_work(Engine::Memory, Dtype::Bf16, 0.0, [0.0; 3], 0.0);
    let added = |op: &str| cpu.op_seconds(op, &work) - none.op_seconds(op, &work);
    // Any dtype: the setup was measured on a few elements, where the dtype does not matter.
    assert!((added("aten::native_batch_norm") - 4e-6).abs() < 1e-15);
    assert_eq!(added("aten::native_batch_norm_backward"), 0.0);
    assert_eq!(added("aten::add"), 0.0);
    assert_eq!(cpu.check(), Ok(()));
    let negative = DeviceRates {
        op_setup: vec![OpSetup {
            op: "aten::gelu".into(),
            seconds: f64::NAN,
        }],
        ..cpu.clone()
    };
    assert!(negative.check().unwrap_err().contains("an operator's setup"));
}
