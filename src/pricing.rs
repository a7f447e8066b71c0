//! What a call costs: a price per call, prices per million tokens, or both.
//!
//! Token prices are kept exactly, in millionths of a credit per million tokens, so a call's
//! cost is an exact sum of whole numbers, rounded up to a whole credit once, at the end. Usage
//! comes in disjoint kinds ([`TokenUsage`]), each priced once: cached input is not also
//! charged as input, and 1-hour cache writes have their own price.
//!
//! ```
//! use model_gateway::{Credits, pricing::{Pricing, TokenPrices, TokenRate}};
//! use model_gateway::protocol::TokenUsage;
//!
//! // 250 credits per million input tokens, 1000 per million output tokens, 125 cached.
//! let prices = TokenPrices::new(TokenRate::per_million(250.0).unwrap(), TokenRate::per_million(1000.0).unwrap())
//!     .with_cache_read(TokenRate::per_million(125.0).unwrap());
//! let pricing = Pricing::tokens(prices);
//! let usage = TokenUsage { input_tokens: Some(10_000), output_tokens: Some(2_000), cache_read_tokens: Some(4_000), ..TokenUsage::default() };
//! // 10,000 × 250 + 2,000 × 1,000 + 4,000 × 125 = 5,000,000 per million: 5 credits.
//! assert_eq!(pricing.cost(&usage), Credits::new(5));
//! ```

use serde::Serialize;

use crate::credits::Credits;
use crate::money::Money;
pub use crate::protocol::ServiceTier;
use crate::protocol::TokenUsage;
use crate::protocol::tokens::BYTES_PER_TOKEN;
pub use crate::protocol::tokens::{counted_text_tokens, estimated_text_tokens};

/// Millionths of a credit: the unit token prices are kept in.
const MICROS: u128 = 1_000_000;

/// Tokens a token price is given for.
const PER_TOKENS: u128 = 1_000_000;

/// The highest token price the catalogue takes, in credits per million tokens: far above any
/// real price, low enough that no sum of a call's tokens can overflow.
pub const MAX_TOKEN_RATE: f64 = 1e9;

/// A price in credits per million tokens, kept to a millionth of a credit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TokenRate(u64);

impl TokenRate {
    /// Free.
    pub const ZERO: TokenRate = TokenRate(0);

    /// `credits` per million tokens, rounded to a millionth of a credit; `None` when it is
    /// negative, not finite, or above [`MAX_TOKEN_RATE`].
    pub fn per_million(credits: f64) -> Option<TokenRate> {
        if !credits.is_finite() || !(0.0..=MAX_TOKEN_RATE).contains(&credits) {
            return None;
        }
        // At most 1e15 after scaling: exact in an f64 and in a u64.
        Some(TokenRate((credits * MICROS as f64).round() as u64))
    }

    /// The price in credits per million tokens.
    pub fn credits_per_million(self) -> f64 {
        self.0 as f64 / MICROS as f64
    }

    /// What `tokens` cost at this price, in millionths of a credit per million tokens (exact).
    fn of(self, tokens: u64) -> u128 {
        u128::from(self.0) * u128::from(tokens)
    }
}

impl Serialize for TokenRate {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(self.credits_per_million())
    }
}

/// Prices per million tokens, by kind. A kind without its own price is charged at the input
/// price (a provider's cache discount is the operator's to pass on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct TokenPrices {
    /// Input tokens that were neither read from nor written to a cache.
    pub input: TokenRate,
    /// Output tokens, reasoning included.
    pub output: TokenRate,
    /// Input tokens read from the provider's cache.
    pub cache_read: TokenRate,
    /// Input tokens written to the provider's cache for 5 minutes (Anthropic's default).
    pub cache_write: TokenRate,
    /// Input tokens written to the provider's cache for an hour.
    pub cache_write_1h: TokenRate,
}

impl TokenPrices {
    /// `input` and `output` prices; the cache kinds at the input price.
    pub fn new(input: TokenRate, output: TokenRate) -> TokenPrices {
        TokenPrices {
            input,
            output,
            cache_read: input,
            cache_write: input,
            cache_write_1h: input,
        }
    }

    /// With a price for cache reads.
    #[must_use]
    pub fn with_cache_read(mut self, rate: TokenRate) -> TokenPrices {
        self.cache_read = rate;
        self
    }

    /// With a price for 5-minute cache writes.
    #[must_use]
    pub fn with_cache_write(mut self, rate: TokenRate) -> TokenPrices {
        self.cache_write = rate;
        self
    }

    /// With a price for 1-hour cache writes.
    #[must_use]
    pub fn with_cache_write_1h(mut self, rate: TokenRate) -> TokenPrices {
        self.cache_write_1h = rate;
        self
    }

