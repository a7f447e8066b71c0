//! A Responses request as a chat-completions request.

mod read;

pub(crate) use read::{Request as ReadRequest, read as read_request};

use serde_json::{Map, Value, json};

use super::reply::{Echoed, Given};
use super::write::WriteJson;
use crate::protocol::BuiltinTools;
pub use crate::protocol::translate::Untranslatable;
use crate::protocol::translate::refuse;

/// A Responses request's chat-completions translation, made once (by the router, which checks
/// it) and sent to each channel under that channel's name for the model, with what the reply
/// repeats of the request.
///
/// ```
/// use model_gateway::protocol::responses::Translated;
/// use serde_json::{Value, json};
///
/// let translated = Translated::from_slice(br#"{"model":"gpt-4o-mini","input":"Hi"}"#).unwrap();
/// let chat: Value = serde_json::from_slice(&translated.chat_body("gpt-4o-mini-2024")).unwrap();
/// assert_eq!(chat, json!({ "model": "gpt-4o-mini-2024",
///                          "messages": [{ "role": "user", "content": "Hi" }] }));
/// let refused = Translated::from_slice(br#"{"input":"Hi","background":true}"#).unwrap_err();
/// assert_eq!(refused.field, "background");
/// ```
#[derive(Debug, Clone)]
pub struct Translated {
    /// The chat request's fields after its `model`, from a comma to the closing brace.
    chat: Vec<u8>,
    echoed: Echoed,
    /// The tools left out (see [`BuiltinTools::Drop`]), by type, in the request's order.
    dropped: Vec<String>,
    /// The tools of a namespace of tools, offered to chat completions under a flat name.
    namespaced: Vec<Namespaced>,
}

/// A tool of a namespace of tools (as Codex groups its multi-agent tools), which chat
/// completions offers under one flat name: `{namespace}__{name}`, as Codex itself flattens one
/// where a namespace cannot be kept. A call of the flat name comes back as a call of the tool
/// in its namespace (`name` and `namespace`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Namespaced {
    pub(crate) flat: String,
    pub(crate) namespace: String,
    pub(crate) name: String,
}

/// A namespaced tool's flat name.
fn flat_name(namespace: &str, name: &str) -> String {
    format!(
        "{}__{}",
        namespace.trim_end_matches('_'),
        name.trim_start_matches('_')
    )
}

impl Translated {
    /// Translates a parsed `request`, or names the field that does not translate (built-in
    /// tools among them).
    pub fn new(request: Value) -> Result<Translated, Untranslatable> {
        Translated::new_with(request, BuiltinTools::Refuse)
    }

    /// [`Translated::new`], with the request's built-in tools dropped or refused as
    /// `builtin` says.
    pub fn new_with(request: Value, builtin: BuiltinTools) -> Result<Translated, Untranslatable> {
        let (chat, dropped, namespaced) = translate_value(&request, "", builtin)?;
        let Value::Object(mut chat) = chat else {
            unreachable!("a chat request is an object");
        };
        chat.remove("model");
        let mut chat = serde_json::to_vec(&chat).expect("a JSON map serialises");
        // `{"messages":...}` becomes `,"messages":...}`: the fields after the model.
        chat[0] = b',';
        Ok(Translated {
            chat,
            echoed: Given::of(&request).echoed(request["model"].as_str()),
            dropped,
            namespaced,
        })
    }

    /// Translates a request from its bytes, or names the field that does not translate (a
    /// body that is not JSON names none; built-in tools are refused). A request as clients
    /// send it is read without building a `serde_json::Value`, what it passes on (texts, tool
    /// schemas, settings) copied as the client wrote it; anything unusual is read as
    /// [`Translated::new`] reads it.
    pub fn from_slice(request: &[u8]) -> Result<Translated, Untranslatable> {
        Translated::from_slice_with(request, BuiltinTools::Refuse)
    }

    /// [`Translated::from_slice`], with the request's built-in tools dropped or refused as
    /// `builtin` says.
    pub fn from_slice_with(
        request: &[u8],
        builtin: BuiltinTools,
    ) -> Result<Translated, Untranslatable> {
        if let Some((chat, echoed)) = read::translate(request) {
            return Ok(Translated {
                chat,
                echoed,
                dropped: Vec::new(),
                namespaced: Vec::new(),
            });
        }
        Translated::from_value_reading(request, builtin)
    }

