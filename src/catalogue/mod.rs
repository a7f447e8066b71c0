//! The model catalogue: which models exist, on which protocol, at what price, served by which
//! upstream. Loaded from TOML and validated once at start; lookups afterwards are a hash-map read.
//!
//! ```
//! use model_gateway::{Catalogue, Protocol};
//!
//! let catalogue = Catalogue::from_toml(r#"
//!     [[upstreams]]
//!     name = "openai"
//!     kind = "openai"
//!     base_url = "https://api.openai.com/v1"
//!     api_key_env = "OPENAI_API_KEY"
//!
//!     [[models]]
//!     name = "gpt-4o-mini"
//!     protocol = "chat_completions"
//!     price = 2
//!     upstream = "openai"
//! "#).unwrap();
//! let model = catalogue.model("gpt-4o-mini").unwrap();
//! assert_eq!(model.protocol, Protocol::ChatCompletions);
//! assert_eq!(model.price.get(), 2);
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::credits::Credits;
use crate::protocol::Protocol;

/// The catalogue used when no file is given: two OpenAI-style vendors, one operator-own chat
/// model and two Anthropic messages models.
pub const DEMO_CATALOGUE: &str = include_str!("demo.toml");

/// Default total time-out of one upstream call.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(120);

/// The wire format an upstream speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamKind {
    /// `POST {base_url}/chat/completions` with `Authorization: Bearer`.
    Openai,
    /// `POST {base_url}/v1/messages` with `x-api-key` and `anthropic-version`.
    Anthropic,
}

/// One upstream provider endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// Name models refer to.
    pub name: String,
    /// Wire format.
    pub kind: UpstreamKind,
    /// Base URL, without a trailing slash.
    pub base_url: String,
    /// Environment variable holding the provider key.
    pub api_key_env: String,
    /// Total time-out of one call.
    pub timeout: Duration,
}

/// One model clients can call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRoute {
    /// The name clients send in `model`.
    pub name: String,
    /// The endpoint it is served on.
    pub protocol: Protocol,
    /// Credits charged per successful call.
    pub price: Credits,
    /// Who serves it.
    pub upstream: Arc<UpstreamConfig>,
    /// The name sent upstream, when it differs from `name`.
    pub upstream_model: Option<String>,
}

/// A validated set of upstreams and models.
#[derive(Debug, Clone, Default)]
pub struct Catalogue {
    models: HashMap<String, Arc<ModelRoute>>,
    upstreams: Vec<Arc<UpstreamConfig>>,
}

