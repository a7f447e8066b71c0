//! A Gemini request as a chat-completions request.

use serde_json::{Map, Value, json};

use crate::protocol::BuiltinTools;
use crate::protocol::translate::{Untranslatable, refuse};

/// The fields of a Gemini request this translation knows; any other is refused by name.
/// (`model` is what a `countTokens` call's `generateContentRequest` carries.)
const KNOWN: &[&str] = &[
    "model",
    "contents",
    "systemInstruction",
    "tools",
    "toolConfig",
    "generationConfig",
    "safetySettings",
];

/// What a Gemini request became in chat-completions terms.
pub(super) struct ChatRequest {
    /// The chat request, without `model`.
    pub(super) chat: Map<String, Value>,
    /// The built-in tools left out.
    pub(super) dropped: Vec<String>,
    /// Whether the client asked for the model's thoughts (`thinkingConfig.includeThoughts`).
    pub(super) include_thoughts: bool,
}

/// The chat-completions request for the Gemini `request` (streamed when `stream`, its usage
/// always asked: the call is billed by it).
pub(super) fn chat_request(
    request: &Value,
    stream: bool,
    builtin: BuiltinTools,
) -> Result<ChatRequest, Untranslatable> {
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
    if let Some(system) = fields.get("systemInstruction").filter(|v| !v.is_null()) {
        let text = system_text(system)?;
        if !text.is_empty() {
            messages.push(json!({ "role": "system", "content": text }));
        }
    }
    let Some(Value::Array(contents)) = fields.get("contents") else {
        return refuse("contents", "must be a list");
    };
    let mut calls = PendingCalls::default();
    for (at, content) in contents.iter().enumerate() {
        content_messages(
            content,
            &format!("contents[{at}]"),
            &mut calls,
            &mut messages,
        )?;
    }
    chat.insert("messages".into(), Value::Array(messages));
    let mut dropped = Vec::new();
    if let Some(tools) = fields.get("tools").filter(|v| !v.is_null()) {
        let tools = chat_tools(tools, builtin, &mut dropped)?;
        if !tools.is_empty() {
            chat.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(config) = fields.get("toolConfig").filter(|v| !v.is_null())
        && let Some(choice) = tool_choice(config)?
        && (chat.contains_key("tools") || choice == "none")
    {
        chat.insert("tool_choice".into(), choice);
    }
    let mut include_thoughts = false;
    if let Some(config) = fields.get("generationConfig").filter(|v| !v.is_null()) {
        include_thoughts = generation_config(config, &mut chat)?;
    }
    if stream {
        chat.insert("stream".into(), Value::Bool(true));
        chat.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    Ok(ChatRequest {
        chat,
        dropped,
        include_thoughts,
    })
}

/// `systemInstruction` (a content, or a string) as one text: its text parts joined by lines.
fn system_text(system: &Value) -> Result<String, Untranslatable> {
    if let Value::String(text) = system {
        return Ok(text.clone());
    }
    let Some(parts) = system["parts"].as_array() else {
        return refuse("systemInstruction.parts", "must be a list");
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (at, part) in parts.iter().enumerate() {
        match part["text"].as_str() {
            Some(text) => texts.push(text),
            None => return refuse(format!("systemInstruction.parts[{at}]"), "must be text"),
        }
    }
    Ok(texts.join("\n"))
}

/// The function calls of the model's turns, waiting for their responses: Gemini's calls and
/// responses may name no id, chat completions' always do, so one is given each call and a
/// response takes the first waiting call of its name.
#[derive(Default)]
struct PendingCalls {
    waiting: Vec<(String, String)>,
    given: u64,
}

impl PendingCalls {
    fn call(&mut self, id: Option<&str>, name: &str) -> String {
        let id = match id.filter(|id| !id.is_empty()) {
            Some(id) => id.to_owned(),
            None => {
                self.given += 1;
                format!("call_{}", self.given)
            }
        };
        self.waiting.push((id.clone(), name.to_owned()));
        id
    }

    fn response(&mut self, id: Option<&str>, name: &str) -> Option<String> {
        let at = match id.filter(|id| !id.is_empty()) {
            Some(id) => self.waiting.iter().position(|(waiting, _)| waiting == id),
            None => self.waiting.iter().position(|(_, called)| called == name),
        }?;
        Some(self.waiting.remove(at).0)
    }
}

/// One content as chat messages: a model turn as an assistant message (its function calls as
/// `tool_calls`), a user turn's function responses as `tool` messages before the rest of it.
fn content_messages(
    content: &Value,
    path: &str,
    calls: &mut PendingCalls,
    out: &mut Vec<Value>,
) -> Result<(), Untranslatable> {
    let Some(parts) = content["parts"].as_array() else {
        return refuse(format!("{path}.parts"), "must be a list");
    };
    match content["role"].as_str() {
        Some("model") => {
            out.push(model_message(parts, path, calls)?);
            Ok(())
        }
        None | Some("user" | "function") => user_messages(parts, path, calls, out),
        Some(_) => refuse(format!("{path}.role"), "must be user or model"),
    }
}

fn model_message(
    parts: &[Value],
    path: &str,
    calls: &mut PendingCalls,
) -> Result<Value, Untranslatable> {
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for (at, part) in parts.iter().enumerate() {
        let path = format!("{path}.parts[{at}]");
        // The model's earlier thoughts: chat completions takes no reasoning back.
        if part["thought"] == Value::Bool(true) {
            continue;
        }
        if let Some(said) = part["text"].as_str() {
            text.push_str(said);
        } else if let Some(call) = part.get("functionCall") {
            let Some(name) = call["name"].as_str() else {
                return refuse(format!("{path}.functionCall.name"), "must be a string");
            };
            let id = calls.call(call["id"].as_str(), name);
            let args = match &call["args"] {
                Value::Null => "{}".to_owned(),
                args => args.to_string(),
            };
            tool_calls.push(json!({
                "id": id, "type": "function", "function": { "name": name, "arguments": args },
            }));
        } else {
            return refuse(path, "a model turn's part must be text or a function call");
        }
    }
    let mut message = json!({ "role": "assistant", "content": null });
    if !text.is_empty() {
        message["content"] = Value::from(text);
    }
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls);
    }
    Ok(message)
}

fn user_messages(
    parts: &[Value],
    path: &str,
    calls: &mut PendingCalls,
    out: &mut Vec<Value>,
) -> Result<(), Untranslatable> {
    let mut content = Vec::new();
    for (at, part) in parts.iter().enumerate() {
        let path = format!("{path}.parts[{at}]");
        if let Some(response) = part.get("functionResponse") {
            let name = response["name"].as_str().unwrap_or_default();
            let Some(id) = calls.response(response["id"].as_str(), name) else {
                return refuse(
                    format!("{path}.functionResponse"),
                    "answers no function call of the model's turns",
                );
            };
            let result = match &response["response"] {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            out.push(json!({ "role": "tool", "tool_call_id": id, "content": result }));
        } else if let Some(text) = part["text"].as_str() {
            content.push(json!({ "type": "text", "text": text }));
        } else if let Some(data) = part.get("inlineData") {
            content.push(inline_part(data, &path)?);
        } else if let Some(file) = part.get("fileData") {
            content.push(file_part(file, &path)?);
        } else {
            return refuse(
                path,
                "a user turn's part must be text, inline data, file data or a function response",
            );
        }
    }
    match content.as_slice() {
        [] => {}
        [only] if only["type"] == "text" => {
            out.push(json!({ "role": "user", "content": only["text"] }));
        }
        _ => out.push(json!({ "role": "user", "content": content })),
    }
    Ok(())
}

/// `inlineData`: an image as a data URL, a PDF as a `file` part; other data has no equivalent.
fn inline_part(data: &Value, path: &str) -> Result<Value, Untranslatable> {
    let (Some(mime), Some(base64)) = (data["mimeType"].as_str(), data["data"].as_str()) else {
        return refuse(
            format!("{path}.inlineData"),
            "needs mimeType and data strings",
        );
    };
    let url = format!("data:{mime};base64,{base64}");
    if mime.starts_with("image/") {
        Ok(json!({ "type": "image_url", "image_url": { "url": url } }))
    } else if mime == "application/pdf" {
        Ok(json!({ "type": "file", "file": { "filename": "document.pdf", "file_data": url } }))
    } else {
        refuse(
            format!("{path}.inlineData.mimeType"),
            "only images and PDF documents translate",
        )
    }
}

/// `fileData`: an image by its address; Google's stored files have no equivalent.
fn file_part(file: &Value, path: &str) -> Result<Value, Untranslatable> {
    let uri = file["fileUri"].as_str().unwrap_or_default();
    let image = file["mimeType"]
        .as_str()
        .is_some_and(|mime| mime.starts_with("image/"));
    if image && (uri.starts_with("https://") || uri.starts_with("http://")) {
        Ok(json!({ "type": "image_url", "image_url": { "url": uri } }))
    } else {
        refuse(
            format!("{path}.fileData"),
            "only an image at an http(s) address translates",
        )
    }
}

/// `tools`: each function declaration as a chat function tool (its `OpenAPI` schema as JSON
/// Schema); Google's own tools (search, code execution, URL context, ...) dropped or refused as
/// `builtin` says.
fn chat_tools(
    tools: &Value,
    builtin: BuiltinTools,
    dropped: &mut Vec<String>,
) -> Result<Vec<Value>, Untranslatable> {
    let Value::Array(tools) = tools else {
        return refuse("tools", "must be a list");
    };
    let mut chat = Vec::new();
    for (at, tool) in tools.iter().enumerate() {
        let Value::Object(tool) = tool else {
            return refuse(format!("tools[{at}]"), "must be an object");
        };
        for (kind, value) in tool {
            if kind != "functionDeclarations" {
                match builtin {
                    BuiltinTools::Drop => {
                        dropped.push(kind.clone());
                        continue;
                    }
                    BuiltinTools::Refuse => {
                        return refuse(
                            format!("tools[{at}].{kind}"),
                            "a tool run inside Google's API has no equivalent in chat completions",
                        );
                    }
                }
            }
            let Value::Array(declarations) = value else {
                return refuse(
                    format!("tools[{at}].functionDeclarations"),
                    "must be a list",
                );
            };
            for (index, declaration) in declarations.iter().enumerate() {
                let path = format!("tools[{at}].functionDeclarations[{index}]");
                chat.push(function_tool(declaration, &path)?);
            }
        }
    }
    Ok(chat)
}

fn function_tool(declaration: &Value, path: &str) -> Result<Value, Untranslatable> {
    let Some(name) = declaration["name"].as_str() else {
        return refuse(format!("{path}.name"), "must be a string");
    };
    let mut function = Map::new();
    function.insert("name".into(), Value::from(name));
    if let Some(description) = declaration["description"].as_str() {
        function.insert("description".into(), Value::from(description));
    }
    let parameters = match (
        declaration.get("parametersJsonSchema"),
        declaration.get("parameters"),
    ) {
        (Some(schema), _) if !schema.is_null() => schema.clone(),
        (_, Some(schema)) if !schema.is_null() => json_schema(schema),
        _ => json!({ "type": "object", "properties": {} }),
    };
    function.insert("parameters".into(), parameters);
    Ok(json!({ "type": "function", "function": function }))
}

/// Google's `OpenAPI` schema subset as JSON Schema: its upper-case `type` names in lower case,
/// `nullable` as a `null` type, `propertyOrdering` (Google's own) left out; the rest as it is.
pub(super) fn json_schema(schema: &Value) -> Value {
    let Value::Object(fields) = schema else {
        return schema.clone();
    };
    let nullable = fields.get("nullable") == Some(&Value::Bool(true));
    let mut out = Map::new();
    for (key, value) in fields {
        let converted = match key.as_str() {
            "nullable" | "propertyOrdering" => continue,
            "type" => match value.as_str() {
                Some(kind) => {
                    let kind = Value::from(kind.to_ascii_lowercase());
                    if nullable {
                        json!([kind, "null"])
                    } else {
                        kind
                    }
                }
                None => value.clone(),
            },
            "properties" => match value {
                Value::Object(properties) => Value::Object(
                    properties
                        .iter()
                        .map(|(name, schema)| (name.clone(), json_schema(schema)))
                        .collect(),
                ),
                other => other.clone(),
            },
            "items" => json_schema(value),
            "anyOf" => match value {
                Value::Array(options) => Value::Array(options.iter().map(json_schema).collect()),
                other => other.clone(),
            },
            _ => value.clone(),
        };
        out.insert(key.clone(), converted);
    }
    Value::Object(out)
}

/// `toolConfig.functionCallingConfig` as `tool_choice`: `AUTO` (and `VALIDATED`) `auto`, `NONE`
/// `none`, `ANY` `required`, or the one function `allowedFunctionNames` names.
fn tool_choice(config: &Value) -> Result<Option<Value>, Untranslatable> {
    let Value::Object(config) = config else {
        return refuse("toolConfig", "must be an object");
    };
    if let Some(other) = config.keys().find(|key| *key != "functionCallingConfig") {
        return refuse(
            format!("toolConfig.{other}"),
            "this field has no equivalent in chat completions",
        );
    }
    let Some(calling) = config.get("functionCallingConfig") else {
        return Ok(None);
    };
    let allowed: Vec<&str> = calling["allowedFunctionNames"]
        .as_array()
        .map(|names| names.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let choice = match calling["mode"].as_str().unwrap_or("AUTO") {
        "AUTO" | "MODE_UNSPECIFIED" | "VALIDATED" => Value::from("auto"),
        "NONE" => Value::from("none"),
        "ANY" => match allowed.as_slice() {
            [] => Value::from("required"),
            [one] => json!({ "type": "function", "function": { "name": one } }),
            _ => {
                return refuse(
                    "toolConfig.functionCallingConfig.allowedFunctionNames",
                    "chat completions can force one function, or any, not a choice of some",
                );
            }
        },
        _ => {
            return refuse(
                "toolConfig.functionCallingConfig.mode",
                "must be AUTO, ANY, NONE or VALIDATED",
            );
        }
    };
    Ok(Some(choice))
}

/// `generationConfig` into the chat request; whether the client asked for thoughts.
fn generation_config(
    config: &Value,
    chat: &mut Map<String, Value>,
) -> Result<bool, Untranslatable> {
    let Value::Object(config) = config else {
        return refuse("generationConfig", "must be an object");
    };
    let renamed = [
        ("maxOutputTokens", "max_tokens"),
        ("temperature", "temperature"),
        ("topP", "top_p"),
        ("stopSequences", "stop"),
        ("candidateCount", "n"),
        ("presencePenalty", "presence_penalty"),
        ("frequencyPenalty", "frequency_penalty"),
        ("seed", "seed"),
        ("responseLogprobs", "logprobs"),
        ("logprobs", "top_logprobs"),
    ];
    let mut include_thoughts = false;
    let mut schema = None;
    let mut json_mime = false;
    for (key, value) in config {
        if value.is_null() {
            continue;
        }
        if let Some((_, chat_name)) = renamed.iter().find(|(name, _)| name == key) {
            chat.insert((*chat_name).into(), value.clone());
            continue;
        }
        match key.as_str() {
            // A sampling setting chat completions has no name for, which the Gemini CLI sends
            // on every call (64): left out rather than refused, or the CLI could not work.
            "topK" => {}
            "responseMimeType" => match value.as_str() {
                Some("text/plain") => {}
                Some("application/json") => json_mime = true,
                _ => {
                    return refuse(
                        "generationConfig.responseMimeType",
                        "only text/plain and application/json translate",
                    );
                }
            },
            "responseSchema" => schema = Some(json_schema(value)),
            "responseJsonSchema" => schema = Some(value.clone()),
            "responseModalities" => {
                let text_only = value
                    .as_array()
                    .is_some_and(|modalities| modalities.iter().all(|m| m == "TEXT"));
                if !text_only {
                    return refuse(
                        "generationConfig.responseModalities",
                        "chat completions answers text only",
                    );
                }
            }
            "thinkingConfig" => {
                let (effort, include) = thinking(value)?;
                include_thoughts = include;
                if let Some(effort) = effort {
                    chat.insert("reasoning_effort".into(), Value::from(effort));
                }
            }
            _ => {
                return refuse(
                    format!("generationConfig.{key}"),
                    "this setting has no equivalent in chat completions",
                );
            }
        }
    }
    match schema {
        Some(schema) => {
            chat.insert(
                "response_format".into(),
                json!({ "type": "json_schema", "json_schema": { "name": "response", "schema": schema } }),
            );
        }
        None if json_mime => {
            chat.insert("response_format".into(), json!({ "type": "json_object" }));
        }
        None => {}
    }
    Ok(include_thoughts)
}

/// `thinkingConfig`: its level, or its budget in tokens, as `reasoning_effort` (a budget of 0
/// or the dynamic -1 leaves the provider's default); and `includeThoughts`.
fn thinking(config: &Value) -> Result<(Option<&'static str>, bool), Untranslatable> {
    let Value::Object(config) = config else {
        return refuse("generationConfig.thinkingConfig", "must be an object");
    };
    let mut effort = None;
    let mut include = false;
    for (key, value) in config {
        match key.as_str() {
            "includeThoughts" => include = value == &Value::Bool(true),
            "thinkingLevel" => {
                effort = match value.as_str().map(str::to_ascii_lowercase).as_deref() {
                    Some("minimal") => Some("minimal"),
                    Some("low") => Some("low"),
                    Some("medium") => Some("medium"),
                    Some("high") => Some("high"),
                    _ => {
                        return refuse(
                            "generationConfig.thinkingConfig.thinkingLevel",
                            "must be minimal, low, medium or high",
                        );
                    }
                }
            }
            "thinkingBudget" => {
                let Some(budget) = value.as_i64() else {
                    return refuse(
                        "generationConfig.thinkingConfig.thinkingBudget",
                        "must be a whole number",
                    );
                };
                effort = match budget {
                    ..=0 => effort,
                    1..4096 => Some("low"),
                    4096..16384 => Some("medium"),
                    _ => Some("high"),
                };
            }
            _ => {
                return refuse(
                    format!("generationConfig.thinkingConfig.{key}"),
                    "this setting has no equivalent in chat completions",
                );
            }
        }
    }
    Ok((effort, include))
}
