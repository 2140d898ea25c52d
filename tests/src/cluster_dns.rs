//! The harness's pod network: each pod that serves on its declared port gets an address of its
//! own on loopback (`127.a.b.c`), and a process-wide DNS server answers the names a cluster's
//! DNS would give it (`<service>.<namespace>[.svc[.cluster.local]]`).
//!
//! PKO's manager dials `<workspace>-workspace.<namespace>:50051`, one port for every workspace,
//! so several of PKO's agents at once need an address each and names that resolve to them. Its
//! resolver (Go's, reading `/etc/resolv.conf`) is pointed at this server by running it in a
//! private mount namespace with [`ClusterDns::resolv_conf`] bound over `/etc/resolv.conf`
//! (see `pko_peer`). A DNS server rather than an `/etc/hosts` file because Go caches the hosts
//! file for 5 s: a pod started meanwhile would not resolve.
//!
//! The server answers A queries for the names it holds, an empty answer for their other types,
//! and NXDOMAIN for every other name; nothing is forwarded. It binds UDP port 53 on a random
//! loopback address, so test processes of several users on one machine do not meet.

use std::collections::HashMap;
use std::net::{Ipv4Addr, UdpSocket};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use crate::HarnessError;

/// The cluster domain, as a default cluster names it.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

/// The process-wide DNS server.
pub struct ClusterDns {
    address: Ipv4Addr,
    names: Arc<RwLock<HashMap<String, Ipv4Addr>>>,
    resolv_conf: PathBuf,
    _dir: tempfile::TempDir,
}

static SHARED: OnceLock<Result<ClusterDns, String>> = OnceLock::new();

