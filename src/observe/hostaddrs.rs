//! This node's addresses, read from the kernel of the agent's network namespace (`getifaddrs`:
//! one netlink dump of every interface address, no privilege needed). Feeds the endpoint policy
//! ([`crate::core::decisions::endpoint_policy`]): a node's own address, and the directed broadcast address of each
//! of its interfaces, is not a DNAT target; and node port pools' `addresses` (which interface
//! each address is on).

use std::net::IpAddr;

use crate::core::decisions::endpoint_policy::HostAddresses;

#[derive(Debug, thiserror::Error)]
pub enum HostAddrError {
    #[error("cannot list this node's interface addresses (getifaddrs): {0}")]
    List(#[from] nix::Error),
}

fn ip_of(s: &nix::sys::socket::SockaddrStorage) -> Option<IpAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(IpAddr::V4(v4.ip()));
    }
    s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
}

/// Every address of every interface (loopback included: `127.0.0.1` is refused anyway, and a
/// node may carry more addresses on `lo`, e.g. a kube-vip or BGP-announced one), each owned by
/// `this node (<interface>)`, and the interfaces' broadcast addresses.
pub fn read() -> Result<HostAddresses, HostAddrError> {
    let mut out = HostAddresses::default();
    for ifa in nix::ifaddrs::getifaddrs()? {
        if let Some(addr) = ifa.address.as_ref().and_then(ip_of) {
            out.add(addr, format!("this node ({})", ifa.interface_name));
            out.own.interfaces.entry(addr).or_default().insert(ifa.interface_name.clone());
        }
        if ifa.flags.contains(nix::net::if_::InterfaceFlags::IFF_BROADCAST)
            && let Some(b) = ifa.broadcast.as_ref().and_then(ip_of)
        {
            out.broadcasts.insert(b);
        }
    }
    // An address added without a broadcast (`ip addr add 192.0.2.1/24 dev x`) is reported with
    // itself in the broadcast field: that is a node address, not a broadcast one.
    let HostAddresses { nodes, broadcasts, .. } = &mut out;
    broadcasts.retain(|b| !nodes.contains_key(b));
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// Whatever namespace the test runs in has a loopback interface with 127.0.0.1 (or at least
    /// some address); the read works without privileges.
    #[test]
    fn reads_this_namespace() {
        let got = super::read().expect("getifaddrs");
        let lo: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        assert!(got.nodes.get(&lo).is_none_or(|o| o == "this node (lo)"), "{got:?}");
    }
}
