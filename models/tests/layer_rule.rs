//! The layer rule (`export::layers`) on the module names of the reference families, as
//! `nn_module_stack` lists them: which modules `--granularity layer` offers as candidates.

use std::collections::HashMap;

use ckptune_models::export::layers;

/// The rule over `mods`, each module running its node range.
fn ranged(mods: &[(&str, (usize, usize))]) -> Vec<String> {
    let modules: Vec<String> = mods.iter().map(|(m, _)| m.to_string()).collect();
    let runs: HashMap<String, Vec<(usize, usize)>> = mods.iter().map(|(m, r)| (m.to_string(), vec![*r])).collect();
    layers(&modules, &runs)
}

/// The rule over `mods`, each module one node of its own (where the nodes they run do not
/// decide).
fn rule(mods: &[&str]) -> Vec<String> {
    let one_node_each: Vec<(&str, (usize, usize))> = mods.iter().enumerate().map(|(i, m)| (*m, (i, i))).collect();
    ranged(&one_node_each)
}

#[test]
fn numbered_sibling_containers_are_the_layers() {
    // torchvision ResNet.
    assert_eq!(
        rule(&["conv1", "bn1", "layer1", "layer1.0", "layer1.1", "layer2", "layer2.0", "fc"]),
        ["layer1", "layer2"]
    );
}

#[test]
fn a_lone_containers_numbered_children_are_the_layers() {
    // BERT.
    assert_eq!(
        rule(&[
            "bert",
            "bert.embeddings",
            "bert.encoder",
            "bert.encoder.layer",
            "bert.encoder.layer.0",
            "bert.encoder.layer.0.attention",
            "bert.encoder.layer.1",
            "bert.pooler",
            "classifier",
        ]),
        ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    );
    // Llama (Hugging Face).
    assert_eq!(
        rule(&[
            "model",
            "model.embed_tokens",
            "model.layers",
            "model.layers.0",
            "model.layers.0.self_attn",
            "model.layers.1",
            "model.norm",
            "lm_head"
        ]),
        ["model.layers.0", "model.layers.1"]
    );
    // torchvision ViT: children named encoder_layer_N.
    assert_eq!(
        rule(&[
            "conv_proj",
            "encoder",
            "encoder.dropout",
            "encoder.layers",
            "encoder.layers.encoder_layer_0",
            "encoder.layers.encoder_layer_0.mlp",
            "encoder.layers.encoder_layer_0.mlp.0",
            "encoder.layers.encoder_layer_1",
            "encoder.ln",
            "heads",
            "heads.0",
        ]),
        ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"]
    );
    // No repeated layers: the top-level modules.
    assert_eq!(
        rule(&["features", "features.conv", "classifier"]),
        ["features", "classifier"]
    );
}

#[test]
fn the_body_is_the_layers_not_the_head() {
    // torchvision MobileNet / EfficientNet: `features` and `classifier` are both containers of
    // numbered children but no numbered siblings; the stages are `features.N`.
    assert_eq!(
        rule(&[
            "features",
            "features.0",
            "features.0.0",
            "features.1",
            "features.1.conv",
            "features.2",
            "classifier",
            "classifier.0",
            "classifier.1",
        ]),
        ["features.0", "features.1", "features.2"]
    );
    // torchvision MaxViT: its head `classifier` lists six numbered modules and the body `blocks`
    // four; the blocks, which run almost every node, are the layers.
    let mut maxvit = vec![
        ("stem", (0, 5)),
        ("stem.0", (0, 2)),
        ("stem.1", (3, 5)),
        ("blocks", (6, 805)),
        ("blocks.0", (6, 205)),
        ("blocks.0.layers", (6, 205)),
        ("blocks.0.layers.0", (6, 105)),
        ("blocks.0.layers.1", (106, 205)),
        ("blocks.1", (206, 405)),
        ("blocks.2", (406, 605)),
        ("blocks.3", (606, 805)),
        ("classifier", (806, 811)),
    ];
    let head: Vec<String> = (0..6).map(|k| format!("classifier.{k}")).collect();
    maxvit.extend(head.iter().enumerate().map(|(k, m)| (m.as_str(), (806 + k, 806 + k))));
    assert_eq!(ranged(&maxvit), ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]);
}

