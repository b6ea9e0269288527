//! The CUDA side of 8-bit Adam: `csrc/adam8bit.cu` compiles to PTX with NVRTC wherever libnvrtc
//! is found (it ships with torch's PyPI dependencies, so on every development machine), and on a
//! machine with a GPU the kernel's steps equal the CPU path's bit for bit. Where something is
//! missing, the test says what it skipped and why.

#![cfg(feature = "cuda")]

use std::io::Write;

use ckptune_kernels::adam8bit::{self, Adam8bit, AdamHyper, Moments, BLOCK};
use ckptune_kernels::{autograd, cuda, meter, nvrtc};
use tch::{Device, Kind, Tensor};

/// Writes a line to the process's real stderr in one piece: the test harness captures
/// `eprintln!` of passing tests, and a skip must be visible in a plain `cargo test`.
fn say(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn skip(test: &str, why: &str) {
    say(&format!("SKIPPED {test}: {why}"));
}

#[test]
fn nvrtc_compiles_the_adam8bit_kernel_to_ptx() {
    let _lock = meter::exclusive();
    let found = match nvrtc::locate() {
        Ok(found) => found,
        Err(e) => {
            skip("nvrtc_compiles_the_adam8bit_kernel_to_ptx", &e.to_string());
            return;
        }
    };
    let from = found
        .path
        .as_deref()
        .map_or("the system search path".into(), |p| p.display().to_string());
    // Not captured either: which libnvrtc a run used is worth seeing in every log.
    say(&format!("NVRTC {}.{} from {from}", found.version.0, found.version.1));
    let ptx = adam8bit::gpu::ptx().expect("csrc/adam8bit.cu compiles").to_src();
    for kernel in adam8bit::CUDA_KERNELS {
        assert!(ptx.contains(&format!(".entry {kernel}(")), "PTX defines {kernel}");
    }
    // --fmad=false: no fused multiply-add may appear, or the GPU would round differently.
    assert!(
        !ptx.contains("fma.rn.f32"),
        "the kernel is compiled without FMA contraction"
    );
    assert!(
        ptx.contains("ckpt_map_m_bits"),
        "the generated map prelude is part of the module"
    );
    eprintln!("PTX: {} bytes", ptx.len());
}

#[test]
fn a_compile_error_carries_nvrtc_s_log() {
    let _lock = meter::exclusive();
    if let Err(e) = nvrtc::locate() {
        skip("a_compile_error_carries_nvrtc_s_log", &e.to_string());
        return;
    }
    let e = nvrtc::compile("broken.cu", "extern \"C\" __global__ void k() { undefined_name; }", &[]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("compiling a CUDA kernel with NVRTC: broken.cu:"),
        "{msg}"
    );
    assert!(msg.contains("undefined_name"), "the log names the problem: {msg}");
}

/// Why a GPU run cannot happen here, if it cannot.
fn no_gpu() -> Option<String> {
    if !cuda::driver_present() {
        return Some("libcuda (the NVIDIA driver library) is not present".into());
    }
    if !tch::Cuda::is_available() {
        return Some("libtorch sees no CUDA device".into());
    }
    if let Err(e) = nvrtc::locate() {
        return Some(e.to_string());
    }
    None
}

fn set_grad(p: &Tensor, g: &Tensor) {
    autograd::clear_grad(p).unwrap();
    (p * g).sum(Kind::Float).backward();
}

#[test]
fn gpu_steps_equal_cpu_steps_bit_for_bit() {
    let _lock = meter::exclusive();
    if let Some(why) = no_gpu() {
        skip("gpu_steps_equal_cpu_steps_bit_for_bit", &why);
        return;
    }
    let gpu = Device::Cuda(0);
    tch::manual_seed(0);
    // An 8-bit tensor with a partial last block, a 32-bit one, and an AdamW and an Adam+L2 run.
    for h in [
        AdamHyper::adamw(1e-3),
        AdamHyper {
            weight_decay: 0.05,
            ..AdamHyper::adam(2e-3)
        },
    ] {
        let shapes = [vec![37 * BLOCK as i64 + 1001], vec![300], vec![64, 4096]];
        let cpu_params: Vec<Tensor> = shapes
            .iter()
            .map(|s| (Tensor::randn(s.as_slice(), (Kind::Float, Device::Cpu)) * 0.1).set_requires_grad(true))
            .collect();
        let gpu_params: Vec<Tensor> = cpu_params
            .iter()
            .map(|p| p.detach().to_device(gpu).set_requires_grad(true))
            .collect();
        let mut cpu_opt = Adam8bit::new(cpu_params.iter().map(Tensor::shallow_clone).collect(), h);
        let mut gpu_opt = Adam8bit::new(gpu_params.iter().map(Tensor::shallow_clone).collect(), h);
        for step in 1..=5 {
            for (pc, pg) in cpu_params.iter().zip(&gpu_params) {
                // Heavy-tailed gradients reach every decade of the maps.
                let g = Tensor::randn(pc.size().as_slice(), (Kind::Float, Device::Cpu))
                    * Tensor::randn(pc.size().as_slice(), (Kind::Float, Device::Cpu)).pow_tensor_scalar(3);
                set_grad(pc, &g);
                set_grad(pg, &g.to_device(gpu));
            }
            cpu_opt.step().unwrap();
            gpu_opt.step().unwrap();
            adam8bit::gpu::synchronize(0).unwrap();
            for (i, (pc, pg)) in cpu_params.iter().zip(&gpu_params).enumerate() {
                let back = pg.detach().to_device(Device::Cpu);
                let same = pc
                    .detach()
                    .view([-1])
                    .view_dtype(Kind::Int)
                    .eq_tensor(&back.view([-1]).view_dtype(Kind::Int));
                let mismatched = same.logical_not().sum(Kind::Int64).int64_value(&[]);
                assert_eq!(
                    mismatched, 0,
                    "{h:?} step {step} parameter {i}: {mismatched} elements differ"
                );
                let (sc, sg) = (cpu_opt.state(i).unwrap(), gpu_opt.state(i).unwrap());
                match (&sc.moments, &sg.moments) {
                    (
                        Moments::Blockwise {
                            m_codes,
                            v_codes,
                            m_absmax,
                            v_absmax,
                        },
                        Moments::Blockwise {
                            m_codes: gm,
                            v_codes: gv,
                            m_absmax: gam,
                            v_absmax: gav,
                        },
                    ) => {
                        for (what, a, b) in [
                            ("m codes", m_codes, gm),
                            ("v codes", v_codes, gv),
                            ("m absmax", m_absmax, gam),
                            ("v absmax", v_absmax, gav),
                        ] {
                            assert!(
                                a.equal(&b.to_device(Device::Cpu)),
                                "{h:?} step {step} parameter {i}: {what}"
                            );
                        }
                    }
                    (Moments::Full { m, v }, Moments::Full { m: gm, v: gv }) => {
                        assert!(
                            m.equal(&gm.to_device(Device::Cpu)),
                            "{h:?} step {step} parameter {i}: m"
                        );
                        assert!(
                            v.equal(&gv.to_device(Device::Cpu)),
                            "{h:?} step {step} parameter {i}: v"
                        );
                    }
                    _ => panic!("parameter {i}: CPU and GPU chose different state layouts"),
                }
            }
        }
        assert_eq!(cpu_opt.state_bytes(), gpu_opt.state_bytes());
    }
    eprintln!("GPU and CPU 8-bit Adam agree bit for bit over 5 steps (AdamW and Adam+L2)");
}
