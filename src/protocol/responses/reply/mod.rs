//! A chat-completions reply as a Responses `response` object.

use std::borrow::Cow;
use std::sync::LazyLock;

use serde_json::Value;

use super::write::{Json, ObjectWriter, Str, WriteJson, write_plain};
use super::{Ids, Translated};
use crate::protocol::TokenUsage;

/// A setting as a `response` repeats it: the request's own value, or the API's default.
#[derive(Debug, Clone, Copy)]
enum Setting<'a> {
    Given(Json<'a>),
    Null,
    True,
    One,
    Auto,
    DefaultTier,
    NoMetadata,
    NoTools,
    PlainText,
}

impl WriteJson for Setting<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        let literal: &[u8] = match self {
            Setting::Given(value) => return value.write_json(out),
            Setting::Null => b"null",
            Setting::True => b"true",
            Setting::One => b"1.0",
            Setting::Auto => b"\"auto\"",
            Setting::DefaultTier => b"\"default\"",
            Setting::NoMetadata => b"{}",
            Setting::NoTools => b"[]",
            Setting::PlainText => br#"{"type":"text"}"#,
        };
        out.extend_from_slice(literal);
    }
}

/// What a `response` object repeats from the request that asked for it (the Responses API
/// echoes its settings, with the API's defaults for those left out), borrowed from it.
#[derive(Debug, Clone, Copy)]
struct Echo<'a> {
    /// The request's `model`, for a reply that names none.
    model: Option<&'a str>,
    instructions: Setting<'a>,
    max_output_tokens: Setting<'a>,
    metadata: Setting<'a>,
    parallel_tool_calls: Setting<'a>,
    effort: Setting<'a>,
    service_tier: Setting<'a>,
    temperature: Setting<'a>,
    format: Setting<'a>,
    tool_choice: Setting<'a>,
    tools: Setting<'a>,
    top_p: Setting<'a>,
    user: Setting<'a>,
    /// Whether any setting is the request's own (else the echo is the defaults' own).
    any_given: bool,
}

/// The settings a request gives that a `response` repeats, each as the request has it (`None`
/// where it gives none).
pub(super) struct Given<'a> {
    pub instructions: Option<Json<'a>>,
    pub max_output_tokens: Option<Json<'a>>,
    pub metadata: Option<Json<'a>>,
    pub parallel_tool_calls: Option<Json<'a>>,
    /// `reasoning.effort`.
    pub effort: Option<Json<'a>>,
    pub service_tier: Option<Json<'a>>,
    pub temperature: Option<Json<'a>>,
    /// `text.format`.
    pub format: Option<Json<'a>>,
    pub tool_choice: Option<Json<'a>>,
    pub tools: Option<Json<'a>>,
    pub top_p: Option<Json<'a>>,
    pub user: Option<Json<'a>>,
}

impl<'a> Given<'a> {
    /// What a `response` repeats of a request calling `model` that gives these settings: for
    /// one that gives none (most), the defaults' echo, without building an [`Echo`].
    pub(super) fn echoed(self, model: Option<&'a str>) -> Echoed {
        let fields = [
            &self.instructions,
            &self.max_output_tokens,
            &self.metadata,
            &self.parallel_tool_calls,
            &self.effort,
            &self.service_tier,
            &self.temperature,
            &self.format,
            &self.tool_choice,
            &self.tools,
            &self.top_p,
            &self.user,
        ];
        if fields.iter().all(|field| field.is_none()) {
            return Echoed {
                model: model.map(str::to_owned),
                settings: Cow::Borrowed(Echo::defaults_settings()),
            };
        }
        Echo::with(model, self).owned()
    }
}

/// `request[outer][name]`, if there is one.
fn inner<'a>(request: &'a Value, outer: &str, name: &str) -> Option<&'a Value> {
    request.get(outer)?.get(name)
}

