//! Turns raw arguments into a resolved setup (the one place flags are validated) and builds
//! the model chains it names.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ckptune_kernels::fake::GpuGeometry;
use ckptune_kernels::sac::SacPolicy;
use ckptune_models::{Attention, Chain, Granularity, ModelOptions, TraceKernels};
/// The CPU's identity (model name and vector extensions): the runtime's, which keys the cost
/// model's calibration cache as it keys the profile cache here.
pub use ckptune_runtime::cost::cpu_identity;
use ckptune_runtime::{OptimizerImpl, OptimizerKind, Precision, Session, TrainConfig};
use ckptune_solver::cuda_overheads::{cuda_overheads, CudaOverheads};
use ckptune_solver::formats::{BlockJson, DeviceJson, GroupJson, ModelJson};
use ckptune_solver::gpus::{self, GpuSpec};
use ckptune_solver::shard::Parameter;
use tch::Device;

use super::args::{Measure, ModelArgs};
use super::error::UsageError;

/// Resolved model and config space.
#[derive(Debug, Clone)]
pub struct Setup {
    pub model: String,
    pub opts: ModelOptions,
    pub device: Device,
    pub threads: i32,
    pub repeats: usize,
    pub configs: Vec<TrainConfig>,
    pub global_batch: i64,
    pub cache_dir: Option<PathBuf>,
    pub quiet: bool,
    /// `--measure`: how profiles are measured (`measure.rs`).
    pub measure: Measure,
    /// `--threads` was not given: [`Setup::fit_threads_to_load`] may lower `threads`.
    pub threads_auto: bool,
    /// `--target cuda:NAME`: the GPU whose rates the cost model estimates step times over.
    pub gpu: Option<&'static GpuSpec>,
    /// The GPU a step traced on the meta device is traced for (`for_cuda`): its kernels are
    /// CUDA's, its reductions allocate as on that GPU. `None`: the device's own.
    pub traced_for: Option<GpuGeometry>,
    /// What `--device auto` chose and why.
    pub device_note: Option<String>,
    /// Configs the flags asked for that cannot run and were left out, and why.
    pub config_note: Option<String>,
    /// `--selective POLICIES` (`plan`, `profile`): each candidate layer may also run selective
    /// under any of these policies, each measured by a step S of the profile. Empty: none.
    pub selective: Vec<SacPolicy>,
}

fn usage(msg: String) -> anyhow::Error {
    UsageError(msg).into()
}

impl Setup {
    /// Without `--threads`, before the model runs: as many threads as the rest of the machine
    /// leaves CPUs free, watched for 0.4 s. More threads than free cores make every step wait
    /// on the slowest thread at each barrier: on 2 CPUs with one busy, a 2-thread step ran up
    /// to 20 times slower (docs/timing.md). Returns why fewer threads than CPUs run, if they do.
    pub fn fit_threads_to_load(&mut self) -> Option<String> {
        if !self.threads_auto {
            return None;
        }
        let all = self.threads;
        let (free, other) = ckptune_runtime::load::free_cpus(std::time::Duration::from_millis(400))?;
        if free as i32 >= all {
            return None;
        }
        self.threads = free as i32;
        Some(format!(
            "the rest of the machine kept {other:.1} of its {all} CPUs busy when this started: ckptune ran \
             {free} thread{} (the free cores), and its step times are for that; pass --threads to choose",
            if free == 1 { "" } else { "s" }
        ))
    }

    /// [`Setup::fit_threads_to_load`], saying why on stderr (unless `--quiet`), for commands
    /// whose output has no notes of its own.
    pub fn fit_threads_to_load_announced(&mut self) {
        if let (Some(n), false) = (self.fit_threads_to_load(), self.quiet) {
            eprintln!("note: {n}");
        }
    }

