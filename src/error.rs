//! Every refusal the gateway can give, and the one place that maps each to its HTTP status and
//! `{"detail": ...}` text.
//!
//! Layers return a [`GatewayError`]; only [`GatewayError::into_response`] formats JSON. A rejection
//! is an `Ok(response)` for the service, never a service error, so the client always has
//! something to read.
//!
//! The body is exactly `{"detail": "..."}` by default, as specified. An operator may choose
//! [`ErrorBody::Compatible`]: the same text is then also given in the error object of the
//! client's own protocol ([`ErrorShape`]), which the `OpenAI` SDKs and the clients built on
//! them read ([`GatewayError::compatible_body`]; the [`error_body`](crate::error_body) layer
//! writes it). Every answer the gateway refuses says whether asking again can help
//! (`x-should-retry`, which the official SDKs honour).
//!
//! ```
//! use bytes::Bytes;
//! use model_gateway::{GatewayError, error::ErrorShape};
//!
//! let refused: http::Response<Bytes> = GatewayError::InsufficientCredits.into_response();
//! assert_eq!(refused.status(), 402);
//! assert_eq!(refused.body(), r#"{"detail":"积分不足"}"#);
//! assert_eq!(refused.headers()["x-should-retry"], "false");
//!
//! let body = GatewayError::InsufficientCredits.compatible_body(ErrorShape::OpenAi);
//! let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
//! assert_eq!(body["detail"], "积分不足");
//! assert_eq!(body["error"]["message"], "积分不足");
//! assert_eq!(body["error"]["type"], "insufficient_quota");
//! ```

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use serde::Deserialize;

/// The header that tells the official SDKs whether to retry an answer.
pub const SHOULD_RETRY_HEADER: &str = "x-should-retry";

/// Which body the gateway's refusals have. An operator's choice: the catalogue's `error_body`,
/// `GATEWAY_ERROR_BODY` for the example gateway, [`Gateway::error_body`](crate::Gateway) in the
/// library.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorBody {
    /// Exactly `{"detail": "..."}`: the specified contract, and the default.
    #[default]
    Detail,
    /// `detail`, and beside it the same text in the error object of the client's protocol
    /// ([`GatewayError::compatible_body`]), so that clients which read only that object show
    /// the gateway's text.
    Compatible,
}

impl ErrorBody {
    /// The setting's name: `detail` or `compatible`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorBody::Detail => "detail",
            ErrorBody::Compatible => "compatible",
        }
    }
}

impl std::str::FromStr for ErrorBody {
    type Err = String;

    fn from_str(text: &str) -> Result<ErrorBody, String> {
        match text {
            "detail" => Ok(ErrorBody::Detail),
            "compatible" => Ok(ErrorBody::Compatible),
            other => Err(format!(
                "`{other}` is not an error body: `detail` or `compatible`"
            )),
        }
    }
}