impl<'a> Given<'a> {
    /// The settings a parsed `request` gives.
    pub(super) fn of(request: &'a Value) -> Given<'a> {
        let field = |name| request.get(name).map(Json::Value);
        Given {
            instructions: field("instructions"),
            max_output_tokens: field("max_output_tokens"),
            metadata: field("metadata"),
            parallel_tool_calls: field("parallel_tool_calls"),
            // Not `Value::pointer`, which unescapes each step of its path.
            effort: inner(request, "reasoning", "effort").map(Json::Value),
            service_tier: field("service_tier"),
            temperature: field("temperature"),
            format: inner(request, "text", "format").map(Json::Value),
            tool_choice: field("tool_choice"),
            tools: field("tools"),
            top_p: field("top_p"),
            user: field("user"),
        }
    }
}

impl<'a> Echo<'a> {
    /// What a request calling `model` and giving the settings `given` has a `response`
    /// repeat (the settings are named fields rather than looked up by name: matching a dozen
    /// names cost more than the rest of the echo).
    fn with(model: Option<&'a str>, given: Given<'a>) -> Echo<'a> {
        let mut any_given = false;
        let mut given_or = |value: Option<Json<'a>>, default: Setting<'a>| match value {
            Some(value) if !value.is_null() => {
                any_given = true;
                Setting::Given(value)
            }
            _ => default,
        };
        let defaults = Echo::DEFAULTS;
        let echo = Echo {
            model,
            instructions: given_or(given.instructions, defaults.instructions),
            max_output_tokens: given_or(given.max_output_tokens, defaults.max_output_tokens),
            metadata: given_or(given.metadata, defaults.metadata),
            parallel_tool_calls: given_or(given.parallel_tool_calls, defaults.parallel_tool_calls),
            effort: given_or(given.effort, defaults.effort),
            service_tier: given_or(given.service_tier, defaults.service_tier),
            temperature: given_or(given.temperature, defaults.temperature),
            format: given_or(given.format, defaults.format),
            tool_choice: given_or(given.tool_choice, defaults.tool_choice),
            tools: given_or(given.tools, defaults.tools),
            top_p: given_or(given.top_p, defaults.top_p),
            user: given_or(given.user, defaults.user),
            any_given: false,
        };
        Echo { any_given, ..echo }
    }

    /// The echo, written once, for every `response` object of the call.
    fn owned(&self) -> Echoed {
        Echoed {
            model: self.model.map(str::to_owned),
            settings: match self.any_given {
                true => Cow::Owned(self.settings()),
                false => Cow::Borrowed(Echo::defaults_settings()),
            },
        }
    }

    /// What a request that gives none of the settings has repeated, written once.
    fn defaults_settings() -> &'static [u8] {
        static DEFAULTS: LazyLock<Vec<u8>> = LazyLock::new(|| Echo::DEFAULTS.settings());
        &DEFAULTS
    }

    /// A request that gives none of the settings.
    const DEFAULTS: Echo<'static> = Echo {
        model: None,
        instructions: Setting::Null,
        max_output_tokens: Setting::Null,
        metadata: Setting::NoMetadata,
        parallel_tool_calls: Setting::True,
        effort: Setting::Null,
        service_tier: Setting::DefaultTier,
        temperature: Setting::One,
        format: Setting::PlainText,
        tool_choice: Setting::Auto,
        tools: Setting::NoTools,
        top_p: Setting::One,
        user: Setting::Null,
        any_given: false,
    };

    /// The settings, as a JSON object.
    fn settings(&self) -> Vec<u8> {
        let mut settings = Vec::with_capacity(320);
        let mut object = ObjectWriter::open(&mut settings);
        object.raw("background", "false");
        object.write("instructions", &self.instructions);
        object.write("max_output_tokens", &self.max_output_tokens);
        object.write("metadata", &self.metadata);
        object.write("parallel_tool_calls", &self.parallel_tool_calls);
        object.raw("previous_response_id", "null");
        let mut reasoning = object.object("reasoning");
        reasoning.write("effort", &self.effort);
        reasoning.raw("summary", "null");
        reasoning.close();
        object.write("service_tier", &self.service_tier);
        // A translated call keeps nothing: its response cannot be fetched again.
        object.raw("store", "false");
        object.write("temperature", &self.temperature);
        let mut text = object.object("text");
        text.write("format", &self.format);
        text.close();
        object.write("tool_choice", &self.tool_choice);
        object.write("tools", &self.tools);
        object.write("top_p", &self.top_p);
        object.raw("truncation", "\"disabled\"");
        object.write("user", &self.user);
        object.close();
        settings
    }
}

