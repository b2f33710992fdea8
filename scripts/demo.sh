#!/usr/bin/env bash
# nodelb end to end, in network namespaces, on one machine. Run as root on Debian: `sudo scripts/demo.sh`.
#
#   nodelb-demo-client (203.0.113.10)
#        │  veth
#   nodelb-demo-node   (203.0.113.1 │ 198.51.100.1)  ← `nodelb run --manifests examples/ --node-name node-1`
#        │  bridge
#   nodelb-demo-be1 (198.51.100.11)   nodelb-demo-be2 (198.51.100.12)   ← HTTP servers answering their name
#
# Steps: install packages, build nodelb, build the namespaces, start the backends and the agent, wait
# for /readyz, read the allocated port of default/web, curl node:port from the client 10 times (both
# backends must answer), show the nftables table. Everything is removed on exit, whatever happens.
# NODELB_BIN=path uses a prebuilt binary instead of building one.
# Only documentation address ranges are used; the host's own namespace is never changed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

PFX=nodelb-demo
CLIENT=$PFX-client NODE=$PFX-node BE1=$PFX-be1 BE2=$PFX-be2
NODE_IP=203.0.113.1 CLIENT_IP=203.0.113.10
HTTP_ADDR=127.0.0.1:9470
NODE_NAME=node-1
TMP=
AGENT_PID=
SERVER_PIDS=()

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
die() { printf '\ndemo FAILED: %s\n' "$*" >&2; exit 1; }
in_ns() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    [[ -n $AGENT_PID ]] && kill "$AGENT_PID" 2>/dev/null && wait "$AGENT_PID" 2>/dev/null
    for p in "${SERVER_PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    for ns in "$CLIENT" "$NODE" "$BE1" "$BE2"; do ip netns del "$ns" 2>/dev/null; done
    if [[ $rc -ne 0 && -n $TMP && -s $TMP/agent.log ]]; then
        echo "---- agent log (last 40 lines) ----" >&2
        tail -n 40 "$TMP/agent.log" >&2
    fi
    [[ -n $TMP ]] && rm -rf "$TMP"
    echo
    if [[ $rc -eq 0 ]]; then echo "demo OK (namespaces removed)"; else echo "demo exited with $rc (namespaces removed)" >&2; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[[ $(id -u) -eq 0 ]] || die "run as root (sudo scripts/demo.sh): it creates network namespaces"
[[ -f examples/web.yaml ]] || die "examples/web.yaml not found"

step "Installing packages (iproute2, nftables, curl, python3)"
export DEBIAN_FRONTEND=noninteractive
pkgs=(iproute2 nftables curl python3 python3-yaml procps ca-certificates)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ -z ${NODELB_BIN:-} ]]; then
    step "Rust toolchain"
    nodelb_ensure_rust || die "no usable Rust toolchain (need 1.85+)"
    cargo --version
fi

if [[ -n ${NODELB_BIN:-} ]]; then
    BIN=$(realpath "$NODELB_BIN") # a prebuilt binary instead of building
else
    step "Building nodelb (cargo build --release)"
    cargo build --release --locked
    BIN=$PWD/target/release/nodelb
fi
[[ -x $BIN ]] || die "$BIN not built"

step "Creating namespaces $CLIENT, $NODE, $BE1, $BE2"
for ns in "$CLIENT" "$NODE" "$BE1" "$BE2"; do
    ip netns del "$ns" 2>/dev/null || true # a previous run that was killed hard
    ip netns add "$ns"
    in_ns "$ns" ip link set lo up
done
TMP=$(mktemp -d /tmp/nodelb-demo.XXXXXX)

# client ── node
ip -n "$NODE" link add c0 type veth peer name eth0 netns "$CLIENT"
ip -n "$NODE" addr add "$NODE_IP/24" dev c0
ip -n "$NODE" link set c0 up
ip -n "$CLIENT" addr add "$CLIENT_IP/24" dev eth0
ip -n "$CLIENT" link set eth0 up
ip -n "$CLIENT" route add default via "$NODE_IP"
# node ── bridge ── be1, be2
ip -n "$NODE" link add br-b type bridge
ip -n "$NODE" addr add 198.51.100.1/24 dev br-b
ip -n "$NODE" link set br-b up
i=0
for be in "$BE1" "$BE2"; do
    i=$((i + 1))
    ip -n "$NODE" link add "b$i" type veth peer name eth0 netns "$be"
    ip -n "$NODE" link set "b$i" master br-b up
    ip -n "$be" addr add "198.51.100.1$i/24" dev eth0
    ip -n "$be" link set eth0 up
    ip -n "$be" route add default via 198.51.100.1
done
in_ns "$NODE" sysctl -qw net.ipv4.ip_forward=1
in_ns "$NODE" sysctl -qw net.ipv6.conf.all.forwarding=1

