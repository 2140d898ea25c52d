//! The restricted profile (Pod Security Standards "restricted") on a workspace's final pod: the
//! defaults the admission webhook stores (`policies/defaults.rego`) and the rules it enforces
//! (`policies/restricted.rego`, strict form), applied again by the Workspace controller, so a
//! namespace-scoped install (no webhook) or a webhook outage cannot turn a restricted workspace
//! into a root pod.
//!
//! Two implementations of one rule set can drift: the `restricted_crosscheck` integration test
//! runs this module and the compiled policies on one corpus and requires the same codes, paths
//! and messages. Change both together.

use serde_json::{Map, Value, json};

/// The containers of a pod, in the order the policies walk them.
const CONTAINER_FIELDS: [&str; 3] = ["containers", "initContainers", "ephemeralContainers"];

const ALLOWED_SECCOMP: [&str; 2] = ["RuntimeDefault", "Localhost"];
const ALLOWED_APPARMOR: [&str; 2] = ["RuntimeDefault", "Localhost"];
const ALLOWED_SELINUX_TYPES: [&str; 5] = [
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
];
/// Volume sources "restricted" allows, sorted (the message lists them in this order).
const ALLOWED_VOLUME_SOURCES: [&str; 8] = [
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
];
/// Sysctls Pod Security "baseline" allows.
const SAFE_SYSCTLS: [&str; 10] = [
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
];

/// One broken rule, named as the admission policy names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The policy's code (`privileged`, `seccomp`, …).
    pub code: &'static str,
    /// The field, under the prefix given to [`violations`]
    /// (`<prefix>.containers[1].securityContext.privileged`).
    pub path: String,
    /// The container's name, when the rule is about one.
    pub container: Option<String>,
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)?;
        if let Some(name) = &self.container {
            write!(f, " (container {name})")?;
        }
        Ok(())
    }
}

/// Stores the restricted defaults in `pod` (a pod spec) where unset, as the defaulting webhook
/// does: the pod's `runAsNonRoot` true and seccomp `RuntimeDefault`, every container's
/// `allowPrivilegeEscalation` false and capabilities drop `ALL`.
pub fn apply_defaults(pod: &mut Value) {
    let Some(pod) = pod.as_object_mut() else {
        return;
    };
    let sc = pod
        .entry("securityContext")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Some(sc) = sc.as_object_mut() {
        sc.entry("runAsNonRoot").or_insert(json!(true));
        sc.entry("seccompProfile")
            .or_insert(json!({"type": "RuntimeDefault"}));
    }
    for field in CONTAINER_FIELDS {
        let Some(list) = pod.get_mut(field).and_then(Value::as_array_mut) else {
            continue;
        };
        for container in list.iter_mut().filter_map(Value::as_object_mut) {
            let sc = container
                .entry("securityContext")
                .or_insert_with(|| Value::Object(Map::new()));
            let Some(sc) = sc.as_object_mut() else {
                continue;
            };
            sc.entry("allowPrivilegeEscalation").or_insert(json!(false));
            let caps = sc
                .entry("capabilities")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(caps) = caps.as_object_mut() {
                caps.entry("drop").or_insert(json!(["ALL"]));
            }
        }
    }
}

/// Every rule of the restricted profile that `pod` (a final pod spec: every security field
/// must be set, not only free of bad values) breaks, its fields named under `prefix`.
pub fn violations(pod: &Value, prefix: &str) -> Vec<Violation> {
    let mut report = Report::default();
    pod_context(&mut report, &pod["securityContext"], prefix);
    pod_host(&mut report, pod, prefix);
    for field in CONTAINER_FIELDS {
        for (i, c) in array(&pod[field]) {
            let container = Container {
                base: format!("{prefix}.{field}[{i}]"),
                name: c["name"].as_str(),
                spec: c,
                sc: &c["securityContext"],
                pod_sc: &pod["securityContext"],
            };
            container_identity(&mut report, &container);
            container_confinement(&mut report, &container);
        }
    }
    report.0
}

