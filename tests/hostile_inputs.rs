//! Hostile but valid (or nearly valid) input at the sizes an operator should expect to meet:
//! Services with thousands of ports, EndpointSlice sets with thousands of endpoints, megabyte
//! annotations, YAML alias bombs, deep nesting, huge files and lines. Each is bounded (in what
//! nodelb keeps and programs) or refused with a reason naming the object and the value, and the
//! good Services next to it keep being planned. The bounds are in docs/design.md ("Bounds on
//! input"); the times these take are printed (`--nocapture`), not asserted (docs/reliability.md).

// Only the good world and its checks are used here; the targets run in tests/fuzz.rs.
#[allow(dead_code)]
mod fuzzing;

use std::time::Instant;

use fuzzing::world::{self, MAX_MESSAGE, World};
use k8s_openapi::api::core::v1::Service;
use nodelb::core::decisions::desired::{AllocationMode, Desired, SourceNotes};
use nodelb::core::inputs::compact::EndpointSlice;
use nodelb::core::inputs::model::{self, MAX_ANNOTATION_BYTES, MAX_SERVICE_BACKENDS, ModelOptions, Refusal};
use serde_json::{Value, json};

fn svc(name: &str, ports: Vec<Value>, f: impl FnOnce(&mut Value)) -> Service {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "big", "annotations": {}},
        "spec": {"type": "LoadBalancer", "ports": ports}
    });
    f(&mut v);
    serde_json::from_value(v).expect("Service")
}

fn ports(n: usize) -> Vec<Value> {
    (0..n).map(|i| json!({"name": format!("p{i}"), "port": 1 + i, "protocol": "UDP"})).collect()
}

fn slice(
    name: &str,
    service: &str,
    port_names: &[String],
    addrs: impl Iterator<Item = String>,
) -> EndpointSlice {
    let endpoints: Vec<Value> =
        addrs.map(|a| json!({"addresses": [a], "conditions": {"ready": true}})).collect();
    let ports: Vec<Value> =
        port_names.iter().map(|n| json!({"name": n, "port": 8080, "protocol": "UDP"})).collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "big", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4", "endpoints": endpoints, "ports": ports
    }))
    .expect("EndpointSlice")
}

/// `n` distinct documentation-range addresses (198.18.0.0/15, benchmark space: never refused).
fn addrs(n: usize) -> impl Iterator<Item = String> {
    (0..n).map(|i| format!("198.18.{}.{}", i / 250, 1 + i % 250))
}

/// The hostile objects next to the good world, in both modes; the good Services are planned as
/// when alone and every message is bounded. Returns the manifests-mode result.
fn next_to_good(what: &str, services: Vec<Service>, slices: Vec<EndpointSlice>) -> Desired {
    let world = World::new();
    let (gs, ge) = world.typed();
    let notes = SourceNotes::default();
    let alone = world::compute(AllocationMode::Allocate, &gs, &ge, &notes, &world.allocations);
    let all: Vec<Service> = gs.iter().cloned().chain(services).collect();
    let all_slices: Vec<EndpointSlice> = ge.iter().cloned().chain(slices).collect();
    let t = Instant::now();
    let with = world::compute(AllocationMode::Allocate, &all, &all_slices, &notes, &world.allocations);
    eprintln!("{what}: desired::compute {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    world::assert_good_served(&world, &alone, &with, what);
    world::assert_messages_bounded(&with, what);
    let kube_alone = world::compute(AllocationMode::Annotated, &gs, &ge, &notes, &Default::default());
    let kube = world::compute(AllocationMode::Annotated, &all, &all_slices, &notes, &Default::default());
    world::assert_good_served(&world, &kube_alone, &kube, what);
    with
}

fn rules_of(d: &Desired, needle: &str) -> usize {
    d.ruleset.chains.iter().filter(|(n, _)| n.contains(needle)).map(|(_, c)| c.rules.len()).sum()
}

fn refusal_of<'a>(d: &'a Desired, name: &str) -> &'a Refusal {
    d.refusals.iter().find(|r| &*r.service().name == name).unwrap_or_else(|| panic!("{name} not refused"))
}

