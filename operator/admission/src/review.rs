//! An AdmissionReview as the handlers read it: the raw JSON for the policies (fetched URLs
//! annotated with their parsed form) and the few fields of `request` the handlers need, with
//! the body's JSON values counted before any tree is built.

use std::sync::Arc;

use kube::core::admission::AdmissionResponse;
use kube::core::{GroupVersionKind, Status};
use pko_api::names::{LABEL_MAX as MAX_LABEL, is_dns1123_label};
use serde::Deserialize;
use serde_json::Value;

use crate::errors::WebhookError;

/// What the handlers read of a review's `request`; the rest stays in the policies' input.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestHead {
    pub uid: String,
    pub kind: GroupVersionKind,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    #[serde(default)]
    pub operation: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub object: Option<ObjectHead>,
}

impl RequestHead {
    /// Why `request.namespace` cannot be used, if it cannot: it names a namespace in an
    /// apiserver GET (`/api/v1/namespaces/{namespace}`), so anything but a DNS label (a
    /// `/`, `?`, `..`) would bend that path. The apiserver never sends one; a direct POST may.
    pub fn namespace_problem(&self) -> Option<String> {
        match self.namespace.as_deref() {
            None | Some("") => None,
            Some(ns) if is_dns1123_label(ns) => None,
            Some(ns) => Some(format!(
                "request.namespace {:?} is not a DNS-1123 label (lower-case letters, digits \
                 and '-', at most {MAX_LABEL} characters)",
                ns.chars().take(2 * MAX_LABEL).collect::<String>()
            )),
        }
    }

    /// An allowing answer to this request.
    pub(crate) fn response(&self) -> AdmissionResponse {
        // The struct is non-exhaustive: start from kube's blank answer (v1 types) and allow.
        let mut response = AdmissionResponse::invalid("");
        response.uid = self.uid.clone();
        response.allowed = true;
        response.result = Status::default();
        response
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct ObjectHead {
    #[serde(default)]
    pub metadata: MetaHead,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetaHead {
    #[serde(default)]
    pub generate_name: Option<String>,
}

/// A parsed review: the raw JSON (the policies' input, URLs annotated) and its request head.
#[derive(Clone, Debug)]
pub struct Review {
    pub input: Arc<Value>,
    pub request: RequestHead,
}

/// Parses a webhook body: the raw JSON (the policies' input) and the request head.
pub fn parse_review(body: &[u8]) -> Result<Review, WebhookError> {
    parse_review_bounded(body, usize::MAX)
}

/// [`parse_review`], refusing bodies of more than `max_values` JSON values before building
/// their tree.
pub fn parse_review_bounded(body: &[u8], max_values: usize) -> Result<Review, WebhookError> {
    if json_values_upper_bound(body) > max_values {
        return Err(WebhookError::TooManyValues { max: max_values });
    }
    let depth = pko_api::decode::json_depth(body);
    if depth > MAX_REVIEW_DEPTH {
        return Err(too_deep(body, depth));
    }
    let mut input: Value = serde_json::from_slice(body)
        .map_err(|e| WebhookError::InvalidReview(format!("the body is not JSON: {e}")))?;
    let api_version = input.get("apiVersion").and_then(Value::as_str);
    let kind = input.get("kind").and_then(Value::as_str);
    if kind != Some("AdmissionReview") || api_version != Some("admission.k8s.io/v1") {
        return Err(WebhookError::InvalidReview(format!(
            "expected an admission.k8s.io/v1 AdmissionReview, got apiVersion {:?} kind {:?}",
            api_version.unwrap_or_default(),
            kind.unwrap_or_default()
        )));
    }
    let request = match input.get("request") {
        None | Some(Value::Null) => {
            return Err(WebhookError::InvalidReview(
                "the AdmissionReview has no request".into(),
            ));
        }
        // Read in place: the object is not copied.
        Some(request) => RequestHead::deserialize(request)
            .map_err(|e| WebhookError::InvalidReview(format!("malformed AdmissionReview: {e}")))?,
    };
    if request.uid.is_empty() {
        return Err(WebhookError::InvalidReview(
            "the AdmissionReview request has no uid".into(),
        ));
    }
    if let Some(depth) = deepest_document(&input)
        && depth > pko_api::decode::MAX_DOCUMENT_DEPTH
    {
        return Err(WebhookError::TooDeep {
            request: Box::new(request),
            depth,
            max: pko_api::decode::MAX_DOCUMENT_DEPTH,
        });
    }
    // The policies judge fetched URLs by what the fetcher will parse, never by their spelling.
    crate::urls::annotate(&mut input);
    Ok(Review {
        input: Arc::new(input),
        request,
    })
}

/// The deepest review the webhook reads: a tenant's document may nest
/// [`pko_api::decode::MAX_DOCUMENT_DEPTH`] levels, under the review's own levels
/// (`request.object.program`) and the apiserver's `managedFields` mirror of it (a few more).
/// Far below serde_json's 128, so a deeper review is denied, never a parse failure.
pub(crate) const MAX_REVIEW_DEPTH: usize = pko_api::decode::MAX_DOCUMENT_DEPTH + 16;

/// The error for a review nested `depth` deep: its request head, read without building the
/// tree, so the answer can name the request it denies.
fn too_deep(body: &[u8], depth: usize) -> WebhookError {
    #[derive(Deserialize)]
    struct Envelope {
        request: Option<RequestHead>,
    }
    match serde_json::from_slice::<Envelope>(body) {
        Ok(Envelope {
            request: Some(request),
        }) if !request.uid.is_empty() => WebhookError::TooDeep {
            request: Box::new(request),
            depth,
            max: MAX_REVIEW_DEPTH,
        },
        Ok(_) => WebhookError::InvalidReview("the AdmissionReview has no request uid".into()),
        Err(e) => WebhookError::InvalidReview(format!("malformed AdmissionReview: {e}")),
    }
}

/// The depth of the deepest free-form document a tenant wrote in the reviewed object: a
/// Program's `program`, a Stack's `spec.config` (each value).
fn deepest_document(review: &Value) -> Option<usize> {
    let object = review.get("request")?.get("object")?;
    let program = object.get("program").map(pko_api::decode::value_depth);
    let config = object
        .get("spec")
        .and_then(|s| s.get("config"))
        .map(pko_api::decode::value_depth)
        // The values sit one level inside the `config` map.
        .map(|d| d.saturating_sub(1));
    program.max(config)
}

/// An upper bound on the JSON values (and keys) in `body`, from one pass over its bytes:
/// every value but the first follows a `[`, a `,` or a `:` outside a string.
pub fn json_values_upper_bound(body: &[u8]) -> usize {
    let (mut count, mut in_string, mut escaped) = (1usize, false, false);
    for &b in body {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'[' | b',' | b':' => count += 1,
                _ => {}
            }
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(object: &str) -> String {
        format!(
            r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{
            "uid":"u1","kind":{{"group":"pulumi.com","version":"v1","kind":"Program"}},
            "name":"p","namespace":"team-a","operation":"CREATE","object":{object}}}}}"#
        )
    }

