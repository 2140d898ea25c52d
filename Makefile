# pko-rs: `make run` runs the operator against a local control plane; `make test` runs every test.
# Everything heavy is cached outside the clone (Rust target dir, Go caches, built tools), so a
# second run on the same machine reuses it.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

CACHE_DIR ?= $(HOME)/.cache/pko-rs
# One Rust target dir per checkout: cargo names a workspace crate's artifacts by its path relative
# to the workspace, so a second checkout would reuse the first one's test binaries, whose
# env!("CARGO_MANIFEST_DIR") still names the first checkout's files.
CHECKOUT_KEY := $(shell printf '%s' '$(CURDIR)' | sha256sum | cut -c1-12)
export CARGO_TARGET_DIR ?= $(CACHE_DIR)/target-$(CHECKOUT_KEY)
export PKO_TOOLS_CACHE ?= $(CACHE_DIR)/tools
export GOTOOLCHAIN := local
export CGO_ENABLED := 0
export CARGO_TERM_COLOR ?= never
# Incremental caches are not reused by a one-shot build and cost gigabytes of disk per target dir.
export CARGO_INCREMENTAL ?= 0
# The admission policy bundle built by `make policies`; the operator and the tests load it.
export PKO_POLICY_BUNDLE ?= $(CACHE_DIR)/policies/policies.tar.gz
# Transform plugins built by `make plugins` (plugins/ is a workspace of its own, built for
# wasm32-wasip2 in its own target dir); the tests and the benchmark load them from here.
PLUGINS_TARGET_DIR ?= $(CACHE_DIR)/plugins-target
export PKO_PLUGINS_DIR ?= $(PLUGINS_TARGET_DIR)/wasm32-wasip2/release
CARGO ?= cargo
# The workspace agent is linked statically (musl), so it runs in any image with the pulumi CLI.
# ring's C code is built with the host C compiler; it needs no libc headers of the target.
AGENT_TARGET := x86_64-unknown-linux-musl
export CC_x86_64_unknown_linux_musl ?= gcc
# The static agent `make test` and `make run` give the harness's kubelet and agent tests.
export PKO_AGENT_BINARY ?= $(CARGO_TARGET_DIR)/$(AGENT_TARGET)/debug/pko-agent

.PHONY: help
help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

.PHONY: toolchain
toolchain: target-dirs ## check the Rust toolchain (rust-toolchain.toml pins it; rustup installs it)
	@command -v cargo >/dev/null || { echo "cargo not found: install rustup first" >&2; exit 1; }
	@rustup show active-toolchain >/dev/null

# Each target dir records the checkout it builds; one whose checkout is gone (a CI clone, a
# removed worktree) is deleted, so the cache does not grow by gigabytes per clone.
.PHONY: target-dirs
target-dirs:
	@tools/target-dirs.sh '$(CACHE_DIR)' '$(CURDIR)' '$(CARGO_TARGET_DIR)' '$(BENCH_TARGET_DIR)'

.PHONY: go-toolchain
go-toolchain:
	@command -v go >/dev/null || { echo "go not found: Go 1.26 is needed to build tools/" >&2; exit 1; }

.PHONY: tools
tools: toolchain go-toolchain ## build kube-apiserver, etcd, kubectl, opa, pulumi (+ YAML host), helm, registry, cosign, promtool, kstatus, the test node (kubelet, containerd, CNI, kube-proxy, CoreDNS, controller-manager, scheduler, kube-router's NetworkPolicy controller, crictl) from Go modules into $(PKO_TOOLS_CACHE)
	tools/build.sh kube
	tools/build.sh opa
	tools/build.sh pulumi
	tools/build.sh helm
	tools/build.sh oci
	tools/build.sh pko
	tools/build.sh promtool
	tools/build.sh kstatus
	tools/build.sh node

.PHONY: crds
crds: ## regenerate deploy/crds from the Rust types
	$(CARGO) run -q -p pko-operator -- crdgen --out deploy/crds

.PHONY: policies
policies: tools ## `opa test` the Rego policies, then `opa build -t wasm` them into $(PKO_POLICY_BUNDLE)
	tools/policies.sh "$(PKO_POLICY_BUNDLE)"

