//! [`ProtocolRouter`]: which endpoint, which model, at what price.
//!
//! Decides the protocol from the path (`/v1/chat/completions`, `/v1/messages`, `/v1/responses`
//! or `/v1/embeddings`), reads the body up to a size limit, checks the few fields the gateway
//! needs (`model`; `messages`, or `input` for embeddings and responses; `max_tokens` on
//! messages), finds `model` in the [`Catalogue`] and checks that its protocol matches the
//! endpoint (responses are served by the chat-completions models, and refused with 400 where a
//! channel would have to translate a field that does not translate). It adds the [`RoutedCall`]
//! extension and hands the inner service the body as [`Bytes`], exactly as the client sent it.
//!
//! Refusals: unknown path 404, other methods than `POST` 405, a body over the limit 413, a
//! malformed request 400, an unknown model or a model of the other protocol 404 `模型不存在`,
//! a model the caller's key may not call (its [`KeyRules`], when
//! [`ApiKeyAuth`](crate::ApiKeyAuth) added them) 403 `该 API Key 无权使用此模型`.
//!
//! ```
//! use std::{convert::Infallible, sync::Arc};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use model_gateway::{Catalogue, ProtocolRouterLayer, call::RoutedCall};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let service = ServiceBuilder::new()
//!     .layer(ProtocolRouterLayer::new(Arc::new(Catalogue::demo())))
//!     .service(service_fn(|request: Request<Bytes>| async move {
//!         let routed = request.extensions().get::<RoutedCall>().unwrap();
//!         Ok::<_, Infallible>(Response::new(Full::<Bytes>::from(routed.model.pricing.per_call.to_string())))
//!     }));
//!
//! let call = |body: &'static str| {
//!     Request::post("/v1/messages").body(Full::new(Bytes::from(body))).unwrap()
//! };
//! let ok = r#"{"model":"claude-haiku-4-5","max_tokens":16,"messages":[]}"#;
//! assert_eq!(service.clone().oneshot(call(ok)).await.unwrap().status(), StatusCode::OK);
//! // A chat-completions model on the messages endpoint does not exist there.
//! let wrong = r#"{"model":"gpt-4o-mini","max_tokens":16,"messages":[]}"#;
//! assert_eq!(service.oneshot(call(wrong)).await.unwrap().status(), StatusCode::NOT_FOUND);
//! # }
//! ```

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Body;
use serde_json::value::RawValue;
use tower_layer::Layer;
use tower_service::Service;

use crate::call::{AccessEntry, Caller, IdempotencyKey, KeyRules, RoutedCall};
use crate::catalogue::{Catalogue, LiveCatalogue, ModelChannel};
use crate::error::GatewayError;
use crate::protocol::dialect::{Dialect, Fields, UsageAsk};
use crate::protocol::translate::Needs;
use crate::protocol::{BuiltinTools, Protocol, UpstreamKind};
use crate::store::{Ledger, ResponseOwners};

#[cfg(feature = "server")]
pub(crate) use crate::body_limit::read_beside_calls;
pub use crate::body_limit::{
    BodyBudget, BodyLimits, BodyPermit, DEFAULT_BODY_BUDGET_BYTES, DEFAULT_BODY_DEADLINE,
    DEFAULT_BODY_IDLE_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_UNFUNDED_MAX_BODY_BYTES,
};
use crate::body_limit::{Funds, declared_length, read_body};
use tower::BoxError;

/// Configuration of [`ProtocolRouter`]: the catalogue and the body limit.
#[derive(Debug, Clone)]
#[must_use]
pub struct ProtocolRouterLayer {
    catalogue: LiveCatalogue,
    body: BodyLimits,
    streaming: bool,
    funds: Option<Arc<dyn Ledger>>,
    owners: Option<Arc<dyn ResponseOwners>>,
}

impl ProtocolRouterLayer {
    /// Routes against `catalogue` (a [`Catalogue`], or a [`LiveCatalogue`] that reloads), with
    /// the default body limit; streaming as the catalogue says ([`Catalogue::streaming`]).
    pub fn new(catalogue: impl Into<LiveCatalogue>) -> ProtocolRouterLayer {
        let catalogue = catalogue.into();
        ProtocolRouterLayer {
            streaming: catalogue.current().streaming(),
            catalogue,
            body: BodyLimits::default(),
            funds: None,
            owners: None,
        }
    }