    /// [`Translated::from_slice_with`] for a `request` already read from `body` (by the
    /// router, which reads a Responses call's fields from the same reading, and its `model` as
    /// `model`).
    pub(crate) fn from_read(
        request: &ReadRequest<'_>,
        model: &str,
        body: &[u8],
        builtin: BuiltinTools,
    ) -> Result<Translated, Untranslatable> {
        if let Some((chat, echoed)) = read::translate_read(request, Some(model), body.len()) {
            return Ok(Translated {
                chat,
                echoed,
                dropped: Vec::new(),
                namespaced: Vec::new(),
            });
        }
        Translated::from_value_reading(body, builtin)
    }

    /// `request` read into a `Value` and translated from it. (A request with a built-in tool
    /// is always read this way: the reading from bytes translates function and custom tools
    /// only.)
    fn from_value_reading(
        request: &[u8],
        builtin: BuiltinTools,
    ) -> Result<Translated, Untranslatable> {
        let request = serde_json::from_slice(request).map_err(|_| Untranslatable {
            field: String::new(),
            reason: "the request is not JSON",
        })?;
        Translated::new_with(request, builtin)
    }

    /// The tools the translation left out (see [`BuiltinTools::Drop`]), by type, in the
    /// request's order.
    pub fn dropped_tools(&self) -> &[String] {
        &self.dropped
    }

    /// The namespaced tools offered to chat completions under flat names.
    pub(crate) fn namespaced(&self) -> &[Namespaced] {
        &self.namespaced
    }

    /// The namespace and name of the namespaced tool offered to chat completions as `flat`,
    /// if it is one.
    pub(crate) fn unflatten(&self, flat: &str) -> Option<(&str, &str)> {
        self.namespaced
            .iter()
            .find(|tool| tool.flat == flat)
            .map(|tool| (tool.namespace.as_str(), tool.name.as_str()))
    }

    /// The chat-completions request calling `model`, serialised.
    pub fn chat_body(&self, model: &str) -> Vec<u8> {
        let mut body = Vec::with_capacity(self.chat.len() + model.len() + 16);
        body.extend_from_slice(b"{\"model\":");
        model.write_json(&mut body);
        body.extend_from_slice(&self.chat);
        body
    }

    /// What the reply repeats of the request.
    pub(crate) fn echoed(&self) -> &Echoed {
        &self.echoed
    }
}

/// Fields whose meaning is the same in both APIs: copied as they are.
const COPIED: &[&str] = &["temperature", "top_p", "user", "service_tier"];

/// Fields that only tune what the provider does or keeps, and that a chat-completions provider
/// has no use for: dropped. `store` (nothing is kept by a translated call), `include`
/// (`reasoning.encrypted_content` and the outputs of built-in tools, which a translated call
/// never has), caching and safety hints, `metadata` (kept by the provider only when it stores),
/// `client_metadata` (what a client tells the provider about itself, for its analytics) and
/// `stream_options` (its only option concerns obfuscation padding).
const HINTS: &[&str] = &[
    "store",
    "client_metadata",
    "include",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "metadata",
    "stream_options",
];

/// The chat-completions request for a Responses `request`, calling `model`. Every field is
/// either translated, copied (same meaning), dropped as a hint that changes nothing a
/// chat-completions provider does (see the crate's README), or refused (built-in tools too).
pub fn chat_request(request: &Value, model: &str) -> Result<Value, Untranslatable> {
    translate_value(request, model, BuiltinTools::Refuse).map(|(chat, _, _)| chat)
}