# The backends' ports come from the examples' EndpointSlices (web: 8080/TCP; UDP ones if any).
read_ports() {
    python3 - "$@" <<'PY'
import sys, yaml
for path in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "EndpointSlice":
            for p in doc.get("ports") or []:
                print(p.get("protocol", "TCP"), p["port"])
PY
}
mapfile -t backend_ports < <(read_ports examples/*.yaml | sort -u)
((${#backend_ports[@]})) || die "no EndpointSlice ports in examples/*.yaml"

step "Starting backend servers in $BE1 and $BE2: ${backend_ports[*]}"
cat >"$TMP/backend.py" <<'PY'
import socket, sys, threading
name, proto, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def peer(a): return f"{a[0]}:{a[1]}"
if proto == "UDP":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    while True:
        data, a = s.recvfrom(2048)
        s.sendto(f"backend={name} peer={peer(a)}\n".encode(), a)
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    def handle(c, a):
        with c:
            c.settimeout(2)
            try:
                c.recv(4096)
            except OSError:
                pass
            body = f"backend={name} peer={peer(a)}\n"
            c.sendall(f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    while True:
        c, a = s.accept()
        threading.Thread(target=handle, args=(c, a), daemon=True).start()
PY
for be in "$BE1" "$BE2"; do
    for pp in "${backend_ports[@]}"; do
        read -r proto port <<<"$pp"
        ip netns exec "$be" python3 "$TMP/backend.py" "${be#"$PFX"-}" "$proto" "$port" </dev/null &
        SERVER_PIDS+=($!)
    done
done

step "Starting nodelb in $NODE"
echo "nodelb run --manifests examples/ --state-file $TMP/state.json --node-name $NODE_NAME --http-addr $HTTP_ADDR"
ip netns exec "$NODE" "$BIN" run --manifests examples/ --state-file "$TMP/state.json" --node-name "$NODE_NAME" \
    --http-addr "$HTTP_ADDR" </dev/null >"$TMP/agent.log" 2>&1 &
AGENT_PID=$!

step "Waiting for /readyz"
ready=
for _ in $(seq 1 100); do
    kill -0 "$AGENT_PID" 2>/dev/null || die "nodelb exited"
    if in_ns "$NODE" curl -fsS --max-time 1 "http://$HTTP_ADDR/readyz" >/dev/null 2>&1; then ready=1; break; fi
    sleep 0.2
done
[[ -n $ready ]] || die "nodelb not ready after 20 s: $(in_ns "$NODE" curl -sS --max-time 1 "http://$HTTP_ADDR/readyz" 2>&1)"
echo "ready"

step "nodelb status"
in_ns "$NODE" "$BIN" status --http-addr "$HTTP_ADDR" || die "nodelb status failed"

status_json=$(in_ns "$NODE" curl -fsS --max-time 2 "http://$HTTP_ADDR/status")
port_of() { # namespace name port protocol → allocated node port
    python3 -c '
import json, sys
st = json.loads(sys.stdin.read())
ns, name, port, proto = sys.argv[1:]
for s in st["services"]:
    if s["namespace"] == ns and s["name"] == name:
        for p in s["ports"]:
            if str(p["port"]) == port and p["protocol"] == proto and p.get("nodePort"):
                print(p["nodePort"])
' "$@" <<<"$status_json"
}
WEB_PORT=$(port_of default web 80 TCP)
[[ -n $WEB_PORT ]] || die "no allocated port for default/web 80/TCP in /status: $status_json"
echo "default/web 80/TCP is at $NODE_IP:$WEB_PORT"

step "curl http://$NODE_IP:$WEB_PORT/ from $CLIENT, 10 times"
seen=()
# Random balancing: after 10 requests, go on (up to 30) only until both backends have answered.
for n in $(seq 1 30); do
    body=$(in_ns "$CLIENT" curl -fsS --max-time 2 "http://$NODE_IP:$WEB_PORT/") || die "request $n failed"
    echo "  $n: $body"
    seen+=("$(sed -n 's/.*backend=\([^ ]*\).*/\1/p' <<<"$body")")
    if ((n >= 10)) && printf '%s\n' "${seen[@]}" | grep -qx be1 && printf '%s\n' "${seen[@]}" | grep -qx be2; then
        break
    fi
done
for be in be1 be2; do
    printf '%s\n' "${seen[@]}" | grep -qx "$be" || die "backend $be never answered"
done
echo "both backends answered"

# UDP services in the examples (e.g. dns.yaml), if any.
while read -r ns name port; do
    [[ -n ${ns:-} ]] || continue
    UDP_PORT=$(port_of "$ns" "$name" "$port" UDP)
    [[ -n $UDP_PORT ]] || die "no allocated port for $ns/$name $port/UDP"
    step "UDP: $ns/$name $port/UDP at $NODE_IP:$UDP_PORT from $CLIENT"
    for n in 1 2 3; do
        body=$(in_ns "$CLIENT" python3 -c '
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
s.connect((sys.argv[1], int(sys.argv[2]))); s.send(b"hello")
print(s.recv(2048).decode().strip())' "$NODE_IP" "$UDP_PORT" </dev/null) || die "UDP request $n failed"
        echo "  $n: $body"
    done
done < <(python3 - examples/*.yaml <<'PY'
import sys, yaml
for path in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "Service" and (doc.get("spec") or {}).get("type") == "LoadBalancer":
            md = doc["metadata"]
            for p in doc["spec"].get("ports") or []:
                if p.get("protocol") == "UDP":
                    print(md.get("namespace", "default"), md["name"], p["port"])
PY
)

step "nft list table inet nodelb (in $NODE)"
in_ns "$NODE" nft list table inet nodelb

step "Done; cleaning up"