impl ClusterDns {
    /// The server of this test process, started on first use (on a thread of its own, so it
    /// outlives every test's runtime).
    pub fn shared() -> Result<&'static ClusterDns, HarnessError> {
        SHARED
            .get_or_init(|| Self::start().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| HarnessError::Missing {
                what: format!("the cluster DNS server: {e}"),
            })
    }

    fn start() -> Result<Self, HarnessError> {
        let mut last = None;
        let mut bound = None;
        for _ in 0..32 {
            let address = random_loopback();
            match UdpSocket::bind((address, 53)) {
                Ok(socket) => {
                    bound = Some((address, socket));
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let Some((address, socket)) = bound else {
            return Err(HarnessError::io(
                "binding the cluster DNS server to port 53 of a loopback address",
                last.unwrap_or_else(|| std::io::Error::other("no address left")),
            ));
        };
        // The server lives as long as the process, and a static is never dropped: the folders
        // of processes that are gone are removed here instead.
        remove_stale_folders(&std::env::temp_dir());
        let dir = tempfile::Builder::new()
            .prefix(&format!("{FOLDER_PREFIX}{}-", std::process::id()))
            .tempdir()
            .map_err(|e| HarnessError::io("creating the DNS folder", e))?;
        let resolv_conf = dir.path().join("resolv.conf");
        // One quick attempt: an unknown name is answered at once, and there is nothing else.
        std::fs::write(
            &resolv_conf,
            format!("nameserver {address}\noptions ndots:1 timeout:1 attempts:1\n"),
        )
        .map_err(|e| HarnessError::io(format!("writing {}", resolv_conf.display()), e))?;
        let names: Arc<RwLock<HashMap<String, Ipv4Addr>>> = Arc::default();
        let served = names.clone();
        std::thread::Builder::new()
            .name("pko-tests-dns".into())
            .spawn(move || serve(&socket, &served))
            .map_err(|e| HarnessError::io("starting the DNS thread", e))?;
        Ok(Self {
            address,
            names,
            resolv_conf,
            _dir: dir,
        })
    }

    /// The server's address (port 53).
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// A `resolv.conf` naming this server only.
    pub fn resolv_conf(&self) -> &std::path::Path {
        &self.resolv_conf
    }

    /// Makes `<service>.<namespace>`, `….svc` and `….svc.cluster.local` resolve to `ip` (a
    /// headless Service with one pod).
    pub fn set_service(&self, service: &str, namespace: &str, ip: Ipv4Addr) {
        let mut names = self.names.write().unwrap_or_else(PoisonError::into_inner);
        for name in service_names(service, namespace) {
            names.insert(name, ip);
        }
    }

    /// Forgets the names of a Service.
    pub fn remove_service(&self, service: &str, namespace: &str) {
        let mut names = self.names.write().unwrap_or_else(PoisonError::into_inner);
        for name in service_names(service, namespace) {
            names.remove(&name);
        }
    }

    /// What `name` resolves to now.
    pub fn lookup(&self, name: &str) -> Option<Ipv4Addr> {
        let names = self.names.read().unwrap_or_else(PoisonError::into_inner);
        names
            .get(name.trim_end_matches('.').to_ascii_lowercase().as_str())
            .copied()
    }
}

/// Sets up a process's private mounts, then runs it: `/etc/resolv.conf` from
/// `$PKO_TESTS_RESOLV_CONF` when set, and the in-cluster namespace file
/// (`/run/secrets/kubernetes.io/serviceaccount/namespace`, which controller-runtime reads for
/// its leader-election namespace) holding `$PKO_TESTS_POD_NAMESPACE` when set.
const PRIVATE_MOUNTS: &str = "set -e; \
    if [ -n \"$PKO_TESTS_RESOLV_CONF\" ]; then mount --bind \"$PKO_TESTS_RESOLV_CONF\" /etc/resolv.conf; fi; \
    if [ -n \"$PKO_TESTS_POD_NAMESPACE\" ]; then mount -t tmpfs none /run \
      && mkdir -p /run/secrets/kubernetes.io/serviceaccount \
      && printf %s \"$PKO_TESTS_POD_NAMESPACE\" > /run/secrets/kubernetes.io/serviceaccount/namespace; fi; \
    exec \"$0\" \"$@\"";

/// `program` run in a mount namespace of its own (`unshare`, as root), resolving names with
/// the cluster DNS when `dns` and seeing `pod_namespace` as its in-cluster namespace when set.
/// Arguments added to the command go to `program`.
pub fn private_mounts(
    program: &std::path::Path,
    dns: Option<&ClusterDns>,
    pod_namespace: Option<&str>,
) -> std::process::Command {
    let mut cmd = std::process::Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        PRIVATE_MOUNTS,
    ])
    .arg(program);
    if let Some(dns) = dns {
        cmd.env("PKO_TESTS_RESOLV_CONF", dns.resolv_conf());
    }
    if let Some(ns) = pod_namespace {
        cmd.env("PKO_TESTS_POD_NAMESPACE", ns);
    }
    cmd
}

/// `<temp>/pko-tests-dns-<pid>-…`: the folder of one test process's server.
const FOLDER_PREFIX: &str = "pko-tests-dns-";

