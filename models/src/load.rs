//! Models from files: a Hugging Face folder (or its `config.json`) goes to [`crate::hf`],
//! anything else is read as a state dict ([`crate::state_dict`]), its architecture inferred
//! from key names and shapes ([`crate::infer`]), and the chain built with every weight copied
//! in ([`crate::assemble`]). In fake mode ([`ckptune_kernels::fake::active`]) every file is
//! read as shapes and the chain's tensors are fake: no weight is read.
//!
//! Files are recognised by content, not extension. TorchScript archives are recognised and
//! returned as [`ModelError::TorchScript`] so that the caller routes them to the TorchScript
//! loader. A pickled module (`torch.save(model)`) gets an error saying to save
//! `model.state_dict()`.

use std::collections::BTreeMap;
use std::path::Path;

use crate::architecture::Architecture;
use crate::assemble::{assemble, restore_tied_embedding, Loaded};
use crate::chain::Chain;
use crate::error::Result;
use crate::infer::infer;
use crate::options::ModelOptions;
use crate::state_dict::read_state_dict;
use crate::weights::same_values;

/// Builds the model a state-dict file holds, weights included. The chain is named after the
/// path. See [`load`] for what was stripped, ignored or left at its initial value.
pub fn from_file(path: impl AsRef<Path>, opts: &ModelOptions) -> Result<Chain> {
    load(path, opts).map(|loaded| loaded.chain)
}

/// Whether the model file at `path` can be measured only on the meta device (fake mode): a
/// `torch.export` program exported on the meta device, which holds shapes and no weights. Every
/// other file loads in both modes; in fake mode only shapes are read from any of them.
pub fn needs_meta(path: impl AsRef<Path>) -> bool {
    let path = path.as_ref();
    crate::export::is_export_archive(path) && crate::export::exported_on_meta(path)
}

/// [`from_file`] with the loading report.
pub fn load(path: impl AsRef<Path>, opts: &ModelOptions) -> Result<Loaded> {
    let path = path.as_ref();
    if path.is_dir() || path.file_name().is_some_and(|n| n == "config.json") {
        return crate::hf::load(path, opts);
    }
    let mut tensors = read_state_dict(path, opts.state_dict_key.as_deref())?;
    let restored = restore_tied_embedding(&mut tensors);
    let shapes: BTreeMap<String, Vec<i64>> = tensors.iter().map(|(k, t)| (k.clone(), t.size())).collect();
    let mut inferred = infer(path, &shapes, opts.heads)?;
    if let Architecture::Llama(c) = &mut inferred.architecture {
        // A tied model's `state_dict()` lists `lm_head.weight` beside the embedding it is;
        // equal values mean tied (an untied head never equals the embedding bit for bit).
        let get = |name: &str| tensors.iter().find(|(k, _)| k == name).map(|(_, t)| t);
        let prefix = inferred.prefix.as_deref().unwrap_or_default();
        if let (Some(head), Some(embed)) = (
            get(&format!("{prefix}lm_head.weight")),
            get(&format!("{prefix}model.embed_tokens.weight")),
        ) {
            if !c.tie_word_embeddings && head.size() == embed.size() && same_values(path, head, embed)? {
                c.tie_word_embeddings = true;
            }
        }
    }

    assemble(path, tensors, &shapes, inferred, restored, opts)
}
