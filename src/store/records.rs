//! What the administration side of a store reads and writes: accounts and keys as an operator
//! sees them, grants with their reason and idempotency key, call-log queries, and the audit.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::types::{CallRecord, CallStatus};
use crate::call::{AccountId, CallId, KeyId, KeyRules};
use crate::codes::CodeHash;
use crate::credits::{Balance, Bucket, Credits};
use crate::money::Money;

/// An account as listed: who, and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountSummary {
    /// The account.
    pub id: AccountId,
    /// The operator's label.
    pub name: String,
    /// Its credits, bucket by bucket, as stored (see [`AccountSummary::spendable`]).
    pub balance: Balance,
    /// When its subscription credits end; `None`: never.
    pub subscription_ends_at: Option<DateTime<Utc>>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Its own low-balance threshold (`account.balance_low`); `None`: the store's default.
    pub low_balance_credits: Option<Credits>,
}

impl AccountSummary {
    /// What a call made at `now` may spend: no subscription credits once their period ended,
    /// even before the lapse is recorded.
    pub fn spendable(&self, now: DateTime<Utc>) -> Balance {
        self.balance.spendable(self.subscription_ends_at, now)
    }
}

/// Which accounts [`Accounts::accounts`](super::Accounts::accounts) lists: ascending by id,
/// after `after`, at most `limit`, optionally only those whose name contains `search` or that
/// own a key whose display prefix starts with it.
#[derive(Debug, Clone, Copy, Default)]
pub struct AccountQuery<'a> {
    /// List accounts with a larger id only.
    pub after: Option<AccountId>,
    /// Most accounts in the page.
    pub limit: u64,
    /// Part of a name, or the start of a key (`sk-mg-1a2b...`).
    pub search: Option<&'a str>,
}

/// Whether a key works.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStatus {
    /// It authenticates.
    Active,
    /// Its expiry has passed.
    Expired,
    /// The operator revoked it.
    Revoked,
}

/// One key as the operator sees it (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    /// The key.
    pub id: KeyId,
    /// Its account.
    pub account: AccountId,
    /// Its first characters, to tell keys apart.
    pub prefix: String,
    /// Its rules.
    pub rules: KeyRules,
    /// What it has spent in its spending limit's current period, calls under way included;
    /// zero without a limit.
    pub spent: Credits,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it was revoked.
    pub revoked_at: Option<DateTime<Utc>>,
}

impl KeyInfo {
    /// Whether the key works at `now`.
    pub fn status(&self, now: DateTime<Utc>) -> KeyStatus {
        if self.revoked_at.is_some() {
            KeyStatus::Revoked
        } else if self.rules.expired(now) {
            KeyStatus::Expired
        } else {
            KeyStatus::Active
        }
    }
}

/// Credits entering an account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant<'a> {
    /// The bucket they go to.
    pub bucket: Bucket,
    /// How many; positive.
    pub amount: Credits,
    /// Why, for the books.
    pub reason: Option<&'a str>,
    /// A grant with a key already used on the account is not applied again: sending it twice
    /// grants once.
    pub idempotency_key: Option<&'a str>,
    /// For subscription credits: a new period that ends then. What was left of the previous
    /// period's credits lapses first (a renewal replaces, it does not add up).
    pub period_end: Option<DateTime<Utc>>,
    /// When the grant is made (whether the current period has ended is judged at this time).
    pub at: DateTime<Utc>,
}

impl Grant<'_> {
    /// `amount` credits to `bucket` now, with no reason, idempotency key or period.
    pub fn plain(bucket: Bucket, amount: Credits) -> Grant<'static> {
        Grant {
            bucket,
            amount,
            reason: None,
            idempotency_key: None,
            period_end: None,
            at: Utc::now(),
        }
    }
}

/// Subscription credits that lapsed when their period ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Lapse {
    /// The account.
    pub account: AccountId,
    /// How many credits lapsed.
    pub amount: Credits,
    /// The end of their period.
    pub period_end: DateTime<Utc>,
}

/// What a grant did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// The account's balance afterwards.
    pub balance: Balance,
    /// `false` when a grant with the same idempotency key had been applied before and this one
    /// moved nothing.
    pub applied: bool,
    /// The subscription credits left of the previous period that lapsed because this grant
    /// started a new one (a renewal replaces, it does not add up); zero otherwise.
    pub lapsed: Credits,
}

/// Which call-log entries [`CallLog::calls`](super::CallLog::calls) returns: newest first, older
/// than `before`, at most `limit`, optionally of one status or model.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallQuery<'a> {
    /// Entries older than this one only.
    pub before: Option<CallId>,
    /// Most entries in the page.
    pub limit: u64,
    /// Only entries with this status.
    pub status: Option<CallStatus>,
    /// Only entries for this model.
    pub model: Option<&'a str>,
}

