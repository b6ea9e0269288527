//! Model files read in fake mode (a step measured on the meta device): every source gives the
//! chain it gives outside fake mode, as shapes, with no weight read. State dicts (safetensors
//! and torch.save), a state dict declaring gigabytes (only its header is read), `torch.export`
//! programs with weights and exported on the meta device (fixtures from
//! `fixtures/make_meta_fixtures.py`), and the operators fake mode cannot run, named.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use ckptune_kernels::fake::{self, FakeMode};
use ckptune_kernels::meter;
use ckptune_models::export::chain_from_export;
use ckptune_models::{load, needs_meta, Chain, ModelError, ModelOptions};
use common::fixture;
use tch::Kind;

/// Every variable's shape and dtype, by name.
type Layout = BTreeMap<String, (Vec<i64>, Kind)>;

fn layout(c: &Chain) -> Layout {
    c.vs.variables()
        .into_iter()
        .map(|(name, t)| (name, (t.size(), t.kind())))
        .collect()
}

/// Whether every variable of the chain is fake (a meta tensor, no values).
fn all_fake(c: &Chain) -> bool {
    c.vs.variables().values().all(fake::is_fake)
}

/// What a loaded chain is made of: its layout, blocks, candidates and parameter count.
fn anatomy(c: &Chain) -> (Layout, Vec<String>, Vec<String>, i64) {
    let blocks = c.blocks.iter().map(|b| b.name.clone()).collect();
    let candidates = c.candidates().into_iter().map(String::from).collect();
    (layout(c), blocks, candidates, c.param_count())
}

#[test]
fn state_dicts_in_fake_mode_give_the_chains_they_give_for_real() {
    let _lock = meter::exclusive();
    let heads = ModelOptions {
        heads: Some(2),
        seq: Some(8),
        ..Default::default()
    };
    let cases = [
        ("tiny_resnet.safetensors", ModelOptions::default()),
        ("tiny_resnet.pt", ModelOptions::default()),
        ("tiny_bert.safetensors", heads.clone()),
        ("tiny_bert.pt", heads.clone()),
        ("tiny_gpt2.safetensors", heads.clone()),
        ("tiny_llama.safetensors", heads.clone()),
        ("tiny_qwen2.safetensors", heads.clone()),
        ("tiny_qwen2_ordered.pt", heads.clone()),
        ("tiny_qwen2_ckpt.pt", heads.clone()),
    ];
    for (file, opts) in cases {
        let real = load::load(fixture(file), &opts).unwrap_or_else(|e| panic!("{file}: {e}"));
        let _fake = FakeMode::enter().unwrap();
        let shapes = load::load(fixture(file), &opts).unwrap_or_else(|e| panic!("{file} in fake mode: {e}"));
        assert!(all_fake(&shapes.chain), "{file}: a variable holds values");
        assert_eq!(anatomy(&shapes.chain), anatomy(&real.chain), "{file}");
        assert_eq!(shapes.architecture, real.architecture, "{file}");
        assert_eq!(
            (&shapes.prefix, &shapes.ignored, &shapes.defaulted, &shapes.restored),
            (&real.prefix, &real.ignored, &real.defaulted, &real.restored),
            "{file}: the loading report"
        );
    }
}

/// A safetensors header naming a Llama-shaped state dict of `layers` layers, hidden 4096, in
/// fp32, over a data section of the declared size that is a hole in a sparse file: reading any
/// weight would read gigabytes (of zeros).
fn sparse_llama(path: &Path, layers: usize) -> u64 {
    let (hidden, inter, vocab) = (4096u64, 11008u64, 32000u64);
    let mut tensors: Vec<(String, Vec<u64>)> = vec![("model.embed_tokens.weight".into(), vec![vocab, hidden])];
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            tensors.push((format!("{p}self_attn.{proj}.weight"), vec![hidden, hidden]));
        }
        tensors.push((format!("{p}mlp.gate_proj.weight"), vec![inter, hidden]));
        tensors.push((format!("{p}mlp.up_proj.weight"), vec![inter, hidden]));
        tensors.push((format!("{p}mlp.down_proj.weight"), vec![hidden, inter]));
        tensors.push((format!("{p}input_layernorm.weight"), vec![hidden]));
        tensors.push((format!("{p}post_attention_layernorm.weight"), vec![hidden]));
    }
    // No `lm_head.weight`: tied to the embedding, so no tie check compares the two.
    tensors.push(("model.norm.weight".into(), vec![hidden]));
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, shape) in &tensors {
        let len = shape.iter().product::<u64>() * 4;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    let header = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&header).unwrap();
    f.set_len(8 + header.len() as u64 + at).unwrap();
    at
}

