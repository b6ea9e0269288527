//! What each operator of a trace does, for the cost model (docs/cost-model.md): the FLOPs of
//! matrix products, convolutions and attention from their shapes, the bytes every other
//! operator reads and writes, and which operators of a nested trace do the work at all.

pub use ckptune_kernels::optrace::is_operator;
use ckptune_kernels::optrace::{self, OpEvent};
use ckptune_solver::rates::{AttentionWork, Dtype, Engine, Setup, Work};
use tch::Kind;

/// Allocation and metadata: operators that move no data (their children, if any, are traced).
const BOOKKEEPING: &[&str] = &[
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::resize_",
    "aten::as_strided_",
    "aten::set_",
    "aten::detach_",
    "aten::lift_fresh",
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::record_stream",
    // Return their input's storage under new sizes, as views do, but without the schema's alias
    // annotation (`matmul` folds its operands and its result with `_unsafe_view`).
    "aten::_unsafe_view",
    "aten::unsafe_split",
    "aten::unsafe_split_with_sizes",
    "aten::unsafe_chunk",
];

/// In-place operators that overwrite their first input without reading it.
const OVERWRITES: &[&str] = &[
    "aten::copy_",
    "aten::fill_",
    "aten::zero_",
    "aten::bernoulli_",
    "aten::uniform_",
    "aten::normal_",
    "aten::random_",
    "aten::exponential_",
];

/// Parts that only initialize what an operator then computes from inputs of other shapes
/// (`max_pool2d_with_indices_backward` zeroes its gradient, then scatters into it): the
/// operator's work is its own. A factory's fill (`ones`, `zeros_like`) is its work.
const INITIALIZES: &[&str] = &["aten::fill_", "aten::zero_"];

/// The operator's name without its overload (`aten::add` of `aten::add.Tensor`).
pub fn base(name: &str) -> &str {
    let after = name.find("::").map_or(0, |i| i + 2);
    name[after..].find('.').map_or(name, |d| &name[..after + d])
}

fn elements(shape: &[i64]) -> f64 {
    shape.iter().map(|&s| s.max(0) as f64).product()
}

fn tensor(e: &OpEvent, i: usize) -> Option<&(Kind, Vec<i64>)> {
    e.inputs.get(i).and_then(Option::as_ref)
}

fn number(e: &OpEvent, i: usize) -> Option<f64> {
    e.numbers.get(i).copied().flatten()
}

fn dtype_of(kind: Kind) -> Dtype {
    match kind {
        Kind::BFloat16 => Dtype::Bf16,
        Kind::Half => Dtype::Fp16,
        _ => Dtype::Fp32,
    }
}

fn is_floating(kind: Kind) -> bool {
    matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}

fn bytes_of((kind, shape): &(Kind, Vec<i64>)) -> f64 {
    elements(shape) * kind.elt_size_in_bytes() as f64
}

/// Operators that read only the rows they select from their first input: it counts as many
/// bytes as they return (an embedding reads its batch's rows, not the vocabulary).
const GATHERS: &[&str] = &[
    "aten::index_select",
    "aten::gather",
    "aten::index",
    "aten::take",
    "aten::embedding",
];

/// The bytes an operator reads and writes: its tensor inputs and outputs, less an input it
/// writes without reading (the destination of `copy_`, `fill_`, an `out=` argument), which
/// its output already counts, and of a gather's source only what it returns.
fn bytes_moved(e: &OpEvent, writes_input: bool) -> f64 {
    let returned: f64 = e.outputs.iter().flatten().map(bytes_of).sum();
    if GATHERS.contains(&base(&e.name)) {
        let source = e
            .inputs
            .first()
            .and_then(Option::as_ref)
            .map_or(0.0, |t| bytes_of(t).min(returned));
        let rest: f64 = e.inputs.iter().skip(1).flatten().map(bytes_of).sum();
        return source + rest + returned;
    }
    let mut inputs: Vec<&(Kind, Vec<i64>)> = e.inputs.iter().flatten().collect();
    if writes_input {
        if is_out_overload(&e.name) {
            inputs.pop();
        } else if OVERWRITES.contains(&base(&e.name)) && !inputs.is_empty() {
            inputs.remove(0);
        }
    }
    inputs.into_iter().map(bytes_of).sum::<f64>() + returned
}

