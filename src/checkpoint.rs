//! Checkpoints that lose nothing, survive crashes and stay small in memory.
//!
//! A checkpoint holds the f32 weights (the masters at O2), every optimizer's state, every
//! loss scaler's state and skip counters, the resolved properties, the step number, every
//! generator a run depends on, and the user's own data. A [`CheckpointDir`] writes it as a
//! versioned subdirectory:
//!
//! ```text
//! DIR/LATEST                            "v00000012": the committed version
//! DIR/v00000012/weights.safetensors     f32 weights, the model's own names
//! DIR/v00000012/optimizer.safetensors   optimizer buffers, named "{optimizer}/{param}/{buffer}"
//! DIR/v00000012/state.json              scalars and names only: steps, scalers, generators, ...
//! DIR/v00000012/manifest.json           format version, step, size and CRC-32 of each file
//! ```
//!
//! Every tensor is in safetensors, never in JSON. [`CheckpointDir::save`] streams the live
//! run's tensors into the files one at a time (no copy of the state is made); loading
//! verifies every checksum by streaming the files through a small buffer, then
//! memory-maps the safetensors and reads each tensor only when it is restored.
//!
//! Saving writes a new version into `vN.tmp`, syncs its files and the directory, renames it
//! to `vN`, then replaces `LATEST` atomically (write `LATEST.tmp`, fsync, rename, fsync the
//! directory; `rename` cannot replace a non-empty directory, hence the pointer). A crash at
//! any moment leaves the previous `LATEST` and the version it names intact. A save holds the
//! directory's lock file (`DIR/.lock`) exclusively and a load holds it shared, so a load
//! never reads a version that a save is pruning and a clean-up never deletes a save in
//! progress (where the lock file cannot be opened, a read-only directory, say, a load
//! retries when its version vanishes). Saving keeps the last `keep` committed versions. A
//! damaged `LATEST` is recovered from the newest version that verifies, and the load says so
//! ([`Checkpoint::recovered_from`]).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::amp::{Amp, AmpState, STATE_FORMAT_VERSION};
use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};
use crate::files::{Source, crc_of, fsync_dir, map_safetensors, write_sources, write_synced};
use crate::precision::opt_level::Properties;
use crate::scaling::scaler::ScalerState;
use crate::train::optim::{AmpOptimizer, AmpOptimizerState, GroupHyper, OptimizerState, ParamState, same_values};

const LATEST: &str = "LATEST";
const WEIGHTS: &str = "weights.safetensors";
const BUFFERS: &str = "optimizer.safetensors";
const STATE: &str = "state.json";
const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "candle-amp-checkpoint";
const LOCK: &str = ".lock";

/// Tensors to write, by name.
type NamedSources = Vec<(String, Source<'static>)>;
/// The files of a version, each listed in its manifest with size and CRC-32.
const FILES: [&str; 3] = [WEIGHTS, BUFFERS, STATE];

/// One optimizer's state without its buffers (those are tensors in `optimizer.safetensors`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OptimizerRecord {
    kind: String,
    /// Per parameter: steps applied and the names of its buffers.
    params: BTreeMap<String, (u64, Vec<String>)>,
    groups: Vec<(String, GroupHyper)>,
    steps: u64,
    skipped_steps: u64,
    consecutive_skips: u32,
}

fn buffer_key(optimizer: usize, param: &str, buffer: &str) -> String {
    format!("{optimizer}/{param}/{buffer}")
}

/// `state.json`: everything but the tensors.
#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    step: u64,
    amp: AmpState,
    optimizers: Vec<OptimizerRecord>,
    #[serde(default)]
    extra: serde_json::Value,
}

/// Where a checkpoint's tensors are read from.
#[derive(Clone)]
enum Tensors {
    /// In memory: a capture (copies) or the live run's own tensors while it is being saved.
    Memory {
        weights: BTreeMap<String, Tensor>,
        buffers: BTreeMap<String, Tensor>,
    },
    /// The memory-mapped files of a loaded version; each tensor is read when it is used.
    Mapped {
        weights: Arc<MmapedSafetensors>,
        buffers: Arc<MmapedSafetensors>,
    },
}

/// Everything needed to resume a run exactly: made by [`Checkpoint::capture`] or
/// [`CheckpointDir::load`], applied by [`Checkpoint::restore`].
#[derive(Clone)]
pub struct Checkpoint {
    step: u64,
    extra: serde_json::Value,
    amp: AmpState,
    optimizers: Vec<OptimizerRecord>,
    tensors: Tensors,
    origin: String,
    recovered: Option<String>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("origin", &self.origin)
            .field("step", &self.step)
            .field("optimizers", &self.optimizers.len())
            .field("recovered", &self.recovered)
            .finish()
    }
}

