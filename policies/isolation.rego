# METADATA
# title: Namespace isolation
# description: |
#   Nothing an object references leaves its namespace or the namespace's allowances:
#   - Secret references naming another namespace (PKO's deprecated `secret.namespace`), and
#     references to the operator's own environment or file system, shared by every tenant;
#   - Workspace flux URLs (a Workspace's or a Stack's workspace template) that point at another
#     namespace's Program on the operator's file server (http or https, one of
#     data.tenancy.fileServer's hosts and ports, path /programs/<namespace>/...). Only the parts
#     the webhook parsed (input.pko.urls, the WHATWG URL standard, like the agent's client) are
#     used; a URL the parser rejects is refused (invalid-flux-url), and so is one the webhook
#     did not parse (unparsed-flux-url: fail closed);
#   - service accounts, workspace images and transform module digests outside the allowances
#     of the TenancyPolicies selecting the namespace (no allowance list = no restriction).
package pko.isolation

import data.pko.lib

violations contains v if {
	lib.checked
	some v in _violations
}

_v(code, path, message) := lib.violation("isolation", code, path, message)

# With the TenancyPolicy that made the violation, so its enforcement action applies.
_pv(code, path, message, policy) := object.union(_v(code, path, message), {"tenancyPolicy": policy.name})

# Every ResourceRef of a Stack (envRefs, secretsRef, gitAuth).
resource_refs contains {"ref": ref, "path": concat(".", ["spec.envRefs", key])} if {
	lib.is_stack
	some key, ref in lib.object.spec.envRefs
}

resource_refs contains {"ref": ref, "path": concat(".", ["spec.secretsRef", key])} if {
	lib.is_stack
	some key, ref in lib.object.spec.secretsRef
}

git_auth_refs := [
	["accessToken"],
	["sshAuth", "sshPrivateKey"],
	["sshAuth", "password"],
	["basicAuth", "userName"],
	["basicAuth", "password"],
	["githubApp", "appID"],
	["githubApp", "installationID"],
	["githubApp", "privateKey"],
]

resource_refs contains {"ref": ref, "path": concat(".", array.concat(["spec.gitAuth"], fields))} if {
	lib.is_stack
	some fields in git_auth_refs
	ref := object.get(lib.object.spec.gitAuth, fields, null)
	is_object(ref)
}

_violations contains _v(
	"cross-namespace-secret",
	concat(".", [r.path, "secret.namespace"]),
	concat("", ["refers to a Secret in namespace ", r.ref.secret.namespace, "; only Secrets of namespace ", lib.namespace, " may be used"]),
) if {
	some r in resource_refs
	is_string(r.ref.secret.namespace)
	r.ref.secret.namespace != ""
	r.ref.secret.namespace != lib.namespace
}

_violations contains _v(
	"operator-local-ref",
	concat(".", [r.path, "type"]),
	concat("", ["a ", r.ref.type, " reference reads the operator's own environment or file system, which every tenant shares; use a Secret or a literal"]),
) if {
	some r in resource_refs
	r.ref.type in {"Env", "FS"}
}

# Workspace flux URLs, each with the path of its field.
flux_urls contains {"url": ws.spec.flux.url, "path": concat(".", [ws.path, "flux.url"])} if {
	some ws in lib.workspace_specs
}

# The parts of a flux URL, as the webhook parsed it (input.pko.urls, keyed by the raw string)
# exactly like the agent's HTTP client does (WHATWG URL standard). Only these parts are used:
# the raw string has countless spellings of one place (case, default ports, IPv4 forms, dot
# and empty segments, percent-encoding, userinfo, backslashes, tabs, ...).
parsed_url(url) := u if {
	u := input.pko.urls[url]
	u.valid == true
	is_string(u.scheme)
	is_string(u.host)
	_is_port(u.port)
	is_array(u.segments)
	every segment in u.segments {
		is_string(segment)
	}
}

# A scheme without a default port (not http or https) may have none.
_is_port(p) if is_number(p)

_is_port(null)

# A URL the parser rejects, with its message.
url_error(url) := e if {
	input.pko.urls[url].valid == false
	e := _error_text(object.get(input.pko.urls[url], "error", null))
}

