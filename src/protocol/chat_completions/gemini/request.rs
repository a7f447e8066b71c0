//! A chat-completions request as a Gemini request.

use serde_json::{Map, Value, json};

use crate::protocol::BuiltinTools;
use crate::protocol::chat_completions::{OPENAI_HINTS, data_url};
use crate::protocol::translate::{Untranslatable, refuse};

/// Hints a Gemini provider has no use for, beside `OpenAI`'s own: dropped.
const DROPPED: &[&str] = &["user", "safety_identifier"];

/// A chat-completions request in Gemini terms.
pub(super) struct Translated {
    /// The Gemini request (the model and the stream are in its path, not here).
    pub(super) body: Map<String, Value>,
    /// The built-in tools left out.
    pub(super) dropped: Vec<String>,
}

/// The Gemini request for the chat-completions `request`, its output limit `max_tokens`
/// where the request sets none.
pub(super) fn gemini_request(
    request: &Value,
    builtin: BuiltinTools,
    max_tokens: Option<u64>,
) -> Result<Translated, Untranslatable> {
    let Value::Object(fields) = request else {
        return refuse("", "the request is not a JSON object");
    };
    let mut config = Map::new();
    let mut dropped = Vec::new();
    for (key, value) in fields {
        if value.is_null()
            || OPENAI_HINTS.contains(&key.as_str())
            || DROPPED.contains(&key.as_str())
        {
            continue;
        }
        let renamed = match key.as_str() {
            "model"
            | "messages"
            | "stream"
            | "tools"
            | "tool_choice"
            | "max_tokens"
            | "max_completion_tokens" => continue,
            "temperature" => "temperature",
            "top_p" => "topP",
            "n" => "candidateCount",
            "presence_penalty" => "presencePenalty",
            "frequency_penalty" => "frequencyPenalty",
            "seed" => "seed",
            "logprobs" => "responseLogprobs",
            "top_logprobs" => "logprobs",
            "stop" => {
                let stops = match value {
                    Value::String(stop) => vec![Value::from(stop.as_str())],
                    Value::Array(stops) if stops.iter().all(Value::is_string) => stops.clone(),
                    _ => return refuse("stop", "must be a string or a list of strings"),
                };
                config.insert("stopSequences".into(), Value::Array(stops));
                continue;
            }
            "response_format" => {
                response_format(value, &mut config)?;
                continue;
            }
            "reasoning_effort" => {
                let budget = match value.as_str() {
                    Some("none" | "minimal") => 0,
                    Some("low") => 1_024,
                    Some("medium") => 8_192,
                    Some("high" | "xhigh") => 24_576,
                    _ => {
                        return refuse(
                            "reasoning_effort",
                            "must be none, minimal, low, medium or high",
                        );
                    }
                };
                config.insert("thinkingConfig".into(), json!({ "thinkingBudget": budget }));
                continue;
            }
            "modalities" => {
                let text_only = value
                    .as_array()
                    .is_some_and(|modalities| modalities.iter().all(|m| m == "text"));
                if !text_only {
                    return refuse("modalities", "only text translates");
                }
                continue;
            }
            "web_search_options" => match builtin {
                BuiltinTools::Drop => {
                    dropped.push("web_search".to_owned());
                    continue;
                }
                BuiltinTools::Refuse => {
                    return refuse(key.clone(), "a web search is the provider's own tool");
                }
            },
            _ => {
                return refuse(
                    key.clone(),
                    "this field has no equivalent in the Gemini API",
                );
            }
        };
        config.insert(renamed.into(), value.clone());
    }
    let limit = ["max_completion_tokens", "max_tokens"]
        .into_iter()
        .find_map(|field| fields.get(field).and_then(Value::as_u64))
        .or(max_tokens);
    if let Some(limit) = limit {
        config.insert("maxOutputTokens".into(), Value::from(limit));
    }
    let Some(Value::Array(turns)) = fields.get("messages") else {
        return refuse("messages", "must be a list");
    };
    let mut out = Map::new();
    let (system, contents) = contents_of(turns)?;
    if !system.is_empty() {
        out.insert(
            "systemInstruction".into(),
            json!({ "parts": [{ "text": system.join("\n\n") }] }),
        );
    }
    out.insert("contents".into(), Value::Array(contents));
    if let Some(tools) = fields.get("tools").filter(|value| !value.is_null()) {
        let declarations = function_declarations(tools)?;
        if !declarations.is_empty() {
            out.insert(
                "tools".into(),
                json!([{ "functionDeclarations": declarations }]),
            );
        }
    }
    if let Some(choice) = fields.get("tool_choice").filter(|value| !value.is_null()) {
        out.insert(
            "toolConfig".into(),
            json!({ "functionCallingConfig": function_calling(choice)? }),
        );
    }
    if !config.is_empty() {
        out.insert("generationConfig".into(), Value::Object(config));
    }
    Ok(Translated { body: out, dropped })
}

