//! The import direction, checked (docs/design.md, "Module map"): domain ← plan ← encode ← agent.
//!
//! - The pure core is its own crate (`crates/core`): the compiler refuses an import of the agent
//!   from it, and this test refuses a dependency that would let it do I/O (its whole dependency
//!   closure, read from Cargo.lock).
//! - Inside the core, `domain` imports nothing and `ir` only `domain`.
//! - Inside the agent, each stage folder imports only the stages before it: `encode` nothing but
//!   the core, `observe` no later stage, `apply` and `serve` not the loop that drives them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Crates that mean I/O or a runtime; none may be in the core's dependency closure.
const NOT_IN_CORE: &[&str] = &[
    "tokio",
    "mio",
    "kube",
    "kube-client",
    "kube-runtime",
    "hyper",
    "axum",
    "futures",
    "nix",
    "libc",
    "netlink-sys",
    "netlink-packet-core",
    "netlink-packet-netfilter",
    "netlink-packet-sock-diag",
    "socket2",
    "prometheus",
    "tracing",
    "nodelb",
];

/// `[[package]]` name → its dependencies' names, from Cargo.lock.
fn lock_graph() -> BTreeMap<String, Vec<String>> {
    let text = std::fs::read_to_string(Path::new(ROOT).join("Cargo.lock")).expect("Cargo.lock");
    let mut graph = BTreeMap::new();
    for block in text.split("[[package]]").skip(1) {
        let name = block
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|l| l.strip_suffix('"'))
            .expect("package name")
            .to_string();
        let deps: Vec<String> = match block.split_once("dependencies = [") {
            Some((_, rest)) => rest
                .split(']')
                .next()
                .unwrap_or("")
                .split(',')
                .filter_map(|d| d.trim().trim_matches('"').split(' ').next().map(str::to_string))
                .filter(|d| !d.is_empty())
                .collect(),
            None => vec![],
        };
        graph.insert(name, deps);
    }
    graph
}

fn closure(graph: &BTreeMap<String, Vec<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_string()];
    while let Some(p) = todo.pop() {
        if seen.insert(p.clone()) {
            todo.extend(graph.get(&p).into_iter().flatten().cloned());
        }
    }
    seen.remove(from);
    seen
}

#[test]
fn the_core_depends_on_nothing_that_does_io() {
    let graph = lock_graph();
    assert!(graph.contains_key("nodelb-core"), "Cargo.lock has no nodelb-core");
    let deps = closure(&graph, "nodelb-core");
    let bad: Vec<&String> = deps.iter().filter(|d| NOT_IN_CORE.contains(&d.as_str())).collect();
    assert!(bad.is_empty(), "nodelb-core reaches {bad:?} (its dependencies: {deps:?})");
    // The agent does depend on the core: the check above is about the crate that is used.
    assert!(graph["nodelb"].iter().any(|d| d == "nodelb-core"));
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = e.expect("dir entry").path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    out
}

/// The first segment after `crate::` of every path in the code of `file` (comments left out).
fn crate_imports(file: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(file).expect("source file");
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            let seg: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !seg.is_empty() {
                out.insert(seg);
            }
        }
    }
    out
}

/// Files of `dir` (under `src/` of `krate`) that import one of `forbidden`, with what they import.
fn offenders(krate: &str, dir: &str, forbidden: &[&str]) -> Vec<String> {
    let base = Path::new(ROOT).join(krate).join("src").join(dir);
    let files = if base.is_dir() { rust_files(&base) } else { vec![base.with_extension("rs")] };
    let mut out = vec![];
    for f in files {
        let bad: Vec<String> =
            crate_imports(&f).into_iter().filter(|m| forbidden.contains(&m.as_str())).collect();
        if !bad.is_empty() {
            out.push(format!("{} imports {bad:?}", f.strip_prefix(ROOT).unwrap_or(&f).display()));
        }
    }
    out
}

#[test]
fn the_core_imports_point_one_way() {
    let everything_else: Vec<&str> =
        ["alloc", "counters", "desired", "endpoint_policy", "hairpin", "hostfw", "ir"]
            .into_iter()
            .chain(["k8s", "kernel_support", "manifests", "model", "plan", "port_policy", "report", "slim"])
            .chain(["simulate", "trace"])
            .collect();
    let mut bad = offenders("crates/core", "domain", &everything_else);
    let after_ir: Vec<&str> = everything_else.iter().copied().filter(|m| *m != "ir").collect();
    bad.extend(offenders("crates/core", "ir", &after_ir));
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn the_agent_stages_import_only_earlier_stages() {
    let rules: &[(&str, &[&str])] = &[
        // IR ↔ netlink bytes: the core and nothing else.
        ("encode", &["observe", "apply", "serve", "agent", "k8s", "commands", "cli", "locks"]),
        // Reading the world knows nothing of how it is programmed or reported.
        ("observe", &["encode", "apply", "serve", "agent", "commands", "cli"]),
        ("apply", &["agent", "commands", "cli", "k8s"]),
        ("serve", &["agent", "commands", "cli", "apply", "observe"]),
        ("k8s", &["agent", "commands", "cli", "apply", "encode"]),
    ];
    let mut bad = vec![];
    for (dir, forbidden) in rules {
        bad.extend(offenders(".", dir, forbidden));
    }
    assert!(bad.is_empty(), "{bad:#?}");
}
