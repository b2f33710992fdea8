//! Sets `NODELB_GIT_COMMIT` for `nodelb_build_info{git_commit}`: the checkout's
//! `git rev-parse --short=12 HEAD` when git and the repository are there; else the builder's own
//! `NODELB_GIT_COMMIT` environment variable (the Docker build: `.dockerignore` leaves `.git` out,
//! so the Dockerfile takes it as a build argument); else `unknown`. Never fails the build.
//!
//! No `-dirty` marker: knowing whether the tree is dirty would mean rerunning this script on every
//! source change; the commit alone stays correct with the rerun triggers below.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=NODELB_GIT_COMMIT");
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| ".".into()));
    let commit = match git(&dir, &["rev-parse", "--short=12", "HEAD"]).filter(|c| is_commit(c)) {
        Some(commit) => {
            watch_head(&dir);
            commit
        }
        None => std::env::var("NODELB_GIT_COMMIT")
            .ok()
            .map(|c| c.trim().to_string())
            .filter(|c| is_commit(c))
            .unwrap_or_else(|| "unknown".to_string()),
    };
    println!("cargo:rustc-env=NODELB_GIT_COMMIT={commit}");
}

/// A hex object name (possibly abbreviated), so nothing odd ends up in a label or the rustc env.
fn is_commit(s: &str) -> bool {
    (4..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").arg("-C").arg(dir).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_string())
}

/// Reruns this script when HEAD moves: a checkout changes `HEAD`, a commit changes the branch's ref
/// (a loose file, or `packed-refs` after `git pack-refs`). Git itself says where these live, so a
/// worktree (where `.git` is a file pointing elsewhere) works too. Only existing paths are
/// watched: cargo reruns a script on every build when a watched path is missing.
fn watch_head(dir: &Path) {
    let path = |args: &[&str]| git(dir, args).map(|p| dir.join(p));
    let watch = |p: &Path| {
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    };
    if let Some(head) = path(&["rev-parse", "--git-path", "HEAD"]) {
        watch(&head);
    }
    if let Some(common) = path(&["rev-parse", "--git-common-dir"]) {
        watch(&common.join("packed-refs"));
    }
    // Detached HEAD: no symbolic ref, HEAD itself holds the commit.
    if let Some(name) = git(dir, &["symbolic-ref", "-q", "HEAD"])
        && let Some(loose) = path(&["rev-parse", "--git-path", &name])
    {
        // A branch without a loose ref yet (only packed): its directory gets the file on the next
        // commit.
        if let Some(p) = loose.ancestors().find(|p| p.exists()) {
            watch(p);
        }
    }
}
