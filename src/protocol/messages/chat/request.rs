//! A messages request as a chat-completions request.

use serde_json::{Map, Value, json};

use crate::protocol::BuiltinTools;
use crate::protocol::translate::{Untranslatable, refuse};

/// The fields of a messages request this translation knows; any other is refused by name.
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
    "output_config",
    "context_management",
];

/// The chat-completions request (without `model`) for the messages `request`, and the
/// built-in tools it dropped.
pub(super) fn chat_request(
    request: &Value,
    builtin: BuiltinTools,
) -> Result<(Map<String, Value>, Vec<String>), Untranslatable> {
    let Value::Object(fields) = request else {
        return refuse("", "the request is not a JSON object");
    };
    if let Some(unknown) = fields.keys().find(|key| !KNOWN.contains(&key.as_str())) {
        return refuse(
            unknown.clone(),
            "this field has no equivalent in chat completions",
        );
    }
    let mut chat = Map::new();
    let mut messages = Vec::new();
    if let Some(system) = fields.get("system") {
        let text = system_text(system)?;
        if !text.is_empty() {
            messages.push(json!({ "role": "system", "content": text }));
        }
    }
    let Some(Value::Array(turns)) = fields.get("messages") else {
        return refuse("messages", "must be a list");
    };
    for (at, turn) in turns.iter().enumerate() {
        turn_messages(turn, &format!("messages[{at}]"), &mut messages)?;
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(max) = fields.get("max_tokens") {
        chat.insert("max_tokens".into(), max.clone());
    }
    for field in ["temperature", "top_p"] {
        if let Some(value) = fields.get(field).filter(|value| !value.is_null()) {
            chat.insert(field.into(), value.clone());
        }
    }
    if let Some(stop) = fields
        .get("stop_sequences")
        .filter(|value| !value.is_null())
    {
        if !stop.is_array() {
            return refuse("stop_sequences", "must be a list of strings");
        }
        chat.insert("stop".into(), stop.clone());
    }
    let mut dropped = Vec::new();
    let mut parallel = None;
    if let Some(tools) = fields.get("tools").filter(|value| !value.is_null()) {
        let tools = chat_tools(tools, builtin, &mut dropped)?;
        if !tools.is_empty() {
            chat.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(choice) = fields.get("tool_choice").filter(|value| !value.is_null()) {
        let (choice, disable_parallel) = tool_choice(choice)?;
        if chat.contains_key("tools") || choice == "none" {
            chat.insert("tool_choice".into(), choice);
        }
        parallel = disable_parallel.then_some(false);
    }
    if let Some(parallel) = parallel.filter(|_| chat.contains_key("tools")) {
        chat.insert("parallel_tool_calls".into(), Value::Bool(parallel));
    }
    if let Some(thinking) = fields.get("thinking").filter(|value| !value.is_null())
        && let Some(effort) = reasoning_effort(thinking)?
    {
        chat.insert("reasoning_effort".into(), Value::from(effort));
    }
    if let Some(config) = fields.get("output_config").filter(|value| !value.is_null()) {
        output_config(config, &mut chat)?;
    }
    if let Some(metadata) = fields.get("metadata").filter(|value| !value.is_null()) {
        let Value::Object(metadata) = metadata else {
            return refuse("metadata", "must be an object");
        };
        if let Some(user) = metadata.get("user_id").and_then(Value::as_str) {
            chat.insert("user".into(), Value::from(user));
        }
    }
    if fields.get("stream") == Some(&Value::Bool(true)) {
        chat.insert("stream".into(), Value::Bool(true));
        // The usage is what the call is billed by: always asked.
        chat.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    Ok((chat, dropped))
}

/// `system` as one text: a string, or its text blocks joined by blank lines.
fn system_text(system: &Value) -> Result<String, Untranslatable> {
    match system {
        Value::Null => Ok(String::new()),
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (at, block) in blocks.iter().enumerate() {
                match (block["type"].as_str(), block["text"].as_str()) {
                    (Some("text"), Some(text)) => texts.push(text),
                    _ => return refuse(format!("system[{at}]"), "only text blocks translate"),
                }
            }
            Ok(texts.join("\n\n"))
        }
        _ => refuse("system", "must be a string or a list of text blocks"),
    }
}

/// One turn of `messages` as chat messages, at `path`: an assistant's text and tool calls in
/// one message; a user's tool results as `tool` messages (first, as they answer the calls
/// just before), then the rest of its content as a user message.
fn turn_messages(turn: &Value, path: &str, out: &mut Vec<Value>) -> Result<(), Untranslatable> {
    let role = turn["role"].as_str();
    let content = &turn["content"];
    match (role, content) {
        (Some(role @ ("user" | "assistant")), Value::String(text)) => {
            out.push(json!({ "role": role, "content": text }));
            Ok(())
        }
        (Some("user"), Value::Array(blocks)) => user_blocks(blocks, path, out),
        // A system message among the turns (as Claude Code sends its environment).
        (Some("system"), content) => {
            let text = system_text(content).map_err(|refused| Untranslatable {
                field: format!(
                    "{path}.content{}",
                    refused.field.trim_start_matches("system")
                ),
                reason: refused.reason,
            })?;
            out.push(json!({ "role": "system", "content": text }));
            Ok(())
        }
        (Some("assistant"), Value::Array(blocks)) => {
            out.push(assistant_message(blocks, path)?);
            Ok(())
        }
        (Some("user" | "assistant"), _) => refuse(
            format!("{path}.content"),
            "must be a string or a list of blocks",
        ),
        _ => refuse(
            format!("{path}.role"),
            "must be `user`, `assistant` or `system`",
        ),
    }
}

fn user_blocks(blocks: &[Value], path: &str, out: &mut Vec<Value>) -> Result<(), Untranslatable> {
    let mut parts = Vec::new();
    // Images a tool result returned: chat completions' tool messages take text only, so they
    // follow in a user message.
    let mut result_images = Vec::new();
    for (at, block) in blocks.iter().enumerate() {
        let path = format!("{path}.content[{at}]");
        match block["type"].as_str() {
            Some("tool_result") => {
                let Some(id) = block["tool_use_id"].as_str() else {
                    return refuse(format!("{path}.tool_use_id"), "must be a string");
                };
                let text = tool_result_text(&block["content"], &path, &mut result_images)?;
                out.push(json!({ "role": "tool", "tool_call_id": id, "content": text }));
            }
            _ => parts.push(content_part(block, &path)?),
        }
    }
    parts.extend(result_images);
    if !parts.is_empty() {
        out.push(json!({ "role": "user", "content": parts }));
    }
    Ok(())
}

/// A tool result's content as text (a string, or its text blocks joined by blank lines), its
/// images kept in `images` as chat content parts.
fn tool_result_text(
    content: &Value,
    path: &str,
    images: &mut Vec<Value>,
) -> Result<String, Untranslatable> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::new();
            for (at, block) in blocks.iter().enumerate() {
                let path = format!("{path}.content[{at}]");
                match block["type"].as_str() {
                    Some("text") => texts.push(text_of(block, &path)?.to_owned()),
                    Some("image") => images.push(content_part(block, &path)?),
                    _ => return refuse(format!("{path}.type"), "only text and images translate"),
                }
            }
            Ok(texts.join("\n\n"))
        }
        _ => refuse(
            format!("{path}.content"),
            "must be a string or a list of blocks",
        ),
    }
}

