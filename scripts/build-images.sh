#!/usr/bin/env bash
# Builds the container images the real-node tests run, without a registry: OCI image layouts made
# with umoci, as tar files a container runtime imports (`ctr images import`). Prints the directory
# holding them on stdout, everything else on stderr.
#
#   scripts/build-images.sh [NODELB-BINARY]     (default: target/release/nodelb)
#
#   nodelb.tar   the image the DaemonSet names (its `image:`), from the binary given: its user,
#                entrypoint, command and install path read from the Dockerfile, so the two agree;
#                the binary's shared libraries (ldd) beside it, where the Dockerfile's static
#                build needs none; /etc/passwd and /etc/group as the Dockerfile's base has them.
#   pause.tar    localhost/pause: the pod sandbox process (testkube/pause/pause.c, gcc -static).
#   backend.tar  localhost/nodelb-backend: an HTTP server naming its pod and node
#                (testkube/backend, a static Go binary).
#
# Each file names its image in images.env (NAME_IMAGE=reference). Rebuilt only when an input
# changed (target/images/stamp). Needs umoci (Debian's package, installed when missing), gcc and Go.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/target/images
bin=${1:-target/release/nodelb}
[[ -x $bin ]] || { echo "build-images.sh: no executable $bin (build it first)" >&2; exit 1; }
bin=$(realpath "$bin")
mkdir -p "$out"
exec 9>"$out/.lock"
flock 9

. scripts/lib.sh
if ! command -v umoci >/dev/null; then
    echo "==> installing umoci" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends umoci >/dev/null
fi
nodelb_ensure_go testkube/go.mod || exit 1

# What the Dockerfile says of the final image (its last stage).
dockerfile_json() { # $1: instruction (ENTRYPOINT, CMD): its JSON array, one element a line
    grep -E "^$1 \[" Dockerfile | tail -n1 | sed -E "s/^$1 //" | python3 -c 'import json,sys; [print(a) for a in json.load(sys.stdin)]'
}
user=$(grep -E '^USER ' Dockerfile | tail -n1 | awk '{print $2}')
install_path=$(grep -E '^COPY --from=build ' Dockerfile | tail -n1 | awk '{print $NF}')
mapfile -t entrypoint < <(dockerfile_json ENTRYPOINT)
mapfile -t cmd < <(dockerfile_json CMD)
[[ -n $user && -n $install_path && ${#entrypoint[@]} -gt 0 ]] || {
    echo "build-images.sh: the Dockerfile's USER, COPY --from=build or ENTRYPOINT not found" >&2
    exit 1
}
nodelb_image=$(awk '$1 == "image:" {print $2; exit}' daemonset/20-daemonset.yaml)

want=$({
    sha256sum "$bin" Dockerfile daemonset/20-daemonset.yaml scripts/build-images.sh testkube/pause/pause.c testkube/backend/*.go
    go version
} | sha256sum | awk '{print $1}')
if [[ -f $out/stamp && $(cat "$out/stamp") == "$want" ]]; then
    echo "$out"
    exit 0
fi
rm -f "$out/stamp"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# image NAME REF ROOTFS-DIR UMOCI-CONFIG-ARG...: $out/NAME.tar, an OCI layout whose one tag is REF's.
image() {
    local name=$1 ref=$2 files=$3
    shift 3
    local layout=$work/$name-layout tag=${ref##*:}
    umoci init --layout "$layout"
    umoci new --image "$layout:$tag"
    umoci unpack --image "$layout:$tag" "$work/$name-bundle" >/dev/null
    cp -a "$files/." "$work/$name-bundle/rootfs/"
    umoci repack --image "$layout:$tag" "$work/$name-bundle"
    umoci config --image "$layout:$tag" "$@"
    umoci gc --layout "$layout"
    tar -C "$layout" -cf "$out/$name.tar" .
    echo "==> $out/$name.tar: $ref" >&2
}

# /etc/passwd and /etc/group of the Dockerfile's base (distroless): root, nobody, nonroot.
base_files() {
    mkdir -p "$1/etc" "$1/tmp" "$1/home/nonroot"
    chmod 1777 "$1/tmp"
    chown 65532:65532 "$1/home/nonroot"
    printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$1/etc/passwd"
    printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$1/etc/group"
}

files=$work/nodelb-files
base_files "$files"
install -D -m 0755 "$bin" "$files$install_path"
# The shared libraries and the loader, at the paths the binary asks for.
ldd "$bin" | grep -oE '/[^ ]+' | while read -r lib; do
    install -D -m 0755 "$(realpath "$lib")" "$files$lib"
done
config=(--config.user "$user")
for a in "${entrypoint[@]}"; do config+=(--config.entrypoint "$a"); done
for a in "${cmd[@]}"; do config+=(--config.cmd "$a"); done
image nodelb "$nodelb_image" "$files" "${config[@]}"

files=$work/pause-files
mkdir -p "$files"
gcc -static -O2 -o "$files/pause" testkube/pause/pause.c
image pause localhost/pause:3.10 "$files" --config.entrypoint /pause --config.user 65535:65535

files=$work/backend-files
mkdir -p "$files"
(cd testkube && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$files/backend" ./backend)
image backend localhost/nodelb-backend:1 "$files" --config.entrypoint /backend --config.user 65532:65532

cat >"$out/images.env" <<ENV
NODELB_IMAGE=$nodelb_image
PAUSE_IMAGE=localhost/pause:3.10
BACKEND_IMAGE=localhost/nodelb-backend:1
ENV
echo "$want" >"$out/stamp"
echo "$out"
