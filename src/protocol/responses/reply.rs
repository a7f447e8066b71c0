//! A chat-completions reply as a Responses `response` object.

use serde::Serialize;
use serde_json::{Value, json};

use super::Ids;

/// The request settings a `response` object repeats (the Responses API echoes them), with the
/// API's defaults for those the request left out.
const ECHOED: [&str; 12] = [
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "reasoning",
    "service_tier",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_p",
    "user",
];

/// Just the settings of `request` that a `response` repeats, for a translation that outlives
/// the request (a stream).
pub(super) fn echoed_settings(request: &Value) -> Value {
    let mut settings = serde_json::Map::new();
    for name in ECHOED {
        if let Some(value) = request.get(name) {
            settings.insert(name.to_owned(), value.clone());
        }
    }
    Value::Object(settings)
}

/// A setting as a `response` repeats it: the request's own value, or the API's default.
#[derive(Debug, Clone, Copy)]
enum Setting<'a> {
    Given(&'a Value),
    Null,
    True,
    One,
    Auto,
    DefaultTier,
    NoMetadata,
    NoTools,
    PlainText,
}

impl Serialize for Setting<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self {
            Setting::Given(value) => value.serialize(serializer),
            Setting::Null => serializer.serialize_none(),
            Setting::True => serializer.serialize_bool(true),
            Setting::One => serializer.serialize_f64(1.0),
            Setting::Auto => serializer.serialize_str("auto"),
            Setting::DefaultTier => serializer.serialize_str("default"),
            Setting::NoMetadata => serializer.serialize_map(Some(0))?.end(),
            Setting::NoTools => serializer.serialize_seq(Some(0))?.end(),
            Setting::PlainText => {
                let mut format = serializer.serialize_map(Some(1))?;
                format.serialize_entry("type", "text")?;
                format.end()
            }
        }
    }
}

/// What a `response` object repeats from the request that asked for it, borrowed from it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Echo<'a> {
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
}

/// A `response` object, serialised as it is built.
#[derive(Serialize)]
struct ResponseObject<'a, I, U> {
    id: &'a str,
    object: &'static str,
    created_at: i64,
    status: &'static str,
    error: Option<()>,
    incomplete_details: Option<Incomplete<'a>>,
    model: &'a str,
    output: &'a [I],
    usage: &'a U,
    background: bool,
    instructions: Setting<'a>,
    max_output_tokens: Setting<'a>,
    metadata: Setting<'a>,
    parallel_tool_calls: Setting<'a>,
    previous_response_id: Option<()>,
    reasoning: ReasoningEcho<'a>,
    service_tier: Setting<'a>,
    /// A translated call keeps nothing: its response cannot be fetched again.
    store: bool,
    temperature: Setting<'a>,
    text: TextEcho<'a>,
    tool_choice: Setting<'a>,
    tools: Setting<'a>,
    top_p: Setting<'a>,
    truncation: &'static str,
    user: Setting<'a>,
}

#[derive(Serialize)]
struct ReasoningEcho<'a> {
    effort: Setting<'a>,
    summary: Option<()>,
}

#[derive(Serialize)]
struct TextEcho<'a> {
    format: Setting<'a>,
}

#[derive(Serialize)]
struct Incomplete<'a> {
    reason: &'a str,
}

