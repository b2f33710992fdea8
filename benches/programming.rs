//! Kernel programming cost of nodelb's ruleset at scale, split into user and kernel time: one full
//! replace of N Services × E endpoints through `NftClient::apply` (the agent's code), then adding
//! and removing one Service as a diff. A benchmark, not a test (docs/benchmarks.md, "Programming
//! against kube-proxy's layout"); root, in a network namespace it creates and deletes.
//!
//! ```text
//! sudo cargo bench --bench programming -- --services 10000 --endpoints 5 --reps 5
//! sudo cargo bench --bench programming -- --services 1000 --endpoints 5 --affinity   # ClientIP on all
//! sudo cargo bench --bench programming -- --services 10000 --endpoints 5 --nat-shards 1,4,16  # side by side
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Instant;

use common::netns::NetNs;
use common::scenarios::scale_ruleset;
use nix::sys::resource::{UsageWho, getrusage};
use nodelb::core::ruleset::plan;
use nodelb::encode::nft::NftClient;

/// (user, system) CPU time of the calling thread, in ms.
fn thread_cpu_ms() -> (f64, f64) {
    let u = getrusage(UsageWho::RUSAGE_THREAD).expect("getrusage");
    let ms = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1e3 + t.tv_usec() as f64 / 1e3;
    (ms(u.user_time()), ms(u.system_time()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str, default: usize| {
        args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(default)
    };
    let (n, endpoints, reps) = (value("--services", 10_000), value("--endpoints", 1), value("--reps", 5));
    if n == 0 || n >= 64_000 || endpoints == 0 || reps == 0 {
        eprintln!("--services 1..64000, --endpoints ≥ 1, --reps ≥ 1");
        std::process::exit(2);
    }
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("programming benchmark: needs root (network namespace, nftables)");
        std::process::exit(1);
    }
    let affinity = args.iter().any(|a| a == "--affinity");
    let shards: Vec<u8> = match args.iter().position(|a| a == "--nat-shards").and_then(|i| args.get(i + 1)) {
        None => vec![1],
        Some(list) => list.split(',').map(|k| k.trim().parse().expect("--nat-shards 1,4,16")).collect(),
    };
    let with = if affinity { ", all with ClientIP affinity" } else { "" };
    println!("{n} Services × {endpoints} endpoints{with}, median of {reps} (ms):");
    println!(
        "  {:>10} {:>10} {:>14} {:>12} {:>10} {:>10}",
        "nat shards", "plan", "full replace", "(kernel)", "add one", "remove one"
    );
    for k in shards {
        let (plan_ms, full, full_sys, add_ms, remove_ms) = measure(n, endpoints, affinity, k, reps);
        println!("  {k:>10} {plan_ms:>10.1} {full:>14.1} {full_sys:>12.1} {add_ms:>10.2} {remove_ms:>10.2}");
    }
}

/// (plan, full replace, its kernel time, add one, remove one), ms, medians of `reps`.
fn measure(n: usize, endpoints: usize, affinity: bool, shards: u8, reps: usize) -> (f64, f64, f64, f64, f64) {
    let t = Instant::now();
    let base = scale_ruleset(n, endpoints, affinity, shards);
    let plus = scale_ruleset(n + 1, endpoints, affinity, shards);
    let plan_ms = t.elapsed().as_secs_f64() * 1e3 / 2.0;
    let add = plan::diff(&base, &plus);
    let remove = plan::diff(&plus, &base);
    let ns = NetNs::new("prog");
    let (full, full_sys, add_ms, remove_ms) = ns.run(move || {
        let mut c = NftClient::new().expect("netlink socket");
        let (mut full, mut full_sys, mut adds, mut removes) = (vec![], vec![], vec![], vec![]);
        for _ in 0..reps {
            let (_, s0) = thread_cpu_ms();
            let t = Instant::now();
            c.apply(&base.full_replace()).expect("full replace");
            full.push(t.elapsed().as_secs_f64() * 1e3);
            full_sys.push(thread_cpu_ms().1 - s0);
            let t = Instant::now();
            c.apply(&add).expect("add one");
            adds.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            c.apply(&remove).expect("remove one");
            removes.push(t.elapsed().as_secs_f64() * 1e3);
        }
        c.delete_table().expect("delete table");
        (median(full), median(full_sys), median(adds), median(removes))
    });
    (plan_ms, full, full_sys, add_ms, remove_ms)
}
