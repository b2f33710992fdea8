//! Builders for the manifests the agent reads: one `Service` plus one `EndpointSlice` per address
//! family, rendered as multi-document YAML.

use std::net::IpAddr;

use serde_json::{Value, json};

use super::topology::{BACKEND_TCP_PORT, BACKEND_UDP_PORT, NODE_NAME};

#[derive(Debug, Clone)]
pub struct PortSpec {
    pub name: String,
    pub port: u16,
    /// `TCP` or `UDP`.
    pub protocol: String,
    pub target_port: u16,
    /// Requested node port (`nodelb.io/ports` annotation); `None` lets the agent allocate.
    pub node_port: Option<u16>,
}

impl PortSpec {
    /// `80/TCP` → the backends' HTTP server, node port `node_port`.
    pub fn tcp(port: u16, node_port: Option<u16>) -> PortSpec {
        PortSpec {
            name: format!("tcp-{port}"),
            port,
            protocol: "TCP".into(),
            target_port: BACKEND_TCP_PORT,
            node_port,
        }
    }
    /// `53/UDP` → the backends' UDP server, node port `node_port`.
    pub fn udp(port: u16, node_port: Option<u16>) -> PortSpec {
        PortSpec {
            name: format!("udp-{port}"),
            port,
            protocol: "UDP".into(),
            target_port: BACKEND_UDP_PORT,
            node_port,
        }
    }
}

#[derive(Debug, Clone)]
pub struct EndpointSpec {
    pub addr: IpAddr,
    pub node: String,
    pub ready: bool,
    /// Terminating but still serving (graceful termination): `ready` false, `serving` true.
    pub terminating: bool,
}

impl EndpointSpec {
    /// A ready endpoint on the agent's own node.
    pub fn local(addr: impl Into<IpAddr>) -> EndpointSpec {
        EndpointSpec { addr: addr.into(), node: NODE_NAME.into(), ready: true, terminating: false }
    }
    /// A ready endpoint on another node.
    pub fn remote(addr: impl Into<IpAddr>, node: &str) -> EndpointSpec {
        EndpointSpec { addr: addr.into(), node: node.into(), ready: true, terminating: false }
    }
    pub fn not_ready(mut self) -> EndpointSpec {
        self.ready = false;
        self
    }
    /// Terminating and still serving (a Pod in its grace period).
    pub fn terminating(mut self) -> EndpointSpec {
        self.ready = false;
        self.terminating = true;
        self
    }
}

#[derive(Debug, Clone)]
pub struct ServiceSpec {
    pub namespace: String,
    pub name: String,
    pub ports: Vec<PortSpec>,
    pub source_ranges: Vec<String>,
    /// `Cluster` (default) or `Local`.
    pub traffic_policy: String,
    /// `IPv4`, `IPv6`, or both.
    pub ip_families: Vec<String>,
    pub endpoints: Vec<EndpointSpec>,
    /// Render the EndpointSlice(s) at all (false: a Service with no slice).
    pub with_slices: bool,
    /// `sessionAffinity: ClientIP` with this `timeoutSeconds` (`None`: no affinity).
    pub affinity_timeout: Option<u32>,
    /// `allocateLoadBalancerNodePorts: false` (the API server's NodePort range, 30000-32767,
    /// holds 2,768 Services; nodelb does not use those ports).
    pub no_kube_node_ports: bool,
}

