//! Reading a `torch.export.save` archive (`.pt2`, a zip): `<archive>/models/model.json` (the
//! program), `data/weights/` and `data/constants/` (one raw little-endian file per tensor plus a
//! JSON config naming it with dtype, sizes and strides).

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use serde_json::Value as Json;
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};

/// The serializer's schema major version this reader understands (`torch/_export/serde/schema.py`
/// `SCHEMA_VERSION`; a new major version changes the format incompatibly).
pub(crate) const SCHEMA_MAJOR: i64 = 8;

pub(crate) struct Archive {
    pub model: Json,
    /// Parameters, buffers and constants by their fully qualified name.
    pub tensors: HashMap<String, Tensor>,
    /// Per name, where its data lies in the archive (file, offset, sizes, strides): names with
    /// the same place are one tensor of the model, tied (GPT-2's `lm_head.weight` and
    /// `transformer.wte.weight`).
    pub storage: HashMap<String, String>,
}

fn bad(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::BadExport {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Whether `path` is meant as a `torch.export` archive: named `.pt2` (torch.export.save's
/// extension, so that a damaged one is reported as the program it was meant to be), or a zip
/// holding `models/model.json`.
pub fn is_export_archive(path: &Path) -> bool {
    if path.extension().is_some_and(|e| e == "pt2") && path.is_file() {
        return true;
    }
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let Ok(zip) = zip::ZipArchive::new(file) else {
        return false;
    };
    let found = zip.file_names().any(|n| n.ends_with("models/model.json"));
    found
}

fn kind_of(serde: i64) -> Option<Kind> {
    Some(match serde {
        1 => Kind::Uint8,
        2 => Kind::Int8,
        3 => Kind::Int16,
        4 => Kind::Int,
        5 => Kind::Int64,
        6 => Kind::Half,
        7 => Kind::Float,
        8 => Kind::Double,
        12 => Kind::Bool,
        13 => Kind::BFloat16,
        _ => return None,
    })
}

fn ints(j: Option<&Json>) -> Option<Vec<i64>> {
    j?.as_array()?
        .iter()
        .map(|d| d.get("as_int").and_then(Json::as_i64))
        .collect()
}

pub(crate) fn read(path: &Path) -> Result<Archive> {
    let file = std::fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| {
        bad(
            path,
            format!(
                "not a readable zip archive ({e}): the file is cut short or was not written by \
                 torch.export.save; save the program again with torch.export.save(ep, path)"
            ),
        )
    })?;
    let model_json = zip
        .file_names()
        .find(|n| n.ends_with("models/model.json"))
        .map(str::to_owned)
        .ok_or_else(|| {
            bad(
                path,
                "no models/model.json inside; save it with torch.export.save(ep, path)",
            )
        })?;
    let root = model_json.trim_end_matches("models/model.json").to_owned();
    let mut read_entry = |name: &str| -> Result<Vec<u8>> {
        let mut f = zip
            .by_name(name)
            .map_err(|e| bad(path, format!("missing entry {name} ({e})")))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)
            .map_err(|e| bad(path, format!("entry {name} is corrupt ({e})")))?;
        Ok(buf)
    };
    if let Ok(order) = read_entry(&format!("{root}byteorder")) {
        if order != b"little" {
            return Err(bad(
                path,
                format!(
                    "byte order {:?}; only little-endian archives are supported",
                    String::from_utf8_lossy(&order)
                ),
            ));
        }
    }
    let model: Json = serde_json::from_slice(&read_entry(&model_json)?)
        .map_err(|e| bad(path, format!("{model_json} is not valid JSON ({e})")))?;
    let major = model
        .get("schema_version")
        .and_then(|v| v.get("major"))
        .and_then(Json::as_i64)
        .ok_or_else(|| bad(path, format!("{model_json} has no schema_version")))?;
    if major != SCHEMA_MAJOR {
        return Err(bad(
            path,
            format!(
                "schema version {major} (torch {}); ckptune reads version {SCHEMA_MAJOR} (torch 2.13's \
                 torch.export.save): re-export it with that torch",
                model.get("torch_version").and_then(Json::as_str).unwrap_or("unknown")
            ),
        ));
    }
    let mut tensors = HashMap::new();
    let mut storage = HashMap::new();
    for (dir, config) in [
        ("weights", "model_weights_config.json"),
        ("constants", "model_constants_config.json"),
    ] {
        let Ok(raw) = read_entry(&format!("{root}data/{dir}/{config}")) else {
            continue;
        };
        let cfg: Json = serde_json::from_slice(&raw).map_err(|e| bad(path, format!("{config}: {e}")))?;
        for (fqn, entry) in cfg.get("config").and_then(Json::as_object).into_iter().flatten() {
            if entry.get("use_pickle").and_then(Json::as_bool) == Some(true) {
                return Err(bad(
                    path,
                    format!("{fqn} is stored pickled (a tensor subclass or custom object), which ckptune cannot read"),
                ));
            }
            let file = entry
                .get("path_name")
                .and_then(Json::as_str)
                .ok_or_else(|| bad(path, format!("{fqn}: no path_name")))?;
            let meta = entry
                .get("tensor_meta")
                .ok_or_else(|| bad(path, format!("{fqn}: no tensor_meta")))?;
            let dtype = meta.get("dtype").and_then(Json::as_i64).unwrap_or(0);
            let kind = kind_of(dtype).ok_or_else(|| bad(path, format!("{fqn}: dtype {dtype} is not supported")))?;
            let sizes =
                ints(meta.get("sizes")).ok_or_else(|| bad(path, format!("{fqn}: symbolic or missing sizes")))?;
            let strides = ints(meta.get("strides")).ok_or_else(|| bad(path, format!("{fqn}: missing strides")))?;
            let offset = meta
                .get("storage_offset")
                .and_then(|o| o.get("as_int"))
                .and_then(Json::as_i64)
                .unwrap_or(0);
            let bytes = read_entry(&format!("{root}data/{dir}/{file}"))?;
            let elem = kind.elt_size_in_bytes();
            if bytes.len() % elem != 0 {
                return Err(bad(
                    path,
                    format!("{fqn}: {} bytes is not a whole number of {kind:?}", bytes.len()),
                ));
            }
            // Each tensor gets its own storage, never a view of the file's buffer: the runtime
            // swaps a checkpointed block's buffers with `set_data`, and a view would keep its
            // base (the old storage) alive through autograd's view metadata, 2.9 KiB of stale
            // BatchNorm statistics in the tiny ResNet, seen as unexplained fixed bytes.
            let numel: i64 = sizes.iter().product();
            let t = if offset == 0 && numel as usize * elem == bytes.len() && strides == contiguous(&sizes) {
                Tensor::f_from_data_size(&bytes, &sizes, kind)
            } else {
                Tensor::f_from_data_size(&bytes, &[(bytes.len() / elem) as i64], kind)
                    .and_then(|s| s.f_as_strided(sizes.as_slice(), strides.as_slice(), Some(offset)))
                    .map(|v| v.copy())
            }
            .map_err(|e| {
                bad(
                    path,
                    format!("{fqn}: sizes {sizes:?} strides {strides:?} do not fit its data ({e})"),
                )
            })?;
            tensors.insert(fqn.clone(), t);
            storage.insert(fqn.clone(), format!("{dir}/{file}@{offset}:{sizes:?}:{strides:?}"));
        }
    }
    Ok(Archive {
        model,
        tensors,
        storage,
    })
}

fn contiguous(sizes: &[i64]) -> Vec<i64> {
    let mut s = vec![1; sizes.len()];
    for i in (0..sizes.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * sizes[i + 1].max(1);
    }
    s
}
