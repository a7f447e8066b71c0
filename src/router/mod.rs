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

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{Method, Request, Response, header};
use http_body::Body;
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use crate::call::{AccessEntry, Caller, IdempotencyKey, KeyRules, RoutedCall};
use crate::catalogue::{Catalogue, LiveCatalogue, ModelChannel, ResponsesRoute, UpstreamKind};
use crate::credits::Credits;
use crate::error::GatewayError;
use crate::protocol::{Protocol, json_string, responses};
use crate::store::{Ledger, ResponseOwners};
use tower::BoxError;

/// Default body limit: 32 MiB, room for a few base64 images.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

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
                Ok(request) => inner.call(request).await,
                Err(refusal) => Ok(refusal.into_response()),
            }
        })
    }
}

/// What [`read_and_route`] reads against.
struct Settings<'a> {
    catalogue: &'a Catalogue,
    limits: &'a BodyLimits,
    funds: Option<&'a Funds>,
    owners: Option<&'a dyn ResponseOwners>,
    streaming: bool,
}

async fn read_and_route<B>(
    request: Request<B>,
    settings: Settings<'_>,
) -> Result<Request<Bytes>, GatewayError>
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
    let routed = route(catalogue, protocol, &body, streaming).inspect_err(|refusal| {
        if let (Some(access), GatewayError::ModelNotFound) = (access, refusal)
            && let Some(name) = model_name(&body)
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
    if let Some(id) = routed.continues.take() {
        let caller = parts.extensions.get::<Caller>().copied();
        let upstream = find_stored_response(owners, caller, &routed, &id).await?;
        routed.upstream = Some(upstream);
    }
    parts.extensions.insert(routed);
    if let Some(permit) = permit {
        parts.extensions.insert(permit);
    }
    Ok(Request::from_parts(parts, body))
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
                && channel.upstream.responses == ResponsesRoute::Native
        })
        .map(|channel| Arc::from(channel.upstream.name.as_str()))
        .ok_or(GatewayError::ResponseNotFound)
}

/// A body's declared length (`Content-Length`), refused at once if over the largest body.
fn declared_length(
    headers: &http::HeaderMap,
    limits: &BodyLimits,
) -> Result<Option<u64>, GatewayError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limits.max_bytes as u64) {
        return Err(GatewayError::PayloadTooLarge);
    }
    Ok(declared)
}

/// Reads the body of a request served beside the calls (`count_tokens`) within the calls'
/// `limits`: its declared length first, then size, pauses, deadline and memory budget as
/// [`read_body`] does; a caller (from [`ApiKeyAuth`](crate::ApiKeyAuth)) whose credits cannot
/// pay for `catalogue`'s cheapest model may send only the unfunded size.
#[cfg(feature = "server")]
pub(crate) async fn read_beside_calls<B>(
    request: Request<B>,
    catalogue: &Catalogue,
    limits: &BodyLimits,
    ledger: Arc<dyn Ledger>,
) -> Result<(http::request::Parts, Bytes, Option<BodyPermit>), GatewayError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let declared_length = declared_length(request.headers(), limits)?;
    let (parts, body) = request.into_parts();
    let funds = catalogue
        .cheapest_charge()
        .map(|cheapest| Funds { ledger, cheapest });
    let payer = funds
        .as_ref()
        .zip(parts.extensions.get::<Caller>().copied());
    let (body, permit) = read_body(body, limits, declared_length, payer).await?;
    Ok((parts, body, permit))
}

