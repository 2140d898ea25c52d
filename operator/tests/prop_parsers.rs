//! Property tests of the operator's parsers of outside input: the Program spec rendered to
//! `Pulumi.yaml` (what a workspace parses back), and the file server's paths and capability
//! queries (what any client on the network sends), driven through the real router.
//!
//! Case count: PKO_PROPTEST_CASES (defaults below; `make fuzz-long` raises it). Failures are not
//! persisted: proptest prints the shrunk input, which becomes a unit test next to the code.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use http::{Request, StatusCode};
use k8s_openapi::ByteString;
use kube::runtime::reflector;
use kube::runtime::watcher::Event;
use pko_api::program::{Program, ProgramSpec};
use pko_operator::artifact::index::ProgramIndex;
use pko_operator::artifact::stored::StoredProgram;
use pko_operator::artifact::{self, ArtifactError};
use pko_operator::capability::{ArtifactRef, KeyRing, KeySet};
use pko_operator::fileserver::{self, FileServer, parse_generation};
use pko_operator::metrics::Metrics;
use proptest::prelude::*;
use serde_json::{Map, Value};
use tower::ServiceExt;

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

// ---------------------------------------------------------------------------------------------
// Program spec → Pulumi.yaml

/// Strings YAML reads as something else when written plainly.
fn tricky_string() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        prop::sample::select(vec![
            "",
            "yes",
            "no",
            "on",
            "off",
            "true",
            "False",
            "null",
            "~",
            "NULL",
            "1",
            "-1",
            "0x1f",
            "0o17",
            "1e3",
            ".inf",
            "-.Inf",
            ".nan",
            "1_000",
            "12:30:00",
            "2024-01-01",
            "<<",
            "&a",
            "*a",
            "!tag",
            "%x",
            "@x",
            "`x",
            "- a",
            "a: b",
            "a #b",
            "#c",
            " lead",
            "trail ",
            "\ttab",
            "multi\nline",
            "line\n",
            "\"q\"",
            "'q'",
            "{a: 1}",
            "[1]",
            "|",
            ">",
            "?",
            "${bucket.id}",
            "\u{feff}bom",
            "\u{85}nel",
            "\u{2028}ls",
            "é",
            "\0nul",
        ])
        .prop_map(str::to_owned),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON numbers are finite", |f| f.is_finite())
            .prop_map(Value::from),
        tricky_string().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((tricky_string(), inner), 0..6)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A spec: an object whose top-level keys are not the reserved `name` and `runtime`.
fn spec() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::vec((tricky_string(), json_value()), 0..6).prop_map(|pairs| {
        pairs
            .into_iter()
            .filter(|(k, _)| k != "name" && k != "runtime")
            .collect()
    })
}

