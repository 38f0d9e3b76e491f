//! Files written so that a crash never leaves half of one, and safetensors read through a
//! memory map. Shared by checkpoints and the handle's weight import and export.

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

/// Writes tensors as safetensors to `path` (one tensor's bytes in memory at a time) and
/// syncs the file.
pub(crate) fn write_safetensors(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let map: HashMap<&str, Tensor> = tensors.iter().map(|(k, t)| (k.as_str(), t.clone())).collect();
    candle_core::safetensors::save(&map, path).map_err(|e| AmpError::checkpoint(path, Kind::Io, e.to_string()))?;
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| AmpError::io(path, e))
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

/// Memory-maps a safetensors file, with typed errors (`NotFound`, `Corrupt`).
pub(crate) fn map_safetensors(path: &Path) -> Result<MmapedSafetensors> {
    if let Err(e) = fs::metadata(path) {
        return Err(AmpError::io(path, e));
    }
    // SAFETY: the file is only read through the map. This crate never writes a file in
    // place (every file is written beside and renamed), so the mapped bytes do not change
    // under us unless another program rewrites the file in place.
    unsafe { MmapedSafetensors::new(path) }
        .map_err(|e| AmpError::checkpoint(path, Kind::Corrupt, format!("not a safetensors file: {e}")))
}
