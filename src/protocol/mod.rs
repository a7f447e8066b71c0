//! The wire protocols the gateway speaks (`OpenAI`'s chat completions, responses and embeddings,
//! Anthropic's messages), and what their replies say: token usage and the provider's own error message. Its
//! `sse` module (inside the crate) reads their event streams.

use serde::{Deserialize, Serialize};

pub mod chat_completions;
pub(crate) mod dialect;
pub(crate) mod embeddings;
pub mod gemini;
pub mod messages;
pub(crate) mod mock;
pub(crate) mod reader;
pub mod responses;
mod service_tier;
pub(crate) mod sse;
pub(crate) mod tokens;
pub(crate) mod translate;
pub(crate) mod translation;
mod upstream_kind;

use dialect::Dialect;
pub use service_tier::ServiceTier;
pub use translate::Untranslatable;
pub(crate) use upstream_kind::HostedOn;
pub use upstream_kind::{BuiltinTools, ResponsesRoute, UpstreamKind};

/// Which API style a call uses; decided by the request path. More may come: match with a `_`
/// arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Protocol {
    /// `OpenAI` chat completions: `POST /v1/chat/completions`.
    ChatCompletions,
    /// Anthropic messages: `POST /v1/messages`.
    Messages,
    /// `OpenAI` embeddings: `POST /v1/embeddings`, never streamed.
    Embeddings,
    /// `OpenAI` responses: `POST /v1/responses`, served by the chat-completions models.
    Responses,
    /// Google's Gemini API: `POST /v1beta/models/{model}:generateContent` and
    /// `:streamGenerateContent`.
    Gemini,
}

impl Protocol {
    /// Every protocol, in the order a path is matched against them.
    pub(crate) const ALL: [Protocol; 5] = [
        Protocol::ChatCompletions,
        Protocol::Messages,
        Protocol::Embeddings,
        Protocol::Responses,
        Protocol::Gemini,
    ];

    /// What this protocol answers for itself; the one `match` that names each protocol's
    /// folder.
    pub(crate) fn dialect(self) -> &'static dyn Dialect {
        match self {
            Protocol::ChatCompletions => &chat_completions::ChatCompletions,
            Protocol::Messages => &messages::Messages,
            Protocol::Embeddings => &embeddings::Embeddings,
            Protocol::Responses => &responses::Responses,
            Protocol::Gemini => &gemini::Gemini,
        }
    }

    /// The endpoint path clients call.
    pub fn path(self) -> &'static str {
        self.dialect().path()
    }

    /// The protocol served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Protocol> {
        Self::ALL
            .into_iter()
            .find(|protocol| protocol.dialect().matches(path))
    }

    /// The name stored in the call log.
    pub fn as_str(self) -> &'static str {
        self.dialect().stored_name()
    }

    /// The protocol of the catalogue models this endpoint serves: the chat-completions models
    /// also answer `/v1/responses`.
    pub fn models_protocol(self) -> Protocol {
        self.dialect().models()
    }

    /// Parses the stored name.
    pub fn parse(name: &str) -> Option<Protocol> {
        Self::ALL
            .into_iter()
            .find(|protocol| protocol.as_str() == name)
    }
}

impl UpstreamKind {
    /// The dialect whose headers an upstream of this kind takes.
    pub(crate) fn speaks(self) -> &'static dyn dialect::UpstreamDialect {
        match self {
            UpstreamKind::Openai => &chat_completions::ChatCompletions,
            UpstreamKind::Anthropic => &messages::Messages,
            UpstreamKind::Gemini => &gemini::Gemini,
        }
    }
}

