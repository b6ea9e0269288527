//! Files that are not loadable state dicts give errors that say what the file is and what to
//! do — never a panic.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ckptune_models::{from_file, load, ModelError, ModelOptions};
use common::{fixture, run_python, tensors};
use tch::Tensor;

fn error(path: &Path, opts: &ModelOptions) -> ModelError {
    match from_file(path, opts) {
        Ok(chain) => panic!("{} loaded as {chain:?}", path.display()),
        Err(e) => e,
    }
}

fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("writing a test file");
    path
}

#[test]
fn a_pickled_module_says_to_save_its_state_dict() {
    let path = fixture("pickled_module.pt");
    let e = error(&path, &ModelOptions::default());
    assert!(
        matches!(&e, ModelError::PickledObject { path: p, class } if *p == path
            && class == "torch.nn.modules.linear.Linear"),
        "{e:?}"
    );
    assert!(e.to_string().contains("torch.save(model.state_dict(), path)"), "{e}");
}

#[test]
fn an_ordered_dict_of_unknown_layout_reaches_inference() {
    // torch.save(nn.Linear(3, 2).state_dict()): read (it used to be refused), then no family
    // matches its keys.
    let e = error(&fixture("ordered_dict.pt"), &ModelOptions::default());
    assert!(matches!(e, ModelError::UnknownArchitecture { .. }), "{e:?}");
    assert!(e.to_string().contains("bias, weight"), "{e}");
}

#[test]
fn corrupt_and_foreign_files_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let st = std::fs::read(fixture("tiny_resnet.safetensors")).unwrap();
    let pt = std::fs::read(fixture("tiny_resnet.pt")).unwrap();
    let cases: [(&str, Vec<u8>, &str); 5] = [
        ("empty.pt", vec![], "the file is empty"),
        (
            "text.pt",
            b"this is not a model at all".to_vec(),
            "neither a safetensors file nor a torch.save zip archive",
        ),
        (
            "half.safetensors",
            st[..st.len() / 2].to_vec(),
            "invalid safetensors file",
        ),
        ("half.pt", pt[..pt.len() / 2].to_vec(), "corrupt zip archive"),
        // Pickle protocol 2 with torch's legacy magic number: pre-1.6 torch.save.
        (
            "legacy.pt",
            vec![0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20],
            "a legacy (pre-1.6, non-zip) torch.save file: pytorch-reader cannot read it",
        ),
    ];
    for (name, bytes, says) in cases {
        let path = write(&dir, name, &bytes);
        let e = error(&path, &ModelOptions::default());
        assert!(matches!(e, ModelError::BadFile { .. }), "{name}: {e:?}");
        let msg = e.to_string();
        assert!(msg.contains(says) && msg.contains(name), "{name}: {msg}");
    }
    let e = error(&dir.path().join("absent.safetensors"), &ModelOptions::default());
    assert!(matches!(e, ModelError::Io { .. }), "{e:?}");
    assert!(
        e.to_string().starts_with("cannot read ") && e.to_string().contains("absent.safetensors"),
        "{e}"
    );
}

