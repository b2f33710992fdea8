//! The netns harness itself: namespaces appear, are isolated, and vanish on drop.
mod common;

use common::netns::{NetNs, veth};

#[test]
fn namespaces_are_created_linked_and_removed() {
    require_root!();
    let name;
    {
        let a = NetNs::new("smoke-a");
        let b = NetNs::new("smoke-b");
        name = a.name.clone();
        veth(&a, "eth0", &b, "eth0");
        a.ip(&["addr", "add", "192.0.2.1/24", "dev", "eth0"]);
        b.ip(&["addr", "add", "192.0.2.2/24", "dev", "eth0"]);
        let out = a.exec("ping", &["-c1", "-W2", "192.0.2.2"]);
        assert!(out.status.success(), "ping across veth failed");
        let listed = common::netns::run_ok("ip", &["netns", "list"]);
        assert!(listed.contains(&name));
    }
    let listed = common::netns::run_ok("ip", &["netns", "list"]);
    assert!(!listed.contains(&name), "netns {name} left behind");
}
