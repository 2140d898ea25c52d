//! Certificates and keys for the apiserver, generated in-process so no openssl CLI is needed.
//!
//! A small CA plus a serving certificate signed by it (passed with `--tls-cert-file`) gives
//! a trust anchor that kube-rs (rustls) and kubectl both accept, independent of what the
//! apiserver would generate into `--cert-dir` on its own.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};

pub(crate) struct Pki {
    pub ca_cert_pem: String,
    pub serving_cert_pem: String,
    pub serving_key_pem: String,
    /// PKCS#8 private key for `--service-account-signing-key-file`.
    pub sa_key_pem: String,
    /// SPKI public key for `--service-account-key-file` (the apiserver's parser does not read
    /// PKCS#8 EC private keys there).
    pub sa_pub_pem: String,
    /// The client certificate of a real node's kubelet ([`NODE_NAME`] in `system:nodes`),
    /// signed by the same CA (the apiserver's `--client-ca-file`).
    pub node_client_cert_pem: String,
    pub node_client_key_pem: String,
}

/// The name of the node a real kubelet registers (see `crate::node`).
pub const NODE_NAME: &str = "pko-node";

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "pko-tests");
    dn
}

pub(crate) fn generate() -> Result<Pki, rcgen::Error> {
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = name("pko-tests-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

    // Loopback names plus the in-cluster names of the `kubernetes` service, for clients that
    // use them through a port-forward or a custom resolver.
    let mut serving = CertificateParams::new(vec![
        "127.0.0.1".to_string(),
        "::1".to_string(),
        "localhost".to_string(),
        "10.0.0.1".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
        "kubernetes.default.svc.cluster.local".to_string(),
    ])?;
    serving.distinguished_name = name("kube-apiserver");
    serving.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    serving.use_authority_key_identifier_extension = true;
    let serving_key = KeyPair::generate()?;
    let serving_cert = serving.signed_by(&serving_key, &*ca)?;

    let mut client = CertificateParams::default();
    let mut client_name = DistinguishedName::new();
    client_name.push(DnType::CommonName, format!("system:node:{NODE_NAME}"));
    client_name.push(DnType::OrganizationName, "system:nodes");
    client.distinguished_name = client_name;
    client.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    client.use_authority_key_identifier_extension = true;
    let client_key = KeyPair::generate()?;
    let client_cert = client.signed_by(&client_key, &*ca)?;

    let sa_key = KeyPair::generate()?;
    Ok(Pki {
        node_client_cert_pem: client_cert.pem(),
        node_client_key_pem: client_key.serialize_pem(),
        ca_cert_pem: ca.pem(),
        serving_cert_pem: serving_cert.pem(),
        serving_key_pem: serving_key.serialize_pem(),
        sa_key_pem: sa_key.serialize_pem(),
        sa_pub_pem: sa_key.public_key_pem(),
    })
}
