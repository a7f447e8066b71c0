//! Model-based property tests of the ledger: random sequences of grants, reservations, settles,
//! refunds and repeated refunds, applied to the in-memory model and to a database backend. After
//! every step both agree on every outcome and balance, and the database's audit holds.

mod common;

use common::*;
use model_gateway::{
    AccountId, Bucket, CallFailure, CallId, CallSuccess, Caller, ChargeRequest, Credits, KeyId,
    MemoryStore, NewApiKey, Protocol, ReserveError, Store,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Grant {
        account: usize,
        subscription: bool,
        amount: i64,
    },
    Reserve {
        account: usize,
        price: i64,
    },
    Settle {
        nth: usize,
    },
    Refund {
        nth: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0..2usize, any::<bool>(), 1..40i64).prop_map(|(account, subscription, amount)| Op::Grant {
            account,
            subscription,
            amount
        }),
        3 => (0..2usize, 1..15i64).prop_map(|(account, price)| Op::Reserve { account, price }),
        2 => (0..64usize).prop_map(|nth| Op::Settle { nth }),
        2 => (0..64usize).prop_map(|nth| Op::Refund { nth }),
    ]
}

/// One backend's side of the run: its accounts, and its call ids in reservation order.
struct Side<'a> {
    store: &'a dyn Store,
    callers: Vec<Caller>,
    calls: Vec<CallId>,
}

impl<'a> Side<'a> {
    async fn new(store: &'a dyn Store) -> Side<'a> {
        let mut callers = Vec::new();
        for _ in 0..2 {
            let account: AccountId = store.create_account("prop").await.unwrap();
            let key: KeyId = store
                .add_key(account, &NewApiKey::generate())
                .await
                .unwrap();
            callers.push(Caller { account, key });
        }
        Side {
            store,
            callers,
            calls: Vec::new(),
        }
    }

    /// Applies `op`; returns what an observer can see of the outcome.
    async fn apply(&mut self, op: &Op) -> String {
        match *op {
            Op::Grant {
                account,
                subscription,
                amount,
            } => {
                let bucket = if subscription {
                    Bucket::Subscription
                } else {
                    Bucket::Topup
                };
                let balance = self
                    .store
                    .grant(self.callers[account].account, bucket, Credits(amount))
                    .await
                    .unwrap();
                format!("granted -> {balance:?}")
            }
            Op::Reserve { account, price } => {
                let request = ChargeRequest {
                    caller: self.callers[account],
                    protocol: Protocol::Messages,
                    model: "m",
                    price: Credits(price),
                };
                match self.store.reserve(request).await {
                    Ok(reservation) => {
                        self.calls.push(reservation.call);
                        format!("reserved {:?}", reservation.taken)
                    }
                    Err(ReserveError::InsufficientCredits) => "insufficient".to_owned(),
                    Err(ReserveError::Store(error)) => panic!("store failed: {error}"),
                }
            }
            Op::Settle { nth } | Op::Refund { nth } if self.calls.is_empty() => {
                let _ = nth;
                "no call yet".to_owned()
            }
            Op::Settle { nth } => {
                let call = self.calls[nth % self.calls.len()];
                let success = CallSuccess {
                    upstream_status: 200,
                    ..CallSuccess::default()
                };
                format!(
                    "settled {}",
                    self.store.settle(call, success).await.unwrap()
                )
            }
            Op::Refund { nth } => {
                let call = self.calls[nth % self.calls.len()];
                let failure = CallFailure {
                    upstream_status: Some(500),
                    error: "prop".into(),
                };
                format!(
                    "refunded {}",
                    self.store.refund(call, &failure).await.unwrap()
                )
            }
        }
    }

    async fn balances(&self) -> Vec<model_gateway::Balance> {
        let mut balances = Vec::new();
        for caller in &self.callers {
            balances.push(self.store.balance(caller.account).await.unwrap());
        }
        balances
    }
}

async fn run_against_model(db: &TestDb, ops: &[Op]) {
    let model = MemoryStore::new();
    let mut expected = Side::new(&model).await;
    let mut actual = Side::new(db.store.as_ref()).await;
    for (step, op) in ops.iter().enumerate() {
        let want = expected.apply(op).await;
        let got = actual.apply(op).await;
        assert_eq!(got, want, "step {step}: {op:?}");
        assert_eq!(
            actual.balances().await,
            expected.balances().await,
            "step {step}: {op:?}"
        );
        for audit in db.store.audit().await.unwrap() {
            assert!(audit.holds(), "step {step}: {op:?}: {audit:?}");
        }
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

    #[test]
    fn sqlite_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(), 1..40)) {
        runtime().block_on(async {
            let db = sqlite_db().await;
            run_against_model(&db, &ops).await;
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn postgres_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(), 1..40)) {
        runtime().block_on(async {
            let Some(db) = postgres_db().await else { return };
            run_against_model(&db, &ops).await;
            db.drop_schema().await;
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn mysql_agrees_with_the_model_on_any_sequence(ops in prop::collection::vec(op(), 1..40)) {
        runtime().block_on(async {
            let Some(db) = mysql_db().await else { return };
            run_against_model(&db, &ops).await;
            db.drop_schema().await;
        });
    }
}
