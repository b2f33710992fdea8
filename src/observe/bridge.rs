//! The Linux bridges of the agent's network namespace, as far as hairpin connections care: which
//! bridges there are, their addresses, whether br_netfilter hands their bridged IP traffic to the
//! netfilter hooks (`/proc/sys/net/bridge/bridge-nf-call-ip{,6}tables`, and each bridge's own
//! `nf_call_ip{,6}tables`), and the hairpin mode of each port (`/sys/class/net/<bridge>/brif/
//! <port>/hairpin_mode`). Reads only, into [`BridgeFacts`]; what they mean is decided by [`crate::core::ruleset::hairpin`].

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use ipnet::IpNet;

use crate::core::ruleset::hairpin::{Bridge, BridgeFacts, BridgePort};

#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} has unexpected value {value:?} (want 0 or 1)")]
    Value { path: PathBuf, value: String },
    #[error("cannot list the interface addresses: {0}")]
    Addresses(#[source] nix::Error),
}

/// Reads under a sysfs and a `/proc/sys` root (tests point them at a temporary tree).
#[derive(Debug, Clone)]
pub struct BridgeReader {
    sys: PathBuf,
    proc_sys: PathBuf,
}

impl Default for BridgeReader {
    fn default() -> Self {
        BridgeReader { sys: PathBuf::from("/sys"), proc_sys: PathBuf::from("/proc/sys") }
    }
}

impl BridgeReader {
    pub fn with_roots(sys: impl Into<PathBuf>, proc_sys: impl Into<PathBuf>) -> BridgeReader {
        BridgeReader { sys: sys.into(), proc_sys: proc_sys.into() }
    }

    /// The bridges and br_netfilter's settings, with the addresses of the bridges (from the
    /// kernel, whatever the roots).
    pub fn read(&self) -> Result<BridgeFacts, BridgeError> {
        let bridge_sysctl = self.proc_sys.join("net/bridge");
        let mut facts = BridgeFacts {
            call_iptables: flag(&bridge_sysctl.join("bridge-nf-call-iptables"))?.unwrap_or(false),
            call_ip6tables: flag(&bridge_sysctl.join("bridge-nf-call-ip6tables"))?.unwrap_or(false),
            bridges: Vec::new(),
        };
        let net = self.sys.join("class/net");
        for dev in sorted_entries(&net)? {
            let dir = net.join(&dev);
            if !dir.join("bridge").is_dir() {
                continue;
            }
            let mut ports = Vec::new();
            for port in sorted_entries(&dir.join("brif"))? {
                let port_dir = dir.join("brif").join(&port);
                // A port that goes away while we read is simply not there.
                let Some(hairpin) = flag(&port_dir.join("hairpin_mode"))? else { continue };
                let physical = net.join(&port).join("device").exists();
                ports.push(BridgePort { name: port, hairpin, physical });
            }
            facts.bridges.push(Bridge {
                nf_call_iptables: flag(&dir.join("bridge/nf_call_iptables"))?.unwrap_or(false),
                nf_call_ip6tables: flag(&dir.join("bridge/nf_call_ip6tables"))?.unwrap_or(false),
                name: dev,
                prefixes: Vec::new(),
                ports,
            });
        }
        if !facts.bridges.is_empty() {
            for ifa in nix::ifaddrs::getifaddrs().map_err(BridgeError::Addresses)? {
                let Some(bridge) = facts.bridges.iter_mut().find(|b| b.name == ifa.interface_name) else {
                    continue;
                };
                if let Some(net) = prefix(&ifa) {
                    bridge.prefixes.push(net);
                }
            }
        }
        Ok(facts)
    }
}

