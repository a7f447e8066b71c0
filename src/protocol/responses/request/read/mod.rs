//! A Responses request translated straight from its bytes: the path of the requests clients
//! send. Nothing is built into a `serde_json::Value`: what is passed on as it is (texts, tool
//! schemas, settings) is copied as the client wrote it, strings with their escapes, and what is
//! only compared (types, roles) is borrowed. A coding agent sends its whole conversation and its
//! tools on every turn, so this is most of what a translated call costs before it reaches the
//! provider.
//!
//! Only the ordinary is read here. Anything else (a field of an unexpected type, a duplicated
//! key, an unknown field, anything refused) gives way to the `Value` reading in the parent
//! module, which decides it, so that the two readings cannot differ in what they accept or in
//! how they refuse; on what both read, a test checks that they translate alike.

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, IgnoredAny};
use serde_json::Value;
use serde_json::value::RawValue;

use super::super::borrowed_text;
use super::super::reply::{Echoed, Given};
use super::super::write::{Json, ObjectWriter, WriteJson};

/// A Responses request, with the fields the translation reads. An unknown field fails the
/// reading (the `Value` reading names it).
///
/// The router reads a Responses call's fields from this reading too (the ones it checks are
/// kept as written), so that a call that translates is read once. `input` is read into items
/// here, whether or not the call translates: a call to a native channel reads them for
/// nothing, which costs less than a translated call's second scan of them cost.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Request<'a> {
    #[serde(borrow)]
    pub(crate) model: Option<&'a RawValue>,
    #[serde(borrow)]
    instructions: Option<RawStr<'a>>,
    /// Read into items as the request is read: capturing it as written and reading it again
    /// scanned it twice (for a one-message request, a third of what its translation cost). A
    /// request whose `input` does not read so (an item of a shape the translation does not
    /// know) fails this reading, and the `Value` reading decides it.
    #[serde(borrow)]
    input: Option<TextOr<'a, Item<'a>>>,
    #[serde(borrow)]
    pub(crate) stream: Option<&'a RawValue>,
    #[serde(borrow)]
    temperature: Option<&'a RawValue>,
    #[serde(borrow)]
    top_p: Option<&'a RawValue>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) service_tier: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) max_output_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    parallel_tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    top_logprobs: Option<&'a RawValue>,
    #[serde(borrow)]
    metadata: Option<&'a RawValue>,
    /// Read as written for the echo, then read for the translation.
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    tool_choice: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<TextSetting<'a>>,
    #[serde(borrow)]
    reasoning: Option<ReasoningSetting<'a>>,
    // Hints, dropped (see `HINTS`); `store` also says whether a native upstream's response
    // is recorded.
    #[serde(borrow)]
    store: Option<&'a RawValue>,
    #[serde(rename = "client_metadata")]
    _client_metadata: Option<IgnoredAny>,
    #[serde(rename = "include")]
    _include: Option<IgnoredAny>,
    #[serde(rename = "prompt_cache_key")]
    _prompt_cache_key: Option<IgnoredAny>,
    #[serde(rename = "prompt_cache_retention")]
    _prompt_cache_retention: Option<IgnoredAny>,
    #[serde(rename = "safety_identifier")]
    _safety_identifier: Option<IgnoredAny>,
    #[serde(borrow)]
    pub(crate) stream_options: Option<&'a RawValue>,
    // Refused unless absent, null, or (the first two) their default.
    #[serde(borrow)]
    truncation: Option<&'a RawValue>,
    #[serde(borrow)]
    background: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) previous_response_id: Option<&'a RawValue>,
    conversation: Option<IgnoredAny>,
    prompt: Option<IgnoredAny>,
    max_tool_calls: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct TextSetting<'a> {
    #[serde(borrow)]
    format: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ReasoningSetting<'a> {
    #[serde(borrow)]
    effort: Option<&'a RawValue>,
}

