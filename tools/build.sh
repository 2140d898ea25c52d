#!/usr/bin/env bash
# Builds the real components (kube-apiserver, etcd, kubectl, opa, pulumi, pulumi-language-yaml,
# the pulumi-resource-kubernetes provider) from Go modules into a cache keyed by the pinned versions. Idempotent: a component whose
# binary already exists in its versioned folder is skipped.
#
# `pko` builds PKO v2.9.0's manager and agent (the peer `make bench` measures against, and the
# agent the switch-over and interoperability tests run) from its source tarball: $PKO_SRC_TARBALL, by default ../shared/reference/pko-v2.9.0-src.tar.gz next to the
# repository. Its folder is keyed by the version and the tarball's sha256. `all` leaves it out.
#
# `node` builds the test node the end-to-end tests run (kubelet, containerd, CNI plugins,
# kube-proxy, CoreDNS, kube-controller-manager, kube-scheduler, kube-router's NetworkPolicy
# controller, crictl) and installs runc, nftables, iptables and ipset from Debian when missing.
#
# `kstatus` builds tools/kstatus: sigs.k8s.io/cli-utils' kstatus (status.Compute, what Flux's
# `wait` and Argo CD read an object's health with) behind a JSON-in, JSON-out command the tests
# run on the objects they read from the apiserver.
#
#   tools/build.sh kube|opa|pulumi|pko|helm|oci|promtool|kstatus|node|all  prints nothing but progress; exits non-zero on failure
#   tools/build.sh dir kube|opa|pulumi|pko|helm|oci|promtool|kstatus|node  prints the bin folder of a component
set -euo pipefail
# shellcheck source=tools/apt.sh
. "$(dirname "$0")/apt.sh"

here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local CGO_ENABLED=0
cache=${PKO_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pko-rs/tools}

K8S_VERSION=1.34.2
ETCD_VERSION=3.6.4
OPA_VERSION=1.22.3
PULUMI_VERSION=3.274.1
PULUMI_YAML_VERSION=1.25.0
# The provider is pinned by tools/pulumi-kubernetes/go.mod (a commit of the v4 line: the newest
# the module proxy serves); this is the version it reports.
PULUMI_KUBERNETES_VERSION=4.0.0-f47bc2d6f199
PKO_VERSION=2.9.0
# The OCI registry and cosign the signed-plugin tests push to and sign with.
REGISTRY_VERSION=3.1.2
COSIGN_VERSION=2.6.5
# Prometheus's promtool, whose `test rules` evaluates PromQL (Prometheus's own engine) over
# series the tests scrape from the operator. Prometheus 3.x is served by the Go module proxy as
# github.com/prometheus/prometheus v0.3XX.Y (3.16.0 = v0.316.0).
PROMETHEUS_VERSION=3.16.0
PROMETHEUS_MODULE_VERSION=v0.316.0
# Helm is pinned by tools/helm/go.mod (helm.sh/helm/v3); this is the version it reports.
HELM_VERSION=3.22.0
# The Kubernetes version `helm template` and `helm lint` assume without a cluster, as Helm's own
# Makefile stamps it: one above the major of its client-go modules (v0.37 -> 1.37).
HELM_KUBE_VERSION=1.37
# kstatus is pinned by tools/kstatus/go.mod (sigs.k8s.io/cli-utils); this is that version.
KSTATUS_VERSION=0.37.2
# The test node (`node`): kubelet, kube-proxy, kube-controller-manager and kube-scheduler come
# from the same Kubernetes module as the apiserver (K8S_VERSION, by tools/node/go.mod); the
# rest are built from their modules at these versions.
CONTAINERD_VERSION=2.4.2
CNI_PLUGINS_VERSION=1.10.0
# CoreDNS is built from tools/node/coredns (its own main with only the plugins the node uses).
COREDNS_VERSION=1.15.0
# NetworkPolicies are enforced by kube-router's firewall (iptables filter rules and ipsets): the
# only enforcer the module proxy serves that needs no nftables `queue` statement, which kernels
# built without CONFIG_NFT_QUEUE lack (kube-network-policies needs it). v2.1.0 is the only
# version served; it runs in the test node's private namespaces only.
KUBE_ROUTER_VERSION=2.1.0
CRICTL_VERSION=1.37.0
PKO_SRC_TARBALL=${PKO_SRC_TARBALL:-$here/../../shared/reference/pko-v$PKO_VERSION-src.tar.gz}

