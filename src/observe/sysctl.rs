//! The forwarding sysctls (`net.ipv4.ip_forward`, `net.ipv6.conf.all.forwarding`) of the network
//! namespace the agent runs in: read them, and switch them on when the operator allows it.
//! A family whose forwarding is off is not programmed (forwarded DNAT traffic would be dropped by
//! the kernel anyway, and silently).

use std::path::PathBuf;

use crate::core::domain::Family;

#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    #[error("cannot read sysctl {name} ({path}): {source}")]
    Read { name: &'static str, path: PathBuf, source: std::io::Error },
    #[error("cannot write sysctl {name}=1 ({path}): {source}")]
    Write { name: &'static str, path: PathBuf, source: std::io::Error },
    #[error("sysctl {name} has unexpected value {value:?} (want 0 or 1)")]
    Value { name: &'static str, value: String },
}

/// The sysctl that controls forwarding for a family, by its `sysctl` name.
pub fn forwarding_sysctl(f: Family) -> &'static str {
    match f {
        Family::Ipv4 => "net.ipv4.ip_forward",
        Family::Ipv6 => "net.ipv6.conf.all.forwarding",
    }
}

/// Reads and writes the sysctls under a `/proc/sys` root (tests point it at a temp dir).
#[derive(Debug, Clone)]
pub struct Sysctls {
    root: PathBuf,
}

impl Default for Sysctls {
    fn default() -> Self {
        Sysctls { root: PathBuf::from("/proc/sys") }
    }
}

impl Sysctls {
    pub fn with_root(root: impl Into<PathBuf>) -> Sysctls {
        Sysctls { root: root.into() }
    }

    fn path(&self, f: Family) -> PathBuf {
        self.root.join(forwarding_sysctl(f).replace('.', "/"))
    }

    /// Whether forwarding is on. A missing IPv6 tree (IPv6 disabled in the kernel) is "off".
    pub fn forwarding(&self, f: Family) -> Result<bool, SysctlError> {
        let path = self.path(f);
        let name = forwarding_sysctl(f);
        match std::fs::read_to_string(&path) {
            Ok(v) => match v.trim() {
                "0" => Ok(false),
                "1" => Ok(true),
                other => Err(SysctlError::Value { name, value: other.to_string() }),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && f == Family::Ipv6 => Ok(false),
            Err(source) => Err(SysctlError::Read { name, path, source }),
        }
    }

    /// Turns forwarding on (`--enable-forwarding`).
    pub fn enable_forwarding(&self, f: Family) -> Result<(), SysctlError> {
        let path = self.path(f);
        std::fs::write(&path, "1\n").map_err(|source| SysctlError::Write {
            name: forwarding_sysctl(f),
            path,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_writes_and_rejects_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let s = Sysctls::with_root(dir.path());
        std::fs::create_dir_all(dir.path().join("net/ipv4")).unwrap();
        std::fs::write(dir.path().join("net/ipv4/ip_forward"), "0\n").unwrap();
        assert!(!s.forwarding(Family::Ipv4).unwrap());
        // No IPv6 tree at all: IPv6 off, not an error.
        assert!(!s.forwarding(Family::Ipv6).unwrap());
        s.enable_forwarding(Family::Ipv4).unwrap();
        assert!(s.forwarding(Family::Ipv4).unwrap());
        std::fs::write(dir.path().join("net/ipv4/ip_forward"), "yes\n").unwrap();
        let err = s.forwarding(Family::Ipv4).unwrap_err().to_string();
        assert!(err.contains("net.ipv4.ip_forward") && err.contains("yes"), "{err}");
    }
}
