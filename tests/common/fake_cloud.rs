//! Fake Amazon Bedrock and Google Vertex AI runtimes, checking what the real ones check.
//!
//! The fake Bedrock recomputes each request's AWS Signature Version 4 from the shared test
//! credentials, written here from AWS's description of the scheme (independently of the
//! gateway, which signs with the AWS SDK's `aws-sigv4`), and refuses a bad one with 403 as AWS
//! does; it streams replies as AWS's event-stream frames, their CRCs written here with
//! `crc32fast`. The fake Vertex issues short-lived access tokens at its token URI for a JWT
//! whose RS256 signature verifies with the test service account's public key, and refuses a
//! call whose token it did not issue or that has expired (401 `UNAUTHENTICATED`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use hmac::{KeyInit, Mac};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The test AWS credentials the gateway signs with and the fake checks against.
pub const AWS_ACCESS_KEY_ID: &str = "AKIAFAKEGATEWAYTEST1";
pub const AWS_SECRET_ACCESS_KEY: &str = "fAkE/sEcReT+kEy/oNlY/fOr/tEsTs/0123456789";
pub const AWS_SESSION_TOKEN: &str = "FwoGZXIvYXdzEFAKEsessionTOKENforTESTSonly";
/// The Bedrock API key the fake takes as `Authorization: Bearer`.
pub const BEDROCK_API_KEY: &str = "ABSKfakeBedrockApiKeyForTestsOnly0123456789";
pub const REGION: &str = "us-east-1";

/// The provider keys of a gateway in front of the fakes: the AWS variables, and
/// `sk-provider` for every other.
pub fn cloud_keys(variable: &str) -> Option<String> {
    Some(
        match variable {
            "AWS_ACCESS_KEY_ID" => AWS_ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY" => AWS_SECRET_ACCESS_KEY,
            "AWS_SESSION_TOKEN" => AWS_SESSION_TOKEN,
            "AWS_BEARER_TOKEN_BEDROCK" | "GOOGLE_APPLICATION_CREDENTIALS" => return None,
            _ => "sk-provider",
        }
        .to_owned(),
    )
}

/// What a fake answers one call with.
#[derive(Debug, Clone)]
pub enum CloudReply {
    /// A complete reply: this JSON, status 200.
    Json(Value),
    /// A stream of these provider events (Anthropic's, or Gemini's chunks), then its end.
    Events(Vec<Value>, Ending),
    /// An error: status, headers, body.
    Error(u16, Vec<(&'static str, &'static str)>, Value),
    /// Bedrock only: an exception frame (`:exception-type`, message) after these events.
    Exception(Vec<Value>, &'static str, &'static str),
}

/// How a streamed reply ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Finish,
    /// The connection is cut after the events.
    Cut,
}