.PHONY: plugins
plugins: toolchain plugins-guests ## build the transform plugins and hostile test guests (wasm32-wasip2; Rust, Python, JavaScript) into $(PKO_PLUGINS_DIR)
	@rustup target list --installed | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
	cd plugins && CARGO_TARGET_DIR=$(PLUGINS_TARGET_DIR) $(CARGO) build --release --target wasm32-wasip2

# The Python and JavaScript plugins, built by componentize-py and componentize-js (pinned in
# tools/guest-toolchains/, installed once into $(PKO_TOOLS_CACHE)); an unchanged plugin is copied
# from its build cache. Cold: toolchains ~30 s, builds ~20 s.
.PHONY: plugins-guests
plugins-guests:
	tools/guest-plugins.sh build py plugins/python-example $(PKO_PLUGINS_DIR)/python_example.wasm
	tools/guest-plugins.sh build js plugins/js-example/plugin.js $(PKO_PLUGINS_DIR)/js_example.wasm

# The Python and JavaScript plugins' logic, natively (CPython's unittest, Node's test runner).
.PHONY: test-guests
test-guests:
	cd plugins/python-example && PYTHONDONTWRITEBYTECODE=1 python3 -m unittest -q
	cd plugins/js-example && node --test

.PHONY: build
build: toolchain agent-static ## build every crate and test (debug)
	$(CARGO) build --workspace --all-targets

.PHONY: agent-target
agent-target: toolchain
	@rustup target list --installed | grep -qx $(AGENT_TARGET) || rustup target add $(AGENT_TARGET)

.PHONY: agent-static
agent-static: agent-target ## the workspace agent as a static binary (debug), which the tests run
	$(CARGO) build -p pko-agent --bin pko-agent --target $(AGENT_TARGET)