/// [`chat_request`], with built-in tools dropped or refused as `builtin` says; the dropped
/// ones named beside it.
fn translate_value(
    request: &Value,
    model: &str,
    builtin: BuiltinTools,
) -> Result<(Value, Vec<String>, Vec<Namespaced>), Untranslatable> {
    let mut dropped = Vec::new();
    let mut namespaced = Vec::new();
    let Some(fields) = request.as_object() else {
        return refuse("", "the request is not a JSON object");
    };
    let mut chat = Map::new();
    chat.insert("model".into(), Value::from(model));
    let mut messages = Vec::new();
    match fields.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => messages.push(json!({ "role": "system", "content": text })),
        Some(_) => return refuse("instructions", "it must be a string"),
    }
    match fields.get("input") {
        Some(Value::String(text)) => messages.push(json!({ "role": "user", "content": text })),
        Some(Value::Array(items)) => {
            for (index, item) in items.iter().enumerate() {
                input_item(item, At::Item(index), &mut messages)?;
            }
        }
        _ => return refuse("input", "it must be a string or a list of items"),
    }
    chat.insert("messages".into(), Value::Array(messages));

    for (name, value) in fields {
        match name.as_str() {
            "model" | "instructions" | "input" => {}
            name if HINTS.contains(&name) => {}
            name if COPIED.contains(&name) => {
                if !value.is_null() {
                    chat.insert(name.into(), value.clone());
                }
            }
            "stream" => {
                if value == &Value::Bool(true) {
                    chat.insert("stream".into(), Value::Bool(true));
                    // The final usage, for `response.completed`; the stream's translation
                    // consumes the chunk that carries it.
                    chat.insert("stream_options".into(), json!({ "include_usage": true }));
                }
            }
            "max_output_tokens" => {
                if !value.is_null() {
                    // `max_tokens`: the name every chat-completions server knows.
                    chat.insert("max_tokens".into(), value.clone());
                }
            }
            "parallel_tool_calls" => {
                if !value.is_null() {
                    chat.insert(name.into(), value.clone());
                }
            }
            "tools" => {
                if let Some(tools) = tools(value, builtin, &mut dropped, &mut namespaced)? {
                    chat.insert("tools".into(), tools);
                }
            }
            "tool_choice" => {
                if let Some(choice) = tool_choice(value)? {
                    chat.insert("tool_choice".into(), choice);
                }
            }
            "text" => {
                if let Some(format) = response_format(value.get("format"))? {
                    chat.insert("response_format".into(), format);
                }
            }
            "reasoning" => match value.get("effort") {
                None | Some(Value::Null) => {}
                Some(effort) => {
                    chat.insert("reasoning_effort".into(), effort.clone());
                }
            },
            "top_logprobs" => {
                if !value.is_null() {
                    chat.insert("logprobs".into(), Value::Bool(true));
                    chat.insert("top_logprobs".into(), value.clone());
                }
            }
            "truncation" => {
                if !matches!(value.as_str(), None | Some("disabled")) {
                    return refuse(
                        "truncation",
                        "only the provider's own Responses API truncates a conversation",
                    );
                }
            }
            "background" => {
                if value == &Value::Bool(true) {
                    return refuse(
                        "background",
                        "a chat-completions call cannot run in the background",
                    );
                }
            }
            "previous_response_id" | "conversation" => {
                if !value.is_null() {
                    return refuse(
                        name,
                        "this model's provider keeps no responses; send the whole conversation in `input`",
                    );
                }
            }
            "prompt" => {
                if !value.is_null() {
                    return refuse("prompt", "prompt templates are kept by OpenAI only");
                }
            }
            "max_tool_calls" => {
                if !value.is_null() {
                    return refuse("max_tool_calls", "chat completions has no such limit");
                }
            }
            other => return refuse(other, "chat completions has no such field"),
        }
    }
    Ok((Value::Object(chat), dropped, namespaced))
}

/// Where in the request a field is (`input[2]`, `input[2].content[0]`), written out only for a
/// refusal.
#[derive(Debug, Clone, Copy)]
enum At<'a> {
    Item(usize),
    Part(&'a At<'a>, usize),
}

impl std::fmt::Display for At<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            At::Item(index) => write!(f, "input[{index}]"),
            At::Part(item, index) => write!(f, "{item}.content[{index}]"),
        }
    }
}

