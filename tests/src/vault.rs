//! A HashiCorp Vault stand-in for `hashivault://` secrets providers, over HTTP on loopback: the
//! transit engine's `encrypt` and `decrypt` endpoints (`/v1/transit/{encrypt,decrypt}/<key>`)
//! as Vault answers them, nothing else. A named key is made at its first encryption (Vault's
//! upsert), 256 random bits kept in memory; encryption is real AES-256-GCM with a random
//! 96-bit nonce, the ciphertext Vault's `vault:v1:<base64(nonce ‖ sealed)>`. Every call needs
//! the `X-Vault-Token` the server was started with (403 otherwise, as Vault's "permission
//! denied"). Pulumi's cloud secrets manager (gocloud's `hashivault`) encrypts the stack's data
//! key with it at `stack init` and decrypts it on each command; [`Vault::seen`] tells which
//! calls came and which ciphertexts were issued.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::put;
use base64::Engine;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use serde_json::{Value, json};

use crate::HarnessError;

const PREFIX: &str = "vault:v1:";

/// What the server saw.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Ciphertexts issued by `encrypt`, by key name, in order.
    pub encrypted: Vec<(String, String)>,
    /// `decrypt` calls answered with a plaintext, by key name.
    pub decrypted: Vec<String>,
    /// Calls refused (wrong token, unknown key, bad ciphertext), with the reason.
    pub refused: Vec<String>,
}

#[derive(Clone)]
struct Server {
    token: String,
    keys: Arc<Mutex<HashMap<String, [u8; 32]>>>,
    seen: Arc<Mutex<Seen>>,
}

pub struct Vault {
    pub port: u16,
    seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl Vault {
    /// A server answering callers that present `token`.
    pub async fn start(token: &str) -> Result<Self, HarnessError> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let server = Server {
            token: token.to_owned(),
            keys: Arc::default(),
            seen: seen.clone(),
        };
        // Vault's client writes with PUT; POST is the same to Vault.
        let router = axum::Router::new()
            .route("/v1/transit/encrypt/{key}", put(encrypt).post(encrypt))
            .route("/v1/transit/decrypt/{key}", put(decrypt).post(decrypt))
            .with_state(server);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::io("binding the Vault stand-in", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError::io("the Vault stand-in's address", e))?
            .port();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Ok(Self { port, seen, task })
    }

    /// `VAULT_ADDR`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn seen(&self) -> Seen {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Vault {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Answer = (StatusCode, axum::Json<Value>);

fn error(status: StatusCode, message: &str) -> Answer {
    (status, axum::Json(json!({"errors": [message]})))
}

fn data(data: Value) -> Answer {
    // Vault wraps every answer of a logical path in a response with `data`.
    (
        StatusCode::OK,
        axum::Json(json!({
            "request_id": "", "lease_id": "", "renewable": false, "lease_duration": 0,
            "data": data, "wrap_info": null, "warnings": null, "auth": null,
        })),
    )
}

impl Server {
    fn record(&self, f: impl FnOnce(&mut Seen)) {
        f(&mut self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner));
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        headers
            .get("x-vault-token")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t == self.token)
    }

    fn refuse(&self, status: StatusCode, reason: String) -> Answer {
        self.record(|s| s.refused.push(reason.clone()));
        error(status, &reason)
    }

    /// The key named `name`, made now if `create` and it does not exist.
    fn key(&self, name: &str, create: bool) -> Option<LessSafeKey> {
        let mut keys = self
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let bytes = match keys.get(name) {
            Some(bytes) => *bytes,
            None if create => {
                let mut bytes = [0u8; 32];
                SystemRandom::new().fill(&mut bytes).ok()?;
                keys.insert(name.to_owned(), bytes);
                bytes
            }
            None => return None,
        };
        UnboundKey::new(&AES_256_GCM, &bytes)
            .ok()
            .map(LessSafeKey::new)
    }
}

