//! Fake mode against the real CPU: the same code, the same bytes counted, nothing computed.

use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::fake::{self, FakeMode};
use ckptune_kernels::meter;
use ckptune_kernels::optrace::{self, OpEvent};
use tch::{Device, Kind, Tensor};

/// A small training step under `precision` (`None`: fp32, else CPU autocast to that type),
/// traced op by op: (level after the forward, peak of the step, the trace).
fn step(precision: Option<Kind>) -> (i64, i64, Vec<OpEvent>) {
    let w = Tensor::randn([64, 32], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([16, 32], (Kind::Float, Device::Cpu));
    let start = meter::current();
    meter::reset_peak();
    optrace::start().unwrap();
    let y = {
        let _ac = precision.map(|k| AutocastGuard::new(Device::Cpu, k, true).unwrap());
        x.linear::<Tensor>(&w, None).gelu("none")
    };
    assert_eq!(
        y.kind(),
        precision.unwrap_or(Kind::Float),
        "autocast runs in fake mode too"
    );
    let after_forward = meter::current() - start;
    // Squared, so that gelu's gradient arrives dense: from a bare sum it is one broadcast
    // value, for which the CPU's gelu_backward makes a dense copy that no meta kernel makes.
    y.to_kind(Kind::Float).square().sum(Kind::Float).backward();
    assert_eq!(w.grad().size(), [64, 32]);
    let trace = optrace::stop().unwrap();
    (after_forward, meter::peak() - start, trace)
}

fn real_and_fake(precision: Option<Kind>) -> [(i64, i64, Vec<OpEvent>); 2] {
    tch::set_num_threads(1);
    meter::install().unwrap();
    let real = step(precision);
    let fake = {
        let _mode = FakeMode::enter().unwrap();
        assert!(fake::active());
        let t = Tensor::zeros([10], (Kind::Float, Device::Cpu));
        assert!(
            fake::is_fake(&t) && t.device() == Device::Cpu,
            "CPU tensors made in fake mode are fake"
        );
        step(precision)
    };
    assert!(!fake::active());
    assert!(!fake::is_fake(&Tensor::zeros([10], (Kind::Float, Device::Cpu))));
    [real, fake]
}

#[test]
fn a_fake_step_counts_the_bytes_of_the_real_one() {
    let _lock = meter::exclusive();
    let [real, fake] = real_and_fake(None);
    assert_eq!(optrace::line_up(&real.2, &fake.2), Ok(vec![]));
    assert_eq!((fake.0, fake.1), (real.0, real.1));
}

/// The linear's backward multiplies a transposed operand for the weight's gradient (as
/// libtorch's `mm_mat2_backward` writes it), and a fake step's trace says so as the real one's
/// does: the cost model times that product at its own rate (`OpEvent::column_major`).
#[test]
fn the_weights_gradient_multiplies_a_transposed_operand_in_the_real_step_and_the_fake_one() {
    let _lock = meter::exclusive();
    let [real, fake] = real_and_fake(None);
    let products = |t: &[OpEvent]| -> Vec<(bool, Vec<i64>)> {
        t.iter()
            .filter(|e| e.name == "aten::mm")
            .map(|e| (e.column_major(0), e.outputs[0].clone().unwrap().1))
            .collect()
    };
    let (r, f) = (products(&real.2), products(&fake.2));
    assert_eq!(r, f);
    let transposed: Vec<&Vec<i64>> = r.iter().filter(|p| p.0).map(|p| &p.1).collect();
    assert_eq!(transposed, [&vec![64, 32]], "{r:?}");
    assert_eq!(
        r.len(),
        2,
        "the forward's and the weight's gradient (x needs none): {r:?}"
    );
}

/// Under bf16 a CPU with AMX or AVX-512-BF16 multiplies through oneDNN, whose scratch the meta
/// kernels do not allocate: every call still leaves the same bytes, and only matrix products
/// peak higher, by at most their operands' and result's bytes in f32, twice over. (The scratch
/// depends on the ISA oneDNN picks: 17,536 B at most on an AMD EPYC with AVX-512-BF16 and
/// without AVX-VNNI, over the bf16 bytes twice over, 14,336 B, that other CPUs stayed within.)
#[test]
fn under_bf16_only_onednn_scratch_differs() {
    let _lock = meter::exclusive();
    let [real, fake] = real_and_fake(Some(Kind::BFloat16));
    assert_eq!(fake.0, real.0);
    let differences = optrace::line_up(&real.2, &fake.2).unwrap();
    for d in &differences {
        let bound = 2 * (16 * 32 + 32 * 64 + 16 * 64) * 4;
        assert!(d.culprit == "aten::mm" && 0 < d.bytes && d.bytes <= bound, "{d:?}");
    }
    let most = differences.iter().map(|d| d.bytes).max().unwrap_or(0);
    assert!(real.1 - fake.1 <= most, "real peak {} B, fake {} B", real.1, fake.1);
}

#[test]
fn values_are_refused_with_a_reason() {
    let _lock = meter::exclusive();
    let _mode = FakeMode::enter().unwrap();
    let t = Tensor::ones([3], (Kind::Float, Device::Cpu)).sum(Kind::Float);
    let e = t.f_double_value(&[]).unwrap_err().to_string();
    assert!(e.contains("depends on tensor values"), "{e}");
}

#[test]
fn real_tensors_compute_in_fake_mode() {
    let _lock = meter::exclusive();
    let _mode = FakeMode::enter().unwrap();
    let step = {
        let _real = fake::real().unwrap();
        Tensor::zeros(Vec::<i64>::new(), (Kind::Float, Device::Cpu))
    };
    assert!(!fake::is_fake(&step));
    let _ = step.shallow_clone().f_add_scalar_(1).unwrap();
    ckptune_kernels::ops::call(
        "aten::add_",
        "Tensor",
        &[
            ("self", ckptune_kernels::ops::Arg::Tensor(&step)),
            ("other", ckptune_kernels::ops::Arg::Int(1)),
        ],
    )
    .unwrap();
    assert_eq!(step.f_double_value(&[]).unwrap(), 2.0);
}

/// Bytes `f` leaves and its peak, on real tensors and on fake ones.
fn same_bytes(what: &str, f: impl Fn() -> Vec<Tensor>) {
    let run = || {
        let start = meter::current();
        meter::reset_peak();
        let kept = f();
        let out = (meter::current() - start, meter::peak() - start);
        drop(kept);
        out
    };
    let real = run();
    let fake = {
        let _mode = FakeMode::enter().unwrap();
        run()
    };
    assert_eq!(fake, real, "{what}: (kept, peak) fake vs real");
}

#[test]
fn elementwise_meta_kernels_allocate_what_the_cpu_does() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    let x = || Tensor::randn([8, 33], (Kind::Float, Device::Cpu));
    same_bytes("logical_not", || vec![x().gt(0.0).logical_not()]);
    same_bytes("logical_and with a float operand", || {
        vec![x().gt(0.0).logical_and(&x())]
    });
    same_bytes("logical_or broadcast", || {
        vec![x().logical_or(&Tensor::ones([33], (Kind::Bool, Device::Cpu)))]
    });
    same_bytes("where with a number", || vec![x().where_scalarother(&x().gt(0.0), 0.5)]);
    same_bytes("mean of bf16", || {
        vec![x().to_kind(Kind::BFloat16).mean_dim(-1, true, None)]
    });
    same_bytes("relu", || vec![x().relu()]);
    same_bytes("hardtanh_backward of a transposed gradient", || {
        let g = x().transpose(0, 1).contiguous().transpose(0, 1);
        vec![g.hardtanh_backward(&x(), 0.0, 6.0)]
    });
    same_bytes("hardswish_backward", || vec![x().hardswish_backward(&x())]);
    same_bytes("abs of integers", || vec![x().to_kind(Kind::Int64).abs()]);
    same_bytes("layer_norm of a transposed input", || {
        let w = Tensor::ones([8], (Kind::Float, Device::Cpu));
        vec![x().transpose(0, 1).layer_norm([8], Some(&w), Some(&w), 1e-5, false)]
    });
}