/// Reads a whole request body within `limits`: no more than its size, no pause between chunks
/// longer than its idle time-out, all of it before its deadline, and no more at once than the
/// memory budget allows across every request (waiting up to the idle time-out for room). A
/// body of declared length takes its whole share of the budget before it is read, so that
/// bodies never hold parts of the budget while each waits for more. A caller that cannot pay
/// for any model may send only `unfunded_max_bytes`.
async fn read_body<B>(
    body: B,
    limits: &BodyLimits,
    declared_length: Option<u64>,
    payer: Option<(&Funds, Caller)>,
) -> Result<(Bytes, Option<BodyPermit>), GatewayError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let deadline = Instant::now() + limits.deadline;
    let within = |now: Instant| deadline.min(now + limits.idle_timeout);
    let mut body = std::pin::pin!(body);
    let mut received = Received::Empty;
    let mut permit: Option<OwnedSemaphorePermit> = None;
    // Bytes of the budget held and not yet filled.
    let mut reserved = 0;
    if let (Some(budget), Some(length)) = (&limits.budget, declared_length)
        && length > 0
    {
        let length = usize::try_from(length).map_err(|_| GatewayError::PayloadTooLarge)?;
        permit = Some(budget.take(length, within(Instant::now())).await?);
        reserved = length;
    }
    let mut payer_checked = payer.is_none();
    loop {
        let frame = match tokio::time::timeout_at(within(Instant::now()), body.frame()).await {
            Err(_) => return Err(GatewayError::RequestTimeout),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(GatewayError::UnreadableBody),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let total = received.len() + data.remaining();
        if total > limits.max_bytes {
            return Err(GatewayError::PayloadTooLarge);
        }
        if !payer_checked && total > limits.unfunded_max_bytes {
            payer_checked = true;
            if let Some((funds, caller)) = payer
                && !funds.can_pay(caller).await
            {
                return Err(GatewayError::PayloadTooLarge);
            }
        }
        let unreserved = data.remaining().saturating_sub(reserved);
        reserved = reserved.saturating_sub(data.remaining());
        if let Some(budget) = &limits.budget
            && unreserved > 0
        {
            let more = budget.take(unreserved, within(Instant::now())).await?;
            match &mut permit {
                Some(held) => held.merge(more),
                None => permit = Some(more),
            }
        }
        received.push(data);
    }
    Ok((
        received.into_bytes(),
        permit.map(|held| BodyPermit {
            _held: Arc::new(held),
        }),
    ))
}

/// A body as it arrives: most are one chunk, kept without a copy.
enum Received {
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Received {
    fn len(&self) -> usize {
        match self {
            Received::Empty => 0,
            Received::One(bytes) => bytes.len(),
            Received::Many(bytes) => bytes.len(),
        }
    }

    fn push(&mut self, mut data: impl Buf) {
        *self = match std::mem::replace(self, Received::Empty) {
            Received::Empty => Received::One(data.copy_to_bytes(data.remaining())),
            Received::One(first) => {
                let mut joined = BytesMut::with_capacity(first.len() + data.remaining());
                joined.extend_from_slice(&first);
                joined.put(data);
                Received::Many(joined)
            }
            Received::Many(mut joined) => {
                joined.put(data);
                Received::Many(joined)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Received::Empty => Bytes::new(),
            Received::One(bytes) => bytes,
            Received::Many(bytes) => bytes.freeze(),
        }
    }
}

/// How request bodies are read by [`ProtocolRouter`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BodyLimits {
    /// Largest body accepted (413 beyond).
    pub max_bytes: usize,
    /// Longest pause between two chunks of a body (408 beyond).
    pub idle_timeout: Duration,
    /// Longest time to receive a whole body (408 beyond).
    pub deadline: Duration,
    /// Memory for bodies being read, shared by every request through the same layer (and its
    /// clones); `None` for no budget.
    pub budget: Option<BodyBudget>,
    /// Largest body from a caller who cannot pay for any model (see
    /// [`ProtocolRouterLayer::unfunded_callers_through`]).
    pub unfunded_max_bytes: usize,
}

impl BodyLimits {
    /// The defaults with a largest body of `max_bytes`.
    pub fn new(max_bytes: usize) -> BodyLimits {
        BodyLimits {
            max_bytes,
            ..BodyLimits::default()
        }
    }

    /// The same limits with a pause of at most `idle` between chunks.
    #[must_use]
    pub fn idle_timeout(mut self, idle: Duration) -> BodyLimits {
        self.idle_timeout = idle;
        self
    }

