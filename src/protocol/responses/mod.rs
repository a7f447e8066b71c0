//! `OpenAI`'s Responses API (`POST /v1/responses`) in terms of chat completions, for providers
//! that speak only chat completions (an upstream with `responses = "translate"`).
//!
//! Pure functions over JSON, with no I/O: [`Translated`] turns a Responses request into a
//! chat-completions request (or names the field that has no equivalent), read from its bytes
//! without building a `serde_json::Value` ([`chat_request`] does the same for a parsed
//! request), [`response_from_chat`] turns the chat reply into a `response` object, and
//! [`StreamTranslator`] turns a chat event stream into the Responses event sequence as its
//! bytes arrive.
//!
//! What translates, and how:
//! - `instructions`, and system or developer messages: system messages;
//! - `input` (a string, or items): messages with text, image (`image_url`), file and audio
//!   parts; `function_call` items as an assistant message's `tool_calls` (consecutive calls in
//!   one message); `function_call_output` items as `tool` messages; earlier `reasoning` items
//!   are left out (chat completions takes no reasoning back);
//! - custom tools (free-form input, plain or under a grammar) as chat completions' custom
//!   tools (the grammar nested as `format.grammar`), their `custom_tool_call` items as custom
//!   tool calls and `custom_tool_call_output` items as `tool` messages, a custom `tool_choice`,
//!   and an `allowed_tools` choice (chat completions nests its mode and tools one level deeper);
//!   back, custom tool calls as `custom_tool_call` items (streamed as
//!   `response.custom_tool_call_input.delta` and `.done`);
//! - a namespace of function tools (as Codex groups its multi-agent tools): each tool as a
//!   function tool named `{namespace}__{name}`, an earlier call of one (with its `namespace`)
//!   under that name, and a call back as a `function_call` item with `name` and `namespace`;
//! - function `tools`, `tool_choice`, `parallel_tool_calls`; `max_output_tokens` as
//!   `max_tokens`; `temperature`, `top_p`, `user`, `service_tier` as they are; `text.format` as
//!   `response_format`; `reasoning.effort` as `reasoning_effort`; `top_logprobs`;
//! - back: the reply's text or refusal as a message, its tool calls as `function_call` items,
//!   and the reasoning of reasoning models (`reasoning_content`, or `reasoning`) as a
//!   `reasoning` item with `reasoning_text` (streamed as `response.reasoning_text.delta`);
//! - hints a chat-completions provider has no use for are dropped: `store`, `include`,
//!   `metadata`, `client_metadata`, `prompt_cache_key`, `prompt_cache_retention`,
//!   `safety_identifier`, `stream_options`, `text.verbosity`, `reasoning.summary`;
//! - refused with the field's name: built-in tools, `background: true`,
//!   `previous_response_id`, `conversation`, `prompt`, `truncation: "auto"`, `max_tool_calls`,
//!   `item_reference` and other item types, and any field the Responses API does not have.
//!
//! ```
//! use model_gateway::protocol::responses::{Ids, Translated, chat_request, response_from_chat};
//! use serde_json::json;
//!
//! let request = json!({ "model": "gpt-4o-mini", "instructions": "Be brief.", "input": "Hi" });
//! let chat = chat_request(&request, "gpt-4o-mini").unwrap();
//! assert_eq!(chat["messages"][0], json!({ "role": "system", "content": "Be brief." }));
//! assert_eq!(chat["messages"][1], json!({ "role": "user", "content": "Hi" }));
//!
//! let reply = json!({
//!     "id": "chatcmpl-1", "created": 1, "model": "gpt-4o-mini",
//!     "choices": [{ "index": 0, "message": { "role": "assistant", "content": "Hello!" },
//!                   "finish_reason": "stop" }],
//!     "usage": { "prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11 },
//! });
//! let translated = Translated::new(request).unwrap();
//! let response = response_from_chat(&translated, &reply, &mut Ids::counting());
//! assert_eq!(response["status"], "completed");
//! assert_eq!(response["output"][0]["content"][0]["text"], "Hello!");
//! assert_eq!(response["usage"]["output_tokens"], 2);
//!
//! let refused = chat_request(&json!({ "input": "Hi", "tools": [{ "type": "web_search" }] }), "m");
//! assert_eq!(refused.unwrap_err().field, "tools[0].type");
//! ```

