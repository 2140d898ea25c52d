package pko.defaults_test

import data.pko.defaults

review(kind, operation, spec) := {
	"apiVersion": "admission.k8s.io/v1",
	"kind": "AdmissionReview",
	"request": {
		"uid": "1",
		"operation": operation,
		"namespace": "team-a",
		"kind": {"group": "auto.pulumi.com", "version": "v1alpha1", "kind": kind},
		"object": {"metadata": {"name": "x", "namespace": "team-a"}, "spec": spec},
	},
}

workspace(spec) := review("Workspace", "CREATE", spec)

patch_for(review_doc) := p if {
	p := defaults.patch with input as review_doc
}

# The patched spec, as the apiserver would store it.
patched(spec) := json.patch({"spec": spec}, patch_for(workspace(spec))).spec

test_empty_workspace_gets_profile_and_requests if {
	patch_for(workspace({})) == [
		{"op": "add", "path": "/spec/securityProfile", "value": "restricted"},
		{"op": "add", "path": "/spec/resources", "value": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
	]
}

test_set_values_are_kept if {
	spec := {"securityProfile": "baseline", "resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}
	patch_for(workspace(spec)) == []
}

test_missing_requests_are_added_one_by_one if {
	patched({"resources": {"requests": {"cpu": "1"}}}).resources == {"requests": {"cpu": "1", "memory": "64Mi"}}
	patched({"resources": {"limits": {"memory": "32Mi"}}}).resources == {"limits": {"memory": "32Mi"}, "requests": {"cpu": "100m"}}
	patched({"resources": {"claims": []}}).resources == {"claims": [], "requests": {"cpu": "100m", "memory": "64Mi"}}
}

test_restricted_pod_template_gets_security_contexts if {
	spec := {"podTemplate": {"spec": {
		"containers": [{"name": "pulumi"}, {"name": "sidecar", "securityContext": {"runAsUser": 1000}}],
		"initContainers": [{"name": "fetch", "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}}],
	}}}
	pod := patched(spec).podTemplate.spec
	pod.securityContext == {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}}
	pod.containers[0].securityContext == {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}
	pod.containers[1].securityContext == {"runAsUser": 1000, "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}
	pod.initContainers[0].securityContext == {"allowPrivilegeEscalation": false, "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}}
}

test_explicit_security_values_are_kept if {
	spec := {"podTemplate": {"spec": {
		"securityContext": {"runAsNonRoot": false},
		"containers": [{"name": "pulumi", "securityContext": {"allowPrivilegeEscalation": true, "capabilities": {"drop": ["NET_RAW"]}}}],
	}}}
	pod := patched(spec).podTemplate.spec
	pod.securityContext == {"runAsNonRoot": false, "seccompProfile": {"type": "RuntimeDefault"}}
	pod.containers[0].securityContext == {"allowPrivilegeEscalation": true, "capabilities": {"drop": ["NET_RAW"]}}
}

test_baseline_pod_template_is_left_alone if {
	spec := {"securityProfile": "baseline", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}, "podTemplate": {"spec": {"containers": [{"name": "pulumi"}]}}}
	patch_for(workspace(spec)) == []
}

test_defaulted_workspace_passes_the_restricted_policy if {
	spec := {"podTemplate": {"spec": {"containers": [{"name": "pulumi"}], "initContainers": [{"name": "fetch"}]}}}
	doc := json.patch(workspace(spec), [{"op": "replace", "path": "/request/object/spec", "value": patched(spec)}])
	count(data.pko.restricted.violations) == 0 with input as doc
	count(data.pko.restricted.violations) == 8 with input as workspace(spec)
}

test_other_kinds_and_operations_get_no_patch if {
	patch_for(review("Update", "CREATE", {})) == []
	patch_for(review("Workspace", "DELETE", {})) == []
	patch_for(review("Workspace", "UPDATE", {"securityProfile": "restricted", "resources": {"requests": {"cpu": "1", "memory": "1"}}})) == []
}
