# syntax=docker/dockerfile:1
# The pko-rs operator image: `docker build -t pko-rs:dev .`
#
# The project's build machines have no container engine, so this file has not been built there.
# To keep it honest, its build steps are `make` targets (`make dist`, `make dist-policies`) and
# it copies only what those targets write; tests/tests/deploy.rs checks both against `make -n`,
# and `make test` builds the same crates and the same policy bundle.

ARG RUST_IMAGE=docker.io/library/rust:1.95.0-bookworm
# glibc + libgcc, nothing else; the "nonroot" variant's user is 65532:65532.
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot
# opa is built from its Go module, then compiles the admission policies to wasm.
ARG GO_IMAGE=docker.io/library/golang:1.26-bookworm

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
# BuildKit cache mounts keep the crate registry and the target dir between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/cache \
    make dist CACHE_DIR=/cache DIST_DIR=/out

FROM ${GO_IMAGE} AS policies
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/cache \
    make dist-policies CACHE_DIR=/cache DIST_DIR=/out

FROM ${RUST_IMAGE} AS plugins
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/cache \
    make dist-plugins CACHE_DIR=/cache DIST_DIR=/out

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/pko-operator /usr/local/bin/pko-operator
# The workspace agent ships in the same image, as PKO's does.
COPY --from=build /out/pko-agent /usr/local/bin/pko-agent
# The admission policies (`opa build -t wasm`), loaded with --policy-bundle.
COPY --from=policies /out/policies.tar.gz /usr/local/share/pko-rs/policies.tar.gz
# Example transform plugins (wasm32-wasip2 components), for `file://` module sources.
COPY --from=plugins /out/plugins/default_tags.wasm /out/plugins/naming_policy.wasm /out/plugins/resource_allowlist.wasm /usr/local/share/pko-rs/plugins/
# Numeric, so `runAsNonRoot` can verify it; the operator writes no files, so the root
# filesystem can be (and in deploy/ is) read-only.
USER 65532:65532
# file server, probes, metrics, admission webhook
EXPOSE 9090 8081 8383 9443
ENTRYPOINT ["/usr/local/bin/pko-operator"]
