//! [`Gateway`]: the whole HTTP surface of a gateway as one axum [`Router`], for a server to
//! serve: the call endpoints (chat completions, responses, embeddings, messages, the Gemini
//! API's `:generateContent` and `:streamGenerateContent`) through the
//! [`stack`](crate::stack), the key holders'
//! endpoints and probes ([`key_holder`](crate::key_holder)), and a JSON 404 for the rest, every
//! answer with an `x-request-id` (and `request-id`), every request with one access-log line
//! ([`access_log`](crate::access_log)), refusals with the body the operator chose
//! ([`error_body`](Gateway::error_body)). With the `api` feature, also the admin API when an
//! admin token is set (`admin::router`) and the web console (`console`).
//!
//! ```
//! use std::sync::Arc;
//! use model_gateway::{Catalogue, Gateway, MemoryStore, upstream::MockUpstream, Upstream};
//!
//! let store = Arc::new(MemoryStore::new());
//! let router: axum::Router = Gateway::new(store, Arc::new(Catalogue::demo()), Upstream::Mock(MockUpstream::new()))
//!     .body_limits(1 << 20)
//!     .router();
//! ```

use std::sync::Arc;

use axum::Router;
use axum::body::Body;

use crate::access_log::AccessLogLayer;
#[cfg(feature = "api")]
use crate::admin::{self, Admin, AdminToken};
use crate::catalogue::LiveCatalogue;
use crate::error::{ErrorBody, GatewayError};
use crate::error_body::ErrorBodyLayer;
use crate::protocol::gemini::{
    self,
    framing::{JsonArrayFraming, asks_server_sent_events},
};
use crate::rate_limit::RateLimiter;
use crate::reload::CatalogueReloader;
use crate::request_id::RequestIdLayer;
use crate::router::BodyLimits;
use crate::store::Store;
use crate::upstream::Upstream;

#[cfg(feature = "api")]
type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A gateway's configuration, turned into its router by [`Gateway::router`].
#[must_use]
pub struct Gateway<S> {
    store: Arc<S>,
    catalogue: LiveCatalogue,
    reloader: Option<CatalogueReloader>,
    upstream: Upstream,
    body: BodyLimits,
    limiter: RateLimiter,
    #[cfg(feature = "api")]
    admin_token: Option<AdminToken>,
    #[cfg(feature = "api")]
    metrics: Option<Render>,
}

impl<S> std::fmt::Debug for Gateway<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("body", &self.body)
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