impl PartialEq for Checkpoint {
    /// Equal steps, user data, run state, optimizer states and bit-identical tensors.
    fn eq(&self, other: &Self) -> bool {
        let tensors = |c: &Checkpoint| Ok::<_, AmpError>((c.weights()?, c.optimizer_states()?));
        self.step == other.step
            && self.extra == other.extra
            && self.amp == other.amp
            && match (tensors(self), tensors(other)) {
                (Ok((wa, oa)), Ok((wb, ob))) => {
                    oa == ob
                        && wa.len() == wb.len()
                        && wa
                            .iter()
                            .zip(&wb)
                            .all(|((ka, a), (kb, b))| ka == kb && same_values(a, b))
                }
                _ => false,
            }
    }
}

fn record_of(state: &AmpOptimizerState) -> OptimizerRecord {
    OptimizerRecord {
        kind: state.algorithm.kind.clone(),
        params: state
            .algorithm
            .params
            .iter()
            .map(|(k, p)| (k.clone(), (p.step, p.buffers.keys().cloned().collect())))
            .collect(),
        groups: state.groups.clone(),
        steps: state.steps,
        skipped_steps: state.skipped_steps,
        consecutive_skips: state.consecutive_skips,
    }
}

impl Checkpoint {
    /// Captures a run in memory: the AMP handle's state and the optimizers' states, in
    /// order. The tensors are copied, so the capture does not change as training goes on
    /// (it costs one copy of the state; [`CheckpointDir::save`] writes a run without one).
    pub fn capture(amp: &Amp, optimizers: &[&AmpOptimizer], step: u64) -> Result<Self> {
        let extra = serde_json::Value::Null;
        let mut weights = BTreeMap::new();
        for p in amp.store().params() {
            let v = p.f32_value()?;
            // The master or an f32 working weight shares the live Var's storage: copy it.
            let v = if p.f32_var().is_some() { v.copy()? } else { v };
            weights.insert(p.name().to_string(), v.detach());
        }
        let mut buffers = BTreeMap::new();
        let mut records = Vec::new();
        for (i, o) in optimizers.iter().enumerate() {
            let st = o.state_dict()?;
            for (name, ps) in &st.algorithm.params {
                for (b, t) in &ps.buffers {
                    buffers.insert(buffer_key(i, name, b), t.to_dtype(DType::F32)?);
                }
            }
            records.push(record_of(&st));
        }
        let mut state = amp.state_dict_without_weights();
        state.weights.clear();
        Ok(Self {
            step,
            extra,
            amp: state,
            optimizers: records,
            tensors: Tensors::Memory { weights, buffers },
            origin: format!("the checkpoint captured at step {step}"),
            recovered: None,
        })
    }

    /// The training step it was taken at (the caller's count).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The user's own data (e.g. an epoch number, a loss history).
    pub fn extra(&self) -> &serde_json::Value {
        &self.extra
    }

    /// Replaces the user's own data.
    pub fn set_extra(&mut self, extra: serde_json::Value) {
        self.extra = extra;
    }

    /// When `LATEST` was damaged and this checkpoint is the newest version that verified:
    /// what happened. `None` for a normal load.
    pub fn recovered_from(&self) -> Option<&str> {
        self.recovered.as_deref()
    }

    /// The resolved properties of the run that saved it.
    pub fn properties(&self) -> &Properties {
        &self.amp.properties
    }

    /// Every loss scaler's saved state.
    pub fn scaler_states(&self) -> &[ScalerState] {
        &self.amp.scalers
    }

    fn tensor(&self, buffers: bool, name: &str) -> Result<Tensor> {
        let missing = || {
            AmpError::checkpoint(
                &self.origin,
                Kind::Corrupt,
                format!("tensor `{name}` is listed in the state but missing"),
            )
        };
        match &self.tensors {
            Tensors::Memory { weights, buffers: b } => {
                let m = if buffers { b } else { weights };
                m.get(name).cloned().ok_or_else(missing)
            }
            Tensors::Mapped { weights, buffers: b } => {
                let m = if buffers { b } else { weights };
                m.load(name, &Device::Cpu)
                    .map_err(|e| AmpError::checkpoint(&self.origin, Kind::Corrupt, format!("`{name}`: {e}")))
            }
        }
    }