    /// `default_precisions` applies when `--precision` is not given.
    pub fn resolve(a: &ModelArgs, default_precisions: &[Precision]) -> Result<Setup> {
        let resolved = super::device::resolve(&a.device)?;
        let device = resolved.device;
        if let (Some(n), false) = (&resolved.note, a.quiet) {
            eprintln!("note: {n}");
        }
        let granularity = granularity(&a.granularity)?;
        let space = ConfigSpace::resolve(a, default_precisions, device)?;
        let (configs, config_note) = space.configs()?;
        if a.repeats == 0 {
            return Err(usage("--repeats 0: at least one timed repeat is needed".into()));
        }
        let threads = match a.threads {
            Some(t) if t < 1 => return Err(usage(format!("--threads {t}: must be at least 1"))),
            Some(t) => t,
            None => std::thread::available_parallelism().map_or(1, |n| n.get() as i32),
        };
        let cache_dir = if a.no_cache {
            None
        } else {
            Some(a.cache_dir.clone().unwrap_or_else(default_cache_dir))
        };
        let opts = ModelOptions {
            image: a.image,
            seq: a.seq,
            classes: a.classes,
            state_dict_key: a.state_dict_key.clone(),
            heads: a.heads,
            attention: a.attention.as_deref().map(attention).transpose()?,
            granularity,
            device,
            // A torch.export program with a static batch runs only at its exported batch.
            batch: a.batch.iter().max().copied(),
            candidates: a.candidates.clone(),
            ..Default::default()
        };
        Ok(Setup {
            model: a.model.clone(),
            opts,
            device,
            threads,
            repeats: a.repeats,
            configs,
            global_batch: space.global_batch,
            cache_dir,
            quiet: a.quiet,
            measure: a.measure,
            threads_auto: a.threads.is_none(),
            gpu: None,
            traced_for: None,
            device_note: resolved.note,
            config_note,
            selective: Vec::new(),
        })
    }

    /// Builds a fresh chain (random weights for built-ins, the file's weights for paths).
    pub fn chain(&self) -> Result<Chain> {
        self.chain_with(&self.opts)
    }

    fn chain_with(&self, opts: &ModelOptions) -> Result<Chain> {
        tch::manual_seed(0);
        let path = Path::new(&self.model);
        if path.exists() {
            // The loaders' errors say whether the file is at fault (exit 2) or libtorch (exit 1).
            let loaded = if ckptune_models::export::is_export_archive(path) {
                ckptune_models::export::chain_from_export(path, opts)
            } else {
                match ckptune_models::from_file(path, opts) {
                    Err(ckptune_models::ModelError::TorchScript(p)) => {
                        ckptune_models::jit::chain_from_torchscript(&p, opts)
                    }
                    other => other,
                }
            };
            // Most loader errors name the file already; the others get it as context.
            loaded.map_err(|e| {
                let named = e.to_string().contains(&path.display().to_string());
                let e = anyhow::Error::new(e);
                if named {
                    e
                } else {
                    e.context(format!("loading model {}", path.display()))
                }
            })
        } else if self.model.ends_with(".pt")
            || self.model.ends_with(".pt2")
            || self.model.ends_with(".safetensors")
            || self.model.contains('/')
        {
            Err(usage(format!("model file {} does not exist", self.model)))
        } else {
            Ok(ckptune_models::builtin(&self.model, opts)?)
        }
    }

    /// A session of a fresh chain under `cfg`: what every command that runs the model starts
    /// from. A config the device cannot run is bad input.
    pub fn session(&self, cfg: &TrainConfig) -> Result<Session> {
        let chain = self.chain()?;
        Ok(Session::new(chain, cfg.clone(), self.device)?)
    }

    /// A session of a fresh chain under `cfg` on the meta device: every tensor fake, nothing
    /// allocated, every byte counted (`kernels/csrc/fake.cpp`).
    pub fn fake_session(&self, cfg: &TrainConfig) -> Result<Session> {
        let mut built = None;
        let opts = ModelOptions {
            trace_kernels: self.fake_kernels(),
            ..self.opts.clone()
        };
        let session = Session::new_fake_for(
            || {
                self.chain_with(&opts).map_err(|e| {
                    let message = format!("{e:#}");
                    built = Some(e);
                    ckptune_runtime::RuntimeError::Invalid(message)
                })
            },
            cfg.clone(),
            self.device,
            self.traced_for,
        );
        // The loader's own error (its exit code) rather than its message wrapped.
        match (session, built) {
            (Ok(s), _) => Ok(s),
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(e.into()),
        }
    }

    /// Traces on the meta device as the `--target` GPU (`gpu`, else an unnamed one) would run
    /// the step: transformers' attention through CUDA's memory-efficient kernel, dropout through
    /// its fused kernel, reductions with the staging buffers they take on that GPU (steps run
    /// here are the CPU's).
    pub fn for_cuda(&mut self) {
        self.for_cuda_on(&cuda_overheads(self.gpu.map(|g| g.key)));
    }

