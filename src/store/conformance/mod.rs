//! The conformance suite for an implementation of the storage traits (feature `testing`): the
//! model-based test that every backend of this crate passes, to run against an embedder's own.
//!
//! A run draws random sequences of steps ([`Op`]): grants (with and without a period),
//! reservations on a key with a spending limit and on one without, settles at the reservation
//! and at token costs below and above it (with shortfall), refunds and repeated refunds,
//! retries under idempotency keys, revoked keys, redemption codes (used twice, expired), the
//! clock moving on and periods lapsing, and bursts of writes submitted concurrently. Each step
//! is applied to the store under test and to [`MemoryStore`], the reference model; after each,
//! both must have answered the same and hold the same balances, no key may have spent past its
//! limit, no balance may be below zero, and the store's own audit
//! ([`Accounts::audit`](crate::store::Accounts::audit)) of the run's accounts must hold. At the
//! end both call logs agree, and with [`Conformance::with_events`] the store's webhook outbox
//! says what happened (a `code.redeemed` per redemption, a `subscription.lapsed` per lapse, a
//! `call.shortfall` per call the account could not pay in full, `key.limit_reached` at most
//! once for a key).
//!
//! A failing sequence is shrunk to a short one and reported as a [`Violation`] naming the
//! [`Rule`] broken, with the steps, which [`Conformance::replay`] runs again.
//!
//! A capability a store does not have (it answers [`StoreError::Unsupported`]) is skipped and
//! listed in the [`Report`]: a store that keeps no redemption codes is run without them.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use model_gateway::store::{MemoryStore, conformance};
//!
//! // Each case gets a store from the closure: a fresh one, or the same database again (each
//! // case makes accounts of its own).
//! let report = conformance::ledger(|| async { MemoryStore::new() }).await;
//! assert_eq!(report.cases, 64);
//! println!("{report}");
//! # }
//! ```

mod ops;
mod side;

use std::future::Future;

use chrono::{DateTime, TimeZone, Utc};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestRunner};

pub use ops::Op;

use super::{DeliveryStatus, MemoryStore, Store, StoreError};
use side::Side;

/// How many redemption codes each run makes (see [`Op::Redeem`]).
pub const CODES: usize = 5;

/// The rule a store broke: where its answers, balances or books left the model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rule {
    /// Making the run's accounts, keys or codes failed.
    Setup,
    /// A grant: its balance, or what a new period lapsed.
    Grant,
    /// The clock (never broken: a step that only moves it).
    Clock,
    /// Whether a call may reserve its price (enough credits, the key active and within its
    /// limit).
    Reserve,
    /// Which buckets a reservation takes: subscription credits first, then top-up.
    SubscriptionFirst,
    /// What a settle charges and gives back, and that a call ends once.
    Settle,
    /// What a refund gives back (to the buckets it came from), once.
    Refund,
    /// A key's spending limit.
    KeyLimit,
    /// A revoked key is refused.
    Revoke,
    /// Retries under an idempotency key: billed once, answered with the kept reply, the key
    /// forgotten after its window.
    Idempotency,
    /// A redemption code grants once, and only while valid.
    Codes,
    /// An ended period's subscription credits lapse, no more than the subscription holds.
    Lapse,
    /// Writes submitted together end as they would one by one.
    Concurrency,
    /// A balance went below zero.
    NoNegativeBalance,
    /// A balance differs from the model's.
    Balance,
    /// The call log differs from the model's.
    CallLog,
    /// The store's own audit of an account's books fails.
    Audit,
    /// The webhook events do not say what happened.
    Events,
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// How a store failed the suite.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The rule broken.
    pub rule: Rule,
    /// What was seen, against what the model answered.
    pub detail: String,
    /// The (shrunk) steps that show it, for [`Conformance::replay`].
    pub steps: Vec<Op>,
    /// The step at which it showed (`None`: at the end of the run).
    pub at_step: Option<usize>,
}

impl Violation {
    fn new(rule: Rule, detail: String) -> Violation {
        Violation {
            rule,
            detail,
            steps: Vec::new(),
            at_step: None,
        }
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the store breaks the rule {}", self.rule)?;
        if let Some(step) = self.at_step {
            write!(f, " at step {step}")?;
        }
        write!(f, ": {}\nsteps: {:?}", self.detail, self.steps)
    }
}

