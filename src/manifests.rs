//! The manifests directory: the cluster-less source of desired state (`nodelb run --manifests DIR`).
//!
//! It owns reading Service and EndpointSlice objects from files, and noticing when they change.
//! Decisions:
//! - Files: every `*.yaml`, `*.yml` and `*.json` directly in DIR (no recursion), sorted by name;
//!   hidden files are skipped, which also skips Kubernetes ConfigMap volume internals (`..data`,
//!   `..2024_…`) while following the visible symlinks into them. Symlinks are followed.
//! - YAML files may hold several documents (`---`). Each document is parsed on its own, so a
//!   syntax error in one does not hide the others; documents are numbered from 1 counting only
//!   non-empty ones (what a human counts), and line numbers are those of the file.
//! - `kind: List` (and `ServiceList`/`EndpointSliceList`, as `kubectl get -o yaml` writes them)
//!   contribute their items.
//! - `v1 Service` and `discovery.k8s.io/v1 EndpointSlice` are parsed into k8s-openapi types. Other
//!   kinds are not errors but are reported in [`Manifests::ignored`] so the caller can log them;
//!   a Service or EndpointSlice of another apiVersion is a problem (almost surely a mistake).
//! - Objects without a namespace get `default`; an object without a name is a problem. The
//!   same kind/namespace/name twice is a problem; the first one (in file order) is kept.
//! - Only an unreadable DIR is an error ([`ManifestError`]); everything else is a
//!   [`ManifestProblem`] and does not stop the other files.
//!
//! [`DirWatcher`] watches DIR itself with inotify (not the files: editors and ConfigMap updates
//! replace files by rename, which a per-file watch would lose). Any event in DIR, hidden names
//! included (ConfigMap updates are a rename of `..data_tmp` over `..data`), schedules one
//! notification; bursts are coalesced: it fires [`DEBOUNCE_QUIET`] after the last event and at
//! most [`DEBOUNCE_MAX`] after the first. It is a plain async fn over a non-blocking inotify fd
//! (no thread). If DIR is deleted or moved away, the watcher reports the
//! change and re-attaches when a directory appears at the path again.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::os::fd::{AsFd as _, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use serde_json::Value;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::model::ServiceKey;
use crate::slim::Slim as _;

/// Quiet time after the last event before notifying. One writer's burst (an editor's temp file +
/// rename, `kubectl cp`, the kubelet's ConfigMap symlink swap) is a few syscalls within a
/// millisecond; 10 ms also covers a writer descheduled on a busy node. A burst split by a longer
/// pause costs one extra sync, never a wrong one (a half-written file keeps its last good
/// content). It is paid on every change: it was 50 ms, a third of the reaction time.
pub const DEBOUNCE_QUIET: Duration = Duration::from_millis(10);
/// Longest delay between the first event of a burst and the notification.
pub const DEBOUNCE_MAX: Duration = Duration::from_millis(150);
/// Largest manifest file read (16 MiB): 10,000 Services with their EndpointSlices fit in a few.
/// A larger file is a problem (its Services keep their last good version), never a read of
/// whatever size into memory: parsing multiplies a file's size several times.
pub const MAX_FILE_BYTES: u64 = 16 << 20;
/// Deepest bracket nesting (`[`, `{`) of a YAML document: serde_yaml refuses more than 128
/// levels anyway, but only after libyaml has scanned the whole document, which takes time
/// quadratic in the depth (`{a: {a: …` 100,000 deep: minutes). Counted on the raw text, so
/// 129 unclosed brackets inside a string count too (see docs/design.md, "Bounds on input").
pub const MAX_YAML_NESTING: usize = 128;
/// Longest problem message: the parsers quote what they refuse (a megabyte string where a
/// number belongs), and a problem goes into a log line and `/status`.
const MAX_PROBLEM_MESSAGE: usize = 1024;
/// How often a watcher that lost DIR looks for it again.
const IDLE_TICK: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifests directory {path}: cannot read: {source}")]
    ReadDir { path: PathBuf, source: io::Error },
    #[error("manifests directory {path}: cannot watch: {source}")]
    Watch { path: PathBuf, source: io::Error },
}

/// Everything read from DIR. Objects are shared (`Arc`): the cache, [`LastGood`] and every
/// snapshot hold the same parsed objects, so a sync copies pointers, never objects.
#[derive(Debug, Clone, Default)]
pub struct Manifests {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    /// Documents that could not be used.
    pub problems: Vec<ManifestProblem>,
    /// Objects of kinds nodelb does not use.
    pub ignored: Vec<IgnoredObject>,
    /// Services whose document names them but does not parse (a wrongly typed field): each is a
    /// refusal on its own status line, unless a last good version of its file serves it.
    pub invalid_services: Vec<InvalidService>,
    /// Services served from the last good version of their file, and why (the file's problem).
    pub stale: BTreeMap<ServiceKey, String>,
    /// Per file: the objects it contributed and whether it had a problem (shared, so that
    /// [`LastGood`] keeps them without copying every object at every sync).
    pub files: BTreeMap<PathBuf, Arc<FileObjects>>,
}

/// What one file contributed to a [`Manifests`].
#[derive(Debug, Clone, Default)]
pub struct FileObjects {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    pub had_problem: bool,
    /// The file's first problem, for the status line of the Services it keeps serving from
    /// their last good version.
    pub first_problem: Option<String>,
}

/// A Service document that names its Service but cannot be read as one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidService {
    pub key: ServiceKey,
    pub problem: ManifestProblem,
}

/// The last good content of each manifest file, so that a file being edited (or broken) does not
/// make its Services vanish, release their ports and reprogram the node half-way.
#[derive(Debug, Clone, Default)]
pub struct LastGood {
    files: BTreeMap<PathBuf, Arc<FileObjects>>,
}

impl LastGood {
    /// Replaces the objects of every file that has a problem with that file's last good content
    /// (when there is one), and remembers the content of every good file. Deleted files are
    /// forgotten: deleting a file is how a user removes its objects.
    pub fn apply(&mut self, mut m: Manifests) -> Manifests {
        self.files.retain(|path, _| m.files.contains_key(path));
        let substituted =
            m.files.iter().any(|(path, objs)| objs.had_problem && self.files.contains_key(path));
        for (path, objs) in &m.files {
            if !objs.had_problem {
                self.files.insert(path.clone(), objs.clone());
            }
        }
        if !substituted {
            // Every file serves what was read of it: that is `m.services` / `m.slices` already.
            return m;
        }
        let mut services = Vec::new();
        let mut slices = Vec::new();
        for (path, objs) in &m.files {
            let served = match self.files.get(path) {
                Some(good) if objs.had_problem => {
                    let why = objs.first_problem.as_deref().unwrap_or("it has a problem");
                    for svc in &good.services {
                        let note = format!("served from the last good version of {}: {why}", path.display());
                        m.stale.insert(crate::model::service_key(svc), note);
                    }
                    m.problems.push(ManifestProblem {
                        file: path.clone(),
                        document: 0,
                        line: None,
                        message: "keeping the last good version of this file until it is fixed".into(),
                    });
                    good
                }
                // Good, or never read good: serve what could be read of it.
                _ => objs,
            };
            services.extend(served.services.iter().cloned());
            slices.extend(served.slices.iter().cloned());
        }
        m.services = services;
        m.slices = slices;
        m
    }
}

