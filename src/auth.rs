//! [`ApiKeyAuth`]: who is calling.
//!
//! Takes the key from `Authorization: Bearer KEY`, `x-api-key: KEY` or `x-goog-api-key: KEY`
//! (and, on the Gemini API's paths, from `?key=KEY`), looks up its SHA-256
//! through a [`KeyStore`], and adds the [`Caller`](crate::store::Caller) and [`KeyRules`](crate::call::KeyRules)
//! request extensions. A missing, unknown, revoked or expired key is answered
//! `401 {"detail":"无效的 API Key"}` and goes no further.
//!
//! ```
//! use std::{convert::Infallible, sync::Arc};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use model_gateway::{Accounts, ApiKeyAuthLayer, store::Caller, MemoryStore, keys::NewApiKey};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = Arc::new(MemoryStore::new());
//! let account = store.create_account("demo").await.unwrap();
//! let key = NewApiKey::generate();
//! store.add_key(account, &key).await.unwrap();
//!
//! let service = ServiceBuilder::new()
//!     .layer(ApiKeyAuthLayer::new(store))
//!     .service(service_fn(|request: Request<Full<Bytes>>| async move {
//!         let caller = request.extensions().get::<Caller>().unwrap();
//!         Ok::<_, Infallible>(Response::new(Full::<Bytes>::from(format!("account {}", caller.account.0))))
//!     }));
//!
//! let request = Request::post("/v1/messages")
//!     .header("x-api-key", key.reveal())
//!     .body(Full::default())
//!     .unwrap();
//! assert_eq!(service.clone().oneshot(request).await.unwrap().status(), StatusCode::OK);
//!
//! let request = Request::post("/v1/messages")
//!     .header("authorization", "Bearer sk-mg-not-a-key")
//!     .body(Full::default())
//!     .unwrap();
//! assert_eq!(service.oneshot(request).await.unwrap().status(), StatusCode::UNAUTHORIZED);
//! # }
//! ```

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, header};
use tower_layer::Layer;
use tower_service::Service;

use crate::call::AccessEntry;
use crate::error::GatewayError;
use crate::keys::KeyHash;
use crate::store::{DEFAULT_LEDGER_TIMEOUT, KeyStore};

/// Configuration of [`ApiKeyAuth`]: the key store to ask, and how long to wait for it.
#[derive(Debug, Clone)]
#[must_use]
pub struct ApiKeyAuthLayer {
    keys: Arc<dyn KeyStore>,
    timeout: Duration,
}

impl ApiKeyAuthLayer {
    /// Authenticates against `keys`.
    pub fn new(keys: Arc<dyn KeyStore>) -> ApiKeyAuthLayer {
        ApiKeyAuthLayer {
            keys,
            timeout: DEFAULT_LEDGER_TIMEOUT,
        }
    }

    /// How long a key's lookup may take before the client is answered `503` (default
    /// [`DEFAULT_LEDGER_TIMEOUT`]).
    pub fn lookup_timeout(mut self, timeout: Duration) -> ApiKeyAuthLayer {
        self.timeout = timeout;
        self
    }
}

impl<S> Layer<S> for ApiKeyAuthLayer {
    type Service = ApiKeyAuth<S>;

    fn layer(&self, inner: S) -> ApiKeyAuth<S> {
        ApiKeyAuth {
            inner,
            keys: self.keys.clone(),
            timeout: self.timeout,
        }
    }
}

/// Middleware that authenticates the caller and adds the [`Caller`](crate::store::Caller) extension.
#[derive(Debug, Clone)]
pub struct ApiKeyAuth<S> {
    inner: S,
    keys: Arc<dyn KeyStore>,
    timeout: Duration,
}

crate::macros::inner_service_accessors!(ApiKeyAuth, S, inner);

impl<S> ApiKeyAuth<S> {
    /// Authenticates callers of `inner` against `keys`.
    pub fn new(inner: S, keys: Arc<dyn KeyStore>) -> ApiKeyAuth<S> {
        ApiKeyAuthLayer::new(keys).layer(inner)
    }

