//! A weight file's tensors as the state-dict loaders see them: values, or — in fake mode, a
//! step measured on the meta device — each tensor's dtype and shape with where its bytes lie,
//! never read into a tensor. A fake chain's parameters need no values (nothing computes), so a
//! 16 GB checkpoint is planned from its header.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};

/// One tensor of a weight file.
#[derive(Debug)]
pub enum Weight {
    /// Its values, on the CPU (real mode).
    Values(Tensor),
    /// Its dtype and shape only (fake mode).
    Shape { kind: Kind, size: Vec<i64>, bytes: Bytes },
}

/// Where a tensor's bytes lie in its file, so that whether two tensors hold the same values
/// (a tied embedding) is decided without making tensors of them.
#[derive(Debug, Clone)]
pub enum Bytes {
    /// `len` bytes at `offset` of `file` (a safetensors file's data section).
    Range { file: Arc<PathBuf>, offset: u64, len: u64 },
    /// A torch.save tensor, which pytorch-reader reads on demand (it does not say which
    /// storage a tensor views, so equal values are the only sign of a tie).
    Torch(pytorch_reader::Tensor),
}

/// A state dict: named tensors, in the order the file's reader gives them.
pub type StateDict = Vec<(String, Weight)>;

impl Weight {
    pub fn size(&self) -> Vec<i64> {
        match self {
            Weight::Values(t) => t.size(),
            Weight::Shape { size, .. } => size.clone(),
        }
    }

    /// The same tensor under another name (a tied embedding restored from `lm_head.weight`).
    pub fn share(&self) -> Weight {
        match self {
            Weight::Values(t) => Weight::Values(t.shallow_clone()),
            Weight::Shape { kind, size, bytes } => Weight::Shape {
                kind: *kind,
                size: size.clone(),
                bytes: bytes.clone(),
            },
        }
    }
}

/// Whether two tensors of a weight file hold equal values (a tie). Values are compared with
/// `torch.equal`; shapes by their bytes in the file, streamed without a tensor (a torch.save
/// tensor is read through pytorch-reader: it gives no storage to compare). Bitwise equality
/// differs from `torch.equal` only on `-0.0` against `0.0` and on NaNs, which no trained
/// embedding holds at the same places as its head.
pub(crate) fn same_values(path: &Path, a: &Weight, b: &Weight) -> Result<bool> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    match (a, b) {
        (Weight::Values(a), Weight::Values(b)) => Ok(a.size() == b.size() && a.equal(b)),
        (
            Weight::Shape {
                kind: ka,
                size: sa,
                bytes: ba,
            },
            Weight::Shape {
                kind: kb,
                size: sb,
                bytes: bb,
            },
        ) => {
            if ka != kb || sa != sb {
                return Ok(false);
            }
            match (ba, bb) {
                (
                    Bytes::Range {
                        file: fa,
                        offset: oa,
                        len: la,
                    },
                    Bytes::Range {
                        file: fb,
                        offset: ob,
                        len: lb,
                    },
                ) => {
                    if fa == fb && oa == ob && la == lb {
                        return Ok(true);
                    }
                    equal_ranges((fa, *oa), (fb, *ob), *la.min(lb)).map_err(io)
                }
                (Bytes::Torch(ta), Bytes::Torch(tb)) => Ok(ta.read().map_err(io)? == tb.read().map_err(io)?),
                _ => Ok(false),
            }
        }
        _ => Ok(false),
    }
}

/// Whether `len` bytes at two places of files are equal, read a chunk at a time.
fn equal_ranges(a: (&Path, u64), b: (&Path, u64), len: u64) -> std::io::Result<bool> {
    const CHUNK: usize = 1 << 20;
    let open = |(path, offset): (&Path, u64)| -> std::io::Result<std::fs::File> {
        let mut f = std::fs::File::open(path)?;
        f.seek(SeekFrom::Start(offset))?;
        Ok(f)
    };
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
    let mut left = len;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        fa.read_exact(&mut ba[..n])?;
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
        left -= n as u64;
    }
    Ok(true)
}