/// An `input` item: a message, a function or custom tool call or its output, or earlier
/// reasoning.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type", borrow, default, deserialize_with = "borrowed_text")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    role: Option<Cow<'a, str>>,
    #[serde(borrow)]
    content: Option<RawTextOr<'a, Part<'a>>>,
    #[serde(borrow)]
    call_id: Option<RawStr<'a>>,
    #[serde(borrow)]
    name: Option<RawStr<'a>>,
    #[serde(borrow)]
    arguments: Option<RawStr<'a>>,
    /// A custom tool call's input.
    #[serde(borrow)]
    input: Option<RawStr<'a>>,
    #[serde(borrow)]
    output: Option<RawTextOr<'a, Part<'a>>>,
    /// A call of a namespaced tool's namespace: read as a `Value` (its name is flattened).
    namespace: Option<serde::de::IgnoredAny>,
}

/// A content part (of a message, or of a function call's output).
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow, default, deserialize_with = "borrowed_text")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    text: Option<RawStr<'a>>,
    #[serde(borrow)]
    refusal: Option<RawStr<'a>>,
    #[serde(borrow)]
    image_url: Option<RawStr<'a>>,
    #[serde(borrow)]
    detail: Option<RawStr<'a>>,
    #[serde(borrow)]
    file_data: Option<&'a RawValue>,
    #[serde(borrow)]
    file_id: Option<&'a RawValue>,
    #[serde(borrow)]
    filename: Option<&'a RawValue>,
    #[serde(borrow)]
    file_url: Option<&'a RawValue>,
    #[serde(borrow)]
    input_audio: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Tool<'a> {
    #[serde(rename = "type", borrow, default, deserialize_with = "borrowed_text")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    description: Option<&'a RawValue>,
    #[serde(borrow)]
    parameters: Option<&'a RawValue>,
    #[serde(borrow)]
    strict: Option<&'a RawValue>,
    /// A custom tool's input format.
    #[serde(borrow)]
    format: Option<&'a RawValue>,
}

/// A string, or a list of `T`: the request's `input`, read in one pass (its list is the whole
/// conversation; a string `input` is short).
enum TextOr<'a, T> {
    Text(Cow<'a, str>),
    List(Vec<T>),
}

impl<'de: 'a, 'a, T: Deserialize<'de>> Deserialize<'de> for TextOr<'a, T> {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<'a, T>(PhantomData<(&'a (), T)>);
        impl<'de: 'a, 'a, T: Deserialize<'de>> de::Visitor<'de> for Visitor<'a, T> {
            type Value = TextOr<'a, T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Self::Value, E> {
                Ok(TextOr::Text(Cow::Borrowed(text)))
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                Ok(TextOr::Text(Cow::Owned(text.to_owned())))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut list = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(element) = seq.next_element()? {
                    list.push(element);
                }
                Ok(TextOr::List(list))
            }
        }
        deserializer.deserialize_any(Visitor(PhantomData))
    }
}

/// A JSON string as the client wrote it, quotes and escapes included: passed on by copying it,
/// rather than unescaped as it is read and escaped again as it is written (a coding agent's
/// tool outputs and instructions are long, and hold escaped line breaks).
#[derive(Debug, Clone, Copy)]
struct RawStr<'a>(&'a RawValue);

impl<'a> RawStr<'a> {
    /// The string with its quotes, as written.
    fn raw(self) -> &'a RawValue {
        self.0
    }

    /// What is between the quotes, still escaped.
    fn escaped(self) -> &'a str {
        let text = self.0.get();
        &text[1..text.len() - 1]
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for RawStr<'a> {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = <&'a RawValue>::deserialize(deserializer)?;
        if !raw.get().starts_with('"') {
            return Err(de::Error::custom("a string was expected"));
        }
        RawStr::of_string(raw).map_err(de::Error::custom)
    }
}

impl<'a> RawStr<'a> {
    /// A raw value that is a string (it starts with a quote), checked as reading it would
    /// check it: `serde_json` skips a string without pairing its escaped surrogates
    /// (`\ud83d\ude00`), so a string holding any is read, and a lone one refused.
    fn of_string(raw: &'a RawValue) -> Result<RawStr<'a>, serde_json::Error> {
        if may_escape_a_surrogate(raw.get()) {
            serde_json::from_str::<Cow<'_, str>>(raw.get())?;
        }
        Ok(RawStr(raw))
    }
}

/// Whether a JSON string literal may hold an escaped UTF-16 surrogate (`\uD800` to `\uDFFF`).
fn may_escape_a_surrogate(literal: &str) -> bool {
    let bytes = literal.as_bytes();
    let surrogate = |at: usize| {
        matches!(
            bytes[at + 2..],
            [b'd' | b'D', b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F', ..]
        )
    };
    // A `memmem` search costs more to set up than a short text takes to scan a backslash at a
    // time; a long one (a tool's output) holds many backslashes, escaped line breaks.
    if bytes.len() < 256 {
        memchr::memchr_iter(b'\\', bytes)
            .any(|at| bytes.get(at + 1) == Some(&b'u') && surrogate(at))
    } else {
        memchr::memmem::find_iter(bytes, b"\\u").any(surrogate)
    }
}

impl WriteJson for RawStr<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        // A JSON string holds no raw line break: copied as it is.
        out.extend_from_slice(self.0.get().as_bytes());
    }
}

