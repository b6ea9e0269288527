//! A profile measured on the meta device (fake mode) against the same profile measured on the
//! CPU: every memory term of docs/memory-model.md, the fixed bytes and the optimizer peak, term
//! for term. Transformers in fp32 are equal to the byte, with eager and with SDPA attention (the
//! CPU's flash attention without dropout, the math path with it), and with the optimizer stepped in
//! backward. Where a CPU kernel allocates scratch of
//! its own (oneDNN's matrix products under bf16, its convolutions), every operator whose peak
//! differs is listed, each must be one of those kernels, the bytes kept are still equal, and
//! each transient term may be short by no more than the largest scratch listed.

mod common;

use ckptune_kernels::meter;
use ckptune_kernels::optrace::{self, PeakDifference};
use ckptune_models::{builtin, Attention, Granularity, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, RuntimeError, Session, TrainConfig};
use common::quick_profile;
use common::terms::{memory_terms, report, Term};
use tch::Device;

/// Kernels that allocate scratch of their own through the CPU allocator (oneDNN). The CPU's
/// flash attention backward multiplies bf16 blocks with `cpublas::gemm`, which hands products
/// over 16³ to oneDNN: its peak in a seq-96 tiny-Llama step is 17,540 B above what the kernel
/// allocates, and equal with `torch.backends.mkldnn.enabled = False`.
const SCRATCH_KERNELS: [&str; 7] = [
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::mkldnn_convolution",
    "aten::convolution_backward",
    "aten::resize_",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
];

struct Case {
    model: &'static str,
    opts: ModelOptions,
    cfg: TrainConfig,
}

impl Case {
    /// A transformer's attention is eager here; [`Case::sdpa`] makes it SDPA.
    fn new(model: &'static str, granularity: Granularity, precision: Precision) -> Self {
        let resnet = model.contains("resnet");
        let opts = ModelOptions {
            seq: (!resnet).then_some(16),
            image: resnet.then_some(32),
            attention: (!resnet).then_some(Attention::Eager),
            granularity,
            ..Default::default()
        };
        Case {
            model,
            opts,
            cfg: TrainConfig::new(precision, OptimizerKind::AdamW, 2),
        }
    }

    /// The same case with SDPA attention over `seq` tokens (at 96 and more, bf16 products in
    /// the flash kernel reach oneDNN).
    fn sdpa(mut self, seq: i64) -> Self {
        self.opts.attention = Some(Attention::Sdpa);
        self.opts.seq = Some(seq);
        self
    }

    fn session(&self, fake: bool) -> Session {
        let build = || builtin(self.model, &self.opts).map_err(|e| RuntimeError::Invalid(e.to_string()));
        tch::manual_seed(0);
        if fake {
            Session::new_fake(build, self.cfg.clone(), Device::Cpu).unwrap()
        } else {
            Session::new(build().unwrap(), self.cfg.clone(), Device::Cpu).unwrap()
        }
    }

    fn label(&self) -> String {
        let attention = self.opts.attention.map_or("", |a| a.hf_name());
        format!(
            "{} {attention} seq {:?} {:?} {}",
            self.model,
            self.opts.seq,
            self.opts.granularity,
            self.cfg.label()
        )
    }

    /// The operators whose peak differs between a real and a fake step, with none and with
    /// every candidate checkpointed.
    fn scratch(&self) -> Vec<PeakDifference> {
        let mut out = Vec::new();
        for all in [false, true] {
            let trace = |mut s: Session| {
                let ckpt = if all {
                    s.chain.every_candidate()
                } else {
                    vec![false; s.chain.units()]
                };
                s.op_trace(&ckpt).unwrap()
            };
            let real = trace(self.session(false));
            let fake = trace(self.session(true));
            let differences = optrace::line_up(&real, &fake).unwrap_or_else(|e| panic!("{}: {e}", self.label()));
            out.extend(differences);
        }
        out
    }

    /// No operator's peak differs between a real and a fake step, nor any term of the profiles.
    fn assert_equal_to_the_byte(&self) {
        assert_eq!(self.scratch(), vec![], "{}", self.label());
        let differ: Vec<_> = self.terms().into_iter().filter(|(_, _, a, b)| a != b).collect();
        assert!(
            differ.is_empty(),
            "{}: the meta profile differs in:\n{}",
            self.label(),
            report(&differ)
        );
    }

