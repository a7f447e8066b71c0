//! Google Vertex AI: Anthropic's models at `…/publishers/anthropic/models/{model}:rawPredict`
//! and `:streamRawPredict`, Google's at `…/publishers/google/models/{model}:generateContent`
//! and `:streamGenerateContent`, with a service account's access token. The token is had by
//! the OAuth 2.0 JWT bearer grant: a JWT signed (RS256) with the account's private key,
//! exchanged at the account's token URI. One token serves every call of the channel until a
//! little before it expires (the renewal is fetched once, whoever asks first), or until
//! Google refuses it.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::HeaderValue;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde::{Deserialize, Serialize};

use crate::catalogue::{VertexPublisher, VertexSettings};
use crate::error::excerpt;
use crate::upstream::transport::transport_error;

/// What the token is asked to allow.
const SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";

/// How long a token is asked for (Google's longest).
const LIFETIME: Duration = Duration::from_secs(3600);

/// The longest the token exchange may take.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(30);

pub(in crate::upstream) struct Vertex {
    project: String,
    region: String,
    publisher: VertexPublisher,
    /// The service account, or why it could not be read (the channel then fails without
    /// being contacted).
    account: Result<ServiceAccount, String>,
    client: reqwest::Client,
    token: Mutex<Option<Token>>,
    /// Held while a token is fetched, so that it is fetched once.
    fetching: tokio::sync::Mutex<()>,
}

/// The fields of a service account key file the gateway uses.
#[derive(Deserialize)]
struct KeyFile {
    client_email: String,
    private_key: String,
    private_key_id: Option<String>,
    token_uri: Option<String>,
}

struct ServiceAccount {
    email: String,
    key: EncodingKey,
    key_id: Option<String>,
    token_uri: String,
    /// The private key as the file holds it, only to scrub it from what the platform echoes.
    pem: String,
}

struct Token {
    header: HeaderValue,
    text: String,
    renew_at: Instant,
}

impl Vertex {
    /// Reads the key file `settings` names, else the one `GOOGLE_APPLICATION_CREDENTIALS`
    /// names.
    pub(super) fn new(
        upstream: &str,
        settings: &VertexSettings,
        key_for: &(dyn Fn(&str) -> Option<String> + Send + Sync),
        client: reqwest::Client,
    ) -> Vertex {
        let account = read_account(settings, key_for);
        if let Err(why) = &account {
            tracing::warn!(
                upstream,
                "{why}; this upstream will fail without being contacted"
            );
        }
        Vertex {
            project: settings.project.clone(),
            region: settings.region.clone(),
            publisher: settings.publisher,
            account,
            client,
            token: Mutex::new(None),
            fetching: tokio::sync::Mutex::new(()),
        }
    }

    pub(super) fn same_credentials(&self, other: &Vertex) -> bool {
        match (&self.account, &other.account) {
            (Ok(one), Ok(other)) => {
                one.pem == other.pem && one.email == other.email && one.token_uri == other.token_uri
            }
            _ => false,
        }
    }

