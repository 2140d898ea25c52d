//! URLs as the workspace's fetcher will read them, for the policies.
//!
//! A flux URL is fetched by the agent's HTTP client, which parses it by the WHATWG URL standard
//! (the `url` crate, as reqwest does). Comparing raw strings in Rego lets many spellings of one
//! address through (case, default ports, trailing dots, userinfo, dot segments plain or
//! percent-encoded, empty segments, backslashes, tabs...). So the webhook parses every flux URL
//! of a request here and passes the parts the fetcher will use (`input.pko.urls[raw]`), and the
//! policies judge only those: host, port and path segments.

use serde_json::{Map, Value, json};
use url::{Host, Url};

use crate::tenancy::FileServerNames;

/// Where a request's object holds URLs a workspace will fetch.
pub const FETCHED_URLS: [&str; 2] = [
    "/request/object/spec/flux/url",
    "/request/object/spec/workspaceTemplate/spec/flux/url",
];

/// Where a fetch of a URL goes, as its fetcher parses it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FetchTarget {
    pub scheme: String,
    /// See [`host_name`].
    pub host: String,
    /// The scheme's default when the URL has none.
    pub port: Option<u16>,
    /// The path after dot segments are resolved, each segment percent-decoded (as the file
    /// server decodes it), empty ones dropped (they select nothing on their own).
    pub segments: Vec<String>,
}

impl FetchTarget {
    /// The namespace of the Program this URL fetches from the operator's file server, if it
    /// is such a URL: the same rule as `policies/isolation.rego`.
    pub fn program_namespace(&self, file_server: &FileServerNames) -> Option<&str> {
        let on_file_server = matches!(self.scheme.as_str(), "http" | "https")
            && (file_server.hosts.is_empty() || file_server.hosts.contains(&self.host))
            && (file_server.ports.is_empty()
                || self.port.is_some_and(|p| file_server.ports.contains(&p)));
        match self.segments.as_slice() {
            [first, namespace, ..] if on_file_server && first == "programs" => Some(namespace),
            _ => None,
        }
    }
}

