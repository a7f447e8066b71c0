//! The Responses API's dialect: `POST /v1/responses`, served by the chat-completions models,
//! at an `OpenAI`-kind upstream's `{base_url}/responses` (native) or translated to its
//! `{base_url}/chat/completions`.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{ChatReply, Echoed, Ids, Str, StreamTranslator, Translated, Usage, write_response};
use crate::error::GatewayError;
use crate::protocol::chat_completions::chat_events;
use crate::protocol::dialect::{Dialect, Envelope, Fields, MockCall, UpstreamRoute};
use crate::protocol::mock::{MOCK_OUTPUT_TOKENS, MOCK_REPLY_TEXT, counted, tokens, unix_now};
use crate::protocol::sse::{ErrorObject, Event, EventKind, StreamState, take_text};
use crate::protocol::translate::Needs;
use crate::protocol::translation::{ToChat, Translation};
use crate::protocol::{Protocol, ResponsesRoute, TokenUsage, UpstreamKind, json_string};

/// The Responses API's dialect.
pub(crate) struct Responses;

impl Dialect for Responses {
    fn protocol(&self) -> Protocol {
        Protocol::Responses
    }

    fn stored_name(&self) -> &'static str {
        "responses"
    }

    fn path(&self) -> &'static str {
        "/v1/responses"
    }

    fn models(&self) -> Protocol {
        Protocol::ChatCompletions
    }

    /// Read from the reading its translation starts from when the request is an ordinary one
    /// (every field one the translation knows, each of the type it reads), so that a call that
    /// translates is read once; otherwise as every request's fields. `model`, then `input` a
    /// string or a list, then `stream`, then `previous_response_id` a string.
    fn envelope<'a>(&self, body: &'a [u8], streaming: bool) -> Result<Envelope<'a>, GatewayError> {
        let fields = fields(body)?;
        let model = fields.model()?;
        if !input_given(&fields) {
            return Err(GatewayError::InvalidInputField);
        }
        let continues = match fields.previous_response_id {
            None => None,
            Some(raw) if raw.get() == "null" => None,
            Some(raw) => Some(json_string(raw).ok_or(GatewayError::InvalidField {
                field: "previous_response_id".into(),
                reason: "须为字符串",
            })),
        };
        let provider_keeps = fields
            .responses
            .as_ref()
            .map(|read| read.kept_by_provider());
        let mut envelope = fields.into_envelope(model, streaming)?;
        envelope.continues = continues.transpose()?;
        envelope.provider_keeps = provider_keeps;
        Ok(envelope)
    }

    /// Translated to chat completions for both kinds of translating upstream (an Anthropic
    /// one takes that translation on to messages).
    fn translation(
        &self,
        envelope: &Envelope<'_>,
        model_name: &str,
        body: &[u8],
        needs: Needs,
    ) -> Option<Result<Translation, GatewayError>> {
        let builtin = needs.strictest_for_chat()?;
        let translated = match &envelope.fields.responses {
            Some(read) => Translated::from_read(read, model_name, body, builtin),
            None => Translated::from_slice_with(body, builtin),
        };
        let translated = translated.and_then(|translated| {
            Translation::through_chat(ToChat::Responses(translated), model_name, needs)
        });
        Some(translated.map_err(|refused| {
            // Not JSON after all: the envelope's reading skips what it does not read, so a
            // number out of range, say, is found only here.
            if refused.field.is_empty() {
                GatewayError::InvalidJson
            } else {
                refused.into()
            }
        }))
    }

    /// Natively or translated by `OpenAI`-kind upstreams, translated (through chat
    /// completions) by Anthropic-kind and Gemini-kind ones.
    fn served_by(&self, _: UpstreamKind) -> bool {
        true
    }

    fn upstream(&self, kind: UpstreamKind, responses: ResponsesRoute) -> Option<UpstreamRoute> {
        match (kind, responses) {
            (UpstreamKind::Anthropic, _) => Some(UpstreamRoute {
                path: "/v1/messages",
                translated: true,
            }),
            (UpstreamKind::Openai, ResponsesRoute::Native) => Some(UpstreamRoute {
                path: "/responses",
                translated: false,
            }),
            (UpstreamKind::Openai, ResponsesRoute::Translate) => Some(UpstreamRoute {
                path: "/chat/completions",
                translated: true,
            }),
            (UpstreamKind::Gemini, _) => Some(UpstreamRoute {
                path: crate::protocol::gemini::MODELS_PATH,
                translated: true,
            }),
        }
    }

    fn provider_keeps_replies(&self) -> bool {
        true
    }

    fn read_event(&self, event: &Event<'_>, state: &mut StreamState) -> EventKind {
        read_event(event, state)
    }

    fn content_text(&self, event: &serde_json::Value, text: &mut String) {
        take_text(text, &event["delta"]);
        take_text(text, &event["item"]["name"]);
    }

    /// The API's `error` event, numbered `next_sequence`.
    fn error_event(&self, error: &GatewayError, next_sequence: u64) -> Bytes {
        let event = format!(
            "event: error\ndata: {}\n\n",
            serde_json::json!({
                "type": "error",
                "code": error.openai_type(),
                "message": error.detail(),
                "param": null,
                "sequence_number": next_sequence,
            })
        );
        Bytes::from(event)
    }

    /// The chat reply, as a translating upstream answers it (written from what the mock says,
    /// without a chat reply to read back).
    fn mock_reply(&self, call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>) {
        let parsed;
        let echoed = match call.translation {
            Some(translation) if translation.responses().is_some() => {
                translation.responses().expect("checked").echoed()
            }
            _ => {
                parsed = Echoed::of_request(call.body);
                &parsed
            }
        };
        let chat = ChatReply {
            created: Some(unix_now()),
            model: Some(call.model),
            // Written between quotes as it is: it holds nothing JSON escapes (a test checks).
            text: Some(Str::Unescaped(MOCK_REPLY_TEXT)),
            finish_reason: Some("stop"),
            usage: Some(Usage::counted(
                tokens(call.input_tokens),
                tokens(MOCK_OUTPUT_TOKENS),
            )),
            ..ChatReply::default()
        };
        let reply = write_response(echoed, &chat, &mut Ids::random());
        // The Responses usage says it has no reasoning tokens, rather than nothing, and the
        // reply names its tier (`default`).
        let usage = TokenUsage {
            reasoning_tokens: Some(0),
            service_tier: Some(crate::protocol::ServiceTier::Standard),
            ..counted(call.input_tokens)
        };
        (Bytes::from(reply), Some(usage))
    }

    /// The chat stream, translated as a translating upstream does, one chunk per chat event.
    fn mock_events(&self, call: &MockCall<'_>) -> Vec<Bytes> {
        let echoed = Echoed::of_request(call.body);
        let chat = format!(
            r#"{{"model":"{}","stream":true,"stream_options":{{"include_usage":true}}}}"#,
            call.model
        );
        let mut translator = StreamTranslator::repeating(echoed, Ids::random());
        let chat = chat_events(&MockCall {
            body: chat.as_bytes(),
            gateway_asks_usage: false,
            ..*call
        });
        chat.iter()
            .map(|chunk| translator.push(chunk))
            .filter(|translated| !translated.is_empty())
            .map(Bytes::from)
            .collect()
    }
}