/// `response_format`: JSON (with its schema) as `responseMimeType` (and `responseJsonSchema`);
/// text as nothing.
fn response_format(format: &Value, config: &mut Map<String, Value>) -> Result<(), Untranslatable> {
    match format["type"].as_str() {
        Some("text") => {}
        Some("json_object") => {
            config.insert("responseMimeType".into(), Value::from("application/json"));
        }
        Some("json_schema") => {
            let Some(schema) = format["json_schema"].get("schema") else {
                return refuse("response_format.json_schema.schema", "must be given");
            };
            config.insert("responseMimeType".into(), Value::from("application/json"));
            config.insert("responseJsonSchema".into(), schema.clone());
        }
        _ => {
            return refuse(
                "response_format.type",
                "must be text, json_object or json_schema",
            );
        }
    }
    Ok(())
}

/// The system and developer messages' texts, and the other messages as Gemini contents: user
/// turns as `user` contents, assistant turns as `model` ones (tool calls as `functionCall`
/// parts), tool messages as `functionResponse` parts of a `user` content; turns of one role in
/// a row joined into one content.
fn contents_of(turns: &[Value]) -> Result<(Vec<String>, Vec<Value>), Untranslatable> {
    let mut system = Vec::new();
    let mut contents: Vec<Value> = Vec::new();
    // The name of each tool call, by its id, for the tool messages that answer it.
    let mut names: Vec<(String, String)> = Vec::new();
    for (at, turn) in turns.iter().enumerate() {
        let path = format!("messages[{at}]");
        let (role, parts) = match turn["role"].as_str() {
            Some("system" | "developer") => {
                system.push(text_of(&turn["content"], &format!("{path}.content"))?);
                continue;
            }
            Some("user") => ("user", user_parts(&turn["content"], &path)?),
            Some("assistant") => ("model", model_parts(turn, &path, &mut names)?),
            Some("tool") => {
                let id = turn["tool_call_id"].as_str().unwrap_or_default();
                let Some((_, name)) = names.iter().find(|(call, _)| call == id) else {
                    return refuse(
                        format!("{path}.tool_call_id"),
                        "answers no tool call of the conversation",
                    );
                };
                let result = text_of(&turn["content"], &format!("{path}.content"))?;
                let response = match serde_json::from_str::<Value>(&result) {
                    Ok(object @ Value::Object(_)) => object,
                    _ => json!({ "result": result }),
                };
                let part = json!({ "functionResponse": { "name": name, "response": response } });
                ("user", vec![part])
            }
            _ => {
                return refuse(
                    format!("{path}.role"),
                    "must be system, user, assistant or tool",
                );
            }
        };
        if parts.is_empty() {
            continue;
        }
        match contents.last_mut() {
            Some(last) if last["role"] == role => {
                if let Some(Value::Array(joined)) = last.get_mut("parts") {
                    joined.extend(parts);
                }
            }
            _ => contents.push(json!({ "role": role, "parts": parts })),
        }
    }
    Ok((system, contents))
}

/// A message's `content` as one text: a string, or its text parts joined.
fn text_of(content: &Value, path: &str) -> Result<String, Untranslatable> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (at, part) in parts.iter().enumerate() {
                match part["text"].as_str() {
                    Some(piece) => text.push_str(piece),
                    None => return refuse(format!("{path}[{at}]"), "must be a text part"),
                }
            }
            Ok(text)
        }
        _ => refuse(path, "must be a string or a list of parts"),
    }
}