/// Whether an operator updates a tensor it was given in place, reading it (`add_`, `lerp_`,
/// `addcmul_`, `_foreach_mul_`): not an `out=` overload or an operator that overwrites its
/// destination ([`OVERWRITES`]), whose destination is commonly memory just allocated for it
/// (`_to_copy`'s `copy_`, `dropout`'s `bernoulli_`). `writes_input`: the schema says it writes
/// an input ([`traits`]).
pub fn updates_in_place(e: &OpEvent, writes_input: bool) -> bool {
    writes_input && !is_out_overload(&e.name) && !OVERWRITES.contains(&base(&e.name))
}

/// Whether `name` is an `out=` overload (`aten::add.out`, or an overload named `…_out`), which
/// writes its last argument.
fn is_out_overload(name: &str) -> bool {
    let overload = name.rsplit_once('.').map_or("", |(_, o)| o);
    overload.starts_with("out") || overload.ends_with("_out")
}

/// The dtype of the largest floating-point tensor an operator touches (fp32 when it touches
/// none): what its kernel computes in. An index tensor never sets it, though it may be the
/// largest: bf16 max pooling's int64 indices hold as many bytes as its input, and taking theirs
/// timed ResNet-18's pooling at fp32's rate, 16.5 ms against 30.6 ms measured on an AMD EPYC.
fn main_dtype(e: &OpEvent) -> Dtype {
    e.inputs
        .iter()
        .chain(&e.outputs)
        .flatten()
        .filter(|t| is_floating(t.0))
        .max_by(|a, b| bytes_of(a).total_cmp(&bytes_of(b)))
        .map_or(Dtype::Fp32, |t| dtype_of(t.0))
}

/// A product of `macs` multiply-adds whose matrices are `m × k` by `k × n`. A matrix product's
/// `thin` is `min(m, n)` (a convolution's implicit product has none: its kernels tile the
/// image, not a weight matrix).
fn product(engine: Engine, e: &OpEvent, macs: f64, mkn: [f64; 3], writes_input: bool) -> Work {
    Work {
        engine,
        dtype: main_dtype(e),
        flops: 2.0 * macs,
        bytes: bytes_moved(e, writes_input),
        size: (mkn[0] * mkn[1] * mkn[2]).cbrt(),
        shape: mkn,
        lhs_transposed: false,
        kernel: 0.0,
        pass_bytes: 0.0,
        setup: Setup::None,
        thin: if engine == Engine::Matmul {
            mkn[0].min(mkn[2])
        } else {
            0.0
        },
        attention: None,
    }
}

/// The multiply-adds of a matrix product of `a` by `b` with NumPy's broadcasting (`matmul`),
/// and its `m, k, n`.
fn matmul_macs(a: &[i64], b: &[i64]) -> Option<(f64, [f64; 3])> {
    let (a, b): (Vec<i64>, Vec<i64>) = (a.to_vec(), b.to_vec());
    let a = if a.len() == 1 { vec![1, a[0]] } else { a };
    let b = if b.len() == 1 { vec![b[0], 1] } else { b };
    if a.len() < 2 || b.len() < 2 {
        return None;
    }
    let (m, k, n) = (a[a.len() - 2] as f64, a[a.len() - 1] as f64, b[b.len() - 1] as f64);
    let (ba, bb) = (&a[..a.len() - 2], &b[..b.len() - 2]);
    let rank = ba.len().max(bb.len());
    let dim = |s: &[i64], i: usize| -> f64 { s.len().checked_sub(rank - i).map_or(1.0, |j| s[j] as f64) };
    let batch: f64 = (0..rank).map(|i| dim(ba, i).max(dim(bb, i))).product();
    Some((batch * m * k * n, [m, k, n]))
}

/// Matrix products, with the index of their first operand (`addmm`'s first argument is what
/// it adds).
const PRODUCTS: &[(&str, usize)] = &[
    ("aten::mm", 0),
    ("aten::bmm", 0),
    ("aten::matmul", 0),
    ("aten::mv", 0),
    ("aten::dot", 0),
    ("aten::vdot", 0),
    ("aten::addmm", 1),
    ("aten::_addmm_activation", 1),
    ("aten::baddbmm", 1),
    ("aten::addbmm", 1),
    ("aten::addmv", 1),
];

