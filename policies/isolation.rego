# METADATA
# title: Namespace isolation
# description: |
#   Nothing an object references leaves its namespace or the namespace's allowances:
#   - Secret references naming another namespace (PKO's deprecated `secret.namespace`), and
#     references to the operator's own environment or file system, shared by every tenant;
#   - Workspace flux URLs (a Workspace's or a Stack's workspace template) that point at another
#     namespace's Program on the operator's file server;
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

# Flux URLs of Programs served by our file server: <scheme>://<host>/programs/<ns>/<name>/...
_violations contains _v(
	"cross-namespace-program",
	concat(".", [ws.path, "flux.url"]),
	concat("", ["points at a Program of namespace ", target, "; only Programs of namespace ", lib.namespace, " may be used"]),
) if {
	some ws in lib.workspace_specs
	target := program_namespace(ws.spec.flux.url)
	target != lib.namespace
}

program_namespace(url) := parts[4] if {
	parts := split(url, "/")
	count(parts) > 5
	endswith(parts[0], ":")
	parts[1] == ""
	file_server_host(parts[2])
	parts[3] == "programs"
}

# Without a configured host list every host counts: the path shape is the file server's own.
file_server_host(_) if not data.tenancy.fileServerHosts

file_server_host(_) if count(data.tenancy.fileServerHosts) == 0

file_server_host(host) if host in data.tenancy.fileServerHosts

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

# Transform modules are pinned by sha256; the digest must be allowed for the namespace.
_violations contains _pv(
	"transform-module",
	"spec.sha256",
	concat("", ["transform module sha256:", digest, " is not allowed in namespace ", lib.namespace, " (TenancyPolicy ", p.name, ")"]),
	p,
) if {
	lib.is_program_transform
	digest := normalize_digest(lib.object.spec.sha256)
	some p in lib.tenancy_policies
	is_array(p.allowedTransformDigests)
	not digest in {normalize_digest(d) | some d in p.allowedTransformDigests}
}

normalize_digest(d) := lower(trim_prefix(d, "sha256:"))
