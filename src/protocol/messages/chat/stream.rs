//! A chat-completions event stream as Anthropic's messages event stream, as its bytes arrive.

use serde_json::{Value, json};

use super::reply::{anthropic_usage, reasoning_of, stop_reason, stop_sequence};
use crate::protocol::sse::{Event, EventSplitter, event_text};

/// The block open in the messages stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
    /// A tool call's, by its index in the chat stream.
    Tool(u64),
}

/// Turns a chat-completions stream into the messages event sequence: `message_start` (and a
/// `ping`) at the first chunk; a `thinking`, `text` or `tool_use` block for each run of
/// reasoning, text or one tool call's arguments (`thinking_delta`, `text_delta`,
/// `input_json_delta`), each stopped before the next starts; at the chat stream's `[DONE]`,
/// `message_delta` with the stop reason and the usage, then `message_stop`. A provider's
/// keep-alive comment is a `ping`; its error chunk an `error` event. A chat stream that stops
/// without `[DONE]` gets no `message_stop`: the stream was cut, and is billed as one.
///
/// Parallel tool calls stream one after another, as providers send them; a call's arguments
/// arriving after the next call began cannot be placed in Anthropic's sequence of blocks and
/// end the stream with an `error` event.
#[derive(Debug)]
pub struct ChatToMessages {
    splitter: EventSplitter,
    model: String,
    id: String,
    started: bool,
    open: Option<Open>,
    /// The index of the next block.
    blocks: u64,
    /// Tool calls (by chat index) whose block was stopped.
    closed_tools: Vec<u64>,
    finish: Option<String>,
    /// The stop sequence the reply ended on, where the server named it (vLLM's `stop_reason`).
    matched: Option<String>,
    usage: Option<Value>,
    ended: bool,
}

impl ChatToMessages {
    /// A translator for a reply to a request for `model`, its message named `id`.
    pub fn new(model: &str, id: String) -> ChatToMessages {
        ChatToMessages {
            splitter: EventSplitter::new(),
            model: model.to_owned(),
            id,
            started: false,
            open: None,
            blocks: 0,
            closed_tools: Vec::new(),
            finish: None,
            matched: None,
            usage: None,
            ended: false,
        }
    }

    /// Takes bytes of the chat stream (cut anywhere) and returns the messages events they
    /// complete, as server-sent event text.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.splitter.push(chunk);
        let mut out = String::new();
        while let Some(event) = self.splitter.next_event() {
            let text = event_text(&event);
            let parsed = Event::parse(&text);
            let data = parsed.data.trim();
            if data.is_empty() {
                // A comment only: the provider keeping the connection open.
                if self.started && !self.ended && text.trim_start().starts_with(':') {
                    emit(&mut out, "ping", &json!({ "type": "ping" }));
                }
                continue;
            }
            self.chat_event(data, &mut out);
        }
        out
    }

    /// Bytes received that do not make a complete chat event yet.
    pub fn pending(&self) -> usize {
        self.splitter.pending()
    }

    fn chat_event(&mut self, data: &str, out: &mut String) {
        if self.ended {
            return;
        }
        if data == "[DONE]" {
            self.start(out);
            self.close(out);
            let matched = stop_sequence(self.finish.as_deref(), self.matched.as_deref());
            let stop = stop_reason(self.finish.as_deref(), matched);
            let usage = match &self.usage {
                Some(chat) => anthropic_usage(chat).0,
                None => json!({ "input_tokens": null, "output_tokens": null }),
            };
            emit(
                out,
                "message_delta",
                &json!({
                    "type": "message_delta",
                    "delta": { "stop_reason": stop, "stop_sequence": matched },
                    "usage": usage,
                }),
            );
            emit(out, "message_stop", &json!({ "type": "message_stop" }));
            self.ended = true;
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(error) = chunk.get("error").filter(|error| !error.is_null()) {
            let message = error["message"].as_str().unwrap_or("the provider failed");
            self.fail(out, message);
            return;
        }
        self.start(out);
        if let Some(usage) = chunk.get("usage").filter(|usage| usage.is_object()) {
            self.usage = Some(usage.clone());
        }
        let Some(choice) = chunk["choices"]
            .as_array()
            .and_then(|choices| choices.first())
        else {
            return;
        };
        let delta = &choice["delta"];
        if let Some(thinking) = reasoning_of(delta) {
            self.open_block(
                out,
                Open::Thinking,
                || json!({ "type": "thinking", "thinking": "", "signature": "" }),
            );
            self.delta(
                out,
                json!({ "type": "thinking_delta", "thinking": thinking }),
            );
        }
        if let Some(text) = delta["content"].as_str().filter(|text| !text.is_empty()) {
            self.open_block(out, Open::Text, || json!({ "type": "text", "text": "" }));
            self.delta(out, json!({ "type": "text_delta", "text": text }));
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap_or(0);
            if self.closed_tools.contains(&index) {
                self.fail(
                    out,
                    "the provider interleaved the arguments of parallel tool calls",
                );
                return;
            }
            let function = &call["function"];
            self.open_block(out, Open::Tool(index), || {
                json!({
                    "type": "tool_use",
                    "id": call["id"].as_str().unwrap_or_default(),
                    "name": function["name"].as_str().unwrap_or_default(),
                    "input": {},
                })
            });
            if let Some(arguments) = function["arguments"]
                .as_str()
                .filter(|text| !text.is_empty())
            {
                self.delta(
                    out,
                    json!({ "type": "input_json_delta", "partial_json": arguments }),
                );
            }
        }
        if let Some(finish) = choice["finish_reason"].as_str() {
            self.finish = Some(finish.to_owned());
            self.matched = choice["stop_reason"].as_str().map(str::to_owned);
            self.close(out);
        }
    }

    fn start(&mut self, out: &mut String) {
        if self.started {
            return;
        }
        self.started = true;
        // No counts yet: chat completions reports usage at the end (`message_delta` has it).
        let message = json!({
            "type": "message_start",
            "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": null, "output_tokens": null },
            },
        });
        emit(out, "message_start", &message);
        emit(out, "ping", &json!({ "type": "ping" }));
    }

    /// Opens a block of `kind` unless it is the one open, stopping the one open first.
    fn open_block(&mut self, out: &mut String, kind: Open, block: impl FnOnce() -> Value) {
        if self.open == Some(kind) {
            return;
        }
        self.close(out);
        let start = json!({
            "type": "content_block_start",
            "index": self.blocks,
            "content_block": block(),
        });
        emit(out, "content_block_start", &start);
        self.open = Some(kind);
    }

    fn delta(&mut self, out: &mut String, delta: Value) {
        let event = json!({ "type": "content_block_delta", "index": self.blocks, "delta": delta });
        emit(out, "content_block_delta", &event);
    }

    fn close(&mut self, out: &mut String) {
        let Some(open) = self.open.take() else {
            return;
        };
        if let Open::Tool(index) = open {
            self.closed_tools.push(index);
        }
        let stop = json!({ "type": "content_block_stop", "index": self.blocks });
        emit(out, "content_block_stop", &stop);
        self.blocks += 1;
    }

    fn fail(&mut self, out: &mut String, message: &str) {
        let error = json!({
            "type": "error",
            "error": { "type": "api_error", "message": message },
        });
        emit(out, "error", &error);
        self.ended = true;
    }
}

fn emit(out: &mut String, name: &str, data: &Value) {
    out.push_str("event: ");
    out.push_str(name);
    out.push_str("\ndata: ");
    out.push_str(&data.to_string());
    out.push_str("\n\n");
}
