//! A GitHub API stand-in for GitHub App tests, over HTTPS on loopback: it answers
//! `POST /app/installations/<id>/access_tokens` as GitHub does, after the checks GitHub makes:
//! a `Bearer` RS256 JWT whose signature verifies with the App's public key, `iss` the App id,
//! `iat` not in the future, `exp` after now and at most 10 minutes ahead (GitHub's own bound).
//! It then issues one installation token (201, `{token, expires_at}`); a [`crate::gitrepo`]
//! server started with that token as the password serves the repository to it alone.

use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use base64::Engine;

use crate::HarnessError;

/// What the stub saw.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Token requests answered 201.
    pub issued: usize,
    /// Requests refused, with GitHub's message.
    pub refused: Vec<String>,
}

#[derive(Clone)]
struct App {
    app_id: String,
    installation_id: String,
    /// The App's public key (an RSA `RSAPublicKey` DER), as GitHub holds it.
    public_key: Vec<u8>,
    token: String,
    seen: Arc<Mutex<Seen>>,
}

pub struct GithubApi {
    pub port: u16,
    /// The CA that signed the stub's certificate (PEM), for `SSL_CERT_FILE`.
    pub ca_pem: String,
    seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl GithubApi {
    /// Serves App `app_id`'s installation `installation_id`, whose key's public half is
    /// `public_key` (RSAPublicKey DER), issuing `token`.
    pub async fn start(
        app_id: &str,
        installation_id: &str,
        public_key: Vec<u8>,
        token: &str,
    ) -> Result<Self, HarnessError> {
        use pko_admission::tls::{Assessment, CertSettings, issue};
        let failed = |what: &str, e: String| HarnessError::io(what, std::io::Error::other(e));
        let settings =
            CertSettings::new("unused".into(), "unused".into(), vec!["127.0.0.1".into()]);
        let now = jiff::Timestamp::now().as_second();
        let certs = issue(None, &Assessment::RenewCa("first".into()), &settings, now)
            .map_err(|e| failed("issuing the GitHub API stub's certificate", e.to_string()))?;
        let tls = axum_server::tls_rustls::RustlsConfig::from_config(
            certs
                .server_config()
                .map_err(|e| failed("the GitHub API stub's TLS", e.to_string()))?,
        );
        let seen = Arc::new(Mutex::new(Seen::default()));
        let app = App {
            app_id: app_id.to_owned(),
            installation_id: installation_id.to_owned(),
            public_key,
            token: token.to_owned(),
            seen: seen.clone(),
        };
        let router = axum::Router::new()
            .route("/app/installations/{id}/access_tokens", post(access_token))
            .with_state(app);
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .map_err(|e| HarnessError::io("binding the GitHub API stub", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError::io("the GitHub API stub's address", e))?
            .port();
        listener
            .set_nonblocking(true)
            .map_err(|e| HarnessError::io("the GitHub API stub's socket", e))?;
        let server = axum_server::from_tcp_rustls(listener, tls)
            .map_err(|e| HarnessError::io("the GitHub API stub", e))?;
        let task = tokio::spawn(async move {
            let _ = server.serve(router.into_make_service()).await;
        });
        Ok(Self {
            port,
            ca_pem: certs.ca_pem.clone(),
            seen,
            task,
        })
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    pub fn seen(&self) -> Seen {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Drop for GithubApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn access_token(
    State(app): State<App>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    let verdict = if id != app.installation_id {
        Err((StatusCode::NOT_FOUND, "Not Found".to_owned()))
    } else {
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        check_jwt(bearer, &app).map_err(|m| (StatusCode::UNAUTHORIZED, m))
    };
    let mut seen = app
        .seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match verdict {
        Ok(()) => {
            seen.issued += 1;
            let expires = jiff::Timestamp::now() + jiff::SignedDuration::from_hours(1);
            (
                StatusCode::CREATED,
                axum::Json(serde_json::json!({
                    "token": app.token,
                    "expires_at": expires.to_string(),
                    "permissions": {"contents": "read"},
                    "repository_selection": "all",
                })),
            )
        }
        Err((status, message)) => {
            seen.refused.push(message.clone());
            (
                status,
                axum::Json(serde_json::json!({
                    "message": message,
                    "documentation_url": "https://docs.github.com/rest",
                })),
            )
        }
    }
}

/// GitHub's checks of an App JWT.
fn check_jwt(jwt: &str, app: &App) -> Result<(), String> {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let bad = |m: &str| Err(m.to_owned());
    let parts: Vec<&str> = jwt.split('.').collect();
    let [header, claims, signature] = parts.as_slice() else {
        return bad("A JSON web token could not be decoded");
    };
    let decode = |p: &str| {
        b64.decode(p)
            .map_err(|_| "A JSON web token could not be decoded".to_owned())
    };
    let header: serde_json::Value =
        serde_json::from_slice(&decode(header)?).map_err(|_| "bad JWT header".to_owned())?;
    if header["alg"] != "RS256" {
        return bad("the JWT must be signed with RS256");
    }
    let key = ring::signature::UnparsedPublicKey::new(
        &ring::signature::RSA_PKCS1_2048_8192_SHA256,
        &app.public_key,
    );
    let signed = format!("{}.{}", parts[0], parts[1]);
    if key.verify(signed.as_bytes(), &decode(signature)?).is_err() {
        return bad("A JSON web token could not be decoded");
    }
    let claims: serde_json::Value =
        serde_json::from_slice(&decode(claims)?).map_err(|_| "bad JWT claims".to_owned())?;
    let iss = match &claims["iss"] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        _ => return bad("'Issuer' claim ('iss') must be an Integer"),
    };
    if iss != app.app_id {
        return bad("Integration not found");
    }
    let now = jiff::Timestamp::now().as_second();
    let (Some(iat), Some(exp)) = (claims["iat"].as_i64(), claims["exp"].as_i64()) else {
        return bad("'Issued at' claim ('iat') must be an Integer");
    };
    if iat > now {
        return bad("'Issued at' claim ('iat') must be an Integer representing a time in the past");
    }
    if exp <= now || exp > now + 600 {
        return bad("'Expiration time' claim ('exp') is too far in the future");
    }
    Ok(())
}