/// Whose error object a client reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "code", "param"}}`: `OpenAI`'s, read by its SDKs and by
    /// the clients built on them (`LangChain`, `LiteLLM`, the AI SDK).
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`: Anthropic's.
    Anthropic,
    /// `{"error": {"code", "message", "status"}}`: Google's, read by the Gemini SDKs and CLI.
    Google,
}

impl ErrorShape {
    /// The shape a request to `path` with these headers reads: Anthropic's on `/v1/messages`
    /// and below it, and for a request that says `anthropic-version` (the Anthropic SDKs
    /// always do, on `/v1/models` too); `OpenAI`'s on the other `/v1/` paths. `None` outside
    /// `/v1/` (the probes, the admin API, the console): their scripts read `detail`. Google's
    /// on the Gemini API's paths: under `/v1beta/`, and a model's verb under `/v1/models/`.
    pub fn of_request(path: &str, headers: &HeaderMap) -> Option<ErrorShape> {
        // The Gemini API's paths (see `protocol::gemini::is_gemini_path`, above this module).
        let gemini_verb = path
            .strip_prefix("/v1/models/")
            .is_some_and(|target| target.contains(':'));
        if path.starts_with("/v1beta/") || gemini_verb {
            return Some(ErrorShape::Google);
        }
        let api = path.strip_prefix("/v1/")?;
        if api == "messages"
            || api.starts_with("messages/")
            || headers.contains_key("anthropic-version")
        {
            Some(ErrorShape::Anthropic)
        } else {
            Some(ErrorShape::OpenAi)
        }
    }
}

/// A request the gateway refuses, or a call it could not complete.
///
/// Its `Display` is English, for the operator's log; what the client reads is
/// [`detail`](GatewayError::detail), the contract's text, which [`into_response`](GatewayError::into_response)
/// sends as `{"detail": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// No key, an unknown key, or a revoked key.
    #[error("no, unknown or revoked API key")]
    InvalidApiKey,
    /// The body is not a JSON object.
    #[error("the request body is not a JSON object")]
    InvalidJson,
    /// `model` is missing or not a string.
    #[error("`model` is missing or not a string")]
    InvalidModelField,
    /// `messages` is missing or not an array.
    #[error("`messages` is missing or not an array")]
    InvalidMessagesField,
    /// `/v1/embeddings` needs an `input`: a string, or an array of strings or of token arrays.
    #[error("`input` is missing or not a string or an array")]
    InvalidInputField,
    /// A field the gateway cannot serve on this path: a Responses field with no chat-completions
    /// equivalent on a model whose provider is reached by translation, or a field that needs
    /// state the gateway does not keep. Names the field (as a path into the request) and why.
    #[error("`{field}` is not supported here: {reason}")]
    UnsupportedField {
        /// The field (`tools[0].type`, `previous_response_id`).
        field: String,
        /// Why (English).
        reason: &'static str,
    },
    /// `/v1/messages` needs a positive integer `max_tokens`.
    #[error("`max_tokens` is missing or not a positive integer")]
    InvalidMaxTokens,
    /// `n` (how many replies) is not a whole number from 1 to 128.
    #[error("`n` is not a whole number from 1 to 128")]
    InvalidReplies,
    /// `stream` is not a boolean.
    #[error("`stream` is not a boolean")]
    InvalidStreamField,
    /// `stream: true`: this version answers non-streaming only.
    #[error("`stream: true` while streaming is off")]
    StreamingUnsupported,
    /// The body could not be read from the connection.
    #[error("the request body could not be read")]
    UnreadableBody,
    /// The body is larger than the configured limit.
    #[error("the request body is over the limit")]
    PayloadTooLarge,
    /// The request's headers are larger than the server accepts.
    #[error("the request headers are over the limit")]
    HeadersTooLarge,
    /// The request body stopped arriving, or took longer than the server allows.
    #[error("the request body stopped arriving or passed its deadline")]
    RequestTimeout,
    /// The server is reading as many request bodies as its memory budget allows.
    #[error("the memory budget for request bodies is full")]
    Busy,
    /// A query parameter is not what the endpoint takes.
    #[error("a query parameter is invalid")]
    InvalidQuery,
    /// The path is not one of the gateway's endpoints.
    #[error("no such endpoint")]
    UnknownPath,
    /// The path is an endpoint of a feature this build leaves out (the console and the admin
    /// API without `api`): answered 404 as an unknown path, saying which feature.
    #[error("an endpoint of the `{0}` feature, which this build leaves out")]
    NotInThisBuild(&'static str),
    /// The endpoints accept `POST` only.
    #[error("method not allowed on this path")]
    MethodNotAllowed,
    /// The model is not in the catalogue, or belongs to the other protocol's endpoint.
    #[error("no such model on this endpoint")]
    ModelNotFound,
    /// A stored response (`previous_response_id`, `/v1/responses/{id}`) that this key's account
    /// did not make, or that is not known: the same answer for both, so that ids cannot be
    /// probed.
    #[error("no such response")]
    ResponseNotFound,
    /// The caller's credits do not cover the model's price.
    #[error("the credits do not cover the price")]
    InsufficientCredits,
    /// The caller's key has spent what its limit allows in the current period.
    #[error("the API key's spending limit is reached")]
    KeyLimitReached,
    /// Every upstream attempt failed; the call was refunded.
    #[error("every upstream attempt failed")]
    UpstreamUnavailable,
    /// The provider refused the request itself (a 4xx other than 401, 403, 429); the call was
    /// refunded and the provider's message is passed on so SDKs can show it.
    #[error("the provider refused the request: {0}")]
    UpstreamRejected(String),
    /// The store (database) could not be reached; nothing was charged.
    #[error("the database could not be reached")]
    StoreUnavailable,
    /// The layers were assembled wrongly (a required request extension is missing).
    #[error("the layers are assembled wrongly (a request extension is missing)")]
    Misconfigured,
    /// The key may not call this model ([`KeyRules::models`](crate::call::KeyRules::models)).
    #[error("the API key may not call this model")]
    ModelNotAllowed,
    /// The key made more requests this minute than its limit; it may try again after the given
    /// number of seconds (`Retry-After`).
    #[error("the API key is over its requests per minute; retry after {0} s")]
    RateLimited(u64),
    /// The admin API was called without the admin token.
    #[error("no or wrong admin token")]
    InvalidAdminToken,
    /// The admin API was asked about an account that does not exist.
    #[error("no such account")]
    NoSuchAccount,
    /// The admin API was asked about a key that does not exist.
    #[error("no such API key")]
    NoSuchKey,
    /// The admin API was asked about a batch of redemption codes that does not exist.
    #[error("no such code batch")]
    NoSuchCodeBatch,
    /// The admin API was asked about a webhook delivery that does not exist.
    #[error("no such webhook delivery")]
    NoSuchDelivery,
    /// A catalogue reload was refused (the text says why, as a start would); the old
    /// catalogue serves on.
    #[error("catalogue refused: {0}")]
    InvalidCatalogue(String),
    /// A redemption code is unknown, used, expired or revoked: one answer for all four, so
    /// that it tells a guesser nothing.
    #[error("invalid redemption code")]
    InvalidCode,
    /// A field of an admin request is missing or wrong; names the field and why.
    #[error("field `{field}`: {reason}")]
    InvalidField {
        /// The field, as the request names it.
        field: std::borrow::Cow<'static, str>,
        /// What is wrong with it (Chinese, shown to the client).
        reason: &'static str,
    },
    /// A grant would take the balance past the largest value it can hold; nothing was granted.
    #[error(
        "the grant would take the balance past the largest value a balance can hold; nothing was granted"
    )]
    BalanceOverflow,
    /// An `Idempotency-Key` was sent again with a different request.
    #[error("the idempotency key was used for a different request")]
    IdempotencyKeyReused,
    /// A call's `Idempotency-Key` header is empty, longer than 255 bytes or not visible ASCII.
    #[error("the Idempotency-Key header is not 1 to 255 visible ASCII characters")]
    InvalidIdempotencyKey,
    /// A call with the same `Idempotency-Key` is still running; the client may retry shortly.
    #[error("a call with this idempotency key is still running")]
    IdempotentCallRunning,
    /// The call with this `Idempotency-Key` was billed, but its reply was not kept (too large,
    /// or the client left its stream), so it cannot be given again.
    #[error("the call with this idempotency key was billed and its reply was not kept")]
    IdempotentReplyNotKept,
}