/// 20,000 ports (the most a Service may have) are modelled and allocated without blowing up:
/// the default range holds 10,000 node ports, the rest are named as exhausted. One more port
/// refuses the Service, naming the count and the bound.
#[test]
fn a_service_with_thousands_of_ports() {
    let many = svc("many", ports(MAX_SERVICE_BACKENDS), |_| {});
    let too_many = svc("too-many", ports(MAX_SERVICE_BACKENDS + 1), |_| {});
    let names: Vec<String> = (0..MAX_SERVICE_BACKENDS).map(|i| format!("p{i}")).collect();
    let backends = slice("many-1", "many", &names, addrs(1));
    let d = next_to_good("20,000 ports", vec![many, too_many], vec![backends]);
    let status = d.services.iter().find(|s| &*s.name == "many").expect("status");
    let allocated = status.ports.iter().filter(|p| p.node_port.is_some()).count();
    assert_eq!(allocated, 10_000 - 3, "the default range, less the good Services' ports");
    assert_eq!(d.alloc_problems.len(), MAX_SERVICE_BACKENDS - allocated);
    let msg = refusal_of(&d, "too-many").to_string();
    assert!(msg.contains("spec.ports has 20001 ports") && msg.contains("at most 20000"), "{msg}");
}

/// 30,000 endpoints for a Service with two ports: each port keeps its share, the best ones (ready
/// first, then by address), and a warning says how many were cut. A one-port Service with
/// Kubernetes' 5,000-endpoint scalability target keeps all of them.
#[test]
fn an_endpointslice_set_with_thousands_of_endpoints() {
    let names = vec!["a".to_string(), "b".to_string()];
    let two = svc(
        "two",
        vec![
            json!({"name": "a", "port": 1, "protocol": "UDP"}),
            json!({"name": "b", "port": 2, "protocol": "UDP"}),
        ],
        |_| {},
    );
    let mut slices: Vec<EndpointSlice> = (0..30)
        .map(|i| slice(&format!("two-{i}"), "two", &names, addrs(30_000).skip(i * 1000).take(1000)))
        .collect();
    // One not-ready endpoint with the lowest address: cut before any ready one.
    let mut low = slice("two-low", "two", &names, std::iter::once("198.18.0.0".to_string()));
    low.endpoints.as_mut().expect("endpoints")[0].conditions.as_mut().expect("conditions").ready =
        Some(false);
    slices.push(low);
    let one = svc("one", vec![json!({"name": "a", "port": 3, "protocol": "UDP"})], |_| {});
    slices.extend(
        (0..5).map(|i| slice(&format!("one-{i}"), "one", &names[..1], addrs(5000).skip(i * 1000).take(1000))),
    );
    let d = next_to_good("30,000 endpoints", vec![two, one], slices);
    let per_port = MAX_SERVICE_BACKENDS / 2;
    let chain_rules = rules_of(&d, "-big/two/udp/1");
    assert!(chain_rules >= per_port && chain_rules <= per_port + 2, "{chain_rules} rules for port 1");
    let status = d.services.iter().find(|s| &*s.name == "two").expect("status");
    assert!(status.ports.iter().all(|p| p.endpoints == per_port), "{:?}", status.ports);
    assert!(!d.ruleset.render().contains("198.18.0.0:"), "the not-ready endpoint was kept over ready ones");
    let cut: Vec<&String> = d.warnings.iter().filter(|w| w.contains("endpoints,")).collect();
    assert_eq!(cut.len(), 2, "one warning per cut port: {cut:?}");
    assert!(cut[0].contains("30001 endpoints, 10000 programmed"), "{}", cut[0]);
    let one = d.services.iter().find(|s| &*s.name == "one").expect("status");
    assert_eq!(one.ports[0].endpoints, 5000);
}

