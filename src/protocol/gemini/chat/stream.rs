//! A chat-completions event stream as Google's server-sent events, as its bytes arrive.

use serde_json::{Value, json};

use super::reply::{finish_reason, function_call, usage_metadata};
use crate::protocol::TokenUsage;
use crate::protocol::sse::{Event, EventSplitter, event_text};

/// A tool call being streamed: Google sends each call whole, so its arguments are gathered.
#[derive(Debug)]
struct Call {
    index: u64,
    id: String,
    name: String,
    arguments: String,
}

/// Turns a chat-completions stream into Google's: a response for each piece of text (and of
/// reasoning, as a thought, when asked), and at the chat stream's `[DONE]` a last response with
/// the tool calls (each whole), the `finishReason` and the `usageMetadata`. A provider's error
/// chunk is Google's error object; a chat stream that stops without `[DONE]` gets no last
/// response: the stream was cut, and is billed as one.
#[derive(Debug)]
pub struct ChatToGemini {
    splitter: EventSplitter,
    model: String,
    thoughts: bool,
    calls: Vec<Call>,
    finish: Option<String>,
    usage: Option<TokenUsage>,
    id: Option<String>,
    ended: bool,
}

impl ChatToGemini {
    /// A translator for a reply to a request for `model` (with thoughts when `thoughts`).
    pub(super) fn new(model: &str, thoughts: bool) -> ChatToGemini {
        ChatToGemini {
            splitter: EventSplitter::new(),
            model: model.to_owned(),
            thoughts,
            calls: Vec::new(),
            finish: None,
            usage: None,
            id: None,
            ended: false,
        }
    }

    /// Takes bytes of the chat stream (cut anywhere) and returns Google's events they
    /// complete, as server-sent event text.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.splitter.push(chunk);
        let mut out = String::new();
        while let Some(event) = self.splitter.next_event() {
            let text = event_text(&event);
            let parsed = Event::parse(&text);
            let data = parsed.data.trim();
            if data.is_empty() || self.ended {
                continue;
            }
            if data == "[DONE]" {
                self.finish(&mut out);
                continue;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            self.chat_chunk(&chunk, &mut out);
        }
        out
    }

    /// Bytes received that do not make a complete event yet.
    pub fn pending(&self) -> usize {
        self.splitter.pending()
    }

    fn chat_chunk(&mut self, chunk: &Value, out: &mut String) {
        if let Some(error) = chunk.get("error") {
            let message = error["message"]
                .as_str()
                .or(error.as_str())
                .unwrap_or("the provider failed");
            let error =
                json!({ "error": { "code": 500, "message": message, "status": "INTERNAL" } });
            emit(out, &error);
            self.ended = true;
            return;
        }
        if self.id.is_none() {
            self.id = chunk["id"].as_str().map(str::to_owned);
        }
        if let Some(usage) = chunk.get("usage").filter(|usage| !usage.is_null()) {
            self.usage = Some(serde_json::from_value(usage.clone()).unwrap_or(TokenUsage {
                malformed: true,
                ..TokenUsage::default()
            }));
        }
        let Some(choice) = chunk["choices"].get(0) else {
            return;
        };
        let delta = &choice["delta"];
        let reasoning = ["reasoning_content", "reasoning"]
            .into_iter()
            .find_map(|field| delta[field].as_str())
            .filter(|text| !text.is_empty());
        if let Some(reasoning) = reasoning.filter(|_| self.thoughts) {
            self.respond(
                out,
                vec![json!({ "text": reasoning, "thought": true })],
                None,
            );
        }
        for field in ["content", "refusal"] {
            if let Some(text) = delta[field].as_str().filter(|text| !text.is_empty()) {
                self.respond(out, vec![json!({ "text": text })], None);
            }
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap_or(0);
            let at = match self.calls.iter().position(|known| known.index == index) {
                Some(at) => at,
                None => {
                    self.calls.push(Call {
                        index,
                        id: String::new(),
                        name: String::new(),
                        arguments: String::new(),
                    });
                    self.calls.len() - 1
                }
            };
            let known = &mut self.calls[at];
            if let Some(id) = call["id"].as_str() {
                known.id = id.to_owned();
            }
            let function = &call["function"];
            if let Some(name) = function["name"].as_str() {
                known.name.push_str(name);
            }
            if let Some(arguments) = function["arguments"].as_str() {
                known.arguments.push_str(arguments);
            }
        }
        if let Some(finish) = choice["finish_reason"].as_str() {
            self.finish = Some(finish.to_owned());
        }
    }

    /// The last response: the tool calls, the finish reason and the usage.
    fn finish(&mut self, out: &mut String) {
        let mut parts: Vec<Value> = self
            .calls
            .iter()
            .map(|call| function_call(&call.id, &call.name, &call.arguments))
            .collect();
        if parts.is_empty() {
            parts.push(json!({ "text": "" }));
        }
        let finish = finish_reason(self.finish.as_deref());
        let usage = self.usage.filter(|usage| !usage.malformed);
        self.respond(out, parts, Some((finish, usage)));
        self.ended = true;
    }

    fn respond(
        &self,
        out: &mut String,
        parts: Vec<Value>,
        last: Option<(&'static str, Option<TokenUsage>)>,
    ) {
        let mut candidate = json!({ "content": { "role": "model", "parts": parts }, "index": 0 });
        let mut response = json!({ "candidates": [], "modelVersion": self.model });
        if let Some((finish, usage)) = last {
            candidate["finishReason"] = Value::from(finish);
            if let Some(usage) = usage {
                response["usageMetadata"] = usage_metadata(&usage);
            }
        }
        response["candidates"] = json!([candidate]);
        if let Some(id) = &self.id {
            response["responseId"] = Value::from(id.as_str());
        }
        emit(out, &response);
    }
}

fn emit(out: &mut String, data: &Value) {
    out.push_str("data: ");
    out.push_str(&data.to_string());
    out.push_str("\r\n\r\n");
}