_error_text(e) := e if is_string(e)

_error_text(e) := "rejected by the URL parser" if not is_string(e)

# Programs served by our file server: http(s)://<host>:<port>/programs/<namespace>/<name>/...
_violations contains _v(
	"cross-namespace-program",
	f.path,
	concat("", ["points at a Program of namespace ", target, "; only Programs of namespace ", lib.namespace, " may be used"]),
) if {
	some f in flux_urls
	target := program_namespace(parsed_url(f.url))
	target != lib.namespace
}

_violations contains _v(
	"invalid-flux-url",
	f.path,
	concat("", ["is not a URL the workspace can fetch: ", url_error(f.url)]),
) if {
	some f in flux_urls
}

# Fail closed: a URL the webhook did not parse (or parsed into something unusable) cannot be
# checked.
_violations contains _v(
	"unparsed-flux-url",
	f.path,
	"the admission webhook did not parse this URL, so where it points cannot be checked",
) if {
	some f in flux_urls
	not parsed_url(f.url)
	not url_error(f.url)
}

program_namespace(u) := u.segments[1] if {
	on_file_server(u)
	count(u.segments) >= 2
	u.segments[0] == "programs"
}

on_file_server(u) if {
	u.scheme in {"http", "https"}
	file_server_host(u.host)
	file_server_port(u.port)
}

# A file-server URL under /programs is an artifact path, /programs/{ns}/{name}/{gen}[.tar.gz]
# (as the file server routes it), or nothing: a segment such as `..%2fteam-b` is harmless to
# the file server but a proxy that unescapes %2F in front of it would read another path.
_violations contains _v(
	"program-url-path",
	f.path,
	"is not an artifact path of the file server: /programs/<namespace>/<name>/<generation>[.tar.gz], each a DNS name or a number",
) if {
	some f in flux_urls
	u := parsed_url(f.url)
	on_file_server(u)
	count(u.segments) > 0
	u.segments[0] == "programs"
	not artifact_path(u.segments)
}

# The segments are percent-decoded: a decoded `/`, `.` run or `%` is no DNS name.
artifact_path(s) if {
	count(s) == 4
	_dns_label(s[1])
	_dns_subdomain(s[2])
	_generation(s[3])
}

