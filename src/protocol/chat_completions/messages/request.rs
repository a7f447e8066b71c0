//! A chat-completions request as a messages request.

use serde_json::{Map, Value, json};

use crate::protocol::BuiltinTools;
use crate::protocol::chat_completions::{OPENAI_HINTS, data_url};
use crate::protocol::translate::{Untranslatable, refuse};

/// Hints an Anthropic provider has no use for, beside `OpenAI`'s own: dropped.
const DROPPED: &[&str] = &["modalities"];

/// A chat-completions request in messages terms.
pub(super) struct Translated {
    /// The messages request without `model`.
    pub(super) body: Map<String, Value>,
    /// The built-in tools left out.
    pub(super) dropped: Vec<String>,
}

/// The messages request for the chat-completions `request`, its output limit `max_tokens`
/// where the request sets none.
pub(super) fn messages_request(
    request: &Value,
    builtin: BuiltinTools,
    max_tokens: Option<u64>,
) -> Result<Translated, Untranslatable> {
    let Value::Object(fields) = request else {
        return refuse("", "the request is not a JSON object");
    };
    let mut out = Map::new();
    let mut dropped = Vec::new();
    for (key, value) in fields {
        if value.is_null()
            || OPENAI_HINTS.contains(&key.as_str())
            || DROPPED.contains(&key.as_str())
        {
            continue;
        }
        match key.as_str() {
            "model"
            | "messages"
            | "max_tokens"
            | "max_completion_tokens"
            | "stream"
            | "tools"
            | "tool_choice"
            | "reasoning_effort" => {}
            "temperature" => match value.as_f64() {
                Some(temperature) if (0.0..=1.0).contains(&temperature) => {
                    out.insert("temperature".into(), value.clone());
                }
                _ => return refuse("temperature", "Anthropic takes a temperature from 0 to 1"),
            },
            "top_p" => {
                out.insert("top_p".into(), value.clone());
            }
            "stop" => {
                let stops = match value {
                    Value::String(stop) => vec![Value::from(stop.as_str())],
                    Value::Array(stops) if stops.iter().all(Value::is_string) => stops.clone(),
                    _ => return refuse("stop", "must be a string or a list of strings"),
                };
                out.insert("stop_sequences".into(), Value::Array(stops));
            }
            "user" | "safety_identifier" => {
                let Some(user) = value.as_str() else {
                    return refuse(key.clone(), "must be a string");
                };
                out.insert("metadata".into(), json!({ "user_id": user }));
            }
            "n" if value.as_u64() == Some(1) => {}
            "logprobs" if value == &Value::Bool(false) => {}
            "presence_penalty" | "frequency_penalty" if value.as_f64() == Some(0.0) => {}
            "response_format" => response_format(value, &mut out)?,
            "web_search_options" => match builtin {
                BuiltinTools::Drop => dropped.push("web_search".to_owned()),
                BuiltinTools::Refuse => {
                    return refuse(
                        key.clone(),
                        "Anthropic's web search is one of its own tools",
                    );
                }
            },
            _ => {
                return refuse(
                    key.clone(),
                    "this field has no equivalent in Anthropic's messages",
                );
            }
        }
    }
    let Some(Value::Array(turns)) = fields.get("messages") else {
        return refuse("messages", "must be a list");
    };
    let (system, messages) = turns_of(turns)?;
    if !system.is_empty() {
        out.insert("system".into(), Value::Array(system));
    }
    out.insert("messages".into(), Value::Array(messages));
    let limit = ["max_completion_tokens", "max_tokens"]
        .into_iter()
        .find_map(|field| fields.get(field).and_then(Value::as_u64))
        .or(max_tokens)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    out.insert("max_tokens".into(), Value::from(limit));
    if let Some(effort) = fields
        .get("reasoning_effort")
        .filter(|value| !value.is_null())
    {
        thinking(effort, limit, &mut out)?;
    }
    let tools = match fields.get("tools").filter(|value| !value.is_null()) {
        Some(tools) => messages_tools(tools)?,
        None => Vec::new(),
    };
    let parallel = fields.get("parallel_tool_calls").and_then(Value::as_bool);
    let choice = match fields.get("tool_choice").filter(|value| !value.is_null()) {
        Some(choice) => Some(tool_choice(choice)?),
        None => None,
    };
    if !tools.is_empty() {
        out.insert("tools".into(), Value::Array(tools));
        let mut choice = choice.unwrap_or_else(|| json!({ "type": "auto" }));
        if parallel == Some(false) && choice["type"] != "none" {
            choice["disable_parallel_tool_use"] = Value::Bool(true);
        }
        if parallel == Some(false) || fields.contains_key("tool_choice") {
            out.insert("tool_choice".into(), choice);
        }
    }
    if fields.get("stream") == Some(&Value::Bool(true)) {
        out.insert("stream".into(), Value::Bool(true));
    }
    Ok(Translated { body: out, dropped })
}

