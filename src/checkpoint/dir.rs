//! [`CheckpointDir`]: saving, loading and cleaning up a directory of versioned checkpoints.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use super::scan::{Committed, Search, version_name};
use super::verify::write_manifest;
use super::{BUFFERS, Checkpoint, DAMAGED, LATEST, LOCK, STATE, StateFile, WEIGHTS, buffer_key, record_of};
use crate::amp::Amp;
use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};
use crate::files::{Source, fsync_dir, write_sources, write_synced};
use crate::train::optim::AmpOptimizer;

/// A directory of versioned checkpoints. See the module documentation for the layout.
///
/// ```
/// use candle_amp::{self as amp, checkpoint::CheckpointDir};
/// # fn main() -> anyhow::Result<()> {
/// let (_model, mut opt, amp) = amp::initialize(
///     |vb| candle_nn::linear(2, 2, vb.pp("fc")),
///     amp::optim::AdamW::new(Default::default())?,
///     amp::OptLevel::O2,
/// )?;
/// let dir = std::env::temp_dir().join(format!("candle-amp-doc-{}", std::process::id()));
/// let ckpts = CheckpointDir::new(&dir, 3);
/// ckpts.save(&amp, &[&opt], 0, serde_json::json!({ "epoch": 0 }))?;
/// let back = ckpts.load()?;
/// assert_eq!(back.step(), 0);
/// assert_eq!(back.extra()["epoch"], 0);
/// back.restore(&amp, &mut [&mut opt])?;
/// # std::fs::remove_dir_all(&dir)?; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    pub(super) root: PathBuf,
    keep: usize,
}

