#!/usr/bin/env bash
# The reliability programs of docs/reliability.md: the chaos soak and the targeted races.
# Root; everything runs in network namespaces they create and delete (also on Ctrl-C).
#
#   sudo scripts/soak.sh                          # chaos soak, 10 minutes of faults
#   sudo scripts/soak.sh soak --duration 120      # the 2-minute version (.ci/run)
#   sudo scripts/soak.sh races --only split-brain --rounds 1000
#   sudo scripts/soak.sh races --only kill-mid-sync --rounds 20
#   sudo scripts/soak.sh soak --seed S            # replays a run's fault and churn sequence
#
# Built with the dev profile (the agents are the same debug build the tests run; the warm target/
# has no release dependencies). Exit status 1 when an invariant broke; the summary row is printed
# and, with --out FILE, written there.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '==> %s\n' "$*" >&2; }

program=soak
case "${1:-}" in
    soak|races) program=$1; shift ;;
esac

if [ "$(id -u)" != 0 ]; then
    echo "scripts/soak.sh: needs root (network namespaces, nftables); run it with sudo" >&2
    exit 1
fi
export PATH=$PATH:/usr/local/go/bin
. scripts/lib.sh
nodelb_ensure_rust || exit 1

log "building nodelb and benches/$program.rs (dev profile)"
cargo build --bin nodelb
exe=$(cargo build --bench "$program" --message-format=json 2>/dev/null |
    sed -n "s/.*\"executable\":\"\([^\"]*\/$program-[^\"]*\)\".*/\1/p" | tail -n1)
[ -x "$exe" ] || { echo "scripts/soak.sh: could not build benches/$program.rs" >&2; exit 1; }

# Copies: a rebuild during a long run must not change the agents it restarts half-way.
pinned=$(mktemp -d /tmp/nodelb-soak.XXXXXX)
cp target/debug/nodelb "$exe" "$pinned/"
exe=$pinned/$(basename "$exe")
export NODELB_TEST_BIN=${NODELB_TEST_BIN:-$pinned/nodelb}

pid=
cleanup() {
    nodelb_stop_program "$pid"
    rm -rf "$pinned"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "running $program $*"
"$exe" "$@" &
pid=$!
status=0
wait "$pid" || status=$?
left=$(ip netns list | grep -E -- "-$pid-" || true)
[ -z "$left" ] || { log "namespaces left behind: $left"; status=1; }
exit "$status"