impl std::error::Error for Violation {}

/// What a passing run checked.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Sequences run.
    pub cases: u32,
    /// Steps run, in all.
    pub steps: u64,
    /// Capabilities the store does not have, or the run was not asked to check, and why.
    pub skipped: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "conformance: {} sequences, {} steps passed",
            self.cases, self.steps
        )?;
        for skipped in &self.skipped {
            write!(f, "; skipped: {skipped}")?;
        }
        Ok(())
    }
}

/// A run's settings (see [`Conformance`]).
#[derive(Debug, Clone)]
struct Settings {
    cases: u32,
    grant_scale: i64,
    bursts_in_order: bool,
    idempotency_window: std::time::Duration,
    events: bool,
}

/// The suite, with its settings; [`ledger`] runs it with the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct Conformance {
    settings: Settings,
}

impl Default for Conformance {
    fn default() -> Conformance {
        Conformance::new()
    }
}

/// Runs the suite with the defaults against the stores `make_store` gives, one per sequence,
/// and panics with the [`Violation`] if the store breaks a rule.
pub async fn ledger<S, F, Fut>(make_store: F) -> Report
where
    S: Store,
    F: FnMut() -> Fut,
    Fut: Future<Output = S>,
{
    match Conformance::new().check(make_store).await {
        Ok(report) => report,
        Err(violation) => panic!("{violation}"),
    }
}

impl Conformance {
    /// 64 sequences of up to 40 steps, grants of 1 to 39 credits, bursts submitted
    /// concurrently, idempotency keys held for
    /// [`DEFAULT_IDEMPOTENCY_WINDOW`](super::DEFAULT_IDEMPOTENCY_WINDOW), events not checked.
    pub fn new() -> Conformance {
        Conformance {
            settings: Settings {
                cases: 64,
                grant_scale: 1,
                bursts_in_order: false,
                idempotency_window: super::DEFAULT_IDEMPOTENCY_WINDOW,
                events: false,
            },
        }
    }

    /// Runs `cases` sequences.
    pub fn cases(mut self, cases: u32) -> Conformance {
        self.settings.cases = cases;
        self
    }

    /// Grants (and codes) `scale` times larger: for a store that holds credits apart once an
    /// account has many (an escrow), so that accounts move between the two.
    pub fn grant_scale(mut self, scale: i64) -> Conformance {
        self.settings.grant_scale = scale.max(1);
        self
    }

    /// Applies a burst's writes one after another rather than submitting them together: for
    /// a store whose concurrent writes may end in another order than submitted.
    pub fn bursts_in_order(mut self) -> Conformance {
        self.settings.bursts_in_order = true;
        self
    }

    /// The window the store holds idempotency keys for (the model holds them as long). The
    /// clock moves up to about 13 minutes in a sequence: a window of a minute or less lets
    /// the suite see keys forgotten.
    pub fn idempotency_window(mut self, window: std::time::Duration) -> Conformance {
        self.settings.idempotency_window = window;
        self
    }

    /// Checks the store's webhook outbox too: for a store set to write every event type, with
    /// no low-balance threshold.
    pub fn with_events(mut self) -> Conformance {
        self.settings.events = true;
        self
    }

    /// Runs the suite against the stores `make_store` gives, one per sequence (it may give the
    /// same database each time: each sequence makes accounts of its own). A failing sequence
    /// is shrunk before it is reported.
    pub async fn check<S, F, Fut>(&self, mut make_store: F) -> Result<Report, Violation>
    where
        S: Store,
        F: FnMut() -> Fut,
        Fut: Future<Output = S>,
    {
        let config = Config {
            cases: self.settings.cases,
            failure_persistence: None,
            ..Config::default()
        };
        let mut runner = TestRunner::new(config);
        let strategy = proptest::collection::vec(ops::op(self.settings.grant_scale), 1..40);
        let mut report = Report {
            cases: 0,
            steps: 0,
            skipped: Vec::new(),
        };
        for _ in 0..self.settings.cases {
            let tree = strategy
                .new_tree(&mut runner)
                .map_err(|why| Violation::new(Rule::Setup, why.to_string()))?;
            let steps = tree.current();
            match self.run(&mut make_store, &steps).await {
                Ok(skipped) => {
                    report.cases += 1;
                    report.steps += steps.len() as u64;
                    for each in skipped {
                        if !report.skipped.contains(&each) {
                            report.skipped.push(each);
                        }
                    }
                }
                Err(violation) => return Err(self.shrink(&mut make_store, tree, violation).await),
            }
        }
        if !self.settings.events {
            report
                .skipped
                .push("webhook events (not asked: Conformance::with_events)".to_owned());
        }
        Ok(report)
    }

