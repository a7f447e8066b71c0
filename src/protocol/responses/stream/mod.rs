//! A chat-completions event stream as the Responses API's event sequence.

use std::borrow::Cow;

use serde_json::Value;

use super::reply::{
    Echoed, Head, OutputItem, Part, Status, Usage, call_item_prefix, call_of_value, reasoning_of,
};
use super::write::{ObjectWriter, Str};
use super::{Ids, Namespaced, Translated};
use crate::protocol::sse::{Event, EventSplitter, event_text};

/// Translates a chat-completions stream, as its bytes arrive, into the Responses event
/// sequence: `response.created`, `response.in_progress`, then for each output item
/// `response.output_item.added`, its deltas (`response.content_part.added` and
/// `response.output_text.delta`, `response.function_call_arguments.delta`, or
/// `response.custom_tool_call_input.delta`) and their
/// `.done` events, `response.output_item.done`; at the chat stream's `[DONE]`,
/// `response.completed` (or `response.incomplete` when the reply was cut short) with the
/// usage. Each event has its `sequence_number`, from 0.
///
/// A chat stream that stops without `[DONE]` gets no final event: the stream is then
/// unfinished, and billed as one. A chat error chunk becomes an `error` event.
#[derive(Debug)]
pub struct StreamTranslator {
    splitter: EventSplitter,
    /// What each `response` object repeats of the request.
    echoed: Echoed,
    ids: Ids,
    head: Option<Head<'static>>,
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
    /// The namespaced tools the request offered under flat names.
    namespaced: Vec<Namespaced>,
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
    /// A function call, or a custom tool's (`custom`), whose input is kept in `arguments`.
    Call {
        id: String,
        custom: bool,
        call_id: String,
        name: String,
        arguments: String,
        open: bool,
        /// A namespaced tool's namespace.
        namespace: Option<String>,
    },
}

impl StreamTranslator {
    /// A translator for the chat stream that answers the `translated` request.
    pub fn new(translated: &Translated, ids: Ids) -> StreamTranslator {
        let mut translator = StreamTranslator::repeating(translated.echoed().clone(), ids);
        translator.namespaced = translated.namespaced().to_vec();
        translator
    }

    /// A translator whose `response` objects repeat `echoed`.
    pub(crate) fn repeating(echoed: Echoed, ids: Ids) -> StreamTranslator {
        StreamTranslator {
            splitter: EventSplitter::new(),
            echoed,
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
            namespaced: Vec::new(),
        }
    }

