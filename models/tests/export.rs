//! Loading `torch.export` archives (fixtures from `fixtures/make_export_fixtures.py`): the
//! candidate rules, the batch rule, and every kind of bad input failing with a message that
//! names the node, its operator and what to do.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use ckptune_models::export::chain_from_export;
use ckptune_models::{builtin, Chain, Granularity, InputSpec, ModelError, ModelOptions, TokenTargets};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

fn load(name: &str, opts: ModelOptions) -> Result<Chain, ModelError> {
    chain_from_export(&fixture(name), &opts)
}

fn candidates(c: &Chain) -> Vec<String> {
    c.candidates().into_iter().map(String::from).collect()
}

#[test]
fn granularities_give_the_builtin_resnet_candidates() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    for g in [Granularity::Layer, Granularity::Block, Granularity::Nested] {
        let ex = load(
            "tiny_resnet.pt2",
            ModelOptions {
                granularity: g,
                ..Default::default()
            },
        )
        .unwrap();
        let bi = builtin(
            "tiny-resnet",
            &ModelOptions {
                granularity: g,
                image: Some(32),
                ..Default::default()
            },
        )
        .unwrap();
        let names = |c: &Chain| c.blocks.iter().map(|b| b.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&ex), names(&bi), "{g:?}");
        assert_eq!(candidates(&ex), candidates(&bi), "{g:?}");
    }
}

#[test]
fn candidates_regex_chooses_modules_outright() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    let opts = |re: &str| ModelOptions {
        candidates: Some(re.into()),
        ..Default::default()
    };
    let c = load("tiny_resnet.pt2", opts(r"layer[12]|layer3\.0\.conv1")).unwrap();
    assert_eq!(candidates(&c), ["layer1", "layer2", "layer3.0.conv1"]);
    // A module called twice (BasicBlock's `relu`) is a block per call; here its first call
    // leaves the glue before it handing on two tensors, `bn1`'s output and the block's input
    // (which the glue between the calls reads for the residual sum).
    let c = load("tiny_resnet.pt2", opts(r"layer1\.0\.relu")).unwrap();
    assert_eq!(candidates(&c), ["layer1.0.relu"]);
    let further: Vec<(usize, usize)> = c.blocks.iter().flat_map(|b| b.extra_reads.clone()).collect();
    assert_eq!(further, [(0, 1)]);
    let e = load("tiny_resnet.pt2", opts(r"layer9")).unwrap_err().to_string();
    assert!(e.contains("contiguous"), "{e}");
}