/// A file or document that could not be used. `document` is 1-based; 0 means the whole file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestProblem {
    pub file: PathBuf,
    pub document: usize,
    pub line: Option<usize>,
    pub message: String,
}

impl ManifestProblem {
    /// A problem whose message is cut to [`MAX_PROBLEM_MESSAGE`] bytes.
    fn new(file: &Path, document: usize, line: Option<usize>, message: String) -> ManifestProblem {
        let message = if message.len() > MAX_PROBLEM_MESSAGE {
            format!("{}… ({} bytes)", crate::model::cut(&message, MAX_PROBLEM_MESSAGE), message.len())
        } else {
            message
        };
        ManifestProblem { file: file.to_path_buf(), document, line, message }
    }
}

impl fmt::Display for ManifestProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if self.document > 0 {
            write!(f, " document {}", self.document)?;
        }
        if let Some(line) = self.line {
            write!(f, " (line {line})")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// An object of a kind nodelb does not use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IgnoredObject {
    pub file: PathBuf,
    pub document: usize,
    pub api_version: String,
    pub kind: String,
    pub name: Option<String>,
}

impl fmt::Display for IgnoredObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short = |s: &str| match s.len() > crate::model::MAX_QUOTED {
            true => format!("{}…", crate::model::cut(s, crate::model::MAX_QUOTED)),
            false => s.to_string(),
        };
        write!(f, "ignored kind {} ({})", short(&self.kind), short(&self.api_version))?;
        if let Some(name) = &self.name {
            write!(f, " {}", crate::model::quoted(name))?;
        }
        write!(f, " in {} document {}", self.file.display(), self.document)
    }
}

/// Which ignored objects were already reported, so that each is logged once when it appears
/// (and again only after it went away and came back), not at every sync.
#[derive(Debug, Clone, Default)]
pub struct IgnoredLog {
    /// (file, kind, name) of the objects ignored at the last call.
    seen: BTreeSet<(PathBuf, String, Option<String>)>,
}

impl IgnoredLog {
    /// The objects of `ignored` to report now: those not ignored at the previous call.
    pub fn newly_ignored<'a>(&mut self, ignored: &'a [IgnoredObject]) -> Vec<&'a IgnoredObject> {
        let key = |o: &IgnoredObject| (o.file.clone(), o.kind.clone(), o.name.clone());
        let current: BTreeSet<_> = ignored.iter().map(key).collect();
        let mut fresh = Vec::new();
        let mut reported = BTreeSet::new();
        for o in ignored {
            let k = key(o);
            if !self.seen.contains(&k) && reported.insert(k) {
                fresh.push(o);
            }
        }
        self.seen = current;
        fresh
    }
}

fn is_manifest_name(name: &str) -> bool {
    !name.starts_with('.') && [".yaml", ".yml", ".json"].iter().any(|ext| name.ends_with(ext))
}

/// Reads every manifest file in `dir`. Fails only when `dir` itself cannot be read.
pub fn load_dir(dir: &Path) -> Result<Manifests, ManifestError> {
    load_dir_cached(dir, &mut ManifestCache::default())
}

/// What identifies a file's content without reading it: a changed stamp means "parse again".
/// `metadata()` follows symlinks, so a ConfigMap `..data` swap (new target inode) is noticed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileStamp {
    len: u64,
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileStamp {
    fn of(m: &std::fs::Metadata) -> FileStamp {
        use std::os::unix::fs::MetadataExt as _;
        FileStamp {
            len: m.len(),
            dev: m.dev(),
            ino: m.ino(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        }
    }
}

/// Parsed files by path and stamp, so a change to one file of a large directory re-parses that
/// file only (the benchmark measured ~650 ms per sync at 1,000 Services without it).
#[derive(Debug, Default)]
pub struct ManifestCache {
    files: BTreeMap<PathBuf, (FileStamp, Manifests)>,
}

impl ManifestCache {
    /// Identifies what the last [`load_dir_cached`] read: equal fingerprints mean the same files
    /// with the same stamps, hence the same manifests.
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::hash::DefaultHasher::new();
        self.files.iter().for_each(|(path, (stamp, _))| (path, stamp).hash(&mut h));
        h.finish()
    }
}

/// [`load_dir`] that re-parses only files whose stamp changed since the last call with `cache`.
pub fn load_dir_cached(dir: &Path, cache: &mut ManifestCache) -> Result<Manifests, ManifestError> {
    cache.refresh(dir)?;
    Ok(cache.merged())
}

impl ManifestCache {
    /// Brings the cache up to date with DIR: stats every manifest file and parses again only
    /// those whose stamp changed; files gone from DIR leave the cache. Fails only when DIR itself
    /// cannot be read. [`ManifestCache::fingerprint`] then says whether anything changed, before
    /// anything is merged.
    pub fn refresh(&mut self, dir: &Path) -> Result<(), ManifestError> {
        let read_err = |source| ManifestError::ReadDir { path: dir.to_path_buf(), source };
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(read_err)? {
            let entry = entry.map_err(read_err)?;
            // Names that are not UTF-8 cannot end in ".yaml" as far as we are concerned.
            if let Some(name) = entry.file_name().to_str().filter(|n| is_manifest_name(n)) {
                names.push(name.to_string());
            }
        }
        let mut fresh = BTreeMap::new();
        for name in names {
            let path = dir.join(&name);
            // metadata() follows symlinks: ConfigMap files are symlinks into `..data/`.
            let file = match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => {
                    let stamp = FileStamp::of(&m);
                    match self.files.remove(&path) {
                        Some((old, parsed)) if old == stamp => (stamp, parsed),
                        _ => (stamp, parse_file(&path, &name)),
                    }
                }
                Ok(_) => continue, // a directory called x.yaml: not a manifest
                Err(e) => {
                    let mut loader = Loader::default();
                    loader.problem(&path, 0, None, format!("cannot read: {e}"));
                    let stamp = FileStamp { len: 0, dev: 0, ino: 0, mtime_ns: -1, ctime_ns: -1 };
                    (stamp, loader.out)
                }
            };
            fresh.insert(path, file);
        }
        // Files gone from DIR leave the cache too.
        self.files = fresh;
        Ok(())
    }

    /// Everything the cached files hold, merged in file name order (objects shared, not copied).
    pub fn merged(&self) -> Manifests {
        let mut out = Manifests::default();
        let mut seen: BTreeMap<(&'static str, String, String), PathBuf> = BTreeMap::new();
        // The map is ordered by path, all in DIR: that is file name order.
        for (path, (_, file)) in &self.files {
            merge_file(&mut out, &mut seen, path, file);
        }
        out
    }
}

