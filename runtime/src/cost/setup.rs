//! What a kernel costs per call beyond its work and the overhead: its setup. Each is measured
//! as a call with next to nothing to compute, forward and then forward and backward through
//! autograd, less an add of a few elements timed the same way, one add's dispatch per call of
//! its own beyond the add's. On the Intel Xeon of `results/cost/` (one thread) a convolution
//! through oneDNN took 45 µs forward and 82-93 µs backward beyond the add, batch norm's forward
//! about 4 µs, where the add took about 1 µs.

use ckptune_solver::rates::{ConvSetup, Dtype, OpSetup};
use tch::{Device, Kind, Tensor};

use super::timed::{forward_backward, Traced};
use crate::error::{torch, Result};

/// The add every setup is measured against: its forward's seconds per dispatched call, and its
/// backward's (forward and backward less forward) and that pass's calls.
pub(super) struct Baseline {
    per_call: f64,
    backward: f64,
    backward_calls: usize,
}

impl Baseline {
    pub(super) fn measure() -> Result<Baseline> {
        let x = Tensor::f_ones([1, 8], (Kind::Float, Device::Cpu)).map_err(torch("calibration: ones"))?;
        let add = |x: &Tensor| x.f_add(x).map_err(torch("calibration: add"));
        let [(t_f, f), (t_fb, b)] = forward_backward(&x, &add)?;
        Ok(Baseline {
            per_call: t_f / f.calls.max(1) as f64,
            backward: t_fb - t_f,
            backward_calls: b.calls.saturating_sub(f.calls),
        })
    }

    /// A measured call's seconds beyond the add, forward and backward (never below 0): the
    /// forward's less the add's dispatch per call it makes, the backward's less the add's
    /// backward and one dispatch per call beyond that backward's.
    fn beyond(&self, measured: &[(f64, Traced); 2]) -> [f64; 2] {
        let [(t_f, f), (t_fb, b)] = measured;
        let forward = t_f - self.per_call * f.calls as f64;
        let backward_calls = b.calls.saturating_sub(f.calls);
        let extra = backward_calls.saturating_sub(self.backward_calls) as f64;
        let backward = (t_fb - t_f) - self.backward - self.per_call * extra;
        [forward.max(0.0), backward.max(0.0)]
    }
}

/// A convolution's setup through oneDNN ([`Setup`](ckptune_solver::rates::Setup)), forward and
/// backward per dtype: one channel, a 1×1 kernel at stride 2 over two 2×2 images, which PyTorch
/// runs through oneDNN at any thread count.
pub(super) fn conv(base: &Baseline) -> Result<Vec<ConvSetup>> {
    let mut setups = Vec::new();
    for dtype in [Dtype::Fp32, Dtype::Bf16] {
        let kind = if dtype == Dtype::Bf16 {
            Kind::BFloat16
        } else {
            Kind::Float
        };
        let x = Tensor::f_randn([2, 1, 2, 2], (kind, Device::Cpu)).map_err(torch("calibration: randn"))?;
        let w = Tensor::f_randn([1, 1, 1, 1], (kind, Device::Cpu))
            .map_err(torch("calibration: randn"))?
            .set_requires_grad(true);
        let conv = |x: &Tensor| {
            x.f_conv2d(&w, None::<&Tensor>, [2, 2], [0, 0], [1, 1], 1)
                .map_err(torch("calibration: conv2d"))
        };
        let [forward, backward] = base.beyond(&forward_backward(&x, &conv)?);
        for (backward, seconds) in [(false, forward), (true, backward)] {
            setups.push(ConvSetup {
                dtype: dtype.name().into(),
                backward,
                seconds,
            });
        }
    }
    Ok(setups)
}

/// A slow kernel's setup: `forward` over `x` (fp32, a few elements), beyond the
/// add, given to `ops[0]` (the forward's operator) and `ops[1]` (the backward's), where named.
pub(super) fn op(
    base: &Baseline,
    x: &Tensor,
    forward: &dyn Fn(&Tensor) -> Result<Tensor>,
    ops: &[&str],
) -> Result<Vec<OpSetup>> {
    let beyond = base.beyond(&forward_backward(x, forward)?);
    Ok(ops
        .iter()
        .zip(beyond)
        .map(|(op, seconds)| OpSetup {
            op: (*op).into(),
            seconds,
        })
        .collect())
}