/// One call as the fake received it, once its credentials were checked.
#[derive(Debug, Clone)]
pub struct CloudCall {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

#[derive(Default)]
struct Script {
    replies: Mutex<VecDeque<CloudReply>>,
    fallback: Mutex<Option<CloudReply>>,
    calls: Mutex<Vec<CloudCall>>,
    /// Calls refused for their credentials.
    refused: AtomicUsize,
}

impl Script {
    fn next(&self) -> CloudReply {
        let scripted = self.replies.lock().unwrap().pop_front();
        scripted
            .or_else(|| self.fallback.lock().unwrap().clone())
            .unwrap_or_else(|| CloudReply::Json(anthropic_message("Hello from the cloud.", 10, 5)))
    }
}

/// An Anthropic message with this text and usage.
pub fn anthropic_message(text: &str, input: u64, output: u64) -> Value {
    json!({
        "id": "msg_cloud", "type": "message", "role": "assistant", "model": "claude-cloud",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": input, "output_tokens": output},
    })
}

/// Anthropic's stream of one text reply, in two deltas, with this usage.
pub fn anthropic_events(input: u64, output: u64) -> Vec<Value> {
    vec![
        json!({"type": "message_start", "message": {"id": "msg_cloud", "type": "message",
            "role": "assistant", "model": "claude-cloud", "content": [], "stop_reason": null,
            "usage": {"input_tokens": input, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "Hello from "}}),
        json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "the cloud."}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": output}}),
        json!({"type": "message_stop"}),
    ]
}

macro_rules! scripted {
    ($fake:ty) => {
        impl $fake {
            /// Answers the next call not yet scripted with `reply`.
            pub fn then(&self, reply: CloudReply) -> &Self {
                self.script.replies.lock().unwrap().push_back(reply);
                self
            }

            /// Answers with `reply` whenever nothing is scripted.
            pub fn always(&self, reply: CloudReply) -> &Self {
                *self.script.fallback.lock().unwrap() = Some(reply);
                self
            }

            /// The calls whose credentials were good, in order.
            pub fn calls(&self) -> Vec<CloudCall> {
                self.script.calls.lock().unwrap().clone()
            }

            /// The calls refused for their credentials.
            pub fn refused(&self) -> usize {
                self.script.refused.load(Ordering::SeqCst)
            }
        }
    };
}

async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

fn json_response(status: u16, body: &Value) -> Response {
    (
        StatusCode::from_u16(status).unwrap(),
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// An error with these headers.
fn error_response(
    status: u16,
    headers: Vec<(&'static str, &'static str)>,
    body: &Value,
) -> Response {
    let mut response = json_response(status, body);
    for (name, value) in headers {
        response.headers_mut().insert(name, value.parse().unwrap());
    }
    response
}

/// A streamed response of `chunks`, cut (the connection dropped mid-body) when `ending` says.
fn streamed(content_type: &'static str, chunks: Vec<Vec<u8>>, ending: Ending) -> Response {
    use futures::StreamExt as _;
    let items: Vec<Result<Bytes, std::io::Error>> = chunks
        .into_iter()
        .map(|chunk| Ok(Bytes::from(chunk)))
        .collect();
    // The events go out before the connection is dropped.
    let cut = futures::stream::once(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Err(std::io::Error::other("cut"))
    })
    .filter(move |_| std::future::ready(ending == Ending::Cut));
    let body = Body::from_stream(futures::stream::iter(items).chain(cut));
    ([("content-type", content_type)], body).into_response()
}

// --- Bedrock --------------------------------------------------------------------------------

/// A running fake Bedrock runtime.
#[derive(Clone)]
pub struct FakeBedrock {
    /// `http://127.0.0.1:PORT`, the upstream's `base_url`.
    pub base: String,
    script: Arc<Script>,
}

scripted!(FakeBedrock);

impl FakeBedrock {
    pub async fn start() -> FakeBedrock {
        let script = Arc::new(Script::default());
        let router = axum::Router::new()
            .fallback(bedrock_call)
            .with_state(script.clone());
        FakeBedrock {
            base: serve(router).await,
            script,
        }
    }
}

async fn bedrock_call(
    State(script): State<Arc<Script>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let stream = path.ends_with("/invoke-with-response-stream");
    if method != Method::POST
        || !path.starts_with("/model/")
        || !(stream || path.ends_with("/invoke"))
    {
        return json_response(404, &json!({"message": "Unknown operation"}));
    }
    if let Err(why) = bedrock_credentials(&method, &uri, &headers, &body) {
        script.refused.fetch_add(1, Ordering::SeqCst);
        return json_response(403, &json!({ "message": why }));
    }
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return json_response(400, &json!({"message": "Malformed input request"}));
    };
    // What Bedrock refuses of a body meant for Anthropic's own API.
    for extraneous in ["model", "stream"] {
        if request.get(extraneous).is_some() {
            let message =
                format!("Malformed input request: extraneous key [{extraneous}] is not permitted");
            return json_response(400, &json!({ "message": message }));
        }
    }
    if request["anthropic_version"] != "bedrock-2023-05-31" {
        return json_response(
            400,
            &json!({"message": "anthropic_version is missing or wrong"}),
        );
    }
    script.calls.lock().unwrap().push(CloudCall {
        path,
        headers: headers.clone(),
        body: request,
    });
    match (script.next(), stream) {
        (CloudReply::Error(status, extra, body), _) => error_response(status, extra, &body),
        (CloudReply::Json(reply), false) => json_response(200, &reply),
        (CloudReply::Events(events, ending), true) => {
            let frames = events.iter().map(chunk_frame).collect();
            streamed("application/vnd.amazon.eventstream", frames, ending)
        }
        (CloudReply::Exception(events, kind, message), true) => {
            let mut frames: Vec<Vec<u8>> = events.iter().map(chunk_frame).collect();
            frames.push(frame(
                &[
                    (":message-type", "exception"),
                    (":exception-type", kind),
                    (":content-type", "application/json"),
                ],
                json!({ "message": message }).to_string().as_bytes(),
            ));
            streamed("application/vnd.amazon.eventstream", frames, Ending::Finish)
        }
        (reply, stream) => {
            panic!("the fake Bedrock was scripted {reply:?} for a call streamed: {stream}")
        }
    }
}

/// Checks a Bedrock API key, or recomputes the request's Signature Version 4 and compares.
fn bedrock_credentials(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(), String> {
    let text = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    let authorization = text("authorization").ok_or("Missing Authentication Token")?;
    if let Some(key) = authorization.strip_prefix("Bearer ") {
        return (key == BEDROCK_API_KEY)
            .then_some(())
            .ok_or_else(|| "Invalid API Key format".to_owned());
    }
    let fields = authorization
        .strip_prefix("AWS4-HMAC-SHA256 ")
        .ok_or("Authorization header requires AWS4-HMAC-SHA256")?;
    let field = |name: &str| {
        fields
            .split(", ")
            .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
            .ok_or(format!("Authorization header requires '{name}'"))
    };
    let (credential, signed_headers, signature) = (
        field("Credential")?,
        field("SignedHeaders")?,
        field("Signature")?,
    );
    let scope: Vec<&str> = credential.split('/').collect();
    let [key_id, date, region, service, "aws4_request"] = scope[..] else {
        return Err(format!(
            "Credential should be scoped correctly: {credential}"
        ));
    };
    if key_id != AWS_ACCESS_KEY_ID {
        return Err("The security token included in the request is invalid.".into());
    }
    if (region, service) != (REGION, "bedrock") {
        return Err(format!(
            "Credential should be scoped to a valid region and service: {region}/{service}"
        ));
    }
    if text("x-amz-security-token") != Some(AWS_SESSION_TOKEN) {
        return Err("The security token included in the request is invalid.".into());
    }
    let amz_date = text("x-amz-date").ok_or("Missing x-amz-date")?;
    let signed_at = chrono::NaiveDateTime::parse_from_str(amz_date, "%Y%m%dT%H%M%SZ")
        .map_err(|_| "x-amz-date is not a date".to_owned())?
        .and_utc();
    if (chrono::Utc::now() - signed_at).num_seconds().abs() > 300 || !amz_date.starts_with(date) {
        return Err("Signature expired".into());
    }
    // The canonical request: each path segment URI-encoded once more (every AWS service but
    // S3), the query sorted, the signed headers lower-cased with trimmed values, the payload's
    // hash.
    let canonical_path: Vec<String> = uri.path().split('/').map(uri_encode).collect();
    let mut query: Vec<(String, String)> = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (key.to_owned(), value.to_owned())
        })
        .collect();
    query.sort();
    let query: Vec<String> = query.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut canonical_headers = String::new();
    for name in signed_headers.split(';') {
        let values: Vec<String> = headers
            .get_all(name)
            .iter()
            .map(|value| {
                let value = value.to_str().unwrap_or_default();
                value.split_whitespace().collect::<Vec<_>>().join(" ")
            })
            .collect();
        if values.is_empty() {
            return Err(format!("signed header {name} is missing"));
        }
        canonical_headers.push_str(&format!("{name}:{}\n", values.join(",")));
    }
    let canonical = format!(
        "{method}\n{}\n{}\n{canonical_headers}\n{signed_headers}\n{}",
        canonical_path.join("/"),
        query.join("&"),
        hex::encode(Sha256::digest(body)),
    );
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{date}/{region}/{service}/aws4_request\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let mut key = hmac_sha256(
        format!("AWS4{AWS_SECRET_ACCESS_KEY}").as_bytes(),
        date.as_bytes(),
    );
    for part in [region, service, "aws4_request"] {
        key = hmac_sha256(&key, part.as_bytes());
    }
    let expected = hex::encode(hmac_sha256(&key, string_to_sign.as_bytes()));
    if expected != signature {
        return Err("The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method.".into());
    }
    Ok(())
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(key).unwrap();
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

/// AWS's URI encoding: every byte but the unreserved characters as `%XX`.
fn uri_encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

/// One `chunk` event frame carrying `event` as Bedrock does: base64 in `{"bytes": ...}`.
pub fn chunk_frame(event: &Value) -> Vec<u8> {
    let bytes = base64::engine::general_purpose::STANDARD.encode(event.to_string());
    frame(
        &[
            (":event-type", "chunk"),
            (":content-type", "application/json"),
            (":message-type", "event"),
        ],
        json!({ "bytes": bytes, "p": "abcdefghij" })
            .to_string()
            .as_bytes(),
    )
}

/// One event-stream frame: total and header lengths, the prelude's CRC-32, string headers,
/// the payload, and the CRC-32 of everything before it.
pub fn frame(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut encoded = Vec::new();
    for (name, value) in headers {
        encoded.push(name.len() as u8);
        encoded.extend_from_slice(name.as_bytes());
        encoded.push(7);
        encoded.extend_from_slice(&(value.len() as u16).to_be_bytes());
        encoded.extend_from_slice(value.as_bytes());
    }
    let total = 12 + encoded.len() + payload.len() + 4;
    let mut frame = Vec::with_capacity(total);
    frame.extend_from_slice(&(total as u32).to_be_bytes());
    frame.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    frame.extend_from_slice(&crc32fast::hash(&frame).to_be_bytes());
    frame.extend_from_slice(&encoded);
    frame.extend_from_slice(payload);
    frame.extend_from_slice(&crc32fast::hash(&frame).to_be_bytes());
    frame
}

// --- Vertex AI ------------------------------------------------------------------------------

/// The test service account's private key (PKCS #8 PEM), and its public half.
pub const VERTEX_PRIVATE_KEY: &str = include_str!("../fixtures/vertex-test-key.pem");
pub const VERTEX_PUBLIC_KEY: &str = include_str!("../fixtures/vertex-test-key.pub.pem");
pub const VERTEX_ACCOUNT: &str = "gateway-test@fake-project.iam.gserviceaccount.com";
pub const VERTEX_PROJECT: &str = "fake-project";
pub const VERTEX_REGION: &str = "us-east5";

/// A running fake Vertex AI, with its token URI at `{base}/token`.
#[derive(Clone)]
pub struct FakeVertex {
    pub base: String,
    script: Arc<Script>,
    tokens: Arc<Tokens>,
}

scripted!(FakeVertex);

#[derive(Default)]
struct Tokens {
    /// Each token issued, and until when it is good.
    issued: Mutex<Vec<(String, Instant)>>,
    /// How long a token lives, as issued.
    lifetime: Mutex<Duration>,
    /// Token requests refused (a bad JWT).
    refused: AtomicUsize,
}

impl FakeVertex {
    /// Issues tokens that live `lifetime` (as `expires_in`, in whole seconds).
    pub async fn start(lifetime: Duration) -> FakeVertex {
        let script = Arc::new(Script::default());
        let tokens = Arc::new(Tokens::default());
        *tokens.lifetime.lock().unwrap() = lifetime;
        let router = axum::Router::new()
            .route("/token", axum::routing::post(vertex_token))
            .with_state(tokens.clone())
            .fallback(vertex_call)
            .with_state((script.clone(), tokens.clone()));
        FakeVertex {
            base: serve(router).await,
            script,
            tokens,
        }
    }

