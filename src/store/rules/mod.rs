//! The rules that move credits, as plain functions over plain values: no database, runtime or
//! clock inside. Every store and every charging mode of this crate calls them, so a rule is
//! changed in one place and tested alone (unit and property tests beside each, and the
//! model-based suite `store::conformance` against every backend). They are public so that an
//! embedder's own implementation of the storage traits decides as ours do: read the rows, call
//! the rule, write what it decided, in one transaction.
//!
//! - [`reserve`]: may a call reserve its price, and from which buckets;
//! - [`allowance`]: what a key with a spending limit may still spend;
//! - [`alerts`]: which writes are told as events (a balance running low, a limit reached);
//! - [`holds`]: what a reservation holds, and what a settle and a refund move;
//! - [`settle`]: what a call is charged once its cost is known, and what goes back;
//! - [`escrow`]: what a call may hold of an escrow pot;
//! - [`idempotency`]: what a call with an idempotency key gets;
//! - [`codes`]: whether a redemption code may be redeemed;
//! - [`lapse`]: what an ended subscription period's lapse takes;
//! - [`usage`]: what a call that did not report its output is charged for.

pub mod alerts;
pub mod allowance;
pub mod codes;
#[cfg(any(feature = "postgres", test))]
pub mod escrow;
pub mod holds;
pub mod idempotency;
pub mod lapse;
pub mod reserve;
pub mod settle;
pub mod usage;

/// Values the rules' tests are written in.
#[cfg(test)]
mod test_values {
    use crate::credits::{Balance, Credits, Split};

    pub(super) fn balance(subscription: i64, topup: i64) -> Balance {
        Balance {
            subscription: Credits::new(subscription),
            topup: Credits::new(topup),
        }
    }

    pub(super) fn split(subscription: i64, topup: i64) -> Split {
        Split {
            subscription: Credits::new(subscription),
            topup: Credits::new(topup),
        }
    }
}