    /// Serves `previous_response_id` on Responses calls: the response must have been made by
    /// the caller's account (as `owners` recorded it; see
    /// [`HttpUpstream::remembering_responses`](crate::upstream::HttpUpstream::remembering_responses)),
    /// else `404 响应不存在`, and the call goes to the upstream that keeps it. Without it,
    /// `previous_response_id` is refused with 400. Needs [`ApiKeyAuth`](crate::ApiKeyAuth) outside.
    pub fn response_owners(mut self, owners: Arc<dyn ResponseOwners>) -> ProtocolRouterLayer {
        self.owners = Some(owners);
        self
    }

    /// How request bodies are read: size, time-outs, the memory budget.
    pub fn body_limits(mut self, limits: impl Into<BodyLimits>) -> ProtocolRouterLayer {
        self.body = limits.into();
        self
    }

    /// Lets a caller whose credits cannot pay for the catalogue's cheapest model send a body of
    /// at most [`BodyLimits::unfunded_max_bytes`]; beyond that it is answered 413 at once
    /// rather than buffered. The balance is read through `ledger`, once per request and only
    /// for bodies past that size. Needs [`ApiKeyAuth`](crate::ApiKeyAuth) outside.
    pub fn unfunded_callers_through(mut self, ledger: Arc<dyn Ledger>) -> ProtocolRouterLayer {
        self.funds = Some(ledger);
        self
    }

    /// Lets `stream: true` through (marked on the [`RoutedCall`]) instead of refusing it with
    /// 400. The layers inside must be able to stream: [`stack`](crate::stack) is.
    pub fn streaming(mut self, streaming: bool) -> ProtocolRouterLayer {
        self.streaming = streaming;
        self
    }

    /// Refuses bodies over `limit` bytes with 413.
    pub fn max_body_bytes(mut self, limit: usize) -> ProtocolRouterLayer {
        self.body.max_bytes = limit;
        self
    }
}

impl<S> Layer<S> for ProtocolRouterLayer {
    type Service = ProtocolRouter<S>;

    fn layer(&self, inner: S) -> ProtocolRouter<S> {
        ProtocolRouter {
            inner,
            catalogue: self.catalogue.clone(),
            body: self.body.clone(),
            streaming: self.streaming,
            funds: self.funds.clone(),
            owners: self.owners.clone(),
        }
    }
}

/// Middleware that reads and checks the request and adds the [`RoutedCall`] extension.
#[derive(Debug, Clone)]
pub struct ProtocolRouter<S> {
    inner: S,
    catalogue: LiveCatalogue,
    body: BodyLimits,
    streaming: bool,
    funds: Option<Arc<dyn Ledger>>,
    owners: Option<Arc<dyn ResponseOwners>>,
}

crate::macros::inner_service_accessors!(ProtocolRouter, S, inner);

impl<S> ProtocolRouter<S> {
    /// Routes requests for `inner` against `catalogue`, with the default body limits.
    pub fn new(inner: S, catalogue: impl Into<LiveCatalogue>) -> ProtocolRouter<S> {
        ProtocolRouterLayer::new(catalogue).layer(inner)
    }

    /// A [`ProtocolRouterLayer`] over `catalogue`.
    pub fn layer(catalogue: impl Into<LiveCatalogue>) -> ProtocolRouterLayer {
        ProtocolRouterLayer::new(catalogue)
    }
}

crate::macros::response_future! {
    /// The future [`ProtocolRouter`] answers with.
    ResponseFuture
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for ProtocolRouter<S>
where
    S: Service<Request<Bytes>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The catalogue as it stands now serves this request to its end, whatever reloads.
        let catalogue = self.catalogue.current();
        let limits = self.body.clone();
        let funds = self.funds.clone().and_then(|ledger| {
            let cheapest = catalogue.cheapest_charge()?;
            Some(Funds { ledger, cheapest })
        });
        let owners = self.owners.clone();
        let streaming = self.streaming;
        let mut inner = crate::macros::take_ready(&mut self.inner);
        ResponseFuture::new(async move {
            let settings = Settings {
                catalogue: &catalogue,
                limits: &limits,
                funds: funds.as_ref(),
                owners: owners.as_deref(),
                streaming,
            };
            match read_and_route(request, settings).await {
                Ok((request, dropped)) => {
                    let mut response = inner.call(request).await?;
                    if let Some(dropped) = dropped {
                        response.headers_mut().insert(DROPPED_TOOLS_HEADER, dropped);
                    }
                    Ok(response)
                }
                Err(refusal) => Ok(refusal.into_response()),
            }
        })
    }
}

/// The response header that names the tools a translated call left out (see
/// [`BuiltinTools::Drop`]), by type, comma-separated.
pub const DROPPED_TOOLS_HEADER: &str = "x-gateway-dropped-tools";