fn text_of<'a>(block: &'a Value, path: &str) -> Result<&'a str, Untranslatable> {
    block["text"]
        .as_str()
        .map_or_else(|| refuse(format!("{path}.text"), "must be a string"), Ok)
}

/// A user's text, image or document block as a chat content part.
fn content_part(block: &Value, path: &str) -> Result<Value, Untranslatable> {
    match block["type"].as_str() {
        Some("text") => Ok(json!({ "type": "text", "text": text_of(block, path)? })),
        Some("image") => {
            let url = source_url(&block["source"], &format!("{path}.source"))?;
            Ok(json!({ "type": "image_url", "image_url": { "url": url } }))
        }
        Some("document") => document_part(block, path),
        _ => refuse(
            format!("{path}.type"),
            "only text, image, document and tool_result blocks translate in a user turn",
        ),
    }
}

/// An image's `source` as the URL chat completions takes: a data URL for base64 data.
fn source_url(source: &Value, path: &str) -> Result<String, Untranslatable> {
    match source["type"].as_str() {
        Some("base64") => match (source["media_type"].as_str(), source["data"].as_str()) {
            (Some(media), Some(data)) => Ok(format!("data:{media};base64,{data}")),
            _ => refuse(path, "base64 data needs `media_type` and `data`"),
        },
        Some("url") => source["url"].as_str().map_or_else(
            || refuse(format!("{path}.url"), "must be a string"),
            |url| Ok(url.to_owned()),
        ),
        _ => refuse(
            format!("{path}.type"),
            "only base64 and url sources translate",
        ),
    }
}