#[derive(Default)]
struct Report(Vec<Violation>);

impl Report {
    fn add(&mut self, code: &'static str, path: String, container: Option<&str>, message: &str) {
        self.0.push(Violation {
            code,
            path,
            container: container.map(str::to_owned),
            message: message.to_owned(),
        });
    }
}

/// One container of the pod, with what its rules read.
struct Container<'a> {
    /// `<prefix>.containers[0]`.
    base: String,
    name: Option<&'a str>,
    spec: &'a Value,
    sc: &'a Value,
    pod_sc: &'a Value,
}

impl Container<'_> {
    fn at(&self, field: &str) -> String {
        format!("{}.securityContext.{field}", self.base)
    }
}

/// A `seccompProfile` or `appArmorProfile` whose type is set to something else than allowed.
fn bad_profile(sc: &Value, profile: &str, allowed: &[&str]) -> bool {
    sc[profile]
        .get("type")
        .is_some_and(|t| !is_one_of(t, allowed))
}

const PROFILE_MESSAGE: &str = "must be RuntimeDefault or Localhost";
const HOST_PROCESS_MESSAGE: &str = "Windows host processes are not allowed";

/// The pod's securityContext.
fn pod_context(report: &mut Report, pod_sc: &Value, prefix: &str) {
    let at = |field: &str| format!("{prefix}.securityContext.{field}");
    if pod_sc["runAsNonRoot"] == json!(false) {
        report.add(
            "run-as-non-root",
            at("runAsNonRoot"),
            None,
            "must not be false",
        );
    }
    if is_zero(&pod_sc["runAsUser"]) {
        report.add(
            "run-as-user-root",
            at("runAsUser"),
            None,
            "must not be 0 (root)",
        );
    }
    if bad_profile(pod_sc, "seccompProfile", &ALLOWED_SECCOMP) {
        report.add("seccomp", at("seccompProfile.type"), None, PROFILE_MESSAGE);
    }
    for (i, sysctl) in array(&pod_sc["sysctls"]) {
        if let Some(name) = sysctl["name"].as_str()
            && !SAFE_SYSCTLS.contains(&name)
        {
            report.add(
                "sysctls",
                at(&format!("sysctls[{i}].name")),
                None,
                &format!("sysctl {name} is not allowed"),
            );
        }
    }
    if bad_profile(pod_sc, "appArmorProfile", &ALLOWED_APPARMOR) {
        report.add(
            "apparmor",
            at("appArmorProfile.type"),
            None,
            PROFILE_MESSAGE,
        );
    }
    if let Some(options) = pod_sc.get("seLinuxOptions") {
        for (path, message) in selinux(options, &at("seLinuxOptions")) {
            report.add("selinux", path, None, message);
        }
    }
    if pod_sc["windowsOptions"]["hostProcess"] == json!(true) {
        report.add(
            "host-process",
            at("windowsOptions.hostProcess"),
            None,
            HOST_PROCESS_MESSAGE,
        );
    }
}

/// What the pod shares with its node: namespaces and volumes.
fn pod_host(report: &mut Report, pod: &Value, prefix: &str) {
    for (i, volume) in array(&pod["volumes"]) {
        if holds(volume.get("hostPath")) {
            report.add(
                "host-path",
                format!("{prefix}.volumes[{i}].hostPath"),
                None,
                "hostPath volumes are not allowed",
            );
        }
    }
    for field in ["hostNetwork", "hostPID", "hostIPC"] {
        if pod[field] == json!(true) {
            report.add(
                "host-namespaces",
                format!("{prefix}.{field}"),
                None,
                "sharing the host's namespaces is not allowed",
            );
        }
    }
    for (i, volume) in array(&pod["volumes"]) {
        for source in volume.as_object().into_iter().flat_map(Map::keys) {
            if source != "name"
                && source != "hostPath"
                && !ALLOWED_VOLUME_SOURCES.contains(&source.as_str())
            {
                report.add(
                    "volume-type",
                    format!("{prefix}.volumes[{i}].{source}"),
                    None,
                    &format!(
                        "volume source {source} is not allowed (only {})",
                        ALLOWED_VOLUME_SOURCES.join(", ")
                    ),
                );
            }
        }
    }
}

