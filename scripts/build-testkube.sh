#!/usr/bin/env bash
# Builds the test control plane (testkube/: etcd + kube-apiserver + the EndpointSlice controller)
# and, from the same Kubernetes release, kubectl and what the real-node tests run (kubelet,
# kube-scheduler, kube-controller-manager) into target/testkube/. Called by scripts/test.sh and,
# when the binaries are missing or stale, by the Kubernetes tests themselves (tests/common/kube.rs).
#
# Cached: nothing is built when go.mod, go.sum, testkube/*.go, this script and the Go version are
# what the last build was made from (target/testkube/stamp); Go's module and build caches make a
# rebuild on the same machine cheap too. Concurrent callers wait for each other (flock).
# Prints the directory holding the binaries on stdout, everything else on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/target/testkube
mkdir -p "$out"

. scripts/lib.sh
nodelb_ensure_go testkube/go.mod || exit 1

exec 9>"$out/.lock"
flock 9

k8s_version=$(awk '$1 == "k8s.io/kubernetes" {print $2}' testkube/go.mod)
stamp_of() {
    {
        go version
        echo "$k8s_version"
        cat testkube/go.mod testkube/go.sum scripts/build-testkube.sh
        find testkube -name '*.go' -print0 | sort -z | xargs -0 cat
    } | sha256sum | awk '{print $1}'
}
want=$(stamp_of)
bins=(testkube kubectl kubelet kube-scheduler kube-controller-manager)
built() { for b in "${bins[@]}"; do [[ -x $out/$b ]] || return 1; done; }
if built && [[ -f $out/stamp && $(cat "$out/stamp") == "$want" ]]; then
    echo "$out"
    exit 0
fi

echo "==> building ${bins[*]} ($k8s_version, $(go version | awk '{print $3}')) into $out" >&2
start=$(date +%s)
cd testkube
go mod download >&2
# The version the binaries report (kubectl version, /version); the module build leaves it unset.
pkg=k8s.io/component-base/version
major=${k8s_version#v}
major=${major%%.*}
minor=${k8s_version#v*.}
minor=${minor%%.*}
ldflags="-s -w -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
ldflags+=" -X $pkg.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"
rm -f "$out/stamp"
go build -trimpath -ldflags "$ldflags" -o "$out/" . k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-controller-manager >&2
echo "$want" >"$out/stamp"
echo "==> testkube built in $(($(date +%s) - start)) s" >&2
echo "$out"