/// Products of an input `[…, k]` by a weight `[n, k]`.
const LINEARS: &[&str] = &["aten::linear", "aten::mkldnn_linear"];

/// Matrix products ([`PRODUCTS`], [`LINEARS`]).
fn matmul_work(e: &OpEvent, writes_input: bool) -> Option<Work> {
    let name = base(&e.name);
    let shape = |i| tensor(e, i).map(|t| t.1.as_slice());
    if LINEARS.contains(&name) {
        let (x, w) = (shape(0)?, shape(1)?);
        let k = *x.last()? as f64;
        let n = if w.len() == 2 { w[0] as f64 } else { 1.0 };
        let m = elements(x) / k.max(1.0);
        return Some(product(Engine::Matmul, e, m * k * n, [m, k, n], writes_input));
    }
    let &(_, first) = PRODUCTS.iter().find(|(n, _)| *n == name)?;
    let (macs, mkn) = matmul_macs(shape(first)?, shape(first + 1)?)?;
    Some(Work {
        lhs_transposed: e.column_major(first),
        pass_bytes: if first == 1 { added_pass(e) } else { 0.0 },
        ..product(Engine::Matmul, e, macs, mkn, writes_input)
    })
}

/// The pass of an `addmm`-like product (`self + mat1 @ mat2`) before it multiplies: ATen's CPU
/// kernels copy `self`, broadcast, into the output, then accumulate the product onto it
/// (`beta` 1). Its bytes: `self` read, and the output twice, as a write into memory not in the
/// cache first reads each line (on the Intel Xeon of `results/cost/`, a bias broadcast into a
/// fresh bf16 `[1024, 768]` took 0.16 ms, 3 MB at its calibrated streaming rate 0.14 ms; an add
/// writing the same output took 0.23 ms); none where `beta` is 0.
fn added_pass(e: &OpEvent) -> f64 {
    // `addmm(self, mat1, mat2, beta, alpha)`, and the same order for its siblings.
    if number(e, 3) == Some(0.0) {
        return 0.0;
    }
    let added = tensor(e, 0).map_or(0.0, bytes_of);
    let written: f64 = e.outputs.iter().flatten().map(bytes_of).sum();
    added + 2.0 * written
}

/// Convolutions, each backend's and their backwards (`convolution`, `mkldnn_convolution`,
/// `_slow_conv2d_forward`, `convolution_backward`, …), not conversions.
fn is_conv(name: &str) -> bool {
    name.contains("conv") && !name.contains("convert")
}

/// The index of `transposed` among a convolution operator's arguments, where it has one.
fn transposed_index(name: &str) -> Option<usize> {
    match base(name) {
        "aten::convolution" | "aten::_convolution" | "aten::convolution_overrideable" => Some(6),
        "aten::convolution_backward" | "aten::convolution_backward_overrideable" => Some(7),
        _ => None,
    }
}

/// A convolution's multiply-adds and implicit product `m, k, n` from its input, weight and
/// output: each output element takes `weight.numel() / out_channels` multiply-adds (a
/// transposed convolution's each input element `weight.numel() / in_channels`).
fn conv_macs(input: &[i64], weight: &[i64], output: &[i64], transposed: bool) -> Option<(f64, [f64; 3])> {
    let w0 = *weight.first()? as f64;
    let per = elements(weight) / w0.max(1.0);
    let (outer, channels) = if transposed {
        (elements(input), *input.get(1)? as f64)
    } else {
        (elements(output), *output.get(1)? as f64)
    };
    let macs = outer * per;
    Some((macs, [outer / channels.max(1.0), per, channels]))
}

