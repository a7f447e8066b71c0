//! Anthropic's messages event stream as a chat-completions stream, as its bytes arrive.

use serde_json::{Value, json};

use super::reply::{chat_usage, finish_reason};
use crate::protocol::TokenUsage;
use crate::protocol::sse::{Event, EventSplitter, event_text};

/// Turns a messages stream into chat completion chunks: a chunk with the assistant's role at
/// `message_start`; text deltas as `content`, thinking deltas as `reasoning_content`, each
/// `tool_use` block as a tool call (its id and name in its first chunk, its `input_json_delta`s
/// as `arguments`), numbered in order; at `message_stop`, a chunk with the `finish_reason`, the
/// usage chunk, and `data: [DONE]`. The usage chunk is always written: the call is billed by
/// it, and the gateway hides it from a client that did not ask for it
/// (`stream_options.include_usage`), as it does when it asks a provider for usage itself. Anthropic's pings are comments; its `error` event is an error chunk. A
/// stream that stops without `message_stop` gets no `[DONE]`: the stream was cut.
#[derive(Debug)]
pub struct MessagesToChat {
    splitter: EventSplitter,
    model: String,
    id: String,
    created: u64,
    /// The tool call each open `tool_use` block is, by block index, and the next call's number.
    calls: Vec<(u64, u64)>,
    next_call: u64,
    stop_reason: Option<String>,
    /// The usage read so far (`message_start`'s, then `message_delta`'s over it), and the last
    /// report as it came, for a report that is not to be trusted.
    usage: TokenUsage,
    last_report: Option<Value>,
    ended: bool,
}

impl MessagesToChat {
    /// A translator for a reply to a request for `model`, its chunks named `id`, made at
    /// `created` (Unix seconds).
    pub fn new(model: &str, id: String, created: u64) -> MessagesToChat {
        MessagesToChat {
            splitter: EventSplitter::new(),
            model: model.to_owned(),
            id,
            created,
            calls: Vec::new(),
            next_call: 0,
            stop_reason: None,
            usage: TokenUsage::default(),
            last_report: None,
            ended: false,
        }
    }

    /// Takes bytes of the messages stream (cut anywhere) and returns the chat chunks they
    /// complete, as server-sent event text.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.splitter.push(chunk);
        let mut out = String::new();
        while let Some(event) = self.splitter.next_event() {
            let text = event_text(&event);
            let parsed = Event::parse(&text);
            let data = parsed.data.trim();
            if !self.ended && !data.is_empty() {
                self.event(data, &mut out);
            }
        }
        out
    }

    /// Bytes received that do not make a complete event yet.
    pub fn pending(&self) -> usize {
        self.splitter.pending()
    }

    fn event(&mut self, data: &str, out: &mut String) {
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            return;
        };
        match event["type"].as_str() {
            Some("message_start") => {
                self.report(&event["message"]["usage"]);
                self.chunk(out, json!({ "role": "assistant", "content": "" }), None);
            }
            Some("content_block_start") => {
                let block = &event["content_block"];
                if block["type"] == "tool_use" {
                    let number = self.next_call;
                    self.next_call += 1;
                    self.calls
                        .push((event["index"].as_u64().unwrap_or(0), number));
                    let call = json!({
                        "index": number, "id": block["id"], "type": "function",
                        "function": { "name": block["name"], "arguments": "" },
                    });
                    self.chunk(out, json!({ "tool_calls": [call] }), None);
                }
            }
            Some("content_block_delta") => {
                let delta = &event["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => {
                        self.chunk(out, json!({ "content": delta["text"] }), None);
                    }
                    Some("thinking_delta") => {
                        let thinking = json!({ "reasoning_content": delta["thinking"] });
                        self.chunk(out, thinking, None);
                    }
                    Some("input_json_delta") => {
                        let index = event["index"].as_u64().unwrap_or(0);
                        if let Some(&(_, number)) =
                            self.calls.iter().find(|(block, _)| *block == index)
                        {
                            let call = json!({
                                "index": number,
                                "function": { "arguments": delta["partial_json"] },
                            });
                            self.chunk(out, json!({ "tool_calls": [call] }), None);
                        }
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let Some(stop) = event["delta"]["stop_reason"].as_str() {
                    self.stop_reason = Some(stop.to_owned());
                }
                self.report(&event["usage"]);
            }
            Some("message_stop") => {
                let finish = finish_reason(self.stop_reason.as_deref());
                self.chunk(out, json!({}), Some(finish));
                let usage = chat_usage(self.usage, || {
                    self.last_report.clone().unwrap_or(Value::Null)
                });
                let chunk = json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [], "usage": usage,
                });
                write(out, &chunk);
                out.push_str("data: [DONE]\n\n");
                self.ended = true;
            }
            Some("ping") => out.push_str(": ping\n\n"),
            Some("error") => {
                let error = &event["error"];
                let chunk = json!({
                    "error": {
                        "message": error["message"].as_str().unwrap_or("the provider failed"),
                        "type": error["type"],
                    },
                });
                write(out, &chunk);
                self.ended = true;
            }
            _ => {}
        }
    }

    /// Reads a usage report over what was read before, as a messages stream is billed.
    fn report(&mut self, usage: &Value) {
        if !usage.is_object() {
            return;
        }
        let read: TokenUsage = serde_json::from_value(usage.clone()).unwrap_or(TokenUsage {
            malformed: true,
            ..TokenUsage::default()
        });
        if read.malformed {
            self.last_report = Some(usage.clone());
        }
        self.usage = self.usage.merged(read);
    }

    fn chunk(&self, out: &mut String, delta: Value, finish: Option<&str>) {
        let chunk = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }],
        });
        write(out, &chunk);
    }
}

fn write(out: &mut String, data: &Value) {
    out.push_str("data: ");
    out.push_str(&data.to_string());
    out.push_str("\n\n");
}