/// A document: a PDF as a chat `file` part (base64 data), plain text as a text part.
fn document_part(block: &Value, path: &str) -> Result<Value, Untranslatable> {
    let source = &block["source"];
    let path = format!("{path}.source");
    match source["type"].as_str() {
        Some("base64") => {
            let (Some(media), Some(data)) =
                (source["media_type"].as_str(), source["data"].as_str())
            else {
                return refuse(path, "base64 data needs `media_type` and `data`");
            };
            let mut file = Map::new();
            if let Some(title) = block["title"].as_str() {
                file.insert("filename".into(), Value::from(title));
            }
            file.insert(
                "file_data".into(),
                Value::from(format!("data:{media};base64,{data}")),
            );
            Ok(json!({ "type": "file", "file": file }))
        }
        Some("text") => match source["data"].as_str() {
            Some(text) => Ok(json!({ "type": "text", "text": text })),
            None => refuse(format!("{path}.data"), "must be a string"),
        },
        _ => refuse(
            format!("{path}.type"),
            "only base64 and text documents translate",
        ),
    }
}

/// An assistant turn's blocks as one chat message: its text joined, its tool calls as
/// `tool_calls`. Earlier thinking is left out (chat completions takes no reasoning back).
fn assistant_message(blocks: &[Value], path: &str) -> Result<Value, Untranslatable> {
    let mut text = String::new();
    let mut calls = Vec::new();
    for (at, block) in blocks.iter().enumerate() {
        let path = format!("{path}.content[{at}]");
        match block["type"].as_str() {
            Some("text") => text.push_str(text_of(block, &path)?),
            Some("thinking" | "redacted_thinking") => {}
            Some("tool_use") => {
                let (Some(id), Some(name)) = (block["id"].as_str(), block["name"].as_str()) else {
                    return refuse(path, "a tool_use block needs `id` and `name`");
                };
                let input = match &block["input"] {
                    Value::Null => "{}".to_owned(),
                    input => input.to_string(),
                };
                calls.push(json!({
                    "id": id, "type": "function",
                    "function": { "name": name, "arguments": input },
                }));
            }
            _ => {
                return refuse(
                    format!("{path}.type"),
                    "only text, thinking and tool_use blocks translate in an assistant turn",
                );
            }
        }
    }
    let mut message = Map::new();
    message.insert("role".into(), Value::from("assistant"));
    message.insert(
        "content".into(),
        if text.is_empty() && !calls.is_empty() {
            Value::Null
        } else {
            Value::from(text)
        },
    );
    if !calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    Ok(Value::Object(message))
}