    /// The same limits with a whole body due within `deadline`.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> BodyLimits {
        self.deadline = deadline;
        self
    }

    /// The same limits with a memory budget of `bytes` for bodies being read (`None`: none).
    #[must_use]
    pub fn budget_bytes(mut self, bytes: Option<usize>) -> BodyLimits {
        self.budget = bytes.map(BodyBudget::new);
        self
    }

    /// The same limits letting unfunded callers send `bytes` at most.
    #[must_use]
    pub fn unfunded_max_bytes(mut self, bytes: usize) -> BodyLimits {
        self.unfunded_max_bytes = bytes;
        self
    }
}

impl Default for BodyLimits {
    fn default() -> BodyLimits {
        BodyLimits {
            max_bytes: DEFAULT_MAX_BODY_BYTES,
            idle_timeout: DEFAULT_BODY_IDLE_TIMEOUT,
            deadline: DEFAULT_BODY_DEADLINE,
            budget: Some(BodyBudget::new(DEFAULT_BODY_BUDGET_BYTES)),
            unfunded_max_bytes: DEFAULT_UNFUNDED_MAX_BODY_BYTES,
        }
    }
}

impl From<usize> for BodyLimits {
    /// The defaults with a largest body of `max_bytes`.
    fn from(max_bytes: usize) -> BodyLimits {
        BodyLimits::new(max_bytes)
    }
}

/// Memory for request bodies being read, shared by the requests that read through it.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    bytes: Arc<Semaphore>,
}

impl BodyBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize) -> BodyBudget {
        BodyBudget {
            bytes: Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// Bytes not held by any request now.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    /// Takes `bytes` of the budget, waiting until `until` for room; 503 if there is none.
    async fn take(
        &self,
        bytes: usize,
        until: Instant,
    ) -> Result<OwnedSemaphorePermit, GatewayError> {
        let count = u32::try_from(bytes).map_err(|_| GatewayError::PayloadTooLarge)?;
        if let Ok(permit) = self.bytes.clone().try_acquire_many_owned(count) {
            return Ok(permit);
        }
        match tokio::time::timeout_at(until, self.bytes.clone().acquire_many_owned(count)).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(GatewayError::Busy),
        }
    }
}

/// The share of the body budget a request holds, as a request extension, for as long as the
/// request (and so its buffered body) lives.
#[derive(Debug, Clone)]
pub struct BodyPermit {
    // Never read: dropping the last clone gives the bytes back to the budget.
    _held: Arc<OwnedSemaphorePermit>,
}

/// Whether a caller can pay for the catalogue's cheapest model.
#[derive(Debug, Clone)]
struct Funds {
    ledger: Arc<dyn Ledger>,
    cheapest: Credits,
}

impl Funds {
    /// A store that cannot answer (in time) does not stop the call: the charge decides later,
    /// and answers `503` itself within its own time-out.
    async fn can_pay(&self, caller: Caller) -> bool {
        let read = self.ledger.balance(caller.account);
        match tokio::time::timeout(crate::store::DEFAULT_LEDGER_TIMEOUT, read).await {
            Ok(Ok(balance)) => balance.total() >= self.cheapest,
            Ok(Err(_)) | Err(_) => true,
        }
    }
}

/// Default longest pause between two chunks of a request body.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// Default longest time to receive a whole request body.
pub const DEFAULT_BODY_DEADLINE: Duration = Duration::from_secs(60);

/// Default memory for request bodies being read at once, across every request: 256 MiB.
pub const DEFAULT_BODY_BUDGET_BYTES: usize = 256 * 1024 * 1024;

/// Default largest body from a caller who cannot pay for any model: 1 MiB.
pub const DEFAULT_UNFUNDED_MAX_BODY_BYTES: usize = 1024 * 1024;

