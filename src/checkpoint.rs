//! Checkpoints that lose nothing and survive crashes.
//!
//! A [`Checkpoint`] holds the f32 weights (the masters at O2), every optimizer's state, every
//! loss scaler's state and skip counters, the resolved properties, the step number, every
//! generator a run depends on, and the user's own data. A [`CheckpointDir`] writes it as a
//! versioned subdirectory:
//!
//! ```text
//! DIR/LATEST                    "v00000012": the committed version
//! DIR/v00000012/weights.safetensors   f32 weights, the model's own names
//! DIR/v00000012/state.json            everything else
//! DIR/v00000012/manifest.json         format version, step, size and CRC-32 of each file
//! ```
//!
//! Saving writes a new version into `vN.tmp`, syncs its files and the directory, renames it
//! to `vN`, then replaces `LATEST` atomically (write `LATEST.tmp`, fsync, rename, fsync the
//! directory; `rename` cannot replace a non-empty directory, hence the pointer). A crash at
//! any moment leaves the previous `LATEST` and the version it names intact. Loading follows
//! `LATEST`, verifies every checksum before parsing anything, and ignores leftovers of
//! interrupted saves; they are removed under the directory's lock file (`DIR/.lock`), which
//! a save holds throughout, so a load never deletes what a concurrent save is writing.
//! Saving keeps the last `keep` committed versions.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::amp::{Amp, AmpState, STATE_FORMAT_VERSION};
use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};
use crate::optim::{AmpOptimizer, AmpOptimizerState, TensorData};

const LATEST: &str = "LATEST";
const WEIGHTS: &str = "weights.safetensors";
const STATE: &str = "state.json";
const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "candle-amp-checkpoint";
const LOCK: &str = ".lock";

/// Everything needed to resume a run exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The training step it was taken at (the caller's count).
    pub step: u64,
    /// Properties, scalers, generators and weights.
    pub amp: AmpState,
    /// Each optimizer's state, in the order given to [`Checkpoint::capture`].
    pub optimizers: Vec<AmpOptimizerState>,
    /// The user's own data (e.g. a loss history).
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl Checkpoint {
    /// Captures a run: the AMP handle's state and the optimizers' states, in order.
    pub fn capture(amp: &Amp, optimizers: &[&AmpOptimizer], step: u64) -> Result<Self> {
        Ok(Self {
            step,
            amp: amp.state_dict()?,
            optimizers: optimizers.iter().map(|o| o.state_dict()).collect::<Result<_>>()?,
            extra: serde_json::Value::Null,
        })
    }

    /// Restores a run captured with [`capture`](Self::capture), at any opt level (see
    /// [`Amp::load_state_dict`]). Checks everything first: a checkpoint from another model,
    /// with another number of optimizers or loss scalers, changes nothing.
    pub fn restore(&self, amp: &Amp, optimizers: &mut [&mut AmpOptimizer]) -> Result<()> {
        amp.check_state(&self.amp, "<checkpoint>")?;
        if optimizers.len() != self.optimizers.len() {
            return Err(AmpError::checkpoint(
                "<checkpoint>",
                Kind::Mismatch,
                format!(
                    "it holds {} optimizer state(s) but {} optimizer(s) were given; pass them in the order they were saved",
                    self.optimizers.len(),
                    optimizers.len()
                ),
            ));
        }
        for (o, s) in optimizers.iter().zip(&self.optimizers) {
            o.check_state(s)
                .map_err(|e| AmpError::checkpoint("<checkpoint>", Kind::Mismatch, e.to_string()))?;
        }
        amp.load_state_dict(&self.amp)?;
        for (o, s) in optimizers.iter_mut().zip(&self.optimizers) {
            o.load_state_dict(s)?;
        }
        Ok(())
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct FileEntry {
    name: String,
    bytes: u64,
    crc32: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    format_version: u32,
    step: u64,
    files: Vec<FileEntry>,
}

/// A directory of versioned checkpoints. See the module documentation for the layout.
///
/// ```
/// use candle_amp::{self as amp, checkpoint::{Checkpoint, CheckpointDir}};
/// # fn main() -> anyhow::Result<()> {
/// let (_model, opt, amp) = amp::initialize(
///     |vb| candle_nn::linear(2, 2, vb.pp("fc")),
///     amp::optim::AdamW::new(Default::default())?,
///     amp::OptLevel::O2,
/// )?;
/// let dir = std::env::temp_dir().join(format!("candle-amp-doc-{}", std::process::id()));
/// let ckpts = CheckpointDir::new(&dir, 3);
/// ckpts.save(&Checkpoint::capture(&amp, &[&opt], 0)?)?;
/// let back = ckpts.load()?;
/// assert_eq!(back.amp.weights, amp.state_dict()?.weights);
/// # std::fs::remove_dir_all(&dir)?; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    root: PathBuf,
    keep: usize,
}

/// An I/O error as a checkpoint error (`NotFound` when the file is missing).
pub(crate) fn io_err(path: &Path, e: std::io::Error) -> AmpError {
    let kind = if e.kind() == std::io::ErrorKind::NotFound {
        Kind::NotFound
    } else {
        Kind::Io
    };
    AmpError::checkpoint(path, kind, e.to_string())
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(|e| io_err(dir, e))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| io_err(path, e))
}