    pub(super) fn secrets(&self) -> Vec<String> {
        let mut secrets = Vec::new();
        if let Ok(account) = &self.account {
            // Line by line: however an echo spells the line breaks (a JSON string's `\n`, or
            // escaped again), no line of the key goes through.
            let lines = account.pem.lines().map(str::trim);
            secrets.extend(
                lines
                    .filter(|line| line.len() >= 16 && !line.starts_with("-----"))
                    .map(str::to_owned),
            );
        }
        if let Some(token) = self.held().as_ref() {
            secrets.push(token.text.clone());
        }
        secrets
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Option<Token>> {
        self.token
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn call_path(&self, model: &str, stream: bool) -> String {
        let (publisher, verb) = match (self.publisher, stream) {
            (VertexPublisher::Anthropic, false) => ("anthropic", "rawPredict"),
            (VertexPublisher::Anthropic, true) => ("anthropic", "streamRawPredict"),
            (VertexPublisher::Google, false) => ("google", "generateContent"),
            (VertexPublisher::Google, true) => ("google", "streamGenerateContent?alt=sse"),
        };
        format!(
            "/v1/projects/{}/locations/{}/publishers/{publisher}/models/{}:{verb}",
            super::path_segment(&self.project, b"@"),
            super::path_segment(&self.region, b"@"),
            super::path_segment(model, b"@")
        )
    }

    /// Adds the access token, fetching one first when none is held or it is due for renewal.
    pub(super) async fn authorize(&self, request: &mut reqwest::Request) -> Result<(), String> {
        let header = match self.current() {
            Some(header) => header,
            None => {
                let _fetching = self.fetching.lock().await;
                // Another call may have fetched it while this one waited.
                match self.current() {
                    Some(header) => header,
                    None => self.fetch().await?,
                }
            }
        };
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, header);
        Ok(())
    }

    /// The token held, unless it is due for renewal.
    fn current(&self) -> Option<HeaderValue> {
        let held = self.held();
        let token = held.as_ref()?;
        (Instant::now() < token.renew_at).then(|| token.header.clone())
    }

    /// Drops the token Google refused (`refused`, the header the call carried), so that the
    /// next call fetches another.
    pub(super) fn forget(&self, refused: Option<&HeaderValue>) {
        let mut held = self.held();
        if held
            .as_ref()
            .is_some_and(|token| refused.is_none_or(|refused| *refused == token.header))
        {
            *held = None;
        }
    }

    /// Exchanges a freshly signed JWT for an access token, and keeps it.
    async fn fetch(&self) -> Result<HeaderValue, String> {
        #[derive(Serialize)]
        struct Claims<'a> {
            iss: &'a str,
            scope: &'a str,
            aud: &'a str,
            iat: u64,
            exp: u64,
        }
        #[derive(Deserialize)]
        struct Answer {
            access_token: String,
            expires_in: Option<u64>,
        }
        let account = self.account.as_ref().map_err(Clone::clone)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let claims = Claims {
            iss: &account.email,
            scope: SCOPE,
            aud: &account.token_uri,
            iat: now,
            exp: now + LIFETIME.as_secs(),
        };
        let mut header = Header::new(Algorithm::RS256);
        header.kid.clone_from(&account.key_id);
        let assertion = jsonwebtoken::encode(&header, &claims, &account.key)
            .map_err(|error| format!("could not sign the Vertex token request: {error}"))?;
        let form = form_urlencoded::Serializer::new(String::new())
            .append_pair("grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer")
            .append_pair("assertion", &assertion)
            .finish();
        let asked = Instant::now();
        let failed = |why: String| format!("could not get a Vertex access token: {why}");
        let reply = self
            .client
            .post(&account.token_uri)
            .header(
                http::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(form)
            .timeout(TOKEN_TIMEOUT)
            .send()
            .await
            .map_err(|error| failed(transport_error(error)))?;
        let status = reply.status();
        let body = reply
            .bytes()
            .await
            .map_err(|error| failed(transport_error(error)))?;
        if !status.is_success() {
            return Err(failed(format!(
                "the token URI answered {status}: {}",
                excerpt(&body)
            )));
        }
        let answer: Answer = serde_json::from_slice(&body)
            .map_err(|_| failed("the token URI's answer holds no access token".to_owned()))?;
        let mut value = HeaderValue::try_from(format!("Bearer {}", answer.access_token))
            .map_err(|_| failed("the access token is not a header value".to_owned()))?;
        value.set_sensitive(true);
        let lifetime = Duration::from_secs(answer.expires_in.unwrap_or(LIFETIME.as_secs()));
        // Renewed five minutes early, or halfway through a shorter life.
        let early = Duration::from_secs(300).min(lifetime / 2);
        *self.held() = Some(Token {
            header: value.clone(),
            text: answer.access_token,
            renew_at: asked + lifetime - early,
        });
        Ok(value)
    }
}

/// The service account `settings` (or `GOOGLE_APPLICATION_CREDENTIALS`) names, read.
fn read_account(
    settings: &VertexSettings,
    key_for: &(dyn Fn(&str) -> Option<String> + Send + Sync),
) -> Result<ServiceAccount, String> {
    let path = settings
        .credentials_file
        .clone()
        .or_else(|| key_for("GOOGLE_APPLICATION_CREDENTIALS").filter(|path| !path.is_empty()))
        .ok_or_else(|| {
            "no Vertex service account: set `credentials_file` or GOOGLE_APPLICATION_CREDENTIALS"
                .to_owned()
        })?;
    let text = std::fs::read(&path)
        .map_err(|error| format!("cannot read the Vertex service account {path}: {error}"))?;
    let file: KeyFile = serde_json::from_slice(&text).map_err(|_| {
        format!("{path} is not a service account key file (client_email, private_key)")
    })?;
    let key = EncodingKey::from_rsa_pem(file.private_key.as_bytes())
        .map_err(|_| format!("the private key in {path} is not an RSA key in PEM"))?;
    Ok(ServiceAccount {
        email: file.client_email,
        key,
        key_id: file.private_key_id,
        token_uri: file
            .token_uri
            .unwrap_or_else(|| "https://oauth2.googleapis.com/token".to_owned()),
        pem: file.private_key,
    })
}
