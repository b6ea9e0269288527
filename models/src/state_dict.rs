//! Reading state-dict files: `.safetensors`, and `.pt`/`.pth`/`.bin` files written by
//! `torch.save` of a state dict (`OrderedDict` or `dict`), alone or nested in a checkpoint dict
//! (`{"model": …, "optimizer": …}`), read with the `pytorch-reader` crate — libtorch's
//! unpickler cannot read an `OrderedDict`; and writing one as safetensors. In fake mode (a
//! step measured on the meta device) only shapes are read ([`crate::shapes`]): the same files
//! are accepted and refused, and no tensor's data is read.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::chain::Chain;
use crate::error::{first_line, ModelError, Result};
use crate::shapes;
use crate::weights::{StateDict, Weight};

/// All tensors of a state-dict file: on the CPU, or as shapes when fake mode is on
/// ([`ckptune_kernels::fake::active`]); safetensors in file order, torch.save files sorted by
/// name. `state_dict_key` picks the entry of a torch.save dict that holds the state dict
/// (`None`: the top level, or the first of `state_dict`, `model_state_dict`, `model`, `module`,
/// `net` that holds one).
pub fn read_state_dict(path: &Path, state_dict_key: Option<&str>) -> Result<StateDict> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let mut head = Vec::with_capacity(16);
    File::open(path)
        .and_then(|f| f.take(16).read_to_end(&mut head))
        .map_err(io)?;
    if head.is_empty() {
        return Err(bad("the file is empty".into()));
    }
    if head.starts_with(b"PK\x03\x04") {
        return read_torch_zip(path, state_dict_key);
    }
    if head.len() > 8 && head[8] == b'{' {
        if let Some(key) = state_dict_key {
            return Err(ModelError::InvalidOption {
                model: path.display().to_string(),
                option: "state_dict_key",
                value: key.to_string(),
                why: "a safetensors file is a flat state dict; the key picks an entry of a torch.save dict".into(),
            });
        }
        if ckptune_kernels::fake::active() {
            return shapes::safetensors(path);
        }
        return Tensor::read_safetensors(path)
            .map(|tensors| tensors.into_iter().map(|(k, t)| (k, Weight::Values(t))).collect())
            .map_err(|e| bad(format!("invalid safetensors file: {}", first_line(&e.to_string()))));
    }
    if head[0] == 0x80 {
        return read_torch_pickle(path, state_dict_key, "a legacy (pre-1.6, non-zip) torch.save file: ");
    }
    Err(bad(format!(
        "neither a safetensors file nor a torch.save zip archive (it starts with bytes {:02x?})",
        &head[..head.len().min(8)]
    )))
}

/// The keys a training checkpoint commonly nests its weights under, tried in this order when
/// the file's top-level dict is not itself a state dict.
const NESTING_KEYS: [&str; 5] = ["state_dict", "model_state_dict", "model", "module", "net"];

