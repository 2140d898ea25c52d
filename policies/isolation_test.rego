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

# The webhook's parse of flux URLs (input.pko.urls: raw string -> parts) added to a review.
with_urls(review_doc, urls) := object.union(review_doc, {"pko": {"urls": urls}})

workspace_flux(url, parsed) := with_urls(workspace({"flux": {"url": url, "digest": "sha256:00"}}), {url: parsed})

stack_flux(url, parsed) := with_urls(stack({"workspaceTemplate": {"spec": {"flux": {"url": url}}}}), {url: parsed})

parsed(scheme, host, port, segments) := {"valid": true, "scheme": scheme, "host": host, "port": port, "segments": segments}

# The operator's file server: Service pko-rs-fileserver in pko-rs-system, ClusterIP 10.96.0.12.
file_server_hosts := [
	"pko-rs-fileserver",
	"pko-rs-fileserver.pko-rs-system",
	"pko-rs-fileserver.pko-rs-system.svc",
	"pko-rs-fileserver.pko-rs-system.svc.cluster.local",
	"10.96.0.12",
]

file_server := {"fileServer": {"hosts": file_server_hosts, "ports": [80]}}

program_url(namespace) := concat("", ["http://pko-rs-fileserver.pko-rs-system/programs/", namespace, "/hello/1"])

program(namespace) := parsed("http", "pko-rs-fileserver.pko-rs-system", 80, ["programs", namespace, "hello", "1"])

test_program_urls_of_the_namespace_pass if {
	count(found(workspace_flux(program_url("team-a"), program("team-a")))) == 0 with data.tenancy as file_server
	count(found(stack_flux(program_url("team-a"), program("team-a")))) == 0 with data.tenancy as file_server
	count(found(workspace({"git": {"url": "https://github.com/o/programs/team-b/x"}}))) == 0
}

test_cross_namespace_program_urls_denied if {
	found(workspace_flux(program_url("team-b"), program("team-b"))) == {["cross-namespace-program", "spec.flux.url"]} with data.tenancy as file_server
	found(stack_flux(program_url("team-b"), program("team-b"))) == {["cross-namespace-program", "spec.workspaceTemplate.spec.flux.url"]} with data.tenancy as file_server
}

test_cross_namespace_messages_name_both_namespaces if {
	vs := isolation.violations with input as workspace_flux(program_url("team-b"), program("team-b")) with data.tenancy as file_server
	[v.message | some v in vs] == ["points at a Program of namespace team-b; only Programs of namespace team-a may be used"]
}

# The decision follows the parsed parts, never the raw string.
test_only_the_parsed_parts_count if {
	elsewhere := parsed("http", "artifacts.example.com", 80, ["programs", "team-b", "hello", "1"])
	count(found(workspace_flux(program_url("team-b"), elsewhere))) == 0 with data.tenancy as file_server
	found(workspace_flux("http://innocent.example/x", program("team-b"))) == {["cross-namespace-program", "spec.flux.url"]} with data.tenancy as file_server
}

test_program_urls_on_other_hosts_and_ports_pass_when_configured if {
	other_host := parsed("https", "artifacts.example.com", 443, ["programs", "team-b", "x", "1"])
	count(found(workspace_flux("https://artifacts.example.com/programs/team-b/x/1", other_host))) == 0 with data.tenancy as file_server
	other_port := parsed("http", "pko-rs-fileserver.pko-rs-system", 8080, ["programs", "team-b", "x", "1"])
	count(found(workspace_flux("http://pko-rs-fileserver.pko-rs-system:8080/programs/team-b/x/1", other_port))) == 0 with data.tenancy as file_server
}

test_every_host_and_port_counts_without_configuration if {
	url := "http://artifacts.example.com:8080/programs/team-b/x/1"
	review_doc := workspace_flux(url, parsed("http", "artifacts.example.com", 8080, ["programs", "team-b", "x", "1"]))
	denied := {["cross-namespace-program", "spec.flux.url"]}
	found(review_doc) == denied
	found(review_doc) == denied with data.tenancy as {}
	found(review_doc) == denied with data.tenancy as {"fileServer": {}}
	found(review_doc) == denied with data.tenancy as {"fileServer": {"hosts": [], "ports": []}}
	found(review_doc) == denied with data.tenancy as {"fileServer": {"hosts": ["artifacts.example.com"]}}
	found(review_doc) == denied with data.tenancy as {"fileServer": {"ports": [8080]}}
	count(found(review_doc)) == 0 with data.tenancy as {"fileServer": {"ports": [80]}}
}