/// One day's `ok` calls of one model, for an account's usage chart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DailyUsage {
    /// The UTC day, `YYYY-MM-DD`.
    pub day: String,
    /// The model's catalogue name.
    pub model: String,
    /// How many calls were billed.
    pub calls: i64,
    /// How many credits they took.
    pub credits: i64,
    /// Their tokens, by kind (see [`TokenUsage`](crate::protocol::TokenUsage)): input neither
    /// read from nor written to a cache.
    pub input_tokens: i64,
    /// Output tokens, reasoning included.
    pub output_tokens: i64,
    /// Input tokens read from a cache.
    pub cache_read_tokens: i64,
    /// Input tokens written to a cache, for 5 minutes or for an hour.
    pub cache_write_tokens: i64,
}

/// How a usage report groups the billed calls it sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportGroup {
    /// By UTC day (`YYYY-MM-DD`) the call was made.
    Day,
    /// By catalogue model name.
    Model,
    /// By the channel (catalogue upstream) that served the call.
    Channel,
    /// By paying account (its id).
    Account,
    /// By API key (its id).
    Key,
}

impl ReportGroup {
    /// Every grouping, in the order the API lists them.
    pub const ALL: [ReportGroup; 5] = [
        ReportGroup::Day,
        ReportGroup::Model,
        ReportGroup::Channel,
        ReportGroup::Account,
        ReportGroup::Key,
    ];

    /// The name the API takes (`group_by=`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReportGroup::Day => "day",
            ReportGroup::Model => "model",
            ReportGroup::Channel => "channel",
            ReportGroup::Account => "account",
            ReportGroup::Key => "key",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s name.
    pub fn parse(name: &str) -> Option<ReportGroup> {
        ReportGroup::ALL
            .into_iter()
            .find(|group| group.as_str() == name)
    }

    /// The group `call` falls in.
    pub fn of(self, call: &CallRecord) -> String {
        match self {
            ReportGroup::Day => call.created_at.format("%Y-%m-%d").to_string(),
            ReportGroup::Model => call.model.clone(),
            ReportGroup::Channel => call.channel.clone().unwrap_or_default(),
            ReportGroup::Account => call.account.0.to_string(),
            ReportGroup::Key => call.key.0.to_string(),
        }
    }
}

/// What a usage report sums: the billed calls made from `from` (inclusive) to `to` (exclusive),
/// grouped by `group_by`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportQuery {
    /// The earliest time a call counted was made.
    pub from: DateTime<Utc>,
    /// The time from which calls no longer count.
    pub to: DateTime<Utc>,
    /// How the calls are grouped.
    pub group_by: ReportGroup,
}

/// One group's sums in a usage report: billed (`ok`) calls only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReportRow {
    /// The group (a day, a model or channel name, an account or key id; empty for calls whose
    /// channel is unknown).
    pub group: String,
    /// How many calls were billed.
    pub calls: i64,
    /// Of them, those charged on a count the gateway made itself.
    pub estimated_calls: i64,
    /// Input tokens neither read from nor written to a cache.
    pub input_tokens: i64,
    /// Output tokens, reasoning included.
    pub output_tokens: i64,
    /// Input tokens read from a cache.
    pub cache_read_tokens: i64,
    /// Input tokens written to a cache for 5 minutes.
    pub cache_write_tokens: i64,
    /// Input tokens written to a cache for an hour.
    pub cache_write_1h_tokens: i64,
    /// Of the output tokens, those spent reasoning.
    pub reasoning_tokens: i64,
    /// The credits the calls were charged.
    pub credits: i64,
    /// Of the calls, those with a cost (a channel with cost prices).
    pub costed_calls: i64,
    /// What they cost the operator, in his currency.
    pub cost: Money,
    /// What the costed calls earned: their charge at the credit's value less their cost.
    pub margin: Money,
}

impl ReportRow {
    /// Adds a billed `call` to the sums.
    pub fn add(&mut self, call: &CallRecord) {
        let count = |tokens: Option<i64>| tokens.unwrap_or(0);
        self.calls += 1;
        self.estimated_calls += i64::from(call.usage_estimated);
        self.input_tokens += count(call.input_tokens);
        self.output_tokens += count(call.output_tokens);
        self.cache_read_tokens += count(call.cache_read_tokens);
        self.cache_write_tokens += count(call.cache_write_tokens);
        self.cache_write_1h_tokens += count(call.cache_write_1h_tokens);
        self.reasoning_tokens += count(call.reasoning_tokens);
        self.credits += call.price.get();
        if let Some(cost) = call.cost {
            self.costed_calls += 1;
            self.cost = self.cost.plus(cost);
        }
        if let Some(margin) = call.margin {
            self.margin = self.margin.plus(margin);
        }
    }

