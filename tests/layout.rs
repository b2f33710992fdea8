//! The import direction, checked (docs/design.md, "Module map"): domain ← plan ← encode ← agent.
//!
//! - The pure core is its own crate (`crates/core`): the compiler refuses an import of the agent
//!   from it, and this test refuses a dependency that would let it do I/O (its whole dependency
//!   closure, as `cargo tree -p nodelb-core` resolves it: the core's own features, not the
//!   agent's, which Cargo.lock would mix in).
//! - Inside the core, `domain` imports nothing and `ir` only `domain`.
//! - Inside the agent, each stage folder imports only the stages before it: `encode` nothing but
//!   the core, `observe` no later stage, `apply` and `serve` not the loop that drives them.
//! - The node agent's code and the controller's (election, round, writes) name none of each
//!   other's modules.
//! - No module of either crate imports, directly or around, one that imports it back; every
//!   module of both is listed in an order ([`CORE_ORDER`], [`AGENT_ORDER`]) and imports only
//!   modules listed before it, so a new module is placed deliberately and no edge points back up.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Crates that mean I/O or a runtime; none may be in the core's dependency closure. (`kube`
/// itself is allowed with its derive only: the NodePortPool type; its client and runtime are not.)
const NOT_IN_CORE: &[&str] = &[
    "tokio",
    "mio",
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

/// The names of the packages `cargo tree` lists for `args`.
fn cargo_tree(args: &[&str]) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let out = std::process::Command::new(cargo)
        .args(["tree", "--offline", "-e", "normal", "--prefix", "none", "--manifest-path"])
        .arg(Path::new(ROOT).join("Cargo.toml"))
        .args(args)
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

#[test]
fn the_core_depends_on_nothing_that_does_io() {
    let mut deps = cargo_tree(&["-p", "nodelb-core"]);
    assert!(deps.remove("nodelb-core"), "cargo tree -p nodelb-core lists no nodelb-core: {deps:?}");
    let bad: Vec<&String> = deps.iter().filter(|d| NOT_IN_CORE.contains(&d.as_str())).collect();
    assert!(bad.is_empty(), "nodelb-core reaches {bad:?} (its dependencies: {deps:?})");
    // The check is about the crate the agent uses.
    assert!(cargo_tree(&["-p", "nodelb", "--depth", "1"]).contains("nodelb-core"));
}

/// The test oracles (the planner's model of the kernel, the packet tracer) are a crate of their
/// own that only tests depend on: the shipped agent does not contain them.
#[test]
fn the_test_oracles_are_not_shipped() {
    assert!(!cargo_tree(&["-p", "nodelb"]).contains("nodelb-oracles"));
    assert!(!cargo_tree(&["-p", "nodelb-core"]).contains("nodelb-oracles"));
    let dev = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string()))
        .args(["tree", "--offline", "-e", "dev", "--depth", "1", "--prefix", "none", "-p", "nodelb"])
        .arg("--manifest-path")
        .arg(Path::new(ROOT).join("Cargo.toml"))
        .output()
        .expect("run cargo tree");
    assert!(String::from_utf8_lossy(&dev.stdout).contains("nodelb-oracles"), "the tests use them");
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
    // The shared words and the ruleset's IR are the foundations: each imports `domain` at most.
    let everything_else = ["inputs", "decisions", "ruleset", "incremental", "reports", "k8s"];
    let mut bad = offenders("crates/core", "domain", &everything_else);
    bad.extend(offenders("crates/core", "ruleset/ir", &everything_else));
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
        // Telemetry does no I/O of its own: the kernel's counters come through a reader the
        // caller hands in, so no netlink encoding either.
        ("serve", &["agent", "commands", "cli", "apply", "observe", "encode"]),
        ("k8s", &["agent", "commands", "cli", "apply", "encode"]),
    ];
    let mut bad = vec![];
    for (dir, forbidden) in rules {
        bad.extend(offenders(".", dir, forbidden));
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Files under `paths` (relative to the repository) whose code names one of `names`.
fn naming(paths: &[&str], names: &[&str]) -> Vec<String> {
    let mut out = vec![];
    for p in paths {
        let path = Path::new(ROOT).join(p);
        let files = if path.is_dir() { rust_files(&path) } else { vec![path] };
        for f in files {
            let text = std::fs::read_to_string(&f).expect("source file");
            let code: String =
                text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
            for n in names.iter().filter(|n| code.contains(*n)) {
                out.push(format!("{} names {n}", f.strip_prefix(ROOT).unwrap_or(&f).display()));
            }
        }
    }
    out
}

/// The two workloads stay two in the code (docs/design.md, "Kubernetes mode"): what a node agent
/// runs (the sync loop, what it observes, its node Lease) never reaches the controller's
/// election, round or writes, and the controller's code never the node Lease.
#[test]
fn the_node_agent_and_the_controller_share_no_code_path() {
    let controller = [
        "k8s::controller",
        "k8s::round",
        "k8s::election",
        "super::controller",
        "super::round",
        "super::election",
    ];
    let mut bad = naming(&["src/agent", "src/observe", "src/k8s/node_lease.rs"], &controller);
    bad.extend(naming(
        &[
            "src/k8s/controller.rs",
            "crates/core/src/k8s/round.rs",
            "crates/core/src/k8s/round",
            "src/k8s/election.rs",
        ],
        &["node_lease"],
    ));
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Each module of the crate rooted at `src` (a file; `mod.rs`, `lib.rs`, `main.rs` name their
/// folder; a sibling `tests.rs` is its parent's tests), by its path (`k8s::source`).
fn modules(src: &Path) -> std::collections::BTreeMap<String, PathBuf> {
    let mut out = std::collections::BTreeMap::new();
    for f in rust_files(src) {
        let rel = f.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        if parts.last().is_some_and(|l| l == "tests") {
            continue;
        }
        if parts.last().is_some_and(|l| matches!(l.as_str(), "mod" | "lib" | "main")) {
            parts.pop();
        }
        out.insert(parts.join("::"), f);
    }
    out
}

/// The module paths `file`'s code (comments and its `#[cfg(test)] mod tests` left out) names
/// through `crate::` and `super::`.
fn module_paths(file: &Path, module: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(file).expect("source file");
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        for (prefix, base) in [("crate::", String::new()), ("super::", parent.to_string())] {
            for (i, _) in line.match_indices(prefix) {
                let rest = &line[i + prefix.len()..];
                let path: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let path = path.trim_end_matches(':');
                // `crate::{a, b::c}`: each item.
                let items: Vec<String> = match rest.strip_prefix('{') {
                    Some(group) => group
                        .split('}')
                        .next()
                        .unwrap_or("")
                        .split(',')
                        .map(|s| s.trim().split(' ').next().unwrap_or("").to_string())
                        .collect(),
                    None => vec![path.to_string()],
                };
                for item in items.into_iter().filter(|s| !s.is_empty()) {
                    out.insert(if base.is_empty() { item } else { format!("{base}::{item}") });
                }
            }
        }
    }
    out
}

/// The modules of `mods` that `file` (module `name`) imports: for each path it names, the longest
/// prefix that is a module, not this one nor one it is inside.
fn imported_modules(
    mods: &std::collections::BTreeMap<String, PathBuf>,
    file: &Path,
    name: &str,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for path in module_paths(file, name) {
        let parts: Vec<&str> = path.split("::").collect();
        let target = (1..=parts.len()).rev().map(|k| parts[..k].join("::")).find(|m| mods.contains_key(m));
        if let Some(t) = target.filter(|t| t != name && !name.starts_with(&format!("{t}::"))) {
            out.insert(t);
        }
    }
    out
}

/// The cycles among the modules of the crate rooted at `src`: each strongly connected set of more
/// than one module (Tarjan), named.
fn import_cycles(src: &Path) -> Vec<Vec<String>> {
    let mods = modules(src);
    let names: Vec<&String> = mods.keys().collect();
    let index: std::collections::BTreeMap<&String, usize> =
        names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); names.len()];
    for (i, name) in names.iter().enumerate() {
        for t in imported_modules(&mods, &mods[*name], name) {
            edges[i].insert(index[&t]);
        }
    }
    struct Tarjan<'a> {
        edges: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on: Vec<bool>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.next);
            self.low[v] = self.next;
            self.next += 1;
            self.stack.push(v);
            self.on[v] = true;
            for &w in self.edges[v].iter() {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut comp = vec![];
                while let Some(w) = self.stack.pop() {
                    self.on[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    self.out.push(comp);
                }
            }
        }
    }
    let n = names.len();
    let mut t = Tarjan {
        edges: &edges,
        index: vec![None; n],
        low: vec![0; n],
        stack: vec![],
        on: vec![false; n],
        next: 0,
        out: vec![],
    };
    for v in 0..n {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    t.out.into_iter().map(|c| c.into_iter().map(|i| names[i].clone()).collect()).collect()
}

