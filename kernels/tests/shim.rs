//! The shim against exact references: byte counts computed from shapes, PyTorch's own autograd
//! for the VJP. Every test takes the meter's process-wide lock, since the counters see every
//! allocation of the process.

use ckptune_kernels::{autocast, autograd, meter, rng, MemoryMeter};
use tch::{Device, Kind, Tensor};

fn setup() -> MemoryMeter {
    let m = MemoryMeter::new().expect("meter installs");
    tch::set_num_threads(1);
    m
}

#[test]
fn meter_counts_exact_bytes_for_sizes_and_dtypes() {
    let m = setup();
    for (shape, kind, elem) in [
        (vec![1000i64, 1000], Kind::Float, 4i64),
        (vec![1], Kind::Float, 4),
        (vec![3, 5, 7], Kind::Double, 8),
        (vec![17, 31], Kind::BFloat16, 2),
        (vec![10_000], Kind::Int64, 8),
        (vec![123, 9], Kind::Uint8, 1),
        (vec![64, 64], Kind::Half, 2),
    ] {
        let (t, got) = m.measure(|| Tensor::zeros(&shape, (kind, Device::Cpu)));
        let expect: i64 = shape.iter().product::<i64>() * elem;
        assert_eq!(got.kept(), expect, "{shape:?} {kind:?}");
        assert_eq!(got.peak_above_start(), expect, "{shape:?} {kind:?}: no transient");
        let before_drop = meter::current();
        drop(t);
        assert_eq!(
            meter::current(),
            before_drop - expect,
            "{shape:?} {kind:?} frees exactly"
        );
        assert_eq!(meter::current(), got.before, "back to the previous count");
    }
}

#[test]
fn million_floats_count_four_million_bytes() {
    let m = setup();
    let start = meter::current();
    let t = Tensor::ones([1000, 1000], (Kind::Float, Device::Cpu));
    assert_eq!(meter::current() - start, 4_000_000);
    drop(t);
    assert_eq!(meter::current(), start);
    drop(m);
}

#[test]
fn views_share_storage_and_count_once() {
    let m = setup();
    let (t, made) = m.measure(|| Tensor::zeros([256, 128], (Kind::Float, Device::Cpu)));
    assert_eq!(made.kept(), 256 * 128 * 4);
    let (views, got) = m.measure(|| {
        let a = t.view([128, 256]);
        let b = t.narrow(0, 10, 20);
        let c = t.tr();
        let d = t.detach();
        (a, b, c, d)
    });
    assert_eq!(got.kept(), 0, "views allocate nothing");
    assert_eq!(got.peak_above_start(), 0);
    let level = meter::current();
    drop(t);
    assert_eq!(meter::current(), level, "storage lives while a view does");
    drop(views);
    assert_eq!(meter::current(), made.before, "freed with the last view");
}

#[test]
fn peak_and_window_reset_semantics() {
    let _m = setup();
    let base = meter::current();
    meter::reset_peak();
    assert_eq!(meter::peak(), base);
    let big = Tensor::zeros([1 << 20], (Kind::Float, Device::Cpu)); // 4 MiB
    drop(big);
    assert_eq!(meter::peak(), base + (4 << 20), "peak remembers a freed tensor");
    meter::reset_window();
    assert_eq!(meter::window_peak(), base);
    let small = Tensor::zeros([1024], (Kind::Float, Device::Cpu));
    assert_eq!(meter::window_peak(), base + 4096, "window starts from the reset level");
    assert_eq!(
        meter::peak(),
        base + (4 << 20),
        "window reset leaves the overall peak alone"
    );
    drop(small);
    meter::reset_peak();
    assert_eq!(meter::peak(), base, "reset sets the peak to the current level");
}

#[test]
fn reading_the_meter_allocates_nothing() {
    let _m = setup();
    let n = meter::allocations();
    for _ in 0..100 {
        let _ = (meter::current(), meter::peak(), meter::window_peak());
        meter::reset_window();
    }
    assert_eq!(meter::allocations(), n);
}

#[test]
fn autocast_guard_makes_matmul_bf16_and_restores_state() {
    let _m = setup();
    let a = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
    let b = Tensor::randn([16, 4], (Kind::Float, Device::Cpu));
    assert!(!autocast::is_enabled(Device::Cpu));
    let before_dtype = autocast::dtype(Device::Cpu);
    {
        let _g = autocast::AutocastGuard::new(Device::Cpu, Kind::BFloat16, true).unwrap();
        assert!(autocast::is_enabled(Device::Cpu));
        assert_eq!(a.matmul(&b).kind(), Kind::BFloat16);
        {
            // Nested region that disables autocast, as torch.autocast(enabled=False).
            let _off = autocast::AutocastGuard::new(Device::Cpu, Kind::BFloat16, false).unwrap();
            assert!(!autocast::is_enabled(Device::Cpu));
            assert_eq!(a.matmul(&b).kind(), Kind::Float);
        }
        assert!(
            autocast::is_enabled(Device::Cpu),
            "inner region restores the outer state"
        );
        assert_eq!(a.matmul(&b).kind(), Kind::BFloat16);
    }
    assert!(!autocast::is_enabled(Device::Cpu));
    assert_eq!(autocast::dtype(Device::Cpu), before_dtype);
    assert_eq!(a.matmul(&b).kind(), Kind::Float);
}