    /// The sums of `rows` together, under `group`.
    pub fn total(group: &str, rows: &[ReportRow]) -> ReportRow {
        let mut total = ReportRow {
            group: group.to_owned(),
            ..ReportRow::default()
        };
        for row in rows {
            total.calls += row.calls;
            total.estimated_calls += row.estimated_calls;
            total.input_tokens += row.input_tokens;
            total.output_tokens += row.output_tokens;
            total.cache_read_tokens += row.cache_read_tokens;
            total.cache_write_tokens += row.cache_write_tokens;
            total.cache_write_1h_tokens += row.cache_write_1h_tokens;
            total.reasoning_tokens += row.reasoning_tokens;
            total.credits += row.credits;
            total.costed_calls += row.costed_calls;
            total.cost = total.cost.plus(row.cost);
            total.margin = total.margin.plus(row.margin);
        }
        total
    }

    /// The report's rows from `calls` (any order, any status: billed ones are summed), by
    /// group, in the group's order: what a backend without a query language of its own answers.
    pub fn from_calls<'a>(
        query: &ReportQuery,
        calls: impl IntoIterator<Item = &'a CallRecord>,
    ) -> Vec<ReportRow> {
        let mut groups: std::collections::BTreeMap<String, ReportRow> = Default::default();
        for call in calls {
            if call.status != CallStatus::Ok
                || call.created_at < query.from
                || call.created_at >= query.to
            {
                continue;
            }
            let group = query.group_by.of(call);
            groups
                .entry(group.clone())
                .or_insert_with(|| ReportRow {
                    group,
                    ..ReportRow::default()
                })
                .add(call);
        }
        groups.into_values().collect()
    }
}

/// One account's audit: what was granted, what `ok` and `pending` calls took, what is left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountAudit {
    /// The account.
    pub account: AccountId,
    /// Sum of grants, per bucket (exact: it may pass what one balance can hold).
    pub granted: Sums,
    /// Sum of what `ok` and `pending` calls took, per bucket (exact).
    pub charged: Sums,
    /// Subscription credits that lapsed at the end of their periods (exact).
    pub lapsed: i128,
    /// The stored balance.
    pub balance: Balance,
    /// What its `ok` calls cost beyond what they were charged (their entries' `shortfall`):
    /// the operator's loss, outside the books' balance (exact).
    pub shortfall: i128,
}

/// Exact sums of credits, per bucket, wider than one balance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Sums {
    /// Subscription credits.
    pub subscription: i128,
    /// Top-up credits.
    pub topup: i128,
}

impl Sums {
    /// The sums with `amount` more in `bucket`.
    pub(crate) fn add(&mut self, bucket: Bucket, amount: Credits) {
        match bucket {
            Bucket::Subscription => self.subscription += i128::from(amount.get()),
            Bucket::Topup => self.topup += i128::from(amount.get()),
        }
    }
}

impl AccountAudit {
    /// `granted - charged (- lapsed, for subscriptions) == balance` in both buckets, neither
    /// bucket negative, and the two together representable.
    pub fn holds(&self) -> bool {
        self.problem().is_none()
    }

    /// What is wrong with this account's books, if anything.
    pub fn problem(&self) -> Option<&'static str> {
        let Balance {
            subscription,
            topup,
        } = self.balance;
        if subscription < Credits::ZERO || topup < Credits::ZERO {
            return Some("a bucket is negative");
        }
        if self.balance.checked_total().is_none() {
            return Some(
                "the two buckets together cannot be represented (past the largest balance)",
            );
        }
        let left = |granted: i128, charged: i128| granted - charged;
        if left(self.granted.subscription, self.charged.subscription) - self.lapsed
            != i128::from(subscription.get())
            || left(self.granted.topup, self.charged.topup) != i128::from(topup.get())
        {
            return Some(
                "the balance differs from grants minus ok and pending charges (and lapses)",
            );
        }
        None
    }
}

/// Reservations still `pending` past the longest a call can take (see
/// [`Accounts::overdue_reservations`](super::Accounts::overdue_reservations)): credits that no
/// live call holds. A gateway finishes its calls' outcomes itself, so there should be none; one
/// here is for the operator to look at (and recovery to refund once its lease ends).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Overdue {
    /// How many.
    pub calls: u64,
    /// The credits they hold.
    pub credits: i128,
}

