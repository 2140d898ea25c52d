package pko.restricted_test

import data.pko.restricted

# An AdmissionReview for a Workspace or a Stack in namespace team-a.
review(group, kind, spec) := {
	"apiVersion": "admission.k8s.io/v1",
	"kind": "AdmissionReview",
	"request": {
		"uid": "1",
		"operation": "CREATE",
		"namespace": "team-a",
		"kind": {"group": group, "version": "v1", "kind": kind},
		"object": {"metadata": {"name": "x", "namespace": "team-a"}, "spec": spec},
	},
}

workspace(spec) := review("auto.pulumi.com", "Workspace", spec)

stack(template_spec) := review("pulumi.com", "Stack", {"stack": "dev", "workspaceTemplate": {"spec": template_spec}})

good_container := {
	"name": "pulumi",
	"securityContext": {
		"allowPrivilegeEscalation": false,
		"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
	},
}

good_pod := {
	"securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
	"containers": [good_container],
	"initContainers": [good_container],
	"volumes": [{"name": "tmp", "emptyDir": {}}],
}

good_spec := {"securityProfile": "restricted", "podTemplate": {"spec": good_pod}}

# The [code, path] pairs of the violations for `review_doc`.
found(review_doc) := pairs if {
	pairs := {[v.code, v.path] | some v in restricted.violations} with input as review_doc
}

# `spec` with the pod template's `path` (a list of keys) set to `value`.
with_pod(spec, path, value) := json.patch(spec, [{"op": "add", "path": concat("/", array.concat(["", "podTemplate", "spec"], path)), "value": value}])

test_compliant_workspace_and_stack_pass if {
	count(found(workspace(good_spec))) == 0
	count(found(stack(good_spec))) == 0
}

test_workspace_without_pod_template_passes if {
	count(found(workspace({"securityProfile": "restricted"}))) == 0
}

test_baseline_profile_denied if {
	found(workspace({"securityProfile": "baseline"})) == {["baseline-profile", "spec.securityProfile"]}
	found(stack({"securityProfile": "baseline"})) == {["baseline-profile", "spec.workspaceTemplate.spec.securityProfile"]}
}

test_exempt_namespace_skips_every_rule if {
	data_exempt := {"policies": [{"name": "legacy", "action": "deny", "namespaces": ["team-a"], "exemptFromRestricted": true}]}
	review_doc := workspace(with_pod({"securityProfile": "baseline", "podTemplate": {"spec": good_pod}}, ["hostNetwork"], true))
	count(found(review_doc)) == 0 with data.tenancy as data_exempt
}

test_exemption_of_another_namespace_does_not_apply if {
	other := {"policies": [{"name": "legacy", "action": "deny", "namespaces": ["team-b"], "exemptFromRestricted": true}]}
	found(workspace({"securityProfile": "baseline"})) == {["baseline-profile", "spec.securityProfile"]} with data.tenancy as other
}

test_run_as_non_root_false_denied if {
	pod := json.patch(good_pod, [{"op": "replace", "path": "/securityContext/runAsNonRoot", "value": false}])
	found(workspace({"podTemplate": {"spec": pod}})) == {["run-as-non-root", "spec.podTemplate.spec.securityContext.runAsNonRoot"]}
	container := json.patch(good_container, [{"op": "add", "path": "/securityContext/runAsNonRoot", "value": false}])
	tpl := json.patch(good_pod, [{"op": "replace", "path": "/containers/0", "value": container}])
	found(stack({"podTemplate": {"spec": tpl}})) == {["run-as-non-root", "spec.workspaceTemplate.spec.podTemplate.spec.containers[0].securityContext.runAsNonRoot"]}
}

test_run_as_non_root_must_be_set_on_workspaces_only if {
	pod := json.patch(good_pod, [{"op": "remove", "path": "/securityContext/runAsNonRoot"}])
	found(workspace({"podTemplate": {"spec": pod}})) == {
		["run-as-non-root", "spec.podTemplate.spec.containers[0].securityContext.runAsNonRoot"],
		["run-as-non-root", "spec.podTemplate.spec.initContainers[0].securityContext.runAsNonRoot"],
	}
	count(found(stack({"podTemplate": {"spec": pod}}))) == 0
}

