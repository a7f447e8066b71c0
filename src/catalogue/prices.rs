//! The catalogue's price tables, as written and as checked: a model's sale prices
//! (`[models.tokens]`, credits per million tokens) and cost prices (`[models.cost]`, or a
//! channel's `cost`, in the catalogue's `currency`), each with its long-context and
//! service-tier tables and its minimum.

use serde::Deserialize;

use super::CatalogueError;
use crate::credits::Credits;
use crate::money::Money;
use crate::pricing::{
    CostPrices, LongContext, MAX_TOKEN_RATE, Pricing, TieredPrices, TokenPrices, TokenRate,
    TokenTable,
};

/// The rates of one table, by kind of token: `input` and `output`, the cache kinds at the input
/// price unless given.
#[derive(Debug, Default, Clone, Copy)]
struct Rates {
    input: Option<f64>,
    output: Option<f64>,
    cache_read: Option<f64>,
    cache_write: Option<f64>,
    cache_write_1h: Option<f64>,
}

/// A long-context table: `above` input tokens, the whole call at these rates.
#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct LongContextEntry {
    above: u64,
    input: Option<f64>,
    output: Option<f64>,
    cache_read: Option<f64>,
    cache_write: Option<f64>,
    cache_write_1h: Option<f64>,
}

/// A service tier's table (`priority`, `flex`), with its own long-context table if any.
#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct TierEntry {
    input: Option<f64>,
    output: Option<f64>,
    cache_read: Option<f64>,
    cache_write: Option<f64>,
    cache_write_1h: Option<f64>,
    long_context: Option<LongContextEntry>,
}

/// `[models.tokens]` (credits per million tokens) or `[models.cost]` and a channel's `cost` (the
/// operator's currency): rates by kind, a long-context table, `priority` and `flex` tables, a
/// minimum per call, and (cost only) a price per call.
#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct PriceTableEntry {
    call: Option<f64>,
    minimum: Option<f64>,
    input: Option<f64>,
    output: Option<f64>,
    cache_read: Option<f64>,
    cache_write: Option<f64>,
    cache_write_1h: Option<f64>,
    long_context: Option<LongContextEntry>,
    priority: Option<TierEntry>,
    flex: Option<TierEntry>,
}

impl PriceTableEntry {
    fn rates(&self) -> Rates {
        Rates {
            input: self.input,
            output: self.output,
            cache_read: self.cache_read,
            cache_write: self.cache_write,
            cache_write_1h: self.cache_write_1h,
        }
    }

    fn has_tokens(&self) -> bool {
        let rates = self.rates();
        [
            rates.input,
            rates.output,
            rates.cache_read,
            rates.cache_write,
            rates.cache_write_1h,
        ]
        .iter()
        .any(Option::is_some)
            || self.long_context.is_some()
            || self.priority.is_some()
            || self.flex.is_some()
    }
}

/// Builds one model's tables, naming it in every refusal.
pub(super) struct TableReader<'a> {
    pub(super) model: &'a str,
}

