//! Model-based property tests of the ledger: random sequences of grants (subscription credits
//! with or without a period), reservations, settles, refunds, repeated refunds, key
//! revocations, the clock moving on and ended periods lapsing, alone or in bursts that the
//! database applies as one group-commit batch, and calls with idempotency keys (retries of the
//! same request, the key reused for another, replies kept with the settle, keys forgotten past
//! their window), on keys with and without a spending limit, applied to the in-memory model
//! and to a database backend. After every step
//! both agree on every outcome and balance, and the database's audit holds.

use crate::common;

use chrono::{DateTime, Duration, TimeZone, Utc};
use common::*;
use model_gateway::store::Grant;
use model_gateway::store::{CallStatus, IdempotencyKey, KeptReply};
use model_gateway::{
    AccountId, CallId, Credits, KeyId, MemoryStore, Protocol, Store, credits::Bucket,
    keys::NewApiKey, store::CallFailure, store::CallSuccess, store::Caller, store::ChargeRequest,
    store::ReserveError,
};

/// How long an idempotency key holds in these runs: a few ticks of the clock.
const WINDOW: std::time::Duration = std::time::Duration::from_secs(45);
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Grant {
        account: usize,
        subscription: bool,
        amount: i64,
        /// For subscription credits: a period ending this many seconds from now.
        period: Option<u8>,
    },
    /// The clock moves on.
    Tick {
        seconds: u8,
    },
    /// Ended periods lapse.
    Lapse,
    Reserve {
        account: usize,
        key: usize,
        price: i64,
        /// An idempotency key (one of three) and which of two request bodies it comes with.
        idempotency: Option<(u8, u8)>,
    },
    Settle {
        nth: usize,
        /// Whether the settle keeps a reply (as it does for a keyed call).
        reply: bool,
        /// What the call cost, for a call priced by tokens (`None`: its reservation): below
        /// it, the rest goes back; above it, the reservation is charged, or with `beyond` what
        /// the account can pay and the key's limit allows beyond it.
        cost: Option<i64>,
        beyond: bool,
    },
    /// Idempotency records past their window are deleted.
    Forget,
    Refund {
        nth: usize,
    },
    Revoke {
        account: usize,
        key: usize,
    },
    /// Ledger writes submitted together, in this order, so that the database's committer applies
    /// them in one batch (the test runtime has one thread: all are queued before it runs).
    Burst(Vec<Op>),
}

/// The protocols calls are reserved under, by price.
const PROTOCOLS: [Protocol; 4] = [
    Protocol::ChatCompletions,
    Protocol::Messages,
    Protocol::Embeddings,
    Protocol::Responses,
];

/// A settle's cost: its reservation (a price per call) half the time, else any cost from one
/// credit (the least a call costs) to well above any reservation (a token-priced call whose
/// estimate was high or low).
fn cost() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![1 => Just(None), 1 => (1..40i64).prop_map(Some)]
}

/// A write the committer applies: a reservation, a settle or a refund.
fn ledger_write() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 0..2usize, 1..15i64).prop_map(|(account, key, price)| Op::Reserve {
            account,
            key,
            price,
            idempotency: None
        }),
        2 => (0..64usize, cost(), any::<bool>())
            .prop_map(|(nth, cost, beyond)| Op::Settle { nth, reply: false, cost, beyond }),
        2 => (0..64usize).prop_map(|nth| Op::Refund { nth }),
    ]
}

/// A keyed reservation or a settle that keeps its reply. These take a transaction of their own
/// on a database, outside the group commit, so they are never part of a burst (whose order
/// against them the model could not know).
fn keyed_write() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 0..2usize, 1..15i64, 0..3u8, 0..2u8).prop_map(
            |(account, key, price, idem, body)| Op::Reserve {
                account,
                key,
                price,
                idempotency: Some((idem, body)),
            }
        ),
        2 => (0..64usize, cost(), any::<bool>())
            .prop_map(|(nth, cost, beyond)| Op::Settle { nth, reply: true, cost, beyond }),
    ]
}

