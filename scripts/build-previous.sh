#!/usr/bin/env bash
# Builds the previous release of nodelb, the one the upgrade test upgrades from
# (tests/lifecycle.rs: one DaemonSet whose agents elected a leader among themselves, before the
# controller became its own workload): its `nodelb` binary and its chart, from the pinned commit
# below of this repository's history. Prints the directory holding `nodelb` and
# `charts/nodelb` on stdout, everything else on stderr.
#
# Cached outside the clone (NODELB_CACHE, default ~/.cache/nodelb): a commit's build never
# changes, so it is built once per machine; its Cargo target directory is kept there too.
# Concurrent callers wait for each other (flock).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
previous=39fc7125cdec3c4bffc4e3ff75941657764a4efb
cache=${NODELB_CACHE:-$HOME/.cache/nodelb}/previous
out=$cache/$previous
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [[ -x $out/nodelb && -f $out/charts/nodelb/Chart.yaml ]]; then
    echo "$out"
    exit 0
fi
nodelb_ensure_rust >&2 || exit 1
if ! git cat-file -e "$previous^{commit}" 2>/dev/null; then
    echo "build-previous.sh: commit $previous is not in this clone's history (a shallow clone?)" >&2
    exit 1
fi
echo "==> building the previous release ($previous) into $out" >&2
start=$(date +%s)
src=$(mktemp -d)
trap 'git worktree remove --force "$src" >/dev/null 2>&1 || rm -rf "$src"' EXIT
git worktree add --detach "$src" "$previous" >&2
rm -rf "$out"
mkdir -p "$out"
cargo build --locked --bin nodelb --manifest-path "$src/Cargo.toml" --target-dir "$cache/target" >&2
cp "$cache/target/debug/nodelb" "$out/nodelb.tmp"
git archive "$previous" charts/nodelb | tar -x -C "$out"
mv "$out/nodelb.tmp" "$out/nodelb"
echo "==> previous release built in $(($(date +%s) - start)) s" >&2
echo "$out"