test_only_http_and_https_reach_the_file_server if {
	ftp := parsed("ftp", "pko-rs-fileserver.pko-rs-system", 80, ["programs", "team-b", "x", "1"])
	count(found(workspace_flux("ftp://pko-rs-fileserver.pko-rs-system:80/programs/team-b/x/1", ftp))) == 0
	s3 := parsed("s3", "bucket", null, ["programs", "team-b", "x", "1"])
	count(found(workspace_flux("s3://bucket/programs/team-b/x/1", s3))) == 0
	https := parsed("https", "pko-rs-fileserver.pko-rs-system", 80, ["programs", "team-b", "x", "1"])
	found(workspace_flux("https://pko-rs-fileserver.pko-rs-system:80/programs/team-b/x/1", https)) == {["cross-namespace-program", "spec.flux.url"]} with data.tenancy as file_server
}

for_path(segments) := pairs if {
	pairs := found(workspace_flux("http://pko-rs-fileserver/x", parsed("http", "pko-rs-fileserver", 80, segments))) with data.tenancy as file_server
}

test_paths_outside_programs_pass if {
	count(for_path([])) == 0
	count(for_path(["x", "programs", "team-b", "p", "1"])) == 0
	count(for_path(["PROGRAMS", "team-b", "p", "1"])) == 0
	for_path(["programs", "team-b"]) == {["cross-namespace-program", "spec.flux.url"], ["program-url-path", "spec.flux.url"]}
	for_path(["programs", "Team-A", "p", "1"]) == {["cross-namespace-program", "spec.flux.url"], ["program-url-path", "spec.flux.url"]}
}

# Under /programs only an artifact path passes (segments as the webhook decodes them).
test_program_paths_must_be_artifact_paths if {
	count(for_path(["programs", "team-a", "p", "1"])) == 0
	count(for_path(["programs", "team-a", "p.q-r", "12"])) == 0
	count(for_path(["programs", "team-a", "p", "1.tar.gz"])) == 0
	bad := {["program-url-path", "spec.flux.url"]}

	# /programs/team-a/..%2fteam-b/p/1
	for_path(["programs", "team-a", "../team-b", "p", "1"]) == bad
	for_path(["programs"]) == bad
	for_path(["programs", "team-a"]) == bad
	for_path(["programs", "team-a", "p"]) == bad
	for_path(["programs", "team-a", "p", "1", "x"]) == bad
	for_path(["programs", "team-a", "a/b", "1"]) == bad
	for_path(["programs", "team-a", "p%2f", "1"]) == bad
	for_path(["programs", "team-a", "p", "1?x"]) == bad
	for_path(["programs", "team-a", "p", "x"]) == bad
	for_path(["programs", "team-a", "p", ".tar.gz"]) == bad
	for_path(["programs", "team-a", "p", "1.zip"]) == bad
	for_path(["programs", "team-a", "-p", "1"]) == bad
	for_path(["programs", "team-a", "p..q", "1"]) == bad
}

# Elsewhere than the file server, /programs paths are someone else's.
test_program_paths_elsewhere_pass if {
	u := parsed("https", "artifacts.example.com", 443, ["programs", "team-a", "../team-b", "p", "1"])
	count(found(workspace_flux("https://artifacts.example.com/x", u))) == 0 with data.tenancy as file_server
}

for_host(host) := pairs if {
	pairs := found(workspace_flux("http://[x]/", parsed("http", host, 80, ["programs", "team-b", "p", "1"]))) with data.tenancy as file_server
}

test_ipv4_mapped_addresses_of_a_file_server_address if {
	denied := {["cross-namespace-program", "spec.flux.url"]}
	for_host("::ffff:a60:c") == denied
	for_host("::ffff:10.96.0.12") == denied
	count(for_host("::ffff:a60:d")) == 0
	count(for_host("::ffff:10.96.0.13")) == 0
	count(for_host("::a60:c")) == 0
	count(for_host("::ffff:a60:c:0")) == 0
	count(for_host("::ffff:g60:c")) == 0
	count(for_host("::ffff:10.96.0")) == 0
	count(for_host("::ffff:10.96.0.1x")) == 0
	count(for_host("::1")) == 0
	mapped := {
		"::ffff:0:0": "0.0.0.0",
		"::ffff:ffff:ffff": "255.255.255.255",
		"::ffff:a60:c": "10.96.0.12",
		"::ffff:c0a8:101": "192.168.1.1",
		"::ffff:192.168.1.1": "192.168.1.1",
	}
	every host, ipv4 in mapped {
		isolation.mapped_ipv4(host) == ipv4
	}
}

