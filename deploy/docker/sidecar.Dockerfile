# kvgate-sidecar: built from the repository, run as a non-root user on a
# distroless base. Build from the repository root:
#   docker build -f deploy/docker/sidecar.Dockerfile -t kvgate-sidecar:0.1.0 .
# `cargo xtask dist` builds the same binary without Docker (target/dist/).

FROM rust:1.95-bookworm AS build
WORKDIR /src
# The workspace's release profile keeps debug info for profiling; the image
# needs none of it (nine tenths of the binary's size).
ENV CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols
# libzmq is vendored and built by the zmq crate (a C++ compiler is in the
# image); nothing else is needed from the system.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --release -p kvgate-sidecar \
    && install -D -m 0755 target/release/kvgate-sidecar /out/kvgate-sidecar

# glibc, libgcc and libstdc++ (the vendored libzmq is C++), nothing else: no
# shell, no package manager. The liveness probe runs the binary itself
# (`kvgate-sidecar status`). NVML (`nvml = true`, `kvgate-sidecar agent`)
# is loaded at run time from the driver the GPU node mounts in.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/kvgate-sidecar /usr/local/bin/kvgate-sidecar
USER 65532:65532
EXPOSE 9190
ENTRYPOINT ["/usr/local/bin/kvgate-sidecar"]
CMD ["--config", "/etc/kvgate/kvgate.toml"]
