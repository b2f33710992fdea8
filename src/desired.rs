//! From a snapshot of the desired state (Services + EndpointSlices) to everything the node should
//! do: validated services, port allocations, the ruleset, and a status line per Service. Pure: the
//! agent loop feeds it and applies the result.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::alloc::{self, AllocProblem, Allocations, PortRange};
use crate::ir::{Family, Ruleset};
use crate::metrics::{CounterIndex, CounterKind, SeriesKey};
use crate::model::{self, LbService, ModelOptions, Refusal, ServiceKey};
use crate::plan::{self, NodeFacts, ServicePlan};
use crate::status::{PortStatus, ServiceState, ServiceStatus};

/// Everything computed from one snapshot.
#[derive(Debug, Clone)]
pub struct Desired {
    pub ruleset: Ruleset,
    pub allocations: Allocations,
    pub services: Vec<ServiceStatus>,
    /// Families the valid Services ask for.
    pub needed_families: BTreeSet<Family>,
    pub refusals: Vec<Refusal>,
    pub alloc_problems: Vec<AllocProblem>,
    /// Which counter feeds which per-Service-port series, and which Service ports exist (for
    /// `/metrics`); empty when computed without it ([`compute_with`]).
    pub counter_index: CounterIndex,
    /// Non-fatal input problems (e.g. a bad endpoint address skipped).
    pub warnings: Vec<String>,
}

/// Where the node ports come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationMode {
    /// Manifests mode: this agent allocates (keeping `previous`, the state file).
    Allocate,
    /// Kubernetes mode: the allocation written on each Service by the leader
    /// (`nodelb.io/allocated-ports`), duplicates settled (older Service keeps the port); this
    /// agent never computes one itself, so every node agrees.
    Annotated,
}

/// `S` / `E`: the objects owned or shared (`Arc`, as the sources hold them).
pub struct Inputs<'a, S = Service, E = EndpointSlice> {
    pub mode: AllocationMode,
    pub services: &'a [S],
    pub slices: &'a [E],
    pub previous: &'a Allocations,
    pub range: &'a PortRange,
    pub model: &'a ModelOptions,
    pub node: &'a NodeFacts,
}

pub fn compute<S: Borrow<Service>, E: Borrow<EndpointSlice>>(inputs: &Inputs<'_, S, E>) -> Desired {
    compute_with(inputs, true)
}

/// [`compute`]; `counter_index: false` leaves [`Desired::counter_index`] empty (per-Service
/// metrics off: at 10,000 Services the index is tens of thousands of chain names).
pub fn compute_with<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    inputs: &Inputs<'_, S, E>,
    counter_index: bool,
) -> Desired {
    let out = model::build(inputs.services, inputs.slices, inputs.model);
    let (allocations, alloc_problems, duplicates) = match inputs.mode {
        AllocationMode::Allocate => {
            let result = alloc::allocate(inputs.range, &out.services, inputs.previous);
            let mut allocations = result.allocations;
            keep_refused_allocations(&mut allocations, inputs.previous, &out.refused);
            (allocations, result.problems, vec![])
        }
        AllocationMode::Annotated => {
            let (allocations, duplicates) = crate::k8s::dupes::settle(&out.services);
            (allocations, vec![], duplicates)
        }
    };
    let no_allocation = match inputs.mode {
        AllocationMode::Allocate => "no node port could be allocated".to_string(),
        AllocationMode::Annotated => {
            format!(
                "no node port on the Service yet ({} is written by the leader)",
                model::ANNOTATION_ALLOCATED
            )
        }
    };

    let empty = BTreeMap::new();
    let plans: Vec<ServicePlan<'_>> = out
        .services
        .iter()
        .map(|s| ServicePlan { service: s, node_ports: allocations.get(&s.key).unwrap_or(&empty) })
        .collect();
    let ruleset = plan::plan(&plans, inputs.node);

    let mut services: Vec<ServiceStatus> = out
        .services
        .iter()
        .map(|s| {
            let ports = allocations.get(&s.key).unwrap_or(&empty);
            service_status(s, ports, &alloc_problems, inputs.node, &no_allocation)
        })
        .collect();
    for r in &out.refused {
        services.push(ServiceStatus {
            namespace: r.service().namespace.clone(),
            name: r.service().name.clone(),
            state: ServiceState::Refused,
            reason_code: Some(r.code().to_string()),
            reason: Some(r.to_string()),
            ports: vec![],
            session_affinity_seconds: None,
        });
    }
    services.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let counter_index =
        if counter_index { self::counter_index(&out.services, &ruleset) } else { CounterIndex::default() };
    let needed_families = out.services.iter().flat_map(|s| s.families.iter().copied()).collect();
    Desired {
        ruleset,
        needed_families,
        counter_index,
        allocations,
        services,
        refusals: out.refused,
        alloc_problems,
        warnings: out
            .warnings
            .iter()
            .map(|w| w.to_string())
            .chain(duplicates.iter().map(|d| format!("duplicate {d}")))
            .collect(),
    }
}