fn version_name(n: u64) -> String {
    format!("v{n:08}")
}

fn parse_version(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('v')?;
    if digits.len() < 8 || digits.len() > 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

impl CheckpointDir {
    /// Checkpoints under `root`, keeping the last `keep` (at least 1).
    pub fn new(root: impl Into<PathBuf>, keep: usize) -> Self {
        Self {
            root: root.into(),
            keep: keep.max(1),
        }
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn lock_file(&self) -> Result<File> {
        let p = self.root.join(LOCK);
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| io_err(&p, e))
    }

    /// Committed version numbers and leftovers (`.tmp` directories, uncommitted versions).
    fn scan(&self) -> Result<(Vec<u64>, Vec<PathBuf>)> {
        let mut versions = Vec::new();
        let mut tmp = Vec::new();
        let rd = match fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((versions, tmp)),
            Err(e) => return Err(io_err(&self.root, e)),
        };
        for entry in rd {
            let entry = entry.map_err(|e| io_err(&self.root, e))?;
            let name = entry.file_name().to_string_lossy().to_string();
            if let Some(v) = parse_version(&name) {
                versions.push(v);
            } else if name.ends_with(".tmp") {
                tmp.push(entry.path());
            }
        }
        versions.sort_unstable();
        Ok((versions, tmp))
    }

    /// The committed version `LATEST` names, if any.
    pub fn latest_version(&self) -> Result<Option<u64>> {
        let p = self.root.join(LATEST);
        match fs::read_to_string(&p) {
            Ok(s) => parse_version(s.trim())
                .map(Some)
                .ok_or_else(|| AmpError::checkpoint(&p, Kind::Corrupt, format!("names no version: {:?}", s.trim()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&p, e)),
        }
    }

    /// The path of the committed version's f32 weights (loadable into a plain candle
    /// `VarMap` of the same architecture).
    pub fn latest_weights(&self) -> Result<PathBuf> {
        let v = self
            .latest_version()?
            .ok_or_else(|| AmpError::checkpoint(&self.root, Kind::NotFound, "no checkpoint has been saved here"))?;
        Ok(self.root.join(version_name(v)).join(WEIGHTS))
    }

    /// Writes `ckpt` as a new version, commits it, and prunes old versions. Returns the
    /// version's directory.
    pub fn save(&self, ckpt: &Checkpoint) -> Result<PathBuf> {
        fs::create_dir_all(&self.root).map_err(|e| io_err(&self.root, e))?;
        // Held until the save returns (and released by the OS if the process dies).
        let lock = self.lock_file()?;
        lock.lock().map_err(|e| io_err(&self.root.join(LOCK), e))?;
        self.clean_up_locked()?;
        let (versions, _) = self.scan()?;
        let n = versions.last().map_or(1, |v| v + 1);
        let name = version_name(n);
        let tmp_dir = self.root.join(format!("{name}.tmp"));
        if tmp_dir.exists() {
            fs::remove_dir_all(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;
        }
        fs::create_dir(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;

        // Weights: f32 safetensors with the model's own names.
        let dev = candle_core::Device::Cpu;
        let mut tensors = std::collections::HashMap::new();
        for (k, t) in &ckpt.amp.weights {
            tensors.insert(k.clone(), t.to_tensor(&dev)?);
        }
        let wpath = tmp_dir.join(WEIGHTS);
        candle_core::safetensors::save(&tensors, &wpath)
            .map_err(|e| AmpError::checkpoint(&wpath, Kind::Io, e.to_string()))?;
        let weights = fs::read(&wpath).map_err(|e| io_err(&wpath, e))?;
        File::open(&wpath)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err(&wpath, e))?;

        let mut rest = ckpt.clone();
        rest.amp.weights = BTreeMap::new();
        let state = serde_json::to_vec(&rest).map_err(|e| AmpError::checkpoint(&tmp_dir, Kind::Io, e.to_string()))?;
        write_synced(&tmp_dir.join(STATE), &state)?;

        let manifest = Manifest {
            format: FORMAT.into(),
            format_version: STATE_FORMAT_VERSION,
            step: ckpt.step,
            files: [(WEIGHTS, &weights), (STATE, &state)]
                .into_iter()
                .map(|(name, b)| FileEntry {
                    name: name.into(),
                    bytes: b.len() as u64,
                    crc32: crc32fast::hash(b),
                })
                .collect(),
        };
        let mbytes = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| AmpError::checkpoint(&tmp_dir, Kind::Io, e.to_string()))?;
        write_synced(&tmp_dir.join(MANIFEST), &mbytes)?;
        fsync_dir(&tmp_dir)?;

        let final_dir = self.root.join(&name);
        fs::rename(&tmp_dir, &final_dir).map_err(|e| io_err(&final_dir, e))?;
        fsync_dir(&self.root)?;

        // Commit: replace the pointer atomically.
        let ptmp = self.root.join(format!("{LATEST}.tmp"));
        write_synced(&ptmp, format!("{name}\n").as_bytes())?;
        fs::rename(&ptmp, self.root.join(LATEST)).map_err(|e| io_err(&self.root, e))?;
        fsync_dir(&self.root)?;

        // The checkpoint is committed: a failure to prune old versions is not a failed save.
        if let Err(e) = self.prune(n) {
            log::warn!(
                "checkpoint {} saved, but old versions could not be removed: {e}",
                final_dir.display()
            );
        }
        Ok(final_dir)
    }

    /// Removes committed versions older than the newest `keep` (never `committed` itself).
    fn prune(&self, committed: u64) -> Result<()> {
        let (versions, _) = self.scan()?;
        let old: Vec<u64> = versions.into_iter().filter(|&v| v < committed).collect();
        if old.len() + 1 > self.keep {
            for v in &old[..old.len() + 1 - self.keep] {
                let p = self.root.join(version_name(*v));
                fs::remove_dir_all(&p).map_err(|e| io_err(&p, e))?;
            }
        }
        Ok(())
    }

    /// Removes leftovers of interrupted saves: `.tmp` directories, versions newer than the
    /// committed one, and committed versions beyond `keep` (a save killed while pruning).
    /// Waits for a save in progress (the lock file).
    pub fn clean_up(&self) -> Result<()> {
        if !self.root.exists() {
            return Ok(());
        }
        let lock = self.lock_file()?;
        lock.lock().map_err(|e| io_err(&self.root.join(LOCK), e))?;
        self.clean_up_locked()
    }

    fn clean_up_locked(&self) -> Result<()> {
        let committed = self.latest_version()?;
        let (versions, tmp) = self.scan()?;
        for p in tmp {
            if p.is_dir() {
                fs::remove_dir_all(&p).map_err(|e| io_err(&p, e))?;
            } else {
                fs::remove_file(&p).map_err(|e| io_err(&p, e))?;
            }
        }
        if let Some(c) = committed {
            for v in versions.into_iter().filter(|&v| v > c) {
                let p = self.root.join(version_name(v));
                fs::remove_dir_all(&p).map_err(|e| io_err(&p, e))?;
            }
            self.prune(c)?;
        }
        Ok(())
    }

    /// Loads and verifies the committed checkpoint. Leftovers of interrupted saves are
    /// ignored, and removed when no save is in progress and the directory is writable.
    pub fn load(&self) -> Result<Checkpoint> {
        let v = self.latest_version()?.ok_or_else(|| {
            AmpError::checkpoint(
                &self.root,
                Kind::NotFound,
                "no committed checkpoint (no LATEST file): save one first",
            )
        })?;
        let ckpt = self.load_version(v)?;
        if let Ok(lock) = self.lock_file()
            && lock.try_lock().is_ok()
            && let Err(e) = self.clean_up_locked()
        {
            log::debug!("could not remove leftovers of interrupted saves: {e}");
        }
        Ok(ckpt)
    }

    /// Loads and verifies one version.
    pub fn load_version(&self, v: u64) -> Result<Checkpoint> {
        let dir = self.root.join(version_name(v));
        let mpath = dir.join(MANIFEST);
        let mbytes = fs::read(&mpath).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => AmpError::checkpoint(&mpath, Kind::MissingFile, "the manifest is missing"),
            _ => io_err(&mpath, e),
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
        let mut files = BTreeMap::new();
        for name in [WEIGHTS, STATE] {
            let entry = manifest.files.iter().find(|f| f.name == name).ok_or_else(|| {
                AmpError::checkpoint(&mpath, Kind::Corrupt, format!("the manifest does not list {name}"))
            })?;
            let p = dir.join(name);
            let bytes = fs::read(&p).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => {
                    AmpError::checkpoint(&p, Kind::MissingFile, "listed in the manifest but missing")
                }
                _ => io_err(&p, e),
            })?;
            if (bytes.len() as u64) < entry.bytes {
                return Err(AmpError::checkpoint(
                    &p,
                    Kind::Truncated,
                    format!("{} bytes, the manifest says {}", bytes.len(), entry.bytes),
                ));
            }
            if bytes.len() as u64 != entry.bytes || crc32fast::hash(&bytes) != entry.crc32 {
                return Err(AmpError::checkpoint(
                    &p,
                    Kind::Corrupt,
                    "checksum mismatch: the file was damaged",
                ));
            }
            files.insert(name, bytes);
        }
        let mut ckpt: Checkpoint = serde_json::from_slice(&files[STATE])
            .map_err(|e| AmpError::checkpoint(dir.join(STATE), Kind::Corrupt, format!("unreadable state: {e}")))?;
        if ckpt.step != manifest.step {
            return Err(AmpError::checkpoint(
                &dir,
                Kind::Corrupt,
                "the manifest and the state disagree on the step",
            ));
        }
        let tensors = candle_core::safetensors::load_buffer(&files[WEIGHTS], &candle_core::Device::Cpu)
            .map_err(|e| AmpError::checkpoint(dir.join(WEIGHTS), Kind::Corrupt, e.to_string()))?;
        let mut weights = BTreeMap::new();
        for (k, t) in tensors {
            let t: Tensor = t;
            weights.insert(k, TensorData::from_tensor(&t)?);
        }
        ckpt.amp.weights = weights;
        Ok(ckpt)
    }
}