#[test]
fn every_stack_of_modules_of_modules_is_layers() {
    // results/export's CNN: MobileNet-style stages, then a DenseNet-style dense block running
    // fewer nodes. Both are stacks of layers (each entry a module of modules); the stem's
    // Sequential of single operators is not.
    let mut cnn = vec![
        ("stem", (0, 2)),
        ("stem.0", (0, 0)),
        ("stem.1", (1, 1)),
        ("stem.2", (2, 2)),
        ("features", (3, 38)),
        ("denseblock", (39, 58)),
        ("pool", (59, 59)),
        ("classifier", (60, 60)),
    ];
    let names: Vec<[String; 4]> = (0..4)
        .map(|k| {
            [
                "features.{k}",
                "features.{k}.conv",
                "denseblock.{k}",
                "denseblock.{k}.conv1",
            ]
            .map(|m| m.replace("{k}", &k.to_string()))
        })
        .collect();
    for (k, [f, fc, d, dc]) in names.iter().enumerate() {
        cnn.push((f.as_str(), (3 + 9 * k, 11 + 9 * k)));
        cnn.push((fc.as_str(), (3 + 9 * k, 3 + 9 * k)));
        cnn.push((d.as_str(), (39 + 5 * k, 43 + 5 * k)));
        cnn.push((dc.as_str(), (41 + 5 * k, 41 + 5 * k)));
    }
    // nn_module_stack lists modules in the order they are first called.
    cnn.sort_by_key(|(_, (first, _))| *first);
    assert_eq!(
        ranged(&cnn),
        [
            "features.0",
            "features.1",
            "features.2",
            "features.3",
            "denseblock.0",
            "denseblock.1",
            "denseblock.2",
            "denseblock.3"
        ]
    );
    // wav2vec2 (Hugging Face): the convolutional feature encoder's layers before the
    // transformer's, as its own gradient checkpointing takes both.
    assert_eq!(
        ranged(&[
            ("feature_extractor", (0, 9)),
            ("feature_extractor.conv_layers", (0, 9)),
            ("feature_extractor.conv_layers.0", (0, 4)),
            ("feature_extractor.conv_layers.0.conv", (0, 0)),
            ("feature_extractor.conv_layers.1", (5, 9)),
            ("feature_extractor.conv_layers.1.conv", (5, 5)),
            ("feature_projection", (10, 12)),
            ("encoder", (13, 73)),
            ("encoder.layers", (13, 72)),
            ("encoder.layers.0", (13, 42)),
            ("encoder.layers.0.attention", (13, 30)),
            ("encoder.layers.1", (43, 72)),
            ("encoder.layers.1.attention", (43, 60)),
            ("encoder.layer_norm", (73, 73)),
        ]),
        [
            "feature_extractor.conv_layers.0",
            "feature_extractor.conv_layers.1",
            "encoder.layers.0",
            "encoder.layers.1"
        ]
    );
}

#[test]
fn a_container_beside_numbered_operators_is_not_inside_them() {
    // Whisper (Hugging Face): the encoder's two convolutions are numbered, but its layers are
    // not inside either, so they are the layers.
    assert_eq!(
        ranged(&[
            ("encoder", (0, 65)),
            ("encoder.conv1", (0, 0)),
            ("encoder.conv2", (2, 2)),
            ("encoder.embed_positions", (4, 4)),
            ("encoder.layers", (5, 64)),
            ("encoder.layers.0", (5, 34)),
            ("encoder.layers.0.self_attn", (5, 20)),
            ("encoder.layers.0.fc1", (25, 25)),
            ("encoder.layers.1", (35, 64)),
            ("encoder.layers.1.self_attn", (35, 50)),
            ("encoder.layers.1.fc1", (55, 55)),
            ("encoder.layer_norm", (65, 65)),
            ("projector", (66, 66)),
            ("classifier", (67, 67)),
        ]),
        ["encoder.layers.0", "encoder.layers.1"]
    );
}