/// Every module of the core, in the order a reader meets them: each imports only modules listed
/// before it. Foundations (names, objects as the API gives them, plain reports), the ruleset's
/// IR and what reads it, the model of a Service and its ports, what chooses pools, numbers and
/// endpoints, the Kubernetes inputs and the leader's bookkeeping, then the two decisions: the
/// node's (`desired`) and the leader's (`k8s::round`).
const CORE_ORDER: &[&str] = &[
    "domain",
    "inputs::compact",
    "incremental::per_object",
    "reports::report",
    "decisions::servicelb",
    "k8s::leader",
    "k8s::uninstall",
    "k8s::events",
    "ruleset::ir",
    "reports::counters",
    "ruleset::kernel_support",
    "ruleset::hostfw",
    "inputs::model",
    "decisions::port_policy",
    "ruleset::plan",
    "ruleset::hairpin",
    "incremental::replan",
    "decisions::sharing",
    "decisions::alloc",
    "incremental::book",
    "decisions::pool",
    "inputs::slim",
    "inputs::manifests",
    "decisions::endpoint_policy",
    "incremental::model_cache",
    "incremental::view",
    "k8s::nodes",
    "k8s::snapshot",
    "k8s::pools",
    "k8s::claims::record",
    "k8s::claims",
    "k8s::lastgood",
    "k8s::dupes",
    "k8s::cluster_view",
    "k8s::publish",
    "decisions::desired",
    "k8s::round",
];

