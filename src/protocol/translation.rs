//! A call translated between two dialects on its way to a provider and back: the request made
//! once by the router (which checks that it translates, before any charge), the provider's
//! reply and stream read back into the client's dialect. One translation per pair of
//! dialects, each in the folder of the dialect the client speaks, composed where needed:
//!
//! | The client speaks | To a chat-completions provider | To an Anthropic provider | To a Gemini provider |
//! |---|---|---|---|
//! | chat completions | as it is | [`ChatAsMessages`] | [`ChatAsGemini`] |
//! | Responses | [`responses::Translated`] | [`responses::Translated`], then [`ChatAsMessages`] | [`responses::Translated`], then [`ChatAsGemini`] |
//! | messages | [`MessagesAsChat`] | as it is | [`MessagesAsChat`], then [`ChatAsGemini`] |
//! | Gemini | [`GeminiAsChat`] | [`GeminiAsChat`], then [`ChatAsMessages`] | as it is |

use bytes::Bytes;

use super::chat_completions::gemini::{ChatAsGemini, GeminiToChat};
use super::chat_completions::messages::{ChatAsMessages, MessagesToChat, completion_id};
use super::gemini::chat::{ChatToGemini, GeminiAsChat};
use super::messages::chat::{ChatToMessages, MessagesAsChat, message_id};
use super::responses::{self, Ids, StreamTranslator};
use super::translate::{Needs, Untranslatable};
use super::{TokenUsage, UpstreamKind};

/// A Responses, messages or Gemini request in chat-completions terms.
#[derive(Debug)]
pub(crate) enum ToChat {
    /// A Responses request.
    Responses(responses::Translated),
    /// A messages request.
    Messages(MessagesAsChat),
    /// A Gemini request.
    Gemini(GeminiAsChat),
}

impl ToChat {
    /// The chat-completions request calling `model`, serialised.
    pub(crate) fn chat_body(&self, model: &str) -> Vec<u8> {
        match self {
            ToChat::Responses(translated) => translated.chat_body(model),
            ToChat::Messages(translated) => translated.chat_body(model),
            ToChat::Gemini(translated) => translated.chat_body(model),
        }
    }
}

/// A request's translations: for the chat-completions providers, and for the Anthropic ones.
#[derive(Debug, Default)]
pub(crate) struct Translation {
    /// The request in chat-completions terms (a Responses or messages request).
    pub(crate) chat: Option<ToChat>,
    /// The request in messages terms (a chat request, or a Responses request through its chat
    /// terms).
    pub(crate) messages: Option<ChatAsMessages>,
    /// The request in the Gemini API's terms (a chat request, or a Responses or messages
    /// request through its chat terms).
    pub(crate) gemini: Option<ChatAsGemini>,
}

impl Translation {
    /// A request translated to chat completions as `chat`, with the translations onward from
    /// its chat terms (calling `model`) that `needs` asks for: to messages, and to the Gemini
    /// API.
    pub(crate) fn through_chat(
        chat: ToChat,
        model: &str,
        needs: Needs,
    ) -> Result<Translation, Untranslatable> {
        let chat_body = || chat.chat_body(model);
        let max_tokens = needs.max_output_tokens;
        let messages = match needs.to_messages {
            Some(builtin) => Some(ChatAsMessages::from_slice_with(
                &chat_body(),
                builtin,
                max_tokens,
            )?),
            None => None,
        };
        let gemini = match needs.to_gemini {
            Some(builtin) => Some(ChatAsGemini::from_slice_with(
                &chat_body(),
                builtin,
                max_tokens,
            )?),
            None => None,
        };
        Ok(Translation {
            chat: Some(chat),
            messages,
            gemini,
        })
    }

    /// The Responses request's chat translation, if this is one.
    pub(crate) fn responses(&self) -> Option<&responses::Translated> {
        match &self.chat {
            Some(ToChat::Responses(translated)) => Some(translated),
            _ => None,
        }
    }

    /// The tools the translations left out, by type, in the request's order.
    pub(crate) fn dropped_tools(&self) -> Vec<&str> {
        let chat = match &self.chat {
            Some(ToChat::Responses(translated)) => translated.dropped_tools(),
            Some(ToChat::Messages(translated)) => translated.dropped_tools(),
            Some(ToChat::Gemini(translated)) => translated.dropped_tools(),
            None => &[],
        };
        let messages = self
            .messages
            .as_ref()
            .map_or(&[][..], ChatAsMessages::dropped_tools);
        let gemini = self
            .gemini
            .as_ref()
            .map_or(&[][..], ChatAsGemini::dropped_tools);
        let mut dropped: Vec<&str> = chat.iter().map(String::as_str).collect();
        for tool in messages.iter().chain(gemini) {
            if !dropped.contains(&tool.as_str()) {
                dropped.push(tool);
            }
        }
        dropped
    }

    /// The request an upstream of `kind` is sent, calling `model`; `None` when this
    /// translation has none for it.
    pub(crate) fn upstream_body(&self, kind: UpstreamKind, model: &str) -> Option<Vec<u8>> {
        match kind {
            UpstreamKind::Openai => Some(self.chat.as_ref()?.chat_body(model)),
            UpstreamKind::Anthropic => Some(self.messages.as_ref()?.messages_body(model)),
            // The model is in the call's path.
            UpstreamKind::Gemini => Some(self.gemini.as_ref()?.gemini_body()),
        }
    }