/// The [`DROPPED_TOOLS_HEADER`] of a `routed` call, if its translation dropped tools.
fn dropped_tools(routed: &RoutedCall) -> Option<http::HeaderValue> {
    let translation = routed.translation()?;
    let dropped = translation.dropped_tools();
    if dropped.is_empty() {
        return None;
    }
    tracing::info!(dropped = ?dropped, "tools left out of a translated call");
    // Tool types and names are the client's JSON strings: any that a header cannot carry is
    // left out of it (the log line has them all).
    let names: Vec<&str> = dropped
        .iter()
        .copied()
        .filter(|name| http::HeaderValue::from_str(name).is_ok() && !name.contains(','))
        .collect();
    http::HeaderValue::from_str(&names.join(", ")).ok()
}

/// What [`read_and_route`] reads against.
struct Settings<'a> {
    catalogue: &'a Catalogue,
    limits: &'a BodyLimits,
    funds: Option<&'a Funds>,
    owners: Option<&'a dyn ResponseOwners>,
    streaming: bool,
}

/// Reads and routes a call: the request for the service inside, and the header that names the
/// tools its translation dropped, if any.
async fn read_and_route<B>(
    request: Request<B>,
    settings: Settings<'_>,
) -> Result<(Request<Bytes>, Option<http::HeaderValue>), GatewayError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let Settings {
        catalogue,
        limits,
        funds,
        owners,
        streaming,
    } = settings;
    let protocol = Protocol::from_path(request.uri().path()).ok_or(GatewayError::UnknownPath)?;
    if request.method() != Method::POST {
        return Err(GatewayError::MethodNotAllowed);
    }
    let declared_length = declared_length(request.headers(), limits)?;
    let (mut parts, body) = request.into_parts();
    let payer = funds.zip(parts.extensions.get::<Caller>().copied());
    let (body, permit) = read_body(body, limits, declared_length, payer).await?;
    if let Some(value) = parts.headers.get(IdempotencyKey::HEADER) {
        let key = value
            .to_str()
            .ok()
            .and_then(|key| IdempotencyKey::new(key, parts.uri.path(), &body))
            .ok_or(GatewayError::InvalidIdempotencyKey)?;
        parts.extensions.insert(key);
    }
    let access = parts.extensions.get::<AccessEntry>();
    let path = parts.uri.path();
    let routed = route_at(catalogue, protocol, path, &body, streaming).inspect_err(|refusal| {
        if let (Some(access), GatewayError::ModelNotFound) = (access, refusal)
            && let Some(name) = model_name(protocol, path, &body)
        {
            access.unknown_model(&name);
        }
    })?;
    if let Some(access) = access {
        access.model(&routed.model, routed.alias.as_deref());
    }
    if let Some(rules) = parts.extensions.get::<KeyRules>()
        && !rules.allows(&routed.model.name)
    {
        return Err(GatewayError::ModelNotAllowed);
    }
    let mut routed = routed;
    // The operator's header names the tier where the body does not (an upstream whose tier is
    // chosen by header, a client that cannot set the field).
    if let Some(header) = catalogue.service_tier_header()
        && let Some(tier) = parts
            .headers
            .get(header)
            .and_then(|value| value.to_str().ok())
            .and_then(crate::protocol::ServiceTier::asked)
    {
        routed.asked_tier = tier.or(routed.asked_tier);
    }
    if let Some(id) = routed.continues.take() {
        let caller = parts.extensions.get::<Caller>().copied();
        let upstream = find_stored_response(owners, caller, &routed, &id).await?;
        routed.upstream = Some(upstream);
    }
    let dropped = dropped_tools(&routed);
    parts.extensions.insert(routed);
    if let Some(permit) = permit {
        parts.extensions.insert(permit);
    }
    Ok((Request::from_parts(parts, body), dropped))
}

/// The upstream that keeps the stored response `id` that a call of `routed` continues: it must
/// have been made by `caller`'s account at one of the model's native channels, else `404
/// 响应不存在` (the same for an unknown id and another account's, so that ids cannot be
/// probed). Without `owners`, nothing is kept: 400.
async fn find_stored_response(
    owners: Option<&dyn ResponseOwners>,
    caller: Option<Caller>,
    routed: &RoutedCall,
    id: &str,
) -> Result<Arc<str>, GatewayError> {
    let Some(owners) = owners else {
        return Err(GatewayError::UnsupportedField {
            field: "previous_response_id".into(),
            reason: "this gateway keeps no record of responses; send the whole conversation in `input`",
        });
    };
    let Some(caller) = caller else {
        return Err(GatewayError::ResponseNotFound);
    };
    let read = owners.response_owner(id);
    let owner = match tokio::time::timeout(crate::store::DEFAULT_LEDGER_TIMEOUT, read).await {
        Ok(Ok(owner)) => owner,
        Ok(Err(_)) | Err(_) => return Err(GatewayError::StoreUnavailable),
    };
    let owner = owner
        .filter(|owner| owner.account == caller.account)
        .ok_or(GatewayError::ResponseNotFound)?;
    routed
        .model
        .channels
        .iter()
        .find(|channel| {
            channel.upstream.name == owner.upstream
                && keeps_replies(routed.protocol.dialect(), channel)
        })
        .map(|channel| Arc::from(channel.upstream.name.as_str()))
        .ok_or(GatewayError::ResponseNotFound)
}

