//! A device's rates for the cost model (docs/cost-model.md): how fast it multiplies matrices
//! and convolves per dtype, how fast it streams bytes, and what every operator costs on top.
//! A CPU's rates are measured by a calibration run (the runtime's `cost::calibrate`); a GPU's
//! are its published peaks times stated efficiencies (`crate::gpus`), never measured. An
//! operator's [`Work`] over these rates gives its time ([`DeviceRates::seconds`]); the runtime
//! counts the work on an operator trace.

/// What an operator's time is bound by besides its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// A matrix product (mm, addmm, bmm, attention's products).
    Matmul,
    /// A convolution's forward.
    Conv,
    /// A convolution's backward (its input's and weight's gradients).
    ConvBackward,
    /// Nothing but its bytes (elementwise operators, reductions, copies, norms).
    Memory,
}

/// Whether a CPU sets a convolution's kernel up on every call: PyTorch runs it through oneDNN,
/// which builds the primitive's descriptors and reorders each call, whatever the convolution's
/// size (on the Intel Xeon of `results/cost/`, one thread: 45 µs forward and 82-93 µs backward
/// beyond an add of as few elements, which takes about 1 µs). PyTorch picks the backend by the
/// convolution's shapes (`ConvParams::use_mkldnn`); the runtime's work counting applies its
/// rule. A GPU of the table times no setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Setup {
    /// None beyond the per-operator overhead (every other operator; a convolution PyTorch runs
    /// with its own kernel).
    #[default]
    None,
    /// Every call.
    Always,
    /// Every call where the step runs more than one intra-op thread: PyTorch runs an unstrided
    /// fp32 1×1 convolution of fewer than 16 images with its own kernel on one thread, through
    /// oneDNN on more.
    Threaded,
}

impl Setup {
    /// Whether a call pays the setup at `threads` intra-op threads (unknown: one).
    pub fn applies(self, threads: Option<i32>) -> bool {
        match self {
            Setup::None => false,
            Setup::Always => true,
            Setup::Threaded => threads.is_some_and(|t| t > 1),
        }
    }
}

/// The element types rates are given for; every other type streams at fp32's rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Fp32,
    Bf16,
    Fp16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Fp32 => 4.0,
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
        }
    }
}

/// One operator's work: floating-point operations on its engine, bytes read and written, and
/// the size that sets how efficient a product is (the geometric mean of m, n and k; 0 for
/// memory-bound work).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Work {
    pub engine: Engine,
    pub dtype: Dtype,
    pub flops: f64,
    pub bytes: f64,
    pub size: f64,
    /// A matrix product's smaller output dimension (`min(m, n)`): how many times each element of
    /// its larger operand is used, which bounds a skinny product by how fast that operand
    /// streams in ([`DeviceRates::matmul_thin`]). 0 for every other operator.
    pub thin: f64,
    /// A fused attention kernel's scores, which a device with calibrated attention rates times
    /// beyond the FLOPs (None for every other operator).
    pub attention: Option<AttentionWork>,
    /// A product's or convolution's implicit product, `[m, k, n]`, which a convolution of a
    /// shape the device measured is timed at ([`DeviceRates::conv_shapes`]); zeros for other
    /// work.
    pub shape: [f64; 3],
    /// A matrix product whose first operand is stored transposed (column-major: a weight's
    /// gradient, `x.t() @ grad`), which some kernels reorder before they multiply
    /// ([`DeviceRates::matmul_transposed`]).
    pub lhs_transposed: bool,
    /// A convolution's kernel pixels (9 for a 3×3), which picks the measured shapes an
    /// unmeasured one is timed among ([`DeviceRates::conv_shapes`]); 0 for other work.
    pub kernel: f64,
    /// Bytes of a streaming pass a CPU kernel makes besides its main work, not overlapped with
    /// it ([`DeviceRates::pass_seconds`]): an `addmm` copies its added term (a linear's bias)
    /// into its output before the product accumulates onto it, and an elementwise operator over
    /// inputs of mixed dtypes runs TensorIterator's casting loop, which takes about as long as
    /// casting those inputs first. 0 for other work.
    pub pass_bytes: f64,
    /// Whether a CPU sets the kernel up on every call ([`DeviceRates::conv_setup`]); `None` for
    /// every operator but a convolution.
    pub setup: Setup,
}

