//! Manifests: Service and EndpointSlice objects from YAML/JSON text, and the merge of a
//! directory's files into one view. Pure: the agent's `manifest_dir` reads the files (and caches
//! them by stamp), `dir_watch` notices when they change.
//!
//! Decisions:
//! - YAML files may hold several documents (`---`). Each document is parsed on its own, so a
//!   syntax error in one does not hide the others; documents are numbered from 1 counting only
//!   non-empty ones (what a human counts), and line numbers are those of the file.
//! - `kind: List` (and `ServiceList`/`EndpointSliceList`/`NodePortPoolList`, as `kubectl get -o
//!   yaml` writes them) contribute their items.
//! - `nodelb.io/v1alpha1 NodePortPool` objects (cluster-scoped: a namespace given is dropped) are
//!   read too; whether a pool is *valid* is the pure `pool` module's decision, as in Kubernetes
//!   mode (a document that does not even parse as one is a problem of its file here).
//! - `v1 Service` and `discovery.k8s.io/v1 EndpointSlice` are parsed into k8s-openapi types. Other
//!   kinds are not errors but are reported in [`Manifests::ignored`] so the caller can log them;
//!   a Service or EndpointSlice of another apiVersion is a problem (almost surely a mistake).
//! - Objects without a namespace get `default`; an object without a name is a problem. The
//!   same kind/namespace/name twice, in one file or across files, is a problem ([`Taken`]); the
//!   first one (in file order) is kept.
//! - A file with a problem is served from its last good content ([`LastGood`]), so a file being
//!   edited does not make its Services vanish.
//! - Nothing here fails: every unusable file or document is a [`ManifestProblem`] and does not
//!   stop the others.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::inputs::compact::EndpointSlice;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::decisions::pool::NodePortPool;
use crate::domain::ServiceKey;
use crate::inputs::slim::Slim as _;

/// Deepest nesting (mappings, sequences, flow or block) of a YAML document: far deeper than any
/// Kubernetes object, and the parser stops there as it reads, whatever follows.
pub const MAX_YAML_NESTING: usize = 64;
/// Longest problem message: the parsers quote what they refuse (a megabyte string where a
/// number belongs), and a problem goes into a log line and `/status`.
const MAX_PROBLEM_MESSAGE: usize = 1024;

