//! State dicts written from built models come back as the same architecture with the same
//! weights, under the prefixes wrapper models and DataParallel put in front of the keys.

use ckptune_models::load;
use ckptune_models::state_dict::write_safetensors;
use ckptune_models::Architecture;
use ckptune_models::{bert, builtin, gpt2, resnet, Granularity, ModelOptions};

#[test]
fn architecture_and_weights_round_trip_through_files() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let heads2 = ModelOptions {
        heads: Some(2),
        ..Default::default()
    };
    let cases = [
        (
            "tiny-resnet",
            "",
            Architecture::ResNet(resnet::Config::tiny()),
            ModelOptions::default(),
        ),
        (
            "tiny-resnet",
            "module.",
            Architecture::ResNet(resnet::Config::tiny()),
            ModelOptions::default(),
        ),
        (
            "tiny-bert",
            "",
            Architecture::Bert(bert::Config::tiny()),
            heads2.clone(),
        ),
        (
            "tiny-bert",
            "bert.",
            Architecture::Bert(bert::Config::tiny()),
            heads2.clone(),
        ),
        (
            "tiny-gpt2",
            "transformer.",
            Architecture::Gpt2(gpt2::Config::tiny()),
            heads2.clone(),
        ),
    ];
    for (name, prefix, arch, opts) in cases {
        let original = builtin(name, &ModelOptions::default()).unwrap();
        let path = dir
            .path()
            .join(format!("{name}-{}.safetensors", prefix.trim_end_matches('.')));
        write_safetensors(&original, prefix, &path).unwrap();
        let loaded = load::load(&path, &opts).unwrap_or_else(|e| panic!("{name} {prefix:?}: {e}"));
        assert_eq!(loaded.architecture, arch, "{name} {prefix:?}");
        assert_eq!(
            loaded.prefix.as_deref(),
            (!prefix.is_empty()).then_some(prefix),
            "{name}"
        );
        assert!(
            loaded.ignored.is_empty() && loaded.defaulted.is_empty(),
            "{name}: {loaded:?}"
        );
        let ours = loaded.chain.vs.variables();
        for (key, t) in original.vs.variables() {
            assert!(
                t.equal(&ours[&key]),
                "{name} {prefix:?}: {key} differs after the round trip"
            );
        }
        assert_eq!(loaded.chain.modules, original.modules);
        assert_eq!(loaded.chain.candidates(), original.candidates());
    }
}

#[test]
fn granularity_applies_to_loaded_resnets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.safetensors");
    write_safetensors(&builtin("tiny-resnet", &ModelOptions::default()).unwrap(), "", &path).unwrap();
    let chain = load::from_file(
        &path,
        &ModelOptions {
            granularity: Granularity::Block,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(chain.candidates(), ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]);
}

#[test]
fn wrapped_classification_checkpoints_keep_their_head() {
    // DataParallel(BertForSequenceClassification): `module.bert.*` and `module.classifier.*`.
    let dir = tempfile::tempdir().unwrap();
    let original = builtin(
        "tiny-bert",
        &ModelOptions {
            classes: Some(3),
            ..Default::default()
        },
    )
    .unwrap();
    let named: Vec<(String, tch::Tensor)> = original
        .vs
        .variables()
        .into_iter()
        .map(|(k, t)| {
            let key = if k.starts_with("classifier.") {
                format!("module.{k}")
            } else {
                format!("module.bert.{k}")
            };
            (key, t.detach())
        })
        .collect();
    let path = dir.path().join("wrapped.safetensors");
    tch::Tensor::write_safetensors(&named, &path).unwrap();
    let loaded = load::load(
        &path,
        &ModelOptions {
            heads: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(loaded.prefix.as_deref(), Some("module.bert."));
    let Architecture::Bert(cfg) = &loaded.architecture else {
        panic!("not BERT")
    };
    assert_eq!(cfg.num_labels, 3);
    assert!(loaded.defaulted.is_empty(), "{:?}", loaded.defaulted);
    let ours = loaded.chain.vs.variables();
    for (key, t) in original.vs.variables() {
        assert!(t.equal(&ours[&key]), "{key} differs");
    }
}