    fn program(depth: usize) -> String {
        let nested = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
        format!(r#"{{"metadata":{{"name":"p"}},"program":{{"variables":{nested}}}}}"#)
    }

    #[test]
    fn a_review_past_serde_jsons_limit_is_a_denial_of_its_request() {
        let Err(WebhookError::TooDeep {
            request,
            depth,
            max,
        }) = parse_review(review(&program(10_000)).as_bytes())
        else {
            panic!("not refused as too deep")
        };
        assert_eq!((request.uid.as_str(), request.name.as_str()), ("u1", "p"));
        assert!(depth > 10_000 && max == MAX_REVIEW_DEPTH, "{depth} {max}");
    }

    #[test]
    fn a_document_past_the_bound_is_refused_and_one_at_it_is_read() {
        // `program` is one object around `variables`, which nests `depth` levels.
        let at = pko_api::decode::MAX_DOCUMENT_DEPTH - 1;
        assert!(parse_review(review(&program(at)).as_bytes()).is_ok());
        let Err(err @ WebhookError::TooDeep { .. }) =
            parse_review(review(&program(at + 1)).as_bytes())
        else {
            panic!("not refused as too deep")
        };
        assert!(err.to_string().contains("at most 64"), "{err}");
        let stack = format!(
            r#"{{"metadata":{{"name":"s"}},"spec":{{"config":{{"k":{}1{}}}}}}}"#,
            "[".repeat(65),
            "]".repeat(65)
        );
        assert!(matches!(
            parse_review(review(&stack).as_bytes()),
            Err(WebhookError::TooDeep { depth: 65, .. })
        ));
    }

    fn head(namespace: Option<&str>) -> RequestHead {
        RequestHead {
            uid: "u".into(),
            kind: GroupVersionKind::gvk("", "v1", "Pod"),
            operation: "CREATE".into(),
            name: String::new(),
            namespace: namespace.map(str::to_owned),
            object: None,
        }
    }

    #[test]
    fn only_dns_labels_are_namespaces() {
        for ok in [None, Some(""), Some("team-a"), Some("a"), Some("0a-9")] {
            assert_eq!(head(ok).namespace_problem(), None, "{ok:?}");
        }
        let long = "a".repeat(64);
        for bad in [
            "../b",
            "a/b",
            "a?watch=true",
            "a#b",
            "a%2fb",
            "A",
            "-a",
            "a-",
            "a.b",
            long.as_str(),
        ] {
            assert!(head(Some(bad)).namespace_problem().is_some(), "{bad}");
        }
    }
}