    /// The kernels of a step traced on the meta device: CUDA's for a plan for a GPU, else the
    /// device's.
    pub fn fake_kernels(&self) -> TraceKernels {
        if self.traced_for.is_some() {
            TraceKernels::Cuda
        } else {
            TraceKernels::Device
        }
    }

    /// [`Setup::for_cuda`] for the GPU of `ov`.
    pub fn for_cuda_on(&mut self, ov: &CudaOverheads) {
        self.traced_for = Some(GpuGeometry {
            multiprocessors: ov.multiprocessors,
            threads_per_multiprocessor: ov.threads_per_multiprocessor,
        });
    }

    pub fn device_json(&self) -> DeviceJson {
        DeviceJson {
            device: match self.device {
                Device::Cpu => "cpu".into(),
                Device::Cuda(i) => format!("cuda:{i}"),
                other => format!("{other:?}"),
            },
            threads: self.threads,
            memory: match self.device {
                Device::Cpu => "exact CPU tensor bytes (counting allocator)".into(),
                _ => "CUDA caching allocator, allocated bytes (reserved bytes beside them)".into(),
            },
            cpu: cpu_identity(),
            measured: String::new(),
        }
    }

    /// A key naming everything a profile depends on.
    pub fn cache_key(&self, cfg: &TrainConfig) -> String {
        let model_id = match std::fs::metadata(&self.model) {
            Ok(m) => format!(
                "{}:{}:{:?}",
                std::fs::canonicalize(&self.model)
                    .unwrap_or_else(|_| PathBuf::from(&self.model))
                    .display(),
                m.len(),
                m.modified().ok()
            ),
            Err(_) => self.model.clone(),
        };
        format!(
            // `chain2`: the chain layout with groups and skips; profiles of older layouts miss.
            // `win2`: every allocation of the step inside a moment's window (the recompute's
            // RNG swap joined its window). `cpu`: oneDNN picks kernels, and so workspace
            // sizes, by the CPU's vector extensions; a profile from another CPU is not exact.
            // `--candidates` and `--state-dict-key` choose the chain and the weights. `optim2`:
            // the optimizers allocate what torch.optim's implementations allocate. `timing2`:
            // step times checked for contention, and identical units' recompute times pooled
            // (older profiles did neither). `step2`: a
            // split layer's boundaries are views and its input's gradient is seeded (nested
            // memory moved); export side values, no-op casts and tied weights (exported
            // programs' chains changed). `shard1`: the loss head's forward, its seed and the
            // end of backward measured, and the parameters' shapes recorded (plan --shard); `shard2`:
            // what each block's backward frees as it starts (FSDP's pre-backward sees it).
            // `shared1`: Llama's rotary pair, causal mask and position_ids and BERT's SDPA mask
            // made once per micro-batch and shared by the layers (their memory changed);
            // `shared2`: GPT-2's SDPA mask too.
            // `held1`: what a selective block's cache keeps of its output (`held_output`).
            // `attn`: --attention, or `model` (what config.json says, else sdpa); keys before it
            // were eager's, so none of them can name an sdpa profile.
            "v{}|chain2|win2|optim2|timing2|step2|shard2|shared2|held1|cpu={}|{}|image={:?}|seq={:?}|classes={:?}|gran={:?}|cand={:?}|sdk={:?}|heads={:?}|attn={}|{}|{:?}|threads={}|repeats={}",
            env!("CARGO_PKG_VERSION"),
            cpu_identity(),
            model_id,
            self.opts.image,
            self.opts.seq,
            self.opts.classes,
            self.opts.granularity,
            self.opts.candidates,
            self.opts.state_dict_key,
            self.opts.heads,
            self.opts.attention.map_or("model", |a| a.hf_name()),
            cfg.label(),
            self.device,
            self.threads,
            self.repeats
        ) + &if self.fake_kernels() == TraceKernels::Cuda {
            // Traced as the GPU runs it (its attention, dropout and reduction kernels, the last
            // sized by its multiprocessors): not the CPU's profile.
            format!(
                "|kernels=cuda(efficient-attention-autocast,fused-dropout,reductions{})",
                self.traced_for
                    .map(|g| format!("@{}x{}", g.multiprocessors, g.threads_per_multiprocessor))
                    .unwrap_or_default()
            )
        } else {
            String::new()
        } + &if self.selective.is_empty() {
            String::new()
        } else {
            // A profile with steps S holds terms one without them lacks (and the converse is a
            // profile that cannot plan selective).
            format!("|selective={}", self.selective_names())
        }
    }

