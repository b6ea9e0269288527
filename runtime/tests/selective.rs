//! Selective checkpointing (a checkpointed block whose forward keeps the outputs of the
//! operators its policy saves, `ckptune_kernels::sac`), under each policy: gradients equal the
//! plain step's bit for bit on every transformer family of the zoo, in fp32 and bf16 autocast
//! with dropout active, with every candidate selective and with keep, selective and full
//! checkpointing mixed; a selective block keeps more than a checkpointed one (and under `matmul`
//! less than a plain one); and one profile (with a step S per policy) predicts every moment of
//! every choice of keep, checkpointed and selective under either policy per block, policies
//! mixed in one step, to the byte, and its selective terms measured on the meta device equal
//! the CPU's.

mod common;

use ckptune_kernels::meter;
use ckptune_kernels::sac::SacPolicy;
use ckptune_models::{builtin, Attention, ModelOptions};
use ckptune_runtime::exec::MicroTrace;
use ckptune_runtime::profile::{measured_moments, profile, ProfileSettings, RetimePolicy};
use ckptune_runtime::{OptimizerKind, Precision, RuntimeError, Session, StepTrace, TrainConfig};
use ckptune_solver::model::{moments_at_selective, peak_at_selective};
use common::assert_bitwise;
use tch::{Device, Tensor};

const FAMILIES: [&str; 4] = ["tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-qwen2"];

/// The sequence: not the tiny models' head dimension (16), so that only the attention's scores
/// have the `[..., s, s]` shape the `attention` policy recomputes.
const SEQ: i64 = 12;

/// One micro-step of `model` with `mask` checkpointed, the blocks `selective` names running
/// selective; its gradients and trace.
fn run(
    (model, attention): (&str, Attention),
    precision: Precision,
    mask: &dyn Fn(usize, bool) -> bool,
    selective: &dyn Fn(usize) -> Option<SacPolicy>,
) -> (Vec<(String, Tensor)>, MicroTrace) {
    tch::manual_seed(11);
    let opts = ModelOptions {
        seq: Some(SEQ),
        attention: Some(attention),
        ..Default::default()
    };
    let chain = builtin(model, &opts).unwrap();
    let cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 2);
    let mut s = Session::new(chain, cfg, Device::Cpu).unwrap();
    let m: Vec<bool> = s
        .chain
        .blocks
        .iter()
        .enumerate()
        .map(|(i, b)| mask(i, b.candidate))
        .collect();
    s.selective = (0..m.len()).map(selective).collect();
    tch::manual_seed(5);
    let batch = s.make_batch();
    let mut tr = MicroTrace::default();
    s.micro_step(&batch, &m, Some(&mut tr)).unwrap();
    (s.named_grads(), tr)
}

#[test]
fn selective_gradients_equal_plain_bit_for_bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in FAMILIES
        .into_iter()
        .flat_map(|m| [(m, Attention::Sdpa), (m, Attention::Eager)])
    {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let (plain, _) = run(model, precision, &|_, _| false, &|_| None);
            for policy in SacPolicy::ALL {
                let what = format!("{model:?} {precision} {}", policy.name());
                let (all, _) = run(model, precision, &|_, c| c, &|_| Some(policy));
                assert_bitwise(&format!("{what}, every candidate selective"), &plain, &all);
                // Keep, selective and full in turn along the chain.
                let (mixed, _) = run(model, precision, &|i, c| c && i % 3 != 0, &|i| {
                    (i % 3 == 1).then_some(policy)
                });
                assert_bitwise(&format!("{what}, mixed"), &plain, &mixed);
            }
        }
    }
}

#[test]
fn a_selective_block_keeps_more_than_checkpointed_and_matmul_less_than_plain() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for model in FAMILIES
        .into_iter()
        .flat_map(|m| [(m, Attention::Sdpa), (m, Attention::Eager)])
    {
        let kept = |tr: &MicroTrace, i: usize| tr.blocks[i].fwd_after - tr.blocks[i].fwd_before;
        let (_, plain) = run(model, Precision::Fp32, &|_, _| false, &|_| None);
        let (_, full) = run(model, Precision::Fp32, &|_, c| c, &|_| None);
        for policy in SacPolicy::ALL {
            let (_, sel) = run(model, Precision::Fp32, &|_, c| c, &|_| Some(policy));
            // Blocks where checkpointing saves memory (not a head whose plain output is smaller
            // than its checkpointed one): a selective one keeps at least a checkpointed one's
            // bytes, more where its policy keeps an output; under `matmul`, less than the plain
            // block (`attention` keeps outputs plain autograd does not, such as a dropout's).
            let mut more = 0;
            for i in (0..plain.blocks.len()).filter(|&i| full.blocks[i].checkpointed) {
                let (p, f, s) = (kept(&plain, i), kept(&full, i), kept(&sel, i));
                if f < p {
                    assert!(f <= s, "{model:?} block {i}: full {f} <= {} {s}", policy.name());
                    if policy == SacPolicy::Matmul {
                        assert!(s < p, "{model:?} block {i}: matmul {s} < plain {p}");
                    }
                    more += usize::from(f < s);
                }
            }
            assert!(
                more > 0,
                "{model:?}: no block selective under {} kept an output",
                policy.name()
            );
        }
    }
}

