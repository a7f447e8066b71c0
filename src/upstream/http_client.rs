//! The HTTP upstream: one reqwest client per catalogue upstream, reused across calls, and the
//! failover across a model's channels.
//!
//! A call tries the model's channels by ascending priority (equals in weighted random order),
//! skipping those whose circuit breaker is open, until one answers 2xx with a JSON body:
//! - connection failures, time-outs, 429, 5xx, 401/403 (the channel's own credentials) and a 2xx
//!   that is not JSON move on to the next channel and count against the breaker;
//! - any other 4xx means the request itself is wrong: no other channel is tried, and the
//!   provider's message is passed on to the client;
//! - a 429's `Retry-After` (seconds, milliseconds or an HTTP date) is honoured within the
//!   call's deadline: when every channel has failed, the call waits that long and tries that
//!   channel once more.
//!
//! If every channel's breaker is open, they are all tried anyway: a call never fails untried.
//!
//! A streamed call's wait for the answer and its first event is bounded here; the rest of the
//! stream is not: its deadline and idle time-out are kept by the layer that bills it
//! ([`RefundOnUpstreamError`](crate::RefundOnUpstreamError)), with one timer per stream.

use std::collections::HashMap;

use arc_swap::ArcSwap;
use chrono::Utc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use tower_service::Service;

use super::ResponseFuture;
use super::breaker::CircuitBreaker;
use super::translated::ChatAsResponses;
use crate::call::{AccountId, Caller, RoutedCall, ServedBy};
use crate::catalogue::{Catalogue, ModelChannel, ResponsesRoute, UpstreamConfig, UpstreamKind};
use crate::classify::{complete_reply, is_retryable, retry_after};
use crate::error::{UpstreamError, excerpt};
use crate::events::{EventType, WebhookEvent};
use crate::protocol::responses::{self, Ids, StreamTranslator, Translated};
use crate::protocol::sse::EventSplitter;
use crate::protocol::{Protocol, provider_message};
use crate::reply::{Inner, UpstreamBody};
use crate::store::{EventOutbox, ResponseOwner, ResponseOwners};

/// `anthropic-version` sent when the client sent none.
pub(super) const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

/// Client headers passed on to the provider, per wire format. Everything else (and in
/// particular the client's own gateway key) stays at the gateway.
const OPENAI_PASSED_HEADERS: &[&str] = &[
    "openai-organization",
    "openai-project",
    "openai-beta",
    "idempotency-key",
    "traceparent",
    "tracestate",
    "x-request-id",
];
const ANTHROPIC_PASSED_HEADERS: &[&str] = &[
    "anthropic-beta",
    "idempotency-key",
    "traceparent",
    "tracestate",
    "x-request-id",
];

/// Where provider keys are read: the name of a variable to its value.
type KeySource = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The upstreams by name, as one catalogue names them.
type Channels = HashMap<String, Arc<Channel>>;

/// How many catalogues' upstreams are kept after a reload, newest first: a call routed on an
/// older catalogue finds the upstreams it names there, as long as it lasts.
const GENERATIONS: usize = 8;

/// Calls the providers named in the catalogue.
#[derive(Clone)]
pub struct HttpUpstream {
    /// The upstreams of the catalogue served now, then of the ones before it (see
    /// [`GENERATIONS`]); replaced whole by [`HttpUpstream::reload`].
    channels: Arc<ArcSwap<Vec<Arc<Channels>>>>,
    keys: KeySource,
    call_deadline: Duration,
    /// Where the owners of the responses native upstreams keep are recorded, if anywhere.
    owners: Option<Arc<dyn ResponseOwners>>,
    /// Where breakers opening and closing are recorded as webhook events, if anywhere.
    events: Option<Arc<dyn EventOutbox>>,
}

struct Channel {
    config: Arc<UpstreamConfig>,
    client: reqwest::Client,
    /// The provider key as a header value; `None` when the variable is unset, in which case
    /// this channel fails without being contacted.
    api_key: Option<HeaderValue>,
    /// The provider key in clear, only to scrub it from anything the provider echoes back.
    secret: Option<String>,
    /// Shared with the same upstream's channel in the catalogues after a reload that kept it.
    breaker: Arc<CircuitBreaker>,
    /// How much of a provider's answer is read at most.
    limits: ReadLimits,
    /// Where each protocol's calls go, parsed once.
    endpoints: Endpoints,
}

