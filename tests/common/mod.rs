//! Shared support for integration tests (each test binary includes it with `mod common;`).
#![allow(dead_code)]

pub mod agent;
pub mod args;
pub mod cleanup;
pub mod cluster;
pub mod invariants;
pub mod kube;
pub mod manifest;
pub mod netns;
pub mod real_node;
pub mod rng;
pub mod scenarios;
pub mod topology;
