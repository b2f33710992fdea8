//! The manifests directory (`nodelb run --manifests DIR`): which files are manifests, reading
//! them, and a cache of parsed files by stamp so that a change to one file of a large directory
//! parses that file only. What the text means is [`crate::core::inputs::manifests`]'s.
//!
//! Files: every `*.yaml`, `*.yml` and `*.json` directly in DIR (no recursion), sorted by name;
//! hidden files are skipped, which also skips Kubernetes ConfigMap volume internals (`..data`,
//! `..2024_…`) while following the visible symlinks into them. Symlinks are followed. Only an
//! unreadable DIR is an error ([`ManifestError`]); an unreadable file is a problem of its own.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::core::inputs::manifests::{self, Manifests};

/// Largest manifest file read (16 MiB): thousands of Services with their EndpointSlices fit in one.
/// A larger file is a problem (its Services keep their last good version), never a read of
/// whatever size into memory: parsing multiplies a file's size several times.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifests directory {path}: cannot read: {source}")]
    ReadDir { path: PathBuf, source: io::Error },
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
/// file only: parsing is most of a sync's time at a thousand Services (docs/benchmarks.md).
#[derive(Debug, Default)]
pub struct ManifestCache {
    files: BTreeMap<PathBuf, (FileStamp, Arc<Manifests>)>,
    /// Merges again only what changed (a parse is a new `Arc`).
    merger: manifests::Merger,
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
        let mut changed = Vec::new();
        for name in names {
            let path = dir.join(&name);
            // metadata() follows symlinks: ConfigMap files are symlinks into `..data/`.
            let file = match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => {
                    let stamp = FileStamp::of(&m);
                    match self.files.remove(&path) {
                        Some((old, parsed)) if old == stamp => (stamp, parsed),
                        _ => {
                            changed.push((path, name, stamp));
                            continue;
                        }
                    }
                }
                Ok(m) if m.is_dir() => continue, // a directory called x.yaml: not a manifest
                // A FIFO, a socket or a device: named, never read (the read checks the opened file
                // too, should it be replaced in between).
                Ok(_) => {
                    let stamp = FileStamp { len: 0, dev: 0, ino: 0, mtime_ns: -2, ctime_ns: -2 };
                    let why = crate::observe::bounded::read_to_string(&path, MAX_FILE_BYTES)
                        .err()
                        .map_or_else(|| "not a regular file".to_string(), |e| e.to_string());
                    (stamp, Arc::new(manifests::unreadable(&path, &why)))
                }
                Err(e) => {
                    let stamp = FileStamp { len: 0, dev: 0, ino: 0, mtime_ns: -1, ctime_ns: -1 };
                    (stamp, Arc::new(manifests::unreadable(&path, &e.to_string())))
                }
            };
            fresh.insert(path, file);
        }
        let parsed = parse_files(&changed);
        fresh.extend(
            changed.into_iter().zip(parsed).map(|((path, _, stamp), m)| (path, (stamp, Arc::new(m)))),
        );
        // Files gone from DIR leave the cache too.
        self.files = fresh;
        Ok(())
    }

    /// Everything the cached files hold, merged in file name order (objects shared, not copied).
    pub fn merged(&mut self) -> Manifests {
        // The map is ordered by path, all in DIR: that is file name order.
        let files: Vec<(&Path, &Arc<Manifests>)> =
            self.files.iter().map(|(path, (_, file))| (path.as_path(), file)).collect();
        self.merger.merge(&files)
    }
}

/// Threads a load parses its files on, at most: the chart sets no CPU limit, so the cores the
/// process may use can be many, and each thread holds the file it parses.
const MAX_PARSE_THREADS: usize = 4;

/// Parses `files` (path, name, stamp), in their order, on up to [`MAX_PARSE_THREADS`] threads
/// (no more than `available_parallelism`, which follows the cgroup's CPU quota): a start, or a
/// directory replaced, parses every file, and parsing is most of such a sync; one changed file is
/// parsed on this thread, and so is a share whose thread cannot be started.
fn parse_files<S: Sync>(files: &[(PathBuf, String, S)]) -> Vec<Manifests> {
    let parse = |chunk: &[(PathBuf, String, S)]| -> Vec<Manifests> {
        chunk.iter().map(|(path, name, _)| parse_file(path, name)).collect()
    };
    let threads =
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_PARSE_THREADS).min(files.len());
    if threads <= 1 {
        return parse(files);
    }
    std::thread::scope(|scope| {
        let parsing: Vec<Result<std::thread::ScopedJoinHandle<'_, Vec<Manifests>>, &[_]>> = files
            .chunks(files.len().div_ceil(threads))
            .map(|chunk| {
                std::thread::Builder::new().spawn_scoped(scope, move || parse(chunk)).map_err(|_| chunk)
            })
            .collect();
        let joined = parsing.into_iter().map(|t| match t {
            Ok(t) => t.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            Err(chunk) => parse(chunk),
        });
        joined.flatten().collect()
    })
}

/// Reads and parses one file.
fn parse_file(path: &Path, name: &str) -> Manifests {
    match crate::observe::bounded::read_to_string(path, MAX_FILE_BYTES) {
        Ok(text) => manifests::parse(path, name, &text),
        Err(e) if e.kind() == io::ErrorKind::FileTooLarge => manifests::unreadable(
            path,
            &format!("{e}: manifests larger than 16 MiB are not read (split the file)"),
        ),
        Err(e) => manifests::unreadable(path, &e.to_string()),
    }
}

/// A manifests directory for tests (here and in [`crate::observe::dir_watch`]).
#[cfg(test)]
pub(crate) mod fixtures {
    use std::fs;

    pub const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\nspec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n";
    pub const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: prod\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [198.51.100.11]\nports:\n- port: 8080\n";

    /// A temporary directory holding `files` (name, text).
    pub fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in files {
            fs::write(dir.path().join(name), text).expect("write");
        }
        dir
    }
}

#[cfg(test)]
mod tests;