/// What a fused attention call does besides its products' FLOPs: each element of its score
/// matrices is scaled, maxed, exponentiated and summed (forward; the backward also forms dP
/// and dS), work a product's rate does not time. At head size 16 this is most of the call on
/// the benchmark's CPU (docs/cost-model.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionWork {
    /// Elements of the full score matrices: heads × query length × key length.
    pub scores: f64,
    /// The products' FLOPs over the full score matrices ([`Work::flops`] is halved when causal,
    /// as a kernel that skips the masked half does).
    pub full_flops: f64,
    pub causal: bool,
    /// The query length, which sets how much of the masked half a causal kernel skips.
    pub length: f64,
    /// The head size of the queries and keys, which sets the seconds per score.
    pub head: f64,
    pub backward: bool,
}

/// A rate by size: `(size, rate)` points with increasing sizes, read piecewise linearly in
/// log-log space and held flat beyond the ends.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Curve {
    pub dtype: String,
    pub points: Vec<[f64; 2]>,
}

impl Curve {
    /// The curve of measured convolution `shapes` by their implicit product's cube-root size,
    /// the slower of shapes of one size (ResNet's 3×3 stages all do equal multiply-adds); `None`
    /// without any.
    pub fn of_shapes<'a>(dtype: Dtype, shapes: impl Iterator<Item = &'a ConvShape>) -> Option<Curve> {
        let points: Vec<[f64; 2]> = shapes
            .map(|s| [s.shape.iter().product::<f64>().cbrt(), s.flops_per_second])
            .collect();
        (!points.is_empty()).then(|| Curve::of_points(dtype, points))
    }

    /// The curve through `[size, rate]` points in any order, the slower of points of one size.
    pub fn of_points(dtype: Dtype, mut points: Vec<[f64; 2]>) -> Curve {
        points.sort_by(|a, b| a[0].total_cmp(&b[0]));
        points.dedup_by(|later, kept| {
            let same = later[0] == kept[0];
            if same {
                kept[1] = kept[1].min(later[1]);
            }
            same
        });
        Curve {
            dtype: dtype.name().into(),
            points,
        }
    }

    pub fn flat(dtype: Dtype, rate: f64) -> Curve {
        Curve {
            dtype: dtype.name().into(),
            points: vec![[1.0, rate]],
        }
    }

    /// The rate at `size`; `None` for a curve without points.
    pub fn at(&self, size: f64) -> Option<f64> {
        let p = &self.points;
        let (first, last) = (p.first()?, p.last()?);
        if size <= first[0] {
            return Some(first[1]);
        }
        if size >= last[0] {
            return Some(last[1]);
        }
        let i = p.iter().position(|q| q[0] >= size)?;
        let (a, b) = (p[i - 1], p[i]);
        let t = (size.ln() - a[0].ln()) / (b[0].ln() - a[0].ln());
        Some((a[1].ln() + t * (b[1].ln() - a[1].ln())).exp())
    }
}