/// A Responses request's fields, from the reading its translation starts from when the request
/// is an ordinary one (every field one the translation knows, each of the type it reads), so
/// that a call that translates is read once; otherwise as every request's fields. The fields
/// the router checks are kept as written in both.
fn fields(body: &[u8]) -> Result<Fields<'_>, GatewayError> {
    let Some(read) = super::read_request(body) else {
        return Fields::read(body);
    };
    Ok(Fields {
        model: read.model,
        max_output_tokens: read.max_output_tokens,
        stream: read.stream,
        stream_options: read.stream_options,
        previous_response_id: read.previous_response_id,
        service_tier: read.service_tier,
        responses: Some(Box::new(read)),
        // Not fields of a Responses request, which the reading refuses; `input` is read into
        // items.
        ..Fields::default()
    })
}

/// Whether a Responses call's `input` is a string or a list (read into items by the
/// translation's reading, when the fields came from it).
fn input_given(fields: &Fields<'_>) -> bool {
    match &fields.responses {
        Some(read) => read.has_input(),
        None => fields.has_input(),
    }
}

/// Reads one Responses event: usage in the response that completes, content in a delta or an
/// item that opens with a name, a failure in `error` or `response.failed`.
fn read_event(event: &Event<'_>, state: &mut StreamState) -> EventKind {
    #[derive(Deserialize)]
    struct Data<'a> {
        #[serde(rename = "type")]
        kind: Option<&'a str>,
        sequence_number: Option<u64>,
        delta: Option<&'a RawValue>,
        item: Option<Item<'a>>,
        response: Option<Response>,
        message: Option<String>,
        code: Option<String>,
    }
    #[derive(Deserialize)]
    struct Item<'a> {
        #[serde(rename = "type")]
        kind: Option<&'a str>,
    }
    #[derive(Deserialize)]
    struct Response {
        usage: Option<TokenUsage>,
        error: Option<ErrorObject>,
        service_tier: Option<String>,
    }
    let data: Option<Data<'_>> = serde_json::from_str(&event.data).ok();
    let Some(data) = data else {
        return EventKind::Other;
    };
    let Some(name) = event.name.or(data.kind) else {
        return EventKind::Other;
    };
    // A failure event is not passed on: the gateway's own error event takes its number.
    if let Some(sequence) = data.sequence_number
        && !matches!(name, "error" | "response.failed")
    {
        state.numbered(sequence);
    }
    match name {
        "response.completed" | "response.incomplete" => {
            if let Some(response) = data.response
                && let Some(usage) = response.usage
            {
                state.merge(crate::protocol::served_at(
                    usage,
                    response.service_tier.as_deref(),
                ));
            }
            EventKind::End
        }
        "response.failed" => EventKind::Error(
            data.response
                .and_then(|response| response.error)
                .map_or_else(|| "the response failed".to_owned(), ErrorObject::describe),
        ),
        "error" => EventKind::Error(match (data.code, data.message) {
            (Some(code), Some(message)) => format!("{code}: {message}"),
            (code, message) => message.or(code).unwrap_or_else(|| event.data.to_string()),
        }),
        // A function call opens with its name, as a chat tool call does.
        "response.output_item.added" => match data.item.and_then(|item| item.kind) {
            Some("function_call" | "custom_tool_call") => EventKind::Content,
            _ => EventKind::Other,
        },
        name if name.ends_with(".delta") => match data.delta.map(RawValue::get) {
            None | Some("\"\"" | "null") => EventKind::Other,
            Some(_) => EventKind::Content,
        },
        _ => EventKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Responses call's fields read from its translation's reading are the fields the envelope
    /// reads, each as written (`input` given alike), and a body that reading does not take is
    /// read as before.
    #[test]
    fn the_fields_read_with_the_translation_are_the_plain_fields() {
        let raw = |envelope: &Fields<'_>| {
            [
                envelope.model,
                envelope.messages,
                envelope.max_tokens,
                envelope.max_completion_tokens,
                envelope.max_output_tokens,
                envelope.stream,
                envelope.stream_options,
                envelope.previous_response_id,
            ]
            .map(|raw| raw.map(|raw| raw.get().to_owned()))
        };
        // (body, whether the translation's reading takes it)
        let cases = [
            (r#"{"model":"gpt-4o-mini","input":"Hi"}"#, true),
            (
                r#"{"model":"gpt-4o-mini","input":[{"role":"user","content":"Hi"}],"stream":true,"stream_options":{"include_obfuscation":false},"max_output_tokens":50}"#,
                true,
            ),
            (
                r#" {"model":"gpt-\u006fmini","input":"Hi","stream":null}"#,
                true,
            ),
            (r#"{"model":5,"input":"Hi"}"#, true),
            // An `input` that is not a string or a list of items is not the translation's.
            (r#"{"model":"m","input":5,"stream":"yes"}"#, false),
            (r#"{"model":"m","input":null}"#, true),
            (
                r#"{"model":"m","input":[{"role":"user","content":5}]}"#,
                false,
            ),
            (
                r#"{"model":"m","input":"Hi","previous_response_id":"resp_1"}"#,
                true,
            ),
            (
                r#"{"model":"m","input":"Hi","previous_response_id":null}"#,
                true,
            ),
            (r#"{"input":"Hi","max_output_tokens":-1}"#, true),
            (
                r#"{"model":"m","input":"Hi","tools":[{"type":"web_search"}]}"#,
                true,
            ),
            (r#"{"model":"m","input":"Hi","unknown":1}"#, false),
            (r#"{"model":"m","messages":[],"input":"Hi"}"#, false),
            (
                r#"{"model":"m","input":"Hi","temperature":1,"temperature":2}"#,
                false,
            ),
            (r#"{"model":"m","input":"Hi","instructions":5}"#, false),
        ];
        for (body, read) in cases {
            let plain = Fields::read(body.as_bytes()).unwrap();
            let responses = fields(body.as_bytes()).unwrap();
            assert_eq!(raw(&responses), raw(&plain), "{body}");
            // `input` is read into items by the translation's reading: given alike.
            assert_eq!(input_given(&responses), input_given(&plain), "{body}");
            assert_eq!(responses.responses.is_some(), read, "{body}");
        }
        for refused in [
            "not json",
            "[]",
            r#"{"model":"m","model":"n","input":"Hi"}"#,
            "{",
        ] {
            assert_eq!(
                fields(refused.as_bytes()).err(),
                Fields::read(refused.as_bytes()).err(),
                "{refused}"
            );
        }
    }
}