/// What every `response` object of a call repeats from its request, written.
#[derive(Debug, Clone)]
pub(crate) struct Echoed {
    model: Option<String>,
    /// The settings, from `background` to `user`, as a JSON object (one shared object for a
    /// request that gives none).
    settings: Cow<'static, [u8]>,
}

impl Echoed {
    /// What a `response` repeats of the request in `body`, whether or not it translates (the
    /// mock answers every request); the defaults when it is not JSON.
    pub(crate) fn of_request(body: &[u8]) -> Echoed {
        let request: Value = serde_json::from_slice(body).unwrap_or_default();
        Given::of(&request).echoed(request["model"].as_str())
    }

    /// A `response` object, appended to `out`. Written by hand rather than derived:
    /// `serde_json` escapes every key of a derived struct a byte at a time, which was a third
    /// of what writing a response cost.
    pub(super) fn write(
        &self,
        head: &Head<'_>,
        status: Status<'_>,
        output: &[impl WriteJson],
        usage: &impl WriteJson,
        out: &mut Vec<u8>,
    ) {
        // The fixed runs between the values are copied whole: a `response` is written on
        // every call, and a field at a time (key, quotes, colon, comma) its fixed parts took
        // more work than its values.
        write_plain(br#"{"id":"#, &head.id, out);
        out.extend_from_slice(br#","object":"response","created_at":"#);
        out.extend_from_slice(itoa::Buffer::new().format(head.created_at).as_bytes());
        match status {
            Status::Incomplete(reason) => {
                out.extend_from_slice(
                    br#","status":"incomplete","error":null,"incomplete_details":{"reason":"#,
                );
                reason.write_json(out);
                out.push(b'}');
            }
            Status::InProgress => out.extend_from_slice(
                br#","status":"in_progress","error":null,"incomplete_details":null"#,
            ),
            Status::Completed => out.extend_from_slice(
                br#","status":"completed","error":null,"incomplete_details":null"#,
            ),
        }
        out.extend_from_slice(br#","model":"#);
        head.model.write_json(out);
        out.extend_from_slice(br#","output":"#);
        output.write_json(out);
        out.extend_from_slice(br#","usage":"#);
        usage.write_json(out);
        // The settings object's fields, as this object's last (there is always one:
        // `background` opens them).
        out.push(b',');
        out.extend_from_slice(&self.settings[1..]);
    }
}

/// What every `response` object of one call shares.
#[derive(Debug, Clone)]
pub(super) struct Head<'a> {
    pub id: Cow<'a, str>,
    pub created_at: i64,
    pub model: Cow<'a, str>,
}

/// Where a response stands.
#[derive(Debug, Clone, Copy)]
pub(super) enum Status<'a> {
    InProgress,
    Completed,
    /// Cut short; the reason as the Responses API names it.
    Incomplete(&'a str),
}

impl Status<'_> {
    /// The status a chat `finish_reason` ends a response with.
    pub(super) fn finished(reason: Option<&str>) -> Status<'static> {
        match reason {
            Some("length") => Status::Incomplete("max_output_tokens"),
            Some("content_filter") => Status::Incomplete("content_filter"),
            _ => Status::Completed,
        }
    }

    /// The event that ends a stream with this status.
    pub(super) fn end_event(self) -> &'static str {
        match self {
            Status::Incomplete(_) => "response.incomplete",
            _ => "response.completed",
        }
    }
}

/// Token counts in the Responses API's names.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Usage {
    input_tokens: i64,
    /// Of the input tokens, those read from the provider's cache.
    cached_tokens: i64,
    output_tokens: i64,
    /// Of the output tokens, those spent reasoning.
    reasoning_tokens: i64,
    total_tokens: i64,
}

