//! The Program file server: `GET`/`HEAD /programs/{namespace}/{name}/{generation}[.tar.gz]`.
//!
//! Runs on every replica. Answers from the watch-fed [`crate::artifact::index::ProgramIndex`], never with an
//! apiserver round trip per request, with explicit errors: 400 for a malformed path, 404 for an
//! unknown Program or generation (after a bounded wait for this replica's watch, so a URL just
//! published elsewhere is served), 410 for a superseded generation, 405 for other methods.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use pko_api::names::{is_dns1123_label, is_dns1123_subdomain};

use crate::artifact::Artifact;
use crate::artifact::index::{Lookup, ProgramIndex};
use crate::capability::{ArtifactRef, KeyRing};
use crate::metrics::{Metrics, RefusalReason, RequestLabels};

/// Suffix PKO advertises in `status.artifact.path`; accepted on URLs too.
const TAR_GZ: &str = ".tar.gz";

/// Shared state of the file-server handlers.
#[derive(Clone)]
pub struct FileServer {
    pub index: Arc<ProgramIndex>,
    pub metrics: Metrics,
    /// Verifies the capability tokens of artifact URLs.
    pub keys: KeyRing,
}

/// The file server's routes.
pub fn router(state: FileServer) -> Router {
    let metrics = state.metrics.clone();
    Router::new()
        .route("/programs", any(programs_root))
        .route("/programs/", any(programs_root))
        .route("/programs/{*rest}", any(programs))
        .fallback(not_found)
        .with_state(state)
        .layer(middleware::from_fn_with_state(metrics, record))
}

/// Everything under `/programs/`: one wildcard route, split here, so malformed paths get a 400
/// that says what was expected instead of a routing miss.
async fn programs(
    State(state): State<FileServer>,
    method: Method,
    uri: Uri,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return method_not_allowed();
    }
    let Some(segments) = uri
        .path()
        .strip_prefix("/programs/")
        .and_then(path_segments)
    else {
        return malformed();
    };
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    match segments.as_slice() {
        [namespace, name, generation] => {
            let request = ProgramRequest {
                namespace,
                name,
                generation,
                query: query.as_deref().unwrap_or_default(),
            };
            serve_program(&state, request, &headers).await
        }
        _ => malformed(),
    }
}

/// The segments of a path, split on `/` first and percent-decoded one by one, as an HTTP client
/// and the admission policies read them: an encoded `/` (`%2F`) never splits a segment, and a
/// segment that decodes to something holding `/` or to invalid UTF-8 makes the path malformed.
fn path_segments(raw: &str) -> Option<Vec<String>> {
    raw.split('/')
        .map(|segment| {
            let decoded = percent_encoding::percent_decode_str(segment)
                .decode_utf8()
                .ok()?;
            (!decoded.contains('/')).then(|| decoded.into_owned())
        })
        .collect()
}

/// One request for an artifact, as it came.
struct ProgramRequest<'a> {
    namespace: &'a str,
    name: &'a str,
    generation: &'a str,
    query: &'a str,
}

/// The capability of a request: `digest` and `token`, each exactly once.
#[derive(Debug, PartialEq)]
struct Capability {
    digest: String,
    token: String,
}

fn capability(query: &str) -> Result<Capability, RefusalReason> {
    let (mut digest, mut token) = (None, None);
    for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
        let slot = match &*key {
            "digest" => &mut digest,
            "token" => &mut token,
            _ => continue,
        };
        if slot.replace(value.into_owned()).is_some() {
            return Err(RefusalReason::BadToken);
        }
    }
    match (digest, token) {
        (Some(digest), Some(token)) => Ok(Capability { digest, token }),
        _ => Err(RefusalReason::NoToken),
    }
}

async fn programs_root(method: Method) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return method_not_allowed();
    }
    malformed()
}