    /// Runs `steps` once against a store from `make_store`.
    pub async fn replay<S, F, Fut>(&self, mut make_store: F, steps: &[Op]) -> Result<(), Violation>
    where
        S: Store,
        F: FnMut() -> Fut,
        Fut: Future<Output = S>,
    {
        self.run(&mut make_store, steps).await.map(drop)
    }

    /// The shortest failing sequence proptest's shrinking finds from `tree` (at most 256
    /// runs), with its violation.
    async fn shrink<S, F, Fut>(
        &self,
        make_store: &mut F,
        mut tree: impl ValueTree<Value = Vec<Op>>,
        first: Violation,
    ) -> Violation
    where
        S: Store,
        F: FnMut() -> Fut,
        Fut: Future<Output = S>,
    {
        let mut found = first;
        let mut runs = 0;
        if tree.simplify() {
            while runs < 256 {
                runs += 1;
                let steps = tree.current();
                match self.run(make_store, &steps).await {
                    Err(violation) => {
                        found = violation;
                        if !tree.simplify() {
                            break;
                        }
                    }
                    Ok(_) => {
                        if !tree.complicate() {
                            break;
                        }
                    }
                }
            }
        }
        found
    }

    /// One sequence: what it skipped, or the first violation, with the steps.
    async fn run<S, F, Fut>(
        &self,
        make_store: &mut F,
        steps: &[Op],
    ) -> Result<Vec<String>, Violation>
    where
        S: Store,
        F: FnMut() -> Fut,
        Fut: Future<Output = S>,
    {
        let store = make_store().await;
        self.compare(&store, steps).await.map_err(|mut violation| {
            violation.steps = steps.to_vec();
            violation
        })
    }

    async fn compare(&self, store: &dyn Store, steps: &[Op]) -> Result<Vec<String>, Violation> {
        let settings = &self.settings;
        let start: DateTime<Utc> = Utc
            .with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
            .single()
            .expect("a valid date");
        let model = MemoryStore::new().with_idempotency_window(settings.idempotency_window);
        let mut actual = Side::new(store, settings, start, true).await?;
        let mut expected = Side::new(&model, settings, start, actual.codes.is_some()).await?;
        let mut skipped = Vec::new();
        if actual.codes.is_none() {
            skipped.push("redemption codes (the store answers Unsupported)".to_owned());
        }
        for (step, op) in steps.iter().enumerate() {
            let at = |mut violation: Violation| {
                violation.at_step = Some(step);
                violation
            };
            let limited = actual.settles_beyond_on_a_limited_key(op);
            let want = expected.apply(op).await.map_err(at)?;
            let got = actual.apply(op).await.map_err(at)?;
            if got != want {
                let rule = refine(op, &got, &want);
                return Err(at(Violation::new(
                    rule,
                    format!("{op:?}: the store answered {got}; the model, {want}"),
                )));
            }
            // The invariants first: they name the rule more closely than a balance does.
            actual.limits_hold().await.map_err(at)?;
            let (got, want) = (
                actual.balances().await.map_err(at)?,
                expected.balances().await.map_err(at)?,
            );
            if got != want {
                return Err(at(Violation::new(
                    balance_rule(op, limited),
                    format!(
                        "after {op:?}: the store's balances are {got:?}; the model's, {want:?}"
                    ),
                )));
            }
            actual.audit_holds().await.map_err(at)?;
        }
        store
            .release_lease()
            .await
            .map_err(|e| Violation::new(Rule::Setup, format!("release_lease failed: {e}")))?;
        let (got, want) = (actual.balances().await?, expected.balances().await?);
        if got != want {
            return Err(Violation::new(
                Rule::Balance,
                format!(
                    "after the lease's release: the store's balances are {got:?}; the model's, {want:?}"
                ),
            ));
        }
        let (got, want) = (actual.call_logs().await?, expected.call_logs().await?);
        if got.lines != want.lines {
            return Err(Violation::new(
                Rule::CallLog,
                format!(
                    "the store's call log is {:?}; the model's, {:?}",
                    got.lines, want.lines
                ),
            ));
        }
        actual.audit_holds().await?;
        if settings.events
            && let Some(why) = events_agree(&actual, got.shortfalls).await?
        {
            skipped.push(why);
        }
        Ok(skipped)
    }
}

