# METADATA
# title: Non-root workspaces (Pod Security Standards "restricted")
# description: |
#   The pod template of a Workspace (spec.podTemplate) and of a Stack's workspace template
#   (spec.workspaceTemplate.spec.podTemplate) meets the "restricted" Pod Security Standard for
#   the pod and for every container, init and ephemeral ones included. The baseline security
#   profile, which runs the workspace as root, is refused. A TenancyPolicy with
#   exemptFromRestricted exempts the namespaces it selects from this whole policy.
package pko.restricted

import data.pko.lib

violations contains v if {
	lib.checked
	not lib.exempt_from_restricted
	some v in _violations
}

_v(code, path, message) := lib.violation("restricted", code, path, message)

allowed_seccomp := {"RuntimeDefault", "Localhost"}

_violations contains _v(
	"baseline-profile",
	concat(".", [ws.path, "securityProfile"]),
	"the baseline security profile runs the workspace as root; use restricted, or have an admin exempt this namespace",
) if {
	some ws in lib.workspace_specs
	ws.spec.securityProfile == "baseline"
}

# runAsNonRoot: never false; set (true) at pod or container level on final objects.
_violations contains _v(
	"run-as-non-root",
	concat(".", [pod.path, "securityContext.runAsNonRoot"]),
	"must not be false",
) if {
	some pod in lib.pod_specs
	pod.spec.securityContext.runAsNonRoot == false
}

_violations contains _v(
	"run-as-non-root",
	concat(".", [c.path, "securityContext.runAsNonRoot"]),
	"must not be false",
) if {
	some c in lib.containers
	c.container.securityContext.runAsNonRoot == false
}

_violations contains _v(
	"run-as-non-root",
	concat(".", [c.path, "securityContext.runAsNonRoot"]),
	"must be true, here or in the pod's securityContext",
) if {
	some c in lib.containers
	c.pod.strict
	object.get(c.pod.spec, ["securityContext", "runAsNonRoot"], null) == null
	object.get(c.container, ["securityContext", "runAsNonRoot"], null) == null
}

# runAsUser: never 0.
_violations contains _v(
	"run-as-user-root",
	concat(".", [pod.path, "securityContext.runAsUser"]),
	"must not be 0 (root)",
) if {
	some pod in lib.pod_specs
	pod.spec.securityContext.runAsUser == 0
}

_violations contains _v(
	"run-as-user-root",
	concat(".", [c.path, "securityContext.runAsUser"]),
	"must not be 0 (root)",
) if {
	some c in lib.containers
	c.container.securityContext.runAsUser == 0
}

# allowPrivilegeEscalation: false on every container.
_violations contains _v(
	"privilege-escalation",
	concat(".", [c.path, "securityContext.allowPrivilegeEscalation"]),
	"must be false",
) if {
	some c in lib.containers
	c.container.securityContext.allowPrivilegeEscalation == true
}

_violations contains _v(
	"privilege-escalation",
	concat(".", [c.path, "securityContext.allowPrivilegeEscalation"]),
	"must be set to false",
) if {
	some c in lib.containers
	c.pod.strict
	object.get(c.container, ["securityContext", "allowPrivilegeEscalation"], null) == null
}

_violations contains _v(
	"privileged",
	concat(".", [c.path, "securityContext.privileged"]),
	"privileged containers are not allowed",
) if {
	some c in lib.containers
	c.container.securityContext.privileged == true
}

# Capabilities: drop ALL; add at most NET_BIND_SERVICE.
_violations contains _v(
	"capabilities",
	lib.index_path(concat(".", [c.path, "securityContext.capabilities.add"]), i),
	concat("", ["capability ", cap, " may not be added (only NET_BIND_SERVICE)"]),
) if {
	some c in lib.containers
	some i, cap in c.container.securityContext.capabilities.add
	cap != "NET_BIND_SERVICE"
}

_violations contains _v(
	"capabilities",
	concat(".", [c.path, "securityContext.capabilities.drop"]),
	"must include ALL",
) if {
	some c in lib.containers
	_drop_required(c)
	not _drops_all(c)
}

# A helper: `not "ALL" in x` with x undefined would be undefined, not true.
_drops_all(c) if "ALL" in c.container.securityContext.capabilities.drop

# A final object must drop ALL; a template that sets a drop list must include ALL in it.
_drop_required(c) if c.pod.strict

_drop_required(c) if is_array(c.container.securityContext.capabilities.drop)

# seccomp: RuntimeDefault or Localhost, at pod or container level.
_violations contains _v(
	"seccomp",
	concat(".", [pod.path, "securityContext.seccompProfile.type"]),
	"must be RuntimeDefault or Localhost",
) if {
	some pod in lib.pod_specs
	type := pod.spec.securityContext.seccompProfile.type
	not type in allowed_seccomp
}

_violations contains _v(
	"seccomp",
	concat(".", [c.path, "securityContext.seccompProfile.type"]),
	"must be RuntimeDefault or Localhost",
) if {
	some c in lib.containers
	type := c.container.securityContext.seccompProfile.type
	not type in allowed_seccomp
}

_violations contains _v(
	"seccomp",
	concat(".", [c.path, "securityContext.seccompProfile.type"]),
	"must be set to RuntimeDefault or Localhost, here or in the pod's securityContext",
) if {
	some c in lib.containers
	c.pod.strict
	not c.pod.spec.securityContext.seccompProfile.type
	not c.container.securityContext.seccompProfile.type
}

