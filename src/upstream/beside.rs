//! Requests beside the calls, passed to one channel as they are: a stored response's reads
//! and deletes, and counting a messages request's tokens. Not calls: nothing is charged,
//! nothing is retried elsewhere, and no breaker is fed.

use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Method, Response, StatusCode, header};

use super::channel::{Channel, read_capped, transport_error};
use super::failover::attempt_order;
use super::http_client::HttpUpstream;
use crate::call::RoutedCall;
use crate::catalogue::{BuiltinTools, UpstreamKind};
use crate::error::{GatewayError, UpstreamError};
use crate::protocol::messages::{MessagesAsChat, local_input_tokens};

impl HttpUpstream {
    /// Passes a request about a stored response (`GET`/`DELETE /v1/responses/{id}`,
    /// `POST .../cancel`, `GET .../input_items`; `path_and_query` as the client sent it, from
    /// `/v1`) to `upstream`, which keeps it, and answers as the provider answered (its key
    /// scrubbed). Not a call: not retried elsewhere, and the breaker is not fed.
    pub async fn stored_response(
        &self,
        upstream: &str,
        method: Method,
        path_and_query: &str,
        client_headers: &HeaderMap,
    ) -> Result<Response<Bytes>, UpstreamError> {
        let channels = self.current();
        let channel = channels
            .get(upstream)
            .ok_or_else(|| UpstreamError::transport(format!("{upstream}: not configured")))?;
        let path = path_and_query.strip_prefix("/v1").unwrap_or(path_and_query);
        let url = format!("{}{path}", channel.config.base_url);
        channel.beside(method, url, client_headers, None).await
    }

    /// Counts the tokens of a messages request at the model's first channel that is up (an
    /// Anthropic-style upstream), and answers as the provider answered; a model without one
    /// (its messages calls translated to chat completions) has them counted by the gateway
    /// ([`local_input_tokens`]). Not a call: nothing is retried elsewhere, and the breaker is
    /// not fed.
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
            .min_by_key(|c| !channels[&c.upstream.name].breaker.admits(now));
        let Some(pick) = pick else {
            return Ok(counted_here(body));
        };
        let channel = &channels[&pick.upstream.name];
        let url = format!("{}/v1/messages/count_tokens", channel.config.base_url);
        let body = routed.upstream_body(body, pick.upstream_model.as_deref());
        (channel.beside(Method::POST, url, client_headers, Some(body))).await
    }
}

impl Channel {
    /// Sends a request beside the calls to this upstream, with its key and the client headers
    /// it takes, within its time-out, and answers as the provider answered.
    async fn beside(
        &self,
        method: Method,
        url: String,
        client_headers: &HeaderMap,
        body: Option<Bytes>,
    ) -> Result<Response<Bytes>, UpstreamError> {
        let api_key = self.api_key.clone().ok_or_else(|| {
            UpstreamError::transport(format!(
                "provider key variable {} is not set",
                self.config.api_key_env
            ))
        })?;
        let mut request = (self.client.request(method, url))
            .headers(self.headers(client_headers, api_key))
            .timeout(self.config.timeout);
        if let Some(body) = body {
            request = request.body(body);
        }
        let reply = request
            .send()
            .await
            .map_err(|error| UpstreamError::transport(transport_error(error)))?;
        self.answer_as_is(reply).await
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
}

/// The answer to `count_tokens` for a messages request no provider of its model counts: the
/// gateway's count of its translation, or `400` naming what does not translate.
fn counted_here(body: &[u8]) -> Response<Bytes> {
    let (status, answer) = match MessagesAsChat::from_slice_with(body, BuiltinTools::Drop) {
        Ok(translated) => (
            StatusCode::OK,
            serde_json::json!({ "input_tokens": local_input_tokens(&translated) }),
        ),
        Err(untranslatable) => (
            StatusCode::BAD_REQUEST,
            serde_json::json!({ "detail": GatewayError::from(untranslatable).detail() }),
        ),
    };
    let mut response = Response::new(Bytes::from(answer.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}
