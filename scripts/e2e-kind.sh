#!/usr/bin/env bash
# End to end on a real cluster (kind or k3d), for users who have one. It cannot run in this project's
# CI (no container engine, no cluster); it is kept correct by reading it against daemonset/. The
# same user path runs in CI on real kubelets and containerd without a container engine:
# tests/real_nodes.rs (docs/testing.md, "Real nodes"), which also checks the pods' confinement,
# rolling updates, a drain, a node leaving and Helm.
#
#   scripts/e2e-kind.sh            # kind: creates cluster "nodelb-e2e", deletes it at the end
#   E2E_TOOL=k3d scripts/e2e-kind.sh
#   E2E_KEEP=1 scripts/e2e-kind.sh # keep the cluster for inspection
#
# Steps: build the image under the name daemonset/20-daemonset.yaml uses (the local docker keeps
# that tag), load it into the cluster (imagePullPolicy IfNotPresent then uses it, nothing is
# pulled), `kubectl apply -f daemonset/` exactly as the README says, create a Deployment + type:
# LoadBalancer Service, wait for the allocation annotation and the status, curl
# <node-ip>:<allocated-port> from inside the node container, scrape /metrics (on the node's
# loopback, and from the host over TLS with a scraper ServiceAccount's token), clean up.
# Needs: docker, kubectl, kind (or k3d). With k3d, ServiceLB (klipper-lb) is disabled for the
# cluster (--disable=servicelb) so the two do not fight over the same Services.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOL=${E2E_TOOL:-kind}
CLUSTER=${E2E_CLUSTER:-nodelb-e2e}
# The image the manifest names (and its pull policy, which must let a loaded image be used).
IMAGE=$(awk '$1 == "image:" {print $2; exit}' daemonset/20-daemonset.yaml)
PULL=$(awk '$1 == "imagePullPolicy:" {print $2; exit}' daemonset/20-daemonset.yaml)
NS=nodelb-e2e
log() { printf '\n==> %s\n' "$*" >&2; }
# HTTP GET from inside the node container (kind nodes have curl; k3s images may only have wget).
node_get() {
    docker exec "$NODE_CONTAINER" sh -c \
        "curl -fsS --max-time 3 '$1' 2>/dev/null || wget -q -T 3 -O - '$1'"
}
die() { echo "e2e: $*" >&2; exit 1; }

for cmd in docker kubectl "$TOOL"; do
    command -v "$cmd" >/dev/null || die "$cmd is required"
done
[[ -n $IMAGE ]] || die "no image: in daemonset/20-daemonset.yaml"
[[ $PULL == IfNotPresent || $PULL == Never ]] ||
    die "imagePullPolicy $PULL in daemonset/20-daemonset.yaml would pull $IMAGE instead of using the loaded one"

cleanup() {
    local rc=$?
    if [[ ${E2E_KEEP:-0} == 1 ]]; then
        log "keeping cluster $CLUSTER (E2E_KEEP=1)"
    else
        log "deleting cluster $CLUSTER"
        if [[ $TOOL == kind ]]; then kind delete cluster --name "$CLUSTER" || true
        else k3d cluster delete "$CLUSTER" || true; fi
    fi
    exit $rc
}
trap cleanup EXIT INT TERM

log "creating cluster $CLUSTER with $TOOL"
if [[ $TOOL == kind ]]; then
    kind create cluster --name "$CLUSTER" --wait 120s
    NODE_CONTAINER="$CLUSTER-control-plane"
else
    k3d cluster create "$CLUSTER" --k3s-arg '--disable=servicelb@server:0' --wait
    NODE_CONTAINER="k3d-$CLUSTER-server-0"
fi

log "building $IMAGE"
docker build --build-arg NODELB_GIT_COMMIT="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" -t "$IMAGE" .
if [[ $TOOL == kind ]]; then kind load docker-image "$IMAGE" --name "$CLUSTER"
else k3d image import "$IMAGE" -c "$CLUSTER"; fi

log "installing nodelb: kubectl apply -f daemonset/ (image $IMAGE, loaded above)"
kubectl apply -f daemonset/
kubectl -n nodelb-system rollout status daemonset/nodelb --timeout=180s
kubectl -n nodelb-system rollout status deployment/nodelb-controller --timeout=180s

log "creating a Deployment and a LoadBalancer Service"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$NS" apply -f - <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  replicas: 2
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
        - name: web
          image: registry.k8s.io/e2e-test-images/agnhost:2.47
          args: ["netexec", "--http-port=8080"]
          ports: [{name: http, containerPort: 8080}]
          readinessProbe:
            httpGet: {path: /hostname, port: http}
---
apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  type: LoadBalancer
  selector: {app: web}
  ports:
    - name: http
      port: 80
      targetPort: http
YAML
kubectl -n "$NS" rollout status deployment/web --timeout=180s

log "waiting for the allocation and the status"
port=""
for _ in $(seq 1 60); do
    alloc=$(kubectl -n "$NS" get svc web -o jsonpath='{.metadata.annotations.nodelb\.io/allocated-ports}' || true)
    ingress=$(kubectl -n "$NS" get svc web -o jsonpath='{.status.loadBalancer.ingress[*].ip}' || true)
    if [[ -n $alloc && -n $ingress ]]; then
        port=${alloc##*=}
        port=${port%%,*}
        break
    fi
    sleep 2
done
[[ -n $port ]] || die "no allocation/status on Service web: $(kubectl -n "$NS" get svc web -o yaml)"
kubectl -n "$NS" get svc web -o wide
echo "allocated: $alloc; ingress: $ingress"

log "curl <node-ip>:$port from the node"
node_ip=${ingress%% *}
seen=""
for i in $(seq 1 20); do
    body=$(node_get "http://$node_ip:$port/hostname") ||
        die "request $i to $node_ip:$port failed"
    seen+="$body"$'\n'
done
printf '%s' "$seen" | sort | uniq -c
[[ $(printf '%s' "$seen" | sort -u | wc -l) -ge 2 ]] || die "only one pod answered"

log "scraping /metrics"
metrics=$(node_get "http://127.0.0.1:9470/metrics")
grep -E '^nodelb_services\{' <<<"$metrics"
grep -q "nodelb_service_connections_total{namespace=\"$NS\",service=\"web\"" <<<"$metrics" ||
    die "no per-Service counters for $NS/web on /metrics"

log "scraping the authenticated /metrics from the host (TLS, bearer token, the real authorizer)"
kubectl apply -f daemonset/monitoring/scraper-rbac.yaml
token=$(kubectl -n nodelb-system create token nodelb-metrics-scraper)
code=$(curl -sk -o /dev/null -w '%{http_code}' --max-time 5 "https://$node_ip:9472/metrics" || true)
[[ $code == 401 ]] || die "https://$node_ip:9472/metrics without a token: HTTP $code (want 401)"
curl -fsSk --max-time 5 -H "Authorization: Bearer $token" "https://$node_ip:9472/metrics" |
    grep -q '^nodelb_build_info' || die "the scraper's token does not get /metrics"
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 3 "http://$node_ip:9470/status" || true)
[[ $code == 000 ]] || die "/status is reachable from outside the node (HTTP $code)"

log "deleting the Service: rules and allocation go"
kubectl -n "$NS" delete svc web --wait
sleep 3
if node_get "http://$node_ip:$port/hostname" >/dev/null 2>&1; then
    die "still served after the Service was deleted"
fi
log "e2e OK"