/// A module called several times: `layer` three times in a row (ALBERT's shared layer group),
/// `act` twice apart. Each call is a block of its own under the module's name: `layer` by the
/// layer rule, at block granularity each of its calls cut into its children (each called once per
/// call of `layer`), at nested granularity whole (its calls would be groups of one name); `act`,
/// whose calls are apart, when `--candidates` names it.
#[test]
fn a_module_called_several_times_is_a_block_per_call() {
    let _lock = ckptune_kernels::meter::exclusive();
    let names = |g: Granularity, re: Option<&str>| {
        let c = load(
            "shared_layer.pt2",
            ModelOptions {
                granularity: g,
                candidates: re.map(String::from),
                ..Default::default()
            },
        )
        .unwrap();
        let blocks: Vec<String> = (c.blocks.iter())
            .map(|b| format!("{}{}", b.name, if b.candidate { "" } else { " (glue)" }))
            .collect();
        (blocks, candidates(&c))
    };
    let layer = ["inp", "act (glue)", "layer", "layer", "layer", "act (glue)", "head"];
    assert_eq!(names(Granularity::Layer, None).0, layer);
    assert_eq!(names(Granularity::Layer, None).1, ["inp", "layer", "head"]);
    assert_eq!(names(Granularity::Nested, None).0, layer);
    let call = ["layer.up", "layer.act", "layer.down", "layer.drop"];
    let (blocks, cands) = names(Granularity::Block, None);
    let mut want: Vec<String> = vec!["inp".into(), "act (glue)".into()];
    for add in ["add", "add_1", "add_2"] {
        want.extend(call.iter().map(|c| c.to_string()));
        want.push(format!("layer ({add}) (glue)"));
    }
    want.extend(["act (glue)".into(), "head".into()]);
    assert_eq!(blocks, want);
    assert_eq!(
        cands,
        ["inp", "layer.up", "layer.act", "layer.down", "layer.drop", "head"]
    );
    let (blocks, cands) = names(Granularity::Layer, Some(r"inp|act|layer|head"));
    assert_eq!(blocks, ["inp", "act", "layer", "layer", "layer", "act", "head"]);
    assert_eq!(cands, ["inp", "act", "layer", "head"]);
    let (blocks, cands) = names(Granularity::Layer, Some(r"layer\.up"));
    assert_eq!(cands, ["layer.up"]);
    assert_eq!(blocks.iter().filter(|b| *b == "layer.up").count(), 3);
    // One call whose nodes are apart (here both of `act`'s, given one stack key): named by
    // `--candidates`, refused naming it; unnamed, the layers plan as before.
    let dir = tempfile::tempdir().unwrap();
    let apart = dir.path().join("apart.pt2");
    rewrite(&fixture("shared_layer.pt2"), &apart, |j| {
        j.replace("L__self__act@1,act", "L__self__act,act")
    });
    let opts = |re: &str| ModelOptions {
        candidates: Some(re.into()),
        ..Default::default()
    };
    let e = chain_from_export(&apart, &opts("act|layer")).unwrap_err().to_string();
    for needle in [
        "act, a call of which is not one contiguous run",
        "name its parent module or its children",
    ] {
        assert!(e.contains(needle), "{needle:?} not in {e}");
    }
    assert!(chain_from_export(&apart, &opts("layer")).is_ok());
}