/// Convolutions forward (`convolution` and each backend's: `mkldnn_convolution`,
/// `_slow_conv2d_forward`, …) and backward (`convolution_backward`, the backends'), groups
/// included through the weight's shape. A backward does a forward's work per gradient it
/// computes (input, weight).
fn conv_work(e: &OpEvent, writes_input: bool) -> Option<Work> {
    let name = base(&e.name);
    if !is_conv(name) {
        return None;
    }
    let transposed = name.contains("transpose") || transposed_index(name).and_then(|i| number(e, i)) == Some(1.0);
    let shape = |i| tensor(e, i).map(|t| t.1.as_slice());
    if name.contains("backward") {
        let (grad_out, input, weight) = (shape(0)?, shape(1)?, shape(2)?);
        if weight.len() < 3 {
            return None;
        }
        let grads = e.outputs.iter().take(2).filter(|o| o.is_some()).count() as f64;
        let (macs, mkn) = conv_macs(input, weight, grad_out, transposed)?;
        let work = product(Engine::ConvBackward, e, macs * grads, mkn, writes_input);
        return Some(with_kernel(work, input, weight, grad_out, transposed));
    }
    let (input, weight) = (shape(0)?, shape(1)?);
    let output = e.outputs.first()?.as_ref()?.1.as_slice();
    if weight.len() < 3 || input.len() != weight.len() {
        return None;
    }
    let (macs, mkn) = conv_macs(input, weight, output, transposed)?;
    let work = product(Engine::Conv, e, macs, mkn, writes_input);
    Some(with_kernel(work, input, weight, output, transposed))
}

/// A convolution's `work` with the pixels of its kernel (the weight's dimensions past its
/// output and input channels) and its setup on a CPU ([`conv_setup`]).
fn with_kernel(work: Work, input: &[i64], weight: &[i64], output: &[i64], transposed: bool) -> Work {
    Work {
        kernel: elements(&weight[2..]),
        setup: conv_setup(work.dtype, input, weight, output, transposed),
        ..work
    }
}

/// Whether PyTorch runs a CPU convolution of these shapes through oneDNN, which sets its kernel
/// up on every call ([`Setup`]): `ConvParams::use_mkldnn` of torch 2.13, with a 1-D
/// convolution's shapes as the 2-D view it is run as. bf16 and fp16 always (a CPU without their
/// kernels runs them with PyTorch's own, and its calibration measures that setup). fp32 where the
/// convolution is grouped, its kernel over 3 by 3, its batch over 1 or its input over 20,480
/// elements, and besides that strided, its batch at least 16, its kernel not 1×1, or the step
/// threaded ([`Setup::Threaded`]). A 1×1 kernel's stride is read off its spatial sizes (equal:
/// unstrided); dilation does not change a 1×1 kernel's output, and is taken as absent.
pub fn conv_setup(dtype: Dtype, input: &[i64], weight: &[i64], output: &[i64], transposed: bool) -> Setup {
    if dtype != Dtype::Fp32 {
        return Setup::Always;
    }
    let as_2d = |s: &[i64]| -> Vec<i64> {
        let mut v = s.to_vec();
        if v.len() == 3 {
            v.insert(2, 1);
        }
        v
    };
    let (input, weight, output) = (as_2d(input), as_2d(weight), as_2d(output));
    let (Some(&batch), Some(&kw), Some(&kh)) = (input.first(), weight.last(), weight.iter().rev().nth(1)) else {
        return Setup::None;
    };
    let channels = if transposed { output.get(1) } else { input.get(1) }
        .copied()
        .unwrap_or(1);
    let groups = channels / weight.get(1).copied().unwrap_or(1).max(1);
    let first_four: i64 = input.iter().take(4).product();
    if !(groups > 1 || (kw > 3 && kh > 3) || batch > 1 || first_four > 20_480) {
        return Setup::None;
    }
    let strided = input.get(2..) != output.get(2..);
    if strided || batch >= 16 || kw != 1 || kh != 1 {
        Setup::Always
    } else {
        Setup::Threaded
    }
}

/// Scaled dot-product attention's fused kernels and their backwards, with the index of
/// `is_causal` among their arguments.
const ATTENTION: &[(&str, usize)] = &[
    ("aten::_scaled_dot_product_flash_attention_for_cpu", 4),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 7),
    ("aten::_scaled_dot_product_flash_attention", 4),
    ("aten::_scaled_dot_product_flash_attention_backward", 8),
    ("aten::_scaled_dot_product_efficient_attention", 6),
    ("aten::_scaled_dot_product_efficient_attention_backward", 10),
    ("aten::_scaled_dot_product_cudnn_attention", 7),
    ("aten::_scaled_dot_product_cudnn_attention_backward", 12),
];

