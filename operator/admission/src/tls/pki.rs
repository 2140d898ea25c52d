//! The certificates themselves: what a bundle needs at a point in time, and issuing a CA and a
//! serving certificate (rcgen).

use super::*;

/// What a bundle needs, judged at a point in time.
#[derive(Debug, PartialEq, Eq)]
pub enum Assessment {
    /// Good as it is.
    Valid,
    /// The CA is fine; the serving certificate must be (re)issued, for the given reason.
    RenewServing(String),
    /// A new CA is needed (and so a new serving certificate).
    RenewCa(String),
}

pub(super) fn parse_pem_certs(pem: &str) -> Result<Vec<x509_parser::pem::Pem>, TlsError> {
    let blocks = x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem(e.to_string()))?;
    if blocks.is_empty() {
        return Err(TlsError::Pem("no PEM certificate".into()));
    }
    Ok(blocks)
}

/// Unix expiry time of the first certificate of `pem`.
pub fn not_after(pem: &str) -> Result<i64, TlsError> {
    let blocks = parse_pem_certs(pem)?;
    let cert = blocks[0]
        .parse_x509()
        .map_err(|e| TlsError::Pem(e.to_string()))?;
    Ok(cert.validity().not_after.timestamp())
}

/// Judges `bundle` against `settings` at `now` (unix seconds).
pub fn assess(bundle: &CertBundle, settings: &CertSettings, now: i64) -> Assessment {
    let Some(ca_key) = &bundle.ca_key_pem else {
        return Assessment::RenewCa("no CA key".into());
    };
    if KeyPair::from_pem(ca_key).is_err() {
        return Assessment::RenewCa("the CA key does not parse".into());
    }
    let cas = match parse_pem_certs(&bundle.ca_pem) {
        Ok(cas) => cas,
        Err(e) => return Assessment::RenewCa(format!("the CA does not parse: {e}")),
    };
    let ca = match cas[0].parse_x509() {
        Ok(ca) => ca,
        Err(e) => return Assessment::RenewCa(format!("the CA does not parse: {e}")),
    };
    if ca.validity().not_after.timestamp() - now < secs(CA_RENEW_BEFORE) {
        return Assessment::RenewCa("the CA expires within a year".into());
    }
    if KeyPair::from_pem(&bundle.key_pem).is_err() {
        return Assessment::RenewServing("the serving key does not parse".into());
    }
    let blocks = match parse_pem_certs(&bundle.cert_pem) {
        Ok(blocks) => blocks,
        Err(e) => return Assessment::RenewServing(format!("the serving certificate: {e}")),
    };
    let cert = match blocks[0].parse_x509() {
        Ok(cert) => cert,
        Err(e) => return Assessment::RenewServing(format!("the serving certificate: {e}")),
    };
    if cert.verify_signature(Some(ca.public_key())).is_err() {
        return Assessment::RenewServing("the serving certificate is not signed by the CA".into());
    }
    let remaining = cert.validity().not_after.timestamp() - now;
    if remaining < secs(settings.renew_before) {
        return Assessment::RenewServing(format!("it expires in {remaining} s"));
    }
    let covered = covered_hosts(&cert);
    if let Some(missing) = settings.hosts.iter().find(|h| !host_covered(h, &covered)) {
        return Assessment::RenewServing(format!("it does not cover {missing}"));
    }
    Assessment::Valid
}

pub(super) fn covered_hosts(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(dns) => Some((*dns).to_owned()),
            GeneralName::IPAddress(bytes) => match bytes.len() {
                4 => <[u8; 4]>::try_from(*bytes)
                    .ok()
                    .map(|b| IpAddr::from(b).to_string()),
                16 => <[u8; 16]>::try_from(*bytes)
                    .ok()
                    .map(|b| IpAddr::from(b).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

pub(super) fn host_covered(host: &str, covered: &[String]) -> bool {
    match host.parse::<IpAddr>() {
        Ok(ip) => covered.iter().any(|c| c.parse::<IpAddr>() == Ok(ip)),
        Err(_) => covered.iter().any(|c| c.eq_ignore_ascii_case(host)),
    }
}

pub(super) fn distinguished_name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "pko-rs");
    dn
}

pub(super) fn offset(now: i64, delta: i64) -> Result<time::OffsetDateTime, TlsError> {
    time::OffsetDateTime::from_unix_timestamp(now.saturating_add(delta))
        .map_err(|e| TlsError::Pem(format!("certificate time out of range: {e}")))
}

/// Issues what `assessment` asks for, keeping what is still good in `current`.
pub fn issue(
    current: Option<&CertBundle>,
    assessment: &Assessment,
    settings: &CertSettings,
    now: i64,
) -> Result<CertBundle, TlsError> {
    // Reuse the CA when only the serving certificate needs renewing.
    let reused = match (assessment, current) {
        (Assessment::RenewServing(_) | Assessment::Valid, Some(bundle)) => {
            match &bundle.ca_key_pem {
                Some(key) => Some((bundle.ca_pem.clone(), KeyPair::from_pem(key)?, key.clone())),
                None => None,
            }
        }
        _ => None,
    };
    let (ca_pem, ca_key, ca_key_pem) = match reused {
        Some(ca) => ca,
        None => {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::default();
            params.distinguished_name = distinguished_name("pko-rs-webhook-ca");
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            params.not_before = offset(now, -3600)?;
            params.not_after = offset(now, secs(settings.ca_validity))?;
            let cert = params.self_signed(&key)?;
            // Keep the previous CAs that are still valid: replicas may serve their
            // certificates until they pick up the new Secret.
            let mut pem = cert.pem();
            if let Some(old) = current {
                for block in parse_pem_certs(&old.ca_pem).unwrap_or_default() {
                    let still_valid = block
                        .parse_x509()
                        .map(|c| c.validity().not_after.timestamp() > now)
                        .unwrap_or(false);
                    if still_valid {
                        pem.push_str(&pem_encode("CERTIFICATE", &block.contents));
                    }
                }
            }
            let key_pem = key.serialize_pem();
            (pem, key, key_pem)
        }
    };
    let first_ca = parse_pem_certs(&ca_pem)?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::Pem("empty CA bundle".into()))?;
    let ca_expiry = first_ca
        .parse_x509()
        .map_err(|e| TlsError::Pem(e.to_string()))?
        .validity()
        .not_after
        .timestamp();
    let issuer =
        Issuer::from_ca_cert_der(&CertificateDer::from(first_ca.contents.clone()), ca_key)?;

    let serving_key = KeyPair::generate()?;
    let mut params = CertificateParams::new(settings.hosts.clone())?;
    params.distinguished_name = distinguished_name(
        settings
            .hosts
            .first()
            .map(String::as_str)
            .unwrap_or("pko-rs-webhook"),
    );
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = offset(now, -3600)?;
    // Never past the CA's own expiry.
    params.not_after = offset(now, secs(settings.serving_validity).min(ca_expiry - now))?;
    let cert = params.signed_by(&serving_key, &issuer)?;
    Ok(CertBundle {
        cert_pem: cert.pem(),
        key_pem: serving_key.serialize_pem(),
        ca_pem,
        ca_key_pem: Some(ca_key_pem),
    })
}

pub(super) fn pem_encode(label: &str, der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}