    /// The selective policies offered, comma-separated as `--selective` takes them.
    pub fn selective_names(&self) -> String {
        self.selective.iter().map(|p| p.name()).collect::<Vec<_>>().join(",")
    }

    /// `--selective POLICIES`, each checked against the policies the runtime knows, none twice;
    /// a selective candidate runs as one block, so nested candidates are refused.
    pub fn set_selective(&mut self, names: &[String], granularity: &str) -> Result<()> {
        if names.is_empty() {
            return Ok(());
        }
        let known = || SacPolicy::ALL.map(SacPolicy::name).join(", ");
        let mut policies = Vec::new();
        for name in names {
            let policy = SacPolicy::from_name(name)
                .ok_or_else(|| usage(format!("--selective {name:?}: expected policies, any of {}", known())))?;
            if policies.contains(&policy) {
                return Err(usage(format!("--selective names {name} twice; name each policy once")));
            }
            policies.push(policy);
        }
        if granularity == "nested" {
            return Err(usage(
                "--selective with --granularity nested: a candidate runs selective as one block, and \
                 a nested layer is several (use --granularity layer or block, or drop --selective)"
                    .into(),
            ));
        }
        self.selective = policies;
        Ok(())
    }
}

/// `--granularity`.
fn granularity(name: &str) -> Result<Granularity> {
    match name {
        "layer" => Ok(Granularity::Layer),
        "block" => Ok(Granularity::Block),
        "nested" => Ok(Granularity::Nested),
        other => Err(usage(format!(
            "--granularity {other:?}: expected layer, block or nested"
        ))),
    }
}

/// `--attention`.
fn attention(name: &str) -> Result<Attention> {
    Attention::from_hf_name(name).ok_or_else(|| usage(format!("--attention {name:?}: expected eager or sdpa")))
}

/// The config flags, each resolved: precisions, optimizers with their implementations,
/// micro-batches, the global batch, and the gradient reset.
struct ConfigSpace {
    precisions: Vec<Precision>,
    variants: Vec<(OptimizerKind, OptimizerImpl)>,
    batches: Vec<i64>,
    global_batch: i64,
    set_to_none: bool,
    autocast_cache: bool,
    loss_chunks: Vec<i64>,
    /// Per `--optimizer-step` value: whether the optimizer steps in backward.
    in_backward: Vec<bool>,
}

impl ConfigSpace {
    fn resolve(a: &ModelArgs, default_precisions: &[Precision], device: Device) -> Result<Self> {
        let precisions = precisions(a, default_precisions, device)?;
        let variants = optimizer_variants(a, device)?;
        let batches = micro_batches(a)?;
        let global_batch = a
            .global_batch
            .unwrap_or(*batches.last().expect("at least one micro-batch"));
        if global_batch < 1 {
            return Err(usage(format!("--global-batch {global_batch}: must be at least 1")));
        }
        Ok(ConfigSpace {
            precisions,
            variants,
            batches,
            global_batch,
            set_to_none: !a.zero_grad_in_place,
            autocast_cache: a.autocast_cache,
            loss_chunks: loss_chunks(a)?,
            in_backward: optimizer_steps(a)?,
        })
    }

    /// Every precision × optimizer × micro-batch × loss chunks whose micro-batch divides the
    /// global batch.
    /// With a note naming the configs that cannot step in backward, left out.
    fn configs(&self) -> Result<(Vec<TrainConfig>, Option<String>)> {
        let mut configs = Vec::new();
        let mut refused: Option<(String, String)> = None;
        let mut left_out = 0;
        for &p in &self.precisions {
            for &(o, imp) in &self.variants {
                for &mb in &self.batches {
                    if self.global_batch % mb != 0 {
                        if self.batches.len() == 1 {
                            return Err(usage(format!(
                                "--global-batch {} is not a multiple of --batch {mb}: gradient \
                                 accumulation needs a whole number of micro-batches",
                                self.global_batch
                            )));
                        }
                        continue;
                    }
                    for (&chunks, &in_backward) in iproduct(&self.loss_chunks, &self.in_backward) {
                        let mut c = TrainConfig::new(p, o, mb);
                        c.optimizer_impl = imp;
                        c.grad_accum = self.global_batch / mb;
                        c.set_to_none = self.set_to_none;
                        c.autocast_cache = self.autocast_cache && p.autocast().is_some();
                        c.loss_chunks = chunks;
                        c.optimizer_in_backward = in_backward;
                        // A config that cannot step in backward is left out; if that leaves
                        // nothing, the reason is the error.
                        match c.in_backward_refusal().filter(|_| in_backward) {
                            Some(why) => {
                                left_out += 1;
                                refused = refused.or(Some((c.label(), why)));
                            }
                            None => configs.push(c),
                        }
                    }
                }
            }
        }
        let note = match refused {
            Some((label, why)) if configs.is_empty() => {
                return Err(usage(format!(
                    "--optimizer-step in-backward: config {label} cannot step its optimizer in backward: {why}"
                )))
            }
            Some((label, why)) => Some(format!(
                "--optimizer-step in-backward: {left_out} config(s) cannot step the optimizer in backward and \
                 were left out ({label}: {why})"
            )),
            None => None,
        };
        if configs.is_empty() {
            return Err(usage(format!(
                "no config to measure: no --batch among {:?} divides --global-batch {}",
                self.batches, self.global_batch
            )));
        }
        Ok((configs, note))
    }
}