/// Checks a buffered request body and resolves its model, in the order the contract gives:
/// malformed request (400, as the protocol's dialect reads it) before unknown model (404).
/// `stream: true` is refused with 400 unless `streaming` is on.
pub fn route(
    catalogue: &Catalogue,
    protocol: Protocol,
    body: &[u8],
    streaming: bool,
) -> Result<RoutedCall, GatewayError> {
    route_at(catalogue, protocol, protocol.path(), body, streaming)
}

/// [`route`] for a request sent to `path`, where a protocol that names the model (or the
/// stream) in its path reads them (the Gemini API's `/v1beta/models/{model}:generateContent`).
pub fn route_at(
    catalogue: &Catalogue,
    protocol: Protocol,
    path: &str,
    body: &[u8],
    streaming: bool,
) -> Result<RoutedCall, GatewayError> {
    let dialect = protocol.dialect();
    let envelope = dialect.envelope_at(path, body, streaming)?;
    let model_name = &envelope.model.name;
    let mut routed = resolve(
        catalogue,
        protocol,
        body,
        envelope.model.raw,
        model_name,
        envelope.stream,
    )?;
    if let Some(keeps) = envelope.provider_keeps {
        routed.keep_provider_keeps(keeps);
    }
    if let Some(id) = &envelope.continues {
        // Served where the reply is kept (see `find_stored_response`).
        if !routed
            .model
            .channels
            .iter()
            .any(|channel| keeps_replies(dialect, channel))
        {
            return Err(GatewayError::UnsupportedField {
                field: "previous_response_id".into(),
                reason: "this model's providers keep no responses; send the whole conversation in `input`",
            });
        }
        routed.continues = Some(Arc::from(id.as_ref()));
    } else if let Some(translation) =
        dialect.translation(&envelope, model_name, body, needs(dialect, &routed))
    {
        // Where one of the model's channels translates, the request must translate (checked
        // here, so that an untranslatable request is refused before it is charged, whichever
        // channel would have served it).
        let translation = translation?;
        // A chat stream translated from messages or Google's events carries the usage chunk
        // the translation writes: hidden from a client that did not ask for it, as when the
        // gateway asks a provider for it.
        let from_provider = (translation.messages.is_some() || translation.gemini.is_some())
            && translation.chat.is_none();
        routed.keep_translation(translation);
        if from_provider && envelope.stream {
            match dialect.metering(&envelope, body)?.usage {
                UsageAsk::Asked => {}
                UsageAsk::GatewayAsks => routed.gateway_asks_usage = true,
                UsageAsk::OverClientsOptions => routed.ask_usage_over_clients_options(),
            }
        }
    }
    if routed.model.pricing.is_metered() {
        routed.input_estimate = crate::pricing::estimated_input_tokens(body.len());
        routed.input_ceiling = crate::pricing::input_ceiling_tokens(body);
        let metering = dialect.metering(&envelope, body)?;
        if let Some(field) = metering.kept_input {
            // Input the provider keeps may be as large as the model takes: reserved for whole,
            // so that its report is trusted and charged in full.
            let Some(window) = routed.model.context_window else {
                return Err(GatewayError::UnsupportedField {
                    field: field.into(),
                    reason: "this model's catalogue entry sets no context_window, so the input it names cannot be reserved for",
                });
            };
            routed.input_ceiling = routed.input_ceiling.max(u64::from(window));
        }
        routed.output_limit = metering.output_limit;
        routed.replies = metering.replies;
        routed.asked_tier = envelope.fields.asked_tier();
        match metering.usage {
            UsageAsk::Asked => {}
            UsageAsk::GatewayAsks => routed.gateway_asks_usage = true,
            UsageAsk::OverClientsOptions => routed.ask_usage_over_clients_options(),
        }
    }
    Ok(routed)
}