/// The URL a call of each protocol goes to on one upstream, parsed when the channel is made:
/// given text, reqwest would parse it again (and check its host name) on every call.
#[derive(Debug, Clone)]
struct Endpoints([Option<reqwest::Url>; 4]);

impl Endpoints {
    const PROTOCOLS: [Protocol; 4] = [
        Protocol::ChatCompletions,
        Protocol::Messages,
        Protocol::Embeddings,
        Protocol::Responses,
    ];

    fn of(config: &UpstreamConfig) -> Endpoints {
        Endpoints(Self::PROTOCOLS.map(|protocol| reqwest::Url::parse(&url(config, protocol)).ok()))
    }

    fn get(&self, protocol: Protocol) -> Option<&reqwest::Url> {
        let at = Self::PROTOCOLS.iter().position(|each| *each == protocol)?;
        self.0[at].as_ref()
    }
}

/// Where a call of `protocol` goes on the upstream `config` (the catalogue checked that it
/// serves it).
fn url(config: &UpstreamConfig, protocol: Protocol) -> String {
    match (config.kind, protocol) {
        (UpstreamKind::Openai, Protocol::Embeddings) => format!("{}/embeddings", config.base_url),
        (UpstreamKind::Openai, Protocol::Responses) if !translates(config, protocol) => {
            format!("{}/responses", config.base_url)
        }
        (UpstreamKind::Openai, _) => format!("{}/chat/completions", config.base_url),
        (UpstreamKind::Anthropic, _) => format!("{}/v1/messages", config.base_url),
    }
}

/// Whether a call of `protocol` is translated on its way to the upstream `config` and back: a
/// Responses call to an upstream that speaks only chat completions.
fn translates(config: &UpstreamConfig, protocol: Protocol) -> bool {
    protocol == Protocol::Responses && config.responses == ResponsesRoute::Translate
}

/// How much of a provider's answer the gateway reads at most, so that a provider sending a
/// reply or an event without end cannot take the gateway's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ReadLimits {
    /// A complete reply.
    reply: usize,
    /// One event of a stream, or its unfinished tail.
    event: usize,
}

impl std::fmt::Debug for HttpUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let channels = self.current();
        let mut names: Vec<_> = channels.keys().collect();
        names.sort();
        f.debug_struct("HttpUpstream")
            .field("upstreams", &names)
            .field("call_deadline", &self.call_deadline)
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
        key_for: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Result<HttpUpstream, reqwest::Error> {
        let keys: KeySource = Arc::new(key_for);
        let channels = build_channels(catalogue, &*keys, &HashMap::new())?;
        Ok(HttpUpstream {
            channels: Arc::new(ArcSwap::from_pointee(vec![Arc::new(channels)])),
            keys,
            call_deadline: catalogue.call_deadline(),
            owners: None,
            events: None,
        })
    }

    /// Calls the upstreams `catalogue` names from now on (a reload), reading their keys again.
    /// An upstream whose settings and key are unchanged keeps its client and its breaker's
    /// state; calls under way finish on the upstreams they began with.
    pub fn reload(&self, catalogue: &Catalogue) -> Result<(), reqwest::Error> {
        let generations = self.channels.load_full();
        let channels = build_channels(catalogue, &*self.keys, &generations[0])?;
        let mut kept = vec![Arc::new(channels)];
        kept.extend(generations.iter().take(GENERATIONS - 1).cloned());
        self.channels.store(Arc::new(kept));
        Ok(())
    }

    /// The upstreams of the catalogue served now.
    fn current(&self) -> Arc<Channels> {
        self.channels.load()[0].clone()
    }

    /// Records each upstream's breaker opening and closing in `events` (webhook events
    /// `upstream.breaker_opened` and `upstream.breaker_closed`), aside from the call.
    #[must_use]
    pub fn reporting_breakers(mut self, events: Arc<dyn EventOutbox>) -> HttpUpstream {
        self.events = Some(events);
        self
    }

    /// Records in `owners` who made each response that a native Responses upstream keeps (a
    /// call without `store: false`), so that `previous_response_id` and `/v1/responses/{id}`
    /// reach it for that account only (see
    /// [`ProtocolRouterLayer::response_owners`](crate::ProtocolRouterLayer::response_owners)).
    /// [`Gateway`](crate::Gateway) sets it to its store.
    #[must_use]
    pub fn remembering_responses(mut self, owners: Arc<dyn ResponseOwners>) -> HttpUpstream {
        self.owners = Some(owners);
        self
    }
}