/// A device's rates. Fields are in the order of the JSON that caches a CPU's calibration and
/// records the rates behind an estimated profile.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DeviceRates {
    /// `cpu`, or `cuda:<name>` for a GPU of the table.
    pub device: String,
    /// The CPU's identity (model name and vector extensions) or the GPU's full name.
    pub name: String,
    /// Whether the rates were measured here (a CPU's calibration run) rather than taken from
    /// published peaks.
    pub measured: bool,
    /// Where the numbers come from, in words.
    pub source: String,
    /// Intra-op threads the calibration ran with (CPU only).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub threads: Option<i32>,
    /// FLOP/s of matrix products per dtype, by the product's mean dimension.
    pub matmul: Vec<Curve>,
    /// FLOP/s of skinny matrix products per dtype, by their smaller output dimension
    /// ([`Work::thin`]), the larger operand read from memory, where measured (a CPU's
    /// calibration): a product runs at the slower of this and `matmul`. A BERT pooler's `[8, 768]`
    /// by `[768, 768]` ran at a quarter of the rate of a square product of its mean dimension.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub matmul_thin: Vec<Curve>,
    /// FLOP/s of square products whose first operand is stored transposed, per dtype where
    /// measured (a dtype without one takes `matmul`'s): on an Intel Xeon with AMX a bf16
    /// product of a transposed operand ran at 0.57-0.82 of `matmul`'s rate, an fp32 one at its
    /// rate. Empty for a GPU of the table.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub matmul_transposed: Vec<Curve>,
    /// FLOP/s of convolutions per dtype, by the mean dimension of their implicit product.
    pub conv: Vec<Curve>,
    /// The convolutions the device measured, each at its own FLOP/s: one of the same channels
    /// and kernel and at least as many rows takes it over `conv`'s and `conv_backward`'s curves,
    /// which key a convolution by its mean dimension alone. ResNet's four 3×3 stages at batch 8
    /// do equal multiply-adds, one size on the curve (which kept the slowest), and ran 1.5 times
    /// apart in bf16 on an Intel Xeon with AMX. Empty for a GPU of the table.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub conv_shapes: Vec<ConvShape>,
    /// FLOP/s of convolutions' backwards per dtype, where measured (a CPU's calibration, whose
    /// backward kernels run slower than its forward ones); a dtype without one takes `conv`'s.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub conv_backward: Vec<Curve>,
    /// Seconds a convolution's setup takes per call ([`Setup`]), forward and backward per dtype,
    /// where measured (a CPU's calibration); a dtype without its own takes fp32's. Empty: no
    /// setup is timed (a GPU of the table).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub conv_setup: Vec<ConvSetup>,
    /// Bytes/s of streaming elementwise work per dtype, by the bytes an operator moves, writing
    /// into fresh memory as a step's outputs do (a CPU's first touch of a page faults).
    pub bandwidth: Vec<Curve>,
    /// Bytes/s of an operator that updates a tensor it was given in place (`add_`, `lerp_`,
    /// `addcmul_`: an optimizer's step), where measured (a CPU's calibration): it writes memory
    /// already touched, so it pays no page faults. Empty: such operators stream at `bandwidth`.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub bandwidth_in_place: Vec<Curve>,
    /// Seconds every operator costs besides its work (dispatch, and on a GPU the launch).
    pub overhead_seconds: f64,
    /// Memory-bound operators whose kernels stream slower than an elementwise add (windowed,
    /// reducing, transcendental: batch norm, max pooling, softmax, GELU), each with its own
    /// measured rate in bytes/s of the bytes it reads and writes. Empty for a GPU of the table.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub ops: Vec<OpRate>,
    /// Seconds those kernels take per call besides their bytes and the overhead, where measured
    /// (a CPU's calibration, on inputs of a few elements, any dtype): batch norm's forward took
    /// about 4 µs beyond an add of as few elements on the Intel Xeon of `results/cost/`, GELU's
    /// 7 µs, a cost that a block of a few small calls (tiny-ResNet's) measures mostly. Empty for
    /// a GPU of the table.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub op_setup: Vec<OpSetup>,
    /// Fused attention's cost per score and a causal call's share of an unmasked one's, where
    /// measured (a CPU's calibration); without them attention is timed by its FLOPs alone.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub attention: Option<AttentionRates>,
    /// The runtime's own seconds around a block, per part of the step, where measured (a CPU's
    /// calibration); none for a GPU of the table, whose kernels run while the host does this.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub block_overhead: Option<BlockOverhead>,
    /// A GPU's host, which issues the operators while the device runs the kernels already
    /// issued: a part of the step takes the longer of the device's time (its kernels' work and
    /// `overhead_seconds` per call) and the host's time to issue its operators. None: the
    /// device runs the calls as they are made (a CPU), each part the sum of its calls' seconds.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub host: Option<HostIssue>,
}