/// `--precision`, or the defaults the device can run.
fn precisions(a: &ModelArgs, default_precisions: &[Precision], device: Device) -> Result<Vec<Precision>> {
    if a.precision.is_empty() {
        // Defaults only include what the device can run.
        return Ok(default_precisions
            .iter()
            .copied()
            .filter(|p| p.check_device(device).is_ok())
            .collect());
    }
    let precisions: Vec<Precision> = a
        .precision
        .iter()
        .map(|p| p.parse::<Precision>().context("--precision"))
        .collect::<Result<_>>()?;
    for p in &precisions {
        p.check_device(device).context("--precision")?;
    }
    let program = Path::new(&a.model);
    if precisions.contains(&Precision::Bf16Pure) && ckptune_models::export::pins_fp32(program) {
        return Err(usage(format!(
            "--precision bf16-pure: the torch.export program {} was traced with fp32 parameters and \
             fixes the dtypes of its casts (it asserts them: _assert_tensor_metadata), so it cannot run \
             with bf16 parameters, as PyTorch's ep.module().to(torch.bfloat16) cannot; plan fp32 or bf16 \
             (autocast), or export the model after model.to(torch.bfloat16) to plan bf16-pure",
            program.display()
        )));
    }
    Ok(precisions)
}

/// `--optimizer` (with `--allow-8bit`'s 8-bit variants) × `--optimizer-impl`: Lion and the 8-bit
/// optimizers have one implementation each.
fn optimizer_variants(a: &ModelArgs, device: Device) -> Result<Vec<(OptimizerKind, OptimizerImpl)>> {
    let mut optimizers: Vec<OptimizerKind> = a
        .optimizer
        .iter()
        .map(|o| o.parse::<OptimizerKind>().context("--optimizer"))
        .collect::<Result<_>>()?;
    if a.allow_8bit {
        for o in optimizers.clone() {
            let eight = match o {
                OptimizerKind::Adam => Some(OptimizerKind::Adam8bit),
                OptimizerKind::AdamW => Some(OptimizerKind::AdamW8bit),
                _ => None,
            };
            if let Some(e) = eight.filter(|e| !optimizers.contains(e)) {
                optimizers.push(e);
            }
        }
    }
    let impls: Vec<OptimizerImpl> = if a.optimizer_impl.is_empty() {
        vec![OptimizerImpl::default_for(device)]
    } else {
        let mut v: Vec<OptimizerImpl> = a
            .optimizer_impl
            .iter()
            .map(|i| i.parse::<OptimizerImpl>().context("--optimizer-impl"))
            .collect::<Result<_>>()?;
        v.dedup();
        if !optimizers.iter().any(|o| o.in_torch_optim()) {
            return Err(usage(format!(
                "--optimizer-impl {}: none of the optimizers ({}) is torch.optim's; the \
                 implementations apply to sgd, sgd-momentum, adam and adamw",
                a.optimizer_impl.join(","),
                a.optimizer.join(",")
            )));
        }
        v
    };
    Ok(optimizers
        .iter()
        .flat_map(|&o| {
            let own = if o.in_torch_optim() {
                impls.clone()
            } else {
                vec![OptimizerImpl::Single]
            };
            own.into_iter().map(move |i| (o, i))
        })
        .collect())
}

