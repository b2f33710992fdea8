//! The state file: the allocator's memory across restarts when no Kubernetes API holds it
//! (`nodelb run --manifests DIR`), and a second source of stable ports otherwise.
//!
//! Format (JSON, so a human can read and fix it):
//! `{"version":1,"allocations":{"default/web":{"80/TCP":20001}},"since":{"default/web":"2025-01-01T00:00:00Z"}}`.
//! `since` is when this node first allocated the Service a port: manifests have no
//! creationTimestamp, so this is what "older" means in manifests mode ([`crate::alloc`]).
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

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use k8s_openapi::jiff::Timestamp;

use crate::alloc::Allocations;
use crate::domain::{PortId, ServiceKey};

pub const STATE_VERSION: u32 = 1;

/// Largest state file read (16 MiB; 10,000 Services take about 1 MB): a larger one is not one
/// nodelb wrote, and is an error rather than a read of whatever size into memory.
pub const MAX_STATE_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state file {path}: cannot read: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// `message`: serde_json's, which quotes what it refuses, cut to 1 KiB.
    #[error("state file {path}: not valid JSON of the expected shape: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("state file {path}: unsupported version {version} (this nodelb understands {STATE_VERSION})")]
    Version { path: PathBuf, version: u32 },
    #[error("state file {path}: bad entry {}: {reason}", crate::domain::quoted(.entry))]
    Entry { path: PathBuf, entry: String, reason: String },
    #[error("state file {path}: cannot write: {source}")]
    Write { path: PathBuf, source: io::Error },
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
}

/// [`OnDisk`] as written, serialized from the state as it is (in its key order), with no map of
/// strings built first: at 50,000 Services building one was half of a save.
struct OnDiskOut<'a>(&'a State);

