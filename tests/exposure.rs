//! Who can see and touch the agent (docs/design.md), on the real kernel: the agent runs with
//! its default addresses in the node namespace; a client in another namespace (another host on
//! the node's network) reaches only the probes, which withhold their reasons; `/status` and
//! `/metrics` answer on the node's own loopback only, where `nodelb status` reads them; the state
//! file is readable by root only.

mod common;

use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use common::agent::{Agent, HEALTH_PORT, HTTP_PORT, nodelb};
use common::manifest::{EndpointSpec, PortSpec, ServiceSpec};
use common::topology::{ClientError, NODE_V4, Topology, backend_v4, http_request, wait_until};

const READY: Duration = Duration::from_secs(15);
const CHANGE: Duration = Duration::from_secs(5);
const T: Duration = Duration::from_secs(2);

fn node() -> IpAddr {
    IpAddr::V4(NODE_V4)
}

/// The TCP ports the agent's process listens on in the node namespace, as `address:port`.
fn agent_listeners(agent: &Agent, topo: &Topology) -> Vec<String> {
    let pid = agent.pid().expect("running").to_string();
    let out = topo.node.exec_ok("ss", &["-Hltnp"]);
    let mut found: Vec<String> = out
        .lines()
        .filter(|l| l.contains(&format!("pid={pid},")) || l.contains(&format!("pid={pid})")))
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_string))
        .collect();
    found.sort();
    found
}

/// One node serving `default/web` (20080 → a local backend) with the default listeners, ready.
fn web_on_one_node() -> (Topology, Agent) {
    let topo = Topology::new(1, 1);
    let web = ServiceSpec::new("web")
        .port(PortSpec::tcp(80, Some(20080)))
        .endpoint(EndpointSpec::local(backend_v4(0)));
    let mut agent = Agent::start(&topo.node, &[("web.yaml", web.render())], &[]);
    agent.wait_ready(READY);
    (topo, agent)
}

