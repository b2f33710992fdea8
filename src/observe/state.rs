//! The state file: the allocator's memory across restarts when no Kubernetes API holds it
//! (`nodelb run --manifests DIR`), and a second source of stable ports otherwise.
//!
//! Format (JSON, so a human can read and fix it):
//! `{"version":1,"journal":3,"allocations":{"default/web":{"80/TCP":20001}},"since":{"default/web":"2025-01-01T00:00:00Z"}}`.
//! `since` is when this node first allocated the Service a port: manifests have no
//! creationTimestamp, so this is what "older" means in manifests mode ([`crate::core::decisions::alloc`]).
//! Decisions:
//! - `since` is an addition, not a new version: files of older nodelb versions (no `since`) load
//!   as they are, their Services are stamped with the time they are first read (logged once) and
//!   the stamp is written with the next save; an older nodelb reading a newer file ignores the
//!   unknown field (a rollback keeps every port). A `since` that is not an RFC 3339 time, or
//!   names a Service without allocations, is skipped with a warning like a bad entry.
//! - A missing file is an empty allocation (first start). A file that exists but cannot be read
//!   or parsed is an error naming the file: silently starting from scratch would move every
//!   port, so the caller decides (refuse to start, or log and continue).
//! - Unknown top-level fields are ignored (forward compatibility); an unknown `version` is an
//!   error (we cannot know what it means).
//! - A bad entry (a key that is not `namespace/name` of DNS-1123 labels, as an older nodelb could
//!   write for `metadata.name: a/b`; a bad port or node port; a port spelled twice) is skipped
//!   with a warning naming the file and the entry, and the rest is used: one bad line must not
//!   stop the agent (it did), and losing that one entry moves at most that Service's ports.
//! - [`StateFile::save`] is atomic: a temporary file in the same directory, written, fsynced,
//!   renamed over the target, then the directory fsynced, so a crash leaves the old or the new
//!   file, never a torn one. The directory is created when missing.
//! - The file is readable and writable by root only (mode 0600 whatever the umask, set before a
//!   byte is written; the directory 0700 when nodelb creates it): it lists every Service.
//! - **A change is a line appended to a journal** (`<file>.journal`, also 0600), not the file
//!   written whole ([`StateFile::save_change`]): one JSON line per Service whose entry changed,
//!   `{"service":"default/web","ports":{"80/TCP":20001},"since":"…"}`, or `{"service":"default/web"}`
//!   for one no longer allocated, then `{"end":K}` (K lines: a change is applied only whole, so a
//!   power cut or a short write in the middle of one leaves it out whole), then `fdatasync`. With
//!   many Services, writing and syncing the whole file is most of a one-Service sync
//!   (docs/benchmarks.md, "Design decisions, measured").
//!   The file is written whole instead when it is not there (the first allocations), and again
//!   (the journal removed) once the journal holds more
//!   lines than a quarter of the Services (at least [`MIN_JOURNAL_LINES`]), at start when a
//!   journal is there ([`StateFile::fold_journal`]), and at a clean shutdown, so the file a human
//!   reads is whole whenever the agent is not running after a clean stop.
//! - Loading reads the file, then replays the journal's lines in order. Each whole write gives
//!   the file a new number (`"journal": N`), and a journal starts with the number of the file it
//!   follows (`{"journal":N}`): a journal left by a crash between writing the file whole and
//!   removing it, or after any failed write, follows an older file and is not replayed (a line of
//!   it could undo a later change); a whole write is numbered above every number seen, in the
//!   file or a journal, so a journal left behind never follows a later write (after a rollback an
//!   older nodelb writes the file without a number). The journal is also folded once it passes 4
//!   MiB, whatever its lines. After a failed write the next change writes the file whole.
//!   A line that is not valid (a torn last line: the crash came while it was written, before
//!   anything was programmed with it) is skipped with a warning naming the journal and the line,
//!   like a bad entry. An older nodelb ignores the journal (and the number): after a rollback
//!   from a crash (not a clean stop) the changes since the file was last written whole are
//!   allocated anew.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use k8s_openapi::jiff::Timestamp;

use crate::core::decisions::alloc::Allocations;
use crate::core::domain::{PortId, ServiceKey};

pub const STATE_VERSION: u32 = 1;

/// Largest state file (and journal) read (16 MiB, far more than a cluster's Services take): a
/// larger one is not one nodelb wrote, and is an error rather than a read of whatever size into
/// memory.
pub const MAX_STATE_BYTES: u64 = 16 << 20;