/// The channel for `model_channel`'s upstream as the catalogue that routed the call named it
/// (newest first), or else by name in the newest catalogue (a model built outside one).
fn channel_for<'a>(
    generations: &'a [Arc<Channels>],
    model_channel: &ModelChannel,
) -> Option<&'a Arc<Channel>> {
    let name = &model_channel.upstream.name;
    generations
        .iter()
        .filter_map(|channels| channels.get(name))
        .find(|channel| Arc::ptr_eq(&channel.config, &model_channel.upstream))
        .or_else(|| generations.first()?.get(name))
}

/// A channel for each of `catalogue`'s upstreams; one of `old` is kept where its settings and
/// key are the same.
fn build_channels(
    catalogue: &Catalogue,
    key_for: &(dyn Fn(&str) -> Option<String> + Send + Sync),
    old: &Channels,
) -> Result<Channels, reqwest::Error> {
    let mut channels = HashMap::new();
    for config in catalogue.upstreams() {
        let secret = key_for(&config.api_key_env).filter(|key| !key.is_empty());
        let limits = ReadLimits {
            reply: catalogue.max_reply_bytes(),
            event: catalogue.max_event_bytes(),
        };
        let unchanged = old.get(&config.name).filter(|kept| {
            *kept.config == **config && kept.secret == secret && kept.limits == limits
        });
        if let Some(kept) = unchanged {
            // The same upstream: its connections and its breaker go on, under the new
            // catalogue's settings (equal to the old), so that its models find it.
            let channel = Channel {
                config: config.clone(),
                client: kept.client.clone(),
                api_key: kept.api_key.clone(),
                secret: kept.secret.clone(),
                breaker: kept.breaker.clone(),
                limits,
                endpoints: kept.endpoints.clone(),
            };
            channels.insert(config.name.clone(), Arc::new(channel));
            continue;
        }
        let api_key = secret.as_deref().and_then(|key| {
            let value = match config.kind {
                UpstreamKind::Openai => format!("Bearer {key}"),
                UpstreamKind::Anthropic => key.to_owned(),
            };
            let mut value = HeaderValue::try_from(value).ok()?;
            value.set_sensitive(true);
            Some(value)
        });
        if api_key.is_none() {
            tracing::warn!(
                upstream = %config.name,
                variable = %config.api_key_env,
                "provider key not set; this upstream will fail without being contacted"
            );
        }
        let channel = Channel {
            client: build_client(config)?,
            breaker: Arc::new(CircuitBreaker::new(
                config.breaker_failures,
                config.breaker_cooldown,
            )),
            config: config.clone(),
            api_key,
            secret,
            limits,
            endpoints: Endpoints::of(config),
        };
        channels.insert(config.name.clone(), Arc::new(channel));
    }
    Ok(channels)
}

/// Reads a whole reply, at most `max` bytes: a larger one (declared or as it arrives) is an
/// error, read no further. Most replies arrive in one chunk and are kept without a copy.
async fn read_capped(mut reply: reqwest::Response, max: usize) -> Result<Bytes, String> {
    let too_large = || format!("the reply is larger than the {max} bytes the gateway reads");
    if reply
        .content_length()
        .is_some_and(|length| length > max as u64)
    {
        return Err(too_large());
    }
    let mut first: Option<Bytes> = None;
    let mut joined: Option<bytes::BytesMut> = None;
    let mut length = 0;
    while let Some(chunk) = reply.chunk().await.map_err(transport_error)? {
        length += chunk.len();
        if length > max {
            return Err(too_large());
        }
        match (&mut first, &mut joined) {
            (None, _) => first = Some(chunk),
            (Some(head), None) => {
                let mut both = bytes::BytesMut::with_capacity(length);
                both.extend_from_slice(head);
                both.extend_from_slice(&chunk);
                joined = Some(both);
            }
            (Some(_), Some(both)) => both.extend_from_slice(&chunk),
        }
    }
    Ok(joined
        .map(bytes::BytesMut::freeze)
        .or(first)
        .unwrap_or_default())
}

fn build_client(config: &UpstreamConfig) -> Result<reqwest::Client, reqwest::Error> {
    let mut default_headers = HeaderMap::new();
    for (name, value) in &config.headers {
        // Validated when the catalogue was loaded.
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            default_headers.append(name, value);
        }
    }
    // No client-wide time-out: each request sets its own, and a streamed one none (see
    // `Channel::attempt`).
    let mut builder = reqwest::Client::builder()
        .connect_timeout(config.connect_timeout)
        .default_headers(default_headers)
        // A redirected POST would be replayed as a GET elsewhere: treat it as a failure.
        .redirect(reqwest::redirect::Policy::none());
    if let Some(proxy) = &config.proxy {
        builder = builder.proxy(reqwest::Proxy::all(proxy)?);
    }
    builder.build()
}

