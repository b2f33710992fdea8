//! The sync policy, without root: the agent's real sync against [`FakeKernel`] (the planner's
//! own model of the kernel), a manifests directory and a fixed node. Root tests
//! (`tests/dataplane.rs`, `tests/golden_kernel.rs`) prove the same against the real kernel.

use std::path::Path;
use std::sync::RwLock;

use super::*;
use crate::apply::kernel_fake::{Batch, Failing, FakeKernel, FakeNode};
use crate::core::decisions::port_policy::{PortPolicy, PortRange};
use crate::core::reports::counters::CounterKind;
use crate::core::ruleset::ir::{Carried, Change, Key, Ruleset, SetKind};
use crate::observe::source::ManifestPools;
use crate::serve::status::Status;
use schedule::{WHOLE_SYNC_AT_MOST, WHOLE_SYNC_EVERY};

/// A Service `name` (`port`/`protocol` to `target`, `sessionAffinity: ClientIP` if `sticky`) and
/// its EndpointSlice with these endpoint addresses.
fn service(name: &str, protocol: &str, port: u16, target: u16, sticky: bool, addresses: &[&str]) -> String {
    let affinity = if sticky { "\n  sessionAffinity: ClientIP" } else { "" };
    let mut text = format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: LoadBalancer{affinity}
  ports: [{{name: p, port: {port}, protocol: {protocol}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: p, port: {target}, protocol: {protocol}}}]
endpoints:
"#
    );
    for a in addresses {
        text.push_str(&format!("- addresses: [{a}]\n"));
    }
    text
}

fn web(addresses: &[&str]) -> String {
    service("web", "TCP", 80, 8080, false, addresses)
}

fn dns(addresses: &[&str]) -> String {
    service("dns", "UDP", 53, 5353, false, addresses)
}

fn sticky(addresses: &[&str]) -> String {
    service("sticky", "TCP", 80, 8080, true, addresses)
}

struct Harness {
    agent: Agent<FakeKernel, FakeNode>,
    dir: tempfile::TempDir,
}