/// The host's seconds per operator it issues to a GPU (every operator that passes the
/// dispatcher, nested ones included: `linear`'s `t` and `addmm`, autocast's casts). PyTorch's
/// eager step reaches each operator through Python and the dispatcher, its backward through
/// autograd's engine; both came out alike per operator on the GPU host of results/gpu/times.md.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct HostIssue {
    /// Per operator.
    pub op_seconds: f64,
    /// Per operator of a checkpointed block's forward, which is its recompute's cost: PyTorch's
    /// checkpoint runs Python for every tensor an operator saves, packing it in the forward,
    /// recomputing and unpacking it in the backward.
    pub checkpoint_op_seconds: f64,
}

/// What ckptune's runtime spends around one block besides its operators' calls, in seconds:
/// saving or swapping the RNG state, the block's scope and autocast region, the boundary's
/// aliases and gradient sink. A block of a few calls measures mostly this.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BlockOverhead {
    /// A plain block's forward, in grad mode.
    pub forward: f64,
    /// A checkpointed block's forward, under no-grad (its RNG state saved).
    pub nograd_forward: f64,
    /// A checkpointed block's recompute (the RNG state swapped, buffers snapshotted).
    pub recompute: f64,
    /// A block's backward (its VJP from the output's gradient edge).
    pub backward: f64,
}

/// A CPU's fused attention, measured ([`AttentionWork`]): a call takes its full products' FLOPs
/// at the matrix product rate plus its scores at the seconds per score at its head size, times,
/// when causal, the causal share at its query length.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct AttentionRates {
    /// Seconds per score beyond the products' FLOPs, by head size: the kernel's work per score
    /// grows with the head size faster than a product's rate says, so one constant measured at
    /// one head size overstates smaller heads (tiny-Llama's 16: its backward estimated at
    /// 1.9 times its time over a constant measured at 64).
    pub forward_seconds_per_score: Curve,
    pub backward_seconds_per_score: Curve,
    /// A causal call's time over the same call unmasked (forward and backward), by query length.
    pub causal_share: Curve,
}

/// One convolution shape's measured rate ([`DeviceRates::conv_shapes`]).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ConvShape {
    pub dtype: String,
    /// Its backward (both gradients), else its forward.
    pub backward: bool,
    /// The implicit product `[m, k, n]`: batch × output pixels, input channels × kernel
    /// pixels, output channels.
    pub shape: [f64; 3],
    /// Kernel pixels (9 for a 3×3; 0 where a cache did not record it).
    #[cfg_attr(feature = "serde", serde(default))]
    pub kernel: f64,
    pub flops_per_second: f64,
}

/// A convolution's setup per call ([`DeviceRates::conv_setup`]).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ConvSetup {
    pub dtype: String,
    /// Its backward (both gradients), else its forward.
    pub backward: bool,
    pub seconds: f64,
}

impl ConvSetup {
    /// Seconds among `setups` of a convolution of `dtype` in its direction (fp32's where `dtype`
    /// has none); 0 without one.
    pub fn seconds(setups: &[ConvSetup], dtype: Dtype, backward: bool) -> f64 {
        let of = |d: Dtype| {
            setups
                .iter()
                .find(|s| s.dtype == d.name() && s.backward == backward)
                .map(|s| s.seconds)
        };
        of(dtype).or_else(|| of(Dtype::Fp32)).unwrap_or(0.0)
    }

    /// Seconds among `setups` that a convolution of `dtype` in its direction, set up as `setup`
    /// says, pays per call at `threads` intra-op threads.
    pub fn paid(setups: &[ConvSetup], setup: Setup, dtype: Dtype, backward: bool, threads: Option<i32>) -> f64 {
        if setup.applies(threads) {
            ConvSetup::seconds(setups, dtype, backward)
        } else {
            0.0
        }
    }

    /// Seconds among `setups` that `work` pays per call at `threads` intra-op threads.
    pub fn of_work(setups: &[ConvSetup], work: &Work, threads: Option<i32>) -> f64 {
        let backward = work.engine == Engine::ConvBackward;
        ConvSetup::paid(setups, work.setup, work.dtype, backward, threads)
    }
}

