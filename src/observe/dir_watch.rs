//! Noticing that the manifests directory changed. [`DirWatcher`] watches DIR itself with inotify
//! (not the files: editors and ConfigMap updates replace files by rename, which a per-file watch
//! would lose). Any event in DIR, hidden names included (ConfigMap updates are a rename of
//! `..data_tmp` over `..data`), schedules one notification; bursts are coalesced
//! ([`crate::observe::debounce`]): it fires [`DEBOUNCE_QUIET`] after the last event and at most
//! [`DEBOUNCE_MAX`] after the first. It is a plain async fn over a non-blocking inotify fd (no
//! thread). If DIR is deleted or moved away, the watcher reports the change and re-attaches when a
//! directory appears at the path again.

use std::io;
use std::os::fd::{AsFd as _, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::observe::debounce::{Burst, Events};

/// Quiet time after the last event before notifying. One writer's burst (an editor's temp file +
/// rename, `kubectl cp`, the kubelet's ConfigMap symlink swap) is a few syscalls in a row; the
/// quiet time also covers a writer descheduled on a busy node. A burst split by a longer pause
/// costs one extra sync, never a wrong one (a half-written file keeps its last good content). It
/// is paid on every change, so it is kept short (docs/benchmarks.md, "Design decisions, measured").
pub const DEBOUNCE_QUIET: Duration = Duration::from_millis(10);
/// Longest delay between the first event of a burst and the notification.
pub const DEBOUNCE_MAX: Duration = Duration::from_millis(150);
/// How often a watcher that lost DIR looks for it again.
const IDLE_TICK: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
#[error("manifests directory {path}: cannot watch: {source}")]
pub struct WatchError {
    pub path: PathBuf,
    pub source: io::Error,
}

/// Watches a manifests directory; see the module documentation. Create it *before* the first
/// read of DIR, so that a change in between is not lost. Events that happen while nobody waits
/// in [`DirWatcher::changed`] queue in the kernel and make the next call return promptly.
pub struct DirWatcher {
    inotify: DirEvents,
    burst: Burst,
}

/// The inotify watch on DIR, as a source of [`Events`].
struct DirEvents {
    dir: PathBuf,
    fd: AsyncFd<InotifyFd>,
    /// `None` while DIR is gone (deleted or moved away).
    watch: Option<WatchDescriptor>,
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
    pub fn new(dir: &Path) -> Result<DirWatcher, WatchError> {
        Self::with_debounce(dir, DEBOUNCE_QUIET, DEBOUNCE_MAX)
    }

    /// [`DirWatcher::new`] with another debounce (tests that need a long one).
    fn with_debounce(dir: &Path, quiet: Duration, max: Duration) -> Result<DirWatcher, WatchError> {
        let watch_err = |source: io::Error| WatchError { path: dir.to_path_buf(), source };
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
        let inotify = DirEvents { dir: dir.to_path_buf(), fd, watch: Some(wd) };
        Ok(DirWatcher { inotify, burst: Burst::new(quiet, max) })
    }

    /// Waits until something in DIR changed, then for the burst to settle (see
    /// [`DEBOUNCE_QUIET`], [`DEBOUNCE_MAX`]). Cancel-safe: a call dropped part-way (in a
    /// `select!`) leaves the burst pending, and the next call finishes it. An error means inotify
    /// itself failed.
    pub async fn changed(&mut self) -> Result<(), WatchError> {
        self.burst.settle(&mut self.inotify).await
    }
}

impl Events for DirEvents {
    type Error = WatchError;

    /// Reads events; while DIR is gone, wakes up regularly to re-attach.
    async fn wait(&mut self, burst: &mut Burst) -> Result<(), WatchError> {
        if self.watch.is_some() {
            self.read_events(burst).await?;
        } else {
            tokio::time::timeout(IDLE_TICK, self.read_events(burst)).await.unwrap_or(Ok(()))?;
        }
        if self.reattach() {
            burst.note();
        }
        Ok(())
    }
}

impl DirEvents {
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

    /// Reads at least one batch of events and records them in `burst` before returning (no
    /// await between reading and recording, so a cancellation cannot lose them).
    async fn read_events(&mut self, burst: &mut Burst) -> Result<(), WatchError> {
        let dir = self.dir.clone();
        let err = |source: io::Error| WatchError { path: dir.clone(), source };
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
                        burst.note();
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
    use std::fs;

    use std::time::Instant;

    use super::*;
    use crate::observe::manifest_dir::fixtures::{SLICE, SVC, dir_with};
    use crate::observe::manifest_dir::load_dir;

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