/// How one attempt on one channel ended, when it did not succeed.
enum AttemptError {
    /// Worth trying another channel.
    Retryable {
        status: Option<u16>,
        message: String,
        retry_after: Option<Duration>,
    },
    /// The provider refused the request itself: no other channel will do better.
    Rejected(UpstreamError),
}

impl Channel {
    /// Starts a call of `protocol` to this upstream.
    fn post(&self, protocol: Protocol) -> reqwest::RequestBuilder {
        match self.endpoints.get(protocol) {
            Some(parsed) => self.client.post(parsed.clone()),
            // A URL that does not parse: reqwest says why when the call is sent.
            None => self.client.post(url(&self.config, protocol)),
        }
    }

    /// Whether a call of `protocol` is translated on its way to this upstream and back.
    fn translates(&self, protocol: Protocol) -> bool {
        translates(&self.config, protocol)
    }

    /// The body sent for a call, and, for a translated Responses call, the translation (whose
    /// request the reply echoes).
    fn request_body(
        &self,
        channel: &ModelChannel,
        routed: &RoutedCall,
        body: &Bytes,
    ) -> Result<(Bytes, Option<Arc<Translated>>), AttemptError> {
        if !self.translates(routed.protocol) {
            let body = routed.upstream_body(body, channel.upstream_model.as_deref());
            return Ok((body, None));
        }
        // The router translated the request to check it; an embedder's own stack may not have,
        // so a refusal here is the request's fault, never this channel's.
        let refused = |message: String| {
            AttemptError::Rejected(UpstreamError {
                status: None,
                message: format!("{}: {message}", self.config.name),
                client_message: Some(message),
            })
        };
        let translation = match routed.translation() {
            Some(translation) => translation,
            None => Arc::new(
                Translated::from_slice(body)
                    .map_err(|untranslatable| refused(untranslatable.to_string()))?,
            ),
        };
        let model = channel
            .upstream_model
            .as_deref()
            .unwrap_or(&routed.model.name);
        let chat = translation.chat_body(model);
        Ok((Bytes::from(chat), Some(translation)))
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

    /// A 2xx answer to a streamed call: an event stream is handed on once its first event has
    /// arrived, so that a provider failing before that is still failed over; anything else is
    /// this channel's failure.
    async fn event_stream(
        &self,
        reply: reqwest::Response,
        first_event_within: Duration,
        translated: Option<&Translated>,
    ) -> Result<(Response<UpstreamBody>, Bytes), AttemptError> {
        let status = reply.status();
        let failed = |message: String| AttemptError::Retryable {
            status: Some(status.as_u16()),
            message,
            retry_after: None,
        };
        let content_type = reply.headers().get(header::CONTENT_TYPE).cloned();
        let is_event_stream = content_type
            .as_ref()
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.trim_start().starts_with("text/event-stream"));
        if !is_event_stream {
            return Err(failed(format!(
                "answered {status} to a streamed call without an event stream ({content_type:?})"
            )));
        }
        let mut body = http::Response::<reqwest::Body>::from(reply)
            .into_body()
            .map_err(|error| UpstreamError::transport(transport_error(error)));
        let mut received = Vec::new();
        let mut splitter = EventSplitter::new();
        let first = async {
            loop {
                if let Some(event) = splitter.next_event() {
                    return Ok(event);
                }
                if splitter.pending() > self.limits.event {
                    return Err(format!(
                        "the first event passed the {} bytes an event may have",
                        self.limits.event
                    ));
                }
                match body.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            splitter.push(&data);
                            received.push(data);
                        }
                    }
                    Some(Err(error)) => return Err(error.message),
                    None => return Err("the stream ended before its first event".to_owned()),
                }
            }
        };
        let first_event = match tokio::time::timeout(first_event_within, first).await {
            Ok(Ok(event)) => event,
            Ok(Err(message)) => return Err(failed(self.scrub(message))),
            Err(_) => return Err(failed("no event before the time-out".to_owned())),
        };
        let events = UpstreamBody::events_after(received, body);
        let events = match translated {
            Some(request) => {
                let Inner::Events(chat) = events.into_inner() else {
                    unreachable!("`events_after` makes an event stream")
                };
                let translator = StreamTranslator::new(request, Ids::random());
                UpstreamBody::events(ChatAsResponses::new(chat, translator, self.limits.event))
            }
            None => events,
        };
        let mut response = Response::new(events);
        *response.status_mut() = status;
        if let Some(content_type) = content_type {
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, content_type);
        }
        response
            .extensions_mut()
            .insert(ServedBy(self.config.name.clone()));
        Ok((response, first_event))
    }

    /// Where and for whom to record who made the response a native Responses upstream answers
    /// `request` with: `None` when nothing is recorded (another protocol, a translated call,
    /// no store of owners or no caller), or the client asked the provider not to keep the
    /// response (`store: false`).
    fn owner_record<'a>(
        &self,
        owners: Option<&'a dyn ResponseOwners>,
        routed: &RoutedCall,
        request: &Request<Bytes>,
    ) -> Option<(&'a dyn ResponseOwners, AccountId)> {
        let owners = owners?;
        if routed.protocol != Protocol::Responses || self.translates(routed.protocol) {
            return None;
        }
        let caller = request.extensions().get::<Caller>()?;
        routed
            .kept_by_provider(request.body())
            .then_some((owners, caller.account))
    }

    /// Records that `account` made the response `response_id` (see [`owner_record`]). A
    /// record that fails is logged: the call goes on, and the response cannot be reached again
    /// through the gateway.
    ///
    /// [`owner_record`]: Self::owner_record
    async fn remember(
        &self,
        (owners, account): (&dyn ResponseOwners, AccountId),
        response_id: String,
    ) {
        let owner = ResponseOwner {
            response_id,
            account,
            upstream: self.config.name.clone(),
        };
        let recorded = owners.record_response(&owner);
        match tokio::time::timeout(crate::store::DEFAULT_LEDGER_TIMEOUT, recorded).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(response = %owner.response_id, %error, "the response's owner was not recorded");
            }
            Err(_) => {
                tracing::warn!(response = %owner.response_id, "the response's owner was not recorded in time");
            }
        }
    }

    /// A provider's answer passed on as it is (status, content type, body, read within the
    /// reply limit), its key scrubbed: for requests beside the calls.
    async fn answer_as_is(
        &self,
        reply: reqwest::Response,
    ) -> Result<Response<Bytes>, UpstreamError> {
        let status = reply.status();
        let content_type = reply.headers().get(header::CONTENT_TYPE).cloned();
        let body = read_capped(reply, self.limits.reply)
            .await
            .map_err(UpstreamError::transport)?;
        let mut response = Response::new(Bytes::from(
            self.scrub(String::from_utf8_lossy(&body).into_owned()),
        ));
        *response.status_mut() = status;
        if let Some(content_type) = content_type {
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, content_type);
        }
        Ok(response)
    }

    /// Removes the provider key from text the provider sent back.
    fn scrub(&self, text: String) -> String {
        match &self.secret {
            Some(secret) if text.contains(secret.as_str()) => {
                text.replace(secret.as_str(), "[redacted]")
            }
            _ => text,
        }
    }

    async fn attempt(
        &self,
        channel: &ModelChannel,
        routed: &RoutedCall,
        request: &Request<Bytes>,
        deadline: Instant,
        owners: Option<&dyn ResponseOwners>,
    ) -> Result<Response<UpstreamBody>, AttemptError> {
        let retryable = |status: Option<u16>, message: String| AttemptError::Retryable {
            status,
            message,
            retry_after: None,
        };
        let Some(api_key) = self.api_key.clone() else {
            return Err(retryable(
                None,
                format!(
                    "provider key variable {} is not set",
                    self.config.api_key_env
                ),
            ));
        };
        let remaining = deadline.saturating_duration_since(Instant::now());
        let mut sent = self
            .post(routed.protocol)
            .headers(self.headers(request.headers(), api_key));
        // A streamed reply's time limits (deadline, idle time-out) are kept by the billing layer
        // with one timer, which tells the client why; a reqwest time-out would poll a second
        // timer for every event. The wait for the answer and its first event is bounded below.
        if !routed.stream {
            sent = sent.timeout(remaining.min(self.config.timeout));
        }
        let (body, translated) = self.request_body(channel, routed, request.body())?;
        let sent = sent.body(body).send();
        let reply = tokio::time::timeout(remaining.min(self.config.timeout), sent)
            .await
            .map_err(|_| retryable(None, "timed out waiting for the answer".to_owned()))?
            .map_err(|error| retryable(None, transport_error(error)))?;
        let status = reply.status();
        if routed.stream && status.is_success() {
            let first_event = remaining.min(self.config.timeout);
            let (response, first) = self
                .event_stream(reply, first_event, translated.as_deref())
                .await?;
            // Its id is in its first event (`response.created`'s `response.id`).
            if let Some(record) = self.owner_record(owners, routed, request) {
                let first = crate::protocol::sse::event_text(&first);
                let data = crate::protocol::sse::Event::parse(&first).data;
                if let Some(id) = responses::response_id(data.as_bytes()) {
                    self.remember(record, id).await;
                }
            }
            return Ok(response);
        }
        let reply_headers = reply.headers().clone();
        let body = read_capped(reply, self.limits.reply)
            .await
            .map_err(|message| retryable(Some(status.as_u16()), message))?;

        if status.is_success() {
            let not_an_object = || {
                retryable(
                    Some(status.as_u16()),
                    format!("answered {status} with a body that is not a JSON object"),
                )
            };
            let (body, usage) = match &translated {
                // Read once, for the response and for its usage.
                Some(translation) => {
                    let (response, usage) = responses::response_json_from_chat_bytes(
                        translation,
                        &body,
                        &mut Ids::random(),
                    )
                    .map_err(|_| not_an_object())?;
                    (Bytes::from(response), usage.ok_or_else(not_an_object)?)
                }
                // A native Responses reply is read once, for its usage and for who made it.
                None => match self.owner_record(owners, routed, request) {
                    Some(record) => {
                        let (usage, id) =
                            responses::reply_usage_and_id(&body).ok_or_else(not_an_object)?;
                        if let Some(id) = id {
                            self.remember(record, id).await;
                        }
                        (body, usage)
                    }
                    None => {
                        let usage = complete_reply(status, &body)
                            .map_err(|error| retryable(error.status, error.message))?;
                        (body, usage)
                    }
                },
            };
            let mut response = Response::new(UpstreamBody::complete(body));
            *response.status_mut() = status;
            let content_type = reply_headers
                .get(header::CONTENT_TYPE)
                .cloned()
                .unwrap_or(HeaderValue::from_static("application/json"));
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, content_type);
            response.extensions_mut().insert(usage);
            response
                .extensions_mut()
                .insert(ServedBy(self.config.name.clone()));
            return Ok(response);
        }

        let message = self.scrub(format!("answered {status}: {}", excerpt(&body)));
        if is_retryable(status) {
            return Err(AttemptError::Retryable {
                status: Some(status.as_u16()),
                message,
                retry_after: (status == StatusCode::TOO_MANY_REQUESTS)
                    .then(|| retry_after(&reply_headers))
                    .flatten(),
            });
        }
        Err(AttemptError::Rejected(UpstreamError {
            status: Some(status.as_u16()),
            message: format!("{}: {message}", self.config.name),
            client_message: provider_message(&body).map(|text| self.scrub(text)),
        }))
    }
}

