//! The HTTP upstream: one reqwest client per catalogue upstream, reused across calls.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, header};
use tower_service::Service;

use super::UpstreamError;
use crate::BoxFuture;
use crate::catalogue::{Catalogue, UpstreamConfig, UpstreamKind};
use crate::router::RoutedCall;

/// `anthropic-version` sent when the client sent none.
pub const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Client headers passed on to the provider, per wire format. Everything else (and in
/// particular the client's own gateway key) stays at the gateway.
const OPENAI_PASSED_HEADERS: &[&str] =
    &["openai-organization", "openai-project", "idempotency-key"];
const ANTHROPIC_PASSED_HEADERS: &[&str] = &["anthropic-beta", "idempotency-key"];

/// Calls the providers named in the catalogue.
#[derive(Clone)]
pub struct HttpUpstream {
    channels: Arc<HashMap<String, Channel>>,
}

struct Channel {
    config: Arc<UpstreamConfig>,
    client: reqwest::Client,
    /// The provider key from the environment; `None` when the variable is unset, in which case
    /// calls fail (and are refunded) without contacting the provider.
    api_key: Option<HeaderValue>,
}

impl std::fmt::Debug for HttpUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<_> = self.channels.keys().collect();
        names.sort();
        f.debug_struct("HttpUpstream")
            .field("upstreams", &names)
            .finish()
    }
}

impl HttpUpstream {
    /// Builds a client for each upstream, reading each provider key from the environment
    /// variable the catalogue names.
    pub fn from_env(catalogue: &Catalogue) -> Result<HttpUpstream, reqwest::Error> {
        HttpUpstream::with_keys(catalogue, |variable| std::env::var(variable).ok())
    }

    /// Builds a client for each upstream, asking `key_for` for the value of each key variable.
    pub fn with_keys(
        catalogue: &Catalogue,
        key_for: impl Fn(&str) -> Option<String>,
    ) -> Result<HttpUpstream, reqwest::Error> {
        let mut channels = HashMap::new();
        for config in catalogue.upstreams() {
            let client = reqwest::Client::builder()
                .connect_timeout(CONNECT_TIMEOUT.min(config.timeout))
                .timeout(config.timeout)
                .build()?;
            let api_key = key_for(&config.api_key_env).and_then(|key| {
                let value = match config.kind {
                    UpstreamKind::Openai => format!("Bearer {key}"),
                    UpstreamKind::Anthropic => key,
                };
                let mut value = HeaderValue::try_from(value).ok()?;
                value.set_sensitive(true);
                Some(value)
            });
            if api_key.is_none() {
                tracing::warn!(
                    upstream = %config.name,
                    variable = %config.api_key_env,
                    "provider key not set; calls to this upstream will fail and be refunded"
                );
            }
            channels.insert(
                config.name.clone(),
                Channel {
                    config: config.clone(),
                    client,
                    api_key,
                },
            );
        }
        Ok(HttpUpstream {
            channels: Arc::new(channels),
        })
    }
}

impl Channel {
    fn url(&self) -> String {
        match self.config.kind {
            UpstreamKind::Openai => format!("{}/chat/completions", self.config.base_url),
            UpstreamKind::Anthropic => format!("{}/v1/messages", self.config.base_url),
        }
    }

    fn headers(&self, client_headers: &HeaderMap, api_key: HeaderValue) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let passed = match self.config.kind {
            UpstreamKind::Openai => {
                headers.insert(header::AUTHORIZATION, api_key);
                OPENAI_PASSED_HEADERS
            }
            UpstreamKind::Anthropic => {
                headers.insert(HeaderName::from_static("x-api-key"), api_key);
                let version = client_headers
                    .get("anthropic-version")
                    .cloned()
                    .unwrap_or(HeaderValue::from_static(DEFAULT_ANTHROPIC_VERSION));
                headers.insert(HeaderName::from_static("anthropic-version"), version);
                ANTHROPIC_PASSED_HEADERS
            }
        };
        for name in passed {
            for value in client_headers.get_all(*name) {
                headers.append(HeaderName::from_static(name), value.clone());
            }
        }
        headers
    }
}

impl Service<Request<Bytes>> for HttpUpstream {
    type Response = Response<Bytes>;
    type Error = UpstreamError;
    type Future = BoxFuture<Result<Response<Bytes>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let channels = self.channels.clone();
        Box::pin(async move {
            let routed = request
                .extensions()
                .get::<RoutedCall>()
                .ok_or_else(|| UpstreamError::transport("no RoutedCall extension"))?;
            let channel = channels.get(&routed.model.upstream.name).ok_or_else(|| {
                UpstreamError::transport(format!(
                    "upstream `{}` is not configured",
                    routed.model.upstream.name
                ))
            })?;
            let api_key = channel.api_key.clone().ok_or_else(|| {
                UpstreamError::transport(format!(
                    "provider key variable {} is not set",
                    channel.config.api_key_env
                ))
            })?;
            let reply = channel
                .client
                .post(channel.url())
                .headers(channel.headers(request.headers(), api_key))
                .body(routed.upstream_body(request.body()))
                .send()
                .await
                .map_err(|error| transport_error(&channel.config, error))?;
            let status = reply.status();
            let content_type = reply.headers().get(header::CONTENT_TYPE).cloned();
            let body = reply
                .bytes()
                .await
                .map_err(|error| transport_error(&channel.config, error))?;
            if !status.is_success() {
                return Err(UpstreamError::status(status.as_u16(), &body));
            }
            let mut response = Response::new(body);
            *response.status_mut() = status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                content_type.unwrap_or(HeaderValue::from_static("application/json")),
            );
            Ok(response)
        })
    }
}

/// A transport failure, described without the URL's query or any header (no credentials).
fn transport_error(config: &UpstreamConfig, error: reqwest::Error) -> UpstreamError {
    let what = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "connection failed"
    } else if error.is_body() || error.is_decode() {
        "reply body unreadable"
    } else {
        "request failed"
    };
    UpstreamError::transport(format!(
        "upstream `{}` {what}: {}",
        config.name,
        error.without_url()
    ))
}