    /// What `usage` costs, in millionths of a credit per million tokens (exact).
    fn of(&self, usage: &TokenUsage) -> u128 {
        let count = |tokens: Option<i64>| u64::try_from(tokens.unwrap_or(0)).unwrap_or(0);
        self.input.of(count(usage.input_tokens))
            + self.output.of(count(usage.output_tokens))
            + self.cache_read.of(count(usage.cache_read_tokens))
            + self.cache_write.of(count(usage.cache_write_tokens))
            + self.cache_write_1h.of(count(usage.cache_write_1h_tokens))
    }

    /// The most `input` tokens in (at the dearest input kind) and `output` out cost, exact.
    fn ceiling(&self, input: u64, output: u64) -> u128 {
        let dearest_input = self
            .input
            .max(self.cache_read)
            .max(self.cache_write)
            .max(self.cache_write_1h);
        dearest_input.of(input) + self.output.of(output)
    }
}

/// Which service tiers a call could be served at, for its reservation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TierReach {
    /// The client named no tier (or `auto`): the provider may serve it at any.
    #[default]
    Any,
    /// The client asked for this tier: served at it, or at the standard tier.
    Asked(ServiceTier),
}

/// Other prices for the whole of a call whose input passes a threshold, as providers price long
/// context (Anthropic above 200k input tokens, `OpenAI` above 272k).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct LongContext {
    /// Input tokens (every kind: cached, written and uncached together) a call may hold at
    /// the table's own prices; one more and the whole call is priced at [`prices`](Self::prices).
    pub above: u64,
    /// The prices of such a call.
    pub prices: TokenPrices,
}

/// One tier's token prices, and its long-context prices if it has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct TokenTable {
    /// The prices of a call whose input is within [`long_context`](Self::long_context)'s
    /// threshold (or of every call, without one).
    #[serde(flatten)]
    pub prices: TokenPrices,
    /// The prices of a call whose input passes a threshold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub long_context: Option<LongContext>,
}

impl TokenTable {
    /// A table without long-context prices.
    pub fn flat(prices: TokenPrices) -> TokenTable {
        TokenTable {
            prices,
            long_context: None,
        }
    }

    /// The prices of a call with `input` tokens in.
    fn for_input(&self, input: u64) -> &TokenPrices {
        match &self.long_context {
            Some(long) if input > long.above => &long.prices,
            _ => &self.prices,
        }
    }

    /// The most a call of up to `input` tokens in and `output` out costs at this table, exact.
    fn ceiling(&self, input: u64, output: u64) -> u128 {
        let base = self.prices.ceiling(input, output);
        match &self.long_context {
            Some(long) if input > long.above => base.max(long.prices.ceiling(input, output)),
            _ => base,
        }
    }
}

/// Token prices by service tier and context length: for a sale price in credits, for a cost
/// price in the operator's currency (the unit is the owner's; the rules are the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct TieredPrices {
    /// The standard tier's prices (what every call is priced at unless a tier below applies).
    #[serde(flatten)]
    pub standard: TokenTable,
    /// Prices of a call served at priority; unset: the standard prices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<TokenTable>,
    /// Prices of a call served at flex; unset: the standard prices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flex: Option<TokenTable>,
}

impl TieredPrices {
    /// One flat table for every tier and length.
    pub fn flat(prices: TokenPrices) -> TieredPrices {
        TieredPrices {
            standard: TokenTable::flat(prices),
            priority: None,
            flex: None,
        }
    }

    /// The table of `tier`: its own, else the standard one.
    pub fn table(&self, tier: ServiceTier) -> &TokenTable {
        let own = match tier {
            ServiceTier::Standard => None,
            ServiceTier::Priority => self.priority.as_ref(),
            ServiceTier::Flex => self.flex.as_ref(),
        };
        own.unwrap_or(&self.standard)
    }

    /// The prices `usage` is charged at: its tier's table ([`TokenUsage::service_tier`], else
    /// standard), and in it the long-context prices when its input passes their threshold.
    pub fn prices_for(&self, usage: &TokenUsage) -> &TokenPrices {
        let input = u64::try_from(usage.all_input_tokens().unwrap_or(0)).unwrap_or(0);
        self.table(usage.service_tier.unwrap_or_default())
            .for_input(input)
    }

    /// What `usage` costs, exact, in millionths of the unit per million tokens.
    fn of(&self, usage: &TokenUsage) -> u128 {
        self.prices_for(usage).of(usage)
    }

    /// The most a call can cost at any tier in `reach`, exact.
    fn ceiling(&self, input: u64, output: u64, reach: TierReach) -> u128 {
        let tiers: &[ServiceTier] = match reach {
            TierReach::Any => &[
                ServiceTier::Standard,
                ServiceTier::Priority,
                ServiceTier::Flex,
            ],
            TierReach::Asked(ServiceTier::Standard) => &[ServiceTier::Standard],
            TierReach::Asked(ServiceTier::Priority) => {
                &[ServiceTier::Standard, ServiceTier::Priority]
            }
            TierReach::Asked(ServiceTier::Flex) => &[ServiceTier::Standard, ServiceTier::Flex],
        };
        tiers
            .iter()
            .map(|tier| self.table(*tier).ceiling(input, output))
            .max()
            .unwrap_or(0)
    }
}

