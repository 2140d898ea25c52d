//! Where the operator itself may connect when a tenant chooses the URL: git branch lookups
//! (`<repo>/info/refs`, or an SSH server), GitHub App token requests and https transform
//! modules.
//!
//! Every address a host name resolves to is checked before a connection is made, and so is
//! every redirect: the cloud metadata addresses (a list, not only link-local ones: AWS's IPv6
//! `fd00:ec2::254`, Alibaba's `100.100.100.200`), loopback, link-local, unspecified, multicast
//! and broadcast addresses are refused, plus the cluster's own ranges given by flags (Service
//! and Pod CIDRs), so a tenant cannot make the operator reach the apiserver's neighbours, the
//! node, or the metadata service on its behalf. No proxy from the environment is used unless a
//! flag says so: a proxy would make the connection, and its address checks are not ours.
//!
//! What a tenant learns of a failed request is a [`Failure`] class, never a status code, a
//! port, a connection error or a remote's words: from the operator's network position those
//! would make it a scanner whose results are written into the tenant's status.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Flags of the egress rules.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct EgressArgs {
    /// Address ranges the operator never connects to for a tenant's URL (git branch lookups,
    /// https transform modules), besides loopback, link-local, multicast and unspecified
    /// addresses: the cluster's Service and Pod CIDRs, e.g. 10.96.0.0/12,10.244.0.0/16.
    #[arg(long = "egress-deny-cidr", env = "EGRESS_DENY_CIDRS", value_delimiter = ',', value_parser = parse_cidr)]
    pub deny_cidrs: Vec<IpNet>,
    /// Allow loopback addresses (tests and local development only).
    #[arg(long, env = "EGRESS_ALLOW_LOOPBACK")]
    pub egress_allow_loopback: bool,
    /// More cloud metadata addresses to refuse, besides the well-known ones (see
    /// docs/operations.md), e.g. a provider's or a node agent's own.
    #[arg(long = "egress-deny-metadata-address", env = "EGRESS_DENY_METADATA_ADDRESSES", value_delimiter = ',', value_parser = parse_ip)]
    pub deny_metadata: Vec<IpAddr>,
    /// Send tenants' requests through the proxy named by HTTPS_PROXY/HTTP_PROXY/ALL_PROXY
    /// (NO_PROXY honoured). Off: the environment's proxy is ignored, since the proxy, not the
    /// operator, would connect, beyond the checks above.
    #[arg(long, env = "EGRESS_USE_ENV_PROXY")]
    pub egress_use_env_proxy: bool,
}

/// Cloud metadata and credential endpoints, refused whatever the ranges: some are not
/// link-local, and the link-local ones get their own reason.
pub const METADATA_ADDRESSES: &[IpAddr] = &[
    // AWS, GCP, Azure, OpenStack, Oracle, DigitalOcean, Hetzner, IBM, Huawei… (IPv4).
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    // AWS IMDS over IPv6 (Nitro).
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    // AWS ECS task metadata and credentials.
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 2)),
    // AWS EKS Pod Identity agent, IPv4 and IPv6.
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 23)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23)),
    // GCP metadata over IPv6.
    IpAddr::V6(Ipv6Addr::new(0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254)),
    // Alibaba Cloud.
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    // Azure WireServer (host agent, certificates).
    IpAddr::V4(Ipv4Addr::new(168, 63, 129, 16)),
    // Oracle Cloud (legacy metadata).
    IpAddr::V4(Ipv4Addr::new(192, 0, 0, 192)),
    // Tencent Cloud.
    IpAddr::V4(Ipv4Addr::new(169, 254, 0, 23)),
];

fn parse_ip(text: &str) -> Result<IpAddr, String> {
    text.trim()
        .parse::<IpAddr>()
        .map_err(|e| format!("invalid IP address {text:?}: {e}"))
}

