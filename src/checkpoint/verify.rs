//! A version's manifest: writing it, and verifying a version against it before loading.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::scan::version_name;
use super::{
    Checkpoint, CheckpointDir, FORMAT, MANIFEST, STATE, StateFile, Tensors, buffer_key, tensor_files, version_files,
};
use crate::amp::STATE_FORMAT_VERSION;
use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};
use crate::files::{crc_of, map_safetensors, write_synced};

/// One file of a version, as its manifest lists it.
#[derive(Debug, Serialize, Deserialize)]
struct FileEntry {
    name: String,
    bytes: u64,
    crc32: u32,
}

/// `manifest.json`: what a version must hold to verify.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Manifest {
    format: String,
    format_version: u32,
    step: u64,
    files: Vec<FileEntry>,
    /// The ranks that wrote a sharded version (one weights and one optimizer file each);
    /// absent for a version written by one process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) shards: Option<usize>,
}

/// Writes (and syncs) the manifest of the version being written in `dir`: the size and
/// CRC-32 of each of its files, read back from the disk (`shards`: the ranks that wrote a
/// sharded version).
pub(super) fn write_manifest(dir: &Path, step: u64, shards: Option<usize>) -> Result<()> {
    let files = version_files(shards)
        .iter()
        .map(|f| {
            let (bytes, crc32) = crc_of(&dir.join(f))?;
            Ok(FileEntry {
                name: f.to_string(),
                bytes,
                crc32,
            })
        })
        .collect::<Result<_>>()?;
    let manifest = Manifest {
        format: FORMAT.into(),
        format_version: STATE_FORMAT_VERSION,
        step,
        files,
        shards,
    };
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| AmpError::checkpoint(dir, Kind::Io, e.to_string()))?;
    write_synced(&dir.join(MANIFEST), &bytes)
}

impl CheckpointDir {
    /// Reads one version's manifest and checks its format (no file is read).
    pub(super) fn read_manifest(&self, v: u64) -> Result<Manifest> {
        let mpath = self.root.join(version_name(v)).join(MANIFEST);
        let mbytes = fs::read(&mpath).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => AmpError::checkpoint(&mpath, Kind::MissingFile, "the manifest is missing"),
            _ => AmpError::io(&mpath, e),
        })?;
        let manifest: Manifest = serde_json::from_slice(&mbytes).map_err(|e| {
            let kind = if e.is_eof() { Kind::Truncated } else { Kind::Corrupt };
            AmpError::checkpoint(&mpath, kind, format!("unreadable manifest: {e}"))
        })?;
        if manifest.format != FORMAT {
            return Err(AmpError::checkpoint(
                &mpath,
                Kind::Corrupt,
                format!("not a {FORMAT} manifest"),
            ));
        }
        if manifest.format_version < STATE_FORMAT_VERSION {
            return Err(AmpError::checkpoint(
                &mpath,
                Kind::OldFormat,
                format!(
                    "format version {} was written by an earlier candle-amp; this build reads version \
                     {STATE_FORMAT_VERSION} (every tensor in safetensors): load it with the version that wrote it \
                     and export the weights (Amp::export_half or weights.safetensors) to start from",
                    manifest.format_version
                ),
            ));
        }
        if manifest.format_version > STATE_FORMAT_VERSION {
            return Err(AmpError::checkpoint(
                &mpath,
                Kind::NewerFormat,
                format!(
                    "format version {} is newer than {STATE_FORMAT_VERSION}, the newest this build reads; upgrade candle-amp",
                    manifest.format_version
                ),
            ));
        }
        Ok(manifest)
    }

    /// Verifies one version's manifest and every file's size and checksum.
    pub(super) fn verify(&self, v: u64) -> Result<Manifest> {
        let dir = self.root.join(version_name(v));
        let mpath = dir.join(MANIFEST);
        let manifest = self.read_manifest(v)?;
        if manifest.shards == Some(0) {
            return Err(AmpError::checkpoint(
                &mpath,
                Kind::Corrupt,
                "a sharded version of 0 ranks",
            ));
        }
        for name in version_files(manifest.shards) {
            let entry = manifest.files.iter().find(|f| f.name == name).ok_or_else(|| {
                AmpError::checkpoint(&mpath, Kind::Corrupt, format!("the manifest does not list {name}"))
            })?;
            let p = dir.join(&name);
            let (bytes, crc) = crc_of(&p)?;
            if bytes < entry.bytes {
                return Err(AmpError::checkpoint(
                    &p,
                    Kind::Truncated,
                    format!("{bytes} bytes, the manifest says {}", entry.bytes),
                ));
            }
            if bytes != entry.bytes || crc != entry.crc32 {
                return Err(AmpError::checkpoint(
                    &p,
                    Kind::Corrupt,
                    "checksum mismatch: the file was damaged",
                ));
            }
        }
        Ok(manifest)
    }

    /// Loads and verifies one version: every checksum first, then the state; the tensors
    /// stay memory-mapped until they are restored.
    pub fn load_version(&self, v: u64) -> Result<Checkpoint> {
        let dir = self.root.join(version_name(v));
        if !dir.is_dir() {
            return Err(AmpError::checkpoint(&dir, Kind::NotFound, "no such version"));
        }
        let manifest = self.verify(v)?;
        let spath = dir.join(STATE);
        let bytes = fs::read(&spath).map_err(|e| AmpError::io(&spath, e))?;
        let state: StateFile = serde_json::from_slice(&bytes)
            .map_err(|e| AmpError::checkpoint(&spath, Kind::Corrupt, format!("unreadable state: {e}")))?;
        if state.step != manifest.step {
            return Err(AmpError::checkpoint(
                &dir,
                Kind::Corrupt,
                "the manifest and the state disagree on the step",
            ));
        }
        let (wfiles, bfiles) = tensor_files(manifest.shards);
        let paths = |files: &[String]| files.iter().map(|f| dir.join(f)).collect::<Vec<_>>();
        let weights = Arc::new(map_safetensors(&paths(&wfiles))?);
        let buffers = Arc::new(map_safetensors(&paths(&bfiles))?);
        // Every buffer the state lists must be there, with a floating type.
        for (i, r) in state.optimizers.iter().enumerate() {
            for (name, (_, bufs)) in &r.params {
                for b in bufs {
                    let k = buffer_key(i, name, b);
                    let ok = buffers
                        .get(&k)
                        .is_ok_and(|t| DType::try_from(t.dtype()).is_ok_and(|d| d.is_float()));
                    if !ok {
                        return Err(AmpError::checkpoint(
                            dir.join(&bfiles[0]),
                            Kind::Corrupt,
                            format!("optimizer buffer `{k}` is missing or not a floating tensor"),
                        ));
                    }
                }
            }
        }
        Ok(Checkpoint {
            step: state.step,
            extra: state.extra,
            amp: state.amp,
            optimizers: state.optimizers,
            tensors: Tensors::Mapped { weights, buffers },
            origin: dir.display().to_string(),
            recovered: None,
            skipped: Vec::new(),
        })
    }
}