    /// The tokens issued so far.
    pub fn tokens_issued(&self) -> Vec<String> {
        let issued = self.tokens.issued.lock().unwrap();
        issued.iter().map(|(token, _)| token.clone()).collect()
    }

    /// Token requests refused for a JWT that does not verify.
    pub fn token_requests_refused(&self) -> usize {
        self.tokens.refused.load(Ordering::SeqCst)
    }

    /// Every token issued so far stops being good now (as a revoked or expired one).
    pub fn expire_tokens(&self) {
        for (_, until) in self.tokens.issued.lock().unwrap().iter_mut() {
            *until = Instant::now();
        }
    }

    /// A service account key file whose token URI is this fake's, written to `dir`.
    pub fn key_file(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("service-account.json");
        let file = json!({
            "type": "service_account",
            "project_id": VERTEX_PROJECT,
            "private_key_id": "0123456789abcdef",
            "private_key": VERTEX_PRIVATE_KEY,
            "client_email": VERTEX_ACCOUNT,
            "client_id": "1",
            "token_uri": format!("{}/token", self.base),
        });
        std::fs::write(&path, file.to_string()).unwrap();
        path
    }
}

/// The JWT bearer grant: the assertion must be signed with the service account's key, for this
/// token URI, unexpired.
async fn vertex_token(State(tokens): State<Arc<Tokens>>, body: String) -> Response {
    #[derive(serde::Deserialize)]
    struct Claims {
        scope: String,
    }
    let form: std::collections::HashMap<String, String> = form_urlencoded::parse(body.as_bytes())
        .into_owned()
        .collect();
    let refuse = |why: &str| {
        tokens.refused.fetch_add(1, Ordering::SeqCst);
        json_response(
            400,
            &json!({"error": "invalid_grant", "error_description": why}),
        )
    };
    if form.get("grant_type").map(String::as_str)
        != Some("urn:ietf:params:oauth:grant-type:jwt-bearer")
    {
        return refuse("grant_type");
    }
    let Some(assertion) = form.get("assertion") else {
        return refuse("no assertion");
    };
    let key = jsonwebtoken::DecodingKey::from_rsa_pem(VERTEX_PUBLIC_KEY.as_bytes()).unwrap();
    let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::RS256);
    validation.set_issuer(&[VERTEX_ACCOUNT]);
    // The audience is this token URI, whatever port the fake has: checked below by path.
    validation.validate_aud = false;
    validation.set_required_spec_claims(&["exp", "iat", "iss", "aud"]);
    let claims = match jsonwebtoken::decode::<Value>(assertion, &key, &validation) {
        Ok(token) => token.claims,
        Err(error) => return refuse(&format!("Invalid JWT Signature: {error}")),
    };
    if !claims["aud"]
        .as_str()
        .is_some_and(|aud| aud.ends_with("/token"))
    {
        return refuse("aud");
    }
    match serde_json::from_value::<Claims>(claims) {
        Ok(claims) if claims.scope.contains("cloud-platform") => {}
        _ => return refuse("scope"),
    }
    let lifetime = *tokens.lifetime.lock().unwrap();
    let mut issued = tokens.issued.lock().unwrap();
    let token = format!(
        "ya29.fake-token-{}-{}",
        issued.len(),
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    issued.push((token.clone(), Instant::now() + lifetime));
    json_response(
        200,
        &json!({"access_token": token, "expires_in": lifetime.as_secs(), "token_type": "Bearer"}),
    )
}

async fn vertex_call(
    State((script, tokens)): State<(Arc<Script>, Arc<Tokens>)>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let unauthenticated = || {
        script.refused.fetch_add(1, Ordering::SeqCst);
        json_response(
            401,
            &json!({"error": {"code": 401,
            "message": "Request had invalid authentication credentials. Expected OAuth 2 access token.",
            "status": "UNAUTHENTICATED"}}),
        )
    };
    let token = headers
        .get("authorization")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    let good = token.is_some_and(|token| {
        let issued = tokens.issued.lock().unwrap();
        issued
            .iter()
            .any(|(issued, until)| issued == token && Instant::now() < *until)
    });
    if !good {
        return unauthenticated();
    }
    let path = uri.path().to_owned();
    let prefix = format!("/v1/projects/{VERTEX_PROJECT}/locations/{VERTEX_REGION}/publishers/");
    let Some(rest) = path.strip_prefix(&prefix) else {
        return json_response(
            404,
            &json!({"error": {"code": 404, "message": "not found", "status": "NOT_FOUND"}}),
        );
    };
    let Some((publisher, verb)) = rest
        .split_once("/models/")
        .and_then(|(publisher, model)| Some((publisher, model.rsplit_once(':')?.1)))
    else {
        return json_response(
            404,
            &json!({"error": {"code": 404, "message": "not found", "status": "NOT_FOUND"}}),
        );
    };
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return json_response(
            400,
            &json!({"error": {"code": 400, "message": "bad JSON", "status": "INVALID_ARGUMENT"}}),
        );
    };
    let stream = match (publisher, verb) {
        ("anthropic", "rawPredict") => false,
        ("anthropic", "streamRawPredict") => true,
        ("google", "generateContent") => false,
        ("google", "streamGenerateContent") if uri.query() == Some("alt=sse") => true,
        _ => {
            return json_response(
                404,
                &json!({"error": {"code": 404, "message": "no such method", "status": "NOT_FOUND"}}),
            );
        }
    };
    if publisher == "anthropic"
        && (request.get("model").is_some() || request["anthropic_version"] != "vertex-2023-10-16")
    {
        let message = "anthropic_version must be vertex-2023-10-16 and the model named in the path";
        return json_response(
            400,
            &json!({"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}),
        );
    }
    let publisher = publisher.to_owned();
    script.calls.lock().unwrap().push(CloudCall {
        path,
        headers: headers.clone(),
        body: request,
    });
    match (script.next(), stream) {
        (CloudReply::Error(status, extra, body), _) => error_response(status, extra, &body),
        (CloudReply::Json(reply), false) => json_response(200, &reply),
        (CloudReply::Events(events, ending), true) => {
            let chunks = events
                .iter()
                .map(|event| match event["type"].as_str() {
                    Some(kind) if publisher == "anthropic" => {
                        format!("event: {kind}\ndata: {event}\n\n").into_bytes()
                    }
                    _ => format!("data: {event}\r\n\r\n").into_bytes(),
                })
                .collect();
            streamed("text/event-stream", chunks, ending)
        }
        (reply, stream) => {
            panic!("the fake Vertex was scripted {reply:?} for a call streamed: {stream}")
        }
    }
}
