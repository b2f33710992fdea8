//! The words every stage shares: address family, transport protocol, the identity of a Service
//! and of one of its ports, with their spellings (as annotations, the state file and nft write
//! them) and how they parse; and the stable hash behind generated names and fingerprints. No
//! stage owns them, so none depends on another's vocabulary to speak of a Service port.

use arcstr::ArcStr;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// Address family of a packet (`meta nfproto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    pub fn of(addr: &IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::Ipv4,
            IpAddr::V6(_) => Family::Ipv6,
        }
    }

    /// `ipv4` / `ipv6`, as nft writes it and as set names use it.
    pub fn name(self) -> &'static str {
        match self {
            Family::Ipv4 => "ipv4",
            Family::Ipv6 => "ipv6",
        }
    }

    /// `ip` / `ip6`: the protocol word of this family's header fields (`ip saddr`).
    pub fn payload_word(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }

    /// NFPROTO_* value.
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Ipv4 => 2,
            Family::Ipv6 => 10,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Transport protocol of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// IPPROTO_* value.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// Lower-case name as nft writes it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// Kubernetes spelling (`TCP`).
    pub fn k8s_name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.k8s_name())
    }
}

/// `namespace/name` of a Service. Both parts are shared, not copied: a key is cloned into every
/// structure that names its Service (the counter index three times per port, the allocations,
/// the status lines, the leader's registry), and copies would add up with every Service.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct ServiceKey {
    pub namespace: ArcStr,
    pub name: ArcStr,
}

impl fmt::Display for ServiceKey {
    /// `namespace/name`. A part longer than any Kubernetes name (253 bytes: only an invalid,
    /// refused manifest has one) is cut as [`quoted`] cuts values, so that a message naming the
    /// Service stays short; a valid key (DNS labels, 63 bytes) is always written whole.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let part =
            |s: &str| if s.len() > MAX_NAME { cut(s, MAX_NAME).to_string() + "…" } else { s.to_string() };
        write!(f, "{}/{}", part(&self.namespace), part(&self.name))
    }
}

/// Which objects a pass decides again: every one, or only these keys (those that changed, and
/// those tied to them). Each incremental step takes one, so a whole pass and a scoped pass are the
/// same function: what a scoped pass leaves out keeps what the last pass decided for it.
#[derive(Debug)]
pub enum Scope<'a, K = ServiceKey> {
    All,
    Keys(&'a foldhash::HashSet<K>),
}

impl<K> Clone for Scope<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Scope<'_, K> {}

impl<'a, K: Eq + std::hash::Hash> Scope<'a, K> {
    /// `None`: every object.
    pub fn of(keys: Option<&'a foldhash::HashSet<K>>) -> Self {
        keys.map_or(Scope::All, Scope::Keys)
    }
}

impl ServiceKey {
    /// This Service as a message about `viewer` names it: `Service namespace/name` when both are
    /// in one namespace, else only that it is a Service of another namespace. Whatever is
    /// recorded on a Service (its conditions, its Events) is read by that namespace's users,
    /// who must not learn the names of other namespaces' Services.
    pub fn named_for<'a>(&'a self, viewer: &'a ServiceKey) -> NamedFor<'a> {
        NamedFor { key: self, viewer }
    }
}

/// [`ServiceKey::named_for`].
pub struct NamedFor<'a> {
    key: &'a ServiceKey,
    viewer: &'a ServiceKey,
}

impl fmt::Display for NamedFor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.key.namespace == self.viewer.namespace {
            true => write!(f, "Service {}", self.key),
            false => f.write_str("a Service of another namespace"),
        }
    }
}

/// Longest name of any Kubernetes object (a DNS-1123 subdomain).
const MAX_NAME: usize = 253;

/// Longest part of a value a message quotes. A refusal goes into a status line, a log line, a
/// condition (the API server allows 32 KiB) and an Event (1 KiB); an annotation may hold 256 KiB.
pub const MAX_QUOTED: usize = 200;

/// `value` as `{value:?}` writes it, cut after [`MAX_QUOTED`] bytes (at a character boundary)
/// with its full length: `"80/TCP=20080,80/TCP=2008…" (300000 bytes)`.
pub fn quoted(value: &str) -> String {
    if value.len() <= MAX_QUOTED {
        return format!("{value:?}");
    }
    format!("{:?}… ({} bytes)", cut(value, MAX_QUOTED), value.len())
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn cut(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Identity of one service port: its `port` number and protocol (`80/TCP`). Unique within a
/// Service by Kubernetes validation, and the key of allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct PortId {
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.port, self.protocol)
    }
}

impl ServiceKey {
    pub fn new(namespace: impl Into<ArcStr>, name: impl Into<ArcStr>) -> ServiceKey {
        ServiceKey { namespace: namespace.into(), name: name.into() }
    }
}

impl PortId {
    pub fn tcp(port: u16) -> PortId {
        PortId { port, protocol: Protocol::Tcp }
    }

    pub fn udp(port: u16) -> PortId {
        PortId { port, protocol: Protocol::Udp }
    }
}