async fn serve_program(
    state: &FileServer,
    request: ProgramRequest<'_>,
    headers: &HeaderMap,
) -> Response {
    let ProgramRequest {
        namespace,
        name,
        generation,
        query,
    } = request;
    if !is_dns1123_label(namespace) {
        return text(
            StatusCode::BAD_REQUEST,
            format!("invalid namespace {namespace:?}: expected a DNS-1123 label"),
        );
    }
    if !is_dns1123_subdomain(name) {
        return text(
            StatusCode::BAD_REQUEST,
            format!("invalid program name {name:?}: expected a DNS-1123 subdomain"),
        );
    }
    let Some(gen_num) = parse_generation(generation) else {
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "invalid generation {generation:?}: expected a positive integer, optionally followed by {TAR_GZ}"
            ),
        );
    };
    // The token is checked before anything is looked up, and a request without a valid one is
    // answered exactly like an unknown Program: no existence or generation oracle.
    let authorised = capability(query).and_then(|cap| {
        let artifact = ArtifactRef {
            namespace,
            name,
            generation: gen_num,
            digest: &cap.digest,
        };
        if state.keys.get().verify(&cap.token, &artifact) {
            Ok(cap.digest)
        } else {
            Err(RefusalReason::BadToken)
        }
    });
    let digest = match authorised {
        Ok(digest) => digest,
        Err(reason) => {
            state
                .metrics
                .fileserver_refused
                .get_or_create(&reason.labels())
                .inc();
            return artifact_not_found();
        }
    };
    match state.index.lookup_published(namespace, name, gen_num).await {
        Lookup::Found(built) if built.artifact.digest != digest => text(
            StatusCode::GONE,
            format!(
                "generation {gen_num} of program {namespace}/{name} was rebuilt (a transform changed); the Program's status.artifact.url has the current URL"
            ),
        ),
        Lookup::Found(built) => artifact_response(&built.artifact, headers),
        Lookup::ProgramNotFound => artifact_not_found(),
        Lookup::Superseded { current } => text(
            StatusCode::GONE,
            format!(
                "generation {gen_num} of program {namespace}/{name} is superseded; the current generation is {current}"
            ),
        ),
        // A Program deleted and re-created may be at a lower generation than a valid token's.
        Lookup::UnknownGeneration { .. } => artifact_not_found(),
        Lookup::Failed(err) if err.is_transient() => {
            // A timeout or a busy plugin host: the same request may succeed shortly.
            let mut response = text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("artifact of program {namespace}/{name} cannot be built now: {err}"),
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            response
        }
        Lookup::Failed(err) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("artifact of program {namespace}/{name} cannot be built: {err}"),
        ),
    }
}

