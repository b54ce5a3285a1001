# The filter as an OCI image holding one file, /plugin.wasm: the layout
# Istio's WasmPlugin and Envoy Gateway's Image code source read, and what
# the plain Deployment mounts as an image volume. Build it after
# `cargo xtask dist`, from the repository root:
#   cargo xtask dist
#   docker build -f deploy/docker/filter.Dockerfile -t kvgate-filter:0.1.0 .
# The .wasm's sha256 is in target/dist/kvgate_filter.wasm.sha256 (for HTTP
# URLs); OCI references are checked against the image's digest instead.
FROM scratch
COPY target/dist/kvgate_filter.wasm /plugin.wasm
