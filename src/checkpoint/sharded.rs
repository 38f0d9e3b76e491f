//! Sharded versions: each rank of a ZeRO run writes the f32 weights and optimizer buffers of
//! its own shard (`weights-00001-of-00002.safetensors`, `optimizer-00001-of-00002.safetensors`)
//! into the version's `.tmp` directory; rank 0 numbers the version, writes the shared state
//! (scalers, generators, counters, every rank's per-parameter records) and the manifest over
//! every file, and commits it as a one-process save does. No rank ever holds another's
//! shard. Loading maps every rank's files as one set, so any world size (or one process)
//! restores it and keeps what its own partition needs.

use std::path::PathBuf;

use super::dir::NewVersion;
use super::{BUFFERS, CheckpointDir, OptimizerRecord, StateFile, WEIGHTS, buffer_key, record_of, shard_file};
use crate::amp::Amp;
use crate::comm::Communicator;
use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};
use crate::files::{Source, write_sources};
use crate::precision::store::ParamKind;
use crate::train::optim::AmpOptimizer;

/// A rank's answer in the exchanges of a collective save: `1` and a payload, or `0` and an
/// error's text.
fn answer(r: std::result::Result<Vec<u8>, String>) -> Vec<u8> {
    match r {
        Ok(mut b) => {
            b.insert(0, 1);
            b
        }
        Err(e) => {
            let mut b = vec![0];
            b.extend(e.into_bytes());
            b
        }
    }
}

/// The payload of an answer, or the error's text.
fn read_answer(b: &[u8]) -> std::result::Result<&[u8], String> {
    match b.split_first() {
        Some((1, rest)) => Ok(rest),
        Some((_, rest)) => Err(String::from_utf8_lossy(rest).into_owned()),
        None => Err("no answer".into()),
    }
}

impl CheckpointDir {
    /// The collective save of a sharded run: every rank of `comm` calls it with the same
    /// `step`; `owns` says which trainable parameters are this rank's (their f32 values and
    /// optimizer buffers are written here; rank 0 also writes the parameters no rank owns
    /// and the buffers such as batch-norm statistics). Every rank returns the version's
    /// directory, or an error when any rank failed (the version is then not committed).
    pub(crate) fn save_sharded(
        &self,
        amp: &Amp,
        optimizers: &[&AmpOptimizer],
        step: u64,
        extra: serde_json::Value,
        comm: &dyn Communicator,
        owns: &dyn Fn(&str) -> Option<bool>,
    ) -> Result<PathBuf> {
        // A diverged run's weights mix two steps: nothing of it is worth saving.
        amp.run().check_not_diverged("DataParallel::save_checkpoint")?;
        let (rank, world) = (comm.rank(), comm.world_size());
        // 1. Rank 0 takes the lock, numbers the version and makes its directory.
        let mut begun: Option<NewVersion> = None;
        let mut own_err = None;
        let mut msg = Vec::new();
        if rank == 0 {
            msg = answer(match self.begin_version() {
                Ok(v) => {
                    let n = v.n.to_le_bytes().to_vec();
                    begun = Some(v);
                    Ok(n)
                }
                Err(e) => {
                    let text = e.to_string();
                    own_err = Some(e);
                    Err(text)
                }
            });
        }
        comm.broadcast_bytes(&mut msg, 0)?;
        let n = match read_answer(&msg) {
            Ok(b) if b.len() == 8 => u64::from_le_bytes(b.try_into().expect("8 bytes")),
            Ok(_) => {
                return Err(AmpError::checkpoint(
                    &self.root,
                    Kind::Io,
                    "rank 0 sent no version number",
                ));
            }
            Err(text) => {
                return Err(own_err.unwrap_or_else(|| {
                    AmpError::checkpoint(
                        &self.root,
                        Kind::Io,
                        format!("rank 0 could not start the sharded save: {text}"),
                    )
                }));
            }
        };
        let tmp = self.root.join(format!("{}.tmp", super::scan::version_name(n)));

        // 2. Every rank writes its shard and sends its records (or its error) to the others.
        let mine = self.write_shard(amp, optimizers, &tmp, rank, world, owns);
        let payload = answer(match &mine {
            Ok(records) => serde_json::to_vec(records).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        });
        let mut all = Vec::with_capacity(world);
        for r in 0..world {
            let mut b = if r == rank { payload.clone() } else { Vec::new() };
            comm.broadcast_bytes(&mut b, r)?;
            all.push(b);
        }
        let failed = all
            .iter()
            .enumerate()
            .find_map(|(r, b)| read_answer(b).err().map(|t| (r, t)));
        if let Some((r, text)) = failed {
            if let Some(v) = begun {
                v.abandon();
            }
            return Err(match mine {
                Err(e) => e,
                Ok(_) => AmpError::checkpoint(
                    &tmp,
                    Kind::Io,
                    format!("rank {r} could not write its shard, nothing was committed: {text}"),
                ),
            });
        }

        // 3. Rank 0 merges the records, writes the state and commits; everyone learns how it went.
        let done = begun.map(|v| {
            merge_records(&all).and_then(|optimizers| {
                let state = StateFile {
                    step,
                    amp: amp.state_dict_without_weights(),
                    optimizers,
                    extra,
                };
                self.finish_version(v, &state, Some(world))
            })
        });
        share_outcome(comm, done, &tmp, "commit the sharded save")
    }