/// A string, as written (see [`RawStr`]), or a list of `T`: a message's `content`, a call
/// output's `output`. The value is read once as written, and a list read again from it (a list
/// of parts is short; the long values are the strings).
enum RawTextOr<'a, T> {
    Text(RawStr<'a>),
    List(Vec<T>),
}

impl<'de: 'a, 'a, T: Deserialize<'a>> Deserialize<'de> for RawTextOr<'a, T> {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = <&'a RawValue>::deserialize(deserializer)?;
        if raw.get().starts_with('"') {
            return RawStr::of_string(raw)
                .map(RawTextOr::Text)
                .map_err(de::Error::custom);
        }
        serde_json::from_str(raw.get())
            .map(RawTextOr::List)
            .map_err(de::Error::custom)
    }
}

/// A text a chat message holds.
enum Text<'r> {
    /// As the client wrote it.
    Raw(RawStr<'r>),
    /// Read (unescaped) from the request.
    Read(&'r str),
    /// Pieces as the client wrote them, joined (still escaped, without quotes).
    Joined(String),
}

impl WriteJson for Text<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            Text::Raw(raw) => raw.write_json(out),
            Text::Read(text) => text.write_json(out),
            Text::Joined(escaped) => {
                out.push(b'"');
                out.extend_from_slice(escaped.as_bytes());
                out.push(b'"');
            }
        }
    }
}

/// The chat request's fields after its `model` (see `Translated`) and the echo, for `body`;
/// `None` when the `Value` reading must decide.
pub(super) fn translate(body: &[u8]) -> Option<(Vec<u8>, Echoed)> {
    let request = read(body)?;
    let model = match request.model {
        Some(raw) => Some(crate::protocol::json_string(raw)?),
        None => None,
    };
    translate_read(&request, model.as_deref(), body.len())
}

impl Request<'_> {
    /// Whether the request has an `input`, a string or a list of items.
    pub(crate) fn has_input(&self) -> bool {
        self.input.is_some()
    }

    /// Whether the request lets the provider keep its response, as
    /// [`kept_by_provider`](super::super::kept_by_provider) reads it from the same body.
    pub(crate) fn kept_by_provider(&self) -> bool {
        self.store.is_none_or(|store| store.get() != "false")
    }
}

/// `body` read as a Responses request; `None` when the `Value` reading must decide.
pub(crate) fn read(body: &[u8]) -> Option<Request<'_>> {
    // serde would take a list for a struct too; a request is an object.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    crate::protocol::read_json(body).ok()
}

