//! The CPU's rates, measured: matrix products per dtype over sizes, 3×3 convolutions over
//! ResNet-like shapes, elementwise streaming per dtype over sizes, and the time of an operator
//! that does nothing (the dispatcher's overhead, paid by every call). Each point is the fastest
//! of a few batches of calls (a shared machine only ever slows a batch down), its work rate the
//! work over the time less one call's overhead, so that work plus overhead gives the call back.
//! The whole run stops adding points after [`BUDGET_SECONDS`].

use std::time::Instant;

use ckptune_solver::rates::{Curve, DeviceRates, Dtype};
use tch::{Device, Kind, Tensor};

use crate::error::{torch, Result};

/// Bumped whenever what is measured changes: cached calibrations of another version are
/// measured again.
pub const CALIBRATION_VERSION: u32 = 1;

/// The calibration's time limit; points not reached by then are left out (their curves hold
/// flat from the last point measured).
pub const BUDGET_SECONDS: f64 = 16.0;

/// Each timed batch runs at least this long.
const BATCH_SECONDS: f64 = 0.015;
/// Batches per point; the fastest counts.
const BATCHES: usize = 3;

/// Square matrix sides.
const MATMUL_SIDES: [i64; 8] = [8, 16, 32, 64, 128, 256, 512, 1024];
/// Convolutions `(batch, channels in = out, side)`, 3×3, stride 1, padding 1.
const CONVS: [(i64, i64, i64); 7] = [
    (1, 4, 8),
    (2, 8, 16),
    (2, 16, 32),
    (2, 32, 32),
    (2, 64, 56),
    (2, 128, 28),
    (2, 256, 14),
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
    let _no_grad = tch::no_grad_guard();
    let mut run = Run {
        t0: Instant::now(),
        overhead: 0.0,
    };
    let (a, b) = (randn(&[1], Dtype::Fp32)?, randn(&[1], Dtype::Fp32)?);
    run.overhead = time_call(|| a.f_add(&b).map_err(torch("calibration: add")))?;
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
             3×3 and add timed over sizes, each point the fastest of {BATCHES} batches"
        ),
        threads: Some(threads),
        matmul: matmul.into_iter().filter(|c| !c.points.is_empty()).collect(),
        conv: conv.into_iter().filter(|c| !c.points.is_empty()).collect(),
        bandwidth: bandwidth.into_iter().filter(|c| !c.points.is_empty()).collect(),
        overhead_seconds: run.overhead,
    })
}