/// A transport failure, described without the URL (it may carry credentials in a query), with
/// its causes (reqwest's own text alone, "error sending request", does not say what failed).
fn transport_error(error: reqwest::Error) -> String {
    let what = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "connection failed"
    } else if error.is_body() || error.is_decode() {
        "reply body unreadable"
    } else {
        "request failed"
    };
    let error = error.without_url();
    let mut text = format!("{what}: {error}");
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// The order in which to try a model's channels: by priority; equals in weighted random order.
fn attempt_order(channels: &[ModelChannel]) -> Vec<&ModelChannel> {
    let mut order = Vec::with_capacity(channels.len());
    for group in channels.chunk_by(|a, b| a.priority == b.priority) {
        let mut rest: Vec<&ModelChannel> = group.iter().collect();
        while !rest.is_empty() {
            let total: u64 = rest.iter().map(|c| u64::from(c.weight)).sum();
            let mut pick = fastrand::u64(0..total);
            let index = rest
                .iter()
                .position(|c| {
                    let weight = u64::from(c.weight);
                    if pick < weight {
                        true
                    } else {
                        pick -= weight;
                        false
                    }
                })
                .unwrap_or(0);
            order.push(rest.remove(index));
        }
    }
    order
}

impl Service<Request<Bytes>> for HttpUpstream {
    type Response = Response<UpstreamBody>;
    type Error = UpstreamError;
    type Future = ResponseFuture<Result<Response<UpstreamBody>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let generations = self.channels.load_full();
        let owners = self.owners.clone();
        let events = self.events.clone();
        let deadline = Instant::now() + self.call_deadline;
        ResponseFuture::new(async move {
            let routed = request
                .extensions()
                .get::<RoutedCall>()
                .cloned()
                .ok_or_else(|| UpstreamError::transport("no RoutedCall extension"))?;
            let mut failures: Vec<String> = Vec::new();
            let mut last_status = None;
            let mut retry_later: Option<(&ModelChannel, Instant)> = None;

            // Channels whose breaker is open are skipped, unless that would leave none at all.
            let mut order = attempt_order(&routed.model.channels);
            // A call that continues a stored response goes only where it is kept.
            if let Some(upstream) = &routed.upstream {
                order.retain(|channel| *channel.upstream.name == **upstream);
            }
            let now = Instant::now();
            let admitted: Vec<&ModelChannel> = order
                .iter()
                .copied()
                .filter(|c| channel_for(&generations, c).is_none_or(|ch| ch.breaker.admits(now)))
                .collect();
            for skipped in order.iter().filter(|c| !admitted.contains(c)) {
                if !admitted.is_empty() {
                    failures.push(format!("{}: skipped, circuit open", skipped.upstream.name));
                }
            }
            let plan = if admitted.is_empty() { order } else { admitted };

            for model_channel in plan {
                let name = &model_channel.upstream.name;
                let Some(channel) = channel_for(&generations, model_channel) else {
                    failures.push(format!("{name}: not configured"));
                    continue;
                };
                if Instant::now() >= deadline {
                    failures.push("call deadline reached".to_owned());
                    break;
                }
                let started = Instant::now();
                let outcome = channel
                    .attempt(
                        model_channel,
                        &routed,
                        &request,
                        deadline,
                        owners.as_deref(),
                    )
                    .await;
                let attempt = (outcome, started.elapsed());
                let recorded = record(
                    channel,
                    name,
                    attempt,
                    &mut failures,
                    &mut last_status,
                    events.as_ref(),
                );
                match recorded {
                    Next::Answer(answer) => return answer,
                    Next::GoOn(Some(wait)) => {
                        let at = Instant::now() + wait;
                        if retry_later.is_none() && at < deadline {
                            retry_later = Some((model_channel, at));
                        }
                    }
                    Next::GoOn(None) => {}
                }
            }

            if let Some((model_channel, at)) = retry_later
                && let Some(channel) = channel_for(&generations, model_channel)
            {
                tokio::time::sleep_until(at.into()).await;
                let started = Instant::now();
                let outcome = channel
                    .attempt(
                        model_channel,
                        &routed,
                        &request,
                        deadline,
                        owners.as_deref(),
                    )
                    .await;
                let attempt = (outcome, started.elapsed());
                let label = format!("{} after Retry-After", model_channel.upstream.name);
                if let Next::Answer(answer) = record(
                    channel,
                    &label,
                    attempt,
                    &mut failures,
                    &mut last_status,
                    events.as_ref(),
                ) {
                    return answer;
                }
            }
            Err(UpstreamError {
                status: last_status,
                message: failures.join("; "),
                client_message: None,
            })
        })
    }
}

