//! Files written so that a crash never leaves half of one, and safetensors read through a
//! memory map. Shared by checkpoints and the handle's weight import and export.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::Path;

use candle_core::Tensor;
use candle_core::safetensors::MmapedSafetensors;

use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};

pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| AmpError::io(dir, e))
}

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| AmpError::io(path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| AmpError::io(path, e))
}

/// Size and CRC-32 of a file, read through a small buffer (never the whole file at once).
pub(crate) fn crc_of(path: &Path) -> Result<(u64, u32)> {
    let mut f = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            AmpError::checkpoint(path, Kind::MissingFile, "listed in the manifest but missing")
        }
        _ => AmpError::io(path, e),
    })?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(|e| AmpError::io(path, e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, h.finalize()))
}

/// A tensor to write: a candle tensor (its bytes made when it is written, one at a time) or
/// f32 values that may be borrowed (written without a copy).
pub(crate) enum Source<'a> {
    Tensor(Tensor),
    Values(Cow<'a, [f32]>, Vec<usize>),
}

impl safetensors::View for &Source<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self {
            Source::Tensor(t) => match t.dtype() {
                candle_core::DType::F16 => safetensors::Dtype::F16,
                candle_core::DType::BF16 => safetensors::Dtype::BF16,
                candle_core::DType::F64 => safetensors::Dtype::F64,
                candle_core::DType::U8 => safetensors::Dtype::U8,
                candle_core::DType::U32 => safetensors::Dtype::U32,
                candle_core::DType::I64 => safetensors::Dtype::I64,
                _ => safetensors::Dtype::F32,
            },
            Source::Values(..) => safetensors::Dtype::F32,
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            Source::Tensor(t) => t.dims(),
            Source::Values(_, s) => s,
        }
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            // candle's own conversion (one tensor's bytes at a time). The view cannot fail:
            // a tensor that cannot be read writes no bytes, and the file's length check fails.
            Source::Tensor(t) => Cow::Owned(tensor_bytes(t).unwrap_or_default()),
            Source::Values(v, _) => f32_bytes(v),
        }
    }

    fn data_len(&self) -> usize {
        match self {
            Source::Tensor(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Source::Values(v, _) => v.len() * 4,
        }
    }
}

/// f32 values as little-endian bytes: borrowed on little-endian machines.
fn f32_bytes(v: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: f32 has no padding and every byte is initialised; u8 has alignment 1.
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) })
    } else {
        Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// A tensor's values as little-endian bytes of its own type (row-major; read to the host
/// once). Types other than f16, bf16, f64, u8, u32 and i64 are read as f32.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(t.elem_count() * t.dtype().size_in_bytes());
    let t = t.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
    macro_rules! put {
        ($ty:ty) => {
            for x in t.to_vec1::<$ty>()? {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match t.dtype() {
        candle_core::DType::F16 => put!(half::f16),
        candle_core::DType::BF16 => put!(half::bf16),
        candle_core::DType::F64 => put!(f64),
        candle_core::DType::U8 => put!(u8),
        candle_core::DType::U32 => put!(u32),
        candle_core::DType::I64 => put!(i64),
        _ => put!(f32),
    }
    Ok(out)
}

/// Writes named tensors as safetensors to `path` (one tensor's bytes in memory at a time,
/// none for borrowed values) and syncs the file.
pub(crate) fn write_sources(items: &[(String, Source<'_>)], path: &Path) -> Result<()> {
    let mut items: Vec<(&str, &Source<'_>)> = items.iter().map(|(k, s)| (k.as_str(), s)).collect();
    items.sort_by(|a, b| a.0.cmp(b.0));
    let expected: usize = items.iter().map(|(_, s)| safetensors::View::data_len(s)).sum();
    safetensors::serialize_to_file(items, None, path)
        .map_err(|e| AmpError::checkpoint(path, Kind::Io, e.to_string()))?;
    let f = File::open(path).map_err(|e| AmpError::io(path, e))?;
    let len = f.metadata().map_err(|e| AmpError::io(path, e))?.len() as usize;
    if len < expected {
        return Err(AmpError::checkpoint(path, Kind::Io, "short write"));
    }
    f.sync_all().map_err(|e| AmpError::io(path, e))
}

/// Writes tensors as safetensors to `path` and syncs the file.
pub(crate) fn write_safetensors(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let items: Vec<(String, Source<'_>)> = tensors
        .iter()
        .map(|(k, t)| (k.clone(), Source::Tensor(t.clone())))
        .collect();
    write_sources(&items, path)
}

/// Writes safetensors beside `path` and renames them over it, so that a crash leaves either
/// the old file or the new one.
pub(crate) fn write_safetensors_atomic(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| AmpError::checkpoint(path, Kind::Io, "not a file path"))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    let sorted: BTreeMap<String, Tensor> = tensors.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
    let res = write_safetensors(&sorted, &tmp).and_then(|_| fs::rename(&tmp, path).map_err(|e| AmpError::io(path, e)));
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fsync_dir(dir)?;
    }
    Ok(())
}

/// Memory-maps safetensors files as one set of named tensors (a tensor is read from the file
/// that holds it), with typed errors (`NotFound`, `Corrupt`).
pub(crate) fn map_safetensors(paths: &[std::path::PathBuf]) -> Result<MmapedSafetensors> {
    for path in paths {
        if let Err(e) = fs::metadata(path) {
            return Err(AmpError::io(path, e));
        }
    }
    let first = paths.first().map(|p| p.as_path()).unwrap_or(Path::new(""));
    // SAFETY: the files are only read through the maps. This crate never writes a file in
    // place (every file is written beside and renamed), so the mapped bytes do not change
    // under us unless another program rewrites a file in place.
    unsafe { MmapedSafetensors::multi(paths) }
        .map_err(|e| AmpError::checkpoint(first, Kind::Corrupt, format!("not a safetensors file: {e}")))
}
