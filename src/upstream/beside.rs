//! Requests beside the calls, passed to one channel as they are: a stored response's reads
//! and deletes, and counting a request's tokens. Not calls: nothing is charged,
//! nothing is retried elsewhere, and no breaker is fed.

use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Method, Response, StatusCode, header};

use super::channel::{Channel, read_capped};
use super::failover::attempt_order;
use super::http_client::HttpUpstream;
use super::transport::transport_error;
use crate::call::RoutedCall;
use crate::catalogue::ModelChannel;
use crate::error::UpstreamError;

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

    /// Counts the tokens of a request (messages, or Gemini's) at the model's first channel
    /// that is up and counts them (an upstream that speaks the request's protocol), and
    /// answers as the provider answered; a model without one (its calls translated) has them
    /// counted by the gateway ([`local_input_tokens`](crate::protocol::messages::local_input_tokens)
    /// for messages). Not a call: nothing is retried elsewhere, and the breaker is not fed.
    pub async fn count_tokens(
        &self,
        routed: &RoutedCall,
        client_headers: &HeaderMap,
        body: &Bytes,
    ) -> Result<Response<Bytes>, UpstreamError> {
        let now = Instant::now();
        let channels = self.current();
        let dialect = routed.protocol.dialect();
        let order = attempt_order(&routed.model.channels);
        let path_at = |pick: &ModelChannel| {
            let channel = channels.get(&pick.upstream.name)?;
            // A platform hosting the models counts at paths of its own: the gateway counts.
            if channel.hosted.is_some() {
                return None;
            }
            let model = pick.upstream_model.as_deref().unwrap_or(&routed.model.name);
            dialect.count_tokens_path(channel.config.kind, model)
        };
        let pick = order
            .iter()
            .copied()
            .filter(|pick| path_at(pick).is_some())
            // Channels whose breaker admits come first, in their order.
            .min_by_key(|c| !channels[&c.upstream.name].breaker.admits(now));
        let Some((pick, path)) = pick.and_then(|pick| Some((pick, path_at(pick)?))) else {
            return Ok(counted_here(routed, body));
        };
        let channel = &channels[&pick.upstream.name];
        let url = format!("{}{path}", channel.config.base_url);
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

/// The answer to a count request no provider of its model counts: the gateway's count, or
/// `400` naming what cannot be counted.
fn counted_here(routed: &RoutedCall, body: &[u8]) -> Response<Bytes> {
    let dialect = routed.protocol.dialect();
    let (status, answer) = match dialect.counted_here(body) {
        Ok(tokens) => (StatusCode::OK, dialect.count_reply(tokens)),
        Err(refused) => (
            refused.status(),
            serde_json::json!({ "detail": refused.detail() }),
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