/// Attention over `q [.., L, E]`, `k [.., S, E]`, `v [.., S, Ev]`: two products, `2·L·S·(E +
/// Ev)` FLOPs per head, half that when causal; the backward recomputes the scores and takes
/// four more products (dV, dP, dQ, dK: 2.5 times the forward, as FlashAttention-2 counts it).
/// Its scores (`heads·L·S`, masked or not) are timed besides over a CPU's measured rates.
fn attention_work(e: &OpEvent, writes_input: bool) -> Option<Work> {
    let name = base(&e.name);
    let &(_, causal_at) = ATTENTION.iter().find(|(n, _)| *n == name)?;
    let backward = name.ends_with("_backward");
    let first = usize::from(backward);
    let shape = |i| tensor(e, i).map(|t| t.1.as_slice());
    let (q, k, v) = (shape(first)?, shape(first + 1)?, shape(first + 2)?);
    let (l, e_qk) = (q[q.len().checked_sub(2)?] as f64, *q.last()? as f64);
    let s = k[k.len().checked_sub(2)?] as f64;
    let ev = *v.last()? as f64;
    let heads = elements(q) / (l * e_qk).max(1.0);
    let causal = if number(e, causal_at) == Some(1.0) { 0.5 } else { 1.0 };
    let factor = if backward { 2.5 } else { 1.0 };
    let full = heads * l * s * (e_qk + ev) * factor;
    let mut work = product(Engine::Matmul, e, full * causal, [l, e_qk, s], writes_input);
    // Its products are the scores' and the values': no weight streams through them.
    work.thin = 0.0;
    work.attention = Some(AttentionWork {
        scores: heads * l * s,
        full_flops: 2.0 * full,
        causal: causal < 1.0,
        length: l,
        head: e_qk,
        backward,
    });
    Some(work)
}

/// The work of one operator call, by its formula: FLOPs for products, convolutions and
/// attention, else the bytes it reads and writes. `writes_input`: the operator writes into an
/// input (libtorch's schema says so; [`optrace::op_traits`]).
pub fn work_of(e: &OpEvent, writes_input: bool) -> Work {
    matmul_work(e, writes_input)
        .or_else(|| conv_work(e, writes_input))
        .or_else(|| attention_work(e, writes_input))
        .unwrap_or_else(|| Work {
            engine: Engine::Memory,
            dtype: main_dtype(e),
            flops: 0.0,
            bytes: bytes_moved(e, writes_input),
            size: 0.0,
            thin: 0.0,
            attention: None,
            shape: [0.0; 3],
            lhs_transposed: false,
            kernel: 0.0,
            pass_bytes: cast_pass(e),
            setup: Setup::None,
        })
}

/// Elementwise arithmetic that promotes inputs of mixed dtypes to a common one (TensorIterator),
/// in place or not.
const PROMOTING: &[&str] = &[
    "aten::add",
    "aten::sub",
    "aten::rsub",
    "aten::mul",
    "aten::div",
    "aten::maximum",
    "aten::minimum",
    "aten::where",
    "aten::lerp",
    "aten::addcmul",
    "aten::addcdiv",
    "aten::pow",
];

/// Whether `e` is elementwise arithmetic that promotes its inputs ([`PROMOTING`]).
fn promotes(e: &OpEvent) -> bool {
    let name = base(&e.name);
    PROMOTING.contains(&name.strip_suffix('_').unwrap_or(name))
}

/// Whether `e` is a cast's work (`to`'s `_to_copy`'s `copy_`).
fn is_cast(e: &OpEvent) -> bool {
    ["aten::copy_", "aten::_to_copy", "aten::to"].contains(&base(&e.name))
}

