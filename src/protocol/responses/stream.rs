//! A chat-completions event stream as the Responses API's event sequence.

use serde_json::{Value, json};

use super::Ids;
use super::reply::{
    Echo, Head, Status, Usage, content_part, echoed_settings, function_call_item, message_item,
    reasoning_item, reasoning_of,
};
use super::write::ObjectWriter;
use crate::protocol::sse::{Event, EventSplitter};

/// Translates a chat-completions stream, as its bytes arrive, into the Responses event
/// sequence: `response.created`, `response.in_progress`, then for each output item
/// `response.output_item.added`, its deltas (`response.content_part.added` and
/// `response.output_text.delta`, or `response.function_call_arguments.delta`) and their
/// `.done` events, `response.output_item.done`; at the chat stream's `[DONE]`,
/// `response.completed` (or `response.incomplete` when the reply was cut short) with the
/// usage. Each event has its `sequence_number`, from 0.
///
/// A chat stream that stops without `[DONE]` gets no final event: the stream is then
/// unfinished, and billed as one. A chat error chunk becomes an `error` event.
#[derive(Debug)]
pub struct StreamTranslator {
    splitter: EventSplitter,
    /// The request's settings that each `response` object repeats.
    settings: Value,
    ids: Ids,
    head: Option<Head>,
    sequence: u64,
    items: Vec<Item>,
    /// The open reasoning item (an index into `items`).
    reasoning: Option<usize>,
    /// The open message item (an index into `items`).
    message: Option<usize>,
    /// Chat tool-call index → index into `items`, for the calls still open.
    calls: Vec<(u64, usize)>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    ended: bool,
}

#[derive(Debug)]
enum Item {
    Reasoning {
        id: String,
        text: String,
        open: bool,
    },
    Message {
        id: String,
        refusal: bool,
        text: String,
        open: bool,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        open: bool,
    },
}

impl StreamTranslator {
    /// A translator for the chat stream that answers the translation of `request`.
    pub fn new(request: &Value, ids: Ids) -> StreamTranslator {
        StreamTranslator {
            splitter: EventSplitter::new(),
            settings: echoed_settings(request),
            ids,
            head: None,
            sequence: 0,
            items: Vec::new(),
            reasoning: None,
            message: None,
            calls: Vec::new(),
            finish_reason: None,
            usage: None,
            ended: false,
        }
    }