/// Token counts as the upstream reported them, in disjoint kinds so that each is priced once
/// (see [`pricing`](crate::pricing)). Read from every protocol's names:
///
/// - chat completions: `prompt_tokens` (cached tokens inside it, in
///   `prompt_tokens_details.cached_tokens`), `completion_tokens` (reasoning inside it, in
///   `completion_tokens_details.reasoning_tokens`);
/// - Responses: `input_tokens` and `input_tokens_details.cached_tokens`, `output_tokens` and
///   `output_tokens_details.reasoning_tokens`, counted the same way;
/// - Anthropic messages: `input_tokens` (no cached tokens inside it), `cache_read_input_tokens`,
///   `cache_creation_input_tokens` with its split `cache_creation.ephemeral_5m_input_tokens` and
///   `ephemeral_1h_input_tokens`, `output_tokens`;
/// - Gemini: `usageMetadata`'s `promptTokenCount` (cached tokens inside it, in
///   `cachedContentTokenCount`) and `toolUsePromptTokenCount` (outside it), `candidatesTokenCount`
///   and `thoughtsTokenCount` (reasoning, outside it: added to the output).
///
/// Cached input reported inside the input count is moved out of it, so
/// [`input_tokens`](Self::input_tokens) is the input that was neither read from nor written to
/// a cache, on every protocol.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ReportedUsage")]
pub struct TokenUsage {
    /// Input tokens neither read from nor written to a cache.
    pub input_tokens: Option<i64>,
    /// Output tokens, reasoning included.
    pub output_tokens: Option<i64>,
    /// Input tokens read from the provider's cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<i64>,
    /// Input tokens written to the provider's cache for 5 minutes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<i64>,
    /// Input tokens written to the provider's cache for an hour.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_write_1h_tokens: Option<i64>,
    /// Of the output tokens, those the model spent reasoning (counted in
    /// [`output_tokens`](Self::output_tokens) too; shown, not priced again).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<i64>,
    /// Whether a count here is the gateway's own (output counted from what was forwarded,
    /// input estimated from the request) rather than the provider's report.
    #[serde(skip)]
    pub estimated: bool,
    /// Whether the provider's report held a count that is no count at all (below zero, not a
    /// whole number, not a number, beyond what fits) or cached input beyond the input it
    /// is part of. Such a count is left out (`None`), and the report is not trusted: see
    /// [`store::rules::usage::charge`](crate::store::rules::usage::charge).
    #[serde(skip)]
    pub malformed: bool,
    /// The service tier the provider says it served the call at (or, when it says none, the
    /// tier the client asked for): which of a model's tier prices apply.
    #[serde(skip)]
    pub service_tier: Option<ServiceTier>,
}

impl TokenUsage {
    /// Every input token, whatever the cache did with it.
    pub fn all_input_tokens(&self) -> Option<i64> {
        let kinds = [
            self.input_tokens,
            self.cache_read_tokens,
            self.cache_write_tokens,
            self.cache_write_1h_tokens,
        ];
        kinds
            .iter()
            .any(Option::is_some)
            .then(|| kinds.iter().flatten().sum())
    }

    /// `self` with what `later` reports replacing what it reported (a stream reports usage in
    /// parts, and a later report of a kind is the whole count so far).
    pub(crate) fn merged(self, later: TokenUsage) -> TokenUsage {
        TokenUsage {
            input_tokens: later.input_tokens.or(self.input_tokens),
            output_tokens: later.output_tokens.or(self.output_tokens),
            cache_read_tokens: later.cache_read_tokens.or(self.cache_read_tokens),
            cache_write_tokens: later.cache_write_tokens.or(self.cache_write_tokens),
            cache_write_1h_tokens: later.cache_write_1h_tokens.or(self.cache_write_1h_tokens),
            reasoning_tokens: later.reasoning_tokens.or(self.reasoning_tokens),
            estimated: self.estimated || later.estimated,
            malformed: self.malformed || later.malformed,
            service_tier: later.service_tier.or(self.service_tier),
        }
    }
}

