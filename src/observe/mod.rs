//! Observe: what the agent reads of the world. The desired state's sources (the manifests
//! directory, watched with inotify; the Kubernetes source is `crate::k8s`), the state file, and
//! the node's own facts (addresses, listening sockets, bridges, forwarding sysctls).

pub mod bounded;
pub mod bridge;
pub(crate) mod debounce;
pub mod dir_watch;
pub mod fingerprint;
pub mod hostaddrs;
pub mod listeners;
pub mod manifest_dir;
pub mod source;
pub mod state;
pub mod sysctl;
