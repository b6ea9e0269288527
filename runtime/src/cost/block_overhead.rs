//! The runtime's own time around a block, per part of the step: what a block's measured time
//! holds beyond its operators (saving and swapping the RNG state, the scope, the autocast
//! region, the boundary's aliases and gradient sink, the meter's readings), which an estimate
//! from the operator trace leaves out. Measured on a chain of small blocks, as the difference
//! between a block's time inside the runtime's steps and the same block's operators called
//! alone, in the same process at the same moment.
//!
//! It is a few microseconds per block and part on the benchmark's CPUs: next to a layer of
//! milliseconds it is noise, and a block of a few calls misses its estimate by more than it
//! (tiny-Llama's `model.embed_tokens` and `model.norm`: their kernels are slower than their
//! bytes, docs/cost-model.md), so it is measured, not assumed, and added where it belongs.

use ckptune_kernels::autograd;
use ckptune_models::toy::{toy, ToyConfig};
use ckptune_models::Ctx;
use ckptune_solver::profile::Stats;
use ckptune_solver::rates::BlockOverhead;
use tch::{Device, Kind, Tensor};

use super::timed::time_call;
use crate::config::{OptimizerKind, Precision, TrainConfig};
use crate::error::{torch, Result};
use crate::exec::{Session, StepTrace};

/// The chain: small blocks (a linear and a ReLU), enough of them that one preempted block does
/// not move the median.
const TOY: ToyConfig = ToyConfig {
    width: 32,
    blocks: 16,
    classes: 2,
    batch_norm: false,
    dropout: 0.0,
};
const BATCH: i64 = 4;
/// Measured pairs of steps (nothing checkpointed, everything), after two untimed pairs.
const PAIRS: usize = 8;

/// A block's seconds per part of the step, as the runtime's steps measure them.
struct InRuntime {
    forward: Vec<f64>,
    nograd_forward: Vec<f64>,
    recompute: Vec<f64>,
    backward: Vec<f64>,
}

fn in_runtime(s: &mut Session) -> Result<InRuntime> {
    let none = vec![false; s.chain.units()];
    let all = s.chain.every_candidate();
    let mut out = InRuntime {
        forward: Vec::new(),
        nograd_forward: Vec::new(),
        recompute: Vec::new(),
        backward: Vec::new(),
    };
    for round in 0..PAIRS + 2 {
        let (mut a, mut b) = (StepTrace::default(), StepTrace::default());
        s.step(&none, Some(&mut a))?;
        s.step(&all, Some(&mut b))?;
        if round < 2 {
            continue;
        }
        // The first block reads the batch, not a boundary: its time is not a typical block's.
        for (ta, tb) in a.micro[0].blocks.iter().zip(&b.micro[0].blocks).skip(1) {
            out.forward.push(ta.fwd_seconds);
            out.nograd_forward.push(tb.fwd_seconds);
            out.recompute.push(tb.rec_seconds);
            out.backward.push(tb.bwd_seconds);
        }
    }
    Ok(out)
}

/// The runtime's seconds around a block in each part of the step: the median of the toy chain's
/// blocks measured in its steps less the same block called alone on a leaf of the same shape
/// (under no-grad; with grad; its backward as forward and backward less forward).
pub(super) fn per_block() -> Result<BlockOverhead> {
    let mut s = Session::new(
        toy(&TOY, Device::Cpu),
        TrainConfig::new(Precision::Fp32, OptimizerKind::Sgd, BATCH),
        Device::Cpu,
    )?;
    let runtime = in_runtime(&mut s)?;
    let block = &s.chain.blocks[1].block;
    let ctx = Ctx::new(None, true);
    let x0 = Tensor::f_randn([BATCH, TOY.width], (Kind::Float, Device::Cpu)).map_err(torch("calibration: randn"))?;
    let leaf = || x0.detach().set_requires_grad(true);
    let forward = |x: &Tensor| -> Result<Tensor> {
        Ok(block
            .try_forward_all(x, &ctx)
            .map_err(|f| crate::error::RuntimeError::Invalid(format!("calibration: a toy block failed: {f}")))?
            .0)
    };
    let nograd = time_call(|| tch::no_grad(|| forward(&x0)))?;
    let grad = time_call(|| forward(&leaf()))?;
    let both = time_call(|| {
        let x = leaf();
        let out = forward(&x)?;
        let seed = out.f_ones_like().map_err(torch("calibration: ones_like"))?;
        autograd::backward(out, seed)?;
        Ok(x.grad())
    })?;
    let less = |measured: &[f64], bare: f64| (Stats::of(measured).median - bare).max(0.0);
    Ok(BlockOverhead {
        forward: less(&runtime.forward, grad),
        nograd_forward: less(&runtime.nograd_forward, nograd),
        recompute: less(&runtime.recompute, grad),
        backward: less(&runtime.backward, (both - grad).max(0.0)),
    })
}