#[test]
fn shape_meta_kernels_allocate_what_the_cpu_does() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    let image = || Tensor::randn([2, 3, 7, 5], (Kind::Float, Device::Cpu));
    same_bytes("roll along one dimension", || vec![image().roll([2], [2])]);
    same_bytes("roll along two dimensions (Swin's shifted windows)", || {
        vec![image().roll([-3, -3], [2, 3])]
    });
    same_bytes("roll of the flattened tensor", || vec![image().roll([4], [0i64; 0])]);
    same_bytes("adaptive_avg_pool2d to 7x7", || {
        vec![image().adaptive_avg_pool2d([7, 7])]
    });
    same_bytes("adaptive_avg_pool2d of a transposed input", || {
        vec![image().transpose(2, 3).adaptive_avg_pool2d([3, 2])]
    });
    same_bytes("adaptive_avg_pool2d of a channels-last input", || {
        let x = image().permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2]);
        vec![x.adaptive_avg_pool2d([3, 3])]
    });
    same_bytes("adaptive_avg_pool2d backward", || {
        let x = image();
        let g = Tensor::randn([2, 3, 3, 2], (Kind::Float, Device::Cpu));
        vec![x.internal_adaptive_avg_pool2d_backward(&g)]
    });
    same_bytes("adaptive_avg_pool2d backward of a transposed gradient", || {
        let x = image();
        let g = Tensor::randn([2, 3, 2, 3], (Kind::Float, Device::Cpu)).transpose(2, 3);
        vec![x.internal_adaptive_avg_pool2d_backward(&g)]
    });
    same_bytes(
        "repeat with new leading dimensions (GPT-J's rotary table, SigLIP's probe)",
        || vec![image().repeat([2, 1, 1, 3, 1])],
    );
    same_bytes("repeat of a transposed input", || {
        vec![image().transpose(1, 3).repeat([1, 2, 1, 2])]
    });
}

