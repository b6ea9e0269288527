//! `torch.export` programs run node by node: the exported tiny ResNet (models/fixtures,
//! made by make_export_fixtures.py from reference.py) cuts into the built-in's blocks, its
//! training step peaks at exactly the built-in's bytes under every checkpoint subset, and its
//! gradients with checkpointing equal the plain step's bit for bit; the exported tiny BERT holds
//! the built-in's bytes but for what Python's locals hold in its forward, derived from PyTorch.

use std::path::PathBuf;

mod common;

use ckptune_kernels::meter;
use ckptune_models::export::chain_from_export;
use ckptune_models::{builtin, Attention, Chain, ModelOptions};
use ckptune_runtime::profile::measured_moments;
use ckptune_runtime::{OptimizerKind, Precision, Session, StepTrace, TrainConfig};
use ckptune_solver::model::{moments_at, peak_at};
use tch::Device;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/fixtures")
        .join(name)
}

fn exported(batch: Option<i64>) -> Chain {
    let opts = ModelOptions {
        batch,
        ..Default::default()
    };
    chain_from_export(&fixture("tiny_resnet.pt2"), &opts).unwrap()
}

fn session(chain: Chain, precision: Precision, batch: i64) -> Session {
    Session::new(
        chain,
        TrainConfig::new(precision, OptimizerKind::AdamW, batch),
        Device::Cpu,
    )
    .unwrap()
}

#[test]
fn exported_resnet_cuts_into_the_builtin_blocks() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = meter::exclusive();
    let ex = exported(None);
    let opts = ModelOptions {
        image: Some(32),
        ..Default::default()
    };
    let bi = builtin("tiny-resnet", &opts).unwrap();
    let names = |c: &Chain| -> Vec<(String, bool)> { c.blocks.iter().map(|b| (b.name.clone(), b.candidate)).collect() };
    assert_eq!(names(&ex), names(&bi));
    assert_eq!(ex.input, bi.input);
    let mut a: Vec<(String, Vec<i64>)> = ex.vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
    let mut b: Vec<(String, Vec<i64>)> = bi.vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "parameter and buffer names and shapes equal the built-in's");
}

/// Step peak above the step's start, for every subset of the four candidates.
fn peaks(chain: Chain, precision: Precision, batch: i64) -> Vec<i64> {
    let mut s = session(chain, precision, batch);
    let cands: Vec<usize> = (0..s.chain.blocks.len())
        .filter(|&i| s.chain.blocks[i].candidate)
        .collect();
    let n = s.chain.blocks.len();
    (0..1usize << cands.len())
        .map(|bits| {
            let mut mask = vec![false; n];
            for (k, &i) in cands.iter().enumerate() {
                mask[i] = bits >> k & 1 == 1;
            }
            s.step(&mask, None).unwrap(); // warm-up of this subset
            let r = s.step(&mask, None).unwrap();
            r.peak_bytes - r.start_bytes
        })
        .collect()
}

#[test]
fn exported_resnet_peaks_at_the_builtin_bytes_under_every_subset() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let opts = ModelOptions {
        image: Some(32),
        ..Default::default()
    };
    // fp32 only: in bf16 at 16 pixels the built-in tiny-resnet itself ends some runs with a NaN
    // loss (`ckptune profile tiny-resnet --image 16 --batch 2 --precision bf16`: 2 runs of 8 on
    // the development machine), which Session::step refuses; not a difference of the export.
    for (precision, batch) in [(Precision::Fp32, 4), (Precision::Fp32, 2)] {
        tch::manual_seed(0);
        let want = peaks(builtin("tiny-resnet", &opts).unwrap(), precision, batch);
        tch::manual_seed(0);
        let got = peaks(exported(Some(batch)), precision, batch);
        assert_eq!(got, want, "{precision} batch {batch}: exported vs built-in step peaks");
    }
}

