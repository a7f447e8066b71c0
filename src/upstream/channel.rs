//! One provider endpoint: its client, where each protocol's calls go, the headers it takes,
//! and one attempt of a call on it (a complete reply read within its limit, or an event stream
//! handed on once its first event arrived), classified for the failover
//! ([`AttemptError`]). A Responses call to an upstream that speaks only chat completions is
//! translated here, both ways.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;

use super::breaker::CircuitBreaker;
use super::failover::AttemptError;
use super::hosted::Hosted;
use super::translated::TranslatedStream;
use super::transport::transport_error;
use crate::call::{RawUsage, RoutedCall, ServedBy, Spoke};
use crate::catalogue::{ModelChannel, UpstreamConfig};
use crate::classify::{complete_reply, is_retryable, retry_after};
use crate::error::{UpstreamError, excerpt};
use crate::pricing::estimated_text_tokens;
use crate::protocol::responses;
use crate::protocol::sse::EventSplitter;
use crate::protocol::translate::Needs;
use crate::protocol::translation::Translation;
use crate::protocol::{Protocol, provider_message};
use crate::reply::{Inner, ProviderUsage, UpstreamBody};
use crate::store::rules::usage::{Counted, unreported};

/// The id of the response a native Responses upstream answered with and keeps, and that
/// upstream: set on the reply of an attempt asked to read it, for the record of who made it.
#[derive(Debug, Clone)]
pub(super) struct ProviderResponseId {
    pub(super) id: String,
    pub(super) upstream: String,
}

pub(super) struct Channel {
    pub(super) config: Arc<UpstreamConfig>,
    pub(super) client: reqwest::Client,
    /// The provider key as a header value; `None` when the variable is unset, in which case
    /// this channel fails without being contacted.
    pub(super) api_key: Option<HeaderValue>,
    /// The provider key in clear, only to scrub it from anything the provider echoes back.
    pub(super) secret: Option<String>,
    /// Shared with the same upstream's channel in the catalogues after a reload that kept it.
    pub(super) breaker: Arc<CircuitBreaker>,
    /// How much of a provider's answer is read at most.
    pub(super) limits: ReadLimits,
    /// Where each protocol's calls go, parsed once.
    pub(super) endpoints: Endpoints,
    /// The platform hosting the provider's models, with its credentials; `None` for the
    /// provider's own API.
    pub(super) hosted: Option<Arc<Hosted>>,
}

/// The URL a call of each protocol goes to on one upstream, parsed when the channel is made:
/// given text, reqwest would parse it again (and check its host name) on every call.
#[derive(Debug, Clone)]
pub(super) struct Endpoints(Vec<(Protocol, reqwest::Url)>);

impl Endpoints {
    pub(super) fn of(config: &UpstreamConfig) -> Endpoints {
        let parsed = Protocol::ALL.into_iter().filter_map(|protocol| {
            let url = reqwest::Url::parse(&url(config, protocol)?).ok()?;
            Some((protocol, url))
        });
        Endpoints(parsed.collect())
    }

    fn get(&self, protocol: Protocol) -> Option<&reqwest::Url> {
        let at = self.0.iter().position(|(each, _)| *each == protocol)?;
        Some(&self.0[at].1)
    }
}

/// Where a call of `protocol` goes on the upstream `config`, as its dialect says; `None` where
/// the upstream does not serve it (the catalogue checked that it does).
fn url(config: &UpstreamConfig, protocol: Protocol) -> Option<String> {
    let route = protocol.dialect().upstream(config.kind, config.responses)?;
    Some(format!("{}{}", config.base_url, route.path))
}

/// Whether a call of `protocol` is translated on its way to the upstream `config` and back: a
/// Responses call to an upstream that speaks only chat completions.
fn translates(config: &UpstreamConfig, protocol: Protocol) -> bool {
    protocol
        .dialect()
        .upstream(config.kind, config.responses)
        .is_some_and(|route| route.translated)
}

/// How much of a provider's answer the gateway reads at most, so that a provider sending a
/// reply or an event without end cannot take the gateway's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ReadLimits {
    /// A complete reply.
    pub(super) reply: usize,
    /// One event of a stream, or its unfinished tail.
    pub(super) event: usize,
}