/// The fields the gateway reads; everything else passes through untouched. Each is kept as the
/// raw JSON text so that a field of the wrong type gets a precise 400, not a generic one.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_output_tokens: Option<&'a RawValue>,
    /// Chat completions' number of replies, each up to the output limit.
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
    /// A Responses call's whole reading, when its fields came from it (see
    /// [`responses_envelope`]): translated from it, not read again. Boxed: inline, the
    /// reading (its items included) made every envelope, a chat call's too, a struct that
    /// reading one copied with `memcpy`.
    #[serde(skip)]
    responses: Option<Box<responses::ReadRequest<'a>>>,
}

/// Checks a buffered request body and resolves its model, in the order the contract gives:
/// malformed request (400) before unknown model (404). `stream: true` is refused with 400
/// unless `streaming` is on.
pub fn route(
    catalogue: &Catalogue,
    protocol: Protocol,
    body: &[u8],
    streaming: bool,
) -> Result<RoutedCall, GatewayError> {
    let envelope = if protocol == Protocol::Responses {
        responses_envelope(body)?
    } else {
        envelope(body)?
    };
    let mut routed = route_envelope(catalogue, protocol, body, &envelope, streaming)?;
    if routed.model.pricing.is_metered() {
        routed.input_estimate = crate::pricing::estimated_input_tokens(body.len());
        routed.input_ceiling = crate::pricing::input_ceiling_tokens(body);
        routed.output_limit = output_limit(&envelope);
        if protocol == Protocol::ChatCompletions {
            routed.replies = replies(&envelope)?;
        }
        // A chat stream reports its usage only when asked, and a token-priced call is billed
        // on it: the gateway asks whatever the client set, and keeps the usage chunk from a
        // client that did not ask for it.
        if routed.stream && protocol == Protocol::ChatCompletions {
            match envelope.stream_options {
                // Absent, or `null` (which reads as absent): a field of the gateway's own is
                // added only where the client has none, so that no parser takes the client's.
                None if memchr::memmem::find(body, b"\"stream_options\"").is_some() => {
                    routed.ask_usage_over_clients_options();
                }
                None => routed.gateway_asks_usage = true,
                Some(options) if !asks_usage(options) => routed.ask_usage_over_clients_options(),
                Some(_) => {}
            }
        }
    }
    Ok(routed)
}

/// The output limit a request sets: the largest of the ones it gives as whole numbers. Each
/// protocol has its own name, and a provider may follow any of them (vLLM follows
/// `max_completion_tokens` over `max_tokens`), so the ceiling covers the one that lets the most
/// through. A value a provider would refuse is refused there, and refunded.
fn output_limit(envelope: &Envelope<'_>) -> Option<u64> {
    [
        envelope.max_tokens,
        envelope.max_completion_tokens,
        envelope.max_output_tokens,
    ]
    .into_iter()
    .flatten()
    .filter_map(|raw| serde_json::from_str::<u64>(raw.get()).ok())
    .max()
}

/// Whether a chat request's `stream_options` ask for the stream's usage (`include_usage: true`).
fn asks_usage(options: &RawValue) -> bool {
    #[derive(Deserialize)]
    struct Options {
        include_usage: Option<bool>,
    }
    serde_json::from_str::<Options>(options.get())
        .is_ok_and(|options| options.include_usage == Some(true))
}

/// The most replies a request may ask for (`n`): `OpenAI` takes up to 128.
const MAX_REPLIES: u64 = 128;

/// How many replies a request asks for: `n` as a whole number from 1 to [`MAX_REPLIES`], 1 when
/// absent or `null`; anything else is `400` (a provider could honour a value the gateway read
/// otherwise, bringing output its ceiling did not hold).
fn replies(envelope: &Envelope<'_>) -> Result<u64, GatewayError> {
    match envelope.n.map(RawValue::get) {
        None | Some("null") => Ok(1),
        Some(raw) => match serde_json::from_str::<u64>(raw) {
            Ok(n) if (1..=MAX_REPLIES).contains(&n) => Ok(n),
            _ => Err(GatewayError::InvalidReplies),
        },
    }
}

