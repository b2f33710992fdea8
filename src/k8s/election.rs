//! Leader election among the controller's replicas, on Lease `nodelb-leader`
//! ([`crate::core::k8s::leader`] decides; every write is a replace carrying the resourceVersion read, so a
//! 409 means someone else won). Released on shutdown, so a successor takes over at its next poll.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client};
use tracing::{debug, info, warn};

use crate::serve::metrics::ControllerMetrics;

use super::api::{Failing, is_conflict, post_params};
use crate::core::k8s::leader::{self, Decision, LeaseRecord, Observed};

/// Who competes, where, for how long.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// This replica's holder identity (its pod name).
    pub identity: String,
    /// nodelb's namespace, where the Lease lives.
    pub namespace: String,
    pub lease_duration: Duration,
}

/// Name of the leader-election Lease in the agent namespace.
pub const LEADER_LEASE: &str = "nodelb-leader";

/// Whether this replica currently leads (read by the metrics and the allocator).
#[derive(Debug, Default)]
pub struct Leadership(AtomicBool);

impl Leadership {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

fn record_of(lease: &Lease) -> LeaseRecord {
    let spec = lease.spec.clone().unwrap_or_default();
    LeaseRecord {
        holder: spec.holder_identity,
        duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64),
        transitions: spec.lease_transitions.unwrap_or(0),
        resource_version: lease.metadata.resource_version.clone(),
    }
}

pub async fn elect(
    client: Client,
    cfg: ElectionConfig,
    leadership: Arc<Leadership>,
    metrics: Arc<ControllerMetrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let me = cfg.identity.clone();
    let retry = (cfg.lease_duration / 3).max(Duration::from_millis(500));
    let secs = cfg.lease_duration.as_secs().max(1) as i32;
    let mut observed: Option<Observed> = None;
    let mut last_renew: Option<Instant> = None;
    let mut failing = Failing::new(
        "leader election: cannot reach the API (Lease nodelb-leader)",
        metrics.kube.api_errors.with_label_values(&["lease"]),
    );
    loop {
        if *stop.borrow() {
            if leadership.get() {
                leadership.0.store(false, Ordering::Release);
                metrics.leader.set(0);
                metrics.leader_transitions.inc();
            }
            if last_renew.is_some() && observed.as_ref().is_some_and(|o| held_by(o, &me)) {
                release(&api, &me).await;
            }
            return;
        }
        let now = Instant::now();
        let mut sleep_until = now + retry;
        match api.get_opt(LEADER_LEASE).await {
            Err(e) => failing.failed(&e),
            Ok(current) => {
                failing.ok();
                let obs = leader::observe(observed.as_ref(), current.as_ref().map(record_of), now);
                let started = Instant::now();
                let stamp = Some(MicroTime(Timestamp::now()));
                let result = match leader::decide(&me, &obs, last_renew, now) {
                    Decision::Wait(t) => {
                        sleep_until = t.min(sleep_until);
                        None
                    }
                    Decision::Create => {
                        let lease = Lease {
                            metadata: ObjectMeta { name: Some(LEADER_LEASE.into()), ..Default::default() },
                            spec: Some(LeaseSpec {
                                holder_identity: Some(me.clone()),
                                lease_duration_seconds: Some(secs),
                                acquire_time: stamp.clone(),
                                renew_time: stamp,
                                lease_transitions: Some(0),
                                ..Default::default()
                            }),
                        };
                        Some(api.create(&post_params(), &lease).await)
                    }
                    d @ (Decision::Acquire | Decision::Renew) => {
                        // `current` is Some here; its resourceVersion is the precondition.
                        let mut lease = current.clone().unwrap_or_default();
                        let spec = lease.spec.get_or_insert_default();
                        if d == Decision::Acquire {
                            spec.holder_identity = Some(me.clone());
                            spec.acquire_time = stamp.clone();
                            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                        }
                        spec.lease_duration_seconds = Some(secs);
                        spec.renew_time = stamp;
                        Some(api.replace(LEADER_LEASE, &post_params(), &lease).await)
                    }
                };
                observed = Some(match result {
                    None => obs,
                    Some(Ok(lease)) => {
                        last_renew = Some(started);
                        sleep_until = Instant::now() + retry;
                        leader::observe(None, Some(record_of(&lease)), Instant::now())
                    }
                    Some(Err(e)) => {
                        if is_conflict(&e) {
                            debug!("leader election: Lease changed under us (409); re-reading");
                        } else {
                            failing.failed(&e);
                        }
                        sleep_until = Instant::now() + Duration::from_millis(200).min(retry);
                        obs
                    }
                });
            }
        }
        let leading =
            observed.as_ref().is_some_and(|o| leader::is_leader(&me, o, last_renew, Instant::now()));
        if leading != leadership.get() {
            leadership.0.store(leading, Ordering::Release);
            metrics.leader.set(i64::from(leading));
            metrics.leader_transitions.inc();
            if leading {
                info!(
                    lease = LEADER_LEASE,
                    "became leader: allocating node ports and writing Service status"
                );
            } else {
                warn!(lease = LEADER_LEASE, "no longer leader");
            }
        }
        // Wake in time to notice the renew deadline passing.
        let deadline = last_renew.map(|t| t + cfg.lease_duration * 2 / 3).filter(|_| leading);
        let wake = deadline
            .map_or(sleep_until, |d| d.min(sleep_until))
            .max(Instant::now() + Duration::from_millis(50));
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = stop.changed() => {}
        }
    }
}

fn held_by(o: &Observed, me: &str) -> bool {
    o.record.as_ref().and_then(|r| r.holder.as_deref()) == Some(me)
}

/// Clears the holder of the leader Lease if it is still ours (resourceVersion precondition: never
/// releases a Lease someone else took meanwhile), like client-go's `ReleaseOnCancel`.
async fn release(api: &Api<Lease>, me: &str) {
    let result = async {
        let Some(mut lease) = api.get_opt(LEADER_LEASE).await? else { return Ok(false) };
        let spec = lease.spec.get_or_insert_default();
        if spec.holder_identity.as_deref() != Some(me) {
            return Ok(false);
        }
        let now = Some(MicroTime(Timestamp::now()));
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = now.clone();
        spec.acquire_time = now;
        api.replace(LEADER_LEASE, &post_params(), &lease).await.map(|_| true)
    }
    .await;
    match result {
        Ok(true) => info!(lease = LEADER_LEASE, "released the leader Lease (shutting down)"),
        Ok(false) => {}
        Err(e) => warn!(error = %e, "could not release the leader Lease; it will expire instead"),
    }
}
