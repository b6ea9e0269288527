//! The chunked loss (`loss_chunks`): the loss and every gradient equal the whole loss's within a
//! stated tolerance, every moment of a step is what the memory model predicts to the byte, and
//! models without a language model's head refuse it.

mod common;

use ckptune_kernels::meter;
use ckptune_models::{builtin, ModelOptions};
use ckptune_runtime::profile::measured_moments;
use ckptune_runtime::{OptimizerKind, Precision, Session, StepTrace, TrainConfig};
use ckptune_solver::model::{moments_at, peak_at};
use common::{python_reference, quick_profile, subsets};
use tch::Device;

const LMS: [&str; 3] = ["tiny-gpt2", "tiny-llama", "tiny-qwen2"];

fn session(model: &str, precision: Precision, chunks: i64, accum: i64, set_to_none: bool) -> Session {
    let mut cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 2);
    cfg.loss_chunks = chunks;
    cfg.grad_accum = accum;
    cfg.set_to_none = set_to_none;
    session_with(model, cfg)
}

fn session_with(model: &str, cfg: TrainConfig) -> Session {
    tch::manual_seed(11);
    let opts = ModelOptions {
        seq: Some(16),
        ..Default::default()
    };
    Session::new(builtin(model, &opts).unwrap(), cfg, Device::Cpu).unwrap()
}

/// The loss and the gradients of one micro-step.
fn loss_and_grads(model: &str, precision: Precision, chunks: i64) -> (f64, Vec<(String, tch::Tensor)>) {
    let mut s = session(model, precision, chunks, 1, true);
    let mask = vec![false; s.chain.blocks.len()];
    tch::manual_seed(5);
    let batch = s.make_batch();
    let loss = s.micro_step(&batch, &mask, None).unwrap();
    (loss, s.named_grads())
}

/// The chunks sum the same products in another order (each chunk's cross entropy, then their
/// sum; the gradients scaled by 1/tokens after the sum rather than before), so results agree
/// to rounding: in fp32 within 1e-5 of the largest gradient element, in bf16 autocast (whose
/// matmuls round their inputs and outputs to 8 bits of mantissa) within 2e-2.
#[test]
fn chunked_loss_and_gradients_equal_the_whole_loss() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in LMS {
        for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Bf16, 2e-2)] {
            let (whole, plain) = loss_and_grads(model, precision, 1);
            // 32 tokens: 4 chunks of 8, and 7 chunks of 5 but the last of 2 (torch.chunk).
            for chunks in [4, 7] {
                let (loss, grads) = loss_and_grads(model, precision, chunks);
                assert!(
                    (loss - whole).abs() <= tol * whole.abs(),
                    "{model} {precision} {chunks} chunks: loss {loss} vs {whole}"
                );
                assert_eq!(plain.len(), grads.len());
                for ((name, a), (_, b)) in plain.iter().zip(&grads) {
                    let scale = a.abs().max().double_value(&[]);
                    let diff = (a - b).abs().max().double_value(&[]);
                    assert!(
                        diff <= tol * scale,
                        "{model} {precision} {chunks} chunks: gradient of {name} differs by {diff} (largest {scale})"
                    );
                }
            }
        }
    }
}

/// Every subset of candidates, in both memory regimes (accumulation, gradients zeroed in
/// place), fp32 and bf16: the measured moments are the predicted ones, byte for byte.
#[test]
fn chunked_loss_peaks_exactly_as_predicted() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in LMS {
        for precision in [Precision::Fp32, Precision::Bf16] {
            for (accum, set_to_none) in [(1, true), (2, false)] {
                every_subset_peaks_as_predicted(&mut session(model, precision, 3, accum, set_to_none));
            }
        }
    }
}

