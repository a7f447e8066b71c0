//! Reconciliation: the gateway's books for a channel against its provider's own usage report,
//! by day and model.
//!
//! A provider that publishes usage (`OpenAI`'s organization usage API, Anthropic's usage
//! report) says, per UTC day and model, how many tokens of each kind it billed the operator's
//! organization for. The ledger says the same of the calls its channel served, from each
//! call's usage as the provider reported it. [`compare`] names every day, model and kind of
//! token where the two differ by more than the operator's threshold: a provider that bills more
//! output than its replies reported, cache writes the gateway never saw, calls the gateway did
//! not record.
//!
//! What is compared, and why: tokens by kind (input not from a cache, cache reads, cache
//! writes, output), because they are what both sides count the same way and what the bill is
//! made of; not money, because the provider's cost report has no model for every line and its
//! prices are the operator's contract, not the gateway's. Each provider's report is read as
//! its documentation spells it ([`openai`], [`anthropic`]).
//!
//! ```
//! use model_gateway::reconcile::{Tokens, DayUsage, compare, Threshold};
//!
//! let day = chrono::NaiveDate::from_ymd_opt(2026, 11, 3).unwrap();
//! let ours = Tokens { input: 1_000_000, output: 100_000, ..Tokens::default() };
//! let theirs = Tokens { output: 105_000, ..ours }; // 5 % more output than the replies said
//! let drifts = compare(
//!     &[DayUsage::new(day, "gpt-4o", ours)],
//!     &[DayUsage::new(day, "gpt-4o", theirs)],
//!     Threshold::default(), // beyond 1,000 tokens and 1 %
//! );
//! assert_eq!(drifts.len(), 1);
//! assert_eq!((drifts[0].kind.as_str(), drifts[0].difference), ("output", 5_000));
//! ```

pub mod anthropic;
pub mod openai;

use std::collections::BTreeMap;

use chrono::NaiveDate;
use serde::Serialize;

/// One page of a provider's usage report: its rows, and the cursor of the next page if there is
/// one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// A row per day and model.
    pub rows: Vec<DayUsage>,
    /// The `page` to ask for next.
    pub next_page: Option<String>,
}

/// A report page as both providers wrap it: `data` a list of time buckets, `has_more` and
/// `next_page` for the next page.
#[derive(serde::Deserialize)]
struct Wire<B> {
    data: Vec<B>,
    #[serde(default)]
    has_more: bool,
    next_page: Option<String>,
}

/// Reads a page whose buckets are `B`, each made rows by `rows`; `None` when it is not that
/// shape (or a bucket is not).
fn read_page<B: serde::de::DeserializeOwned>(
    body: &[u8],
    rows: impl Fn(B) -> Option<Vec<DayUsage>>,
) -> Option<Page> {
    let wire: Wire<B> = serde_json::from_slice(body).ok()?;
    let mut read = Vec::new();
    for bucket in wire.data {
        read.extend(rows(bucket)?);
    }
    Some(Page {
        rows: read,
        next_page: wire.next_page.filter(|_| wire.has_more),
    })
}

/// Tokens by kind, as a provider bills them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tokens {
    /// Input tokens neither read from nor written to a cache.
    pub input: i64,
    /// Output tokens, reasoning included.
    pub output: i64,
    /// Input tokens read from a cache.
    pub cache_read: i64,
    /// Input tokens written to a cache for 5 minutes.
    pub cache_write: i64,
    /// Input tokens written to a cache for an hour.
    pub cache_write_1h: i64,
}

impl Tokens {
    /// Each kind with its name, in the order reports list them.
    pub fn kinds(&self) -> [(TokenKind, i64); 5] {
        [
            (TokenKind::Input, self.input),
            (TokenKind::CacheRead, self.cache_read),
            (TokenKind::CacheWrite, self.cache_write),
            (TokenKind::CacheWrite1h, self.cache_write_1h),
            (TokenKind::Output, self.output),
        ]
    }

    fn add(&mut self, other: &Tokens) {
        self.input += other.input;
        self.output += other.output;
        self.cache_read += other.cache_read;
        self.cache_write += other.cache_write;
        self.cache_write_1h += other.cache_write_1h;
    }
}

/// A kind of token, as a drift names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenKind {
    /// Input not from a cache.
    Input,
    /// Cache reads.
    CacheRead,
    /// 5-minute cache writes.
    CacheWrite,
    /// 1-hour cache writes.
    CacheWrite1h,
    /// Output.
    Output,
}

impl TokenKind {
    /// The kind's name in reports and events.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenKind::Input => "input",
            TokenKind::CacheRead => "cache_read",
            TokenKind::CacheWrite => "cache_write",
            TokenKind::CacheWrite1h => "cache_write_1h",
            TokenKind::Output => "output",
        }
    }
}

/// One UTC day's usage of one model, on one side of the books.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DayUsage {
    /// The UTC day.
    pub day: NaiveDate,
    /// The model, as the provider names it.
    pub model: String,
    /// Its tokens by kind.
    pub tokens: Tokens,
    /// How many requests, where the side counts them.
    pub requests: Option<i64>,
}

impl DayUsage {
    /// `tokens` of `model` on `day`, requests uncounted.
    pub fn new(day: NaiveDate, model: &str, tokens: Tokens) -> DayUsage {
        DayUsage {
            day,
            model: model.to_owned(),
            tokens,
            requests: None,
        }
    }
}

