//! The rules that move credits, as plain functions over plain values: no database, runtime or
//! clock inside. Every store and every charging mode calls them, so a rule is changed in one
//! place and tested alone (unit and property tests here, against the in-memory model in
//! `tests/it/ledger_properties.rs`).
//!
//! - [`reserve`]: may a call reserve its price, and from which buckets;
//! - [`allowance`]: what a key with a spending limit may still spend;
//! - [`alerts`]: which writes are told as events (a balance running low, a limit reached);
//! - [`holds`]: what a reservation holds, and what a settle and a refund move;
//! - [`settle`]: what a call is charged once its cost is known, and what goes back;
//! - [`escrow`]: what a call may hold of an escrow pot;
//! - [`idempotency`]: what a call with an idempotency key gets.

pub(crate) mod alerts;
pub(crate) mod allowance;
#[cfg(any(feature = "postgres", test))]
pub(crate) mod escrow;
pub(crate) mod holds;
pub(crate) mod idempotency;
pub(crate) mod reserve;
pub(crate) mod settle;

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