/// Why a catalogue was refused.
#[derive(Debug, thiserror::Error)]
pub enum CatalogueError {
    /// The file could not be read.
    #[error("cannot read model catalogue {path}: {source}")]
    Read {
        /// The path given.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid TOML, an unknown field, or a value of the wrong type.
    #[error("invalid model catalogue: {0}")]
    Syntax(#[from] toml::de::Error),
    /// Two upstreams share a name.
    #[error("invalid model catalogue: upstream `{0}` is defined twice")]
    DuplicateUpstream(String),
    /// Two models share a name.
    #[error("invalid model catalogue: model `{0}` is defined twice")]
    DuplicateModel(String),
    /// A model names an upstream that is not defined.
    #[error("invalid model catalogue: model `{model}` uses unknown upstream `{upstream}`")]
    UnknownUpstream {
        /// The model.
        model: String,
        /// The name it gave.
        upstream: String,
    },
    /// A price of zero or less.
    #[error("invalid model catalogue: model `{model}` has price {price}; prices must be positive")]
    NonPositivePrice {
        /// The model.
        model: String,
        /// The price given.
        price: i64,
    },
    /// An upstream time-out of zero.
    #[error("invalid model catalogue: upstream `{0}` has timeout_secs = 0")]
    ZeroTimeout(String),
    /// A model whose protocol its upstream cannot serve.
    #[error(
        "invalid model catalogue: model `{model}` is a {protocol} model but upstream `{upstream}` speaks the other protocol"
    )]
    ProtocolMismatch {
        /// The model.
        model: String,
        /// Its protocol.
        protocol: &'static str,
        /// Its upstream.
        upstream: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogueFile {
    #[serde(default)]
    upstreams: Vec<UpstreamEntry>,
    #[serde(default)]
    models: Vec<ModelEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamEntry {
    name: String,
    kind: UpstreamKind,
    base_url: String,
    api_key_env: String,
    timeout_secs: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelEntry {
    name: String,
    protocol: Protocol,
    price: i64,
    upstream: String,
    upstream_model: Option<String>,
}

impl Catalogue {
    /// The built-in demo catalogue.
    pub fn demo() -> Catalogue {
        Catalogue::from_toml(DEMO_CATALOGUE).expect("the built-in catalogue is valid")
    }

    /// Reads and validates a catalogue file.
    pub fn from_path(path: impl AsRef<std::path::Path>) -> Result<Catalogue, CatalogueError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| CatalogueError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Catalogue::from_toml(&text)
    }

    /// Parses and validates a catalogue.
    pub fn from_toml(text: &str) -> Result<Catalogue, CatalogueError> {
        let file: CatalogueFile = toml::from_str(text)?;
        let mut upstreams: HashMap<String, Arc<UpstreamConfig>> = HashMap::new();
        for entry in file.upstreams {
            if entry.timeout_secs == Some(0) {
                return Err(CatalogueError::ZeroTimeout(entry.name));
            }
            let config = UpstreamConfig {
                timeout: entry
                    .timeout_secs
                    .map_or(DEFAULT_UPSTREAM_TIMEOUT, Duration::from_secs),
                base_url: entry.base_url.trim_end_matches('/').to_owned(),
                kind: entry.kind,
                api_key_env: entry.api_key_env,
                name: entry.name,
            };
            if upstreams.contains_key(&config.name) {
                return Err(CatalogueError::DuplicateUpstream(config.name));
            }
            upstreams.insert(config.name.clone(), Arc::new(config));
        }

        let mut models = HashMap::new();
        for entry in file.models {
            let upstream = upstreams.get(&entry.upstream).cloned().ok_or_else(|| {
                CatalogueError::UnknownUpstream {
                    model: entry.name.clone(),
                    upstream: entry.upstream.clone(),
                }
            })?;
            if entry.price <= 0 {
                return Err(CatalogueError::NonPositivePrice {
                    model: entry.name,
                    price: entry.price,
                });
            }
            let speaks = match upstream.kind {
                UpstreamKind::Openai => Protocol::ChatCompletions,
                UpstreamKind::Anthropic => Protocol::Messages,
            };
            if speaks != entry.protocol {
                return Err(CatalogueError::ProtocolMismatch {
                    model: entry.name,
                    protocol: entry.protocol.as_str(),
                    upstream: entry.upstream,
                });
            }
            if models.contains_key(&entry.name) {
                return Err(CatalogueError::DuplicateModel(entry.name));
            }
            let route = ModelRoute {
                name: entry.name.clone(),
                protocol: entry.protocol,
                price: Credits(entry.price),
                upstream,
                upstream_model: entry.upstream_model,
            };
            models.insert(entry.name, Arc::new(route));
        }
        let mut upstreams: Vec<_> = upstreams.into_values().collect();
        upstreams.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Catalogue { models, upstreams })
    }

    /// The model called `name`, on whichever protocol.
    pub fn model(&self, name: &str) -> Option<&Arc<ModelRoute>> {
        self.models.get(name)
    }

    /// Every model, in no particular order.
    pub fn models(&self) -> impl Iterator<Item = &Arc<ModelRoute>> {
        self.models.values()
    }

    /// Every upstream, by name.
    pub fn upstreams(&self) -> &[Arc<UpstreamConfig>] {
        &self.upstreams
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UPSTREAM: &str = r#"
        [[upstreams]]
        name = "openai"
        kind = "openai"
        base_url = "https://api.openai.com/v1/"
        api_key_env = "OPENAI_API_KEY"
        timeout_secs = 60
    "#;

    fn with_model(model: &str) -> Result<Catalogue, CatalogueError> {
        Catalogue::from_toml(&format!("{UPSTREAM}\n[[models]]\n{model}"))
    }

    #[test]
    fn the_documented_shape_loads() {
        let catalogue = with_model(
            r#"name = "gpt-4o-mini"
            protocol = "chat_completions"
            price = 2
            upstream = "openai"
            upstream_model = "gpt-4o-mini-2024-07-18""#,
        )
        .unwrap();
        let model = catalogue.model("gpt-4o-mini").unwrap();
        assert_eq!(model.price, Credits(2));
        assert_eq!(model.upstream.base_url, "https://api.openai.com/v1");
        assert_eq!(model.upstream.timeout, Duration::from_secs(60));
        assert_eq!(
            model.upstream_model.as_deref(),
            Some("gpt-4o-mini-2024-07-18")
        );
    }

    #[test]
    fn the_demo_catalogue_covers_both_protocols_and_three_vendors() {
        let demo = Catalogue::demo();
        let chat: Vec<_> = demo
            .models()
            .filter(|m| m.protocol == Protocol::ChatCompletions)
            .collect();
        let messages = demo
            .models()
            .filter(|m| m.protocol == Protocol::Messages)
            .count();
        assert!(chat.len() >= 3 && messages >= 2);
        let vendors: std::collections::HashSet<_> =
            chat.iter().map(|m| m.upstream.name.as_str()).collect();
        assert!(vendors.len() >= 3, "{vendors:?}");
    }

    #[test]
    fn an_unknown_upstream_is_refused_by_name() {
        let error = with_model(
            r#"name = "m"
            protocol = "chat_completions"
            price = 1
            upstream = "nowhere""#,
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("unknown upstream `nowhere`"),
            "{error}"
        );
    }

    #[test]
    fn a_duplicate_model_is_refused_by_name() {
        let model = r#"name = "twice"
            protocol = "chat_completions"
            price = 1
            upstream = "openai""#;
        let error = with_model(&format!("{model}\n[[models]]\n{model}")).unwrap_err();
        assert!(
            error.to_string().contains("model `twice` is defined twice"),
            "{error}"
        );
    }

    #[test]
    fn a_non_positive_price_is_refused() {
        for price in ["0", "-3"] {
            let error = with_model(&format!(
                "name = \"free\"\nprotocol = \"chat_completions\"\nprice = {price}\nupstream = \"openai\""
            ))
            .unwrap_err();
            assert!(
                error.to_string().contains("prices must be positive"),
                "{error}"
            );
        }
    }

    #[test]
    fn a_fractional_price_is_refused() {
        let error = with_model(
            "name = \"m\"\nprotocol = \"chat_completions\"\nprice = 1.5\nupstream = \"openai\"",
        )
        .unwrap_err();
        assert!(matches!(error, CatalogueError::Syntax(_)), "{error}");
    }

    #[test]
    fn an_unknown_field_is_refused_by_name() {
        let error = with_model(
            "name = \"m\"\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"openai\"\ncost = 3",
        )
        .unwrap_err();
        assert!(error.to_string().contains("cost"), "{error}");
    }

    #[test]
    fn a_messages_model_on_an_openai_upstream_is_refused() {
        let error = with_model(
            "name = \"claude\"\nprotocol = \"messages\"\nprice = 1\nupstream = \"openai\"",
        )
        .unwrap_err();
        assert!(
            matches!(error, CatalogueError::ProtocolMismatch { .. }),
            "{error}"
        );
    }
}