    /// The terms of the CPU's profile and the meta profile, side by side.
    fn terms(&self) -> Vec<(String, Term, i64, i64)> {
        let cpu = quick_profile(&mut self.session(false));
        let meta = quick_profile(&mut self.session(true));
        memory_terms(&cpu)
            .into_iter()
            .zip(memory_terms(&meta))
            .map(|((name, kind, a), (_, _, b))| (name, kind, a, b))
            .collect()
    }
}

fn setup() -> std::sync::MutexGuard<'static, ()> {
    let lock = meter::exclusive();
    meter::install().unwrap();
    tch::set_num_threads(1);
    lock
}

#[test]
fn transformers_measured_on_meta_equal_the_cpu_to_the_byte() {
    let _lock = setup();
    for model in ["tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-qwen2"] {
        for (granularity, sdpa) in [
            (Granularity::Layer, false),
            (Granularity::Nested, false),
            (Granularity::Layer, true),
            (Granularity::Nested, true),
        ] {
            let case = Case::new(model, granularity, Precision::Fp32);
            // SDPA: BERT and GPT-2 train with attention dropout (the math path), the Llama
            // family without (flash attention); a Llama at 96 tokens also splits its blocks.
            let case = match (sdpa, model) {
                (false, _) => case,
                (true, "tiny-llama") => case.sdpa(96),
                (true, _) => case.sdpa(16),
            };
            case.assert_equal_to_the_byte();
        }
    }
}

/// The chunked loss (its gradients computed in the loss window, chunk by chunk) measured on the
/// meta device equals the CPU's, term for term, for an untied and a tied head.
#[test]
fn a_chunked_loss_measured_on_meta_equals_the_cpu_to_the_byte() {
    let _lock = setup();
    for model in ["tiny-gpt2", "tiny-llama", "tiny-qwen2"] {
        let mut case = Case::new(model, Granularity::Layer, Precision::Fp32).sdpa(16);
        case.cfg.loss_chunks = 3;
        case.assert_equal_to_the_byte();
    }
}

/// The optimizer step in backward (each parameter's update inside its block's VJP) measured on
/// the meta device equals the CPU's, term for term, with layers and with nested groups (a fused
/// group's parameters stepped in its one VJP), a tied head included.
#[test]
fn the_optimizer_step_in_backward_measured_on_meta_equals_the_cpu_to_the_byte() {
    let _lock = setup();
    for model in ["tiny-bert", "tiny-gpt2", "tiny-llama"] {
        for granularity in [Granularity::Layer, Granularity::Nested] {
            let mut case = Case::new(model, granularity, Precision::Fp32);
            case.cfg.optimizer_in_backward = true;
            case.assert_equal_to_the_byte();
        }
    }
}

/// Under bf16 (oneDNN's matrix products on CPUs with AVX-512-BF16 or AMX) and in convolutions,
/// the bytes kept are equal and transients are short by at most the listed scratch.
#[test]
fn where_onednn_allocates_scratch_only_transients_differ_within_it() {
    let _lock = setup();
    let cases = [
        Case::new("tiny-bert", Granularity::Layer, Precision::Bf16),
        Case::new("tiny-llama", Granularity::Nested, Precision::Bf16Pure),
        Case::new("tiny-bert", Granularity::Layer, Precision::Bf16).sdpa(16),
        Case::new("tiny-qwen2", Granularity::Nested, Precision::Bf16).sdpa(96),
        Case::new("tiny-llama", Granularity::Layer, Precision::Bf16Pure).sdpa(16),
        Case::new("tiny-resnet", Granularity::Layer, Precision::Fp32),
        Case::new("tiny-resnet", Granularity::Layer, Precision::Bf16),
    ];
    for case in cases {
        let scratch = case.scratch();
        for d in &scratch {
            assert!(
                SCRATCH_KERNELS.contains(&d.culprit.as_str()) && d.bytes > 0,
                "{}: {d:?} is not a oneDNN kernel's scratch",
                case.label()
            );
        }
        let most = scratch.iter().map(|d| d.bytes).max().unwrap_or(0);
        let wrong: Vec<_> = case
            .terms()
            .into_iter()
            .filter(|(_, kind, cpu, meta)| match kind {
                Term::Kept => cpu != meta,
                Term::Transient => !(0..=most).contains(&(cpu - meta)),
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "{}: beyond the scratch of {} operators (at most {most} B):\n{}",
            case.label(),
            scratch.len(),
            report(&wrong)
        );
    }
}