/// `tools` as chat function tools. A tool with a `type` other than `custom` is one of
/// Anthropic's own (web search, code execution, the computer, the bash and text editor
/// tools...), run by Anthropic or described by it: dropped or refused as `builtin` says.
fn chat_tools(
    tools: &Value,
    builtin: BuiltinTools,
    dropped: &mut Vec<String>,
) -> Result<Vec<Value>, Untranslatable> {
    let Value::Array(tools) = tools else {
        return refuse("tools", "must be a list");
    };
    let mut chat = Vec::with_capacity(tools.len());
    for (at, tool) in tools.iter().enumerate() {
        let path = format!("tools[{at}]");
        match tool["type"].as_str() {
            None | Some("custom") => {}
            Some(kind) => match builtin {
                BuiltinTools::Drop => {
                    dropped.push(kind.to_owned());
                    continue;
                }
                BuiltinTools::Refuse => {
                    return refuse(
                        format!("{path}.type"),
                        "Anthropic's own tools run at Anthropic only",
                    );
                }
            },
        }
        let Some(name) = tool["name"].as_str() else {
            return refuse(format!("{path}.name"), "must be a string");
        };
        let mut function = Map::new();
        function.insert("name".into(), Value::from(name));
        if let Some(description) = tool["description"].as_str() {
            function.insert("description".into(), Value::from(description));
        }
        let schema = match &tool["input_schema"] {
            Value::Null => json!({ "type": "object" }),
            schema @ Value::Object(_) => schema.clone(),
            _ => return refuse(format!("{path}.input_schema"), "must be an object"),
        };
        function.insert("parameters".into(), schema);
        chat.push(json!({ "type": "function", "function": function }));
    }
    Ok(chat)
}

/// `tool_choice` in chat completions' terms, and whether parallel tool use is disabled.
fn tool_choice(choice: &Value) -> Result<(Value, bool), Untranslatable> {
    let disable_parallel = choice["disable_parallel_tool_use"].as_bool() == Some(true);
    let chat = match choice["type"].as_str() {
        Some("auto") => Value::from("auto"),
        Some("any") => Value::from("required"),
        Some("none") => Value::from("none"),
        Some("tool") => match choice["name"].as_str() {
            Some(name) => json!({ "type": "function", "function": { "name": name } }),
            None => return refuse("tool_choice.name", "must be a string"),
        },
        _ => return refuse("tool_choice.type", "must be auto, any, tool or none"),
    };
    Ok((chat, disable_parallel))
}

/// `thinking` as chat completions' `reasoning_effort`: a budget below 4,096 tokens is `low`,
/// below 16,384 `medium`, else `high`; disabled or adaptive thinking sets nothing (the
/// provider's default).
fn reasoning_effort(thinking: &Value) -> Result<Option<&'static str>, Untranslatable> {
    match thinking["type"].as_str() {
        Some("enabled") => {
            let Some(budget) = thinking["budget_tokens"].as_u64() else {
                return refuse("thinking.budget_tokens", "must be a whole number");
            };
            Ok(Some(match budget {
                0..4096 => "low",
                4096..16384 => "medium",
                _ => "high",
            }))
        }
        Some("disabled" | "adaptive") => Ok(None),
        _ => refuse("thinking.type", "must be enabled, disabled or adaptive"),
    }
}

/// `output_config`: its `effort` as `reasoning_effort` (`max` as `high`, the most chat
/// completions takes), its `format` (a JSON schema) as `response_format`.
fn output_config(config: &Value, chat: &mut Map<String, Value>) -> Result<(), Untranslatable> {
    let Value::Object(config) = config else {
        return refuse("output_config", "must be an object");
    };
    for (key, value) in config {
        match key.as_str() {
            "effort" => {
                let effort = match value.as_str() {
                    Some(effort @ ("low" | "medium" | "high")) => effort,
                    Some("max") => "high",
                    _ => return refuse("output_config.effort", "must be low, medium, high or max"),
                };
                chat.insert("reasoning_effort".into(), Value::from(effort));
            }
            "format" if value.is_null() => {}
            "format" => {
                let (Some("json_schema"), Some(schema)) =
                    (value["type"].as_str(), value.get("schema"))
                else {
                    return refuse(
                        "output_config.format",
                        "only a json_schema format translates",
                    );
                };
                chat.insert(
                    "response_format".into(),
                    json!({
                        "type": "json_schema",
                        "json_schema": { "name": "output", "schema": schema, "strict": true },
                    }),
                );
            }
            other => {
                return refuse(
                    format!("output_config.{other}"),
                    "this field has no equivalent in chat completions",
                );
            }
        }
    }
    Ok(())
}
