//! nodelb's pure core: no I/O, no clock but the one it is given, no async. Everything here is a
//! function of its arguments, tested table-driven; the agent (the `nodelb` crate) does the I/O
//! around it. The crate's dependencies are plain data and parsing only, so the compiler keeps it
//! that way (docs/design.md, "Module map").
//!
//! - The shared words: [`domain`].
//! - What the inputs mean: [`model`] (a Service and its EndpointSlices, validated), [`slim`]
//!   (the fields kept), [`compact`] (the objects' own compact forms), [`manifests`] (YAML/JSON text), [`k8s`] (Kubernetes mode's decisions).
//! - What to program: [`pool`] (node port pools), [`port_policy`], [`alloc`], [`endpoint_policy`],
//!   [`desired`] (one sync's decision), [`plan`] → [`ir`] (the ruleset), [`hairpin`], [`hostfw`]
//!   (the host firewall diagnosis), [`kernel_support`] (what the kernel must have).
//! - Only what changed, between syncs: [`model_cache`] (each Service's model), [`replan`] (the
//!   ruleset patched per Service), [`per_object`] (values kept per unchanged object), [`view`]
//!   (what changed in a source's view, by object).
//! - What to report: [`counters`], [`report`].
//! - Test oracles (feature `testing`): [`simulate`], [`trace`].

pub mod alloc;
pub mod compact;
pub mod counters;
pub mod desired;
pub mod domain;
pub mod endpoint_policy;
pub mod hairpin;
pub mod hostfw;
pub mod ir;
pub mod k8s;
pub mod kernel_support;
pub mod manifests;
pub mod model;
pub mod model_cache;
pub mod per_object;
pub mod plan;
pub mod pool;
pub mod port_policy;
pub mod replan;
pub mod report;
pub mod servicelb;
#[cfg(any(test, feature = "testing"))]
pub mod simulate;
pub mod slim;
#[cfg(any(test, feature = "testing"))]
pub mod trace;
pub mod view;