impl<'a> Echo<'a> {
    pub(super) fn of(request: &'a Value) -> Echo<'a> {
        let given = |value: Option<&'a Value>, default: Setting<'a>| match value {
            Some(value) if !value.is_null() => Setting::Given(value),
            _ => default,
        };
        let field = |name: &str, default| given(request.get(name), default);
        Echo {
            instructions: field("instructions", Setting::Null),
            max_output_tokens: field("max_output_tokens", Setting::Null),
            metadata: field("metadata", Setting::NoMetadata),
            parallel_tool_calls: field("parallel_tool_calls", Setting::True),
            effort: given(request.pointer("/reasoning/effort"), Setting::Null),
            service_tier: field("service_tier", Setting::DefaultTier),
            temperature: field("temperature", Setting::One),
            format: given(request.pointer("/text/format"), Setting::PlainText),
            tool_choice: field("tool_choice", Setting::Auto),
            tools: field("tools", Setting::NoTools),
            top_p: field("top_p", Setting::One),
            user: field("user", Setting::Null),
        }
    }

    /// A `response` object with these echoed settings.
    pub(super) fn response(
        &self,
        head: &Head,
        status: Status<'_>,
        output: Vec<Value>,
        usage: Value,
    ) -> Value {
        serde_json::to_value(self.object(head, status, &output, &usage))
            .expect("a response serialises")
    }

    fn object<'b, I, U>(
        &self,
        head: &'b Head,
        status: Status<'b>,
        output: &'b [I],
        usage: &'b U,
    ) -> ResponseObject<'b, I, U>
    where
        'a: 'b,
    {
        ResponseObject {
            id: &head.id,
            object: "response",
            created_at: head.created_at,
            status: status.name(),
            error: None,
            incomplete_details: match status {
                Status::Incomplete(reason) => Some(Incomplete { reason }),
                _ => None,
            },
            model: &head.model,
            output,
            usage,
            background: false,
            instructions: self.instructions,
            max_output_tokens: self.max_output_tokens,
            metadata: self.metadata,
            parallel_tool_calls: self.parallel_tool_calls,
            previous_response_id: None,
            reasoning: ReasoningEcho {
                effort: self.effort,
                summary: None,
            },
            service_tier: self.service_tier,
            store: false,
            temperature: self.temperature,
            text: TextEcho {
                format: self.format,
            },
            tool_choice: self.tool_choice,
            tools: self.tools,
            top_p: self.top_p,
            truncation: "disabled",
            user: self.user,
        }
    }
}

/// What every `response` object of one call shares.
#[derive(Debug, Clone)]
pub(super) struct Head {
    pub id: String,
    pub created_at: i64,
    pub model: String,
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

    fn name(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Incomplete(_) => "incomplete",
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
#[derive(Debug, Clone, Serialize)]
pub(super) struct Usage {
    input_tokens: i64,
    input_tokens_details: CachedTokens,
    output_tokens: i64,
    output_tokens_details: ReasoningTokens,
    total_tokens: i64,
}

#[derive(Debug, Clone, Serialize)]
struct CachedTokens {
    cached_tokens: i64,
}

#[derive(Debug, Clone, Serialize)]
struct ReasoningTokens {
    reasoning_tokens: i64,
}

/// Chat completions' `usage` in the Responses API's names; `None` when there is none.
pub(super) fn usage(chat_usage: Option<&Value>) -> Option<Usage> {
    let usage = chat_usage.filter(|usage| usage.is_object())?;
    let count = |pointer: &str| usage.pointer(pointer).and_then(Value::as_i64).unwrap_or(0);
    let (input, output) = (count("/prompt_tokens"), count("/completion_tokens"));
    Some(Usage {
        input_tokens: input,
        input_tokens_details: CachedTokens {
            cached_tokens: count("/prompt_tokens_details/cached_tokens"),
        },
        output_tokens: output,
        output_tokens_details: ReasoningTokens {
            reasoning_tokens: count("/completion_tokens_details/reasoning_tokens"),
        },
        total_tokens: usage
            .get("total_tokens")
            .and_then(Value::as_i64)
            .unwrap_or(input + output),
    })
}

/// An output item.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum OutputItem<'a> {
    /// The model's reasoning, as chat-completions servers of reasoning models send it
    /// (`reasoning_content`).
    Reasoning {
        id: &'a str,
        summary: [(); 0],
        content: Vec<ReasoningText<'a>>,
    },
    Message {
        id: &'a str,
        status: &'a str,
        role: &'static str,
        content: Vec<Part<'a>>,
    },
    FunctionCall {
        id: &'a str,
        status: &'a str,
        call_id: &'a str,
        name: &'a str,
        arguments: &'a str,
    },
}

/// A reasoning item's text.
#[derive(Serialize)]
#[serde(tag = "type", rename = "reasoning_text")]
pub(super) struct ReasoningText<'a> {
    text: &'a str,
}

/// A reasoning item holding `text` (none when it is empty, as when it opens).
pub(super) fn reasoning_item(id: &str, text: &str) -> Value {
    let content = if text.is_empty() {
        Vec::new()
    } else {
        vec![ReasoningText { text }]
    };
    to_value(OutputItem::Reasoning {
        id,
        summary: [],
        content,
    })
}

