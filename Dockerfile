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
# Non-root: grant CAP_NET_ADMIN to the container (securityContext.capabilities.add: [NET_ADMIN]) and, in
# Kubernetes, allowPrivilegeEscalation is not needed because the binary carries no file capabilities;
# run as root instead (runAsUser: 0) where the runtime cannot give ambient capabilities to a non-root user.
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/nodelb", "run"]