/// How a model is charged: a price per call, token prices, or a base per call plus tokens;
/// tiers, long-context prices and a minimum charge besides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Pricing {
    /// Credits per successful call (zero when the model is priced by tokens alone).
    pub per_call: Credits,
    /// Prices per million tokens, if the model is priced by tokens.
    pub tokens: Option<TieredPrices>,
    /// The least a successful call is charged (never below one credit).
    pub minimum: Credits,
}

impl Pricing {
    /// A price per call, as the specified contract has it.
    pub fn per_call(price: Credits) -> Pricing {
        Pricing {
            per_call: price,
            tokens: None,
            minimum: MIN_CHARGE,
        }
    }

    /// Token prices alone.
    pub fn tokens(prices: TokenPrices) -> Pricing {
        Pricing::base_and_tokens(Credits::ZERO, prices)
    }

    /// A base per call plus token prices.
    pub fn base_and_tokens(per_call: Credits, prices: TokenPrices) -> Pricing {
        Pricing::tiered(per_call, TieredPrices::flat(prices))
    }

    /// A base per call plus token prices by tier and length.
    pub fn tiered(per_call: Credits, tokens: TieredPrices) -> Pricing {
        Pricing {
            per_call,
            tokens: Some(tokens),
            minimum: MIN_CHARGE,
        }
    }

    /// With a minimum charge per call (at least one credit).
    #[must_use]
    pub fn with_minimum(mut self, minimum: Credits) -> Pricing {
        self.minimum = minimum.max(MIN_CHARGE);
        self
    }

    /// Whether what a call costs depends on what the provider reports.
    pub fn is_metered(&self) -> bool {
        self.tokens.is_some()
    }

    /// What a call with `usage` costs: the base plus the exact sum of its tokens' prices (at
    /// the tier and length its usage says), rounded up to a whole credit once; at least the
    /// minimum, and at least one credit (a successful call is never free, and the ledger holds
    /// no empty charge).
    pub fn cost(&self, usage: &TokenUsage) -> Credits {
        let tokens = self.tokens.map_or(0, |prices| prices.of(usage));
        self.per_call
            .plus(whole_credits(tokens))
            .max(self.minimum)
            .max(MIN_CHARGE)
    }

    /// The most a call can cost with `input` tokens in and at most `output` tokens out, all
    /// priced at the dearest input kind and the output price of the dearest tier and length it
    /// could reach: what a reservation holds.
    pub fn ceiling(&self, input: u64, output: u64) -> Credits {
        self.ceiling_reaching(input, output, TierReach::Any)
    }

    /// [`ceiling`](Self::ceiling) for a call that can reach the tiers of `reach`.
    pub fn ceiling_reaching(&self, input: u64, output: u64, reach: TierReach) -> Credits {
        let Some(prices) = self.tokens else {
            return self.per_call.max(self.minimum);
        };
        self.per_call
            .plus(whole_credits(prices.ceiling(input, output, reach)))
            .max(self.minimum)
            .max(MIN_CHARGE)
    }
}

/// What a call costs the operator at his provider, in his currency: a price per call, token
/// prices (by tier and length, as sale prices), a minimum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct CostPrices {
    /// Paid per successful call.
    #[serde(rename = "call")]
    pub per_call: Money,
    /// Paid per million tokens, in millionths of the currency's unit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TieredPrices>,
    /// The least a call costs.
    pub minimum: Money,
}

impl CostPrices {
    /// What a call with `usage` costs the operator: the per-call price plus the exact sum of
    /// its tokens' prices, rounded half up to a billionth of the unit once; at least the
    /// minimum.
    pub fn cost(&self, usage: &TokenUsage) -> Money {
        // Millionths of a unit per million tokens: a thousandth of a billionth each.
        let exact = self.tokens.map_or(0, |prices| prices.of(usage));
        let nanos = i128::try_from(exact.saturating_add(500) / 1_000).unwrap_or(i128::MAX);
        self.per_call
            .plus(Money::saturating(nanos))
            .max(self.minimum)
    }
}

/// A call of a token-priced model, as its reservation saw it: what its charge is worked out
/// from, beside the usage its provider reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metered {
    /// The model's prices.
    pub pricing: Pricing,
    /// Input tokens estimated from the request body (see [`estimated_input_tokens`]): what a
    /// call whose provider reported no input is charged for.
    pub input_estimate: u64,
    /// What the reservation holds: the call's ceiling, the most it is expected to cost.
    pub reserved: Credits,
    /// The most input a report may claim: the model's context window, else the request's
    /// input ceiling ([`input_ceiling_tokens`]).
    pub input_bound: u64,
    /// The most output a report may claim: the call's output ceiling (its largest output limit,
    /// or the model's `max_output_tokens`, times the replies asked for).
    pub output_bound: u64,
    /// The tier the client asked for: what a report that names no tier is priced at.
    pub asked_tier: Option<ServiceTier>,
}

