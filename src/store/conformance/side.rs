//! One store's side of a run: its accounts, keys and codes, the calls it reserved, and what an
//! observer sees of each step.

use chrono::{DateTime, Duration, Utc};

use super::ops::Op;
use super::{Rule, Settings, Violation};
use crate::call::{KeyLimit, KeyRules, LimitPeriod};
use crate::codes::NewCode;
use crate::credits::{Balance, Bucket, Credits};
use crate::keys::NewApiKey;
use crate::money::Money;
use crate::protocol::{Protocol, ServiceTier};
use crate::store::{
    AccountId, CallFailure, CallId, CallStatus, CallSuccess, Caller, ChargeRequest, Grant,
    IdempotencyKey, KeptReply, KeyId, NewCodeBatch, OperatorCost, ReserveError, Store, StoreError,
};

/// What the first key of each account may spend in all.
pub(super) const KEY_LIMIT: i64 = 20;

/// The protocols calls are reserved under, by price.
const PROTOCOLS: [Protocol; 4] = [
    Protocol::ChatCompletions,
    Protocol::Messages,
    Protocol::Embeddings,
    Protocol::Responses,
];

/// What a step's failure to run is reported as.
pub(super) type Step<T> = Result<T, Violation>;

/// A store error met while running a step: the rule of the step, with the error.
fn failed(rule: Rule, what: &str, error: impl std::fmt::Display) -> Violation {
    Violation::new(rule, format!("{what} failed: {error}"))
}

pub(super) struct Side<'a> {
    pub(super) store: &'a dyn Store,
    pub(super) accounts: Vec<AccountId>,
    keys: Vec<[(KeyId, NewApiKey); 2]>,
    /// The calls reserved, each with the index of its key (0: the limited one).
    calls: Vec<(CallId, usize)>,
    /// The redemption codes, `None` when the store keeps none.
    pub(super) codes: Option<Vec<NewCode>>,
    /// The run's clock, the same on both sides.
    now: DateTime<Utc>,
    settings: &'a Settings,
    /// Per account: codes redeemed, subscriptions lapsed (what its events should say).
    pub(super) redeemed: [u32; 2],
    pub(super) lapses: [u32; 2],
}

