# syntax=docker/dockerfile:1
# The pko-rs images: `docker build -t pko-rs:latest .` (operator) and
# `docker build --target agent -t pko-rs-agent:latest .` (workspace image: agent + pulumi).
#
# `make image` assembles the same two images without a container daemon (tools/image.sh,
# umoci), from the same `make dist*` outputs at the same paths, user and entrypoint; the
# tests run those with runc. This file itself is not built on the project's machines: to keep
# it honest, its build steps are `make` targets and it copies only what those targets write
# (tests/tests/it/deploy.rs checks both against `make -n`).

ARG RUST_IMAGE=docker.io/library/rust:1.95.0-bookworm
# opa and pulumi are built from their Go modules; opa compiles the admission policies to wasm.
ARG GO_IMAGE=docker.io/library/golang:1.26-bookworm

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
# BuildKit cache mounts keep the crate registry and the target dir between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/cache \
    make dist CACHE_DIR=/cache DIST_DIR=/out
# /etc/passwd and /etc/group (nonroot 65532, pulumi 1000), Debian's CA bundle, /tmp and the
# agent image's home: the images have no base.
RUN make dist-rootfs DIST_DIR=/out

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

FROM ${GO_IMAGE} AS pulumi
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/cache \
    make dist-pulumi CACHE_DIR=/cache DIST_DIR=/out

# The workspace image: the pulumi container of a Workspace with `spec.image` set to it runs
# YAML programs (no language runtime besides pulumi-language-yaml).
FROM scratch AS agent
COPY --from=build /out/passwd /out/group /etc/
COPY --from=build /out/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/tmp /tmp
COPY --from=build --chown=65532:65532 /out/home/nonroot /home/nonroot
COPY --from=build /out/pko-agent /usr/local/bin/pko-agent
COPY --from=pulumi /out/pulumi /out/pulumi-language-yaml /usr/local/bin/
# What the pod PKO's manager lays out runs from its agent image: /agent and /tini (links to the
# agent, which acts as tini when called so) and busybox's sh, cp and ln in /bin.
COPY --from=build /out/agent-root/ /
ENV PATH=/usr/local/bin:/bin HOME=/home/nonroot
USER 65532:65532
# No entrypoint: PKO's init containers give only `args` (`cp /agent /tini /share/`, `sh -c …`).
CMD ["/usr/local/bin/pko-agent"]

# The operator image (the default target). Static binaries: no libc, no base image.
FROM scratch
COPY --from=build /out/passwd /out/group /etc/
COPY --from=build /out/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/tmp /tmp
COPY --from=build /out/pko-operator /usr/local/bin/pko-operator
# The workspace agent ships in the same image, as PKO's does: the workspace pods' bootstrap
# container copies it from here (--agent-image, default pko-rs:latest).
COPY --from=build /out/pko-agent /usr/local/bin/pko-agent
# The admission policies (`opa build -t wasm`), loaded with --policy-bundle.
COPY --from=policies /out/policies.tar.gz /usr/local/share/pko-rs/policies.tar.gz
# Example transform plugins (wasm32-wasip2 components), for `file://` module sources.
COPY --from=plugins /out/plugins/default_tags.wasm /out/plugins/naming_policy.wasm /out/plugins/resource_allowlist.wasm /usr/local/share/pko-rs/plugins/
ENV PATH=/usr/local/bin
# Numeric, so `runAsNonRoot` can verify it; the operator writes only to --plugin-cache-dir,
# so the root filesystem can be (and in deploy/ is) read-only.
USER 65532:65532
# file server, probes, metrics, admission webhook
EXPOSE 9090 8081 8383 9443
ENTRYPOINT ["/usr/local/bin/pko-operator"]