    /// Takes bytes of the chat stream (cut anywhere) and returns the Responses events they
    /// complete, as server-sent event text.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.splitter.push(chunk);
        let mut out = Vec::new();
        while let Some(event) = self.splitter.next_event() {
            let text = event_text(&event);
            let event = Event::parse(&text);
            self.chat_event(event.data.trim(), &mut out);
        }
        String::from_utf8(out).expect("events are written from strings")
    }

    /// Bytes received that do not make a complete chat event yet.
    pub fn pending(&self) -> usize {
        self.splitter.pending()
    }

    /// Whether the chat stream's end (`[DONE]`) has been translated.
    pub fn ended(&self) -> bool {
        self.ended
    }

    fn chat_event(&mut self, data: &str, out: &mut Out) {
        if self.ended || data.is_empty() {
            return;
        }
        if data == "[DONE]" {
            self.start(None, out);
            self.close_all(out);
            self.finish(out);
            return;
        }
        self.value_chunk(data, out);
    }

    /// A chunk, read as a `Value`.
    fn value_chunk(&mut self, data: &str, out: &mut Out) {
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(error) = chunk.get("error").filter(|error| !error.is_null()) {
            let code = error["code"].as_str().or(error["type"].as_str());
            let message = error["message"].as_str().unwrap_or("the provider failed");
            emit(&mut self.sequence, out, "error", |event| {
                event.field("code", &code);
                event.field("message", message);
                event.field("param", &error.get("param"));
            });
            self.ended = true;
            return;
        }
        self.chunk(&ChunkView::of_value(&chunk), out);
    }

    fn chunk(&mut self, chunk: &ChunkView<'_>, out: &mut Out) {
        self.start(Some(chunk), out);
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage);
        }
        let Some(choice) = &chunk.choice else {
            return;
        };
        if let Some(text) = choice.reasoning {
            self.reasoning_text(text, out);
        }
        for (refusal, text) in [(false, choice.content), (true, choice.refusal)] {
            if let Some(text) = text.filter(|text| !text.is_empty()) {
                self.text(refusal, text, out);
            }
        }
        for call in &choice.calls {
            self.call_delta(call, out);
        }
        if let Some(reason) = choice.finish_reason {
            self.finish_reason = Some(reason.to_owned());
            self.close_all(out);
        }
    }

    /// `response.created` and `response.in_progress`, once, from the first chunk's id and model.
    fn start(&mut self, chunk: Option<&ChunkView<'_>>, out: &mut Out) {
        if self.head.is_some() {
            return;
        }
        self.head = Some(Head {
            id: Cow::Owned(self.ids.next("resp")),
            created_at: chunk
                .and_then(|chunk| chunk.created)
                .unwrap_or_else(|| chrono::Utc::now().timestamp()),
            model: Cow::Owned(
                chunk
                    .and_then(|chunk| chunk.model)
                    .unwrap_or_default()
                    .to_owned(),
            ),
        });
        for name in ["response.created", "response.in_progress"] {
            self.emit_response(name, Status::InProgress, false, None, out);
        }
    }

    /// Reasoning comes before the reply; a reasoning item opens (closing an open message, so
    /// that the items stay in order) or grows.
    fn reasoning_text(&mut self, piece: &str, out: &mut Out) {
        let index = match self.reasoning {
            Some(index) => index,
            None => {
                if let Some(message) = self.message.take() {
                    self.close(message, out);
                }
                let id = self.ids.next("rs");
                let index = self.items.len();
                let item = OutputItem::Reasoning {
                    id: &id,
                    text: None,
                };
                item_added(&mut self.sequence, out, index, &item);
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
        emit(
            &mut self.sequence,
            out,
            "response.reasoning_text.delta",
            |event| {
                place(event, id, index, true);
                event.field("delta", piece);
            },
        );
    }

    /// The reasoning, if open, ends where the reply or a call begins.
    fn end_reasoning(&mut self, out: &mut Out) {
        if let Some(reasoning) = self.reasoning.take() {
            self.close(reasoning, out);
        }
    }

    fn text(&mut self, refusal: bool, piece: &str, out: &mut Out) {
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
        let refusal = *refusal;
        let name = if refusal {
            "response.refusal.delta"
        } else {
            "response.output_text.delta"
        };
        emit(&mut self.sequence, out, name, |event| {
            place(event, id, index, true);
            event.field("delta", piece);
            if !refusal {
                event.raw("logprobs", "[]");
            }
        });
    }

    fn open_message(&mut self, refusal: bool, out: &mut Out) -> usize {
        let id = self.ids.next("msg");
        let index = self.items.len();
        let item = OutputItem::Message {
            id: &id,
            status: "in_progress",
            content: None,
        };
        item_added(&mut self.sequence, out, index, &item);
        emit(
            &mut self.sequence,
            out,
            "response.content_part.added",
            |event| {
                place(event, &id, index, true);
                event.write(
                    "part",
                    &Part {
                        refusal,
                        text: Str::Read(""),
                    },
                );
            },
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

    fn call_delta(&mut self, call: &CallView<'_>, out: &mut Out) {
        let chat_index = call.index;
        let index = match self.calls.iter().find(|(at, _)| *at == chat_index) {
            Some(&(_, index)) => index,
            None => {
                // Reasoning and a message's text come before the calls; close them so the items
                // stay in order.
                self.end_reasoning(out);
                if let Some(message) = self.message.take() {
                    self.close(message, out);
                }
                let prefix = call_item_prefix(call.custom);
                let id = self.ids.next(prefix);
                let call_id = call.id.map_or_else(
                    || format!("call_{}", &id[prefix.len() + 1..]),
                    str::to_owned,
                );
                // A namespaced tool's call, under its name in its namespace.
                let flat = call.name.unwrap_or_default();
                let (namespace, name) = match self.namespaced.iter().find(|tool| tool.flat == flat)
                {
                    Some(tool) => (Some(tool.namespace.clone()), tool.name.clone()),
                    None => (None, flat.to_owned()),
                };
                let index = self.items.len();
                let item = OutputItem::FunctionCall {
                    id: &id,
                    status: "in_progress",
                    custom: call.custom,
                    call_id: Str::Read(&call_id),
                    name: Str::Read(&name),
                    arguments: Str::Read(""),
                    namespace: namespace.as_deref(),
                };
                item_added(&mut self.sequence, out, index, &item);
                self.items.push(Item::Call {
                    id,
                    custom: call.custom,
                    call_id,
                    name,
                    arguments: String::new(),
                    open: true,
                    namespace,
                });
                self.calls.push((chat_index, index));
                index
            }
        };
        let Some(piece) = call.arguments.filter(|piece| !piece.is_empty()) else {
            return;
        };
        let Item::Call {
            id,
            custom,
            arguments,
            ..
        } = &mut self.items[index]
        else {
            unreachable!("`calls` index tool call items");
        };
        arguments.push_str(piece);
        let name = if *custom {
            "response.custom_tool_call_input.delta"
        } else {
            "response.function_call_arguments.delta"
        };
        emit(&mut self.sequence, out, name, |event| {
            place(event, id, index, false);
            event.field("delta", piece);
        });
    }

    fn close_all(&mut self, out: &mut Out) {
        for index in 0..self.items.len() {
            self.close(index, out);
        }
        self.reasoning = None;
        self.message = None;
        self.calls.clear();
    }

    /// The `.done` events of an open item.
    fn close(&mut self, index: usize, out: &mut Out) {
        let sequence = &mut self.sequence;
        let item = &mut self.items[index];
        let open = match item {
            Item::Reasoning { open, .. } | Item::Message { open, .. } | Item::Call { open, .. } => {
                open
            }
        };
        if !std::mem::replace(open, false) {
            return;
        }
        match &*item {
            Item::Reasoning { id, text, .. } => {
                emit(sequence, out, "response.reasoning_text.done", |event| {
                    place(event, id, index, true);
                    event.field("text", text);
                });
            }
            Item::Message {
                id, refusal, text, ..
            } => {
                let (name, field) = if *refusal {
                    ("response.refusal.done", "refusal")
                } else {
                    ("response.output_text.done", "text")
                };
                emit(sequence, out, name, |event| {
                    place(event, id, index, true);
                    event.field(field, text);
                    if !refusal {
                        event.raw("logprobs", "[]");
                    }
                });
                emit(sequence, out, "response.content_part.done", |event| {
                    place(event, id, index, true);
                    event.write(
                        "part",
                        &Part {
                            refusal: *refusal,
                            text: Str::Read(text),
                        },
                    );
                });
            }
            Item::Call {
                id,
                custom: true,
                arguments,
                ..
            } => {
                emit(
                    sequence,
                    out,
                    "response.custom_tool_call_input.done",
                    |event| {
                        place(event, id, index, false);
                        event.field("input", arguments);
                    },
                );
            }
            Item::Call {
                id,
                custom: false,
                name,
                arguments,
                ..
            } => {
                emit(
                    sequence,
                    out,
                    "response.function_call_arguments.done",
                    |event| {
                        place(event, id, index, false);
                        event.field("name", name);
                        event.field("arguments", arguments);
                    },
                );
            }
        }
        emit(sequence, out, "response.output_item.done", |event| {
            event.field("output_index", &index);
            event.write("item", &item.completed());
        });
    }

    fn finish(&mut self, out: &mut Out) {
        let status = Status::finished(self.finish_reason.as_deref());
        let usage = self.usage.take();
        self.emit_response(status.end_event(), status, true, usage, out);
        self.ended = true;
    }

    /// Writes an event that carries the `response` as it stands: with its items as they
    /// ended when `with_items`, and none before.
    fn emit_response(
        &mut self,
        name: &'static str,
        status: Status<'_>,
        with_items: bool,
        usage: Option<Usage>,
        out: &mut Out,
    ) {
        let head = self.head.as_ref().expect("the response started");
        let output: Vec<OutputItem<'_>> = if with_items {
            self.items.iter().map(Item::completed).collect()
        } else {
            Vec::new()
        };
        let echoed = &self.echoed;
        emit(&mut self.sequence, out, name, |event| {
            event.write_with("response", |json| {
                echoed.write(head, status, &output, &usage, json);
            });
        });
    }
}

/// What the translation reads of a chat chunk, however it was read.
struct ChunkView<'a> {
    created: Option<i64>,
    model: Option<&'a str>,
    /// The chunk's usage, when it is an object.
    usage: Option<Usage>,
    /// The first choice.
    choice: Option<ChoiceView<'a>>,
}

struct ChoiceView<'a> {
    /// The delta's reasoning, when it is not empty.
    reasoning: Option<&'a str>,
    content: Option<&'a str>,
    refusal: Option<&'a str>,
    calls: Vec<CallView<'a>>,
    finish_reason: Option<&'a str>,
}

