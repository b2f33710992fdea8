# syntax=docker/dockerfile:1
# nodelb agent image: one static binary, nothing else (no shell, no nft/iptables binaries).
# Runs with hostNetwork and needs CAP_NET_ADMIN (nftables and conntrack over netlink); write access
# to /proc/sys/net only with --enable-forwarding.
#
# Build: docker build --build-arg NODELB_GIT_COMMIT=$(git rev-parse --short=12 HEAD) -t nodelb .
# (.dockerignore leaves .git out, so build.rs cannot ask git; without the argument
# nodelb_build_info reports git_commit="unknown".)

FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools \
    && rm -rf /var/lib/apt/lists/* \
    && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
# Read by build.rs (as an environment variable of the RUN below) for nodelb_build_info.
ARG NODELB_GIT_COMMIT=""
# Everything the workspace manifest names must be present for cargo to build.
COPY . .
RUN cargo build --release --locked --target x86_64-unknown-linux-musl --bin nodelb \
    && install -D -m 0755 target/x86_64-unknown-linux-musl/release/nodelb /out/nodelb

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/nodelb /usr/local/bin/nodelb
# Default user is non-root (for `nodelb status`, `--help`). The agent itself needs CAP_NET_ADMIN in
# its effective set, which a non-root process does not get from `capabilities.add` (Kubernetes sets
# no ambient capabilities): the DaemonSet runs it with runAsUser: 0, capabilities drop [ALL] add
# [NET_ADMIN], readOnlyRootFilesystem.
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/nodelb"]
CMD ["run"]