/// The chat request's fields after its `model` and the echo, for a `request` read by [`read`]
/// from `size` bytes, whose `model` (as written, a string) reads `model`; `None` when the
/// `Value` reading must decide.
pub(super) fn translate_read(
    request: &Request<'_>,
    model: Option<&str>,
    size: usize,
) -> Option<(Vec<u8>, Echoed)> {
    // What the reading keeps as written is checked here as a typed reading would check it.
    let stream = match request.stream.map(RawValue::get) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return None,
    };
    let input = request.input.as_ref()?;
    let refused = request.previous_response_id.is_some()
        || request.conversation.is_some()
        || request.prompt.is_some()
        || request.max_tool_calls.is_some()
        || request
            .truncation
            .is_some_and(|value| value.get() != r#""disabled""#)
        || request
            .background
            .is_some_and(|value| value.get() != "false");
    if refused {
        return None;
    }
    let mut chat = Vec::with_capacity(size + 64);
    let mut object = ObjectWriter::open(&mut chat);
    let messages = messages(request, input)?;
    object.write("messages", &messages[..]);
    if stream {
        object.raw("stream", "true");
        // The final usage, for `response.completed`, as the `Value` reading asks for it.
        object.raw("stream_options", r#"{"include_usage":true}"#);
    }
    let copied = [
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("user", request.user),
        ("service_tier", request.service_tier),
        ("max_tokens", request.max_output_tokens),
        ("parallel_tool_calls", request.parallel_tool_calls),
    ];
    object.write_given(copied);
    if let Some(tools) = request.tools {
        let tools: Vec<Tool<'_>> = serde_json::from_str(tools.get()).ok()?;
        let tools = tools.iter().map(ChatTool::of).collect::<Option<Vec<_>>>()?;
        if !tools.is_empty() {
            object.write("tools", &tools[..]);
        }
    }
    // Small and seldom given: read as the `Value` reading reads them.
    if let Some(choice) = request.tool_choice {
        let choice: Value = serde_json::from_str(choice.get()).ok()?;
        if let Some(choice) = super::tool_choice(&choice).ok()? {
            object.write("tool_choice", &choice);
        }
    }
    let format = request.text.as_ref().and_then(|text| text.format);
    if let Some(format) = format {
        let format: Value = serde_json::from_str(format.get()).ok()?;
        if let Some(format) = super::response_format(Some(&format)).ok()? {
            object.write("response_format", &format);
        }
    }
    let effort = request
        .reasoning
        .as_ref()
        .and_then(|reasoning| reasoning.effort);
    if let Some(effort) = effort {
        object.write("reasoning_effort", effort);
    }
    if let Some(top_logprobs) = request.top_logprobs {
        object.raw("logprobs", "true");
        object.write("top_logprobs", top_logprobs);
    }
    object.close();
    // `{"messages":...}` becomes `,"messages":...}`: the fields after the model.
    chat[0] = b',';
    Some((chat, echo(request, model, effort, format)))
}

/// What the `response` repeats of `request`, which calls `model`, written.
fn echo<'a>(
    request: &'a Request<'a>,
    model: Option<&'a str>,
    effort: Option<&'a RawValue>,
    format: Option<&'a RawValue>,
) -> Echoed {
    let raw = |value: Option<&'a RawValue>| value.map(Json::Raw);
    Given {
        instructions: request.instructions.map(|text| Json::Raw(text.raw())),
        max_output_tokens: raw(request.max_output_tokens),
        metadata: raw(request.metadata),
        parallel_tool_calls: raw(request.parallel_tool_calls),
        effort: raw(effort),
        service_tier: raw(request.service_tier),
        temperature: raw(request.temperature),
        format: raw(format),
        tool_choice: raw(request.tool_choice),
        tools: raw(request.tools),
        top_p: raw(request.top_p),
        user: raw(request.user),
    }
    .echoed(model)
}

/// A chat message, borrowed from the request.
enum Message<'r> {
    /// A message whose content is one string.
    Text { role: &'static str, text: Text<'r> },
    /// A user or system message's parts.
    Parts {
        role: &'static str,
        parts: Vec<ChatPart<'r>>,
    },
    /// An earlier reply: its text (`null` for calls alone), a refusal, its tool calls.
    Assistant {
        text: Option<Text<'r>>,
        refusal: Option<Text<'r>>,
        calls: Vec<Call<'r>>,
    },
    /// A function call's output.
    Tool {
        call_id: RawStr<'r>,
        output: Text<'r>,
    },
}

/// A function call (`{}` for arguments not given) or a custom tool's (`""` for input not
/// given), in an assistant message.
struct Call<'r> {
    id: RawStr<'r>,
    custom: bool,
    name: RawStr<'r>,
    arguments: Option<RawStr<'r>>,
}