/// What a metered call is charged, and whether its provider's report was trusted (see
/// [`store::rules::usage::charge`](crate::store::rules::usage::charge)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// What the usage costs (or the ceiling, for a report that failed the checks).
    pub cost: Credits,
    /// Whether the report failed the checks ([`Metered::check`]).
    pub usage_rejected: bool,
    /// The usage as it was priced: the tier asked for where the report named none, the input
    /// estimated where it gave none (then marked [`estimated`](TokenUsage::estimated)).
    pub usage: TokenUsage,
}

/// Why a usage report is not trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implausible {
    /// A count that is no count: below zero, not a whole number, not a number, or cached input
    /// beyond the input it is part of.
    Malformed,
    /// More input than the call could send.
    Input,
    /// More output than the call allowed, or more reasoning than output.
    Output,
}

impl Metered {
    /// Checks a usage report against what the call could use: each count a whole number from
    /// zero up, cache reads and writes inside the input they are part of, input within
    /// [`input_bound`](Self::input_bound), output within [`output_bound`](Self::output_bound),
    /// reasoning within output.
    pub fn check(&self, usage: &TokenUsage) -> Result<(), Implausible> {
        let counts = [
            usage.input_tokens,
            usage.output_tokens,
            usage.cache_read_tokens,
            usage.cache_write_tokens,
            usage.cache_write_1h_tokens,
            usage.reasoning_tokens,
        ];
        if usage.malformed || counts.iter().flatten().any(|count| *count < 0) {
            return Err(Implausible::Malformed);
        }
        let input: i128 = [
            usage.input_tokens,
            usage.cache_read_tokens,
            usage.cache_write_tokens,
            usage.cache_write_1h_tokens,
        ]
        .iter()
        .flatten()
        .map(|count| i128::from(*count))
        .sum();
        if input > i128::from(self.input_bound) {
            return Err(Implausible::Input);
        }
        let output = usage.output_tokens.unwrap_or(0);
        if !usage.estimated && i128::from(output) > i128::from(self.output_bound) {
            return Err(Implausible::Output);
        }
        if usage.reasoning_tokens.unwrap_or(0) > output && usage.output_tokens.is_some() {
            return Err(Implausible::Output);
        }
        Ok(())
    }
}

/// The least a successful call is charged.
const MIN_CHARGE: Credits = Credits::new(1);

/// Millionths of a credit per million tokens as whole credits, rounded up; saturating.
fn whole_credits(micros_per_million: u128) -> Credits {
    let credits = micros_per_million.div_ceil(MICROS * PER_TOKENS);
    Credits::new(i64::try_from(credits).unwrap_or(i64::MAX))
}

/// Input tokens a request body can hold at most, estimated from its size before the provider
/// counts them: a token is about four bytes of text in the `OpenAI` and Anthropic tokenizers, and
/// the estimate is rounded up. A reservation that turns out low is settled as
/// [`Ledger::settle`](crate::store::Ledger::settle) says (the account pays what it can, the
/// entry records the rest).
pub fn estimated_input_tokens(body_bytes: usize) -> u64 {
    (body_bytes as u64).div_ceil(BYTES_PER_TOKEN)
}

/// Input tokens a request body can hold at most, as the provider will count them: a
/// tokenizer that works on bytes (`OpenAI`'s, Anthropic's, Gemini's with byte fallback) makes
/// a token of at least one byte of text, so a body's length bounds its text's tokens (the
/// JSON around the text is longer than the few tokens a provider adds for each message); each
/// image, audio or file part adds [`MEDIA_PART_TOKENS`], and every request
/// [`PROVIDER_PROMPT_TOKENS`], since a part that names a picture by
/// its address is short and costs the provider's count for a picture. What a reservation
/// holds for input.
pub fn input_ceiling_tokens(body: &[u8]) -> u64 {
    let parts = media_parts(body);
    (body.len() as u64)
        .saturating_add(parts.saturating_mul(MEDIA_PART_TOKENS))
        .saturating_add(PROVIDER_PROMPT_TOKENS)
}

/// Tokens a provider may add to a request of its own (Anthropic's system prompt for tool use
/// is a few hundred), which a call's input ceiling holds beside the body's.
pub const PROVIDER_PROMPT_TOKENS: u64 = 1_024;

/// Tokens a call's ceiling holds for each image, audio or file part of its request: above
/// what `OpenAI` and Anthropic count for one picture. A document of many pages can cost more;
/// its provider's report is then charged up to the ceiling.
pub const MEDIA_PART_TOKENS: u64 = 8_192;