/// Any step; grants of 1 to 39 credits times `scale`.
fn op(scale: i64) -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..2usize, any::<bool>(), 1..40i64, prop::option::of(1..30u8)).prop_map(
            move |(account, subscription, amount, period)| Op::Grant {
                account,
                subscription,
                amount: amount * scale,
                period,
            }
        ),
        7 => ledger_write(),
        4 => keyed_write(),
        1 => Just(Op::Forget),
        1 => (0..2usize, 0..2usize).prop_map(|(account, key)| Op::Revoke { account, key }),
        1 => (1..20u8).prop_map(|seconds| Op::Tick { seconds }),
        1 => Just(Op::Lapse),
        2 => prop::collection::vec(ledger_write(), 2..24).prop_map(Op::Burst),
    ]
}

/// One backend's side of the run: its accounts (two keys each), and its call ids in
/// reservation order.
struct Side<'a> {
    store: &'a dyn Store,
    accounts: Vec<AccountId>,
    keys: Vec<[(KeyId, NewApiKey); 2]>,
    calls: Vec<CallId>,
    /// The run's clock, the same on both sides.
    now: DateTime<Utc>,
    /// Whether a burst's writes are applied one after another rather than submitted together
    /// (for a store whose concurrent writes may end in another order than submitted).
    bursts_in_order: bool,
}

impl<'a> Side<'a> {
    async fn new(store: &'a dyn Store) -> Side<'a> {
        let (mut accounts, mut keys) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            let account: AccountId = store.create_account("prop").await.unwrap();
            let key = async || {
                let key = NewApiKey::generate();
                (store.add_key(account, &key).await.unwrap(), key)
            };
            let limited = key().await;
            // The first key of each account may spend 60 credits in all: its reservations are
            // refused past that, its refunds give the allowance back.
            let rules = model_gateway::call::KeyRules {
                limit: Some(model_gateway::call::KeyLimit {
                    credits: Credits::new(60),
                    period: model_gateway::call::LimitPeriod::None,
                }),
                ..Default::default()
            };
            store.set_key_rules(limited.0, &rules).await.unwrap();
            keys.push([limited, key().await]);
            accounts.push(account);
        }
        Side {
            store,
            accounts,
            keys,
            calls: Vec::new(),
            now: Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap(),
            bursts_in_order: false,
        }
    }

