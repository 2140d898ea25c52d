//! Kubernetes name forms, shared by the schemas, the operator and the admission webhook.
//!
//! A name from a spec becomes a segment of an apiserver request path, and kube's client pastes
//! it in unescaped: `../`, `/`, `?`, `#` or `%` in one would bend the request into another
//! namespace, another resource or a watch. The schema refuses them ([`DNS1123_SUBDOMAIN`] on
//! every name field), and the operator checks again with [`checked_name`] before any request,
//! because a cluster switching from PKO may still have PKO's CRDs, which have no pattern.

use std::fmt;

/// An object name: a DNS-1123 subdomain (pattern of the name fields in the CRDs).
pub const DNS1123_SUBDOMAIN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// A namespace name: a DNS-1123 label.
pub const DNS1123_LABEL: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// Longest DNS-1123 label (a namespace name).
pub const LABEL_MAX: usize = 63;
/// Longest DNS-1123 subdomain (an object name).
pub const SUBDOMAIN_MAX: usize = 253;

/// Whether `s` is a DNS-1123 label: lower-case letters, digits and `-`, neither first nor last.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= LABEL_MAX
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Whether `s` is a DNS-1123 subdomain: labels joined by `.`, at most 253 bytes.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= SUBDOMAIN_MAX && s.split('.').all(is_dns1123_label)
}

/// A name from a spec that cannot be a request path segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidName {
    /// The field it came from, e.g. `spec.programRef.name`.
    pub field: String,
    /// The name, cut to twice the longest valid one.
    pub name: String,
}

impl fmt::Display for InvalidName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:?} is not a DNS-1123 subdomain (lower-case letters, digits, '-' and '.', at \
             most {SUBDOMAIN_MAX} characters)",
            self.field, self.name
        )
    }
}

impl std::error::Error for InvalidName {}

/// `name` if it is a DNS-1123 subdomain, the only form an object name takes; otherwise the
/// error naming `field`. Call it on every name a tenant wrote before it goes into a request.
pub fn checked_name<'a>(field: &str, name: &'a str) -> Result<&'a str, InvalidName> {
    if is_dns1123_subdomain(name) {
        return Ok(name);
    }
    Err(InvalidName {
        field: field.to_owned(),
        name: name.chars().take(2 * SUBDOMAIN_MAX).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_bend_a_path_are_refused() {
        for ok in ["a", "my.program-1", "0", &"a".repeat(63)] {
            assert_eq!(checked_name("f", ok), Ok(ok), "{ok}");
        }
        let long = format!("{}.{}", "a".repeat(63), "b".repeat(200));
        for bad in [
            "",
            ".",
            "..",
            "../b",
            "a/b",
            "a?watch=true",
            "a#b",
            "a%2fb",
            "A",
            "-a",
            "a-",
            "a..b",
            "a_b",
            " a",
            &"a".repeat(64),
            long.as_str(),
        ] {
            let err = checked_name("spec.x.name", bad).expect_err(bad);
            assert!(err.to_string().starts_with("spec.x.name "), "{err}");
        }
    }
}
