//! The ruleset: [`plan`] turns a decision into [`ir`] (tables, chains, sets, maps, their stable
//! names, and the diff between two), [`hairpin`] (hairpin masquerade), [`hostfw`] (the host
//! firewall diagnosis), [`kernel_support`] (what the kernel must have). Test oracles (feature
//! `testing`): [`simulate`] (the planner's model of the kernel), [`trace`] (the packet tracer).

pub mod hairpin;
pub mod hostfw;
pub mod ir;
pub mod kernel_support;
pub mod plan;
#[cfg(any(test, feature = "testing"))]
pub mod simulate;
#[cfg(any(test, feature = "testing"))]
pub mod trace;