# The folder's name carries every version and a hash of the helper module's go.sum, so a bump
# builds into a new folder and never reuses a stale binary.
key() {
  local mod=$1 sum
  sum=$( (cat "$here/$mod/go.mod" "$here/$mod/go.sum" 2>/dev/null || true) | sha256sum | cut -c1-12)
  echo "$sum"
}
dir_for() {
  case $1 in
    kube) echo "$cache/kube-v$K8S_VERSION-etcd-v$ETCD_VERSION-$(key kube)" ;;
    opa) echo "$cache/opa-v$OPA_VERSION" ;;
    pulumi) echo "$cache/pulumi-v$PULUMI_VERSION-yaml-v$PULUMI_YAML_VERSION-$(key pulumi)" ;;
    pko) echo "$cache/pko-v$PKO_VERSION-$(pko_src_sum)" ;;
    oci) echo "$cache/registry-v$REGISTRY_VERSION-cosign-v$COSIGN_VERSION" ;;
    helm) echo "$cache/helm-v$HELM_VERSION-k$HELM_KUBE_VERSION-$(key helm)" ;;
    promtool) echo "$cache/promtool-v$PROMETHEUS_VERSION" ;;
    kstatus) echo "$cache/kstatus-v$KSTATUS_VERSION-$(kstatus_key)" ;;
    node) echo "$cache/node-k$K8S_VERSION-c$CONTAINERD_VERSION-cni$CNI_PLUGINS_VERSION-dns$COREDNS_VERSION-kr$KUBE_ROUTER_VERSION-cri$CRICTL_VERSION-$(node_key)" ;;
    *) echo "unknown component: $1" >&2; exit 2 ;;
  esac
}

kstatus_key() {
  cat "$here/kstatus/go.mod" "$here/kstatus/go.sum" "$here/kstatus/main.go" | sha256sum | cut -c1-12
}

node_key() {
  (cat "$here/node/go.mod" "$here/node/go.sum" "$here/node/coredns/go.mod" \
    "$here/node/coredns/go.sum" "$here/node/coredns/main.go" "$here/node/pause/main.go" 2>/dev/null || true) |
    sha256sum | cut -c1-12
}

require_pko_src() {
  if [[ ! -f $PKO_SRC_TARBALL ]]; then
    echo "PKO v$PKO_VERSION source tarball not found: $PKO_SRC_TARBALL" >&2
    echo "set PKO_SRC_TARBALL to the path of pko-v$PKO_VERSION-src.tar.gz" >&2
    exit 1
  fi
}
pko_src_sum() {
  sha256sum "$PKO_SRC_TARBALL" | cut -c1-12
}

