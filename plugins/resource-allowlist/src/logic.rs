//! resource-allowlist: reject a Program that uses resource types outside an allowlist.
//!
//! Pure Rust on serde_json, with no plugin bindings, so the same code also runs natively (the
//! benchmark compares the two).

use serde::Deserialize;
use serde_json::{Map, Value};

/// Why the plugin refuses.
#[derive(Debug)]
pub enum Error {
    InvalidConfig(String),
    Rejected(String),
}

/// The configuration (`spec.config`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Allowed type tokens; `*` matches any run of characters (`aws:s3*`, `random:*`).
    pub allow: Vec<String>,
}

/// Checks a configuration beyond its shape.
pub fn check_config(config: &Config) -> Result<(), Error> {
    if config.allow.is_empty() {
        return Err(Error::InvalidConfig(
            "allow is empty: every Program would be rejected".into(),
        ));
    }
    if let Some(bad) = config.allow.iter().find(|p| p.trim().is_empty()) {
        return Err(Error::InvalidConfig(format!(
            "empty pattern {bad:?} in allow"
        )));
    }
    Ok(())
}

/// Leaves the Program unchanged or rejects it, naming every offending resource.
pub fn transform(spec: &Map<String, Value>, config: &Config) -> Result<(), Error> {
    let Some(Value::Object(resources)) = spec.get("resources") else {
        return Ok(());
    };
    let offenders: Vec<String> = resources
        .iter()
        .filter_map(|(name, resource)| {
            let type_token = resource
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default();
            (!config.allow.iter().any(|p| glob(p, type_token)))
                .then(|| format!("{name:?} ({type_token})"))
        })
        .collect();
    if offenders.is_empty() {
        Ok(())
    } else {
        Err(Error::Rejected(format!(
            "{} resource(s) use types outside the allowlist: {}",
            offenders.len(),
            offenders.join(", ")
        )))
    }
}

/// `*` matches any run of characters (including none); everything else matches itself.
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let Some(first) = parts.next() else {
        return text.is_empty();
    };
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        // No `*`: the whole text must be the pattern.
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::glob;

    #[test]
    fn globs() {
        assert!(glob("aws:s3*", "aws:s3/bucket:Bucket"));
        assert!(glob("*", ""));
        assert!(glob("a*b*c", "aXXbYYc"));
        assert!(!glob("a*b*c", "aXXcYYb"));
        assert!(glob(
            "random:index/randomPet:RandomPet",
            "random:index/randomPet:RandomPet"
        ));
        assert!(!glob("random:index", "random:index/x"));
        assert!(!glob("ab*ba", "aba"));
    }
}