#[test]
fn exported_resnet_checkpointed_gradients_equal_plain_bit_for_bit() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for precision in [Precision::Fp32, Precision::Bf16] {
        let grads = |all: bool| {
            let mut s = session(exported(Some(2)), precision, 2);
            let mask: Vec<bool> = s.chain.blocks.iter().map(|b| all && b.candidate).collect();
            tch::manual_seed(5);
            let batch = s.make_batch();
            s.micro_step(&batch, &mask, None).unwrap();
            let buffers: Vec<(String, tch::Tensor)> = s
                .chain
                .vs
                .variables()
                .into_iter()
                .filter(|(_, t)| !t.requires_grad())
                .collect();
            (s.named_grads(), buffers)
        };
        let (plain, plain_buf) = grads(false);
        let (ckpt, ckpt_buf) = grads(true);
        assert_eq!(plain.len(), ckpt.len());
        assert!(!plain.is_empty());
        for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
            assert!(a.defined(), "{precision}: {n} got no gradient");
            assert!(a.equal(b), "{precision}: gradient of {n} differs");
        }
        let mut pb = plain_buf;
        let mut cb = ckpt_buf;
        pb.sort_by(|a, b| a.0.cmp(&b.0));
        cb.sort_by(|a, b| a.0.cmp(&b.0));
        for ((n, a), (_, b)) in pb.iter().zip(&cb) {
            assert!(a.equal(b), "{precision}: buffer {n} differs after a checkpointed step");
        }
    }
}

#[test]
fn exported_stack_with_dropout_checkpoints_bitwise_at_every_level() {
    // Nested groups, skips into groups, dropout replayed under recompute: gradients with the
    // children checkpointed, and with the layers (groups) checkpointed, equal the plain step's.
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let opts = ModelOptions {
        granularity: ckptune_models::Granularity::Nested,
        ..Default::default()
    };
    for precision in [Precision::Fp32, Precision::Bf16] {
        let grads = |which: u8| {
            let chain = chain_from_export(&fixture("tiny_stack.pt2"), &opts).unwrap();
            let mut s = session(chain, precision, 4);
            let n = s.chain.blocks.len();
            let mut mask = vec![false; s.chain.units()];
            for (i, m) in mask.iter_mut().enumerate() {
                *m = match which {
                    1 => i < n && s.chain.blocks[i].candidate,
                    2 => i >= n,
                    _ => false,
                };
            }
            tch::manual_seed(5);
            let batch = s.make_batch();
            tch::manual_seed(9);
            s.micro_step(&batch, &mask, None).unwrap();
            s.named_grads()
        };
        let plain = grads(0);
        assert!(!plain.is_empty());
        for which in [1, 2] {
            let ckpt = grads(which);
            assert_eq!(plain.len(), ckpt.len());
            for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
                assert!(a.defined(), "{precision}: {n} got no gradient");
                assert!(a.equal(b), "{precision} mask {which}: gradient of {n} differs");
            }
        }
    }
}

/// The parameter gradients of one micro-step of `file` at batch 4, with the candidate blocks `i`
/// for which `ckpt(i)` holds checkpointed (seeded: two calls draw the same batch and dropout).
fn micro_step_grads(
    file: &str,
    opts: &ModelOptions,
    precision: Precision,
    ckpt: &dyn Fn(usize) -> bool,
) -> Vec<(String, tch::Tensor)> {
    let chain = chain_from_export(&fixture(file), opts).unwrap();
    let mut s = session(chain, precision, 4);
    let n = s.chain.blocks.len();
    let mask: Vec<bool> = (0..s.chain.units())
        .map(|i| i < n && s.chain.blocks[i].candidate && ckpt(i))
        .collect();
    tch::manual_seed(5);
    let batch = s.make_batch();
    tch::manual_seed(9);
    s.micro_step(&batch, &mask, None).unwrap();
    s.named_grads()
}

