#!/usr/bin/env bash
# Validates daemonset/ offline against the official Kubernetes schemas (kubernetes-validate, from
# PyPI), checks that the Kustomization lists exactly the manifests `kubectl apply -f daemonset/`
# applies, and that the Grafana dashboard is valid JSON. Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v kubernetes-validate >/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate 2>/dev/null ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages kubernetes-validate
fi
# --strict: unknown fields are errors. The PodMonitor (a CRD) has no official schema.
kubernetes-validate --strict --quiet daemonset/*.yaml
echo "daemonset/*.yaml: valid"

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
applied = sorted(os.path.basename(p) for p in glob.glob("daemonset/*.yaml"))
if sorted(listed) != applied:
    sys.exit(f"daemonset/Kustomization lists {sorted(listed)}, but kubectl apply -f daemonset/ applies {applied}")
json.load(open("daemonset/monitoring/grafana-dashboard.json"))
# The PodMonitor must select the DaemonSet's pods and name a port they expose.
import yaml
ds = yaml.safe_load(open("daemonset/daemonset.yaml"))
pm = yaml.safe_load(open("daemonset/monitoring/podmonitor.yaml"))
labels = ds["spec"]["template"]["metadata"]["labels"]
want = pm["spec"]["selector"]["matchLabels"]
if any(labels.get(k) != v for k, v in want.items()):
    sys.exit(f"PodMonitor selector {want} does not match pod labels {labels}")
ports = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
for ep in pm["spec"]["podMetricsEndpoints"]:
    if ep["port"] not in ports:
        sys.exit(f"PodMonitor port {ep['port']} not among DaemonSet ports {ports}")
print("Kustomization and dashboard: consistent")
PY