/// Megabyte annotations: a `nodelb.io/ports` larger than the API server would ever store refuses
/// the Service naming the annotation and its size (quoting 200 bytes of it); an oversized
/// `nodelb.io/allocated-ports` (machine-written) is ignored with one warning; 256 KiB of valid
/// requests and 20,000 bad allocation entries are one parse and one warning.
#[test]
fn megabyte_annotations() {
    let huge = "80/TCP=20080,".repeat(80_000);
    let big = svc("big-ports", ports(2), |v| v["metadata"]["annotations"]["nodelb.io/ports"] = json!(huge));
    let alloc = svc("big-alloc", ports(2), |v| {
        v["metadata"]["annotations"]["nodelb.io/allocated-ports"] = json!(huge)
    });
    let legacy = svc("big-legacy", ports(2), |v| {
        v["metadata"]["annotations"]["service.beta.kubernetes.io/load-balancer-source-ranges"] =
            json!("10.0.0.0/8,".repeat(100_000))
    });
    // Just under the limit: a request for each of 15,000 ports (as `service` would ask).
    let n = 15_000;
    let requests: Vec<String> = (0..n).map(|i| format!("{}/UDP={}", 1 + i, 1 + i)).collect();
    let requests = requests.join(",");
    assert!(requests.len() <= MAX_ANNOTATION_BYTES);
    let max =
        svc("max-requests", ports(n), |v| v["metadata"]["annotations"]["nodelb.io/ports"] = json!(requests));
    let bad: Vec<String> = (0..20_000).map(|i| format!("{i}/TCP=x")).collect();
    let bad = svc("bad-alloc", ports(2), |v| {
        v["metadata"]["annotations"]["nodelb.io/allocated-ports"] = json!(bad.join(","))
    });
    let d = next_to_good("megabyte annotations", vec![big, alloc, legacy, max, bad], vec![]);
    for (name, annotation) in [
        ("big-ports", "nodelb.io/ports"),
        ("big-legacy", "service.beta.kubernetes.io/load-balancer-source-ranges"),
    ] {
        let msg = refusal_of(&d, name).to_string();
        assert!(msg.contains(&format!("invalid annotation {annotation}=")), "{msg}");
        assert!(msg.contains("bytes long; the API server allows 262144 bytes"), "{msg}");
        assert!(msg.len() < 1000, "{} bytes", msg.len());
    }
    let warnings = |name: &str| {
        d.warnings.iter().filter(|w| w.contains(&format!("big/{name}:"))).cloned().collect::<Vec<_>>()
    };
    let w = warnings("big-alloc");
    assert!(
        w.len() == 1 && w[0].contains("ignoring annotation nodelb.io/allocated-ports: is 1040000 bytes"),
        "{w:?}"
    );
    let w = warnings("bad-alloc");
    assert!(w.len() == 1 && w[0].contains("and 19999 more bad entries"), "{w:?}");
    assert!(d.services.iter().any(|s| &*s.name == "max-requests"), "a 256 KiB valid request refused");
}

/// Source ranges are one rule per range and port: more than the bound refuses the Service (it
/// fails closed, as an invalid range does), naming the field and the numbers.
#[test]
fn source_ranges_times_ports_are_bounded() {
    let ranges: Vec<String> = (0..1000).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256)).collect();
    let ok = svc("ranges-ok", ports(20), |v| v["spec"]["loadBalancerSourceRanges"] = json!(ranges));
    let mut more = ranges.clone();
    more.push("192.0.2.0/24".into());
    let over = svc("ranges-over", ports(20), |v| v["spec"]["loadBalancerSourceRanges"] = json!(more));
    let d = next_to_good("source ranges", vec![ok, over], vec![]);
    assert!(
        d.services
            .iter()
            .any(|s| &*s.name == "ranges-ok"
                && s.state != nodelb::core::reports::report::ServiceState::Refused)
    );
    let msg = refusal_of(&d, "ranges-over").to_string();
    assert!(
        msg.contains(
            "loadBalancerSourceRanges has 1001 distinct ranges for 20 ports: 20020 rules, at most 20000"
        ),
        "{msg}"
    );
}

/// 100,000 unusable endpoint addresses behind a 100-port Service are parsed once and reported in
/// at most six warnings (they were one warning per address and port: ten million strings).
#[test]
fn many_bad_endpoint_addresses_make_few_warnings() {
    let names: Vec<String> = (0..100).map(|i| format!("p{i}")).collect();
    let bad = svc("bad-addrs", ports(100), |_| {});
    let slices: Vec<EndpointSlice> = (0..100)
        .map(|s| slice(&format!("bad-{s}"), "bad-addrs", &names, (0..1000).map(|i| format!("not-an-ip-{i}"))))
        .collect();
    let d = next_to_good("bad addresses", vec![bad], slices);
    let w: Vec<&String> = d.warnings.iter().filter(|w| w.contains("big/bad-addrs")).collect();
    assert_eq!(w.len(), 6, "{} warnings, the first: {:?}", w.len(), w.first());
    assert!(w[5].ends_with("99995 more endpoint addresses skipped"), "{}", w[5]);
}

/// The leader's writes for a Service refused for a 256 KiB annotation fit what the API server
/// accepts: a condition message of at most 32 KiB, an Event note of at most 1 KiB.
#[test]
fn leader_writes_about_huge_values_fit_the_api() {
    let value = "x".repeat(MAX_ANNOTATION_BYTES);
    let s = svc("huge", ports(1), |v| v["metadata"]["annotations"]["nodelb.io/ports"] = json!(value));
    let out = model::build(&[s], model::NO_SLICES, &ModelOptions::default());
    let msg = out.refused[0].to_string();
    assert!(msg.len() <= MAX_MESSAGE, "{} bytes", msg.len());
    assert!(
        msg.contains("invalid annotation nodelb.io/ports=\"xxxx") && msg.contains("(262144 bytes)"),
        "{}",
        &msg[..300]
    );
    assert!(nodelb::core::k8s::events::event_note(&msg).len() <= nodelb::core::k8s::events::MAX_NOTE_BYTES);
}