#[test]
fn exported_inplace_input_symbolic_size_and_shared_bias_checkpoint_bitwise() {
    // A layer writing its input in place (`relu_` of the previous layer's output) writes a
    // non-leaf alias of its input leaf; a symbolic size hoisted ahead of the first layer runs
    // with that layer; a bias one layer computes from its parameter and every later layer reads
    // is computed by each reader. Gradients with each candidate checkpointed alone, and with all
    // of them, equal the plain step's.
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    for (file, block) in [
        ("inplace_relu.pt2", "features.1"),
        ("sym_size.pt2", "inp"),
        ("position_bias.pt2", "layers.2"),
    ] {
        let chain = chain_from_export(&fixture(file), &ModelOptions::default()).unwrap();
        assert!(chain.blocks.iter().any(|b| b.name == block), "{file}: no block {block}");
        every_checkpoint_bitwise(file, chain.blocks.len());
    }
}

/// With each of the program's `n` blocks checkpointed alone, and with all of them, in fp32 and
/// bf16: every parameter gets a gradient, bit for bit the plain step's.
fn every_checkpoint_bitwise(file: &str, n: usize) {
    for precision in [Precision::Fp32, Precision::Bf16] {
        let grads = |ckpt: &dyn Fn(usize) -> bool| micro_step_grads(file, &ModelOptions::default(), precision, ckpt);
        let plain = grads(&|_| false);
        assert!(!plain.is_empty());
        for k in (0..n).map(Some).chain([None]) {
            let ckpt = grads(&|i| k.is_none_or(|k| k == i));
            for ((name, a), (_, b)) in plain.iter().zip(&ckpt) {
                assert!(a.defined() && b.defined(), "{file}: {name} got no gradient");
                assert!(a.equal(b), "{file} {precision} block {k:?}: gradient of {name} differs");
            }
        }
    }
}

#[test]
fn exported_several_outputs_and_input_read_again_checkpoint_bitwise() {
    // A program with several outputs: the loss reads the pooler's output and the last layer's
    // (which the pooler reads too), or an auxiliary classifier's output that no later block
    // reads. Every parameter gets a gradient (the pooler's and `aux`'s only through the loss),
    // and with each candidate checkpointed alone, and with all of them, it equals the plain
    // step's bit for bit.
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    // A head that reads the batch's token ids again (`last_token.pt2`) takes them from the step.
    let none: &[&str] = &[];
    for (file, reads) in [
        ("pooled_outputs.pt2", &["layers.1"][..]),
        ("aux_outputs.pt2", &["aux"]),
        ("last_token.pt2", none),
    ] {
        let chain = chain_from_export(&fixture(file), &ModelOptions::default()).unwrap();
        let read: Vec<&str> = chain
            .head
            .reads()
            .iter()
            .map(|&k| chain.blocks[k].name.as_str())
            .collect();
        assert_eq!(
            read, reads,
            "{file}: the blocks whose outputs the loss reads besides the last"
        );
        every_checkpoint_bitwise(file, chain.blocks.len());
    }
}

#[test]
fn exported_transformers_checkpoint_bitwise() {
    // Values every layer reads but no layer makes (a mask from the batch or from the sizes,
    // rotary cos/sin) are computed by each block that reads them; dropout replays under
    // recompute. Layers, and the layers' children, checkpointed.
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    use ckptune_models::Granularity::{Layer, Nested};
    for (file, granularity) in [
        ("tiny_bert.pt2", Layer),
        ("tiny_bert.pt2", Nested),
        ("tiny_bert_hf.pt2", Nested),
        ("tiny_llama.pt2", Layer),
        ("tiny_llama.pt2", Nested),
        ("hf_bert.pt2", Nested),
        ("hf_bert_mask.pt2", Layer),
        ("hf_llama.pt2", Layer),
        ("hf_llama.pt2", Nested),
        ("hf_gpt2.pt2", Nested),
    ] {
        let opts = ModelOptions {
            granularity,
            ..Default::default()
        };
        for precision in [Precision::Fp32, Precision::Bf16] {
            let grads = |all: bool| micro_step_grads(file, &opts, precision, &|_| all);
            let plain = grads(false);
            let ckpt = grads(true);
            assert!(!plain.is_empty());
            for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
                // Every parameter trains: a tied pair (GPT-2's wte and lm_head) is one.
                assert!(a.defined() && b.defined(), "{file}: {n} got no gradient");
                assert!(
                    a.equal(b),
                    "{file} {granularity:?} {precision}: gradient of {n} differs"
                );
            }
        }
    }
}

