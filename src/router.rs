//! [`ProtocolRouter`]: which endpoint, which model, at what price.
//!
//! Decides the protocol from the path (`/v1/chat/completions` or `/v1/messages`), reads the body
//! up to a size limit, checks the few fields the gateway needs, finds `model` in the
//! [`Catalogue`] and checks that its protocol matches the endpoint. It adds the [`RoutedCall`]
//! extension and hands the inner service the body as [`Bytes`], exactly as the client sent it.
//!
//! Refusals: unknown path 404, other methods than `POST` 405, a body over the limit 413, a
//! malformed request 400, an unknown model or a model of the other protocol 404 `模型不存在`.
//!
//! ```
//! use std::{convert::Infallible, sync::Arc};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use model_gateway::{Catalogue, ProtocolRouterLayer, RoutedCall};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let service = ServiceBuilder::new()
//!     .layer(ProtocolRouterLayer::new(Arc::new(Catalogue::demo())))
//!     .service(service_fn(|request: Request<Bytes>| async move {
//!         let routed = request.extensions().get::<RoutedCall>().unwrap();
//!         Ok::<_, Infallible>(Response::new(Full::<Bytes>::from(routed.model.price.to_string())))
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
use http::{Method, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Deserialize;
use serde_json::value::RawValue;
use tower_layer::Layer;
use tower_service::Service;

use crate::call::RoutedCall;
use crate::catalogue::Catalogue;
use crate::error::GatewayError;
use crate::protocol::Protocol;
use crate::{BoxError, BoxFuture};

/// Default body limit: 32 MiB, room for a few base64 images.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// Configuration of [`ProtocolRouter`]: the catalogue and the body limit.
#[derive(Debug, Clone)]
#[must_use]
pub struct ProtocolRouterLayer {
    catalogue: Arc<Catalogue>,
    max_body_bytes: usize,
    streaming: bool,
}

impl ProtocolRouterLayer {
    /// Routes against `catalogue`, with the default body limit; streaming as the catalogue
    /// says ([`Catalogue::streaming`]).
    pub fn new(catalogue: Arc<Catalogue>) -> ProtocolRouterLayer {
        ProtocolRouterLayer {
            streaming: catalogue.streaming(),
            catalogue,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }

    /// Lets `stream: true` through (marked on the [`RoutedCall`]) instead of refusing it with
    /// 400. The layers inside must be able to stream: [`stack`](crate::stack) is.
    pub fn streaming(mut self, streaming: bool) -> ProtocolRouterLayer {
        self.streaming = streaming;
        self
    }

    /// Refuses bodies over `limit` bytes with 413.
    pub fn max_body_bytes(mut self, limit: usize) -> ProtocolRouterLayer {
        self.max_body_bytes = limit;
        self
    }
}

impl<S> Layer<S> for ProtocolRouterLayer {
    type Service = ProtocolRouter<S>;

    fn layer(&self, inner: S) -> ProtocolRouter<S> {
        ProtocolRouter {
            inner,
            catalogue: self.catalogue.clone(),
            max_body_bytes: self.max_body_bytes,
            streaming: self.streaming,
        }
    }
}

/// Middleware that reads and checks the request and adds the [`RoutedCall`] extension.
#[derive(Debug, Clone)]
pub struct ProtocolRouter<S> {
    inner: S,
    catalogue: Arc<Catalogue>,
    max_body_bytes: usize,
    streaming: bool,
}

impl<S> ProtocolRouter<S> {
    /// A [`ProtocolRouterLayer`] over `catalogue`.
    pub fn layer(catalogue: Arc<Catalogue>) -> ProtocolRouterLayer {
        ProtocolRouterLayer::new(catalogue)
    }
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
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let catalogue = self.catalogue.clone();
        let limit = self.max_body_bytes;
        let streaming = self.streaming;
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            match read_and_route(request, &catalogue, limit, streaming).await {
                Ok(request) => inner.call(request).await,
                Err(refusal) => Ok(refusal.into_response()),
            }
        })
    }
}