/// What the translations of a call of `dialect` on `routed`'s model must be made for: for
/// each kind of upstream among its channels that translates the call, what it does with
/// built-in tools (refused if one of those channels refuses them, so that which channel serves
/// a call never changes whether it is accepted).
fn needs(dialect: &dyn Dialect, routed: &RoutedCall) -> Needs {
    let rule = |kind: UpstreamKind| {
        routed
            .model
            .channels
            .iter()
            .filter(|channel| channel.upstream.kind == kind && translated_at(dialect, channel))
            .map(|channel| channel.upstream.builtin_tools)
            .reduce(|one, other| match (one, other) {
                (BuiltinTools::Drop, BuiltinTools::Drop) => BuiltinTools::Drop,
                _ => BuiltinTools::Refuse,
            })
    };
    Needs {
        to_chat: rule(UpstreamKind::Openai),
        to_messages: rule(UpstreamKind::Anthropic),
        to_gemini: rule(UpstreamKind::Gemini),
        max_output_tokens: routed.model.max_output_tokens.map(u64::from),
    }
}

/// Whether `channel`'s upstream translates a call of `dialect` on its way.
fn translated_at(dialect: &dyn Dialect, channel: &ModelChannel) -> bool {
    let upstream = &channel.upstream;
    dialect
        .upstream(upstream.kind, upstream.responses)
        .is_some_and(|route| route.translated)
}

/// Whether `channel`'s provider keeps the replies of `dialect`'s calls, to be continued: one
/// that speaks the protocol itself.
fn keeps_replies(dialect: &dyn Dialect, channel: &ModelChannel) -> bool {
    let upstream = &channel.upstream;
    dialect.provider_keeps_replies()
        && dialect
            .upstream(upstream.kind, upstream.responses)
            .is_some_and(|route| !route.translated)
}

/// Resolves the model of a request that is not a call (such as `count_tokens`): a JSON object
/// with a string `model` (400 otherwise) that the catalogue serves on `protocol` (404
/// otherwise). Nothing else in the body is checked.
pub fn route_model(
    catalogue: &Catalogue,
    protocol: Protocol,
    body: &[u8],
) -> Result<RoutedCall, GatewayError> {
    let model = Fields::read(body)?.model()?;
    resolve(catalogue, protocol, body, model.raw, &model.name, false)
}

/// Resolves the model a Gemini request beside the calls names in its `path`
/// (`/v1beta/models/{model}:countTokens`, `GET /v1beta/models/{model}`): one the catalogue
/// serves on the Gemini API (`404` otherwise).
pub fn route_named(
    catalogue: &Catalogue,
    protocol: Protocol,
    model_name: &str,
) -> Result<RoutedCall, GatewayError> {
    resolve(catalogue, protocol, &[], None, model_name, false)
}

/// Checks that a request beside the calls (`count_tokens`) for `routed`'s model would
/// translate where one of the model's channels translates its calls: a field that does not is
/// refused as a call's is (`400` naming it).
pub fn check_translates(routed: &RoutedCall, body: &[u8]) -> Result<(), GatewayError> {
    let dialect = routed.protocol.dialect();
    let needs = needs(dialect, routed);
    if !needs.any() {
        return Ok(());
    }
    let fields = Fields::read(body)?;
    let model = fields.model()?;
    let name = model.name.clone();
    let envelope = fields.into_envelope(model, true)?;
    match dialect.translation(&envelope, &name, body, needs) {
        Some(Err(refused)) => Err(refused),
        _ => Ok(()),
    }
}

fn resolve(
    catalogue: &Catalogue,
    protocol: Protocol,
    body: &[u8],
    model_raw: Option<&RawValue>,
    model_name: &str,
    stream: bool,
) -> Result<RoutedCall, GatewayError> {
    let model = catalogue
        .model(model_name)
        .filter(|model| model.endpoints.contains(&protocol))
        .ok_or(GatewayError::ModelNotFound)?;
    let alias = (model.name != model_name).then(|| Arc::from(model_name));
    // The raw value borrows from `body`, so its position in `body` is where the model sits.
    let span = model_raw.map(|raw| {
        let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
        start..start + raw.get().len()
    });
    Ok(RoutedCall::from_body(
        protocol,
        model.clone(),
        alias,
        stream,
        span,
    ))
}

/// The `model` a call names, in its body or, where the protocol says so, in its `path` (for
/// the access log of a model not found).
fn model_name(protocol: Protocol, path: &str, body: &[u8]) -> Option<String> {
    let envelope = protocol.dialect().envelope_at(path, body, true).ok()?;
    Some(envelope.model.name.into_owned())
}

#[cfg(test)]
mod tests;