impl From<crate::protocol::responses::Untranslatable> for GatewayError {
    fn from(refused: crate::protocol::responses::Untranslatable) -> GatewayError {
        GatewayError::UnsupportedField {
            field: refused.field,
            reason: refused.reason,
        }
    }
}

impl GatewayError {
    /// What the client is told: the contract's text (Chinese), as `{"detail": ...}` carries it.
    pub fn detail(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Self::InvalidApiKey => "无效的 API Key".into(),
            Self::InvalidJson => "请求体不是有效的 JSON 对象".into(),
            Self::InvalidModelField => "缺少 model 字段, 或 model 不是字符串".into(),
            Self::InvalidMessagesField => "缺少 messages 字段, 或 messages 不是数组".into(),
            Self::InvalidInputField => "缺少 input 字段, 或 input 不是字符串或数组".into(),
            Self::UnsupportedField { field, reason } => {
                format!("不支持字段 {field}: {reason}").into()
            }
            Self::InvalidMaxTokens => "缺少 max_tokens 字段, 或 max_tokens 不是正整数".into(),
            Self::InvalidReplies => "n 必须是 1 到 128 之间的整数".into(),
            Self::InvalidStreamField => "stream 必须是布尔值".into(),
            Self::StreamingUnsupported => "暂不支持流式输出 (stream: true)".into(),
            Self::UnreadableBody => "无法读取请求体".into(),
            Self::PayloadTooLarge => "请求体过大".into(),
            Self::HeadersTooLarge => "请求头过大".into(),
            Self::RequestTimeout => "请求超时: 请求体未在规定时间内发送完".into(),
            Self::Busy => "服务繁忙, 请稍后重试".into(),
            Self::InvalidQuery => "查询参数无效".into(),
            Self::UnknownPath => "接口不存在".into(),
            Self::NotInThisBuild(feature) => format!(
                "接口不存在: this endpoint needs the `{feature}` feature (cargo run --release \
                 --features {feature} --example gateway)"
            )
            .into(),
            Self::MethodNotAllowed => "不支持的请求方法".into(),
            Self::ModelNotFound => "模型不存在".into(),
            Self::ResponseNotFound => "响应不存在".into(),
            Self::InsufficientCredits => "积分不足".into(),
            Self::KeyLimitReached => "API Key 额度已用尽".into(),
            Self::UpstreamUnavailable => "上游服务暂时不可用".into(),
            Self::UpstreamRejected(message) => format!("上游服务暂时不可用: {message}").into(),
            Self::StoreUnavailable => "服务暂时不可用, 请稍后重试".into(),
            Self::Misconfigured => "网关内部错误".into(),
            Self::ModelNotAllowed => "该 API Key 无权使用此模型".into(),
            Self::RateLimited(_) => "请求过于频繁".into(),
            Self::InvalidAdminToken => "无效的管理员令牌".into(),
            Self::NoSuchAccount => "账户不存在".into(),
            Self::NoSuchKey => "API Key 不存在".into(),
            Self::NoSuchCodeBatch => "兑换码批次不存在".into(),
            Self::NoSuchDelivery => "Webhook 投递不存在".into(),
            Self::InvalidCode => "兑换码无效".into(),
            Self::InvalidCatalogue(why) => why.clone().into(),
            Self::InvalidField { field, reason } => format!("字段 {field} 无效: {reason}").into(),
            Self::BalanceOverflow => "积分将超过余额上限, 未发放".into(),
            Self::IdempotencyKeyReused => "Idempotency-Key 已用于另一个不同的请求".into(),
            Self::InvalidIdempotencyKey => "Idempotency-Key 须为 1 到 255 个可见 ASCII 字符".into(),
            Self::IdempotentCallRunning => {
                "相同 Idempotency-Key 的请求仍在处理中, 请稍后重试".into()
            }
            Self::IdempotentReplyNotKept => {
                "相同 Idempotency-Key 的请求已完成并计费, 但其回复未保存, 无法重放".into()
            }
        }
    }

    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidApiKey => StatusCode::UNAUTHORIZED,
            Self::InvalidJson
            | Self::InvalidModelField
            | Self::InvalidMessagesField
            | Self::InvalidInputField
            | Self::UnsupportedField { .. }
            | Self::InvalidMaxTokens
            | Self::InvalidReplies
            | Self::InvalidStreamField
            | Self::StreamingUnsupported
            | Self::InvalidQuery
            | Self::InvalidIdempotencyKey
            | Self::UnreadableBody => StatusCode::BAD_REQUEST,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Self::UnknownPath
            | Self::NotInThisBuild(_)
            | Self::ModelNotFound
            | Self::ResponseNotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::InsufficientCredits | Self::KeyLimitReached => StatusCode::PAYMENT_REQUIRED,
            Self::UpstreamUnavailable | Self::UpstreamRejected(_) => StatusCode::BAD_GATEWAY,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Misconfigured => StatusCode::INTERNAL_SERVER_ERROR,
            Self::ModelNotAllowed => StatusCode::FORBIDDEN,
            Self::RateLimited(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::InvalidAdminToken => StatusCode::UNAUTHORIZED,
            Self::NoSuchAccount
            | Self::NoSuchKey
            | Self::NoSuchCodeBatch
            | Self::NoSuchDelivery => StatusCode::NOT_FOUND,
            Self::InvalidField { .. }
            | Self::BalanceOverflow
            | Self::InvalidCode
            | Self::InvalidCatalogue(_) => StatusCode::BAD_REQUEST,
            Self::IdempotencyKeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::IdempotentCallRunning | Self::IdempotentReplyNotKept => StatusCode::CONFLICT,
        }
    }

    /// The `{"detail": ...}` body as bytes.
    pub fn body(&self) -> Bytes {
        detail_body(&self.detail())
    }

    /// A short name for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidApiKey => "invalid_api_key",
            Self::InvalidJson => "invalid_json",
            Self::InvalidModelField => "invalid_model_field",
            Self::InvalidMessagesField => "invalid_messages_field",
            Self::InvalidInputField => "invalid_input_field",
            Self::UnsupportedField { .. } => "unsupported_field",
            Self::InvalidMaxTokens => "invalid_max_tokens",
            Self::InvalidReplies => "invalid_n",
            Self::InvalidStreamField => "invalid_stream_field",
            Self::StreamingUnsupported => "streaming_unsupported",
            Self::UnreadableBody => "unreadable_body",
            Self::PayloadTooLarge => "payload_too_large",
            Self::HeadersTooLarge => "headers_too_large",
            Self::RequestTimeout => "request_timeout",
            Self::Busy => "busy",
            Self::InvalidQuery => "invalid_query",
            Self::UnknownPath | Self::NotInThisBuild(_) => "unknown_path",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::ModelNotFound => "model_not_found",
            Self::ResponseNotFound => "response_not_found",
            Self::InsufficientCredits => "insufficient_credits",
            Self::KeyLimitReached => "key_limit_reached",
            Self::UpstreamUnavailable => "upstream_unavailable",
            Self::UpstreamRejected(_) => "upstream_rejected",
            Self::StoreUnavailable => "store_unavailable",
            Self::Misconfigured => "misconfigured",
            Self::ModelNotAllowed => "model_not_allowed",
            Self::RateLimited(_) => "rate_limited",
            Self::InvalidAdminToken => "invalid_admin_token",
            Self::NoSuchAccount => "no_such_account",
            Self::NoSuchKey => "no_such_key",
            Self::NoSuchCodeBatch => "no_such_code_batch",
            Self::NoSuchDelivery => "no_such_delivery",
            Self::InvalidCode => "invalid_code",
            Self::InvalidCatalogue(_) => "invalid_catalogue",
            Self::InvalidField { .. } => "invalid_field",
            Self::BalanceOverflow => "balance_overflow",
            Self::IdempotencyKeyReused => "idempotency_key_reused",
            Self::InvalidIdempotencyKey => "invalid_idempotency_key",
            Self::IdempotentCallRunning => "idempotent_call_running",
            Self::IdempotentReplyNotKept => "idempotent_reply_not_kept",
        }
    }

    /// Whether asking again can change the answer: `Some(false)` for what the request or the
    /// account must change first (400, 401, 402, 403, 404, 405, 413, 422, 431, a 409 whose
    /// reply is gone, and a provider's refusal of the request itself), `Some(true)` for what
    /// passes (429, 502, 503, and the 409 of a call still running). `None`: the SDKs' own rule.
    pub fn should_retry(&self) -> Option<bool> {
        match self {
            // The provider refused the request itself: the same request is refused again.
            Self::UpstreamRejected(_) => Some(false),
            Self::IdempotentCallRunning => Some(true),
            _ => match self.status().as_u16() {
                400 | 401 | 402 | 403 | 404 | 405 | 409 | 413 | 422 | 431 => Some(false),
                429 | 502 | 503 => Some(true),
                _ => None,
            },
        }
    }

    /// The `type` of `OpenAI`'s error object for this error: the names the `OpenAI` SDKs and
    /// the clients built on them recognise.
    pub fn openai_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            402 => "insufficient_quota",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_exceeded",
            500..=599 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The `type` of Anthropic's error object for this error (Anthropic's documented types).
    pub fn anthropic_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            402 => "billing_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            500..=599 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The `code` of `OpenAI`'s error object: `OpenAI`'s own where it has one for the case
    /// (`insufficient_quota`, `rate_limit_exceeded`, `invalid_api_key`, `model_not_found`), else
    /// the [`reason`](Self::reason).
    pub fn openai_code(&self) -> &'static str {
        match self {
            Self::InsufficientCredits | Self::KeyLimitReached => "insufficient_quota",
            Self::RateLimited(_) => "rate_limit_exceeded",
            other => other.reason(),
        }
    }

    /// The request field the error is about, when it is one field (`OpenAI`'s `param`).
    fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidModelField | Self::ModelNotFound | Self::ModelNotAllowed => Some("model"),
            Self::InvalidMessagesField => Some("messages"),
            Self::InvalidInputField => Some("input"),
            Self::InvalidMaxTokens => Some("max_tokens"),
            Self::InvalidReplies => Some("n"),
            Self::InvalidStreamField | Self::StreamingUnsupported => Some("stream"),
            Self::InvalidField { field, .. } => Some(field),
            Self::UnsupportedField { field, .. } => Some(field),
            _ => None,
        }
    }

    /// Google's `status` name for this error's HTTP status, as its error objects give it.
    pub fn google_status(&self) -> &'static str {
        match self.status().as_u16() {
            400 | 405 | 413 | 422 | 431 => "INVALID_ARGUMENT",
            401 => "UNAUTHENTICATED",
            402 | 429 => "RESOURCE_EXHAUSTED",
            403 => "PERMISSION_DENIED",
            404 => "NOT_FOUND",
            409 => "ABORTED",
            408 | 504 => "DEADLINE_EXCEEDED",
            500 => "INTERNAL",
            502 | 503 => "UNAVAILABLE",
            _ => "UNKNOWN",
        }
    }

    /// The body [`ErrorBody::Compatible`] gives: `detail`, and the same text in `shape`'s
    /// error object: `{"detail", "error": {"message", "type", "code", "param"}}` for `OpenAI`'s,
    /// `{"detail", "type": "error", "error": {"type", "message"}}` for Anthropic's,
    /// `{"detail", "error": {"code", "message", "status"}}` for Google's.
    pub fn compatible_body(&self, shape: ErrorShape) -> Bytes {
        let detail = self.detail();
        let body = match shape {
            ErrorShape::OpenAi => serde_json::json!({
                "detail": detail,
                "error": {
                    "message": detail,
                    "type": self.openai_type(),
                    "code": self.openai_code(),
                    "param": self.param(),
                },
            }),
            ErrorShape::Anthropic => serde_json::json!({
                "detail": detail,
                "type": "error",
                "error": { "type": self.anthropic_type(), "message": detail },
            }),
            ErrorShape::Google => serde_json::json!({
                "detail": detail,
                "error": {
                    "code": self.status().as_u16(),
                    "message": detail,
                    "status": self.google_status(),
                },
            }),
        };
        Bytes::from(body.to_string())
    }

    /// The complete HTTP response, for any body type that can be built from bytes: the
    /// `{"detail": ...}` body, `x-should-retry` where [`should_retry`](Self::should_retry)
    /// knows, and the error itself as a response extension, for the layers outside to read (the
    /// access log, and the [`error_body`](crate::error_body) layer, which rewrites the body
    /// when the operator chose [`ErrorBody::Compatible`]).
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        crate::telemetry::refused(self.status().as_u16(), self.reason());
        let mut response = json_response(self.status(), self.body());
        let headers = response.headers_mut();
        match self {
            Self::MethodNotAllowed => {
                headers.insert(header::ALLOW, HeaderValue::from_static("POST"));
            }
            Self::RateLimited(seconds) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            }
            // The official SDKs retry a 409 after `Retry-After`, by when the first call may
            // have ended and its reply can be given again.
            Self::IdempotentCallRunning => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(1));
            }
            _ => {}
        }
        if let Some(retry) = self.should_retry() {
            let value = if retry { "true" } else { "false" };
            headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static(value));
        }
        response.extensions_mut().insert(self);
        response
    }
}

