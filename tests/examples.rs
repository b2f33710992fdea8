//! The demo manifests in `examples/` load, validate and allocate without any problem.

use std::path::Path;

use nodelb::core::decisions::alloc::{Allocations, allocate};
use nodelb::core::decisions::port_policy::PortRange;
use nodelb::core::inputs::model::{ModelOptions, build};
use nodelb::observe::manifest_dir::load_dir;

#[test]
fn examples_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let m = load_dir(&dir).expect("examples/ readable");
    assert!(m.problems.is_empty(), "{:?}", m.problems);
    assert!(m.ignored.is_empty(), "{:?}", m.ignored);
    let out = build(&m.services, &m.slices, &ModelOptions::default());
    assert!(out.refused.is_empty() && out.warnings.is_empty(), "{out:?}");
    let keys: Vec<String> = out.services.iter().map(|s| s.key.to_string()).collect();
    assert_eq!(keys, vec!["default/dns", "default/web"]);
    for s in &out.services {
        assert_eq!(s.ports.len(), 1);
        let eps: Vec<String> =
            s.ports[0].endpoints.iter().map(|e| format!("{}:{}", e.addr, e.port)).collect();
        let port = if &*s.key.name == "web" { 8080 } else { 5353 };
        assert_eq!(eps, vec![format!("198.51.100.11:{port}"), format!("198.51.100.12:{port}")]);
        assert!(s.ports[0].endpoints.iter().all(|e| e.ready && e.node_name.as_deref() == Some("node-1")));
    }
    let alloc = allocate(&PortRange::default(), &out.services, &Allocations::new());
    assert!(alloc.problems.is_empty());
    assert_eq!(alloc.allocations.len(), 2);
}