test_run_as_non_root_false_is_reported_once if {
	container := json.patch(good_container, [{"op": "add", "path": "/securityContext/runAsNonRoot", "value": false}])
	pod := json.patch(good_pod, [
		{"op": "remove", "path": "/securityContext/runAsNonRoot"},
		{"op": "replace", "path": "/containers/0", "value": container},
		{"op": "add", "path": "/initContainers/0/securityContext/runAsNonRoot", "value": true},
	])
	found(workspace({"podTemplate": {"spec": pod}})) == {["run-as-non-root", "spec.podTemplate.spec.containers[0].securityContext.runAsNonRoot"]}
}

test_run_as_non_root_at_container_level_is_enough if {
	pod := json.patch(good_pod, [
		{"op": "remove", "path": "/securityContext/runAsNonRoot"},
		{"op": "add", "path": "/containers/0/securityContext/runAsNonRoot", "value": true},
		{"op": "add", "path": "/initContainers/0/securityContext/runAsNonRoot", "value": true},
	])
	count(found(workspace({"podTemplate": {"spec": pod}}))) == 0
}

test_run_as_user_root_denied if {
	pod := json.patch(good_pod, [
		{"op": "replace", "path": "/securityContext/runAsUser", "value": 0},
		{"op": "add", "path": "/containers/0/securityContext/runAsUser", "value": 0},
	])
	found(workspace({"podTemplate": {"spec": pod}})) == {
		["run-as-user-root", "spec.podTemplate.spec.securityContext.runAsUser"],
		["run-as-user-root", "spec.podTemplate.spec.containers[0].securityContext.runAsUser"],
	}
}

test_privilege_escalation if {
	allowed := json.patch(good_pod, [{"op": "add", "path": "/ephemeralContainers", "value": [good_container]}])
	count(found(workspace({"podTemplate": {"spec": allowed}}))) == 0
	escalating := json.patch(good_pod, [{"op": "replace", "path": "/initContainers/0/securityContext/allowPrivilegeEscalation", "value": true}])
	found(stack({"podTemplate": {"spec": escalating}})) == {["privilege-escalation", "spec.workspaceTemplate.spec.podTemplate.spec.initContainers[0].securityContext.allowPrivilegeEscalation"]}
	unset := json.patch(good_pod, [{"op": "add", "path": "/ephemeralContainers", "value": [{"name": "debug", "securityContext": {"capabilities": {"drop": ["ALL"]}}}]}])
	found(workspace({"podTemplate": {"spec": unset}})) == {["privilege-escalation", "spec.podTemplate.spec.ephemeralContainers[0].securityContext.allowPrivilegeEscalation"]}
	count(found(stack({"podTemplate": {"spec": unset}}))) == 0
}

test_privileged_denied if {
	pod := json.patch(good_pod, [{"op": "add", "path": "/containers/0/securityContext/privileged", "value": true}])
	found(workspace({"podTemplate": {"spec": pod}})) == {["privileged", "spec.podTemplate.spec.containers[0].securityContext.privileged"]}
	not_privileged := json.patch(good_pod, [{"op": "add", "path": "/containers/0/securityContext/privileged", "value": false}])
	count(found(workspace({"podTemplate": {"spec": not_privileged}}))) == 0
}

test_capabilities if {
	adds := json.patch(good_pod, [{"op": "replace", "path": "/containers/0/securityContext/capabilities/add", "value": ["NET_BIND_SERVICE", "SYS_ADMIN"]}])
	found(stack({"podTemplate": {"spec": adds}})) == {["capabilities", "spec.workspaceTemplate.spec.podTemplate.spec.containers[0].securityContext.capabilities.add[1]"]}
	no_drop := json.patch(good_pod, [{"op": "remove", "path": "/initContainers/0/securityContext/capabilities/drop"}])
	found(workspace({"podTemplate": {"spec": no_drop}})) == {["capabilities", "spec.podTemplate.spec.initContainers[0].securityContext.capabilities.drop"]}
	count(found(stack({"podTemplate": {"spec": no_drop}}))) == 0
	partial_drop := json.patch(good_pod, [{"op": "replace", "path": "/containers/0/securityContext/capabilities/drop", "value": ["NET_RAW"]}])
	found(stack({"podTemplate": {"spec": partial_drop}})) == {["capabilities", "spec.workspaceTemplate.spec.podTemplate.spec.containers[0].securityContext.capabilities.drop"]}
}