/// The rule an answer that differs from the model's breaks: a reservation that took other
/// buckets than the model's broke subscription-first; one refused for its key's limit (or not),
/// the key limit; a redemption's, the codes'.
fn refine(op: &Op, got: &str, want: &str) -> Rule {
    let reserved = |seen: &str| seen.starts_with("reserved ");
    match op {
        Op::Reserve { .. } if reserved(got) && reserved(want) => Rule::SubscriptionFirst,
        Op::Reserve { .. } if got == "key limit" || want == "key limit" => Rule::KeyLimit,
        Op::Burst(writes) => {
            let (got, want): (Vec<_>, Vec<_>) =
                (got.split(" | ").collect(), want.split(" | ").collect());
            writes
                .iter()
                .zip(got.iter().zip(&want))
                .find(|(_, (got, want))| got != want)
                .map_or(Rule::Concurrency, |(op, (got, want))| refine(op, got, want))
        }
        op => op.rule(),
    }
}

/// The rule balances that differ after `op` break; `limited`: it settles beyond its
/// reservation a call of a key with a spending limit (which bounds what it may charge).
fn balance_rule(op: &Op, limited: bool) -> Rule {
    match op {
        _ if limited => Rule::KeyLimit,
        Op::Reserve {
            idempotency: None, ..
        } => Rule::SubscriptionFirst,
        Op::Burst(_) => Rule::Concurrency,
        op => op.rule(),
    }
}

/// Whether the store's outbox says what happened to the run's accounts; `Some(why)` when it
/// keeps no events.
async fn events_agree(side: &Side<'_>, shortfalls: [u32; 2]) -> Result<Option<String>, Violation> {
    let deliveries = match side
        .store
        .deliveries(None::<DeliveryStatus>, 1_000_000)
        .await
    {
        Ok(deliveries) => deliveries,
        Err(StoreError::Unsupported(_)) => {
            return Ok(Some(
                "webhook events (the store answers Unsupported)".to_owned(),
            ));
        }
        Err(error) => {
            return Err(Violation::new(
                Rule::Events,
                format!("deliveries failed: {error}"),
            ));
        }
    };
    for (index, account) in side.accounts.iter().enumerate() {
        let count = |kind: &str| {
            deliveries
                .iter()
                .filter(|delivery| delivery.kind == kind)
                .filter(|delivery| {
                    serde_json::from_str::<serde_json::Value>(&delivery.body)
                        .ok()
                        .and_then(|body| body["data"]["account"].as_i64())
                        == Some(account.0)
                })
                .count()
        };
        let seen = [
            (
                "code.redeemed",
                count("code.redeemed"),
                side.redeemed[index],
            ),
            (
                "subscription.lapsed",
                count("subscription.lapsed"),
                side.lapses[index],
            ),
            ("call.shortfall", count("call.shortfall"), shortfalls[index]),
        ];
        for (kind, got, want) in seen {
            if got != want as usize {
                return Err(Violation::new(
                    Rule::Events,
                    format!("account {index}: {got} {kind} events for {want} such writes"),
                ));
            }
        }
        let limits = count("key.limit_reached");
        if limits > 1 {
            return Err(Violation::new(
                Rule::Events,
                format!("account {index}: key.limit_reached told {limits} times for one key"),
            ));
        }
    }
    Ok(None)
}