#[test]
fn static_batch_runs_only_at_its_exported_batch() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    let at = |b: Option<i64>| {
        load(
            "tiny_mlp_static.pt2",
            ModelOptions {
                batch: b,
                ..Default::default()
            },
        )
    };
    let c = at(Some(2)).unwrap();
    assert_eq!(
        c.input,
        InputSpec::Features {
            features: 8,
            classes: 4
        }
    );
    for b in [Some(8), None] {
        let e = at(b).unwrap_err();
        assert!(matches!(e, ModelError::StaticBatch { exported: 2, .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("--batch 2") && msg.contains(r#"Dim("batch")"#), "{msg}");
    }
}

#[test]
fn an_operator_the_dispatcher_lacks_names_the_node() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    let e = load("custom_op.pt2", ModelOptions::default()).unwrap_err();
    let ModelError::ExportNode { node, target, why, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(node, "twice");
    assert_eq!(target, "torch.ops.ckptune_test.twice.default");
    assert!(why.contains("no such operator") && why.contains("TORCH_LIBRARY"), "{e}");
}

#[test]
fn cond_is_an_unsupported_higher_order_op() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    let e = load("cond.pt2", ModelOptions::default()).unwrap_err();
    let ModelError::ExportNode { target, why, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(target, "torch.ops.higher_order.cond");
    assert!(why.contains("data-dependent control flow"), "{e}");
}

/// A copy of `src` with `model.json` passed through `edit`.
fn rewrite(src: &Path, dst: &Path, edit: impl Fn(&str) -> String) {
    let mut zin = zip::ZipArchive::new(std::fs::File::open(src).unwrap()).unwrap();
    let mut zout = zip::ZipWriter::new(std::fs::File::create(dst).unwrap());
    for i in 0..zin.len() {
        let mut f = zin.by_index(i).unwrap();
        let name = f.name().to_owned();
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).unwrap();
        if name.ends_with("models/model.json") {
            buf = edit(&String::from_utf8(buf).unwrap()).into_bytes();
        }
        zout.start_file(
            name,
            zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored),
        )
        .unwrap();
        zout.write_all(&buf).unwrap();
    }
    zout.finish().unwrap();
}

#[test]
fn corrupt_archives_and_unknown_versions_are_bad_input() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    let dir = tempfile::tempdir().unwrap();
    let truncated = dir.path().join("truncated.pt2");
    let bytes = std::fs::read(fixture("tiny_mlp_static.pt2")).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let e = chain_from_export(&truncated, &ModelOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::BadExport { .. }), "{e}");
    assert!(e.to_string().contains("not a readable zip archive"), "{e}");

    let future = dir.path().join("future.pt2");
    rewrite(&fixture("tiny_mlp_static.pt2"), &future, |j| {
        j.replace(r#""schema_version": {"major": 8"#, r#""schema_version": {"major": 99"#)
    });
    let e = chain_from_export(&future, &ModelOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("schema version 99") && e.contains("re-export"), "{e}");

    let broken = dir.path().join("broken.pt2");
    rewrite(&fixture("tiny_mlp_static.pt2"), &broken, |j| {
        j[..j.len() / 2].to_owned()
    });
    let e = chain_from_export(&broken, &ModelOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not valid JSON"), "{e}");
}

#[test]
fn interpreter_matches_tch_and_runs_no_grad_subgraphs() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    // The static MLP, node by node, against the same math through tch's bindings.
    let c = load(
        "tiny_mlp_static.pt2",
        ModelOptions {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let batch = c.make_batch(2, tch::Device::Cpu, 3);
    let got = c.forward_all(&batch.input, None, true).pop().unwrap();
    let v = c.vs.variables();
    let want = batch
        .input
        .linear(&v["0.weight"], Some(&v["0.bias"]))
        .relu()
        .linear(&v["2.weight"], Some(&v["2.bias"]));
    assert!(got.equal(&want), "interpreted MLP differs from tch");

    // `with torch.no_grad()` inside forward: wrap_with_set_grad_enabled's subgraph runs without
    // grad, so `frozen` gets no gradient while `inp` and `body` do.
    let c = load("set_grad.pt2", ModelOptions::default()).unwrap();
    let batch = c.make_batch(3, tch::Device::Cpu, 3);
    let out = c.forward_all(&batch.input, None, true).pop().unwrap();
    c.head.loss(&out, &batch).backward();
    let v = c.vs.variables();
    for name in ["inp.weight", "body.weight", "body.bias"] {
        assert!(v[name].grad().defined(), "{name} has a gradient");
    }
    for name in ["frozen.weight", "frozen.bias"] {
        assert!(!v[name].grad().defined(), "{name} ran under no_grad");
    }
    let h = batch.input.linear(&v["inp.weight"], Some(&v["inp.bias"]));
    let want =
        h.linear(&v["body.weight"], Some(&v["body.bias"])) + h.linear(&v["frozen.weight"], Some(&v["frozen.bias"]));
    assert!(out.equal(&want), "set_grad program differs from tch");
}

#[test]
fn core_aten_programs_write_buffer_mutations_back() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    // The same tiny ResNet as a training-IR program (batch norm updates its statistics in
    // place) and decomposed to core ATen (functional batch norm; the signature's buffer
    // mutations carry the new statistics): one training forward leaves equal buffers.
    let run = |name: &str| {
        let c = load(name, ModelOptions::default()).unwrap();
        let batch = c.make_batch(2, tch::Device::Cpu, 7);
        let out = tch::no_grad(|| c.forward_all(&batch.input, None, true).pop().unwrap());
        let mut vars: Vec<(String, tch::Tensor)> = c.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        (out, vars)
    };
    let (out_a, vars_a) = run("tiny_resnet.pt2");
    let (out_b, vars_b) = run("tiny_resnet_core.pt2");
    assert!(out_a.allclose(&out_b, 1e-5, 1e-5, false), "outputs differ");
    let names = |v: &[(String, tch::Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&vars_a), names(&vars_b));
    let mut moved = 0;
    for ((n, a), (_, b)) in vars_a.iter().zip(&vars_b) {
        assert!(
            a.allclose(b, 1e-5, 1e-6, false),
            "{n}: training-IR vs core-ATen after one step"
        );
        if n.ends_with("num_batches_tracked") {
            assert_eq!(a.int64_value(&[]), 1, "{n} counted the step");
            moved += 1;
        }
    }
    assert_eq!(moved, 12, "every batch norm counted its batch");
}

#[test]
fn nested_granularity_groups_a_layer_over_its_children() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    let c = load(
        "tiny_stack.pt2",
        ModelOptions {
            granularity: Granularity::Nested,
            ..Default::default()
        },
    )
    .unwrap();
    let groups: Vec<&str> = c.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(groups, ["layers.0", "layers.1", "layers.2"]);
    let cands = candidates(&c);
    for want in ["layers.1.fc1", "layers.1.act", "layers.1.fc2", "layers.1"] {
        assert!(cands.iter().any(|n| n == want), "{want} in {cands:?}");
    }
    // The residual sum reads the layer's input: a skip from the block before the group.
    let sum = c.groups[1].last;
    assert_eq!(c.blocks[sum].skips, [c.groups[1].first - 1], "{:?}", c.blocks[sum].name);
    let layer = load("tiny_stack.pt2", ModelOptions::default()).unwrap();
    assert_eq!(candidates(&layer), ["layers.0", "layers.1", "layers.2"]);
}

