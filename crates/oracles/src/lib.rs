//! Test oracles over nodelb's ruleset, for the tests, the fuzz targets and the agent's fake
//! kernel; never part of the shipped binary: [`simulate`] (the planner's model of the kernel:
//! a batch applied the way nf_tables takes it) and [`trace`] (one packet followed through the
//! table the way the kernel would).

pub mod simulate;
pub mod trace;