    /// Applies `op`; returns what an observer can see of the outcome.
    async fn apply(&mut self, op: &Op) -> String {
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
                    .unwrap();
                format!("granted -> {:?}", granted.balance)
            }
            Op::Tick { seconds } => {
                self.now += Duration::seconds(i64::from(*seconds));
                "tick".to_owned()
            }
            Op::Lapse => {
                let lapses = self
                    .store
                    .lapse_ended_subscriptions(self.now)
                    .await
                    .unwrap();
                let mut lapsed: Vec<_> = lapses
                    .iter()
                    .map(|lapse| {
                        let side = self.accounts.iter().position(|a| *a == lapse.account);
                        (side, lapse.amount, lapse.period_end)
                    })
                    .collect();
                lapsed.sort();
                format!("lapsed {lapsed:?}")
            }
            Op::Forget => {
                let forgotten = self.store.forget_idempotent_calls(self.now).await.unwrap();
                format!("forgot {forgotten}")
            }
            Op::Revoke { account, key } => {
                let hash = self.keys[*account][*key].1.hash();
                format!("revoked {}", self.store.revoke_key(&hash).await.unwrap())
            }
            Op::Burst(writes) => {
                let done = if self.bursts_in_order {
                    let mut done = Vec::new();
                    for op in writes {
                        done.push(self.write(op).await);
                    }
                    done
                } else {
                    futures::future::join_all(writes.iter().map(|op| self.write(op))).await
                };
                let mut seen = Vec::new();
                for (outcome, reserved) in done {
                    seen.push(outcome);
                    self.calls.extend(reserved);
                }
                seen.join(", ")
            }
            write => {
                let (outcome, reserved) = self.write(write).await;
                self.calls.extend(reserved);
                outcome
            }
        }
    }

    /// A reservation, settle or refund: its visible outcome and the call it reserved.
    async fn write(&self, op: &Op) -> (String, Option<CallId>) {
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
                        .unwrap()
                });
                let request = ChargeRequest::new(
                    Caller {
                        account: self.accounts[account],
                        key: self.keys[account][key].0,
                    },
                    // Every endpoint's calls, each logged with its own protocol.
                    PROTOCOLS[price as usize % PROTOCOLS.len()],
                    "m",
                    Credits::new(price),
                )
                .at(self.now)
                .with_idempotency(idempotency.as_ref());
                match self.store.reserve(request).await {
                    Ok(reservation) => (
                        format!("reserved {:?}", reservation.taken),
                        Some(reservation.call),
                    ),
                    Err(ReserveError::InsufficientCredits) => ("insufficient".to_owned(), None),
                    Err(ReserveError::KeyRevoked) => ("key revoked".to_owned(), None),
                    Err(ReserveError::KeyLimitReached) => ("key limit".to_owned(), None),
                    Err(ReserveError::IdempotentCallRunning) => ("running".to_owned(), None),
                    Err(ReserveError::IdempotencyKeyReused) => ("key reused".to_owned(), None),
                    Err(ReserveError::AlreadyAnswered(reply)) => {
                        (format!("replay {reply:?}"), None)
                    }
                    Err(ReserveError::Store(error)) => panic!("store failed: {error}"),
                    Err(other) => panic!("a refusal the model does not know: {other}"),
                }
            }
            Op::Settle { .. } | Op::Refund { .. } if self.calls.is_empty() => {
                ("no call yet".to_owned(), None)
            }
            Op::Settle {
                nth,
                reply,
                cost,
                beyond,
            } => {
                let index = nth % self.calls.len();
                let call = self.calls[index];
                let body = format!("{{\"reply\":{index}}}").into();
                let success = CallSuccess {
                    upstream_status: 200,
                    reply: reply
                        .then(|| KeptReply::new(200, Some("application/json".into()), body))
                        .flatten(),
                    cost: cost.map(Credits::new),
                    beyond_reservation: beyond,
                    ..CallSuccess::default()
                };
                let settled = self.store.settle(call, success).await.unwrap();
                (format!("settled {settled}"), None)
            }
            Op::Refund { nth } => {
                let call = self.calls[nth % self.calls.len()];
                let failure = CallFailure {
                    upstream_status: Some(500),
                    error: "prop".into(),
                };
                let refunded = self.store.refund(call, &failure).await.unwrap();
                (format!("refunded {refunded}"), None)
            }
            _ => unreachable!("not a ledger write: {op:?}"),
        }
    }

    /// No key spent past its limit (60), and no account holds less than nothing, whatever a
    /// settle's cost.
    async fn limits_hold(&self, when: &str) {
        for [limited, _] in &self.keys {
            let info = self.store.key_info(limited.0).await.unwrap().unwrap();
            assert!(info.spent.get() <= 60, "{when}: {info:?}");
        }
        for balance in self.balances().await {
            assert!(
                balance.subscription.get() >= 0 && balance.topup.get() >= 0,
                "{when}"
            );
        }
    }

    /// Every account's finished calls: protocol, price, status, what each bucket paid and what the
    /// account could not, sorted.
    /// (Pending calls are left out, and the order too: an owned `SQLite` file holds its
    /// reservations in memory and logs a call, with its id, when it ends.)
    async fn call_logs(&self) -> Vec<Vec<String>> {
        let mut logs = Vec::new();
        for account in &self.accounts {
            let calls = self
                .store
                .calls_before(*account, None, 10_000)
                .await
                .unwrap();
            let mut log: Vec<String> = calls
                .iter()
                .filter(|call| call.status != CallStatus::Pending)
                .map(|call| {
                    format!(
                        "{} {} {:?} {}+{} short {}",
                        call.protocol.as_str(),
                        call.price,
                        call.status,
                        call.charged_subscription,
                        call.charged_topup,
                        call.shortfall
                    )
                })
                .collect();
            log.sort();
            logs.push(log);
        }
        logs
    }

    async fn balances(&self) -> Vec<model_gateway::Balance> {
        let mut balances = Vec::new();
        for account in &self.accounts {
            balances.push(self.store.balance(*account).await.unwrap());
        }
        balances
    }
}