/// The output limit sent where neither the request nor the model's `max_output_tokens` sets
/// one (Anthropic requires one).
pub(crate) const DEFAULT_MAX_TOKENS: u64 = 8_192;

/// `response_format`: a JSON schema as `output_config.format`; text as nothing.
fn response_format(format: &Value, out: &mut Map<String, Value>) -> Result<(), Untranslatable> {
    match format["type"].as_str() {
        Some("text") => Ok(()),
        Some("json_schema") => {
            let Some(schema) = format["json_schema"].get("schema") else {
                return refuse("response_format.json_schema.schema", "must be given");
            };
            out.insert(
                "output_config".into(),
                json!({ "format": { "type": "json_schema", "schema": schema } }),
            );
            Ok(())
        }
        _ => refuse(
            "response_format.type",
            "only text and json_schema have an equivalent in Anthropic's messages",
        ),
    }
}

/// `reasoning_effort` as extended thinking with a budget (`low` 2,048 tokens, `medium` 8,192,
/// `high` 16,384), below the output limit (Anthropic's rule); `none` and `minimal` as none.
fn thinking(
    effort: &Value,
    limit: u64,
    out: &mut Map<String, Value>,
) -> Result<(), Untranslatable> {
    let budget: u64 = match effort.as_str() {
        Some("none" | "minimal") => return Ok(()),
        Some("low") => 2_048,
        Some("medium") => 8_192,
        Some("high" | "xhigh") => 16_384,
        _ => {
            return refuse(
                "reasoning_effort",
                "must be none, minimal, low, medium or high",
            );
        }
    };
    // Anthropic's least budget is 1,024 tokens, and it must be below `max_tokens`.
    let budget = budget.min(limit.saturating_sub(1));
    if budget >= 1_024 {
        out.insert(
            "thinking".into(),
            json!({ "type": "enabled", "budget_tokens": budget }),
        );
    }
    Ok(())
}