fn read_torch_zip(path: &Path, state_dict_key: Option<&str>) -> Result<StateDict> {
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let file = File::open(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(format!("corrupt zip archive: {e}")))?;
    let names: Vec<String> = zip.file_names().map(String::from).collect();
    // torch.jit.save writes `<archive>/constants.pkl` and `<archive>/code/…`; torch.save never does.
    if names
        .iter()
        .any(|n| n.ends_with("/constants.pkl") || n.contains("/code/"))
    {
        return Err(ModelError::TorchScript(path.to_path_buf()));
    }
    let Some(pickle) = names
        .iter()
        .find(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .cloned()
    else {
        return Err(bad("a zip archive without data.pkl: not written by torch.save".into()));
    };
    let mut data = Vec::new();
    zip.by_name(&pickle)
        .map_err(std::io::Error::from)
        .and_then(|mut f| f.read_to_end(&mut data))
        .map_err(|e| bad(format!("cannot read {pickle}: {e}")))?;
    // `torch.save(model)` pickles the module object itself, whose class lives in the user's
    // code; pytorch-reader would read its parameters, but the file is not what ckptune asks
    // for and the class's forward is unknown, so say what to save instead.
    if let Some(class) = top_level_class(&data).filter(|c| c != "collections.OrderedDict") {
        return Err(ModelError::PickledObject {
            path: path.to_path_buf(),
            class,
        });
    }
    read_torch_pickle(path, state_dict_key, "")
}

/// The state dict of a torch.save file (zip or legacy container) through pytorch-reader, from
/// the top-level dict or the entry `state_dict_key` (found automatically when `None`).
/// `what` prefixes read errors with what the file was taken to be.
fn read_torch_pickle(path: &Path, state_dict_key: Option<&str>, what: &str) -> Result<StateDict> {
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let reader_err = |e: pytorch_reader::PytorchError| {
        // Observed with pytorch-reader 0.23.0-pre.1 (zip 9): torch.save archives whose root
        // folder (the stem of the name they were saved under) has 21 or more characters fail
        // so, although zip 0.6 and Python's zipfile read them.
        let hint = if matches!(&e, pytorch_reader::PytorchError::Zip(_)) {
            "; pytorch-reader fails so on torch.save archives saved under a name longer than 20 \
             characters before .pt: re-save it under a shorter name, or as safetensors"
        } else {
            ""
        };
        bad(format!("{what}pytorch-reader cannot read it: {e}{hint}"))
    };
    let key = match state_dict_key {
        Some(key) => Some(key.to_string()),
        None => find_state_dict_key(path).map_err(|e| match e {
            ModelError::BadFile { path, reason } => ModelError::BadFile {
                path,
                reason: format!("{what}{reason}"),
            },
            other => other,
        })?,
    };
    let reader = match &key {
        Some(key) => pytorch_reader::PytorchReader::with_top_level_key(path, key),
        None => pytorch_reader::PytorchReader::new(path),
    }
    .map_err(reader_err)?;
    let mut tensors: Vec<(String, pytorch_reader::Tensor)> = reader.into_tensors().into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    if tensors.is_empty() {
        return Err(bad(match &key {
            Some(key) => format!("its entry {key:?} holds no tensors"),
            None => "it holds no tensors".into(),
        }));
    }
    let fake = ckptune_kernels::fake::active();
    tensors
        .into_iter()
        .map(|(name, t)| {
            let kind = kind_of(path, &name, &t)?;
            let w = if fake {
                shapes::torch(kind, t)
            } else {
                Weight::Values(to_tch(path, &name, kind, &t)?)
            };
            Ok((name, w))
        })
        .collect()
}

/// Where the state dict sits in a torch.save dict: `None` when the top-level dict maps names
/// to tensors, else the first of [`NESTING_KEYS`] that holds such a dict.
fn find_state_dict_key(path: &Path) -> Result<Option<String>> {
    use pytorch_reader::PickleValue;
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let root = match pytorch_reader::PytorchReader::read_pickle_data(path, None) {
        Ok(root) => root,
        // Reported with its hint by the caller's read.
        Err(pytorch_reader::PytorchError::Zip(_)) => return Ok(None),
        Err(e) => return Err(bad(format!("pytorch-reader cannot read it: {e}"))),
    };
    let is_tensor = |v: &PickleValue| matches!(v, PickleValue::Unsupported(t) if t == "torch.Tensor");
    // `model.state_dict()` is an OrderedDict carrying a `_metadata` attribute (module
    // versions), which pytorch-reader shows as one more entry.
    let is_state_dict = |v: &PickleValue| match v {
        PickleValue::Dict(d) => {
            d.keys().any(|k| k != "_metadata") && d.iter().all(|(k, v)| k == "_metadata" || is_tensor(v))
        }
        _ => false,
    };
    let PickleValue::Dict(top) = &root else {
        return Err(bad("its top-level object is not a dict of tensors".into()));
    };
    if is_state_dict(&root) {
        return Ok(None);
    }
    if let Some(key) = NESTING_KEYS.iter().find(|k| top.get(**k).is_some_and(is_state_dict)) {
        return Ok(Some(key.to_string()));
    }
    let mut keys: Vec<&str> = top.keys().map(String::as_str).filter(|k| *k != "_metadata").collect();
    keys.sort_unstable();
    Err(bad(format!(
        "it holds a dict whose values are not all tensors and none of the usual entries ({}) is a \
         state dict; its top-level keys are [{}]: choose one with --state-dict-key",
        NESTING_KEYS.join(", "),
        keys.join(", ")
    )))
}

/// The libtorch dtype of a pytorch-reader tensor.
fn kind_of(path: &Path, name: &str, t: &pytorch_reader::Tensor) -> Result<Kind> {
    use pytorch_reader::DType;
    Ok(match t.dtype() {
        DType::F64 => Kind::Double,
        DType::F32 => Kind::Float,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::I16 => Kind::Int16,
        DType::I8 => Kind::Int8,
        DType::U8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
        other => {
            return Err(ModelError::BadFile {
                path: path.to_path_buf(),
                reason: format!("tensor {name} has dtype {other:?}, which libtorch's CPU tensors do not hold"),
            })
        }
    })
}

/// A pytorch-reader tensor as a CPU tch tensor (the bytes are read here).
fn to_tch(path: &Path, name: &str, kind: Kind, t: &pytorch_reader::Tensor) -> Result<Tensor> {
    let bytes = t.read().map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(&bytes, &shape, kind)
        .map_err(|e| ModelError::torch(format!("building tensor {name} of {}", path.display()), e))
}

/// The class of a pickle's top-level object when it is an instance built from a global
/// (`collections.OrderedDict` for `torch.save(model.state_dict())`, the model's own class for
/// `torch.save(model)`), `None` for a plain dict or anything else. Protocol 2, torch.save's
/// default, opens with PROTO then the GLOBAL opcode `c` and `module\nname\n`; protocols 4 and
/// 5 add a FRAME and name the class with two SHORT_BINUNICODE strings (each maybe memoized)
/// and STACK_GLOBAL. (Every torch.save pickle names classes further on — tensors' rebuild
/// functions, their backward-hooks OrderedDict — so only the first object counts.)
fn top_level_class(data: &[u8]) -> Option<String> {
    let mut rest = data;
    if let [0x80, _, tail @ ..] = rest {
        rest = tail; // PROTO n
    }
    if let [0x95, tail @ ..] = rest {
        rest = tail.get(8..).unwrap_or_default(); // FRAME with an 8-byte length
    }
    if let [b'c', tail @ ..] = rest {
        let mut lines = tail.splitn(3, |&b| b == b'\n');
        let (module, name) = (lines.next()?, lines.next()?);
        lines.next()?;
        return Some(format!(
            "{}.{}",
            String::from_utf8_lossy(module),
            String::from_utf8_lossy(name)
        ));
    }
    let short_unicode = |rest: &[u8]| -> Option<(String, usize)> {
        let [0x8c, len, tail @ ..] = rest else { return None };
        let s = tail.get(..*len as usize)?;
        let used = 2 + s.len();
        Some((
            String::from_utf8_lossy(s).into_owned(),
            used + usize::from(rest.get(used) == Some(&0x94)),
        ))
    };
    let (module, n) = short_unicode(rest)?;
    let (name, m) = short_unicode(&rest[n..])?;
    (rest.get(n + m) == Some(&0x93)).then(|| format!("{module}.{name}"))
}

/// Writes `chain`'s variables as a safetensors state dict, keys prefixed by `prefix`
/// (`""` for none). Used to round-trip models; the format is what `safetensors.torch`
/// writes and reads.
pub fn write_safetensors(chain: &Chain, prefix: &str, path: &Path) -> Result<()> {
    let mut named: Vec<(String, Tensor)> = chain
        .vs
        .variables()
        .into_iter()
        .map(|(k, v)| {
            let t = v
                .f_detach()
                .and_then(|t| t.f_to_device(Device::Cpu))
                .and_then(|t| t.f_contiguous());
            t.map(|t| (format!("{prefix}{k}"), t))
                .map_err(|e| ModelError::torch(format!("reading variable {k}"), e))
        })
        .collect::<Result<_>>()?;
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&named, path)
        .map_err(|e| ModelError::torch(format!("writing {}", PathBuf::from(path).display()), e))
}

#[cfg(test)]
mod tests {
    use super::top_level_class;

    #[test]
    fn the_top_level_class_is_read_only_at_the_top() {
        let ordered = Some("collections.OrderedDict".to_string());
        // `torch.save(OrderedDict(...))`, protocol 2.
        assert_eq!(
            top_level_class(b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01"),
            ordered
        );
        // Protocol 4: FRAME, then memoized SHORT_BINUNICODE names and STACK_GLOBAL.
        let mut p4 = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00".to_vec();
        p4.extend_from_slice(b"\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93");
        assert_eq!(top_level_class(&p4), ordered);
        // `torch.save(model)`: the model's class, then NEWOBJ.
        assert_eq!(
            top_level_class(b"\x80\x02c__main__\nNet\nq\x00)\x81q\x01}"),
            Some("__main__.Net".to_string())
        );
        // A plain dict whose tensors carry OrderedDict backward hooks further on.
        assert_eq!(
            top_level_class(
                b"\x80\x02}q\x00(X\x01\x00\x00\x00actorch._utils\n_rebuild_tensor_v2\nccollections\nOrderedDict\n"
            ),
            None
        );
        assert_eq!(top_level_class(b""), None);
    }
}