impl HttpUpstream {
    /// Passes a request about a stored response (`GET`/`DELETE /v1/responses/{id}`,
    /// `POST .../cancel`, `GET .../input_items`; `path_and_query` as the client sent it, from
    /// `/v1`) to `upstream`, which keeps it, and answers as the provider answered (its key
    /// scrubbed). Not a call: not retried elsewhere, and the breaker is not fed.
    pub async fn stored_response(
        &self,
        upstream: &str,
        method: http::Method,
        path_and_query: &str,
        client_headers: &HeaderMap,
    ) -> Result<Response<Bytes>, UpstreamError> {
        let channels = self.current();
        let channel = channels
            .get(upstream)
            .ok_or_else(|| UpstreamError::transport(format!("{upstream}: not configured")))?;
        let api_key = channel.api_key.clone().ok_or_else(|| {
            UpstreamError::transport(format!(
                "provider key variable {} is not set",
                channel.config.api_key_env
            ))
        })?;
        let path = path_and_query.strip_prefix("/v1").unwrap_or(path_and_query);
        let reply = channel
            .client
            .request(method, format!("{}{path}", channel.config.base_url))
            .headers(channel.headers(client_headers, api_key))
            .timeout(channel.config.timeout)
            .send()
            .await
            .map_err(|error| UpstreamError::transport(transport_error(error)))?;
        channel.answer_as_is(reply).await
    }

