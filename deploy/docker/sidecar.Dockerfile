# kvgate-sidecar with Docker, for those who have it: the same files as the
# image `cargo xtask images` builds without it (target/dist/kvgate-sidecar.oci.tar;
# its list is target/dist/kvgate-sidecar.files): the binary, the libraries
# the loader maps for it, and the user it runs as. No shell, no package
# manager. Build from the repository root:
#   docker build -f deploy/docker/sidecar.Dockerfile -t kvgate-sidecar:0.1.0 .
# deploy/README.md ("Images") shows how to check both list the same files.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# libzmq is vendored and built by the zmq crate (a C++ compiler is in the
# image); nothing else is needed from the system.
COPY . .
# release-image: the release build without debug info, symbols stripped
# (the workspace's Cargo.toml).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --profile release-image -p kvgate-sidecar \
    && install -D -m 0755 target/release-image/kvgate-sidecar /out/kvgate-sidecar \
    && ldd /out/kvgate-sidecar
RUN mkdir -p /out/etc \
    && echo 'nonroot:x:65532:65532:nonroot:/nonexistent:/usr/sbin/nologin' > /out/etc/passwd \
    && echo 'nonroot:x:65532:' > /out/etc/group

# Every file by name: the binary, its DT_NEEDED closure as ldd prints it
# above (glibc, libgcc and libstdc++, which the vendored libzmq needs; the
# loader), passwd and group. NVML (`nvml = true`, `kvgate-sidecar agent`) is
# loaded at run time from the driver the GPU node mounts in. The liveness
# probe runs the binary itself (`kvgate-sidecar status`).
FROM scratch
COPY --from=build /out/kvgate-sidecar /usr/local/bin/kvgate-sidecar
COPY --from=build /lib/x86_64-linux-gnu/libstdc++.so.6 /lib/x86_64-linux-gnu/libstdc++.so.6
COPY --from=build /lib/x86_64-linux-gnu/libgcc_s.so.1 /lib/x86_64-linux-gnu/libgcc_s.so.1
COPY --from=build /lib/x86_64-linux-gnu/libm.so.6 /lib/x86_64-linux-gnu/libm.so.6
COPY --from=build /lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libc.so.6
COPY --from=build /lib64/ld-linux-x86-64.so.2 /lib64/ld-linux-x86-64.so.2
COPY --from=build /out/etc/passwd /out/etc/group /etc/
USER 65532:65532
EXPOSE 9190 9400
ENTRYPOINT ["/usr/local/bin/kvgate-sidecar"]
CMD ["--config", "/etc/kvgate/kvgate.toml"]