/// The directory's lock, held while it lives (and released by the OS if the process dies).
struct DirLock(#[allow(dead_code)] Option<File>);

/// A version being written: the directory's lock, its number and its `.tmp` directory.
pub(super) struct NewVersion {
    _lock: DirLock,
    pub(super) n: u64,
    /// Whether the clean-up found `LATEST` damaged (the commit then says what it names now).
    damaged_latest: bool,
    pub(super) tmp_dir: PathBuf,
}

impl NewVersion {
    /// Removes the `.tmp` directory of a save that failed (the next save would anyway).
    pub(super) fn abandon(self) {
        let _ = fs::remove_dir_all(&self.tmp_dir);
    }
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

    fn lock_file(&self) -> std::io::Result<File> {
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .read(true)
            .open(self.root.join(LOCK))
    }

    /// The exclusive lock a save holds.
    fn lock_exclusive(&self) -> Result<DirLock> {
        let p = self.root.join(LOCK);
        let f = self.lock_file().map_err(|e| AmpError::io(&p, e))?;
        f.lock().map_err(|e| AmpError::io(&p, e))?;
        Ok(DirLock(Some(f)))
    }

    /// The shared lock a load holds; none where the lock file cannot be opened (a read-only
    /// directory): the load then retries if its version vanishes.
    fn lock_shared(&self) -> DirLock {
        let f = self.lock_file().or_else(|_| File::open(self.root.join(LOCK)));
        DirLock(f.ok().filter(|f| f.lock_shared().is_ok()))
    }

    /// The path of the committed version's f32 weights (loadable into a plain candle
    /// `VarMap` of the same architecture).
    /// A sharded version (written by the ranks of a ZeRO run) has one weights file per rank:
    /// that is a [`Kind::Mismatch`] here, and [`latest_weight_files`](Self::latest_weight_files)
    /// lists them.
    pub fn latest_weights(&self) -> Result<PathBuf> {
        let mut files = self.latest_weight_files()?;
        if files.len() != 1 {
            return Err(AmpError::checkpoint(
                &self.root,
                Kind::Mismatch,
                format!(
                    "the committed version is sharded: its f32 weights are in {} files (latest_weight_files lists \
                     them; a candle VarMap loads each in turn)",
                    files.len()
                ),
            ));
        }
        Ok(files.remove(0))
    }

    /// The paths of the committed version's f32 weights: one file, or one per rank that
    /// wrote a sharded version (each parameter in exactly one of them).
    pub fn latest_weight_files(&self) -> Result<Vec<PathBuf>> {
        let c = self
            .committed()?
            .ok_or_else(|| AmpError::checkpoint(&self.root, Kind::NotFound, "no checkpoint has been saved here"))?;
        let dir = self.root.join(version_name(c.version));
        // The manifest says whether the version is sharded; one that cannot be read (the
        // load will say why) names the one-process file, as before sharded versions existed.
        let shards = self.read_manifest(c.version).ok().and_then(|m| m.shards);
        Ok(super::tensor_files(shards).0.into_iter().map(|f| dir.join(f)).collect())
    }

    /// Saves the live run (weights, every optimizer's state in the order given, scalers,
    /// generators, `step` and your `extra` data) as a new version, commits it, and prunes old
    /// versions (moving aside any version a damaged `LATEST` made it pass over, see the module
    /// documentation; when `LATEST` is damaged and no version verifies, every version is
    /// moved aside and the save commits afresh: a save on a writable directory succeeds). Its number is above that of every version the directory holds or
    /// held in view (damaged, quarantined and leftovers included). Tensors are streamed from the run into the files one at a time, and the
    /// optimizers' own f32 buffers (moments) are written straight from where they live: no
    /// copy of the state is made. Returns the version's directory. Refused on a rank of a
    /// ZeRO-sharded run ([`crate::error::DistErrorKind::Sharded`]), before anything is written.
    pub fn save(
        &self,
        amp: &Amp,
        optimizers: &[&AmpOptimizer],
        step: u64,
        extra: serde_json::Value,
    ) -> Result<PathBuf> {
        amp.run().check_whole_state("CheckpointDir::save")?;
        let mut weights = Vec::new();
        for p in amp.store().params() {
            weights.push((p.name().to_string(), Source::Tensor(p.f32_value()?.detach())));
        }
        let mut buffers = Vec::new();
        let mut records = Vec::new();
        for (i, o) in optimizers.iter().enumerate() {
            let meta = o.state_meta()?;
            let mut record = record_of(&meta);
            for pb in o.param_buffers()? {
                let names = pb.buffers.iter().map(|(k, _)| k.clone()).collect();
                record.params.insert(pb.param.clone(), (pb.step, names));
                for (k, v) in pb.buffers {
                    buffers.push((buffer_key(i, &pb.param, &k), Source::Values(v, pb.shape.clone())));
                }
            }
            records.push(record);
        }
        let state = StateFile {
            step,
            amp: amp.state_dict_without_weights(),
            optimizers: records,
            extra,
        };
        self.write_version(&weights, &buffers, &state)
    }

    /// Writes a [`Checkpoint`] (a capture, or one loaded elsewhere) as a new version,
    /// commits it, and prunes old versions. Returns the version's directory.
    pub fn save_checkpoint(&self, ckpt: &Checkpoint) -> Result<PathBuf> {
        let (weights, buffers) = ckpt.sources()?;
        let state = StateFile {
            step: ckpt.step,
            amp: ckpt.amp.clone(),
            optimizers: ckpt.optimizers.clone(),
            extra: ckpt.extra.clone(),
        };
        self.write_version(&weights, &buffers, &state)
    }

    /// Writes one version from its tensors and state, commits it, prunes old versions.
    fn write_version(
        &self,
        weights: &[(String, Source<'_>)],
        buffers: &[(String, Source<'_>)],
        state: &StateFile,
    ) -> Result<PathBuf> {
        let v = self.begin_version()?;
        let written = (|| {
            write_sources(weights, &v.tmp_dir.join(WEIGHTS))?;
            write_sources(buffers, &v.tmp_dir.join(BUFFERS))
        })();
        if let Err(e) = written {
            v.abandon();
            return Err(e);
        }
        self.finish_version(v, state, None)
    }

    /// Takes the lock, cleans up, numbers the new version and makes its `.tmp` directory.
    pub(super) fn begin_version(&self) -> Result<NewVersion> {
        fs::create_dir_all(&self.root).map_err(|e| AmpError::io(&self.root, e))?;
        let lock = self.lock_exclusive()?;
        // The number is taken before the clean-up removes leftovers: none is ever reused.
        let n = self.scan()?.highest + 1;
        let committed = self.clean_up_locked()?;
        let tmp_dir = self.root.join(format!("{}.tmp", version_name(n)));
        fs::create_dir(&tmp_dir).map_err(|e| AmpError::io(&tmp_dir, e))?;
        Ok(NewVersion {
            _lock: lock,
            n,
            damaged_latest: committed.is_some_and(|c| c.note.is_some()),
            tmp_dir,
        })
    }

    /// Writes the state and the manifest of a version whose tensor files are written
    /// (`shards`: the ranks that wrote a sharded one), renames it into place, commits it and
    /// prunes old versions.
    pub(super) fn finish_version(&self, v: NewVersion, state: &StateFile, shards: Option<usize>) -> Result<PathBuf> {
        let tmp_dir = &v.tmp_dir;
        let bytes = serde_json::to_vec(state).map_err(|e| AmpError::checkpoint(tmp_dir, Kind::Io, e.to_string()))?;
        write_synced(&tmp_dir.join(STATE), &bytes)?;
        write_manifest(tmp_dir, state.step, shards)?;
        fsync_dir(tmp_dir)?;

        let name = version_name(v.n);
        let final_dir = self.root.join(&name);
        fs::rename(tmp_dir, &final_dir).map_err(|e| AmpError::io(&final_dir, e))?;
        fsync_dir(&self.root)?;
        self.commit(&name)?;
        if v.damaged_latest {
            log::warn!("{} now names {name}", self.root.join(LATEST).display());
        }

        // The checkpoint is committed: a failure to prune old versions is not a failed save.
        if let Err(e) = self.prune(v.n) {
            log::warn!(
                "checkpoint {} saved, but old versions could not be removed: {e}",
                final_dir.display()
            );
        }
        Ok(final_dir)
    }

    /// Points `LATEST` at the version called `name`, atomically.
    fn commit(&self, name: &str) -> Result<()> {
        let ptmp = self.root.join(format!("{LATEST}.tmp"));
        write_synced(&ptmp, format!("{name}\n").as_bytes())?;
        fs::rename(&ptmp, self.root.join(LATEST)).map_err(|e| AmpError::io(&self.root, e))?;
        fsync_dir(&self.root)
    }

    /// Removes committed versions older than the newest `keep` (never `committed` itself,
    /// never a quarantined version).
    fn prune(&self, committed: u64) -> Result<()> {
        let old: Vec<u64> = self.scan()?.versions.into_iter().filter(|&v| v < committed).collect();
        if old.len() + 1 > self.keep {
            for v in &old[..old.len() + 1 - self.keep] {
                let p = self.root.join(version_name(*v));
                fs::remove_dir_all(&p).map_err(|e| AmpError::io(&p, e))?;
            }
        }
        Ok(())
    }

    /// Removes leftovers of interrupted saves (`.tmp` files and directories, versions newer
    /// than an intact `LATEST`, which no save committed) and committed versions beyond
    /// `keep` (a save killed while pruning), and moves aside to `vN.damaged` the versions a
    /// damaged `LATEST` made it pass over ([`Checkpoint::skipped_versions`]): those may have
    /// been committed, so they are kept. A write: waits for a save or load in progress (the
    /// lock file). Loads never clean up.
    pub fn clean_up(&self) -> Result<()> {
        if !self.root.exists() {
            return Ok(());
        }
        let _lock = self.lock_exclusive()?;
        self.clean_up_locked().map(|_| ())
    }

    fn clean_up_locked(&self) -> Result<Option<Committed>> {
        let committed = match self.search()? {
            Search::Nothing => None,
            Search::Found(c) => Some(c),
            Search::NoneVerifies { damage, skipped } => {
                // Nothing a load could read: every version is moved aside (never deleted, and
                // out of pruning's reach) and the next save commits afresh.
                for s in &skipped {
                    self.quarantine(s.version)?;
                }
                log::warn!(
                    "{} was damaged ({damage}) and no version verifies: {} version(s) moved aside to vN{DAMAGED}; \
                     the next save commits a new one",
                    self.root.join(LATEST).display(),
                    skipped.len()
                );
                None
            }
        };
        let entries = self.scan()?;
        for p in entries.tmp {
            if p.is_dir() {
                fs::remove_dir_all(&p).map_err(|e| AmpError::io(&p, e))?;
            } else if p.file_name().is_some_and(|n| n != LOCK) {
                fs::remove_file(&p).map_err(|e| AmpError::io(&p, e))?;
            }
        }
        if let Some(c) = &committed {
            for s in &c.skipped {
                self.quarantine(s.version)?;
            }
            // With `LATEST` intact, a newer version is a save's leftover that never committed.
            let uncommitted = entries
                .versions
                .into_iter()
                .filter(|&v| v > c.version && !c.skipped.iter().any(|s| s.version == v));
            for v in uncommitted {
                let p = self.root.join(version_name(v));
                fs::remove_dir_all(&p).map_err(|e| AmpError::io(&p, e))?;
            }
            self.prune(c.version)?;
        }
        Ok(committed)
    }

    /// Loads and verifies the committed checkpoint (recovering a damaged `LATEST`, see
    /// [`Checkpoint::recovered_from`] and [`Checkpoint::skipped_versions`]). Holds the
    /// directory's lock shared while it reads, so no save prunes the version meanwhile. A
    /// read: it moves, rewrites and removes nothing. Damaged versions and leftovers of
    /// interrupted saves stay where they are for the next save (or
    /// [`clean_up`](Self::clean_up)) to deal with.
    pub fn load(&self) -> Result<Checkpoint> {
        let mut attempt = 0;
        loop {
            let lock = self.lock_shared();
            let res = self.load_committed();
            let locked = lock.0.is_some();
            drop(lock);
            match res {
                // Without the lock a concurrent save may have pruned the version: read the
                // pointer again.
                Err(AmpError::Checkpoint {
                    kind: Kind::MissingFile | Kind::NotFound,
                    ..
                }) if !locked && attempt < 3 => attempt += 1,
                other => return other,
            }
        }
    }

    /// Finds and loads the committed version, with what the search found on the way.
    fn load_committed(&self) -> Result<Checkpoint> {
        let c = self.committed()?.ok_or_else(|| {
            AmpError::checkpoint(
                &self.root,
                Kind::NotFound,
                "no committed checkpoint (no LATEST file): save one first",
            )
        })?;
        let mut ck = self.load_version(c.version)?;
        ck.recovered = c.note;
        ck.skipped = c.skipped;
        Ok(ck)
    }
}