/// The journal is folded into the file once it holds more lines than a quarter of the Services,
/// and never before it holds this many: a full write per that many changes is a small share.
pub const MIN_JOURNAL_LINES: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state file {path}: cannot read: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// `message`: serde_json's, which quotes what it refuses, cut to 1 KiB.
    #[error("state file {path}: not valid JSON of the expected shape: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("state file {path}: unsupported version {version} (this nodelb understands {STATE_VERSION})")]
    Version { path: PathBuf, version: u32 },
    #[error("state file {path}: bad entry {}: {reason}", crate::core::domain::quoted(.entry))]
    Entry { path: PathBuf, entry: String, reason: String },
    #[error("state file {path}: cannot write: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("state journal {path}: line {line}: {reason}")]
    JournalLine { path: PathBuf, line: usize, reason: String },
}

/// One journal line: a Service's whole entry after a change; no `ports`: not allocated.
#[derive(serde::Serialize, serde::Deserialize)]
struct JournalLine<'a> {
    #[serde(borrow)]
    service: std::borrow::Cow<'a, str>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ports: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    since: Option<String>,
}

/// On-disk shape; keys are the human spellings `namespace/name` and `80/TCP`. Read with JSON values
/// (checked entry by entry on load, a bad one is skipped, not a parse error); written straight
/// from the [`State`] ([`OnDiskOut`]).
#[derive(serde::Deserialize)]
struct OnDisk {
    version: u32,
    #[serde(default = "BTreeMap::new")]
    allocations: BTreeMap<String, serde_json::Value>,
    /// Allocation time per Service (RFC 3339); absent in files of older versions.
    #[serde(default = "BTreeMap::new")]
    since: BTreeMap<String, serde_json::Value>,
    /// The number of this whole write: the journal that follows it starts with it.
    #[serde(default)]
    journal: u64,
}

/// A journal's first line: the number of the file it follows.
#[derive(serde::Serialize, serde::Deserialize)]
struct JournalHeader {
    journal: u64,
}

/// The line that ends one change's lines (`{"end":K}`: K lines): a change is applied only whole.
#[derive(serde::Serialize, serde::Deserialize)]
struct JournalEnd {
    end: usize,
}

/// A journal is folded into the file once it is this large, whatever its lines.
const MAX_JOURNAL_BYTES: u64 = MAX_STATE_BYTES / 4;

/// [`OnDisk`] as written, serialized from the state as it is (in its key order), with no map of
/// strings built first: building one would be a large share of every save.
struct OnDiskOut<'a>(&'a State, u64);

impl serde::Serialize for OnDiskOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let state = self.0;
        let fields = if state.since.is_empty() { 3 } else { 4 };
        let mut out = s.serialize_struct("OnDisk", fields)?;
        out.serialize_field("version", &STATE_VERSION)?;
        out.serialize_field("journal", &self.1)?;
        out.serialize_field("allocations", &AllocationsOut(&state.allocations))?;
        if !state.since.is_empty() {
            out.serialize_field("since", &SinceOut(&state.since))?;
        }
        out.end()
    }
}

struct AllocationsOut<'a>(&'a Allocations);

impl serde::Serialize for AllocationsOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, ports)| (Display(k), PortsOut(ports))))
    }
}

struct PortsOut<'a>(&'a BTreeMap<PortId, u16>);

impl serde::Serialize for PortsOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(id, n)| (Display(id), n)))
    }
}

struct SinceOut<'a>(&'a BTreeMap<ServiceKey, Timestamp>);

impl serde::Serialize for SinceOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, t)| (Display(k), Display(t))))
    }
}

/// A value written as its `Display`.
struct Display<T>(T);

impl<T: std::fmt::Display> serde::Serialize for Display<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

/// What the state file holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    pub allocations: Allocations,
    /// When this node first allocated each Service a port. A Service of `allocations` without
    /// one comes from a file of an older version (see [`State::stamp`]).
    pub since: BTreeMap<ServiceKey, Timestamp>,
}

impl State {
    /// The state after a sync: `allocations`, with the time of every Service that had one kept
    /// and `now` for the others (new allocations, and entries migrated from an older file).
    /// Services no longer allocated lose theirs. Pure.
    pub fn stamp(&self, allocations: Allocations, now: Timestamp) -> State {
        // Both in key order: one walk, no lookup per Service.
        let mut old = self.since.iter().peekable();
        let since = (allocations.keys())
            .map(|k| {
                while old.next_if(|(o, _)| *o < k).is_some() {}
                (k.clone(), old.peek().filter(|(o, _)| *o == k).map_or(now, |(_, t)| **t))
            })
            .collect();
        State { allocations, since }
    }

