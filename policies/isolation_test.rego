package pko.isolation_test

import data.pko.isolation

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

stack(spec) := review("pulumi.com", "Stack", object.union({"stack": "dev"}, spec))

transform(spec) := review("pko-rs.dev", "ProgramTransform", spec)

found(review_doc) := pairs if {
	pairs := {[v.code, v.path] | some v in isolation.violations} with input as review_doc
}

secret_ref(namespace) := {"type": "Secret", "secret": {"namespace": namespace, "name": "creds", "key": "token"}}

team_a := {"policies": [{
	"name": "team-a",
	"action": "deny",
	"namespaces": ["team-a"],
	"allowedServiceAccounts": ["pulumi"],
	"allowedImagePrefixes": ["pulumi/pulumi:", "registry.team-a.example/"],
	"allowedTransformDigests": ["sha256:ABCDEF"],
}]}

team_b_only := {"policies": [object.union(team_a.policies[0], {"name": "team-b", "namespaces": ["team-b"]})]}

test_secret_refs_in_the_namespace_pass if {
	count(found(stack({
		"envRefs": {"A": secret_ref("team-a"), "B": {"type": "Secret", "secret": {"name": "creds", "key": "k"}}},
		"secretsRef": {"C": {"type": "Literal", "literal": {"value": "x"}}},
		"gitAuth": {"accessToken": secret_ref("")},
	}))) == 0
}

test_cross_namespace_secret_refs_denied if {
	found(stack({
		"envRefs": {"A": secret_ref("team-b")},
		"secretsRef": {"S": secret_ref("kube-system")},
		"gitAuth": {"basicAuth": {"userName": secret_ref("team-a"), "password": secret_ref("team-b")}},
	})) == {
		["cross-namespace-secret", "spec.envRefs.A.secret.namespace"],
		["cross-namespace-secret", "spec.secretsRef.S.secret.namespace"],
		["cross-namespace-secret", "spec.gitAuth.basicAuth.password.secret.namespace"],
	}
}

test_operator_local_refs_denied if {
	found(stack({
		"envRefs": {"E": {"type": "Env", "env": {"name": "AWS_SECRET_ACCESS_KEY"}}},
		"gitAuth": {"sshAuth": {"sshPrivateKey": {"type": "FS", "filesystem": {"path": "/root/.ssh/id_rsa"}}}},
	})) == {
		["operator-local-ref", "spec.envRefs.E.type"],
		["operator-local-ref", "spec.gitAuth.sshAuth.sshPrivateKey.type"],
	}
}

program_url(namespace) := concat("", ["http://pko-rs-operator.pko-rs-system:80/programs/", namespace, "/hello/1"])

test_program_urls_of_the_namespace_pass if {
	count(found(workspace({"flux": {"url": program_url("team-a"), "digest": "sha256:00"}}))) == 0
	count(found(workspace({"git": {"url": "https://github.com/o/programs/team-b/x"}}))) == 0
}

test_cross_namespace_program_urls_denied if {
	found(workspace({"flux": {"url": program_url("team-b")}})) == {["cross-namespace-program", "spec.flux.url"]}
	found(stack({"workspaceTemplate": {"spec": {"flux": {"url": program_url("team-b")}}}})) == {["cross-namespace-program", "spec.workspaceTemplate.spec.flux.url"]}
}

test_program_urls_on_other_hosts_pass_when_hosts_are_configured if {
	hosts := {"fileServerHosts": ["pko-rs-operator.pko-rs-system:80"]}
	found(workspace({"flux": {"url": program_url("team-b")}})) == {["cross-namespace-program", "spec.flux.url"]} with data.tenancy as hosts
	other := "https://artifacts.example.com/programs/team-b/hello/1"
	count(found(workspace({"flux": {"url": other}}))) == 0 with data.tenancy as hosts
}

test_service_accounts if {
	count(found(workspace({"serviceAccountName": "pulumi"}))) == 0 with data.tenancy as team_a
	count(found(workspace({"serviceAccountName": "default"}))) == 0 with data.tenancy as team_a
	found(workspace({"serviceAccountName": "admin", "podTemplate": {"spec": {"serviceAccountName": "root", "containers": []}}})) == {
		["service-account", "spec.serviceAccountName"],
		["service-account", "spec.podTemplate.spec.serviceAccountName"],
	} with data.tenancy as team_a
	found(stack({"serviceAccountName": "admin", "workspaceTemplate": {"spec": {"serviceAccountName": "ops"}}})) == {
		["service-account", "spec.serviceAccountName"],
		["service-account", "spec.workspaceTemplate.spec.serviceAccountName"],
	} with data.tenancy as team_a
}

test_service_accounts_unrestricted_without_a_list_or_another_namespace if {
	count(found(workspace({"serviceAccountName": "admin"}))) == 0
	count(found(workspace({"serviceAccountName": "admin"}))) == 0 with data.tenancy as team_b_only
}

test_images if {
	count(found(workspace({"image": "pulumi/pulumi:3.200.0-nonroot"}))) == 0 with data.tenancy as team_a
	found(workspace({
		"image": "evil.example/pulumi:latest",
		"podTemplate": {"spec": {"containers": [
			{"name": "pulumi", "image": "registry.team-a.example/pulumi:1"},
			{"name": "sidecar", "image": "docker.io/library/busybox"},
		]}},
	})) == {
		["image", "spec.image"],
		["image", "spec.podTemplate.spec.containers[1].image"],
	} with data.tenancy as team_a
	found(stack({"workspaceTemplate": {"spec": {"image": "evil.example/x"}}})) == {["image", "spec.workspaceTemplate.spec.image"]} with data.tenancy as team_a
	count(found(workspace({"image": "evil.example/pulumi:latest"}))) == 0 with data.tenancy as team_b_only
}

test_transform_modules if {
	count(found(transform({"sha256": "abcdef"}))) == 0 with data.tenancy as team_a
	count(found(transform({"sha256": "sha256:AbCdEf"}))) == 0 with data.tenancy as team_a
	found(transform({"sha256": "123456"})) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a
	count(found(transform({"sha256": "123456"}))) == 0
}

test_allowance_violations_name_their_policy if {
	vs := isolation.violations with input as workspace({"serviceAccountName": "admin"}) with data.tenancy as team_a
	[v.tenancyPolicy | some v in vs] == ["team-a"]
}

test_every_matching_policy_applies if {
	two := {"policies": [
		team_a.policies[0],
		object.union(team_a.policies[0], {"name": "extra", "allowedImagePrefixes": ["registry.team-a.example/"]}),
	]}
	vs := isolation.violations with input as workspace({"image": "pulumi/pulumi:latest"}) with data.tenancy as two
	{v.tenancyPolicy | some v in vs} == {"extra"}
}