async fn read_and_route<B>(
    request: Request<B>,
    catalogue: &Catalogue,
    limit: usize,
    streaming: bool,
) -> Result<Request<Bytes>, GatewayError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let protocol = Protocol::from_path(request.uri().path()).ok_or(GatewayError::UnknownPath)?;
    if request.method() != Method::POST {
        return Err(GatewayError::MethodNotAllowed);
    }
    let declared_length = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared_length.is_some_and(|length| length > limit as u64) {
        return Err(GatewayError::PayloadTooLarge);
    }
    let (mut parts, body) = request.into_parts();
    let body = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => return Err(GatewayError::PayloadTooLarge),
        Err(_) => return Err(GatewayError::UnreadableBody),
    };
    let routed = route(catalogue, protocol, &body, streaming)?;
    parts.extensions.insert(routed);
    Ok(Request::from_parts(parts, body))
}

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
    stream: Option<&'a RawValue>,
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
    // serde would also accept an array for a struct; requests are objects.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(GatewayError::InvalidJson);
    }
    let envelope: Envelope = serde_json::from_slice(body).map_err(|_| GatewayError::InvalidJson)?;

    let model_raw = envelope.model.ok_or(GatewayError::InvalidModelField)?;
    let model_name = json_string(model_raw).ok_or(GatewayError::InvalidModelField)?;
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
    let stream = match envelope.stream.map(RawValue::get) {
        None | Some("false") | Some("null") => false,
        Some("true") if streaming => true,
        Some("true") => return Err(GatewayError::StreamingUnsupported),
        Some(_) => return Err(GatewayError::InvalidStreamField),
    };

    let model = catalogue
        .model(&model_name)
        .filter(|model| model.protocol == protocol)
        .ok_or(GatewayError::ModelNotFound)?;
    // The raw value borrows from `body`, so its position in `body` is where the model sits.
    let start = model_raw.get().as_ptr() as usize - body.as_ptr() as usize;
    Ok(RoutedCall {
        protocol,
        model: model.clone(),
        stream,
        model_span: start..start + model_raw.get().len(),
    })
}