#[test]
fn exported_bert_peaks_as_the_builtin_but_for_python_locals() {
    // The exported tiny BERT and the built-in tiny-bert (both reference.py's model) hold the same
    // bytes at every backward moment and at the optimizer step. In a module's forward, the
    // built-in holds what Python's locals hold, as the nn.Module in PyTorch eager does (say
    // `hidden_states` in BertOutput.forward, the dropout output, alive while its LayerNorm runs),
    // while the export interpreter frees each value after its last reader, as PyTorch's own
    // graph interpreter does. So every forward and recompute moment differs by exactly what
    // PyTorch measures between those two runs of the same module, and the export's step peak is
    // the highest of the built-in's moments less those differences; the test derives each byte
    // from the reference.
    for batch in [4, 2] {
        python_locals_explain_every_byte(batch);
    }
}

fn python_locals_explain_every_byte(batch: i64) {
    let reference = common::python_reference("locals_vs_graph.py", &[batch.to_string(), "8".into()]);
    let at = |mode: &str, run: &str, module: &str| reference[mode][run][module].as_i64().unwrap();
    let rng_state = reference["rng_state_bytes"].as_i64().unwrap();
    let locals = |mode: &str, module: &str| at(mode, "eager", module) - at(mode, "graph", module);
    // Every layer computes the values all layers read (the extended mask) itself, so each is
    // measured as layer 0 is in the graph run, where the mask is made before the layer.
    let module = |block: &str| {
        if block.starts_with("encoder.layer.") {
            "encoder.layer.0"
        } else {
            block
        }
        .to_owned()
    };

    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let opts = ModelOptions {
        batch: Some(batch),
        seq: Some(8),
        ..Default::default()
    };
    for bits in 0..4usize {
        let ckpt = |name: &str| match name {
            "encoder.layer.0" => bits & 1 == 1,
            "encoder.layer.1" => bits & 2 == 2,
            _ => false,
        };
        // Per chain: the step's moments (relative to its start), its peak, and each block's
        // forward window above the level where the block began.
        let run = |chain: Chain| {
            let mut s = session(chain, Precision::Fp32, batch);
            let mask: Vec<bool> = s.chain.blocks.iter().map(|b| ckpt(&b.name)).collect();
            s.step(&mask, None).unwrap(); // warm-up of this subset
            let mut trace = StepTrace::default();
            let r = s.step(&mask, Some(&mut trace)).unwrap();
            let moments: Vec<(String, i64)> = measured_moments(&trace, &s.chain, 1)
                .into_iter()
                .map(|(l, v)| (l, v - r.start_bytes))
                .collect();
            let windows: Vec<(String, i64)> = s
                .chain
                .blocks
                .iter()
                .zip(&trace.micro[0].blocks)
                .map(|(b, t)| (b.name.clone(), t.fwd_peak - t.fwd_before))
                .collect();
            (moments, r.peak_bytes - r.start_bytes, windows)
        };
        tch::manual_seed(0);
        // The program was exported from the eager reference.
        let eager = ModelOptions {
            attention: Some(Attention::Eager),
            ..opts.clone()
        };
        let (bi, bi_peak, bi_windows) = run(builtin("tiny-bert", &eager).unwrap());
        tch::manual_seed(0);
        let (ex, ex_peak, ex_windows) = run(chain_from_export(&fixture("tiny_bert.pt2"), &opts).unwrap());

        // Each side is its PyTorch run, byte for byte: the built-in is eager, the export the
        // graph; a checkpointed block's no-grad forward is the checkpoint's (it keeps the
        // wrapped numbers the graph saves), and also saves the generator's state.
        for (windows, run_name) in [(&bi_windows, "eager"), (&ex_windows, "graph")] {
            for (name, window) in windows
                .iter()
                .filter(|(n, _)| n == "embeddings" || n.starts_with("encoder.layer."))
            {
                let want = if ckpt(name) {
                    at("checkpoint", run_name, &module(name)) + rng_state
                } else {
                    at("grad", run_name, &module(name))
                };
                assert_eq!(
                    *window, want,
                    "batch {batch} subset {bits}: {name}'s forward vs PyTorch's {run_name} run"
                );
            }
        }

        // Moment by moment, where the two chains have the same blocks.
        let expected = |label: &str| -> i64 {
            let (_, what) = label.split_once(": ").unwrap_or(("", label));
            if let Some(block) = what.strip_prefix("forward ") {
                let mode = if ckpt(block) { "checkpoint" } else { "grad" };
                locals(mode, &module(block))
            } else if let Some(block) = what.strip_prefix("recompute ") {
                locals("grad", &module(block))
            } else {
                0 // backward moments and the optimizer step
            }
        };
        // The head is cut differently (the built-in's pooler block and its loss over dropout and
        // classifier; the export's pooler+dropout+classifier block and a bare loss): those
        // moments are left to the step peak below, and neither chain peaks there.
        let head = |label: &str| label.contains("pooler") || label.ends_with(": loss");
        let mut compared = 0;
        for (label, b) in bi.iter().filter(|(l, _)| !head(l)) {
            let (_, e) = ex
                .iter()
                .find(|(l, _)| l == label)
                .expect("the same moment in the export");
            assert_eq!(b - e, expected(label), "batch {batch} subset {bits}: {label}");
            compared += 1;
        }
        assert!(
            compared >= 7,
            "batch {batch} subset {bits}: {compared} moments compared"
        );
        // So the export's step peak follows from the built-in's moments and the reference:
        // where a checkpointed layer's recompute is the built-in's peak, the export's is lower
        // by its locals or lands on another moment.
        let highest = |ms: &[(String, i64)]| ms.iter().filter(|(l, _)| !head(l)).map(|(_, v)| *v).max().unwrap();
        assert_eq!(
            bi_peak,
            highest(&bi),
            "batch {batch} subset {bits}: the built-in peaks outside the head"
        );
        assert_eq!(
            ex_peak,
            highest(&ex),
            "batch {batch} subset {bits}: the export peaks outside the head"
        );
        let derived = bi
            .iter()
            .filter(|(l, _)| !head(l))
            .map(|(l, v)| v - expected(l))
            .max()
            .unwrap();
        assert_eq!(
            ex_peak, derived,
            "batch {batch} subset {bits}: the export's step peak from the built-in's moments"
        );
    }
}