/// The chat messages as Anthropic's `system` blocks (the system and developer messages before
/// the first turn) and turns (a later system message as a system turn); tool messages as
/// `tool_result` blocks of a user turn, and consecutive turns of one role joined, as Anthropic
/// takes them.
fn turns_of(turns: &[Value]) -> Result<(Vec<Value>, Vec<Value>), Untranslatable> {
    let mut system = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    for (at, turn) in turns.iter().enumerate() {
        let path = format!("messages[{at}]");
        let (role, blocks) = match turn["role"].as_str() {
            Some("system" | "developer") => {
                let blocks = text_blocks(&turn["content"], &path)?;
                if out.is_empty() {
                    system.extend(blocks);
                    continue;
                }
                ("system", blocks)
            }
            Some("user") => ("user", user_blocks(&turn["content"], &path)?),
            Some("assistant") => ("assistant", assistant_blocks(turn, &path)?),
            Some("tool") => {
                let Some(id) = turn["tool_call_id"].as_str() else {
                    return refuse(format!("{path}.tool_call_id"), "must be a string");
                };
                let content = text_blocks(&turn["content"], &path)?;
                let result =
                    json!({ "type": "tool_result", "tool_use_id": id, "content": content });
                ("user", vec![result])
            }
            _ => {
                return refuse(
                    format!("{path}.role"),
                    "must be system, developer, user, assistant or tool",
                );
            }
        };
        if blocks.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last["role"] == role && role != "system" => {
                let content = last["content"].as_array_mut().expect("written as a list");
                // A tool result answers the call just before: results come first in a turn.
                if role == "user" && blocks.iter().any(|block| block["type"] == "tool_result") {
                    let first_other = content
                        .iter()
                        .position(|block| block["type"] != "tool_result")
                        .unwrap_or(content.len());
                    content.splice(first_other..first_other, blocks);
                } else {
                    content.extend(blocks);
                }
            }
            _ => out.push(json!({ "role": role, "content": blocks })),
        }
    }
    Ok((system, out))
}

/// A message's content as text blocks: a string, or its text parts.
fn text_blocks(content: &Value, path: &str) -> Result<Vec<Value>, Untranslatable> {
    match content {
        Value::String(text) if text.is_empty() => Ok(Vec::new()),
        Value::String(text) => Ok(vec![json!({ "type": "text", "text": text })]),
        Value::Array(parts) => {
            let mut blocks = Vec::with_capacity(parts.len());
            for (at, part) in parts.iter().enumerate() {
                match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("text"), Some("")) => {}
                    (Some("text"), Some(text)) => {
                        blocks.push(json!({ "type": "text", "text": text }))
                    }
                    _ => {
                        return refuse(
                            format!("{path}.content[{at}]"),
                            "only text parts translate here",
                        );
                    }
                }
            }
            Ok(blocks)
        }
        Value::Null => Ok(Vec::new()),
        _ => refuse(
            format!("{path}.content"),
            "must be a string or a list of parts",
        ),
    }
}

/// A user message's content: text, images (a data URL as base64, else by URL) and PDF files.
fn user_blocks(content: &Value, path: &str) -> Result<Vec<Value>, Untranslatable> {
    let Value::Array(parts) = content else {
        return text_blocks(content, path);
    };
    let mut blocks = Vec::with_capacity(parts.len());
    for (at, part) in parts.iter().enumerate() {
        let path = format!("{path}.content[{at}]");
        match part["type"].as_str() {
            Some("text") => blocks.extend(text_blocks(&Value::Array(vec![part.clone()]), &path)?),
            Some("image_url") => {
                let Some(url) = part["image_url"]["url"].as_str() else {
                    return refuse(format!("{path}.image_url.url"), "must be a string");
                };
                let source = match data_url(url) {
                    Some((media, data)) => {
                        json!({ "type": "base64", "media_type": media, "data": data })
                    }
                    None => json!({ "type": "url", "url": url }),
                };
                blocks.push(json!({ "type": "image", "source": source }));
            }
            Some("file") => {
                let file = &part["file"];
                let Some((media, data)) = file["file_data"].as_str().and_then(data_url) else {
                    return refuse(
                        format!("{path}.file"),
                        "only a file given as data translates",
                    );
                };
                let mut document = json!({
                    "type": "document",
                    "source": { "type": "base64", "media_type": media, "data": data },
                });
                if let Some(name) = file["filename"].as_str() {
                    document["title"] = Value::from(name);
                }
                blocks.push(document);
            }
            _ => {
                return refuse(
                    format!("{path}.type"),
                    "only text, image_url and file parts translate",
                );
            }
        }
    }
    Ok(blocks)
}