impl serde::Serialize for OnDiskOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let state = self.0;
        let fields = if state.since.is_empty() { 2 } else { 3 };
        let mut out = s.serialize_struct("OnDisk", fields)?;
        out.serialize_field("version", &STATE_VERSION)?;
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

    /// The allocation time of `key` as [`crate::model::LbService::allocated_since`] carries it.
    pub fn since_of(&self, key: &ServiceKey) -> Option<String> {
        self.since.get(key).map(|t| t.to_string())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The saved state; empty when the file does not exist. Bad entries are skipped and logged
    /// (see [`StateFile::load_lenient`]).
    pub fn load(&self) -> Result<State, StateError> {
        let (state, skipped) = self.load_lenient()?;
        for e in &skipped {
            tracing::warn!("{e}; skipping it (its ports are allocated anew)");
        }
        Ok(state)
    }

    /// The saved state and the entries skipped as bad (each a [`StateError::Entry`]). Only a
    /// file that cannot be read or parsed as a whole, or has another version, is an error.
    pub fn load_lenient(&self) -> Result<(State, Vec<StateError>), StateError> {
        let text = match crate::observe::bounded::read_to_string(&self.path, MAX_STATE_BYTES) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((State::default(), vec![])),
            Err(source) => {
                return Err(StateError::Read { path: self.path.clone(), source });
            }
        };
        let disk: OnDisk = serde_json::from_str(&text).map_err(|e| {
            let message = e.to_string();
            let message = match message.len() > 1024 {
                true => format!("{}… ({} bytes)", crate::domain::cut(&message, 1024), message.len()),
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
                Err(crate::domain::ParseError(reason)) => {
                    bad(service, reason);
                    continue;
                }
            };
            let serde_json::Value::Object(ports) = ports else {
                bad(service, format!("{ports} is not an object of PORT/PROTOCOL: NODEPORT"));
                continue;
            };
            let mut map = BTreeMap::new();
            for (port, node) in ports {
                let entry = format!("{service}: {port}");
                let id: PortId = match port.parse() {
                    Ok(id) => id,
                    Err(crate::domain::ParseError(reason)) => {
                        bad(entry, reason);
                        continue;
                    }
                };
                let Some(node) = node.as_u64().and_then(|n| u16::try_from(n).ok()).filter(|n| *n != 0) else {
                    bad(entry, format!("node port {node} is out of range 1-65535"));
                    continue;
                };
                // "80/TCP" and "80/tcp" are one port; two spellings are a hand edit gone wrong.
                // The first one read is kept.
                if map.contains_key(&id) {
                    bad(entry, "port listed twice (another spelling of it is used)".to_string());
                    continue;
                }
                map.insert(id, node);
            }
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
                (Err(crate::domain::ParseError(reason)), _) => bad(entry, reason),
                (Ok(_), None) => bad(entry, format!("{value} is not an RFC 3339 time")),
            }
        }
        Ok((State { allocations: out, since }, skipped))
    }

    /// Replaces the file atomically with `state`.
    pub fn save(&self, state: &State) -> Result<(), StateError> {
        let mut text = serde_json::to_string_pretty(&OnDiskOut(state))
            .map_err(|e| StateError::Write { path: self.path.clone(), source: io::Error::other(e) })?;
        text.push('\n');
        self.write_atomically(text.as_bytes())
            .map_err(|source| StateError::Write { path: self.path.clone(), source })
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
            let mut f =
                fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
            // A temporary file left by a crash keeps its mode through `open`: set it.
            f.set_permissions(fs::Permissions::from_mode(0o600))?;
            f.write_all(bytes)?;
            f.sync_all()?;
            drop(f);
            fs::rename(&tmp, &self.path)?;
            // The rename is durable only once the directory entry is.
            fs::File::open(&dir)?.sync_all()
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Protocol;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).expect("stat").permissions().mode() & 0o777
    }

    /// Root only, whatever the umask and whatever mode an older file or a leftover temporary
    /// file had; a directory nodelb creates is 0700.
    #[test]
    fn the_state_file_is_readable_by_root_only() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("new/sub/state.json");
        let file = StateFile::new(&path);
        file.save(&sample()).expect("save");
        assert_eq!(mode(&path), 0o600, "new file");
        assert_eq!(mode(&dir.path().join("new")), 0o700, "created directory");
        assert_eq!(mode(&dir.path().join("new/sub")), 0o700, "created directory");
        let old = dir.path().join("old.json");
        fs::write(&old, "{}").expect("write");
        fs::set_permissions(&old, fs::Permissions::from_mode(0o644)).expect("chmod");
        let tmp = dir.path().join(format!(".old.json.tmp.{}", std::process::id()));
        fs::write(&tmp, "partial").expect("write");
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o666)).expect("chmod");
        StateFile::new(&old).save(&sample()).expect("save");
        assert_eq!(mode(&old), 0o600, "replaced file");
        assert_eq!(StateFile::new(&old).load().expect("load"), sample());
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn sample() -> State {
        let allocations = sample_allocations();
        let since = allocations.keys().enumerate().map(|(i, k)| (k.clone(), t(i as i64))).collect();
        State { allocations, since }
    }

    /// The Services that have a `since` in the file at `path`.
    fn v_since(path: &Path) -> Vec<String> {
        let v: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(path).expect("read")).expect("json");
        v["since"].as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default()
    }

    fn sample_allocations() -> Allocations {
        let mut a = Allocations::new();
        a.insert(
            ServiceKey { namespace: "default".into(), name: "web".into() },
            BTreeMap::from([(PortId { port: 80, protocol: Protocol::Tcp }, 20001)]),
        );
        a.insert(
            ServiceKey { namespace: "kube-system".into(), name: "dns".into() },
            BTreeMap::from([
                (PortId { port: 53, protocol: Protocol::Udp }, 20002),
                (PortId { port: 53, protocol: Protocol::Tcp }, 20002),
            ]),
        );
        a
    }

    #[test]
    fn missing_file_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let st = StateFile::new(dir.path().join("state.json"));
        assert_eq!(st.load().expect("load"), State::default());
    }

    #[test]
    fn roundtrip_and_format() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/dir/state.json");
        let st = StateFile::new(&path);
        st.save(&sample()).expect("save");
        assert_eq!(st.load().expect("load"), sample());
        assert_eq!(v_since(&path), vec!["default/web", "kube-system/dns"]);
        let v: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).expect("read")).expect("json");
        assert_eq!(v["version"], 1);
        assert_eq!(v["allocations"]["default/web"]["80/TCP"], 20001);
        assert_eq!(v["allocations"]["kube-system/dns"]["53/UDP"], 20002);
        // Overwrite with less: nothing of the old content survives, no temp files left behind.
        st.save(&State::default()).expect("save");
        assert_eq!(st.load().expect("load"), State::default());
        let names: Vec<_> = fs::read_dir(path.parent().expect("parent"))
            .expect("readdir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
    }

    #[test]
    fn accepts_the_documented_example() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        fs::write(&path, r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001}},"future":true}"#)
            .expect("write");
        let got = StateFile::new(&path).load().expect("load");
        assert_eq!(got.allocations.len(), 1);
    }

    #[test]
    fn corrupt_files_name_the_file() {
        let cases = [
            ("truncated", "{\"version\":1,\"allocations\":{"),
            ("not json", "hello"),
            ("empty", ""),
            ("no version", "{\"allocations\":{}}"),
            ("future version", "{\"version\":2,\"allocations\":{}}"),
            ("allocations not an object", "{\"version\":1,\"allocations\":[]}"),
        ];
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in cases {
            let path = dir.path().join("state.json");
            fs::write(&path, text).expect("write");
            let err = StateFile::new(&path).load().expect_err(name);
            assert!(err.to_string().contains(&path.display().to_string()), "{name}: {err}");
        }
    }

    /// A bad entry is skipped with a message naming the file and the entry; every good entry next
    /// to it is kept, and the agent starts.
    #[test]
    fn bad_entries_are_skipped_and_named() {
        // (case, bad entry inside "allocations", substring of the message)
        let cases = [
            (
                "slash in name (written by older versions)",
                r#""default/a/b":{"80/TCP":20009}"#,
                "\"default/a/b\"",
            ),
            ("no namespace", r#""web":{"80/TCP":20009}"#, "\"web\" is not namespace/name"),
            ("uppercase", r#""default/Web":{"80/TCP":20009}"#, "name \"Web\""),
            ("NUL", r#""default/a\u0000b":{"80/TCP":20009}"#, "\\0"),
            ("ports not an object", r#""default/x":[20009]"#, "not an object"),
            ("bad port id", r#""default/x":{"80/ICMP":20009}"#, "default/x: 80/ICMP"),
            ("node port 0", r#""default/x":{"80/TCP":0}"#, "node port 0 is out of range"),
            ("node port big", r#""default/x":{"80/TCP":70000}"#, "node port 70000"),
            ("negative", r#""default/x":{"80/TCP":-1}"#, "node port -1"),
            ("string", r#""default/x":{"80/TCP":"20009"}"#, "node port \"20009\""),
        ];
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        for (case, entry, needle) in cases {
            let text =
                format!(r#"{{"version":1,"allocations":{{"default/web":{{"80/TCP":20001}},{entry}}}}}"#);
            fs::write(&path, &text).expect("write");
            let (got, skipped) =
                StateFile::new(&path).load_lenient().unwrap_or_else(|e| panic!("{case}: {e}"));
            let web = got.allocations.get(&ServiceKey::new("default", "web"));
            assert_eq!(web, Some(&BTreeMap::from([(PortId::tcp(80), 20001)])), "{case}: good entry kept");
            assert!(
                got.allocations.values().all(|m| !m.values().any(|n| *n == 20009)),
                "{case}: bad entry used: {got:?}"
            );
            let messages: Vec<String> = skipped.iter().map(|e| e.to_string()).collect();
            assert_eq!(messages.len(), 1, "{case}: {messages:?}");
            assert!(messages[0].contains(needle), "{case}: {:?} lacks {needle:?}", messages[0]);
            assert!(messages[0].contains(&path.display().to_string()), "{case}: {:?}", messages[0]);
            assert!(StateFile::new(&path).load().is_ok(), "{case}: load fails");
        }
        // Two spellings of one port: the first read is kept, the other skipped.
        fs::write(&path, r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001,"80/tcp":20002}}}"#)
            .expect("write");
        let (got, skipped) = StateFile::new(&path).load_lenient().expect("load");
        assert_eq!(got.allocations[&ServiceKey::new("default", "web")].len(), 1);
        assert!(skipped.len() == 1 && skipped[0].to_string().contains("listed twice"), "{skipped:?}");
    }

    /// A file written by an older nodelb (no `since`) loads with every allocation; the agent
    /// stamps its Services once, keeps the stamps of those that had one, and drops gone ones.
    #[test]
    fn old_files_migrate_and_stamps_are_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        fs::write(
            &path,
            r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001},"default/db":{"5432/TCP":20002}}}"#,
        )
        .expect("write");
        let st = StateFile::new(&path);
        let old = st.load().expect("an old file loads");
        assert_eq!(old.allocations.len(), 2);
        assert!(old.since.is_empty());
        let web = ServiceKey::new("default", "web");
        let db = ServiceKey::new("default", "db");
        let migrated = old.stamp(old.allocations.clone(), t(5));
        assert_eq!(migrated.since, BTreeMap::from([(db.clone(), t(5)), (web.clone(), t(5))]));
        st.save(&migrated).expect("save");
        assert_eq!(st.load().expect("load"), migrated, "round trip with times");
        // Later: db goes, new comes; web keeps its time.
        let mut next = migrated.allocations.clone();
        next.remove(&db);
        let new = ServiceKey::new("default", "new");
        next.insert(new.clone(), BTreeMap::from([(PortId::tcp(80), 20003)]));
        let later = migrated.stamp(next.clone(), t(9));
        assert_eq!(later.since, BTreeMap::from([(new, t(9)), (web.clone(), t(5))]));
        assert_eq!(later.since_of(&web), Some(t(5).to_string()));
        // Bad times are skipped, named, and the allocation stays.
        fs::write(
            &path,
            r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001}},"since":{"default/web":"yesterday","default/gone":"2024-01-01T00:00:00Z"}}"#,
        )
        .expect("write");
        let (got, skipped) = st.load_lenient().expect("load");
        assert_eq!(got.allocations.len(), 1);
        assert!(got.since.is_empty());
        let messages: Vec<String> = skipped.iter().map(|e| e.to_string()).collect();
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(
            messages.iter().any(|m| m.contains("since default/web") && m.contains("yesterday")),
            "{messages:?}"
        );
        assert!(messages.iter().any(|m| m.contains("since default/gone")), "{messages:?}");
    }

    #[test]
    fn unreadable_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A directory where the file should be.
        let st = StateFile::new(dir.path());
        assert!(matches!(st.load(), Err(StateError::Read { .. })));
        assert!(matches!(st.save(&sample()), Err(StateError::Write { .. })));
    }
}