impl Usage {
    /// Chat completions' counts in the Responses API's names: `prompt` tokens (`cached` of them
    /// read from the cache), `completion` tokens (`reasoning` of them spent reasoning), and
    /// their `total` (the sum when the reply gives none).
    fn new(prompt: i64, completion: i64, total: Option<i64>, cached: i64, reasoning: i64) -> Usage {
        Usage {
            input_tokens: prompt,
            cached_tokens: cached,
            output_tokens: completion,
            reasoning_tokens: reasoning,
            total_tokens: total.unwrap_or(prompt.saturating_add(completion)),
        }
    }

    /// `input` and `output` tokens, none of them cached or reasoning.
    pub(crate) fn counted(input: i64, output: i64) -> Usage {
        Usage::new(input, output, None, 0, 0)
    }
}

impl WriteJson for Usage {
    fn write_json(&self, out: &mut Vec<u8>) {
        // Fixed runs copied whole, as in `Echoed::write`.
        let mut number = itoa::Buffer::new();
        let mut count = |run: &[u8], n: i64, out: &mut Vec<u8>| {
            out.extend_from_slice(run);
            out.extend_from_slice(number.format(n).as_bytes());
        };
        count(br#"{"input_tokens":"#, self.input_tokens, out);
        count(
            br#","input_tokens_details":{"cached_tokens":"#,
            self.cached_tokens,
            out,
        );
        count(br#"},"output_tokens":"#, self.output_tokens, out);
        count(
            br#","output_tokens_details":{"reasoning_tokens":"#,
            self.reasoning_tokens,
            out,
        );
        count(br#"},"total_tokens":"#, self.total_tokens, out);
        out.push(b'}');
    }
}

/// Chat completions' `usage` in the Responses API's names; `None` when there is none.
pub(super) fn usage(chat_usage: Option<&Value>) -> Option<Usage> {
    let usage = chat_usage.filter(|usage| usage.is_object())?;
    let count = |pointer: &str| usage.pointer(pointer).and_then(Value::as_i64).unwrap_or(0);
    Some(Usage::new(
        count("/prompt_tokens"),
        count("/completion_tokens"),
        usage.get("total_tokens").and_then(Value::as_i64),
        count("/prompt_tokens_details/cached_tokens"),
        count("/completion_tokens_details/reasoning_tokens"),
    ))
}

/// An output item.
pub(super) enum OutputItem<'a> {
    /// The model's reasoning, as chat-completions servers of reasoning models send it
    /// (`reasoning_content`); no text when it is empty (as a streamed item opens).
    Reasoning { id: &'a str, text: Option<Str<'a>> },
    Message {
        id: &'a str,
        status: &'a str,
        content: Option<Part<'a>>,
    },
    /// A function call (`arguments`), or a custom tool's call (`input`, free-form).
    FunctionCall {
        id: &'a str,
        status: &'a str,
        custom: bool,
        call_id: Str<'a>,
        name: Str<'a>,
        arguments: Str<'a>,
        /// A namespaced tool's namespace.
        namespace: Option<&'a str>,
    },
}

impl WriteJson for OutputItem<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            // A reply's message, on every call: its fixed runs copied whole (see
            // `Echoed::write`).
            OutputItem::Message {
                id,
                status,
                content,
            } => {
                write_plain(br#"{"type":"message","id":"#, id, out);
                write_plain(br#","status":"#, status, out);
                out.extend_from_slice(br#","role":"assistant","content":"#);
                content.as_slice().write_json(out);
                out.push(b'}');
            }
            OutputItem::Reasoning { id, text } => {
                let mut item = ObjectWriter::open(out);
                item.raw("type", r#""reasoning""#);
                item.id("id", id);
                item.raw("summary", "[]");
                match text {
                    Some(text) => item.write("content", &[ReasoningText(*text)][..]),
                    None => item.raw("content", "[]"),
                }
                item.close();
            }
            OutputItem::FunctionCall {
                id,
                status,
                custom,
                call_id,
                name,
                arguments,
                namespace,
            } => {
                let (kind, text) = if *custom {
                    (r#""custom_tool_call""#, "input")
                } else {
                    (r#""function_call""#, "arguments")
                };
                let mut item = ObjectWriter::open(out);
                item.raw("type", kind);
                item.id("id", id);
                item.field("status", status);
                item.write("call_id", call_id);
                item.write("name", name);
                if let Some(namespace) = namespace {
                    item.field("namespace", namespace);
                }
                item.write(text, arguments);
                item.close();
            }
        }
    }
}

/// A reasoning item's text.
struct ReasoningText<'a>(Str<'a>);

impl WriteJson for ReasoningText<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        let mut part = ObjectWriter::open(out);
        part.raw("type", r#""reasoning_text""#);
        part.write("text", &self.0);
        part.close();
    }
}

/// The reasoning text a chat message or delta carries: `reasoning_content` (vLLM, `DeepSeek`,
/// most servers of open reasoning models) or `reasoning` (some routers).
pub(super) fn reasoning_of(message: &Value) -> Option<&str> {
    message["reasoning_content"]
        .as_str()
        .or(message["reasoning"].as_str())
        .filter(|text| !text.is_empty())
}

/// A message's content part: text, or a refusal.
pub(super) struct Part<'a> {
    pub(super) refusal: bool,
    pub(super) text: Str<'a>,
}

impl WriteJson for Part<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        if self.refusal {
            out.extend_from_slice(br#"{"type":"refusal","refusal":"#);
            self.text.write_json(out);
            out.push(b'}');
        } else {
            out.extend_from_slice(br#"{"type":"output_text","text":"#);
            self.text.write_json(out);
            out.extend_from_slice(br#","annotations":[],"logprobs":[]}"#);
        }
    }
}

/// The `response` object for a chat-completions `reply` to the `translated` request.
pub fn response_from_chat(translated: &Translated, reply: &Value, ids: &mut Ids) -> Value {
    serde_json::from_slice(&response_json_from_chat(translated, reply, ids))
        .expect("the response is JSON")
}

/// [`response_from_chat`], serialised: what a translating upstream answers with.
pub fn response_json_from_chat(translated: &Translated, reply: &Value, ids: &mut Ids) -> Vec<u8> {
    let mut read = ChatReply::of(reply);
    // A namespaced tool's call comes back under its name, in its namespace.
    for call in &mut read.calls {
        let flat = match call.name {
            Str::Read(text) | Str::Unescaped(text) => text,
        };
        if let Some((namespace, name)) = translated.unflatten(flat) {
            call.namespace = Some(namespace);
            call.name = Str::Read(name);
        }
    }
    write_response(translated.echoed(), &read, ids)
}

/// [`response_json_from_chat`] for a reply still in its bytes (the translating upstream's
/// path), with the usage the reply reports as
/// [`reply_usage`](crate::protocol::reply_usage) reads it: `None` where that finds no JSON
/// object or cannot read the `usage`, which the billing layer judges a failed call. An error
/// when `reply` is not JSON.
///
/// ```
/// use model_gateway::protocol::responses::{Ids, Translated, response_json_from_chat_bytes};
/// use serde_json::Value;
///
/// let translated = Translated::from_slice(br#"{"model":"m","input":"Hello"}"#).unwrap();
/// let reply = br#"{"created":1,"model":"m","choices":[{"message":{"content":"Hi"},
///                 "finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
/// let (response, usage) =
///     response_json_from_chat_bytes(&translated, reply, &mut Ids::counting()).unwrap();
/// let response: Value = serde_json::from_slice(&response).unwrap();
/// assert_eq!(response["output"][0]["content"][0]["text"], "Hi");
/// assert_eq!(response["usage"]["total_tokens"], 4);
/// assert_eq!(usage.unwrap().output_tokens, Some(1));
/// assert!(response_json_from_chat_bytes(&translated, b"not json", &mut Ids::counting()).is_err());
/// ```
pub fn response_json_from_chat_bytes(
    translated: &Translated,
    reply: &[u8],
    ids: &mut Ids,
) -> Result<(Vec<u8>, Option<TokenUsage>), serde_json::Error> {
    let parsed: Value = serde_json::from_slice(reply)?;
    // The usage is read as a chat call reads it, so that both paths charge one reply alike.
    let usage = crate::protocol::reply_usage(reply);
    Ok((response_json_from_chat(translated, &parsed, ids), usage))
}

/// What the translation reads from a chat-completions reply, borrowed from it.
#[derive(Debug, Default)]
pub(crate) struct ChatReply<'a> {
    pub created: Option<i64>,
    pub model: Option<&'a str>,
    /// The message's text (`content`), when it is a string.
    pub text: Option<Str<'a>>,
    pub refusal: Option<Str<'a>>,
    pub reasoning: Option<Str<'a>>,
    pub calls: Vec<ToolCall<'a>>,
    pub finish_reason: Option<&'a str>,
    pub usage: Option<Usage>,
}

/// A tool call of a chat reply: a function's, or a custom tool's (whose `input` is held in
/// `arguments`).
#[derive(Debug)]
pub(crate) struct ToolCall<'a> {
    pub id: Option<Str<'a>>,
    pub custom: bool,
    pub name: Str<'a>,
    pub arguments: Str<'a>,
    /// The namespace of a namespaced tool's call (its flat name read back).
    pub namespace: Option<&'a str>,
}

/// Whether a chat tool call (or a stream's first piece of one) is a custom tool's: its `type`
/// says so, or it has no `type` and carries a `custom` object and no `function`.
pub(super) fn is_custom(kind: Option<&str>, has_custom: bool, has_function: bool) -> bool {
    match kind {
        Some(kind) => kind == "custom",
        None => has_custom && !has_function,
    }
}

/// The prefix of a tool call item's id, as `OpenAI` writes them: `ctc` for a custom tool's
/// call, `fc` for a function's.
pub(super) fn call_item_prefix(custom: bool) -> &'static str {
    if custom { "ctc" } else { "fc" }
}