/// The parts of `raw` that decide where a fetch goes, or why it cannot be fetched.
pub fn parse_fetch_url(raw: &str) -> Result<FetchTarget, String> {
    let url = Url::parse(raw).map_err(|e| e.to_string())?;
    let host = url.host().ok_or("the URL has no host")?;
    let segments = url
        .path_segments()
        .map(|segments| {
            segments
                .map(|s| {
                    percent_encoding::percent_decode_str(s)
                        .decode_utf8_lossy()
                        .into_owned()
                })
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let host = host_name(&host);
    // `http:.` or `http://../`: a host of dots only names no server (and gave policies "").
    if host.is_empty() {
        return Err("the URL has no host".into());
    }
    Ok(FetchTarget {
        scheme: url.scheme().to_owned(),
        host,
        port: url.port_or_known_default(),
        segments,
    })
}

/// [`parse_fetch_url`] as the policies receive it: `{valid: true, scheme, host, port,
/// segments}` or `{valid: false, error}`.
pub fn fetch_target(raw: &str) -> Value {
    match parse_fetch_url(raw) {
        Ok(target) => {
            let mut value = json!(target);
            if let Value::Object(map) = &mut value {
                map.insert("valid".into(), json!(true));
            }
            value
        }
        Err(error) => json!({"valid": false, "error": error}),
    }
}

/// A host as the policies compare it: lower case (the parser did it), no trailing dots, IPv6
/// without brackets.
pub fn host_name(host: &Host<&str>) -> String {
    match host {
        Host::Domain(domain) => {
            let trimmed = domain.trim_end_matches('.');
            // Dots only (no server: the caller refuses ""), or no trailing dot at all.
            if trimmed.is_empty() || trimmed.len() == domain.len() {
                return trimmed.to_owned();
            }
            // `0..` is a name to the URL parser (one trailing dot only makes an address), but
            // without its dots it reads as 0.0.0.0: the policies get the address, the stricter
            // reading, never a bare name that spells one. A name that is no host without its
            // dots (`.0..`) stays as it was given.
            match Host::parse(trimmed) {
                Ok(Host::Ipv4(v4)) => v4.to_string(),
                Ok(Host::Domain(_)) => trimmed.to_owned(),
                _ => (*domain).to_owned(),
            }
        }
        Host::Ipv4(v4) => v4.to_string(),
        // The URL standard's serialisation (hex only, `::ffff:a60:c`), without brackets.
        Host::Ipv6(v6) => Host::<&str>::Ipv6(*v6)
            .to_string()
            .trim_matches(['[', ']'])
            .to_owned(),
    }
}

/// `host[:port]` (as in flags) → (host as the policies compare it, port; 80 when none).
pub fn host_and_port(text: &str) -> Option<(String, u16)> {
    let url = Url::parse(&format!("http://{}/", text.trim())).ok()?;
    let host = url.host()?;
    Some((host_name(&host), url.port_or_known_default()?))
}

/// Adds `pko.urls` to a review: every fetched URL of its object, parsed.
pub fn annotate(input: &mut Value) {
    let urls: Map<String, Value> = FETCHED_URLS
        .iter()
        .filter_map(|pointer| input.pointer(pointer)?.as_str())
        .map(|raw| (raw.to_owned(), fetch_target(raw)))
        .collect();
    if let Value::Object(map) = input {
        map.insert("pko".into(), json!({"urls": urls}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The corpus the Rego tests and the opa cross-check fixtures use: the parts written there by
    /// hand from the URL standard must be what the parser gives.
    #[test]
    fn the_policy_corpus_is_what_the_fetcher_parses() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/url-corpus.json"
        );
        let text = std::fs::read_to_string(path).expect("url corpus");
        let corpus: Vec<Value> = serde_json::from_str(&text).expect("corpus JSON");
        assert!(corpus.len() >= 20, "{} spellings", corpus.len());
        for case in corpus {
            let raw = case["url"].as_str().expect("url");
            assert_eq!(fetch_target(raw), case["expect"], "{raw:?}");
        }
    }

    #[test]
    fn spellings_of_one_target_are_one_target() {
        let target = json!({
            "valid": true, "scheme": "http", "host": "fs.sys.svc", "port": 80,
            "segments": ["programs", "b", "p", "1"],
        });
        for raw in [
            "http://fs.sys.svc/programs/b/p/1",
            "HTTP://FS.SYS.SVC:80/programs/b/p/1",
            "http://fs.sys.svc./programs/b/p/1",
            "http://user:pw@fs.sys.svc/programs/b/p/1",
            "http://fs.sys.svc/programs/a/../b/p/1",
            "http://fs.sys.svc/programs/a/%2e%2E/b/p/1",
            "http://fs.sys.svc//programs//b///p/1",
            "http://fs.sys.svc/programs/%62/p/1",
            "http:\\\\fs.sys.svc\\programs\\b\\p\\1",
            "http://fs.sys.svc/prog\trams/b/p/1",
            "http://fs.sys.svc/programs/b/p/1?x=/programs/a#/programs/a",
        ] {
            assert_eq!(fetch_target(raw), target, "{raw:?}");
        }
        assert_eq!(fetch_target("http://2130706433/")["host"], "127.0.0.1");
        // More than one trailing dot makes a name to the parser; without the dots it is an
        // address, and the policies get the address.
        for spelled in ["http:0..", "http://0x7f.1../", "http://2130706433.../"] {
            let host = fetch_target(spelled)["host"].clone();
            assert!(
                host == "0.0.0.0" || host == "127.0.0.1",
                "{spelled}: {host}"
            );
        }
        assert_eq!(fetch_target("http:.0..")["host"], ".0..");
        assert_eq!(
            fetch_target("http://[::FFFF:127.0.0.1]/")["host"],
            "::ffff:7f00:1"
        );
        assert_eq!(fetch_target("http://[::1/x")["valid"], false);
        for dots in ["http:.", "http://../programs/b/p/1", "https://.:443/"] {
            assert_eq!(
                fetch_target(dots),
                json!({"valid": false, "error": "the URL has no host"}),
                "{dots:?}"
            );
        }
    }

    #[test]
    fn the_controllers_rule_is_the_policies_rule() {
        let names = FileServerNames {
            hosts: vec!["fs.sys".into(), "10.96.0.12".into()],
            ports: vec![80],
        };
        let ns = |raw: &str| {
            parse_fetch_url(raw)
                .expect("url")
                .program_namespace(&names)
                .map(str::to_owned)
        };
        assert_eq!(ns("http://FS.sys./programs/b/p/1").as_deref(), Some("b"));
        assert_eq!(
            ns("http://174063628/x/../programs/b/p/1").as_deref(),
            Some("b")
        );
        assert_eq!(ns("http://fs.sys:8080/programs/b/p/1"), None);
        assert_eq!(ns("http://elsewhere/programs/b/p/1"), None);
        assert_eq!(ns("http://fs.sys/artifacts/b/p/1"), None);
        let any = FileServerNames::default();
        assert_eq!(
            parse_fetch_url("https://x:1/programs/b")
                .expect("url")
                .program_namespace(&any),
            Some("b")
        );
    }

    #[test]
    fn annotate_parses_every_fetched_url() {
        let mut input = json!({"request": {"object": {"spec": {
            "flux": {"url": "http://A/x"},
            "workspaceTemplate": {"spec": {"flux": {"url": "bad url"}}},
        }}}});
        annotate(&mut input);
        assert_eq!(input["pko"]["urls"]["http://A/x"]["host"], "a");
        assert_eq!(input["pko"]["urls"]["bad url"]["valid"], false);
        let mut none = json!({"request": {"object": {"spec": {}}}});
        annotate(&mut none);
        assert_eq!(none["pko"], json!({"urls": {}}));
        assert_eq!(host_and_port("FS.ns.:80"), Some(("fs.ns".into(), 80)));
        assert_eq!(host_and_port("fs"), Some(("fs".into(), 80)));
        assert_eq!(
            host_and_port("127.0.0.1:9090"),
            Some(("127.0.0.1".into(), 9090))
        );
    }
}
