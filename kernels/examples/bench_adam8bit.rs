//! Benchmark: one optimizer step of fp32 AdamW (libtorch ops) against 8-bit block-wise AdamW
//! (`ckptune_kernels::adam8bit`, the fused CPU path) on parameter sets shaped like ResNet-152
//! and bert-base-uncased, with state bytes from the memory meter.
//!
//! ```text
//! cargo run --release -p ckptune-kernels --example bench_adam8bit -- \
//!     --out results/bench/optimizer_8bit.json [--threads 1,2] [--repeats 7] [--warmup 2]
//! ```
//!
//! Writes the JSON atomically (temporary file + rename) and a markdown table next to it
//! (same name, `.md`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use ckptune_kernels::adam8bit::{self, Adam8bit, AdamHyper, BLOCK, MIN_8BIT_NUMEL};
use ckptune_kernels::{autograd, MemoryMeter};
use tch::{Device, Kind, Tensor};

struct Args {
    out: PathBuf,
    /// Thread counts to measure at, each set with `tch::set_num_threads` (libtorch's intra-op
    /// pool and the 8-bit path's workers alike).
    threads: Vec<i32>,
    repeats: usize,
    warmup: usize,
}

fn usage(msg: &str) -> ! {
    eprintln!(
        "error: {msg}\nusage: bench_adam8bit --out FILE.json [--threads N,M,... (default 1,2)] [--repeats N (default 7)] \
         [--warmup N (default 2)]"
    );
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut args = Args {
        out: PathBuf::new(),
        threads: vec![1, 2],
        repeats: 7,
        warmup: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--out" => args.out = PathBuf::from(value()),
            "--threads" => {
                args.threads = value()
                    .split(',')
                    .map(|t| {
                        t.trim()
                            .parse()
                            .unwrap_or_else(|e| usage(&format!("--threads {t:?}: {e}")))
                    })
                    .collect()
            }
            "--repeats" => args.repeats = value().parse().unwrap_or_else(|e| usage(&format!("--repeats: {e}"))),
            "--warmup" => args.warmup = value().parse().unwrap_or_else(|e| usage(&format!("--warmup: {e}"))),
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    if args.out.as_os_str().is_empty() {
        usage("--out is required");
    }
    if args.threads.iter().any(|&t| t < 1) || args.repeats < 1 {
        usage("--threads and --repeats must be at least 1");
    }
    args
}

// ---------------------------------------------------------------------------------------------
// Parameter shapes
// ---------------------------------------------------------------------------------------------

/// torchvision's `resnet152()` trainable parameters, in `named_parameters()` order: the stem,
/// bottleneck layers [3, 8, 36, 3] (conv1 1×1, conv2 3×3, conv3 1×1 with expansion 4, a BatchNorm
/// weight and bias after each, a 1×1 downsample in each layer's first block), and the fc head.
fn resnet152() -> Vec<Vec<i64>> {
    let mut s: Vec<Vec<i64>> = vec![vec![64, 3, 7, 7], vec![64], vec![64]];
    let bn = |s: &mut Vec<Vec<i64>>, c: i64| s.extend([vec![c], vec![c]]);
    let mut inplanes = 64;
    for (planes, blocks) in [(64i64, 3), (128, 8), (256, 36), (512, 3)] {
        for b in 0..blocks {
            s.push(vec![planes, inplanes, 1, 1]);
            bn(&mut s, planes);
            s.push(vec![planes, planes, 3, 3]);
            bn(&mut s, planes);
            s.push(vec![planes * 4, planes, 1, 1]);
            bn(&mut s, planes * 4);
            if b == 0 {
                s.push(vec![planes * 4, inplanes, 1, 1]);
                bn(&mut s, planes * 4);
            }
            inplanes = planes * 4;
        }
    }
    s.extend([vec![1000, 2048], vec![1000]]);
    s
}

/// Hugging Face `BertModel` (bert-base-uncased) parameters: embeddings (word 30522×768,
/// position 512×768, token type 2×768, LayerNorm), 12 layers of (query, key, value, attention
/// output: 768×768 + 768 each; LayerNorm; intermediate 3072×768 + 3072; output 768×3072 + 768;
/// LayerNorm), and the pooler 768×768 + 768.
fn bert_base() -> Vec<Vec<i64>> {
    let h = 768;
    let mut s = vec![vec![30522, h], vec![512, h], vec![2, h], vec![h], vec![h]];
    for _ in 0..12 {
        for _ in 0..4 {
            s.extend([vec![h, h], vec![h]]);
        }
        s.extend([vec![h], vec![h]]);
        s.extend([vec![3072, h], vec![3072], vec![h, 3072], vec![h]]);
        s.extend([vec![h], vec![h]]);
    }
    s.extend([vec![h, h], vec![h]]);
    s
}

fn numel(shape: &[i64]) -> i64 {
    shape.iter().product()
}

// ---------------------------------------------------------------------------------------------
// The baseline: fp32 AdamW with libtorch ops
// ---------------------------------------------------------------------------------------------

/// torch.optim.AdamW's single-tensor loop with in-place libtorch ops and one temporary per
/// tensor (the same sequence as `ckptune_runtime::optim`'s AdamW).
struct AdamW32 {
    params: Vec<Tensor>,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    h: AdamHyper,
    step: i32,
}

impl AdamW32 {
    fn new(params: Vec<Tensor>, h: AdamHyper) -> Self {
        let n = params.len();
        Self {
            params,
            m: (0..n).map(|_| None).collect(),
            v: (0..n).map(|_| None).collect(),
            h,
            step: 0,
        }
    }

    fn step(&mut self) -> Result<(), tch::TchError> {
        self.step += 1;
        let h = self.h;
        let bc1 = 1.0 - h.betas.0.powi(self.step);
        let bc2_sqrt = (1.0 - h.betas.1.powi(self.step)).sqrt();
        let _guard = tch::no_grad_guard();
        for ((p, m), v) in self.params.iter().zip(&mut self.m).zip(&mut self.v) {
            let g = p.grad();
            let mut p = p.shallow_clone();
            let m = m.get_or_insert_with(|| p.zeros_like());
            let v = v.get_or_insert_with(|| p.zeros_like());
            let _ = p.f_mul_scalar_(1.0 - h.lr * h.weight_decay)?;
            let _ = m.f_lerp_(&g, 1.0 - h.betas.0)?;
            let c = 1.0 - h.betas.1;
            let _ = v.f_mul_scalar_(h.betas.1 / c)?;
            let _ = v.f_addcmul_(&g, &g)?;
            let _ = v.f_mul_scalar_(c)?;
            let mut denom = v.f_sqrt()?;
            let _ = denom.f_div_scalar_(bc2_sqrt)?;
            let _ = denom.f_add_scalar_(h.eps)?;
            let _ = denom.f_reciprocal_()?;
            let _ = denom.f_mul_scalar_(-h.lr / bc1)?;
            let _ = p.f_addcmul_(m, &denom)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Measurement
// ---------------------------------------------------------------------------------------------

struct Measured {
    name: &'static str,
    seconds: Vec<f64>,
    state_bytes: i64,
    transient_bytes: i64,
}

impl Measured {
    fn median(&self) -> f64 {
        let mut s = self.seconds.clone();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        }
    }
}

/// Parameters of `shapes` with random values and a random `.grad` each (kept for every step).
fn make_params(shapes: &[Vec<i64>]) -> Vec<Tensor> {
    shapes
        .iter()
        .map(|s| {
            let p = (Tensor::randn(s.as_slice(), (Kind::Float, Device::Cpu)) * 0.02).set_requires_grad(true);
            let g = Tensor::randn(s.as_slice(), (Kind::Float, Device::Cpu)) * 1e-3;
            (&p * g).sum(Kind::Float).backward();
            p
        })
        .collect()
}

/// A step function under test: its name, the step, and the state bytes it reports (if any).
struct Contender<'a> {
    name: &'static str,
    step: Box<dyn FnMut() -> Result<(), String> + 'a>,
    reported_state: Box<dyn Fn() -> Option<i64> + 'a>,
}

/// Each contender's first step on the meter (it allocates the state), then `warmup` untimed
/// rounds, then `repeats` timed rounds in which the contenders alternate step by step, so load
/// from other processes on a shared machine falls on all of them alike.
fn measure(meter: &MemoryMeter, args: &Args, contenders: &mut [Contender<'_>]) -> Result<Vec<Measured>, String> {
    let mut out = Vec::new();
    for c in contenders.iter_mut() {
        let (r, first) = meter.measure(&mut c.step);
        r?;
        let state = first.kept();
        if let Some(own) = (c.reported_state)() {
            if own != state {
                return Err(format!(
                    "{}: meter saw {state} B of state, the optimizer reports {own} B",
                    c.name
                ));
            }
        }
        out.push(Measured {
            name: c.name,
            seconds: Vec::with_capacity(args.repeats),
            state_bytes: state,
            transient_bytes: first.peak_above_start() - state,
        });
    }
    for _ in 0..args.warmup {
        for c in contenders.iter_mut() {
            (c.step)()?;
        }
    }
    for _ in 0..args.repeats {
        for (c, m) in contenders.iter_mut().zip(&mut out) {
            let t0 = Instant::now();
            let (r, mem) = meter.measure(&mut c.step);
            m.seconds.push(t0.elapsed().as_secs_f64());
            r?;
            m.transient_bytes = m.transient_bytes.max(mem.peak_above_start());
        }
    }
    Ok(out)
}

struct ModelResult {
    name: &'static str,
    threads: i32,
    source: &'static str,
    params: i64,
    tensors: usize,
    tensors_8bit: usize,
    params_8bit: i64,
    runs: Vec<Measured>,
}

fn bench_model(
    meter: &MemoryMeter,
    args: &Args,
    threads: i32,
    name: &'static str,
    source: &'static str,
    shapes: &[Vec<i64>],
) -> Result<ModelResult, String> {
    let h = AdamHyper::adamw(1e-3);
    // Same seed: both start from the same parameters and gradients.
    tch::manual_seed(0);
    let mut fp32 = AdamW32::new(make_params(shapes), h);
    tch::manual_seed(0);
    let eight = std::cell::RefCell::new(Adam8bit::new(make_params(shapes), h));
    let runs = measure(
        meter,
        args,
        &mut [
            Contender {
                name: "adamw",
                step: Box::new(|| fp32.step().map_err(|e| e.to_string())),
                reported_state: Box::new(|| None),
            },
            Contender {
                name: "adamw8bit",
                step: Box::new(|| eight.borrow_mut().step().map_err(|e| e.to_string())),
                reported_state: Box::new(|| Some(eight.borrow().state_bytes())),
            },
        ],
    )?;
    for r in &runs {
        eprintln!(
            "  {:<10} median {:.1} ms, state {} B, transient {} B",
            r.name,
            r.median() * 1e3,
            r.state_bytes,
            r.transient_bytes
        );
    }
    let big: Vec<i64> = shapes
        .iter()
        .map(|s| numel(s))
        .filter(|&n| n >= MIN_8BIT_NUMEL)
        .collect();
    Ok(ModelResult {
        name,
        threads,
        source,
        params: shapes.iter().map(|s| numel(s)).sum(),
        tensors: shapes.len(),
        tensors_8bit: big.len(),
        params_8bit: big.iter().sum(),
        runs,
    })
}

/// For the record: the same 8-bit update written with libtorch ops (gather the map, per-block
/// amax, `searchsorted` for the nearest code) on one tensor, to compare with the fused path.
fn ops_8bit_step(
    p: &mut Tensor,
    g: &Tensor,
    codes: (&mut Tensor, &mut Tensor),
    absmax: (&mut Tensor, &mut Tensor),
    maps: (&Tensor, &Tensor),
    s: &adam8bit::StepScalars,
) -> Result<(), tch::TchError> {
    let _guard = tch::no_grad_guard();
    let rows = p.numel() as i64 / BLOCK as i64;
    let deq = |c: &Tensor, a: &Tensor, map: &Tensor| -> Result<Tensor, tch::TchError> {
        Ok(map
            .f_index_select(0, &c.f_to_kind(Kind::Int64)?)?
            .f_view([rows, BLOCK as i64])?
            * a.f_unsqueeze(1)?)
    };
    let m = deq(codes.0, absmax.0, maps.0)?;
    let v = deq(codes.1, absmax.1, maps.1)?;
    let g2 = g.f_view([rows, BLOCK as i64])?;
    let m = &m + (&g2 - &m) * f64::from(s.one_minus_beta1);
    let v = &v * f64::from(s.beta2) + (&g2 * &g2) * f64::from(s.one_minus_beta2);
    let denom = v.f_sqrt()? / f64::from(s.bc2_sqrt) + f64::from(s.eps);
    let _ = p.f_mul_scalar_(f64::from(s.decay))?;
    let _ = p.f_add_(&(&m * f64::from(s.neg_step_size) / denom).f_view([-1])?)?;
    let quant = |x: &Tensor, a: &mut Tensor, c: &mut Tensor, map: &Tensor| -> Result<(), tch::TchError> {
        let am = x.f_abs()?.f_amax([1i64].as_slice(), false)?;
        let inv = am.f_clamp_min(f64::MIN_POSITIVE)?.f_reciprocal()?;
        let xn = (x * inv.f_unsqueeze(1)?).f_view([-1])?;
        let hi = xn
            .f_searchsorted(map, false, false, "left", None::<Tensor>)?
            .f_clamp(0, 255)?;
        let lo = (&hi - 1).f_clamp(0, 255)?;
        let (vh, vl) = (map.f_index_select(0, &hi)?, map.f_index_select(0, &lo)?);
        let pick_hi = (&vh - &xn).f_lt_tensor(&(&xn - &vl))?;
        c.f_copy_(&hi.f_where_self(&pick_hi, &lo)?)?;
        a.f_copy_(&am)?;
        Ok(())
    };
    quant(&m, absmax.0, codes.0, maps.0)?;
    quant(&v, absmax.1, codes.1, maps.1)?;
    Ok(())
}

struct OpsComparison {
    threads: i32,
    elements: i64,
    fused_ms: f64,
    ops_ms: f64,
}

fn compare_with_ops(args: &Args, threads: i32) -> Result<OpsComparison, String> {
    let n = 1i64 << 24; // 16.8 M elements, a whole number of blocks
    let e = |e: tch::TchError| e.to_string();
    tch::manual_seed(1);
    let p = Tensor::randn([n], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let g = Tensor::randn([n], (Kind::Float, Device::Cpu)) * 1e-3;
    (&p * &g).sum(Kind::Float).backward();
    let h = AdamHyper::adamw(1e-3);
    let mut fused = Adam8bit::new(vec![p.shallow_clone()], h);
    let time = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        for _ in 0..args.warmup.max(1) {
            f()?;
        }
        let mut t: Vec<f64> = (0..args.repeats)
            .map(|_| {
                let t0 = Instant::now();
                f().map(|_| t0.elapsed().as_secs_f64())
            })
            .collect::<Result<_, _>>()?;
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2] * 1e3)
    };
    let fused_ms = time(&mut || fused.step().map_err(|e| e.to_string()))?;
    let rows = n / BLOCK as i64;
    let maps = (
        Tensor::from_slice(adam8bit::SIGNED.values().as_slice()),
        Tensor::from_slice(adam8bit::UNSIGNED.values().as_slice()),
    );
    let mut codes = (
        Tensor::full([n], i64::from(adam8bit::SIGNED.zero_code()), (Kind::Uint8, Device::Cpu)),
        Tensor::zeros([n], (Kind::Uint8, Device::Cpu)),
    );
    let mut absmax = (
        Tensor::zeros([rows], (Kind::Float, Device::Cpu)),
        Tensor::zeros([rows], (Kind::Float, Device::Cpu)),
    );
    let mut q = p.detach().copy();
    let gd = p.grad();
    let mut step = 0u64;
    let ops_ms = time(&mut || {
        step += 1;
        let s = adam8bit::StepScalars::new(&h, step);
        ops_8bit_step(
            &mut q,
            &gd,
            (&mut codes.0, &mut codes.1),
            (&mut absmax.0, &mut absmax.1),
            (&maps.0, &maps.1),
            &s,
        )
        .map_err(e)
    })?;
    autograd::clear_grad(&p).map_err(|e| e.to_string())?;
    eprintln!("one {n}-element tensor: fused 8-bit {fused_ms:.1} ms, libtorch-ops 8-bit {ops_ms:.1} ms");
    Ok(OpsComparison {
        threads,
        elements: n,
        fused_ms,
        ops_ms,
    })
}

// ---------------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------------

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// What else was running: the machine's load average, as /proc/loadavg gives it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The conditions a run measured under.
struct Conditions {
    load_start: String,
    load_end: String,
    avx2: bool,
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn to_json(args: &Args, env: &Conditions, models: &[ModelResult], ops: &OpsComparison) -> String {
    let mut j = String::new();
    let _ = writeln!(j, "{{\n  \"format\": \"ckptune.bench-optimizer-8bit/1\",");
    let _ = writeln!(
        j,
        "  \"command\": \"cargo run --release -p ckptune-kernels --example bench_adam8bit -- --out {} --threads {} \
         --repeats {} --warmup {}\",",
        args.out.display(),
        args.threads.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","),
        args.repeats,
        args.warmup
    );
    let _ = writeln!(j, "  \"cpu\": {},", json_str(&cpu_name()));
    let _ = writeln!(
        j,
        "  \"threads\": [{}],",
        args.threads.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
    );
    let _ = writeln!(j, "  \"avx2\": {},", env.avx2);
    let _ = writeln!(
        j,
        "  \"load_average\": {{\"start\": {}, \"end\": {}}},",
        json_str(&env.load_start),
        json_str(&env.load_end)
    );
    let _ = writeln!(j, "  \"repeats\": {},\n  \"warmup\": {},", args.repeats, args.warmup);
    let _ = writeln!(
        j,
        "  \"state_format\": \"8-bit codes for both moments, one f32 absmax per {BLOCK}-element block per moment; \
         tensors below {MIN_8BIT_NUMEL} elements keep fp32 moments\","
    );
    let _ = writeln!(j, "  \"models\": [");
    for (k, m) in models.iter().enumerate() {
        let _ = writeln!(j, "    {{\n      \"name\": {},", json_str(m.name));
        let _ = writeln!(j, "      \"threads\": {},", m.threads);
        let _ = writeln!(j, "      \"shapes\": {},", json_str(m.source));
        let _ = writeln!(
            j,
            "      \"params\": {},\n      \"tensors\": {},\n      \"tensors_8bit\": {},\n      \"params_8bit\": {},",
            m.params, m.tensors, m.tensors_8bit, m.params_8bit
        );
        let _ = writeln!(j, "      \"optimizers\": [");
        for (i, r) in m.runs.iter().enumerate() {
            let secs: Vec<String> = r.seconds.iter().map(|s| format!("{s:.6}")).collect();
            let _ = writeln!(
                j,
                "        {{\"name\": {}, \"step_seconds_median\": {:.6}, \"step_seconds\": [{}], \"state_bytes\": {}, \
                 \"transient_bytes\": {}}}{}",
                json_str(r.name),
                r.median(),
                secs.join(", "),
                r.state_bytes,
                r.transient_bytes,
                if i + 1 < m.runs.len() { "," } else { "" }
            );
        }
        let _ = writeln!(j, "      ]\n    }}{}", if k + 1 < models.len() { "," } else { "" });
    }
    let _ = writeln!(j, "  ],");
    let _ = writeln!(
        j,
        "  \"fused_vs_libtorch_ops_8bit\": {{\"threads\": {}, \"elements\": {}, \"fused_ms\": {:.3}, \
         \"libtorch_ops_ms\": {:.3}}}",
        ops.threads, ops.elements, ops.fused_ms, ops.ops_ms
    );
    j.push_str("}\n");
    j
}

fn to_markdown(args: &Args, env: &Conditions, models: &[ModelResult], ops: &OpsComparison) -> String {
    let mib = |b: i64| b as f64 / (1u64 << 20) as f64;
    let mut md = String::new();
    let _ = writeln!(md, "# Optimizer step: fp32 AdamW vs 8-bit block-wise AdamW (CPU)\n");
    let _ = writeln!(
        md,
        "Written by `cargo run --release -p ckptune-kernels --example bench_adam8bit -- --out {}`. CPU: {} \
         (AVX2 path: {}), threads {}, median of {} steps after {} warm-up steps, the two optimizers alternating \
         step by step. Load average (1/5/15 min) {} at the start, {} at the end: on a shared machine, compare \
         the rows of one run, not runs. State bytes are read from the memory meter.\n",
        args.out.display(),
        cpu_name(),
        if env.avx2 { "yes" } else { "no" },
        args.threads.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","),
        args.repeats,
        args.warmup,
        env.load_start,
        env.load_end
    );
    let _ = writeln!(
        md,
        "| model | params | threads | optimizer | step (ms, median) | state (MiB) | state / param (B) | optimizer \
         transient (MiB) |"
    );
    let _ = writeln!(md, "|---|---:|---:|---|---:|---:|---:|---:|");
    for m in models {
        for r in &m.runs {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.3} | {:.1} |",
                m.name,
                m.params,
                m.threads,
                r.name,
                r.median() * 1e3,
                mib(r.state_bytes),
                r.state_bytes as f64 / m.params as f64,
                mib(r.transient_bytes)
            );
        }
    }
    let _ = writeln!(md);
    for m in models
        .iter()
        .filter(|m| Some(m.threads) == args.threads.first().copied())
    {
        let _ = writeln!(
            md,
            "- {}: {} tensors, {} with 8-bit state ({:.2}% of parameters). Shapes: {}",
            m.name,
            m.tensors,
            m.tensors_8bit,
            100.0 * m.params_8bit as f64 / m.params as f64,
            m.source
        );
    }
    let _ = writeln!(
        md,
        "- The same 8-bit update written with libtorch ops (map gather, per-block amax, `searchsorted`) on one \
         {}-element tensor, {} thread(s): {:.1} ms, against {:.1} ms for the fused path.",
        ops.elements, ops.threads, ops.ops_ms, ops.fused_ms
    );
    md
}

