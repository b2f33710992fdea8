#!/usr/bin/env bash
# Runs the whole test suite, including the root tests on the real kernel (network namespaces).
# Run as root: `sudo scripts/test.sh`. Extra arguments go to the test runner (e.g. a test name filter).
# On a fresh Debian machine it installs what it needs: the packages the root tests run, and a Rust
# toolchain when there is none (scripts/lib.sh, shared with scripts/demo.sh); it builds the test
# control plane (Go 1.26+ needed: scripts/build-testkube.sh). cargo-nextest is used when installed,
# else `cargo test` under an overall deadline (NODELB_TEST_DEADLINE, default 40m), so a hung test
# fails the run with its output instead of holding CI until its limit.
#
# NODELB_REQUIRE_ROOT_TESTS=1 (set by .ci/run) turns a root test's skip into a failure.
# Fails when a test namespace (nlb-*) or a table `inet nodelb` is left in the host namespace.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

log() { printf '==> %s\n' "$*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    if [[ ${NODELB_REQUIRE_ROOT_TESTS:-} == 1 ]]; then
        echo "scripts/test.sh: must run as root (NODELB_REQUIRE_ROOT_TESTS=1)" >&2
        exit 1
    fi
    echo "scripts/test.sh: not root: the root tests will be skipped (use sudo to run them)" >&2
fi

# What the root tests run: ip (iproute2), nft, sysctl (procps), ping, conntrack,
# iptables-nft / iptables-legacy (Debian's iptables: the host firewalls of tests/host_firewall.rs),
# and Prometheus with promtool (the alert rules' tests, tests/alerts.rs; the package's service is
# not started where no init system runs it, and the test runs its own server in a namespace; the
# same holds for containerd, which the real-node tests run inside each node's namespaces).
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v sysctl >/dev/null || need+=(procps)
command -v ping >/dev/null || need+=(iputils-ping)
command -v conntrack >/dev/null || need+=(conntrack)
{ command -v iptables-nft && command -v iptables-legacy; } >/dev/null || need+=(iptables)
{ command -v prometheus && command -v promtool; } >/dev/null || need+=(prometheus)
# The real nodes of tests/real_nodes.rs: containerd (with ctr), runc, the CNI plugins, and umoci,
# which makes the images they run (scripts/build-images.sh); gcc builds the pause image.
{ command -v containerd && command -v ctr; } >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local ]] || need+=(containernetworking-plugins)
command -v umoci >/dev/null || need+=(umoci)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
if ((${#need[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        log "installing ${need[*]}"
        # Debian starts (and enables) a package's service when it is installed: the tests want
        # Prometheus's binaries, not a server on this host. policy-rc.d keeps it from starting.
        policy=
        if [[ ! -e /usr/sbin/policy-rc.d ]]; then
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
            chmod +x /usr/sbin/policy-rc.d
            policy=1
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
        [[ -n $policy ]] && rm -f /usr/sbin/policy-rc.d
        if command -v systemctl >/dev/null; then
            for service in prometheus containerd; do
                if [[ " ${need[*]} " == *" $service "* ]]; then
                    systemctl disable --now "$service" >/dev/null 2>&1 || true
                fi
            done
        fi
    else
        echo "scripts/test.sh: missing ${need[*]} (install them, or run as root on Debian)" >&2
        exit 1
    fi
fi

# On a fresh machine: no cargo yet (or only the one sudo's PATH hides). As in scripts/demo.sh.
nodelb_ensure_rust || exit 1
log "$(cargo --version)"

# The Kubernetes tests (tests/kube_cluster.rs) run a real kube-apiserver + etcd built from their Go
# modules (testkube/): built here once, cached (a second run costs a fraction of a second). They
# are root tests, so without root nothing needs it.
if [[ $(id -u) -eq 0 ]]; then
    log "test control plane: scripts/build-testkube.sh"
    scripts/build-testkube.sh >/dev/null
    # helm, for the chart and lifecycle tests (tests/chart.rs, tests/lifecycle.rs): same caching.
    log "helm: scripts/build-helm.sh"
    scripts/build-helm.sh >/dev/null
    # The previous release, which the upgrade test upgrades from (tests/lifecycle.rs): built
    # from this repository's history once per machine, cached outside the clone.
    log "previous release: scripts/build-previous.sh"
    NODELB_PREVIOUS_DIR=$(scripts/build-previous.sh)
    export NODELB_PREVIOUS_DIR
fi

list_test_netns() { { ip netns list 2>/dev/null || true; } | awk '{print $1}' | grep '^nlb-' | sort || true; }
host_has_table() { command -v nft >/dev/null && nft list table inet nodelb >/dev/null 2>&1; }

netns_before=$(list_test_netns)
table_before=no
if [[ $(id -u) -eq 0 ]] && host_has_table; then table_before=yes; fi

status=0
if command -v cargo-nextest >/dev/null || cargo nextest --version >/dev/null 2>&1; then
    log "cargo nextest run --workspace $*"
    cargo nextest run --workspace --no-fail-fast "$@" || status=$?
    # nextest does not run doctests.
    if [[ $# -eq 0 ]]; then
        log "cargo test --doc"
        cargo test --workspace --doc || status=$?
    fi
else
    log "cargo test --workspace $* (deadline ${NODELB_TEST_DEADLINE:-40m})"
    timeout --kill-after=30s "${NODELB_TEST_DEADLINE:-40m}" cargo test --workspace --no-fail-fast "$@" || status=$?
fi

# Nothing may be left behind in the host namespace.
if [[ $(id -u) -eq 0 ]]; then
    sleep 0.5
    leftover=$(comm -13 <(echo "$netns_before") <(list_test_netns) | grep . || true)
    if [[ -n $leftover ]]; then
        echo "scripts/test.sh: FAIL: test network namespaces left behind:" >&2
        echo "$leftover" >&2
        status=1
    fi
    # The real nodes' cgroups (tests/common/real_node.rs).
    cgroups_left=$(find /sys/fs/cgroup -mindepth 2 -maxdepth 2 -name 'nodelb-nlb-*' 2>/dev/null || true)
    if [[ -n $cgroups_left ]]; then
        echo "scripts/test.sh: FAIL: real nodes' cgroups left behind:" >&2
        echo "$cgroups_left" >&2
        status=1
    fi
    if host_has_table; then
        echo "scripts/test.sh: FAIL: table inet nodelb exists in the host namespace (before the run: $table_before)" >&2
        status=1
    fi
fi

if [[ $status -ne 0 ]]; then
    log "tests FAILED (exit $status)"
else
    log "tests passed"
fi
exit "$status"
