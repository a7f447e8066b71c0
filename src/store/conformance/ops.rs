//! The steps a run is made of, and the strategies that draw them.

use proptest::prelude::*;

use super::Rule;

/// One step of a run. A failing run reports its (shrunk) steps in this form, so that they can be
/// replayed with [`Conformance::replay`](super::Conformance::replay).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Credits granted to one of the run's two accounts.
    Grant {
        /// The account (0 or 1).
        account: usize,
        /// Subscription credits (else top-up).
        subscription: bool,
        /// How many.
        amount: i64,
        /// For subscription credits: a period ending this many seconds from now.
        period: Option<u8>,
    },
    /// The clock moves on.
    Tick {
        /// By this many seconds.
        seconds: u8,
    },
    /// Ended periods lapse.
    Lapse,
    /// A call reserves its price.
    Reserve {
        /// The account (0 or 1).
        account: usize,
        /// Its key: 0 has a spending limit of 60 credits, 1 none.
        key: usize,
        /// The price.
        price: i64,
        /// An idempotency key (one of three) and which of two request bodies it comes with.
        idempotency: Option<(u8, u8)>,
    },
    /// The `nth` reserved call (modulo their number) is settled.
    Settle {
        /// Which call.
        nth: usize,
        /// Whether the settle keeps a reply (as it does for a keyed call).
        reply: bool,
        /// What the call cost, for a call priced by tokens (`None`: its reservation): below
        /// it, the rest goes back; above it, the reservation is charged, or with `beyond` what
        /// the account can pay and the key's limit allows beyond it.
        cost: Option<i64>,
        /// Whether a cost above the reservation is charged beyond it.
        beyond: bool,
    },
    /// Idempotency records past their window are deleted.
    Forget,
    /// The `nth` reserved call (modulo their number) is refunded.
    Refund {
        /// Which call.
        nth: usize,
    },
    /// A key is revoked.
    Revoke {
        /// The account (0 or 1).
        account: usize,
        /// Which of its keys.
        key: usize,
    },
    /// A redemption code (one of [`CODES`](super::CODES)) is redeemed for an account: codes 0-2
    /// grant top-up credits, 3-4 start a subscription period and stop working 60 seconds into
    /// the run.
    Redeem {
        /// The account (0 or 1).
        account: usize,
        /// Which code.
        code: usize,
    },
    /// Ledger writes submitted together, in this order (concurrently, unless the run applies
    /// bursts in order).
    Burst(Vec<Op>),
}

impl Op {
    /// The rule a disagreement at this step breaks.
    pub(super) fn rule(&self) -> Rule {
        match self {
            Op::Grant { .. } => Rule::Grant,
            Op::Tick { .. } => Rule::Clock,
            Op::Lapse => Rule::Lapse,
            Op::Reserve {
                idempotency: Some(_),
                ..
            } => Rule::Idempotency,
            Op::Reserve { .. } => Rule::Reserve,
            Op::Settle { .. } => Rule::Settle,
            Op::Forget => Rule::Idempotency,
            Op::Refund { .. } => Rule::Refund,
            Op::Revoke { .. } => Rule::Revoke,
            Op::Redeem { .. } => Rule::Codes,
            Op::Burst(_) => Rule::Concurrency,
        }
    }
}

/// A settle's cost: its reservation (a price per call) half the time, else any cost from one
/// credit (the least a call costs) to well above any reservation (a token-priced call whose
/// estimate was high or low).
fn cost() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![1 => Just(None), 1 => (1..40i64).prop_map(Some)]
}

/// A write a store may apply together with others: a reservation, a settle or a refund.
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

/// A keyed reservation or a settle that keeps its reply. A store may write these outside its
/// batches, so they are never part of a burst (whose order against them the model could not
/// know).
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
pub(super) fn op(scale: i64) -> impl Strategy<Value = Op> {
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
        1 => (0..2usize, 0..super::CODES).prop_map(|(account, code)| Op::Redeem { account, code }),
        2 => prop::collection::vec(ledger_write(), 2..24).prop_map(Op::Burst),
    ]
}