/// A tool call's delta.
struct CallView<'a> {
    /// The chat tool call's `index` (0 when it gives none).
    index: u64,
    id: Option<&'a str>,
    /// A custom tool's call, whose `custom.input` comes in pieces where a function's
    /// `function.arguments` would.
    custom: bool,
    name: Option<&'a str>,
    /// A function's arguments, or a custom tool's input.
    arguments: Option<&'a str>,
}

impl<'a> ChunkView<'a> {
    fn of_value(chunk: &'a Value) -> ChunkView<'a> {
        let choice = chunk["choices"]
            .as_array()
            .and_then(|choices| choices.first())
            .map(|choice| {
                let delta = &choice["delta"];
                ChoiceView {
                    reasoning: reasoning_of(delta),
                    content: delta["content"].as_str(),
                    refusal: delta["refusal"].as_str(),
                    calls: (delta["tool_calls"].as_array().into_iter().flatten())
                        .map(|call| {
                            let (custom, name, arguments) = call_of_value(call);
                            CallView {
                                index: call["index"].as_u64().unwrap_or(0),
                                id: call["id"].as_str(),
                                custom,
                                name,
                                arguments,
                            }
                        })
                        .collect(),
                    finish_reason: choice["finish_reason"].as_str(),
                }
            });
        ChunkView {
            created: chunk.get("created").and_then(Value::as_i64),
            model: chunk.get("model").and_then(Value::as_str),
            usage: super::reply::usage(chunk.get("usage")),
            choice,
        }
    }
}

/// Where an event belongs: its item, the item's place in the output, and for an event about
/// the item's content, the content part's place (an item here has one part).
fn place(event: &mut ObjectWriter<'_>, id: &str, index: usize, content: bool) {
    event.field("item_id", id);
    event.field("output_index", &index);
    if content {
        event.raw("content_index", "0");
    }
}

/// `response.output_item.added`: `item`, opened at `index` of the output.
fn item_added(sequence: &mut u64, out: &mut Out, index: usize, item: &OutputItem<'_>) {
    emit(sequence, out, "response.output_item.added", |event| {
        event.field("output_index", &index);
        event.write("item", item);
    });
}

/// The Responses events being written, as server-sent event text.
type Out = Vec<u8>;

/// Writes one event: its name as `event:`, and as `data:` an object with the name in `type`,
/// the next sequence number, then what `fields` writes.
fn emit(
    sequence: &mut u64,
    out: &mut Out,
    name: &'static str,
    fields: impl FnOnce(&mut ObjectWriter<'_>),
) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    // Written compact, so the data is one line: strings' line breaks are escaped.
    let mut event = ObjectWriter::open(out);
    event.field("type", name);
    event.field("sequence_number", sequence);
    fields(&mut event);
    event.close();
    out.extend_from_slice(b"\n\n");
    *sequence += 1;
}

impl Item {
    /// The item as it ended.
    fn completed(&self) -> OutputItem<'_> {
        match self {
            Item::Reasoning { id, text, .. } => OutputItem::Reasoning {
                id,
                text: (!text.is_empty()).then_some(Str::Read(text)),
            },
            Item::Message {
                id, refusal, text, ..
            } => OutputItem::Message {
                id,
                status: "completed",
                content: Some(Part {
                    refusal: *refusal,
                    text: Str::Read(text),
                }),
            },
            Item::Call {
                id,
                custom,
                call_id,
                name,
                arguments,
                namespace,
                ..
            } => OutputItem::FunctionCall {
                id,
                status: "completed",
                custom: *custom,
                call_id: Str::Read(call_id),
                name: Str::Read(name),
                arguments: Str::Read(arguments),
                namespace: namespace.as_deref(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::protocol::responses::write::keys_of_every_object;

    fn chunk(body: &Value) -> String {
        format!("data: {body}\n\n")
    }

    /// Every chunk, ordinary or with a field of an odd type (or an error, or not an object), is
    /// translated into well-formed events: each names itself in its `type`, counts on from
    /// the one before, and the stream ends once, in a terminal event. Each chunk is tried first
    /// in its stream and after an ordinary one, before a last chunk and `[DONE]`.
    #[test]
    fn ordinary_and_odd_chunks_translate_into_well_formed_events() {
        let ordinary = r#"{"id":"c","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}"#;
        let ordinary_kinds = [
            ordinary,
            r#"{"choices":[{"delta":{"content":"say \"x\"\n\u00e9 \ud83d\ude00"}}]}"#,
            r#"{"choices":[{"delta":{"content":""}}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":"a","reasoning":"b"}}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":"","reasoning":"b"}}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":null,"reasoning":""}}]}"#,
            r#"{"choices":[{"delta":{"refusal":"No."}}]}"#,
            r#"{"choices":[{"delta":{"content":"a","refusal":"b"},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":1,"id":"call_1","function":{"name":"f","arguments":"{\"a\""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":":1}"}},{"id":null,"function":null}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f"}},{"function":{"arguments":"{}"}},{"index":2,"function":{"arguments":"[]"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[]}},{"delta":{"content":"second choice"}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","type":"custom","custom":{"name":"p","input":"*** 世"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"custom":{"input":"more"}},{"index":1,"type":"custom"},{"index":2,"custom":{"name":"q"},"function":{"name":"f"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"type":"function","custom":{"name":"p"}},{"index":1,"custom":null,"function":null}]}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8,"prompt_tokens_details":null,"completion_tokens_details":{"reasoning_tokens":2}}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":null}}"#,
            r#"{"choices":null,"usage":null,"error":null,"delta":{"content":"not in a choice"}}"#,
            r#"{"choices":[{"delta":null,"finish_reason":"length"}]}"#,
            r#"{"choices":[{"delta":{"content":"x"},"finish_reason":"content_filter"}],"created":9,"model":"other"}"#,
        ];
        // and chunks with a field of an odd type, an error, or no object at all.
        let odd = [
            r#"{"created":"7","choices":[{"delta":{"content":"x"}}]}"#,
            r#"{"created":7.5,"model":5,"choices":[{"delta":{"content":"x"}}]}"#,
            r#"{"choices":{"delta":{"content":"x"}}}"#,
            r#"{"choices":[5,{"delta":{"content":"x"}}]}"#,
            r#"{"choices":[{"delta":{"content":5,"refusal":"r"}}]}"#,
            r#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":1.0,"function":{"name":"g"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":-1,"function":{"name":"g"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":{"index":0}}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"custom":"input"}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"type":7,"custom":{"input":"x"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"type":"custom","custom":{"input":["x"]}}]}}]}"#,
            r#"{"choices":[{"finish_reason":1,"delta":{"content":"x"}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":"3","completion_tokens":5}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":1.5}}}"#,
            r#"{"choices":[],"usage":7}"#,
            r#"{"error":{"code":"overloaded","message":"Try later.","param":null}}"#,
            r#"{"error":"boom","choices":[{"delta":{"content":"x"}}]}"#,
            r#"[{"choices":[{"delta":{"content":"x"}}]}]"#,
            "5",
            "not json",
        ];
        let request = Translated::from_slice(br#"{"model":"m","input":"Hi"}"#).unwrap();
        let last = r#"{"choices":[{"delta":{"content":" there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#;
        let terminal = [
            "response.completed",
            "response.incomplete",
            "response.failed",
            "error",
        ];
        for case in ordinary_kinds.iter().chain(&odd) {
            for chunks in [[case, last].as_slice(), &[ordinary, case, last]] {
                let stream: String = chunks
                    .iter()
                    .map(|data| format!("data: {data}\n\n"))
                    .chain(["data: [DONE]\n\n".to_owned()])
                    .collect();
                let mut translator = StreamTranslator::new(&request, Ids::counting());
                let out = translator.push(stream.as_bytes());
                assert!(translator.ended(), "{stream}");
                let events: Vec<(&str, Value)> = out
                    .split_terminator("\n\n")
                    .map(|event| {
                        let (name, data) = event
                            .strip_prefix("event: ")
                            .and_then(|event| event.split_once("\ndata: "))
                            .unwrap_or_else(|| panic!("{event:?} in {out}"));
                        (name, serde_json::from_str(data).unwrap())
                    })
                    .collect();
                for (at, (name, data)) in events.iter().enumerate() {
                    assert_eq!(data["type"], *name, "{out}");
                    assert_eq!(data["sequence_number"], at, "{out}");
                }
                let ends = events.iter().filter(|(name, _)| terminal.contains(name));
                assert_eq!(ends.count(), 1, "{out}");
                assert!(terminal.contains(&events.last().unwrap().0), "{out}");
            }
        }
    }

    /// The events' data are written field by field, so nothing but this test would see a key
    /// written twice: every object of every event of a stream with every kind of item (and of
    /// one that ends in an error) holds each key once, and each event gives its name in `type`
    /// and its place in `sequence_number`.
    #[test]
    fn every_event_written_holds_each_key_once_in_every_object() {
        let delta = |delta: Value, finish: Value| {
            chunk(&json!({ "id": "c", "created": 1, "model": "m",
                "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] }))
        };
        let call = |index: u64, id: Value, name: Value, arguments: &str| {
            json!({ "tool_calls": [{ "index": index, "id": id,
                "function": { "name": name, "arguments": arguments } }] })
        };
        let every_kind = [
            delta(
                json!({ "role": "assistant", "reasoning_content": "Hm, " }),
                Value::Null,
            ),
            delta(json!({ "reasoning_content": "yes." }), Value::Null),
            delta(json!({ "content": "Calling \"f\"\n" }), Value::Null),
            delta(call(0, json!("call_a"), json!("f"), "{\"x\""), Value::Null),
            delta(call(1, json!("call_b"), json!("g"), ""), Value::Null),
            delta(call(0, Value::Null, Value::Null, ":1}"), Value::Null),
            delta(
                json!({ "tool_calls": [{ "index": 2, "id": "call_c", "type": "custom",
                    "custom": { "name": "p", "input": "*** Begin" } }] }),
                Value::Null,
            ),
            delta(
                json!({ "tool_calls": [{ "index": 2, "custom": { "input": " Patch" } }] }),
                Value::Null,
            ),
            delta(json!({}), json!("tool_calls")),
            chunk(&json!({ "choices": [], "usage": { "prompt_tokens": 3,
                "completion_tokens": 5, "total_tokens": 8,
                "completion_tokens_details": { "reasoning_tokens": 2 } } })),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let refusal = [
            delta(json!({ "refusal": "No." }), Value::Null),
            delta(json!({}), json!("stop")),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let failed = [
            delta(json!({ "content": "Hi" }), Value::Null),
            chunk(
                &json!({ "error": { "code": "overloaded", "message": "Try later.",
                "param": null } }),
            ),
        ]
        .concat();
        let request = br#"{"model":"m","input":"Hi","temperature":0.5}"#;
        let request = Translated::from_slice(request).unwrap();
        for (stream, count) in [(every_kind, 27), (refusal, 9), (failed, 6)] {
            let mut translator = StreamTranslator::new(&request, Ids::counting());
            let text = translator.push(stream.as_bytes());
            let events: Vec<&str> = text.split_terminator("\n\n").collect();
            assert_eq!(events.len(), count, "{text}");
            for (sequence, event) in events.iter().enumerate() {
                let (name, data) = event.split_once("\ndata: ").expect("an event");
                let name = name.strip_prefix("event: ").expect("a name");
                for keys in keys_of_every_object(data.as_bytes()) {
                    let mut unique = keys.clone();
                    unique.sort();
                    unique.dedup();
                    assert_eq!(unique.len(), keys.len(), "{name}: {keys:?}");
                }
                let data: Value = serde_json::from_str(data).expect("JSON");
                assert_eq!(data["type"], name);
                assert_eq!(data["sequence_number"], sequence);
            }
        }
    }
}