/// The address of an interface address entry with its netmask, as a network.
fn prefix(ifa: &nix::ifaddrs::InterfaceAddress) -> Option<IpNet> {
    let (addr, mask) = (ifa.address.as_ref()?, ifa.netmask.as_ref()?);
    if let (Some(a), Some(m)) = (addr.as_sockaddr_in(), mask.as_sockaddr_in()) {
        let len = u32::from(m.ip()).leading_ones() as u8;
        return IpNet::new(a.ip().into(), len).ok().map(|n| n.trunc());
    }
    if let (Some(a), Some(m)) = (addr.as_sockaddr_in6(), mask.as_sockaddr_in6()) {
        let len = u128::from(m.ip()).leading_ones() as u8;
        return IpNet::new(a.ip().into(), len).ok().map(|n| n.trunc());
    }
    None
}

/// Names in a directory, sorted; none when it does not exist.
fn sorted_entries(dir: &Path) -> Result<Vec<String>, BridgeError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(BridgeError::Read { path: dir.to_path_buf(), source }),
    };
    let mut names: Vec<String> =
        entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    Ok(names)
}

/// A `0`/`1` file; `None` when it does not exist.
fn flag(path: &Path) -> Result<Option<bool>, BridgeError> {
    match std::fs::read_to_string(path) {
        Ok(v) => match v.trim() {
            "0" => Ok(Some(false)),
            "1" => Ok(Some(true)),
            other => Err(BridgeError::Value { path: path.to_path_buf(), value: other.to_string() }),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(source) => Err(BridgeError::Read { path: path.to_path_buf(), source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, path: &str, value: &str) {
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, value).unwrap();
    }

    #[test]
    fn reads_bridges_ports_and_br_netfilter() {
        let sys = tempfile::tempdir().unwrap();
        let proc_sys = tempfile::tempdir().unwrap();
        let s = sys.path();
        write(proc_sys.path(), "net/bridge/bridge-nf-call-iptables", "1\n");
        // A bridge with a pod's veth (hairpin off), an uplink NIC (hairpin off) and a pod's veth
        // with hairpin on; an interface that is no bridge; a bridge without ports.
        write(s, "class/net/nlbtest0/bridge/nf_call_iptables", "0\n");
        write(s, "class/net/nlbtest0/bridge/nf_call_ip6tables", "1\n");
        write(s, "class/net/nlbtest0/brif/veth1/hairpin_mode", "0\n");
        write(s, "class/net/nlbtest0/brif/eno1/hairpin_mode", "0\n");
        write(s, "class/net/nlbtest0/brif/veth2/hairpin_mode", "1\n");
        write(s, "class/net/eno1/device/vendor", "0x8086\n");
        write(s, "class/net/veth1/mtu", "1500\n");
        write(s, "class/net/eth9/mtu", "1500\n");
        std::fs::create_dir_all(s.join("class/net/nlbtest1/bridge")).unwrap();
        let facts = BridgeReader::with_roots(s, proc_sys.path()).read().unwrap();
        assert!(facts.call_iptables && !facts.call_ip6tables, "{facts:?}");
        let port = |name: &str, hairpin, physical| BridgePort { name: name.into(), hairpin, physical };
        assert_eq!(
            facts.bridges,
            vec![
                Bridge {
                    name: "nlbtest0".into(),
                    nf_call_iptables: false,
                    nf_call_ip6tables: true,
                    prefixes: vec![],
                    ports: vec![
                        port("eno1", false, true),
                        port("veth1", false, false),
                        port("veth2", true, false)
                    ],
                },
                Bridge { name: "nlbtest1".into(), ..Default::default() },
            ]
        );
    }

    #[test]
    fn no_br_netfilter_no_bridges_and_bad_values() {
        let sys = tempfile::tempdir().unwrap();
        let proc_sys = tempfile::tempdir().unwrap();
        let r = BridgeReader::with_roots(sys.path(), proc_sys.path());
        assert_eq!(r.read().unwrap(), BridgeFacts::default());
        write(proc_sys.path(), "net/bridge/bridge-nf-call-iptables", "yes\n");
        let e = r.read().unwrap_err().to_string();
        assert!(e.contains("bridge-nf-call-iptables") && e.contains("yes"), "{e}");
    }
}
