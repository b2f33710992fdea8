//! What a sync reports: [`counters`] (per-Service-port traffic counters across table
//! replaces), [`report`] (each Service's state, per port).

pub mod counters;
pub mod report;