/// Writes `text` to `path` through a temporary file in the same directory and a rename, so a
/// reader never sees a half-written file.
fn write_atomic(path: &Path, text: &str) -> Result<(), String> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("renaming {} to {}: {e}", tmp.display(), path.display()))
}

fn run(args: &Args) -> Result<(), String> {
    let load_start = load_average();
    let meter = MemoryMeter::new().map_err(|e| e.to_string())?;
    let r152 = resnet152();
    let bert = bert_base();
    let (n152, nbert) = (
        r152.iter().map(|s| numel(s)).sum::<i64>(),
        bert.iter().map(|s| numel(s)).sum::<i64>(),
    );
    // The published parameter counts; the shapes above must reproduce them exactly.
    if (n152, nbert) != (60_192_808, 109_482_240) {
        return Err(format!("shape tables are off: resnet152 {n152}, bert-base {nbert}"));
    }
    let mut models = Vec::new();
    for &threads in &args.threads {
        tch::set_num_threads(threads);
        for (name, source, shapes) in [
            (
                "resnet152",
                "torchvision resnet152() per-tensor shapes (convolutions, BatchNorm weights and biases, fc)",
                &r152,
            ),
            (
                "bert-base-uncased",
                "Hugging Face BertModel per-tensor shapes (embeddings, 12 encoder layers, pooler)",
                &bert,
            ),
        ] {
            eprintln!("{name}, {threads} thread(s):");
            models.push(bench_model(&meter, args, threads, name, source, shapes)?);
        }
    }
    let ops_threads = args.threads.iter().copied().max().unwrap_or(1);
    tch::set_num_threads(ops_threads);
    let ops = compare_with_ops(args, ops_threads)?;
    let env = Conditions {
        load_start,
        load_end: load_average(),
        avx2: avx2(),
    };
    write_atomic(&args.out, &to_json(args, &env, &models, &ops))?;
    let md = args.out.with_extension("md");
    write_atomic(&md, &to_markdown(args, &env, &models, &ops))?;
    eprintln!("wrote {} and {}", args.out.display(), md.display());
    Ok(())
}

fn main() {
    let args = parse_args();
    if let Err(e) = run(&args) {
        eprintln!("error: bench_adam8bit: {e}");
        std::process::exit(1);
    }
}