/// Every choice of keep (0), checkpointed (1) and selective under `SacPolicy::ALL[k - 2]` (k ≥ 2)
/// for the candidate blocks.
fn choices(candidate: &[bool]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = vec![Vec::new()];
    let every: Vec<u8> = (0..2 + SacPolicy::ALL.len() as u8).collect();
    for &c in candidate {
        let states: &[u8] = if c { &every } else { &[0] };
        out = out
            .into_iter()
            .flat_map(|v| {
                states.iter().map(move |&k| {
                    let mut v = v.clone();
                    v.push(k);
                    v
                })
            })
            .collect();
    }
    out
}

/// The profile's prediction of every moment, from one profile with a step S per policy, equals
/// the instrumented step's under every choice of keep, checkpointed and selective under either
/// policy per block (the policies mixed in one step), to the byte; and the step peaks at the
/// highest moment. In bf16 tiny BERT a layer's `attention` cache keeps its output, which a plain
/// next layer (or the pooler) would otherwise let go of after its forward.
#[test]
fn predicted_moments_equal_measured_under_every_choice() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for (model, precision, accum) in [
        ("tiny-bert", Precision::Fp32, 1),
        ("tiny-bert", Precision::Bf16, 1),
        ("tiny-llama", Precision::Bf16, 1),
        ("tiny-gpt2", Precision::Fp32, 2),
    ] {
        tch::manual_seed(3);
        let opts = ModelOptions {
            seq: Some(SEQ),
            ..Default::default()
        };
        let chain = builtin(model, &opts).unwrap();
        let mut cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 2);
        cfg.grad_accum = accum;
        let mut s = Session::new(chain, cfg, Device::Cpu).unwrap();
        let settings = ProfileSettings {
            repeats: 1,
            quiet: true,
            retime: RetimePolicy::never(),
            selective: SacPolicy::ALL.to_vec(),
        };
        let p = profile(&mut s, &settings).unwrap();
        let candidate: Vec<bool> = s.chain.blocks.iter().map(|b| b.candidate).collect();
        let names: Vec<&str> = SacPolicy::ALL.iter().map(|p| p.name()).collect();
        for r in &p.regimes {
            for b in &r.blocks {
                let measured: Vec<&str> = b.selective.iter().map(|s| s.policy.as_str()).collect();
                let want: &[&str] = if b.candidate { &names } else { &[] };
                assert_eq!(measured, want, "{model} {}: selective terms", b.name);
            }
        }
        let all = choices(&candidate);
        assert!(all.len() >= 64, "{model}: {} choices", all.len());
        for c in all {
            let mask: Vec<bool> = c.iter().map(|&k| k != 0).collect();
            // The profile measured the policies in `SacPolicy::ALL`'s order.
            let sel: Vec<Option<usize>> = c.iter().map(|&k| (k >= 2).then(|| k as usize - 2)).collect();
            s.selective = sel.iter().map(|p| p.map(|p| SacPolicy::ALL[p])).collect();
            s.step(&mask, None).unwrap();
            let mut trace = StepTrace::default();
            let peak = s.step(&mask, Some(&mut trace)).unwrap().peak_bytes;
            let seen = measured_moments(&trace, &s.chain, p.regimes.len());
            let what = format!("{model} {precision} accum {accum} choice {c:?}");
            assert_eq!(moments_at_selective(&p, &mask, &sel), seen, "{what}: moments");
            assert_eq!(peak_at_selective(&p, &mask, &sel).0, peak, "{what}: peak");
        }
    }
}