/// The chat messages of `request`: `instructions`, then `input`'s; `None` for anything the
/// `Value` reading must decide.
fn messages<'r>(
    request: &'r Request<'r>,
    input: &'r TextOr<'r, Item<'r>>,
) -> Option<Vec<Message<'r>>> {
    let items = match input {
        TextOr::List(items) => items.as_slice(),
        TextOr::Text(_) => &[],
    };
    let mut messages = Vec::with_capacity(items.len() + 1);
    if let Some(instructions) = request.instructions {
        messages.push(Message::Text {
            role: "system",
            text: Text::Raw(instructions),
        });
    }
    if let TextOr::Text(text) = input {
        messages.push(Message::Text {
            role: "user",
            text: Text::Read(text),
        });
    }
    for item in items {
        match (item.kind.as_deref(), item.role.as_deref()) {
            (Some("message") | None, Some(role)) => messages.push(message(item, role)?),
            (Some(kind @ ("function_call" | "custom_tool_call")), _) => {
                if item.namespace.is_some() {
                    return None;
                }
                let custom = kind == "custom_tool_call";
                let call = Call {
                    id: item.call_id?,
                    custom,
                    name: item.name?,
                    arguments: if custom { item.input } else { item.arguments },
                };
                match messages.last_mut() {
                    Some(Message::Assistant { calls, .. }) => calls.push(call),
                    _ => messages.push(Message::Assistant {
                        text: None,
                        refusal: None,
                        calls: vec![call],
                    }),
                }
            }
            (Some("function_call_output" | "custom_tool_call_output"), _) => {
                let output = match item.output.as_ref()? {
                    RawTextOr::Text(text) => Text::Raw(*text),
                    RawTextOr::List(parts) => {
                        let mut text = String::new();
                        for part in parts {
                            match (part.kind.as_deref(), part.text) {
                                (Some("input_text" | "output_text"), Some(piece)) => {
                                    text.push_str(piece.escaped())
                                }
                                _ => return None,
                            }
                        }
                        Text::Joined(text)
                    }
                };
                messages.push(Message::Tool {
                    call_id: item.call_id?,
                    output,
                });
            }
            // The model's own reasoning from an earlier turn: chat completions takes none back.
            (Some("reasoning"), _) => {}
            _ => return None,
        }
    }
    Some(messages)
}

/// A message item; the developer role is sent as `system`.
fn message<'r>(item: &'r Item<'r>, role: &str) -> Option<Message<'r>> {
    let role = match role {
        "developer" | "system" => "system",
        "user" => "user",
        "assistant" => "assistant",
        _ => return None,
    };
    let parts = match item.content.as_ref()? {
        RawTextOr::Text(text) if role == "assistant" => {
            return Some(Message::Assistant {
                text: Some(Text::Raw(*text)),
                refusal: None,
                calls: Vec::new(),
            });
        }
        RawTextOr::Text(text) => {
            return Some(Message::Text {
                role,
                text: Text::Raw(*text),
            });
        }
        RawTextOr::List(parts) => parts,
    };
    if role != "assistant" {
        let system = role == "system";
        let parts = parts
            .iter()
            .map(|part| ChatPart::of(part, system))
            .collect::<Option<_>>()?;
        return Some(Message::Parts { role, parts });
    }
    let (mut text, mut refusal) = (String::new(), None);
    for part in parts {
        match part.kind.as_deref() {
            Some("output_text" | "input_text") => {
                text.push_str(part.text.map_or("", RawStr::escaped))
            }
            Some("refusal") => refusal = Some(part.refusal.map_or("", RawStr::escaped)),
            _ => return None,
        }
    }
    Some(Message::Assistant {
        text: Some(Text::Joined(text)),
        refusal: refusal.map(|refusal| Text::Joined(refusal.to_owned())),
        calls: Vec::new(),
    })
}

impl WriteJson for Message<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        let mut message = ObjectWriter::open(out);
        match self {
            Message::Text { role, text } => {
                message.field("role", role);
                message.write("content", text);
            }
            Message::Parts { role, parts } => {
                message.field("role", role);
                message.write("content", &parts[..]);
            }
            Message::Assistant {
                text,
                refusal,
                calls,
            } => {
                message.raw("role", r#""assistant""#);
                message.write("content", text);
                if let Some(refusal) = refusal {
                    message.write("refusal", refusal);
                }
                if !calls.is_empty() {
                    message.write("tool_calls", &calls[..]);
                }
            }
            Message::Tool { call_id, output } => {
                message.raw("role", r#""tool""#);
                message.write("tool_call_id", call_id);
                message.write("content", output);
            }
        }
        message.close();
    }
}