async fn encrypt(
    State(server): State<Server>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Answer {
    // Vault's client sends JSON without a Content-Type.
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if !server.authorized(&headers) {
        return server.refuse(StatusCode::FORBIDDEN, "permission denied".into());
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let Some(mut sealed) = body["plaintext"].as_str().and_then(|p| b64.decode(p).ok()) else {
        return server.refuse(
            StatusCode::BAD_REQUEST,
            "plaintext must be base64 data".into(),
        );
    };
    let Some(key) = server.key(&name, true) else {
        return server.refuse(StatusCode::INTERNAL_SERVER_ERROR, "no key".into());
    };
    let mut nonce = [0u8; NONCE_LEN];
    if SystemRandom::new().fill(&mut nonce).is_err()
        || key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut sealed,
            )
            .is_err()
    {
        return server.refuse(StatusCode::INTERNAL_SERVER_ERROR, "sealing failed".into());
    }
    let mut blob = nonce.to_vec();
    blob.extend_from_slice(&sealed);
    let ciphertext = format!("{PREFIX}{}", b64.encode(blob));
    server.record(|s| s.encrypted.push((name.clone(), ciphertext.clone())));
    data(json!({"ciphertext": ciphertext, "key_version": 1}))
}

async fn decrypt(
    State(server): State<Server>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Answer {
    // Vault's client sends JSON without a Content-Type.
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if !server.authorized(&headers) {
        return server.refuse(StatusCode::FORBIDDEN, "permission denied".into());
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let Some(key) = server.key(&name, false) else {
        return server.refuse(
            StatusCode::BAD_REQUEST,
            format!("encryption key not found: {name}"),
        );
    };
    let blob = body["ciphertext"]
        .as_str()
        .and_then(|c| c.strip_prefix(PREFIX))
        .and_then(|c| b64.decode(c).ok())
        .filter(|b| b.len() > NONCE_LEN);
    let Some(blob) = blob else {
        return server.refuse(StatusCode::BAD_REQUEST, "invalid ciphertext".into());
    };
    let (nonce, sealed) = blob.split_at(NONCE_LEN);
    let mut sealed = sealed.to_vec();
    let opened = Nonce::try_assume_unique_for_key(nonce)
        .ok()
        .and_then(|n| key.open_in_place(n, Aad::empty(), &mut sealed).ok());
    let Some(plaintext) = opened else {
        return server.refuse(
            StatusCode::BAD_REQUEST,
            "cipher: message authentication failed".into(),
        );
    };
    let plaintext = b64.encode(plaintext);
    server.record(|s| s.decrypted.push(name.clone()));
    data(json!({"plaintext": plaintext}))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn call(port: u16, path: &str, token: &str, body: Value) -> (u16, Value) {
        let response = reqwest::Client::new()
            .put(format!("http://127.0.0.1:{port}{path}"))
            .header("X-Vault-Token", token)
            .body(body.to_string())
            .send()
            .await
            .expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).expect("json"))
    }

    #[tokio::test]
    async fn transit_round_trips_and_refuses_tampering_and_strangers() {
        let vault = Vault::start("root").await.expect("vault");
        let b64 = base64::engine::general_purpose::STANDARD;
        let plaintext = b64.encode(b"the data key");
        let (status, answer) = call(
            vault.port,
            "/v1/transit/encrypt/k",
            "root",
            json!({"plaintext": plaintext}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        let ciphertext = answer["data"]["ciphertext"].as_str().expect("ciphertext");
        assert!(ciphertext.starts_with("vault:v1:"), "{ciphertext}");
        assert!(!ciphertext.contains(&plaintext));
        let (status, answer) = call(
            vault.port,
            "/v1/transit/decrypt/k",
            "root",
            json!({"ciphertext": ciphertext}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["data"]["plaintext"], json!(plaintext));

        // One flipped byte of the sealed data fails authentication.
        let mut blob = b64.decode(&ciphertext[PREFIX.len()..]).expect("b64");
        let last = blob.len() - 1;
        blob[last] ^= 1;
        let tampered = format!("{PREFIX}{}", b64.encode(blob));
        let (status, _) = call(
            vault.port,
            "/v1/transit/decrypt/k",
            "root",
            json!({"ciphertext": tampered}),
        )
        .await;
        assert_eq!(status, 400);
        let (status, _) = call(
            vault.port,
            "/v1/transit/decrypt/other",
            "root",
            json!({"ciphertext": ciphertext}),
        )
        .await;
        assert_eq!(status, 400, "another key opens nothing");
        let (status, _) = call(
            vault.port,
            "/v1/transit/encrypt/k",
            "wrong",
            json!({"plaintext": plaintext}),
        )
        .await;
        assert_eq!(status, 403);
        let seen = vault.seen();
        assert_eq!(seen.encrypted.len(), 1);
        assert_eq!(seen.decrypted, ["k"]);
        assert_eq!(seen.refused.len(), 3, "{:?}", seen.refused);
    }
}