    /// Takes bytes of the chat stream (cut anywhere) and returns the Responses events they
    /// complete, as server-sent event text.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.splitter.push(chunk);
        let mut out = String::new();
        while let Some(event) = self.splitter.next_event() {
            let text = String::from_utf8_lossy(&event);
            let event = Event::parse(&text);
            self.chat_event(event.data.trim(), &mut out);
        }
        out
    }

    /// Bytes received that do not make a complete chat event yet.
    pub fn pending(&self) -> usize {
        self.splitter.pending()
    }

    /// Whether the chat stream's end (`[DONE]`) has been translated.
    pub fn ended(&self) -> bool {
        self.ended
    }

    fn chat_event(&mut self, data: &str, out: &mut String) {
        if self.ended || data.is_empty() {
            return;
        }
        if data == "[DONE]" {
            self.start(None, out);
            self.close_all(out);
            self.finish(out);
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(error) = chunk.get("error").filter(|error| !error.is_null()) {
            let code = error["code"].as_str().or(error["type"].as_str());
            let message = error["message"].as_str().unwrap_or("the provider failed");
            self.emit(
                "error",
                json!({ "code": code, "message": message, "param": error.get("param") }),
                out,
            );
            self.ended = true;
            return;
        }
        self.start(Some(&chunk), out);
        if let Some(usage) = chunk.get("usage").filter(|usage| usage.is_object()) {
            self.usage = super::reply::usage(Some(usage));
        }
        let Some(choice) = chunk["choices"]
            .as_array()
            .and_then(|choices| choices.first())
        else {
            return;
        };
        let delta = &choice["delta"];
        if let Some(text) = reasoning_of(delta) {
            self.reasoning_text(text, out);
        }
        for (refusal, field) in [(false, "content"), (true, "refusal")] {
            if let Some(text) = delta[field].as_str().filter(|text| !text.is_empty()) {
                self.text(refusal, text, out);
            }
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            self.call_delta(call, out);
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish_reason = Some(reason.to_owned());
            self.close_all(out);
        }
    }

    /// `response.created` and `response.in_progress`, once, from the first chunk's id and model.
    fn start(&mut self, chunk: Option<&Value>, out: &mut String) {
        if self.head.is_some() {
            return;
        }
        let field = |name: &str| chunk.and_then(|chunk| chunk.get(name));
        self.head = Some(Head {
            id: self.ids.next("resp"),
            created_at: field("created")
                .and_then(Value::as_i64)
                .unwrap_or_else(|| chrono::Utc::now().timestamp()),
            model: field("model")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
        });
        for name in ["response.created", "response.in_progress"] {
            self.emit_response(name, Status::InProgress, &[], &None, out);
        }
    }

    /// Reasoning comes before the reply; a reasoning item opens (closing an open message, so
    /// that the items stay in order) or grows.
    fn reasoning_text(&mut self, piece: &str, out: &mut String) {
        let index = match self.reasoning {
            Some(index) => index,
            None => {
                if let Some(message) = self.message.take() {
                    self.close(message, out);
                }
                let id = self.ids.next("rs");
                let index = self.items.len();
                let item = reasoning_item(&id, "");
                self.emit(
                    "response.output_item.added",
                    json!({ "output_index": index, "item": item }),
                    out,
                );
                self.items.push(Item::Reasoning {
                    id,
                    text: String::new(),
                    open: true,
                });
                self.reasoning = Some(index);
                index
            }
        };
        let Item::Reasoning { id, text, .. } = &mut self.items[index] else {
            unreachable!("`reasoning` indexes a reasoning item");
        };
        text.push_str(piece);
        let delta =
            json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": piece });
        self.emit("response.reasoning_text.delta", delta, out);
    }

    /// The reasoning, if open, ends where the reply or a call begins.
    fn end_reasoning(&mut self, out: &mut String) {
        if let Some(reasoning) = self.reasoning.take() {
            self.close(reasoning, out);
        }
    }

    fn text(&mut self, refusal: bool, piece: &str, out: &mut String) {
        self.end_reasoning(out);
        let index = match self.message {
            Some(index) => index,
            None => self.open_message(refusal, out),
        };
        let Item::Message {
            id, text, refusal, ..
        } = &mut self.items[index]
        else {
            unreachable!("`message` indexes a message item");
        };
        text.push_str(piece);
        let (name, delta) = if *refusal {
            (
                "response.refusal.delta",
                json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": piece }),
            )
        } else {
            (
                "response.output_text.delta",
                json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": piece, "logprobs": [] }),
            )
        };
        self.emit(name, delta, out);
    }

    fn open_message(&mut self, refusal: bool, out: &mut String) -> usize {
        let id = self.ids.next("msg");
        let index = self.items.len();
        self.emit(
            "response.output_item.added",
            json!({ "output_index": index, "item": message_item(&id, "in_progress", Value::Null) }),
            out,
        );
        self.emit(
            "response.content_part.added",
            json!({ "item_id": id, "output_index": index, "content_index": 0, "part": content_part(refusal, "") }),
            out,
        );
        self.items.push(Item::Message {
            id,
            refusal,
            text: String::new(),
            open: true,
        });
        self.message = Some(index);
        index
    }

    fn call_delta(&mut self, call: &Value, out: &mut String) {
        let chat_index = call["index"].as_u64().unwrap_or(0);
        let function = &call["function"];
        let index = match self.calls.iter().find(|(at, _)| *at == chat_index) {
            Some(&(_, index)) => index,
            None => {
                // Reasoning and a message's text come before the calls; close them so the items
                // stay in order.
                self.end_reasoning(out);
                if let Some(message) = self.message.take() {
                    self.close(message, out);
                }
                let id = self.ids.next("fc");
                let call_id = call["id"]
                    .as_str()
                    .map_or_else(|| format!("call_{}", &id[3..]), str::to_owned);
                let name = function["name"].as_str().unwrap_or_default().to_owned();
                let index = self.items.len();
                self.emit(
                    "response.output_item.added",
                    json!({ "output_index": index, "item": function_call_item(&id, "in_progress", &call_id, &name, "") }),
                    out,
                );
                self.items.push(Item::Call {
                    id,
                    call_id,
                    name,
                    arguments: String::new(),
                    open: true,
                });
                self.calls.push((chat_index, index));
                index
            }
        };
        let Some(piece) = function["arguments"]
            .as_str()
            .filter(|piece| !piece.is_empty())
        else {
            return;
        };
        let Item::Call { id, arguments, .. } = &mut self.items[index] else {
            unreachable!("`calls` index function call items");
        };
        arguments.push_str(piece);
        let delta = json!({ "item_id": id, "output_index": index, "delta": piece });
        self.emit("response.function_call_arguments.delta", delta, out);
    }

    fn close_all(&mut self, out: &mut String) {
        for index in 0..self.items.len() {
            self.close(index, out);
        }
        self.reasoning = None;
        self.message = None;
        self.calls.clear();
    }

    /// The `.done` events of an open item.
    fn close(&mut self, index: usize, out: &mut String) {
        let events: Vec<(&str, Value)> = match &mut self.items[index] {
            Item::Reasoning { open: false, .. }
            | Item::Message { open: false, .. }
            | Item::Call { open: false, .. } => return,
            Item::Reasoning { id, text, open } => {
                *open = false;
                vec![
                    (
                        "response.reasoning_text.done",
                        json!({ "item_id": id, "output_index": index, "content_index": 0, "text": text }),
                    ),
                    (
                        "response.output_item.done",
                        json!({ "output_index": index, "item": reasoning_item(id, text) }),
                    ),
                ]
            }
            Item::Message {
                id,
                refusal,
                text,
                open,
            } => {
                *open = false;
                let part = content_part(*refusal, text);
                let done = if *refusal {
                    (
                        "response.refusal.done",
                        json!({ "item_id": id, "output_index": index, "content_index": 0, "refusal": text }),
                    )
                } else {
                    (
                        "response.output_text.done",
                        json!({ "item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": [] }),
                    )
                };
                vec![
                    done,
                    (
                        "response.content_part.done",
                        json!({ "item_id": id, "output_index": index, "content_index": 0, "part": part }),
                    ),
                    (
                        "response.output_item.done",
                        json!({ "output_index": index, "item": message_item(id, "completed", part) }),
                    ),
                ]
            }
            Item::Call {
                id,
                call_id,
                name,
                arguments,
                open,
            } => {
                *open = false;
                vec![
                    (
                        "response.function_call_arguments.done",
                        json!({ "item_id": id, "output_index": index, "name": name, "arguments": arguments }),
                    ),
                    (
                        "response.output_item.done",
                        json!({ "output_index": index, "item": function_call_item(id, "completed", call_id, name, arguments) }),
                    ),
                ]
            }
        };
        for (name, data) in events {
            self.emit(name, data, out);
        }
    }

    fn finish(&mut self, out: &mut String) {
        let status = Status::finished(self.finish_reason.as_deref());
        let output: Vec<Value> = self.items.iter().map(Item::completed).collect();
        let usage = self.usage.take();
        self.emit_response(status.end_event(), status, &output, &usage, out);
        self.ended = true;
    }

    /// Writes an event that carries the `response` as it stands (written straight into the
    /// event, as a complete reply's response is).
    fn emit_response(
        &mut self,
        name: &'static str,
        status: Status<'_>,
        output: &[Value],
        usage: &Option<Usage>,
        out: &mut String,
    ) {
        let head = self.head.as_ref().expect("the response started");
        let mut data = Vec::with_capacity(1024);
        let mut event = ObjectWriter::open(&mut data);
        event.field("type", name);
        event.field("sequence_number", &self.sequence);
        event.write_with("response", |json| {
            Echo::of(&self.settings).write(head, status, output, usage, json);
        });
        event.close();
        let data = String::from_utf8(data).expect("JSON is UTF-8");
        self.write_event(name, &data, out);
    }

    /// Writes one event: its name as `event:` and in `type`, and the next sequence number.
    fn emit(&mut self, name: &str, data: Value, out: &mut String) {
        let mut data = data;
        let object = data.as_object_mut().expect("events are objects");
        object.insert("type".into(), name.into());
        object.insert("sequence_number".into(), self.sequence.into());
        // `serde_json::to_string`, not `Display`, which writes through the formatting machinery.
        let data = serde_json::to_string(&data).expect("an event serialises");
        self.write_event(name, &data, out);
    }

    /// Writes an event whose `data` holds its name and sequence number, and counts it.
    fn write_event(&mut self, name: &str, data: &str, out: &mut String) {
        self.sequence += 1;
        out.push_str("event: ");
        out.push_str(name);
        out.push_str("\ndata: ");
        out.push_str(data);
        out.push_str("\n\n");
    }
}

impl Item {
    fn completed(&self) -> Value {
        match self {
            Item::Reasoning { id, text, .. } => reasoning_item(id, text),
            Item::Message {
                id, refusal, text, ..
            } => message_item(id, "completed", content_part(*refusal, text)),
            Item::Call {
                id,
                call_id,
                name,
                arguments,
                ..
            } => function_call_item(id, "completed", call_id, name, arguments),
        }
    }
}