impl WriteJson for Call<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        let mut call = ObjectWriter::open(out);
        call.write("id", &self.id);
        let (kind, text, empty) = if self.custom {
            ("custom", "input", r#""""#)
        } else {
            ("function", "arguments", r#""{}""#)
        };
        call.field("type", kind);
        let mut spec = call.object(kind);
        spec.write("name", &self.name);
        match &self.arguments {
            Some(arguments) => spec.write(text, arguments),
            None => spec.raw(text, empty),
        }
        spec.close();
        call.close();
    }
}

/// A user or system message's part in chat completions' form.
enum ChatPart<'r> {
    /// Its text (empty when it has none).
    Text(Option<RawStr<'r>>),
    Image {
        url: RawStr<'r>,
        detail: Option<RawStr<'r>>,
    },
    File(&'r Part<'r>),
    Audio(Option<&'r RawValue>),
}

impl<'r> ChatPart<'r> {
    /// `part` in chat completions' form; `None` when it does not translate (or `system`'s
    /// holds more than text).
    fn of(part: &'r Part<'r>, system: bool) -> Option<ChatPart<'r>> {
        let kind = part.kind.as_deref();
        if let Some("input_text" | "output_text") = kind {
            return Some(ChatPart::Text(part.text));
        }
        if system {
            return None;
        }
        match kind? {
            "input_image" => Some(ChatPart::Image {
                url: part.image_url?,
                detail: part.detail,
            }),
            "input_file" if part.file_url.is_none() => Some(ChatPart::File(part)),
            "input_audio" => Some(ChatPart::Audio(part.input_audio)),
            _ => None,
        }
    }
}

impl WriteJson for ChatPart<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        let mut part = ObjectWriter::open(out);
        match self {
            ChatPart::Text(text) => {
                part.raw("type", r#""text""#);
                match text {
                    Some(text) => part.write("text", text),
                    None => part.raw("text", r#""""#),
                }
            }
            ChatPart::Image { url, detail } => {
                part.raw("type", r#""image_url""#);
                let mut image = part.object("image_url");
                image.write("url", url);
                if let Some(detail) = detail {
                    image.write("detail", detail);
                }
                image.close();
            }
            ChatPart::File(file) => {
                part.raw("type", r#""file""#);
                let mut fields = part.object("file");
                let given = [
                    ("file_data", file.file_data),
                    ("file_id", file.file_id),
                    ("filename", file.filename),
                ];
                fields.write_given(given);
                fields.close();
            }
            ChatPart::Audio(audio) => {
                part.raw("type", r#""input_audio""#);
                part.write("input_audio", audio);
            }
        }
        part.close();
    }
}

/// A function or custom tool in chat completions' form.
enum ChatTool<'r> {
    Function(&'r Tool<'r>, &'r str),
    /// A custom tool, with its format in chat completions' form (small, and read as the
    /// `Value` reading reads it).
    Custom(&'r Tool<'r>, &'r str, Option<Value>),
}

impl<'r> ChatTool<'r> {
    /// `None` for a built-in tool, a tool without a name, or a format that does not translate.
    fn of(tool: &'r Tool<'r>) -> Option<ChatTool<'r>> {
        let name = tool.name.as_deref()?;
        match tool.kind.as_deref()? {
            "function" => Some(ChatTool::Function(tool, name)),
            "custom" => {
                let format = match tool.format {
                    Some(format) => {
                        let format: Value = serde_json::from_str(format.get()).ok()?;
                        super::custom_format(Some(&format), 0).ok()?
                    }
                    None => None,
                };
                Some(ChatTool::Custom(tool, name, format))
            }
            _ => None,
        }
    }
}

impl WriteJson for ChatTool<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        let mut chat = ObjectWriter::open(out);
        match self {
            ChatTool::Function(tool, name) => {
                chat.raw("type", r#""function""#);
                let mut function = chat.object("function");
                function.field("name", name);
                let given = [
                    ("description", tool.description),
                    ("parameters", tool.parameters),
                    ("strict", tool.strict),
                ];
                function.write_given(given);
                function.close();
            }
            ChatTool::Custom(tool, name, format) => {
                chat.raw("type", r#""custom""#);
                let mut custom = chat.object("custom");
                custom.field("name", name);
                if let Some(description) = tool.description {
                    custom.write("description", description);
                }
                if let Some(format) = format {
                    custom.write("format", format);
                }
                custom.close();
            }
        }
        chat.close();
    }
}

#[cfg(test)]
mod tests;