    /// The collective save of an unsharded run: rank 0 saves as [`CheckpointDir::save`]
    /// does while the others wait, and every rank returns its outcome.
    pub(crate) fn save_on_rank0(
        &self,
        amp: &Amp,
        optimizers: &[&AmpOptimizer],
        step: u64,
        extra: serde_json::Value,
        comm: &dyn Communicator,
    ) -> Result<PathBuf> {
        amp.run().check_not_diverged("DataParallel::save_checkpoint")?;
        let done = (comm.rank() == 0).then(|| self.save(amp, optimizers, step, extra));
        share_outcome(comm, done, &self.root, "save the checkpoint")
    }

    /// Writes this rank's two files of a sharded version into `tmp`; returns its records
    /// (per optimizer, the parameters whose state it wrote).
    fn write_shard(
        &self,
        amp: &Amp,
        optimizers: &[&AmpOptimizer],
        tmp: &std::path::Path,
        rank: usize,
        world: usize,
        owns: &dyn Fn(&str) -> Option<bool>,
    ) -> Result<Vec<OptimizerRecord>> {
        let mut weights = Vec::new();
        for p in amp.store().params() {
            let mine = match p.kind() {
                ParamKind::Trainable => owns(p.name()).unwrap_or(rank == 0),
                _ => rank == 0,
            };
            if mine {
                weights.push((p.name().to_string(), Source::Tensor(p.f32_value()?.detach())));
            }
        }
        let mut buffers = Vec::new();
        let mut records = Vec::new();
        for (i, o) in optimizers.iter().enumerate() {
            let mut record = record_of(&o.state_meta()?);
            for pb in o.param_buffers()? {
                if owns(&pb.param) == Some(false) {
                    // Left from before the run was sharded: its owner writes it.
                    continue;
                }
                let names = pb.buffers.iter().map(|(k, _)| k.clone()).collect();
                record.params.insert(pb.param.clone(), (pb.step, names));
                for (k, v) in pb.buffers {
                    buffers.push((buffer_key(i, &pb.param, &k), Source::Values(v, pb.shape.clone())));
                }
            }
            records.push(record);
        }
        write_sources(&weights, &tmp.join(shard_file(WEIGHTS, rank, world)))?;
        write_sources(&buffers, &tmp.join(shard_file(BUFFERS, rank, world)))?;
        Ok(records)
    }
}

/// Tells every rank how rank 0's part of a collective save went (`done`: rank 0's result,
/// `None` on the others): every rank returns the version's directory, or the failure (on
/// the others a checkpoint error at `at` saying rank 0 could not `what`).
fn share_outcome(
    comm: &dyn Communicator,
    done: Option<Result<PathBuf>>,
    at: &std::path::Path,
    what: &str,
) -> Result<PathBuf> {
    let mut outcome = match &done {
        Some(Ok(p)) => answer(Ok(p.to_string_lossy().into_owned().into_bytes())),
        Some(Err(e)) => answer(Err(e.to_string())),
        None => Vec::new(),
    };
    comm.broadcast_bytes(&mut outcome, 0)?;
    if let Some(done) = done {
        return done;
    }
    match read_answer(&outcome) {
        Ok(p) => Ok(PathBuf::from(String::from_utf8_lossy(p).into_owned())),
        Err(text) => Err(AmpError::checkpoint(
            at,
            Kind::Io,
            format!("rank 0 could not {what}: {text}"),
        )),
    }
}

/// Rank 0's records (groups, counters: the same on every rank) with every rank's
/// per-parameter entries.
fn merge_records(all: &[Vec<u8>]) -> Result<Vec<OptimizerRecord>> {
    let bad = |e: String| AmpError::checkpoint("(sharded save)", Kind::Corrupt, e);
    let mut merged: Option<Vec<OptimizerRecord>> = None;
    for (r, b) in all.iter().enumerate() {
        let records: Vec<OptimizerRecord> = serde_json::from_slice(read_answer(b).map_err(bad)?)
            .map_err(|e| bad(format!("rank {r}'s records: {e}")))?;
        match &mut merged {
            None => merged = Some(records),
            Some(m) => {
                if m.len() != records.len() {
                    return Err(bad(format!(
                        "rank {r} saved {} optimizer(s), rank 0 saved {}: pass the same optimizers on every rank",
                        records.len(),
                        m.len()
                    )));
                }
                for (m, rec) in m.iter_mut().zip(records) {
                    m.params.extend(rec.params);
                }
            }
        }
    }
    Ok(merged.unwrap_or_default())
}