/// A `usage` object as any protocol spells it (and as [`TokenUsage`] serialises).
#[derive(Deserialize)]
struct ReportedUsage {
    #[serde(alias = "prompt_tokens")]
    input_tokens: Option<Count>,
    #[serde(alias = "completion_tokens")]
    output_tokens: Option<Count>,
    #[serde(alias = "prompt_tokens_details")]
    input_tokens_details: Option<InputDetails>,
    #[serde(alias = "completion_tokens_details")]
    output_tokens_details: Option<OutputDetails>,
    #[serde(alias = "cache_read_input_tokens")]
    cache_read_tokens: Option<Count>,
    /// Anthropic's: every cache write, both durations.
    cache_creation_input_tokens: Option<Count>,
    cache_creation: Option<CacheCreation>,
    cache_write_tokens: Option<Count>,
    cache_write_1h_tokens: Option<Count>,
    reasoning_tokens: Option<Count>,
    /// Anthropic's: the tier the call was served at.
    service_tier: Option<String>,
}

#[derive(Deserialize)]
struct InputDetails {
    cached_tokens: Option<Count>,
}

#[derive(Deserialize)]
struct OutputDetails {
    reasoning_tokens: Option<Count>,
}

#[derive(Deserialize)]
struct CacheCreation {
    ephemeral_5m_input_tokens: Option<Count>,
    ephemeral_1h_input_tokens: Option<Count>,
}

/// A token count as a provider wrote it: a whole number from zero up, or anything else (a
/// negative or fractional number, a string, an object), which is no count. Read leniently, so
/// that an odd count is judged by the charge rather than failing the whole reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Count {
    Tokens(i64),
    Malformed,
}