/// A slow kernel's setup per call ([`DeviceRates::op_setup`]).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct OpSetup {
    /// The operator without its overload (`aten::native_batch_norm`).
    pub op: String,
    pub seconds: f64,
}

impl OpSetup {
    /// Seconds among `setups` of operator `op` per call; 0 without one.
    pub fn seconds(setups: &[OpSetup], op: &str) -> f64 {
        setups.iter().find(|s| s.op == op).map_or(0.0, |s| s.seconds)
    }
}

/// One operator's own streaming rate.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct OpRate {
    /// The operator without its overload (`aten::native_batch_norm`).
    pub op: String,
    pub dtype: String,
    pub bytes_per_second: f64,
}

impl DeviceRates {
    /// Seconds `work` takes: [`Self::work_seconds`] plus the per-operator overhead.
    pub fn seconds(&self, work: &Work) -> f64 {
        self.work_seconds(work) + self.overhead_seconds
    }

    /// Seconds operator `op` (its name without the overload) takes for `work`, without the
    /// per-operator overhead: at its own rate where it has one, but never faster than its bytes
    /// stream (an own rate is measured on one shape; a square root of a tensor beyond the
    /// caches is as bound by memory as an add), else as [`Self::work_seconds`]; then what it
    /// does besides ([`Self::beside_seconds`]) and its setup, where measured
    /// ([`Self::op_setup`]).
    pub fn op_seconds(&self, op: &str, work: &Work) -> f64 {
        let main = match (self.own_seconds(op, work), work.attention, &self.attention) {
            (Some(s), _, _) if work.engine == Engine::Memory => s.max(self.bound_seconds(work)),
            (_, Some(a), Some(r)) => self.attention_seconds(work, &a, r),
            _ => self.bound_seconds(work),
        };
        main + self.beside_seconds(work) + OpSetup::seconds(&self.op_setup, op)
    }

    /// Seconds `work` spends besides its main work, not overlapped with it: its separate pass
    /// ([`Self::pass_seconds`]) and its kernel's setup ([`Self::setup_seconds`]).
    fn beside_seconds(&self, work: &Work) -> f64 {
        self.pass_seconds(work) + self.setup_seconds(work)
    }

    /// Seconds of a convolution's setup per call ([`Setup`]) at its direction and dtype (fp32's
    /// where its own was not measured), where it applies at the calibration's thread count;
    /// 0 where the device measured none.
    pub fn setup_seconds(&self, work: &Work) -> f64 {
        ConvSetup::of_work(&self.conv_setup, work, self.threads)
    }

    /// Seconds of `work`'s separate streaming pass ([`Work::pass_bytes`]) at the streaming rate
    /// of its dtype, on a CPU; none on a GPU of the table, where cuBLASLt adds a linear's bias
    /// in the product's epilogue and elementwise kernels cast in registers. On the Intel Xeon
    /// of `results/cost/` (bf16, one thread, outputs into fresh memory): `addmm` over `[1024,
    /// 768]` by `[768, 768]` took 0.28 ms more than `mm`; a bf16 + fp32 add of `[8, 128, 768]`
    /// 0.96 ms, the cast 0.44 ms and an fp32 add 0.51 ms.
    pub fn pass_seconds(&self, work: &Work) -> f64 {
        if self.device != "cpu" || work.pass_bytes <= 0.0 {
            return 0.0;
        }
        work.pass_bytes / rate(&self.bandwidth, work.dtype, work.pass_bytes)
    }

    /// Seconds of `work` at operator `op`'s own rate for its dtype; where only fp32's was
    /// measured (a calibration cut short), at fp32's per element: these kernels are slow for
    /// their compute (a random number, a transcendental per element), which a narrower
    /// element does not shorten (an AMD EPYC's dropout took 0.27 s of BERT-base's step in bf16
    /// and 0.26 s in fp32, with half the bytes).
    fn own_seconds(&self, op: &str, work: &Work) -> Option<f64> {
        let rate = |dtype: Dtype| {
            self.ops
                .iter()
                .find(|r| r.op == op && r.dtype == dtype.name() && r.bytes_per_second > 0.0)
                .map(|r| r.bytes_per_second)
        };
        match rate(work.dtype) {
            Some(r) => Some(work.bytes / r),
            None => rate(Dtype::Fp32).map(|r| work.bytes * Dtype::Fp32.bytes() / work.dtype.bytes() / r),
        }
    }

