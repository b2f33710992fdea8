#!/usr/bin/env bash
# Writes daemonset/ (the plain manifests of `kubectl apply -f daemonset/`) from the Helm chart
# charts/nodelb, the one source of truth: `helm template` with the values below, one numbered file
# per template (kubectl applies a directory in file-name order: the Namespace first). Edit the
# chart, then run this; scripts/validate-manifests.sh (CI) fails when daemonset/ is not what this
# writes. `scripts/generate-manifests.sh DIR` writes into DIR instead (DIR/ and DIR/monitoring/).
# Needs Go for helm (scripts/build-helm.sh, cached).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-daemonset}
helm=$(scripts/build-helm.sh)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The plain install: release "nodelb" in nodelb-system, the Namespace included (with its Pod
# Security label), no Helm-only labels, the PodMonitor rendered (into monitoring/, which
# `kubectl apply -f daemonset/` does not apply: it needs the Prometheus operator's CRD).
"$helm" template nodelb charts/nodelb --namespace nodelb-system \
    --set namespace.create=true --set helmLabels=false --set podMonitor.enabled=true \
    --output-dir "$tmp" >/dev/null

header="# GENERATED from charts/nodelb by scripts/generate-manifests.sh: edit the chart, not this file."
emit() { # template, destination
    local src=$tmp/nodelb/templates/$1
    [[ -f $src ]] || {
        echo "generate-manifests.sh: the chart rendered no $1" >&2
        exit 1
    }
    # helm separates documents with "---" and names their template; the file needs neither first.
    {
        echo "$header"
        sed -e '1{/^---$/d}' -e '/^# Source: /d' "$src"
    } >"$tmp/out"
    mkdir -p "$(dirname "$dest/$2")"
    mv "$tmp/out" "$dest/$2"
}
emit namespace.yaml 00-namespace.yaml
emit rbac.yaml 10-rbac.yaml
emit daemonset.yaml 20-daemonset.yaml
emit podmonitor.yaml monitoring/podmonitor.yaml
emit scraper-rbac.yaml monitoring/scraper-rbac.yaml
cp charts/nodelb/dashboards/nodelb.json "$dest/monitoring/grafana-dashboard.json"
echo "wrote $dest/{00-namespace,10-rbac,20-daemonset}.yaml, $dest/monitoring/{podmonitor,scraper-rbac}.yaml, $dest/monitoring/grafana-dashboard.json" >&2