/// A manifests directory holding the good world's file and `name` with `content`; what is read.
fn load_with(
    name: &str,
    content: &[u8],
) -> (nodelb::core::inputs::manifests::Manifests, std::path::PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let world = World::new();
    let docs: Vec<String> = world
        .services
        .iter()
        .chain(&world.slices)
        .map(|v| serde_saphyr::to_string(v).expect("yaml"))
        .collect();
    std::fs::write(dir.path().join("good.yaml"), docs.join("---\n")).expect("write");
    let path = dir.path().join(name);
    std::fs::write(&path, content).expect("write");
    let t = Instant::now();
    let m = nodelb::observe::manifest_dir::load_dir(dir.path()).expect("readable");
    eprintln!("{name} ({} bytes): load_dir {:.0} ms", content.len(), t.elapsed().as_secs_f64() * 1e3);
    let served: std::collections::BTreeSet<_> = m.services.iter().map(|s| model::service_key(s)).collect();
    assert!(world.keys().is_subset(&served), "{name}: the good file's Services are not all read");
    for p in &m.problems {
        assert_eq!(p.file, path, "a problem about another file: {p}");
        assert!(
            p.to_string().len() <= MAX_MESSAGE,
            "{name}: problem message of {} bytes",
            p.to_string().len()
        );
    }
    (m, path, dir)
}

fn problem_with<'a>(
    m: &'a nodelb::core::inputs::manifests::Manifests,
    needle: &str,
) -> &'a nodelb::core::inputs::manifests::ManifestProblem {
    m.problems.iter().find(|p| p.message.contains(needle)).unwrap_or_else(|| {
        panic!(
            "no problem saying {needle:?}: {:?}",
            m.problems.iter().map(|p| world::head(&p.message)).collect::<Vec<_>>()
        )
    })
}

/// YAML aliases expand: 2,000 references to a 2,000-item list are 4,000,000 values from 14 KB of
/// text. A document is refused once it expands to more than twice its size (nodes, string bytes,
/// replayed events); the file's other document and the good file are read.
#[test]
fn yaml_alias_bombs_are_refused() {
    let items = vec!["x"; 2000].join(", ");
    let refs = vec!["*a"; 2000].join(", ");
    let bomb = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: bomb, namespace: big}}\n\
         spec: {{type: LoadBalancer, ports: [{{port: 80}}], list: &a [{items}], more: [{refs}]}}\n\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: fine, namespace: big}}\n\
         spec: {{type: LoadBalancer, ports: [{{port: 81}}]}}\n"
    );
    let (m, _, _dir) = load_with("bomb.yaml", bomb.as_bytes());
    let p = problem_with(&m, "expands");
    assert_eq!(p.document, 1, "{p}");
    assert!(m.services.iter().any(|s| s.metadata.name.as_deref() == Some("fine")));
    assert!(!m.services.iter().any(|s| s.metadata.name.as_deref() == Some("bomb")));
    // The classic nested form is stopped too.
    let mut laughs = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        laughs += &format!("a{i}: &a{i} [{refs}]\n");
    }
    let (m, _, _dir) = load_with("laughs.yaml", laughs.as_bytes());
    assert_eq!(m.problems.len(), 1, "{:?}", m.problems);
}

