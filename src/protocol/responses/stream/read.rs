use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;

use super::super::borrowed_text;
use super::super::reply::ChatUsage;
use super::super::reply::read::{Call, Message as Delta};
use super::{CallView, ChoiceView, ChunkView};

#[derive(Deserialize)]
pub(super) struct Chunk<'a> {
    /// Any value but `null`: the chunk is an error, read as a `Value`.
    error: Option<IgnoredAny>,
    created: Option<i64>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    choices: Option<Vec<Choice<'a>>>,
    usage: Option<ChatUsage>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default, deserialize_with = "borrowed_text")]
    finish_reason: Option<Cow<'a, str>>,
}

impl<'a> Chunk<'a> {
    pub(super) fn has_error(&self) -> bool {
        self.error.is_some()
    }

    pub(super) fn view(&'a self) -> ChunkView<'a> {
        let choice = self.choices.as_deref().and_then(<[Choice<'a>]>::first);
        ChunkView {
            created: self.created,
            model: self.model.as_deref(),
            usage: self.usage.as_ref().map(ChatUsage::counts),
            choice: choice.map(Choice::view),
        }
    }
}

impl<'a> Choice<'a> {
    fn view(&'a self) -> ChoiceView<'a> {
        let delta = self.delta.as_ref();
        let field = |pick: fn(&'a Delta<'a>) -> &'a Option<Cow<'a, str>>| {
            delta.and_then(|delta| pick(delta).as_deref())
        };
        let calls = delta.and_then(|delta| delta.tool_calls.as_deref());
        ChoiceView {
            reasoning: field(|delta| &delta.reasoning_content)
                .or(field(|delta| &delta.reasoning))
                .filter(|text| !text.is_empty()),
            content: field(|delta| &delta.content),
            refusal: field(|delta| &delta.refusal),
            calls: calls.unwrap_or_default().iter().map(call_view).collect(),
            finish_reason: self.finish_reason.as_deref(),
        }
    }
}

fn call_view<'a>(call: &'a Call<'a>) -> CallView<'a> {
    let custom = call.is_custom();
    let (name, arguments) = call.name_and_text(custom);
    CallView {
        index: call.index.unwrap_or(0),
        id: call.id.as_deref(),
        custom,
        name: name.map(|name| &**name),
        arguments: arguments.map(|arguments| &**arguments),
    }
}
