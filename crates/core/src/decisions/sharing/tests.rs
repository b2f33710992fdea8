use super::*;

#[test]
fn only_services_of_pools_apart_share() {
    // `gpu` may meet either (a GPU node can be an edge node); `edge2` selects the edge nodes.
    let apart = |a: &str, b: &str| (a.to_string(), b.to_string());
    let mut s = Sharing::of_apart([apart("edge", "internal"), apart("edge2", "internal")]);
    let o = |c: char| Owner(c.to_string().repeat(12));
    let k = |c: char| ServiceKey::new("default", c.to_string());
    for (c, pool) in [('a', "edge"), ('b', "internal"), ('c', "gpu"), ('d', "edge2"), ('e', "edge")] {
        s.serve(&k(c), o(c), pool);
    }
    assert!(s.may_share(&o('a'), &o('b')) && s.may_share(&o('b'), &o('a')), "edge and internal");
    assert!(s.may_share(&o('d'), &o('b')), "another pool on the edge nodes");
    assert!(!s.may_share(&o('a'), &o('c')), "a gpu node may be an edge node");
    assert!(!s.may_share(&o('a'), &o('d')), "the same nodes");
    assert!(!s.may_share(&o('a'), &o('e')), "one pool");
    assert!(!s.may_share(&o('a'), &o('f')), "a Service of no known pool");
    assert_eq!(s.pool(&o('b')), Some("internal"));
    assert!(s.apart(&k('a'), &k('b')) && !s.apart(&k('a'), &k('c')));
    s.record(443, &k('a'));
    s.record(443, &k('c'));
    assert!(s.recorded_together(443, &k('a'), &k('c')) && !s.recorded_together(443, &k('a'), &k('b')));
    assert!(s.shares("edge") && s.shares("edge2") && !s.shares("gpu") && !s.shares("edg"));
    s.only_recorded();
    assert!(!s.may_share(&o('a'), &o('b')), "closed");
    assert!(s.recorded_together(443, &k('a'), &k('c')), "what is recorded stays");
}