impl Count {
    fn of(tokens: i64) -> Count {
        if tokens >= 0 {
            Count::Tokens(tokens)
        } else {
            Count::Malformed
        }
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Count, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a token count")
            }
            fn visit_u64<E>(self, value: u64) -> Result<Count, E> {
                Ok(i64::try_from(value).map_or(Count::Malformed, Count::Tokens))
            }
            fn visit_i64<E>(self, value: i64) -> Result<Count, E> {
                Ok(Count::of(value))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Count, E> {
                Ok(Count::Malformed)
            }
            fn visit_str<E>(self, _: &str) -> Result<Count, E> {
                Ok(Count::Malformed)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Count, E> {
                Ok(Count::Malformed)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Count, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Count::Malformed)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Count, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Count::Malformed)
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

/// Counts read from a report, and whether any of them was no count.
#[derive(Default)]
struct Counts {
    malformed: bool,
}

impl Counts {
    fn take(&mut self, count: Option<Count>) -> Option<i64> {
        match count? {
            Count::Tokens(tokens) => Some(tokens),
            Count::Malformed => {
                self.malformed = true;
                None
            }
        }
    }
}

impl From<ReportedUsage> for TokenUsage {
    fn from(reported: ReportedUsage) -> TokenUsage {
        let mut counts = Counts::default();
        let reported_input = counts.take(reported.input_tokens);
        // Counted inside the input (`OpenAI`): moved out of it, so it is priced once. Cached
        // input beyond the input it is part of is no report to trust.
        let cached_inside = counts
            .take(
                reported
                    .input_tokens_details
                    .and_then(|details| details.cached_tokens),
            )
            .filter(|cached| *cached > 0);
        let input_tokens = match (reported_input, cached_inside) {
            (Some(input), Some(cached)) => {
                if cached > input {
                    counts.malformed = true;
                }
                Some(input.saturating_sub(cached).max(0))
            }
            (input, _) => input,
        };
        // Anthropic's cache writes: the split when it is given; all at the 5-minute rate (its
        // default duration) when only the total is.
        let (cache_write_tokens, cache_write_1h_tokens) = match reported.cache_creation {
            Some(split) => (
                counts.take(split.ephemeral_5m_input_tokens),
                counts.take(split.ephemeral_1h_input_tokens),
            ),
            None => {
                let total = counts.take(reported.cache_creation_input_tokens);
                let written = counts.take(reported.cache_write_tokens);
                (
                    total.or(written),
                    counts.take(reported.cache_write_1h_tokens),
                )
            }
        };
        let cache_read = counts.take(reported.cache_read_tokens);
        let output_tokens = counts.take(reported.output_tokens);
        let detailed = counts.take(
            reported
                .output_tokens_details
                .and_then(|details| details.reasoning_tokens),
        );
        let reasoning_tokens = detailed.or(counts.take(reported.reasoning_tokens));
        TokenUsage {
            input_tokens,
            output_tokens,
            cache_read_tokens: cache_read.or(cached_inside),
            cache_write_tokens,
            cache_write_1h_tokens,
            reasoning_tokens,
            estimated: false,
            malformed: counts.malformed,
            service_tier: reported
                .service_tier
                .as_deref()
                .and_then(ServiceTier::served),
        }
    }
}

/// The string a raw JSON value holds, borrowed when it has no escapes; `None` for another value.
pub(crate) fn json_string(raw: &serde_json::value::RawValue) -> Option<std::borrow::Cow<'_, str>> {
    if let Ok(plain) = serde_json::from_str::<&str>(raw.get()) {
        return Some(plain.into());
    }
    serde_json::from_str::<String>(raw.get())
        .ok()
        .map(Into::into)
}

/// `T` read from the JSON `body`, checked as UTF-8 once, as a whole: read from bytes,
/// `serde_json` checks each string it reads on its own (about 80 instructions a string, more
/// than reading a short key costs). A body that is not UTF-8 is read from its bytes, which
/// refuses it as before.
pub(crate) fn read_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> serde_json::Result<T> {
    match std::str::from_utf8(body) {
        Ok(text) => serde_json::from_str(text),
        Err(_) => serde_json::from_slice(body),
    }
}

/// Token usage from a reply of any protocol; `None` if the body is not a JSON object.
pub fn reply_usage(body: &[u8]) -> Option<TokenUsage> {
    reply_usage_raw(body).map(|(usage, _)| usage)
}

/// [`reply_usage`], and the usage object as the reply wrote it (`usage`, or Gemini's
/// `usageMetadata`), read in one pass.
pub(crate) fn reply_usage_raw(body: &[u8]) -> Option<(TokenUsage, Option<String>)> {
    #[derive(Deserialize)]
    struct Reply<'a> {
        #[serde(borrow, default)]
        usage: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, default, rename = "usageMetadata")]
        usage_metadata: Option<&'a serde_json::value::RawValue>,
        #[serde(default)]
        service_tier: Option<String>,
    }
    if body.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let reply: Reply<'_> = read_json(body).ok()?;
    let usage = match (reply.usage, reply.usage_metadata) {
        (Some(usage), _) => serde_json::from_str::<TokenUsage>(usage.get()).ok()?,
        (None, Some(metadata)) => TokenUsage::from(
            serde_json::from_str::<gemini::usage::UsageMetadata>(metadata.get()).ok()?,
        ),
        (None, None) => TokenUsage::default(),
    };
    let raw = reply
        .usage
        .or(reply.usage_metadata)
        .map(|raw| raw.get().to_owned());
    Some((served_at(usage, reply.service_tier.as_deref()), raw))
}

/// The usage object (`key`: `usage`, Gemini's `usageMetadata`) a JSON object carries, as
/// written: at its top, or one level down (Anthropic's `message.usage`, the Responses API's
/// `response.usage`).
pub(crate) fn usage_object_in<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    use serde_json::value::RawValue;
    type Fields<'a> = std::collections::HashMap<String, &'a RawValue>;
    fn object(raw: &&&RawValue) -> bool {
        raw.get().starts_with('{')
    }
    let top: Fields<'a> = serde_json::from_str(json).ok()?;
    if let Some(raw) = top.get(key).filter(object) {
        return Some(raw.get());
    }
    top.values().filter(object).find_map(|inner| {
        let inner: Fields<'a> = serde_json::from_str(inner.get()).ok()?;
        inner.get(key).filter(object).map(|raw| raw.get())
    })
}