/// Measured on the meta device (fake mode, where the selective cache keeps fake tensors), a
/// profile's selective terms equal the CPU's to the byte, the output a cache keeps included
/// (bf16 BERT's layers under `attention` keep theirs, which a plain next layer lets go of).
#[test]
fn selective_terms_on_the_meta_device_equal_the_cpu() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    tch::set_num_threads(1);
    let mut held = 0;
    for ((model, precision), policy) in [
        ("tiny-bert", Precision::Fp32),
        ("tiny-bert", Precision::Bf16),
        ("tiny-llama", Precision::Fp32),
    ]
    .into_iter()
    .flat_map(|m| SacPolicy::ALL.map(|p| (m, p)))
    {
        let settings = ProfileSettings {
            repeats: 1,
            quiet: true,
            retime: RetimePolicy::never(),
            selective: vec![policy],
        };
        let opts = ModelOptions {
            seq: Some(SEQ),
            ..Default::default()
        };
        let cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 2);
        let build = || builtin(model, &opts).map_err(|e| RuntimeError::Invalid(e.to_string()));
        tch::manual_seed(0);
        let cpu = profile(
            &mut Session::new(build().unwrap(), cfg.clone(), Device::Cpu).unwrap(),
            &settings,
        )
        .unwrap();
        tch::manual_seed(0);
        let meta = profile(&mut Session::new_fake(build, cfg, Device::Cpu).unwrap(), &settings).unwrap();
        // In bf16 oneDNN's matmuls allocate scratch of their own, which the meta device learns
        // from a real step's trace (runtime/tests/fake.rs) and this profile does not: there the
        // kept bytes are compared, the transients in fp32.
        let transients = precision == Precision::Fp32;
        let bytes = |b: &ckptune_solver::profile::BlockProfile| {
            b.selective
                .iter()
                .map(|s| {
                    (
                        s.kept,
                        transients.then_some((s.fwd_transient, s.rec_transient, s.bwd_transient)),
                        s.cache,
                        s.kept_recompute,
                        s.out_released,
                        s.held_output,
                    )
                })
                .collect::<Vec<_>>()
        };
        for (a, b) in cpu.regimes[0].blocks.iter().zip(&meta.regimes[0].blocks) {
            assert!(a.selective.len() == usize::from(a.candidate), "{model} {}", a.name);
            assert_eq!(
                bytes(a),
                bytes(b),
                "{model} {precision} {} {}: selective terms, CPU vs meta",
                policy.name(),
                a.name
            );
            held += a.selective.iter().filter(|s| s.held_output > 0).count();
        }
    }
    assert!(held > 0, "no selective cache kept its output");
}

/// A session that only ever runs one choice, as `verify` and `train --plan` do, learns what it
/// may let go of from that choice's own steps: a plain layer after a selective one releases its
/// input as the profile's session does, whether the selective cache keeps that input (bf16 tiny
/// BERT at sequence 12) or recomputes it (at sequence 32, where the hidden states have the
/// score shape `[.., s, s]` the `attention` policy recomputes), so the fresh session's third
/// step equals the profile's prediction to the byte.
#[test]
fn a_fresh_session_running_one_selective_choice_matches_the_profile() {
    let _lock = meter::exclusive();
    meter::install().unwrap();
    tch::set_num_threads(1);
    for (seq, held) in [(12, 3072), (32, 0)] {
        let opts = ModelOptions {
            seq: Some(seq),
            ..Default::default()
        };
        let session = || {
            let chain = builtin("tiny-bert", &opts).unwrap();
            Session::new(
                chain,
                TrainConfig::new(Precision::Bf16, OptimizerKind::AdamW, 2),
                Device::Cpu,
            )
            .unwrap()
        };
        let settings = ProfileSettings {
            repeats: 1,
            quiet: true,
            retime: RetimePolicy::never(),
            selective: vec![SacPolicy::Attention],
        };
        let p = profile(&mut session(), &settings).unwrap();
        let layer = |b: &&ckptune_solver::profile::BlockProfile| b.name.starts_with("encoder.layer.");
        let kept: Vec<i64> = p.regimes[0]
            .blocks
            .iter()
            .filter(layer)
            .map(|b| b.selective[0].held_output)
            .collect();
        assert_eq!(kept, [held, held], "seq {seq}: the layers' held outputs");
        // Embeddings, layer 0, layer 1, pooler: one layer selective, the block after it plain.
        for c in [[0u8, 2, 0, 0], [0, 0, 2, 0]] {
            let mask: Vec<bool> = c.iter().map(|&k| k != 0).collect();
            let sel: Vec<Option<usize>> = c.iter().map(|&k| (k >= 2).then_some(0)).collect();
            let mut s = session();
            s.selective = sel.iter().map(|p| p.map(|_| SacPolicy::Attention)).collect();
            // Two warm-up steps, as the profile's: the optimizer's state exists after them.
            s.step(&mask, None).unwrap();
            s.step(&mask, None).unwrap();
            let mut trace = StepTrace::default();
            s.step(&mask, Some(&mut trace)).unwrap();
            let seen = measured_moments(&trace, &s.chain, 1);
            assert_eq!(moments_at_selective(&p, &mask, &sel), seen, "seq {seq} choice {c:?}");
        }
    }
}