/// An elementwise operator over floating tensors of mixed dtypes (under autocast, a bf16 branch
/// added to an fp32 residual) runs, on a CPU, in the widest of them: TensorIterator casts each
/// narrower input into a temporary of that dtype, runs on the temporaries, and casts a narrower
/// output back (in place into bf16). Its pass: each narrower input read and written at that width
/// by the cast, then read at that width rather than its own (`2·n·width` bytes), and each
/// narrower output written at that width, then cast back (`n·(width + own)`). A 0-dim tensor (a
/// wrapped Python number) sets no width. A GPU's kernel casts in registers, one pass over the
/// tensors as they are (`DeviceRates::pass_seconds`).
fn cast_pass(e: &OpEvent) -> f64 {
    if !promotes(e) {
        return 0.0;
    }
    let size = |k: Kind| k.elt_size_in_bytes() as f64;
    let tensors = || e.inputs.iter().flatten().chain(e.outputs.iter().flatten());
    let width = tensors()
        .filter(|(k, shape)| is_floating(*k) && !shape.is_empty())
        .map(|(k, _)| size(*k))
        .fold(0.0, f64::max);
    let narrower = |v: &[Option<(Kind, Vec<i64>)>]| -> Vec<(f64, f64)> {
        v.iter()
            .flatten()
            .filter(|(k, _)| is_floating(*k) && size(*k) < width)
            .map(|(k, shape)| (elements(shape), size(*k)))
            .collect()
    };
    let inputs: f64 = narrower(&e.inputs).iter().map(|(n, _)| 2.0 * n * width).sum();
    let outputs: f64 = narrower(&e.outputs).iter().map(|(n, own)| n * (width + own)).sum();
    inputs + outputs
}

/// Whether [`work_of`] has a FLOP formula for the operator.
pub fn has_flops(name: &str) -> bool {
    let b = base(name);
    PRODUCTS.iter().any(|(n, _)| *n == b)
        || LINEARS.contains(&b)
        || is_conv(b)
        || ATTENTION.iter().any(|(n, _)| *n == b)
}

/// What the dispatcher says of an operator, as far as counting goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traits {
    /// Its parts are traced and do its work (only a `CompositeImplicitAutograd` kernel).
    pub decomposition: bool,
    pub view: bool,
    pub writes_input: bool,
}

/// [`Traits`] from libtorch's dispatcher (an unknown name: none).
pub fn traits(name: &str) -> Traits {
    optrace::op_traits(name).map_or(Traits::default(), |t| Traits {
        decomposition: t.decomposition,
        view: t.view,
        writes_input: t.writes_input,
    })
}

/// One operator call that does work, with what it does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counted {
    /// Its index in the trace.
    pub index: usize,
    pub work: Work,
}

/// The operator calls of a trace that do the work, each once: a product, convolution or
/// attention with a FLOP formula (what it runs inside is its own business), else the
/// innermost operators that move data. Not counted: scopes and autograd's node evaluations
/// (what runs in them is), decompositions whose parts are traced, views, allocation and
/// metadata ([`BOOKKEEPING`]), and an operator one of whose counted parts writes as much as it
/// returns (a wrapper). `traits` says what
/// the dispatcher knows of an operator ([`traits`] in production).
pub fn counted(events: &[OpEvent], traits: &mut dyn FnMut(&str) -> Traits) -> Vec<Counted> {
    counted_except(events, &[], traits)
}

/// [`counted`], with the calls flagged in `replayed` doing no work: a selective block's
/// recompute takes their outputs from its forward's cache. An operator that one of them ran
/// inside (`linear` over a replayed `addmm`) counts only through its other parts.
pub fn counted_except(events: &[OpEvent], replayed: &[bool], traits: &mut dyn FnMut(&str) -> Traits) -> Vec<Counted> {
    let mut out = Vec::new();
    let mut range = CountRange {
        events,
        replayed,
        traits,
        out: &mut out,
    };
    range.count(0, events.len());
    out
}

/// What [`counted_except`] walks, and what it has counted so far.
struct CountRange<'a, 't> {
    events: &'a [OpEvent],
    replayed: &'a [bool],
    traits: &'t mut dyn FnMut(&str) -> Traits,
    out: &'t mut Vec<Counted>,
}

impl CountRange<'_, '_> {
    fn replayed_in(&self, lo: usize, hi: usize) -> bool {
        self.replayed
            .get(lo..hi.min(self.replayed.len()))
            .is_some_and(|r| r.contains(&true))
    }