#[test]
fn another_host_reaches_only_the_probes_and_they_withhold_the_reason() {
    require_root!();
    let (topo, mut agent) = web_on_one_node();
    let client = topo.client(0);
    let get = |port: u16, path: &str| http_request(client, node(), port, path, T);

    // What the process listens on: the local endpoints on loopback, the probes everywhere.
    assert_eq!(
        agent_listeners(&agent, &topo),
        vec![format!("0.0.0.0:{HEALTH_PORT}"), format!("127.0.0.1:{HTTP_PORT}")],
        "the agent's listening sockets"
    );
    // From another host: the full endpoints are not reachable at all.
    for path in ["/status", "/metrics", "/readyz"] {
        match get(HTTP_PORT, path) {
            Err(ClientError::Refused) => {}
            other => panic!("{path} on {}:{HTTP_PORT} from another host: {other:?} (want refused)", node()),
        }
    }
    // The probes answer with their status code; nothing else is served there.
    let r = get(HEALTH_PORT, "/healthz").expect("/healthz");
    assert_eq!((r.status, r.body.as_str()), (200, "ok\n"));
    let r = get(HEALTH_PORT, "/readyz").expect("/readyz");
    assert_eq!((r.status, r.body.as_str()), (200, "ready\n"));
    for path in ["/status", "/metrics", "/", "/readyz/../status"] {
        let r = get(HEALTH_PORT, path).expect(path);
        assert_eq!(r.status, 404, "{path} on the probe port: {}", r.body);
        assert!(!r.body.contains("default/web") && !r.body.contains("20080"), "{path}: {}", r.body);
    }

    // Not ready (the state file cannot be written: a directory where it goes; root ignores
    // modes): the kubelet sees 503, the reason stays on the node.
    let state = agent.state_file();
    let mode = std::fs::metadata(&state).expect("state file").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the state file lists every Service: root only");
    std::fs::remove_file(&state).unwrap();
    std::fs::create_dir(&state).unwrap();
    let b = ServiceSpec::new("b").port(PortSpec::tcp(81, None)).endpoint(EndpointSpec::local(backend_v4(0)));
    agent.write_manifest("b.yaml", &b.render());
    assert!(
        wait_until(CHANGE, || agent.readyz().is_some_and(|(code, _)| code == 503)),
        "not ready: {:?}",
        agent.readyz()
    );
    let r = get(HEALTH_PORT, "/readyz").expect("/readyz");
    assert_eq!(r.status, 503);
    assert_eq!(r.body, "not ready (reason withheld here: run `nodelb status` on the node)\n");
    let (_, local) = agent.readyz().expect("local /readyz");
    assert!(local.contains(&state.display().to_string()), "the node's own /readyz names the file: {local}");

    // On the node, `nodelb status` (default address) still reads everything.
    let out = nodelb(&topo.node, &["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("default/web") && text.contains("20080"), "nodelb status: {text}");
    assert!(text.contains("NOT READY") && text.contains(&state.display().to_string()), "{text}");
    std::fs::remove_dir(&state).unwrap();
    agent.wait_ready(READY);
    let mode = std::fs::metadata(&state).expect("state file").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "rewritten root only");
}

/// `--metrics-addr` needs someone to ask about tokens: in manifests mode it is refused at start,
/// not served unauthenticated.
#[test]
fn authenticated_metrics_are_refused_without_kubernetes() {
    require_root!();
    let topo = Topology::new(1, 0);
    let dir = tempfile::tempdir().expect("dir");
    let manifests = dir.path().to_str().expect("utf-8");
    let out = nodelb(&topo.node, &["run", "--manifests", manifests, "--metrics-addr", "0.0.0.0:9472"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started: {err}");
    assert!(err.contains("--metrics-addr") && err.contains("Kubernetes mode"), "{err}");
}

/// Anyone who reaches a node's listeners gets bounded resources: from another host, 1,100 idle
/// connections to the health port, then 500 connections each trying to send 300 KB of a header
/// that never ends, for 20 s. Meanwhile the node itself (what the kubelet's probes are) keeps
/// getting `/readyz` 200, the dataplane keeps serving, and the agent's peak memory grows by
/// less than 32 MiB (before the bounds: about 150 MiB, the whole headers held).
#[test]
fn hostile_clients_cannot_exhaust_the_public_listener() {
    require_root!();
    let (topo, agent) = web_on_one_node();
    agent.reset_peak_rss();
    let before = agent.peak_rss_kib();

    let client_ns = format!("/run/netns/{}", topo.client(0).name);
    let attack = std::thread::spawn(move || {
        use std::io::Write as _;
        let f = std::fs::File::open(&client_ns).expect("open netns");
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let target = std::net::SocketAddr::from((NODE_V4, HEALTH_PORT));
        let connect = || std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2));
        let idle: Vec<std::net::TcpStream> = (0..1100).filter_map(|_| connect().ok()).collect();
        let started = std::time::Instant::now();
        let chunk = vec![b'a'; 16 * 1024];
        let (mut sent, mut reopened) = (0usize, 0usize);
        let mut slow: Vec<(std::net::TcpStream, usize)> = Vec::new();
        while started.elapsed() < Duration::from_secs(20) {
            while slow.len() < 500 {
                let Ok(s) = connect() else { break };
                s.set_write_timeout(Some(Duration::from_millis(50))).ok();
                let mut s = s;
                if s.write_all(b"GET /readyz HTTP/1.1\r\nX-Long: ").is_ok() {
                    slow.push((s, 0));
                }
                reopened += 1;
            }
            slow.retain_mut(|(s, n)| {
                if *n >= 300 * 1024 {
                    return true;
                }
                match s.write(&chunk) {
                    Ok(k) => {
                        *n += k;
                        sent += k;
                        true
                    }
                    Err(e) => {
                        e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut
                    }
                }
            });
            std::thread::sleep(Duration::from_millis(20));
        }
        (idle.len(), reopened, sent)
    });

    // While the attack runs (it is on a thread of the client namespace): the node itself.
    let node_ns = &topo.node;
    let started = std::time::Instant::now();
    let (mut probes, mut served) = (0, 0);
    while started.elapsed() < Duration::from_secs(18) {
        let r = http_request(node_ns, node(), HEALTH_PORT, "/readyz", T).expect("the node's own probe");
        assert_eq!(r.status, 200, "/readyz from the node itself: {}", r.body);
        probes += 1;
        let body =
            common::topology::http_get(topo.client(0), node(), 20080, T).expect("the dataplane serves");
        assert!(body.starts_with("backend=be1"), "{body}");
        served += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let (idle, opened, sent) = attack.join().expect("the attack");
    let grew = agent.peak_rss_kib().saturating_sub(before);
    eprintln!(
        "{idle} idle connections made, {opened} slow-header connections opened, {sent} header bytes sent; \
         {probes} probes from the node answered 200, {served} requests served; peak RSS grew by {grew} KiB"
    );
    assert!(idle >= 1000, "the attack could not connect: {idle}");
    assert!(grew < 32 * 1024, "the agent's peak RSS grew by {grew} KiB");
}