fn route_envelope(
    catalogue: &Catalogue,
    protocol: Protocol,
    body: &[u8],
    envelope: &Envelope<'_>,
    streaming: bool,
) -> Result<RoutedCall, GatewayError> {
    let model_raw = envelope.model.ok_or(GatewayError::InvalidModelField)?;
    let model_name = json_string(model_raw).ok_or(GatewayError::InvalidModelField)?;
    if protocol == Protocol::Embeddings {
        // A string, or an array of strings or of token arrays; never streamed.
        if !envelope
            .input
            .is_some_and(|raw| raw.get().starts_with(['"', '[']))
        {
            return Err(GatewayError::InvalidInputField);
        }
        return resolve(catalogue, protocol, body, model_raw, &model_name, false);
    }
    if protocol == Protocol::Responses {
        return route_responses(catalogue, body, envelope, &model_name, streaming);
    }
    if !envelope
        .messages
        .is_some_and(|raw| raw.get().starts_with('['))
    {
        return Err(GatewayError::InvalidMessagesField);
    }
    if protocol == Protocol::Messages {
        let max_tokens = envelope.max_tokens.ok_or(GatewayError::InvalidMaxTokens)?;
        match serde_json::from_str::<u64>(max_tokens.get()) {
            Ok(tokens) if tokens > 0 => {}
            _ => return Err(GatewayError::InvalidMaxTokens),
        }
    }
    let stream = stream_flag(envelope, streaming)?;
    resolve(catalogue, protocol, body, model_raw, &model_name, stream)
}

/// `stream`: absent, `false` or `null` for a complete reply; `true` only when streaming is on.
fn stream_flag(envelope: &Envelope<'_>, streaming: bool) -> Result<bool, GatewayError> {
    match envelope.stream.map(RawValue::get) {
        None | Some("false") | Some("null") => Ok(false),
        Some("true") if streaming => Ok(true),
        Some("true") => Err(GatewayError::StreamingUnsupported),
        Some(_) => Err(GatewayError::InvalidStreamField),
    }
}

/// A Responses call: `input` a string or a list of items, served by a chat-completions model.
/// Where one of the model's channels translates, the request must translate (checked here, so
/// that an untranslatable request is refused before it is charged, whichever channel would
/// have served it). A call with `previous_response_id` is marked to go where that response is
/// kept, once [`find_stored_response`] has checked who made it; a model without a native
/// channel keeps no responses (400).
fn route_responses(
    catalogue: &Catalogue,
    body: &[u8],
    envelope: &Envelope<'_>,
    model_name: &str,
    streaming: bool,
) -> Result<RoutedCall, GatewayError> {
    let model_raw = envelope.model.ok_or(GatewayError::InvalidModelField)?;
    if !responses_input_given(envelope) {
        return Err(GatewayError::InvalidInputField);
    }
    let stream = stream_flag(envelope, streaming)?;
    let continues = match envelope.previous_response_id {
        None => None,
        Some(raw) if raw.get() == "null" => None,
        Some(raw) => Some(json_string(raw).ok_or(GatewayError::InvalidField {
            field: "previous_response_id".into(),
            reason: "须为字符串",
        })?),
    };
    let mut routed = resolve(
        catalogue,
        Protocol::Responses,
        body,
        model_raw,
        model_name,
        stream,
    )?;
    if let Some(read) = &envelope.responses {
        routed.keep_provider_keeps(read.kept_by_provider());
    }
    let native = |channel: &ModelChannel| {
        channel.upstream.kind == UpstreamKind::Openai
            && channel.upstream.responses == ResponsesRoute::Native
    };
    if let Some(id) = continues {
        // Served where the response is kept (a native channel; see `find_stored_response`).
        if !routed.model.channels.iter().any(native) {
            return Err(GatewayError::UnsupportedField {
                field: "previous_response_id".into(),
                reason: "this model's providers keep no responses; send the whole conversation in `input`",
            });
        }
        routed.continues = Some(Arc::from(id.as_ref()));
        return Ok(routed);
    }
    let translates = !routed.model.channels.iter().all(native);
    if translates {
        let translation = match &envelope.responses {
            Some(read) => responses::Translated::from_read(read, model_name, body),
            None => responses::Translated::from_slice(body),
        };
        let translation = translation.map_err(|refused| {
            // Not JSON after all: the envelope's reading skips what it does not read, so a
            // number out of range, say, is found only here.
            if refused.field.is_empty() {
                GatewayError::InvalidJson
            } else {
                refused.into()
            }
        })?;
        routed.keep_translation(translation);
    }
    Ok(routed)
}