    /// A fused attention call over measured attention rates ([`AttentionRates`]), never less than
    /// its bytes take.
    fn attention_seconds(&self, work: &Work, a: &AttentionWork, r: &AttentionRates) -> f64 {
        let per_score = if a.backward {
            &r.backward_seconds_per_score
        } else {
            &r.forward_seconds_per_score
        }
        .at(a.head)
        .unwrap_or(0.0);
        let full = a.full_flops / self.matmul_rate(work) + a.scores * per_score;
        let share = if a.causal {
            r.causal_share.at(a.length).unwrap_or(1.0)
        } else {
            1.0
        };
        let memory = work.bytes / rate(&self.bandwidth, work.dtype, work.bytes);
        (full * share).max(memory)
    }

    /// Seconds an operator that updates a tensor in place takes for memory-bound `work`, without
    /// the per-operator overhead: its bytes at the in-place streaming rate where the device has
    /// one for its dtype or fp32, else as [`Self::work_seconds`]; then what it does besides.
    pub fn in_place_seconds(&self, work: &Work) -> f64 {
        let rate = rate(&self.bandwidth_in_place, work.dtype, work.bytes);
        let main = if work.engine == Engine::Memory && rate.is_finite() {
            work.bytes / rate
        } else {
            self.bound_seconds(work)
        };
        main + self.beside_seconds(work)
    }

    /// Seconds `work` takes without the per-operator overhead: the slower of its FLOPs on its
    /// engine and its bytes at the streaming rate, then what it does besides
    /// ([`Self::beside_seconds`]).
    pub fn work_seconds(&self, work: &Work) -> f64 {
        self.bound_seconds(work) + self.beside_seconds(work)
    }

    /// The slower of `work`'s FLOPs on its engine and its bytes at the streaming rate.
    fn bound_seconds(&self, work: &Work) -> f64 {
        let memory = if work.bytes > 0.0 {
            work.bytes / rate(&self.bandwidth, work.dtype, work.bytes)
        } else {
            0.0
        };
        let compute = match work.engine {
            Engine::Memory => 0.0,
            Engine::Matmul => work.flops / self.matmul_rate(work),
            Engine::Conv => work.flops / self.conv_rate(work, false),
            Engine::ConvBackward => work.flops / self.conv_rate(work, true),
        };
        compute.max(memory)
    }

    /// FLOP/s of the convolution `work` (its `backward`): the rate of the measured shape with
    /// its channels and kernel (`k` and `n`) and the most rows (`m`: batch × output pixels) not
    /// over its own, else its curve's at its mean dimension. A larger batch mostly runs at least
    /// as fast over the same weight (ResNet-18's bf16 stages 2-4 at batch 32 ran 7-29% faster
    /// than at 8 on an Intel Xeon with AMX, where the curve, keeping the slowest stage's rate,
    /// was 32-52% low), though not always (stage 1 ran at half, its activations beyond the
    /// cache); fewer rows take the curve. A backward takes its dtype's backward rates where the
    /// device measured them, else the forward's.
    fn conv_rate(&self, work: &Work, backward: bool) -> f64 {
        let own = backward && self.conv_backward.iter().any(|c| c.dtype == work.dtype.name());
        let [m, k, n] = work.shape;
        let shapes = || {
            self.conv_shapes
                .iter()
                .filter(move |s| s.dtype == work.dtype.name() && s.backward == own)
        };
        let measured = shapes()
            .filter(|s| s.shape[1] == k && s.shape[2] == n && s.shape[0] <= m)
            .max_by(|a, b| a.shape[0].total_cmp(&b.shape[0]))
            .map(|s| s.flops_per_second);
        let of_its_kernel = || {
            let same = shapes().filter(|s| s.kernel > 0.0 && s.kernel == work.kernel);
            Curve::of_shapes(work.dtype, same).and_then(|c| c.at(work.size))
        };
        let curves = if own { &self.conv_backward } else { &self.conv };
        measured
            .or_else(of_its_kernel)
            .unwrap_or_else(|| rate(curves, work.dtype, work.size))
    }