/// The image, audio and file parts of a request, in any protocol's spelling (Gemini's
/// `inlineData` and `fileData` too): the type names
/// and keys as whole quoted strings (a quote inside a JSON string is escaped, so these bytes
/// never stand inside one). A part that names its kind twice (`"type":"image_url",
/// "image_url":{...}`) counts twice: a ceiling may be high, never low.
fn media_parts(body: &[u8]) -> u64 {
    use std::sync::LazyLock;
    // Most requests name no media at all: four quick scans say so before the full one.
    static KINDS: LazyLock<[memchr::memmem::Finder<'static>; 5]> = LazyLock::new(|| {
        [
            b"image".as_slice(),
            b"file",
            b"audio",
            b"document",
            b"inline",
        ]
        .map(memchr::memmem::Finder::new)
    });
    if !KINDS.iter().any(|kind| kind.find(body).is_some()) {
        return 0;
    }
    static PARTS: LazyLock<aho_corasick::AhoCorasick> = LazyLock::new(|| {
        aho_corasick::AhoCorasick::new([
            "\"image\"",
            "\"image_url\"",
            "\"input_image\"",
            "\"file\"",
            "\"input_file\"",
            "\"input_audio\"",
            "\"document\"",
            // Gemini's parts, as its REST API and its SDKs spell them.
            "\"inlineData\"",
            "\"inline_data\"",
            "\"fileData\"",
            "\"file_data\"",
        ])
        .expect("fixed patterns build")
    });
    PARTS.find_iter(body).count() as u64
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rate(credits: f64) -> TokenRate {
        TokenRate::per_million(credits).expect("a valid rate")
    }

    fn usage(input: i64, output: i64) -> TokenUsage {
        TokenUsage {
            input_tokens: Some(input),
            output_tokens: Some(output),
            ..TokenUsage::default()
        }
    }

    #[test]
    fn rates_refuse_negative_non_finite_and_absurd_prices() {
        for bad in [-1.0, -0.000_001, f64::NAN, f64::INFINITY, 1e10] {
            assert_eq!(TokenRate::per_million(bad), None, "{bad}");
        }
        assert_eq!(rate(0.15).credits_per_million(), 0.15);
        assert_eq!(rate(0.0), TokenRate::ZERO);
    }

    #[test]
    fn a_call_costs_the_exact_sum_rounded_up_once() {
        // 0.15 per million, 3 calls of 1 token each would round up to 3 credits; one call of
        // 3 tokens is 0.45 per million tokens of a credit: rounded once, to 1.
        let pricing = Pricing::tokens(TokenPrices::new(rate(0.15), rate(0.6)));
        assert_eq!(pricing.cost(&usage(3, 0)), Credits::new(1));
        // 1,000,000 × 0.15 + 1,000,000 × 0.6 = 0.75: one credit, not 0 + 1 rounded apart.
        assert_eq!(pricing.cost(&usage(1_000_000, 1_000_000)), Credits::new(1));
        // Exactly 3 credits stays 3.
        assert_eq!(pricing.cost(&usage(20_000_000, 0)), Credits::new(3));
        // A call is never free.
        assert_eq!(pricing.cost(&usage(0, 0)), Credits::new(1));
        let free = Pricing::tokens(TokenPrices::new(TokenRate::ZERO, TokenRate::ZERO));
        assert_eq!(free.cost(&usage(5, 5)), Credits::new(1));
        assert_eq!(free.ceiling(5, 5), Credits::new(1));
    }

    #[test]
    fn a_base_per_call_is_added_to_the_tokens() {
        let pricing =
            Pricing::base_and_tokens(Credits::new(2), TokenPrices::new(rate(1.0), rate(1.0)));
        assert_eq!(pricing.cost(&usage(0, 0)), Credits::new(2));
        assert_eq!(pricing.cost(&usage(1, 0)), Credits::new(3));
        assert_eq!(
            Pricing::per_call(Credits::new(5)).cost(&usage(9_999_999, 9_999_999)),
            Credits::new(5)
        );
    }

    #[test]
    fn each_kind_of_token_is_priced_once_at_its_own_price() {
        let prices = TokenPrices::new(rate(3.0), rate(15.0))
            .with_cache_read(rate(0.3))
            .with_cache_write(rate(3.75))
            .with_cache_write_1h(rate(6.0));
        let pricing = Pricing::tokens(prices);
        let usage = TokenUsage {
            input_tokens: Some(1_000_000),
            output_tokens: Some(1_000_000),
            cache_read_tokens: Some(10_000_000),
            cache_write_tokens: Some(1_000_000),
            cache_write_1h_tokens: Some(1_000_000),
            reasoning_tokens: Some(500_000),
            estimated: false,
            malformed: false,
            service_tier: None,
        };
        // 3 + 15 + 3 + 3.75 + 6 = 30.75: reasoning is inside output, not added again.
        assert_eq!(pricing.cost(&usage), Credits::new(31));
        let only_1h = TokenUsage {
            cache_write_1h_tokens: Some(1_000_000),
            ..TokenUsage::default()
        };
        assert_eq!(
            pricing.cost(&only_1h),
            Credits::new(6),
            "1-hour writes at their own price"
        );
    }

    #[test]
    fn kinds_without_a_price_are_charged_at_the_input_price() {
        let pricing = Pricing::tokens(TokenPrices::new(rate(2.0), rate(8.0)));
        let cached = TokenUsage {
            cache_read_tokens: Some(1_000_000),
            cache_write_tokens: Some(1_000_000),
            cache_write_1h_tokens: Some(1_000_000),
            ..TokenUsage::default()
        };
        assert_eq!(pricing.cost(&cached), Credits::new(6));
    }

    #[test]
    fn the_ceiling_prices_input_at_its_dearest_kind() {
        let prices = TokenPrices::new(rate(1.0), rate(4.0)).with_cache_write_1h(rate(2.0));
        let pricing = Pricing::tokens(prices);
        assert_eq!(pricing.ceiling(1_000_000, 1_000_000), Credits::new(6));
        assert_eq!(
            Pricing::per_call(Credits::new(3)).ceiling(1_000_000, 1_000_000),
            Credits::new(3)
        );
    }

    #[test]
    #[cfg(feature = "tokenizer")]
    fn forwarded_text_is_counted_with_openais_tokenizer() {
        assert_eq!(counted_text_tokens(""), 0);
        assert_eq!(counted_text_tokens("Hello"), 1);
        assert_eq!(counted_text_tokens("Hello, world!"), 4);
    }

    /// The README's worked example.
    #[test]
    fn the_readmes_worked_example_costs_4_of_the_15_it_reserved() {
        let prices = TokenPrices::new(rate(250.0), rate(1_000.0)).with_cache_read(rate(125.0));
        let pricing = Pricing::tokens(prices);
        let usage = TokenUsage {
            input_tokens: Some(4_000),
            cache_read_tokens: Some(8_000),
            output_tokens: Some(1_500),
            reasoning_tokens: Some(500),
            ..TokenUsage::default()
        };
        assert_eq!(pricing.cost(&usage), Credits::new(4));
        let body = vec![b'a'; 48_000];
        assert_eq!(input_ceiling_tokens(&body), 49_024);
        assert_eq!(
            pricing.ceiling(input_ceiling_tokens(&body), 2_000),
            Credits::new(15)
        );
    }

    #[test]
    fn input_is_estimated_from_the_body_rounded_up() {
        assert_eq!(estimated_input_tokens(0), 0);
        assert_eq!(estimated_input_tokens(1), 1);
        assert_eq!(estimated_input_tokens(8), 2);
        assert_eq!(estimated_input_tokens(9), 3);
    }

    #[test]
    fn the_input_ceiling_is_a_token_a_byte_and_a_bound_a_media_part() {
        let added = PROVIDER_PROMPT_TOKENS;
        assert_eq!(input_ceiling_tokens(b"{}"), 2 + added);
        let text = br#"{"messages":[{"role":"user","content":"say \"image\" twice"}]}"#;
        assert_eq!(
            input_ceiling_tokens(text),
            text.len() as u64 + added,
            "escaped quotes are text"
        );
        let chat = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/a.png"}}]}]}"#;
        assert_eq!(
            input_ceiling_tokens(chat),
            chat.len() as u64 + 2 * MEDIA_PART_TOKENS + added
        );
        let claude = br#"{"messages":[{"role":"user","content":[{"type":"image","source":{}},{"type":"document","source":{}}]}]}"#;
        assert_eq!(
            input_ceiling_tokens(claude),
            claude.len() as u64 + 2 * MEDIA_PART_TOKENS + added
        );
        // Gemini's parts name no media type the others would: a PDF inline, a video by URI.
        let gemini = br#"{"contents":[{"parts":[{"inlineData":{"mimeType":"application/pdf","data":"JVBE"}},{"fileData":{"fileUri":"gs://b/v.mp4"}}]}]}"#;
        assert_eq!(
            input_ceiling_tokens(gemini),
            gemini.len() as u64 + 2 * MEDIA_PART_TOKENS + added
        );
    }

    /// Sale prices of 300/1500 per million, the whole call at 600/2250 above 200,000 input
    /// tokens; priority at 510/2550; flex at 150/750; a minimum of 2 credits.
    fn tiered() -> Pricing {
        let long = LongContext {
            above: 200_000,
            prices: TokenPrices::new(rate(600.0), rate(2_250.0)),
        };
        Pricing::tiered(
            Credits::ZERO,
            TieredPrices {
                standard: TokenTable {
                    prices: TokenPrices::new(rate(300.0), rate(1_500.0))
                        .with_cache_read(rate(30.0)),
                    long_context: Some(long),
                },
                priority: Some(TokenTable::flat(TokenPrices::new(
                    rate(510.0),
                    rate(2_550.0),
                ))),
                flex: Some(TokenTable::flat(TokenPrices::new(rate(150.0), rate(750.0)))),
            },
        )
        .with_minimum(Credits::new(2))
    }

    #[test]
    fn the_long_context_tier_prices_the_whole_call_from_one_token_past_its_threshold() {
        let pricing = tiered();
        // Input counts every kind: 150,000 uncached + 50,000 cached = 200,000, at the threshold.
        let at = TokenUsage {
            input_tokens: Some(150_000),
            cache_read_tokens: Some(50_000),
            output_tokens: Some(10_000),
            ..TokenUsage::default()
        };
        // 150,000 × 300 + 50,000 × 30 + 10,000 × 1,500 = 61.5 credits: 62.
        assert_eq!(pricing.cost(&at), Credits::new(62));
        let below = TokenUsage {
            input_tokens: Some(149_999),
            ..at
        };
        assert_eq!(pricing.cost(&below), Credits::new(62), "61.4997: 62");
        // One more: the whole call at 600/2250, cached input at the long table's input price.
        let above = TokenUsage {
            input_tokens: Some(150_001),
            ..at
        };
        // 200,001 × 600 + 10,000 × 2,250 = 142.5006: 143.
        assert_eq!(pricing.cost(&above), Credits::new(143));
    }

    #[test]
    fn a_call_is_priced_at_the_tier_it_was_served_at_and_never_below_the_minimum() {
        let pricing = tiered();
        let usage = |tier| TokenUsage {
            input_tokens: Some(100_000),
            output_tokens: Some(10_000),
            service_tier: tier,
            ..TokenUsage::default()
        };
        // 30 + 15 = 45; priority 51 + 25.5 = 76.5; flex 15 + 7.5 = 22.5.
        assert_eq!(pricing.cost(&usage(None)), Credits::new(45));
        assert_eq!(
            pricing.cost(&usage(Some(ServiceTier::Standard))),
            Credits::new(45)
        );
        assert_eq!(
            pricing.cost(&usage(Some(ServiceTier::Priority))),
            Credits::new(77)
        );
        assert_eq!(
            pricing.cost(&usage(Some(ServiceTier::Flex))),
            Credits::new(23)
        );
        // A tier the model has no prices for is the standard tier.
        let flat = Pricing::tokens(TokenPrices::new(rate(300.0), rate(1_500.0)));
        assert_eq!(
            flat.cost(&usage(Some(ServiceTier::Priority))),
            Credits::new(45)
        );
        // A tiny call pays the minimum, not one credit.
        assert_eq!(pricing.cost(&usage_of(1, 1)), Credits::new(2));
        assert_eq!(pricing.ceiling(1, 1), Credits::new(2));
    }

    fn usage_of(input: i64, output: i64) -> TokenUsage {
        usage(input, output)
    }

    #[test]
    fn the_ceiling_takes_the_dearest_tier_the_call_can_reach() {
        let pricing = tiered();
        // 100,000 in, 10,000 out.
        let any = pricing.ceiling_reaching(100_000, 10_000, TierReach::Any);
        let flex = pricing.ceiling_reaching(100_000, 10_000, TierReach::Asked(ServiceTier::Flex));
        let standard =
            pricing.ceiling_reaching(100_000, 10_000, TierReach::Asked(ServiceTier::Standard));
        assert_eq!(
            any,
            Credits::new(77),
            "priority may answer a call that named no tier"
        );
        assert_eq!(
            flex,
            Credits::new(45),
            "flex, or standard when flex is full"
        );
        assert_eq!(standard, Credits::new(45));
        // An input ceiling past the threshold holds the long-context prices.
        assert_eq!(
            pricing.ceiling_reaching(200_001, 10_000, TierReach::Asked(ServiceTier::Standard)),
            Credits::new(143)
        );
    }

    #[test]
    fn cost_prices_are_exact_to_the_billionth_rounded_once() {
        let cost = CostPrices {
            per_call: Money::from_nanos(1_000),
            tokens: Some(TieredPrices::flat(
                TokenPrices::new(rate(2.5), rate(10.0)).with_cache_read(rate(0.25)),
            )),
            minimum: Money::ZERO,
        };
        let usage = TokenUsage {
            input_tokens: Some(1_234),
            cache_read_tokens: Some(10_000),
            output_tokens: Some(567),
            ..TokenUsage::default()
        };
        // 1,234 × 2.5 + 10,000 × 0.25 + 567 × 10 = 11,255 millionths: 0.011255, plus 0.000001.
        assert_eq!(cost.cost(&usage), Money::from_nanos(11_256_000));
        // 0.3 of a billionth rounds to nothing; 0.6 rounds up.
        let tiny = CostPrices {
            per_call: Money::ZERO,
            tokens: Some(TieredPrices::flat(TokenPrices::new(
                rate(0.000_3),
                rate(0.000_3),
            ))),
            minimum: Money::from_nanos(0),
        };
        assert_eq!(tiny.cost(&usage_of(1, 0)), Money::ZERO);
        assert_eq!(tiny.cost(&usage_of(1, 1)), Money::from_nanos(1));
        let floor = CostPrices {
            minimum: Money::from_nanos(5),
            ..tiny
        };
        assert_eq!(floor.cost(&usage_of(1, 1)), Money::from_nanos(5));
    }

    /// docs/pricing.md's worked example with a cost, a tier and the margin.
    #[test]
    fn the_pricing_docs_worked_example_with_a_cost_a_tier_and_the_margin() {
        let catalogue = crate::Catalogue::from_toml(
            r#"
            currency = "USD"
            credit_value = 0.01
            [[upstreams]]
            name = "anthropic"
            kind = "anthropic"
            base_url = "https://api.anthropic.com"
            api_key_env = "K"
            [[models]]
            name = "claude-sonnet"
            protocol = "messages"
            upstream = "anthropic"
            max_output_tokens = 8192
            [models.tokens]
            input = 360
            output = 1800
            cache_read = 36
            minimum = 1
            long_context = { above = 200000, input = 720, output = 2700 }
            priority = { input = 600, output = 3000 }
            [models.cost]
            input = 3.0
            output = 15.0
            cache_read = 0.3
            cache_write = 3.75
            cache_write_1h = 6.0
            long_context = { above = 200000, input = 6.0, output = 22.5 }
            "#,
        )
        .unwrap();
        let model = catalogue.model("claude-sonnet").unwrap();
        let cost = model.channels[0].cost.unwrap();
        let call = |input: i64, cached: i64| TokenUsage {
            input_tokens: Some(input),
            cache_read_tokens: Some(cached),
            output_tokens: Some(3_000),
            ..TokenUsage::default()
        };
        let usage = call(1_000, 100_000);
        let charged = model.pricing.cost(&usage);
        assert_eq!(charged, Credits::new(10));
        assert_eq!(cost.cost(&usage), "0.078".parse().unwrap());
        let margin = model
            .credit_value
            .unwrap()
            .times(charged)
            .minus(cost.cost(&usage));
        assert_eq!(margin, "0.022".parse().unwrap());
        // 200,000 in all at the table's own prices; 200,001 at the long-context ones.
        assert_eq!(
            model.pricing.cost(&call(100_000, 100_000)),
            Credits::new(45)
        );
        assert_eq!(
            model.pricing.cost(&call(100_001, 100_000)),
            Credits::new(153)
        );
    }

    proptest! {
        /// A cost is never below the exact sum, and less than a credit above it; the ceiling of
        /// a call is never below its cost when the usage stays within what it was given.
        #[test]
        fn costs_round_up_once_and_stay_under_their_ceiling(
            input in 0u64..5_000_000, output in 0u64..5_000_000,
            cached in 0u64..5_000_000, written in 0u64..5_000_000, written_1h in 0u64..5_000_000,
            rates in prop::array::uniform5(0u64..100_000_000),
            base in 0i64..100,
        ) {
            let [i, o, r, w, w1] = rates.map(TokenRate);
            let prices = TokenPrices { input: i, output: o, cache_read: r, cache_write: w, cache_write_1h: w1 };
            let pricing = Pricing::base_and_tokens(Credits::new(base), prices);
            let usage = TokenUsage {
                input_tokens: Some(input as i64),
                output_tokens: Some(output as i64),
                cache_read_tokens: Some(cached as i64),
                cache_write_tokens: Some(written as i64),
                cache_write_1h_tokens: Some(written_1h as i64),
                reasoning_tokens: None,
                estimated: false,
                malformed: false,
                service_tier: None,
            };
            let exact = prices.of(&usage);
            let cost = pricing.cost(&usage).get();
            let scale = MICROS * PER_TOKENS;
            if cost > 1 || base > 0 {
                let tokens = (cost - base) as u128;
                prop_assert!(tokens * scale >= exact);
                prop_assert!(tokens * scale < exact + scale);
            } else {
                prop_assert!(exact <= scale, "one credit is the floor, not a rounding");
            }
            let ceiling = pricing.ceiling(input + cached + written + written_1h, output);
            prop_assert!(ceiling >= pricing.cost(&usage));
        }

        /// Whatever tier and length a call reaches within its reach, its cost is within its
        /// ceiling.
        #[test]
        fn the_ceiling_is_never_below_the_tier_reached(
            input in 0u64..400_000, cached in 0u64..100_000, output in 0u64..20_000,
            served in 0usize..4, asked in 0usize..4,
        ) {
            let pricing = tiered();
            let tiers = [None, Some(ServiceTier::Standard), Some(ServiceTier::Priority), Some(ServiceTier::Flex)];
            let asked = tiers[asked];
            // Served at the tier asked, or standard; any tier when none was asked.
            let served = match asked {
                None => tiers[served],
                Some(tier) => if served % 2 == 0 { Some(tier) } else { Some(ServiceTier::Standard) },
            };
            let usage = TokenUsage {
                input_tokens: Some(input as i64),
                cache_read_tokens: Some(cached as i64),
                output_tokens: Some(output as i64),
                service_tier: served,
                ..TokenUsage::default()
            };
            let reach = asked.map_or(TierReach::Any, TierReach::Asked);
            let ceiling = pricing.ceiling_reaching(input + cached, output, reach);
            prop_assert!(ceiling >= pricing.cost(&usage), "{usage:?} {reach:?}");
        }
    }
}