.PHONY: lint
lint: toolchain ## rustfmt and clippy, warnings are errors
	$(CARGO) fmt --all -- --check
	cd plugins && $(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

.PHONY: test
test: test-deps tools policies plugins test-guests build lint image ## every test: unit + integration on a real etcd + kube-apiserver
	$(CARGO) test --workspace --all-targets --no-fail-fast

# The test images are assembled from the `dev` static binaries: the same sources, layout, users
# and entrypoints as the release images, without a release compile of every crate (21 of the
# ~105 minutes of a cold run on 2 cores). `make dist`, `make image`, `make bench` and the
# Dockerfile build and ship `release`.
test: DIST_PROFILE := dev

# Property tests (proptest) of every parser of outside input run in `make test` with a bounded
# case count each (PKO_PROPTEST_CASES overrides them all); this target runs the same properties
# with FUZZ_CASES cases each. Failures are not persisted: proptest prints the shrunk input.
FUZZ_CASES ?= 100000

.PHONY: fuzz-long
fuzz-long: toolchain policies ## property tests with FUZZ_CASES (100000) cases each: durations, tar, YAML, file-server paths, reviews, URLs (hours)
	PKO_PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test -p pko-api --lib -- duration::tests::properties
	PKO_PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test -p pko-agent --test prop_init
	PKO_PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test -p pko-operator --test prop_parsers
	PKO_PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test -p pko-admission --test prop_review

.PHONY: run
run: tools policies plugins build ## local control plane + CRDs + operator with its webhook: examples/program.yaml fetched, examples/stack.yaml deployed, a transform plugin, admission refusals and a warn-mode TenancyPolicy
	$(CARGO_TARGET_DIR)/debug/pko-dev run

.PHONY: pko
pko: go-toolchain ## build PKO v2.9.0's manager and agent (the peer `make bench` measures, the switch-over tests run) from its source tarball (PKO_SRC_TARBALL overrides its path)
	tools/build.sh pko

# The bench's release build has a target dir of its own, so it never waits on a debug build.
BENCH_TARGET_DIR ?= $(CACHE_DIR)/target-release-$(CHECKOUT_KEY)
BENCH_BIN := $(BENCH_TARGET_DIR)/release
# PKO v2.9.0 next to pko-rs at 1,000, 5,000 and 10,000 Programs, and the shipped musl build
# beside the glibc one at every count (about 2.5 min more than the two peers alone, which take
# about 9); BENCH_FLAGS adds or overrides.
BENCH_FLAGS ?= --with-10k --musl-operator $(DIST_DIR)/pko-operator
# The Stack section at 3 (the scale `bench-check`'s short run compares with), 10 and 50 Stacks;
# the 10-minute steady window at 10 and 50; pko-rs's drift checks at 10, its cold starts and
# stopped fleet at 10 and 50; the shipped musl build beside the glibc one at 10.
BENCH_STACKS_FLAGS ?= --stacks 3,10,50 --idle-seconds 600 --windows-at 10,50 --idle --idle-at 10,50 --cold-starts 10 --drift --drift-at 10 --musl-operator $(DIST_DIR)/pko-operator --musl-at 10

.PHONY: bench-build
bench-build: toolchain
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release -p pko-operator -p pko-tests --bins

# The workspaces of the bench run the agent the images ship (`make dist`'s static release
# build), as PKO's run its release agent; the tests run the debug one.
BENCH_AGENT = PKO_AGENT_BINARY=$(abspath $(DIST_DIR))/pko-agent

.PHONY: bench
bench: tools plugins policies pko dist bench-build ## benchmarks next to PKO v2.9.0 (release build, own target dir): docs/benchmarks.md and the baseline docs/bench-baseline.json
	$(BENCH_BIN)/pko-bench --out docs/benchmarks.md --write-baseline docs/bench-baseline.json $(BENCH_FLAGS)
	$(BENCH_BIN)/pko-bench-admission --out docs/benchmarks.md
	$(BENCH_BIN)/pko-bench-plugins --out docs/benchmarks.md
	$(BENCH_AGENT) $(BENCH_BIN)/pko-bench-workspaces --out docs/benchmarks.md
	$(BENCH_AGENT) $(BENCH_BIN)/pko-bench-stacks --out docs/benchmarks.md --write-baseline docs/bench-baseline.json $(BENCH_STACKS_FLAGS)

.PHONY: bench-check
bench-check: tools pko agent-static bench-build ## short bench (Programs, and Stacks at N=3); fails when a pko-rs/PKO ratio falls >25% below docs/bench-baseline.json
	$(BENCH_BIN)/pko-bench --check docs/bench-baseline.json --counts 1000 --starts 3 --quiet-seconds 3
	$(BENCH_BIN)/pko-bench-stacks --short --check docs/bench-baseline.json

.PHONY: chaos
chaos: tools policies build ## chaos and hostile-load run (webhook storm, invented methods, hostile module server, hostile agent, kill -9, apiserver restart, leader kill): figures to docs/reliability.md
	$(CARGO_TARGET_DIR)/debug/pko-chaos --out docs/reliability.md

# The container images ship exactly what the `dist*` targets leave in $(DIST_DIR); the
# Dockerfile runs these targets and copies nothing else (tests/tests/it/deploy.rs checks both).
DIST_DIR ?= dist
# The cargo profile of the binaries `dist` builds: `release`, which the images, `make bench` and
# the Dockerfile ship. `make test` builds its test images from `dev` (see `test`).
DIST_PROFILE ?= release
DIST_PROFILE_DIR = $(if $(filter dev,$(DIST_PROFILE)),debug,$(DIST_PROFILE))
DIST_PROFILE_FLAG = $(if $(filter release,$(DIST_PROFILE)),--release,--profile $(DIST_PROFILE))

.PHONY: dist
dist: agent-target ## static release binaries the container images ship, into $(DIST_DIR)/
	# One invocation: the dependencies both binaries share are compiled once, in parallel.
	$(CARGO) build --locked $(DIST_PROFILE_FLAG) -p pko-operator -p pko-agent --bin pko-operator --bin pko-agent --target $(AGENT_TARGET)
	install -D -m 0755 $(CARGO_TARGET_DIR)/$(AGENT_TARGET)/$(DIST_PROFILE_DIR)/pko-operator $(DIST_DIR)/pko-operator
	install -D -m 0755 $(CARGO_TARGET_DIR)/$(AGENT_TARGET)/$(DIST_PROFILE_DIR)/pko-agent $(DIST_DIR)/pko-agent

.PHONY: dist-policies
dist-policies: ## the admission policy bundle the container image ships, into $(DIST_DIR)/
	tools/policies.sh $(CACHE_DIR)/policies/dist.tar.gz
	install -D -m 0644 $(CACHE_DIR)/policies/dist.tar.gz $(DIST_DIR)/policies.tar.gz

# The example transform plugins the image ships (built like `make plugins`; the hostile test
# guests stay out). ProgramTransforms load them with `file:///usr/local/share/pko-rs/plugins/…`.
.PHONY: dist-plugins
dist-plugins: plugins ## the example transform plugins the container image ships, into $(DIST_DIR)/plugins/
	install -D -m 0644 $(PKO_PLUGINS_DIR)/default_tags.wasm $(DIST_DIR)/plugins/default_tags.wasm
	install -D -m 0644 $(PKO_PLUGINS_DIR)/naming_policy.wasm $(DIST_DIR)/plugins/naming_policy.wasm
	install -D -m 0644 $(PKO_PLUGINS_DIR)/resource_allowlist.wasm $(DIST_DIR)/plugins/resource_allowlist.wasm

# The agent image's pulumi CLI and YAML language host (static Go binaries, `tools/build.sh pulumi`).
.PHONY: dist-pulumi
dist-pulumi: go-toolchain ## the pulumi CLI and YAML language host the agent image ships, into $(DIST_DIR)/
	tools/build.sh pulumi
	install -D -m 0755 "$$(tools/build.sh dir pulumi)/pulumi" $(DIST_DIR)/pulumi
	install -D -m 0755 "$$(tools/build.sh dir pulumi)/pulumi-language-yaml" $(DIST_DIR)/pulumi-language-yaml

# The images have no base: the users 65532 (nonroot) and 1000 (pulumi, as which restricted
# workspace pods run) and the CA bundle of Debian's ca-certificates (https plugin sources,
# pulumi) are all they carry besides the binaries.
#
# The agent image also answers the pod PKO's manager lays out (`cp /agent /tini /share/`, then
# `sh -c "/share/agent init … && ln -s …"`, then `/share/tini /share/agent -- serve …`):
# `/agent` and `/tini` are links to the agent (which acts as tini when called so), and `sh`,
# `cp` and `ln` are Debian's static busybox (busybox-static, installed by `tools/image.sh
# busybox` when missing), in agent-root/, copied over the image's root.
.PHONY: dist-rootfs
dist-rootfs: ## /etc/passwd, /etc/group, the CA bundle, /tmp and the user's home the container images ship, plus the agent image's /agent, /tini and busybox (sh, cp, ln), into $(DIST_DIR)/
	install -D -m 0644 tools/rootfs/passwd $(DIST_DIR)/passwd
	install -D -m 0644 tools/rootfs/group $(DIST_DIR)/group
	install -D -m 0644 /etc/ssl/certs/ca-certificates.crt $(DIST_DIR)/ca-certificates.crt
	install -d -m 1777 $(DIST_DIR)/tmp
	install -d -m 1777 $(DIST_DIR)/home/nonroot
	tools/image.sh busybox
	install -d -m 0755 $(DIST_DIR)/agent-root/bin $(DIST_DIR)/agent-root/
	install -m 0755 /bin/busybox $(DIST_DIR)/agent-root/bin/busybox
	for applet in sh cp ln; do ln -sfn busybox $(DIST_DIR)/agent-root/bin/$$applet; done
	ln -sfn usr/local/bin/pko-agent $(DIST_DIR)/agent-root/agent
	ln -sfn usr/local/bin/pko-agent $(DIST_DIR)/agent-root/tini

# `make image`: the operator and agent images as OCI layouts, assembled with umoci (no
# container daemon); the tests unpack and run them with runc (tests/tests/it/image.rs).
export PKO_IMAGE_DIR ?= $(CACHE_DIR)/images

.PHONY: test-deps
test-deps: ## Debian packages the integration tests use as real servers: git, openssh-server (installed when missing)
	tools/test-deps.sh

.PHONY: image-deps
image-deps:
	tools/image.sh deps

.PHONY: image
image: image-deps dist dist-policies dist-plugins dist-pulumi dist-rootfs ## operator and agent images (OCI layouts, digests printed) into $(PKO_IMAGE_DIR)
	tools/image.sh build $(DIST_DIR) $(PKO_IMAGE_DIR)

.PHONY: clean-cache
clean-cache: ## remove built tools and the Rust target dirs
	rm -rf $(CACHE_DIR)