/// Resolves the model of a request that is not a call (such as `count_tokens`): a JSON object
/// with a string `model` (400 otherwise) that the catalogue serves on `protocol` (404
/// otherwise). Nothing else in the body is checked.
pub fn route_model(
    catalogue: &Catalogue,
    protocol: Protocol,
    body: &[u8],
) -> Result<RoutedCall, GatewayError> {
    let envelope = envelope(body)?;
    let model_raw = envelope.model.ok_or(GatewayError::InvalidModelField)?;
    let model_name = json_string(model_raw).ok_or(GatewayError::InvalidModelField)?;
    resolve(catalogue, protocol, body, model_raw, &model_name, false)
}

/// The fields the gateway reads, from a body that must be a JSON object.
fn envelope(body: &[u8]) -> Result<Envelope<'_>, GatewayError> {
    // serde would also accept an array for a struct; requests are objects.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(GatewayError::InvalidJson);
    }
    crate::protocol::read_json(body).map_err(|_| GatewayError::InvalidJson)
}

/// A Responses call's envelope, from the reading its translation starts from when the request
/// is an ordinary one (every field one the translation knows, each of the type it reads), so
/// that a call that translates is read once; otherwise [`envelope`]'s. The fields the router
/// checks are kept as written in both, and checked alike (`input`, read into items by the
/// first, is given there when it is a string or a list).
fn responses_envelope(body: &[u8]) -> Result<Envelope<'_>, GatewayError> {
    let Some(read) = responses::read_request(body) else {
        return envelope(body);
    };
    Ok(Envelope {
        model: read.model,
        // Not fields of a Responses request: the reading refuses them, so they are absent.
        messages: None,
        max_tokens: None,
        max_completion_tokens: None,
        max_output_tokens: read.max_output_tokens,
        n: None,
        stream: read.stream,
        stream_options: read.stream_options,
        // Read into items (see `route_responses`).
        input: None,
        previous_response_id: read.previous_response_id,
        responses: Some(Box::new(read)),
    })
}

/// Whether a Responses call's `input` is a string or a list.
fn responses_input_given(envelope: &Envelope<'_>) -> bool {
    match &envelope.responses {
        // Read as a string or a list of items.
        Some(read) => read.has_input(),
        None => envelope
            .input
            .is_some_and(|raw| raw.get().starts_with(['"', '['])),
    }
}

fn resolve(
    catalogue: &Catalogue,
    protocol: Protocol,
    body: &[u8],
    model_raw: &RawValue,
    model_name: &str,
    stream: bool,
) -> Result<RoutedCall, GatewayError> {
    let model = catalogue
        .model(model_name)
        .filter(|model| model.protocol == protocol.models_protocol())
        .ok_or(GatewayError::ModelNotFound)?;
    let alias = (model.name != model_name).then(|| Arc::from(model_name));
    // The raw value borrows from `body`, so its position in `body` is where the model sits.
    let start = model_raw.get().as_ptr() as usize - body.as_ptr() as usize;
    Ok(RoutedCall::from_body(
        protocol,
        model.clone(),
        alias,
        stream,
        start..start + model_raw.get().len(),
    ))
}

/// The `model` a body names, if it is a JSON object with a string `model` (for the access log
/// of a model not found).
fn model_name(body: &[u8]) -> Option<String> {
    let raw = envelope(body).ok()?.model?;
    json_string(raw).map(std::borrow::Cow::into_owned)
}

#[cfg(test)]
mod tests;