/// A module called several times (`layer`, three times in a row as ALBERT calls its shared layer
/// group; `act`, once after `inp` and once before `head`, a candidate when named) is a block per
/// call and one candidate. Each call checkpointed alone, every call of one module (what a plan's
/// regex and `torch.utils.checkpoint` on the module do), and everything give the plain step's
/// gradients bit for bit, each call's dropout drawn as in the plain step.
#[test]
fn exported_shared_layer_checkpoints_each_call_bitwise() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let file = "shared_layer.pt2";
    let chain = chain_from_export(&fixture(file), &ModelOptions::default()).unwrap();
    assert_eq!(chain.candidates(), ["inp", "layer", "head"]);
    every_checkpoint_bitwise(file, chain.blocks.len());
    let named = ModelOptions {
        candidates: Some("inp|act|layer|head".into()),
        ..Default::default()
    };
    let chain = chain_from_export(&fixture(file), &named).unwrap();
    let names: Vec<String> = chain.blocks.iter().map(|b| b.name.clone()).collect();
    assert_eq!(names, ["inp", "act", "layer", "layer", "layer", "act", "head"]);
    for precision in [Precision::Fp32, Precision::Bf16] {
        let grads = |ckpt: &dyn Fn(usize) -> bool| micro_step_grads(file, &named, precision, ckpt);
        let plain = grads(&|_| false);
        for module in ["layer", "act"] {
            for ckpt in [grads(&|i| names[i] == module), grads(&|i| names[i] != module)] {
                for ((name, a), (_, b)) in plain.iter().zip(&ckpt) {
                    assert!(a.equal(b), "{file} {precision} {module}: gradient of {name} differs");
                }
            }
        }
    }
}