/// Parses one file on its own (duplicates within it are found here; across files by merge_file).
fn parse_file(path: &Path, name: &str) -> Manifests {
    let mut loader = Loader::default();
    match crate::bounded::read_to_string(path, MAX_FILE_BYTES) {
        Ok(text) if name.ends_with(".json") => loader.json_file(path, &text),
        Ok(text) => loader.yaml_file(path, &text),
        Err(e) if e.kind() == io::ErrorKind::FileTooLarge => {
            let msg = format!("cannot read: {e}: manifests larger than 16 MiB are not read (split the file)");
            loader.problem(path, 0, None, msg)
        }
        Err(e) => loader.problem(path, 0, None, format!("cannot read: {e}")),
    }
    loader.out
}

/// Adds one file's objects to `out`, dropping objects an earlier file already defined.
fn merge_file(
    out: &mut Manifests,
    seen: &mut BTreeMap<(&'static str, String, String), PathBuf>,
    path: &Path,
    file: &Manifests,
) {
    let mut objs = FileObjects {
        had_problem: !file.problems.is_empty(),
        first_problem: file.problems.first().map(ToString::to_string),
        ..Default::default()
    };
    out.problems.extend(file.problems.iter().cloned());
    out.ignored.extend(file.ignored.iter().cloned());
    out.invalid_services.extend(file.invalid_services.iter().cloned());
    let mut admit = |kind: &'static str, meta: &ObjectMeta, problems: &mut Vec<ManifestProblem>| {
        let ns = meta.namespace.clone().unwrap_or_default();
        let name = meta.name.clone().unwrap_or_default();
        match seen.get(&(kind, ns.clone(), name.clone())) {
            Some(first) => {
                let message = format!(
                    "duplicate {kind} {} (first defined in {}); the first one is used",
                    ServiceKey::new(ns, name),
                    first.display()
                );
                problems.push(ManifestProblem::new(path, 0, None, message));
                false
            }
            None => {
                seen.insert((kind, ns, name), path.to_path_buf());
                true
            }
        }
    };
    for svc in &file.services {
        if admit("Service", &svc.metadata, &mut out.problems) {
            objs.services.push(Arc::clone(svc));
        } else {
            objs.had_problem = true;
        }
    }
    for slice in &file.slices {
        if admit("EndpointSlice", &slice.metadata, &mut out.problems) {
            objs.slices.push(Arc::clone(slice));
        } else {
            objs.had_problem = true;
        }
    }
    if objs.had_problem && objs.first_problem.is_none() {
        objs.first_problem = out.problems.last().map(ToString::to_string);
    }
    out.services.extend(objs.services.iter().cloned());
    out.slices.extend(objs.slices.iter().cloned());
    out.files.insert(path.to_path_buf(), Arc::new(objs));
}

#[derive(Default)]
struct Loader {
    out: Manifests,
    seen: BTreeSet<(String, String, String)>,
}

/// Where a value came from, for messages.
struct Origin<'a> {
    file: &'a Path,
    document: usize,
    /// `items[3]: ` inside a List.
    prefix: String,
}

impl Loader {
    fn problem(&mut self, file: &Path, document: usize, line: Option<usize>, message: String) {
        self.out.problems.push(ManifestProblem::new(file, document, line, message));
    }