    /// Events `lo..hi`, siblings in order.
    fn count(&mut self, lo: usize, hi: usize) {
        let mut i = lo;
        while i < hi {
            let end = self.events[i].end.clamp(i + 1, hi);
            if !self.replayed_in(i, i + 1) {
                self.count_event(i, end);
            }
            i = end;
        }
    }

    /// Event `i`, whose calls inside it end before `end`.
    fn count_event(&mut self, i: usize, end: usize) {
        let events = self.events;
        let e = &events[i];
        if !is_operator(e) {
            self.count(i + 1, end);
            return;
        }
        let t = (self.traits)(&e.name);
        let formula = has_flops(&e.name);
        let replayed_inside = self.replayed_in(i + 1, end);
        if formula && !t.decomposition && !replayed_inside {
            self.out.push(Counted {
                index: i,
                work: work_of(e, t.writes_input),
            });
            return;
        }
        let first_part = self.out.len();
        self.count(i + 1, end);
        let out = &mut *self.out;
        let casts_only = out.len() > first_part && out[first_part..].iter().all(|c| is_cast(&events[c.index]));
        if casts_only && cast_pass(e) > 0.0 {
            // A CPU's TensorIterator casting inputs of another dtype into temporaries, traced
            // (the meta device's too): the operator's own pass, which a GPU does not make.
            out.truncate(first_part);
            out.push(Counted {
                index: i,
                work: work_of(e, t.writes_input),
            });
            return;
        }
        // A part that writes (about) as many elements as the operator returns did its work
        // (`_to_copy`'s `copy_`, `embedding`'s `index_select`); a smaller one is its own
        // (`div_.Tensor` first casts its scalar with `to`).
        let size = elements_written(e);
        let computes = reads_other_shapes(e);
        let done_by_parts = out[first_part..].iter().any(|c| {
            let part = &events[c.index];
            let init = INITIALIZES.contains(&base(&part.name));
            (!init || !computes) && 2.0 * elements_written(part) >= size
        });
        let done_by_parts = done_by_parts || replayed_inside || (t.decomposition && out.len() > first_part);
        let bookkeeping = BOOKKEEPING.contains(&base(&e.name)) || t.view;
        if !done_by_parts && !bookkeeping && (formula || !t.decomposition) {
            out.push(Counted {
                index: i,
                work: work_of(e, t.writes_input),
            });
        }
    }
}

/// Whether an operator reads a tensor of another shape than the largest it returns.
fn reads_other_shapes(e: &OpEvent) -> bool {
    let out = e
        .outputs
        .iter()
        .flatten()
        .max_by(|a, b| elements(&a.1).total_cmp(&elements(&b.1)))
        .map(|t| t.1.as_slice());
    e.inputs.iter().flatten().any(|t| Some(t.1.as_slice()) != out)
}

/// The elements an operator writes: its largest output, or where it returns none (in-place
/// `_foreach_` operators) its largest tensor input.
fn elements_written(e: &OpEvent) -> f64 {
    let largest = |v: &[Option<(Kind, Vec<i64>)>]| v.iter().flatten().map(|t| elements(&t.1)).reduce(f64::max);
    largest(&e.outputs).or_else(|| largest(&e.inputs)).unwrap_or(0.0)
}

/// The calls that pay the dispatcher's overhead once each: operators the step, a scope or an
/// autograd node calls directly (not inside another operator), and autograd's node
/// evaluations.
pub fn calls(events: &[OpEvent]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut i = 0;
    calls_range(events, &mut i, events.len(), &mut out);
    out
}

fn calls_range(events: &[OpEvent], i: &mut usize, hi: usize, out: &mut Vec<usize>) {
    while *i < hi {
        let j = *i;
        let e = &events[j];
        let end = e.end.clamp(j + 1, hi);
        if is_operator(e) {
            out.push(j);
            *i = end;
        } else {
            if !e.scope && e.name.starts_with("autograd::") {
                out.push(j);
            }
            *i = j + 1;
            calls_range(events, i, end, out);
        }
    }
}

#[cfg(test)]
#[path = "work_tests.rs"]
mod tests;