    /// A [`ApiKeyAuthLayer`] asking `keys`.
    pub fn layer(keys: Arc<dyn KeyStore>) -> ApiKeyAuthLayer {
        ApiKeyAuthLayer::new(keys)
    }
}

/// The key a client presented: `Authorization: Bearer KEY`, else `x-api-key: KEY`, else
/// `x-goog-api-key: KEY` (Google's clients).
pub fn presented_key(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| {
            let (scheme, key) = value.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(key.trim())
        });
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    bearer
        .or_else(|| header("x-api-key"))
        .or_else(|| header("x-goog-api-key"))
        .map(str::trim)
        .filter(|key| !key.is_empty())
}

/// The key of a `request`: [`presented_key`], else, on the Gemini API's paths, its `key` query
/// parameter (percent-decoded), as Google's clients may send it: only there, so that no other
/// endpoint invites a key into URLs (and the logs of whatever proxies them). The gateway's own
/// logs write the path alone.
pub fn request_key<B>(request: &Request<B>) -> Option<std::borrow::Cow<'_, str>> {
    if let Some(key) = presented_key(request.headers()) {
        return Some(key.into());
    }
    let uri = request.uri();
    if !crate::protocol::gemini::is_gemini_path(uri.path()) {
        return None;
    }
    form_urlencoded::parse(uri.query()?.as_bytes())
        .find(|(name, _)| name == "key")
        .map(|(_, key)| key)
        .filter(|key| !key.trim().is_empty())
}

crate::macros::response_future! {
    /// The future [`ApiKeyAuth`] answers with.
    ResponseFuture
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for ApiKeyAuth<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let presented = request_key(&request).map(|key| KeyHash::of(key.trim()));
        let keys = self.keys.clone();
        let timeout = self.timeout;
        let mut inner = crate::macros::take_ready(&mut self.inner);
        ResponseFuture::new(async move {
            let Some(hash) = presented else {
                return Ok(GatewayError::InvalidApiKey.into_response());
            };
            let Ok(looked_up) = crate::time_limit::within(timeout, keys.active_key(&hash)).await
            else {
                tracing::error!(?timeout, "the key store did not answer in time");
                return Ok(GatewayError::StoreUnavailable.into_response());
            };
            match looked_up {
                Ok(Some(active)) if !active.rules.expired_now() => {
                    if let Some(access) = request.extensions().get::<AccessEntry>()
                        && let Some(key) = request_key(&request)
                    {
                        access.key(key.trim());
                    }
                    request.extensions_mut().insert(active.caller);
                    request.extensions_mut().insert(active.rules);
                    inner.call(request).await
                }
                Ok(_) => Ok(GatewayError::InvalidApiKey.into_response()),
                Err(error) => {
                    tracing::error!(%error, "key lookup failed");
                    Ok(GatewayError::StoreUnavailable.into_response())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    http::HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                )
            })
            .collect()
    }

    #[test]
    fn bearer_and_x_api_key_are_both_accepted() {
        assert_eq!(
            presented_key(&headers(&[("authorization", "Bearer k1")])),
            Some("k1")
        );
        assert_eq!(presented_key(&headers(&[("x-api-key", "k2")])), Some("k2"));
        assert_eq!(
            presented_key(&headers(&[("authorization", "bearer  k3 ")])),
            Some("k3")
        );
    }

    #[test]
    fn a_non_bearer_authorization_falls_back_to_x_api_key() {
        let both = headers(&[("authorization", "Basic abc"), ("x-api-key", "k")]);
        assert_eq!(presented_key(&both), Some("k"));
        assert_eq!(
            presented_key(&headers(&[("authorization", "Basic abc")])),
            None
        );
    }

    #[test]
    fn an_empty_key_is_no_key() {
        assert_eq!(presented_key(&headers(&[("x-api-key", "")])), None);
        assert_eq!(
            presented_key(&headers(&[("authorization", "Bearer ")])),
            None
        );
    }
}