mod dialect;
mod reply;
mod request;
mod stream;
mod write;

pub(crate) use dialect::Responses;
pub(crate) use reply::{ChatReply, Echoed, Usage, write_response};
pub use reply::{response_from_chat, response_json_from_chat, response_json_from_chat_bytes};
pub(crate) use request::{Namespaced, ReadRequest, read_request};
pub use request::{Translated, Untranslatable, chat_request};
pub use stream::StreamTranslator;
pub(crate) use write::Str;

use serde_json::value::RawValue;

use crate::protocol::TokenUsage;

/// An optional string read borrowed from the JSON text where it holds no escape, for a field
/// `#[serde(borrow, default, deserialize_with = "borrowed_text")]`.
///
/// serde's derive borrows a `Cow<str>` field marked `borrow`, but reads one inside an `Option`
/// into an owned `String` whatever its text: every text of a reply would be allocated, and
/// written back through the escaper although it holds nothing to escape (see [`Str`]).
pub(crate) fn borrowed_text<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<std::borrow::Cow<'a, str>>, D::Error> {
    #[derive(serde::Deserialize)]
    struct Text<'a>(#[serde(borrow)] std::borrow::Cow<'a, str>);
    let text: Option<Text<'a>> = serde::Deserialize::deserialize(deserializer)?;
    Ok(text.map(|text| text.0))
}

/// The 16 lowercase hex digits of `word`'s 16 nibbles, in an order of their own (the low
/// nibble of each byte, then the high ones), which a random word does not mind: worked out
/// eight at a time by arithmetic on the word, rather than looked up a byte at a time.
fn hex_digits(word: u64) -> [u8; 16] {
    const NIBBLES: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    const ONES: u64 = 0x0101_0101_0101_0101;
    // Each byte holds a nibble `n`: `n + 6` reaches 16 (its bit 4) when `n` is 10 or more,
    // and such a digit is a letter, `'a' - '0' - 10` (0x27) past `'0' + n`. No byte carries
    // into the next: the most a byte holds is 15 + 0x30 + 0x27.
    let digits = |nibbles: u64| {
        let letters = ((nibbles + 6 * ONES) >> 4) & ONES;
        (nibbles + 0x30 * ONES + letters * 0x27).to_le_bytes()
    };
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&digits(word & NIBBLES));
    out[8..].copy_from_slice(&digits((word >> 4) & NIBBLES));
    out
}

/// Where the ids of translated responses and their items come from: random, as `OpenAI`'s
/// look (`resp_` and 48 hex digits), or counting (`resp_1`, `msg_2`, ...) for tests.
#[derive(Debug)]
pub struct Ids {
    counter: Option<u64>,
}

impl Ids {
    /// Random ids.
    pub fn random() -> Ids {
        Ids { counter: None }
    }

    /// Ids numbered from 1 in the order they are asked for.
    pub fn counting() -> Ids {
        Ids { counter: Some(0) }
    }

    /// The next id with `prefix` (`resp`, `msg`, `fc`).
    pub fn next(&mut self, prefix: &str) -> String {
        let mut id = Vec::with_capacity(prefix.len() + 49);
        self.push_next(prefix, &mut id);
        String::from_utf8(id).expect("an id is ASCII")
    }

    /// The next id with `prefix`, appended to `text` (ids are ASCII letters, digits and `_`),
    /// as bytes: a response's ids are read as text once, all of them together.
    pub(super) fn push_next(&mut self, prefix: &str, text: &mut Vec<u8>) {
        text.extend_from_slice(prefix.as_bytes());
        text.push(b'_');
        match &mut self.counter {
            Some(counter) => {
                *counter += 1;
                text.extend_from_slice(itoa::Buffer::new().format(*counter).as_bytes());
            }
            None => {
                // 48 random hex digits, from three random words (this runs for every
                // translated response and item).
                for _ in 0..3 {
                    text.extend_from_slice(&hex_digits(fastrand::u64(..)));
                }
            }
        }
    }
}