/// An upstream call that failed. `message` is for the operator (the call log), never for the
/// client; `client_message` is what the client may learn when the provider rejected the request
/// itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct UpstreamError {
    /// The upstream's HTTP status, when it answered.
    pub status: Option<u16>,
    /// What went wrong, for the operator.
    pub message: String,
    /// The provider's own explanation of why it refused the request (a 4xx other than 401, 403
    /// and 429), passed on to the client.
    pub client_message: Option<String>,
}

impl UpstreamError {
    /// The upstream could not be reached or did not answer in time.
    pub fn transport(message: impl Into<String>) -> UpstreamError {
        UpstreamError {
            status: None,
            message: message.into(),
            client_message: None,
        }
    }

    /// The upstream answered with a non-success status; keeps an excerpt of its body.
    pub fn answered(status: u16, body: &[u8]) -> UpstreamError {
        UpstreamError {
            status: Some(status),
            message: format!("upstream answered {status}: {}", excerpt(body)),
            client_message: None,
        }
    }
}

/// How much of an upstream's error body is kept in the call log.
const ERROR_EXCERPT_CHARS: usize = 512;

/// The start of a body as text, for the call log.
pub(crate) fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body)
        .chars()
        .take(ERROR_EXCERPT_CHARS)
        .collect()
}