/// Everything read from DIR. Objects are shared (`Arc`): the cache, [`LastGood`] and every
/// snapshot hold the same parsed objects, so a sync copies pointers, never objects.
#[derive(Debug, Clone, Default)]
pub struct Manifests {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    /// Node port pools, in file order.
    pub pools: Vec<Arc<NodePortPool>>,
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
    pub pools: Vec<Arc<NodePortPool>>,
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
        let mut pools = Vec::new();
        for (path, objs) in &m.files {
            let served = match self.files.get(path) {
                Some(good) if objs.had_problem => {
                    let why = objs.first_problem.as_deref().unwrap_or("it has a problem");
                    for svc in &good.services {
                        let note = format!("served from the last good version of {}: {why}", path.display());
                        m.stale.insert(crate::inputs::model::service_key(svc), note);
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
            pools.extend(served.pools.iter().cloned());
        }
        m.services = services;
        m.slices = slices;
        m.pools = pools;
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
            format!("{}… ({} bytes)", crate::domain::cut(&message, MAX_PROBLEM_MESSAGE), message.len())
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
        let short = |s: &str| match s.len() > crate::domain::MAX_QUOTED {
            true => format!("{}…", crate::domain::cut(s, crate::domain::MAX_QUOTED)),
            false => s.to_string(),
        };
        write!(f, "ignored kind {} ({})", short(&self.kind), short(&self.api_version))?;
        if let Some(name) = &self.name {
            write!(f, " {}", crate::domain::quoted(name))?;
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

/// The node port pools of a manifests directory as the node uses them: the same decisions as in
/// Kubernetes mode ([`crate::decisions::pool::context`]), with the one node manifests mode knows (this one,
/// labelled `--node-labels`) and namespaces labelled only with their name (no Namespace
/// objects). An invalid pool is a problem naming its file; its last valid version stays in force.
pub fn pool_context(
    m: &Manifests,
    last_valid: &mut crate::decisions::pool::LastValid,
    flag_range: crate::decisions::port_policy::PortRange,
    node_labels: &BTreeMap<String, String>,
    servicelb: bool,
) -> (crate::decisions::pool::PoolContext, Vec<String>) {
    use crate::decisions::pool::PoolObject;
    let objects: Vec<PoolObject> = m.pools.iter().map(|p| PoolObject::from_resource(p)).collect();
    let namespaces = || {
        crate::decisions::pool::implied_namespace_labels(
            m.services.iter().filter_map(|s| s.metadata.namespace.as_deref()),
        )
    };
    let input = crate::decisions::pool::ContextInput {
        objects: &objects,
        flag_range,
        nodes: &[node_labels],
        own: Some(node_labels),
        namespaces: &namespaces,
        servicelb,
    };
    let (ctx, invalid) = crate::decisions::pool::context(last_valid, &input);
    let file_of = |name: &str| {
        m.files.iter().find(|(_, f)| f.pools.iter().any(|p| p.metadata.name.as_deref() == Some(name)))
    };
    let problems = invalid
        .iter()
        .map(|i| match file_of(&i.name) {
            Some((path, _)) => format!("{}: {i}", path.display()),
            None => i.to_string(),
        })
        .collect();
    (ctx, problems)
}

/// One file's objects, parsed from its `text` (`name` ends in `.json`: JSON, else YAML).
/// Duplicates within the file are problems here; across files, [`merge`] finds them.
pub fn parse(path: &Path, name: &str, text: &str) -> Manifests {
    let mut loader = Loader::default();
    if name.ends_with(".json") {
        loader.json_file(path, text);
    } else {
        loader.yaml_file(path, text);
    }
    loader.out
}

/// A file that could not be read: its one problem.
pub fn unreadable(path: &Path, error: &str) -> Manifests {
    let mut loader = Loader::default();
    loader.problem(path, 0, None, format!("cannot read: {error}"));
    loader.out
}

/// Every file's objects merged in the order given (file name order), objects shared, not
/// copied; an object an earlier file already defined is dropped with a problem.
pub fn merge<'a>(files: impl IntoIterator<Item = (&'a Path, &'a Manifests)>) -> Manifests {
    let mut out = Manifests::default();
    let mut taken = Taken::<&str, &Path>::default();
    for (path, file) in files {
        merge_file(&mut out, &mut taken, path, file);
    }
    out
}

/// [`merge`] for a directory read again and again (the manifests mode's sync): when the last
/// merge dropped nothing (no name defined in two files) and the files that changed name nothing
/// another file names, the files that did not change are taken as they were merged, and only the
/// names of those that changed are looked at. Otherwise, a whole [`merge`]. Either way the same
/// result (`tests`): the whole check of every name would be most of a sync's reading of a large
/// directory.
#[derive(Debug, Default)]
pub struct Merger {
    files: BTreeMap<PathBuf, MergedFile>,
    /// How many of the files' objects have each name (kind, namespace, name), by its hash: a
    /// name a changed file brings is new only when its hash is not here (a collision costs a
    /// whole merge, never a wrong one).
    names: foldhash::HashMap<u64, u32>,
    /// The last merge dropped nothing.
    clean: bool,
}

#[derive(Debug)]
struct MergedFile {
    /// The parsed file (held: another parse is another `Arc`).
    parsed: Arc<Manifests>,
    objects: Arc<FileObjects>,
    names: Box<[u64]>,
}

impl Merger {
    /// The files' objects merged as [`merge`] merges them (`files` in file name order).
    pub fn merge(&mut self, files: &[(&Path, &Arc<Manifests>)]) -> Manifests {
        if !(self.clean && self.update(files)) {
            let out = merge(files.iter().map(|(path, m)| (*path, &***m)));
            self.remember(files, &out);
            return out;
        }
        let mut out = Manifests::default();
        for (path, f) in &self.files {
            out.problems.extend(f.parsed.problems.iter().cloned());
            out.ignored.extend(f.parsed.ignored.iter().cloned());
            out.invalid_services.extend(f.parsed.invalid_services.iter().cloned());
            out.services.extend(f.objects.services.iter().cloned());
            out.slices.extend(f.objects.slices.iter().cloned());
            out.pools.extend(f.objects.pools.iter().cloned());
            out.files.insert(path.clone(), Arc::clone(&f.objects));
        }
        out
    }

    /// Takes in the files that changed, came or went; `false` when a whole merge is needed (a
    /// name one of them brings is already taken; what is kept is then rebuilt by it).
    fn update(&mut self, files: &[(&Path, &Arc<Manifests>)]) -> bool {
        let now: BTreeMap<&Path, &Arc<Manifests>> = files.iter().copied().collect();
        if now.len() != files.len() {
            return false;
        }
        let gone: Vec<PathBuf> = (self.files.iter())
            .filter(|(path, f)| now.get(path.as_path()).is_none_or(|m| !Arc::ptr_eq(m, &f.parsed)))
            .map(|(path, _)| path.clone())
            .collect();
        for path in &gone {
            let f = self.files.remove(path).expect("listed");
            for n in f.names.iter() {
                if let std::collections::hash_map::Entry::Occupied(mut e) = self.names.entry(*n) {
                    *e.get_mut() -= 1;
                    if *e.get() == 0 {
                        e.remove();
                    }
                }
            }
        }
        for (path, parsed) in files {
            if self.files.contains_key(*path) {
                continue;
            }
            let names = names_of(parsed);
            for n in names.iter() {
                if self.names.insert(*n, 1).is_some() {
                    return false;
                }
            }
            // Merged on its own: none of its names is another file's.
            let mut alone = Manifests::default();
            merge_file(&mut alone, &mut Taken::default(), path, parsed);
            let objects = alone.files.remove(*path).expect("merged");
            let file = MergedFile { parsed: Arc::clone(parsed), objects, names };
            self.files.insert(path.to_path_buf(), file);
        }
        true
    }

    /// After a whole merge: each file as it was merged, every name, whether it dropped anything.
    fn remember(&mut self, files: &[(&Path, &Arc<Manifests>)], out: &Manifests) {
        self.files.clear();
        self.names.clear();
        let mut given = 0;
        for (path, parsed) in files {
            given += parsed.services.len() + parsed.slices.len() + parsed.pools.len();
            let Some(objects) = out.files.get(*path) else { continue };
            let names = names_of(parsed);
            for n in names.iter() {
                *self.names.entry(*n).or_default() += 1;
            }
            let file = MergedFile { parsed: Arc::clone(parsed), objects: Arc::clone(objects), names };
            self.files.insert(path.to_path_buf(), file);
        }
        self.clean = given == out.services.len() + out.slices.len() + out.pools.len();
    }
}

/// The hashes of the names (kind, namespace, name) of a file's objects, as [`Taken`] keys them.
fn names_of(m: &Manifests) -> Box<[u64]> {
    use std::hash::BuildHasher as _;
    let hasher = foldhash::fast::FixedState::with_seed(0x6e6f_6465_6c62);
    let name = |kind: &'static str, meta: &ObjectMeta| {
        let (ns, name) =
            (meta.namespace.as_deref().unwrap_or_default(), meta.name.as_deref().unwrap_or_default());
        hasher.hash_one((kind, ns, name))
    };
    (m.services.iter().map(|s| name("Service", &s.metadata)))
        .chain(m.slices.iter().map(|s| name("EndpointSlice", &s.metadata)))
        .chain(m.pools.iter().map(|p| name("NodePortPool", &p.metadata)))
        .collect()
}

/// The objects defined so far, by kind and namespace/name, with the file that defined each: the
/// one duplicate check, within a file and across files (the first definition wins). `K`: the
/// names and file owned (while a file is parsed) or borrowed from the parsed files (a merge
/// takes every object of the directory: copies of each name would be a good part of its time).
#[derive(Debug)]
/// Hashed: a tree of every name would be most of a merge.
struct Taken<S, P>(foldhash::HashMap<(&'static str, S, S), P>);

impl<S, P> Default for Taken<S, P> {
    fn default() -> Self {
        Taken(Default::default())
    }
}

impl<S: std::hash::Hash + Eq + std::ops::Deref<Target = str>, P: std::ops::Deref<Target = Path>> Taken<S, P> {
    /// Takes `kind` `ns`/`name` for `file`; when an earlier definition has it, the problem's
    /// message.
    fn take(&mut self, kind: &'static str, ns: S, name: S, file: P) -> Result<(), String> {
        match self.0.entry((kind, ns, name)) {
            Entry::Vacant(e) => {
                e.insert(file);
                Ok(())
            }
            Entry::Occupied(e) => {
                // Formatted for duplicates only.
                let (_, ns, name) = e.key();
                let what = match ns.is_empty() {
                    true => format!("duplicate {kind} {}", crate::domain::quoted(name)),
                    false => format!("duplicate {kind} {}", ServiceKey::new(&**ns, &**name)),
                };
                if **e.get() == *file {
                    Err(format!("{what}; the first one is used"))
                } else {
                    Err(format!("{what} (first defined in {}); the first one is used", e.get().display()))
                }
            }
        }
    }
}

/// Adds one file's objects to `out`, dropping objects an earlier file already defined.
fn merge_file<'a>(
    out: &mut Manifests,
    taken: &mut Taken<&'a str, &'a Path>,
    path: &'a Path,
    file: &'a Manifests,
) {
    let mut objs = FileObjects {
        had_problem: !file.problems.is_empty(),
        first_problem: file.problems.first().map(ToString::to_string),
        ..Default::default()
    };
    out.problems.extend(file.problems.iter().cloned());
    out.ignored.extend(file.ignored.iter().cloned());
    out.invalid_services.extend(file.invalid_services.iter().cloned());
    let mut admit = |kind: &'static str, meta: &'a ObjectMeta, problems: &mut Vec<ManifestProblem>| {
        let (ns, name) =
            (meta.namespace.as_deref().unwrap_or_default(), meta.name.as_deref().unwrap_or_default());
        taken
            .take(kind, ns, name, path)
            .map_err(|message| problems.push(ManifestProblem::new(path, 0, None, message)))
            .is_ok()
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
    for pool in &file.pools {
        if admit("NodePortPool", &pool.metadata, &mut out.problems) {
            objs.pools.push(Arc::clone(pool));
        } else {
            objs.had_problem = true;
        }
    }
    if objs.had_problem && objs.first_problem.is_none() {
        objs.first_problem = out.problems.last().map(ToString::to_string);
    }
    out.services.extend(objs.services.iter().cloned());
    out.slices.extend(objs.slices.iter().cloned());
    out.pools.extend(objs.pools.iter().cloned());
    out.files.insert(path.to_path_buf(), Arc::new(objs));
}

#[derive(Default)]
struct Loader {
    out: Manifests,
    taken: Taken<String, PathBuf>,
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
        self.object(&origin, value, Some(&|kind| kind.read(&JsonText(text))));
    }

    fn yaml_file(&mut self, file: &Path, text: &str) {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut document = 0;
        for (first_line, body) in split_documents(text) {
            if body.trim().is_empty() {
                continue; // not a document (a million `---` lines are read in one pass)
            }
            // Parsed on its own (padding it with the preceding lines would make a large file
            // quadratic to read); error lines are shifted to file lines.
            let value: Value = match yaml_value(&body) {
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
            self.object(&origin, value, Some(&|kind| kind.read(&YamlText(&body, first_line))));
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
            ("List" | "ServiceList" | "EndpointSliceList" | "NodePortPoolList", _) => {
                return self.list(origin, &kind, map.get("items"));
            }
            ("Service", "v1") => Kind::Service,
            ("EndpointSlice", "discovery.k8s.io/v1") => Kind::Slice,
            ("NodePortPool", "nodelb.io/v1alpha1") => Kind::Pool,
            ("Service" | "EndpointSlice" | "NodePortPool", other) => {
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
        // From the value already read; a document that does not read so is read again from its
        // text, which gives its error a line (or reads what the YAML reading takes and a JSON
        // value does not: a number where a string belongs).
        let typed = match (typed_kind.read(&value), reparse) {
            (Err(_), Some(reparse)) => reparse(typed_kind),
            (typed, _) => typed,
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
            Ok(Typed::Pool(mut pool)) => {
                if self.admit(origin, "NodePortPool", &mut pool.metadata) {
                    pool.slim();
                    self.out.pools.push(Arc::from(pool));
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
            "NodePortPoolList" => Some(("nodelb.io/v1alpha1", "NodePortPool")),
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
    fn admit(&mut self, origin: &Origin<'_>, kind: &'static str, meta: &mut ObjectMeta) -> bool {
        if kind == "NodePortPool" {
            meta.namespace = None; // cluster-scoped, as the API server treats it
        } else if meta.namespace.as_deref().is_none_or(str::is_empty) {
            meta.namespace = Some("default".to_string());
        }
        if meta.name.as_deref().is_none_or(str::is_empty) {
            let msg = format!("{}{kind} has no metadata.name", origin.prefix);
            self.problem(origin.file, origin.document, None, msg);
            return false;
        }
        let (ns, name) = (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default());
        if let Err(duplicate) = self.taken.take(kind, ns, name, origin.file.to_path_buf()) {
            let msg = format!("{}{duplicate}", origin.prefix);
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

/// How one YAML document of `len` bytes is read: YAML 1.2 core booleans (`yes` and `on` are
/// strings), a key given twice is an error, and the parser's budgets bound what the document may
/// expand to. Aliases repeat what they name, so the nodes and string bytes a document yields are
/// bounded by twice its size plus 4 KiB, not by its size: 2,000 uses of a 2,000-item list are
/// millions of values from a few kilobytes of text. Without aliases a document never comes close.
fn yaml_options(len: usize) -> serde_saphyr::Options {
    let expands = 2 * len + 4096;
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = MAX_YAML_NESTING;
    budget.flow_nesting_limit = MAX_YAML_NESTING;
    budget.max_nodes = expands;
    budget.max_total_scalar_bytes = expands;
    // Counts that never bind before the bounds above (a large `kind: List` without aliases has
    // fewer events, aliases and anchors than bytes): no refusal of their own.
    budget.max_events = expands;
    budget.max_aliases = expands;
    budget.max_anchors = expands;
    budget.enforce_alias_anchor_ratio = false;
    let mut aliases = serde_saphyr::options::AliasLimits::default();
    aliases.max_total_replayed_events = expands;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.alias_limits = aliases;
    options.strict_booleans = true;
    options.duplicate_keys = serde_saphyr::DuplicateKeyPolicy::Error;
    options.with_snippet = false;
    options
}

/// One YAML document as a JSON value (`Null` for one with comments only).
fn yaml_value(body: &str) -> Result<Value, serde_saphyr::Error> {
    serde_saphyr::from_str_with_options(body, yaml_options(body.len()))
}

/// A YAML error of a document that starts after `lines_before` lines of its file: its file
/// line, and its message with that line (a budget's breach in words: which bound, not the
/// parser's name for it).
fn yaml_error(e: &serde_saphyr::Error, lines_before: usize) -> (Option<usize>, String) {
    use serde_saphyr::budget::BudgetBreach;
    let line = e.location().map(|l| l.line() as usize + lines_before);
    let text = e.to_string();
    // A breach while replaying an alias comes wrapped with the alias' locations.
    let mut cause = e;
    while let serde_saphyr::Error::AliasError { error, .. } | serde_saphyr::Error::WithSnippet { error, .. } =
        cause
    {
        cause = error;
    }
    let message = match cause {
        // The depth budget, or the scanner's flow nesting limit (the same number).
        serde_saphyr::Error::Budget { breach: BudgetBreach::Depth { .. }, .. } => {
            format!("nested more than {MAX_YAML_NESTING} levels deep; not read")
        }
        _ if text.starts_with("recursion limit exceeded") => {
            format!("nested more than {MAX_YAML_NESTING} levels deep; not read")
        }
        serde_saphyr::Error::Budget {
            breach:
                BudgetBreach::Nodes { .. } | BudgetBreach::ScalarBytes { .. } | BudgetBreach::Events { .. },
            ..
        }
        | serde_saphyr::Error::AliasReplayLimitExceeded { .. } => {
            "the document expands to more than twice its size (YAML aliases repeating large parts?); not read"
                .to_string()
        }
        _ => match e.location() {
            Some(l) => {
                let here = format!("at line {}, column {}", l.line(), l.column());
                let there = format!("at line {}, column {}", l.line() as usize + lines_before, l.column());
                // The position itself, not one that starts with it (`column 3` in `column 30`).
                let at = text
                    .match_indices(&here)
                    .map(|(i, _)| i)
                    .find(|i| !text[i + here.len()..].starts_with(|c: char| c.is_ascii_digit()));
                match at {
                    Some(i) => format!("{}{there}{}", &text[..i], &text[i + here.len()..]),
                    None => text,
                }
            }
            None => text,
        },
    };
    (line, message)
}

#[derive(Clone, Copy)]
enum Kind {
    Service,
    Slice,
    Pool,
}

impl Kind {
    /// The typed object of this kind read from `source`.
    fn read(self, source: &impl TypedSource) -> Result<Typed, (Option<usize>, String)> {
        Ok(match self {
            Kind::Service => Typed::Service(Box::new(source.read()?)),
            Kind::Slice => Typed::Slice(Box::new(source.read()?)),
            Kind::Pool => Typed::Pool(Box::new(source.read()?)),
        })
    }
}

/// Where a typed object is read from; errors carry a file line when known.
trait TypedSource {
    fn read<T: serde::de::DeserializeOwned>(&self) -> Result<T, (Option<usize>, String)>;
}

/// A JSON file's text.
struct JsonText<'a>(&'a str);

impl TypedSource for JsonText<'_> {
    fn read<T: serde::de::DeserializeOwned>(&self) -> Result<T, (Option<usize>, String)> {
        serde_json::from_str(self.0).map_err(|e| (Some(e.line()), e.to_string()))
    }
}

/// A YAML document's text and the file line it starts on.
struct YamlText<'a>(&'a str, usize);

impl TypedSource for YamlText<'_> {
    fn read<T: serde::de::DeserializeOwned>(&self) -> Result<T, (Option<usize>, String)> {
        serde_saphyr::from_str_with_options(self.0, yaml_options(self.0.len()))
            .map_err(|e| yaml_error(&e, self.1))
    }
}

/// A List item, already a value.
impl TypedSource for Value {
    fn read<T: serde::de::DeserializeOwned>(&self) -> Result<T, (Option<usize>, String)> {
        T::deserialize(self).map_err(|e| (None, e.to_string()))
    }
}

/// Boxed: a Service is twice the size of an EndpointSlice.
enum Typed {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
    Pool(Box<NodePortPool>),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Over random edits of a small directory (files written with Services and EndpointSlices
    /// of a few names, so that two files often define one; broken files; files removed and
    /// added), the merger gives what a whole merge gives, every time, and merges only what
    /// changed most of the time.
    #[test]
    fn the_merger_merges_what_a_whole_merge_merges() {
        let service = |name: &str| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n"
            )
        };
        let slice = |name: &str| {
            format!(
                "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\nendpoints: []\n"
            )
        };
        let (mut reused, mut merges) = (0, 0);
        for seed in 0..20u64 {
            // A small xorshift: the merger's cases, not statistics.
            let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut below = |n: u64| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state % n
            };
            let mut files: BTreeMap<PathBuf, Arc<Manifests>> = BTreeMap::new();
            let mut merger = Merger::default();
            let mut last: BTreeMap<PathBuf, Arc<FileObjects>> = BTreeMap::new();
            for step in 0..60 {
                let file = PathBuf::from(format!("f{}.yaml", below(6)));
                match below(6) {
                    0 => {
                        files.remove(&file);
                    }
                    1 => {
                        let text = "kind: Service\nmetadata: [broken\n";
                        files.insert(file.clone(), Arc::new(parse(&file, "f.yaml", text)));
                    }
                    _ => {
                        // Names from a pool of 120: now and then one another file has.
                        let text: String = (0..1 + below(3))
                            .map(|_| {
                                let name = format!("s{}", below(120));
                                service(&name) + "---\n" + &slice(&name) + "---\n"
                            })
                            .collect();
                        files.insert(file.clone(), Arc::new(parse(&file, "f.yaml", &text)));
                    }
                }
                let list: Vec<(&Path, &Arc<Manifests>)> =
                    files.iter().map(|(p, m)| (p.as_path(), m)).collect();
                let got = merger.merge(&list);
                let want = merge(files.iter().map(|(p, m)| (p.as_path(), &**m)));
                assert_eq!(format!("{got:?}"), format!("{want:?}"), "seed {seed} step {step}");
                // Merged again only where it changed: another file's objects are the same `Arc`.
                merges += 1;
                let kept =
                    |(p, o): (&PathBuf, &Arc<FileObjects>)| last.get(p).is_some_and(|l| Arc::ptr_eq(l, o));
                reused += usize::from(got.files.iter().any(kept));
                last = got.files;
            }
        }
        println!("{reused} of {merges} merges took files as they were");
        assert!(reused * 3 > merges * 2, "only {reused} of {merges} merges took files as they were");
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
    fn split_keeps_lines() {
        let docs = split_documents("a: 1\n--- # c\nb: 2\n--- {c: 3}\n...\n");
        let docs: Vec<(usize, &str)> = docs.iter().map(|(l, t)| (*l, t.as_str())).collect();
        assert_eq!(docs, vec![(0, "a: 1\n"), (2, "b: 2\n"), (3, "    {c: 3}\n"), (5, "\n")]);
    }
}
