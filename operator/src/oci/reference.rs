//! OCI references (`host[:port]/repository[:tag]`), parsed with the distribution grammar's
//! rules. A registry host is required: nothing defaults to Docker Hub, so the address the
//! operator contacts is the one written in the object.

use std::fmt;

use super::OciError;

/// Longest repository name the distribution spec allows.
const MAX_REPOSITORY: usize = 255;
/// Longest tag.
const MAX_TAG: usize = 128;
/// Longest host (a DNS name) with its port.
const MAX_HOST: usize = 253 + 6;

/// A parsed reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host` or `host:port`, lowercased (host names are case-insensitive).
    pub registry: String,
    /// The repository path, e.g. `plugins/default-tags`.
    pub repository: String,
    /// The tag, if any (informational when a digest pins the artifact).
    pub tag: Option<String>,
}

impl Reference {
    /// Parses `host[:port]/repository[:tag]`.
    pub fn parse(reference: &str) -> Result<Self, OciError> {
        let refuse = |reason: &str| OciError::Reference {
            reference: reference.chars().take(600).collect(),
            reason: reason.to_owned(),
        };
        if reference.contains('@') {
            return Err(refuse(
                "a digest goes in the digest field, not the reference",
            ));
        }
        if reference.contains("://") {
            return Err(refuse(
                "no scheme: the registry is always reached over https",
            ));
        }
        let (host, rest) = reference
            .split_once('/')
            .ok_or_else(|| refuse("expected host[:port]/repository"))?;
        let registry = parse_host(host).map_err(|r| refuse(&r))?;
        // A tag can only follow the last path component.
        let (repository, tag) = match rest.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => (repo, Some(tag)),
            _ => (rest, None),
        };
        if repository.is_empty() || repository.len() > MAX_REPOSITORY {
            return Err(refuse("the repository must be 1 to 255 characters"));
        }
        if let Some(bad) = repository.split('/').find(|c| !is_path_component(c)) {
            return Err(refuse(&format!(
                "repository component {bad:?} must be lowercase letters and digits, separated by one '.', one or two '_', or '-'s"
            )));
        }
        if let Some(tag) = tag
            && !is_tag(tag)
        {
            return Err(refuse(
                "a tag is 1 to 128 of letters, digits, '_', '.', '-', not starting with '.' or '-'",
            ));
        }
        Ok(Self {
            registry,
            repository: repository.to_owned(),
            tag: tag.map(str::to_owned),
        })
    }

    /// `https://<registry>/v2/<repository>/<kind>/<what>`.
    pub fn url(&self, kind: &str, what: &str) -> String {
        format!(
            "https://{}/v2/{}/{kind}/{what}",
            self.registry, self.repository
        )
    }

    /// `registry/repository`, without the tag.
    pub fn name(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        Ok(())
    }
}

/// `host` or `host:port`: DNS labels or an IPv4 address, and a port of 1 to 65535.
fn parse_host(host: &str) -> Result<String, String> {
    if host.is_empty() || host.len() > MAX_HOST {
        return Err("the registry host must be 1 to 253 characters".into());
    }
    let (name, port) = match host.rsplit_once(':') {
        Some((name, port)) => (name, Some(port)),
        None => (host, None),
    };
    if let Some(port) = port
        && !(port.bytes().all(|b| b.is_ascii_digit())
            && port.len() <= 5
            && port.parse::<u16>().is_ok_and(|p| p > 0))
    {
        return Err(format!("port {port:?} must be a number from 1 to 65535"));
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if !name.split('.').all(label_ok) {
        return Err(format!(
            "registry host {name:?} must be a DNS name or an IPv4 address"
        ));
    }
    // Docker's rule for telling a host from a repository component: without a dot or a port
    // (and not `localhost`), the first component would be a Docker Hub namespace.
    if port.is_none() && !name.contains('.') && !name.eq_ignore_ascii_case("localhost") {
        return Err(format!(
            "{name:?} is not a registry host (no dot or port); write the registry explicitly, e.g. docker.io/{name}/…"
        ));
    }
    Ok(host.to_ascii_lowercase())
}

/// `[a-z0-9]+` runs joined by `.`, `_`, `__` or runs of `-`.
fn is_path_component(c: &str) -> bool {
    let bytes = c.as_bytes();
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if bytes.is_empty() || !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        if alnum(bytes[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && !alnum(bytes[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|b| b == b'-');
        if !ok {
            return false;
        }
    }
    true
}

fn is_tag(tag: &str) -> bool {
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    !tag.is_empty()
        && tag.len() <= MAX_TAG
        && tag.bytes().next().is_some_and(word)
        && tag.bytes().all(|b| word(b) || b == b'.' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_as_the_distribution_grammar_says() {
        let r = Reference::parse("Registry.Example.com:5000/team-a/default_tags:v1.2").expect("ok");
        assert_eq!(r.registry, "registry.example.com:5000");
        assert_eq!(r.repository, "team-a/default_tags");
        assert_eq!(r.tag.as_deref(), Some("v1.2"));
        assert_eq!(
            r.url("manifests", "sha256:00"),
            "https://registry.example.com:5000/v2/team-a/default_tags/manifests/sha256:00"
        );
        let r = Reference::parse("127.0.0.1:5443/plugins/tags").expect("ok");
        assert_eq!((r.registry.as_str(), r.tag), ("127.0.0.1:5443", None));
        assert!(Reference::parse("localhost/a").is_ok());
        assert!(Reference::parse("ghcr.io/a__b/c--d/e.f").is_ok());
    }

    #[test]
    fn spellings_that_would_reach_elsewhere_are_refused() {
        for bad in [
            "tags",                  // no host
            "library/tags",          // a Docker Hub namespace, not a host
            "https://r.example/a",   // scheme
            "r.example/a@sha256:00", // digest in the reference
            "r.example/A",           // uppercase repository
            "r.example/a/../b",      // path tricks
            "r.example//a",          // empty component
            "r.example/a/",          // trailing slash
            "r.example/a?x=1",       // query
            "r.example/a#f",         // fragment
            "r.example:0/a",         // port 0
            "r.example:65536/a",     // port out of range
            "r.example:+80/a",       // sign in the port
            "user@r.example/a",      // userinfo
            "[::1]:5000/a",          // IPv6 literal (not supported)
            "r.example/a:-x",        // bad tag
            "r.ex_ample/a",          // underscore in a host
            "-r.example/a",          // label starts with '-'
            "r.example/a%2f..",      // percent-encoding
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad} was accepted");
        }
        let long = format!("r.example/{}", "a".repeat(256));
        assert!(Reference::parse(&long).is_err());
    }
}
