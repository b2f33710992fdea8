//! Whether an endpoint can reach its own Service through the node (hairpin), given the node's
//! bridges (read by the agent's `bridge` module) and the endpoints programmed. Pure.
//!
//! nodelb masquerades a connection drawn to its own client (`ip saddr . ip daddr … @endpoints-<fam>`),
//! so that the answer comes back through the node. What it cannot change: with br_netfilter passing a
//! bridge's IP traffic to the netfilter hooks, a DNAT in the bridge's prerouting to an address
//! behind the same bridge makes the bridge forward the frame itself, back out of the port it came
//! in on, which a bridge port does only with hairpin mode on. Otherwise the packet is dropped and
//! the connection times out. Hence a warning per bridge that carries programmed endpoints, whose IP
//! traffic br_netfilter hands to netfilter, and which has pods' ports with hairpin mode off.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::domain::Family;
use crate::ruleset::ir::{KeyPart, Ruleset};
use crate::ruleset::plan;

/// What br_netfilter does, and every bridge of the namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BridgeFacts {
    /// `net.bridge.bridge-nf-call-iptables` (false when br_netfilter is not there at all).
    pub call_iptables: bool,
    /// `net.bridge.bridge-nf-call-ip6tables`.
    pub call_ip6tables: bool,
    pub bridges: Vec<Bridge>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bridge {
    pub name: String,
    /// The bridge's own `nf_call_iptables` option (either it or the sysctl is enough).
    pub nf_call_iptables: bool,
    pub nf_call_ip6tables: bool,
    /// Addresses of the bridge device with their prefix: the networks routed through it.
    pub prefixes: Vec<IpNet>,
    pub ports: Vec<BridgePort>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgePort {
    pub name: String,
    pub hairpin: bool,
    /// A hardware interface (it has a `device`), not a pod's veth: an uplink, whose hairpin mode
    /// does not concern the pods.
    pub physical: bool,
}

/// Port names named in a warning's message; the rest are counted.
const PORTS_NAMED: usize = 10;

/// One bridge on which hairpin connections fail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HairpinWarning {
    pub bridge: String,
    /// Ports with hairpin mode off (hardware uplinks left out), by name.
    pub ports: Vec<String>,
    /// Families (`ipv4`, `ipv6`) whose traffic br_netfilter passes to netfilter on that bridge
    /// and which have programmed endpoints behind it.
    pub families: Vec<String>,
    /// Programmed endpoint addresses behind the bridge.
    pub endpoints: usize,
    /// The whole story for a human: what fails, why, and the fix.
    pub message: String,
}

/// Every address the ruleset DNATs to (the elements of `@endpoints-<family>`).
pub fn programmed_endpoints(rs: &Ruleset) -> BTreeSet<IpAddr> {
    Family::ALL
        .iter()
        .filter_map(|f| rs.sets.get(&plan::endpoints_set(*f)))
        .flat_map(|s| s.elements.keys())
        .filter_map(|k| match k.first() {
            Some(KeyPart::Addr(a)) => Some(a),
            _ => None,
        })
        .collect()
}

/// A warning for each bridge where a hairpin connection of one of `endpoints` would be dropped.
pub fn diagnose(facts: &BridgeFacts, endpoints: &BTreeSet<IpAddr>) -> Vec<HairpinWarning> {
    facts.bridges.iter().filter_map(|b| diagnose_bridge(facts, b, endpoints)).collect()
}