/// A Service refused for bad input keeps its ports (when nobody else took them meanwhile), so
/// fixing the input brings it back on the same ports instead of new ones.
fn keep_refused_allocations(allocations: &mut Allocations, previous: &Allocations, refused: &[Refusal]) {
    let used: BTreeSet<u16> = allocations.values().flat_map(|p| p.values().copied()).collect();
    let refused_keys: BTreeSet<&ServiceKey> = refused.iter().map(|r| r.service()).collect();
    for key in refused_keys {
        if allocations.contains_key(key) {
            continue;
        }
        if let Some(ports) = previous.get(key)
            && ports.values().all(|p| !used.contains(p))
        {
            allocations.insert(key.clone(), ports.clone());
        }
    }
}

fn service_status(
    svc: &LbService,
    node_ports: &BTreeMap<model::PortId, u16>,
    problems: &[AllocProblem],
    node: &NodeFacts,
    no_allocation: &str,
) -> ServiceStatus {
    // Kept (in /status) until the next sync: no spare capacity.
    let mut ports = Vec::with_capacity(svc.ports.len());
    let mut any_endpoints = false;
    let mut any_allocated = false;
    for port in &svc.ports {
        let node_port = node_ports.get(&port.id).copied();
        any_allocated |= node_port.is_some();
        let endpoints: usize = svc
            .families
            .iter()
            .filter(|f| node.families.contains(f))
            .map(|&f| plan::usable_endpoints(svc, port, f, &node.node_name).len())
            .sum();
        any_endpoints |= endpoints > 0 && node_port.is_some();
        let problem =
            problems.iter().find(|p| p.service() == &svc.key && p.port() == port.id).map(|p| p.to_string());
        ports.push(PortStatus {
            port: port.id.port,
            protocol: port.id.protocol.k8s_name().to_string(),
            node_port,
            endpoints,
            problem,
        });
    }
    let served: Vec<Family> = svc.families.iter().copied().filter(|f| node.families.contains(f)).collect();
    let (state, reason_code, reason) = if !any_allocated {
        (ServiceState::Refused, Some("no_allocation"), Some(no_allocation.to_string()))
    } else if served.is_empty() {
        let fams: Vec<&str> = svc.families.iter().map(|f| f.name()).collect();
        let reason = format!("forwarding is off on this node for its families ({})", fams.join(", "));
        (ServiceState::Refused, Some("forwarding_off"), Some(reason))
    } else if any_endpoints {
        (ServiceState::Programmed, None, None)
    } else {
        let reason = "no ready endpoint usable on this node".to_string();
        (ServiceState::NoEndpoints, Some("no_endpoints"), Some(reason))
    };
    ServiceStatus {
        namespace: svc.key.namespace.clone(),
        name: svc.key.name.clone(),
        state,
        reason_code: reason_code.map(String::from),
        reason,
        ports,
        session_affinity_seconds: svc.session_affinity,
    }
}

/// The named counters of each served Service port that the ruleset contains, and every Service
/// port (whose series outlive its counters: a port that lost its node port has none).
fn counter_index(services: &[LbService], ruleset: &Ruleset) -> CounterIndex {
    let mut index = CounterIndex::default();
    for svc in services {
        for port in &svc.ports {
            let key = SeriesKey { service: svc.key.clone(), port: port.id };
            // The planner names counters only for the Service's own families.
            for &f in &svc.families {
                for (counter, kind) in [
                    (plan::connections_counter(f, svc, port), CounterKind::Connections),
                    (plan::forwarded_counter(f, svc, port), CounterKind::Traffic),
                    (plan::refused_counter(f, svc, port), CounterKind::Refused),
                ] {
                    if ruleset.counters.contains_key(&counter) {
                        index.counters.insert(counter, (key.clone(), kind));
                    }
                }
            }
            index.ports.insert(key);
        }
    }
    index
}
