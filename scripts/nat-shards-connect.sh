#!/usr/bin/env bash
# What each nat shard table costs a new connection (docs/design/dispatch.md, "Sharding the nat
# chains"): nodelb's own skeleton (`nodelb plan --nat-shards K`, no Services: every shard's nat
# output chain and dispatch maps) loaded in a network namespace per K, and a loop of refused TCP
# connects to 127.0.0.1 in each (every connect's SYN passes the nat output chains of every table;
# nothing answers, so nothing else costs). The loops run in turn, K by K, `reps` rounds; printed:
# per K the median per-connect time and its median difference to K = 1 in the same round (the VM
# drifts between rounds, not within one). The namespaces are the script's own.
#
#   sudo scripts/nat-shards-connect.sh "1 4 16 32" 15 30000
set -euo pipefail
shards=${1:-"1 4 16 32"} reps=${2:-15} conns=${3:-30000}
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, nftables)" >&2; exit 1; }
cd "$(dirname "$0")/.."
bin=${NODELB_TEST_BIN:-target/release/nodelb}
[ -x "$bin" ] || cargo build --release --bin nodelb
dir=$(mktemp -d)
cleanup() { for k in $shards; do ip netns del "nlb-conn-$$-$k" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
mkdir "$dir/none"
for k in $shards; do
    ns=nlb-conn-$$-$k
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    "$bin" plan --manifests "$dir/none" --node-name node-1 --nat-shards "$k" 2>/dev/null | ip netns exec "$ns" nft -f -
done
python3 - "$$" "$reps" "$conns" $shards <<'PY'
import statistics, subprocess, sys, time
pid, reps, conns, shards = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
loop = f"""
import socket
for _ in range({conns}):
    s = socket.socket()
    try: s.connect(("127.0.0.1", 9))
    except ConnectionRefusedError: pass
    s.close()
"""
us = {k: [] for k in shards}
for r in range(reps):
    for k in (shards if r % 2 == 0 else shards[::-1]):
        t = time.monotonic()
        subprocess.run(["ip", "netns", "exec", f"nlb-conn-{pid}-{k}", "python3", "-c", loop], check=True)
        us[k].append((time.monotonic() - t) * 1e6 / conns)
base = shards[0]
print(f"{conns} refused connects per loop, {reps} rounds; µs per connect (median), and minus K = {base} in the same round (median, min…max)")
for k in shards:
    d = [a - b for a, b in zip(us[k], us[base])]
    print(f"  K = {k:>3}: {statistics.median(us[k]):6.2f} µs   {statistics.median(d):+5.2f} ({min(d):+.2f}…{max(d):+.2f})")
PY