impl<S: Store + 'static> Gateway<S> {
    /// A gateway on `store`, selling `catalogue`'s models (a [`Catalogue`](crate::Catalogue),
    /// or a [`LiveCatalogue`] that reloads) from `upstream`; default body limits, rate limits
    /// counted in this process, no admin API.
    pub fn new(
        store: Arc<S>,
        catalogue: impl Into<LiveCatalogue>,
        upstream: Upstream,
    ) -> Gateway<S> {
        // The responses native upstreams keep are recorded in the store, so that only the
        // account that made one reaches it again.
        let upstream = upstream
            .remembering_responses(store.clone())
            .reporting_breakers(store.clone());
        Gateway {
            store,
            catalogue: catalogue.into(),
            reloader: None,
            upstream,
            body: BodyLimits::default(),
            limiter: RateLimiter::local(),
            #[cfg(feature = "api")]
            admin_token: None,
            #[cfg(feature = "api")]
            metrics: None,
        }
    }

    /// How request bodies are read ([`BodyLimits`]; a number is the largest body).
    pub fn body_limits(mut self, body: impl Into<BodyLimits>) -> Gateway<S> {
        self.body = body.into();
        self
    }

    /// Which body refusals have: [`ErrorBody::Detail`] (exactly `{"detail": ...}`, the
    /// default) or [`ErrorBody::Compatible`] (the client protocol's error object beside
    /// `detail`). Overrides the catalogue's `error_body`.
    pub fn error_body(mut self, body: ErrorBody) -> Gateway<S> {
        let catalogue = (*self.catalogue.current()).clone().with_error_body(body);
        self.catalogue = LiveCatalogue::from(catalogue);
        self
    }

    /// Lets the operator reload the catalogue (`POST /admin/catalogue/reload`, with the admin
    /// API): `reloader` must reload this gateway's catalogue (give [`Gateway::new`] its
    /// [`live`](CatalogueReloader::live) catalogue) and upstream.
    pub fn catalogue_reloader(mut self, reloader: CatalogueReloader) -> Gateway<S> {
        self.reloader = Some(reloader);
        self
    }

    /// Where keys' requests per minute are counted (e.g. [`RateLimiter::redis`] to share them
    /// between instances).
    pub fn rate_limiter(mut self, limiter: RateLimiter) -> Gateway<S> {
        self.limiter = limiter;
        self
    }

    /// Serves the admin API under `/admin` for this token's holder; `None`: `/admin` does not
    /// exist (404).
    #[cfg(feature = "api")]
    pub fn admin_token(mut self, token: Option<AdminToken>) -> Gateway<S> {
        self.admin_token = token;
        self
    }

    /// Serves `GET /metrics` (what `render` returns, e.g. a Prometheus handle's text) behind
    /// the admin token; without an admin token this has no effect.
    #[cfg(feature = "api")]
    pub fn metrics(mut self, render: impl Fn() -> String + Send + Sync + 'static) -> Gateway<S> {
        self.metrics = Some(Arc::new(render));
        self
    }

    /// The router; see the module docs.
    pub fn router(self) -> Router {
        let error_body = self.catalogue.current().error_body();
        let stack = crate::stack_with_limiter(
            self.store.clone(),
            self.catalogue.clone(),
            self.body.clone(),
            self.upstream.clone(),
            self.limiter.clone(),
        );
        // The stack is whole (request id, access line, error bodies of its own), so the call
        // endpoints are mounted as they are: a call meets one instance of each layer. The
        // other endpoints get the same three layers around them.
        let calls = Router::new()
            .route_service("/v1/chat/completions", stack.clone())
            .route_service("/v1/messages", stack.clone())
            .route_service("/v1/embeddings", stack.clone())
            .route_service("/v1/responses", stack.clone());
        let rest = crate::key_holder::router_with_body_limits(
            self.store.clone(),
            self.catalogue.clone(),
            self.upstream,
            self.limiter,
            self.body,
        );
        #[cfg(feature = "api")]
        let rest = rest.merge(operator_apis(
            self.store,
            self.catalogue,
            self.reloader,
            self.admin_token,
            self.metrics,
        ));
        #[cfg(not(feature = "api"))]
        let _ = self.reloader;
        #[cfg(not(feature = "api"))]
        let rest = rest.merge(operator_apis_left_out());
        // Outermost last: the request id, then the access line, then refusals' bodies.
        let rest = rest
            .fallback(|| async { GatewayError::UnknownPath.into_response::<Body>() })
            .layer(ErrorBodyLayer::new(error_body))
            .layer(AccessLogLayer::new())
            .layer(RequestIdLayer::new());
        // The other endpoints behind the Gemini API's calls, which name their model in the
        // path: the four call paths above are matched first, as they were.
        calls.fallback_service(with_gemini_calls(rest, stack))
    }
}

/// `router` with the Gemini API's calls, which name the model (and the verb) in the path
/// (`/v1beta/models/{model}:generateContent`, `:streamGenerateContent`, and the same under
/// `/v1/models/`: whatever the method, the stack refuses all but `POST`), sent to the
/// `stack`; the other requests on those paths (a model, `:countTokens`) stay the router's.
fn with_gemini_calls(
    router: Router,
    stack: crate::GatewayStack<Upstream>,
) -> impl tower::Service<
    axum::extract::Request,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