/// A range, or one address as its own range (as `--egress-deny-cidr` takes it).
pub fn parse_cidr(text: &str) -> Result<IpNet, String> {
    text.trim()
        .parse::<IpNet>()
        .or_else(|_| text.trim().parse::<IpAddr>().map(IpNet::from))
        .map_err(|e| format!("invalid CIDR {text:?}: {e}"))
}

/// Why an address is refused (the class only: never anything the remote said).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("a cloud metadata address")]
    Metadata,
    #[error("a loopback address")]
    Loopback,
    #[error("a link-local address (such as the cloud metadata service)")]
    LinkLocal,
    #[error("an unspecified, multicast or broadcast address")]
    NotUnicast,
    #[error("an address of the cluster's own ranges")]
    Cluster,
}

/// The rules, shared by every client that fetches a tenant's URL.
#[derive(Clone, Debug)]
pub struct EgressPolicy {
    deny: Vec<IpNet>,
    metadata: Vec<IpAddr>,
    allow_loopback: bool,
    use_env_proxy: bool,
}

impl Default for EgressPolicy {
    /// The fixed rules, no cluster ranges, no proxy.
    fn default() -> Self {
        Self::from_args(&EgressArgs::default())
    }
}

/// The well-known prefix of NAT64 (RFC 6052): `64:ff9b::a.b.c.d` reaches `a.b.c.d` through a
/// NAT64 gateway, so it is judged as that IPv4 address.
const NAT64: Ipv6Addr = Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0);

impl EgressPolicy {
    pub fn from_args(args: &EgressArgs) -> Self {
        let mut metadata = METADATA_ADDRESSES.to_vec();
        metadata.extend(args.deny_metadata.iter().copied());
        Self {
            deny: args.deny_cidrs.clone(),
            metadata,
            allow_loopback: args.egress_allow_loopback,
            use_env_proxy: args.egress_use_env_proxy,
        }
    }

    /// Whether the operator may connect to `ip` for a tenant.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refused> {
        // An IPv4 address written as IPv6 (::ffff:a.b.c.d, or behind the NAT64 prefix) is
        // judged as the IPv4 address.
        let ip = match ip {
            IpAddr::V6(v6) => v6
                .to_ipv4_mapped()
                .or_else(|| {
                    let s = v6.segments();
                    (s[..6] == NAT64.segments()[..6]).then(|| {
                        let [.., a, b, c, d] = v6.octets();
                        Ipv4Addr::new(a, b, c, d)
                    })
                })
                .map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        if self.metadata.contains(&ip) {
            return Err(Refused::Metadata);
        }
        let loopback = ip.is_loopback();
        if loopback && !self.allow_loopback {
            return Err(Refused::Loopback);
        }
        let link_local = match ip {
            IpAddr::V4(v4) => v4.is_link_local(),
            IpAddr::V6(v6) => v6.is_unicast_link_local(),
        };
        if link_local {
            return Err(Refused::LinkLocal);
        }
        let not_unicast = ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
        if not_unicast {
            return Err(Refused::NotUnicast);
        }
        if self.deny.iter().any(|net| net.contains(&ip)) {
            return Err(Refused::Cluster);
        }
        Ok(())
    }

    /// Checks a URL whose host is an IP address (no name lookup happens for those). Host names
    /// are checked when they resolve (see [`Self::client_builder`]).
    pub fn check_url(&self, url: &reqwest::Url) -> Result<(), Refused> {
        match url.host() {
            Some(url::Host::Ipv4(v4)) => self.check(IpAddr::V4(v4)),
            Some(url::Host::Ipv6(v6)) => self.check(IpAddr::V6(v6)),
            _ => Ok(()),
        }
    }