impl ServiceSpec {
    /// `default/<name>`, IPv4 only, Cluster policy, no ports or endpoints yet.
    pub fn new(name: &str) -> ServiceSpec {
        ServiceSpec {
            namespace: "default".into(),
            name: name.into(),
            ports: Vec::new(),
            source_ranges: Vec::new(),
            traffic_policy: "Cluster".into(),
            ip_families: vec!["IPv4".into()],
            endpoints: Vec::new(),
            with_slices: true,
            affinity_timeout: None,
            no_kube_node_ports: false,
        }
    }
    pub fn in_namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.into();
        self
    }
    pub fn client_ip_affinity(mut self, timeout_seconds: u32) -> Self {
        self.affinity_timeout = Some(timeout_seconds);
        self
    }
    pub fn port(mut self, p: PortSpec) -> Self {
        self.ports.push(p);
        self
    }
    pub fn endpoint(mut self, e: EndpointSpec) -> Self {
        self.endpoints.push(e);
        self
    }
    pub fn endpoints(mut self, es: impl IntoIterator<Item = EndpointSpec>) -> Self {
        self.endpoints.extend(es);
        self
    }
    pub fn source_range(mut self, cidr: &str) -> Self {
        self.source_ranges.push(cidr.into());
        self
    }
    pub fn local_policy(mut self) -> Self {
        self.traffic_policy = "Local".into();
        self
    }
    pub fn dual_stack(mut self) -> Self {
        self.ip_families = vec!["IPv4".into(), "IPv6".into()];
        self
    }
    pub fn without_kube_node_ports(mut self) -> Self {
        self.no_kube_node_ports = true;
        self
    }
    pub fn ipv6_only(mut self) -> Self {
        self.ip_families = vec!["IPv6".into()];
        self
    }
    pub fn without_slices(mut self) -> Self {
        self.with_slices = false;
        self
    }

    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn service(&self) -> Value {
        let requested: Vec<String> = self
            .ports
            .iter()
            .filter_map(|p| p.node_port.map(|np| format!("{}/{}={np}", p.port, p.protocol)))
            .collect();
        let mut annotations = serde_json::Map::new();
        if !requested.is_empty() {
            annotations.insert("nodelb.io/ports".into(), Value::String(requested.join(",")));
        }
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|p| json!({"name": p.name, "port": p.port, "protocol": p.protocol, "targetPort": p.target_port}))
            .collect();
        let mut spec = json!({
            "type": "LoadBalancer",
            "selector": {"app": self.name},
            "externalTrafficPolicy": self.traffic_policy,
            "ipFamilies": self.ip_families,
            "ipFamilyPolicy": if self.ip_families.len() > 1 { "RequireDualStack" } else { "SingleStack" },
            "ports": ports,
        });
        if self.no_kube_node_ports {
            spec["allocateLoadBalancerNodePorts"] = json!(false);
        }
        if !self.source_ranges.is_empty() {
            spec["loadBalancerSourceRanges"] = json!(self.source_ranges);
        }
        if let Some(t) = self.affinity_timeout {
            spec["sessionAffinity"] = json!("ClientIP");
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
        }
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": self.name, "namespace": self.namespace, "annotations": annotations},
            "spec": spec,
        })
    }

    /// One EndpointSlice per address family that has endpoints (or an empty IPv4 one when there are
    /// none at all).
    pub fn slices(&self) -> Vec<Value> {
        if !self.with_slices {
            return Vec::new();
        }
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|p| json!({"name": p.name, "port": p.target_port, "protocol": p.protocol}))
            .collect();
        let mut out = Vec::new();
        for (ty, is_v4) in [("IPv4", true), ("IPv6", false)] {
            let eps: Vec<Value> = self
                .endpoints
                .iter()
                .filter(|e| e.addr.is_ipv4() == is_v4)
                .map(|e| {
                    json!({
                        "addresses": [e.addr.to_string()],
                        "conditions": {"ready": e.ready, "serving": e.ready || e.terminating, "terminating": e.terminating},
                        "nodeName": e.node,
                    })
                })
                .collect();
            if eps.is_empty() && !(is_v4 && self.endpoints.is_empty()) {
                continue;
            }
            out.push(json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": format!("{}-{}", self.name, ty.to_lowercase()),
                    "namespace": self.namespace,
                    "labels": {"kubernetes.io/service-name": self.name},
                },
                "addressType": ty,
                "ports": ports,
                "endpoints": eps,
            }));
        }
        out
    }

    /// The Service and its slices as one multi-document YAML string.
    pub fn render(&self) -> String {
        let mut docs = vec![self.service()];
        docs.extend(self.slices());
        render_docs(&docs)
    }
}

pub fn render_docs(docs: &[Value]) -> String {
    docs.iter().map(|d| format!("---\n{}", serde_saphyr::to_string(d).expect("yaml"))).collect()
}

/// Several services in one file.
pub fn render_all(specs: &[&ServiceSpec]) -> String {
    specs.iter().map(|s| s.render()).collect()
}
