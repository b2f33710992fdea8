//! Fuzz targets for every parser of data someone else wrote. Each target takes arbitrary bytes,
//! builds hostile input from them, runs the code the agent runs on it and checks properties; a
//! panic is a finding. Shared, unchanged, by the stable harness (`tests/fuzz.rs`: bounded,
//! deterministic, part of CI) and by cargo-fuzz (`fuzz/fuzz_targets/`: coverage-guided, on a
//! nightly toolchain), so both run the same inputs the same way. See docs/reliability.md.

#[path = "annotations.rs"]
pub mod annotations;
#[path = "files.rs"]
pub mod files;
#[path = "hostile.rs"]
pub mod hostile;
#[path = "leader.rs"]
pub mod leader;
#[path = "netlink.rs"]
pub mod netlink;
#[path = "objects.rs"]
pub mod objects;
#[path = "world.rs"]
pub mod world;

/// A fuzz target: its name (the corpus directory `fuzz/corpus/<name>/`), its entry point, and how
/// many mutated inputs the stable harness runs by default (a few minutes in all, on 2 cores).
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]),
    pub runs: usize,
}

pub const TARGETS: &[Target] = &[
    Target { name: "objects", run: objects::run, runs: 5_000 },
    Target { name: "annotations", run: annotations::run, runs: 5_000 },
    Target { name: "manifests", run: files::manifests, runs: 10_000 },
    Target { name: "state_file", run: files::state_file, runs: 20_000 },
    Target { name: "nft_dump", run: netlink::nft_dump, runs: 50_000 },
    Target { name: "sock_diag", run: netlink::sock_diag, runs: 100_000 },
];
