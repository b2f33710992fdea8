//! Shared support for integration tests (each test binary includes it with `mod common;`).
#![allow(dead_code)]

pub mod agent;
pub mod cluster;
pub mod kube;
pub mod manifest;
pub mod netns;
pub mod scenarios;
pub mod topology;