#[test]
fn autocast_weight_cast_cache_lives_until_outermost_region_closes() {
    let m = setup();
    // A leaf that requires grad is what autocast caches casts of (model weights).
    let w = Tensor::randn([512, 512], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([4, 512], (Kind::Float, Device::Cpu));
    let start = meter::current();
    let (y, got) = m.measure(|| {
        let _g = autocast::AutocastGuard::new(Device::Cpu, Kind::BFloat16, true).unwrap();
        let y = tch::no_grad(|| x.matmul(&w));
        // The bf16 copy of w (512*512*2 bytes) plus x's cast are alive inside the region.
        assert!(meter::current() - start >= 512 * 512 * 2);
        y
    });
    assert_eq!(y.kind(), Kind::BFloat16);
    assert_eq!(got.kept(), 4 * 512 * 2, "only the bf16 result survives the region");
}

#[test]
fn vjp_equals_autograd_of_weighted_sum() {
    let _m = setup();
    tch::manual_seed(7);
    let x = Tensor::randn([5, 7], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let w = Tensor::randn([7, 3], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let g = Tensor::randn([5, 3], (Kind::Double, Device::Cpu));

    // Reference: PyTorch autograd of (out * g).sum().
    let out = x.matmul(&w).tanh();
    let reference = (&out * &g).sum(Kind::Double);
    reference.backward();
    let (rx, rw) = (x.grad().copy(), w.grad().copy());
    let _ = x.grad().zero_();
    let _ = w.grad().zero_();

    let out = x.matmul(&w).tanh();
    autograd::backward(out, g.copy()).unwrap();
    assert!(x.grad().equal(&rx), "input gradient");
    assert!(w.grad().equal(&rw), "weight gradient");

    // Accumulates like PyTorch: a second VJP adds.
    let out = x.matmul(&w).tanh();
    autograd::backward(out, g.copy()).unwrap();
    assert!(w.grad().equal(&(&rw + &rw)));
}

#[test]
fn vjp_frees_output_and_gradient_before_returning() {
    let m = setup();
    let x = Tensor::randn([1024, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let out = x.sin(); // saves x only
    let g = Tensor::ones([1024, 256], (Kind::Float, Device::Cpu));
    let (_, got) = m.measure(|| autograd::backward(out, g).unwrap());
    // Freed: out (1 MiB) and g (1 MiB); allocated: x.grad (1 MiB).
    assert_eq!(got.kept(), -(1 << 20));
    // While sin's backward runs: out, g, x.grad, and cos(x) (a temporary) at most.
    assert!(got.peak_above_start() <= 2 << 20, "peak {}", got.peak_above_start());
}

#[test]
fn vjp_errors_are_clear() {
    let _m = setup();
    let x = Tensor::ones([3], (Kind::Float, Device::Cpu));
    let err = autograd::backward(x.shallow_clone(), x.shallow_clone())
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not require grad"), "{err}");
    let y = Tensor::ones([3], (Kind::Float, Device::Cpu))
        .set_requires_grad(true)
        .exp();
    let err = autograd::backward(y, Tensor::ones([4], (Kind::Float, Device::Cpu)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("gradient shape"), "{err}");
}

#[test]
fn rng_state_replays_dropout_bitwise() {
    let _m = setup();
    let x = Tensor::ones([1000], (Kind::Float, Device::Cpu));
    let state = rng::cpu_state().unwrap();
    let a = x.dropout(0.5, true);
    let b = x.dropout(0.5, true);
    assert!(!a.equal(&b), "fresh draws differ");
    rng::set_cpu_state(&state).unwrap();
    let c = x.dropout(0.5, true);
    assert!(a.equal(&c), "restored state replays the same mask");
}

/// Three draws: sizes under 16 take one normal at a time, which leaves a cached second sample.
fn draws() -> (Tensor, Tensor, Tensor) {
    let f = || (Kind::Float, Device::Cpu);
    (
        Tensor::randn([3], f()),
        Tensor::randn([40], f()),
        Tensor::randint(1000, [5], (Kind::Int64, Device::Cpu)),
    )
}

#[test]
fn a_snapshot_held_outside_tensors_replays_every_draw_and_allocates_nothing() {
    let _m = setup();
    tch::manual_seed(7);
    let _ = Tensor::randn([1], (Kind::Double, Device::Cpu));
    let before = meter::allocations();
    let snap = rng::CpuSnapshot::take().unwrap();
    assert_eq!(meter::allocations(), before, "taking the state allocates no tensor");
    let first = draws();
    tch::manual_seed(99);
    let _ = draws();
    snap.restore().unwrap();
    assert_eq!(first, draws());
    // The same as the state tensor's save and restore.
    let state = rng::cpu_state().unwrap();
    let third = draws();
    rng::set_cpu_state(&state).unwrap();
    assert_eq!(third, draws());
}

#[test]
fn clear_grad_frees_the_gradient() {
    let m = setup();
    let w = Tensor::zeros([256, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&w * 2.0).sum(Kind::Float).backward();
    assert!(w.grad().defined());
    let (_, got) = m.measure(|| autograd::clear_grad(&w).unwrap());
    assert!(!w.grad().defined());
    assert_eq!(got.kept(), -(256 * 256 * 4));
}
