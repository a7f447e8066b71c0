//! What a provider's answer means: billable (with its usage), worth another channel, or the
//! client's own fault; and how long a 429 asks to wait. The upstreams (which retry) and
//! [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) (which bills) both decide through
//! this one module.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use crate::error::UpstreamError;
use crate::protocol::{TokenUsage, reply_usage_raw};

/// Whether a complete reply is worth paying for: a 2xx whose body is a JSON object, with the
/// usage it reports (and its usage object as written). Anything else is the upstream's failure,
/// with its status kept.
pub(crate) fn complete_reply(
    status: StatusCode,
    body: &Bytes,
) -> Result<(TokenUsage, Option<String>), UpstreamError> {
    if !status.is_success() {
        return Err(UpstreamError::answered(status.as_u16(), body));
    }
    reply_usage_raw(body).ok_or_else(|| UpstreamError {
        status: Some(status.as_u16()),
        message: format!("answered {status} with a body that is not a JSON object"),
        client_message: None,
    })
}

/// Failures another channel may not share: rate limits, server errors, and the channel's own
/// credentials being refused (401/403), which says nothing about the client's request.
pub(crate) fn is_retryable(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::UNAUTHORIZED
        || status == StatusCode::FORBIDDEN
        || status.is_server_error()
        || status.is_redirection()
}

/// `retry-after-ms` (`OpenAI`), or `retry-after` in seconds or as an HTTP date (a date already
/// past means now).
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: &str| Some(headers.get(name)?.to_str().ok()?.trim());
    let number = |name: &str| -> Option<f64> {
        let value: f64 = text(name)?.parse().ok()?;
        (value.is_finite() && value >= 0.0).then_some(value)
    };
    let date = || {
        let at = httpdate::parse_http_date(text("retry-after")?).ok()?;
        Some(
            at.duration_since(std::time::SystemTime::now())
                .unwrap_or_default(),
        )
    };
    number("retry-after-ms")
        .map(|ms| Duration::from_secs_f64(ms / 1000.0))
        .or_else(|| number("retry-after").map(Duration::from_secs_f64))
        .or_else(date)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, header};

    #[test]
    fn a_2xx_json_object_is_billable_with_its_usage() {
        let body = Bytes::from_static(br#"{"usage":{"input_tokens":5,"output_tokens":6}}"#);
        let (usage, raw) = complete_reply(StatusCode::OK, &body).unwrap();
        assert_eq!(usage.output_tokens, Some(6));
        assert_eq!(
            raw.as_deref(),
            Some(r#"{"input_tokens":5,"output_tokens":6}"#),
            "the usage object as the provider wrote it"
        );
    }

    #[test]
    fn a_2xx_that_is_not_a_json_object_is_a_failure() {
        let error = complete_reply(StatusCode::OK, &Bytes::from_static(b"not json")).unwrap_err();
        assert_eq!(error.status, Some(200));
    }

    #[test]
    fn a_non_2xx_reply_is_a_failure_that_keeps_the_status() {
        let body = Bytes::from_static(br#"{"error":"overloaded"}"#);
        let error = complete_reply(StatusCode::TOO_MANY_REQUESTS, &body).unwrap_err();
        assert_eq!(error.status, Some(429));
        assert!(error.message.contains("overloaded"));
    }

    #[test]
    fn retry_after_reads_seconds_and_milliseconds() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(2)));
        headers.insert("retry-after-ms", HeaderValue::from_static("150"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(150)));
        let past = HeaderMap::from_iter([(
            header::RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        )]);
        assert_eq!(retry_after(&past), Some(Duration::ZERO));
        let garbled =
            HeaderMap::from_iter([(header::RETRY_AFTER, HeaderValue::from_static("soon"))]);
        assert_eq!(retry_after(&garbled), None);
    }

    #[test]
    fn retry_after_reads_an_http_date() {
        let in_three_seconds = std::time::SystemTime::now() + Duration::from_secs(3);
        let date = httpdate::fmt_http_date(in_three_seconds);
        let headers = HeaderMap::from_iter([(header::RETRY_AFTER, date.parse().unwrap())]);
        let wait = retry_after(&headers).unwrap();
        // The date has whole seconds: three from now, less what was cut off and what has passed.
        assert!(
            wait > Duration::from_secs(1) && wait <= Duration::from_secs(3),
            "{wait:?}"
        );
    }

    #[test]
    fn only_request_errors_are_final() {
        for status in [400, 404, 413, 422] {
            assert!(
                !is_retryable(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
        for status in [401, 403, 429, 500, 502, 503, 529] {
            assert!(
                is_retryable(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
    }
}