/// A chat tool call (or a stream's piece of one) read from a `Value`: whether it is a custom
/// tool's, its name, and its text (a function's `arguments`, a custom tool's `input`), each
/// when it is a string.
pub(super) fn call_of_value(call: &Value) -> (bool, Option<&str>, Option<&str>) {
    let custom = is_custom(
        call["type"].as_str(),
        !call["custom"].is_null(),
        !call["function"].is_null(),
    );
    let (spec, text) = if custom {
        (&call["custom"], "input")
    } else {
        (&call["function"], "arguments")
    };
    (custom, spec["name"].as_str(), spec[text].as_str())
}

impl<'a> ChatReply<'a> {
    /// The parts of `reply` the translation reads: strings where strings are expected,
    /// anything else skipped.
    fn of(reply: &'a Value) -> ChatReply<'a> {
        let choice = &reply["choices"][0];
        let message = &choice["message"];
        let calls = message["tool_calls"]
            .as_array()
            .map_or(&[][..], Vec::as_slice);
        ChatReply {
            created: reply["created"].as_i64(),
            model: reply["model"].as_str(),
            text: message["content"].as_str().map(Str::Read),
            refusal: message["refusal"].as_str().map(Str::Read),
            reasoning: reasoning_of(message).map(Str::Read),
            calls: calls
                .iter()
                .map(|call| {
                    let (custom, name, arguments) = call_of_value(call);
                    ToolCall {
                        id: call["id"].as_str().map(Str::Read),
                        custom,
                        name: Str::Read(name.unwrap_or_default()),
                        arguments: Str::Read(arguments.unwrap_or(if custom { "" } else { "{}" })),
                        namespace: None,
                    }
                })
                .collect(),
            finish_reason: choice["finish_reason"].as_str(),
            usage: usage(reply.get("usage")),
        }
    }
}

/// The words of a text, a space between each (`str::split` sets up a searcher that costs more
/// than the few ids of a response take to scan).
struct SpaceSeparated<'a>(&'a str);