    fn json_file(&mut self, file: &Path, text: &str) {
        let value: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => return self.problem(file, 1, Some(e.line()), e.to_string()),
        };
        let origin = Origin { file, document: 1, prefix: String::new() };
        // Typed re-parse from the text gives line numbers in errors.
        self.object(
            &origin,
            value,
            Some(&|kind| match kind {
                Kind::Service => serde_json::from_str::<Service>(text)
                    .map(|v| Typed::Service(Box::new(v)))
                    .map_err(|e| (Some(e.line()), e.to_string())),
                Kind::Slice => serde_json::from_str::<EndpointSlice>(text)
                    .map(|v| Typed::Slice(Box::new(v)))
                    .map_err(|e| (Some(e.line()), e.to_string())),
            }),
        );
    }

    fn yaml_file(&mut self, file: &Path, text: &str) {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut document = 0;
        for (first_line, body) in split_documents(text) {
            if body.trim().is_empty() {
                continue; // not a document (a million `---` lines are read in one pass)
            }
            if let Some(line) = nesting_beyond(&body, MAX_YAML_NESTING) {
                document += 1;
                let msg = format!("brackets nested more than {MAX_YAML_NESTING} levels deep; not parsed");
                self.problem(file, document, Some(first_line + line + 1), msg);
                continue;
            }
            // Parsed on its own (padding it with the preceding lines would make a large file
            // quadratic to read); error lines are shifted to file lines.
            let value: Value = match bounded_yaml_value(&body) {
                Ok(Value::Null) => continue, // empty or comments only: not a document
                Ok(v) => v,
                Err(e) => {
                    document += 1;
                    let (line, message) = yaml_error(&e, first_line);
                    self.problem(file, document, line, message);
                    continue;
                }
            };
            document += 1;
            let origin = Origin { file, document, prefix: String::new() };
            self.object(
                &origin,
                value,
                Some(&|kind| match kind {
                    Kind::Service => serde_yaml::from_str::<Service>(&body)
                        .map(|v| Typed::Service(Box::new(v)))
                        .map_err(|e| yaml_error(&e, first_line)),
                    Kind::Slice => serde_yaml::from_str::<EndpointSlice>(&body)
                        .map(|v| Typed::Slice(Box::new(v)))
                        .map_err(|e| yaml_error(&e, first_line)),
                }),
            );
        }
    }

    /// One top-level object or List item. `reparse` re-reads the document's own text into the
    /// typed object (for line numbers); List items are converted from the value.
    fn object(&mut self, origin: &Origin<'_>, value: Value, reparse: Option<&Reparse<'_>>) {
        let Value::Object(map) = &value else {
            let what = match &value {
                Value::Array(_) => "a list",
                Value::String(_) => "a string",
                _ => "a scalar",
            };
            let msg = format!(
                "{}expected a Kubernetes object (a mapping with apiVersion and kind), found {what}",
                origin.prefix
            );
            return self.problem(origin.file, origin.document, None, msg);
        };
        let api_version = map.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_string();
        let kind = map.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
        if kind.is_empty() {
            let msg = format!("{}object has no kind", origin.prefix);
            return self.problem(origin.file, origin.document, None, msg);
        }
        let typed_kind = match (kind.as_str(), api_version.as_str()) {
            ("List" | "ServiceList" | "EndpointSliceList", _) => {
                return self.list(origin, &kind, map.get("items"));
            }
            ("Service", "v1") => Kind::Service,
            ("EndpointSlice", "discovery.k8s.io/v1") => Kind::Slice,
            ("Service" | "EndpointSlice", other) => {
                let msg = format!("{}{kind} with unsupported apiVersion {other:?}", origin.prefix);
                return self.problem(origin.file, origin.document, None, msg);
            }
            _ => {
                let name = map
                    .get("metadata")
                    .and_then(|m| m.get("name"))
                    .and_then(Value::as_str)
                    .map(str::to_string);
                self.out.ignored.push(IgnoredObject {
                    file: origin.file.to_path_buf(),
                    document: origin.document,
                    api_version,
                    kind,
                    name,
                });
                return;
            }
        };
        let typed = match reparse {
            Some(reparse) => reparse(typed_kind),
            None => match typed_kind {
                Kind::Service => {
                    serde_json::from_value::<Service>(value.clone()).map(|v| Typed::Service(Box::new(v)))
                }
                Kind::Slice => {
                    serde_json::from_value::<EndpointSlice>(value.clone()).map(|v| Typed::Slice(Box::new(v)))
                }
            }
            .map_err(|e| (None, e.to_string())),
        };
        match typed {
            Ok(Typed::Service(mut svc)) => {
                if self.admit(origin, "Service", &mut svc.metadata) {
                    svc.slim();
                    self.out.services.push(Arc::from(svc));
                }
            }
            Ok(Typed::Slice(mut slice)) => {
                if self.admit(origin, "EndpointSlice", &mut slice.metadata) {
                    slice.slim();
                    self.out.slices.push(Arc::from(slice));
                }
            }
            Err((line, message)) => {
                let msg = format!("{}invalid {kind}: {message}", origin.prefix);
                self.problem(origin.file, origin.document, line, msg);
                if matches!(typed_kind, Kind::Service)
                    && let Some(key) = named_key(map)
                    && let Some(problem) = self.out.problems.last().cloned()
                {
                    self.out.invalid_services.push(InvalidService { key, problem });
                }
            }
        }
    }

    fn list(&mut self, origin: &Origin<'_>, list_kind: &str, items: Option<&Value>) {
        let items = match items {
            None | Some(Value::Null) => return,
            Some(Value::Array(items)) => items,
            Some(_) => {
                let msg = format!("{}{list_kind}: items is not a list", origin.prefix);
                return self.problem(origin.file, origin.document, None, msg);
            }
        };
        // Typed lists leave out apiVersion/kind of their items.
        let implied = match list_kind {
            "ServiceList" => Some(("v1", "Service")),
            "EndpointSliceList" => Some(("discovery.k8s.io/v1", "EndpointSlice")),
            _ => None,
        };
        for (i, item) in items.iter().enumerate() {
            let mut item = item.clone();
            if let (Some((api, kind)), Value::Object(m)) = (implied, &mut item) {
                m.entry("apiVersion").or_insert_with(|| Value::from(api));
                m.entry("kind").or_insert_with(|| Value::from(kind));
            }
            let inner = Origin {
                file: origin.file,
                document: origin.document,
                prefix: format!("{}items[{i}]: ", origin.prefix),
            };
            self.object(&inner, item, None);
        }
    }

    /// Defaults the namespace, checks the name and duplicates.
    fn admit(&mut self, origin: &Origin<'_>, kind: &str, meta: &mut ObjectMeta) -> bool {
        if meta.namespace.as_deref().is_none_or(str::is_empty) {
            meta.namespace = Some("default".to_string());
        }
        let namespace = meta.namespace.clone().unwrap_or_default();
        let Some(name) = meta.name.clone().filter(|n| !n.is_empty()) else {
            let msg = format!("{}{kind} has no metadata.name", origin.prefix);
            self.problem(origin.file, origin.document, None, msg);
            return false;
        };
        if !self.seen.insert((kind.to_string(), namespace.clone(), name.clone())) {
            let msg = format!("{}duplicate {kind} {namespace}/{name}; the first one is used", origin.prefix);
            self.problem(origin.file, origin.document, None, msg);
            return false;
        }
        true
    }
}

/// `namespace/name` of an object that did not parse, when its metadata still names it.
fn named_key(map: &serde_json::Map<String, Value>) -> Option<ServiceKey> {
    let meta = map.get("metadata")?;
    let name = meta.get("name").and_then(Value::as_str).filter(|n| !n.is_empty())?;
    let namespace =
        meta.get("namespace").and_then(Value::as_str).filter(|n| !n.is_empty()).unwrap_or("default");
    Some(ServiceKey::new(namespace, name))
}

/// The line (0-based, in `text`) where bracket nesting first goes deeper than `max`, counting
/// every `[`/`{` as one level in and every `]`/`}` as one out, quoted or not (a cheap upper
/// bound of the nesting libyaml will see; see [`MAX_YAML_NESTING`]).
fn nesting_beyond(text: &str, max: usize) -> Option<usize> {
    let (mut depth, mut line) = (0usize, 0usize);
    for b in text.bytes() {
        match b {
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return Some(line);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b'\n' => line += 1,
            _ => {}
        }
    }
    None
}

/// One YAML document as a JSON value, refused once it expands to more than twice its size plus
/// 4 KiB (each node counts one, each string its bytes): YAML aliases repeat what they name, and
/// serde_yaml's own limit counts the aliases, not what they expand to (2,000 references to a
/// 2,000-item list are 4,000,000 values from 14 KB). Without aliases a document never comes close.
fn bounded_yaml_value(body: &str) -> Result<Value, serde_yaml::Error> {
    use serde::de::DeserializeSeed as _;
    let budget = Budget(std::cell::Cell::new(2 * body.len() + 4096), 2 * body.len() + 4096);
    ValueSeed(&budget).deserialize(serde_yaml::Deserializer::from_str(body))
}

/// What a document may still expand to, and what it could at first.
struct Budget(std::cell::Cell<usize>, usize);

impl Budget {
    fn spend<E: serde::de::Error>(&self, n: usize) -> Result<(), E> {
        match self.0.get().checked_sub(n) {
            Some(left) => {
                self.0.set(left);
                Ok(())
            }
            None => Err(E::custom(format!(
                "the document expands to more than {} bytes (YAML aliases repeating large parts?); not read",
                self.1
            ))),
        }
    }
}

/// Builds a [`Value`] as serde_json's own `Deserialize` does, spending the [`Budget`].
struct ValueSeed<'b>(&'b Budget);

impl<'de> serde::de::DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// A mapping key: a string, as serde_json's `Value` reads keys.
struct KeySeed<'b>(&'b Budget);

impl<'de> serde::de::DeserializeSeed<'de> for KeySeed<'_> {
    type Value = String;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        let s = <String as serde::Deserialize>::deserialize(d)?;
        self.0.spend(1 + s.len())?;
        Ok(s)
    }
}