/// Whether a Responses request lets the provider keep the response (`store` absent or `true`,
/// as the API defaults).
pub fn kept_by_provider(request: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Asked {
        store: Option<bool>,
    }
    serde_json::from_slice::<Asked>(request).map_or(true, |asked| asked.store != Some(false))
}

/// The longest response id the gateway records.
const MAX_RESPONSE_ID: usize = 255;

/// The id of a `response` object, or of the one a stream event carries (`response.created`'s
/// `response.id`); `None` when there is none, or it is empty or longer than 255 bytes.
pub fn response_id(reply: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Reply<'a> {
        #[serde(borrow)]
        id: Option<&'a RawValue>,
        #[serde(borrow)]
        response: Option<&'a RawValue>,
    }
    let reply: Reply<'_> = crate::protocol::read_json(reply).ok()?;
    chosen_id(reply.id, reply.response)
}

/// A complete reply's usage, as [`reply_usage`](crate::protocol::reply_usage) reads it, and
/// its [`response_id`], in one reading: a native upstream's reply is read once for the ledger
/// and for who made the response. `None` when the reply is not a JSON object.
pub(crate) fn reply_usage_and_id(reply: &[u8]) -> Option<(TokenUsage, Option<String>)> {
    #[derive(serde::Deserialize)]
    struct Reply<'a> {
        #[serde(default)]
        usage: Option<TokenUsage>,
        #[serde(borrow)]
        id: Option<&'a RawValue>,
        #[serde(borrow)]
        response: Option<&'a RawValue>,
        #[serde(default)]
        service_tier: Option<String>,
    }
    let read = (reply.trim_ascii_start().first() == Some(&b'{'))
        .then(|| crate::protocol::read_json::<Reply<'_>>(reply).ok())
        .flatten();
    match read {
        Some(read) => Some((
            crate::protocol::served_at(
                read.usage.unwrap_or_default(),
                read.service_tier.as_deref(),
            ),
            chosen_id(read.id, read.response),
        )),
        // Read apart, as each reading alone decides (a key given twice, say, fails only the
        // reading that takes it).
        None => Some((crate::protocol::reply_usage(reply)?, response_id(reply))),
    }
}

/// The response id of a reply whose `id` and `response` read as written: the `response`'s
/// own `id` (a stream event's), else the reply's; `None` when either is not what the API
/// sends (a string; an object), or the id is empty or longer than 255 bytes.
fn chosen_id(id: Option<&RawValue>, response: Option<&RawValue>) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Inner {
        id: Option<String>,
    }
    let own = id
        .map(|raw| serde_json::from_str::<String>(raw.get()))
        .transpose()
        .ok()?;
    let inner = response
        .map(|raw| serde_json::from_str::<Inner>(raw.get()))
        .transpose()
        .ok()?;
    inner
        .and_then(|inner| inner.id)
        .or(own)
        .filter(|id| !id.is_empty() && id.len() <= MAX_RESPONSE_ID)
}

#[cfg(test)]
mod tests {
    use super::Ids;

    #[test]
    fn random_ids_look_like_openai_ids_and_differ() {
        let mut ids = Ids::random();
        let (first, second) = (ids.next("resp"), ids.next("resp"));
        for id in [&first, &second] {
            let digits = id.strip_prefix("resp_").expect("the prefix");
            assert_eq!(digits.len(), 48, "{id}");
            assert!(
                digits
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            );
        }
        assert_ne!(first, second);
        assert_eq!(Ids::counting().next("msg"), "msg_1");
    }