/// How far the two sides may differ before a difference is a drift: both bounds must be passed
/// (a relative one alone would flag a token on a quiet day).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Threshold {
    /// Tokens the sides may differ by, whatever the size.
    pub tokens: i64,
    /// The share of the larger side they may differ by (`0.01`: one percent).
    pub share: f64,
}

impl Default for Threshold {
    /// 1,000 tokens and 1 %.
    fn default() -> Threshold {
        Threshold {
            tokens: 1_000,
            share: 0.01,
        }
    }
}

/// A difference beyond the threshold: the provider billed `provider` tokens of `kind` of
/// `model` on `day`, the ledger recorded `ledger`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// The UTC day.
    pub day: NaiveDate,
    /// The model, as the provider names it.
    pub model: String,
    /// The kind of token.
    pub kind: TokenKind,
    /// What the ledger recorded.
    pub ledger: i64,
    /// What the provider reported.
    pub provider: i64,
    /// `provider - ledger`: above zero, the provider billed more than the gateway saw.
    pub difference: i64,
    /// The difference as a share of the ledger's count (`None` when the ledger has none).
    pub share: Option<f64>,
}

/// Every day, model and kind where `provider` and `ledger` differ beyond `threshold`, by day,
/// model and kind. Rows of one day and model on one side are summed first; a day and model on
/// one side only is compared with nothing on the other.
pub fn compare(ledger: &[DayUsage], provider: &[DayUsage], threshold: Threshold) -> Vec<Drift> {
    let sums = |rows: &[DayUsage]| {
        let mut sums: BTreeMap<(NaiveDate, String), Tokens> = BTreeMap::new();
        for row in rows {
            sums.entry((row.day, row.model.clone()))
                .or_default()
                .add(&row.tokens);
        }
        sums
    };
    let (ledger, provider) = (sums(ledger), sums(provider));
    let keys: std::collections::BTreeSet<&(NaiveDate, String)> =
        ledger.keys().chain(provider.keys()).collect();
    let mut drifts = Vec::new();
    for key in keys {
        let ours = ledger.get(key).copied().unwrap_or_default();
        let theirs = provider.get(key).copied().unwrap_or_default();
        for ((kind, recorded), (_, reported)) in ours.kinds().into_iter().zip(theirs.kinds()) {
            let difference = reported - recorded;
            let larger = recorded.max(reported) as f64;
            if difference.abs() > threshold.tokens
                && difference.abs() as f64 > threshold.share * larger
            {
                drifts.push(Drift {
                    day: key.0,
                    model: key.1.clone(),
                    kind,
                    ledger: recorded,
                    provider: reported,
                    difference,
                    share: (recorded > 0).then(|| difference as f64 / recorded as f64),
                });
            }
        }
    }
    drifts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn day(n: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(2026, 11, n).unwrap()
    }

    fn tokens(input: i64, output: i64) -> Tokens {
        Tokens {
            input,
            output,
            ..Tokens::default()
        }
    }

    #[test]
    fn agreeing_books_have_no_drift_even_split_over_rows() {
        let ledger = [
            DayUsage::new(day(1), "m", tokens(600_000, 50_000)),
            DayUsage::new(day(1), "m", tokens(400_000, 50_000)),
        ];
        let provider = [DayUsage::new(day(1), "m", tokens(1_000_000, 100_000))];
        assert_eq!(compare(&ledger, &provider, Threshold::default()), []);
    }

    #[test]
    fn five_percent_more_output_is_named_by_day_model_and_size() {
        let ledger = [DayUsage::new(day(2), "m", tokens(1_000_000, 100_000))];
        let provider = [DayUsage::new(day(2), "m", tokens(1_000_000, 105_000))];
        let drifts = compare(&ledger, &provider, Threshold::default());
        assert_eq!(drifts.len(), 1);
        let drift = &drifts[0];
        assert_eq!(
            (drift.day, drift.model.as_str(), drift.kind),
            (day(2), "m", TokenKind::Output)
        );
        assert_eq!(
            (drift.ledger, drift.provider, drift.difference),
            (100_000, 105_000, 5_000)
        );
        assert_eq!(drift.share, Some(0.05));
    }

    #[test]
    fn cache_writes_the_gateway_never_saw_and_a_day_it_has_no_record_of_are_drifts() {
        let ledger = [DayUsage::new(day(3), "m", tokens(10_000, 1_000))];
        let provider = [
            DayUsage::new(
                day(3),
                "m",
                Tokens {
                    cache_write_1h: 50_000,
                    ..tokens(10_000, 1_000)
                },
            ),
            DayUsage::new(day(4), "m", tokens(20_000, 2_000)),
        ];
        let drifts = compare(&ledger, &provider, Threshold::default());
        let named: Vec<_> = drifts
            .iter()
            .map(|d| (d.day, d.kind, d.ledger, d.provider))
            .collect();
        assert_eq!(
            named,
            [
                (day(3), TokenKind::CacheWrite1h, 0, 50_000),
                (day(4), TokenKind::Input, 0, 20_000),
                (day(4), TokenKind::Output, 0, 2_000),
            ]
        );
        assert_eq!(drifts[0].share, None, "no share of nothing");
    }

    #[test]
    fn small_differences_stay_under_either_bound() {
        // 900 more input tokens: under 1,000, however large a share (900 %); 2,000 more output
        // tokens: above 1,000, but 0.02 % of 10,002,000, under 1 %.
        let ledger = [DayUsage::new(day(5), "m", tokens(100, 10_000_000))];
        let provider = [DayUsage::new(day(5), "m", tokens(1_000, 10_002_000))];
        assert_eq!(compare(&ledger, &provider, Threshold::default()), []);
    }
}