/// `buffer` with what the call was charged written into `object` (a usage object that lies
/// inside `buffer`): `"cost"` the credits, `"cost_details"` the credits and the tokens by kind as
/// they were billed (and whether a count was the gateway's own); every other byte kept.
fn with_cost_in(buffer: &[u8], object: &str, credits: i64, usage: &TokenUsage) -> Option<Vec<u8>> {
    let start = (object.as_ptr() as usize).checked_sub(buffer.as_ptr() as usize)?;
    if start + object.len() > buffer.len() || !object.ends_with('}') {
        return None;
    }
    let close = start + object.len() - 1;
    let mut details = serde_json::to_value(usage).ok()?;
    details["credits"] = credits.into();
    details["estimated"] = usage.estimated.into();
    let empty = object[1..object.len() - 1].trim().is_empty();
    let added = format!(
        "{}\"cost\":{credits},\"cost_details\":{details}",
        if empty { "" } else { "," }
    );
    let mut written = Vec::with_capacity(buffer.len() + added.len());
    written.extend_from_slice(&buffer[..close]);
    written.extend_from_slice(added.as_bytes());
    written.extend_from_slice(&buffer[close..]);
    Some(written)
}

/// `reply` (a complete reply of `protocol`) with what the call was charged in its usage object
/// (see [`with_cost_in`]); `None` when the reply has no usage object to write into.
pub(crate) fn with_usage_cost(
    protocol: Protocol,
    reply: &[u8],
    credits: i64,
    usage: &TokenUsage,
) -> Option<Vec<u8>> {
    use serde_json::value::RawValue;
    let key = protocol.dialect().usage_key();
    let text = std::str::from_utf8(reply).ok()?;
    let fields: std::collections::HashMap<String, &RawValue> = serde_json::from_str(text).ok()?;
    let object = fields.get(key)?.get();
    if !object.starts_with('{') {
        return None;
    }
    with_cost_in(reply, object, credits, usage)
}

/// `event` (one whole server-sent event of `protocol`) with what the call was charged so far
/// in the usage object its data carries (at the top or one level down); `None` when it carries
/// none, or its data is not on one line.
pub(crate) fn event_with_usage_cost(
    protocol: Protocol,
    event: &[u8],
    credits: i64,
    usage: &TokenUsage,
) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(event).ok()?;
    let parsed = sse::Event::parse(text);
    let std::borrow::Cow::Borrowed(data) = parsed.data else {
        return None;
    };
    let object = usage_object_in(data, protocol.dialect().usage_key())?;
    with_cost_in(event, object, credits, usage)
}

/// `usage` with the tier a reply names beside it (`OpenAI`'s top-level `service_tier`), when its
/// usage named none.
pub(crate) fn served_at(mut usage: TokenUsage, tier: Option<&str>) -> TokenUsage {
    if usage.service_tier.is_none() {
        usage.service_tier = tier.and_then(ServiceTier::served);
    }
    usage
}

/// Longest provider message passed on to a client.
const CLIENT_MESSAGE_CHARS: usize = 300;

