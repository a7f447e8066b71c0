//! What the ledger's writers and deciders share: a charge that can wait in a queue, one write
//! waiting for its batch and what it came to, what a batch must read, and an account as read.
//! A leaf: the batch plan, the holds, the jobs and the committers all build on it.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};

use crate::credits::{Balance, Credits};
use crate::protocol::Protocol;
use crate::store::rules::alerts::LimitAlert;
pub(super) use crate::store::unknown_account;
use crate::store::{
    CallFailure, CallId, CallSuccess, Caller, ChargeRequest, IdempotencyKey, LeaseId, Reservation,
    ReserveError,
};

/// A [`ChargeRequest`] that can wait in a queue.
#[derive(Debug, Clone)]
pub(super) struct OwnedCharge {
    pub(super) caller: Caller,
    pub(super) protocol: Protocol,
    pub(super) model: String,
    pub(super) requested_model: Option<String>,
    pub(super) dropped_tools: Option<String>,
    pub(super) price: Credits,
    pub(super) request_id: Option<String>,
    pub(super) at: DateTime<Utc>,
    /// The lease of the instance making the reservation (recorded on its entry).
    pub(super) instance: Option<LeaseId>,
    /// The client's idempotency key. A call held with one (on a file its store owns) gets its
    /// key's record when it ends, in the batch that writes its entry.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // read by an owned SQLite file
    pub(super) keyed: Option<IdempotencyKey>,
}

impl From<ChargeRequest<'_>> for OwnedCharge {
    fn from(request: ChargeRequest<'_>) -> OwnedCharge {
        OwnedCharge {
            caller: request.caller,
            protocol: request.protocol,
            model: request.model.to_owned(),
            requested_model: request.requested_model.map(str::to_owned),
            dropped_tools: request.dropped_tools.map(str::to_owned),
            price: request.price,
            request_id: request.request_id.map(str::to_owned),
            at: request.at,
            instance: None,
            keyed: request.idempotency.cloned(),
        }
    }
}

/// One ledger write waiting for its batch.
#[derive(Debug)]
pub(super) enum Write {
    Reserve(OwnedCharge),
    Settle(CallId, Box<CallSuccess>),
    Refund(CallId, CallFailure),
}

impl Write {
    /// Whether, on a file its store owns, this write holds back reservations decided at once
    /// while it waits for the committer (see `owned::State::queued`). A reservation, a refund
    /// or the settle of a call priced by tokens changes what an account has to spend (its cost
    /// returns part of what it held, or takes more); a settle at its price only turns held
    /// credits into a debit, so what later reservations see does not wait on it.
    #[cfg(feature = "sqlite")]
    pub(super) fn holds_back_reservations(&self) -> bool {
        match self {
            Write::Reserve(_) | Write::Refund(..) => true,
            Write::Settle(_, success) => success.cost.is_some(),
        }
    }
}

/// Claims every settle of a batch for its commit (see [`crate::store::SettleClaim`]): the
/// positions of those whose callers gave up on them first, which the batch must not commit.
pub(super) fn abandoned_settles(writes: &[&Write]) -> Vec<usize> {
    writes
        .iter()
        .enumerate()
        .filter(|(_, write)| matches!(write, Write::Settle(_, success) if !success.claim.claim()))
        .map(|(position, _)| position)
        .collect()
}

/// A batch's writes less the settles whose callers gave up on them while it waited (see
/// [`crate::store::SettleClaim`]): what each try writes, and each write's answer once a try
/// commits. A try that finds a settle abandoned is rolled back, and the next leaves it out.
pub(super) struct Unabandoned<'w, 'a> {
    writes: &'w [&'a Write],
    left_out: Vec<usize>,
    /// Positions in `writes` of what the last [`batch`](Self::batch) holds.
    written: Vec<usize>,
}

impl<'w, 'a> Unabandoned<'w, 'a> {
    pub(super) fn new(writes: &'w [&'a Write]) -> Unabandoned<'w, 'a> {
        Unabandoned {
            writes,
            left_out: Vec::new(),
            written: Vec::new(),
        }
    }

    /// The writes to try now.
    pub(super) fn batch(&mut self) -> Vec<&'a Write> {
        self.written = (0..self.writes.len())
            .filter(|position| !self.left_out.contains(position))
            .collect();
        self.written
            .iter()
            .map(|&position| self.writes[position])
            .collect()
    }

    /// Claims the settles of the batch just tried (`batch`): `true` if the try may commit;
    /// else those abandoned are left out of the next.
    pub(super) fn claimed(&mut self, batch: &[&Write]) -> bool {
        let abandoned = abandoned_settles(batch);
        let written = &self.written;
        self.left_out
            .extend(abandoned.iter().map(|&index| written[index]));
        self.left_out.sort_unstable();
        abandoned.is_empty()
    }

    /// Takes back the claims of the batch just tried, whose commit failed for certain (a local
    /// file's): their callers may still give up on them (see
    /// [`crate::store::SettleClaim::release`]).
    #[cfg(feature = "sqlite")]
    pub(super) fn release(batch: &[&Write]) {
        for write in batch {
            if let Write::Settle(_, success) = write {
                success.claim.release();
            }
        }
    }

    /// Every write's answer, given the committed try's outcomes (in order): a settle left out
    /// finished nothing.
    pub(super) fn outcomes(&self, written: Vec<Outcome>) -> Vec<Outcome> {
        let mut written = written.into_iter();
        let outcomes: Vec<Outcome> = (0..self.writes.len())
            .map(|position| {
                if self.left_out.contains(&position) {
                    Outcome::Finished(false)
                } else {
                    written.next().expect("an outcome for every write written")
                }
            })
            .collect();
        debug_assert!(written.next().is_none(), "no outcome without its write");
        outcomes
    }
}

/// What one write came to, once its batch is written (and, for the caller to hear it,
/// committed).
#[derive(Debug)]
pub(super) enum Outcome {
    Reserved(Result<Reservation, ReserveError>),
    /// A settle or refund: `true` if it finished a `pending` entry.
    Finished(bool),
}

/// The rows a batch must read before it decides: the entries its settles and refunds finish,
/// the accounts its reservations charge (refunds add their entries' accounts) and its callers'
/// keys.
#[derive(Debug, Default)]
pub(super) struct Wanted {
    pub(super) entries: BTreeSet<i64>,
    pub(super) accounts: BTreeSet<i64>,
    pub(super) keys: BTreeSet<i64>,
    /// How many reservations the batch holds (each may need a new entry).
    pub(super) reservations: usize,
}

/// A key as a batch reads it: whether it may reserve (not revoked), its allowance if it has a
/// spending limit, and whether reaching that is told.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeyRead {
    pub(super) active: bool,
    pub(super) allowance: Option<crate::store::rules::allowance::Allowance>,
    pub(super) limit_alert: LimitAlert,
}

/// An account as a batch reads it: its balance, when its subscription credits end, and below
/// what its balance is told (`None`: never).
#[derive(Debug, Clone, Copy)]
pub(super) struct AccountRead {
    pub(super) balance: Balance,
    pub(super) subscription_ends_at: Option<DateTime<Utc>>,
    pub(super) alert_below: Option<Credits>,
}

/// A limited key whose row a batch changes: what it has spent, in which window, and the window
/// its limit was told in, if the batch told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyChange {
    pub(super) key: i64,
    pub(super) spent: i64,
    pub(super) window: i64,
    pub(super) told_in: Option<i64>,
}