/// One item of `input`, appended to `messages` (a function call joins the assistant message
/// before it, as chat completions puts parallel calls in one message).
fn input_item(item: &Value, at: At<'_>, messages: &mut Vec<Value>) -> Result<(), Untranslatable> {
    let kind = item.get("type").and_then(Value::as_str);
    let role = item.get("role").and_then(Value::as_str);
    match (kind, role) {
        (Some("message") | None, Some(role)) => messages.push(message(item, role, at)?),
        (Some(kind @ ("function_call" | "custom_tool_call")), _) => {
            let text = |field: &str| item.get(field).and_then(Value::as_str);
            let (Some(call_id), Some(name)) = (text("call_id"), text("name")) else {
                return refuse(at.to_string(), "a tool call needs `call_id` and `name`");
            };
            // A call of a namespaced tool, under the flat name it was offered by.
            let flat = text("namespace").map(|namespace| flat_name(namespace, name));
            let name = flat.as_deref().unwrap_or(name);
            let call = if kind == "function_call" {
                json!({
                    "id": call_id,
                    "type": "function",
                    "function": { "name": name, "arguments": text("arguments").unwrap_or("{}") },
                })
            } else {
                json!({
                    "id": call_id,
                    "type": "custom",
                    "custom": { "name": name, "input": text("input").unwrap_or_default() },
                })
            };
            let joins_last = messages
                .last()
                .is_some_and(|last| last["role"] == "assistant");
            if !joins_last {
                messages.push(json!({ "role": "assistant", "content": null }));
            }
            let last = messages.last_mut().expect("an assistant message is last");
            match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                Some(calls) => calls.push(call),
                None => last["tool_calls"] = json!([call]),
            }
        }
        (Some("function_call_output" | "custom_tool_call_output"), _) => {
            let Some(call_id) = item.get("call_id").and_then(Value::as_str) else {
                return refuse(
                    format!("{at}.call_id"),
                    "a tool call output needs `call_id`",
                );
            };
            let output = match item.get("output") {
                Some(Value::String(text)) => text.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (index, part) in parts.iter().enumerate() {
                        match (part["type"].as_str(), part["text"].as_str()) {
                            (Some("input_text" | "output_text"), Some(piece)) => {
                                text.push_str(piece)
                            }
                            _ => {
                                return refuse(
                                    format!("{at}.output[{index}]"),
                                    "a chat-completions tool result holds text only",
                                );
                            }
                        }
                    }
                    text
                }
                _ => {
                    return refuse(
                        format!("{at}.output"),
                        "it must be a string or a list of parts",
                    );
                }
            };
            messages.push(json!({ "role": "tool", "tool_call_id": call_id, "content": output }));
        }
        // The model's own reasoning from an earlier turn: chat completions takes none back.
        (Some("reasoning"), _) => {}
        (Some("item_reference"), _) => {
            return refuse(
                at.to_string(),
                "this model's provider keeps no items to refer to",
            );
        }
        _ => {
            return refuse(
                format!("{at}.type"),
                "only messages, function and custom tool calls and their outputs translate",
            );
        }
    }
    Ok(())
}

/// A message item in chat completions' form. The developer role is sent as `system`, which
/// every chat-completions server knows.
fn message(item: &Value, role: &str, at: At<'_>) -> Result<Value, Untranslatable> {
    let role = match role {
        "developer" | "system" => "system",
        "user" => "user",
        "assistant" => "assistant",
        _ => {
            return refuse(
                format!("{at}.role"),
                "the role must be user, assistant, system or developer",
            );
        }
    };
    let content = match item.get("content") {
        Some(Value::String(text)) => return Ok(json!({ "role": role, "content": text })),
        Some(Value::Array(parts)) => parts,
        _ => {
            return refuse(
                format!("{at}.content"),
                "it must be a string or a list of parts",
            );
        }
    };
    if role == "assistant" {
        // Earlier replies: their text, and a refusal as chat completions records one.
        let (mut text, mut refusal) = (String::new(), None::<String>);
        for (index, part) in content.iter().enumerate() {
            match part["type"].as_str() {
                Some("output_text" | "input_text") => {
                    text.push_str(part["text"].as_str().unwrap_or_default())
                }
                Some("refusal") => {
                    refusal = Some(part["refusal"].as_str().unwrap_or_default().to_owned())
                }
                _ => {
                    return refuse(
                        format!("{at}.content[{index}].type"),
                        "an assistant message holds text or a refusal",
                    );
                }
            }
        }
        let mut message = json!({ "role": "assistant", "content": text });
        if let Some(refusal) = refusal {
            message["refusal"] = Value::String(refusal);
        }
        return Ok(message);
    }
    let mut parts = Vec::with_capacity(content.len());
    for (index, part) in content.iter().enumerate() {
        parts.push(content_part(part, At::Part(&at, index), role == "system")?);
    }
    Ok(json!({ "role": role, "content": parts }))
}

