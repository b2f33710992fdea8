#!/usr/bin/env bash
# Builds helm (helm.sh/helm/v3, the version tools/helm/go.mod pins) from its Go module into
# target/helm/helm: no Debian package has it and nothing but package registries is reachable here.
# Used by scripts/validate-manifests.sh, scripts/generate-manifests.sh and the chart tests
# (tests/chart.rs, through tests/common/helm.rs).
#
# Cached like scripts/build-testkube.sh: nothing is built when tools/helm/go.mod, go.sum, this script
# and the Go version are what the last build was made from (target/helm/stamp). Concurrent callers
# wait for each other (flock). Prints the path of the binary on stdout, everything else on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
out=$PWD/target/helm
mkdir -p "$out"
nodelb_ensure_go tools/helm/go.mod || exit 1

exec 9>"$out/.lock"
flock 9

version=$(awk '$1 == "helm.sh/helm/v3" {print $2}' tools/helm/go.mod)
want=$({
    go version
    cat tools/helm/go.mod tools/helm/go.sum scripts/build-helm.sh
} | sha256sum | awk '{print $1}')
if [[ -x $out/helm && -f $out/stamp && $(cat "$out/stamp") == "$want" ]]; then
    echo "$out/helm"
    exit 0
fi

echo "==> building helm $version ($(go version | awk '{print $3}')) into $out" >&2
start=$(date +%s)
cd tools/helm
go mod download >&2
rm -f "$out/stamp"
# What helm's Makefile sets and a module build leaves at its defaults: the version `helm version`
# reports, and the Kubernetes version `helm template` and `helm lint` assume without a cluster
# (client-go's v0.X.Y is Kubernetes 1.X; the default, 1.20, fails charts needing a newer one).
k8s=$(go list -f '{{.Version}}' -m k8s.io/client-go)
k8s_minor=$(cut -d. -f2 <<<"$k8s")
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
go build -trimpath -ldflags "$ldflags" -o "$out/helm" helm.sh/helm/v3/cmd/helm >&2
echo "$want" >"$out/stamp"
echo "==> helm built in $(($(date +%s) - start)) s" >&2
echo "$out/helm"