/// A loop that keeps autocast's cache on (the Hugging Face Trainer's) computes the chunked loss
/// inside its region: every block's casts live through the chunks and are freed before
/// `loss.backward()`, the loss's forward and backward moments apart, as predicted.
#[test]
fn chunked_loss_under_autocast_cache_peaks_exactly_as_predicted() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in LMS {
        for (accum, set_to_none) in [(1, true), (2, false)] {
            let mut cfg = TrainConfig::new(Precision::Bf16, OptimizerKind::AdamW, 2);
            cfg.loss_chunks = 3;
            cfg.grad_accum = accum;
            cfg.set_to_none = set_to_none;
            cfg.autocast_cache = true;
            let mut s = session_with(model, cfg);
            let p = every_subset_peaks_as_predicted(&mut s);
            assert!(s.hold_casts, "{model}: the session holds the casts");
            let casts: i64 = p.regimes[0].blocks.iter().filter_map(|b| b.cache_nograd).sum();
            assert!(casts > 0, "{model}: a no-grad bf16 forward caches weight casts");
        }
    }
}

/// Profiles `s`, then steps every subset of its candidates: the measured moments and peak are
/// the predicted ones, byte for byte. Returns the profile.
fn every_subset_peaks_as_predicted(s: &mut Session) -> ckptune_runtime::profile::ConfigProfile {
    let label = format!("{} {}", s.chain.name, s.cfg.label());
    let p = quick_profile(s);
    let candidates: Vec<usize> = (0..s.chain.blocks.len())
        .filter(|&i| s.chain.blocks[i].candidate)
        .collect();
    for pick in subsets(candidates.len()) {
        let mut mask = vec![false; s.chain.blocks.len()];
        for (&i, &on) in candidates.iter().zip(&pick) {
            mask[i] = on;
        }
        let mut trace = StepTrace::default();
        let report = s.step(&mask, Some(&mut trace)).unwrap();
        let measured = measured_moments(&trace, &s.chain, p.regimes.len());
        assert_eq!(measured, moments_at(&p, &mask), "{label} {mask:?}: moments");
        assert_eq!(report.peak_bytes, peak_at(&p, &mask).0, "{label} {mask:?}: peak");
    }
    p
}

/// The loss window, from the last hidden states to their gradient and the head weight's, peaks
/// exactly where PyTorch running `ckptune.chunked_causal_lm_loss` and its backward peaks
/// (tests/fixtures/chunked_loss_window.py, same shapes, the same counting allocator), for an
/// untied and a tied head, fp32 and bf16 autocast, chunks that divide the tokens and not.
#[test]
fn the_loss_window_peaks_as_in_pytorch() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in ["tiny-llama", "tiny-qwen2"] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            for chunks in [3, 7] {
                let mut s = session(model, precision, chunks, 1, true);
                let weight = s.chain.head.causal_lm().unwrap().weight().size();
                let ours = quick_profile(&mut s).regimes[0].loss_transient;
                let args = [2, 16, weight[1], weight[0], chunks].map(|v| v.to_string());
                let mut args = args.to_vec();
                args.push(precision.name().to_string());
                let theirs = python_reference("chunked_loss_window.py", &args)["peak_above_start"]
                    .as_i64()
                    .unwrap();
                assert_eq!(ours, theirs, "{model} {precision} {chunks} chunks: loss window");
            }
        }
    }
}

/// The loss's window holds one chunk's logits and their gradient instead of all of them.
#[test]
fn more_chunks_lower_the_loss_window() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let window = |chunks| {
        let mut s = session("tiny-gpt2", Precision::Fp32, chunks, 1, true);
        quick_profile(&mut s).regimes[0].loss_transient
    };
    let (one, four, sixteen) = (window(1), window(4), window(16));
    assert!(four < one && sixteen < four, "loss windows {one}, {four}, {sixteen}");
}

#[test]
fn a_model_without_a_language_model_head_refuses_chunks() {
    // Building a model draws from the global generator the other tests seed.
    let _lock = meter::exclusive();
    let mut cfg = TrainConfig::new(Precision::Fp32, OptimizerKind::Sgd, 2);
    cfg.loss_chunks = 2;
    let opts = ModelOptions {
        seq: Some(16),
        ..Default::default()
    };
    let err = Session::new(builtin("tiny-bert", &opts).unwrap(), cfg, Device::Cpu)
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(msg.contains("loss chunks 2") && msg.contains("tiny-bert"), "{msg}");
}
