package pko.admission_test

import data.pko.admission

review(namespace, spec) := {
	"apiVersion": "admission.k8s.io/v1",
	"kind": "AdmissionReview",
	"request": {
		"uid": "1",
		"operation": "CREATE",
		"namespace": namespace,
		"kind": {"group": "auto.pulumi.com", "version": "v1alpha1", "kind": "Workspace"},
		"object": {"metadata": {"name": "x", "namespace": namespace}, "spec": spec},
	},
}

policy(name, action, namespaces, extra) := object.union({"name": name, "action": action, "namespaces": namespaces}, extra)

decide(review_doc, tenancy) := d if {
	d := admission.decision with input as review_doc with data.tenancy as tenancy
}

actions(d) := {[v.policy, v.code, v.action] | some v in d.violations}

test_compliant_object_is_allowed if {
	d := decide(review("team-a", {"securityProfile": "restricted"}), {})
	d.allowed
	count(d.violations) == 0
}

test_default_action_is_deny if {
	d := decide(review("team-a", {"securityProfile": "baseline"}), {})
	not d.allowed
	actions(d) == {["restricted", "baseline-profile", "deny"]}
}

test_configured_default_action if {
	d := decide(review("team-a", {"securityProfile": "baseline"}), {"defaultAction": "warn"})
	d.allowed
	actions(d) == {["restricted", "baseline-profile", "warn"]}
}

test_namespace_action_is_the_strictest_selecting_policy if {
	tenancy := {"policies": [policy("audit", "dryrun", ["team-a"], {}), policy("trial", "warn", ["team-a"], {})]}
	d := decide(review("team-a", {"securityProfile": "baseline"}), tenancy)
	d.allowed
	actions(d) == {["restricted", "baseline-profile", "warn"]}
}

test_dryrun_admits if {
	tenancy := {"policies": [policy("audit", "dryrun", ["team-a"], {})]}
	d := decide(review("team-a", {"securityProfile": "baseline"}), tenancy)
	d.allowed
	actions(d) == {["restricted", "baseline-profile", "dryrun"]}
}

test_allowance_violations_take_their_policy_action if {
	tenancy := {"policies": [
		policy("strict", "deny", ["team-a"], {}),
		policy("images", "warn", ["team-a"], {"allowedImagePrefixes": ["registry.example/"]}),
	]}
	d := decide(review("team-a", {"image": "docker.io/pulumi"}), tenancy)
	d.allowed
	actions(d) == {["isolation", "image", "warn"]}
	d2 := decide(review("team-a", {"image": "docker.io/pulumi", "securityProfile": "baseline"}), tenancy)
	not d2.allowed
	actions(d2) == {["isolation", "image", "warn"], ["restricted", "baseline-profile", "deny"]}
}

test_policies_of_other_namespaces_do_not_apply if {
	tenancy := {"defaultAction": "deny", "policies": [policy("b", "dryrun", ["team-b"], {"allowedImagePrefixes": []})]}
	d := decide(review("team-a", {"image": "x", "securityProfile": "baseline"}), tenancy)
	actions(d) == {["restricted", "baseline-profile", "deny"]}
}

test_violations_carry_path_and_message if {
	d := decide(review("team-a", {"securityProfile": "baseline"}), {})
	some v in d.violations
	v.path == "spec.securityProfile"
	contains(v.message, "root")
}
