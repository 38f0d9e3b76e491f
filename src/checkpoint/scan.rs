//! What a checkpoint directory holds: versions, leftovers of interrupted saves, quarantined
//! versions, the committed version, and the moving aside of damaged versions.

use std::fs;
use std::path::PathBuf;

use super::{CheckpointDir, DAMAGED, LATEST, SkippedVersion};
use crate::error::{AmpError, CheckpointErrorKind as Kind, Result};
use crate::files::fsync_dir;

/// A version's directory name.
pub(super) fn version_name(n: u64) -> String {
    format!("v{n:08}")
}

/// The number of a version's directory name (`v` and 8 to 20 digits).
pub(super) fn parse_version(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('v')?;
    if digits.len() < 8 || digits.len() > 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The version number an entry is named after: a version, a quarantined version
/// (`vN.damaged`, `vN.damaged.2`) or a save's leftover (`vN.tmp`).
fn numbered(name: &str) -> Option<u64> {
    parse_version(name.split('.').next()?)
}

/// The directory's entries, sorted.
#[derive(Debug, Default)]
pub(super) struct Entries {
    /// Version numbers present.
    pub(super) versions: Vec<u64>,
    /// Leftovers of interrupted saves (`.tmp` files and directories).
    pub(super) tmp: Vec<PathBuf>,
    /// Versions moved aside as damaged.
    pub(super) quarantined: Vec<PathBuf>,
    /// The highest version number any entry is named after (0 when none is).
    pub(super) highest: u64,
}

/// What a look for the committed version found.
#[derive(Debug)]
pub(super) enum Search {
    /// No `LATEST`: nothing was ever committed.
    Nothing,
    /// The committed version.
    Found(Committed),
    /// `LATEST` is damaged (`damage` says how) and no version verifies: each, newest first,
    /// with what is wrong with it.
    NoneVerifies {
        damage: String,
        skipped: Vec<SkippedVersion>,
    },
}

/// The version a load reads, and how it was found.
#[derive(Debug)]
pub(super) struct Committed {
    pub(super) version: u64,
    /// When `LATEST` was damaged: what happened.
    pub(super) note: Option<String>,
    /// The newer versions passed over because they do not verify, newest first.
    pub(super) skipped: Vec<SkippedVersion>,
}

impl CheckpointDir {
    /// Everything in the directory named after a version, and the leftovers of saves.
    pub(super) fn scan(&self) -> Result<Entries> {
        let mut out = Entries::default();
        let rd = match fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(AmpError::io(&self.root, e)),
        };
        for entry in rd {
            let entry = entry.map_err(|e| AmpError::io(&self.root, e))?;
            let name = entry.file_name().to_string_lossy().to_string();
            out.highest = out.highest.max(numbered(&name).unwrap_or(0));
            if let Some(v) = parse_version(&name) {
                out.versions.push(v);
            } else if name.ends_with(".tmp") {
                out.tmp.push(entry.path());
            } else if numbered(&name).is_some() && name.contains(DAMAGED) {
                out.quarantined.push(entry.path());
            }
        }
        out.versions.sort_unstable();
        out.quarantined.sort();
        Ok(out)
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

    /// The committed version: the one `LATEST` names, or, when `LATEST` is damaged (no
    /// version name, or a version that is not there), the newest version that verifies,
    /// with a note saying so and the newer versions that did not verify. An error when
    /// `LATEST` is damaged and no version verifies. Reads only.
    pub(super) fn committed(&self) -> Result<Option<Committed>> {
        match self.search()? {
            Search::Nothing => Ok(None),
            Search::Found(c) => Ok(Some(c)),
            Search::NoneVerifies { damage, .. } => Err(AmpError::checkpoint(
                self.root.join(LATEST),
                Kind::Corrupt,
                format!("{damage}, and no version verifies"),
            )),
        }
    }

    /// What [`committed`](Self::committed) finds, the case of a damaged `LATEST` with no
    /// version that verifies included (a save then moves every version aside and starts
    /// afresh). Reads only.
    pub(super) fn search(&self) -> Result<Search> {
        let damage = match self.latest_version() {
            Ok(None) => return Ok(Search::Nothing),
            Ok(Some(v)) if self.root.join(version_name(v)).is_dir() => {
                return Ok(Search::Found(Committed {
                    version: v,
                    note: None,
                    skipped: Vec::new(),
                }));
            }
            Ok(Some(v)) => format!("it names {}, which is not there", version_name(v)),
            Err(
                e @ AmpError::Checkpoint {
                    kind: Kind::Corrupt, ..
                },
            ) => e.to_string(),
            Err(e) => return Err(e),
        };
        let mut skipped = Vec::new();
        for &v in self.scan()?.versions.iter().rev() {
            match self.verify(v) {
                Ok(_) => {
                    let note = self.recovery_note(&damage, v, &skipped);
                    log::warn!("{note}");
                    return Ok(Search::Found(Committed {
                        version: v,
                        note: Some(note),
                        skipped,
                    }));
                }
                Err(e) => skipped.push(SkippedVersion {
                    version: v,
                    path: self.root.join(version_name(v)),
                    kind: e.checkpoint_kind().unwrap_or(Kind::Corrupt),
                    reason: e.to_string(),
                }),
            }
        }
        Ok(Search::NoneVerifies { damage, skipped })
    }

    /// What a recovery from a damaged `LATEST` did, in words.
    fn recovery_note(&self, damage: &str, v: u64, skipped: &[SkippedVersion]) -> String {
        let mut note = format!(
            "{} was damaged ({damage}); recovered {}, the newest version that verifies",
            self.root.join(LATEST).display(),
            version_name(v)
        );
        if !skipped.is_empty() {
            let names: Vec<_> = skipped.iter().map(|s| version_name(s.version)).collect();
            note.push_str(&format!(
                "; passed over {} (damaged, left in place: the next save moves them aside to vN{DAMAGED})",
                names.join(", ")
            ));
        }
        note
    }

    /// Moves a damaged version aside to `vN.damaged` (`vN.damaged.2`, ... if that is
    /// taken), where pruning never removes it. Returns where it went.
    pub(super) fn quarantine(&self, v: u64) -> Result<PathBuf> {
        let from = self.root.join(version_name(v));
        let base = format!("{}{DAMAGED}", version_name(v));
        let to = (1..)
            .map(|i| match i {
                1 => self.root.join(&base),
                i => self.root.join(format!("{base}.{i}")),
            })
            .find(|p| !p.exists())
            .expect("an unbounded range has a free name");
        fs::rename(&from, &to).map_err(|e| AmpError::io(&from, e))?;
        fsync_dir(&self.root)?;
        log::warn!(
            "checkpoint {} does not verify: moved aside to {}",
            from.display(),
            to.display()
        );
        Ok(to)
    }

    /// The damaged versions that saves and [`clean_up`](Self::clean_up) moved aside
    /// (`vN.damaged`), sorted. Nothing removes them: delete them yourself once inspected.
    pub fn quarantined(&self) -> Result<Vec<PathBuf>> {
        Ok(self.scan()?.quarantined)
    }
}
