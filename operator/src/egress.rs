//! Where the operator itself may connect when a tenant chooses the URL: git branch lookups
//! (`<repo>/info/refs`) and https transform modules.
//!
//! Every address a host name resolves to is checked before a connection is made, and so is
//! every redirect: loopback, link-local (the cloud metadata address included), unspecified,
//! multicast and broadcast addresses are refused, plus the cluster's own ranges given by flags
//! (Service and Pod CIDRs), so a tenant cannot make the operator reach the apiserver's
//! neighbours, the node, or the metadata service on its behalf.

use std::net::{IpAddr, SocketAddr};
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
}

fn parse_cidr(text: &str) -> Result<IpNet, String> {
    text.trim()
        .parse::<IpNet>()
        .or_else(|_| text.trim().parse::<IpAddr>().map(IpNet::from))
        .map_err(|e| format!("invalid CIDR {text:?}: {e}"))
}

/// Why an address is refused (the class only: never anything the remote said).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
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
#[derive(Clone, Debug, Default)]
pub struct EgressPolicy {
    deny: Vec<IpNet>,
    allow_loopback: bool,
}

impl EgressPolicy {
    pub fn from_args(args: &EgressArgs) -> Self {
        Self {
            deny: args.deny_cidrs.clone(),
            allow_loopback: args.egress_allow_loopback,
        }
    }

    /// Whether the operator may connect to `ip` for a tenant.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refused> {
        // An IPv4 address written as IPv6 (::ffff:a.b.c.d) is judged as the IPv4 address.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
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

    /// A client builder whose name lookups and redirects follow these rules.
    pub fn client_builder(self: &Arc<Self>, max_redirects: usize) -> reqwest::ClientBuilder {
        let redirects = self.clone();
        reqwest::Client::builder()
            .dns_resolver(Arc::new(CheckedResolver {
                policy: self.clone(),
            }))
            .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() > max_redirects {
                    return attempt.error("too many redirects");
                }
                match redirects.check_url(attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(refused) => {
                        let message = format!("redirected to {refused}");
                        attempt.error(message)
                    }
                }
            }))
    }
}

/// A failed request described by its error chain (our client's words only: a remote's answer
/// body never appears in it).
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
            egress_allow_loopback: false,
        });
        for (addr, why) in [
            ("127.0.0.1", Refused::Loopback),
            ("127.9.9.9", Refused::Loopback),
            ("::1", Refused::Loopback),
            ("::ffff:127.0.0.1", Refused::Loopback),
            ("169.254.169.254", Refused::LinkLocal),
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
            Err(Refused::LinkLocal)
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
            deny_cidrs: Vec::new(),
            egress_allow_loopback: true,
        });
        assert_eq!(policy.check(ip("127.0.0.1")), Ok(()));
        assert_eq!(policy.check(ip("169.254.169.254")), Err(Refused::LinkLocal));
        assert!(parse_cidr("10.0.0.0/33").is_err());
        assert_eq!(
            parse_cidr("10.1.2.3").expect("single address"),
            "10.1.2.3/32".parse::<IpNet>().expect("net")
        );
    }
}
