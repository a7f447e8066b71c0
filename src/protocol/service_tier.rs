//! [`ServiceTier`]: the tier a provider serves a call at, as a request asks and a reply says.

use serde::Serialize;

/// A provider's service tier: what a call was served at, priced on its own when the catalogue
/// says (`priority` and `flex` tables beside the standard prices).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceTier {
    /// The provider's usual tier (`OpenAI`'s `default`, Anthropic's `standard`).
    #[default]
    Standard,
    /// Priority processing, at a higher price.
    Priority,
    /// Flex processing, slower and cheaper.
    Flex,
}

impl ServiceTier {
    /// The tier a client asks for by `word` (the request's `service_tier`, or the header the
    /// operator names): `Some(None)` for `auto` (the provider's choice, which may be any tier),
    /// `None` for a word no provider knows.
    pub fn asked(word: &str) -> Option<Option<ServiceTier>> {
        Some(match word {
            "auto" => None,
            // `OpenAI`'s scale tier is a commitment billed at the standard rates.
            "default" | "standard" | "standard_only" | "scale" => Some(ServiceTier::Standard),
            "priority" => Some(ServiceTier::Priority),
            "flex" => Some(ServiceTier::Flex),
            _ => return None,
        })
    }

    /// The tier a provider's reply says it served (`OpenAI`'s top-level `service_tier`,
    /// Anthropic's `usage.service_tier`); `None` for a word it may add later.
    pub fn served(word: &str) -> Option<ServiceTier> {
        match word {
            "default" | "standard" | "scale" | "batch" => Some(ServiceTier::Standard),
            "priority" => Some(ServiceTier::Priority),
            "flex" => Some(ServiceTier::Flex),
            _ => None,
        }
    }

    /// Parses a name [`as_str`](Self::as_str) wrote.
    pub fn parse(name: &str) -> Option<ServiceTier> {
        [
            ServiceTier::Standard,
            ServiceTier::Priority,
            ServiceTier::Flex,
        ]
        .into_iter()
        .find(|tier| tier.as_str() == name)
    }

    /// The tier's name in the catalogue and the call log.
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceTier::Standard => "standard",
            ServiceTier::Priority => "priority",
            ServiceTier::Flex => "flex",
        }
    }
}