    /// Read together, a reply's usage and response id are what each reading alone gives, odd
    /// replies included (a key given twice fails only the reading that takes it).
    #[test]
    fn a_replys_usage_and_id_read_together_are_what_each_reading_gives() {
        let usage = r#""usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":2},"output_tokens":11,"output_tokens_details":{"reasoning_tokens":3},"total_tokens":23}"#;
        let replies = [
            format!(r#"{{"id":"resp_1","object":"response","output":[],{usage}}}"#),
            format!(r#"{{"object":"response",{usage},"id":"resp_\u0041"}}"#),
            r#"{"id":"resp_1","usage":null}"#.to_owned(),
            r#"{"id":"resp_1"}"#.to_owned(),
            r#"{"id":"","usage":{"input_tokens":1}}"#.to_owned(),
            format!(
                r#"{{"id":"{}","usage":{{"input_tokens":1}}}}"#,
                "r".repeat(256)
            ),
            format!(
                r#"{{"id":"{}","usage":{{"input_tokens":1}}}}"#,
                "r".repeat(255)
            ),
            r#"{"id":5,"usage":{"input_tokens":1}}"#.to_owned(),
            r#"{"id":null,"usage":{"input_tokens":1}}"#.to_owned(),
            r#"{"id":"resp_1","id":"resp_2","usage":{"input_tokens":1}}"#.to_owned(),
            r#"{"id":"resp_1","usage":{"input_tokens":1},"usage":{"input_tokens":2}}"#.to_owned(),
            r#"{"type":"response.created","response":{"id":"resp_9","usage":null},"id":"x"}"#
                .to_owned(),
            r#"{"response":{"id":7},"id":"resp_1","usage":{"input_tokens":1}}"#.to_owned(),
            r#"{"response":"resp_1","id":"resp_1"}"#.to_owned(),
            r#"{"id":"resp_1","usage":{"input_tokens":"many"}}"#.to_owned(),
            r#"{"id":"resp_1","usage":[1,2]}"#.to_owned(),
            r#"["resp_1"]"#.to_owned(),
            r#"{"id":"resp_1""#.to_owned(),
            r#"  {"id":"resp_1"}  "#.to_owned(),
            "not json".to_owned(),
        ];
        let mut read_as_object = 0;
        for reply in &replies {
            let apart = crate::protocol::reply_usage(reply.as_bytes())
                .map(|usage| (usage, super::response_id(reply.as_bytes())));
            assert_eq!(
                super::reply_usage_and_id(reply.as_bytes()),
                apart,
                "{reply}"
            );
            read_as_object += usize::from(apart.is_some());
        }
        // The cases are not all refused: most are objects with usage and an id (a count that is
        // no count, `"many"`, is read and marked malformed, not refused).
        assert_eq!(read_as_object, 15);
        let (usage, id) = super::reply_usage_and_id(replies[0].as_bytes()).unwrap();
        assert_eq!(id.as_deref(), Some("resp_1"));
        assert_eq!(usage.output_tokens, Some(11));
        assert_eq!(usage.cache_read_tokens, Some(2));
        assert_eq!(
            super::reply_usage_and_id(replies[1].as_bytes())
                .unwrap()
                .1
                .as_deref(),
            Some("resp_A")
        );
        // Not UTF-8 in the id: skipped by the usage's reading, refused by the id's.
        let bytes = b"{\"id\":\"resp_\xff\",\"usage\":{\"input_tokens\":1}}";
        let (usage, id) = super::reply_usage_and_id(bytes).unwrap();
        assert_eq!((usage.input_tokens, id), (Some(1), None));
        assert_eq!(Some(usage), crate::protocol::reply_usage(bytes));
    }

    #[test]
    fn each_nibble_is_its_lowercase_hex_digit() {
        for nibble in 0..16u64 {
            let digit = format!("{nibble:x}");
            let digits = super::hex_digits(nibble * 0x1111_1111_1111_1111);
            assert_eq!(std::str::from_utf8(&digits).unwrap(), digit.repeat(16));
        }
        // Every nibble of a word, each once: its digits are the word's, in another order.
        let word = 0x0123_4567_89ab_cdef_u64;
        let mut digits = super::hex_digits(word).to_vec();
        digits.sort_unstable();
        assert_eq!(digits, b"0123456789abcdef");
        let mut expected = format!("{:016x}", 0xfedc_ba98_7654_3210_u64).into_bytes();
        let mut got = super::hex_digits(0xfedc_ba98_7654_3210).to_vec();
        expected.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, expected);
    }
}
