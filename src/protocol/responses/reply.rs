//! A chat-completions reply as a Responses `response` object.

use serde_json::{Map, Value, json};

use super::Ids;

/// What a `response` object repeats from the request that asked for it (the Responses API
/// echoes the request's settings), taken once per call.
#[derive(Debug, Clone)]
pub(super) struct Echo {
    fields: Map<String, Value>,
}

impl Echo {
    pub(super) fn of(request: &Value) -> Echo {
        let given = |name: &str, default: Value| {
            request
                .get(name)
                .filter(|value| !value.is_null())
                .cloned()
                .unwrap_or(default)
        };
        let format = request
            .pointer("/text/format")
            .filter(|value| !value.is_null())
            .cloned()
            .unwrap_or(json!({ "type": "text" }));
        let effort = request
            .pointer("/reasoning/effort")
            .cloned()
            .unwrap_or(Value::Null);
        let mut fields = Map::new();
        fields.insert("background".into(), Value::Bool(false));
        fields.insert("instructions".into(), given("instructions", Value::Null));
        fields.insert("max_output_tokens".into(), given("max_output_tokens", Value::Null));
        fields.insert("metadata".into(), given("metadata", json!({})));
        fields.insert("parallel_tool_calls".into(), given("parallel_tool_calls", Value::Bool(true)));
        fields.insert("previous_response_id".into(), Value::Null);
        fields.insert("reasoning".into(), json!({ "effort": effort, "summary": null }));
        fields.insert("service_tier".into(), given("service_tier", json!("default")));
        // A translated call keeps nothing: its response cannot be fetched again.
        fields.insert("store".into(), Value::Bool(false));
        fields.insert("temperature".into(), given("temperature", json!(1.0)));
        fields.insert("text".into(), json!({ "format": format }));
        fields.insert("tool_choice".into(), given("tool_choice", json!("auto")));
        fields.insert("tools".into(), given("tools", json!([])));
        fields.insert("top_p".into(), given("top_p", json!(1.0)));
        fields.insert("truncation".into(), json!("disabled"));
        fields.insert("user".into(), given("user", Value::Null));
        Echo { fields }
    }

    /// A `response` object with these echoed settings.
    pub(super) fn response(&self, head: &Head, status: Status<'_>, output: Vec<Value>, usage: Value) -> Value {
        let mut response = Map::new();
        response.insert("id".into(), head.id.clone().into());
        response.insert("object".into(), "response".into());
        response.insert("created_at".into(), head.created_at.into());
        response.insert("status".into(), status.name().into());
        response.insert("error".into(), Value::Null);
        response.insert("incomplete_details".into(), status.details());
        response.insert("model".into(), head.model.clone().into());
        response.insert("output".into(), Value::Array(output));
        response.insert("usage".into(), usage);
        for (name, value) in &self.fields {
            response.insert(name.clone(), value.clone());
        }
        Value::Object(response)
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

    fn details(self) -> Value {
        match self {
            Status::Incomplete(reason) => json!({ "reason": reason }),
            _ => Value::Null,
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

/// Chat completions' `usage` in the Responses API's names; `null` when there is none.
pub(super) fn usage(chat_usage: Option<&Value>) -> Value {
    let Some(usage) = chat_usage.filter(|usage| usage.is_object()) else {
        return Value::Null;
    };
    let count = |pointer: &str| usage.pointer(pointer).and_then(Value::as_i64).unwrap_or(0);
    let (input, output) = (count("/prompt_tokens"), count("/completion_tokens"));
    json!({
        "input_tokens": input,
        "input_tokens_details": { "cached_tokens": count("/prompt_tokens_details/cached_tokens") },
        "output_tokens": output,
        "output_tokens_details": { "reasoning_tokens": count("/completion_tokens_details/reasoning_tokens") },
        "total_tokens": usage.get("total_tokens").and_then(Value::as_i64).unwrap_or(input + output),
    })
}

/// A completed message item holding `text` (or a refusal).
pub(super) fn message_item(id: &str, status: &str, part: Value) -> Value {
    json!({
        "id": id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": if part.is_null() { json!([]) } else { json!([part]) },
    })
}

/// A message's content part: text, or a refusal.
pub(super) fn content_part(refusal: bool, text: &str) -> Value {
    if refusal {
        json!({ "type": "refusal", "refusal": text })
    } else {
        json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
    }
}

/// A function call item.
pub(super) fn function_call_item(id: &str, status: &str, call_id: &str, name: &str, arguments: &str) -> Value {
    json!({
        "id": id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    })
}

/// The `response` object for a chat-completions `reply` to the translation of `request`.
pub fn response_from_chat(request: &Value, reply: &Value, ids: &mut Ids) -> Value {
    let head = Head {
        id: ids.next("resp"),
        created_at: reply["created"].as_i64().unwrap_or_else(|| chrono::Utc::now().timestamp()),
        model: reply["model"]
            .as_str()
            .or(request["model"].as_str())
            .unwrap_or_default()
            .to_owned(),
    };
    let choice = &reply["choices"][0];
    let message = &choice["message"];
    let mut output = Vec::new();
    let text = message["content"].as_str().filter(|text| !text.is_empty());
    let refusal = message["refusal"].as_str().filter(|text| !text.is_empty());
    if let Some((is_refusal, text)) = refusal.map(|r| (true, r)).or(text.map(|t| (false, t))) {
        let id = ids.next("msg");
        output.push(message_item(&id, "completed", content_part(is_refusal, text)));
    }
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        let function = &call["function"];
        let id = ids.next("fc");
        output.push(function_call_item(
            &id,
            "completed",
            call["id"].as_str().unwrap_or(&id),
            function["name"].as_str().unwrap_or_default(),
            function["arguments"].as_str().unwrap_or("{}"),
        ));
    }
    let status = Status::finished(choice["finish_reason"].as_str());
    Echo::of(request).response(&head, status, output, usage(reply.get("usage")))
}