impl TableReader<'_> {
    fn rate(&self, kind: &'static str, value: f64) -> Result<TokenRate, CatalogueError> {
        TokenRate::per_million(value).ok_or_else(|| CatalogueError::InvalidTokenPrice {
            model: self.model.to_owned(),
            kind,
            value,
            max: MAX_TOKEN_RATE,
        })
    }

    fn refused(&self, problem: impl Into<String>) -> CatalogueError {
        CatalogueError::InvalidPrices {
            model: self.model.to_owned(),
            problem: problem.into(),
        }
    }

    /// A table of rates: `input` and `output` both given (in `table`, named for the refusal);
    /// the cache kinds at the input rate unless given.
    fn prices(&self, table: &str, rates: Rates) -> Result<TokenPrices, CatalogueError> {
        let (Some(input), Some(output)) = (rates.input, rates.output) else {
            return Err(self.refused(format!("{table} needs both `input` and `output`")));
        };
        let mut prices = TokenPrices::new(self.rate("input", input)?, self.rate("output", output)?);
        if let Some(value) = rates.cache_read {
            prices = prices.with_cache_read(self.rate("cache_read", value)?);
        }
        if let Some(value) = rates.cache_write {
            prices = prices.with_cache_write(self.rate("cache_write", value)?);
        }
        if let Some(value) = rates.cache_write_1h {
            prices = prices.with_cache_write_1h(self.rate("cache_write_1h", value)?);
        }
        Ok(prices)
    }

    fn long_context(
        &self,
        table: &str,
        entry: Option<&LongContextEntry>,
    ) -> Result<Option<LongContext>, CatalogueError> {
        let Some(entry) = entry else {
            return Ok(None);
        };
        if entry.above == 0 {
            return Err(self.refused(format!("`above` of {table}.long_context must be positive")));
        }
        let rates = Rates {
            input: entry.input,
            output: entry.output,
            cache_read: entry.cache_read,
            cache_write: entry.cache_write,
            cache_write_1h: entry.cache_write_1h,
        };
        Ok(Some(LongContext {
            above: entry.above,
            prices: self.prices(&format!("{table}.long_context"), rates)?,
        }))
    }

    fn tier(
        &self,
        table: &str,
        entry: Option<&TierEntry>,
    ) -> Result<Option<TokenTable>, CatalogueError> {
        let Some(entry) = entry else {
            return Ok(None);
        };
        let rates = Rates {
            input: entry.input,
            output: entry.output,
            cache_read: entry.cache_read,
            cache_write: entry.cache_write,
            cache_write_1h: entry.cache_write_1h,
        };
        Ok(Some(TokenTable {
            prices: self.prices(table, rates)?,
            long_context: self.long_context(table, entry.long_context.as_ref())?,
        }))
    }

    /// The token tables of `entry` (`table` names it for a refusal).
    fn tiered(&self, table: &str, entry: &PriceTableEntry) -> Result<TieredPrices, CatalogueError> {
        Ok(TieredPrices {
            standard: TokenTable {
                prices: self.prices(table, entry.rates())?,
                long_context: self.long_context(table, entry.long_context.as_ref())?,
            },
            priority: self.tier(&format!("{table}.priority"), entry.priority.as_ref())?,
            flex: self.tier(&format!("{table}.flex"), entry.flex.as_ref())?,
        })
    }

    /// The sale prices of `[models.tokens]` on top of `per_call`.
    pub(super) fn sale(
        &self,
        per_call: Credits,
        entry: &PriceTableEntry,
    ) -> Result<Pricing, CatalogueError> {
        const TABLE: &str = "[models.tokens]";
        if entry.call.is_some() {
            return Err(self.refused(format!(
                "{TABLE} takes no `call`; a price per call is the model's `price`"
            )));
        }
        let pricing = Pricing::tiered(per_call, self.tiered(TABLE, entry)?);
        match entry.minimum {
            None => Ok(pricing),
            Some(minimum) if minimum >= 1.0 && minimum.fract() == 0.0 && minimum < 1e15 => {
                Ok(pricing.with_minimum(Credits(minimum as i64)))
            }
            Some(minimum) => Err(self.refused(format!(
                "`minimum` of {TABLE} is {minimum}; a minimum charge is a whole number of credits, at least 1"
            ))),
        }
    }

    /// Cost prices from a `cost` table (the model's, or one of its channels', named `table`).
    pub(super) fn cost(
        &self,
        table: &str,
        entry: &PriceTableEntry,
    ) -> Result<CostPrices, CatalogueError> {
        let amount = |key: &str, value: Option<f64>| match value {
            None => Ok(Money::ZERO),
            Some(units) => Money::from_units(units)
                .filter(|money| *money >= Money::ZERO)
                .ok_or_else(|| {
                    self.refused(format!(
                        "`{key}` of {table} is {units}; an amount must be finite and at least 0"
                    ))
                }),
        };
        let tokens = if entry.has_tokens() {
            Some(self.tiered(table, entry)?)
        } else {
            None
        };
        if tokens.is_none() && entry.call.is_none() {
            return Err(self.refused(format!(
                "{table} gives no price: give `call` (per call), `input` and `output` (per million tokens), or both"
            )));
        }
        Ok(CostPrices {
            per_call: amount("call", entry.call)?,
            tokens,
            minimum: amount("minimum", entry.minimum)?,
        })
    }
}