/// Removes the folders of servers whose process is gone.
fn remove_stale_folders(temp: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix(FOLDER_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if let Some(pid) = pid
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn service_names(service: &str, namespace: &str) -> [String; 3] {
    let short = format!("{service}.{namespace}").to_ascii_lowercase();
    [
        format!("{short}.svc"),
        format!("{short}.svc.{CLUSTER_DOMAIN}"),
        short,
    ]
}

/// A random loopback address outside `127.0.0.0/24` (where everything else listens).
pub fn random_loopback() -> Ipv4Addr {
    Ipv4Addr::new(
        127,
        rand::random_range(1..=254),
        rand::random_range(0..=255),
        rand::random_range(1..=254),
    )
}

fn serve(socket: &UdpSocket, names: &RwLock<HashMap<String, Ipv4Addr>>) {
    let mut buf = [0u8; 512];
    loop {
        let Ok((n, peer)) = socket.recv_from(&mut buf) else {
            continue;
        };
        let lookup = |name: &str| {
            names
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .get(name)
                .copied()
        };
        if let Some(reply) = answer(&buf[..n], lookup) {
            let _ = socket.send_to(&reply, peer);
        }
    }
}

const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;
const NXDOMAIN: u8 = 3;
const FORMERR: u8 = 1;

/// The answer to one query message, or `None` for what is no query (dropped, as a server
/// does with garbage).
fn answer(query: &[u8], lookup: impl Fn(&str) -> Option<Ipv4Addr>) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 {
        return None;
    }
    let questions = u16::from_be_bytes([query[4], query[5]]);
    let reply = |rcode: u8, question: &[u8], answers: &[u8], count: u16| {
        let mut out = Vec::with_capacity(12 + question.len() + answers.len());
        out.extend_from_slice(&query[..2]);
        // QR, the query's opcode and RD; authoritative; recursion available.
        out.push(0x80 | (query[2] & 0x79) | 0x04);
        out.push(0x80 | rcode);
        out.extend_from_slice(&u16::from(!question.is_empty()).to_be_bytes());
        out.extend_from_slice(&count.to_be_bytes());
        out.extend_from_slice(&[0, 0, 0, 0]);
        out.extend_from_slice(question);
        out.extend_from_slice(answers);
        out
    };
    if questions != 1 {
        return Some(reply(FORMERR, &[], &[], 0));
    }
    let Some((name, end)) = read_name(query, 12) else {
        return Some(reply(FORMERR, &[], &[], 0));
    };
    let Some(fixed) = query.get(end..end + 4) else {
        return Some(reply(FORMERR, &[], &[], 0));
    };
    let qtype = u16::from_be_bytes([fixed[0], fixed[1]]);
    let qclass = u16::from_be_bytes([fixed[2], fixed[3]]);
    let question = &query[12..end + 4];
    let Some(ip) = lookup(&name) else {
        return Some(reply(NXDOMAIN, question, &[], 0));
    };
    if qtype != TYPE_A || qclass != CLASS_IN {
        // The name exists, with no record of this type.
        return Some(reply(0, question, &[], 0));
    }
    let mut record = vec![0xc0, 12];
    record.extend_from_slice(&TYPE_A.to_be_bytes());
    record.extend_from_slice(&CLASS_IN.to_be_bytes());
    // A short TTL: a restarted pod gets a new address.
    record.extend_from_slice(&1u32.to_be_bytes());
    record.extend_from_slice(&4u16.to_be_bytes());
    record.extend_from_slice(&ip.octets());
    Some(reply(0, question, &record, 1))
}

/// The question's name (lowercase, no trailing dot) and the offset after it; compression is
/// not used in questions.
fn read_name(message: &[u8], mut at: usize) -> Option<(String, usize)> {
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*message.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        let label = message.get(at..at + len)?;
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        at += len;
    }
    Some((labels.join("."), at))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(u8::try_from(label.len()).expect("label"));
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&CLASS_IN.to_be_bytes());
        q
    }

    #[test]
    fn known_names_get_their_address_and_others_nxdomain() {
        let ip = Ipv4Addr::new(127, 9, 8, 7);
        let lookup = |n: &str| (n == "ws-workspace.ns").then_some(ip);
        let a = answer(&query("WS-workspace.ns", TYPE_A), lookup).expect("reply");
        assert_eq!(&a[..2], &[0x12, 0x34]);
        assert_eq!(a[3] & 0x0f, 0);
        assert_eq!(u16::from_be_bytes([a[6], a[7]]), 1);
        assert_eq!(&a[a.len() - 4..], &ip.octets());
        let aaaa = answer(&query("ws-workspace.ns", 28), lookup).expect("reply");
        assert_eq!((aaaa[3] & 0x0f, aaaa[7]), (0, 0));
        let other = answer(&query("other.ns", TYPE_A), lookup).expect("reply");
        assert_eq!(other[3] & 0x0f, NXDOMAIN);
        assert!(answer(&[0; 5], lookup).is_none());
    }

    #[test]
    fn a_service_has_its_cluster_names() {
        assert_eq!(
            service_names("ws-workspace", "ns"),
            [
                "ws-workspace.ns.svc",
                "ws-workspace.ns.svc.cluster.local",
                "ws-workspace.ns"
            ]
        );
    }
}
