use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::super::borrowed_text;
use super::super::write::Str;
use super::{ChatReply, ChatUsage, OpenaiUsage, ToolCall};
use crate::protocol::TokenUsage;

#[derive(Deserialize)]
pub(super) struct Reply<'a> {
    created: Option<i64>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
    /// Read twice, small as it is: for the response, and as the ledger counts tokens.
    #[serde(borrow)]
    pub(super) usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow)]
    message: Option<Message<'a>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    finish_reason: Option<Cow<'a, str>>,
}

/// A reply's `message`, or a stream chunk's `delta`.
#[derive(Deserialize)]
pub(in crate::protocol::responses) struct Message<'a> {
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub content: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub refusal: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub reasoning: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub tool_calls: Option<Vec<Call<'a>>>,
}

/// A tool call, or a stream's piece of one (which its `index` places).
#[derive(Deserialize)]
pub(in crate::protocol::responses) struct Call<'a> {
    pub index: Option<u64>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub id: Option<Cow<'a, str>>,
    #[serde(borrow, rename = "type", default, deserialize_with = "borrowed_text")]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub function: Option<Function<'a>>,
    #[serde(borrow)]
    pub custom: Option<Custom<'a>>,
}

#[derive(Deserialize)]
pub(in crate::protocol::responses) struct Function<'a> {
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub name: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub arguments: Option<Cow<'a, str>>,
}

/// A custom tool's call: its name and free-form input.
#[derive(Deserialize)]
pub(in crate::protocol::responses) struct Custom<'a> {
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub name: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    pub input: Option<Cow<'a, str>>,
}

impl<'a> Call<'a> {
    /// Whether this is a custom tool's call (see [`is_custom`](super::is_custom)).
    pub(in crate::protocol::responses) fn is_custom(&self) -> bool {
        super::is_custom(
            self.kind.as_deref(),
            self.custom.is_some(),
            self.function.is_some(),
        )
    }

    /// The call's name and its text (a function's arguments, a custom tool's input).
    pub(in crate::protocol::responses) fn name_and_text(
        &'a self,
        custom: bool,
    ) -> (Option<&'a Cow<'a, str>>, Option<&'a Cow<'a, str>>) {
        if custom {
            let custom = self.custom.as_ref();
            (
                custom.and_then(|custom| custom.name.as_ref()),
                custom.and_then(|custom| custom.input.as_ref()),
            )
        } else {
            let function = self.function.as_ref();
            (
                function.and_then(|function| function.name.as_ref()),
                function.and_then(|function| function.arguments.as_ref()),
            )
        }
    }
}

impl<'a> Reply<'a> {
    /// The reply's `usage`: its counts for the response (an error when it is not an
    /// object of counts), and the billing layer's usage, as
    /// [`reply_usage`](crate::protocol::reply_usage) reads it (`None` when that reading
    /// fails). Read once when it holds `OpenAI`'s keys alone.
    pub(super) fn usage(
        &self,
    ) -> Result<(Option<ChatUsage>, Option<TokenUsage>), serde_json::Error> {
        let Some(raw) = self.usage.filter(|raw| raw.get() != "null") else {
            return Ok((None, Some(TokenUsage::default())));
        };
        if let Ok(usage) = serde_json::from_str::<OpenaiUsage>(raw.get()) {
            let (counts, tokens) = usage.read();
            return Ok((Some(counts), Some(tokens)));
        }
        let counts = serde_json::from_str::<ChatUsage>(raw.get())?;
        let tokens = serde_json::from_str::<TokenUsage>(raw.get()).ok();
        Ok((Some(counts), tokens))
    }

    /// What the translation reads, with the `usage` counts read by [`Reply::usage`].
    pub(super) fn view(&'a self, usage: Option<ChatUsage>) -> ChatReply<'a> {
        let choice = self.choices.as_deref().and_then(<[Choice<'a>]>::first);
        let message = choice.and_then(|choice| choice.message.as_ref());
        let text = |field: &'a Option<Cow<'a, str>>| field.as_ref().map(Str::of_read);
        let reasoning = message.and_then(|message| {
            text(&message.reasoning_content)
                .or(text(&message.reasoning))
                .filter(|text| !text.is_empty())
        });
        let calls = message
            .and_then(|message| message.tool_calls.as_deref())
            .unwrap_or_default();
        ChatReply {
            created: self.created,
            model: self.model.as_deref(),
            text: message.and_then(|message| text(&message.content)),
            refusal: message.and_then(|message| text(&message.refusal)),
            reasoning,
            calls: calls
                .iter()
                .map(|call| {
                    let custom = call.is_custom();
                    let (name, arguments) = call.name_and_text(custom);
                    ToolCall {
                        id: text(&call.id),
                        custom,
                        name: name.map_or(Str::Read(""), Str::of_read),
                        arguments: arguments
                            .map_or(Str::Read(if custom { "" } else { "{}" }), Str::of_read),
                    }
                })
                .collect(),
            finish_reason: choice.and_then(|choice| choice.finish_reason.as_deref()),
            usage: usage.as_ref().map(ChatUsage::counts),
        }
    }
}
