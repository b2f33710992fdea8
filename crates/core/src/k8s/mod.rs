//! Kubernetes mode's pure decisions; the agent's `k8s` module talks to the API server around
//! them: [`round`] (the leader's round and its state), [`claims`] (the node-port registry),
//! [`publish`] (what the leader writes), [`dupes`]
//! (duplicate node ports), [`nodes`] (which nodes serve), [`pools`] (the pool context from the
//! cached objects), [`events`] (once per change), [`leader`] (the Lease election rules),
//! [`lastgood`] (the last valid spec of a Service), [`uninstall`] (uninstall or restart),
//! [`cluster_view`] (what each node reports about itself, and where each Service is served
//! across the cluster); [`snapshot`] is what they are given.

pub mod claims;
pub mod cluster_view;
pub mod dupes;
pub mod events;
pub mod lastgood;
pub mod leader;
pub mod nodes;
pub mod pools;
pub mod publish;
pub mod round;
pub mod snapshot;
pub mod uninstall;