/// The provider's own error message: `{"error":{"message":...}}` (both `OpenAI` and Anthropic),
/// `{"error":"..."}` or `{"message":"..."}`.
pub(crate) fn provider_message(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ErrorField {
        Text(String),
        Object { message: String },
    }
    #[derive(Deserialize)]
    struct ErrorBody {
        error: Option<ErrorField>,
        message: Option<String>,
    }
    let parsed: ErrorBody = serde_json::from_slice(body).ok()?;
    let message = match parsed.error {
        Some(ErrorField::Text(text)) | Some(ErrorField::Object { message: text }) => text,
        None => parsed.message?,
    };
    let message = message.trim();
    (!message.is_empty()).then(|| message.chars().take(CLIENT_MESSAGE_CHARS).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cost_is_written_into_the_usage_object_as_it_stands() {
        let usage = TokenUsage {
            input_tokens: Some(3),
            output_tokens: Some(2),
            ..TokenUsage::default()
        };
        let reply = br#"{"id":"x", "usage" : { "prompt_tokens": 3 } ,"z":[1]}"#;
        let written = with_usage_cost(Protocol::ChatCompletions, reply, 7, &usage).unwrap();
        let written = String::from_utf8(written).unwrap();
        assert_eq!(
            written,
            r#"{"id":"x", "usage" : { "prompt_tokens": 3 ,"cost":7,"cost_details":{"credits":7,"estimated":false,"input_tokens":3,"output_tokens":2}} ,"z":[1]}"#
        );
        let empty = with_usage_cost(Protocol::Messages, br#"{"usage":{}}"#, 1, &usage).unwrap();
        let empty: serde_json::Value = serde_json::from_slice(&empty).unwrap();
        assert_eq!(empty["usage"]["cost"], 1);
        // Gemini's usage is `usageMetadata`; a reply without a usage object is left alone.
        let gemini = with_usage_cost(Protocol::Gemini, br#"{"usageMetadata":{"a":1}}"#, 2, &usage);
        assert!(gemini.is_some());
        // In a stream's event: at the top, or one level down, every other byte kept.
        let completed = b"event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":7}}}\r\n\r\n";
        let written = event_with_usage_cost(Protocol::Responses, completed, 3, &usage).unwrap();
        let written = String::from_utf8(written).unwrap();
        assert!(
            written.starts_with("event: response.completed\r\ndata: {"),
            "{written}"
        );
        assert!(written.ends_with("}}\r\n\r\n"), "{written}");
        assert!(
            written.contains(r#"{"input_tokens":7,"cost":3,"cost_details":"#),
            "{written}"
        );
        let chunk = b"data: {\"candidates\":[],\"usageMetadata\":{\"promptTokenCount\":5}}\n\n";
        let written = event_with_usage_cost(Protocol::Gemini, chunk, 4, &usage).unwrap();
        assert!(
            String::from_utf8(written)
                .unwrap()
                .contains(r#"{"promptTokenCount":5,"cost":4,"#)
        );
        assert_eq!(
            event_with_usage_cost(
                Protocol::Messages,
                b"event: ping\ndata: {\"type\":\"ping\"}\n\n",
                1,
                &usage
            ),
            None
        );
        for none in [&br#"{"usage":null}"#[..], br#"{"choices":[]}"#, b"not json"] {
            assert_eq!(
                with_usage_cost(Protocol::ChatCompletions, none, 1, &usage),
                None
            );
        }
    }

    /// A body checked as UTF-8 whole and read as text reads as its bytes do: the same value
    /// where it is UTF-8 (multi-byte characters and escapes included), refused where it is not.
    #[test]
    fn json_read_as_checked_text_reads_as_its_bytes() {
        let valid: [&[u8]; 3] = [
            "{\"model\":\"m\",\"text\":\"café ☃ 😀\"}".as_bytes(),
            br#"{"text":"\u00e9\ud83d\ude00\n"}"#,
            br#"  [1, "two", {"three": null}]"#,
        ];
        for body in valid {
            let read: serde_json::Value = read_json(body).unwrap();
            let from_bytes: serde_json::Value = serde_json::from_slice(body).unwrap();
            assert_eq!(read, from_bytes);
        }
        // Not UTF-8: a stray byte inside a string, a cut character, a lone continuation byte.
        for body in [
            &b"{\"model\":\"m\xff\"}"[..],
            &b"{\"text\":\"caf\xc3\"}"[..],
            &b"{\"text\":\"\x80\"}"[..],
        ] {
            assert!(serde_json::from_slice::<serde_json::Value>(body).is_err());
            assert!(read_json::<serde_json::Value>(body).is_err());
        }
        // A value the reading skips is not checked, from bytes or not: the usage is read.
        let usage = b"{\"model\":\"\xff\",\"usage\":{\"prompt_tokens\":3}}";
        assert_eq!(
            reply_usage(usage).and_then(|usage| usage.input_tokens),
            Some(3)
        );
    }

    #[test]
    fn usage_is_read_from_both_reply_shapes() {
        let chat = br#"{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
        assert_eq!(
            reply_usage(chat),
            Some(TokenUsage {
                input_tokens: Some(3),
                output_tokens: Some(4),
                ..TokenUsage::default()
            })
        );
        let messages = br#"{"type":"message","usage":{"input_tokens":5,"output_tokens":6}}"#;
        assert_eq!(
            reply_usage(messages),
            Some(TokenUsage {
                input_tokens: Some(5),
                output_tokens: Some(6),
                ..TokenUsage::default()
            })
        );
        assert_eq!(reply_usage(b"{}"), Some(TokenUsage::default()));
    }

    #[test]
    fn cached_input_counted_inside_the_input_is_moved_out_of_it() {
        let chat = br#"{"usage":{"prompt_tokens":100,"completion_tokens":40,"total_tokens":140,
            "prompt_tokens_details":{"cached_tokens":60,"audio_tokens":0},
            "completion_tokens_details":{"reasoning_tokens":30}}}"#;
        let expected = TokenUsage {
            input_tokens: Some(40),
            output_tokens: Some(40),
            cache_read_tokens: Some(60),
            reasoning_tokens: Some(30),
            ..TokenUsage::default()
        };
        assert_eq!(reply_usage(chat), Some(expected));
        let responses = br#"{"object":"response","usage":{"input_tokens":100,
            "input_tokens_details":{"cached_tokens":60},"output_tokens":40,
            "output_tokens_details":{"reasoning_tokens":30},"total_tokens":140}}"#;
        assert_eq!(reply_usage(responses), Some(expected));
        assert_eq!(expected.all_input_tokens(), Some(100));
    }

    #[test]
    fn anthropic_cache_reads_and_writes_are_their_own_kinds_by_duration() {
        let split = br#"{"usage":{"input_tokens":10,"output_tokens":5,
            "cache_read_input_tokens":1000,"cache_creation_input_tokens":300,
            "cache_creation":{"ephemeral_5m_input_tokens":100,"ephemeral_1h_input_tokens":200}}}"#;
        assert_eq!(
            reply_usage(split),
            Some(TokenUsage {
                input_tokens: Some(10),
                output_tokens: Some(5),
                cache_read_tokens: Some(1000),
                cache_write_tokens: Some(100),
                cache_write_1h_tokens: Some(200),
                reasoning_tokens: None,
                estimated: false,
                malformed: false,
                service_tier: None,
            })
        );
        // Without the split (older API versions), every write is a 5-minute one.
        let total_only =
            br#"{"usage":{"input_tokens":10,"output_tokens":5,"cache_creation_input_tokens":300}}"#;
        let usage = reply_usage(total_only).expect("usage");
        assert_eq!(
            (usage.cache_write_tokens, usage.cache_write_1h_tokens),
            (Some(300), None)
        );
        assert_eq!(usage.all_input_tokens(), Some(310));
    }

    #[test]
    fn usage_reads_back_what_it_writes() {
        let usage = TokenUsage {
            input_tokens: Some(1),
            output_tokens: Some(2),
            cache_read_tokens: Some(3),
            cache_write_tokens: Some(4),
            cache_write_1h_tokens: Some(5),
            reasoning_tokens: Some(1),
            estimated: false,
            malformed: false,
            service_tier: None,
        };
        let json = serde_json::to_string(&usage).expect("serialises");
        assert_eq!(
            serde_json::from_str::<TokenUsage>(&json).expect("parses"),
            usage
        );
    }

    #[test]
    fn provider_messages_are_read_from_both_error_shapes() {
        let openai =
            br#"{"error":{"message":"Invalid 'messages[0].role'","type":"invalid_request_error"}}"#;
        assert_eq!(
            provider_message(openai).as_deref(),
            Some("Invalid 'messages[0].role'")
        );
        let anthropic = br#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: too large"}}"#;
        assert_eq!(
            provider_message(anthropic).as_deref(),
            Some("max_tokens: too large")
        );
        assert_eq!(
            provider_message(br#"{"message":"plain"}"#).as_deref(),
            Some("plain")
        );
        assert_eq!(provider_message(b"<html>"), None);
    }
}