+ Send
+ Sync
+ 'static {
    use tower::ServiceExt;
    tower::service_fn(move |request: axum::extract::Request| {
        let uri = request.uri();
        let call = gemini::path_call(uri.path());
        let is_call = call.is_some();
        let as_array =
            call.is_some_and(|call| call.stream) && !asks_server_sent_events(uri.query());
        let (stack, router) = (stack.clone(), router.clone());
        async move {
            if !is_call {
                return router.oneshot(request).await;
            }
            let response = stack.oneshot(request).await?;
            let response = axum::response::IntoResponse::into_response(response);
            Ok(if as_array {
                json_array_stream(response)
            } else {
                response
            })
        }
    })
}

/// A Gemini event stream answered as Google's JSON array (see [`JsonArrayFraming`]) to a client
/// that did not ask `alt=sse`; any other answer (a refusal) as it is.
fn json_array_stream(response: axum::response::Response) -> axum::response::Response {
    let is_events = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"));
    if !response.status().is_success() || !is_events {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    parts.headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    let framed = JsonArrayBody {
        inner: body,
        framing: JsonArrayFraming::new(),
        finished: false,
    };
    axum::response::Response::from_parts(parts, Body::new(framed))
}

/// A body of events, framed as one JSON array as it streams.
struct JsonArrayBody {
    inner: Body,
    framing: JsonArrayFraming,
    finished: bool,
}

impl http_body::Body for JsonArrayBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, axum::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if this.finished {
                return Poll::Ready(None);
            }
            match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let framed = this.framing.push(&data);
                    if !framed.is_empty() {
                        return Poll::Ready(Some(Ok(http_body::Frame::data(framed))));
                    }
                }
                Poll::Ready(None) => {
                    this.finished = true;
                    let end = this.framing.finish();
                    return Poll::Ready(Some(Ok(http_body::Frame::data(end))));
                }
            }
        }
    }
}

/// In a build without `api`: the console's and the admin API's paths, each answering that the
/// feature is left out (a newcomer who opens `/console/` learns how to build it).
#[cfg_attr(feature = "api", allow(dead_code))]
fn operator_apis_left_out() -> Router {
    let left_out = || async { GatewayError::NotInThisBuild("api").into_response::<Body>() };
    Router::new()
        .route("/console", axum::routing::any(left_out))
        .route("/console/", axum::routing::any(left_out))
        .route("/console/{*rest}", axum::routing::any(left_out))
        .route("/admin/{*rest}", axum::routing::any(left_out))
}

/// The console, and the admin API (with `/metrics` when `metrics` is set) for `token`'s holder.
#[cfg(feature = "api")]
fn operator_apis<S: Store + 'static>(
    store: Arc<S>,
    catalogue: LiveCatalogue,
    reloader: Option<CatalogueReloader>,
    token: Option<AdminToken>,
    metrics: Option<Render>,
) -> Router {
    let mut router = crate::console::router(token.is_some());
    if let Some(token) = token {
        let mut admin = Admin::new(store).with_catalogue(catalogue);
        if let Some(reloader) = reloader {
            admin = admin.with_reloader(reloader);
        }
        router = router.merge(admin::router(admin, token.clone()));
        if let Some(render) = metrics {
            router = router.merge(admin::metrics_router(move || render(), token));
        }
    }
    router
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    /// What a build without `api` answers on the console's and the admin API's paths (mounted
    /// only there; tested in every build).
    #[tokio::test]
    async fn the_operator_apis_left_out_say_which_feature_they_need() {
        for path in [
            "/console",
            "/console/",
            "/console/index.html",
            "/admin/accounts",
        ] {
            let request = http::Request::get(path).body(Body::empty()).unwrap();
            let response = operator_apis_left_out().oneshot(request).await.unwrap();
            assert_eq!(response.status(), http::StatusCode::NOT_FOUND, "{path}");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let detail = body["detail"].as_str().unwrap();
            assert!(detail.starts_with("接口不存在"), "{detail}");
            assert!(detail.contains("--features api"), "{path}: {detail}");
        }
    }
}