/// `--batch`, sorted and each at least 1; by default 4 for language models, 8 for the rest.
fn micro_batches(a: &ModelArgs) -> Result<Vec<i64>> {
    let default_batch = if a.model.contains("bert") || a.model.contains("gpt") {
        4
    } else {
        8
    };
    positive_counts(&a.batch, default_batch, |b| {
        format!("--batch {b}: a micro-batch must hold at least one sample")
    })
}

/// `--loss-chunks`: counts of at least 1, sorted; default 1 (the loss whole).
fn loss_chunks(a: &ModelArgs) -> Result<Vec<i64>> {
    positive_counts(&a.loss_chunks, 1, |c| {
        format!("--loss-chunks {c}: the loss needs at least one chunk (1 computes it whole)")
    })
}

/// `--optimizer-step` as its values say (`after` first): whether the optimizer steps in
/// backward; default `after`.
fn optimizer_steps(a: &ModelArgs) -> Result<Vec<bool>> {
    let mut steps = Vec::new();
    for v in &a.optimizer_step {
        let in_backward = match v.trim().to_ascii_lowercase().as_str() {
            "after" => false,
            "in-backward" => true,
            other => {
                return Err(usage(format!(
                    "--optimizer-step {other:?}: expected after (after backward) or in-backward (each parameter \
                     stepped as its gradient is complete)"
                )))
            }
        };
        steps.push(in_backward);
    }
    if steps.is_empty() {
        steps.push(false);
    }
    steps.sort_unstable();
    steps.dedup();
    Ok(steps)
}

/// The `--optimizer-step` value of a config.
pub fn step_name(in_backward: bool) -> &'static str {
    if in_backward {
        "in-backward"
    } else {
        "after"
    }
}

/// Every pair of an item of `a` and an item of `b`.
fn iproduct<'a, A, B>(a: &'a [A], b: &'a [B]) -> impl Iterator<Item = (&'a A, &'a B)> {
    a.iter().flat_map(move |x| b.iter().map(move |y| (x, y)))
}

/// A list flag's values sorted without repeats (`default` when none is given); a value below 1
/// is the error `below` words.
fn positive_counts(given: &[i64], default: i64, below: impl Fn(i64) -> String) -> Result<Vec<i64>> {
    let mut values = if given.is_empty() {
        vec![default]
    } else {
        given.to_vec()
    };
    values.sort_unstable();
    values.dedup();
    match values.iter().find(|v| **v < 1) {
        Some(&v) => Err(usage(below(v))),
        None => Ok(values),
    }
}

fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CKPTUNE_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("ckptune").join("profiles")
}

pub fn model_json(chain: &Chain) -> ModelJson {
    ModelJson {
        name: chain.name.clone(),
        params: chain.param_count(),
        reference_params: chain.reference_params,
        input: format!("{:?}", chain.input),
        blocks: chain
            .blocks
            .iter()
            .map(|b| BlockJson {
                name: b.name.clone(),
                candidate: b.candidate,
            })
            .collect(),
        groups: chain
            .groups
            .iter()
            .map(|g| GroupJson {
                name: g.name.clone(),
                first: g.first,
                last: g.last,
            })
            .collect(),
        modules: chain.modules.clone(),
        parameters: chain
            .parameter_shapes()
            .into_iter()
            .map(|(name, shape, element_bytes)| Parameter {
                name,
                shape,
                element_bytes,
            })
            .collect(),
        attention: chain.attention.map(|a| a.hf_name().to_owned()),
        prefix: Some(match ckptune_solver::formats::backbone_of(&chain.modules) {
            "" => String::new(),
            b => format!("{b}."),
        }),
    }
}

/// `--target`: the device kind a plan is for (`cpu` or `cuda`) and, for `cuda:NAME`, the GPU
/// of the cost model's table whose rates estimate its step times.
pub fn parse_target(target: &str) -> Result<(String, Option<&'static GpuSpec>)> {
    let known = || gpus::gpu_names().join(", ");
    match target.split_once(':') {
        None if target == "cpu" || target == "cuda" => Ok((target.to_owned(), None)),
        Some(("cuda", name)) => match gpus::gpu(name) {
            Some(g) => Ok(("cuda".into(), Some(g))),
            None => Err(usage(format!(
                "--target {target:?}: the cost model has no rates for a GPU called {name:?}; known: {}",
                known()
            ))),
        },
        _ => Err(usage(format!(
            "--target {target:?}: expected cpu, cuda, or cuda:NAME with NAME one of {}",
            known()
        ))),
    }
}

pub fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}
