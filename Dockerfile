# syntax=docker/dockerfile:1
# nodelb agent image: one static binary, nothing else (no shell, no nft/iptables binaries), for
# linux/amd64 and linux/arm64. Runs with hostNetwork and needs CAP_NET_ADMIN (nftables and
# conntrack over netlink); write access to /proc/sys/net only with --enable-forwarding.
#
# Build (the local platform):
#   docker build --build-arg NODELB_GIT_COMMIT=$(git rev-parse --short=12 HEAD) -t nodelb .
# Both platforms (buildx; arm64 on an amd64 host runs under QEMU emulation: slower, same result):
#   docker buildx build --platform linux/amd64,linux/arm64 --build-arg NODELB_GIT_COMMIT=… -t … .
# (.dockerignore leaves .git out, so build.rs cannot ask git; without the argument
# nodelb_build_info reports git_commit="unknown".) .github/workflows/release.yml publishes it.

# Built on the target platform itself (no --platform=$BUILDPLATFORM): musl-tools' musl-gcc is then
# the right C compiler for ring's C and assembly, with no cross toolchain to keep in step.
FROM rust:1-bookworm AS build
# Set by buildx (and by docker build, to the local platform): amd64 or arm64.
ARG TARGETARCH
RUN case "$TARGETARCH" in \
        amd64) echo x86_64-unknown-linux-musl ;; \
        arm64) echo aarch64-unknown-linux-musl ;; \
        *) echo "unsupported TARGETARCH '$TARGETARCH' (amd64, arm64)" >&2; exit 1 ;; \
    esac >/rust-target \
    && apt-get update && apt-get install -y --no-install-recommends musl-tools \
    && rm -rf /var/lib/apt/lists/* \
    && rustup target add "$(cat /rust-target)"
WORKDIR /src
# Read by build.rs (as an environment variable of the RUN below) for nodelb_build_info.
ARG NODELB_GIT_COMMIT=""
# Everything the workspace manifest names must be present for cargo to build.
COPY . .
RUN target=$(cat /rust-target) \
    && cargo build --profile dist --locked --target "$target" --bin nodelb \
    && install -D -m 0755 "target/$target/dist/nodelb" /out/nodelb

# Multi-platform base (amd64, arm64, …): buildx picks the one of TARGETPLATFORM.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/nodelb /usr/local/bin/nodelb
# Default user is non-root (for `nodelb status`, `--help`). The agent itself needs CAP_NET_ADMIN in
# its effective set, which a non-root process does not get from `capabilities.add` (Kubernetes sets
# no ambient capabilities): the DaemonSet runs it with runAsUser: 0, capabilities drop [ALL] add
# [NET_ADMIN], readOnlyRootFilesystem.
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/nodelb"]
CMD ["run"]