/// The artifact's bytes, or 304 when the client's ETag is the artifact's digest.
fn artifact_response(artifact: &Artifact, headers: &HeaderMap) -> Response {
    let etag = format!("\"{}\"", artifact.digest);
    if etag_matches(headers, &etag) {
        return Response::builder()
            .status(StatusCode::NOT_MODIFIED)
            .header(header::ETAG, etag)
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::empty())
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/gzip")
        .header(header::CONTENT_LENGTH, artifact.bytes.len())
        .header(header::ETAG, etag)
        // The same URL can carry new bytes when a transform changes: revalidate by ETag.
        .header(header::CACHE_CONTROL, "no-cache")
        .header(
            header::CONTENT_DISPOSITION,
            "attachment; filename=project.tar.gz",
        )
        .body(Body::from(artifact.bytes.clone()))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The one answer for an unknown artifact and for a request not entitled to it.
fn artifact_not_found() -> Response {
    text(
        StatusCode::NOT_FOUND,
        "artifact not found: use the URL in the Program's status.artifact.url".to_owned(),
    )
}

fn malformed() -> Response {
    text(
        StatusCode::BAD_REQUEST,
        "malformed path: expected /programs/{namespace}/{name}/{generation}".to_owned(),
    )
}

async fn not_found() -> Response {
    artifact_not_found()
}

fn method_not_allowed() -> Response {
    let mut response = text(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed: use GET or HEAD".to_owned(),
    );
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET,HEAD"));
    response
}

/// Counts and times every request, including rejected ones.
async fn record(State(metrics): State<Metrics>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let response = next.run(request).await;
    metrics
        .fileserver_requests
        .get_or_create(&RequestLabels::new(&method, response.status()))
        .inc();
    metrics
        .fileserver_duration
        .observe(started.elapsed().as_secs_f64());
    response
}

fn text(status: StatusCode, message: String) -> Response {
    let mut response = (status, format!("{message}\n")).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// `"12"` or `"12.tar.gz"` → 12. Leading zeros, signs and zero itself are rejected: generations
/// start at 1, and a lenient parse would silently serve the wrong thing.
pub fn parse_generation(raw: &str) -> Option<i64> {
    let digits = raw.strip_suffix(TAR_GZ).unwrap_or(raw);
    if digits.is_empty()
        || digits.len() > 18
        || digits.starts_with('0')
        || !digits.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    digits.parse().ok()
}

/// RFC 9110 `If-None-Match` with weak comparison: `*` or any listed tag equal to ours.
fn etag_matches(headers: &HeaderMap, etag: &str) -> bool {
    headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|tag| tag.trim())
        .any(|tag| tag == "*" || tag.strip_prefix("W/").unwrap_or(tag) == etag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_parse_strictly() {
        assert_eq!(parse_generation("1"), Some(1));
        assert_eq!(parse_generation("42.tar.gz"), Some(42));
        for bad in [
            "",
            "0",
            "01",
            "-1",
            "+1",
            "1.5",
            "abc",
            "1.tar",
            ".tar.gz",
            "1 ",
            "99999999999999999999",
        ] {
            assert_eq!(parse_generation(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn names_follow_kubernetes_rules() {
        assert!(is_dns1123_label("default"));
        assert!(!is_dns1123_label("Default"));
        assert!(!is_dns1123_label("-a"));
        assert!(!is_dns1123_label(&"a".repeat(64)));
        assert!(is_dns1123_subdomain("my.program-1"));
        assert!(!is_dns1123_subdomain("my..program"));
        assert!(!is_dns1123_subdomain("a_b"));
    }

    #[test]
    fn if_none_match_uses_weak_comparison() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::IF_NONE_MATCH,
            HeaderValue::from_static("\"x\", W/\"sha256:ab\""),
        );
        assert!(etag_matches(&headers, "\"sha256:ab\""));
        assert!(!etag_matches(&headers, "\"sha256:cd\""));
        headers.insert(header::IF_NONE_MATCH, HeaderValue::from_static("*"));
        assert!(etag_matches(&headers, "\"anything\""));
    }
}

/// The router driven in-process (kubewarden style), over a real reflector store fed by hand:
/// routing, parsing and HTTP semantics without a control plane. The same cases run against the
/// real apiserver and operator binary in tests/tests/program.rs.
#[cfg(test)]
mod router_tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use axum::body::to_bytes;
    use http::Request;
    use k8s_openapi::ByteString;
    use kube::runtime::reflector;
    use kube::runtime::watcher::Event;
    use pko_api::program::{Program, ProgramSpec};
    use tower::ServiceExt;

    use super::*;
    use crate::artifact::stored::StoredProgram;
    use crate::capability::KeySet;

    fn program(ns: &str, name: &str, generation: i64) -> StoredProgram {
        let mut p = Program::new(name, ProgramSpec::default());
        p.metadata.namespace = Some(ns.to_owned());
        p.metadata.generation = Some(generation);
        p.metadata.uid = Some(format!("uid-{ns}-{name}"));
        StoredProgram::from_program(&p).unwrap()
    }

    fn index_with(
        programs: &[(&str, &str, i64)],
        publish_wait: Duration,
    ) -> (FileServer, reflector::store::Writer<StoredProgram>) {
        let (store, mut writer) = reflector::store::<StoredProgram>();
        for (ns, name, generation) in programs {
            writer.apply_watcher_event(&Event::Apply(program(ns, name, *generation)));
        }
        let metrics = Metrics::new();
        let index =
            ProgramIndex::new(store, 1 << 20, metrics.clone()).with_publish_wait(publish_wait);
        let state = FileServer {
            index: Arc::new(index),
            metrics,
            keys: KeyRing::new(keys()),
        };
        (state, writer)
    }

    fn keys() -> KeySet {
        KeySet::from_data(&BTreeMap::from([(
            "k1".to_owned(),
            ByteString(vec![7; 32]),
        )]))
    }

    /// The capability URL of `/programs/{ns}/{name}/{generation}` for the artifact a Program
    /// with an empty spec has.
    fn signed(ns: &str, name: &str, generation: &str) -> String {
        let digest = crate::artifact::build(name, &serde_json::json!({}))
            .expect("build")
            .digest;
        let artifact = ArtifactRef {
            namespace: ns,
            name,
            generation: parse_generation(generation).expect("generation"),
            digest: &digest,
        };
        let token = keys().sign(0, &artifact).expect("token");
        format!(
            "/programs/{ns}/{name}/{generation}?{}",
            artifact.query(&token)
        )
    }

    fn state_with(programs: &[(&str, &str, i64)]) -> FileServer {
        // Unknown Programs are answered after a short wait here; the wait itself is tested below.
        index_with(programs, Duration::from_millis(20)).0
    }

    async fn call(
        app: &Router,
        method: &str,
        uri: &str,
        etag: Option<&str>,
    ) -> (StatusCode, HeaderMap, Vec<u8>) {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(tag) = etag {
            req = req.header(header::IF_NONE_MATCH, tag);
        }
        let resp = app
            .clone()
            .oneshot(req.body(Body::empty()).expect("request"))
            .await
            .expect("response");
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = to_bytes(resp.into_body(), 1 << 20).await.expect("body");
        (status, headers, body.to_vec())
    }

    #[tokio::test]
    async fn serves_current_generation_with_identity_headers() {
        let app = router(state_with(&[("ns", "p", 2)]));
        let (status, headers, body) = call(&app, "GET", &signed("ns", "p", "2"), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers[header::CONTENT_TYPE], "application/gzip");
        assert_eq!(
            headers[header::CONTENT_LENGTH],
            body.len().to_string().as_str()
        );
        let expected = crate::artifact::build("p", &serde_json::json!({})).expect("build");
        assert_eq!(body, expected.bytes.to_vec());
        let etag = format!("\"{}\"", expected.digest);
        assert_eq!(headers[header::ETAG], etag.as_str());

        let (status, headers, body) =
            call(&app, "GET", &signed("ns", "p", "2.tar.gz"), Some(&etag)).await;
        assert_eq!(status, StatusCode::NOT_MODIFIED);
        assert_eq!(headers[header::ETAG], etag.as_str());
        assert!(body.is_empty());

        // Other encodings of the same segments are the same request.
        let encoded = signed("ns", "p", "2").replacen("/ns/p/", "/%6Es/%70/", 1);
        let (status, _, _) = call(&app, "GET", &encoded, None).await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn rejects_with_the_right_status() {
        let app = router(state_with(&[("ns", "p", 2)]));
        for (method, uri, code) in [
            ("GET", "/programs", 400),
            ("GET", "/programs/", 400),
            ("GET", "/programs/ns/p", 400),
            ("GET", "/programs/ns/p/2/x", 400),
            ("GET", "/programs/ns//2", 400),
            ("GET", "/programs/ns/p/x", 400),
            ("GET", "/programs/NS/p/2", 400),
            // An encoded `/` never splits a segment: this names no Program.
            ("GET", "/programs/ns%2Fp%2F2", 400),
            ("GET", "/programs/ns/p%2F2/2", 400),
            ("GET", "/programs/ns/%FF/2", 400),
            ("GET", &signed("ns", "q", "1"), 404),
            ("GET", &signed("ns", "p", "3"), 404),
            ("GET", &signed("ns", "p", "1"), 410),
            ("GET", "/other", 404),
            ("POST", "/programs/ns/p/2", 405),
            ("PUT", "/programs", 405),
            ("DELETE", "/programs/a", 405),
        ] {
            let (status, headers, body) = call(&app, method, uri, None).await;
            assert_eq!(
                status.as_u16(),
                code,
                "{method} {uri}: {}",
                String::from_utf8_lossy(&body)
            );
            assert!(!body.is_empty(), "{method} {uri} has no message");
            if code == 405 {
                assert_eq!(headers[header::ALLOW], "GET,HEAD");
            }
        }
    }

    #[tokio::test]
    async fn requests_are_counted() {
        let state = state_with(&[("ns", "p", 1)]);
        let metrics = state.metrics.clone();
        let app = router(state);
        call(&app, "GET", &signed("ns", "p", "1"), None).await;
        call(&app, "GET", &signed("ns", "p", "1"), None).await;
        call(&app, "GET", &signed("ns", "p", "9"), None).await;
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("pko_fileserver_requests_total{method=\"GET\",code=\"200\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("pko_fileserver_requests_total{method=\"GET\",code=\"404\"} 1"),
            "{text}"
        );
        assert!(text.contains("pko_fileserver_cache_hits_total 1"), "{text}");
        assert!(
            text.contains("pko_fileserver_cache_misses_total 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_program_published_while_the_request_waits_is_served() {
        // A wait far longer than any machine needs: only the watch event may end it.
        let (state, mut writer) = index_with(&[("ns", "old", 1)], Duration::from_secs(3600));
        let (index, metrics) = (state.index.clone(), state.metrics.clone());
        let app = router(state);
        for (uri, event) in [
            // A Program this replica has not seen yet.
            (signed("ns", "new", "1"), program("ns", "new", 1)),
            // A generation this replica has not seen yet.
            (signed("ns", "old", "2"), program("ns", "old", 2)),
        ] {
            let request = tokio::spawn({
                let (app, uri) = (app.clone(), uri.clone());
                async move { call(&app, "GET", &uri, None).await }
            });
            // The request is waiting for the watch before the watch delivers the Program.
            while index.waiting() == 0 {
                tokio::task::yield_now().await;
            }
            let event = Event::Apply(event);
            writer.apply_watcher_event(&event);
            index.observe(&event);
            let (status, _, body) = request.await.expect("request task");
            assert_eq!(
                status,
                StatusCode::OK,
                "{uri}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("pko_fileserver_publish_waits_total{outcome=\"seen\"} 2"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_unknown_program_is_404_once_the_wait_ends() {
        let (state, _writer) = index_with(&[], Duration::from_millis(10));
        let metrics = state.metrics.clone();
        let app = router(state);
        let (status, _, _) = call(&app, "GET", &signed("ns", "nothing", "1"), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("pko_fileserver_publish_waits_total{outcome=\"not_seen\"} 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn invented_methods_share_one_series() {
        let state = state_with(&[("ns", "p", 1)]);
        let metrics = state.metrics.clone();
        let app = router(state);
        for i in 0..50 {
            call(&app, &format!("INVENTED{i}"), "/programs/ns/p/1", None).await;
        }
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("pko_fileserver_requests_total{method=\"OTHER\",code=\"405\"} 50"),
            "{text}"
        );
        assert!(!text.contains("INVENTED"), "{text}");
    }

    #[tokio::test]
    async fn without_a_valid_token_an_artifact_is_answered_like_an_unknown_program() {
        let state = state_with(&[("ns", "p", 2)]);
        let metrics = state.metrics.clone();
        let app = router(state);
        let (_, _, unknown) = call(&app, "GET", &signed("ns", "nothing", "1"), None).await;
        let good = signed("ns", "p", "2");
        let (query_digest, query_token) = good
            .split_once('?')
            .and_then(|(_, q)| q.split_once('&'))
            .expect("query");
        let refused = [
            "/programs/ns/p/2".to_owned(),
            "/programs/ns/p/2?digest=sha256:00".to_owned(),
            format!("/programs/ns/p/2?{query_digest}"),
            format!("/programs/ns/p/2?{query_token}"),
            // The token of generation 2 for another generation, Program or namespace.
            good.replace("/p/2?", "/p/3?"),
            good.replace("/p/2?", "/q/2?"),
            good.replace("/ns/p/", "/other/p/"),
            // Another digest, a token given twice, a token cut short.
            good.replace("digest=sha256:", "digest=sha256:0"),
            format!("{good}&{query_token}"),
            good[..good.len() - 3].to_owned(),
        ];
        for uri in &refused {
            let (status, _, body) = call(&app, "GET", uri, None).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{uri}");
            assert_eq!(body, unknown, "{uri}: same answer as an unknown Program");
        }
        let (status, _, _) = call(&app, "GET", &good, None).await;
        assert_eq!(status, StatusCode::OK);
        let text = metrics.encode().expect("encode");
        let refusals: f64 = ["no_token", "bad_token"]
            .iter()
            .filter_map(|r| {
                let series = format!("pko_fileserver_refused_total{{reason=\"{r}\"}} ");
                text.lines()
                    .find_map(|l| l.strip_prefix(&series))
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .sum();
        assert_eq!(refusals, refused.len() as f64, "{text}");
    }
}
