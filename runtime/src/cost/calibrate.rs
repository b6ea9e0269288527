//! The CPU's rates, measured: matrix products per dtype over sizes, 3×3 convolutions over
//! ResNet-like shapes, elementwise streaming per dtype over sizes, the kernels that stream
//! slower than an add forward and backward ([`PROBES`]), and the time per call of a tiny
//! training step (the dispatcher's and autograd's overhead, paid by every call). Each point is the fastest
//! of a few batches of calls (a shared machine only ever slows a batch down), its work rate the
//! work over the time less one call's overhead, so that work plus overhead gives the call back.
//! The whole run stops adding points after [`BUDGET_SECONDS`].

use std::time::Instant;

use ckptune_kernels::{autograd, optrace};
use ckptune_solver::rates::{Curve, DeviceRates, Dtype, Engine, OpRate};
use tch::{Device, Kind, Tensor};

use super::work;
use crate::error::{torch, Result};

/// Bumped whenever what is measured changes: cached calibrations of another version are
/// measured again.
pub const CALIBRATION_VERSION: u32 = 2;

/// The calibration's time limit; points not reached by then are left out (their curves hold
/// flat from the last point measured).
pub const BUDGET_SECONDS: f64 = 16.0;

/// Each timed batch runs at least this long.
const BATCH_SECONDS: f64 = 0.015;
/// Batches per point; the fastest counts.
const BATCHES: usize = 5;

/// Square matrix sides.
const MATMUL_SIDES: [i64; 8] = [8, 16, 32, 64, 128, 256, 512, 1024];
/// Convolutions `(batch, channels in = out, side)`, 3×3, stride 1, padding 1.
const CONVS: [(i64, i64, i64); 7] = [
    (1, 4, 8),
    (2, 8, 16),
    (2, 16, 32),
    (2, 32, 32),
    (8, 64, 28),
    (8, 128, 28),
    (8, 256, 14),
];
/// Elements of an elementwise add's operands.
const STREAM_ELEMENTS: [i64; 7] = [64, 1024, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];