/// The same object with its keys inserted in reverse order, at every depth.
fn reversed(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .rev()
                .map(|(k, v)| (k.clone(), reversed(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(reversed).collect()),
        other => other.clone(),
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// The served YAML parses back to the spec, with `name` and `runtime` added.
    #[test]
    fn rendered_yaml_parses_back_to_the_spec(name in tricky_string(), spec in spec()) {
        let yaml = artifact::render_project(&name, &Value::Object(spec.clone())).expect("render");
        let parsed: Value = yaml_serde::from_str(&yaml).expect("the rendered YAML parses");
        let mut expected = spec;
        expected.insert("name".into(), Value::from(name));
        expected.insert("runtime".into(), Value::from("yaml"));
        prop_assert_eq!(parsed, Value::Object(expected), "{}", yaml);
    }

    /// Same spec, same bytes and digest, whatever the key order it came with.
    #[test]
    fn artifacts_are_deterministic(name in "[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?", spec in spec()) {
        let spec = Value::Object(spec);
        let a = artifact::build(&name, &spec).expect("build");
        let b = artifact::build(&name, &reversed(&spec)).expect("build");
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(artifact::build(&name, &spec).expect("build"), a);
    }

    /// Anything but an object (or null) and the reserved keys are refused with a reason.
    #[test]
    fn bad_specs_are_refused(value in json_value(), reserved in prop::sample::select(vec!["name", "runtime"])) {
        match &value {
            Value::Object(_) | Value::Null => {}
            other => prop_assert!(matches!(
                artifact::render_project("p", other),
                Err(ArtifactError::NotAnObject(_))
            )),
        }
        let mut spec = Map::new();
        spec.insert(reserved.to_owned(), value);
        prop_assert!(matches!(
            artifact::render_project("p", &Value::Object(spec)),
            Err(ArtifactError::ReservedKey(k)) if k == reserved
        ));
    }
}

// ---------------------------------------------------------------------------------------------
// File server: paths and capability queries

fn keys() -> KeySet {
    KeySet::from_data(&BTreeMap::from([(
        "k1".to_owned(),
        ByteString(vec![7; 32]),
    )]))
}

fn program(ns: &str, name: &str, generation: i64) -> StoredProgram {
    let mut p = Program::new(name, ProgramSpec::default());
    p.metadata.namespace = Some(ns.to_owned());
    p.metadata.generation = Some(generation);
    p.metadata.uid = Some(format!("uid-{ns}-{name}"));
    StoredProgram::from_program(&p).expect("stores")
}

/// The real router over a reflector store holding `programs`.
fn router_with(programs: &[(&str, &str, i64)]) -> Router {
    let (store, mut writer) = reflector::store::<StoredProgram>();
    for (ns, name, generation) in programs {
        writer.apply_watcher_event(&Event::Apply(program(ns, name, *generation)));
    }
    let metrics = Metrics::new();
    // Unknown Programs are answered once this short wait for the watch ends.
    let index = ProgramIndex::new(store, 1 << 20, metrics.clone())
        .with_publish_wait(Duration::from_millis(1));
    fileserver::router(FileServer {
        index: Arc::new(index),
        metrics,
        keys: KeyRing::new(keys()),
    })
}

/// `digest=…&token=…` of the artifact an empty-spec Program `name` has.
fn capability(ns: &str, name: &str, generation: i64) -> (String, String) {
    let digest = artifact::build(name, &serde_json::json!({}))
        .expect("build")
        .digest;
    let artifact = ArtifactRef {
        namespace: ns,
        name,
        generation,
        digest: &digest,
    };
    let token = keys().sign(0, &artifact).expect("token");
    (digest, token)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn get(app: &Router, uri: &str) -> Option<(StatusCode, Vec<u8>)> {
    // A URI the HTTP layer itself refuses never reaches the router.
    let request = Request::get(uri).body(Body::empty()).ok()?;
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = to_bytes(response.into_body(), 1 << 20).await.expect("body");
    Some((status, body.to_vec()))
}

/// `text` with each byte of `mask`'s choosing percent-encoded (any spelling a client may send),
/// except `/`, whose encoded form is another path.
fn percent_encode_some(text: &str, mask: &[bool]) -> String {
    text.bytes()
        .zip(mask.iter().cycle())
        .map(|(b, &encode)| {
            if encode && b != b'/' {
                format!("%{b:02X}")
            } else {
                (b as char).to_string()
            }
        })
        .collect()
}

fn dns_label() -> impl Strategy<Value = String> {
    "[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?"
}

proptest! {
    #![proptest_config(config(256))]

    /// Generations are canonical positive integers, `.tar.gz` optional: any accepted text is
    /// exactly the number's spelling.
    #[test]
    fn generations_are_canonical(n in 1i64..=999_999_999_999_999_999, text in "[-+0-9.a-z]{0,22}") {
        let digits = n.to_string();
        prop_assert_eq!(parse_generation(&digits), Some(n));
        prop_assert_eq!(parse_generation(&format!("{digits}.tar.gz")), Some(n));
        if let Some(m) = parse_generation(&text) {
            prop_assert!(m > 0);
            prop_assert!(text == m.to_string() || text == format!("{m}.tar.gz"), "{text:?} -> {m}");
        }
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// No request without the token of an existing artifact is served, whatever its path and
    /// query, and none gets a server error.
    #[test]
    fn unsigned_requests_are_never_served(
        path in "(/[-a-zA-Z0-9.%~_:@!$&'()*+,;=]{0,12}){0,5}/?",
        query in proptest::option::of("[-a-zA-Z0-9.%~_=&+/:?]{0,60}"),
    ) {
        let app = router_with(&[("ns", "p", 2)]);
        let uri = match &query {
            Some(q) => format!("/programs{path}?{q}"),
            None => format!("/programs{path}"),
        };
        if let Some((status, body)) = runtime().block_on(get(&app, &uri)) {
            prop_assert!(
                matches!(status.as_u16(), 400 | 404),
                "{uri}: {status} {}", String::from_utf8_lossy(&body)
            );
            prop_assert!(!body.is_empty(), "{uri}: no reason given");
        }
    }

    /// A signed URL is served for any Program, however its path and query are percent-encoded
    /// and ordered, with other parameters around; a token for anything else is answered like an
    /// unknown Program.
    #[test]
    fn signed_urls_are_served_in_any_spelling(
        ns in dns_label(),
        name in dns_label(),
        generation in 1i64..1_000_000,
        tar_gz in any::<bool>(),
        mask in prop::collection::vec(any::<bool>(), 1..16),
        token_first in any::<bool>(),
        extra in proptest::option::of("[a-z]{1,5}=[a-z0-9]{0,5}"),
        flip in any::<prop::sample::Index>(),
    ) {
        let app = router_with(&[(&ns, &name, generation)]);
        let (digest, token) = capability(&ns, &name, generation);
        let suffix = if tar_gz { ".tar.gz" } else { "" };
        let path = percent_encode_some(&format!("{ns}/{name}/{generation}{suffix}"), &mask);
        let enc = |v: &str| url::form_urlencoded::byte_serialize(v.as_bytes()).collect::<String>();
        let mut params = vec![
            format!("digest={}", percent_encode_some(&digest, &mask)),
            format!("token={}", enc(&token)),
        ];
        if token_first {
            params.reverse();
        }
        if let Some(extra) = &extra {
            params.insert(1, extra.clone());
        }
        let uri = format!("/programs/{path}?{}", params.join("&"));
        let rt = runtime();
        let served = rt.block_on(get(&app, &uri)).expect("valid URI");
        prop_assert_eq!(served.0, StatusCode::OK, "{}: {}", uri, String::from_utf8_lossy(&served.1));
        let expected = artifact::build(&name, &serde_json::json!({})).expect("build");
        prop_assert_eq!(&served.1, &expected.bytes.to_vec());

        // One character of the token changed: refused like an unknown Program.
        let i = flip.index(token.len());
        let changed: String = token
            .char_indices()
            .map(|(j, c)| if j == i { if c == 'A' { 'B' } else { 'A' } } else { c })
            .collect();
        let forged = format!("/programs/{ns}/{name}/{generation}?digest={}&token={}", enc(&digest), enc(&changed));
        let unknown = rt
            .block_on(get(&app, &format!("/programs/{ns}/unknown-{name}/{generation}?digest={}&token={}", enc(&digest), enc(&token))))
            .expect("valid URI");
        let refused = rt.block_on(get(&app, &forged)).expect("valid URI");
        prop_assert_eq!(refused.0, StatusCode::NOT_FOUND, "{}", forged);
        prop_assert_eq!(&refused, &unknown);
    }
}