impl Harness {
    /// An agent over `kernel`, programming `manifest` (file `svc.yaml`), forwarding on.
    async fn new(kernel: FakeKernel, manifest: &str) -> Harness {
        let dir = tempfile::tempdir().expect("tempdir");
        let manifests = dir.path().join("manifests");
        std::fs::create_dir(&manifests).unwrap();
        std::fs::write(manifests.join("svc.yaml"), manifest).unwrap();
        for (file, value) in [("net/ipv4/ip_forward", "1\n"), ("net/ipv6/conf/all/forwarding", "1\n")] {
            let path = dir.path().join("proc-sys").join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, value).unwrap();
        }
        let range = PortRange::new(20000, 20099).unwrap();
        let cfg = AgentConfig {
            state_file: Some(dir.path().join("state.json")),
            node_name: "node-1".into(),
            port_range: range,
            resync_period: Duration::from_secs(10),
            enable_forwarding: false,
            masquerade_mark: crate::core::ruleset::plan::DEFAULT_MASQUERADE_MARK,
            connection_mark: crate::core::ruleset::plan::DEFAULT_CONNECTION_MARK,
            forward_mark: None,
            nat_shards: crate::core::ruleset::plan::NatShards::Fixed(1),
            model: ModelOptions::default(),
            sysctls: Sysctls::with_root(dir.path().join("proc-sys")),
            policy: HostPolicy {
                ports: PortPolicy { ranges: vec![range], allowed: vec![] },
                ..Default::default()
            },
            xtables_lockfile: dir.path().join("xtables.lock"),
            bridges: BridgeReader::with_roots(dir.path().join("sys"), dir.path().join("proc-sys")),
        };
        let pools = ManifestPools { node_labels: Default::default(), port_range: range };
        let source = Source::manifests(manifests, pools).expect("watch the manifests");
        let status: SharedStatus = Arc::new(RwLock::new(Status::default()));
        // No scrape here reads the per-Service series: their counter read finds nothing.
        let metrics = Arc::new(
            Metrics::new(true, Arc::new(|_: &[&crate::core::ruleset::ir::Name]| None)).expect("metrics"),
        );
        let state = cfg.state_file.clone().map(StateFile::new);
        let mut agent =
            Agent::new(cfg, source, status, metrics, kernel, FakeNode::default(), state, State::default());
        agent.check_forwarding();
        Harness { agent, dir }
    }

    fn write(&self, manifest: &str) {
        let path = self.dir.path().join("manifests/svc.yaml");
        std::fs::write(&path, manifest).unwrap();
        // A new inode and size: the cache sees a new stamp even within one clock tick.
        touch(&path);
    }

    async fn sync(&mut self, verify: bool) -> Result<(), AgentError> {
        self.agent.sync(verify).await.map(|_| ())
    }

    fn kernel(&mut self) -> &mut FakeKernel {
        &mut self.agent.dataplane.kernel
    }

    /// What the agent believes the kernel holds.
    fn applied(&self) -> Ruleset {
        self.agent.dataplane.applied().cloned().expect("programmed")
    }

    fn syncs(&self, kind: &str, result: &str) -> u64 {
        self.agent.metrics.syncs.with_label_values(&[kind, result]).get()
    }

    fn last_sync(&self) -> SyncStatus {
        self.agent.status.read().unwrap().last_sync.clone().expect("a sync was recorded")
    }

    /// The exported connection totals of every Service port, as a scrape reads them.
    fn connections(&mut self) -> Vec<u64> {
        let kernel = self.kernel().counters.clone();
        let counters = self.agent.metrics.counters.lock().unwrap();
        counters
            .totals(&kernel)
            .into_iter()
            .filter(|((_, k), _)| *k == CounterKind::Connections)
            .map(|(_, t)| t.packets)
            .collect()
    }
}

