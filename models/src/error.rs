//! The one error type of the models crate: every message names the operation and the
//! offending value, so the CLI can print it as is.

use std::path::PathBuf;

/// Why a model could not be built or loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown model {name:?}; known models: {}", known.join(", "))]
    UnknownModel { name: String, known: Vec<String> },

    #[error("invalid {model} configuration: {what}")]
    InvalidConfig { model: String, what: String },

    #[error("option {option} = {value} does not apply to {model}: {why}")]
    InvalidOption {
        model: String,
        option: &'static str,
        value: String,
        why: String,
    },

    /// A libtorch call failed (allocation, device, dtype). `message` is the first line of
    /// libtorch's error, without its C++ backtrace.
    #[error("{op} failed: {message}")]
    Torch { op: String, message: String },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A TorchScript archive: not a state dict. The caller routes it to the TorchScript
    /// loader (kernels' JIT shim).
    #[error("{} is a TorchScript archive (it has code/ and constants.pkl), not a state dict", .0.display())]
    TorchScript(PathBuf),

    /// `torch.save(model)`: a pickled object of the user's class, not a state dict.
    #[error(
        "{} holds a pickled {class} object (torch.save(model)), not a state dict; save the weights \
         with torch.save(model.state_dict(), path) and give that file",
        path.display()
    )]
    PickledObject { path: PathBuf, class: String },

    /// A Hugging Face config.json whose `model_type` ckptune does not build.
    #[error(
        "{}: model_type {model_type:?} is not supported; supported model types: {}. For another \
         architecture, export the model with torch.export (a .pt2 file) and give that file",
        path.display(),
        supported.join(", ")
    )]
    UnsupportedModelType {
        path: PathBuf,
        model_type: String,
        supported: &'static [&'static str],
    },

    /// A folder given as the model, without the `config.json` of a Hugging Face model folder.
    #[error(
        "{} is a folder without config.json: a model folder is a Hugging Face one (config.json, with \
         model.safetensors, its shards, pytorch_model.bin or no weights); give the folder that holds \
         config.json, a state dict file or a torch.export .pt2 program",
        path.display()
    )]
    NotAModelFolder { path: PathBuf },

    #[error("TorchScript model {} cannot be run as a chain of blocks: {reason}", path.display())]
    NotAChain { path: PathBuf, reason: String },

    /// A `torch.export` archive that cannot be read or cut into blocks.
    #[error("cannot run torch.export program {}: {reason}", path.display())]
    BadExport { path: PathBuf, reason: String },

    /// A node of a `torch.export` program that cannot run.
    #[error("torch.export program {}: node {node} ({target}): {why}", path.display())]
    ExportNode {
        path: PathBuf,
        node: String,
        target: String,
        why: String,
    },

    /// A program exported on the meta device, asked for its weights: it has none.
    #[error(
        "torch.export program {} was exported on the meta device: it holds no weights, only their \
         shapes, so no step of it can run for real (train, verify, --measure run or meta); ckptune \
         plans it from the meta device with times estimated by the cost model (--measure auto or \
         estimate), and running it needs a program exported with its weights",
        path.display()
    )]
    ExportedOnMeta { path: PathBuf },

    /// A node of a program that a step measured on the meta device cannot run: an operator
    /// whose result depends on tensor values, or one without a meta kernel.
    #[error(
        "torch.export program {}: node {node} ({target}) cannot be measured on the meta device: \
         {why}; measure the model by running it instead (--measure run){}",
        path.display(),
        if *meta_only { ", from a program exported with its weights (not on the meta device)" } else { "" }
    )]
    NotMeasurableOnMeta {
        path: PathBuf,
        node: String,
        target: String,
        why: String,
        /// The program has no weights, so running it needs another export.
        meta_only: bool,
    },

    /// A TorchScript module keeps its weights in CPU storages its scripted code refers to, so
    /// it cannot be rebuilt from shapes on the meta device.
    #[error(
        "TorchScript model {} cannot be measured on the meta device: its scripted code holds CPU \
         storages; measure it by running it (--measure run), or export it with torch.export",
        path.display()
    )]
    TorchScriptOnMeta { path: PathBuf },

    /// A program exported with a static batch size, run at another one.
    #[error(
        "torch.export program {} was exported with a static batch of {exported}, so it runs only at \
         --batch {exported}{}; to choose the batch, re-export it with a dynamic batch dimension: \
         torch.export.export(model.train(), (batch,), dynamic_shapes=({{0: torch.export.Dim(\"batch\")}},))",
        path.display(),
        requested.map(|b| format!(" (asked for --batch {b})")).unwrap_or_else(|| " (pass it explicitly)".into())
    )]
    StaticBatch {
        path: PathBuf,
        exported: i64,
        requested: Option<i64>,
    },

    #[error("cannot read {} as a state dict: {reason}", path.display())]
    BadFile { path: PathBuf, reason: String },

    #[error("cannot infer the architecture of {}: {reason}", path.display())]
    UnknownArchitecture { path: PathBuf, reason: String },

    #[error(
        "state dict {} does not match the inferred {arch}:{}{}{}",
        path.display(),
        list_line("missing keys", missing),
        list_line("unexpected keys", unexpected),
        list_line("shape mismatches", mismatched)
    )]
    KeyMismatch {
        path: PathBuf,
        arch: String,
        missing: Vec<String>,
        unexpected: Vec<String>,
        /// `key: file [..] vs model [..]`
        mismatched: Vec<String>,
    },
}

/// `" missing keys (3): a, b, c;"`, or nothing for an empty list. Long lists are cut after
/// 20 names: the count says how many there are.
fn list_line(what: &str, names: &[String]) -> String {
    const SHOWN: usize = 20;
    if names.is_empty() {
        return String::new();
    }
    let mut shown = names
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        shown.push_str(&format!(", … ({} more)", names.len() - SHOWN));
    }
    format!(" {what} ({}): {shown};", names.len())
}

impl ModelError {
    /// Wraps a libtorch error, keeping only the first line of its message: libtorch appends a
    /// C++ backtrace ("Exception raised from …") that says nothing to a user.
    pub(crate) fn torch(op: impl Into<String>, err: tch::TchError) -> Self {
        ModelError::Torch {
            op: op.into(),
            message: first_line(&err.to_string()),
        }
    }
}

/// The first line of a libtorch error message, without tch's "Internal torch error: " prefix.
pub(crate) fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or("").trim();
    line.strip_prefix("Internal torch error: ").unwrap_or(line).to_string()
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_line_drops_backtrace_and_prefix() {
        let msg = "Internal torch error: Unrecognized data format\nException raised from x\nframe #0";
        assert_eq!(first_line(msg), "Unrecognized data format");
    }

    #[test]
    fn key_mismatch_lists_each_kind() {
        let e = ModelError::KeyMismatch {
            path: "m.pt".into(),
            arch: "resnet18".into(),
            missing: vec!["fc.bias".into()],
            unexpected: vec![],
            mismatched: vec!["fc.weight: file [10, 512] vs model [1000, 512]".into()],
        };
        assert_eq!(
            e.to_string(),
            "state dict m.pt does not match the inferred resnet18: missing keys (1): fc.bias; \
             shape mismatches (1): fc.weight: file [10, 512] vs model [1000, 512];"
        );
    }
}
