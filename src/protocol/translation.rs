//! A call translated between two dialects on its way to a provider and back: the request made
//! once by the router (which checks that it translates, before any charge), the provider's
//! reply and stream read back into the client's dialect. One translation per pair of
//! dialects, each in the folder of the dialect the client speaks
//! ([`responses`](super::responses) and [`messages`](super::messages) in terms of chat
//! completions).

use bytes::Bytes;

use super::TokenUsage;
use super::messages::{ChatToMessages, MessagesAsChat};
use super::responses::{self, Ids, StreamTranslator};

/// A field of a request that the provider's dialect cannot express. Refused with 400 rather
/// than dropped, so that a client never gets a reply to a different question than the one it
/// asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` cannot be translated to the provider's protocol: {reason}")]
pub struct Untranslatable {
    /// The field, as a path into the request (`tools[0].type`, `input[2]`).
    pub field: String,
    /// Why (English, for logs and the detail).
    pub reason: &'static str,
}

pub(crate) fn refuse<T>(
    field: impl Into<String>,
    reason: &'static str,
) -> Result<T, Untranslatable> {
    Err(Untranslatable {
        field: field.into(),
        reason,
    })
}

/// A request's translation for a chat-completions provider.
#[derive(Debug)]
pub(crate) enum Translation {
    /// A Responses request.
    Responses(responses::Translated),
    /// A messages request.
    Messages(MessagesAsChat),
}

impl Translation {
    /// The tools the translation left out, by type, in the request's order.
    pub(crate) fn dropped_tools(&self) -> &[String] {
        match self {
            Translation::Responses(translated) => translated.dropped_tools(),
            Translation::Messages(translated) => translated.dropped_tools(),
        }
    }

    /// The request the provider is sent, calling `model`.
    pub(crate) fn upstream_body(&self, model: &str) -> Vec<u8> {
        match self {
            Translation::Responses(translated) => translated.chat_body(model),
            Translation::Messages(translated) => translated.chat_body(model),
        }
    }

    /// The provider's complete `reply` in the client's dialect, with the gateway's reading of
    /// its usage; `Err` when the reply is not one of the provider's dialect.
    pub(crate) fn reply(&self, reply: &[u8]) -> Result<(Bytes, Option<TokenUsage>), ()> {
        match self {
            Translation::Responses(translated) => {
                let (response, usage) =
                    responses::response_json_from_chat_bytes(translated, reply, &mut Ids::random())
                        .map_err(|_| ())?;
                Ok((Bytes::from(response), usage))
            }
            Translation::Messages(translated) => {
                let (message, usage) = translated
                    .reply(reply, &super::messages::message_id())
                    .map_err(|_| ())?;
                Ok((Bytes::from(message), Some(usage)))
            }
        }
    }

    /// A translator of the provider's event stream into the client's dialect.
    pub(crate) fn stream(&self) -> StreamTranslation {
        match self {
            Translation::Responses(translated) => StreamTranslation::Responses(Box::new(
                StreamTranslator::new(translated, Ids::random()),
            )),
            Translation::Messages(translated) => StreamTranslation::Messages(Box::new(
                translated.stream(super::messages::message_id()),
            )),
        }
    }
}

/// A provider's event stream being translated into the client's dialect.
#[derive(Debug)]
pub(crate) enum StreamTranslation {
    /// Into the Responses API's events.
    Responses(Box<StreamTranslator>),
    /// Into Anthropic's messages events.
    Messages(Box<ChatToMessages>),
}

impl StreamTranslation {
    /// Takes bytes of the provider's stream (cut anywhere) and returns the events they
    /// complete in the client's dialect.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> String {
        match self {
            StreamTranslation::Responses(translator) => translator.push(chunk),
            StreamTranslation::Messages(translator) => translator.push(chunk),
        }
    }

    /// Bytes received that do not make a complete event yet.
    pub(crate) fn pending(&self) -> usize {
        match self {
            StreamTranslation::Responses(translator) => translator.pending(),
            StreamTranslation::Messages(translator) => translator.pending(),
        }
    }
}