    /// The complete `reply` of an upstream of `kind` in the client's dialect, with the
    /// gateway's reading of its usage; `Err` when the reply is not one of that upstream's
    /// dialect.
    pub(crate) fn reply(
        &self,
        kind: UpstreamKind,
        reply: &[u8],
    ) -> Result<(Bytes, Option<TokenUsage>), ()> {
        match kind {
            UpstreamKind::Openai => self.reply_from_chat(reply),
            UpstreamKind::Anthropic => {
                let messages = self.messages.as_ref().ok_or(())?;
                let (chat, usage) = messages
                    .reply(reply, completion_id(), unix_now())
                    .map_err(|_| ())?;
                match &self.chat {
                    // A Responses call: the chat completion on to a response, its usage the
                    // message's, read once.
                    Some(_) => Ok((self.reply_from_chat(&chat)?.0, Some(usage))),
                    None => Ok((Bytes::from(chat), Some(usage))),
                }
            }
            UpstreamKind::Gemini => {
                let gemini = self.gemini.as_ref().ok_or(())?;
                let (chat, usage) = gemini
                    .reply(reply, completion_id(), unix_now())
                    .map_err(|_| ())?;
                match &self.chat {
                    // A Responses or messages call: the chat completion on to its dialect, its
                    // usage Google's, read once.
                    Some(_) => Ok((self.reply_from_chat(&chat)?.0, Some(usage))),
                    None => Ok((Bytes::from(chat), Some(usage))),
                }
            }
        }
    }

    fn reply_from_chat(&self, reply: &[u8]) -> Result<(Bytes, Option<TokenUsage>), ()> {
        match self.chat.as_ref().ok_or(())? {
            ToChat::Responses(translated) => {
                let (response, usage) =
                    responses::response_json_from_chat_bytes(translated, reply, &mut Ids::random())
                        .map_err(|_| ())?;
                Ok((Bytes::from(response), usage))
            }
            ToChat::Messages(translated) => {
                let (message, usage) = translated.reply(reply, &message_id()).map_err(|_| ())?;
                Ok((Bytes::from(message), Some(usage)))
            }
            ToChat::Gemini(translated) => {
                let (response, usage) = translated.reply(reply).ok_or(())?;
                Ok((Bytes::from(response), Some(usage)))
            }
        }
    }

    /// A translator of the event stream of an upstream of `kind` into the client's dialect.
    pub(crate) fn stream(&self, kind: UpstreamKind) -> StreamTranslation {
        let from_chat = || -> Option<Box<ChatStream>> {
            Some(Box::new(match self.chat.as_ref()? {
                ToChat::Responses(translated) => {
                    ChatStream::Responses(StreamTranslator::new(translated, Ids::random()))
                }
                ToChat::Messages(translated) => {
                    ChatStream::Messages(translated.stream(message_id()))
                }
                ToChat::Gemini(translated) => ChatStream::Gemini(translated.stream()),
            }))
        };
        match kind {
            UpstreamKind::Openai => StreamTranslation {
                from_messages: None,
                from_gemini: None,
                from_chat: from_chat(),
            },
            UpstreamKind::Anthropic => StreamTranslation {
                from_messages: self
                    .messages
                    .as_ref()
                    .map(|messages| Box::new(messages.stream(completion_id(), unix_now()))),
                from_gemini: None,
                from_chat: from_chat(),
            },
            UpstreamKind::Gemini => StreamTranslation {
                from_messages: None,
                from_gemini: self
                    .gemini
                    .as_ref()
                    .map(|gemini| Box::new(gemini.stream(completion_id(), unix_now()))),
                from_chat: from_chat(),
            },
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

/// A chat stream read as the client's dialect.
#[derive(Debug)]
enum ChatStream {
    Responses(StreamTranslator),
    Messages(ChatToMessages),
    Gemini(ChatToGemini),
}

/// A provider's event stream being translated into the client's dialect: a messages stream
/// (or Google's) into chat chunks first, where the provider speaks messages (or Gemini's); chat chunks into the client's
/// events, where the client does not speak chat completions.
#[derive(Debug)]
pub(crate) struct StreamTranslation {
    from_messages: Option<Box<MessagesToChat>>,
    from_gemini: Option<Box<GeminiToChat>>,
    from_chat: Option<Box<ChatStream>>,
}

impl StreamTranslation {
    /// Takes bytes of the provider's stream (cut anywhere) and returns the events they
    /// complete in the client's dialect.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> String {
        let chat = match (&mut self.from_messages, &mut self.from_gemini) {
            (Some(translator), _) => std::borrow::Cow::Owned(translator.push(chunk).into_bytes()),
            (None, Some(translator)) => {
                std::borrow::Cow::Owned(translator.push(chunk).into_bytes())
            }
            (None, None) => std::borrow::Cow::Borrowed(chunk),
        };
        match self.from_chat.as_deref_mut() {
            Some(ChatStream::Responses(translator)) => translator.push(&chat),
            Some(ChatStream::Messages(translator)) => translator.push(&chat),
            Some(ChatStream::Gemini(translator)) => translator.push(&chat),
            None => String::from_utf8(chat.into_owned()).expect("chunks are written as text"),
        }
    }

    /// Bytes received that do not make a complete event yet.
    pub(crate) fn pending(&self) -> usize {
        let first = self.from_messages.as_ref().map_or(0, |t| t.pending())
            + self.from_gemini.as_ref().map_or(0, |t| t.pending());
        let then = match self.from_chat.as_deref() {
            Some(ChatStream::Responses(translator)) => translator.pending(),
            Some(ChatStream::Messages(translator)) => translator.pending(),
            Some(ChatStream::Gemini(translator)) => translator.pending(),
            None => 0,
        };
        first + then
    }
}
