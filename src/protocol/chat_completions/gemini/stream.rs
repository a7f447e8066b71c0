//! Google's server-sent events as a chat-completions event stream, as their bytes arrive.

use serde_json::{Value, json};

use super::reply::{finish_reason, said, usage_of};
use crate::protocol::sse::{Event, EventSplitter, event_text};

/// Turns a Gemini stream into chat chunks: a role chunk first; each response's text as
/// `content`, its thoughts as `reasoning_content`, each function call whole as a tool call of
/// its own index; at the response with the `finishReason`, a chunk with the `finish_reason`,
/// the usage chunk (always written: the call is billed by it), and `data: [DONE]`. Google's
/// error object is chat completions' error chunk; a Gemini stream that stops without a
/// `finishReason` gets no `[DONE]`: the stream was cut.
#[derive(Debug)]
pub struct GeminiToChat {
    splitter: EventSplitter,
    model: String,
    id: String,
    created: u64,
    started: bool,
    calls: usize,
    usage: Option<Value>,
    ended: bool,
}

impl GeminiToChat {
    /// A translator for a reply to a request for `model`, its chunks named `id`, made at
    /// `created` (Unix seconds).
    pub fn new(model: &str, id: String, created: u64) -> GeminiToChat {
        GeminiToChat {
            splitter: EventSplitter::new(),
            model: model.to_owned(),
            id,
            created,
            started: false,
            calls: 0,
            usage: None,
            ended: false,
        }
    }

    /// Takes bytes of the Gemini stream (cut anywhere) and returns the chat chunks they
    /// complete, as server-sent event text.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.splitter.push(chunk);
        let mut out = String::new();
        while let Some(event) = self.splitter.next_event() {
            let text = event_text(&event);
            let data = Event::parse(&text).data;
            let data = data.trim();
            if data.is_empty() || self.ended {
                continue;
            }
            let Ok(response) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            self.response(&response, &mut out);
        }
        out
    }

    /// Bytes received that do not make a complete event yet.
    pub fn pending(&self) -> usize {
        self.splitter.pending()
    }

    fn response(&mut self, response: &Value, out: &mut String) {
        if let Some(error) = response.get("error") {
            let message = error["message"].as_str().unwrap_or("the provider failed");
            let status = error["status"].as_str().unwrap_or("INTERNAL");
            let chunk = json!({ "error": { "message": message, "type": status } });
            write(out, &chunk);
            self.ended = true;
            return;
        }
        if let Some(metadata) = response.get("usageMetadata") {
            self.usage = Some(metadata.clone());
        }
        if !self.started {
            self.started = true;
            self.chunk(out, json!({ "role": "assistant", "content": "" }), None);
        }
        let candidate = &response["candidates"][0];
        let said = said(candidate, self.calls);
        if !said.thoughts.is_empty() {
            self.chunk(out, json!({ "reasoning_content": said.thoughts }), None);
        }
        if !said.text.is_empty() {
            self.chunk(out, json!({ "content": said.text }), None);
        }
        for mut call in said.calls {
            call["index"] = Value::from(self.calls);
            self.calls += 1;
            self.chunk(out, json!({ "tool_calls": [call] }), None);
        }
        let blocked = response["candidates"].is_null()
            && response["promptFeedback"].get("blockReason").is_some();
        let finish = candidate["finishReason"].as_str();
        if finish.is_some() || blocked {
            let reason = if blocked {
                "content_filter"
            } else {
                finish_reason(finish, self.calls > 0)
            };
            self.chunk(out, json!({}), Some(reason));
            let usage = match &self.usage {
                Some(metadata) => usage_of(metadata).1,
                None => Value::Null,
            };
            let chunk = json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage,
            });
            write(out, &chunk);
            out.push_str("data: [DONE]\n\n");
            self.ended = true;
        }
    }

    fn chunk(&self, out: &mut String, delta: Value, finish: Option<&str>) {
        let chunk = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        });
        write(out, &chunk);
    }
}

fn write(out: &mut String, chunk: &Value) {
    out.push_str("data: ");
    out.push_str(&chunk.to_string());
    out.push_str("\n\n");
}