test_seccomp if {
	localhost := json.patch(good_pod, [{"op": "replace", "path": "/securityContext/seccompProfile", "value": {"type": "Localhost", "localhostProfile": "p.json"}}])
	count(found(workspace({"podTemplate": {"spec": localhost}}))) == 0
	unconfined := json.patch(good_pod, [{"op": "add", "path": "/containers/0/securityContext/seccompProfile", "value": {"type": "Unconfined"}}])
	found(stack({"podTemplate": {"spec": unconfined}})) == {["seccomp", "spec.workspaceTemplate.spec.podTemplate.spec.containers[0].securityContext.seccompProfile.type"]}
	pod_unconfined := json.patch(good_pod, [{"op": "replace", "path": "/securityContext/seccompProfile/type", "value": "Unconfined"}])
	found(workspace({"podTemplate": {"spec": pod_unconfined}})) == {["seccomp", "spec.podTemplate.spec.securityContext.seccompProfile.type"]}
	unset := json.patch(good_pod, [{"op": "remove", "path": "/securityContext/seccompProfile"}])
	found(workspace({"podTemplate": {"spec": unset}})) == {
		["seccomp", "spec.podTemplate.spec.containers[0].securityContext.seccompProfile.type"],
		["seccomp", "spec.podTemplate.spec.initContainers[0].securityContext.seccompProfile.type"],
	}
}

test_host_path_denied if {
	pod := json.patch(good_pod, [{"op": "add", "path": "/volumes/-", "value": {"name": "docker", "hostPath": {"path": "/var/run/docker.sock"}}}])
	found(workspace({"podTemplate": {"spec": pod}})) == {["host-path", "spec.podTemplate.spec.volumes[1].hostPath"]}
}

test_host_namespaces_denied if {
	pod := json.patch(good_pod, [
		{"op": "add", "path": "/hostNetwork", "value": true},
		{"op": "add", "path": "/hostPID", "value": true},
		{"op": "add", "path": "/hostIPC", "value": false},
	])
	found(stack({"podTemplate": {"spec": pod}})) == {
		["host-namespaces", "spec.workspaceTemplate.spec.podTemplate.spec.hostNetwork"],
		["host-namespaces", "spec.workspaceTemplate.spec.podTemplate.spec.hostPID"],
	}
}

# An UPDATE of `review_doc`'s object, being deleted, from an object whose spec was `old_spec`.
terminating_update(review_doc, old_spec) := json.patch(review_doc, [
	{"op": "replace", "path": "/request/operation", "value": "UPDATE"},
	{"op": "add", "path": "/request/object/metadata/deletionTimestamp", "value": "2025-01-01T00:00:00Z"},
	{"op": "add", "path": "/request/oldObject", "value": {
		"metadata": {"name": "x", "namespace": "team-a", "finalizers": ["pulumi.com/finalizer"]},
		"spec": old_spec,
	}},
])

test_deletes_and_terminating_objects_are_not_checked if {
	bad := workspace({"securityProfile": "baseline"})
	deleting := json.patch(bad, [{"op": "replace", "path": "/request/operation", "value": "DELETE"}])
	count(found(deleting)) == 0

	# Removing a finalizer from an object being deleted: its spec stays as it was.
	terminating := terminating_update(bad, {"securityProfile": "baseline"})
	count(found(terminating)) == 0
	updating := json.patch(bad, [{"op": "replace", "path": "/request/operation", "value": "UPDATE"}])
	count(found(updating)) == 1
}

# Otherwise a tenant could add its own finalizer, delete the object, then change its spec.
test_spec_changes_of_terminating_objects_are_checked if {
	changed := terminating_update(workspace({"securityProfile": "baseline"}), {"securityProfile": "restricted"})
	found(changed) == {["baseline-profile", "spec.securityProfile"]}
	template := terminating_update(stack({"securityProfile": "baseline"}), {"stack": "dev", "workspaceTemplate": {"spec": {}}})
	found(template) == {["baseline-profile", "spec.workspaceTemplate.spec.securityProfile"]}
	without_old := json.patch(workspace({"securityProfile": "baseline"}), [
		{"op": "replace", "path": "/request/operation", "value": "UPDATE"},
		{"op": "add", "path": "/request/object/metadata/deletionTimestamp", "value": "2025-01-01T00:00:00Z"},
	])
	found(without_old) == {["baseline-profile", "spec.securityProfile"]}
	created := json.patch(workspace({"securityProfile": "baseline"}), [{"op": "add", "path": "/request/object/metadata/deletionTimestamp", "value": "2025-01-01T00:00:00Z"}])
	found(created) == {["baseline-profile", "spec.securityProfile"]}
}