fn diagnose_bridge(facts: &BridgeFacts, b: &Bridge, endpoints: &BTreeSet<IpAddr>) -> Option<HairpinWarning> {
    let behind: Vec<IpAddr> =
        endpoints.iter().copied().filter(|a| b.prefixes.iter().any(|p| p.contains(a))).collect();
    // Why br_netfilter calls the hooks of each family, for the families of those endpoints.
    let causes: Vec<(Family, String)> = Family::ALL
        .into_iter()
        .filter(|f| behind.iter().any(|a| Family::of(a) == *f))
        .filter_map(|f| {
            let (global, own, sysctl, option) = match f {
                Family::Ipv4 => {
                    (facts.call_iptables, b.nf_call_iptables, "bridge-nf-call-iptables", "nf_call_iptables")
                }
                Family::Ipv6 => (
                    facts.call_ip6tables,
                    b.nf_call_ip6tables,
                    "bridge-nf-call-ip6tables",
                    "nf_call_ip6tables",
                ),
            };
            let cause = if global {
                format!("net.bridge.{sysctl}=1")
            } else if own {
                format!("{option} of {} is 1", b.name)
            } else {
                return None;
            };
            Some((f, cause))
        })
        .collect();
    let off: Vec<String> =
        b.ports.iter().filter(|p| !p.hairpin && !p.physical).map(|p| p.name.clone()).collect();
    if causes.is_empty() || off.is_empty() {
        return None;
    }
    let mut named = off.iter().take(PORTS_NAMED).cloned().collect::<Vec<_>>().join(", ");
    if off.len() > PORTS_NAMED {
        named.push_str(&format!(" and {} more", off.len() - PORTS_NAMED));
    }
    let families: Vec<&str> = causes
        .iter()
        .map(|(f, _)| match f {
            Family::Ipv4 => "IPv4",
            Family::Ipv6 => "IPv6",
        })
        .collect();
    let why: Vec<&str> = causes.iter().map(|(_, c)| c.as_str()).collect();
    let message = format!(
        "hairpin mode is off on port(s) {named} of bridge {bridge}, and br_netfilter passes its bridged {fams} \
         traffic to netfilter ({why}): an endpoint behind {bridge} ({n} programmed, e.g. {example}) that connects \
         to its own Service through the node gets no answer whenever it is drawn itself. Turn hairpin mode on for \
         the pods' bridge ports: \"hairpinMode\": true in the bridge CNI plugin's configuration, kubelet \
         --hairpin-mode=hairpin-veth, or `ip link set <port> type bridge_slave hairpin on`",
        bridge = b.name,
        fams = families.join(" and "),
        why = why.join(", "),
        n = behind.len(),
        example = behind[0],
    );
    Some(HairpinWarning {
        bridge: b.name.clone(),
        ports: off,
        families: causes.iter().map(|(f, _)| f.name().to_string()).collect(),
        endpoints: behind.len(),
        message,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(name: &str, hairpin: bool) -> BridgePort {
        BridgePort { name: name.into(), hairpin, physical: false }
    }

    fn cni0(ports: Vec<BridgePort>) -> Bridge {
        Bridge {
            name: "cni0".into(),
            nf_call_iptables: false,
            nf_call_ip6tables: false,
            prefixes: vec![
                "198.51.100.1/24".parse::<ipnet::IpNet>().unwrap().trunc(),
                "2001:db8:2::/64".parse().unwrap(),
            ],
            ports,
        }
    }

    fn addrs(list: &[&str]) -> BTreeSet<IpAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    /// Ports and families of the expected warning, and the cause its message names.
    type Want = (Vec<&'static str>, Vec<&'static str>, &'static str);

    #[test]
    fn which_bridges_break_hairpin() {
        let off = || cni0(vec![port("veth1", false), port("veth2", true)]);
        let on = || cni0(vec![port("veth1", true), port("veth2", true)]);
        let uplink_off = || {
            let mut b = on();
            b.ports.push(BridgePort { name: "eno1".into(), hairpin: false, physical: true });
            b
        };
        let own_option = || {
            let mut b = off();
            b.nf_call_iptables = true;
            b
        };
        let v4 = addrs(&["198.51.100.11"]);
        let v6 = addrs(&["2001:db8:2::11"]);
        let elsewhere = addrs(&["192.0.2.7"]);
        let facts = |iptables, ip6tables, b: Bridge| BridgeFacts {
            call_iptables: iptables,
            call_ip6tables: ip6tables,
            bridges: vec![b],
        };
        #[rustfmt::skip]
        let cases: Vec<(&str, BridgeFacts, &BTreeSet<IpAddr>, Option<Want>)> = vec![
            ("br_netfilter on, a pod's port off", facts(true, true, off()), &v4, Some((vec!["veth1"], vec!["ipv4"], "net.bridge.bridge-nf-call-iptables=1"))),
            ("every port on", facts(true, true, on()), &v4, None),
            ("only the uplink is off", facts(true, true, uplink_off()), &v4, None),
            ("br_netfilter off: routed, hairpin mode irrelevant", facts(false, false, off()), &v4, None),
            ("the bridge's own option", facts(false, false, own_option()), &v4, Some((vec!["veth1"], vec!["ipv4"], "nf_call_iptables of cni0 is 1"))),
            ("IPv6 endpoints, ip6tables off", facts(true, false, off()), &v6, None),
            ("IPv6 endpoints, ip6tables on", facts(false, true, off()), &v6, Some((vec!["veth1"], vec!["ipv6"], "bridge-nf-call-ip6tables=1"))),
            ("no endpoint behind the bridge", facts(true, true, off()), &elsewhere, None),
        ];
        for (desc, facts, eps, want) in cases {
            let got = diagnose(&facts, eps);
            match want {
                None => assert!(got.is_empty(), "{desc}: {got:?}"),
                Some((ports, fams, cause)) => {
                    assert_eq!(got.len(), 1, "{desc}: {got:?}");
                    let w = &got[0];
                    assert_eq!(
                        (w.ports.clone(), w.families.clone()),
                        (
                            ports.iter().map(|s| s.to_string()).collect(),
                            fams.iter().map(|s| s.to_string()).collect()
                        ),
                        "{desc}"
                    );
                    for needle in
                        ["cni0", "hairpin mode is off", cause, "hairpinMode", "--hairpin-mode=hairpin-veth"]
                    {
                        assert!(w.message.contains(needle), "{desc}: {needle} in {}", w.message);
                    }
                }
            }
        }
    }

    #[test]
    fn many_ports_are_counted_not_listed() {
        let ports = (0..25).map(|i| port(&format!("veth{i:02}"), false)).collect();
        let facts = BridgeFacts { call_iptables: true, call_ip6tables: false, bridges: vec![cni0(ports)] };
        let w = diagnose(&facts, &addrs(&["198.51.100.11", "198.51.100.12"]));
        assert_eq!(w[0].ports.len(), 25);
        assert_eq!(w[0].endpoints, 2);
        assert!(w[0].message.contains("veth09 and 15 more"), "{}", w[0].message);
    }
}