async fn run_against_model(db: &TestDb, ops: &[Op]) {
    let store = db.store.as_ref().clone().with_idempotency_window(WINDOW);
    run_store_against_model(db, &store, ops, false).await;
}

/// `store` (on `db`) against the model; `bursts_in_order`: see [`Side`]. In the end the store's
/// lease, if it holds one, is released, and both still agree.
async fn run_store_against_model(
    db: &TestDb,
    store: &dyn Store,
    ops: &[Op],
    bursts_in_order: bool,
) {
    let model = MemoryStore::new().with_idempotency_window(WINDOW);
    let mut expected = Side::new(&model).await;
    let mut actual = Side::new(store).await;
    actual.bursts_in_order = bursts_in_order;
    for (step, op) in ops.iter().enumerate() {
        let want = expected.apply(op).await;
        let got = actual.apply(op).await;
        assert_eq!(got, want, "step {step}: {op:?}");
        assert_eq!(
            actual.balances().await,
            expected.balances().await,
            "step {step}: {op:?}"
        );
        audit_holds(db, &format!("step {step}: {op:?}")).await;
        actual.limits_hold(&format!("step {step}: {op:?}")).await;
        // Every write here is valid: none may need the committer's roll-back-and-rerun path,
        // which would hide a batch that decided wrongly behind its one-by-one rerun.
        assert_eq!(
            db.store.group_commit_stats().rolled_back,
            0,
            "step {step}: {op:?}"
        );
    }
    store.release_lease().await.unwrap();
    assert_eq!(
        actual.balances().await,
        expected.balances().await,
        "after release"
    );
    assert_eq!(
        actual.call_logs().await,
        expected.call_logs().await,
        "the call logs"
    );
    audit_holds(db, "after release").await;
}

