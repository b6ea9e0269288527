//! A weight file's shapes without its values, for fake mode: a safetensors file's header (an
//! 8-byte little-endian length, then JSON naming each tensor's dtype, shape and byte range),
//! and the dtype and shape pytorch-reader parses from a torch.save pickle before reading any
//! storage. Nothing here reads a tensor's data.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use tch::Kind;

use crate::error::{ModelError, Result};
use crate::weights::{Bytes, StateDict, Weight};

/// A safetensors header larger than this is refused unread (the format's own limit).
const MAX_HEADER: u64 = 100 << 20;

/// The tensors a safetensors file's header declares, in file order, as shapes.
pub(crate) fn safetensors(path: &Path) -> Result<StateDict> {
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason: format!("invalid safetensors file: {reason}"),
    };
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(bad(format!("its header claims {n} bytes, but the file has {file_len}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(io)?;
    let json: Value = serde_json::from_slice(&header).map_err(|e| bad(format!("its header is not JSON ({e})")))?;
    let entries = json
        .as_object()
        .ok_or_else(|| bad("its header is not a JSON object".into()))?;
    let data_start = 8 + n;
    let file = Arc::new(path.to_path_buf());
    let mut out: Vec<(u64, String, Weight)> = Vec::with_capacity(entries.len());
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        let dtype = entry.get("dtype").and_then(Value::as_str).unwrap_or("");
        let kind = kind_of(dtype).ok_or_else(|| bad(format!("tensor {name} has unsupported dtype {dtype:?}")))?;
        let size: Vec<i64> = entry
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|s| s.iter().map(Value::as_i64).collect::<Option<_>>())
            .filter(|s: &Vec<i64>| s.iter().all(|&d| d >= 0))
            .ok_or_else(|| bad(format!("tensor {name} has no valid shape")))?;
        let (begin, end) = match entry.get("data_offsets").and_then(Value::as_array).map(Vec::as_slice) {
            Some([b, e]) => match (b.as_u64(), e.as_u64()) {
                (Some(b), Some(e)) if b <= e => (b, e),
                _ => return Err(bad(format!("tensor {name} has invalid data_offsets"))),
            },
            _ => return Err(bad(format!("tensor {name} has no data_offsets"))),
        };
        let bytes = size.iter().product::<i64>() as u64 * kind.elt_size_in_bytes() as u64;
        if end - begin != bytes {
            return Err(bad(format!(
                "tensor {name} of shape {size:?} and dtype {dtype} spans {} bytes, not {bytes}",
                end - begin
            )));
        }
        if data_start + end > file_len {
            return Err(bad(format!(
                "tensor {name} ends at byte {} of a file of {file_len}: the file is cut short",
                data_start + end
            )));
        }
        let bytes = Bytes::Range {
            file: file.clone(),
            offset: data_start + begin,
            len: bytes,
        };
        out.push((begin, name.clone(), Weight::Shape { kind, size, bytes }));
    }
    // As the safetensors crate checks a file it reads: the tensors tile the data section.
    out.sort_by_key(|(begin, _, _)| *begin);
    let mut at = 0;
    for (begin, name, w) in &out {
        if *begin != at {
            return Err(bad(format!("tensor {name} starts at data byte {begin}, not {at}")));
        }
        if let Weight::Shape {
            bytes: Bytes::Range { len, .. },
            ..
        } = w
        {
            at += len;
        }
    }
    if data_start + at != file_len {
        return Err(bad(format!(
            "its tensors end at byte {} of a file of {file_len}",
            data_start + at
        )));
    }
    Ok(out.into_iter().map(|(_, name, w)| (name, w)).collect())
}

/// The libtorch dtype of a safetensors dtype name (those tch reads).
fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "BOOL" => Kind::Bool,
        "U8" => Kind::Uint8,
        "I8" => Kind::Int8,
        "I16" => Kind::Int16,
        "I32" => Kind::Int,
        "I64" => Kind::Int64,
        "BF16" => Kind::BFloat16,
        "F16" => Kind::Half,
        "F32" => Kind::Float,
        "F64" => Kind::Double,
        _ => return None,
    })
}

/// A torch.save tensor as a shape: its dtype and sizes from the pickle, its storage unread.
pub(crate) fn torch(kind: Kind, t: pytorch_reader::Tensor) -> Weight {
    Weight::Shape {
        kind,
        size: t.shape().iter().map(|&d| d as i64).collect(),
        bytes: Bytes::Torch(t),
    }
}