/// A value that does not parse as a [`ServiceKey`], [`PortId`] or [`Protocol`]; the message says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

/// Longest DNS-1123 label (RFC 1123), the limit of a namespace and of a Service name.
pub const MAX_LABEL: usize = 63;

/// Checks a DNS-1123 label, what Kubernetes requires of a namespace (a Service name must even be
/// a DNS-1035 label, which also forbids a leading digit; we accept that superset, it is harmless
/// to us): 1–63 characters, lowercase ASCII letters, digits and `-`, starting and ending with a
/// letter or digit. The error says what is wrong, for a message that also names the value.
pub fn check_dns_label(s: &str) -> Result<(), String> {
    let rule =
        "a DNS-1123 label: 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit";
    if s.is_empty() {
        return Err(format!("is empty; must be {rule}"));
    }
    if s.len() > MAX_LABEL {
        return Err(format!("is {} bytes long; must be {rule}", s.len()));
    }
    if let Some(c) = s.chars().find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')) {
        return Err(format!("contains {c:?}; must be {rule}"));
    }
    if s.starts_with('-') || s.ends_with('-') {
        return Err(format!("starts or ends with '-'; must be {rule}"));
    }
    Ok(())
}

impl FromStr for ServiceKey {
    type Err = ParseError;

    /// `namespace/name`, each a DNS-1123 label (exactly what the model accepts of a Service).
    fn from_str(s: &str) -> Result<Self, ParseError> {
        let Some((ns, name)) = s.split_once('/') else {
            return Err(ParseError(format!("{} is not namespace/name", quoted(s))));
        };
        check_dns_label(ns).map_err(|e| ParseError(format!("namespace {} {e}", quoted(ns))))?;
        check_dns_label(name).map_err(|e| ParseError(format!("name {} {e}", quoted(name))))?;
        Ok(ServiceKey::new(ns, name))
    }
}

/// Parses a protocol the way annotations write it: `TCP`, `udp`, … (case-insensitive).
pub fn parse_protocol(s: &str) -> Result<Protocol, ParseError> {
    match s.to_ascii_uppercase().as_str() {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        _ => Err(ParseError(format!("unknown protocol {} (want TCP, UDP or SCTP)", quoted(s)))),
    }
}

/// Parses a port number 1–65535.
pub fn parse_port_number(s: &str) -> Result<u16, ParseError> {
    match s.trim().parse::<u32>() {
        Ok(n) if (1..=65535).contains(&n) => Ok(n as u16),
        Ok(n) => Err(ParseError(format!("port {n} is out of range 1-65535"))),
        Err(_) => Err(ParseError(format!("{} is not a port number", quoted(s.trim())))),
    }
}

impl FromStr for PortId {
    type Err = ParseError;

    /// `80/TCP` (protocol case-insensitive).
    fn from_str(s: &str) -> Result<Self, ParseError> {
        let (port, proto) =
            s.split_once('/').ok_or_else(|| ParseError(format!("{} is not PORT/PROTOCOL", quoted(s))))?;
        Ok(PortId { port: parse_port_number(port)?, protocol: parse_protocol(proto.trim())? })
    }
}

/// FNV-1a, 64 bit: stable across runs and versions (unlike `DefaultHasher`).
pub fn fnv1a(data: &[u8]) -> u64 {
    fnv1a_extend(FNV1A_OFFSET, data)
}

/// FNV-1a's initial state.
pub const FNV1A_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a state `h` after `data`: `fnv1a_extend(fnv1a(a), b) == fnv1a(a ++ b)`, so a key can be
/// hashed in parts without building it.
pub fn fnv1a_extend(mut h: u64, data: &[u8]) -> u64 {
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Who holds a node port number in the registry (`k8s::claims`): the first 12 hex digits of
/// the Service's uid (48 bits: enough that two Services of one cluster sharing them is not to
/// be expected).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Owner(pub String);

impl Owner {
    pub fn of_uid(uid: &str) -> Owner {
        // Bytes, not chars: a byte of a multi-byte character is never an ASCII hex digit.
        let hex = uid.bytes().filter(u8::is_ascii_hexdigit).take(12);
        Owner(hex.map(|b| char::from(b.to_ascii_lowercase())).collect())
    }

    /// The owner of the Service `key` with `uid` (a Service without one, which the API server
    /// never stores, is named by a hash of its namespace/name).
    pub fn of(key: &ServiceKey, uid: Option<&str>) -> Owner {
        match uid {
            Some(uid) if !uid.is_empty() => Owner::of_uid(uid),
            _ => {
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for b in key.to_string().bytes() {
                    h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                }
                Owner(format!("{:012x}", h & 0xffff_ffff_ffff))
            }
        }
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_is_named_only_to_its_own_namespace() {
        let (a, b, c) = (
            ServiceKey::new("team-a", "web"),
            ServiceKey::new("team-a", "db"),
            ServiceKey::new("team-b", "x"),
        );
        assert_eq!(b.named_for(&a).to_string(), "Service team-a/db");
        assert_eq!(c.named_for(&a).to_string(), "a Service of another namespace");
    }
}
