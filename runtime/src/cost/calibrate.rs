//! The CPU's rates, measured: matrix products per dtype over sizes, convolutions over small and
//! ResNet-50 shapes, elementwise streaming per dtype over sizes, the kernels that run slower
//! than their bytes at an add's rate ([`PROBES`], forward and backward, in fp32), fused
//! attention's cost per score beyond its FLOPs and a causal call's share ([`ATTENTION_SHAPE`],
//! [`CAUSAL_LENGTHS`]), the time per call of a small training step ([`overhead`]: the
//! dispatcher's and autograd's overhead, paid by every call), the runtime's own time around a
//! block ([`block_overhead`]), skinny products by their rows, and last the slow kernels on bf16
//! inputs. Each point is the median of a few batches of calls writing into fresh memory as a
//! step does ([`timed`](super::timed)), its work rate the work over the time less the calls'
//! overhead, so that work plus overhead gives the call back. The whole run stops
//! adding points after [`BUDGET_SECONDS`], in an order that cuts the refinements first.

use std::time::Instant;

use ckptune_kernels::host_memory::HostMemoryHold;
use ckptune_solver::rates::{AttentionRates, ConvSetup, ConvShape, Curve, DeviceRates, Dtype, OpRate, OpSetup, Work};
use tch::{Device, Kind, Tensor};

use super::probes::{kind, randn, Probe, PROBES};
use super::timed::{forward_backward, time_call, traced, Traced, BATCHES};
use super::{block_overhead, overhead, setup, work};
use crate::error::{torch, Result};

/// Bumped whenever what is measured changes: cached calibrations of another version are
/// measured again. Version 4 records the machine's other load while it ran (a version 3
/// cache may hold a busy machine's rates); version 5 measures fused attention's cost per score
/// and its causal share, and convolutions' backward; version 6 times the overhead on a varied
/// small step instead of a loop of two operators; version 7 measures the in-place streaming
/// rate (`add_` into memory already touched); version 8 the runtime's own time around a block
/// and skinny products with their weights from memory, within a limit of 24 s (was 16 s);
/// version 9 the fresh-output streaming rate with its operands beyond a core's L2, and fused
/// attention's cost per score by head size; version 10 the slow kernels on bf16 inputs too (a
/// bf16 dropout had taken the bf16 streaming rate: 16 times too fast on an AMD EPYC); version
/// 11 each convolution shape's own rate; version 12 bf16 convolutions' backward; version 13
/// products of a transposed operand; version 14 measures with freed host memory held, as real
/// steps now run (`HostMemoryHold`), so that no rate pays for fresh pages a step does not, and
/// records each convolution shape's kernel, so that an unmeasured shape is timed among its
/// kernel's; version 15 a convolution's setup per call through oneDNN and the slow kernels',
/// which the overhead, each convolution shape's rate and each slow kernel's are measured less;
/// version 16 a bool reduction along short rows (`all`, SDPA's math path); version 17 the
/// square root (AdamW's) as a slow kernel, and every rate with the memory of its results reused
/// as a step's is (`timed::time_call`: the largest streaming points had faulted in every
/// result's pages); version 18 an embedding's gather and its gradient as slow kernels.
pub const CALIBRATION_VERSION: u32 = 18;

/// The calibration's time limit; points not reached by then are left out (their curves hold
/// flat from the last point measured; each curve has its first point, as the estimates need an
/// fp32 rate of each kind). On the 2-core Intel Xeon of `results/cost/` at 2.0 GHz, one thread
/// spent 16 s before fused attention: 4 s on streaming rates, 4.3 s on convolutions' backward.
pub const BUDGET_SECONDS: f64 = 24.0;