_dns_label(s) if {
	count(s) <= 63
	regex.match(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`, s)
}

_dns_subdomain(s) if {
	count(s) <= 253
	every part in split(s, ".") {
		_dns_label(part)
	}
}

_generation(s) if {
	g := trim_suffix(s, ".tar.gz")
	count(g) <= 19
	regex.match(`^[0-9]+$`, g)
}

# data.tenancy.fileServer: the hosts and ports the file server answers on, normalised like
# parsed URLs. Without hosts every host counts; without ports every port does.
file_server_host(_) if not _configured("hosts")

file_server_host(host) if host in data.tenancy.fileServer.hosts

# An IPv4-mapped IPv6 address (::ffff:0:0/96) connects to its IPv4 address.
file_server_host(host) if mapped_ipv4(host) in data.tenancy.fileServer.hosts

file_server_port(_) if not _configured("ports")

file_server_port(port) if port in data.tenancy.fileServer.ports

_configured(key) if count(data.tenancy.fileServer[key]) > 0

# The URL standard writes an IPv4-mapped address in hex (::ffff:a60:c for 10.96.0.12); the
# dotted form (::ffff:10.96.0.12) is read too.
mapped_ipv4(host) := ipv4 if {
	startswith(host, "::ffff:")
	ipv4 := substring(host, 7, -1)
	parts := split(ipv4, ".")
	count(parts) == 4
	every part in parts {
		_decimal_octet(part)
	}
}

mapped_ipv4(host) := concat(".", [_high(hi), _low(hi), _high(lo), _low(lo)]) if {
	startswith(host, "::ffff:")
	groups := split(substring(host, 7, -1), ":")
	count(groups) == 2
	hi := _hex16(groups[0])
	lo := _hex16(groups[1])
}

_decimal_octet(s) if {
	count(s) > 0
	count(s) <= 3
	every i in numbers.range(0, count(s) - 1) {
		_hex_digits[substring(s, i, 1)] < 10
	}
	to_number(s) <= 255
}

_hex_digits := {
	"0": 0, "1": 1, "2": 2, "3": 3, "4": 4, "5": 5, "6": 6, "7": 7,
	"8": 8, "9": 9, "a": 10, "b": 11, "c": 12, "d": 13, "e": 14, "f": 15,
}

# A 16-bit group of lowercase hex digits, as a number.
_hex16(s) := n if {
	count(s) > 0
	count(s) <= 4
	indexes := numbers.range(0, count(s) - 1)
	every i in indexes {
		_hex_digits[substring(s, i, 1)]
	}
	n := sum([v | some i in indexes; v := _hex_digits[substring(s, i, 1)] * _hex_weights[(count(s) - 1) - i]])
}

_hex_weights := [1, 16, 256, 4096]

_high(n) := format_int((n - (n % 256)) / 256, 10)

_low(n) := format_int(n % 256, 10)

# Service accounts. `default` (the CRD default) is always allowed: it is the namespace's own.
service_accounts contains {"name": ws.spec.serviceAccountName, "path": concat(".", [ws.path, "serviceAccountName"])} if {
	some ws in lib.workspace_specs
}

service_accounts contains {"name": lib.object.spec.serviceAccountName, "path": "spec.serviceAccountName"} if lib.is_stack

service_accounts contains {"name": pod.spec[field], "path": concat(".", [pod.path, field])} if {
	some pod in lib.pod_specs
	some field in ["serviceAccountName", "serviceAccount"]
}

_violations contains _pv(
	"service-account",
	sa.path,
	concat("", ["service account ", sa.name, " is not allowed in namespace ", lib.namespace, " (TenancyPolicy ", p.name, ")"]),
	p,
) if {
	some sa in service_accounts
	not sa.name in {"", "default"}
	some p in lib.tenancy_policies
	is_array(p.allowedServiceAccounts)
	not sa.name in p.allowedServiceAccounts
}

# Images: the workspace image and every container image of the pod templates.
images contains {"image": ws.spec.image, "path": concat(".", [ws.path, "image"])} if {
	some ws in lib.workspace_specs
}

images contains {"image": c.container.image, "path": concat(".", [c.path, "image"])} if {
	some c in lib.containers
}

_violations contains _pv(
	"image",
	img.path,
	concat("", ["image ", img.image, " is not allowed in namespace ", lib.namespace, " (allowed prefixes: ", concat(", ", p.allowedImagePrefixes), "; TenancyPolicy ", p.name, ")"]),
	p,
) if {
	some img in images
	some p in lib.tenancy_policies
	is_array(p.allowedImagePrefixes)
	not _has_prefix(img.image, p.allowedImagePrefixes)
}

_has_prefix(s, prefixes) if {
	some prefix in prefixes
	startswith(s, prefix)
}

# Transform modules are pinned by sha256: the digest must be allowed for the namespace, or the
# module must be an OCI artifact from an allowed registry, verified with allowed keys.
_violations contains _pv(
	"transform-module",
	"spec.sha256",
	concat("", ["transform module sha256:", digest, " is not allowed in namespace ", lib.namespace, " (", _transform_rules(p), "; TenancyPolicy ", p.name, ")"]),
	p,
) if {
	lib.is_program_transform
	digest := normalize_digest(object.get(lib.object, ["spec", "sha256"], ""))
	some p in lib.tenancy_policies
	_restricts_transforms(p)
	not _transform_allowed(p, digest)
}

_restricts_transforms(p) if is_array(p.allowedTransformDigests)

_restricts_transforms(p) if _restricts_sources(p)

_restricts_sources(p) if is_array(p.allowedTransformRegistries)

_restricts_sources(p) if is_array(p.allowedTransformKeys)

_transform_allowed(p, digest) if {
	is_array(p.allowedTransformDigests)
	digest in {normalize_digest(d) | some d in p.allowedTransformDigests}
}

_transform_allowed(p, _) if {
	_restricts_sources(p)
	reference := lib.object.spec.source.oci.reference
	_registry_allowed(p, reference)
	_keys_allowed(p)
}

_registry_allowed(p, _) if not is_array(p.allowedTransformRegistries)

_registry_allowed(p, reference) if {
	is_array(p.allowedTransformRegistries)
	name := oci_name(reference)
	some prefix in p.allowedTransformRegistries
	_under(name, lower(trim_suffix(prefix, "/")))
}

_under(name, prefix) if name == prefix

_under(name, prefix) if startswith(name, concat("", [prefix, "/"]))

_keys_allowed(p) if not is_array(p.allowedTransformKeys)

_keys_allowed(p) if {
	is_array(p.allowedTransformKeys)
	keys := lib.object.spec.verify.cosign.keys
	count(keys) > 0
	allowed := {normalize_key(k) | some k in p.allowedTransformKeys}
	every k in keys {
		normalize_key(k) in allowed
	}
}

_transform_rules(p) := "allowed: the listed digests" if not _restricts_sources(p)

_transform_rules(p) := concat("", [
	"allowed: the listed digests, or OCI artifacts from ",
	_registries_text(p), " verified with ", _keys_text(p),
]) if _restricts_sources(p)

_registries_text(p) := concat(", ", p.allowedTransformRegistries) if is_array(p.allowedTransformRegistries)

_registries_text(p) := "any registry" if not is_array(p.allowedTransformRegistries)

_keys_text(p) := sprintf("one of %d allowed keys listed inline in verify.cosign.keys", [count(p.allowedTransformKeys)]) if is_array(p.allowedTransformKeys)

_keys_text(p) := "any key or none" if not is_array(p.allowedTransformKeys)

# The repository name of an OCI reference, as the operator parses it: the host lowercased, the
# tag (after a ':' in the last path segment) dropped.
oci_name(reference) := name if {
	parts := split(reference, "/")
	n := count(parts)
	last := split(parts[n - 1], ":")[0]
	name := lower(concat("/", array.concat(array.slice(parts, 0, n - 1), [last])))
}

# A PEM key without its line breaks and spaces, so that the same key compares equal however it
# was wrapped.
normalize_key(k) := replace(replace(replace(replace(k, "\r", ""), "\n", ""), " ", ""), "\t", "")

normalize_digest(d) := lower(trim_prefix(d, "sha256:"))

# A Stack's fluxSource reference becomes an apiserver request path in the operator: only
# `group/version` (a DNS-subdomain group and a Kubernetes version), a Flux source kind that
# carries status.artifact, and a DNS-1123 name. Anything else (a second `/`, `?`, `#`, `%`,
# dot segments, Secrets, Programs) could read another namespace's objects.
flux_source_kinds := {"GitRepository", "OCIRepository", "Bucket", "HelmChart", "HelmRepository", "ExternalArtifact"}

_flux_ref := lib.object.spec.fluxSource.sourceRef if lib.is_stack

_violations contains _v(
	"invalid-flux-source-ref",
	"spec.fluxSource.sourceRef.apiVersion",
	"must be group/version (a DNS subdomain, then a version such as v1 or v1beta2)",
) if {
	not _flux_api_version_ok(object.get(_flux_ref, "apiVersion", null))
}

_violations contains _v(
	"invalid-flux-source-ref",
	"spec.fluxSource.sourceRef.kind",
	concat("", ["must be one of ", concat(", ", sort(flux_source_kinds))]),
) if {
	not object.get(_flux_ref, "kind", null) in flux_source_kinds
}

_violations contains _v(
	"invalid-flux-source-ref",
	"spec.fluxSource.sourceRef.name",
	"must be a DNS-1123 subdomain",
) if {
	not _dns_subdomain_ok(object.get(_flux_ref, "name", null))
}

_flux_api_version_ok(v) if {
	is_string(v)
	parts := split(v, "/")
	count(parts) == 2
	_dns_subdomain_ok(parts[0])
	regex.match(`^v[1-9][0-9]*((alpha|beta)[1-9][0-9]*)?$`, parts[1])
}

_dns_subdomain_ok(s) if {
	is_string(s)
	_dns_subdomain(s)
}