async fn audit_holds(db: &TestDb, when: &str) {
    for audit in model_gateway::Accounts::audit(db.store.as_ref())
        .await
        .unwrap()
    {
        assert!(audit.holds(), "{when}: {audit:?}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[cfg(feature = "sqlite")]
    #[test]
    fn sqlite_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(1), 1..40)) {
        runtime().block_on(async {
            let db = sqlite_db().await;
            run_against_model(&db, &ops).await;
        });
    }

    /// The same file owned by its store: reservations held in memory, written when they end.
    #[cfg(feature = "sqlite")]
    #[test]
    fn an_owned_sqlite_file_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(1), 1..40)) {
        runtime().block_on(async {
            let db = owned_sqlite_db().await;
            run_against_model(&db, &ops).await;
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn postgres_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(1), 1..40)) {
        runtime().block_on(async {
            let Some(db) = postgres_db().await else { return };
            run_against_model(&db, &ops).await;
            db.drop_schema().await;
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The same with credit escrow, one instance. Grants are 200 times larger, so that an
    /// account moves between having escrow (256 calls' worth or more) and being charged in
    /// the database. Bursts are applied in order: escrowed reservations wait for a key read
    /// and endings for a batch, so writes submitted together may end in any order. At the end
    /// the lease is released, giving the escrow back, and both still agree.
    #[test]
    fn postgres_with_escrow_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(200), 1..40)) {
        runtime().block_on(async {
            let Some(db) = postgres_db().await else { return };
            let store = db.store.as_ref().clone().with_idempotency_window(WINDOW).with_escrow().unwrap();
            model_gateway::store::Leases::take_lease(&store, Utc::now(), std::time::Duration::from_secs(3600)).await.unwrap();
            run_store_against_model(&db, &store, &ops, true).await;
            drop(store);
            db.drop_schema().await;
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn mysql_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(1), 1..40)) {
        runtime().block_on(async {
            let Some(db) = mysql_db().await else { return };
            run_against_model(&db, &ops).await;
            db.drop_schema().await;
        });
    }
}

/// A sequence the escrow run once found: a call reserved in the database (its account had too
/// little escrow at the time) settled above its reservation while the instance's escrow held
/// free credits of its account. The settle must pay from the account as a whole, subscription
/// first, as the model does, not from the row alone.
#[tokio::test(flavor = "current_thread")]
async fn escrow_settles_a_database_reserved_call_above_its_reservation_from_the_whole_account() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let store = db
        .store
        .as_ref()
        .clone()
        .with_idempotency_window(WINDOW)
        .with_escrow()
        .unwrap();
    model_gateway::store::Leases::take_lease(
        &store,
        Utc::now(),
        std::time::Duration::from_secs(3600),
    )
    .await
    .unwrap();
    let ops = vec![
        Op::Grant {
            account: 0,
            subscription: false,
            amount: 200,
            period: None,
        },
        Op::Revoke { account: 1, key: 0 },
        Op::Grant {
            account: 0,
            subscription: false,
            amount: 200,
            period: None,
        },
        Op::Burst(vec![
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
        ]),
        Op::Grant {
            account: 1,
            subscription: true,
            amount: 200,
            period: None,
        },
        Op::Burst(vec![
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 0,
                price: 1,
                idempotency: None,
            },
        ]),
        Op::Reserve {
            account: 1,
            key: 1,
            price: 1,
            idempotency: Some((0, 0)),
        },
        Op::Grant {
            account: 1,
            subscription: false,
            amount: 7400,
            period: None,
        },
        Op::Burst(vec![
            Op::Reserve {
                account: 0,
                key: 0,
                price: 7,
                idempotency: None,
            },
            Op::Settle {
                nth: 22,
                reply: false,
                cost: Some(3),
                beyond: false,
            },
        ]),
        Op::Burst(vec![
            Op::Refund { nth: 59 },
            Op::Refund { nth: 23 },
            Op::Reserve {
                account: 1,
                key: 1,
                price: 6,
                idempotency: None,
            },
            Op::Settle {
                nth: 57,
                reply: false,
                cost: None,
                beyond: false,
            },
            Op::Reserve {
                account: 1,
                key: 0,
                price: 2,
                idempotency: None,
            },
            Op::Reserve {
                account: 1,
                key: 1,
                price: 13,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 1,
                price: 12,
                idempotency: None,
            },
            Op::Settle {
                nth: 51,
                reply: false,
                cost: None,
                beyond: false,
            },
            Op::Settle {
                nth: 57,
                reply: false,
                cost: None,
                beyond: false,
            },
            Op::Reserve {
                account: 0,
                key: 1,
                price: 2,
                idempotency: None,
            },
            Op::Reserve {
                account: 1,
                key: 1,
                price: 11,
                idempotency: None,
            },
            Op::Settle {
                nth: 41,
                reply: false,
                cost: Some(28),
                beyond: false,
            },
            Op::Settle {
                nth: 46,
                reply: false,
                cost: Some(32),
                beyond: false,
            },
            Op::Reserve {
                account: 1,
                key: 1,
                price: 4,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 1,
                price: 2,
                idempotency: None,
            },
            Op::Reserve {
                account: 1,
                key: 0,
                price: 10,
                idempotency: None,
            },
            Op::Reserve {
                account: 0,
                key: 1,
                price: 9,
                idempotency: None,
            },
        ]),
    ];
    run_store_against_model(&db, &store, &ops, true).await;
    drop(store);
    db.drop_schema().await;
}
