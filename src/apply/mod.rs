//! Apply: what to send to the kernel and when. The kernel behind a trait (`kernel`, with a fake
//! for the policy's unit tests), the sync's apply step (`dataplane`), the conntrack flush, the
//! host-firewall check and its optional ACCEPT (`firewall`, `xtables` for iptables-legacy).

pub mod conntrack;
pub mod dataplane;
pub mod firewall;
pub mod kernel;
#[cfg(test)]
pub mod kernel_fake;
pub mod xtables;
