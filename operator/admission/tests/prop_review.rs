//! Property tests of the webhook's parsers of outside input: AdmissionReview bodies and the flux
//! URLs inside them, the latter also through the real policy bundle (`make policies`; the path
//! comes from PKO_POLICY_BUNDLE) evaluated by opa-wasm.
//!
//! Case count: PKO_PROPTEST_CASES (defaults below; `make fuzz-long` raises it). Failures are not
//! persisted: proptest prints the shrunk input, which becomes a unit test next to the code.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use pko_admission::metrics::AdmissionMetrics;
use pko_admission::tenancy::{FileServerNames, Tenancy, TenancySettings};
use pko_admission::urls::{self, FetchTarget, parse_fetch_url};
use pko_admission::webhook::{self, Admission, FailurePolicy, WebhookError};
use pko_admission::{Bundle, EngineLimits, PolicyEngine};
use proptest::prelude::*;
use serde_json::{Value, json};

fn config(default_cases: u32) -> ProptestConfig {
    let cases = match std::env::var("PKO_PROPTEST_CASES") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("PKO_PROPTEST_CASES={v:?}: expected a case count")),
        Err(_) => default_cases,
    };
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn review(namespace: &str, flux_url: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "6a0c6b4e-5d1c-4b8e-9d3e-000000000001",
            "kind": {"group": "auto.pulumi.com", "version": "v1alpha1", "kind": "Workspace"},
            "resource": {"group": "auto.pulumi.com", "version": "v1alpha1", "resource": "workspaces"},
            "name": "w",
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "auto.pulumi.com/v1alpha1",
                "kind": "Workspace",
                "metadata": {"name": "w", "namespace": namespace},
                "spec": {"flux": {"url": flux_url, "digest": "sha256:00"}},
            },
            "oldObject": null,
            "dryRun": false,
        },
    })
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Every JSON pointer of `value` (objects and arrays), the root included.
fn pointers(value: &Value, at: String, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            out.push(at.clone());
            for (k, v) in map {
                let escaped = k.replace('~', "~0").replace('/', "~1");
                pointers(v, format!("{at}/{escaped}"), out);
            }
        }
        Value::Array(items) => {
            out.push(at.clone());
            for (i, v) in items.iter().enumerate() {
                pointers(v, format!("{at}/{i}"), out);
            }
        }
        _ => out.push(at),
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// Any body: a review or a reason, never a panic; a reason for anything but JSON.
    #[test]
    fn any_body_is_decoded_or_refused(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let result = webhook::parse_review(&body);
        if serde_json::from_slice::<Value>(&body).is_err() {
            prop_assert!(matches!(result, Err(WebhookError::InvalidReview(ref m)) if m.contains("not JSON")));
        }
    }

    /// A valid review with any one value replaced by any JSON: decoded or refused with a
    /// reason; when decoded, the request is the one in the body and every flux URL in it is
    /// annotated with what the URL parser makes of it.
    #[test]
    fn mutated_reviews_are_decoded_or_refused(
        url in ".{0,40}",
        which in any::<prop::sample::Index>(),
        replacement in json_value(),
    ) {
        let mut body = review("team-a", Value::from(url));
        let mut all = Vec::new();
        pointers(&body, String::new(), &mut all);
        let pointer = which.get(&all).clone();
        match body.pointer_mut(&pointer) {
            Some(slot) => *slot = replacement,
            None => prop_assert!(false, "{pointer}"),
        }
        match webhook::parse_review(body.to_string().as_bytes()) {
            Err(WebhookError::InvalidReview(reason)) => prop_assert!(!reason.is_empty()),
            Err(other) => prop_assert!(false, "{other}"),
            Ok(review) => {
                let (input, request) = (&review.input, &review.request);
                prop_assert_eq!(Value::from(request.uid.clone()), body["request"]["uid"].clone());
                prop_assert!(!request.uid.is_empty());
                for pointer in urls::FETCHED_URLS {
                    if let Some(raw) = body.pointer(pointer).and_then(Value::as_str) {
                        prop_assert_eq!(&input["pko"]["urls"][raw], &urls::fetch_target(raw));
                    }
                }
            }
        }
    }

    /// Any text: a target or a reason, never a panic; a target's parts parse back to itself.
    #[test]
    fn any_url_parses_or_is_refused(raw in ".{0,60}", near in "(https?|HTTPS?|ftp|file):[/\\\\]{0,3}[-a-z0-9.:@%\\[\\]]{0,20}(/[-a-z0-9.%]{0,6}){0,4}") {
        for raw in [raw, near] {
            let value = urls::fetch_target(&raw);
            prop_assert!(value["valid"].is_boolean());
            if let Ok(target) = parse_fetch_url(&raw) {
                prop_assert_eq!(parse_fetch_url(&rebuilt(&target)), Ok(target.clone()), "{}", raw);
            } else {
                prop_assert!(value["error"].as_str().is_some_and(|e| !e.is_empty()));
            }
        }
    }
}

/// A URL spelling `target` plainly: the default port, each segment percent-encoded.
fn rebuilt(target: &FetchTarget) -> String {
    let host = if target.host.contains(':') {
        format!("[{}]", target.host)
    } else {
        target.host.clone()
    };
    let port = target.port.map(|p| format!(":{p}")).unwrap_or_default();
    let path: String = target
        .segments
        .iter()
        .map(|s| {
            format!(
                "/{}",
                percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC)
            )
        })
        .collect();
    format!("{}://{host}{port}{path}", target.scheme)
}