#[test]
fn torchscript_archives_and_checkpoints_without_a_state_dict_are_recognised() {
    let dir = tempfile::tempdir().unwrap();
    let (ts, nested) = (dir.path().join("scripted.pt"), dir.path().join("checkpoint.pt"));
    run_python(&format!(
        "import torch\n\
         m = torch.nn.Linear(3, 2)\n\
         torch.jit.save(torch.jit.script(m), {ts:?})\n\
         torch.save({{'weights': {{'a': m.state_dict()}}, 'step': 3}}, {nested:?})\n"
    ));
    let e = error(&ts, &ModelOptions::default());
    assert!(matches!(&e, ModelError::TorchScript(p) if *p == ts), "{e:?}");
    let e = error(&nested, &ModelOptions::default());
    assert!(matches!(e, ModelError::BadFile { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("its top-level keys are [step, weights]: choose one with --state-dict-key"),
        "{e}"
    );
    // A key that is not there names the ones that are.
    let opts = ModelOptions {
        state_dict_key: Some("model".into()),
        ..Default::default()
    };
    let e = error(&nested, &opts);
    assert!(e.to_string().contains("'model' not found"), "{e}");
    // The key means nothing to a safetensors file.
    let e = error(&fixture("tiny_resnet.safetensors"), &opts);
    assert!(
        matches!(
            e,
            ModelError::InvalidOption {
                option: "state_dict_key",
                ..
            }
        ),
        "{e:?}"
    );
}

/// Writes `tensors` (a state dict) as safetensors.
fn save(dir: &tempfile::TempDir, name: &str, tensors: &BTreeMap<String, Tensor>) -> PathBuf {
    let path = dir.path().join(name);
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    Tensor::write_safetensors(&named, &path).unwrap();
    path
}

#[test]
fn missing_unexpected_and_misshaped_keys_are_listed() {
    let dir = tempfile::tempdir().unwrap();
    let mut sd: BTreeMap<String, Tensor> = tensors("tiny_resnet.safetensors").into_iter().collect();
    sd.remove("fc.bias");
    sd.insert(
        "extra.weight".into(),
        Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu)),
    );
    sd.insert(
        "layer1.0.conv1.weight".into(),
        Tensor::zeros([2, 2, 1, 1], (tch::Kind::Float, tch::Device::Cpu)),
    );
    let path = save(&dir, "edited.safetensors", &sd);
    let e = error(&path, &ModelOptions::default());
    let ModelError::KeyMismatch {
        missing,
        unexpected,
        mismatched,
        arch,
        ..
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(missing, &["fc.bias"]);
    assert_eq!(unexpected, &["extra.weight"]);
    assert_eq!(
        mismatched,
        &["layer1.0.conv1.weight: file [2, 2, 1, 1] vs model [2, 2, 3, 3]"]
    );
    assert!(arch.contains("layers [1, 1, 1, 1], inplanes 2"), "{arch}");
    assert!(e.to_string().contains("missing keys (1): fc.bias;"), "{e}");
}

#[test]
fn old_torchvision_files_without_num_batches_tracked_load() {
    let dir = tempfile::tempdir().unwrap();
    let mut sd: BTreeMap<String, Tensor> = tensors("tiny_resnet.safetensors").into_iter().collect();
    sd.retain(|k, _| !k.ends_with("num_batches_tracked"));
    let path = save(&dir, "old.safetensors", &sd);
    let loaded = load::load(&path, &ModelOptions::default()).unwrap();
    assert_eq!(loaded.defaulted.len(), 12, "{:?}", loaded.defaulted);
    assert!(loaded.defaulted.iter().all(|k| k.ends_with(".num_batches_tracked")));
}

#[test]
fn untied_lm_head_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut sd: BTreeMap<String, Tensor> = tensors("tiny_gpt2.safetensors").into_iter().collect();
    let head = sd["lm_head.weight"].zeros_like();
    sd.insert("lm_head.weight".into(), head);
    let path = save(&dir, "untied.safetensors", &sd);
    let e = error(
        &path,
        &ModelOptions {
            heads: Some(2),
            ..Default::default()
        },
    );
    let ModelError::KeyMismatch { mismatched, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(mismatched.len(), 1);
    assert!(
        mismatched[0].starts_with("lm_head.weight: not equal to transformer.wte.weight"),
        "{}",
        mismatched[0]
    );
}

#[test]
fn unknown_layouts_and_contradicting_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut sd = BTreeMap::new();
    sd.insert(
        "encoder.weight".to_string(),
        Tensor::zeros([2, 2], (tch::Kind::Float, tch::Device::Cpu)),
    );
    let path = save(&dir, "mystery.safetensors", &sd);
    let e = error(&path, &ModelOptions::default());
    assert!(matches!(e, ModelError::UnknownArchitecture { .. }), "{e:?}");
    assert!(e.to_string().contains("encoder.weight"), "{e}");

    let e = error(
        &fixture("tiny_resnet.safetensors"),
        &ModelOptions {
            classes: Some(5),
            ..Default::default()
        },
    );
    assert_eq!(
        e.to_string(),
        format!(
            "option classes = 5 does not apply to {}: the state dict's fc.weight has 10 classes",
            fixture("tiny_resnet.safetensors").display()
        )
    );

    // A 32-wide BERT does not follow the hidden/64 head convention: the error says what to set.
    let e = error(&fixture("tiny_bert.safetensors"), &ModelOptions::default());
    assert!(matches!(e, ModelError::UnknownArchitecture { .. }), "{e:?}");
    assert!(e.to_string().contains("hidden size 32 is not a multiple of 64"), "{e}");
    assert!(e.to_string().contains("ModelOptions::heads"), "{e}");
}
