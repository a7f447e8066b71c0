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

/// A price table as written. One shape for every table, so that each key is read once: the
/// top tables (`[models.tokens]`, `[models.cost]`, a channel's `cost`), a tier's (`priority`,
/// `flex`) and a long-context one; a key in a table that does not take it is refused by name
/// ([`TableReader`]).
#[derive(Deserialize, Clone, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct PriceTableEntry {
    /// A long-context table's threshold, in input tokens.
    above: Option<u64>,
    /// A cost table's price per call.
    call: Option<f64>,
    /// A top table's least charge per call.
    minimum: Option<f64>,
    input: Option<f64>,
    output: Option<f64>,
    cache_read: Option<f64>,
    cache_write: Option<f64>,
    cache_write_1h: Option<f64>,
    long_context: Option<Box<PriceTableEntry>>,
    priority: Option<Box<PriceTableEntry>>,
    flex: Option<Box<PriceTableEntry>>,
}

/// Where a table stands, which says the keys it takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    /// `[models.tokens]`.
    Sale,
    /// `[models.cost]` or a channel's `cost`.
    Cost,
    /// A `priority` or `flex` table.
    Tier,
    /// A `long_context` table.
    LongContext,
}

impl PriceTableEntry {
    fn has_rates(&self) -> bool {
        [
            self.input,
            self.output,
            self.cache_read,
            self.cache_write,
            self.cache_write_1h,
        ]
        .iter()
        .any(Option::is_some)
    }

    fn has_tokens(&self) -> bool {
        self.has_rates()
            || self.long_context.is_some()
            || self.priority.is_some()
            || self.flex.is_some()
    }

    /// The first key present that a table at `place` does not take.
    fn misplaced(&self, place: Place) -> Option<&'static str> {
        let tier_tables = self.priority.is_some() || self.flex.is_some();
        [
            ("above", self.above.is_some() && place != Place::LongContext),
            ("call", self.call.is_some() && place != Place::Cost),
            (
                "minimum",
                self.minimum.is_some() && !matches!(place, Place::Sale | Place::Cost),
            ),
            (
                "long_context",
                self.long_context.is_some() && place == Place::LongContext,
            ),
            (
                "priority` or `flex",
                tier_tables && matches!(place, Place::Tier | Place::LongContext),
            ),
        ]
        .into_iter()
        .find_map(|(key, present)| present.then_some(key))
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

    /// `entry`, at `place`, takes every key it has.
    fn check_keys(
        &self,
        table: &str,
        entry: &PriceTableEntry,
        place: Place,
    ) -> Result<(), CatalogueError> {
        match entry.misplaced(place) {
            Some(key) => Err(self.refused(format!("{table} takes no `{key}`"))),
            None => Ok(()),
        }
    }

    /// A table of rates: `input` and `output` both given (in `table`, named for the refusal);
    /// the cache kinds at the input rate unless given.
    fn prices(&self, table: &str, entry: &PriceTableEntry) -> Result<TokenPrices, CatalogueError> {
        let (Some(input), Some(output)) = (entry.input, entry.output) else {
            return Err(self.refused(format!("{table} needs both `input` and `output`")));
        };
        let mut prices = TokenPrices::new(self.rate("input", input)?, self.rate("output", output)?);
        if let Some(value) = entry.cache_read {
            prices = prices.with_cache_read(self.rate("cache_read", value)?);
        }
        if let Some(value) = entry.cache_write {
            prices = prices.with_cache_write(self.rate("cache_write", value)?);
        }
        if let Some(value) = entry.cache_write_1h {
            prices = prices.with_cache_write_1h(self.rate("cache_write_1h", value)?);
        }
        Ok(prices)
    }

    /// A tier's (or the top's) rates and its long-context table.
    fn table(&self, table: &str, entry: &PriceTableEntry) -> Result<TokenTable, CatalogueError> {
        let long_context = match &entry.long_context {
            None => None,
            Some(long) => {
                let name = format!("{table}.long_context");
                self.check_keys(&name, long, Place::LongContext)?;
                let above = match long.above {
                    Some(above) if above > 0 => above,
                    _ => {
                        return Err(self.refused(format!(
                            "{name} needs `above`, a positive number of input tokens"
                        )));
                    }
                };
                Some(LongContext {
                    above,
                    prices: self.prices(&name, long)?,
                })
            }
        };
        Ok(TokenTable {
            prices: self.prices(table, entry)?,
            long_context,
        })
    }

    /// The token tables of `entry` (`table` names it for a refusal).
    fn tiered(&self, table: &str, entry: &PriceTableEntry) -> Result<TieredPrices, CatalogueError> {
        let tier = |name: &str, tier: &Option<Box<PriceTableEntry>>| match tier {
            None => Ok(None),
            Some(tier) => {
                let name = format!("{table}.{name}");
                self.check_keys(&name, tier, Place::Tier)?;
                self.table(&name, tier).map(Some)
            }
        };
        Ok(TieredPrices {
            standard: self.table(table, entry)?,
            priority: tier("priority", &entry.priority)?,
            flex: tier("flex", &entry.flex)?,
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
        self.check_keys(TABLE, entry, Place::Sale)?;
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
        self.check_keys(table, entry, Place::Cost)?;
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