    /// The allocation time of `key` as [`crate::core::inputs::model::LbService::allocated_since`] carries it.
    pub fn since_of(&self, key: &ServiceKey) -> Option<String> {
        self.since.get(key).map(|t| t.to_string())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFile {
    path: PathBuf,
    /// Lines in the journal that follows the file, as far as this process knows (counted at
    /// load, then appended); 0: the next line starts a new journal.
    journal_lines: usize,
    /// The number of the file's last whole write (0: none, or a file of an older version).
    written: u64,
    /// The highest number seen in the file or a journal's first line: the next whole write is
    /// numbered above it, so no journal left behind can follow it.
    highest: u64,
    /// Bytes in the journal, as far as this process knows.
    journal_bytes: u64,
    /// A write failed: what the file and journal hold is not known, the next change writes the
    /// file whole.
    whole_due: bool,
}

impl StateFile {
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile {
            path: path.into(),
            journal_lines: 0,
            written: 0,
            highest: 0,
            journal_bytes: 0,
            whole_due: false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `<file>.journal`, next to the file.
    pub fn journal_path(&self) -> PathBuf {
        let mut name = self.path.as_os_str().to_owned();
        name.push(".journal");
        PathBuf::from(name)
    }

    /// The saved state; empty when the file does not exist. Bad entries are skipped and logged
    /// (see [`StateFile::load_lenient`]).
    pub fn load(&mut self) -> Result<State, StateError> {
        let (state, skipped) = self.load_lenient()?;
        for e in &skipped {
            tracing::warn!("{e}; skipping it (its ports are allocated anew)");
        }
        Ok(state)
    }

    /// The saved state and the entries skipped as bad (each a [`StateError::Entry`]). Only a
    /// file that cannot be read or parsed as a whole, or has another version, is an error.
    pub fn load_lenient(&mut self) -> Result<(State, Vec<StateError>), StateError> {
        // The journal is read before the file, for a reader beside a running agent (`nodelb
        // plan`): a fold between the two reads then leaves a journal that follows an older write
        // than the file read, which holds its changes; read after the file, the journal would be
        // gone (or a new one) and its changes missing from what was read.
        let journal = self.read_journal()?;
        self.load_with(journal)
    }

    /// The journal's text; `None` when there is none.
    fn read_journal(&self) -> Result<Option<String>, StateError> {
        read_if_there(&self.journal_path())
    }

    /// [`StateFile::load_lenient`] with the journal read before.
    fn load_with(&mut self, journal: Option<String>) -> Result<(State, Vec<StateError>), StateError> {
        let Some(text) = read_if_there(&self.path)? else {
            // A journal without its file follows nothing (it is not replayed).
            let (mut state, mut skipped) = (State::default(), Vec::new());
            self.written = 0;
            self.replay_journal(journal, &mut state, &mut skipped);
            return Ok((state, skipped));
        };
        let disk: OnDisk = serde_json::from_str(&text).map_err(|e| {
            let message = e.to_string();
            let message = match message.len() > 1024 {
                true => format!("{}… ({} bytes)", crate::core::domain::cut(&message, 1024), message.len()),
                false => message,
            };
            StateError::Parse { path: self.path.clone(), message }
        })?;
        if disk.version != STATE_VERSION {
            return Err(StateError::Version { path: self.path.clone(), version: disk.version });
        }
        let mut out = Allocations::new();
        let mut skipped = Vec::new();
        let mut bad = |entry: String, reason: String| {
            skipped.push(StateError::Entry { path: self.path.clone(), entry, reason })
        };
        for (service, ports) in disk.allocations {
            let key: ServiceKey = match service.parse() {
                Ok(key) => key,
                Err(crate::core::domain::ParseError(reason)) => {
                    bad(service, reason);
                    continue;
                }
            };
            let Some(map) = parse_ports(&service, ports, &mut bad) else { continue };
            // Distinct strings that parse are distinct keys (parsing does not normalise).
            out.insert(key, map);
        }
        let mut since = BTreeMap::new();
        for (service, value) in disk.since {
            let entry = format!("since {service}");
            let time = value.as_str().and_then(|v| v.parse::<Timestamp>().ok());
            match (service.parse::<ServiceKey>(), time) {
                (Ok(key), Some(t)) if out.contains_key(&key) => {
                    since.insert(key, t);
                }
                (Ok(_), Some(_)) => bad(entry, "names a Service without allocations".to_string()),
                (Err(crate::core::domain::ParseError(reason)), _) => bad(entry, reason),
                (Ok(_), None) => bad(entry, format!("{value} is not an RFC 3339 time")),
            }
        }
        let mut state = State { allocations: out, since };
        self.written = disk.journal;
        self.highest = self.highest.max(disk.journal);
        self.replay_journal(journal, &mut state, &mut skipped);
        Ok((state, skipped))
    }

    /// Applies the journal's lines to `state` in order (none when there is no journal, or it
    /// follows another write of the file: named in `skipped`); a line that is not valid is
    /// skipped (named in `skipped`). Counts the lines.
    fn replay_journal(&mut self, text: Option<String>, state: &mut State, skipped: &mut Vec<StateError>) {
        (self.journal_lines, self.journal_bytes) = (0, 0);
        let path = self.journal_path();
        // Empty: a crash between starting a new journal and writing its first line.
        let Some(text) = text.filter(|t| !t.is_empty()) else { return };
        let torn = !text.ends_with('\n');
        let mut lines: Vec<&str> = text.lines().collect();
        let follows = lines.first().and_then(|l| serde_json::from_str::<JournalHeader>(l).ok());
        if let Some(h) = &follows {
            self.highest = self.highest.max(h.journal);
        }
        let replayed = follows.as_ref().is_some_and(|h| self.written > 0 && h.journal == self.written);
        if !replayed {
            let reason = match follows {
                Some(h) => format!(
                    "follows write {} of the file, which is write {}: not replayed (it does not follow this file)",
                    h.journal, self.written
                ),
                None => "does not start with the number of the file it follows: not replayed".into(),
            };
            skipped.push(StateError::JournalLine { path, line: 1, reason });
            return;
        }
        lines.remove(0);
        self.journal_lines = lines.len();
        self.journal_bytes = text.len() as u64;
        // A change's lines are applied when its end line is read: a crash in the middle of one
        // (a power cut before the sync, a short write) leaves it out whole. `None`: not allocated.
        type Entry = Option<(BTreeMap<PortId, u16>, Option<Timestamp>)>;
        let mut pending: Vec<(ServiceKey, Entry)> = Vec::new();
        let mut first_pending = None;
        for (i, line) in lines.iter().enumerate() {
            if serde_json::from_str::<JournalEnd>(line).is_ok() {
                for (key, entry) in pending.drain(..) {
                    match entry {
                        None => {
                            state.allocations.remove(&key);
                            state.since.remove(&key);
                        }
                        Some((ports, since)) => {
                            match since {
                                Some(t) => drop(state.since.insert(key.clone(), t)),
                                None => drop(state.since.remove(&key)),
                            }
                            state.allocations.insert(key, ports);
                        }
                    }
                }
                first_pending = None;
                continue;
            }
            first_pending.get_or_insert(i);
            let mut reasons = Vec::new();
            let mut bad = |entry: String, reason: String| reasons.push(format!("{entry}: {reason}"));
            match serde_json::from_str::<JournalLine<'_>>(line) {
                Err(e) if torn && i + 1 == lines.len() => {
                    bad("last line".into(), format!("not written whole (a crash while it was written): {e}"))
                }
                Err(e) => bad(crate::core::domain::cut(line, 200).to_string(), e.to_string()),
                Ok(entry) => match entry.service.parse::<ServiceKey>() {
                    Err(crate::core::domain::ParseError(reason)) => bad(entry.service.to_string(), reason),
                    Ok(key) => match entry.ports {
                        None => pending.push((key, None)),
                        Some(ports) => {
                            if let Some(map) = parse_ports(&entry.service, ports, &mut bad) {
                                let time = entry.since.as_deref().and_then(|t| t.parse::<Timestamp>().ok());
                                if let (Some(t), None) = (&entry.since, time) {
                                    bad(format!("since {key}"), format!("{t:?} is not an RFC 3339 time"));
                                }
                                pending.push((key, Some((map, time))));
                            }
                        }
                    },
                },
            }
            skipped.extend(reasons.into_iter().map(|reason| StateError::JournalLine {
                path: path.clone(),
                line: i + 2,
                reason,
            }));
        }
        if let Some(i) = first_pending {
            let reason =
                "a change without its end line (a crash while it was written): not applied".to_string();
            skipped.push(StateError::JournalLine { path, line: i + 2, reason });
        }
    }

    /// Records the change from `prev` (what the file and journal hold) to `next`: one journal
    /// line per Service whose entry differs, appended and synced; or, once the journal is long
    /// enough, the file written whole ([`StateFile::save`]). Nothing when nothing differs.
    pub fn save_change(&mut self, prev: &State, next: &State) -> Result<(), StateError> {
        // After a failed write the files may hold neither side: written whole, changed or not.
        if self.whole_due {
            return self.save(next);
        }
        let lines = journal_lines(prev, next);
        if lines.is_empty() {
            return Ok(());
        }
        // No file yet (the first allocations), or something else where it goes: written whole,
        // so that there is one from the first allocation on, or the error shows now, not at the
        // next start.
        let limit = (next.allocations.len() / 4).max(MIN_JOURNAL_LINES);
        if self.written == 0
            || self.journal_lines + lines.len() > limit
            || self.journal_bytes > MAX_JOURNAL_BYTES
            || !self.path.is_file()
        {
            return self.save(next);
        }
        let path = self.journal_path();
        let mut text = String::new();
        let start = self.journal_lines == 0;
        if start {
            let header = serde_json::to_string(&JournalHeader { journal: self.written }).unwrap_or_default();
            text.push_str(&header);
            text.push('\n');
        }
        for line in &lines {
            text.push_str(line);
            text.push('\n');
        }
        text.push_str(&serde_json::to_string(&JournalEnd { end: lines.len() }).unwrap_or_default());
        text.push('\n');
        if let Err(source) = append_synced(&path, text.as_bytes(), start) {
            self.whole_due = true;
            return Err(StateError::Write { path, source });
        }
        self.journal_lines += lines.len() + 1;
        self.journal_bytes += text.len() as u64;
        Ok(())
    }

    /// A write failed: the next [`StateFile::save_change`] writes the file whole, even when
    /// nothing changed.
    pub fn write_due(&self) -> bool {
        self.whole_due
    }

    /// Writes the file whole when a journal is there (at start and at a clean shutdown: what a
    /// human reads is whole again, and the journal starts empty).
    pub fn fold_journal(&mut self, state: &State) -> Result<(), StateError> {
        match self.whole_due || self.journal_lines > 0 || self.journal_path().exists() {
            true => self.save(state),
            false => Ok(()),
        }
    }

    /// Replaces the file atomically with `state`, as a new numbered write, then removes the
    /// journal (it follows the write before: never replayed over this one, even when a crash
    /// leaves it).
    pub fn save(&mut self, state: &State) -> Result<(), StateError> {
        // Above every number seen: a journal left behind never follows this write.
        let written = self.written.max(self.highest) + 1;
        let mut text = serde_json::to_string_pretty(&OnDiskOut(state, written))
            .map_err(|e| StateError::Write { path: self.path.clone(), source: io::Error::other(e) })?;
        text.push('\n');
        if let Err(source) = self.write_atomically(text.as_bytes()) {
            self.whole_due = true;
            return Err(StateError::Write { path: self.path.clone(), source });
        }
        (self.written, self.highest, self.journal_lines, self.journal_bytes, self.whole_due) =
            (written, written, 0, 0, false);
        let journal = self.journal_path();
        match fs::remove_file(&journal) {
            // Not needed for correctness (a journal left follows an older write), but a removed
            // journal that comes back after a power cut is a warning at the next start.
            Ok(()) => {
                let _ = sync_dir(&journal);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            // Left, it follows an older write and is not replayed; the next line starts anew.
            Err(e) => {
                tracing::warn!(journal = %journal.display(), error = %e, "cannot remove the state journal")
            }
        }
        Ok(())
    }

    fn write_atomically(&self, bytes: &[u8]) -> io::Result<()> {
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let file_name = self
            .path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        // Hidden, pid-suffixed: never picked up as a manifest, never shared by two processes.
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(file_name);
        tmp_name.push(format!(".tmp.{}", std::process::id()));
        let tmp = dir.join(tmp_name);
        let result = (|| {
            // Created new, never through a link someone planted there: a file a crash left is
            // removed first (an unlink removes a link, not what it points to).
            match fs::remove_file(&tmp) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            // A temporary file left by a crash keeps its mode through `open`: set it.
            f.set_permissions(fs::Permissions::from_mode(0o600))?;
            f.write_all(bytes)?;
            f.sync_all()?;
            drop(f);
            fs::rename(&tmp, &self.path)?;
            // The rename is durable only once the directory entry is.
            sync_dir(&self.path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }
}

/// The text of the file at `path` (bounded); `None` when there is none.
fn read_if_there(path: &Path) -> Result<Option<String>, StateError> {
    match crate::observe::bounded::read_own(path, MAX_STATE_BYTES) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(StateError::Read { path: path.to_path_buf(), source }),
    }
}

/// Checks one Service's `{"80/TCP": 20001, …}`; bad ports go to `bad` (entry, reason) and are
/// left out; `None` when it is not an object at all.
fn parse_ports(
    service: &str,
    ports: serde_json::Value,
    bad: &mut impl FnMut(String, String),
) -> Option<BTreeMap<PortId, u16>> {
    let serde_json::Value::Object(ports) = ports else {
        bad(service.to_string(), format!("{ports} is not an object of PORT/PROTOCOL: NODEPORT"));
        return None;
    };
    let mut map = BTreeMap::new();
    for (port, node) in ports {
        let entry = format!("{service}: {port}");
        let id: PortId = match port.parse() {
            Ok(id) => id,
            Err(crate::core::domain::ParseError(reason)) => {
                bad(entry, reason);
                continue;
            }
        };
        let Some(node) = node.as_u64().and_then(|n| u16::try_from(n).ok()).filter(|n| *n != 0) else {
            bad(entry, format!("node port {node} is out of range 1-65535"));
            continue;
        };
        // "80/TCP" and "80/tcp" are one port; two spellings are a hand edit gone wrong. The
        // first one read is kept.
        if map.contains_key(&id) {
            bad(entry, "port listed twice (another spelling of it is used)".to_string());
            continue;
        }
        map.insert(id, node);
    }
    Some(map)
}

/// One Service's entry as the journal compares it: its ports and allocation time.
type Entry<'a> = (&'a ServiceKey, &'a BTreeMap<PortId, u16>, Option<&'a Timestamp>);

/// A state's entries in key order, each with its time (the times' keys are a subset of the
/// allocations' keys: one walk of both).
fn entries(state: &State) -> impl Iterator<Item = Entry<'_>> {
    let mut since = state.since.iter().peekable();
    state.allocations.iter().map(move |(k, ports)| {
        while since.next_if(|(s, _)| *s < k).is_some() {}
        (k, ports, since.peek().filter(|(s, _)| *s == k).map(|(_, t)| *t))
    })
}

/// The journal lines that bring `prev` to `next`: one per Service whose entry differs, in key
/// order. One merge walk of both.
fn journal_lines(prev: &State, next: &State) -> Vec<String> {
    let set = |(k, ports, since): Entry<'_>| {
        let line = JournalLine {
            service: k.to_string().into(),
            ports: serde_json::to_value(PortsOut(ports)).ok(),
            since: since.map(|t| t.to_string()),
        };
        serde_json::to_string(&line).unwrap_or_default()
    };
    let gone = |k: &ServiceKey| {
        serde_json::to_string(&JournalLine { service: k.to_string().into(), ports: None, since: None })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    let mut old = entries(prev).peekable();
    for new in entries(next) {
        while let Some(o) = old.next_if(|o| o.0 < new.0) {
            out.push(gone(o.0));
        }
        match old.next_if(|o| o.0 == new.0) {
            Some(o) if o == new => {}
            _ => out.push(set(new)),
        }
    }
    out.extend(old.map(|o| gone(o.0)));
    out
}

/// Appends `bytes` to `path` (created 0600 when missing, its directory entry then synced; made
/// empty first when `start`) and syncs its data.
fn append_synced(path: &Path, bytes: &[u8], start: bool) -> io::Result<()> {
    let created = fs::symlink_metadata(path).is_err();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    // Never through a link in the journal's place; a new one is created exclusively.
    let mut f = fs::OpenOptions::new()
        .append(true)
        .create_new(created)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    if start {
        f.set_len(0)?;
    }
    f.set_permissions(fs::Permissions::from_mode(0o600))?;
    f.write_all(bytes)?;
    f.sync_data()?;
    if created {
        sync_dir(path)?;
    }
    Ok(())
}

/// Syncs the directory holding `path`: a new, renamed or removed entry is durable only then.
fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests;