impl<'a> Side<'a> {
    /// Two accounts of two keys each (the first limited to [`KEY_LIMIT`]) and two batches of
    /// codes; `codes`: whether to make them.
    pub(super) async fn new(
        store: &'a dyn Store,
        settings: &'a Settings,
        start: DateTime<Utc>,
        codes: bool,
    ) -> Step<Side<'a>> {
        let (mut accounts, mut keys) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            let account = store
                .create_account("conformance")
                .await
                .map_err(|e| failed(Rule::Setup, "create_account", e))?;
            let mut pair = Vec::new();
            for _ in 0..2 {
                let key = NewApiKey::generate();
                let id = store
                    .add_key(account, &key)
                    .await
                    .map_err(|e| failed(Rule::Setup, "add_key", e))?;
                pair.push((id, key));
            }
            let rules = KeyRules {
                limit: Some(KeyLimit {
                    credits: Credits::new(KEY_LIMIT),
                    period: LimitPeriod::None,
                }),
                ..KeyRules::default()
            };
            store
                .set_key_rules(pair[0].0, &rules)
                .await
                .map_err(|e| failed(Rule::Setup, "set_key_rules", e))?;
            let second = pair.pop().expect("two keys");
            let first = pair.pop().expect("two keys");
            keys.push([first, second]);
            accounts.push(account);
        }
        let codes = if codes {
            make_codes(store, settings.grant_scale, start).await?
        } else {
            None
        };
        Ok(Side {
            store,
            accounts,
            keys,
            calls: Vec::new(),
            codes,
            now: start,
            settings,
            redeemed: [0; 2],
            lapses: [0; 2],
        })
    }

    /// Applies `op`; returns what an observer can see of the outcome.
    pub(super) async fn apply(&mut self, op: &Op) -> Step<String> {
        match op {
            Op::Grant {
                account,
                subscription,
                amount,
                period,
            } => {
                let bucket = if *subscription {
                    Bucket::Subscription
                } else {
                    Bucket::Topup
                };
                let grant = Grant {
                    period_end: period
                        .filter(|_| *subscription)
                        .map(|seconds| self.now + Duration::seconds(i64::from(seconds))),
                    at: self.now,
                    ..Grant::plain(bucket, Credits::new(*amount))
                };
                let granted = self
                    .store
                    .grant_once(self.accounts[*account], grant)
                    .await
                    .map_err(|e| failed(Rule::Grant, "grant_once", e))?;
                Ok(format!(
                    "granted -> {:?} lapsed {}",
                    granted.balance, granted.lapsed
                ))
            }
            Op::Tick { seconds } => {
                self.now += Duration::seconds(i64::from(*seconds));
                Ok("tick".to_owned())
            }
            Op::Lapse => {
                let lapses = self
                    .store
                    .lapse_ended_subscriptions(self.now)
                    .await
                    .map_err(|e| failed(Rule::Lapse, "lapse_ended_subscriptions", e))?;
                // Only this run's accounts: the store may hold others.
                let mut lapsed: Vec<_> = lapses
                    .iter()
                    .filter_map(|lapse| {
                        let side = self.accounts.iter().position(|a| *a == lapse.account)?;
                        Some((side, lapse.amount, lapse.period_end))
                    })
                    .collect();
                lapsed.sort();
                for (side, _, _) in &lapsed {
                    self.lapses[*side] += 1;
                }
                Ok(format!("lapsed {lapsed:?}"))
            }
            Op::Forget => {
                // How many is not compared: the store may hold other runs' records (a database
                // shared between sequences). What was forgotten shows in the keyed calls after.
                self.store
                    .forget_idempotent_calls(self.now)
                    .await
                    .map_err(|e| failed(Rule::Idempotency, "forget_idempotent_calls", e))?;
                Ok("forgot".to_owned())
            }
            Op::Revoke { account, key } => {
                let hash = self.keys[*account][*key].1.hash();
                let revoked = self
                    .store
                    .revoke_key(&hash)
                    .await
                    .map_err(|e| failed(Rule::Revoke, "revoke_key", e))?;
                Ok(format!("revoked {revoked}"))
            }
            Op::Redeem { account, code } => self.redeem(*account, *code).await,
            Op::Burst(writes) => {
                let done = if self.settings.bursts_in_order {
                    let mut done = Vec::new();
                    for op in writes {
                        done.push(self.write(op).await);
                    }
                    done
                } else {
                    futures::future::join_all(writes.iter().map(|op| self.write(op))).await
                };
                let mut seen = Vec::new();
                for each in done {
                    let (outcome, reserved) = each?;
                    seen.push(outcome);
                    self.calls.extend(reserved);
                }
                Ok(seen.join(" | "))
            }
            write => {
                let (outcome, reserved) = self.write(write).await?;
                self.calls.extend(reserved);
                Ok(outcome)
            }
        }
    }

    async fn redeem(&mut self, account: usize, code: usize) -> Step<String> {
        let Some(codes) = &self.codes else {
            return Ok("no codes".to_owned());
        };
        let redeemed = self
            .store
            .redeem_code(self.accounts[account], &codes[code].hash(), self.now)
            .await
            .map_err(|e| failed(Rule::Codes, "redeem_code", e))?;
        Ok(match redeemed {
            Some(redeemed) => {
                self.redeemed[account] += 1;
                format!(
                    "redeemed {} {:?} -> {:?} lapsed {}",
                    redeemed.credits, redeemed.bucket, redeemed.balance, redeemed.lapsed
                )
            }
            None => "not redeemed".to_owned(),
        })
    }

    /// A reservation, settle or refund: its visible outcome and the call it reserved.
    async fn write(&self, op: &Op) -> Step<(String, Option<(CallId, usize)>)> {
        match *op {
            Op::Reserve {
                account,
                key,
                price,
                idempotency,
            } => {
                let idempotency = idempotency.map(|(idem, body)| {
                    let body = format!("{{\"body\":{body}}}");
                    IdempotencyKey::new(&format!("key-{idem}"), "/v1/messages", body.as_bytes())
                        .expect("a valid idempotency key")
                });
                let request = ChargeRequest::new(
                    Caller {
                        account: self.accounts[account],
                        key: self.keys[account][key].0,
                    },
                    // Every endpoint's calls, each logged with its own protocol.
                    PROTOCOLS[price.unsigned_abs() as usize % PROTOCOLS.len()],
                    "m",
                    Credits::new(price),
                )
                .at(self.now)
                .with_idempotency(idempotency.as_ref())
                // Some calls translated with tools left out, kept in the call log.
                .with_dropped_tools((price % 3 == 0).then_some("web_search, namespace:n"));
                let seen = match self.store.reserve(request).await {
                    Ok(reservation) => {
                        return Ok((
                            format!("reserved {:?}", reservation.taken),
                            Some((reservation.call, key)),
                        ));
                    }
                    Err(ReserveError::InsufficientCredits) => "insufficient".to_owned(),
                    Err(ReserveError::KeyRevoked) => "key revoked".to_owned(),
                    Err(ReserveError::KeyLimitReached) => "key limit".to_owned(),
                    Err(ReserveError::IdempotentCallRunning) => "running".to_owned(),
                    Err(ReserveError::IdempotencyKeyReused) => "key reused".to_owned(),
                    Err(ReserveError::AlreadyAnswered(reply)) => format!("replay {reply:?}"),
                    Err(ReserveError::Store(error)) => {
                        return Err(failed(op.rule(), "reserve", error));
                    }
                };
                Ok((seen, None))
            }
            Op::Settle { .. } | Op::Refund { .. } if self.calls.is_empty() => {
                Ok(("no call yet".to_owned(), None))
            }
            Op::Settle {
                nth,
                reply,
                cost,
                beyond,
            } => {
                let index = nth % self.calls.len();
                let body = format!("{{\"reply\":{index}}}").into();
                let success = CallSuccess {
                    upstream_status: 200,
                    reply: reply
                        .then(|| KeptReply::new(200, Some("application/json".into()), body))
                        .flatten(),
                    cost: cost.map(Credits::new),
                    beyond_reservation: beyond,
                    // Some served by a channel that spoke another protocol.
                    upstream_protocol: index.is_multiple_of(2).then_some(Protocol::Messages),
                    // Some with what they cost the operator (a margin read back from what the
                    // settle charged), some with usage estimated, at a tier, as reported.
                    operator_cost: index.is_multiple_of(3).then(|| OperatorCost {
                        cost: Money::from_nanos(1_234_567 * (index as i64 + 1)),
                        credit_value: Money::from_nanos(10_000_000),
                    }),
                    raw_usage: (index % 4 == 1)
                        .then(|| format!(r#"{{"input_tokens":{index},"output_tokens":1}}"#)),
                    usage: crate::protocol::TokenUsage {
                        estimated: index % 5 == 2,
                        service_tier: (index % 5 == 3).then_some(ServiceTier::Priority),
                        ..Default::default()
                    },
                    ..CallSuccess::default()
                };
                let settled = self
                    .store
                    .settle(self.calls[index].0, success)
                    .await
                    .map_err(|e| failed(Rule::Settle, "settle", e))?;
                Ok((format!("settled {settled}"), None))
            }
            Op::Refund { nth } => {
                let failure = CallFailure {
                    upstream_status: Some(500),
                    error: "conformance".into(),
                };
                let refunded = self
                    .store
                    .refund(self.calls[nth % self.calls.len()].0, &failure)
                    .await
                    .map_err(|e| failed(Rule::Refund, "refund", e))?;
                Ok((format!("refunded {refunded}"), None))
            }
            _ => unreachable!("not a ledger write: {op:?}"),
        }
    }

    /// Whether `op` (or a write of a burst) settles, beyond its reservation, a call made with
    /// a key that has a spending limit (key 0), or may: in a burst, a settle may target a call
    /// the burst itself reserves on key 0. Asked before `op` is applied.
    pub(super) fn settles_beyond_on_a_limited_key(&self, op: &Op) -> bool {
        let beyond = |op: &Op| {
            matches!(
                op,
                Op::Settle {
                    cost: Some(_),
                    beyond: true,
                    ..
                }
            )
        };
        match op {
            Op::Settle { nth, .. } if beyond(op) && !self.calls.is_empty() => {
                self.calls[nth % self.calls.len()].1 == 0
            }
            Op::Burst(writes) => {
                let reserves_limited = writes
                    .iter()
                    .any(|write| matches!(write, Op::Reserve { key: 0, .. }));
                writes.iter().any(|write| {
                    self.settles_beyond_on_a_limited_key(write)
                        || (beyond(write) && reserves_limited)
                })
            }
            _ => false,
        }
    }

    /// No key spent past its limit, and no account holds less than nothing.
    pub(super) async fn limits_hold(&self) -> Step<()> {
        for [limited, _] in &self.keys {
            let info = self
                .store
                .key_info(limited.0)
                .await
                .map_err(|e| failed(Rule::KeyLimit, "key_info", e))?
                .ok_or_else(|| Violation::new(Rule::KeyLimit, "key_info forgot a key".into()))?;
            if info.spent.get() > KEY_LIMIT {
                return Err(Violation::new(
                    Rule::KeyLimit,
                    format!("a key limited to {KEY_LIMIT} spent {}", info.spent),
                ));
            }
        }
        for balance in self.balances().await? {
            if balance.subscription.get() < 0 || balance.topup.get() < 0 {
                return Err(Violation::new(
                    Rule::NoNegativeBalance,
                    format!("a balance below zero: {balance:?}"),
                ));
            }
        }
        Ok(())
    }

    /// Every account's finished calls: protocol, price, status, what each bucket paid and what
    /// the account could not, sorted. (Pending calls and the order are left out: a store may
    /// hold reservations in memory and log a call when it ends.) And how many calls each
    /// account could not pay in full.
    pub(super) async fn call_logs(&self) -> Step<CallLogs> {
        let mut logs = CallLogs::default();
        for (side, account) in self.accounts.iter().enumerate() {
            let calls = self
                .store
                .calls_before(*account, None, 10_000)
                .await
                .map_err(|e| failed(Rule::CallLog, "calls_before", e))?;
            let mut log: Vec<String> = calls
                .iter()
                .filter(|call| call.status != CallStatus::Pending)
                .map(|call| {
                    format!(
                        "{} {} {:?} {}+{} short {} dropped {:?} spoke {:?} cost {:?} margin {:?} \
                         raw {:?} estimated {} tier {:?}",
                        call.protocol.as_str(),
                        call.price,
                        call.status,
                        call.charged_subscription,
                        call.charged_topup,
                        call.shortfall,
                        call.dropped_tools,
                        call.upstream_protocol,
                        call.cost,
                        call.margin,
                        call.raw_usage,
                        call.usage_estimated,
                        call.service_tier,
                    )
                })
                .collect();
            log.sort();
            logs.lines.push(log);
            logs.shortfalls[side] = calls
                .iter()
                .filter(|call| call.shortfall > Credits::ZERO)
                .count()
                .try_into()
                .unwrap_or(u32::MAX);
        }
        Ok(logs)
    }

    pub(super) async fn balances(&self) -> Step<Vec<Balance>> {
        let mut balances = Vec::new();
        for account in &self.accounts {
            balances.push(
                self.store
                    .balance(*account)
                    .await
                    .map_err(|e| failed(Rule::Balance, "balance", e))?,
            );
        }
        Ok(balances)
    }

    /// Each of this run's accounts' books, from the store's audit.
    pub(super) async fn audit_holds(&self) -> Step<()> {
        let audits = self
            .store
            .audit()
            .await
            .map_err(|e| failed(Rule::Audit, "audit", e))?;
        for audit in audits
            .iter()
            .filter(|audit| self.accounts.contains(&audit.account))
        {
            if let Some(problem) = audit.problem() {
                return Err(Violation::new(
                    Rule::Audit,
                    format!("the audit of an account fails ({problem}): {audit:?}"),
                ));
            }
        }
        Ok(())
    }
}

/// Codes 0-2: top-up credits, for good. Codes 3-4: subscription credits for a day, only
/// within the run's first minute. `None` when the store keeps no codes (it refuses a batch
/// with [`StoreError::Unsupported`]).
async fn make_codes(
    store: &dyn Store,
    scale: i64,
    start: DateTime<Utc>,
) -> Step<Option<Vec<NewCode>>> {
    let codes: Vec<NewCode> = (0..super::CODES).map(|_| NewCode::generate()).collect();
    let hashes: Vec<_> = codes.iter().map(NewCode::hash).collect();
    let batches = [
        NewCodeBatch {
            label: Some("conformance top-up"),
            credits: Credits::new(10 * scale),
            bucket: Bucket::Topup,
            period_days: None,
            expires_at: None,
            codes: &hashes[..3],
            at: start,
        },
        NewCodeBatch {
            label: Some("conformance subscription"),
            credits: Credits::new(8 * scale),
            bucket: Bucket::Subscription,
            period_days: Some(1),
            expires_at: Some(start + Duration::seconds(60)),
            codes: &hashes[3..],
            at: start,
        },
    ];
    for batch in batches {
        match store.create_code_batch(batch).await {
            Ok(_) => {}
            Err(StoreError::Unsupported(_)) => return Ok(None),
            Err(error) => return Err(failed(Rule::Codes, "create_code_batch", error)),
        }
    }
    Ok(Some(codes))
}

/// A side's call logs at the end of a run.
#[derive(Debug, Default)]
pub(super) struct CallLogs {
    /// Per account, its finished calls as lines, sorted (batched writes may land in any order).
    pub(super) lines: Vec<Vec<String>>,
    /// Per account, how many of its calls it could not pay in full.
    pub(super) shortfalls: [u32; 2],
}