/// One part of a user or system message.
fn content_part(part: &Value, at: At<'_>, system: bool) -> Result<Value, Untranslatable> {
    let kind = part["type"].as_str();
    if let Some("input_text" | "output_text") = kind {
        return Ok(json!({ "type": "text", "text": part["text"].as_str().unwrap_or_default() }));
    }
    if system {
        return refuse(format!("{at}.type"), "a system message holds text only");
    }
    match kind {
        Some("input_image") => {
            let Some(url) = part["image_url"].as_str() else {
                return refuse(
                    format!("{at}.file_id"),
                    "an image is sent by `image_url` (a URL or a data URL), not by file id",
                );
            };
            let mut image = json!({ "url": url });
            if let Some(detail) = part["detail"].as_str() {
                image["detail"] = detail.into();
            }
            Ok(json!({ "type": "image_url", "image_url": image }))
        }
        Some("input_file") => {
            if part.get("file_url").is_some_and(|url| !url.is_null()) {
                return refuse(
                    format!("{at}.file_url"),
                    "a file is sent by `file_data` or `file_id`",
                );
            }
            let mut file = Map::new();
            for field in ["file_data", "file_id", "filename"] {
                if let Some(value) = part.get(field).filter(|value| !value.is_null()) {
                    file.insert(field.into(), value.clone());
                }
            }
            Ok(json!({ "type": "file", "file": file }))
        }
        Some("input_audio") => {
            Ok(json!({ "type": "input_audio", "input_audio": part["input_audio"] }))
        }
        _ => refuse(
            format!("{at}.type"),
            "only text, image, file and audio parts translate",
        ),
    }
}

/// The function tools of a namespace of tools (`tools[index]`) in chat completions' form,
/// each under its flat name, kept in `namespaced`.
fn namespace_tools(
    tool: &Value,
    index: usize,
    namespaced: &mut Vec<Namespaced>,
) -> Result<Vec<Value>, Untranslatable> {
    let Some(namespace) = tool["name"].as_str() else {
        return refuse(format!("tools[{index}].name"), "a namespace needs a name");
    };
    let Some(inner) = tool["tools"].as_array() else {
        return refuse(
            format!("tools[{index}].tools"),
            "a namespace lists its tools",
        );
    };
    let mut tools = Vec::with_capacity(inner.len());
    for (at, function) in inner.iter().enumerate() {
        let (Some("function"), Some(name)) = (function["type"].as_str(), function["name"].as_str())
        else {
            return refuse(
                format!("tools[{index}].tools[{at}]"),
                "only function tools of a namespace translate",
            );
        };
        let flat = flat_name(namespace, name);
        let mut spec = Map::new();
        spec.insert("name".into(), Value::from(flat.as_str()));
        for field in ["description", "parameters", "strict"] {
            if let Some(value) = function.get(field).filter(|value| !value.is_null()) {
                spec.insert(field.into(), value.clone());
            }
        }
        tools.push(json!({ "type": "function", "function": spec }));
        namespaced.push(Namespaced {
            flat,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        });
    }
    Ok(tools)
}

/// Function and custom (free-form input) tools in chat completions' form, and the function
/// tools of a namespace under their flat names (kept in `namespaced`); built-in tools (web
/// search, file search, code interpreter, computer use, MCP, ...) run inside `OpenAI`'s
/// Responses API, and are dropped (named in `dropped`) or refused as `builtin` says.
fn tools(
    value: &Value,
    builtin: BuiltinTools,
    dropped: &mut Vec<String>,
    namespaced: &mut Vec<Namespaced>,
) -> Result<Option<Value>, Untranslatable> {
    let list = match value {
        Value::Null => return Ok(None),
        Value::Array(list) => list,
        _ => return refuse("tools", "it must be a list"),
    };
    let mut tools = Vec::with_capacity(list.len());
    for (index, tool) in list.iter().enumerate() {
        let kind = match (tool["type"].as_str(), builtin) {
            (Some(kind @ ("function" | "custom")), _) => kind,
            (Some("namespace"), _) => {
                tools.extend(namespace_tools(tool, index, namespaced)?);
                continue;
            }
            (Some(kind), BuiltinTools::Drop) => {
                dropped.push(kind.to_owned());
                continue;
            }
            _ => {
                return refuse(
                    format!("tools[{index}].type"),
                    "only function and custom tools translate; built-in tools run at OpenAI only",
                );
            }
        };
        let Some(name) = tool["name"].as_str() else {
            return refuse(format!("tools[{index}].name"), "a tool needs a name");
        };
        let mut spec = Map::new();
        spec.insert("name".into(), name.into());
        let fields: &[&str] = if kind == "function" {
            &["description", "parameters", "strict"]
        } else {
            &["description"]
        };
        for &field in fields {
            if let Some(value) = tool.get(field).filter(|value| !value.is_null()) {
                spec.insert(field.into(), value.clone());
            }
        }
        if kind == "custom"
            && let Some(format) = custom_format(tool.get("format"), index)?
        {
            spec.insert("format".into(), format);
        }
        tools.push(json!({ "type": kind, kind: spec }));
    }
    Ok((!tools.is_empty()).then_some(Value::Array(tools)))
}