/// Who the container runs as and what it may gain.
fn container_identity(report: &mut Report, c: &Container<'_>) {
    let (sc, name) = (c.sc, c.name);
    if sc["runAsNonRoot"] == json!(false) {
        report.add(
            "run-as-non-root",
            c.at("runAsNonRoot"),
            name,
            "must not be false",
        );
    }
    if unset(&c.pod_sc["runAsNonRoot"]) && unset(&sc["runAsNonRoot"]) {
        report.add(
            "run-as-non-root",
            c.at("runAsNonRoot"),
            name,
            "must be true, here or in the pod's securityContext",
        );
    }
    if is_zero(&sc["runAsUser"]) {
        report.add(
            "run-as-user-root",
            c.at("runAsUser"),
            name,
            "must not be 0 (root)",
        );
    }
    let escalation = &sc["allowPrivilegeEscalation"];
    if *escalation == json!(true) {
        report.add(
            "privilege-escalation",
            c.at("allowPrivilegeEscalation"),
            name,
            "must be false",
        );
    }
    if unset(escalation) {
        report.add(
            "privilege-escalation",
            c.at("allowPrivilegeEscalation"),
            name,
            "must be set to false",
        );
    }
    if sc["privileged"] == json!(true) {
        report.add(
            "privileged",
            c.at("privileged"),
            name,
            "privileged containers are not allowed",
        );
    }
    for (j, cap) in array(&sc["capabilities"]["add"]) {
        if let Some(cap) = cap.as_str()
            && cap != "NET_BIND_SERVICE"
        {
            report.add(
                "capabilities",
                c.at(&format!("capabilities.add[{j}]")),
                name,
                &format!("capability {cap} may not be added (only NET_BIND_SERVICE)"),
            );
        }
    }
    if !array(&sc["capabilities"]["drop"]).any(|(_, d)| d == "ALL") {
        report.add(
            "capabilities",
            c.at("capabilities.drop"),
            name,
            "must include ALL",
        );
    }
}

/// The container's confinement: seccomp, AppArmor, SELinux, /proc, host ports and processes.
fn container_confinement(report: &mut Report, c: &Container<'_>) {
    let (sc, name) = (c.sc, c.name);
    if bad_profile(sc, "seccompProfile", &ALLOWED_SECCOMP) {
        report.add(
            "seccomp",
            c.at("seccompProfile.type"),
            name,
            PROFILE_MESSAGE,
        );
    }
    if !holds(c.pod_sc["seccompProfile"].get("type")) && !holds(sc["seccompProfile"].get("type")) {
        report.add(
            "seccomp",
            c.at("seccompProfile.type"),
            name,
            "must be set to RuntimeDefault or Localhost, here or in the pod's securityContext",
        );
    }
    for (j, port) in array(&c.spec["ports"]) {
        if port.get("hostPort").is_some_and(|p| !is_zero(p)) {
            report.add(
                "host-ports",
                format!("{}.ports[{j}].hostPort", c.base),
                name,
                "host ports are not allowed",
            );
        }
    }
    if bad_profile(sc, "appArmorProfile", &ALLOWED_APPARMOR) {
        report.add(
            "apparmor",
            c.at("appArmorProfile.type"),
            name,
            PROFILE_MESSAGE,
        );
    }
    if let Some(options) = sc.get("seLinuxOptions") {
        for (path, message) in selinux(options, &c.at("seLinuxOptions")) {
            report.add("selinux", path, name, message);
        }
    }
    if sc.get("procMount").is_some_and(|m| m != "Default") {
        report.add("proc-mount", c.at("procMount"), name, "must be Default");
    }
    if sc["windowsOptions"]["hostProcess"] == json!(true) {
        report.add(
            "host-process",
            c.at("windowsOptions.hostProcess"),
            name,
            HOST_PROCESS_MESSAGE,
        );
    }
}

