//! What each round's calibration measured: in words for the README, in JSON for `results.json`.

use ckptune_solver::rates::{ConvSetup, DeviceRates, Dtype, OpSetup};
use serde_json::json;

use super::span;

/// How long the rounds' calibrations took and what their time limit cut, in words.
pub(super) fn calibrated(seconds: &[f64], rates: &[DeviceRates]) -> String {
    let (lo, hi) = span(seconds);
    let count = |f: &dyn Fn(&DeviceRates) -> bool| rates.iter().filter(|r| f(r)).count();
    let setup = |backward: bool| {
        let us: Vec<f64> = rates
            .iter()
            .map(|r| ConvSetup::seconds(&r.conv_setup, Dtype::Fp32, backward) * 1e6)
            .collect();
        span(&us)
    };
    let ((f_lo, f_hi), (b_lo, b_hi)) = (setup(false), setup(true));
    let norm: Vec<f64> = rates
        .iter()
        .map(|r| OpSetup::seconds(&r.op_setup, "aten::native_batch_norm") * 1e6)
        .collect();
    let (n_lo, n_hi) = span(&norm);
    format!(
        "{lo:.0} to {hi:.0} s; fused attention measured in {} of {n} rounds, skinny products in {}, {} to {} slow-kernel rates, \
         an fp32 convolution's setup {f_lo:.0} to {f_hi:.0} µs forward and {b_lo:.0} to {b_hi:.0} µs backward, \
         batch norm's {n_lo:.1} to {n_hi:.1} µs forward",
        count(&|r| r.attention.is_some()),
        count(&|r| !r.matmul_thin.is_empty()),
        rates.iter().map(|r| r.ops.len()).min().unwrap_or(0),
        rates.iter().map(|r| r.ops.len()).max().unwrap_or(0),
        n = rates.len(),
    )
}

pub(super) fn rates_json(r: &DeviceRates) -> serde_json::Value {
    let curves = |cs: &[ckptune_solver::rates::Curve]| -> serde_json::Value {
        cs.iter()
            .map(|c| (c.dtype.clone(), json!(c.points)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    json!({
        "source": r.source,
        "matmul_flops": curves(&r.matmul),
        "matmul_thin_flops": curves(&r.matmul_thin),
        "slow_kernel_rates": r.ops.len(),
        "attention_measured": r.attention.is_some(),
        "conv_flops": curves(&r.conv),
        "bandwidth_bytes": curves(&r.bandwidth),
        "overhead_seconds": r.overhead_seconds,
        "conv_setup_seconds": r.conv_setup.iter().map(|s| json!({
            "dtype": s.dtype,
            "backward": s.backward,
            "seconds": s.seconds,
        })).collect::<Vec<_>>(),
        "op_setup_seconds": r.op_setup.iter().map(|s| (s.op.clone(), json!(s.seconds))).collect::<serde_json::Map<_, _>>(),
        "block_overhead_seconds": r.block_overhead.map(|b| json!({
            "forward": b.forward,
            "nograd_forward": b.nograd_forward,
            "recompute": b.recompute,
            "backward": b.backward,
        })),
    })
}