_violations contains _v(
	"host-path",
	concat(".", [lib.index_path(concat(".", [pod.path, "volumes"]), i), "hostPath"]),
	"hostPath volumes are not allowed",
) if {
	some pod in lib.pod_specs
	some i, volume in pod.spec.volumes
	volume.hostPath
}

_violations contains _v(
	"host-namespaces",
	concat(".", [pod.path, field]),
	"sharing the host's namespaces is not allowed",
) if {
	some pod in lib.pod_specs
	some field in ["hostNetwork", "hostPID", "hostIPC"]
	pod.spec[field] == true
}

# The rest of Pod Security "baseline" and "restricted" (which includes baseline).

_violations contains _v(
	"host-ports",
	concat(".", [lib.index_path(concat(".", [c.path, "ports"]), i), "hostPort"]),
	"host ports are not allowed",
) if {
	some c in lib.containers
	some i, port in c.container.ports
	port.hostPort != 0
}

# Volume sources "restricted" allows; anything else (hostPath, nfs, iscsi, …) is refused.
allowed_volume_sources := {
	"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
	"persistentVolumeClaim", "projected", "secret",
}

_violations contains _v(
	"volume-type",
	concat(".", [lib.index_path(concat(".", [pod.path, "volumes"]), i), source]),
	concat("", ["volume source ", source, " is not allowed (only ", concat(", ", sort([s | some s in allowed_volume_sources])), ")"]),
) if {
	some pod in lib.pod_specs
	some i, volume in pod.spec.volumes
	some source, _ in volume
	source != "name"
	source != "hostPath" # reported as host-path
	not source in allowed_volume_sources
}

# Sysctls that Pod Security "baseline" allows.
safe_sysctls := {
	"kernel.shm_rmid_forced",
	"net.ipv4.ip_local_port_range",
	"net.ipv4.ip_local_reserved_ports",
	"net.ipv4.ip_unprivileged_port_start",
	"net.ipv4.ping_group_range",
	"net.ipv4.tcp_syncookies",
	"net.ipv4.tcp_keepalive_time",
	"net.ipv4.tcp_fin_timeout",
	"net.ipv4.tcp_keepalive_intvl",
	"net.ipv4.tcp_keepalive_probes",
}

_violations contains _v(
	"sysctls",
	concat(".", [lib.index_path(concat(".", [pod.path, "securityContext.sysctls"]), i), "name"]),
	concat("", ["sysctl ", sysctl.name, " is not allowed"]),
) if {
	some pod in lib.pod_specs
	some i, sysctl in pod.spec.securityContext.sysctls
	not sysctl.name in safe_sysctls
}

# AppArmor: the runtime's default or a profile loaded on the node, never Unconfined.
allowed_apparmor := {"RuntimeDefault", "Localhost"}

_violations contains _v(
	"apparmor",
	concat(".", [pod.path, "securityContext.appArmorProfile.type"]),
	"must be RuntimeDefault or Localhost",
) if {
	some pod in lib.pod_specs
	type := pod.spec.securityContext.appArmorProfile.type
	not type in allowed_apparmor
}

_violations contains _v(
	"apparmor",
	concat(".", [c.path, "securityContext.appArmorProfile.type"]),
	"must be RuntimeDefault or Localhost",
) if {
	some c in lib.containers
	type := c.container.securityContext.appArmorProfile.type
	not type in allowed_apparmor
}

# SELinux: only the container types (an unset type is the runtime's), and no user or role.
allowed_selinux_types := {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}

_selinux_contexts contains {"path": concat(".", [pod.path, "securityContext.seLinuxOptions"]), "options": pod.spec.securityContext.seLinuxOptions} if {
	some pod in lib.pod_specs
}

_selinux_contexts contains {"path": concat(".", [c.path, "securityContext.seLinuxOptions"]), "options": c.container.securityContext.seLinuxOptions} if {
	some c in lib.containers
}

_violations contains _v(
	"selinux",
	concat(".", [ctx.path, "type"]),
	"must be container_t, container_init_t, container_kvm_t or container_engine_t",
) if {
	some ctx in _selinux_contexts
	type := ctx.options.type
	not type in allowed_selinux_types
}

_violations contains _v(
	"selinux",
	concat(".", [ctx.path, field]),
	"must not be set",
) if {
	some ctx in _selinux_contexts
	some field in ["user", "role"]
	ctx.options[field] != ""
}

_violations contains _v(
	"proc-mount",
	concat(".", [c.path, "securityContext.procMount"]),
	"must be Default",
) if {
	some c in lib.containers
	c.container.securityContext.procMount != "Default"
}

_violations contains _v(
	"host-process",
	concat(".", [pod.path, "securityContext.windowsOptions.hostProcess"]),
	"Windows host processes are not allowed",
) if {
	some pod in lib.pod_specs
	pod.spec.securityContext.windowsOptions.hostProcess == true
}

_violations contains _v(
	"host-process",
	concat(".", [c.path, "securityContext.windowsOptions.hostProcess"]),
	"Windows host processes are not allowed",
) if {
	some c in lib.containers
	c.container.securityContext.windowsOptions.hostProcess == true
}