test_other_kinds_are_not_checked if {
	program := review("pulumi.com", "Program", {"securityProfile": "baseline"})
	count(found(program)) == 0
}

test_host_ports_denied if {
	c := json.patch(good_container, [{"op": "add", "path": "/ports", "value": [{"containerPort": 80}, {"containerPort": 443, "hostPort": 443}]}])
	found(workspace(with_pod(good_spec, ["containers"], [c]))) == {["host-ports", "spec.podTemplate.spec.containers[0].ports[1].hostPort"]}
}

test_only_restricted_volume_types_allowed if {
	volumes := [
		{"name": "a", "configMap": {"name": "c"}},
		{"name": "b", "secret": {"secretName": "s"}},
		{"name": "c", "persistentVolumeClaim": {"claimName": "p"}},
		{"name": "d", "projected": {"sources": []}},
		{"name": "e", "nfs": {"server": "n", "path": "/"}},
	]
	found(workspace(with_pod(good_spec, ["volumes"], volumes))) == {["volume-type", "spec.podTemplate.spec.volumes[4].nfs"]}
}

test_host_path_is_reported_once if {
	volumes := [{"name": "h", "hostPath": {"path": "/"}}]
	found(workspace(with_pod(good_spec, ["volumes"], volumes))) == {["host-path", "spec.podTemplate.spec.volumes[0].hostPath"]}
}

test_unsafe_sysctls_denied if {
	sc := {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}, "sysctls": [{"name": "net.ipv4.tcp_syncookies", "value": "1"}, {"name": "kernel.msgmax", "value": "1"}]}
	found(workspace(with_pod(good_spec, ["securityContext"], sc))) == {["sysctls", "spec.podTemplate.spec.securityContext.sysctls[1].name"]}
}

test_apparmor_unconfined_denied if {
	sc := {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}, "appArmorProfile": {"type": "Unconfined"}}
	found(workspace(with_pod(good_spec, ["securityContext"], sc))) == {["apparmor", "spec.podTemplate.spec.securityContext.appArmorProfile.type"]}
	c := json.patch(good_container, [{"op": "add", "path": "/securityContext/appArmorProfile", "value": {"type": "Localhost", "localhostProfile": "p"}}])
	count(found(workspace(with_pod(good_spec, ["containers"], [c])))) == 0
}

test_selinux_limited_to_container_types if {
	c := json.patch(good_container, [{"op": "add", "path": "/securityContext/seLinuxOptions", "value": {"type": "spc_t", "user": "system_u"}}])
	found(workspace(with_pod(good_spec, ["containers"], [c]))) == {
		["selinux", "spec.podTemplate.spec.containers[0].securityContext.seLinuxOptions.type"],
		["selinux", "spec.podTemplate.spec.containers[0].securityContext.seLinuxOptions.user"],
	}
	ok := json.patch(good_container, [{"op": "add", "path": "/securityContext/seLinuxOptions", "value": {"type": "container_t", "level": "s0:c1"}}])
	count(found(workspace(with_pod(good_spec, ["containers"], [ok])))) == 0
	level_only := json.patch(good_container, [{"op": "add", "path": "/securityContext/seLinuxOptions", "value": {"level": "s0:c1"}}])
	count(found(workspace(with_pod(good_spec, ["containers"], [level_only])))) == 0
}

test_proc_mount_and_host_process_denied if {
	c := json.patch(good_container, [
		{"op": "add", "path": "/securityContext/procMount", "value": "Unmasked"},
		{"op": "add", "path": "/securityContext/windowsOptions", "value": {"hostProcess": true}},
	])
	found(stack(with_pod(good_spec, ["initContainers"], [c]))) == {
		["proc-mount", "spec.workspaceTemplate.spec.podTemplate.spec.initContainers[0].securityContext.procMount"],
		["host-process", "spec.workspaceTemplate.spec.podTemplate.spec.initContainers[0].securityContext.windowsOptions.hostProcess"],
	}
}
