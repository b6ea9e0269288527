//! Reading a `torch.export.save` archive (`.pt2`, a zip): `<archive>/models/model.json` (the
//! program), `data/weights/` and `data/constants/` (one raw little-endian file per tensor plus a
//! JSON config naming it with dtype, sizes and strides). In fake mode (a step measured on the
//! meta device) only the configs are read: every tensor is made fake, with its layout, and a
//! program exported on the meta device, whose data files are empty, loads too.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use serde_json::Value as Json;
use tch::{Kind, Tensor};

use crate::error::{first_line, ModelError, Result};

/// The serializer's schema major version this reader understands (`torch/_export/serde/schema.py`
/// `SCHEMA_VERSION`; a new major version changes the format incompatibly).
pub(crate) const SCHEMA_MAJOR: i64 = 8;

pub(crate) struct Archive {
    pub model: Json,
    /// Parameters, buffers and constants by their fully qualified name.
    pub tensors: HashMap<String, Tensor>,
    /// Per name, where its data lies in the archive (file, offset, sizes, strides): names with
    /// the same place are one tensor of the model, tied (GPT-2's `lm_head.weight` and
    /// `transformer.wte.weight`). A name recorded on the meta device has a place of its own.
    pub storage: HashMap<String, String>,
    /// The program was exported on the meta device: its tensors are fake, and its places do not
    /// say which tensors are tied (see `signature::tied_on_meta`).
    pub on_meta: bool,
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

/// A tensor the archive's weights or constants config names.
struct Entry {
    fqn: String,
    /// `weights` or `constants`.
    dir: &'static str,
    /// Its data file in that folder.
    file: String,
    kind: Kind,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    offset: i64,
    /// Recorded on the meta device: the file holds no bytes for it.
    on_meta: bool,
}

/// The archive opened, with the folder every entry sits in (`<name>/`).
struct Zip {
    zip: zip::ZipArchive<std::fs::File>,
    root: String,
}

impl Zip {
    fn open(path: &Path) -> Result<Zip> {
        let file = std::fs::File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let zip = zip::ZipArchive::new(file).map_err(|e| {
            bad(
                path,
                format!(
                    "not a readable zip archive ({e}): the file is cut short or was not written by \
                     torch.export.save; save the program again with torch.export.save(ep, path)"
                ),
            )
        })?;
        let root = zip
            .file_names()
            .find(|n| n.ends_with("models/model.json"))
            .map(|n| n.trim_end_matches("models/model.json").to_owned())
            .ok_or_else(|| {
                bad(
                    path,
                    "no models/model.json inside; save it with torch.export.save(ep, path)",
                )
            })?;
        Ok(Zip { zip, root })
    }

    /// The bytes of entry `name` (below the root).
    fn read(&mut self, path: &Path, name: &str) -> Result<Vec<u8>> {
        let full = format!("{}{name}", self.root);
        let mut f = self
            .zip
            .by_name(&full)
            .map_err(|e| bad(path, format!("missing entry {full} ({e})")))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)
            .map_err(|e| bad(path, format!("entry {full} is corrupt ({e})")))?;
        Ok(buf)
    }

    /// The length of entry `name` (below the root), from the zip's directory.
    fn len(&mut self, path: &Path, name: &str) -> Result<u64> {
        let full = format!("{}{name}", self.root);
        self.zip
            .by_name(&full)
            .map(|f| f.size())
            .map_err(|e| bad(path, format!("missing entry {full} ({e})")))
    }

    /// The tensors the weights and constants configs name, in the configs' order.
    fn entries(&mut self, path: &Path) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        for (dir, config) in [
            ("weights", "model_weights_config.json"),
            ("constants", "model_constants_config.json"),
        ] {
            let Ok(raw) = self.read(path, &format!("data/{dir}/{config}")) else {
                continue;
            };
            let cfg: Json = serde_json::from_slice(&raw).map_err(|e| bad(path, format!("{config}: {e}")))?;
            for (fqn, entry) in cfg.get("config").and_then(Json::as_object).into_iter().flatten() {
                out.push(entry_of(path, dir, fqn, entry)?);
            }
        }
        Ok(out)
    }
}

/// One entry of a weights or constants config.
fn entry_of(path: &Path, dir: &'static str, fqn: &str, entry: &Json) -> Result<Entry> {
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
    let sizes = ints(meta.get("sizes")).ok_or_else(|| bad(path, format!("{fqn}: symbolic or missing sizes")))?;
    let strides = ints(meta.get("strides")).ok_or_else(|| bad(path, format!("{fqn}: missing strides")))?;
    let offset = meta
        .get("storage_offset")
        .and_then(|o| o.get("as_int"))
        .and_then(Json::as_i64)
        .unwrap_or(0);
    let on_meta = meta.get("device").and_then(|d| d.get("type")).and_then(Json::as_str) == Some("meta");
    Ok(Entry {
        fqn: fqn.to_owned(),
        dir,
        file: file.to_owned(),
        kind,
        sizes,
        strides,
        offset,
        on_meta,
    })
}