/// `{"detail": text}` as JSON bytes, with `text` escaped.
pub(crate) fn detail_body(text: &str) -> Bytes {
    Bytes::from(serde_json::json!({ "detail": text }).to_string())
}

/// A response with `content-type: application/json`.
pub(crate) fn json_response<B: From<Bytes>>(status: StatusCode, body: Bytes) -> Response<B> {
    let mut response = Response::new(B::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_has_a_json_detail_and_the_specified_status() {
        let cases = [
            (GatewayError::InvalidApiKey, 401, "无效的 API Key"),
            (GatewayError::InsufficientCredits, 402, "积分不足"),
            (GatewayError::ModelNotFound, 404, "模型不存在"),
            (GatewayError::UpstreamUnavailable, 502, "上游服务暂时不可用"),
        ];
        for (error, status, detail) in cases {
            let response: Response<Bytes> = error.into_response();
            assert_eq!(response.status().as_u16(), status);
            let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
            assert_eq!(body, serde_json::json!({ "detail": detail }));
        }
    }

    #[test]
    fn the_log_reads_english_and_the_client_reads_the_contracts_text() {
        let error = GatewayError::InsufficientCredits;
        assert_eq!(error.to_string(), "the credits do not cover the price");
        assert_eq!(error.detail(), "积分不足");
        let rejected = GatewayError::UpstreamRejected("max_tokens: too large".into());
        assert_eq!(
            rejected.detail(),
            "上游服务暂时不可用: max_tokens: too large"
        );
        assert!(rejected.to_string().contains("max_tokens: too large"));
        assert!(rejected.to_string().is_ascii());
    }

    #[test]
    fn method_not_allowed_names_the_allowed_method() {
        let response: Response<Bytes> = GatewayError::MethodNotAllowed.into_response();
        assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(response.headers()[header::ALLOW], "POST");
    }
}