/// Blocks that hand on several tensors: each layer of `two_tensors.pt2` hands on
/// `(hidden, gate)` (and a glue block a second program output), `mid_output.pt2`'s `layers.1`
/// its hidden state and auxiliary logits that only the loss reads, and the exported ResNet cut
/// at `layer1.0.relu` leaves glue handing on `bn1`'s output and the residual. On every subset
/// of candidates, in fp32 and bf16, every moment and the peak are the model's to the byte, and
/// the gradients are the plain step's bit for bit.
#[test]
fn blocks_handing_on_several_tensors_are_exact_on_every_subset() {
    let _lock = meter::exclusive();
    tch::set_num_threads(1);
    let relu = ModelOptions {
        candidates: Some(r"layer1\.0\.relu".into()),
        ..Default::default()
    };
    for (file, opts) in [
        ("two_tensors.pt2", ModelOptions::default()),
        ("mid_output.pt2", ModelOptions::default()),
        ("tiny_resnet.pt2", relu),
    ] {
        let chain = chain_from_export(&fixture(file), &opts).unwrap();
        let further = chain.blocks.iter().any(|b| !b.extra_reads.is_empty()) || !chain.head.extra_reads().is_empty();
        assert!(further, "{file}: no block hands on several tensors");
        for precision in [Precision::Fp32, Precision::Bf16] {
            let mut s = session(chain_from_export(&fixture(file), &opts).unwrap(), precision, 4);
            let p = common::quick_profile(&mut s);
            let units: Vec<usize> = (0..s.chain.units()).filter(|&u| s.chain.unit_candidate(u)).collect();
            let masks: Vec<Vec<bool>> = common::subsets(units.len())
                .into_iter()
                .map(|pick| {
                    (0..s.chain.units())
                        .map(|u| units.iter().position(|&c| c == u).is_some_and(|k| pick[k]))
                        .collect()
                })
                .collect();
            let grads = |mask: &[bool]| {
                let mut s = session(chain_from_export(&fixture(file), &opts).unwrap(), precision, 4);
                tch::manual_seed(5);
                let batch = s.make_batch();
                tch::manual_seed(9);
                s.micro_step(&batch, mask, None).unwrap();
                s.named_grads()
            };
            for mask in &masks {
                let mut trace = StepTrace::default();
                let report = s.step(mask, Some(&mut trace)).unwrap();
                let measured = measured_moments(&trace, &s.chain, p.regimes.len());
                assert_eq!(measured, moments_at(&p, mask), "{file} {precision} {mask:?}: moments");
                assert_eq!(
                    report.peak_bytes,
                    peak_at(&p, mask).0,
                    "{file} {precision} {mask:?}: peak"
                );
            }
            // Another session's tensors would count in the meter: gradients after the sweep.
            drop(s);
            let plain = grads(&masks[0]);
            let missing: Vec<&str> = plain
                .iter()
                .filter(|(_, g)| !g.defined())
                .map(|(n, _)| n.as_str())
                .collect();
            assert!(missing.is_empty(), "{file}: no gradient for {missing:?}");
            for mask in &masks {
                common::assert_bitwise(&format!("{file} {precision} {mask:?}"), &plain, &grads(mask));
            }
        }
    }
}
