# shellcheck shell=bash
# Shared by scripts/demo.sh and scripts/test.sh (sourced, not run): the Rust toolchain that a fresh
# Debian machine lacks. Both scripts run as root, usually through sudo.

# Puts cargo's bin directory on PATH: rustup installs into ~/.cargo/bin, which sudo's secure_path
# drops (so `sudo scripts/test.sh` would not find the cargo that the last run installed).
nodelb_cargo_path() {
    local bin=${CARGO_HOME:-$HOME/.cargo}/bin
    if [[ -d $bin && :$PATH: != *:$bin:* ]]; then
        PATH=$bin:$PATH
        export PATH
    fi
}

# A cargo and rustc new enough for the crate (edition 2024: Rust 1.85 or newer) and a C linker.
nodelb_rust_ok() {
    command -v cargo >/dev/null && command -v rustc >/dev/null && command -v cc >/dev/null || return 1
    local v
    v=$(rustc --version | awk '{print $2}')
    [[ $(printf '%s\n' 1.85.0 "$v" | sort -V | head -n1) == 1.85.0 ]]
}

# Installs what nodelb_rust_ok wants when it is missing: Debian's rustup package where there is one,
# else the rustup installer (Debian 12's own cargo, 1.63, is too old and it has no rustup package),
# plus build-essential and pkg-config. Needs root and apt-get. Returns non-zero if still unusable.
nodelb_ensure_rust() {
    nodelb_cargo_path
    if nodelb_rust_ok; then
        return 0
    fi
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "no usable Rust toolchain (need cargo 1.85+ and cc); run as root on Debian to install one" >&2
        return 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends build-essential pkg-config curl ca-certificates >/dev/null
    if ! nodelb_rust_ok; then
        if apt-cache policy rustup 2>/dev/null | grep -q 'Candidate: [0-9]'; then
            echo "installing rustup from Debian's packages" >&2
            apt-get install -y -qq --no-install-recommends rustup >/dev/null
            rustup default stable
        else
            echo "Debian has no recent enough Rust here: installing rustup (https://rustup.rs)" >&2
            curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
        fi
        nodelb_cargo_path
        hash -r
    fi
    nodelb_rust_ok || {
        echo "no usable Rust toolchain after installing one (need 1.85+)" >&2
        return 1
    }
}

# Stops a benchmark-style program started in the background ($1: its pid; nothing when empty or
# gone) and deletes the namespaces it created (`nlb-<tag>-<pid>-<n>`): the program deletes them
# itself, this catches a SIGKILLed run. Used by scripts/bench.sh and scripts/soak.sh.
nodelb_stop_program() {
    local pid=$1 ns
    [ -n "$pid" ] || return 0
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^nlb-.*-$pid-[0-9]+$" || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
}

# Puts a Go toolchain on PATH (`sudo` drops /usr/local/go/bin, the official tarball's place) and
# chooses how a module whose go.mod (the argument) says `go 1.26.0` is built: an older Go (1.21+)
# fetches that toolchain as a module from the Go module proxy (GOTOOLCHAIN), a newer one builds with
# itself. GOFLAGS defaults to -mod=readonly: go.sum is what the build trusts. Returns non-zero, with
# a message, when there is no Go at all.
nodelb_ensure_go() {
    local d
    if ! command -v go >/dev/null; then
        for d in /usr/local/go/bin /usr/lib/go/bin "$HOME/go/bin" "$HOME/sdk/go/bin"; do
            if [[ -x $d/go ]]; then
                PATH=$d:$PATH
                break
            fi
        done
    fi
    if ! command -v go >/dev/null; then
        echo "no Go toolchain (go) on PATH or in /usr/local/go/bin: $1 needs Go 1.26+" >&2
        return 1
    fi
    export PATH GOFLAGS=${GOFLAGS:--mod=readonly}
    local go_minor
    go_minor=$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')
    if [[ $go_minor =~ ^[0-9]+$ ]] && ((go_minor < 26)); then
        export GOTOOLCHAIN=go1.26.8
    else
        export GOTOOLCHAIN=local
    fi
}
