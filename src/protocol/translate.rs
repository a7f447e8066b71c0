//! What every translation between two dialects shares, below the dialects' folders (which
//! each hold their own translations; [`translation`](super::translation) composes them): the
//! refusal of a field that has no equivalent, what the translations of a call must be made
//! for, and the writers both directions share.

use serde_json::{Map, Value};

use super::{BuiltinTools, TokenUsage, UpstreamKind};

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

/// The cache writes of `read`, where it reported any, in Anthropic's names (the only provider
/// that reports them, in two durations): `cache_creation_input_tokens` and its split, which
/// the gateway reads back as the same counts whatever protocol's usage they stand in.
pub(crate) fn write_cache_writes(read: &TokenUsage, usage: &mut Map<String, Value>) {
    if read.cache_write_tokens.is_none() && read.cache_write_1h_tokens.is_none() {
        return;
    }
    let total = read
        .cache_write_tokens
        .unwrap_or(0)
        .saturating_add(read.cache_write_1h_tokens.unwrap_or(0));
    usage.insert("cache_creation_input_tokens".into(), Value::from(total));
    let mut split = Map::new();
    if let Some(tokens) = read.cache_write_tokens {
        split.insert("ephemeral_5m_input_tokens".into(), Value::from(tokens));
    }
    if let Some(tokens) = read.cache_write_1h_tokens {
        split.insert("ephemeral_1h_input_tokens".into(), Value::from(tokens));
    }
    usage.insert("cache_creation".into(), Value::Object(split));
}

/// A request of a translation's `fields` calling `model`, serialised: `model` first, then each
/// field as it is (written field by field, rather than cloned into a map with `model`).
pub(crate) fn body_with_model(model: &str, fields: &Map<String, Value>) -> Vec<u8> {
    let mut body = Vec::with_capacity(256);
    body.extend_from_slice(b"{\"model\":");
    serde_json::to_writer(&mut body, model).expect("a string serialises");
    for (key, value) in fields {
        body.push(b',');
        serde_json::to_writer(&mut body, key).expect("a string serialises");
        body.push(b':');
        serde_json::to_writer(&mut body, value).expect("a JSON value serialises");
    }
    body.push(b'}');
    body
}

/// What a call's translations must be made for: the built-in tools rule of the
/// chat-completions channels that translate it, of the Anthropic ones and of the Gemini ones
/// (`None` where no channel of that kind translates it), and the model's output limit
/// (Anthropic requires one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    pub(crate) to_chat: Option<BuiltinTools>,
    pub(crate) to_messages: Option<BuiltinTools>,
    pub(crate) to_gemini: Option<BuiltinTools>,
    pub(crate) max_output_tokens: Option<u64>,
}

impl Needs {
    /// Whether any translation is needed.
    pub(crate) fn any(&self) -> bool {
        self.to_chat.is_some() || self.to_messages.is_some() || self.to_gemini.is_some()
    }

    /// The built-in tools rule of a request translated to chat completions on its way to any
    /// of the upstreams `self` names (refused where one of them refuses, so that which channel
    /// serves a call never changes whether it is accepted); `None` where none translates.
    pub(crate) fn strictest_for_chat(&self) -> Option<BuiltinTools> {
        [self.to_chat, self.to_messages, self.to_gemini]
            .into_iter()
            .flatten()
            .reduce(|one, other| match (one, other) {
                (BuiltinTools::Drop, BuiltinTools::Drop) => BuiltinTools::Drop,
                _ => BuiltinTools::Refuse,
            })
    }

    /// What an upstream of `kind` that translates needs, with `builtin` its rule.
    pub(crate) fn for_kind(
        kind: UpstreamKind,
        builtin: BuiltinTools,
        max_output_tokens: Option<u64>,
    ) -> Needs {
        let mut needs = Needs {
            max_output_tokens,
            ..Needs::default()
        };
        match kind {
            UpstreamKind::Openai => needs.to_chat = Some(builtin),
            UpstreamKind::Anthropic => needs.to_messages = Some(builtin),
            UpstreamKind::Gemini => needs.to_gemini = Some(builtin),
        }
        needs
    }
}

/// The translation corpora's cases (`tests/corpus/{folder}`), by file name, in name order.
#[cfg(test)]
pub(crate) fn corpus(folder: &str) -> Vec<(String, Value)> {
    let dir = format!("{}/tests/corpus/{folder}", env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("the corpus folder")
        .map(|entry| entry.expect("a corpus file").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            let case = std::fs::read(path).expect("a readable case");
            (name, serde_json::from_slice(&case).expect("a JSON case"))
        })
        .collect()
}

/// Usage reports as providers may write them, for the translations' property tests.
#[cfg(test)]
pub(crate) mod usage_counts {
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    /// A count as a provider may write one: absent, a number, or something that is no count.
    pub(crate) fn count() -> impl Strategy<Value = Option<Value>> {
        prop_oneof![
            3 => Just(None),
            6 => (0i64..1_000_000).prop_map(|n| Some(json!(n))),
            1 => prop_oneof![
                Just(json!(-3)),
                Just(json!(1.5)),
                Just(json!("12")),
                Just(json!(null)),
                Just(json!(u64::MAX)),
            ]
            .prop_map(Some),
        ]
    }

    /// `value` under `key`, where there is one.
    pub(crate) fn put(object: &mut Map<String, Value>, key: &str, value: Option<Value>) {
        if let Some(value) = value {
            object.insert(key.into(), value);
        }
    }
}