#[test]
fn a_node_that_fails_at_run_time_is_bad_input_at_load_time() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    // The first linear given the second one's weight: [4, 16] against 8 features.
    let dir = tempfile::tempdir().unwrap();
    let swapped = dir.path().join("swapped.pt2");
    rewrite(&fixture("tiny_mlp_static.pt2"), &swapped, |j| {
        j.replacen(
            r#""name": "weight", "arg": {"as_tensor": {"name": "p_0_weight"}}"#,
            r#""name": "weight", "arg": {"as_tensor": {"name": "p_2_weight"}}"#,
            1,
        )
    });
    let e = chain_from_export(
        &swapped,
        &ModelOptions {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, ModelError::BadExport { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("sample batch") && msg.contains("node linear (torch.ops.aten.linear.default)"),
        "{msg}"
    );
    assert!(!msg.contains("Exception raised from"), "{msg}");
}

#[test]
fn exported_bert_takes_its_mask_and_cuts_into_the_builtin_layers() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    let c = load("tiny_bert.pt2", ModelOptions::default()).unwrap();
    let names: Vec<&str> = c.blocks.iter().map(|b| b.name.as_str()).collect();
    // The layer rule: `encoder.layer.N` (the built-in also offers `embeddings` and `pooler`,
    // which this rule leaves as glue); the head after the pooler is glue too.
    assert_eq!(
        names,
        [
            "embeddings",
            "encoder.layer.0",
            "encoder.layer.1",
            "pooler+dropout+classifier"
        ]
    );
    assert_eq!(candidates(&c), ["encoder.layer.0", "encoder.layer.1"]);
    assert_eq!(
        c.input,
        InputSpec::Tokens {
            seq: 8,
            vocab: 100,
            targets: ckptune_models::TokenTargets::Classes(2)
        }
    );
    let nested = load(
        "tiny_bert.pt2",
        ModelOptions {
            granularity: Granularity::Nested,
            ..Default::default()
        },
    )
    .unwrap();
    let bi = builtin(
        "tiny-bert",
        &ModelOptions {
            granularity: Granularity::Nested,
            ..Default::default()
        },
    )
    .unwrap();
    let layer_parts = |c: &Chain| -> Vec<String> {
        candidates(c)
            .into_iter()
            .filter(|n| n.starts_with("encoder.layer."))
            .collect()
    };
    // A layer or its children: attention, intermediate, output, as in the built-in.
    assert_eq!(layer_parts(&nested), layer_parts(&bi));
}