impl<'a> Iterator for SpaceSeparated<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        if self.0.is_empty() {
            return None;
        }
        let end = memchr::memchr(b' ', self.0.as_bytes()).unwrap_or(self.0.len());
        let word = &self.0[..end];
        self.0 = self.0.get(end + 1..).unwrap_or_default();
        Some(word)
    }
}

/// The `response` object, serialised, for the chat `reply` to a request that has it repeat
/// `echoed`.
pub(crate) fn write_response(echoed: &Echoed, reply: &ChatReply<'_>, ids: &mut Ids) -> Vec<u8> {
    let text = reply.text.filter(|text| !text.is_empty());
    let refusal = reply.refusal.filter(|text| !text.is_empty());
    let said = refusal.map(|r| (true, r)).or(text.map(|t| (false, t)));
    // The response's id and its items', in one text, a space between each (an id holds
    // none): one allocation for them all, checked as text once.
    let items = usize::from(reply.reasoning.is_some()) + usize::from(said.is_some());
    let mut id_text = Vec::with_capacity(56 * (1 + items + reply.calls.len()));
    ids.push_next("resp", &mut id_text);
    let mut push_id = |prefix| {
        id_text.push(b' ');
        ids.push_next(prefix, &mut id_text);
    };
    if reply.reasoning.is_some() {
        push_id("rs");
    }
    if said.is_some() {
        push_id("msg");
    }
    for call in &reply.calls {
        push_id(call_item_prefix(call.custom));
    }
    let id_text = String::from_utf8(id_text).expect("ids are ASCII");
    let mut id = SpaceSeparated(&id_text);
    let head = Head {
        id: Cow::Borrowed(id.next().expect("the response's id")),
        created_at: reply
            .created
            .unwrap_or_else(|| chrono::Utc::now().timestamp()),
        model: Cow::Borrowed(reply.model.or(echoed.model.as_deref()).unwrap_or_default()),
    };
    let mut output = Vec::with_capacity(items + reply.calls.len());
    if let Some(text) = reply.reasoning {
        output.push(OutputItem::Reasoning {
            id: id.next().expect("an id per item"),
            text: Some(text),
        });
    }
    if let Some((is_refusal, text)) = said {
        output.push(OutputItem::Message {
            id: id.next().expect("an id per item"),
            status: "completed",
            content: Some(Part {
                refusal: is_refusal,
                text,
            }),
        });
    }
    for call in &reply.calls {
        let item_id = id.next().expect("an id per item");
        output.push(OutputItem::FunctionCall {
            id: item_id,
            status: "completed",
            custom: call.custom,
            call_id: call.id.unwrap_or(Str::Read(item_id)),
            name: call.name,
            arguments: call.arguments,
            namespace: call.namespace,
        });
    }
    let status = Status::finished(reply.finish_reason);
    let mut out = Vec::with_capacity(1024 + echoed.settings.len());
    echoed.write(&head, status, &output, &reply.usage, &mut out);
    out
}

#[cfg(test)]
mod tests;
