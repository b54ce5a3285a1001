# The filter with Docker, for those who have it: one file, /plugin.wasm, as
# in the image `cargo xtask images` builds without it
# (target/dist/kvgate-filter.oci.tar): what the plain Deployment mounts as an
# image volume, and what Istio's WasmPlugin and Envoy Gateway's Image code
# source pull. Build from the repository root, after `cargo xtask dist`:
#   cargo xtask dist
#   docker build -f deploy/docker/filter.Dockerfile -t kvgate-filter:0.1.0 .
# Docker's image has another digest than the one the rendered manifests pin
# (its config and layer bytes differ); pin the digest `docker push` prints.
FROM scratch
COPY target/dist/kvgate_filter.wasm /plugin.wasm
