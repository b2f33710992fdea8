use super::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

fn selector(labels: &[(&str, &str)]) -> Selector {
    let s = LabelSelector {
        match_labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
        ..Default::default()
    };
    Selector::parse(Some(&s)).expect("selector")
}

#[test]
fn only_services_of_pools_apart_share() {
    let (edge, internal, gpu) =
        (selector(&[("tier", "edge")]), selector(&[("tier", "internal")]), selector(&[("gpu", "yes")]));
    let mut s = Sharing::of([("edge", &edge), ("internal", &internal), ("gpu", &gpu), ("edge2", &edge)]);
    let o = |c: char| Owner(c.to_string().repeat(12));
    s.serve(o('a'), "edge");
    s.serve(o('b'), "internal");
    s.serve(o('c'), "gpu");
    s.serve(o('d'), "edge2");
    s.serve(o('e'), "edge");
    assert!(s.may_share(&o('a'), &o('b')) && s.may_share(&o('b'), &o('a')), "edge and internal");
    assert!(s.may_share(&o('d'), &o('b')), "another pool on the edge nodes");
    assert!(!s.may_share(&o('a'), &o('c')), "a gpu node may be an edge node");
    assert!(!s.may_share(&o('a'), &o('d')), "the same nodes");
    assert!(!s.may_share(&o('a'), &o('e')), "one pool");
    assert!(!s.may_share(&o('a'), &o('f')), "a Service of no known pool");
    assert_eq!(s.pool(&o('b')), Some("internal"));
}
