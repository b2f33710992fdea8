#!/usr/bin/env bash
# The kernel's cost of adding one Service when the Services' nat chains are split over K tables
# (docs/design/dispatch.md, "Sharding the nat chains"; docs/benchmarks.md, "The nat chains
# sharded"): N Services x E endpoints in the floor's shape (a `meta l4proto . th dport` verdict map
# in nat prerouting and nat output, a chain per Service with its draw cascade and DNATs), split
# by Service over K tables `inet nodelbshard<k>`, in a network namespace this script creates and
# deletes. Prints the kernel's time of the add-one batch (the `sendmsg` that commits it,
# validation included, `strace -T`) for each repetition.
#
#   sudo scripts/nat-shards-floor.sh 10000 5 "1 4 16" 5
set -euo pipefail
n=${1:-10000} e=${2:-5} shards=${3:-"1 4 16"} reps=${4:-5}
[ "$(id -u)" = 0 ] || { echo "needs root (a network namespace, nftables)" >&2; exit 1; }
for t in nft strace python3; do command -v $t >/dev/null || { echo "needs $t" >&2; exit 1; }; done
for k in $shards; do
    dir=$(mktemp -d) ns=nlb-shards-$$-$k
    ip netns add "$ns"
    trap 'ip netns del "$ns" 2>/dev/null; rm -rf "$dir"' EXIT
    python3 - "$n" "$e" "$k" "$dir" <<'PY'
import sys
n, e, k, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def chain(t, i):
    lines = [f"add chain inet {t} svc-{i}"]
    for j in range(e):
        x = i * e + j  # endpoints in 198.51.100.0/24, told apart by port
        to = f"198.51.100.{1 + x % 254}:{8000 + x // 254}"
        draw = f"numgen random mod {e - j} 0 " if j < e - 1 else ""
        lines.append(f"add rule inet {t} svc-{i} meta l4proto tcp {draw}dnat ip to {to}")
    return lines
with open(f"{out}/full.nft", "w") as f:
    for s in range(k):
        t = f"nodelbshard{s}"
        f.write(f"add table inet {t}\nadd map inet {t} ports {{ type inet_proto . inet_service : verdict; }}\n")
        for c, hook in (("pre", "prerouting"), ("out", "output")):
            f.write(f"add chain inet {t} {c} {{ type nat hook {hook} priority -100; }}\n")
            f.write(f"add rule inet {t} {c} meta l4proto . th dport vmap @ports\n")
    for i in range(n):
        t = f"nodelbshard{i % k}"
        f.write("\n".join(chain(t, i)) + f"\nadd element inet {t} ports {{ tcp . {1024 + i} : goto svc-{i} }}\n")
with open(f"{out}/add.nft", "w") as f:
    f.write("\n".join(chain("nodelbshard0", n)) + f"\nadd element inet nodelbshard0 ports {{ tcp . {1024 + n} : goto svc-{n} }}\n")
with open(f"{out}/del.nft", "w") as f:
    f.write(f"delete element inet nodelbshard0 ports {{ tcp . {1024 + n} }}\ndelete chain inet nodelbshard0 svc-{n}\n")
PY
    ip netns exec "$ns" nft -f "$dir/full.nft"
    times=()
    for _ in $(seq "$reps"); do
        s=$(ip netns exec "$ns" strace -f -T -e trace=sendmsg nft -f "$dir/add.nft" 2>&1 |
            grep -o '<[0-9.]*>' | tr -d '<>' | sort -n | tail -1)
        times+=("$(python3 -c "print(f'{$s*1000:.1f}')")")
        ip netns exec "$ns" nft -f "$dir/del.nft"
    done
    echo "N=$n x $e, K=$k tables: add one Service, the kernel's commit (ms): ${times[*]}"
    ip netns del "$ns"; rm -rf "$dir"; trap - EXIT
done
