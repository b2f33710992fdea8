//! Cleanup for long-running programs built on this support (benchmarks, soak, races): on Ctrl-C
//! or SIGTERM, every process inside a namespace this process created (agents, the control plane,
//! servers spawned there) is killed, the namespaces are deleted and the temporary directories
//! registered with [`remove_on_signal`] (the control plane's etcd data: ~1 GiB at 50,000
//! Services) are removed, before exiting with 130. Namespaces are named `nlb-<tag>-<pid>-<n>`
//! ([`super::netns::NetNs`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Directories to remove if a signal ends the process (their `TempDir`s are not dropped then).
static OWN_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Registers `dir` (a temporary directory this process created) for removal on Ctrl-C/SIGTERM.
fn remove_on_signal(dir: &Path) {
    OWN_DIRS.lock().unwrap_or_else(|e| e.into_inner()).push(dir.to_path_buf());
}

/// A temporary directory named `<prefix>…`, removed when dropped and, if a signal ends the
/// process first, by the signal handler.
pub fn temp_dir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().expect("temporary directory");
    remove_on_signal(dir.path());
    dir
}

/// This process's namespaces (by name), whatever state they are in.
pub fn own_namespaces() -> Vec<String> {
    let tag = format!("-{}-", std::process::id());
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/run/netns") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("nlb-") && name.contains(&tag) {
                out.push(name);
            }
        }
    }
    out
}

/// SIGKILLs every process living in one of this process's namespaces, then deletes them.
pub fn kill_and_delete_own_namespaces() {
    for name in own_namespaces() {
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>()
                    && pid != std::process::id() as i32
                {
                    let _ =
                        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
                }
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
    }
}

/// Blocks SIGINT/SIGTERM in every thread and handles them on one thread: see the module
/// documentation. Must run before any other thread is spawned (they inherit the mask).
pub fn install_signal_cleanup() {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().expect("block signals");
    std::thread::spawn(move || {
        if let Ok(sig) = set.wait() {
            eprintln!("\n{sig:?}: killing what runs in our namespaces and deleting them");
            kill_and_delete_own_namespaces();
            for dir in OWN_DIRS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = std::fs::remove_dir_all(dir);
            }
            std::process::exit(130);
        }
    });
}
