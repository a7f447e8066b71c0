//! Which webhook events a store writes beside its ledger: whether it writes any
//! ([`SeaOrmStore::with_webhook_events`](super::SeaOrmStore::with_webhook_events)) and the
//! default low-balance threshold
//! ([`SeaOrmStore::with_low_balance_alert`](super::SeaOrmStore::with_low_balance_alert)).
//! Shared by the store's clones, its committer and its escrow, which read it as each batch or
//! refill begins.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use crate::credits::Credits;
use crate::store::rules::alerts::LimitAlert;

/// A store's event settings (see the module docs).
#[derive(Debug, Default)]
pub(super) struct EventSettings {
    on: AtomicBool,
    low_balance: AtomicI64,
}

impl EventSettings {
    pub(super) fn turn_on(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    pub(super) fn set_low_balance(&self, threshold: Credits) {
        self.low_balance.store(threshold.get(), Ordering::Relaxed);
    }

    /// Whether the store writes events at all.
    pub(super) fn writes(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// What a ledger write is told with, if the store writes events.
    pub(super) fn alerting(&self) -> Option<Alerting> {
        self.writes().then(|| Alerting {
            low_balance: Credits(self.low_balance.load(Ordering::Relaxed)),
        })
    }
}

/// What a ledger write is told with: taken as a batch begins.
#[derive(Debug, Clone, Copy)]
pub(super) struct Alerting {
    /// The threshold of accounts without their own.
    pub(super) low_balance: Credits,
}

/// An account's threshold, from its row's own (`NULL`: the default); `None`: never told.
pub(super) fn threshold(alerting: Option<Alerting>, own: Option<i64>) -> Option<Credits> {
    let alerting = alerting?;
    let threshold = own.map_or(alerting.low_balance, Credits);
    (threshold > Credits::ZERO).then_some(threshold)
}

/// A key's limit alert, from its row's last window told.
pub(super) fn limit_alert(alerting: Option<Alerting>, told_in: Option<i64>) -> LimitAlert {
    match alerting {
        Some(_) => LimitAlert::Armed { told_in },
        None => LimitAlert::Off,
    }
}