/// Reads a whole reply, at most `max` bytes: a larger one (declared or as it arrives) is an
/// error, read no further. Most replies arrive in one chunk and are kept without a copy.
pub(super) async fn read_capped(mut reply: reqwest::Response, max: usize) -> Result<Bytes, String> {
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

impl Channel {
    /// Starts a call of `routed` (on `channel`) to this upstream: at the route the call's
    /// dialect gives, with the model (the channel's name for it) and the stream in the path
    /// where the upstream's protocol puts them there (the Gemini API's).
    fn post(&self, channel: &ModelChannel, routed: &RoutedCall) -> reqwest::RequestBuilder {
        if let Some(hosted) = &self.hosted {
            let model = channel
                .upstream_model
                .as_deref()
                .unwrap_or(&routed.model.name);
            let path = hosted.call_path(model, routed.stream);
            return self.client.post(format!("{}{path}", self.config.base_url));
        }
        let protocol = routed.protocol;
        let route = protocol
            .dialect()
            .upstream(self.config.kind, self.config.responses);
        if let Some(route) = route {
            let model = channel
                .upstream_model
                .as_deref()
                .unwrap_or(&routed.model.name);
            let speaks = self.config.kind.speaks();
            if let Some(path) = speaks.call_path(route.path, model, routed.stream) {
                return self.client.post(format!("{}{path}", self.config.base_url));
            }
        }
        match self.endpoints.get(protocol) {
            Some(parsed) => self.client.post(parsed.clone()),
            // A URL that does not parse: reqwest says why when the call is sent.
            None => self
                .client
                .post(url(&self.config, protocol).unwrap_or_else(|| self.config.base_url.clone())),
        }
    }

    /// Whether a call of `protocol` is translated on its way to this upstream and back.
    fn translates(&self, protocol: Protocol) -> bool {
        translates(&self.config, protocol)
    }

    /// The body sent for a call, and, for a translated call, the translation (which reads the
    /// reply back).
    fn request_body(
        &self,
        channel: &ModelChannel,
        routed: &RoutedCall,
        body: &Bytes,
    ) -> Result<(Bytes, Option<Arc<Translation>>), AttemptError> {
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
        let kind = self.config.kind;
        let translation = match routed.translation() {
            Some(translation) => translation,
            None => {
                let needs = Needs::for_kind(
                    kind,
                    self.config.builtin_tools,
                    routed.model.max_output_tokens.map(u64::from),
                );
                let translated = translate(routed.protocol, body, needs)
                    .ok_or_else(|| refused("this call does not translate here".to_owned()))?;
                Arc::new(translated.map_err(|error| refused(error.detail().into_owned()))?)
            }
        };
        let model = channel
            .upstream_model
            .as_deref()
            .unwrap_or(&routed.model.name);
        let sent = translation
            .upstream_body(kind, model)
            .ok_or_else(|| refused("this call does not translate here".to_owned()))?;
        Ok((Bytes::from(sent), Some(translation)))
    }

    /// The headers of a call: those the upstream's kind takes (see
    /// [`UpstreamDialect::headers`]).
    pub(super) fn headers(&self, client_headers: &HeaderMap, api_key: HeaderValue) -> HeaderMap {
        self.config.kind.speaks().headers(client_headers, api_key)
    }

    /// A call's request, whole and with its credentials: the provider key in its header, or,
    /// where a platform hosts the models, the platform's body and headers, signed or carrying
    /// its token. A failure says why the channel cannot be called, without a secret.
    async fn request(
        &self,
        channel: &ModelChannel,
        routed: &RoutedCall,
        client_headers: &HeaderMap,
        body: Bytes,
    ) -> Result<reqwest::Request, String> {
        let Some(hosted) = &self.hosted else {
            let api_key = self.api_key.clone().ok_or_else(|| {
                format!(
                    "provider key variable {} is not set",
                    self.config.api_key_env
                )
            })?;
            return (self.post(channel, routed))
                .headers(self.headers(client_headers, api_key))
                .body(body)
                .build()
                .map_err(transport_error);
        };
        let speaks = self.config.kind.speaks();
        let on = hosted.on();
        let body = speaks
            .hosted_body(&body, on, client_headers)
            .unwrap_or(body);
        let mut request = (self.post(channel, routed))
            .headers(speaks.hosted_headers(on, client_headers))
            .body(body)
            .build()
            .map_err(transport_error)?;
        hosted.authorize(&mut request).await?;
        Ok(request)
    }

    /// A 2xx answer to a streamed call: an event stream is handed on once its first event has
    /// arrived, so that a provider failing before that is still failed over; anything else is
    /// this channel's failure.
    async fn event_stream(
        &self,
        reply: reqwest::Response,
        first_event_within: Duration,
        translated: Option<&Translation>,
    ) -> Result<(Response<UpstreamBody>, Bytes), AttemptError> {
        let status = reply.status();
        let failed = |message: String| AttemptError::Retryable {
            status: Some(status.as_u16()),
            message,
            retry_after: None,
        };
        let content_type = reply.headers().get(header::CONTENT_TYPE).cloned();
        let expected = self
            .hosted
            .as_ref()
            .map_or("text/event-stream", |hosted| hosted.stream_content_type());
        let is_event_stream = content_type
            .as_ref()
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.trim_start().starts_with(expected));
        if !is_event_stream {
            return Err(failed(format!(
                "answered {status} to a streamed call without an event stream ({content_type:?})"
            )));
        }
        let body = http::Response::<reqwest::Body>::from(reply)
            .into_body()
            .map_err(|error| UpstreamError::transport(transport_error(error)));
        let mut body = match &self.hosted {
            // Bedrock's frames, as the events Anthropic's own API sends.
            Some(hosted) => hosted.events(body.boxed_unsync(), self.limits.event),
            None => body.boxed_unsync(),
        };
        let content_type = content_type.map(|value| match &self.hosted {
            Some(_) => HeaderValue::from_static("text/event-stream"),
            None => value,
        });
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
        let mut provider_usage = None;
        let events = match translated {
            Some(translation) => {
                let Inner::Events(chat) = events.into_inner() else {
                    unreachable!("`events_after` makes an event stream")
                };
                let kind = self.config.kind;
                let usage = ProviderUsage::default();
                provider_usage = Some(usage.clone());
                let translated = TranslatedStream::new(
                    chat,
                    translation.stream(kind),
                    kind.protocol(),
                    usage,
                    self.limits.event,
                );
                UpstreamBody::events(translated)
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
        if let Some(usage) = provider_usage {
            response.extensions_mut().insert(usage);
        }
        Ok((response, first_event))
    }

    /// Tells the service around the failover the id of the response this upstream keeps, to
    /// record who made it.
    fn tell_id<B>(&self, response: &mut Response<B>, id: String) {
        response.extensions_mut().insert(ProviderResponseId {
            id,
            upstream: self.config.name.clone(),
        });
    }

    /// Removes the provider key from text the provider sent back.
    pub(super) fn scrub(&self, text: String) -> String {
        let mut text = match &self.secret {
            Some(secret) if text.contains(secret.as_str()) => {
                text.replace(secret.as_str(), "[redacted]")
            }
            _ => text,
        };
        if let Some(hosted) = &self.hosted {
            for secret in hosted.secrets() {
                if !secret.is_empty() && text.contains(&secret) {
                    text = text.replace(&secret, "[redacted]");
                }
            }
        }
        text
    }

    pub(super) async fn attempt(
        &self,
        channel: &ModelChannel,
        routed: &RoutedCall,
        request: &Request<Bytes>,
        deadline: Instant,
        read_id: bool,
    ) -> Result<Response<UpstreamBody>, AttemptError> {
        let retryable = |status: Option<u16>, message: String| AttemptError::Retryable {
            status,
            message,
            retry_after: None,
        };
        if self.api_key.is_none() && self.hosted.is_none() {
            return Err(retryable(
                None,
                format!(
                    "provider key variable {} is not set",
                    self.config.api_key_env
                ),
            ));
        }
        let (body, translated) = self.request_body(channel, routed, request.body())?;
        let mut sent = self
            .request(channel, routed, request.headers(), body)
            .await
            .map_err(|message| retryable(None, message))?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        // A streamed reply's time limits (deadline, idle time-out) are kept by the billing layer
        // with one timer, which tells the client why; a reqwest time-out would poll a second
        // timer for every event. The wait for the answer and its first event is bounded below.
        if !routed.stream {
            *sent.timeout_mut() = Some(remaining.min(self.config.timeout));
        }
        let authorization = sent.headers().get(header::AUTHORIZATION).cloned();
        // The protocol this provider is asked in, for the call log.
        let spoke = match translated {
            Some(_) => self.config.kind.protocol(),
            None => routed.protocol,
        };
        let sent = self.client.execute(sent);
        let reply = tokio::time::timeout(remaining.min(self.config.timeout), sent)
            .await
            .map_err(|_| retryable(None, "timed out waiting for the answer".to_owned()))?
            .map_err(|error| retryable(None, transport_error(error)))?;
        let status = reply.status();
        if routed.stream && status.is_success() {
            let first_event = remaining.min(self.config.timeout);
            let (mut response, first) = self
                .event_stream(reply, first_event, translated.as_deref())
                .await?;
            response.extensions_mut().insert(Spoke(spoke));
            // Its id is in its first event (`response.created`'s `response.id`).
            if read_id && translated.is_none() {
                let first = crate::protocol::sse::event_text(&first);
                let data = crate::protocol::sse::Event::parse(&first).data;
                if let Some(id) = responses::response_id(data.as_bytes()) {
                    self.tell_id(&mut response, id);
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
            let (body, usage, id, raw) = match &translated {
                // Read once, for the response and for its usage.
                Some(translation) => {
                    let raw = crate::protocol::reply_usage_raw(&body).and_then(|(_, raw)| raw);
                    let (reply, usage) = translation
                        .reply(self.config.kind, &body)
                        .map_err(|()| not_an_object())?;
                    let mut usage = usage.ok_or_else(not_an_object)?;
                    if routed.model.pricing.is_metered() {
                        // Output the provider did not report is counted from its own reply,
                        // as for an untranslated call (the translated reply is longer or
                        // shorter), so that it costs the same by either endpoint.
                        let counted = Counted {
                            output: Some(estimated_text_tokens(body.len())),
                            ended: true,
                        };
                        usage = unreported(usage, counted);
                    }
                    (reply, usage, None, raw)
                }
                // A native Responses reply whose maker is recorded is read once, for its
                // usage and its id.
                None if read_id => {
                    let (usage, id) =
                        responses::reply_usage_and_id(&body).ok_or_else(not_an_object)?;
                    let raw = crate::protocol::reply_usage_raw(&body).and_then(|(_, raw)| raw);
                    (body, usage, id, raw)
                }
                None => {
                    let (usage, raw) = complete_reply(status, &body)
                        .map_err(|error| retryable(error.status, error.message))?;
                    (body, usage, None, raw)
                }
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
            if let Some(raw) = raw {
                response.extensions_mut().insert(RawUsage(raw));
            }
            response
                .extensions_mut()
                .insert(ServedBy(self.config.name.clone()));
            response.extensions_mut().insert(Spoke(spoke));
            if let Some(id) = id {
                self.tell_id(&mut response, id);
            }
            return Ok(response);
        }

        let mut message = self.scrub(format!("answered {status}: {}", excerpt(&body)));
        if let Some(hosted) = &self.hosted
            && matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
        {
            hosted.refused(authorization.as_ref());
            message = format!("the platform refused this upstream's credentials ({message})");
        }
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

/// The translation of a call of `protocol` with `body` that `needs` says, as the router would
/// have made it (for an embedder's stack without the router); `None` where `protocol` is not
/// translated so.
fn translate(
    protocol: Protocol,
    body: &[u8],
    needs: Needs,
) -> Option<Result<Translation, crate::error::GatewayError>> {
    let fields = crate::protocol::dialect::Fields::read(body).ok()?;
    let model = fields.model().ok()?;
    let name = model.name.clone().into_owned();
    let envelope = fields.into_envelope(model, true).ok()?;
    protocol
        .dialect()
        .translation(&envelope, &name, body, needs)
}