/// Square matrix sides.
const MATMUL_SIDES: [i64; 8] = [8, 16, 32, 64, 128, 256, 512, 1024];
/// Rows of the skinny products, each by a `[THIN_WEIGHT, THIN_WEIGHT]` weight, as a linear
/// layer over that many tokens multiplies (`x @ w.T`).
const THIN_ROWS: [i64; 6] = [1, 4, 16, 64, 256, 1024];
const THIN_WEIGHT: i64 = 1024;
/// Convolutions `(batch, channels in, channels out, side, kernel)`, stride 1, padding `kernel /
/// 2`: small ones, then ResNet-50's at batch 8 (activations beyond the caches, 1×1 and 3×3).
const CONVS: [(i64, i64, i64, i64, i64); 9] = [
    (1, 4, 4, 8, 3),
    (2, 8, 8, 16, 3),
    (2, 16, 16, 32, 3),
    (8, 512, 128, 28, 1),
    (8, 256, 64, 56, 1),
    (8, 512, 512, 7, 3),
    (8, 256, 256, 14, 3),
    (8, 128, 128, 28, 3),
    (8, 64, 64, 56, 3),
];
/// Fused attention `[batch, heads, length, head size]`: BERT-base's heads at sequence 128,
/// unmasked, for the cost per score beyond the products' FLOPs, at each head size of
/// [`ATTENTION_HEADS`].
const ATTENTION_SHAPE: [i64; 3] = [2, 12, 128];
/// Head sizes the cost per score is measured at: BERT's and GPT-2's first (a calibration out of
/// time keeps it), then a small model's and Llama's. On the benchmark's CPU the backward's cost
/// per score beyond its FLOPs at head size 16 was about a third of that at 64 (3.5 against
/// 9.7 ns).
const ATTENTION_HEADS: [i64; 3] = [64, 16, 128];
/// Query lengths at which a causal attention call is timed against the unmasked one (head size
/// 64, about a million scores each): how much of the masked half the CPU's kernel skips. On the
/// benchmark's CPU, nothing up to 512 (its blocks span the whole key range), a quarter at 1024.
const CAUSAL_LENGTHS: [i64; 3] = [128, 512, 2048];

/// Elements of an elementwise add's operands.
const STREAM_ELEMENTS: [i64; 7] = [64, 1024, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];

/// The calibration's running state: what is measured so far and the time left.
struct Run {
    t0: Instant,
    /// Seconds after `t0` when points stop being added ([`BUDGET_SECONDS`]).
    budget: f64,
    threads: i32,
    overhead: f64,
    conv_setup: Vec<ConvSetup>,
    op_setup: Vec<OpSetup>,
}

impl Run {
    fn over(&self) -> bool {
        self.t0.elapsed().as_secs_f64() > self.budget
    }

    /// The rate of `work` units per second of a call that took `seconds`, less its overhead
    /// (never less than a fifth of the call: tiny calls are mostly overhead).
    fn rate(&self, work: f64, seconds: f64) -> f64 {
        work / (seconds - self.overhead).max(0.2 * seconds)
    }

    /// Square products' FLOP/s over [`MATMUL_SIDES`]; with `transposed` their first operand
    /// stored transposed (column-major, as a weight's gradient reads its input).
    fn matmul(&self, dtype: Dtype, transposed: bool) -> Result<Curve> {
        let mut points = Vec::new();
        for n in MATMUL_SIDES {
            if self.over() && !points.is_empty() {
                break;
            }
            let a = randn(&[n, n], dtype)?;
            let a = if transposed {
                a.f_transpose(0, 1).map_err(torch("calibration: transpose"))?
            } else {
                a
            };
            let b = randn(&[n, n], dtype)?;
            let t = time_call(|| a.f_mm(&b).map_err(torch("calibration: mm")))?;
            points.push([n as f64, self.rate(2.0 * (n * n * n) as f64, t)]);
        }
        Ok(Curve {
            dtype: dtype.name().into(),
            points,
        })
    }

