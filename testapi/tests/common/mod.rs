#![allow(dead_code)]

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kube::config::{KubeConfigOptions, Kubeconfig};
use nodelb_testapi::TestApiServer;
use serde_json::json;

pub fn server() -> TestApiServer {
    TestApiServer::start("127.0.0.1:0".parse().unwrap()).expect("start test API server")
}

pub async fn client(srv: &TestApiServer) -> kube::Client {
    let kc = Kubeconfig::from_yaml(&srv.kubeconfig_yaml()).expect("kubeconfig parses");
    let config =
        kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("config");
    kube::Client::try_from(config).expect("client")
}

pub fn lb_service(name: &str) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": {"type": "LoadBalancer", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
                 "selector": {"app": name}},
    }))
    .unwrap()
}

/// Poll `f` until it returns true (or panic after `secs`).
pub async fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