    /// FLOP/s of the matrix product `work`: the rate of its mean dimension, or of its smaller
    /// output dimension where that is slower (a skinny product, where the device measured one).
    fn matmul_rate(&self, work: &Work) -> f64 {
        let transposed = work.lhs_transposed
            && self
                .matmul_transposed
                .iter()
                .any(|c| c.dtype == work.dtype.name() && !c.points.is_empty());
        let curves = if transposed {
            &self.matmul_transposed
        } else {
            &self.matmul
        };
        let square = rate(curves, work.dtype, work.size);
        if work.thin > 0.0 {
            square.min(rate(&self.matmul_thin, work.dtype, work.thin))
        } else {
            square
        }
    }

    /// The rates are complete: every curve positive and finite, fp32 given for each engine.
    pub fn check(&self) -> Result<(), String> {
        for (what, curves) in [
            ("matmul", &self.matmul),
            ("conv", &self.conv),
            ("bandwidth", &self.bandwidth),
            ("bandwidth_in_place", &self.bandwidth_in_place),
            ("matmul_thin", &self.matmul_thin),
            ("matmul_transposed", &self.matmul_transposed),
        ] {
            let optional = ["bandwidth_in_place", "matmul_thin", "matmul_transposed"].contains(&what);
            if !optional && !curves.iter().any(|c| c.dtype == "fp32" && !c.points.is_empty()) {
                return Err(format!("rates of {}: no fp32 {what} rate", self.device));
            }
            for c in curves {
                if let Some(p) = c
                    .points
                    .iter()
                    .find(|p| !(p[0] > 0.0 && p[1] > 0.0 && p[1].is_finite()))
                {
                    return Err(format!(
                        "rates of {}: {what} {} has the point {:?}; sizes and rates must be positive",
                        self.device, c.dtype, p
                    ));
                }
                if c.points.windows(2).any(|w| w[0][0] >= w[1][0]) {
                    return Err(format!(
                        "rates of {}: {what} {}'s sizes do not increase",
                        self.device, c.dtype
                    ));
                }
            }
        }
        if let Some(s) = self
            .conv_shapes
            .iter()
            .find(|s| !(s.flops_per_second > 0.0 && s.flops_per_second.is_finite()))
        {
            return Err(format!(
                "rates of {}: the convolution {:?} ({}) has the rate {}; rates must be positive",
                self.device, s.shape, s.dtype, s.flops_per_second
            ));
        }
        let setups = self.conv_setup.iter().map(|s| {
            let what = if s.backward {
                "convolution backward's setup"
            } else {
                "convolution's setup"
            };
            (what, s.seconds)
        });
        let op_setups = self.op_setup.iter().map(|s| ("an operator's setup", s.seconds));
        let durations = self.block_overhead.iter().flat_map(|b| {
            [
                ("a block's forward", b.forward),
                ("a block's no-grad forward", b.nograd_forward),
                ("a block's recompute", b.recompute),
                ("a block's backward", b.backward),
            ]
        });
        let overhead = [("overhead", self.overhead_seconds)].into_iter();
        for (what, seconds) in overhead.chain(setups).chain(op_setups).chain(durations) {
            if !(seconds >= 0.0 && seconds.is_finite()) {
                return Err(format!(
                    "rates of {}: {what} {seconds} s is not a duration",
                    self.device
                ));
            }
        }
        Ok(())
    }
}

/// The curve of `dtype`, fp32's where the device has none for it.
fn rate(curves: &[Curve], dtype: Dtype, size: f64) -> f64 {
    let of = |name: &str| curves.iter().find(|c| c.dtype == name).and_then(|c| c.at(size));
    of(dtype.name())
        .or_else(|| of("fp32"))
        .filter(|r| *r > 0.0)
        .unwrap_or(f64::INFINITY)
}

#[cfg(test)]
#[path = "rates_tests.rs"]
pub(crate) mod tests;