/// A batch of redemption codes, as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CodeBatch {
    /// The batch.
    #[serde(rename = "batch")]
    pub id: i64,
    /// The operator's label.
    pub label: Option<String>,
    /// What each code grants.
    pub credits: Credits,
    /// The bucket it goes to.
    pub bucket: Bucket,
    /// Subscription only: a code starts a period of this many days from its redemption.
    pub period_days: Option<u32>,
    /// After this, the batch's codes are refused; `None`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// How many codes it has.
    pub count: u64,
    /// How many were redeemed.
    pub used: u64,
    /// How many unused codes were revoked.
    pub revoked: u64,
}

impl CodeBatch {
    /// Codes that can still be redeemed (none once the batch expired).
    pub fn unused(&self, now: DateTime<Utc>) -> u64 {
        if self.expires_at.is_some_and(|at| at <= now) {
            return 0;
        }
        self.count - self.used - self.revoked
    }
}

/// A batch to store: its terms and its codes' hashes.
#[derive(Debug, Clone, Copy)]
pub struct NewCodeBatch<'a> {
    /// The operator's label.
    pub label: Option<&'a str>,
    /// What each code grants; positive.
    pub credits: Credits,
    /// The bucket it goes to.
    pub bucket: Bucket,
    /// Subscription only: the period a code starts, in days from its redemption.
    pub period_days: Option<u32>,
    /// When the codes stop working.
    pub expires_at: Option<DateTime<Utc>>,
    /// The codes ([`NewCode::hash`](crate::codes::NewCode::hash)).
    pub codes: &'a [CodeHash],
    /// When the batch is made.
    pub at: DateTime<Utc>,
}

/// What redeeming a code granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redeemed {
    /// The code's batch.
    pub batch: i64,
    /// How many credits.
    pub credits: Credits,
    /// Into which bucket.
    pub bucket: Bucket,
    /// The account's balance afterwards.
    pub balance: Balance,
    /// The subscription credits of the current period that lapsed because the code started a
    /// new one (see [`Granted::lapsed`]); zero otherwise.
    pub lapsed: Credits,
}

/// The reason recorded with the grant a code makes: it names the batch, so that the books say
/// where the credits came from.
pub(crate) fn redemption_reason(batch: i64) -> String {
    format!("redemption code, batch {batch}")
}

impl CodeBatch {
    /// The grant one of its codes makes when redeemed at `at`, with `reason`
    /// ([`redemption_reason`]): its credits to its bucket, and for a subscription batch with a
    /// period, a period from `at`.
    pub(crate) fn grant<'a>(&self, reason: &'a str, at: DateTime<Utc>) -> Grant<'a> {
        Grant {
            bucket: self.bucket,
            amount: self.credits,
            reason: Some(reason),
            idempotency_key: None,
            period_end: self
                .period_days
                .map(|days| at + chrono::Duration::days(i64::from(days))),
            at,
        }
    }
}

/// Where a webhook delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Not yet accepted by the endpoint: tried again at `next_attempt_at`.
    Pending,
    /// The endpoint answered 2xx.
    Delivered,
    /// Given up after the last retry; an operator may retry it by hand.
    Failed,
}

impl DeliveryStatus {
    /// Its name as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
        }
    }

    /// The status named `name`.
    pub fn parse(name: &str) -> Option<DeliveryStatus> {
        match name {
            "pending" => Some(DeliveryStatus::Pending),
            "delivered" => Some(DeliveryStatus::Delivered),
            "failed" => Some(DeliveryStatus::Failed),
            _ => None,
        }
    }
}

/// One event in the outbox and its delivery to the webhook endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delivery {
    /// The outbox row.
    pub id: i64,
    /// The event's id (`evt_...`), the same on every attempt.
    pub event_id: String,
    /// The event's type (`code.redeemed`, ...).
    #[serde(rename = "type")]
    pub kind: String,
    /// The body delivered, exactly.
    #[serde(skip)]
    pub body: String,
    /// Where it stands.
    pub status: DeliveryStatus,
    /// Attempts made.
    pub attempts: u32,
    /// When it is tried next (while pending).
    pub next_attempt_at: DateTime<Utc>,
    /// The endpoint's last answer, if it answered.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When the event happened (was written).
    pub created_at: DateTime<Utc>,
    /// When the endpoint accepted it.
    pub delivered_at: Option<DateTime<Utc>>,
}

/// How one delivery attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempted {
    /// The endpoint answered 2xx.
    Delivered {
        /// Its status.
        status: u16,
        /// When.
        at: DateTime<Utc>,
    },
    /// It did not: try again at `retry_at`, or give up (`None`).
    Failed {
        /// The endpoint's status, if it answered.
        status: Option<u16>,
        /// Why.
        error: String,
        /// When to try again; `None`: give up ([`DeliveryStatus::Failed`]).
        retry_at: Option<DateTime<Utc>>,
    },
}