    /// The addresses of `host` the operator may connect to on `port`, for a connection that
    /// is not HTTP (git over SSH). A name that resolves only to refused addresses is refused.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, Failure> {
        let found: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|_| Failure::Unreachable)?
            .collect();
        let mut refused = None;
        let allowed: Vec<SocketAddr> = found
            .into_iter()
            .filter(|addr| match self.check(addr.ip()) {
                Ok(()) => true,
                Err(why) => {
                    refused = Some(why);
                    false
                }
            })
            .collect();
        match (allowed.is_empty(), refused) {
            (true, Some(why)) => Err(Failure::Refused(why)),
            (true, None) => Err(Failure::Unreachable),
            (false, _) => Ok(allowed),
        }
    }

    /// A client builder whose name lookups and redirects follow these rules.
    pub fn client_builder(self: &Arc<Self>, max_redirects: usize) -> reqwest::ClientBuilder {
        let redirects = self.clone();
        let builder = reqwest::Client::builder()
            .dns_resolver(Arc::new(CheckedResolver {
                policy: self.clone(),
            }))
            .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() > max_redirects {
                    return attempt.error(TooManyRedirects);
                }
                match redirects.check_url(attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(refused) => attempt.error(RedirectRefused(refused)),
                }
            }));
        if self.use_env_proxy {
            builder
        } else {
            builder.no_proxy()
        }
    }
}

/// A redirect to a refused address (typed, so [`classify`] finds it in the error chain).
#[derive(Debug, thiserror::Error)]
#[error("redirected to {0}")]
struct RedirectRefused(Refused);

/// More redirects than the client follows.
#[derive(Debug, thiserror::Error)]
#[error("too many redirects")]
struct TooManyRedirects;

/// What a tenant is told about a failed request to its URL: a class of failure. Connection
/// refused, reset, timed out, an unknown name and a failed TLS handshake are one class, so a
/// tenant cannot tell a closed port from a filtered one or a TLS port from another; an HTTP
/// answer is told by its class, never its code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    #[error("refused by the egress policy (its address is {0})")]
    Refused(Refused),
    #[error("refused by the egress policy (too many redirects)")]
    TooManyRedirects,
    #[error("unreachable (no connection, or no answer in time)")]
    Unreachable,
    #[error("authentication required or refused")]
    Unauthorized,
    #[error("not found")]
    NotFound,
    #[error("the server failed")]
    ServerError,
    #[error("the request was refused by the server")]
    Rejected,
    #[error("an unexpected answer")]
    Unexpected,
}

impl Failure {
    /// The class of an HTTP answer that is not a success (`None` for a success).
    pub fn of_status(status: u16) -> Option<Self> {
        Some(match status {
            200..=299 => return None,
            401 | 403 | 407 => Self::Unauthorized,
            404 | 410 => Self::NotFound,
            400..=499 => Self::Rejected,
            500..=599 => Self::ServerError,
            _ => Self::Unexpected,
        })
    }
}

/// The class of a failed request (see [`describe`] for the operator's own log).
pub fn classify(err: &reqwest::Error) -> Failure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(cause) = source {
        if let Some(RedirectRefused(refused)) = cause.downcast_ref::<RedirectRefused>() {
            return Failure::Refused(*refused);
        }
        if cause.downcast_ref::<TooManyRedirects>().is_some() {
            return Failure::TooManyRedirects;
        }
        if let Some(resolved) = cause.downcast_ref::<ResolvedToRefused>() {
            return Failure::Refused(resolved.refused);
        }
        source = cause.source();
    }
    match err.status() {
        Some(status) => Failure::of_status(status.as_u16()).unwrap_or(Failure::Unexpected),
        None => Failure::Unreachable,
    }
}

