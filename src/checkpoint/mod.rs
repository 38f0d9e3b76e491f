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
//! DIR/v00000011.damaged/                a version that failed verification, moved aside
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
//! retries when its version vanishes). Saving keeps the last `keep` committed versions.
//!
//! A read never destroys data. A damaged `LATEST` is recovered from the newest version that
//! verifies, and the load says so ([`Checkpoint::recovered_from`]) and names every newer
//! version it passed over as damaged ([`Checkpoint::skipped_versions`]), leaving them where
//! they are: a load moves, rewrites and removes nothing (leftovers of interrupted saves
//! included). The next write (a save, or [`CheckpointDir::clean_up`]) moves each damaged
//! version aside to `vN.damaged` ([`CheckpointDir::quarantined`]), where no pruning ever
//! removes it, and a save always takes a number above every version it has seen (committed,
//! damaged, quarantined or left over), so a version number is never reused. When `LATEST`
//! and every version are damaged, a load fails, and the next save moves every version aside
//! and commits afresh: a save never fails for damage it finds, and never deletes a version.

mod dir;
mod scan;
mod sharded;
mod verify;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::amp::{Amp, AmpState};
use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};
use crate::files::Source;
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
/// The suffix of a damaged version moved aside.
const DAMAGED: &str = ".damaged";

pub use dir::CheckpointDir;

/// Tensors to write, by name.
type NamedSources = Vec<(String, Source<'static>)>;
/// The name of rank `rank`'s file of a sharded version: `weights.safetensors` becomes
/// `weights-00001-of-00002.safetensors` (as sharded safetensors are named elsewhere).
fn shard_file(file: &str, rank: usize, world: usize) -> String {
    let stem = file.strip_suffix(".safetensors").unwrap_or(file);
    format!("{stem}-{rank:05}-of-{world:05}.safetensors")
}

/// The tensor files of a version: one weights and one optimizer file, or, written by the
/// `shards` ranks of a ZeRO run, one of each per rank.
fn tensor_files(shards: Option<usize>) -> (Vec<String>, Vec<String>) {
    match shards {
        None => (vec![WEIGHTS.to_string()], vec![BUFFERS.to_string()]),
        Some(n) => (
            (0..n).map(|r| shard_file(WEIGHTS, r, n)).collect(),
            (0..n).map(|r| shard_file(BUFFERS, r, n)).collect(),
        ),
    }
}

/// Every file of a version, each listed in its manifest with size and CRC-32.
fn version_files(shards: Option<usize>) -> Vec<String> {
    let (mut files, buffers) = tensor_files(shards);
    files.extend(buffers);
    files.push(STATE.to_string());
    files
}

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
    skipped: Vec<SkippedVersion>,
}

/// A version that a load passed over because it does not verify: when `LATEST` is damaged,
/// the load falls back to the newest version that verifies and names every newer one here.
/// The load leaves it as it was; the next save (or [`CheckpointDir::clean_up`]) moves it
/// aside to `vN.damaged`, which no pruning removes ([`CheckpointDir::quarantined`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SkippedVersion {
    /// Its version number (`N` of `vN`), never reused by a later save.
    pub version: u64,
    /// Its directory, where the load left it.
    pub path: PathBuf,
    /// What verification found.
    pub kind: Kind,
    /// The verification error, in words.
    pub reason: String,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("origin", &self.origin)
            .field("step", &self.step)
            .field("optimizers", &self.optimizers.len())
            .field("recovered", &self.recovered)
            .field("skipped", &self.skipped)
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
    /// Refused on a rank of a ZeRO-sharded run ([`crate::error::DistErrorKind::Sharded`]).
    pub fn capture(amp: &Amp, optimizers: &[&AmpOptimizer], step: u64) -> Result<Self> {
        amp.run().check_whole_state("Checkpoint::capture")?;
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
            skipped: Vec::new(),
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

    /// The versions newer than this one that the load passed over because they do not
    /// verify (only when `LATEST` was damaged; empty otherwise), newest first. The load left
    /// them in place; see [`SkippedVersion`].
    pub fn skipped_versions(&self) -> &[SkippedVersion] {
        &self.skipped
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
