//! Operator settings that more than one module needs, and PKO's address conventions.

/// Where artifacts are advertised: `<scheme>://<host[:port]>` with no trailing slash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdvertisedAddress(String);

impl AdvertisedAddress {
    /// PKO's rules: an explicit advertised address wins; otherwise it is derived from the bind
    /// address (empty host → `localhost`, `0.0.0.0` → `$HOSTNAME` or the host name). `http://` is
    /// added when the address has no scheme.
    pub fn resolve(bind_addr: &str, advertised: Option<&str>, hostname: Option<&str>) -> Self {
        let raw = match advertised.map(str::trim).filter(|a| !a.is_empty()) {
            Some(adv) => adv.to_owned(),
            None => derive_from_bind(bind_addr, hostname),
        };
        let with_scheme = if raw.starts_with("http://") || raw.starts_with("https://") {
            raw
        } else {
            format!("http://{raw}")
        };
        Self(with_scheme.trim_end_matches('/').to_owned())
    }

    /// The artifact URL of one generation, as in `status.artifact.url`.
    pub fn program_url(&self, namespace: &str, name: &str, generation: i64) -> String {
        format!("{}/{}", self.0, program_path(namespace, name, generation))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// URL path (no leading slash) of one generation: `programs/<ns>/<name>/<gen>`.
pub fn program_path(namespace: &str, name: &str, generation: i64) -> String {
    format!("programs/{namespace}/{name}/{generation}")
}

/// `status.artifact.path`: `programs/<ns>/<name>/<gen>.tar.gz`.
pub fn artifact_path(namespace: &str, name: &str, generation: i64) -> String {
    format!("{}.tar.gz", program_path(namespace, name, generation))
}

fn derive_from_bind(bind_addr: &str, hostname: Option<&str>) -> String {
    let (host, port) = match bind_addr.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (bind_addr, None),
    };
    let host = match host {
        "" => "localhost".to_owned(),
        "0.0.0.0" | "[::]" => hostname
            .filter(|h| !h.is_empty())
            .map(str::to_owned)
            .unwrap_or_else(|| "localhost".to_owned()),
        other => other.to_owned(),
    };
    match port {
        Some(port) => format!("{host}:{port}"),
        None => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // PKO's TestDetermineAdvAddr cases, plus scheme handling.
    #[test]
    fn derives_like_pko() {
        let host = Some("fakehostname");
        let r = |bind, adv| AdvertisedAddress::resolve(bind, adv, host).0;
        assert_eq!(r(":9090", None), "http://localhost:9090");
        assert_eq!(r("localhost:1111", None), "http://localhost:1111");
        assert_eq!(r("0.0.0.0:9090", None), "http://fakehostname:9090");
        assert_eq!(r("fake.default:9090", None), "http://fake.default:9090");
        assert_eq!(
            r("fake.default.svc.cluster.local:9090", None),
            "http://fake.default.svc.cluster.local:9090"
        );
        assert_eq!(r(":9090", Some("")), "http://localhost:9090");
    }

    #[test]
    fn keeps_https_and_adds_http() {
        let adv = AdvertisedAddress::resolve(":9090", Some("https://fake-address"), None);
        assert_eq!(
            adv.program_url("default", "p", 2),
            "https://fake-address/programs/default/p/2"
        );
        let adv = AdvertisedAddress::resolve(":9090", Some("fake-address/"), None);
        assert_eq!(
            adv.program_url("default", "p", 1),
            "http://fake-address/programs/default/p/1"
        );
        assert_eq!(artifact_path("ns", "p", 3), "programs/ns/p/3.tar.gz");
    }
}