    /// Counts the tokens of a messages request at the model's first channel that is up (an
    /// Anthropic-style upstream), and answers as the provider answered. Not a call: nothing is
    /// retried elsewhere, and the breaker is not fed.
    pub async fn count_tokens(
        &self,
        routed: &RoutedCall,
        client_headers: &HeaderMap,
        body: &Bytes,
    ) -> Result<Response<Bytes>, UpstreamError> {
        let now = Instant::now();
        let channels = self.current();
        let order = attempt_order(&routed.model.channels);
        let pick = order
            .iter()
            .copied()
            .filter(|c| {
                channels
                    .get(&c.upstream.name)
                    .is_some_and(|ch| ch.config.kind == UpstreamKind::Anthropic)
            })
            // Channels whose breaker admits come first, in their order.
            .min_by_key(|c| !channels[&c.upstream.name].breaker.admits(now))
            .ok_or_else(|| UpstreamError::transport("no Anthropic-style channel for this model"))?;
        let channel = &channels[&pick.upstream.name];
        let api_key = channel.api_key.clone().ok_or_else(|| {
            UpstreamError::transport(format!(
                "provider key variable {} is not set",
                channel.config.api_key_env
            ))
        })?;
        let reply = channel
            .client
            .post(format!(
                "{}/v1/messages/count_tokens",
                channel.config.base_url
            ))
            .headers(channel.headers(client_headers, api_key))
            .timeout(channel.config.timeout)
            .body(routed.upstream_body(body, pick.upstream_model.as_deref()))
            .send()
            .await
            .map_err(|error| UpstreamError::transport(transport_error(error)))?;
        channel.answer_as_is(reply).await
    }
}

