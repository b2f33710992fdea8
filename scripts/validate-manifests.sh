#!/usr/bin/env bash
# Checks the Helm chart charts/nodelb and the plain manifests daemonset/ generated from it. Used by
# .ci/run. Offline except for building helm (scripts/build-helm.sh: Go modules, cached):
# - daemonset/ is exactly what scripts/generate-manifests.sh writes from the chart (one source of
#   truth: the chart);
# - `helm lint --strict` with the default values and with every optional object on;
# - daemonset/*.yaml and the chart's output with every option on, against the official
#   Kubernetes schemas (kubernetes-validate, from PyPI; --strict: unknown fields are errors);
# - the Kustomization lists exactly the manifests `kubectl apply -f daemonset/` applies, and
#   `kubectl apply -f daemonset/` works on a fresh cluster (every namespaced object comes after
#   its Namespace in the order kubectl applies them);
# - the PodMonitor selects the agent's pods and names their port; the Grafana dashboard is JSON.
# The server-side dry run (`helm template | kubectl apply --dry-run=server` against a real API
# server) is a root test: tests/chart.rs.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v kubernetes-validate >/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate 2>/dev/null ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages kubernetes-validate
fi
helm=$(scripts/build-helm.sh)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
scripts/generate-manifests.sh "$tmp/daemonset" 2>/dev/null
cp daemonset/Kustomization "$tmp/daemonset/"
if ! diff -ru daemonset "$tmp/daemonset" >"$tmp/diff"; then
    cat "$tmp/diff" >&2
    echo "daemonset/ is not what charts/nodelb renders (diff above: - is daemonset/): edit the chart, then run scripts/generate-manifests.sh" >&2
    exit 1
fi
echo "daemonset/: generated from charts/nodelb, up to date"

all_on=(--set namespace.create=true --set podMonitor.enabled=true --set grafanaDashboard.enabled=true
    --set pools.k3sTraefik.enabled=true --set prometheusRule.enabled=true --set serviceMonitor.enabled=true)
"$helm" lint --strict charts/nodelb
"$helm" lint --strict charts/nodelb "${all_on[@]}" --set 'config.endpoint-cidrs={10.0.0.0/8,192.168.0.0/16}'
# The PodMonitor (a CRD) has no official schema: rendered without it here.
"$helm" template nodelb charts/nodelb -n nodelb-system --set namespace.create=true \
    --set grafanaDashboard.enabled=true >"$tmp/chart.yaml"