test_invalid_urls_denied if {
	url := "http://[::1/x"
	rejected := {"valid": false, "error": "invalid IPv6 address"}
	found(workspace_flux(url, rejected)) == {["invalid-flux-url", "spec.flux.url"]}
	found(stack_flux(url, rejected)) == {["invalid-flux-url", "spec.workspaceTemplate.spec.flux.url"]}
	vs := isolation.violations with input as workspace_flux(url, rejected)
	[v.message | some v in vs] == ["is not a URL the workspace can fetch: invalid IPv6 address"]
	without_message := isolation.violations with input as workspace_flux(url, {"valid": false})
	[[v.code, v.message] | some v in without_message] == [["invalid-flux-url", "is not a URL the workspace can fetch: rejected by the URL parser"]]
}

# Fail closed: a flux URL without a usable parse is refused.
test_unparsed_urls_denied if {
	url := program_url("team-a")
	denied := {["unparsed-flux-url", "spec.flux.url"]}
	found(workspace({"flux": {"url": url}})) == denied
	found(stack({"workspaceTemplate": {"spec": {"flux": {"url": url}}}})) == {["unparsed-flux-url", "spec.workspaceTemplate.spec.flux.url"]}
	found(with_urls(workspace({"flux": {"url": url}}), {})) == denied
	found(with_urls(workspace({"flux": {"url": url}}), {concat("", [url, "/"]): program("team-a")})) == denied
	found(workspace_flux(url, null)) == denied
	found(workspace_flux(url, object.remove(program("team-a"), ["segments"]))) == denied
	found(workspace_flux(url, object.union(program("team-a"), {"valid": "true"}))) == denied
	found(workspace_flux(url, object.union(program("team-a"), {"port": "80"}))) == denied
	found(workspace_flux(url, object.union(program("team-a"), {"segments": ["programs", 1]}))) == denied
	vs := isolation.violations with input as workspace({"flux": {"url": url}})
	[v.message | some v in vs] == ["the admission webhook did not parse this URL, so where it points cannot be checked"]
}

# An update that changes the spec of an object being deleted is checked.
terminating_update(review_doc, old_spec) := json.patch(review_doc, [
	{"op": "replace", "path": "/request/operation", "value": "UPDATE"},
	{"op": "add", "path": "/request/object/metadata/deletionTimestamp", "value": "2025-01-01T00:00:00Z"},
	{"op": "add", "path": "/request/oldObject", "value": {
		"metadata": {"name": "x", "namespace": "team-a", "finalizers": ["team-a.example/hold"]},
		"spec": old_spec,
	}},
])

test_terminating_transforms_are_checked_when_their_spec_changes if {
	admitted := {"sha256": "abcdef", "source": {"configMap": {"name": "m", "key": "k"}}}

	# Only finalizers change: passes, even with a digest the policy no longer allows.
	stale := {"sha256": "123456", "source": {"configMap": {"name": "m", "key": "k"}}}
	count(found(terminating_update(transform(stale), stale))) == 0 with data.tenancy as team_a

	# The digest or the source changes while the object is being deleted: checked.
	swapped := {"sha256": "123456", "source": {"url": "https://evil.example/t.wasm"}}
	found(terminating_update(transform(swapped), admitted)) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a
	digest_only := {"sha256": "123456", "source": admitted.source}
	found(terminating_update(transform(digest_only), admitted)) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a
}