fn touch(path: &Path) {
    let tmp = path.with_extension("tmp");
    std::fs::copy(path, &tmp).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn full_replaces(k: &FakeKernel) -> usize {
    k.batches.iter().filter(|b| matches!(b, Batch::FullReplace { .. })).count()
}

/// Rules an earlier agent left: a chain nobody programs any more.
fn leftover() -> Ruleset {
    let mut rs = Ruleset::default();
    rs.add_chain(crate::core::ruleset::ir::Chain {
        name: "svc4-old".into(),
        base: None,
        rules: vec![],
        comment: None,
    });
    rs
}

#[tokio::test]
async fn first_sync_replaces_the_table_whatever_it_holds() {
    let mut h = Harness::new(FakeKernel::holding(leftover()), &web(&["198.51.100.11"])).await;
    h.sync(false).await.expect("sync");
    let applied = h.applied();
    let k = h.kernel();
    assert_eq!(k.batches, vec![Batch::FullReplace { carried: Default::default() }]);
    assert_eq!(k.table.as_ref(), Some(&applied), "the kernel holds exactly the desired ruleset");
    assert!(!applied.chains.contains_key("svc4-old"));
    assert!(applied.chains.keys().any(|c| c.starts_with("svc4-")), "web is programmed");
    assert_eq!(h.syncs("full", "success"), 1);
    assert_eq!(h.last_sync().kind, "full");
}

#[tokio::test]
async fn later_syncs_are_diffs() {
    let mut h = Harness::new(FakeKernel::default(), &web(&["198.51.100.11"])).await;
    h.sync(false).await.expect("first sync");
    h.write(&web(&["198.51.100.11", "198.51.100.12"]));
    h.sync(false).await.expect("second sync");
    let applied = h.applied();
    let k = h.kernel();
    assert_eq!(k.batches.len(), 2);
    let Batch::Diff(diff) = &k.batches[1] else { panic!("a diff, got {:?}", k.batches[1]) };
    assert!(
        !diff.is_empty() && !diff.contains(&Change::DeleteTable(crate::core::ruleset::ir::Table::Main)),
        "{diff:?}"
    );
    assert_eq!(k.table.as_ref(), Some(&applied));
    assert_eq!(h.syncs("incremental", "success"), 1);
    assert_eq!(h.last_sync().kind, "incremental");
}

#[tokio::test]
async fn a_failed_batch_forces_a_full_replace_with_backoff_and_the_backoff_resets() {
    let mut h = Harness::new(FakeKernel::default(), &web(&["198.51.100.11"])).await;
    let mut schedule = Schedule::new();
    let t0 = tokio::time::Instant::now();
    h.agent.sync_if_due(&mut schedule, t0).await;
    assert_eq!(full_replaces(h.kernel()), 1);

    // A change whose diff the kernel refuses, and then the first retry too.
    h.write(&web(&["198.51.100.11", "198.51.100.12"]));
    schedule.changed();
    h.kernel().refuse_batches = Failing(2);
    h.agent.sync_if_due(&mut schedule, t0).await;
    assert!(!h.last_sync().ok, "the refused batch is a failed sync");
    assert_eq!(h.agent.metrics.sync_failures.with_label_values(&["netlink"]).get(), 1);
    assert_eq!(schedule.retry_at(), Some(t0 + Duration::from_millis(200)));

    // Not before the backoff.
    h.agent.sync_if_due(&mut schedule, t0 + Duration::from_millis(199)).await;
    assert_eq!(h.syncs("full", "error") + h.syncs("incremental", "error"), 1, "no attempt yet");

    // The retry is a full replace (refused once more: the backoff doubles).
    let t1 = t0 + Duration::from_millis(200);
    h.agent.sync_if_due(&mut schedule, t1).await;
    assert_eq!(h.syncs("full", "error"), 1, "the retry was a full replace");
    assert_eq!(schedule.retry_at(), Some(t1 + Duration::from_millis(400)));

    let t2 = t1 + Duration::from_millis(400);
    h.agent.sync_if_due(&mut schedule, t2).await;
    assert!(h.last_sync().ok);
    assert_eq!(h.last_sync().kind, "full");
    let applied = h.applied();
    assert_eq!(full_replaces(h.kernel()), 2, "the good retry replaced the table");
    assert_eq!(h.kernel().table.as_ref(), Some(&applied));

    // The next failure waits the first backoff again.
    h.write(&web(&["198.51.100.12"]));
    schedule.changed();
    h.kernel().refuse_batches = Failing(1);
    h.agent.sync_if_due(&mut schedule, t2).await;
    assert_eq!(schedule.retry_at(), Some(t2 + Duration::from_millis(200)), "the backoff was reset");
}

#[tokio::test]
async fn tampering_is_repaired_and_other_transactions_are_not() {
    let mut h = Harness::new(FakeKernel::default(), &web(&["198.51.100.11"])).await;
    h.sync(false).await.expect("sync");
    let applied = h.applied();

    // Another table changed: the table is read once, found intact, and left alone.
    h.kernel().other_transaction();
    h.sync(true).await.expect("resync");
    assert_eq!((h.kernel().table_reads, h.kernel().batches.len()), (1, 1));
    h.sync(true).await.expect("resync");
    assert_eq!(h.kernel().table_reads, 1, "the new generation was remembered");
    assert_eq!(h.agent.metrics.repairs.get(), 0);

    // Someone deletes our dispatch map's elements.
    h.kernel().tamper(|t| {
        for set in t.sets.values_mut().filter(|s| s.name.starts_with("service-ports-")) {
            set.elements.clear();
        }
    });
    h.sync(true).await.expect("repair");
    assert_eq!(h.agent.metrics.repairs.get(), 1);
    assert_eq!(full_replaces(h.kernel()), 2, "repaired by a full replace");
    assert_eq!(h.kernel().table.as_ref(), Some(&applied));
}

#[tokio::test]
async fn counters_survive_a_full_replace() {
    let mut h = Harness::new(FakeKernel::default(), &web(&["198.51.100.11"])).await;
    h.sync(false).await.expect("sync");
    let conn = h.applied().counters.keys().find(|c| c.starts_with("conn4-")).cloned().expect("counter");
    h.kernel().count(&conn, 5);
    assert_eq!(h.connections(), vec![5]);

    h.kernel().tamper(|t| t.chains.values_mut().for_each(|c| c.rules.clear()));
    h.sync(true).await.expect("repair");
    assert_eq!(full_replaces(h.kernel()), 2);
    assert_eq!(h.kernel().counters[&*conn].packets, 0, "the kernel's counter restarted");
    assert_eq!(h.connections(), vec![5], "the exported total did not");
    h.kernel().count(&conn, 2);
    assert_eq!(h.connections(), vec![7]);
}

#[tokio::test]
async fn a_failed_generation_read_after_a_good_batch_is_not_a_failure() {
    let mut h = Harness::new(FakeKernel::default(), &web(&["198.51.100.11"])).await;
    h.kernel().fail_generation = Failing(1);
    h.sync(false).await.expect("the batch went in");
    assert!(h.last_sync().ok);
    assert_eq!(
        (h.syncs("full", "success"), h.agent.metrics.sync_failures.with_label_values(&["kernel_read"]).get()),
        (1, 0)
    );

    // The next resync verifies the table (the generation is unknown), finds it intact.
    h.sync(true).await.expect("resync");
    assert_eq!((h.kernel().table_reads, h.kernel().batches.len()), (1, 1));
    h.sync(true).await.expect("resync");
    assert_eq!(h.kernel().table_reads, 1);
}

#[tokio::test]
async fn affinities_are_carried_across_a_full_replace() {
    let mut h = Harness::new(FakeKernel::default(), &sticky(&["198.51.100.11", "198.51.100.12"])).await;
    h.sync(false).await.expect("sync");
    // The set of clients of each endpoint, by the endpoint its comment names.
    let set_of = |rs: &Ruleset, endpoint: &str| {
        rs.sets
            .values()
            .find(|s| {
                matches!(s.kind, SetKind::Dynamic { .. })
                    && s.comment.as_deref().is_some_and(|c| c.contains(endpoint))
            })
            .map(|s| s.name.clone())
    };
    let (first, second) =
        (set_of(&h.applied(), "198.51.100.11:8080"), set_of(&h.applied(), "198.51.100.12:8080"));
    let (Some(first), Some(second)) = (first, second) else { panic!("a set of clients per endpoint") };
    let client = |a: &str| Key::addr(a.parse().unwrap());
    h.kernel().dynamic.insert(first.clone(), vec![(client("203.0.113.7"), 5_000)]);
    h.kernel().dynamic.insert(second.clone(), vec![(client("203.0.113.8"), 7_000)]);
    let held = h.kernel().dynamic.clone();

    h.kernel().tamper(|t| t.chains.values_mut().for_each(|c| c.rules.clear()));
    h.sync(true).await.expect("repair");
    assert_eq!(h.kernel().batches.last(), Some(&Batch::FullReplace { carried: held.clone() }));
    assert_eq!(h.kernel().dynamic, held, "the clients' affinities are back in their sets");

    // An endpoint that goes takes its affinities with it; the other's stay.
    h.write(&sticky(&["198.51.100.12"]));
    h.sync(false).await.expect("sync");
    assert!(matches!(h.kernel().batches.last(), Some(Batch::Diff(_))));
    assert_eq!(h.kernel().dynamic, Carried::from([(second.clone(), held[&second].clone())]));
}

#[tokio::test]
async fn an_unchanged_input_does_nothing() {
    let mut h = Harness::new(FakeKernel::default(), &web(&["198.51.100.11"])).await;
    h.sync(false).await.expect("sync");
    let (generation, last) = (h.kernel().generation, h.last_sync());
    for verify in [false, true, false, true] {
        h.sync(verify).await.expect("sync");
    }
    let k = h.kernel();
    assert_eq!((k.batches.len(), k.table_reads, k.generation), (1, 0, generation));
    assert_eq!(h.syncs("full", "success") + h.syncs("incremental", "success"), 1, "not counted as syncs");
    assert_eq!(h.last_sync().at, last.at);
}

#[tokio::test]
async fn a_udp_endpoint_that_goes_has_its_conntrack_entries_deleted_after_the_batch() {
    let mut h = Harness::new(FakeKernel::default(), &dns(&["198.51.100.11", "198.51.100.12"])).await;
    h.sync(false).await.expect("sync");
    h.write(&dns(&["198.51.100.12"]));
    h.kernel().refuse_batches = Failing(1);
    assert!(h.sync(false).await.is_err());
    assert!(h.kernel().flushed.is_empty(), "nothing is flushed for a batch that did not go in");
    h.agent.dataplane.forget();
    h.sync(false).await.expect("sync");
    assert!(h.kernel().flushed.is_empty(), "a full replace knows nothing of before");
    h.write(&dns(&["198.51.100.11"]));
    h.sync(false).await.expect("sync");
    let flushed = &h.kernel().flushed;
    assert_eq!(flushed.len(), 1);
    let gone: Vec<_> = flushed[0].iter().map(|(_, addr, port)| (addr.to_string(), *port)).collect();
    assert_eq!(gone, [("198.51.100.12".to_string(), 5353)]);
}

/// Services added, changed and removed one sync after another: each sync after the first is a
/// patch of the last ruleset, its batch takes the kernel (the planner's model of it) to exactly
/// what the agent then believes it holds, and that is the whole plan of the same input.
#[tokio::test]
async fn changes_in_a_row_are_patches_that_the_kernel_follows() {
    let steps = [
        web(&["198.51.100.11"]),
        [web(&["198.51.100.11"]), dns(&["198.51.100.11"])].join("---"),
        [web(&["198.51.100.11", "198.51.100.12"]), dns(&["198.51.100.11"]), sticky(&["198.51.100.11"])]
            .join("---"),
        [dns(&["198.51.100.12"]), sticky(&["198.51.100.11", "198.51.100.12"])].join("---"),
        sticky(&[]),
        web(&["198.51.100.12"]),
    ];
    let mut h = Harness::new(FakeKernel::default(), &steps[0]).await;
    h.sync(false).await.expect("first sync");
    for (i, step) in steps.iter().enumerate().skip(1) {
        h.write(step);
        h.sync(false).await.unwrap_or_else(|e| panic!("step {i}: {e}"));
        let applied = h.applied();
        assert_eq!(
            h.kernel().table.as_ref(),
            Some(&applied),
            "step {i}: the kernel holds what the agent believes"
        );
        h.agent.dataplane.forget();
        h.agent.kept = desired::Kept::default();
        h.agent.last_input = None;
        h.sync(false).await.expect("the same input planned whole");
        assert_eq!(h.applied(), applied, "step {i}: the patched ruleset is the whole plan");
    }
    assert_eq!(h.syncs("incremental", "success"), steps.len() as u64 - 1);
    assert_eq!(full_replaces(h.kernel()), steps.len(), "the first sync and each whole plan to compare with");
}

/// The whole decision (the oracle of the scoped ones) is taken on a resync once syncs decided
/// only what changed, WHOLE_SYNC_EVERY after the last: on one with no change waiting, so that no
/// change waits for it; a resync that finds a change decides that change alone, unless changes
/// have kept coming for WHOLE_SYNC_AT_MOST. Nothing decided since the last whole one: no new one.
#[tokio::test]
async fn the_whole_decision_waits_for_a_resync_with_no_change() {
    let mut h = Harness::new(FakeKernel::default(), &web(&["198.51.100.11"])).await;
    h.sync(false).await.expect("first sync");
    assert!(h.agent.pace.last_whole.is_some() && !h.agent.pace.scoped_since_whole, "the first sync is whole");
    let long_ago = |d: Duration| Some(Instant::now() - d - Duration::from_secs(1));
    let steps = [web(&["198.51.100.12"]), web(&["198.51.100.13"]), web(&["198.51.100.14"])];
    // A change, decided alone.
    h.write(&steps[0]);
    h.sync(false).await.expect("change");
    assert!(h.agent.pace.scoped_since_whole);
    // The whole decision is due; a resync finds another change waiting: that change alone.
    h.agent.pace.last_whole = long_ago(WHOLE_SYNC_EVERY);
    let due = h.agent.pace.last_whole;
    h.write(&steps[1]);
    h.sync(true).await.expect("resync with a change");
    assert_eq!(h.agent.pace.last_whole, due, "no whole decision while a change waits");
    assert!(h.agent.pace.scoped_since_whole);
    // The next resync finds nothing waiting: the whole decision, though nothing changed.
    h.sync(true).await.expect("quiet resync");
    assert!(h.agent.pace.last_whole > due && !h.agent.pace.scoped_since_whole, "whole on a quiet resync");
    // Nothing decided since: a quiet resync computes nothing, however old the whole one is.
    h.agent.pace.last_whole = long_ago(WHOLE_SYNC_EVERY);
    let due = h.agent.pace.last_whole;
    let syncs = h.syncs("incremental", "success");
    h.sync(true).await.expect("quiet resync");
    assert_eq!(
        (h.agent.pace.last_whole, h.syncs("incremental", "success")),
        (due, syncs),
        "nothing to verify"
    );
    // Changes that keep coming: past WHOLE_SYNC_AT_MOST the whole decision is taken with one.
    h.write(&steps[2]);
    h.sync(false).await.expect("change");
    h.agent.pace.last_whole = long_ago(WHOLE_SYNC_AT_MOST);
    let due = h.agent.pace.last_whole;
    h.write(&steps[0]);
    h.sync(true).await.expect("resync with a change, overdue");
    assert!(
        h.agent.pace.last_whole > due && !h.agent.pace.scoped_since_whole,
        "overdue: whole with the change"
    );
    let applied = h.applied();
    assert_eq!(h.kernel().table.as_ref(), Some(&applied), "the kernel holds what the agent believes");
}

/// The first sync decides with the allocation time each Service is then stamped with (later
/// than any it has, so new ones stay the youngest): no model has another age than the state's
/// afterwards, so the next change is decided alone, not with every Service again.
#[tokio::test]
async fn the_first_sync_decides_with_the_ages_it_stamps() {
    let both = [web(&["198.51.100.11"]), dns(&["198.51.100.11"])].join("---");
    let mut h = Harness::new(FakeKernel::default(), &both).await;
    h.sync(false).await.expect("first sync");
    assert_eq!(h.agent.allocations.since.len(), 2, "both allocated and stamped");
    assert!(h.agent.kept.models.aged(&h.agent.allocations.since).is_empty(), "no model has another age");
    // A restart among them, and a new Service: it is younger than both.
    let old = h.agent.allocations.since.values().max().copied().unwrap();
    h.write(&[both, sticky(&["198.51.100.11"])].join("---"));
    h.agent.dataplane.forget();
    h.sync(false).await.expect("a whole sync again");
    let key = ServiceKey::new("default", "sticky");
    assert!(h.agent.allocations.since[&key] > old, "the new Service is the youngest");
    assert!(h.agent.kept.models.aged(&h.agent.allocations.since).is_empty());
}