/// Whether the program at `path` was traced with fp32 parameters and asserts its tensors' dtypes
/// (`_assert_tensor_metadata`, which torch.export writes where the traced code cast with
/// `.to(dtype)`: RMSNorm's upcast, rotary cos/sin): its graph then runs only with the dtypes it
/// was traced with, not with bf16 parameters, as PyTorch's `ep.module().to(torch.bfloat16)`
/// cannot either. `false` for anything that is not such a readable archive.
pub fn pins_fp32(path: &Path) -> bool {
    let Ok(mut z) = Zip::open(path) else {
        return false;
    };
    let asserts = z
        .read(path, "models/model.json")
        .is_ok_and(|raw| raw.windows(23).any(|w| w == b"_assert_tensor_metadata"));
    asserts && z.entries(path).is_ok_and(|e| e.iter().any(|e| e.kind == Kind::Float))
}

/// Whether the program at `path` was exported on the meta device (`with torch.device("meta")`):
/// its weights are recorded as shapes with no bytes, so it can only be measured in fake mode
/// (a step on the meta device). `false` for anything that is not such a readable archive.
pub fn exported_on_meta(path: &Path) -> bool {
    Zip::open(path)
        .and_then(|mut z| z.entries(path))
        .is_ok_and(|entries| entries.iter().any(|e| e.on_meta))
}

pub(crate) fn read(path: &Path) -> Result<Archive> {
    let mut z = Zip::open(path)?;
    if let Ok(order) = z.read(path, "byteorder") {
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
    let model: Json = serde_json::from_slice(&z.read(path, "models/model.json")?)
        .map_err(|e| bad(path, format!("models/model.json is not valid JSON ({e})")))?;
    let major = model
        .get("schema_version")
        .and_then(|v| v.get("major"))
        .and_then(Json::as_i64)
        .ok_or_else(|| bad(path, "models/model.json has no schema_version"))?;
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
    let entries = z.entries(path)?;
    let on_meta = entries.iter().any(|e| e.on_meta);
    let fake = ckptune_kernels::fake::active();
    if on_meta && !fake {
        return Err(ModelError::ExportedOnMeta {
            path: path.to_path_buf(),
        });
    }
    let mut tensors = HashMap::new();
    let mut storage = HashMap::new();
    for e in entries {
        let t = if fake {
            fake_tensor(path, &mut z, &e)?
        } else {
            tensor(path, &mut z, &e)?
        };
        // Meta tensors all share one empty data file: their places say nothing of ties.
        let place = if e.on_meta {
            format!("meta:{}", e.fqn)
        } else {
            format!("{}/{}@{}:{:?}:{:?}", e.dir, e.file, e.offset, e.sizes, e.strides)
        };
        storage.insert(e.fqn.clone(), place);
        tensors.insert(e.fqn, t);
    }
    Ok(Archive {
        model,
        tensors,
        storage,
        on_meta,
    })
}

/// Entry `e`'s tensor with its values.
fn tensor(path: &Path, z: &mut Zip, e: &Entry) -> Result<Tensor> {
    let Entry {
        fqn,
        kind,
        sizes,
        strides,
        offset,
        ..
    } = e;
    let bytes = z.read(path, &format!("data/{}/{}", e.dir, e.file))?;
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
    if *offset == 0 && numel as usize * elem == bytes.len() && *strides == contiguous(sizes) {
        Tensor::f_from_data_size(&bytes, sizes, *kind)
    } else {
        Tensor::f_from_data_size(&bytes, &[(bytes.len() / elem) as i64], *kind)
            .and_then(|s| s.f_as_strided(sizes.as_slice(), strides.as_slice(), Some(*offset)))
            .map(|v| v.copy())
    }
    .map_err(|e| {
        bad(
            path,
            format!(
                "{fqn}: sizes {sizes:?} strides {strides:?} do not fit its data ({})",
                first_line(&e.to_string())
            ),
        )
    })
}

/// Entry `e`'s tensor in fake mode: the layout [`tensor`] gives it, made by the same calls on a
/// fake storage; no data is read (a meta export has none).
fn fake_tensor(path: &Path, z: &mut Zip, e: &Entry) -> Result<Tensor> {
    let (fqn, kind, sizes, strides, offset) = (&e.fqn, &e.kind, &e.sizes, &e.strides, &e.offset);
    let elem = kind.elt_size_in_bytes() as i64;
    // The elements the view reaches, which a real file's data must hold.
    let reach = if sizes.contains(&0) {
        0
    } else {
        offset + sizes.iter().zip(strides).map(|(n, s)| (n - 1) * s).sum::<i64>() + 1
    };
    let stored = if e.on_meta {
        reach
    } else {
        let len = z.len(path, &format!("data/{}/{}", e.dir, e.file))? as i64;
        if len % elem != 0 || len / elem < reach {
            return Err(bad(
                path,
                format!("{fqn}: sizes {sizes:?} strides {strides:?} do not fit its {len} bytes of {kind:?}"),
            ));
        }
        len / elem
    };
    let opts = (*kind, tch::Device::Cpu);
    let numel: i64 = sizes.iter().product();
    if *offset == 0 && numel == stored && *strides == contiguous(sizes) {
        Tensor::f_empty(sizes.as_slice(), opts)
    } else {
        Tensor::f_empty([stored], opts)
            .and_then(|s| s.f_as_strided(sizes.as_slice(), strides.as_slice(), Some(*offset)))
            .map(|v| v.copy())
    }
    .map_err(|err| ModelError::torch(format!("making a fake {fqn} of {}", path.display()), err))
}

fn contiguous(sizes: &[i64]) -> Vec<i64> {
    let mut s = vec![1; sizes.len()];
    for i in (0..sizes.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * sizes[i + 1].max(1);
    }
    s
}