/// A failed request described by its error chain (our client's words only: a remote's answer
/// body never appears in it). For the operator's log: it names ports and connection errors,
/// which a tenant is never shown ([`classify`]).
pub fn describe(err: &reqwest::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The system resolver, minus the refused addresses.
struct CheckedResolver {
    policy: Arc<EgressPolicy>,
}

/// A name that resolves only to refused addresses.
#[derive(Debug, thiserror::Error)]
#[error("{host} resolves only to refused addresses ({refused})")]
struct ResolvedToRefused {
    host: String,
    refused: Refused,
}

impl Resolve for CheckedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let mut refused = None;
            let allowed: Vec<SocketAddr> = found
                .into_iter()
                .filter(|addr| match policy.check(addr.ip()) {
                    Ok(()) => true,
                    Err(why) => {
                        refused = Some(why);
                        false
                    }
                })
                .collect();
            if allowed.is_empty()
                && let Some(refused) = refused
            {
                return Err(Box::new(ResolvedToRefused { host, refused })
                    as Box<dyn std::error::Error + Send + Sync>);
            }
            let addrs: Addrs = Box::new(allowed.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn refuses_what_a_tenant_must_not_reach() {
        let policy = EgressPolicy::from_args(&EgressArgs {
            deny_cidrs: vec![parse_cidr("10.96.0.0/12").expect("cidr")],
            ..EgressArgs::default()
        });
        for (addr, why) in [
            ("127.0.0.1", Refused::Loopback),
            ("127.9.9.9", Refused::Loopback),
            ("::1", Refused::Loopback),
            ("::ffff:127.0.0.1", Refused::Loopback),
            ("169.254.169.254", Refused::Metadata),
            ("169.254.1.1", Refused::LinkLocal),
            ("fe80::1", Refused::LinkLocal),
            ("0.0.0.0", Refused::NotUnicast),
            ("::", Refused::NotUnicast),
            ("224.0.0.1", Refused::NotUnicast),
            ("255.255.255.255", Refused::NotUnicast),
            ("10.96.0.1", Refused::Cluster),
            ("::ffff:10.100.0.1", Refused::Cluster),
        ] {
            assert_eq!(policy.check(ip(addr)), Err(why), "{addr}");
        }
        for addr in ["140.82.112.3", "10.0.0.5", "2606:4700::1111"] {
            assert_eq!(policy.check(ip(addr)), Ok(()), "{addr}");
        }
        let url = |s: &str| reqwest::Url::parse(s).expect("url");
        assert_eq!(
            policy.check_url(&url("http://169.254.169.254/latest")),
            Err(Refused::Metadata)
        );
        // WHATWG spellings of one address are one address.
        assert_eq!(
            policy.check_url(&url("http://2130706433/")),
            Err(Refused::Loopback)
        );
        assert_eq!(
            policy.check_url(&url("http://[::1]:8080/")),
            Err(Refused::Loopback)
        );
        assert_eq!(policy.check_url(&url("https://example.com/")), Ok(()));
    }

    #[test]
    fn loopback_only_when_allowed() {
        let policy = EgressPolicy::from_args(&EgressArgs {
            egress_allow_loopback: true,
            ..EgressArgs::default()
        });
        assert_eq!(policy.check(ip("127.0.0.1")), Ok(()));
        assert_eq!(policy.check(ip("169.254.1.1")), Err(Refused::LinkLocal));
        assert!(parse_cidr("10.0.0.0/33").is_err());
        assert_eq!(
            parse_cidr("10.1.2.3").expect("single address"),
            "10.1.2.3/32".parse::<IpNet>().expect("net")
        );
    }

    /// Issue 23: metadata addresses that are not link-local passed (AWS's IPv6 IMDS, Alibaba).
    #[test]
    fn metadata_addresses_are_refused_with_their_own_reason_and_the_flag_adds_more() {
        let policy = EgressPolicy::default();
        for addr in [
            "169.254.169.254",
            "fd00:ec2::254",
            "169.254.170.2",
            "169.254.170.23",
            "fd00:ec2::23",
            "fd20:ce::254",
            "100.100.100.200",
            "168.63.129.16",
            "192.0.0.192",
            "169.254.0.23",
            // The same addresses in IPv6 clothing.
            "::ffff:100.100.100.200",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b::100.100.100.200",
        ] {
            assert_eq!(policy.check(ip(addr)), Err(Refused::Metadata), "{addr}");
        }
        let url = |s: &str| reqwest::Url::parse(s).expect("url");
        assert_eq!(
            policy.check_url(&url("http://[fd00:ec2::254]/latest/meta-data/")),
            Err(Refused::Metadata)
        );
        assert_eq!(
            policy.check_url(&url("http://100.100.100.200/latest/meta-data/")),
            Err(Refused::Metadata)
        );
        // Neighbours of the listed addresses are judged by the other rules only.
        assert_eq!(policy.check(ip("100.100.100.201")), Ok(()));
        assert_eq!(policy.check(ip("fd00:ec2::255")), Ok(()));
        assert_eq!(policy.check(ip("64:ff9b::7f00:1")), Err(Refused::Loopback));

        let more = EgressPolicy::from_args(&EgressArgs {
            deny_metadata: vec![parse_ip("203.0.113.9").expect("ip")],
            ..EgressArgs::default()
        });
        assert_eq!(more.check(ip("203.0.113.9")), Err(Refused::Metadata));
        assert_eq!(more.check(ip("fd00:ec2::254")), Err(Refused::Metadata));
        assert_eq!(policy.check(ip("203.0.113.9")), Ok(()));
        assert!(parse_ip("203.0.113.0/24").is_err());
    }

    #[test]
    fn answers_are_told_by_class_never_by_code() {
        for (status, class) in [
            (200, None),
            (204, None),
            (301, Some(Failure::Unexpected)),
            (401, Some(Failure::Unauthorized)),
            (403, Some(Failure::Unauthorized)),
            (404, Some(Failure::NotFound)),
            (410, Some(Failure::NotFound)),
            (418, Some(Failure::Rejected)),
            (429, Some(Failure::Rejected)),
            (500, Some(Failure::ServerError)),
            (503, Some(Failure::ServerError)),
            (600, Some(Failure::Unexpected)),
        ] {
            assert_eq!(Failure::of_status(status), class, "{status}");
            if let Some(class) = class {
                let text = class.to_string();
                assert!(!text.contains(&status.to_string()), "{status}: {text}");
            }
        }
    }

    /// One connection accepted on loopback, answered with `answer`, and its port.
    async fn answer_once(answer: &'static str) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            if let Ok((mut sock, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = sock.read(&mut buf).await;
                let _ = sock.write_all(answer.as_bytes()).await;
                let _ = sock.shutdown().await;
            }
        });
        port
    }

    #[tokio::test]
    async fn failed_requests_are_classified_from_the_client_error() {
        let allow_loopback = |extra: Vec<IpNet>| {
            Arc::new(EgressPolicy::from_args(&EgressArgs {
                deny_cidrs: extra,
                egress_allow_loopback: true,
                ..EgressArgs::default()
            }))
        };
        let policy = allow_loopback(Vec::new());
        let client = policy.client_builder(2).build().expect("client");
        // A closed port: refused at once, told as unreachable (no port oracle).
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let err = client
            .get(format!("http://127.0.0.1:{closed}/"))
            .send()
            .await
            .expect_err("closed port");
        assert_eq!(classify(&err), Failure::Unreachable, "{}", describe(&err));
        // A teapot: the class of its status, not the status.
        let port = answer_once("HTTP/1.1 418 I'm a teapot\r\nContent-Length: 3\r\n\r\ntea").await;
        let err = client
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .expect_err("418");
        assert_eq!(classify(&err), Failure::Rejected);
        // A redirect to a refused address: refused, with the address's class.
        let policy = allow_loopback(vec![parse_cidr("127.0.0.2/32").expect("cidr")]);
        let client = policy.client_builder(2).build().expect("client");
        let port = answer_once(
            "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.2:1/x\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        let err = client
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .expect_err("redirect refused");
        assert_eq!(classify(&err), Failure::Refused(Refused::Cluster));
        // A name resolving only to refused addresses.
        let client = Arc::new(EgressPolicy::default())
            .client_builder(2)
            .build()
            .expect("client");
        let err = client
            .get("http://localhost:1/")
            .send()
            .await
            .expect_err("loopback name");
        assert_eq!(classify(&err), Failure::Refused(Refused::Loopback));
    }
}
