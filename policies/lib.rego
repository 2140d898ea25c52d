# METADATA
# title: Shared helpers of the pko-rs admission policies
# description: |
#   What the other packages need from the AdmissionReview (input) and the tenancy data
#   (data.tenancy): which objects are checked (every create and update but one that only
#   removes finalizers from an object being deleted: its spec must equal oldObject's), the
#   workspace specs and pod templates they declare, and the TenancyPolicies that select the
#   request's namespace.
package pko.lib

namespace := input.request.namespace

object := input.request.object

group := input.request.kind.group

kind := input.request.kind.kind

# Only writes carry an object, and every CREATE and UPDATE is checked but one: an update of an
# object already being deleted (metadata.deletionTimestamp) that leaves its spec as it was
# (request.oldObject.spec), so that finalizers can always be removed, even from objects
# admitted before a policy changed. A spec that changes is checked, being deleted or not:
# otherwise a tenant could add its own finalizer to an admitted object, delete it, and then
# give it any spec while the finalizer holds it.
checked if input.request.operation == "CREATE"

checked if {
	input.request.operation == "UPDATE"
	not _finalizing
}

# Being deleted, and the spec unchanged: only metadata (finalizers) changes.
_finalizing if {
	object.metadata.deletionTimestamp
	object.spec == input.request.oldObject.spec
}

is_workspace if {
	group == "auto.pulumi.com"
	kind == "Workspace"
}

is_stack if {
	group == "pulumi.com"
	kind == "Stack"
}

is_program_transform if {
	group == "pko-rs.dev"
	kind == "ProgramTransform"
}

# The workspace specs a tenant declares: a Workspace's own spec, or the workspace template of a
# Stack. `strict` is true where the object is final (a Workspace, after the mutating webhook
# stored its defaults): there, security fields must be set, not only be free of bad values. A
# Stack's template is merged into a Workspace that gets its own defaults and its own check.
workspace_specs contains {"spec": object.spec, "path": "spec", "strict": true} if is_workspace

workspace_specs contains {"spec": spec, "path": "spec.workspaceTemplate.spec", "strict": false} if {
	is_stack
	spec := object.spec.workspaceTemplate.spec
}

pod_specs contains {"spec": spec, "path": concat(".", [ws.path, "podTemplate.spec"]), "strict": ws.strict} if {
	some ws in workspace_specs
	spec := ws.spec.podTemplate.spec
}

container_fields := ["containers", "initContainers", "ephemeralContainers"]

# Every container of every pod template, init and ephemeral ones included.
containers contains {"container": c, "pod": pod, "path": index_path(concat(".", [pod.path, field]), i)} if {
	some pod in pod_specs
	some field in container_fields
	some i, c in pod.spec[field]
}

# `a.b[3]`
index_path(prefix, i) := concat("", [prefix, "[", format_int(i, 10), "]"])

# The TenancyPolicies that select the request's namespace.
tenancy_policies contains p if {
	some p in data.tenancy.policies
	namespace in p.namespaces
}

exempt_from_restricted if {
	some p in tenancy_policies
	p.exemptFromRestricted == true
}

violation(policy, code, path, message) := {
	"policy": policy,
	"code": code,
	"path": path,
	"message": message,
}