#[test]
fn the_loss_reads_every_output() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    // `(logits, hidden)`: `hidden` (the last layer's output) is what the head block reads and
    // what the loss reads besides the logits; no block hands on two tensors.
    let c = load("tiny_stack_tuple.pt2", ModelOptions::default()).unwrap();
    let reads: Vec<&str> = c.head.reads().iter().map(|&k| c.blocks[k].name.as_str()).collect();
    assert_eq!(reads, ["layers.2"]);
    assert_eq!(candidates(&c), ["layers.0", "layers.1", "layers.2"]);
    assert_eq!(
        c.input,
        InputSpec::Features {
            features: 8,
            classes: 4
        }
    );
    let batch = c.make_batch(3, tch::Device::Cpu, 1);
    let mut outs = c.forward_all(&batch.input, None, true);
    let out = outs.pop().unwrap();
    assert_eq!(out.size(), [3, 4]);
    // The first output's cross-entropy plus the further output's sum, in that order.
    let hidden = &outs[c.head.reads()[0]];
    let want = out.cross_entropy_for_logits(&batch.target) + hidden.sum(tch::Kind::Float);
    let got = c.head.loss_over(&out, std::slice::from_ref(hidden), &batch);
    assert!(got.equal(&want), "loss {got} is not {want}");
}

#[test]
fn a_further_output_made_beside_the_first_joins_the_loss() {
    let _lock = ckptune_kernels::meter::exclusive();
    // The glue after the layers makes `(hidden, pooled)` both: it hands on `hidden`, the first
    // output, and `pooled` as its further output, which the loss reads: the first output's
    // cross-entropy plus `pooled`'s sum.
    let c = load("one_block_two_outputs.pt2", ModelOptions::default()).unwrap();
    let last = c.blocks.len() - 1;
    assert!(c.head.reads().is_empty());
    assert_eq!(c.head.extra_reads(), [(last, 1)]);
    let batch = c.make_batch(3, tch::Device::Cpu, 1);
    let mut handed = c.forward_handed(&batch.input, None, true).pop().unwrap();
    let pooled = handed.pop().unwrap();
    let out = handed.pop().unwrap();
    assert_eq!(out.size(), [3, 16]);
    let want = out.cross_entropy_for_logits(&batch.target) + pooled.sum(tch::Kind::Float);
    let got = c.head.loss_over(&out, &[pooled], &batch);
    assert!(got.equal(&want), "loss {got} is not {want}");
}

#[test]
fn blocks_hand_on_several_tensors_and_outputs_made_mid_network() {
    let _lock = ckptune_kernels::meter::exclusive();
    // Each layer returns `(hidden, gate)`, both made from the batch and both read by the next
    // layer: each hands on two tensors, its output and a further one, which the next reads
    // besides its input. The second program output (a tanh of both, after `layers.0`) is made
    // by the glue after it, handed to the loss.
    let c = load("two_tensors.pt2", ModelOptions::default()).unwrap();
    let names: Vec<&str> = c.blocks.iter().map(|b| b.name.as_str()).collect();
    let at = |name: &str| names.iter().position(|n| *n == name).unwrap();
    for (reader, read) in [("layers.1", "layers.0"), ("layers.2", "layers.1"), ("head", "layers.2")] {
        let extra: Vec<&str> = c.blocks[at(reader)]
            .extra_reads
            .iter()
            .map(|&(k, _)| names[k])
            .collect();
        assert!(
            extra.contains(&read),
            "{reader} reads {extra:?}, not {read}'s further output"
        );
    }
    let batch = c.make_batch(3, tch::Device::Cpu, 1);
    let handed = c.forward_handed(&batch.input, None, true);
    assert_eq!(handed[at("layers.1")].len(), 2, "layers.1 hands on (hidden, gate)");
    // At nested granularity a layer is a group over its children, and the hidden state its first
    // child makes is read after the group: refused, naming the group and what to do.
    let nested = ModelOptions {
        granularity: Granularity::Nested,
        ..Default::default()
    };
    let e = load("two_tensors.pt2", nested).unwrap_err().to_string();
    for needle in ["group layers.0", "--candidates REGEX", "--granularity layer"] {
        assert!(e.contains(needle), "{needle:?} not in {e}");
    }
    // An auxiliary classifier inside a layer (Inception v3's `AuxLogits`): the layer hands on its
    // hidden state and the logits, which only the loss reads.
    let c = load("mid_output.pt2", ModelOptions::default()).unwrap();
    let reads: Vec<(&str, usize)> = c
        .head
        .extra_reads()
        .iter()
        .map(|&(k, s)| (c.blocks[k].name.as_str(), s))
        .collect();
    assert_eq!(reads, [("layers.1", 1)]);
    let batch = c.make_batch(3, tch::Device::Cpu, 1);
    let handed = c.forward_handed(&batch.input, None, true);
    let aux = &handed[c.head.extra_reads()[0].0][1];
    let out = &handed[handed.len() - 1][0];
    let want = out.cross_entropy_for_logits(&batch.target) + aux.sum(tch::Kind::Float);
    let got = c.head.loss_over(out, std::slice::from_ref(aux), &batch);
    assert!(got.equal(&want), "loss {got} is not {want}");
}