    /// Names and shapes of the weights, read without loading them.
    fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        match &self.tensors {
            Tensors::Memory { weights, .. } => weights.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect(),
            Tensors::Mapped { weights, .. } => {
                let mut v: Vec<_> = weights
                    .tensors()
                    .into_iter()
                    .map(|(k, t)| (k, t.shape().to_vec()))
                    .collect();
                v.sort();
                v
            }
        }
    }

    /// The f32 weights and buffers by name (read from the files of a loaded checkpoint).
    pub fn weights(&self) -> Result<BTreeMap<String, Tensor>> {
        self.weight_shapes()
            .into_iter()
            .map(|(k, _)| Ok((k.clone(), self.tensor(false, &k)?)))
            .collect()
    }

    /// Each optimizer's state, in the order they were saved (buffers read from the files of
    /// a loaded checkpoint).
    pub fn optimizer_states(&self) -> Result<Vec<AmpOptimizerState>> {
        self.optimizers
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut params = BTreeMap::new();
                for (name, (step, bufs)) in &r.params {
                    let buffers = bufs
                        .iter()
                        .map(|b| Ok((b.clone(), self.tensor(true, &buffer_key(i, name, b))?)))
                        .collect::<Result<_>>()?;
                    params.insert(name.clone(), ParamState { step: *step, buffers });
                }
                Ok(AmpOptimizerState {
                    algorithm: OptimizerState {
                        kind: r.kind.clone(),
                        params,
                    },
                    groups: r.groups.clone(),
                    steps: r.steps,
                    skipped_steps: r.skipped_steps,
                    consecutive_skips: r.consecutive_skips,
                })
            })
            .collect()
    }

    /// Restores the run, at any opt level (see [`Amp::load_state_dict`]). Checks everything
    /// first: a checkpoint from another model, with another number of optimizers or loss
    /// scalers, changes nothing. Weights are read and written one tensor at a time.
    pub fn restore(&self, amp: &Amp, optimizers: &mut [&mut AmpOptimizer]) -> Result<()> {
        let shapes = self.weight_shapes();
        amp.check_run_state(&self.amp, Some(&shapes), &self.origin)?;
        if let Some((k, _)) = shapes.iter().find(|(k, _)| !self.is_float(k)) {
            return Err(AmpError::checkpoint(
                &self.origin,
                Kind::Corrupt,
                format!("weight `{k}` is not a floating tensor"),
            ));
        }
        if optimizers.len() != self.optimizers.len() {
            return Err(AmpError::checkpoint(
                &self.origin,
                Kind::Mismatch,
                format!(
                    "it holds {} optimizer state(s) but {} optimizer(s) were given; pass them in the order they were saved",
                    self.optimizers.len(),
                    optimizers.len()
                ),
            ));
        }
        let states = self.optimizer_states()?;
        for (o, s) in optimizers.iter().zip(&states) {
            o.check_state(s)
                .map_err(|e| AmpError::checkpoint(&self.origin, Kind::Mismatch, e.to_string()))?;
        }
        for (name, _) in &shapes {
            let t = self.tensor(false, name)?;
            amp.store().write_f32(name, &t.to_dtype(DType::F32)?)?;
        }
        amp.restore_run_state(&self.amp);
        // By value: each saved buffer is freed as the optimizer takes it in.
        for (o, s) in optimizers.iter_mut().zip(states) {
            o.load_state(s)?;
        }
        Ok(())
    }

    fn is_float(&self, name: &str) -> bool {
        match &self.tensors {
            Tensors::Memory { weights, .. } => weights.get(name).is_some_and(|t| t.dtype().is_float()),
            Tensors::Mapped { weights, .. } => weights
                .get(name)
                .is_ok_and(|v| DType::try_from(v.dtype()).is_ok_and(|d| d.is_float())),
        }
    }

    /// The tensors to write (a loaded checkpoint's are read from its files).
    fn sources(&self) -> Result<(NamedSources, NamedSources)> {
        let weights = self
            .weight_shapes()
            .into_iter()
            .map(|(k, _)| Ok((k.clone(), Source::Tensor(self.tensor(false, &k)?))))
            .collect::<Result<_>>()?;
        let mut buffers = Vec::new();
        for (i, r) in self.optimizers.iter().enumerate() {
            for (name, (_, bufs)) in &r.params {
                for b in bufs {
                    let k = buffer_key(i, name, b);
                    let t = self.tensor(true, &k)?;
                    buffers.push((k, Source::Tensor(t)));
                }
            }
        }
        Ok((weights, buffers))
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
    root: PathBuf,
    keep: usize,
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

/// The directory's lock, held while it lives (and released by the OS if the process dies).
struct DirLock(#[allow(dead_code)] Option<File>);

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

    /// Version numbers present and leftovers (`.tmp` files and directories).
    fn scan(&self) -> Result<(Vec<u64>, Vec<PathBuf>)> {
        let mut versions = Vec::new();
        let mut tmp = Vec::new();
        let rd = match fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((versions, tmp)),
            Err(e) => return Err(AmpError::io(&self.root, e)),
        };
        for entry in rd {
            let entry = entry.map_err(|e| AmpError::io(&self.root, e))?;
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

    /// The version `LATEST` names, if any (an error if it is damaged).
    fn latest_version(&self) -> Result<Option<u64>> {
        let p = self.root.join(LATEST);
        match fs::read(&p) {
            Ok(b) => {
                let s = String::from_utf8_lossy(&b);
                parse_version(s.trim())
                    .map(Some)
                    .ok_or_else(|| AmpError::checkpoint(&p, Kind::Corrupt, format!("names no version: {:?}", s.trim())))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(AmpError::io(&p, e)),
        }
    }

    /// The committed version: the one `LATEST` names, or, when `LATEST` is damaged (no version
    /// name, or a version that is not there), the newest version that verifies, with a note
    /// saying so.
    fn committed(&self) -> Result<Option<(u64, Option<String>)>> {
        let damage = match self.latest_version() {
            Ok(None) => return Ok(None),
            Ok(Some(v)) if self.root.join(version_name(v)).is_dir() => return Ok(Some((v, None))),
            Ok(Some(v)) => format!("it names {}, which is not there", version_name(v)),
            Err(
                e @ AmpError::Checkpoint {
                    kind: Kind::Corrupt, ..
                },
            ) => e.to_string(),
            Err(e) => return Err(e),
        };
        let (versions, _) = self.scan()?;
        for &v in versions.iter().rev() {
            if self.verify(v).is_ok() {
                let note = format!(
                    "{} was damaged ({damage}); recovered {}, the newest version that verifies",
                    self.root.join(LATEST).display(),
                    version_name(v)
                );
                log::warn!("{note}");
                return Ok(Some((v, Some(note))));
            }
        }
        Err(AmpError::checkpoint(
            self.root.join(LATEST),
            Kind::Corrupt,
            format!("{damage}, and no version verifies"),
        ))
    }

    /// The path of the committed version's f32 weights (loadable into a plain candle
    /// `VarMap` of the same architecture).
    pub fn latest_weights(&self) -> Result<PathBuf> {
        let (v, _) = self
            .committed()?
            .ok_or_else(|| AmpError::checkpoint(&self.root, Kind::NotFound, "no checkpoint has been saved here"))?;
        Ok(self.root.join(version_name(v)).join(WEIGHTS))
    }

    /// Saves the live run (weights, every optimizer's state in the order given, scalers,
    /// generators, `step` and your `extra` data) as a new version, commits it, and prunes old
    /// versions. Tensors are streamed from the run into the files one at a time, and the
    /// optimizers' own f32 buffers (moments) are written straight from where they live: no
    /// copy of the state is made. Returns the version's directory.
    pub fn save(
        &self,
        amp: &Amp,
        optimizers: &[&AmpOptimizer],
        step: u64,
        extra: serde_json::Value,
    ) -> Result<PathBuf> {
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
        fs::create_dir_all(&self.root).map_err(|e| AmpError::io(&self.root, e))?;
        let _lock = self.lock_exclusive()?;
        let committed = self.clean_up_locked()?;
        let (versions, _) = self.scan()?;
        let n = versions.last().map_or(1, |v| v + 1);
        let name = version_name(n);
        let tmp_dir = self.root.join(format!("{name}.tmp"));
        if tmp_dir.exists() {
            fs::remove_dir_all(&tmp_dir).map_err(|e| AmpError::io(&tmp_dir, e))?;
        }
        fs::create_dir(&tmp_dir).map_err(|e| AmpError::io(&tmp_dir, e))?;

        write_sources(weights, &tmp_dir.join(WEIGHTS))?;
        write_sources(buffers, &tmp_dir.join(BUFFERS))?;
        let bytes = serde_json::to_vec(state).map_err(|e| AmpError::checkpoint(&tmp_dir, Kind::Io, e.to_string()))?;
        write_synced(&tmp_dir.join(STATE), &bytes)?;

        let files = FILES
            .iter()
            .map(|f| {
                let (bytes, crc32) = crc_of(&tmp_dir.join(f))?;
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
            step: state.step,
            files,
        };
        let mbytes = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| AmpError::checkpoint(&tmp_dir, Kind::Io, e.to_string()))?;
        write_synced(&tmp_dir.join(MANIFEST), &mbytes)?;
        fsync_dir(&tmp_dir)?;

        let final_dir = self.root.join(&name);
        fs::rename(&tmp_dir, &final_dir).map_err(|e| AmpError::io(&final_dir, e))?;
        fsync_dir(&self.root)?;

        // Commit: replace the pointer atomically.
        let ptmp = self.root.join(format!("{LATEST}.tmp"));
        write_synced(&ptmp, format!("{name}\n").as_bytes())?;
        fs::rename(&ptmp, self.root.join(LATEST)).map_err(|e| AmpError::io(&self.root, e))?;
        fsync_dir(&self.root)?;
        if committed.is_some_and(|(_, note)| note.is_some()) {
            log::warn!("{} now names {name}", self.root.join(LATEST).display());
        }

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
                fs::remove_dir_all(&p).map_err(|e| AmpError::io(&p, e))?;
            }
        }
        Ok(())
    }

    /// Removes leftovers of interrupted saves: `.tmp` files and directories, versions newer
    /// than the committed one, and committed versions beyond `keep` (a save killed while
    /// pruning). Waits for a save or load in progress (the lock file).
    pub fn clean_up(&self) -> Result<()> {
        if !self.root.exists() {
            return Ok(());
        }
        let _lock = self.lock_exclusive()?;
        self.clean_up_locked().map(|_| ())
    }

    fn clean_up_locked(&self) -> Result<Option<(u64, Option<String>)>> {
        let committed = self.committed()?;
        let (versions, tmp) = self.scan()?;
        for p in tmp {
            if p.is_dir() {
                fs::remove_dir_all(&p).map_err(|e| AmpError::io(&p, e))?;
            } else if p.file_name().is_some_and(|n| n != LOCK) {
                fs::remove_file(&p).map_err(|e| AmpError::io(&p, e))?;
            }
        }
        if let Some((c, _)) = &committed {
            for v in versions.into_iter().filter(|v| v > c) {
                let p = self.root.join(version_name(v));
                fs::remove_dir_all(&p).map_err(|e| AmpError::io(&p, e))?;
            }
            self.prune(*c)?;
        }
        Ok(committed)
    }

    /// Loads and verifies the committed checkpoint (recovering a damaged `LATEST`, see
    /// [`Checkpoint::recovered_from`]). Holds the directory's lock shared while it reads, so
    /// no save prunes the version meanwhile. Leftovers of interrupted saves are ignored, and
    /// removed when no save or load is in progress and the directory is writable.
    pub fn load(&self) -> Result<Checkpoint> {
        let mut attempt = 0;
        let ckpt = loop {
            let lock = self.lock_shared();
            let res = self.committed().and_then(|c| {
                let (v, note) = c.ok_or_else(|| {
                    AmpError::checkpoint(
                        &self.root,
                        Kind::NotFound,
                        "no committed checkpoint (no LATEST file): save one first",
                    )
                })?;
                let mut ck = self.load_version(v)?;
                ck.recovered = note;
                Ok(ck)
            });
            let locked = lock.0.is_some();
            drop(lock);
            match res {
                // Without the lock a concurrent save may have pruned the version: read the
                // pointer again.
                Err(AmpError::Checkpoint {
                    kind: Kind::MissingFile | Kind::NotFound,
                    ..
                }) if !locked && attempt < 3 => attempt += 1,
                other => break other?,
            }
        };
        if let Ok(lock) = self.lock_file()
            && lock.try_lock().is_ok()
            && let Err(e) = self.clean_up_locked()
        {
            log::debug!("could not remove leftovers of interrupted saves: {e}");
        }
        Ok(ckpt)
    }

    /// Verifies one version's manifest and every file's size and checksum.
    fn verify(&self, v: u64) -> Result<Manifest> {
        let dir = self.root.join(version_name(v));
        let mpath = dir.join(MANIFEST);
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
        for name in FILES {
            let entry = manifest.files.iter().find(|f| f.name == name).ok_or_else(|| {
                AmpError::checkpoint(&mpath, Kind::Corrupt, format!("the manifest does not list {name}"))
            })?;
            let p = dir.join(name);
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
        let weights = Arc::new(map_safetensors(&dir.join(WEIGHTS))?);
        let buffers = Arc::new(map_safetensors(&dir.join(BUFFERS))?);
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
                            dir.join(BUFFERS),
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
        })
    }
}