fn user_parts(content: &Value, path: &str) -> Result<Vec<Value>, Untranslatable> {
    let Value::Array(parts) = content else {
        let text = text_of(content, &format!("{path}.content"))?;
        return Ok(vec![json!({ "text": text })]);
    };
    let mut out = Vec::with_capacity(parts.len());
    for (at, part) in parts.iter().enumerate() {
        let path = format!("{path}.content[{at}]");
        match part["type"].as_str() {
            Some("text") => out.push(json!({ "text": part["text"] })),
            Some("image_url") => {
                let url = part["image_url"]["url"].as_str().unwrap_or_default();
                let Some((mime, data)) = data_url(url) else {
                    return refuse(
                        format!("{path}.image_url.url"),
                        "only an image given as a data URL translates",
                    );
                };
                out.push(json!({ "inlineData": { "mimeType": mime, "data": data } }));
            }
            Some("file") => {
                let Some((mime, data)) = part["file"]["file_data"].as_str().and_then(data_url)
                else {
                    return refuse(
                        format!("{path}.file"),
                        "only a file given as data translates",
                    );
                };
                out.push(json!({ "inlineData": { "mimeType": mime, "data": data } }));
            }
            Some("input_audio") => {
                let audio = &part["input_audio"];
                let (Some(data), Some(format)) = (audio["data"].as_str(), audio["format"].as_str())
                else {
                    return refuse(format!("{path}.input_audio"), "needs data and format");
                };
                let mime = format!("audio/{format}");
                out.push(json!({ "inlineData": { "mimeType": mime, "data": data } }));
            }
            _ => {
                return refuse(
                    format!("{path}.type"),
                    "only text, image_url, file and input_audio parts translate",
                );
            }
        }
    }
    Ok(out)
}

/// An assistant message's text (a refusal as text) and tool calls (their arguments, a JSON
/// object, as `args`); reasoning it carried is left out.
fn model_parts(
    turn: &Value,
    path: &str,
    names: &mut Vec<(String, String)>,
) -> Result<Vec<Value>, Untranslatable> {
    let mut parts = Vec::new();
    for field in ["content", "refusal"] {
        let text = text_of(&turn[field], &format!("{path}.{field}"))?;
        if !text.is_empty() {
            parts.push(json!({ "text": text }));
        }
    }
    for (at, call) in turn["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let path = format!("{path}.tool_calls[{at}]");
        if call["type"].as_str().unwrap_or("function") != "function" {
            return refuse(format!("{path}.type"), "only function calls translate");
        }
        let function = &call["function"];
        let Some(name) = function["name"].as_str() else {
            return refuse(format!("{path}.function.name"), "must be a string");
        };
        let arguments = function["arguments"].as_str().unwrap_or("{}");
        let args = match serde_json::from_str::<Value>(if arguments.trim().is_empty() {
            "{}"
        } else {
            arguments
        }) {
            Ok(object @ Value::Object(_)) => object,
            _ => {
                return refuse(
                    format!("{path}.function.arguments"),
                    "must be a JSON object",
                );
            }
        };
        if let Some(id) = call["id"].as_str() {
            names.push((id.to_owned(), name.to_owned()));
        }
        parts.push(json!({ "functionCall": { "name": name, "args": args } }));
    }
    Ok(parts)
}

/// Function tools as function declarations (their JSON Schema as `parametersJsonSchema`).
fn function_declarations(tools: &Value) -> Result<Vec<Value>, Untranslatable> {
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
        let mut declaration = Map::new();
        declaration.insert("name".into(), Value::from(name));
        if let Some(description) = function["description"].as_str() {
            declaration.insert("description".into(), Value::from(description));
        }
        match &function["parameters"] {
            Value::Null => {}
            schema @ Value::Object(_) => {
                declaration.insert("parametersJsonSchema".into(), schema.clone());
            }
            _ => return refuse(format!("{path}.function.parameters"), "must be an object"),
        }
        out.push(Value::Object(declaration));
    }
    Ok(out)
}

/// `tool_choice` as `functionCallingConfig`.
fn function_calling(choice: &Value) -> Result<Value, Untranslatable> {
    match choice {
        Value::String(mode) => match mode.as_str() {
            "auto" => Ok(json!({ "mode": "AUTO" })),
            "none" => Ok(json!({ "mode": "NONE" })),
            "required" => Ok(json!({ "mode": "ANY" })),
            _ => refuse("tool_choice", "must be auto, none, required or a function"),
        },
        Value::Object(_) => match choice["function"]["name"].as_str() {
            Some(name) => Ok(json!({ "mode": "ANY", "allowedFunctionNames": [name] })),
            None => refuse("tool_choice", "only a function choice translates"),
        },
        _ => refuse("tool_choice", "must be a string or an object"),
    }
}
