//! What a batch reads and writes, as rows: the rows its writes want, what it read of them
//! under lock, and the entries it inserts, finishes, or inserts already finished (see
//! `super::batch`, which decides them).

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};

use crate::credits::{Credits, Split};
use crate::store::rules::settle::Settlement;
use crate::store::sea::held::{HeldCall, Holds};
use crate::store::sea::writes::{AccountRead, KeyRead, OwnedCharge, Wanted, Write};
use crate::store::{CallFailure, CallStatus, CallSuccess};

impl Wanted {
    /// What `writes` need read; a call held in `holds` needs its account, not an entry.
    pub(in crate::store::sea) fn of(writes: &[&Write], holds: Option<&Holds>) -> Wanted {
        let mut wanted = Wanted::default();
        for write in writes {
            match write {
                Write::Reserve(charge) => {
                    wanted.accounts.insert(charge.caller.account.0);
                    wanted.keys.insert(charge.caller.key.0);
                    wanted.reservations += 1;
                }
                Write::Settle(call, _) | Write::Refund(call, _) => {
                    match holds.and_then(|holds| holds.call(*call)) {
                        Some(held) => {
                            wanted.accounts.insert(held.account.0);
                            wanted.keys.insert(held.charge.caller.key.0);
                        }
                        None => {
                            wanted.entries.insert(call.0);
                        }
                    };
                }
            }
        }
        wanted
    }

    /// The keys to read (and lock where limited) once the entries are read: the
    /// reservations', the held calls' and the entries'.
    pub(in crate::store::sea) fn keys_with(&self, entries: &BTreeMap<i64, Entry>) -> BTreeSet<i64> {
        let mut keys = self.keys.clone();
        keys.extend(entries.values().map(|entry| entry.key));
        keys
    }

    /// The accounts to lock once the entries are read: the reservations' and the entries'.
    pub(in crate::store::sea) fn accounts_with(
        &self,
        entries: &BTreeMap<i64, Entry>,
    ) -> BTreeSet<i64> {
        let mut accounts = self.accounts.clone();
        accounts.extend(entries.values().map(|entry| entry.account));
        accounts
    }
}

/// What a batch read, under lock. Rows that do not exist are simply absent.
#[derive(Debug, Default)]
pub(in crate::store::sea) struct Reads {
    pub(in crate::store::sea) entries: BTreeMap<i64, Entry>,
    pub(in crate::store::sea) accounts: BTreeMap<i64, AccountRead>,
    pub(in crate::store::sea) keys: BTreeMap<i64, KeyRead>,
    /// Whether a settle that leaves a shortfall is told (`call.shortfall`).
    pub(in crate::store::sea) tell_shortfalls: bool,
}

/// A call-log entry that a settle or refund may finish.
#[derive(Debug)]
pub(in crate::store::sea) struct Entry {
    pub(in crate::store::sea) account: i64,
    pub(in crate::store::sea) key: i64,
    pub(in crate::store::sea) pending: bool,
    pub(in crate::store::sea) taken: Split,
    /// Its `created_at`: the window its key's spending counts in.
    pub(in crate::store::sea) reserved_at: DateTime<Utc>,
}

/// A `pending` entry to insert.
#[derive(Debug)]
pub(in crate::store::sea) struct NewEntry<'a> {
    pub(in crate::store::sea) account: i64,
    pub(in crate::store::sea) charge: &'a OwnedCharge,
    pub(in crate::store::sea) taken: Split,
}

/// How a finished entry ends.
#[derive(Debug)]
pub(in crate::store::sea) enum Finish<'a> {
    /// Billed: what it reported, and what the settle charged of it.
    Settled(&'a CallSuccess, Settlement),
    Refunded(&'a CallFailure),
    /// A held call whose credits were gone from its account when it ended (another
    /// connection took them meanwhile): written `refunded`, nothing billed.
    CreditsGone(&'a CallSuccess),
}

impl Finish<'_> {
    /// The status the entry ends in.
    pub(in crate::store::sea) fn status(&self) -> CallStatus {
        match self {
            Finish::Settled(..) => CallStatus::Ok,
            Finish::Refunded(_) | Finish::CreditsGone(_) => CallStatus::Refunded,
        }
    }

    pub(in crate::store::sea) fn upstream_status(&self) -> Option<i32> {
        match self {
            Finish::Settled(success, _) | Finish::CreditsGone(success) => {
                Some(i32::from(success.upstream_status))
            }
            Finish::Refunded(failure) => failure.upstream_status.map(i32::from),
        }
    }

    /// What a billed call reports (its channel and token counts); `None` for the others.
    pub(in crate::store::sea) fn billed(&self) -> Option<&CallSuccess> {
        match self {
            Finish::Settled(success, _) => Some(success),
            Finish::Refunded(_) | Finish::CreditsGone(_) => None,
        }
    }

    /// What a billed call's settle charged, bucket by bucket, and what its account could not
    /// pay of its cost; `None` for the others (their entries keep what they took).
    pub(in crate::store::sea) fn charged(&self) -> Option<(Split, Credits)> {
        match self {
            Finish::Settled(_, settled) => Some((settled.charged, settled.shortfall)),
            Finish::Refunded(_) | Finish::CreditsGone(_) => None,
        }
    }

    /// Why a call was not billed; `None` for a billed one.
    pub(in crate::store::sea) fn error(&self) -> Option<&str> {
        match self {
            Finish::Settled(..) => None,
            Finish::Refunded(failure) => Some(&failure.error),
            Finish::CreditsGone(_) => Some(CREDITS_GONE),
        }
    }
}

/// Why a held call ended with [`Finish::CreditsGone`], as its entry records it.
pub(in crate::store::sea) const CREDITS_GONE: &str =
    "not billed: its credits were taken from the account while the call ran";

/// A held call that ends in this batch: its entry is inserted, already finished.
#[derive(Debug)]
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // written by `sqlite_direct` only
pub(in crate::store::sea) struct EndedHold<'a> {
    pub(in crate::store::sea) call: i64,
    pub(in crate::store::sea) held: &'a HeldCall,
    pub(in crate::store::sea) finish: Finish<'a>,
}