/// Every module of the agent, in the same sense: what reads the host and the files, the
/// netlink encoding, the listeners' plumbing, the API server's edges and the telemetry they
/// feed, what programs the kernel, and the loop and commands that drive them all.
const AGENT_ORDER: &[&str] = &[
    "locks",
    "memory",
    "cli",
    "observe::bounded",
    "observe::bridge",
    "observe::debounce",
    "observe::fingerprint",
    "observe::hostaddrs",
    "observe::listeners",
    "observe::sysctl",
    "observe::dir_watch",
    "observe::manifest_dir",
    "observe::state",
    "encode::xt",
    "encode::nft::consts",
    "encode::nft::nla",
    "encode::nft::encode",
    "encode::nft::decode",
    "encode::nft::foreign",
    "encode::nft::verify",
    "encode::nft::client",
    "serve::access",
    "serve::conn",
    "serve::tls",
    "k8s::metrics",
    "k8s::api",
    "k8s::installation",
    "k8s::source",
    "observe::source",
    "serve::metrics",
    "serve::status",
    "k8s::review",
    "k8s::election",
    "k8s::pool_status",
    "k8s::controller",
    "k8s::node_lease",
    "serve::http",
    "apply::conntrack",
    "apply::xtables",
    "apply::xtables::blob",
    "apply::kernel",
    "apply::kernel_fake",
    "apply::dataplane",
    "apply::firewall",
    "agent::schedule",
    "agent",
    "commands",
];

/// Each module of `order` imports only modules listed before it, and every module of the crate
/// is listed (a folder's `mod.rs` only declares and re-exports: not ordered).
#[test]
fn every_module_imports_only_modules_listed_before_it() {
    for (krate, order) in [("crates/core/src", CORE_ORDER), ("src", AGENT_ORDER)] {
        let mods = modules(&Path::new(ROOT).join(krate));
        let rank: std::collections::BTreeMap<&str, usize> =
            order.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        let folders: BTreeSet<String> = (mods.keys())
            .filter(|m| mods.keys().any(|n| n.starts_with(&format!("{m}::"))) || m.is_empty())
            .cloned()
            .collect();
        let unlisted: Vec<&String> =
            mods.keys().filter(|m| !folders.contains(*m) && !rank.contains_key(m.as_str())).collect();
        assert!(unlisted.is_empty(), "{krate}: modules missing from the order: {unlisted:?}");
        let gone: Vec<&&str> = order.iter().filter(|m| !mods.contains_key(**m)).collect();
        assert!(gone.is_empty(), "{krate}: listed modules that do not exist: {gone:?}");
        let mut bad = vec![];
        for (name, file) in mods.iter().filter(|(m, _)| rank.contains_key(m.as_str())) {
            for target in imported_modules(&mods, file, name) {
                if rank.get(target.as_str()).is_some_and(|t| *t > rank[name.as_str()]) {
                    bad.push(format!("{name} imports {target}, listed after it"));
                }
            }
        }
        assert!(bad.is_empty(), "{krate}: {bad:#?}");
    }
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    for krate in ["crates/core/src", "src"] {
        let src = Path::new(ROOT).join(krate);
        assert!(modules(&src).len() > 20, "{krate}: modules not found");
        let cycles = import_cycles(&src);
        assert!(cycles.is_empty(), "{krate}: modules that import each other, directly or around: {cycles:?}");
    }
}