#[test]
fn group_norm_meta_kernels_allocate_what_the_cpu_does() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    // wav2vec2's and HuBERT's feature encoder: a group per channel over `[batch, channels, time]`.
    let signal = |kind| Tensor::randn([2, 16, 50], (kind, Device::Cpu));
    let params = |kind| Tensor::ones([16], (kind, Device::Cpu));
    for (what, kind, param_kind) in [
        ("fp32", Kind::Float, Kind::Float),
        ("bf16 with fp32 parameters (autocast)", Kind::BFloat16, Kind::Float),
        ("bf16", Kind::BFloat16, Kind::BFloat16),
    ] {
        same_bytes(&format!("group_norm {what}"), || {
            vec![signal(kind).group_norm(16, Some(&params(param_kind)), Some(&params(param_kind)), 1e-5, false)]
        });
        same_bytes(&format!("group_norm {what}, forward and backward"), || {
            let x = signal(kind).set_requires_grad(true);
            let (w, b) = (
                params(param_kind).set_requires_grad(true),
                params(param_kind).set_requires_grad(true),
            );
            let y = x.group_norm(4, Some(&w), Some(&b), 1e-5, false);
            Tensor::run_backward(&[y.sum(None)], &[&x, &w, &b], false, false)
        });
    }
    // The channels-last kernel's buffers are not modelled: refused as an operator the meta
    // device cannot run, which the CLI turns into exit 2 with `--measure run` as the way out.
    let refused = {
        let _mode = FakeMode::enter().unwrap();
        let x = Tensor::randn([2, 5, 3, 8], (Kind::Float, Device::Cpu)).permute([0, 3, 1, 2]);
        x.f_group_norm(2, None::<&Tensor>, None::<&Tensor>, 1e-5, false)
            .map(|_| ())
    };
    let message = refused.expect_err("a channels-last group norm on meta").to_string();
    let failure = fake::meta_failure(&message);
    assert!(
        failure
            .as_deref()
            .is_some_and(|f| f.starts_with("aten::native_group_norm:")),
        "{message}"
    );
    same_bytes("group_norm of a transposed image, without parameters", || {
        let x = Tensor::randn([2, 8, 5, 3], (Kind::Float, Device::Cpu)).transpose(2, 3);
        vec![x.group_norm(2, None::<&Tensor>, None::<&Tensor>, 1e-5, false)]
    });
}

#[test]
fn weight_norm_meta_kernels_allocate_what_the_cpu_does() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    // wav2vec2's positional convolution: `weight_norm(conv, dim=2)` over `[out, in / groups, kernel]`.
    for (what, kind, dim) in [
        ("along the last dimension", Kind::Float, 2),
        ("along the first dimension", Kind::Float, 0),
        ("of bf16 along the last dimension", Kind::BFloat16, 2),
    ] {
        same_bytes(&format!("weight norm {what}, forward and backward"), || {
            let v = Tensor::randn([6, 4, 5], (kind, Device::Cpu)).set_requires_grad(true);
            let g_shape: Vec<i64> = (0..3)
                .map(|d| if d == dim { v.size()[d as usize] } else { 1 })
                .collect();
            let g = Tensor::ones(g_shape, (kind, Device::Cpu)).set_requires_grad(true);
            let w = Tensor::internal_weight_norm(&v, &g, dim);
            Tensor::run_backward(&[w.sum(None)], &[&v, &g], false, false)
        });
    }
}