#[test]
fn values_every_layer_reads_are_computed_where_they_are_read() {
    // Loading a program runs it once on a sample batch, saving and restoring the global RNG:
    // serialized with every other test that runs a model.
    let _lock = ckptune_kernels::meter::exclusive();
    // A mask made inside `bert` (from the batch's mask, or from the sizes alone), rotary cos/sin
    // and a causal mask made inside `model`: each layer reads them, no layer makes them, and
    // they used to make the glue before the first layer hand on several tensors. The tiny_*
    // files come from reference.py, the hf_* files from transformers itself.
    let bert = ["bert.encoder.layer.0", "bert.encoder.layer.1"];
    let llama = ["model.layers.0", "model.layers.1"];
    let gpt2 = ["transformer.h.0", "transformer.h.1"];
    for (file, layers, seq, vocab, targets) in [
        ("tiny_bert_hf.pt2", bert, 8, 100, TokenTargets::Classes(2)),
        ("tiny_llama.pt2", llama, 8, 100, TokenTargets::PerToken),
        ("hf_bert.pt2", bert, 16, 120, TokenTargets::Classes(3)),
        ("hf_bert_mask.pt2", bert, 16, 120, TokenTargets::Classes(3)),
        ("hf_llama.pt2", llama, 16, 128, TokenTargets::PerToken),
        // GPT-2 embeds a reshape of its ids (`input_ids.view(-1, seq)`), not the input itself.
        ("hf_gpt2.pt2", gpt2, 16, 120, TokenTargets::PerToken),
    ] {
        let c = load(file, ModelOptions::default()).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(candidates(&c), layers, "{file}");
        assert_eq!(c.input, InputSpec::Tokens { seq, vocab, targets }, "{file}");
        assert!(
            c.blocks.iter().all(|b| b.skips.is_empty()),
            "{file}: nothing crosses a cut but the chain"
        );
        // GPT-2's lm_head.weight is transformer.wte.weight: one parameter, as model.parameters()
        // yields it, under the first name.
        if file == "hf_gpt2.pt2" {
            let names: Vec<String> = c.vs.variables().into_keys().collect();
            assert!(names.iter().any(|n| n == "transformer.wte.weight"), "{names:?}");
            assert!(!names.iter().any(|n| n == "lm_head.weight"), "{names:?}");
        }
        if !file.contains("mask") && !file.starts_with("tiny_bert") {
            // Another batch than the exported one: the sizes the side values are made from
            // are this batch's.
            let batch = c.make_batch(3, tch::Device::Cpu, 1);
            let out = tch::no_grad(|| c.forward_all(&batch.input, None, true).pop().unwrap());
            assert_eq!(out.size()[0], 3, "{file}");
        }
    }
    // Llama's layers as their children: RMSNorm casts its input to float32, a no-op the
    // residual sum read through when the program was traced; it reads the layer input instead.
    for file in ["tiny_llama.pt2", "hf_llama.pt2"] {
        let c = load(
            file,
            ModelOptions {
                granularity: Granularity::Nested,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{file}: {e}"));
        let cands = candidates(&c);
        for m in ["model.layers.1", "model.layers.1.self_attn", "model.layers.1.mlp"] {
            assert!(cands.iter().any(|c| c == m), "{file}: {m} not in {cands:?}");
        }
        assert_eq!(c.groups.len(), 2, "{file}: each layer a group over its children");
    }
}