/// One address, spelled in the many ways a fetcher reads as that address.
#[derive(Clone, Debug)]
struct Spelling {
    upper_scheme: bool,
    upper_host: bool,
    explicit_port: bool,
    trailing_dot: bool,
    userinfo: bool,
    dot_segment: bool,
    encoded_dot_segment: bool,
    empty_segments: bool,
    backslashes: bool,
    tab: bool,
    encode: Vec<bool>,
    query: bool,
}

fn spelling() -> impl Strategy<Value = Spelling> {
    (
        prop::array::uniform12(any::<bool>()),
        prop::collection::vec(any::<bool>(), 1..8),
    )
        .prop_map(|(b, encode)| Spelling {
            upper_scheme: b[0],
            upper_host: b[1],
            explicit_port: b[2],
            trailing_dot: b[3],
            userinfo: b[4],
            dot_segment: b[5],
            encoded_dot_segment: b[6],
            empty_segments: b[7],
            backslashes: b[8],
            tab: b[9],
            query: b[10],
            encode,
        })
}

/// `http://fs.sys/programs/{namespace}/{name}/1`, spelled as `s` says.
fn spell(s: &Spelling, namespace: &str, name: &str) -> String {
    let scheme = if s.upper_scheme { "HTTP" } else { "http" };
    let mut host = if s.upper_host { "FS.SYS" } else { "fs.sys" }.to_owned();
    if s.trailing_dot {
        host.push('.');
    }
    let userinfo = if s.userinfo { "user:pw@" } else { "" };
    let port = if s.explicit_port { ":80" } else { "" };
    let sep = if s.backslashes { "\\" } else { "/" };
    let mut segments = vec!["programs".to_owned()];
    if s.dot_segment {
        segments.extend(["elsewhere".into(), "..".into()]);
    }
    if s.encoded_dot_segment {
        segments.extend(["x".into(), "%2e%2E".into()]);
    }
    let encode = |text: &str| -> String {
        text.chars()
            .zip(s.encode.iter().cycle())
            .map(|(c, &e)| {
                if e {
                    format!("%{:02X}", c as u32)
                } else {
                    c.to_string()
                }
            })
            .collect()
    };
    // Empty segments only after the dot segments: `..` after an empty one removes that one.
    let joiner = if s.empty_segments {
        format!("{sep}{sep}")
    } else {
        sep.to_owned()
    };
    let rest = [encode(namespace), encode(name), "1".into()].join(&joiner);
    let mut path = format!("{sep}{}{joiner}{rest}", segments.join(sep));
    if s.tab {
        path.insert(2, '\t');
    }
    let query = if s.query {
        "?x=/programs/team-a#/programs/team-a"
    } else {
        ""
    };
    format!("{scheme}://{userinfo}{host}{port}{path}{query}")
}

fn names() -> FileServerNames {
    FileServerNames {
        hosts: vec!["fs.sys".into()],
        ports: vec![80],
    }
}

fn bundle_path() -> PathBuf {
    match std::env::var_os("PKO_POLICY_BUNDLE").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "PKO_POLICY_BUNDLE is not set: run `make policies` (or `make test`, which sets it) \
             and export PKO_POLICY_BUNDLE=~/.cache/pko-rs/policies/policies.tar.gz"
        ),
    }
}

/// The violations of a review's decision, as (policy/code, field path).
fn violations(
    runtime: &tokio::runtime::Runtime,
    admission: &Admission,
    body: &Value,
) -> BTreeSet<(String, String)> {
    let review = webhook::parse_review(body.to_string().as_bytes()).expect("review");
    let decision = runtime
        .block_on(admission.decision(&review))
        .expect("decision");
    decision
        .violations
        .into_iter()
        .map(|v| (format!("{}/{}", v.policy, v.code), v.path))
        .collect()
}

#[test]
fn spellings_of_a_program_url_get_one_verdict() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let admission = runtime.block_on(async {
        let bundle = Bundle::load(&bundle_path()).expect("bundle loads");
        let engine = PolicyEngine::new(&bundle, EngineLimits::default())
            .await
            .expect("engine");
        let settings = TenancySettings {
            file_server: names(),
            ..TenancySettings::default()
        };
        let tenancy = Tenancy::fixed(vec![], BTreeMap::new(), settings);
        Admission::new(
            engine,
            tenancy,
            AdmissionMetrics::new(),
            FailurePolicy::Fail,
        )
    });
    let canonical = |ns: &str| {
        review(
            "team-a",
            Value::from(format!("http://fs.sys/programs/{ns}/p/1")),
        )
    };
    let foreign = violations(&runtime, &admission, &canonical("team-b"));
    let own = violations(&runtime, &admission, &canonical("team-a"));
    assert!(
        foreign
            .iter()
            .any(|(code, _)| code.starts_with("isolation/")),
        "a Program of another namespace is an isolation violation: {foreign:?}"
    );
    assert!(
        !own.iter().any(|(code, _)| code.starts_with("isolation/")),
        "{own:?}"
    );
    let mut runner = proptest::test_runner::TestRunner::new(config(64));
    let result = runner.run(
        &(spelling(), prop::sample::select(vec!["team-a", "team-b"])),
        |(s, ns)| {
            let raw = spell(&s, ns, "p");
            let target = parse_fetch_url(&raw).expect("a valid URL");
            prop_assert_eq!(target.program_namespace(&names()), Some(ns), "{}", raw);
            let expected = if ns == "team-a" { &own } else { &foreign };
            let got = violations(
                &runtime,
                &admission,
                &review("team-a", Value::from(raw.clone())),
            );
            prop_assert_eq!(&got, expected, "{}", raw);
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}
