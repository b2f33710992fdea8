//! The ruleset: [`plan`] turns a decision into [`ir`] (tables, chains, sets, maps, their stable
//! names, and the diff between two), [`hairpin`] (hairpin masquerade), [`hostfw`] (the host
//! firewall diagnosis), [`kernel_support`] (what the kernel must have). The test oracles over
//! the ruleset (the planner's model of the kernel, the packet tracer) are the `nodelb-oracles`
//! crate's.

pub mod hairpin;
pub mod hostfw;
pub mod ir;
pub mod kernel_support;
pub mod plan;