/// The reasoning text a chat message or delta carries: `reasoning_content` (vLLM, `DeepSeek`,
/// most servers of open reasoning models) or `reasoning` (some routers).
pub(super) fn reasoning_of(message: &Value) -> Option<&str> {
    message["reasoning_content"]
        .as_str()
        .or(message["reasoning"].as_str())
        .filter(|text| !text.is_empty())
}

/// A message's content part.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum Part<'a> {
    OutputText {
        text: &'a str,
        annotations: [(); 0],
        logprobs: [(); 0],
    },
    Refusal {
        refusal: &'a str,
    },
}

impl<'a> Part<'a> {
    fn new(refusal: bool, text: &'a str) -> Part<'a> {
        if refusal {
            Part::Refusal { refusal: text }
        } else {
            Part::OutputText {
                text,
                annotations: [],
                logprobs: [],
            }
        }
    }
}

fn to_value(item: impl Serialize) -> Value {
    serde_json::to_value(item).expect("an item serialises")
}

/// A message item holding `part` (none when `part` is `null`).
pub(super) fn message_item(id: &str, status: &str, part: Value) -> Value {
    let mut item = to_value(OutputItem::Message {
        id,
        status,
        role: "assistant",
        content: Vec::new(),
    });
    if !part.is_null() {
        item["content"] = json!([part]);
    }
    item
}

/// A message's content part: text, or a refusal.
pub(super) fn content_part(refusal: bool, text: &str) -> Value {
    to_value(Part::new(refusal, text))
}

/// A function call item.
pub(super) fn function_call_item(
    id: &str,
    status: &str,
    call_id: &str,
    name: &str,
    arguments: &str,
) -> Value {
    to_value(OutputItem::FunctionCall {
        id,
        status,
        call_id,
        name,
        arguments,
    })
}

/// The `response` object for a chat-completions `reply` to the translation of `request`.
pub fn response_from_chat(request: &Value, reply: &Value, ids: &mut Ids) -> Value {
    serde_json::from_slice(&response_json_from_chat(request, reply, ids))
        .expect("the response is JSON")
}

/// [`response_from_chat`], serialised: what a translating upstream answers with.
pub fn response_json_from_chat(request: &Value, reply: &Value, ids: &mut Ids) -> Vec<u8> {
    let head = Head {
        id: ids.next("resp"),
        created_at: reply["created"]
            .as_i64()
            .unwrap_or_else(|| chrono::Utc::now().timestamp()),
        model: reply["model"]
            .as_str()
            .or(request["model"].as_str())
            .unwrap_or_default()
            .to_owned(),
    };
    let choice = &reply["choices"][0];
    let message = &choice["message"];
    let text = message["content"].as_str().filter(|text| !text.is_empty());
    let refusal = message["refusal"].as_str().filter(|text| !text.is_empty());
    let said = refusal.map(|r| (true, r)).or(text.map(|t| (false, t)));
    let calls = message["tool_calls"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let reasoning = reasoning_of(message);
    let mut item_ids = Vec::with_capacity(calls.len() + 2);
    if reasoning.is_some() {
        item_ids.push(ids.next("rs"));
    }
    if said.is_some() {
        item_ids.push(ids.next("msg"));
    }
    for _ in calls {
        item_ids.push(ids.next("fc"));
    }
    let mut output = Vec::with_capacity(item_ids.len());
    let mut id = item_ids.iter();
    if let Some(text) = reasoning {
        output.push(OutputItem::Reasoning {
            id: id.next().expect("an id per item"),
            summary: [],
            content: vec![ReasoningText { text }],
        });
    }
    if let Some((is_refusal, text)) = said {
        output.push(OutputItem::Message {
            id: id.next().expect("an id per item"),
            status: "completed",
            role: "assistant",
            content: vec![Part::new(is_refusal, text)],
        });
    }
    for call in calls {
        let item_id = id.next().expect("an id per item");
        let function = &call["function"];
        output.push(OutputItem::FunctionCall {
            id: item_id,
            status: "completed",
            call_id: call["id"].as_str().unwrap_or(item_id),
            name: function["name"].as_str().unwrap_or_default(),
            arguments: function["arguments"].as_str().unwrap_or("{}"),
        });
    }
    let status = Status::finished(choice["finish_reason"].as_str());
    let usage = usage(reply.get("usage"));
    let echo = Echo::of(request);
    serde_json::to_vec(&echo.object(&head, status, &output, &usage)).expect("a response serialises")
}