# PKO v2.9.0's manager (`operator/cmd`) and agent (`agent`), built from its source in a scratch
# folder (every dependency comes from the Go module proxy by the tarball's go.sum), next to the
# CRDs they are deployed with (`crds/`, from the same tarball).
build_pko() {
  require_pko_src
  local out; out=$(dir_for pko)
  if [[ -x $out/pko-manager && -x $out/pko-agent && -d $out/crds ]]; then return; fi
  echo "building PKO v$PKO_VERSION's manager and agent into $out (cold: ~5-6 min)" >&2
  mkdir -p "$cache"
  pko_work=$(mktemp -d "$cache/.pko-src.XXXXXX")
  trap 'rm -rf "$pko_work"' EXIT
  local work=$pko_work
  tar -xzf "$PKO_SRC_TARBALL" -C "$work"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp/crds"
  (cd "$work" && go build -trimpath -ldflags "-s -w" -o "$out.tmp/pko-manager" ./operator/cmd &&
    go build -trimpath -ldflags "-s -w" -o "$out.tmp/pko-agent" ./agent)
  cp "$work"/operator/config/crd/bases/*.yaml "$out.tmp/crds/"
  rm -rf "$work"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_kube() {
  local out; out=$(dir_for kube)
  if [[ -x $out/kube-apiserver && -x $out/etcd && -x $out/kubectl ]]; then return; fi
  echo "building kube-apiserver v$K8S_VERSION, kubectl, etcd v$ETCD_VERSION into $out (cold: ~10-15 min)" >&2
  mkdir -p "$out.tmp"
  local stamp="-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${K8S_VERSION#1.}"
  stamp="${stamp%.*} -X k8s.io/component-base/version.gitTreeState=clean"
  (cd "$here/kube" &&
    go build -trimpath -ldflags "-s -w $stamp" -o "$out.tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver &&
    go build -trimpath -ldflags "-s -w $stamp" -o "$out.tmp/kubectl" k8s.io/kubernetes/cmd/kubectl &&
    go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3)
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_opa() {
  local out; out=$(dir_for opa)
  if [[ -x $out/opa ]]; then return; fi
  echo "building opa v$OPA_VERSION into $out" >&2
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath -ldflags "-s -w" "github.com/open-policy-agent/opa@v$OPA_VERSION"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

# distribution's registry (the reference OCI registry) and cosign (v2: signatures as
# `sha256-<digest>.sig` tags, the layout the operator verifies). Cold: ~4 + ~8 min on 2 cores.
build_oci() {
  local out; out=$(dir_for oci)
  if [[ -x $out/registry && -x $out/cosign ]]; then return; fi
  echo "building registry v$REGISTRY_VERSION and cosign v$COSIGN_VERSION into $out (cold: ~12 min)" >&2
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath -ldflags "-s -w" \
    "github.com/distribution/distribution/v3/cmd/registry@v$REGISTRY_VERSION"
  GOBIN="$out.tmp" go install -trimpath -ldflags "-s -w" \
    "github.com/sigstore/cosign/v2/cmd/cosign@v$COSIGN_VERSION"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

# The provider's command embeds a versioned schema that its repository generates (`go generate`)
# and does not ship, so it is built in a scratch copy of tools/pulumi-kubernetes: the command's
# files are copied from the module cache, the schema generated, then built. Its own key file
# lets it be added to (or replaced in) an existing pulumi folder without rebuilding the CLI.
build_pulumi_kubernetes() {
  local out=$1 stamp; stamp="$PULUMI_KUBERNETES_VERSION-$(key pulumi-kubernetes)"
  if [[ -x $out/pulumi-resource-kubernetes && -f $out/pulumi-resource-kubernetes.version &&
    "$(cat "$out/.pulumi-kubernetes.key" 2>/dev/null)" == "$stamp" ]]; then return; fi
  echo "building pulumi-resource-kubernetes v$PULUMI_KUBERNETES_VERSION into $out (cold: ~15 min)" >&2
  local mod=github.com/pulumi/pulumi-kubernetes/provider/v4 src work
  (cd "$here/pulumi-kubernetes" && go mod download "$mod")
  src=$(cd "$here/pulumi-kubernetes" && go list -m -f '{{.Dir}}' "$mod")
  mkdir -p "$cache"
  work=$(mktemp -d "$cache/.pulumi-kubernetes.XXXXXX")
  cp "$here/pulumi-kubernetes/go.mod" "$here/pulumi-kubernetes/go.sum" "$work/"
  mkdir "$work/cmd"
  cp "$src"/cmd/pulumi-resource-kubernetes/{main.go,generate.go,schema.json,terraform-mapping.json} "$work/cmd/"
  chmod u+w "$work"/cmd/*
  (cd "$work/cmd" && VERSION=$PULUMI_KUBERNETES_VERSION go run generate.go)
  (cd "$work" && go build -trimpath -o "$out/pulumi-resource-kubernetes.tmp" \
    -ldflags "-s -w -X $mod/pkg/version.Version=$PULUMI_KUBERNETES_VERSION" ./cmd)
  mv "$out/pulumi-resource-kubernetes.tmp" "$out/pulumi-resource-kubernetes"
  echo "$stamp" > "$out/.pulumi-kubernetes.key"
  # Where a workspace image installs it: ~/.pulumi/plugins/resource-kubernetes-v<version>/.
  echo "$PULUMI_KUBERNETES_VERSION" > "$out/pulumi-resource-kubernetes.version"
  rm -rf "$work"
}

build_pulumi() {
  local out; out=$(dir_for pulumi)
  if [[ -x $out/pulumi && -x $out/pulumi-language-yaml ]]; then build_pulumi_kubernetes "$out"; return; fi
  echo "building pulumi v$PULUMI_VERSION and pulumi-language-yaml v$PULUMI_YAML_VERSION into $out" >&2
  mkdir -p "$out.tmp"
  (cd "$here/pulumi" &&
    go build -trimpath -tags osusergo,grpcnotrace -o "$out.tmp/pulumi" \
      -ldflags "-s -w -X github.com/pulumi/pulumi/sdk/v3/go/common/version.Version=v$PULUMI_VERSION" \
      github.com/pulumi/pulumi/pkg/v3/cmd/pulumi)
  GOBIN="$out.tmp" go install -trimpath \
    -ldflags "-s -w -X github.com/pulumi/pulumi-yaml/pkg/version.Version=v$PULUMI_YAML_VERSION" \
    "github.com/pulumi/pulumi-yaml/cmd/pulumi-language-yaml@v$PULUMI_YAML_VERSION"
  rm -rf "$out" && mv "$out.tmp" "$out"
  build_pulumi_kubernetes "$out"
}

# promtool alone (not the server), without the service discovery plugins (build tag
# remove_all_sd: no cloud SDKs), so it builds in minutes. Cold: ~4 min on 2 cores.
build_promtool() {
  local out; out=$(dir_for promtool)
  if [[ -x $out/promtool ]]; then return; fi
  echo "building promtool v$PROMETHEUS_VERSION into $out (cold: ~4 min)" >&2
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath -tags remove_all_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$PROMETHEUS_VERSION" \
    "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_MODULE_VERSION"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

# Helm's CLI, which the tests run `helm lint` and `helm template` of deploy/helm/pko-rs with.
build_helm() {
  local out; out=$(dir_for helm)
  if [[ -x $out/helm ]]; then return; fi
  echo "building helm v$HELM_VERSION into $out" >&2
  mkdir -p "$out.tmp"
  local stamp="-X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION" pkg
  for pkg in pkg/lint/rules pkg/chartutil; do
    stamp+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=${HELM_KUBE_VERSION%%.*}"
    stamp+=" -X helm.sh/helm/v3/$pkg.k8sVersionMinor=${HELM_KUBE_VERSION#*.}"
  done
  (cd "$here/helm" &&
    go build -trimpath -o "$out.tmp/helm" -ldflags "-s -w $stamp" helm.sh/helm/v3/cmd/helm)
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_kstatus() {
  local out; out=$(dir_for kstatus)
  if [[ -x $out/kstatus ]]; then return; fi
  echo "building kstatus (sigs.k8s.io/cli-utils v$KSTATUS_VERSION) into $out" >&2
  mkdir -p "$out.tmp"
  (cd "$here/kstatus" && go build -trimpath -ldflags "-s -w" -o "$out.tmp/kstatus" .)
  rm -rf "$out" && mv "$out.tmp" "$out"
}

# Debian packages the test node runs: runc (containerd's runtime; crun does not run on this
# kind of machine's hybrid cgroups), nftables (the `nft` CLI kube-proxy's nftables mode
# drives), iptables and ipset (the CLIs kube-router's firewall drives).
node_deps() {
  local missing=()
  command -v runc >/dev/null || missing+=(runc)
  command -v nft >/dev/null || missing+=(nftables)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v ipset >/dev/null || missing+=(ipset)
  apt_install "${missing[@]}"
}

# One binary of the node into $out.tmp, skipped when an interrupted build already made it.
node_bin() {
  local name=$1
  shift
  if [[ -x $node_tmp/$name ]]; then return; fi
  echo "  $name" >&2
  "$@"
}

# The binaries a real node of the end-to-end tests runs (tests/src/node.rs), only those, each
# stripped. Cold: ~12-18 min on 2 cores.
build_node() {
  node_deps
  local out; out=$(dir_for node)
  if [[ -x $out/crictl ]]; then return; fi
  echo "building the test node (kubelet, kube-proxy, kube-controller-manager, kube-scheduler v$K8S_VERSION, containerd v$CONTAINERD_VERSION, CNI plugins v$CNI_PLUGINS_VERSION, CoreDNS v$COREDNS_VERSION, kube-router v$KUBE_ROUTER_VERSION, crictl v$CRICTL_VERSION) into $out" >&2
  node_tmp=$out.tmp
  mkdir -p "$node_tmp"
  local flags=(-trimpath -ldflags "-s -w")
  local stamp="-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${K8S_VERSION#1.}"
  stamp="${stamp%.*} -X k8s.io/component-base/version.gitTreeState=clean"
  local c
  for c in kubelet kube-proxy kube-controller-manager kube-scheduler; do
    node_bin "$c" bash -c 'cd "$1/node" && go build -trimpath -ldflags "-s -w $2" -o "$3/$4" "k8s.io/kubernetes/cmd/$4"' \
      _ "$here" "$stamp" "$node_tmp" "$c"
  done
  # No btrfs, devmapper or zfs snapshotter (overlayfs only), no tracing exporter.
  local ctags=no_btrfs,no_devmapper,no_zfs,no_tracing
  local cmod=github.com/containerd/containerd/v2 cstamp="-X github.com/containerd/containerd/v2/version.Version=v$CONTAINERD_VERSION"
  for c in containerd containerd-shim-runc-v2; do
    node_bin "$c" env GOBIN="$node_tmp" go install -trimpath -tags "$ctags" -ldflags "-s -w $cstamp" "$cmod/cmd/$c@v$CONTAINERD_VERSION"
  done
  # The CNI plugins in a folder of their own: containerd's CNI binary folder.
  local cni=github.com/containernetworking/plugins/plugins
  for c in main/bridge main/loopback ipam/host-local meta/portmap; do
    node_bin "cni/${c#*/}" env GOBIN="$node_tmp/cni" go install "${flags[@]}" "$cni/$c@v$CNI_PLUGINS_VERSION"
  done
  node_bin coredns bash -c 'cd "$1/node/coredns" && go build -trimpath -ldflags "-s -w" -o "$2/coredns" .' _ "$here" "$node_tmp"
  node_bin kube-router env GOBIN="$node_tmp" go install "${flags[@]}" "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@v$KUBE_ROUTER_VERSION"
  # The pod sandbox's process; the harness puts it in an image of its own.
  node_bin pause bash -c 'cd "$1/node" && go build -trimpath -ldflags "-s -w" -o "$2/pause" ./pause' _ "$here" "$node_tmp"
  node_bin crictl env GOBIN="$node_tmp" go install "${flags[@]}" "sigs.k8s.io/cri-tools/cmd/crictl@v$CRICTL_VERSION"
  rm -rf "$out" && mv "$node_tmp" "$out"
}

case ${1:-all} in
  dir)
    if [[ ${2:-} == pko ]]; then require_pko_src; fi
    dir_for "${2:?component}"
    ;;
  kube) build_kube ;;
  opa) build_opa ;;
  pulumi) build_pulumi ;;
  pko) build_pko ;;
  oci) build_oci ;;
  helm) build_helm ;;
  promtool) build_promtool ;;
  kstatus) build_kstatus ;;
  node) build_node ;;
  all) build_kube; build_opa; build_pulumi; build_helm; build_oci; build_promtool; build_kstatus; build_node ;;
  *) echo "usage: $0 kube|opa|pulumi|pko|helm|oci|promtool|kstatus|node|all | dir COMPONENT" >&2; exit 2 ;;
esac
