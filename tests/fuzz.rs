//! Bounded, deterministic fuzzing on the stable toolchain (part of CI through `scripts/test.sh`).
//! For each target of `tests/fuzzing/`: every committed input is replayed (`fuzz/corpus/<target>/`
//! and the inputs that once failed, `fuzz/regressions/<target>/`), then a fixed number of inputs
//! mutated from them with a fixed seed (bit flips, byte edits, insertions, deletions, splices).
//! Same code as the coverage-guided targets of `fuzz/` (cargo-fuzz, nightly), without the
//! coverage feedback. `NODELB_FUZZ_RUNS` (default: each target's `runs`) and `NODELB_FUZZ_SEED`
//! change the budget and the seed; a failing input is written to `target/fuzz-failures/<target>/` and
//! replays with `NODELB_FUZZ_REPLAY=<file> cargo test --test fuzz <target>`.

mod fuzzing;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use fuzzing::{TARGETS, Target};

const DEFAULT_SEED: u64 = 0x6e6f_6465_6c62_0001;
/// Longest a mutated input grows (the targets' generators make long values themselves).
const MAX_INPUT: usize = 16 << 10;
/// An input still running after this is a wedge (an endless loop, a runaway allocation), not a
/// slow input: the slowest seen are milliseconds. Not a performance assertion.
const WEDGED_AFTER: Duration = Duration::from_secs(120);

/// splitmix64: small, good enough to drive mutations, and the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Values that sit at the edges of integer fields.
const INTERESTING: &[&[u8]] = &[
    &[0],
    &[0xff],
    &[0x7f],
    &[0x80],
    &[0, 0],
    &[0xff, 0xff],
    &[0, 0, 0, 0],
    &[0xff, 0xff, 0xff, 0xff],
    &[0, 0, 0, 0x80],
    &[0x04, 0x00],
    &[0x08, 0x00],
];

fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(8) {
        let len = out.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = rng.next() as u8;
            }
            2 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(32);
                let extra = rng.bytes(n);
                out.splice(i..i, extra);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                out.drain(i..i + n);
            }
            4 if len > 0 => {
                // Duplicate a range (repetition: lists, nesting).
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(256));
                let copy = out[i..i + n].to_vec();
                let at = rng.below(out.len() + 1);
                out.splice(at..at, copy);
            }
            5 if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())];
                if !other.is_empty() {
                    let i = rng.below(other.len());
                    let n = 1 + rng.below((other.len() - i).min(512));
                    let at = rng.below(out.len() + 1);
                    out.splice(at..at, other[i..i + n].iter().copied());
                }
            }
            6 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let at = rng.below(len + 1);
                let end = (at + v.len()).min(len);
                out.splice(at..end, v.iter().copied());
            }
            7 if len > 0 => out.truncate(rng.below(len)),
            _ => {
                let n = rng.below(64);
                let extra = rng.bytes(n);
                out.extend(extra);
            }
        }
    }
    out.truncate(MAX_INPUT);
    out
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The committed inputs of a target: its corpus and its regressions, in name order.
fn committed(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for dir in ["corpus", "regressions"] {
        let dir = repo().join("fuzz").join(dir).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            if p.is_file() {
                let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                out.push((p, bytes));
            }
        }
    }
    out
}

fn save_failure(target: &str, input: &[u8]) -> PathBuf {
    let dir = repo().join("target").join("fuzz-failures").join(target);
    let _ = std::fs::create_dir_all(&dir);
    let hash = fnv(input);
    let path = dir.join(format!("{hash:016x}"));
    let _ = std::fs::write(&path, input);
    path
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Runs one target: replays, then mutates. Panics (failing the test) on the first failing input,
/// after writing it to `target/fuzz-failures/`.
fn fuzz(name: &str) {
    let target: &Target = TARGETS.iter().find(|t| t.name == name).expect("target");
    let inputs = committed(name);
    assert!(!inputs.is_empty(), "fuzz/corpus/{name}/ has no inputs: the target would start from nothing");
    let runs: usize = env_or("NODELB_FUZZ_RUNS", target.runs);
    let seed: u64 = env_or("NODELB_FUZZ_SEED", DEFAULT_SEED) ^ fnv(name.as_bytes());
    let current: Arc<Mutex<Vec<u8>>> = Arc::default();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let run = target.run;
    let cur = current.clone();
    let replay = std::env::var_os("NODELB_FUZZ_REPLAY").map(PathBuf::from);
    let name_owned = name.to_string();
    let worker = std::thread::spawn(move || {
        let started = Instant::now();
        let mut slowest = (Duration::ZERO, String::new());
        let mut one = |label: String, input: &[u8]| {
            *cur.lock().unwrap_or_else(|e| e.into_inner()) = input.to_vec();
            let t = Instant::now();
            let result = std::panic::catch_unwind(|| run(input));
            if result.is_err() {
                let saved = save_failure(&name_owned, input);
                panic!(
                    "fuzz target {name_owned}: input {label} failed; saved to {} (replay: \
                     NODELB_FUZZ_REPLAY={} cargo test --test fuzz {name_owned})",
                    saved.display(),
                    saved.display()
                );
            }
            let took = t.elapsed();
            if took > slowest.0 {
                slowest = (took, label);
            }
            let _ = done_tx.send(());
        };
        if let Some(path) = replay {
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            one(path.display().to_string(), &bytes);
            return;
        }
        for (path, bytes) in &inputs {
            one(path.display().to_string(), bytes);
        }
        let pool: Vec<Vec<u8>> = inputs.iter().map(|(_, b)| b.clone()).collect();
        let mut rng = Rng(seed);
        for i in 0..runs {
            let base = &pool[rng.below(pool.len())];
            let input = mutate(&mut rng, base, &pool);
            one(format!("#{i} (seed {seed:#x})"), &input);
        }
        eprintln!(
            "fuzz {name_owned}: {} committed + {runs} mutated inputs in {:.1}s; slowest {:.1} ms ({})",
            inputs.len(),
            started.elapsed().as_secs_f64(),
            slowest.0.as_secs_f64() * 1e3,
            slowest.1
        );
    });
    // A watchdog: each finished input resets it.
    loop {
        match done_rx.recv_timeout(WEDGED_AFTER) {
            Ok(()) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let input = current.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let saved = save_failure(name, &input);
                panic!(
                    "fuzz target {name}: an input ran for more than {WEDGED_AFTER:?} (wedged); saved to {}",
                    saved.display()
                );
            }
        }
    }
    if let Err(e) = worker.join() {
        std::panic::resume_unwind(e);
    }
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

#[test]
fn objects() {
    fuzz("objects");
}

#[test]
fn annotations() {
    fuzz("annotations");
}

#[test]
fn manifests() {
    fuzz("manifests");
}

#[test]
fn state_file() {
    fuzz("state_file");
}

#[test]
fn nft_dump() {
    fuzz("nft_dump");
}

#[test]
fn sock_diag() {
    fuzz("sock_diag");
}

/// Every target has a test above and a cargo-fuzz binary in `fuzz/fuzz_targets/`.
#[test]
fn every_target_is_run_here_and_by_cargo_fuzz() {
    let this = std::fs::read_to_string(repo().join("tests/fuzz.rs")).expect("read");
    for t in TARGETS {
        assert!(this.contains(&format!("fuzz(\"{}\")", t.name)), "no #[test] for target {}", t.name);
        let bin = repo().join("fuzz/fuzz_targets").join(format!("{}.rs", t.name));
        assert!(Path::new(&bin).is_file(), "no cargo-fuzz target {}", bin.display());
    }
}