test_terminating_workspaces_are_checked_when_their_flux_url_changes if {
	url := program_url("team-b")
	changed := terminating_update(workspace_flux(url, program("team-b")), {"flux": {"url": program_url("team-a"), "digest": "sha256:00"}})
	found(changed) == {["cross-namespace-program", "spec.flux.url"]} with data.tenancy as file_server
	unchanged := terminating_update(workspace_flux(url, program("team-b")), {"flux": {"url": url, "digest": "sha256:00"}})
	count(found(unchanged)) == 0 with data.tenancy as file_server
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

oci(reference, keys) := {
	"sha256": "123456",
	"source": {"oci": {"reference": reference, "digest": "sha256:00"}},
	"verify": {"cosign": {"keys": keys}},
}

key_a := "-----BEGIN PUBLIC KEY-----\nAAAA\nBBBB\n-----END PUBLIC KEY-----\n"

key_b := "-----BEGIN PUBLIC KEY-----\nCCCC\n-----END PUBLIC KEY-----\n"

team_a_registry := {"policies": [object.union(team_a.policies[0], {
	"allowedTransformRegistries": ["Registry.Team-A.example/plugins/"],
	"allowedTransformKeys": [key_a],
})]}

team_a_registry_only := {"policies": [object.union(team_a.policies[0], {"allowedTransformRegistries": ["registry.team-a.example/plugins"]})]}

test_transform_modules_from_allowed_registries_and_keys if {
	# Allowed: the registry (host case and a tag do not matter) and a key listed, rewrapped.
	count(found(transform(oci("registry.team-a.example/plugins/tags:v1", ["-----BEGIN PUBLIC KEY-----\r\nAAAABBBB\r\n-----END PUBLIC KEY-----"])))) == 0 with data.tenancy as team_a_registry
	count(found(transform(oci("REGISTRY.team-a.example/plugins/a/b", [key_a])))) == 0 with data.tenancy as team_a_registry

	# A prefix matches whole path segments only; other registries and hosts are refused.
	found(transform(oci("registry.team-a.example/plugins-evil/tags", [key_a]))) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a_registry
	found(transform(oci("registry.team-a.example.evil.com/plugins/tags", [key_a]))) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a_registry
	found(transform(oci("evil.example/registry.team-a.example/plugins/tags", [key_a]))) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a_registry

	# Keys: every inline key must be allowed, there must be one, and a Secret cannot be checked.
	found(transform(oci("registry.team-a.example/plugins/tags", [key_a, key_b]))) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a_registry
	found(transform(oci("registry.team-a.example/plugins/tags", []))) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a_registry
	found(transform({
		"sha256": "123456",
		"source": {"oci": {"reference": "registry.team-a.example/plugins/tags", "digest": "sha256:00"}},
		"verify": {"cosign": {"publicKeySecretRef": {"name": "keys", "key": "cosign.pub"}}},
	})) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a_registry

	# Not an OCI source: only the digest list applies.
	found(transform({"sha256": "123456", "source": {"url": "https://registry.team-a.example/plugins/tags.wasm"}})) == {["transform-module", "spec.sha256"]} with data.tenancy as team_a_registry
	count(found(transform({"sha256": "abcdef", "source": {"url": "https://x.example/a.wasm"}}))) == 0 with data.tenancy as team_a_registry

	# Registries without keys: the registry is enough, signed or not.
	count(found(transform({"sha256": "123456", "source": {"oci": {"reference": "registry.team-a.example/plugins/x", "digest": "sha256:00"}}}))) == 0 with data.tenancy as team_a_registry_only
}

test_transform_refusals_say_what_is_allowed if {
	vs := isolation.violations with input as transform(oci("evil.example/x", [key_a])) with data.tenancy as team_a_registry
	[v.message | some v in vs] == ["transform module sha256:123456 is not allowed in namespace team-a (allowed: the listed digests, or OCI artifacts from Registry.Team-A.example/plugins/ verified with one of 1 allowed keys listed inline in verify.cosign.keys; TenancyPolicy team-a)"]
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

# The URL corpus (isolation_corpus_test.rego, a copy of tests/fixtures/url-corpus.json): every
# raw URL with the parts the webhook passes for it, and the namespace the rule must see (null:
# not a Program of the file server). Evaluated with the file server above, for a Workspace and
# for a Stack's workspace template, in namespace team-a.
corpus_review("Workspace", e) := with_urls(workspace({"flux": {"url": e.url, "digest": "sha256:00"}}), {e.url: e.expect})

corpus_review("Stack", e) := with_urls(stack({"workspaceTemplate": {"spec": {"flux": {"url": e.url}}}}), {e.url: e.expect})

flux_url_path := {"Workspace": "spec.flux.url", "Stack": "spec.workspaceTemplate.spec.flux.url"}

corpus_violations(kind, e) := vs if {
	vs := isolation.violations with input as corpus_review(kind, e) with data.tenancy as file_server
}

# Rejected by the parser: invalid-flux-url, with the parser's message.
decided_as_expected(kind, e) if {
	e.expect.valid == false
	vs := corpus_violations(kind, e)
	{[v.code, v.path] | some v in vs} == {["invalid-flux-url", flux_url_path[kind]]}
	every v in vs {
		v.message == concat("", ["is not a URL the workspace can fetch: ", e.expect.error])
	}
}

# Another namespace's Program: denied, and the message names that namespace.
decided_as_expected(kind, e) if {
	e.expect.valid == true
	not e.target in {null, "team-a"}
	vs := corpus_violations(kind, e)
	{[v.code, v.path] | some v in vs} == {["cross-namespace-program", flux_url_path[kind]]} | corpus_path_violation(kind, e)
	every v in [v | some v in vs; v.code == "cross-namespace-program"] {
		v.message == concat("", ["points at a Program of namespace ", e.target, "; only Programs of namespace team-a may be used"])
	}
}

# A corpus path that is not an artifact path is refused for that too.
corpus_path_violation(kind, e) := {["program-url-path", flux_url_path[kind]]} if {
	not isolation.artifact_path(e.expect.segments)
} else := set()

# The own namespace's Program, or not the file server: allowed.
decided_as_expected(kind, e) if {
	e.expect.valid == true
	e.target in {null, "team-a"}
	count(corpus_violations(kind, e)) == 0
}

# [kind, url] of every corpus entry not decided as the corpus says (`opa test -v --var-values`
# shows them when the test below fails).
corpus_mismatches contains [kind, e.url] if {
	some e in corpus
	some kind in ["Workspace", "Stack"]
	not decided_as_expected(kind, e)
}

test_every_corpus_url_is_decided_as_expected if {
	mismatches := corpus_mismatches
	count(mismatches) == 0
}

test_corpus_covers_every_outcome if {
	count(corpus) >= 24
	count({e.url | some e in corpus}) == count(corpus)
	count([e | some e in corpus; e.expect.valid == false]) >= 3
	count([e | some e in corpus; e.target == "team-b"]) >= 24
	count([e | some e in corpus; e.target == "team-a"]) >= 3
	count([e | some e in corpus; e.expect.valid == true; e.target == null]) >= 3
}

# What the rule reads for each entry is exactly the corpus's target.
test_corpus_targets_are_what_the_rule_reads if {
	every e in corpus {
		_target(e) == e.target
	}
}

_target(e) := t if {
	t := isolation.program_namespace(e.expect) with data.tenancy as file_server
} else := null

flux_stack(api_version, kind, name) := stack({"fluxSource": {"sourceRef": {"apiVersion": api_version, "kind": kind, "name": name}}})

test_flux_source_refs_of_flux_kinds_pass if {
	every k in isolation.flux_source_kinds {
		count(found(flux_stack("source.toolkit.fluxcd.io/v1", k, "repo.v2"))) == 0
	}
	count(found(flux_stack("source.toolkit.fluxcd.io/v1beta2", "OCIRepository", "r"))) == 0
}

test_flux_source_refs_that_bend_the_request_path_denied if {
	every av in [
		"pulumi.com/v1/namespaces/team-b/programs/secret-prog?x=",
		"source.toolkit.fluxcd.io/v1?watch=true",
		"source.toolkit.fluxcd.io/v1#x",
		"source.toolkit.fluxcd.io%2Fv1",
		"source.toolkit.fluxcd.io/v1%3F",
		"../v1",
		"v1",
		"source.toolkit.fluxcd.io/v01",
	] {
		found(flux_stack(av, "GitRepository", "r")) == {["invalid-flux-source-ref", "spec.fluxSource.sourceRef.apiVersion"]}
	}
	every n in ["../x", "x/y", "x?watch=true", "x%2Fy", "x#y", "", "Upper"] {
		found(flux_stack("source.toolkit.fluxcd.io/v1", "GitRepository", n)) == {["invalid-flux-source-ref", "spec.fluxSource.sourceRef.name"]}
	}
}

test_flux_source_refs_of_other_kinds_denied if {
	every k in ["Secret", "Program", "ConfigMap", "Namespace", "gitrepository"] {
		found(flux_stack("source.toolkit.fluxcd.io/v1", k, "r")) == {["invalid-flux-source-ref", "spec.fluxSource.sourceRef.kind"]}
	}
}

test_stacks_without_flux_source_pass_the_flux_rule if {
	not "invalid-flux-source-ref" in {c | some [c, _] in found(stack({"programRef": {"name": "p"}}))}
}