/// The string a raw JSON value holds, borrowed when it has no escapes.
fn json_string(raw: &RawValue) -> Option<std::borrow::Cow<'_, str>> {
    if let Ok(plain) = serde_json::from_str::<&str>(raw.get()) {
        return Some(plain.into());
    }
    serde_json::from_str::<String>(raw.get())
        .ok()
        .map(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route_chat(body: &str) -> Result<RoutedCall, GatewayError> {
        route(
            &Catalogue::demo(),
            Protocol::ChatCompletions,
            body.as_bytes(),
            false,
        )
    }

    fn route_messages(body: &str) -> Result<RoutedCall, GatewayError> {
        route(
            &Catalogue::demo(),
            Protocol::Messages,
            body.as_bytes(),
            false,
        )
    }

    #[test]
    fn with_streaming_on_stream_true_is_routed_and_marked() {
        let body = br#"{"model":"gpt-4o-mini","messages":[],"stream":true}"#;
        let catalogue = Catalogue::demo();
        let routed = route(&catalogue, Protocol::ChatCompletions, body, true).unwrap();
        assert!(routed.stream);
        let plain = br#"{"model":"gpt-4o-mini","messages":[],"stream":false}"#;
        assert!(
            !route(&catalogue, Protocol::ChatCompletions, plain, true)
                .unwrap()
                .stream
        );
        let wrong = br#"{"model":"gpt-4o-mini","messages":[],"stream":1}"#;
        assert_eq!(
            route(&catalogue, Protocol::ChatCompletions, wrong, true).unwrap_err(),
            GatewayError::InvalidStreamField
        );
    }

    #[test]
    fn a_chat_request_resolves_its_model_and_price() {
        let routed =
            route_chat(r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#)
                .unwrap();
        assert_eq!(routed.model.name, "gpt-4o-mini");
        assert_eq!(routed.model.price.get(), 2);
    }

    #[test]
    fn malformed_requests_get_a_precise_400() {
        let cases = [
            ("not json", GatewayError::InvalidJson),
            (r#"[{"model":"gpt-4o-mini"}]"#, GatewayError::InvalidJson),
            (
                r#"{"model":"gpt-4o-mini","messages":[]"#,
                GatewayError::InvalidJson,
            ),
            (r#"{"messages":[]}"#, GatewayError::InvalidModelField),
            (
                r#"{"model":7,"messages":[]}"#,
                GatewayError::InvalidModelField,
            ),
            (
                r#"{"model":"gpt-4o-mini"}"#,
                GatewayError::InvalidMessagesField,
            ),
            (
                r#"{"model":"gpt-4o-mini","messages":"hi"}"#,
                GatewayError::InvalidMessagesField,
            ),
            (
                r#"{"model":"gpt-4o-mini","messages":[],"stream":true}"#,
                GatewayError::StreamingUnsupported,
            ),
            (
                r#"{"model":"gpt-4o-mini","messages":[],"stream":"yes"}"#,
                GatewayError::InvalidStreamField,
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(route_chat(body).unwrap_err(), expected, "{body}");
        }
    }

    #[test]
    fn messages_requires_a_positive_max_tokens() {
        let model = "claude-haiku-4-5";
        for max_tokens in ["", r#","max_tokens":0"#, r#","max_tokens":"10""#] {
            let body = format!(r#"{{"model":"{model}","messages":[]{max_tokens}}}"#);
            assert_eq!(
                route_messages(&body).unwrap_err(),
                GatewayError::InvalidMaxTokens
            );
        }
        let body = format!(r#"{{"model":"{model}","messages":[],"max_tokens":5}}"#);
        assert!(route_messages(&body).is_ok());
    }

    #[test]
    fn a_model_of_the_other_protocol_is_not_found_on_either_endpoint() {
        let messages_model = r#"{"model":"claude-haiku-4-5","max_tokens":5,"messages":[]}"#;
        assert_eq!(
            route_chat(messages_model).unwrap_err(),
            GatewayError::ModelNotFound
        );
        let chat_model = r#"{"model":"gpt-4o-mini","max_tokens":5,"messages":[]}"#;
        assert_eq!(
            route_messages(chat_model).unwrap_err(),
            GatewayError::ModelNotFound
        );
        let unknown = r#"{"model":"no-such-model","messages":[]}"#;
        assert_eq!(
            route_chat(unknown).unwrap_err(),
            GatewayError::ModelNotFound
        );
    }

    #[test]
    fn malformed_is_reported_before_an_unknown_model() {
        let body = r#"{"model":"no-such-model","messages":[],"stream":true}"#;
        assert_eq!(
            route_chat(body).unwrap_err(),
            GatewayError::StreamingUnsupported
        );
    }

    #[test]
    fn an_escaped_model_name_still_resolves() {
        let routed = route_chat(r#"{"model":"gpt\u002d4o-mini","messages":[]}"#).unwrap();
        assert_eq!(routed.model.name, "gpt-4o-mini");
    }

    #[test]
    fn upstream_model_renames_only_the_model_value() {
        let body = Bytes::from_static(
            br#"{ "temperature" : 0.70, "model" : "house-chat", "messages":[{"x":1e3}] }"#,
        );
        let routed = route_chat(std::str::from_utf8(&body).unwrap()).unwrap();
        let upstream_model = routed.model.channels[0].upstream_model.as_deref();
        assert_eq!(
            routed.upstream_body(&body, upstream_model),
            Bytes::from_static(
                br#"{ "temperature" : 0.70, "model" : "qwen2.5-7b-instruct", "messages":[{"x":1e3}] }"#
            )
        );
    }

    #[test]
    fn without_upstream_model_the_body_is_forwarded_as_is() {
        let body = Bytes::from_static(br#"{"model":"gpt-4o-mini","messages":[],"n":1.0}"#);
        let routed = route_chat(std::str::from_utf8(&body).unwrap()).unwrap();
        assert_eq!(routed.model.channels[0].upstream_model, None);
        assert_eq!(routed.upstream_body(&body, None), body);
    }
}