/// Seconds per call of `f`: the fastest of [`BATCHES`] batches, each long enough to time.
fn time_call(mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    drop(f()?);
    let t = Instant::now();
    drop(f()?);
    let once = t.elapsed().as_secs_f64().max(1e-7);
    let calls = ((BATCH_SECONDS / once).ceil() as usize).clamp(1, 100_000);
    let mut best = f64::INFINITY;
    for _ in 0..BATCHES {
        let t = Instant::now();
        for _ in 0..calls {
            drop(f()?);
        }
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    Ok(best)
}

fn kind(dtype: Dtype) -> Kind {
    match dtype {
        Dtype::Fp32 => Kind::Float,
        Dtype::Bf16 => Kind::BFloat16,
        Dtype::Fp16 => Kind::Half,
    }
}

fn randn(shape: &[i64], dtype: Dtype) -> Result<Tensor> {
    Tensor::f_randn(shape, (kind(dtype), Device::Cpu)).map_err(torch("calibration: randn"))
}

/// The calibration's running state: what is measured so far and the time left.
struct Run {
    t0: Instant,
    overhead: f64,
}

impl Run {
    fn over(&self) -> bool {
        self.t0.elapsed().as_secs_f64() > BUDGET_SECONDS
    }

    /// The rate of `work` units per second of a call that took `seconds`, less its overhead
    /// (never less than a fifth of the call: tiny calls are mostly overhead).
    fn rate(&self, work: f64, seconds: f64) -> f64 {
        work / (seconds - self.overhead).max(0.2 * seconds)
    }

    fn matmul(&self, dtype: Dtype) -> Result<Curve> {
        let mut points = Vec::new();
        for n in MATMUL_SIDES {
            if self.over() {
                break;
            }
            let (a, b) = (randn(&[n, n], dtype)?, randn(&[n, n], dtype)?);
            let t = time_call(|| a.f_mm(&b).map_err(torch("calibration: mm")))?;
            points.push([n as f64, self.rate(2.0 * (n * n * n) as f64, t)]);
        }
        Ok(Curve {
            dtype: dtype.name().into(),
            points,
        })
    }

    fn conv(&self, dtype: Dtype) -> Result<Curve> {
        let mut points = Vec::new();
        for (batch, c, side) in CONVS {
            if self.over() {
                break;
            }
            let x = randn(&[batch, c, side, side], dtype)?;
            let w = randn(&[c, c, 3, 3], dtype)?;
            let t = time_call(|| {
                x.f_conv2d(&w, None::<&Tensor>, [1, 1], [1, 1], [1, 1], 1)
                    .map_err(torch("calibration: conv2d"))
            })?;
            // The implicit product: batch·side² rows, c·9 deep, c columns.
            let (m, k, n) = ((batch * side * side) as f64, (c * 9) as f64, c as f64);
            points.push([(m * k * n).cbrt(), self.rate(2.0 * m * k * n, t)]);
        }
        points.sort_by(|a, b| a[0].total_cmp(&b[0]));
        points.dedup_by(|a, b| a[0] == b[0]);
        Ok(Curve {
            dtype: dtype.name().into(),
            points,
        })
    }

    fn bandwidth(&self, dtype: Dtype) -> Result<Curve> {
        let mut points = Vec::new();
        for n in STREAM_ELEMENTS {
            if self.over() {
                break;
            }
            let (a, b) = (randn(&[n], dtype)?, randn(&[n], dtype)?);
            let t = time_call(|| a.f_add(&b).map_err(torch("calibration: add")))?;
            let bytes = 3.0 * n as f64 * kind(dtype).elt_size_in_bytes() as f64;
            points.push([bytes, self.rate(bytes, t)]);
        }
        Ok(Curve {
            dtype: dtype.name().into(),
            points,
        })
    }
}

/// A probe: the input's shape and a forward over it in grad mode.
type Probe = (&'static [i64], fn(&Tensor) -> Result<Tensor>);

/// Kernels that stream slower than an add, each timed forward and backward on a typical shape
/// (ResNet-50's and BERT-base's at batch 8).
const PROBES: [Probe; 7] = [
    (&[8, 64, 56, 56], |x| {
        let c = Tensor::f_ones([64], (Kind::Float, Device::Cpu)).map_err(torch("calibration: ones"))?;
        x.f_batch_norm(Some(&c), Some(&c), Some(&c.copy()), Some(&c.copy()), true, 0.1, 1e-5, false)
            .map_err(torch("calibration: batch_norm"))
    }),
    (&[8, 64, 56, 56], |x| {
        x.f_max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false)
            .map_err(torch("calibration: max_pool2d"))
    }),
    (&[1024, 768], |x| {
        x.f_layer_norm([768], None::<&Tensor>, None::<&Tensor>, 1e-12, false)
            .map_err(torch("calibration: layer_norm"))
    }),
    (&[8, 12, 128, 128], |x| x.f_softmax(-1, Kind::Float).map_err(torch("calibration: softmax"))),
    (&[256, 8192], |x| x.f_log_softmax(-1, Kind::Float).map_err(torch("calibration: log_softmax"))),
    (&[1024, 3072], |x| x.f_gelu("none").map_err(torch("calibration: gelu"))),
    (&[1024, 2048], |x| x.f_silu().map_err(torch("calibration: silu"))),
];

/// The operators a call of `f` runs that do work, traced once: their names, what they do, and
/// how many calls pay the overhead.
fn traced(f: &mut dyn FnMut() -> Result<Tensor>) -> Result<(Vec<(String, work::Counted)>, usize)> {
    optrace::start()?;
    let out = f();
    let events = optrace::stop()?;
    drop(out?);
    let counted = work::counted(&events, &mut work::traits)
        .into_iter()
        .map(|c| (work::base(&events[c.index].name).to_owned(), c))
        .collect();
    Ok((counted, work::calls(&events).len()))
}

impl Run {
    /// The time per call of a tiny training step: a chain of elementwise operators on one
    /// element, forward and backward, over the calls that pay the overhead.
    fn overhead(&mut self) -> Result<()> {
        let x = randn(&[1], Dtype::Fp32)?.set_requires_grad(true);
        let mut step = || -> Result<Tensor> {
            let mut y = x.shallow_clone();
            for _ in 0..4 {
                y = y.f_mul_scalar(1.5).and_then(|y| y.f_add_scalar(0.5)).map_err(torch("calibration: mul"))?;
            }
            autograd::backward(y, Tensor::f_ones([1], (Kind::Float, Device::Cpu)).map_err(torch("calibration"))?)?;
            Ok(x.grad())
        };
        let (_, calls) = traced(&mut step)?;
        self.overhead = time_call(step)? / calls.max(1) as f64;
        Ok(())
    }

    /// Each probe's forward and backward operator, at its own rate.
    fn op_rates(&self) -> Result<Vec<OpRate>> {
        let mut out = Vec::new();
        for (shape, forward) in PROBES {
            if self.over() {
                break;
            }
            let x = randn(shape, Dtype::Fp32)?.set_requires_grad(true);
            let mut fwd = || forward(&x);
            let mut both = || -> Result<Tensor> {
                let y = forward(&x)?;
                let g = y.f_ones_like().map_err(torch("calibration: ones_like"))?;
                autograd::backward(y, g)?;
                Ok(x.grad())
            };
            let (f_ops, f_calls) = traced(&mut fwd)?;
            let (b_ops, b_calls) = traced(&mut both)?;
            let t_f = time_call(&mut fwd)?;
            let t_b = time_call(&mut both)? - t_f;
            let main = |ops: &[(String, work::Counted)], skip: Option<&str>| {
                ops.iter()
                    .filter(|(n, c)| c.work.engine == Engine::Memory && Some(n.as_str()) != skip)
                    .max_by(|a, b| a.1.work.bytes.total_cmp(&b.1.work.bytes))
                    .map(|(n, c)| (n.clone(), c.work.bytes))
            };
            let f_main = main(&f_ops, None);
            let b_main = main(&b_ops, f_main.as_ref().map(|(n, _)| n.as_str()));
            for (found, t, calls) in [(f_main, t_f, f_calls), (b_main, t_b, b_calls.saturating_sub(f_calls))] {
                if let Some((op, bytes)) = found {
                    let own = (t - self.overhead * calls as f64).max(0.2 * t);
                    out.push(OpRate {
                        op,
                        dtype: Dtype::Fp32.name().into(),
                        bytes_per_second: bytes / own,
                    });
                }
            }
        }
        Ok(out)
    }
}

/// Measures this CPU's rates with `threads` intra-op threads (restored afterwards). Takes at
/// most about [`BUDGET_SECONDS`].
pub fn calibrate(threads: i32, identity: &str) -> Result<DeviceRates> {
    let before = tch::get_num_threads();
    tch::set_num_threads(threads);
    let measured = measure(threads, identity);
    tch::set_num_threads(before);
    measured
}

fn measure(threads: i32, identity: &str) -> Result<DeviceRates> {
    let mut run = Run {
        t0: Instant::now(),
        overhead: 0.0,
    };
    run.overhead()?;
    let ops = run.op_rates()?;
    let _no_grad = tch::no_grad_guard();
    let matmul = vec![run.matmul(Dtype::Fp32)?, run.matmul(Dtype::Bf16)?];
    let bandwidth = vec![run.bandwidth(Dtype::Fp32)?, run.bandwidth(Dtype::Bf16)?];
    let conv = vec![run.conv(Dtype::Fp32)?, run.conv(Dtype::Bf16)?];
    let seconds = run.t0.elapsed().as_secs_f64();
    Ok(DeviceRates {
        device: "cpu".into(),
        name: identity.into(),
        measured: true,
        source: format!(
            "calibration run (version {CALIBRATION_VERSION}) with {threads} threads, {seconds:.1} s: mm, conv2d \
             3×3 and add over sizes, {} slow kernels forward and backward, a tiny training step's overhead per \
             call; each point the fastest of {BATCHES} batches",
            PROBES.len()
        ),
        threads: Some(threads),
        matmul: matmul.into_iter().filter(|c| !c.points.is_empty()).collect(),
        conv: conv.into_iter().filter(|c| !c.points.is_empty()).collect(),
        bandwidth: bandwidth.into_iter().filter(|c| !c.points.is_empty()).collect(),
        overhead_seconds: run.overhead,
        ops,
    })
}