/// Nesting 100,000 levels deep is a problem naming the file, document and line, not a stack
/// overflow or minutes of parsing: YAML flow and block nesting by the parser's depth budget as it
/// reads, JSON by serde_json's recursion limit.
#[test]
fn deep_nesting_is_a_problem_not_a_crash() {
    let depth = 100_000;
    let service = "apiVersion: v1\nkind: Service\nmetadata: {name: deep, namespace: big}\n";
    for (name, spec) in [
        ("flow-seq.yaml", format!("spec: {}{}\n", "[".repeat(depth), "]".repeat(depth))),
        ("flow-map.yaml", format!("spec: {}{}\n", "{a: ".repeat(depth), "}".repeat(depth))),
    ] {
        let (m, _, _dir) = load_with(name, format!("{service}{spec}").as_bytes());
        let p = problem_with(&m, "nested more than 64 levels deep; not read");
        assert_eq!((p.document, p.line), (1, Some(4)), "{p}");
    }
    let block = format!("{service}spec:\n  x:\n    {}y\n", "- ".repeat(depth));
    let (m, _, _dir) = load_with("block.yaml", block.as_bytes());
    let p = problem_with(&m, "nested more than 64 levels deep; not read");
    assert_eq!((p.document, p.line), (1, Some(6)), "{p}");
    let json = format!(
        "{{\"apiVersion\": \"v1\", \"kind\": \"Service\", \"spec\": {}{}}}",
        "[".repeat(depth),
        "]".repeat(depth)
    );
    let (m, _, _dir) = load_with("deep.json", json.as_bytes());
    problem_with(&m, "recursion limit exceeded");
}

/// A file larger than any manifest directory should hold (16 MiB) is not read: a problem says
/// its size and the bound; the other files are read.
#[test]
fn huge_manifest_files_are_not_read() {
    let big = vec![b'#'; (16 << 20) + 1];
    let (m, _, _dir) = load_with("huge.yaml", &big);
    let p = problem_with(&m, "cannot read: is 16777217 bytes, more than 16777216");
    assert!(p.message.ends_with("manifests larger than 16 MiB are not read (split the file)"), "{p}");
}

/// A 10 MB line (one long JSON value) is read; what is wrong with it is said in a bounded message:
/// a megabyte string where a number belongs (serde quotes the value it refuses), a megabyte
/// annotation, a megabyte name, a megabyte kind.
#[test]
fn long_lines_and_values_give_short_messages() {
    let long = "x".repeat(1 << 20);
    let doc = json!([
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "long-port", "namespace": "big"},
         "spec": {"type": "LoadBalancer", "ports": [{"port": long}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "long-ann", "namespace": "big",
         "annotations": {"nodelb.io/ports": long}}, "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": long, "namespace": "big"},
         "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}},
        {"apiVersion": "v1", "kind": long, "metadata": {"name": long}},
    ]);
    let list = json!({"apiVersion": "v1", "kind": "List", "items": doc});
    let (m, _, _dir) = load_with("long.json", list.to_string().as_bytes());
    problem_with(&m, "invalid Service");
    let world = World::new();
    let services: Vec<Service> = m.services.iter().map(|s| Service::clone(s)).collect();
    let slices: Vec<EndpointSlice> = m.slices.iter().map(|s| EndpointSlice::clone(s)).collect();
    let d = world::compute(
        AllocationMode::Allocate,
        &services,
        &slices,
        &SourceNotes::default(),
        &world.allocations,
    );
    world::assert_messages_bounded(&d, "long values");
    for i in &m.ignored {
        assert!(i.to_string().len() <= MAX_MESSAGE, "ignored-object line of {} bytes", i.to_string().len());
    }
    assert_eq!(m.ignored.len(), 1);
}

/// A million empty documents (`---` lines) are read in one pass.
#[test]
fn a_million_empty_documents() {
    let (m, _, _dir) = load_with("empty-docs.yaml", "---\n".repeat(1_000_000).as_bytes());
    assert!(m.problems.is_empty());
}

/// The state file: a megabyte string where the version belongs, and a file larger than nodelb
/// ever writes (16 MiB), are errors naming the file, in short messages.
#[test]
fn hostile_state_files_give_short_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("state.json");
    let mut file = nodelb::observe::state::StateFile::new(&path);
    std::fs::write(&path, json!({"version": "v".repeat(1 << 20)}).to_string()).expect("write");
    let e = file.load().expect_err("a string version").to_string();
    assert!(
        e.contains(&path.display().to_string()) && e.len() <= MAX_MESSAGE,
        "{} bytes: {}",
        e.len(),
        world::head(&e)
    );
    let key = "a".repeat(1 << 20);
    std::fs::write(&path, json!({"version": 1, "allocations": {key: {"80/TCP": 20001}}}).to_string())
        .expect("write");
    let (_, skipped) = file.load_lenient().expect("one bad entry");
    let e = skipped[0].to_string();
    assert!(e.len() <= MAX_MESSAGE, "{} bytes: {}", e.len(), world::head(&e));
    std::fs::write(&path, vec![b' '; (16 << 20) + 1]).expect("write");
    let e = file.load().expect_err("too big").to_string();
    assert!(
        e.contains("is 16777217 bytes, more than 16777216") && e.contains(&path.display().to_string()),
        "{e}"
    );
}
