# syntax=docker/dockerfile:1
# nodelb agent image. Runs with hostNetwork and needs CAP_NET_ADMIN (nftables over netlink), plus write
# access to /proc/sys/net only with --enable-forwarding. No nft/iptables binaries are needed or shipped.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked \
    && install -D -m 0755 target/release/nodelb /out/nodelb

# glibc + libgcc, no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/nodelb /usr/local/bin/nodelb
# Default user is non-root (for `nodelb status`, `--help`). The agent itself needs CAP_NET_ADMIN in its
# effective set, which a non-root process does not get from `capabilities.add` (no ambient capabilities):
# run the DaemonSet with runAsUser: 0, capabilities drop [ALL] add [NET_ADMIN], readOnlyRootFilesystem.
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/nodelb", "run"]
