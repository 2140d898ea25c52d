# pko-rs: `make run` runs the operator against a local control plane; `make test` runs every test.
# Everything heavy is cached outside the clone (Rust target dir, Go caches, built tools), so a
# second run on the same machine reuses it.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

CACHE_DIR ?= $(HOME)/.cache/pko-rs
export CARGO_TARGET_DIR ?= $(CACHE_DIR)/target
export PKO_TOOLS_CACHE ?= $(CACHE_DIR)/tools
export GOTOOLCHAIN := local
export CGO_ENABLED := 0
export CARGO_TERM_COLOR ?= never
CARGO ?= cargo

.PHONY: help
help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

.PHONY: toolchain
toolchain: ## check the Rust toolchain (rust-toolchain.toml pins it; rustup installs it)
	@command -v cargo >/dev/null || { echo "cargo not found: install rustup first" >&2; exit 1; }
	@command -v go >/dev/null || { echo "go not found: Go 1.26 is needed to build tools/" >&2; exit 1; }
	@rustup show active-toolchain >/dev/null

.PHONY: tools
tools: toolchain ## build kube-apiserver, etcd and kubectl from Go modules into $(PKO_TOOLS_CACHE)
	tools/build.sh kube

.PHONY: crds
crds: ## regenerate deploy/crds from the Rust types
	$(CARGO) run -q -p pko-operator -- crdgen --out deploy/crds

.PHONY: build
build: toolchain ## build every crate and test (debug)
	$(CARGO) build --workspace --all-targets

.PHONY: lint
lint: toolchain ## rustfmt and clippy, warnings are errors
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

.PHONY: test
test: tools build lint ## every test: unit + integration on a real etcd + kube-apiserver
	$(CARGO) test --workspace --all-targets --no-fail-fast

.PHONY: run
run: tools build ## local control plane + CRDs + operator + examples/program.yaml, artifact fetched
	$(CARGO_TARGET_DIR)/debug/pko-dev run

.PHONY: bench
bench: tools ## benchmarks (release build, own target dir); results go to docs/benchmarks.md
	CARGO_TARGET_DIR=$(CACHE_DIR)/target-release $(CARGO) build --release -p pko-operator -p pko-tests --bins
	$(CACHE_DIR)/target-release/release/pko-bench --out docs/benchmarks.md

.PHONY: clean-cache
clean-cache: ## remove built tools and the Rust target dir
	rm -rf $(CACHE_DIR)