impl<'de> serde::de::Visitor<'de> for ValueSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        self.0.spend(1)?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.0.spend(1)?;
        Ok(Value::from(v))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.0.spend(1)?;
        Ok(Value::from(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        self.0.spend(1)?;
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        self.0.spend(1 + v.len())?;
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        self.0.spend(1 + v.len())?;
        Ok(Value::String(v))
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Value, E> {
        self.0.spend(1)?;
        Ok(Value::Null)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        self.visit_none()
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        serde::de::DeserializeSeed::deserialize(self, d)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.0.spend(1)?;
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(ValueSeed(self.0))? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.0.spend(1)?;
        let mut out = serde_json::Map::new();
        while let Some(k) = map.next_key_seed(KeySeed(self.0))? {
            let v = map.next_value_seed(ValueSeed(self.0))?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

/// A serde_yaml error of a document that starts after `lines_before` lines of its file, with
/// its line (and the one in its message) counted in the file.
fn yaml_error(e: &serde_yaml::Error, lines_before: usize) -> (Option<usize>, String) {
    let message = e.to_string();
    match e.location() {
        Some(l) => {
            let here = format!("at line {} column {}", l.line(), l.column());
            let there = format!("at line {} column {}", l.line() + lines_before, l.column());
            (Some(l.line() + lines_before), message.replace(&here, &there))
        }
        None => (None, message),
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Service,
    Slice,
}

/// Boxed: a Service is twice the size of an EndpointSlice.
enum Typed {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
}

/// Re-reads a document's own text as the given kind; errors carry a line when known.
type Reparse<'a> = dyn Fn(Kind) -> Result<Typed, (Option<usize>, String)> + 'a;

/// Splits YAML text at document markers (`---` and `...` at column 0, which YAML forbids inside
/// content) into `(index of the first line, text)`. Content after `--- ` on the marker line
/// belongs to the new document and keeps its column.
fn split_documents(text: &str) -> Vec<(usize, String)> {
    let mut docs = Vec::new();
    let mut start = 0;
    let mut body = String::new();
    for (i, line) in text.split('\n').enumerate() {
        let bare = line.trim_end_matches('\r');
        let marker = if bare == "---" || bare == "..." {
            Some("")
        } else {
            bare.strip_prefix("---").filter(|r| r.starts_with([' ', '\t']))
        };
        match marker {
            Some(rest) => {
                docs.push((start, std::mem::take(&mut body)));
                start = i;
                if rest.trim().is_empty() || rest.trim_start().starts_with('#') {
                    start = i + 1;
                } else {
                    body.push_str("   ");
                    body.push_str(rest);
                    body.push('\n');
                }
            }
            None => {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    docs.push((start, body));
    docs
}

/// Watches a manifests directory; see the module documentation. Create it *before* the first
/// [`load_dir`], so that a change in between is not lost. Events that happen while nobody waits
/// in [`DirWatcher::changed`] queue in the kernel and make the next call return promptly.
pub struct DirWatcher {
    dir: PathBuf,
    fd: AsyncFd<InotifyFd>,
    /// `None` while DIR is gone (deleted or moved away).
    watch: Option<WatchDescriptor>,
    /// (first, last) event of a burst not yet reported. Kept here, not in `changed()`'s locals,
    /// so that `changed()` is cancel-safe: the agent awaits it inside `select!`, and a cancelled
    /// call must not lose events it already read from the inotify descriptor.
    pending: Option<(Instant, Instant)>,
    /// [`DEBOUNCE_QUIET`], [`DEBOUNCE_MAX`].
    quiet: Duration,
    max: Duration,
}

/// `AsyncFd` wants `AsRawFd`, which nix's `Inotify` only offers as `AsFd`.
struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl DirWatcher {
    /// Starts watching `dir`, which must exist. Needs a Tokio runtime with I/O and time enabled.
    pub fn new(dir: &Path) -> Result<DirWatcher, ManifestError> {
        Self::with_debounce(dir, DEBOUNCE_QUIET, DEBOUNCE_MAX)
    }

    /// [`DirWatcher::new`] with another debounce (tests that need a long one).
    fn with_debounce(dir: &Path, quiet: Duration, max: Duration) -> Result<DirWatcher, ManifestError> {
        let watch_err = |source: io::Error| ManifestError::Watch { path: dir.to_path_buf(), source };
        if tokio::runtime::Handle::try_current().is_err() {
            // Registering would panic.
            return Err(watch_err(io::Error::other("not inside a Tokio runtime")));
        }
        let inotify =
            Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).map_err(|e| watch_err(e.into()))?;
        let wd = inotify.add_watch(dir, watch_mask()).map_err(|e| watch_err(e.into()))?;
        // SAFETY: InotifyFd owns the descriptor (an OwnedFd inside nix's Inotify) for its whole
        // life and always returns that same descriptor; the AsyncFd owns the InotifyFd.
        let fd = unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), Interest::READABLE) }
            .map_err(|e| watch_err(e.into()))?;
        Ok(DirWatcher { dir: dir.to_path_buf(), fd, watch: Some(wd), pending: None, quiet, max })
    }

    /// Waits until something in DIR changed, then for the burst to settle (see
    /// [`DEBOUNCE_QUIET`], [`DEBOUNCE_MAX`]). Cancel-safe: a call dropped part-way (in a
    /// `select!`) leaves the burst pending, and the next call finishes it. An error means inotify
    /// itself failed.
    pub async fn changed(&mut self) -> Result<(), ManifestError> {
        // Wait for the first event. While DIR is gone, wake up regularly to re-attach.
        while self.pending.is_none() {
            if self.watch.is_some() {
                self.read_events().await?;
            } else {
                tokio::time::timeout(IDLE_TICK, self.read_events()).await.unwrap_or(Ok(()))?;
            }
            if self.reattach() {
                self.note_event();
            }
        }
        while let Some((first, last)) = self.pending {
            let deadline = (last + self.quiet).min(first + self.max);
            match tokio::time::timeout_at(deadline.into(), self.read_events()).await {
                Err(_elapsed) => break,
                Ok(result) => {
                    result?;
                    if self.reattach() {
                        self.note_event();
                    }
                }
            }
        }
        if let Some((first, last)) = self.pending.take() {
            tracing::debug!(
                burst_ms = (last - first).as_secs_f64() * 1e3,
                waited_ms = first.elapsed().as_secs_f64() * 1e3,
                "manifests changed"
            );
        }
        Ok(())
    }

    fn note_event(&mut self) {
        let now = Instant::now();
        self.pending = Some(match self.pending {
            Some((first, _)) => (first, now),
            None => (now, now),
        });
    }

    /// Tries to watch DIR again when it was lost; `true` when it is back.
    fn reattach(&mut self) -> bool {
        if self.watch.is_some() {
            return false;
        }
        match self.fd.get_ref().0.add_watch(&self.dir, watch_mask()) {
            Ok(wd) => {
                // DIR is back (or replaced): its content may be entirely new.
                self.watch = Some(wd);
                true
            }
            Err(_) => false,
        }
    }

    /// Reads at least one batch of events and records them in `pending` before returning (no
    /// await between reading and recording, so a cancellation cannot lose them).
    async fn read_events(&mut self) -> Result<(), ManifestError> {
        let dir = self.dir.clone();
        let err = |source: io::Error| ManifestError::Watch { path: dir.clone(), source };
        loop {
            let mut guard = self.fd.readable().await.map_err(err)?;
            match guard.try_io(|inner| inner.get_ref().0.read_events().map_err(io::Error::from)) {
                Ok(Ok(events)) => {
                    for ev in &events {
                        // Only events of the current watch count: after a re-attach, the
                        // IN_IGNORED of the old watch arrives late and must not drop the new one.
                        let ours = self.watch == Some(ev.wd);
                        // The watch ends on delete; on a move it would follow the inode, but we
                        // care about the path.
                        let lost = ev.mask.intersects(
                            AddWatchFlags::IN_IGNORED
                                | AddWatchFlags::IN_DELETE_SELF
                                | AddWatchFlags::IN_MOVE_SELF,
                        );
                        if ours
                            && lost
                            && let Some(wd) = self.watch.take()
                        {
                            // Already gone after a delete; needed after a move.
                            let _ = self.fd.get_ref().0.rm_watch(wd);
                        }
                    }
                    if !events.is_empty() {
                        self.note_event();
                    }
                    return Ok(());
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

fn watch_mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\nspec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: prod\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [198.51.100.11]\nports:\n- port: 8080\n";

    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in files {
            fs::write(dir.path().join(name), text).expect("write");
        }
        dir
    }

    fn names(m: &Manifests) -> (Vec<String>, Vec<String>) {
        let key = |meta: &ObjectMeta| {
            format!(
                "{}/{}",
                meta.namespace.clone().unwrap_or_default(),
                meta.name.clone().unwrap_or_default()
            )
        };
        (
            m.services.iter().map(|s| key(&s.metadata)).collect(),
            m.slices.iter().map(|s| key(&s.metadata)).collect(),
        )
    }

    #[test]
    fn a_broken_file_keeps_its_last_good_content_and_a_deleted_one_goes() {
        let dir = dir_with(&[("web.yaml", SVC), ("slice.yaml", SLICE)]);
        let mut last = LastGood::default();
        let m = last.apply(load_dir(dir.path()).expect("load"));
        assert_eq!(names(&m).0, vec!["default/web".to_string()]);

        // Half-edited: the Service stays as it was, and the problem says so.
        fs::write(dir.path().join("web.yaml"), "apiVersion: v1\nkind: Service\nmetadata: {name: [oops\n")
            .unwrap();
        let m = last.apply(load_dir(dir.path()).expect("load"));
        assert_eq!(names(&m).0, vec!["default/web".to_string()], "{:?}", m.problems);
        assert!(m.problems.iter().any(|p| p.message.contains("last good")), "{:?}", m.problems);
        assert_eq!(names(&m).1, vec!["prod/web-1".to_string()]);

        // Fixed with another name: the new content wins.
        fs::write(dir.path().join("web.yaml"), SVC.replace("name: web", "name: web2")).unwrap();
        let m = last.apply(load_dir(dir.path()).expect("load"));
        assert_eq!(names(&m).0, vec!["default/web2".to_string()]);

        // Deleted: gone, even though it was good before.
        fs::remove_file(dir.path().join("web.yaml")).unwrap();
        let m = last.apply(load_dir(dir.path()).expect("load"));
        assert!(names(&m).0.is_empty());

        // A file that was never good serves what could be read of it.
        let bad_second = format!("{SVC}---\nkind: Service\nmetadata: {{name: [oops\n");
        fs::write(dir.path().join("new.yaml"), bad_second).unwrap();
        let m = last.apply(load_dir(dir.path()).expect("load"));
        assert_eq!(names(&m).0, vec!["default/web".to_string()]);
    }

    #[test]
    fn multi_document_and_defaults() {
        let text = format!("# leading comment\n---\n{SVC}---\n# only a comment\n---\n{SLICE}...\n");
        let dir = dir_with(&[("a.yaml", &text)]);
        let m = load_dir(dir.path()).expect("load");
        assert!(m.problems.is_empty(), "{:?}", m.problems);
        assert_eq!(names(&m), (vec!["default/web".to_string()], vec!["prod/web-1".to_string()]));
    }

    #[test]
    fn problems_are_per_document_with_file_lines() {
        let bad_syntax = "apiVersion: v1\nkind: Service\nmetadata: {name: [oops\n";
        let bad_type =
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: typed\nspec:\n  ports:\n  - port: eighty\n";
        let text = format!("{SVC}---\n{bad_syntax}---\n{bad_type}---\n{SLICE}");
        let dir = dir_with(&[("m.yaml", &text)]);
        let m = load_dir(dir.path()).expect("load");
        assert_eq!(names(&m).0, vec!["default/web".to_string()]);
        assert_eq!(names(&m).1, vec!["prod/web-1".to_string()], "a bad document does not stop the next");
        assert_eq!(m.problems.len(), 2, "{:?}", m.problems);
        let p = &m.problems[0];
        assert_eq!((p.document, p.file.file_name().and_then(|f| f.to_str())), (2, Some("m.yaml")));
        // The broken flow sequence starts on line 12 of the file; libyaml notices it at or after.
        assert!(p.line.is_some_and(|l| (12..=13).contains(&l)), "{p}");
        let p = &m.problems[1];
        assert_eq!(p.document, 3);
        assert_eq!(p.line, Some(20), "{p}");
        assert!(p.message.contains("invalid Service"), "{p}");
        let shown = p.to_string();
        assert!(shown.contains("m.yaml document 3 (line 20): invalid Service"), "{shown}");
        // The wrongly typed Service still names itself: it gets a status line of its own.
        let invalid: Vec<String> = m.invalid_services.iter().map(|i| i.key.to_string()).collect();
        assert_eq!(invalid, ["default/typed"], "the unparsable one has no name");
        assert_eq!(m.invalid_services[0].problem, m.problems[1]);
    }

    #[test]
    fn services_served_from_a_last_good_file_say_so() {
        let dir = dir_with(&[("m.yaml", SVC)]);
        let mut lg = LastGood::default();
        assert!(lg.apply(load_dir(dir.path()).expect("load")).stale.is_empty());
        std::fs::write(dir.path().join("m.yaml"), format!("{SVC}  - port: eighty\n")).unwrap();
        let m = lg.apply(load_dir(dir.path()).expect("load"));
        assert_eq!(names(&m).0, vec!["default/web".to_string()], "kept: {:?}", m.problems);
        let note = m.stale.get(&ServiceKey::new("default", "web")).expect("a note for default/web");
        assert!(note.contains("last good version") && note.contains("m.yaml"), "{note}");
    }

    #[test]
    fn kinds_and_versions() {
        let files = [
            ("a.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cfg\n"),
            ("b.yaml", "apiVersion: v1beta1\nkind: Service\nmetadata:\n  name: old\n"),
            ("c.yaml", "apiVersion: v1\nmetadata:\n  name: nokind\n"),
            ("d.yaml", "- just\n- a list\n"),
            ("e.yaml", "apiVersion: v1\nkind: Service\nmetadata:\n  namespace: x\nspec: {}\n"),
            ("f.yaml", SVC),
            ("g.yaml", SVC), // duplicate of f.yaml
        ];
        let dir = dir_with(&files);
        let m = load_dir(dir.path()).expect("load");
        assert_eq!(m.services.len(), 1);
        assert_eq!(m.ignored.len(), 1);
        let ignored = m.ignored[0].to_string();
        assert!(
            ignored.starts_with("ignored kind ConfigMap (v1) \"cfg\" in ")
                && ignored.ends_with("a.yaml document 1"),
            "{ignored}"
        );
        let msgs: Vec<String> = m.problems.iter().map(ToString::to_string).collect();
        assert_eq!(msgs.len(), 5, "{msgs:?}");
        let expect = [
            ("b.yaml", "unsupported apiVersion \"v1beta1\""),
            ("c.yaml", "no kind"),
            ("d.yaml", "found a list"),
            ("e.yaml", "no metadata.name"),
            ("g.yaml", "duplicate Service default/web"),
        ];
        for ((file, needle), msg) in expect.iter().zip(&msgs) {
            assert!(msg.contains(file) && msg.contains(needle), "{msg} lacks {file}/{needle}");
        }
    }

    #[test]
    fn ignored_objects_are_reported_once_per_appearance() {
        let obj = |file: &str, kind: &str, name: Option<&str>, document: usize| IgnoredObject {
            file: PathBuf::from(file),
            document,
            api_version: "v1".into(),
            kind: kind.into(),
            name: name.map(str::to_string),
        };
        let cm = obj("a.yaml", "ConfigMap", Some("cfg"), 1);
        let dep = obj("a.yaml", "Deployment", Some("app"), 2);
        let cm_moved = obj("a.yaml", "ConfigMap", Some("cfg"), 3); // a document inserted above it
        let cm_other_file = obj("b.yaml", "ConfigMap", Some("cfg"), 1);
        let unnamed = obj("a.yaml", "Secret", None, 4);
        // (step, ignored at this sync, what is reported)
        let steps: Vec<(&str, Vec<IgnoredObject>, Vec<&IgnoredObject>)> = vec![
            ("first sync reports all", vec![cm.clone(), dep.clone()], vec![&cm, &dep]),
            ("unchanged: nothing", vec![cm.clone(), dep.clone()], vec![]),
            ("moved within its file: nothing", vec![cm_moved.clone(), dep.clone()], vec![]),
            (
                "same in another file: reported",
                vec![cm_moved.clone(), dep.clone(), cm_other_file.clone()],
                vec![&cm_other_file],
            ),
            ("one removed: nothing", vec![cm_moved.clone(), cm_other_file.clone()], vec![]),
            ("back again: reported", vec![cm_moved.clone(), cm_other_file.clone(), dep.clone()], vec![&dep]),
            ("unnamed, twice in one sync: once", vec![unnamed.clone(), unnamed.clone()], vec![&unnamed]),
            ("nothing ignored", vec![], vec![]),
            ("after a gap: reported again", vec![cm.clone()], vec![&cm]),
        ];
        let mut log = IgnoredLog::default();
        for (step, ignored, want) in &steps {
            let got = log.newly_ignored(ignored);
            assert_eq!(&got, want, "{step}");
        }
    }

    #[test]
    fn json_and_lists() {
        let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j","namespace":"ns"},"spec":{"ports":[{"port":53,"protocol":"UDP"}]}}"#;
        let bad_json =
            "{\n  \"apiVersion\": \"v1\",\n  \"kind\": \"Service\",\n  \"metadata\": {\"name\": 5}\n}\n";
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n- {}\n- apiVersion: v1\n  kind: Secret\n  metadata: {{name: s}}\n- apiVersion: v1\n  kind: Service\n  metadata: {{name: bad}}\n  spec: {{ports: [{{port: x}}]}}\n",
            serde_json::to_string(&serde_yaml::from_str::<Value>(SLICE).expect("slice")).expect("json")
        );
        let svc_list = "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: from-list}\n  spec: {type: LoadBalancer, ports: [{port: 1}]}\n";
        let dir = dir_with(&[("j.json", json), ("k.json", bad_json), ("l.yml", &list), ("s.yaml", svc_list)]);
        let m = load_dir(dir.path()).expect("load");
        assert_eq!(
            names(&m),
            (vec!["ns/j".to_string(), "default/from-list".to_string()], vec!["prod/web-1".to_string()])
        );
        assert_eq!(m.ignored.len(), 1);
        assert_eq!(m.ignored[0].kind, "Secret");
        let msgs: Vec<String> = m.problems.iter().map(ToString::to_string).collect();
        assert_eq!(msgs.len(), 2, "{msgs:?}");
        assert!(msgs[0].contains("k.json document 1 (line 4)"), "{}", msgs[0]);
        assert!(msgs[1].contains("l.yml document 1: items[2]: invalid Service"), "{}", msgs[1]);
    }

    #[test]
    fn file_selection() {
        let dir = dir_with(&[
            (".hidden.yaml", SVC),
            ("notes.txt", "hello"),
            ("web.yaml.bak", SVC),
            ("z.yaml", SLICE),
        ]);
        fs::create_dir(dir.path().join("sub.yaml")).expect("mkdir");
        fs::write(dir.path().join("sub.yaml/x.yaml"), SVC).expect("write");
        // ConfigMap volume layout: visible symlinks into a hidden, timestamped directory.
        fs::create_dir(dir.path().join("..2024_01_01")).expect("mkdir");
        fs::write(dir.path().join("..2024_01_01/web.yaml"), SVC).expect("write");
        std::os::unix::fs::symlink("..2024_01_01", dir.path().join("..data")).expect("symlink");
        std::os::unix::fs::symlink("..data/web.yaml", dir.path().join("web.yaml")).expect("symlink");
        std::os::unix::fs::symlink("nowhere.yaml", dir.path().join("dangling.yaml")).expect("symlink");
        let m = load_dir(dir.path()).expect("load");
        assert_eq!(names(&m), (vec!["default/web".to_string()], vec!["prod/web-1".to_string()]));
        assert_eq!(m.problems.len(), 1, "{:?}", m.problems);
        assert!(m.problems[0].to_string().contains("dangling.yaml: cannot read"), "{}", m.problems[0]);
    }

    #[test]
    fn missing_dir_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = load_dir(&dir.path().join("nope")).expect_err("missing");
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn split_keeps_lines() {
        let docs = split_documents("a: 1\n--- # c\nb: 2\n--- {c: 3}\n...\n");
        let docs: Vec<(usize, &str)> = docs.iter().map(|(l, t)| (*l, t.as_str())).collect();
        assert_eq!(docs, vec![(0, "a: 1\n"), (2, "b: 2\n"), (3, "    {c: 3}\n"), (5, "\n")]);
    }

    /// Waits for one notification, failing after `limit`.
    async fn expect_change(w: &mut DirWatcher, what: &str, limit: Duration) {
        let started = Instant::now();
        match tokio::time::timeout(limit, w.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{what}: {e}"),
            Err(_) => panic!("{what}: no notification within {limit:?}"),
        }
        assert!(started.elapsed() < limit, "{what}");
    }

    async fn expect_quiet(w: &mut DirWatcher, what: &str) {
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(400), w.changed()).await {
            panic!("{what}: unexpected notification {r:?}");
        }
    }

    #[test]
    fn cached_loading_equals_fresh_loading_across_edits() {
        let dir = dir_with(&[("a.yaml", SVC), ("b.yaml", SLICE)]);
        let mut cache = ManifestCache::default();
        let check = |cache: &mut ManifestCache, what: &str| {
            let cached = load_dir_cached(dir.path(), cache).expect("cached");
            let fresh = load_dir(dir.path()).expect("fresh");
            assert_eq!(names(&cached), names(&fresh), "{what}");
            let p = |m: &Manifests| m.problems.iter().map(|p| p.to_string()).collect::<Vec<_>>();
            assert_eq!(p(&cached), p(&fresh), "{what}");
            cached
        };
        check(&mut cache, "first load");
        fs::write(dir.path().join("a.yaml"), SVC.replace("name: web", "name: web2")).unwrap();
        let m = check(&mut cache, "modified");
        assert_eq!(names(&m).0, vec!["default/web2".to_string()]);
        // The same Service in a second file: a duplicate across files, the first file wins.
        fs::write(dir.path().join("c.yaml"), SVC.replace("name: web", "name: web2")).unwrap();
        let m = check(&mut cache, "duplicate across files");
        assert_eq!(names(&m).0, vec!["default/web2".to_string()]);
        assert!(
            m.problems.iter().any(|p| p.message.contains("duplicate Service default/web2")),
            "{:?}",
            m.problems
        );
        fs::rename(dir.path().join("a.yaml"), dir.path().join("z.yaml")).unwrap();
        check(&mut cache, "renamed");
        fs::remove_file(dir.path().join("z.yaml")).unwrap();
        fs::remove_file(dir.path().join("c.yaml")).unwrap();
        let m = check(&mut cache, "deleted");
        assert!(names(&m).0.is_empty());
        assert_eq!(cache.files.len(), 1, "deleted files leave the cache");
    }

    /// The agent awaits `changed()` in a `select!`: a call cancelled after it read the events
    /// must not lose them (found by the benchmark: changes waited for the next resync).
    #[tokio::test]
    async fn watcher_is_cancel_safe() {
        let dir = dir_with(&[]);
        // A long debounce, so that the call below is surely cancelled during it.
        let quiet = Duration::from_millis(300);
        let mut w = DirWatcher::with_debounce(dir.path(), quiet, 2 * quiet).expect("watch");
        fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        // Let the events arrive, then cancel the call during its debounce wait.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let cancelled = tokio::time::timeout(Duration::from_millis(10), w.changed()).await;
        assert!(cancelled.is_err(), "the debounce should still be running after 10 ms");
        expect_change(&mut w, "change read by a cancelled call", Duration::from_secs(1)).await;
        expect_quiet(&mut w, "nothing more").await;
    }

    #[tokio::test]
    async fn watcher_sees_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let mut w = DirWatcher::new(d).expect("watch");
        expect_quiet(&mut w, "nothing happened").await;
        // Generous limit for loaded CI machines; the design target is ~200 ms.
        let limit = Duration::from_secs(2);

        fs::write(d.join("web.yaml"), SVC).expect("write");
        expect_change(&mut w, "create", limit).await;
        expect_quiet(&mut w, "after create").await;

        let fast = Instant::now();
        fs::write(d.join("web.yaml"), SLICE).expect("write");
        expect_change(&mut w, "modify", limit).await;
        assert!(fast.elapsed() < Duration::from_millis(1000), "slow: {:?}", fast.elapsed());

        // Editor style: write a temp file, rename over.
        fs::write(d.join(".web.yaml.swp"), SVC).expect("write");
        fs::rename(d.join(".web.yaml.swp"), d.join("web.yaml")).expect("rename");
        expect_change(&mut w, "rename over", limit).await;

        fs::rename(d.join("web.yaml"), d.join("web2.yaml")).expect("rename");
        expect_change(&mut w, "rename", limit).await;

        fs::remove_file(d.join("web2.yaml")).expect("rm");
        expect_change(&mut w, "delete", limit).await;

        // A burst is one notification.
        for i in 0..30 {
            fs::write(d.join(format!("f{}.yaml", i % 3)), format!("# {i}\n")).expect("write");
        }
        expect_change(&mut w, "burst", limit).await;
        expect_quiet(&mut w, "after burst").await;
    }

    #[tokio::test]
    async fn watcher_sees_configmap_swaps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        fs::create_dir(d.join("..v1")).expect("mkdir");
        fs::write(d.join("..v1/web.yaml"), SVC).expect("write");
        std::os::unix::fs::symlink("..v1", d.join("..data")).expect("symlink");
        std::os::unix::fs::symlink("..data/web.yaml", d.join("web.yaml")).expect("symlink");
        let mut w = DirWatcher::new(d).expect("watch");
        // What the kubelet does on a ConfigMap update.
        fs::create_dir(d.join("..v2")).expect("mkdir");
        fs::write(d.join("..v2/web.yaml"), SLICE).expect("write");
        std::os::unix::fs::symlink("..v2", d.join("..data_tmp")).expect("symlink");
        fs::rename(d.join("..data_tmp"), d.join("..data")).expect("rename");
        fs::remove_dir_all(d.join("..v1")).expect("rm");
        expect_change(&mut w, "configmap swap", Duration::from_secs(2)).await;
        let m = load_dir(d).expect("load");
        assert_eq!(m.slices.len(), 1);
    }

    #[tokio::test]
    async fn watcher_survives_dir_replacement() {
        let parent = tempfile::tempdir().expect("tempdir");
        let d = parent.path().join("manifests");
        fs::create_dir(&d).expect("mkdir");
        let mut w = DirWatcher::new(&d).expect("watch");
        fs::remove_dir(&d).expect("rmdir");
        expect_change(&mut w, "dir deleted", Duration::from_secs(2)).await;
        fs::create_dir(&d).expect("mkdir");
        expect_change(&mut w, "dir recreated", Duration::from_secs(2)).await;
        fs::write(d.join("web.yaml"), SVC).expect("write");
        expect_change(&mut w, "file in recreated dir", Duration::from_secs(2)).await;
        // Moved away and another directory put in its place.
        fs::rename(&d, parent.path().join("old")).expect("mv");
        fs::create_dir(&d).expect("mkdir");
        expect_change(&mut w, "dir moved", Duration::from_secs(2)).await;
        fs::write(d.join("x.yaml"), SVC).expect("write");
        expect_change(&mut w, "file in new dir", Duration::from_secs(2)).await;
        fs::write(parent.path().join("old/y.yaml"), SVC).expect("write");
        expect_quiet(&mut w, "old dir is not watched").await;
    }
}