/// SELinux: only the container types (an unset type is the runtime's), and no user or role.
fn selinux(options: &Value, path: &str) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    if let Some(kind) = options.get("type")
        && !is_one_of(kind, &ALLOWED_SELINUX_TYPES)
    {
        out.push((
            format!("{path}.type"),
            "must be container_t, container_init_t, container_kvm_t or container_engine_t",
        ));
    }
    for field in ["user", "role"] {
        if options.get(field).is_some_and(|v| v != "") {
            out.push((format!("{path}.{field}"), "must not be set"));
        }
    }
    out
}

/// The items of `value` with their indexes, none when it is not an array.
fn array(value: &Value) -> impl Iterator<Item = (usize, &Value)> {
    value.as_array().into_iter().flatten().enumerate()
}

fn is_zero(value: &Value) -> bool {
    value.as_f64() == Some(0.0)
}

fn is_one_of(value: &Value, allowed: &[&str]) -> bool {
    value.as_str().is_some_and(|s| allowed.contains(&s))
}

/// Missing or null: what the policies read as "not set".
fn unset(value: &Value) -> bool {
    value.is_null()
}

/// Present and not false: a Rego expression that holds (null does).
fn holds(value: Option<&Value>) -> bool {
    value.is_some_and(|v| *v != json!(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codes(pod: Value) -> Vec<&'static str> {
        let mut pod = pod;
        apply_defaults(&mut pod);
        violations(&pod, "spec")
            .into_iter()
            .map(|v| v.code)
            .collect()
    }

    #[test]
    fn defaults_make_a_plain_pod_restricted() {
        assert_eq!(
            codes(
                json!({"containers": [{"name": "a"}], "initContainers": [{"name": "b", "securityContext": {}}]})
            ),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn defaults_never_replace_what_is_set() {
        let mut pod = json!({"securityContext": {"runAsNonRoot": false},
            "containers": [{"name": "a", "securityContext": {"allowPrivilegeEscalation": true, "capabilities": {"drop": ["NET_RAW"]}}}]});
        apply_defaults(&mut pod);
        let v = violations(&pod, "spec");
        let found: Vec<(&str, &str)> = v.iter().map(|v| (v.code, v.path.as_str())).collect();
        assert_eq!(
            found,
            vec![
                ("run-as-non-root", "spec.securityContext.runAsNonRoot"),
                (
                    "privilege-escalation",
                    "spec.containers[0].securityContext.allowPrivilegeEscalation"
                ),
                (
                    "capabilities",
                    "spec.containers[0].securityContext.capabilities.drop"
                ),
            ]
        );
        assert_eq!(v[1].container.as_deref(), Some("a"));
        assert!(v[1].to_string().ends_with("(container a)"), "{}", v[1]);
    }

    #[test]
    fn an_unset_selinux_type_is_the_runtimes() {
        assert!(
            codes(json!({"securityContext": {"seLinuxOptions": {"level": "s0:c1,c2"}}})).is_empty()
        );
        assert_eq!(
            codes(
                json!({"securityContext": {"seLinuxOptions": {"type": "spc_t", "user": "root"}}})
            ),
            vec!["selinux", "selinux"]
        );
    }

    #[test]
    fn a_host_port_of_zero_is_no_host_port() {
        assert!(codes(json!({"containers": [{"name": "a", "ports": [{"containerPort": 80, "hostPort": 0}]}]})).is_empty());
        assert_eq!(
            codes(
                json!({"containers": [{"name": "a", "ports": [{"containerPort": 80, "hostPort": 80}]}]})
            ),
            vec!["host-ports"]
        );
    }
}
