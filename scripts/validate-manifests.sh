#!/usr/bin/env bash
# Validates daemonset/ offline against the official Kubernetes schemas (kubernetes-validate, from
# PyPI), checks that the Kustomization lists exactly the manifests `kubectl apply -f daemonset/`
# applies, that `kubectl apply -f daemonset/` works on a fresh cluster (every namespaced object comes
# after its Namespace in the order kubectl applies them), and that the Grafana dashboard is valid
# JSON. Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v kubernetes-validate >/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate 2>/dev/null ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages kubernetes-validate
fi
# --strict: unknown fields are errors. The PodMonitor (a CRD) has no official schema.
kubernetes-validate --strict --quiet daemonset/*.yaml daemonset/monitoring/scraper-rbac.yaml
echo "daemonset/*.yaml, daemonset/monitoring/scraper-rbac.yaml: valid"

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
json.load(open("daemonset/monitoring/grafana-dashboard.json"))
import yaml
# Kinds in daemonset/ that are cluster-scoped; any other kind is namespaced.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "CustomResourceDefinition"}
namespaces = set()
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
# The PodMonitor must select the DaemonSet's pods and name a port they expose.
ds = yaml.safe_load(open("daemonset/20-daemonset.yaml"))
pm = yaml.safe_load(open("daemonset/monitoring/podmonitor.yaml"))
labels = ds["spec"]["template"]["metadata"]["labels"]
want = pm["spec"]["selector"]["matchLabels"]
if any(labels.get(k) != v for k, v in want.items()):
    sys.exit(f"PodMonitor selector {want} does not match pod labels {labels}")
ports = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
for ep in pm["spec"]["podMetricsEndpoints"]:
    if ep["port"] not in ports:
        sys.exit(f"PodMonitor port {ep['port']} not among DaemonSet ports {ports}")
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
print("Kustomization and dashboard: consistent; PodMonitor scrapes https with the scraper's token")
PY