    /// Skinny products' FLOP/s by their rows ([`THIN_ROWS`]): `x @ w.T` with `w` a
    /// [`THIN_WEIGHT`]-square weight, the weights taken in turn from enough of them to span
    /// [`FROM_MEMORY`], so that each comes from memory as a step's weights do (read once
    /// per pass). Below a few dozen rows the product's time is its weight's, packed and streamed,
    /// not its FLOPs: on the benchmark's Intel Xeon, a BERT pooler's `[8, 768]` by `[768, 768]`
    /// took 300 µs with its weight in cache and 530 µs from memory, at a quarter of a square
    /// product's rate of its mean dimension.
    fn matmul_thin(&self, dtype: Dtype) -> Result<Curve> {
        let weight_bytes = (THIN_WEIGHT * THIN_WEIGHT) as f64 * kind(dtype).elt_size_in_bytes() as f64;
        let count = (FROM_MEMORY / weight_bytes).ceil() as usize;
        let weights = (0..count)
            .map(|_| {
                Tensor::f_ones([THIN_WEIGHT, THIN_WEIGHT], (kind(dtype), Device::Cpu))
                    .map_err(torch("calibration: ones"))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut points = Vec::new();
        for rows in THIN_ROWS {
            if self.over() && !points.is_empty() {
                break;
            }
            let x = randn(&[rows, THIN_WEIGHT], dtype)?;
            let mut next = 0;
            let t = time_call(|| {
                next = (next + 1) % weights.len();
                x.f_mm(&weights[next].tr()).map_err(torch("calibration: mm"))
            })?;
            let flops = 2.0 * (rows * THIN_WEIGHT * THIN_WEIGHT) as f64;
            points.push([rows as f64, self.rate(flops, t)]);
        }
        Ok(Curve {
            dtype: dtype.name().into(),
            points,
        })
    }

    /// Convolutions' forward FLOP/s over [`CONVS`] (under no-grad), or with `backward` their
    /// backward's: both gradients through autograd, timed as forward and backward less the
    /// forward, at twice the forward's FLOPs. Each shape's rate, and the curve by mean
    /// dimension for the shapes not measured.
    fn conv(&self, dtype: Dtype, backward: bool) -> Result<(Curve, Vec<ConvShape>)> {
        let mut points = Vec::new();
        let mut shapes = Vec::new();
        for (batch, cin, cout, side, kernel) in CONVS {
            if self.over() && !points.is_empty() {
                break;
            }
            let x = randn(&[batch, cin, side, side], dtype)?;
            let w = randn(&[cout, cin, kernel, kernel], dtype)?.set_requires_grad(backward);
            let pad = kernel / 2;
            let conv = |x: &Tensor| {
                x.f_conv2d(&w, None::<&Tensor>, [1, 1], [pad, pad], [1, 1], 1)
                    .map_err(torch("calibration: conv2d"))
            };
            let t = if backward {
                let [(t_f, _), (t_fb, _)] = forward_backward(&x, &conv)?;
                (t_fb - t_f).max(0.0)
            } else {
                time_call(|| conv(&x))?
            };
            // The implicit product: batch·side² rows, cin·kernel² deep, cout columns.
            let (m, k, n) = (
                (batch * side * side) as f64,
                (cin * kernel * kernel) as f64,
                cout as f64,
            );
            let flops = if backward { 4.0 } else { 2.0 } * m * k * n;
            let [input, output] = [cin, cout].map(|c| [batch, c, side, side]);
            let setup = work::conv_setup(dtype, &input, &[cout, cin, kernel, kernel], &output, false);
            let setup = ConvSetup::paid(&self.conv_setup, setup, dtype, backward, Some(self.threads));
            let rate = flops / (t - self.overhead - setup).max(0.2 * t);
            points.push([(m * k * n).cbrt(), rate]);
            // A backward timed at no more than its forward has no rate of its own to keep.
            if rate.is_finite() {
                shapes.push(ConvShape {
                    dtype: dtype.name().into(),
                    backward,
                    shape: [m, k, n],
                    kernel: (kernel * kernel) as f64,
                    flops_per_second: rate,
                });
            }
        }
        Ok((Curve::of_points(dtype, points), shapes))
    }

    /// An elementwise add's bytes/s over [`STREAM_ELEMENTS`]: into a fresh output (`a + b`,
    /// the outputs kept alive as a step keeps its activations, the operands beyond the L2), or
    /// with `in_place` into its first operand (`a += b`, memory already touched: no page faults,
    /// as an optimizer's updates of its state).
    fn bandwidth(&self, dtype: Dtype, in_place: bool) -> Result<Curve> {
        let mut points = Vec::new();
        for n in STREAM_ELEMENTS {
            if self.over() && !points.is_empty() {
                break;
            }
            let t = if in_place {
                let mut pairs = operand_pairs(n, dtype, FROM_MEMORY)?;
                let mut next = 0;
                time_call(|| {
                    next = (next + 1) % pairs.len();
                    let (a, b) = &mut pairs[next];
                    a.f_add_(b).map_err(torch("calibration: add_"))
                })?
            } else {
                let pairs = operand_pairs(n, dtype, BEYOND_L2)?;
                let mut next = 0;
                time_call(|| {
                    next = (next + 1) % pairs.len();
                    let (a, b) = &pairs[next];
                    a.f_add(b).map_err(torch("calibration: add"))
                })?
            };
            let bytes = 3.0 * n as f64 * kind(dtype).elt_size_in_bytes() as f64;
            points.push([bytes, self.rate(bytes, t)]);
        }
        Ok(Curve {
            dtype: dtype.name().into(),
            points,
        })
    }
}

/// Bytes the operands of the in-place streaming rate and of the skinny products span at least
/// (where [`OPERAND_PAIRS`] allow), so that they come from memory, not the caches, as an
/// optimizer's state and a step's weights do: each is touched once per pass.
const FROM_MEMORY: f64 = 256.0 * 1024.0 * 1024.0;
/// Bytes the operands of the fresh-output streaming rate span at least (where [`OPERAND_PAIRS`]
/// allow): beyond a core's L2 (2 MiB on the Intel Xeon of `results/cost/`, 0.5-1 MiB on the AMD
/// EPYCs), as a step's operators find their inputs among the many tensors the step touched
/// since. With one pair reused, a small operator's operands stay in L1 and L2 and stream at a
/// rate no step reaches: on that Xeon an fp32 `add` of 16 Ki elements ran at 156 GB/s with one
/// pair, 33 GB/s with pairs spanning 16 MiB; a multiply of `[8, 128, 32]` timed from Python
/// took 8 µs with one pair, 16-17 µs with pairs spanning 4 or 16 MiB, 22-27 µs spanning 64 MiB
/// or more (memory, not the L3), and 15-28 µs in tiny-Llama's traced step.
const BEYOND_L2: f64 = 16.0 * 1024.0 * 1024.0;
/// At most this many operand pairs: below a few KiB per operand the call's overhead dominates.
const OPERAND_PAIRS: usize = 1024;

/// Pairs of operands of `n` elements, taken in turn, spanning `span` bytes where
/// [`OPERAND_PAIRS`] allow (ones: the values do not matter).
fn operand_pairs(n: i64, dtype: Dtype, span: f64) -> Result<Vec<(Tensor, Tensor)>> {
    let pair_bytes = 2.0 * n as f64 * kind(dtype).elt_size_in_bytes() as f64;
    let count = ((span / pair_bytes).ceil() as usize).clamp(2, OPERAND_PAIRS);
    let ones = || Tensor::f_ones([n], (kind(dtype), Device::Cpu)).map_err(torch("calibration: ones"));
    (0..count).map(|_| Ok((ones()?, ones()?))).collect()
}

impl Run {
    /// The time per call of a small varied training step ([`overhead`]), less its operators'
    /// setups.
    fn overhead(&mut self) -> Result<()> {
        let setup = |op: &str, w: &Work| {
            ConvSetup::of_work(&self.conv_setup, w, Some(self.threads)) + OpSetup::seconds(&self.op_setup, op)
        };
        self.overhead = overhead::per_call(&setup)?;
        Ok(())
    }

    /// A convolution's setup per call through oneDNN, and every probe's operators', beyond an
    /// add's ([`setup`]).
    fn setups(&mut self) -> Result<()> {
        let base = setup::Baseline::measure()?;
        self.conv_setup = setup::conv(&base)?;
        for p in &PROBES {
            self.op_setup
                .extend(setup::op(&base, &p.input(p.tiny, Dtype::Fp32)?, &p.forward, p.ops)?);
        }
        Ok(())
    }

    /// The rates of every probe's operators on `dtype` inputs, until the time limit.
    fn probes(&self, dtype: Dtype, generic: &DeviceRates, out: &mut Vec<OpRate>) -> Result<()> {
        for p in &PROBES {
            if self.over() {
                break;
            }
            self.probe(p, dtype, generic, out)?;
        }
        Ok(())
    }

    /// The rates of a probe's operators on `dtype` inputs: each one's bytes over its own seconds
    /// ([`Run::isolate`]); none for an operator whose pass measured no time of its own.
    fn probe(&self, p: &Probe, dtype: Dtype, generic: &DeviceRates, out: &mut Vec<OpRate>) -> Result<()> {
        let measured = forward_backward(&p.input(p.shape, dtype)?, &p.forward)?;
        for &op in p.ops {
            let (mine, own) = self.isolate(&measured, op, generic);
            let setups = OpSetup::seconds(&self.op_setup, op) * mine.len() as f64;
            let own = (own - setups).max(0.2 * own);
            let bytes: f64 = mine.iter().map(|w| w.bytes).sum();
            if bytes > 0.0 && own > 0.0 {
                out.push(OpRate {
                    op: op.into(),
                    dtype: dtype.name().into(),
                    bytes_per_second: bytes / own,
                });
            }
        }
        Ok(())
    }

    /// Operator `op`'s work in a [`forward_backward`] measurement, and its own seconds: those of
    /// the pass it ran in (the forward; else the backward, both less the forward) less that
    /// pass's calls' overhead and its other operators' work at `generic` rates (never less than
    /// a fifth of the pass: tiny passes are mostly overhead).
    fn isolate(&self, measured: &[(f64, Traced); 2], op: &str, generic: &DeviceRates) -> (Vec<Work>, f64) {
        let [(t_f, f), (t_fb, b)] = measured;
        let in_forward = |name: &str| f.counted.iter().any(|(n, _)| n == name);
        let (ops, t, calls, skip_forward) = if in_forward(op) {
            (&f.counted, *t_f, f.calls, false)
        } else {
            (&b.counted, t_fb - t_f, b.calls.saturating_sub(f.calls), true)
        };
        let mine = ops.iter().filter(|(n, _)| n == op).map(|(_, c)| c.work).collect();
        let others: f64 = ops
            .iter()
            .filter(|(n, _)| n != op && !(skip_forward && in_forward(n)))
            .map(|(_, c)| generic.work_seconds(&c.work))
            .sum();
        (mine, (t - self.overhead * calls as f64 - others).max(0.2 * t))
    }
}

/// The rows `all` reduces in [`Run::row_reduction`]: SDPA's scores in BERT-base at batch 8.
const ROWS_SHAPE: [i64; 4] = [8, 12, 128, 128];

impl Run {
    /// The rate of a bool reduction along short rows (`all`, which SDPA's math path asks of every
    /// row of its scores: is the whole row masked?), over rows of `false` as theirs are (Hugging
    /// Face masks with the dtype's lowest finite value, never `-inf`): its bytes over its time
    /// less the call's overhead. The kernel runs far below an add's rate and depends on the
    /// values: on the Intel Xeon of `results/cost/`, `all` over [`ROWS_SHAPE`] took 1.0 ms over
    /// rows of `false`, 0.65 ms over rows of `true` and 4.4 ms over random bools, against
    /// 0.05 ms by its bytes at an add's rate. None once the time limit has passed.
    fn row_reduction(&self) -> Result<Option<OpRate>> {
        if self.over() {
            return Ok(None);
        }
        let rows = Tensor::f_zeros(ROWS_SHAPE, (Kind::Bool, Device::Cpu)).map_err(torch("calibration: zeros"))?;
        let mut call = || rows.f_all_dim(-1, true).map_err(torch("calibration: all"));
        let bytes: f64 = traced(&mut call)?
            .counted
            .iter()
            .filter(|(n, _)| n == "aten::all")
            .map(|(_, c)| c.work.bytes)
            .sum();
        let t = time_call(&mut call)?;
        Ok((bytes > 0.0).then(|| OpRate {
            op: "aten::all".into(),
            dtype: Dtype::Fp32.name().into(),
            bytes_per_second: self.rate(bytes, t),
        }))
    }
}

/// The operator fused attention runs on the CPU, forward and backward.
const ATTENTION_OPS: [&str; 2] = [
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
];

fn attention_call(x: &Tensor, causal: bool) -> Result<Tensor> {
    Tensor::f_scaled_dot_product_attention(x, x, x, None::<&Tensor>, 0.0, causal, None::<f64>, false)
        .map_err(torch("calibration: scaled_dot_product_attention"))
}

impl Run {
    /// Fused attention's seconds per score beyond its products' FLOPs at `generic`'s matrix
    /// product rate (forward; backward from forward and backward less forward), and a causal
    /// call's share of an unmasked one's by query length.
    fn attention(&self, generic: &DeviceRates) -> Result<Option<AttentionRates>> {
        let mut per_score = [Vec::new(), Vec::new()];
        for head in ATTENTION_HEADS {
            if self.over() && !per_score[0].is_empty() {
                break;
            }
            let Some(at) = self.per_score(head, generic)? else {
                return Ok(None);
            };
            for k in 0..2 {
                per_score[k].push([head as f64, at[k]]);
            }
        }
        let by_head = |mut points: Vec<[f64; 2]>| {
            points.sort_by(|a, b| a[0].total_cmp(&b[0]));
            Curve {
                dtype: Dtype::Fp32.name().into(),
                points,
            }
        };
        let [forward, backward] = per_score;
        let mut share = Vec::new();
        for l in CAUSAL_LENGTHS {
            if self.over() {
                break;
            }
            let x = randn(&[1, ((1 << 20) / (l * l)).max(1), l, 64], Dtype::Fp32)?;
            let [_, (full, _)] = forward_backward(&x, &|x| attention_call(x, false))?;
            let [_, (causal, _)] = forward_backward(&x, &|x| attention_call(x, true))?;
            share.push([l as f64, (causal / full).min(1.0)]);
        }
        Ok(Some(AttentionRates {
            forward_seconds_per_score: by_head(forward),
            backward_seconds_per_score: by_head(backward),
            causal_share: Curve {
                dtype: Dtype::Fp32.name().into(),
                points: share,
            },
        }))
    }

    /// Fused attention's seconds per score beyond its products' FLOPs at `generic`'s matrix
    /// product rate at head size `head`, forward and backward; `None` where the trace shows no
    /// fused attention kernel.
    fn per_score(&self, head: i64, generic: &DeviceRates) -> Result<Option<[f64; 2]>> {
        let [b, h, l] = ATTENTION_SHAPE;
        let x = randn(&[b, h, l, head], Dtype::Fp32)?;
        let measured = forward_backward(&x, &|x| attention_call(x, false))?;
        let mut per_score = [0.0; 2];
        for (k, op) in ATTENTION_OPS.iter().enumerate() {
            let (mine, own) = self.isolate(&measured, op, generic);
            let Some(w) = mine.first().filter(|w| w.attention.is_some()) else {
                return Ok(None);
            };
            let a = w.attention.expect("filtered");
            let products = generic.work_seconds(&Work {
                flops: a.full_flops,
                bytes: 0.0,
                attention: None,
                ..*w
            });
            // Positive, as the curve is read in log space: a head size whose products take the
            // whole call adds nothing per score.
            per_score[k] = ((own - products) / a.scores).max(f64::MIN_POSITIVE);
        }
        Ok(Some(per_score))
    }
}

/// Measures this CPU's rates with `threads` intra-op threads (restored afterwards). Takes at
/// most about [`BUDGET_SECONDS`].
pub fn calibrate(threads: i32, identity: &str) -> Result<DeviceRates> {
    let before = tch::get_num_threads();
    tch::set_num_threads(threads);
    let _held = HostMemoryHold::new();
    let measured = measure(threads, identity, BUDGET_SECONDS);
    tch::set_num_threads(before);
    measured
}

/// The rates the refinements (slow kernels, attention) are isolated over: the streaming curves
/// and the overhead measured, products and convolutions at a flat placeholder rate until theirs
/// are measured.
fn generic_rates(threads: i32, identity: &str, bandwidth: Vec<Curve>, overhead: f64) -> DeviceRates {
    DeviceRates {
        device: "cpu".into(),
        name: identity.into(),
        measured: true,
        source: String::new(),
        threads: Some(threads),
        matmul: vec![Curve::flat(Dtype::Fp32, 1e11)],
        matmul_thin: Vec::new(),
        matmul_transposed: Vec::new(),
        conv: vec![Curve::flat(Dtype::Fp32, 1e11)],
        conv_shapes: Vec::new(),
        conv_backward: Vec::new(),
        conv_setup: Vec::new(),
        bandwidth,
        bandwidth_in_place: Vec::new(),
        overhead_seconds: overhead,
        ops: Vec::new(),
        op_setup: Vec::new(),
        attention: None,
        block_overhead: None,
        host: None,
    }
}

/// Square products of a transposed first operand per dtype, each kept only where the time
/// limit left room for every side: a curve holds flat past its last point, and a product of a
/// transposed operand without one takes `matmul`'s rate. On an Intel Xeon with AMX, bf16's ran
/// at 0.58 of `matmul`'s at BERT-base's weight gradients (`[768, 1024]` by `[1024, 768]`),
/// fp32's at its rate.
fn transposed_products(run: &Run) -> Result<Vec<Curve>> {
    let _no_grad = tch::no_grad_guard();
    let mut curves = Vec::new();
    for dtype in [Dtype::Fp32, Dtype::Bf16] {
        if run.over() {
            break;
        }
        let curve = run.matmul(dtype, true)?;
        if curve.points.len() == MATMUL_SIDES.len() {
            curves.push(curve);
        }
    }
    Ok(curves)
}

/// bf16 convolutions' backward, kept only where the time limit left room for every shape: a
/// curve holds flat past its last point, and without one a bf16 backward takes the bf16
/// forward's rate. On an Intel Xeon with AMX that backward ran at 0.33-0.89 of the forward's
/// rate (ResNet's 1×1 reductions the slowest), where fp32's ran at 0.37-0.99.
fn bf16_conv_backward(run: &Run) -> Result<(Option<Curve>, Vec<ConvShape>)> {
    if run.over() {
        return Ok((None, Vec::new()));
    }
    let (curve, shapes) = run.conv(Dtype::Bf16, true)?;
    Ok(if shapes.len() == CONVS.len() {
        (Some(curve), shapes)
    } else {
        (None, Vec::new())
    })
}

fn measure(threads: i32, identity: &str, budget: f64) -> Result<DeviceRates> {
    let mut run = Run {
        t0: Instant::now(),
        budget,
        threads,
        overhead: 0.0,
        conv_setup: Vec::new(),
        op_setup: Vec::new(),
    };
    run.setups()?;
    run.overhead()?;
    let block_overhead = Some(block_overhead::per_block()?);
    let (bandwidth, bandwidth_in_place) = {
        let _no_grad = tch::no_grad_guard();
        (
            vec![run.bandwidth(Dtype::Fp32, false)?, run.bandwidth(Dtype::Bf16, false)?],
            vec![run.bandwidth(Dtype::Fp32, true)?, run.bandwidth(Dtype::Bf16, true)?],
        )
    };
    let generic = generic_rates(threads, identity, bandwidth.clone(), run.overhead);
    // The curves every estimate needs come first, so that a busy or slow machine's time limit
    // cuts the slow kernels, attention and last the skinny products (which fall back to the
    // generic and square rates) rather than them.
    let (matmul, conv, forward_shapes) = {
        let _no_grad = tch::no_grad_guard();
        let matmul = vec![run.matmul(Dtype::Fp32, false)?, run.matmul(Dtype::Bf16, false)?];
        let (fp32, fp32_shapes) = run.conv(Dtype::Fp32, false)?;
        let (bf16, bf16_shapes) = run.conv(Dtype::Bf16, false)?;
        (matmul, vec![fp32, bf16], [fp32_shapes, bf16_shapes].concat())
    };
    let matmul: Vec<Curve> = matmul.into_iter().filter(|c| !c.points.is_empty()).collect();
    let (conv_backward, backward_shapes) = run.conv(Dtype::Fp32, true)?;
    let mut ops = Vec::new();
    run.probes(Dtype::Fp32, &generic, &mut ops)?;
    ops.extend(run.row_reduction()?);
    let attention = if run.over() || matmul.is_empty() {
        None
    } else {
        run.attention(&DeviceRates {
            matmul: matmul.clone(),
            ..generic.clone()
        })?
    };
    // A refinement for the few products of a few rows (a pooler, a classifier head), kept only
    // where the time limit left room for every point of both dtypes: a curve holds flat past its
    // last point, and a bf16 product without its own curve would take fp32's, so a cut one
    // would cap larger products at a few rows' rate.
    let matmul_thin = if run.over() {
        Vec::new()
    } else {
        let _no_grad = tch::no_grad_guard();
        vec![run.matmul_thin(Dtype::Fp32)?, run.matmul_thin(Dtype::Bf16)?]
    };
    let matmul_thin = if matmul_thin.iter().all(|c| c.points.len() == THIN_ROWS.len()) {
        matmul_thin
    } else {
        Vec::new()
    };
    let matmul_transposed = transposed_products(&run)?;
    let (bf16_backward, bf16_backward_shapes) = bf16_conv_backward(&run)?;
    let conv_shapes = [forward_shapes, backward_shapes, bf16_backward_shapes].concat();
    // Last, so that the time limit cuts them first: a bf16 operator without its own rate takes
    // fp32's per element (`DeviceRates::op_seconds`).
    run.probes(Dtype::Bf16, &generic, &mut ops)?;
    let seconds = run.t0.elapsed().as_secs_f64();
    Ok(DeviceRates {
        device: "cpu".into(),
        name: identity.into(),
        measured: true,
        source: format!(
            "calibration run (version {CALIBRATION_VERSION}) with {threads} threads, {seconds:.1} s: mm (and of a transposed operand), conv2d \
             3×3 and 1×1 forward and backward in fp32 and bf16 (each shape's rate, and by size) and add (fresh and in place) over sizes, skinny mm by rows, {} slow kernels forward and backward in fp32 and bf16, a bool reduction along rows, fused attention per score and its \
             causal share, a small varied training step's overhead per call, the runtime's time around a block; \
             each point the median of {BATCHES} batches",
            PROBES.len()
        ),
        threads: Some(threads),
        matmul,
        matmul_thin,
        matmul_transposed,
        conv: conv.into_iter().filter(|c| !c.points.is_empty()).collect(),
        conv_shapes,
        conv_backward: [Some(conv_backward), bf16_backward]
            .into_iter()
            .flatten()
            .filter(|c| !c.points.is_empty())
            .collect(),
        bandwidth: bandwidth.into_iter().filter(|c| !c.points.is_empty()).collect(),
        bandwidth_in_place: bandwidth_in_place.into_iter().filter(|c| !c.points.is_empty()).collect(),
        overhead_seconds: run.overhead,
        conv_setup: run.conv_setup,
        ops,
        op_setup: run.op_setup,
        attention,
        block_overhead,
        host: None,
    })
}

#[cfg(test)]
#[path = "calibrate_tests.rs"]
mod tests;