kubernetes-validate --strict --quiet daemonset/*.yaml daemonset/monitoring/scraper-rbac.yaml "$tmp/chart.yaml"
echo "daemonset/*.yaml, daemonset/monitoring/scraper-rbac.yaml, the chart with every option: valid"

python3 - <<'PY'
import glob, json, os, sys
listed = []
in_resources = False
for line in open("daemonset/Kustomization"):
    s = line.strip()
    if s.startswith("resources:"):
        in_resources = True
    elif in_resources and s.startswith("- "):
        listed.append(s[2:].strip())
    elif s and not s.startswith("#"):
        in_resources = False
# What `kubectl apply -f daemonset/` applies, in its order: the directory's regular files with a
# .json/.yaml/.yml extension (no recursion without -R), in lexical file-name order (Go's
# filepath.Walk), each file's documents in order; it does not reorder objects by kind.
applied = sorted(
    f for f in os.listdir("daemonset")
    if os.path.isfile(os.path.join("daemonset", f)) and os.path.splitext(f)[1] in (".json", ".yaml", ".yml")
)
if sorted(listed) != applied:
    sys.exit(f"daemonset/Kustomization lists {sorted(listed)}, but kubectl apply -f daemonset/ applies {applied}")
json.load(open("charts/nodelb/dashboards/nodelb.json"))
import yaml
# Kinds in daemonset/ that are cluster-scoped; any other kind is namespaced.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "CustomResourceDefinition",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
# Every cluster has "default" (the node agents' Node Events go there).
namespaces = {"default"}
for f in applied:
    for i, doc in enumerate(d for d in yaml.safe_load_all(open(os.path.join("daemonset", f))) if d):
        what = f"daemonset/{f} document {i + 1} ({doc.get('kind')} {doc.get('metadata', {}).get('name')})"
        if doc.get("kind") == "Namespace":
            namespaces.add(doc["metadata"]["name"])
        elif doc.get("kind") not in CLUSTER_SCOPED:
            ns = doc.get("metadata", {}).get("namespace")
            if not ns:
                sys.exit(f"{what}: no metadata.namespace (it would land in kubectl's current namespace)")
            if ns not in namespaces:
                sys.exit(
                    f"{what}: namespace {ns!r} is not created before it by `kubectl apply -f daemonset/` "
                    f"(files apply in name order: {applied}); on a fresh cluster: namespaces '{ns}' not found"
                )
print(f"kubectl apply -f daemonset/ order: {', '.join(applied)} (Namespace first)")
# The PodMonitor must select the DaemonSet's and the controller's pods and name a port both
# expose; the two workloads' selectors must not select each other's pods.
pm = yaml.safe_load(open("daemonset/monitoring/podmonitor.yaml"))
selector = pm["spec"]["selector"]
def selects(sel, labels):
    if any(labels.get(k) != v for k, v in sel.get("matchLabels", {}).items()):
        return False
    for e in sel.get("matchExpressions", []):
        if e["operator"] != "In":
            sys.exit(f"PodMonitor selector operator {e['operator']} not understood here")
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True
workloads = {f: next(d for d in yaml.safe_load_all(open(f"daemonset/{f}")) if d and d["kind"] in ("DaemonSet", "Deployment")) for f in ("20-daemonset.yaml", "30-controller.yaml")}
for f, w in workloads.items():
    labels = w["spec"]["template"]["metadata"]["labels"]
    if not selects(selector, labels):
        sys.exit(f"PodMonitor selector {selector} does not match the pod labels of {f}: {labels}")
    for g, other in workloads.items():
        if g != f and selects(other["spec"]["selector"], labels):
            sys.exit(f"the selector of {g} selects the pods of {f}")
    ports = {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        if ep["port"] not in ports:
            sys.exit(f"PodMonitor port {ep['port']} not among the ports of {f}: {ports}")
# The PodMonitor scrapes with the token of the Secret scraper-rbac.yaml creates, whose
# ServiceAccount is bound to a ClusterRole of 10-rbac.yaml granting exactly get on /metrics.
scraper = {d["kind"]: d for d in yaml.safe_load_all(open("daemonset/monitoring/scraper-rbac.yaml")) if d}
roles = {d["metadata"]["name"]: d for d in yaml.safe_load_all(open("daemonset/10-rbac.yaml")) if d and d["kind"] == "ClusterRole"}
for ep in pm["spec"]["podMetricsEndpoints"]:
    secret = ep["authorization"]["credentials"]["name"]
    if secret != scraper["Secret"]["metadata"]["name"]:
        sys.exit(f"PodMonitor token Secret {secret} is not the one scraper-rbac.yaml creates")
    if ep.get("scheme") != "https":
        sys.exit("PodMonitor must scrape over https (a bearer token is sent)")
sa = scraper["Secret"]["metadata"]["annotations"]["kubernetes.io/service-account.name"]
binding = scraper["ClusterRoleBinding"]
if [s["name"] for s in binding["subjects"]] != [sa] or sa != scraper["ServiceAccount"]["metadata"]["name"]:
    sys.exit("scraper-rbac.yaml: the Secret, ServiceAccount and binding do not name the same ServiceAccount")
role = roles.get(binding["roleRef"]["name"])
if role is None or role["rules"] != [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]:
    sys.exit(f"scraper-rbac.yaml binds {binding['roleRef']['name']}, which must grant exactly get on /metrics")
print("Kustomization, PodMonitor and dashboard: consistent; PodMonitor scrapes https with the scraper's token")
# The release workflow (it cannot run here) against the Dockerfile and the chart: every platform
# it builds is a TARGETARCH the Dockerfile handles, every build argument is an ARG there, and it
# pushes the image the chart installs (for the owner nodelb).
import re
wf = yaml.safe_load(open(".github/workflows/release.yml"))
steps = wf["jobs"]["release"]["steps"]
build = next(s["with"] for s in steps if s.get("uses", "").startswith("docker/build-push-action"))
dockerfile = open("Dockerfile").read()
for platform in build["platforms"].split(","):
    arch = platform.split("/")[1]
    if not re.search(rf"^\s*{arch}\)", dockerfile, re.M):
        sys.exit(f"release.yml builds {platform}, the Dockerfile has no TARGETARCH case {arch})")
for arg in filter(None, map(str.strip, build.get("build-args", "").splitlines())):
    if not re.search(rf"^ARG {arg.split('=')[0]}\b", dockerfile, re.M):
        sys.exit(f"release.yml passes --build-arg {arg}, the Dockerfile has no such ARG")
values = yaml.safe_load(open("charts/nodelb/values.yaml"))
image = wf["jobs"]["release"]["env"]["IMAGE"].replace("${{ github.repository_owner }}", "nodelb")
if values["image"]["repository"] != image:
    sys.exit(f"release.yml pushes {image}, the chart installs {values['image']['repository']}")
print("release workflow: consistent with the Dockerfile and the chart")
PY