/// What the failover loop does after one attempt.
enum Next {
    /// Stop: the call's answer.
    Answer(Result<Response<UpstreamBody>, UpstreamError>),
    /// Try the next channel; a 429's `Retry-After`, if it gave one.
    GoOn(Option<Duration>),
}

/// Feeds one attempt's outcome (and how long it took) to the channel's breaker, the metrics and
/// the call's list of failures (labelled `label`), and says whether the call is decided.
fn record(
    channel: &Channel,
    label: &str,
    (outcome, took): (Result<Response<UpstreamBody>, AttemptError>, Duration),
    failures: &mut Vec<String>,
    last_status: &mut Option<u16>,
    events: Option<&Arc<dyn EventOutbox>>,
) -> Next {
    let kind = match &outcome {
        Ok(_) => "ok",
        Err(AttemptError::Rejected(_)) => "rejected",
        Err(AttemptError::Retryable { .. }) => "retryable",
    };
    let name = &channel.config.name;
    crate::telemetry::upstream_attempt(name, kind, took.as_secs_f64());
    let (next, turned) = record_outcome(channel, label, outcome, failures, last_status);
    crate::telemetry::breaker(name, !channel.breaker.admits(Instant::now()));
    if let (Some(kind), Some(events)) = (turned, events) {
        // Recorded aside: a store that is slow or down never holds the call up.
        let event = WebhookEvent::new(kind, serde_json::json!({ "upstream": name }), Utc::now());
        let events = events.clone();
        tokio::spawn(async move {
            if let Err(error) = events.record_event(&event).await {
                tracing::warn!(%error, "could not record the breaker's event");
            }
        });
    }
    next
}

/// What to do next, and the breaker's turn if it opened or closed.
fn record_outcome(
    channel: &Channel,
    label: &str,
    outcome: Result<Response<UpstreamBody>, AttemptError>,
    failures: &mut Vec<String>,
    last_status: &mut Option<u16>,
) -> (Next, Option<EventType>) {
    match outcome {
        Ok(response) => {
            let closed = channel.breaker.record_success();
            let turned = closed.then_some(EventType::UpstreamBreakerClosed);
            (Next::Answer(Ok(response)), turned)
        }
        Err(AttemptError::Rejected(mut error)) => {
            failures.push(std::mem::take(&mut error.message));
            error.message = failures.join("; ");
            (Next::Answer(Err(error)), None)
        }
        Err(AttemptError::Retryable {
            status,
            message,
            retry_after,
        }) => {
            let opened = channel.breaker.record_failure(Instant::now());
            failures.push(format!("{label}: {message}"));
            *last_status = status.or(*last_status);
            let turned = opened.then_some(EventType::UpstreamBreakerOpened);
            (Next::GoOn(retry_after), turned)
        }
    }
}