/// The largest resident set this process had since [`reset_peak_rss`] (Linux's `VmHWM`).
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Sets `VmHWM` to the current resident set (Linux ≥ 4.0; false elsewhere).
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[test]
fn a_state_dict_of_gigabytes_is_read_from_its_header_alone() {
    let _lock = meter::exclusive();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama.safetensors");
    let declared = sparse_llama(&path, 8);
    assert!(declared > 4 << 30, "declares {declared} B");
    let opts = ModelOptions {
        heads: Some(32),
        seq: Some(8),
        ..Default::default()
    };
    let _fake = FakeMode::enter().unwrap();
    let measured = reset_peak_rss();
    let loaded = load::load(&path, &opts).unwrap_or_else(|e| panic!("{e}"));
    if measured {
        let grew = peak_rss().unwrap_or(0);
        assert!(grew < 512 << 20, "the process's peak resident set reached {grew} B");
    }
    assert!(all_fake(&loaded.chain));
    // Every declared byte is a fake parameter of the chain.
    assert_eq!(loaded.chain.param_count() as u64 * 4, declared);
}

#[test]
fn a_program_exported_on_the_meta_device_is_refused_outside_fake_mode() {
    for name in ["bert", "gpt2", "llama"] {
        let path = fixture(&format!("hf_{name}_meta.pt2"));
        assert!(needs_meta(&path), "{name}");
        assert!(!needs_meta(fixture(&format!("hf_{name}_eager.pt2"))), "{name}");
        let e = chain_from_export(&path, &ModelOptions::default()).unwrap_err();
        assert!(matches!(e, ModelError::ExportedOnMeta { .. }), "{name}: {e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("exported on the meta device") && msg.contains("--measure auto or estimate"),
            "{name}: {msg}"
        );
    }
    assert!(!needs_meta(fixture("tiny_llama.safetensors")));
}

/// In fake mode a program exported on the meta device gives the chain its eager export gives:
/// blocks, candidates, every variable's shape and dtype, one parameter for GPT-2's tied head.
#[test]
fn in_fake_mode_a_meta_export_is_its_eager_exports_chain() {
    let _lock = meter::exclusive();
    let _fake = FakeMode::enter().unwrap();
    for name in ["bert", "gpt2", "llama"] {
        let opts = ModelOptions::default();
        let eager = chain_from_export(&fixture(&format!("hf_{name}_eager.pt2")), &opts)
            .unwrap_or_else(|e| panic!("{name} eager: {e}"));
        let meta = chain_from_export(&fixture(&format!("hf_{name}_meta.pt2")), &opts)
            .unwrap_or_else(|e| panic!("{name} meta: {e}"));
        assert!(all_fake(&eager) && all_fake(&meta), "{name}");
        assert_eq!(anatomy(&meta), anatomy(&eager), "{name}");
    }
}

/// A value read (`.item()`) and an operator without a meta kernel (`mode`) run on the CPU, and
/// in fake mode are refused at load naming the node and pointing to `--measure run`.
#[test]
fn operators_fake_mode_cannot_run_are_named_with_their_node() {
    let _lock = meter::exclusive();
    for (file, target) in [
        ("meta_item.pt2", "torch.ops.aten.item"),
        ("meta_no_kernel.pt2", "torch.ops.aten.mode"),
    ] {
        chain_from_export(&fixture(file), &ModelOptions::default()).unwrap_or_else(|e| panic!("{file}: {e}"));
        let _fake = FakeMode::enter().unwrap();
        let e = chain_from_export(&fixture(file), &ModelOptions::default()).unwrap_err();
        let ModelError::NotMeasurableOnMeta { node, target: t, .. } = &e else {
            panic!("{file}: {e:?}");
        };
        assert!(t.starts_with(target), "{file}: target {t}");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("node {node}")) && msg.contains("--measure run"),
            "{file}: {msg}"
        );
        assert!(
            !msg.contains("Exception raised from"),
            "{file}: a C++ traceback in {msg}"
        );
        // The failed trial left grad mode as it found it.
        let w = tch::Tensor::ones([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        assert!((&w * 2).requires_grad(), "{file}: grad mode is off after a failed load");
    }
}

/// Sizes that depend on values (`nonzero` in a mixture of experts' routing, `masked_select`)
/// are refused on the CPU and on the meta device alike, naming the node that makes one.
#[test]
fn sizes_that_depend_on_values_are_refused_naming_their_node() {
    let _lock = meter::exclusive();
    for (file, node) in [("moe_nonzero.pt2", "nonzero"), ("masked_select.pt2", "masked_select")] {
        for fake in [false, true] {
            let _fake = fake.then(|| FakeMode::enter().unwrap());
            let e = chain_from_export(&fixture(file), &ModelOptions::default()).unwrap_err();
            let ModelError::ExportNode { node: n, .. } = &e else {
                panic!("{file}: {e:?}");
            };
            assert_eq!(n, node, "{file}");
            assert!(e.to_string().contains("depends on tensor values"), "{file}: {e}");
        }
    }
}