/// A custom tool's input `format` in chat completions' form: free text, or a grammar (Lark or a
/// regular expression), whose definition chat completions nests one level deeper.
fn custom_format(format: Option<&Value>, index: usize) -> Result<Option<Value>, Untranslatable> {
    let format = match format {
        None | Some(Value::Null) => return Ok(None),
        Some(format) => format,
    };
    match format["type"].as_str() {
        Some("text") => Ok(Some(json!({ "type": "text" }))),
        Some("grammar") => {
            let (Some(syntax), Some(definition)) =
                (format["syntax"].as_str(), format["definition"].as_str())
            else {
                return refuse(
                    format!("tools[{index}].format"),
                    "a grammar needs its `syntax` and `definition`",
                );
            };
            Ok(Some(json!({
                "type": "grammar",
                "grammar": { "definition": definition, "syntax": syntax },
            })))
        }
        _ => refuse(
            format!("tools[{index}].format.type"),
            "a custom tool's format is text or a grammar",
        ),
    }
}

/// `tool_choice` in chat completions' form: a mode, a function or a custom tool by name, or
/// the tools allowed.
fn tool_choice(value: &Value) -> Result<Option<Value>, Untranslatable> {
    const TRANSLATED: &str =
        "only auto, none, required, a function, a custom tool or allowed tools translate";
    match value {
        Value::Null => Ok(None),
        Value::String(mode) if matches!(mode.as_str(), "auto" | "none" | "required") => {
            Ok(Some(value.clone()))
        }
        Value::Object(choice) => match choice.get("type").and_then(Value::as_str) {
            Some(kind @ ("function" | "custom")) => {
                match choice.get("name").and_then(Value::as_str) {
                    Some(name) => Ok(Some(json!({ "type": kind, kind: { "name": name } }))),
                    None => refuse("tool_choice.name", "a tool choice needs a name"),
                }
            }
            Some("allowed_tools") => allowed_tools(choice).map(Some),
            _ => refuse("tool_choice", TRANSLATED),
        },
        _ => refuse("tool_choice", TRANSLATED),
    }
}

/// An `allowed_tools` choice (a mode, and the tools the model may call, named as in `tools`)
/// in chat completions' form, which nests it one level deeper and names each tool as its
/// `tools` do.
fn allowed_tools(choice: &Map<String, Value>) -> Result<Value, Untranslatable> {
    let Some(mode @ ("auto" | "required")) = choice.get("mode").and_then(Value::as_str) else {
        return refuse("tool_choice.mode", "it must be auto or required");
    };
    let Some(listed) = choice.get("tools").and_then(Value::as_array) else {
        return refuse("tool_choice.tools", "it must be a list");
    };
    let mut tools = Vec::with_capacity(listed.len());
    for (index, tool) in listed.iter().enumerate() {
        let (Some(kind @ ("function" | "custom")), Some(name)) =
            (tool["type"].as_str(), tool["name"].as_str())
        else {
            return refuse(
                format!("tool_choice.tools[{index}]"),
                "only function and custom tools, by name, translate",
            );
        };
        tools.push(json!({ "type": kind, kind: { "name": name } }));
    }
    Ok(json!({ "type": "allowed_tools", "allowed_tools": { "mode": mode, "tools": tools } }))
}

/// `text.format` as `response_format` (`None` for plain text); `text.verbosity`, a hint, is
/// dropped.
fn response_format(format: Option<&Value>) -> Result<Option<Value>, Untranslatable> {
    let format = match format {
        None | Some(Value::Null) => return Ok(None),
        Some(format) => format,
    };
    match format["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({ "type": "json_object" }))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for field in ["name", "schema", "description", "strict"] {
                if let Some(value) = format.get(field).filter(|value| !value.is_null()) {
                    schema.insert(field.into(), value.clone());
                }
            }
            if !schema.contains_key("name") {
                return refuse("text.format.name", "a JSON schema format needs a name");
            }
            Ok(Some(
                json!({ "type": "json_schema", "json_schema": schema }),
            ))
        }
        _ => refuse(
            "text.format.type",
            "only text, json_object and json_schema translate",
        ),
    }
}
