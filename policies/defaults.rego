# METADATA
# title: Defaults stored at admission (entrypoint pko/defaults/patch)
# description: |
#   A JSON Patch for a Workspace being created or updated, so the defaults PKO applies in
#   memory on every reconcile are stored in the object instead:
#   - spec.securityProfile: restricted;
#   - spec.resources.requests: memory 64Mi and cpu 100m, each only when neither its request
#     nor its limit is set (Kubernetes defaults a missing request to the limit);
#   - with the restricted profile and a pod template: the pod's runAsNonRoot true and seccomp
#     RuntimeDefault, and every container's allowPrivilegeEscalation false and capabilities
#     drop ALL, each only when unset.
#   Anything else gets an empty patch.
package pko.defaults

import data.pko.lib

default_requests := {"memory": "64Mi", "cpu": "100m"}

spec := lib.object.spec

applies if {
	lib.checked
	lib.is_workspace
}

# Operations in order: every parent is added before its children.
patch := array.concat(
	array.concat(_profile, _resources),
	array.concat(_pod, _containers),
) if applies

patch := [] if not applies

_add(path, value) := {"op": "add", "path": path, "value": value}

_profile := [_add("/spec/securityProfile", "restricted")] if not spec.securityProfile

_profile := [] if spec.securityProfile

_missing_requests := {name: value |
	some name, value in default_requests
	not spec.resources.requests[name]
	not spec.resources.limits[name]
}

_resources := [] if count(_missing_requests) == 0

_resources := [_add("/spec/resources", {"requests": _missing_requests})] if {
	count(_missing_requests) > 0
	not spec.resources
}

_resources := [_add("/spec/resources/requests", _missing_requests)] if {
	count(_missing_requests) > 0
	spec.resources
	not spec.resources.requests
}

_resources := [_add(concat("/", ["/spec/resources/requests", name]), value) |
	some name, value in _missing_requests
] if {
	count(_missing_requests) > 0
	spec.resources.requests
}

restricted if object.get(spec, "securityProfile", "restricted") == "restricted"

pod := spec.podTemplate.spec

_pod_defaults := {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}}

_pod := [] if not restricted

_pod := [] if not pod

_pod := [_add("/spec/podTemplate/spec/securityContext", _pod_defaults)] if {
	restricted
	pod
	not pod.securityContext
}

_pod := [_add(concat("/", ["/spec/podTemplate/spec/securityContext", name]), value) |
	some name, value in _pod_defaults
	not _has(pod.securityContext, name)
] if {
	restricted
	pod.securityContext
}

_container_defaults := {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}

_containers := [] if not restricted

_containers := [] if not pod

_containers := [op |
	some field in lib.container_fields
	some i, c in pod[field]
	some op in _container_ops(concat("/", ["/spec/podTemplate/spec", field, format_int(i, 10), "securityContext"]), c)
] if {
	restricted
	pod
}

_container_ops(path, c) := [_add(path, _container_defaults)] if not c.securityContext

_container_ops(path, c) := array.concat(
	[_add(concat("/", [path, "allowPrivilegeEscalation"]), false) | not _has(c.securityContext, "allowPrivilegeEscalation")],
	_capability_ops(concat("/", [path, "capabilities"]), c.securityContext),
) if c.securityContext

_capability_ops(path, sc) := [_add(path, {"drop": ["ALL"]})] if not sc.capabilities

_capability_ops(path, sc) := [_add(concat("/", [path, "drop"]), ["ALL"])] if {
	sc.capabilities
	not sc.capabilities.drop
}

_capability_ops(_, sc) := [] if sc.capabilities.drop

_has(obj, key) if _ = obj[key]