/// An assistant message as blocks: its text (a refusal as text) and its tool calls as
/// `tool_use` blocks (their arguments, a JSON object, as `input`). Reasoning it carried is left
/// out: Anthropic takes thinking back only with its signature.
fn assistant_blocks(turn: &Value, path: &str) -> Result<Vec<Value>, Untranslatable> {
    let mut blocks = match &turn["content"] {
        Value::Array(parts) => {
            let mut blocks = Vec::new();
            for (at, part) in parts.iter().enumerate() {
                match (
                    part["type"].as_str(),
                    part["text"].as_str(),
                    part["refusal"].as_str(),
                ) {
                    (Some("text"), Some(text), _) | (Some("refusal"), _, Some(text)) => {
                        if !text.is_empty() {
                            blocks.push(json!({ "type": "text", "text": text }));
                        }
                    }
                    _ => {
                        return refuse(
                            format!("{path}.content[{at}]"),
                            "only text and refusal parts translate",
                        );
                    }
                }
            }
            blocks
        }
        content => text_blocks(content, path)?,
    };
    for (at, call) in turn["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let path = format!("{path}.tool_calls[{at}]");
        if call["type"].as_str().is_some_and(|kind| kind != "function") {
            return refuse(format!("{path}.type"), "only function tool calls translate");
        }
        let function = &call["function"];
        let (Some(id), Some(name)) = (call["id"].as_str(), function["name"].as_str()) else {
            return refuse(path, "a tool call needs `id` and `function.name`");
        };
        let arguments = function["arguments"].as_str().unwrap_or("{}");
        let input = if arguments.trim().is_empty() {
            json!({})
        } else {
            match serde_json::from_str::<Value>(arguments) {
                Ok(input @ Value::Object(_)) => input,
                _ => {
                    return refuse(
                        format!("{path}.function.arguments"),
                        "must be a JSON object",
                    );
                }
            }
        };
        blocks.push(json!({ "type": "tool_use", "id": id, "name": name, "input": input }));
    }
    Ok(blocks)
}

/// Function `tools` as Anthropic's tools (`parameters` as `input_schema`).
fn messages_tools(tools: &Value) -> Result<Vec<Value>, Untranslatable> {
    let Value::Array(tools) = tools else {
        return refuse("tools", "must be a list");
    };
    let mut out = Vec::with_capacity(tools.len());
    for (at, tool) in tools.iter().enumerate() {
        let path = format!("tools[{at}]");
        if tool["type"].as_str() != Some("function") {
            return refuse(format!("{path}.type"), "only function tools translate");
        }
        let function = &tool["function"];
        let Some(name) = function["name"].as_str() else {
            return refuse(format!("{path}.function.name"), "must be a string");
        };
        let mut translated = Map::new();
        translated.insert("name".into(), Value::from(name));
        if let Some(description) = function["description"].as_str() {
            translated.insert("description".into(), Value::from(description));
        }
        let schema = match &function["parameters"] {
            Value::Null => json!({ "type": "object" }),
            schema @ Value::Object(_) => schema.clone(),
            _ => return refuse(format!("{path}.function.parameters"), "must be an object"),
        };
        translated.insert("input_schema".into(), schema);
        out.push(Value::Object(translated));
    }
    Ok(out)
}

/// `tool_choice` in Anthropic's terms.
fn tool_choice(choice: &Value) -> Result<Value, Untranslatable> {
    match choice {
        Value::String(mode) => match mode.as_str() {
            "auto" => Ok(json!({ "type": "auto" })),
            "required" => Ok(json!({ "type": "any" })),
            "none" => Ok(json!({ "type": "none" })),
            _ => refuse("tool_choice", "must be auto, required, none or a function"),
        },
        Value::Object(_) if choice["type"] == "function" => {
            match choice["function"]["name"].as_str() {
                Some(name) => Ok(json!({ "type": "tool", "name": name })),
                None => refuse("tool_choice.function.name", "must be a string"),
            }
        }
        _ => refuse("tool_choice", "must be auto, required, none or a function"),
    }
}
