//! Which webhook events a store writes beside its ledger: whether it writes any
//! ([`SeaOrmStore::with_webhook_events`](super::SeaOrmStore::with_webhook_events)), of which
//! types ([`SeaOrmStore::with_webhook_event_types`](super::SeaOrmStore::with_webhook_event_types)),
//! and the default low-balance threshold
//! ([`SeaOrmStore::with_low_balance_alert`](super::SeaOrmStore::with_low_balance_alert)).
//! Shared by the store's clones, its committer and its escrow, which read it as each batch or
//! refill begins.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, Ordering};

use crate::credits::Credits;
use crate::events::EventType;
use crate::store::rules::alerts::LimitAlert;

/// A store's event settings (see the module docs).
#[derive(Debug)]
pub(super) struct EventSettings {
    on: AtomicBool,
    /// The types written, one bit each (by their place in [`EventType::ALL`]).
    types: AtomicU8,
    low_balance: AtomicI64,
}

impl Default for EventSettings {
    fn default() -> EventSettings {
        EventSettings {
            on: AtomicBool::new(false),
            types: AtomicU8::new(mask(EventType::ALL)),
            low_balance: AtomicI64::new(0),
        }
    }
}

fn bit(kind: EventType) -> u8 {
    let place = EventType::ALL
        .iter()
        .position(|each| *each == kind)
        .expect("every type is in ALL");
    1 << place
}

fn mask(types: impl IntoIterator<Item = EventType>) -> u8 {
    types.into_iter().fold(0, |mask, kind| mask | bit(kind))
}

impl EventSettings {
    pub(super) fn turn_on(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    pub(super) fn set_types(&self, types: impl IntoIterator<Item = EventType>) {
        self.types.store(mask(types), Ordering::Relaxed);
    }

    pub(super) fn set_low_balance(&self, threshold: Credits) {
        self.low_balance.store(threshold.get(), Ordering::Relaxed);
    }

    /// Whether the store writes events of type `kind`.
    pub(super) fn writes(&self, kind: EventType) -> bool {
        self.on.load(Ordering::Relaxed) && self.types.load(Ordering::Relaxed) & bit(kind) != 0
    }

    /// What a ledger write is told with, if the store writes either alert.
    pub(super) fn alerting(&self) -> Option<Alerting> {
        let alerting = Alerting {
            low_balance: self
                .writes(EventType::AccountBalanceLow)
                .then(|| Credits(self.low_balance.load(Ordering::Relaxed))),
            limits: self.writes(EventType::KeyLimitReached),
            shortfalls: self.writes(EventType::CallShortfall),
        };
        (alerting.low_balance.is_some() || alerting.limits || alerting.shortfalls)
            .then_some(alerting)
    }
}

/// What a ledger write is told with: taken as a batch begins.
#[derive(Debug, Clone, Copy)]
pub(super) struct Alerting {
    /// The threshold of accounts without their own, if low balances are told.
    pub(super) low_balance: Option<Credits>,
    /// Whether keys reaching their limits are told.
    pub(super) limits: bool,
    /// Whether calls charged less than they cost are told.
    pub(super) shortfalls: bool,
}

/// An account's threshold, from its row's own (`NULL`: the default); `None`: never told.
pub(super) fn threshold(alerting: Option<Alerting>, own: Option<i64>) -> Option<Credits> {
    let default = alerting?.low_balance?;
    let threshold = own.map_or(default, Credits);
    (threshold > Credits::ZERO).then_some(threshold)
}

/// A key's limit alert, from its row's last window told.
pub(super) fn limit_alert(alerting: Option<Alerting>, told_in: Option<i64>) -> LimitAlert {
    match alerting {
        Some(Alerting { limits: true, .. }) => LimitAlert::Armed { told_in },
        _ => LimitAlert::Off,
    }
}
