//! One group-commit batch, decided in memory: which rows it must read (and lock), what each
//! write comes to against those rows, in queue order, and what must be written. The decisions
//! are the in-memory model's own, taken against rows nobody else can change while the batch's
//! transaction holds them. Both ways of writing a batch use this: set-based statements through
//! sea-orm ([`super::ledger_ops`]) and, for a `SQLite` file, direct calls on the committer's own
//! thread ([`super::sqlite_direct`]).

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};

use crate::credits::{Balance, Credits, Split};
use crate::protocol::Protocol;
use crate::store::{
    AccountId, CallFailure, CallId, CallSuccess, Caller, ChargeRequest, Reservation, ReserveError,
    StoreError,
};

/// A [`ChargeRequest`] that can wait in a queue.
#[derive(Debug, Clone)]
pub(super) struct OwnedCharge {
    pub(super) caller: Caller,
    pub(super) protocol: Protocol,
    pub(super) model: String,
    pub(super) price: Credits,
    pub(super) request_id: Option<String>,
    pub(super) at: DateTime<Utc>,
    /// The lease of the instance making the reservation (recorded on its entry).
    pub(super) instance: Option<i64>,
}

impl From<ChargeRequest<'_>> for OwnedCharge {
    fn from(request: ChargeRequest<'_>) -> OwnedCharge {
        OwnedCharge {
            caller: request.caller,
            protocol: request.protocol,
            model: request.model.to_owned(),
            price: request.price,
            request_id: request.request_id.map(str::to_owned),
            at: request.at,
            instance: None,
        }
    }
}

/// One ledger write waiting for its batch.
#[derive(Debug)]
pub(super) enum Write {
    Reserve(OwnedCharge),
    Settle(CallId, CallSuccess),
    Refund(CallId, CallFailure),
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

impl Wanted {
    pub(super) fn of(writes: &[&Write]) -> Wanted {
        let mut wanted = Wanted::default();
        for write in writes {
            match write {
                Write::Reserve(charge) => {
                    wanted.accounts.insert(charge.caller.account.0);
                    wanted.keys.insert(charge.caller.key.0);
                    wanted.reservations += 1;
                }
                Write::Settle(call, _) | Write::Refund(call, _) => {
                    wanted.entries.insert(call.0);
                }
            }
        }
        wanted
    }

    /// The accounts to lock once the entries are read: the reservations' and the entries'.
    pub(super) fn accounts_with(&self, entries: &BTreeMap<i64, Entry>) -> BTreeSet<i64> {
        let mut accounts = self.accounts.clone();
        accounts.extend(entries.values().map(|entry| entry.account));
        accounts
    }
}

/// What a batch read, under lock. Rows that do not exist are simply absent.
#[derive(Debug, Default)]
pub(super) struct Reads {
    pub(super) entries: BTreeMap<i64, Entry>,
    pub(super) accounts: BTreeMap<i64, AccountRead>,
    pub(super) active_keys: BTreeSet<i64>,
}

/// An account as a batch reads it: its balance, and when its subscription credits end.
#[derive(Debug, Clone, Copy)]
pub(super) struct AccountRead {
    pub(super) balance: Balance,
    pub(super) subscription_ends_at: Option<DateTime<Utc>>,
}

/// A call-log entry that a settle or refund may finish.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) account: i64,
    pub(super) pending: bool,
    pub(super) taken: Split,
}

/// A `pending` entry to insert.
#[derive(Debug)]
pub(super) struct NewEntry<'a> {
    pub(super) account: i64,
    pub(super) charge: &'a OwnedCharge,
    pub(super) taken: Split,
}

/// How a finished entry ends.
#[derive(Debug)]
pub(super) enum Finish<'a> {
    Settled(&'a CallSuccess),
    Refunded(&'a CallFailure),
}

/// A batch decided: what to insert, finish and write to the accounts, and each write's answer.
#[derive(Debug)]
pub(super) struct Plan<'a> {
    /// New `pending` entries, in queue order.
    pub(super) new_entries: Vec<NewEntry<'a>>,
    /// Entries that stop being `pending`, with how.
    pub(super) finished: Vec<(i64, Finish<'a>)>,
    /// Each account's balance as the batch leaves it, and its net change.
    accounts: BTreeMap<i64, Held>,
    decisions: Vec<Decision>,
}

#[derive(Debug)]
struct Held {
    balance: Balance,
    change: Balance,
    subscription_ends_at: Option<DateTime<Utc>>,
}

#[derive(Debug)]
enum Decision {
    /// Index into [`Plan::new_entries`].
    Reserved(usize),
    Refused(ReserveError),
    Finished(bool),
}

impl<'a> Plan<'a> {
    /// Decides every write, in order, against what the batch read.
    pub(super) fn decide(writes: &[&'a Write], reads: Reads) -> Result<Plan<'a>, StoreError> {
        let Reads {
            mut entries,
            accounts,
            active_keys,
        } = reads;
        let accounts = accounts
            .into_iter()
            .map(|(id, read)| {
                let held = Held {
                    balance: read.balance,
                    change: Balance::default(),
                    subscription_ends_at: read.subscription_ends_at,
                };
                (id, held)
            })
            .collect();
        let mut plan = Plan {
            new_entries: Vec::new(),
            finished: Vec::new(),
            accounts,
            decisions: Vec::with_capacity(writes.len()),
        };
        for write in writes {
            let decision = match write {
                Write::Reserve(charge) => plan.reserve(charge, &active_keys),
                Write::Settle(call, success) => match entries.get_mut(&call.0) {
                    Some(entry) if entry.pending => {
                        entry.pending = false;
                        plan.finished.push((call.0, Finish::Settled(success)));
                        Decision::Finished(true)
                    }
                    _ => Decision::Finished(false),
                },
                Write::Refund(call, failure) => match entries.get_mut(&call.0) {
                    Some(entry) if entry.pending => {
                        let held = plan
                            .accounts
                            .get_mut(&entry.account)
                            .ok_or_else(|| unknown_account(AccountId(entry.account)))?;
                        held.give_back(entry.taken);
                        entry.pending = false;
                        plan.finished.push((call.0, Finish::Refunded(failure)));
                        Decision::Finished(true)
                    }
                    _ => Decision::Finished(false),
                },
            };
            plan.decisions.push(decision);
        }
        Ok(plan)
    }

    fn reserve(&mut self, charge: &'a OwnedCharge, active_keys: &BTreeSet<i64>) -> Decision {
        let account = charge.caller.account;
        if !active_keys.contains(&charge.caller.key.0) {
            return Decision::Refused(ReserveError::KeyRevoked);
        }
        let Some(held) = self.accounts.get_mut(&account.0) else {
            return Decision::Refused(unknown_account(account).into());
        };
        let Some(taken) = held.spendable(charge.at).split_charge(charge.price) else {
            return Decision::Refused(ReserveError::InsufficientCredits);
        };
        held.take(taken);
        self.new_entries.push(NewEntry {
            account: account.0,
            charge,
            taken,
        });
        Decision::Reserved(self.new_entries.len() - 1)
    }

    /// Each account whose balance the batch changes, with the net change.
    pub(super) fn account_changes(&self) -> Vec<(i64, Balance)> {
        self.accounts
            .iter()
            .filter(|(_, held)| held.change != Balance::default())
            .map(|(id, held)| (*id, held.change))
            .collect()
    }

    /// Each write's answer, given the ids the new entries were inserted under (in order).
    pub(super) fn outcomes(self, ids: &[i64]) -> Vec<Outcome> {
        let new_entries = self.new_entries;
        self.decisions
            .into_iter()
            .map(|decision| match decision {
                Decision::Reserved(new) => Outcome::Reserved(Ok(Reservation {
                    call: CallId(ids[new]),
                    account: AccountId(new_entries[new].account),
                    taken: new_entries[new].taken,
                })),
                Decision::Refused(error) => Outcome::Reserved(Err(error)),
                Decision::Finished(finished) => Outcome::Finished(finished),
            })
            .collect()
    }
}

impl Held {
    /// What a call made at `at` may spend: nothing of a subscription whose period has ended.
    fn spendable(&self, at: DateTime<Utc>) -> Balance {
        self.balance.spendable(self.subscription_ends_at, at)
    }

    fn take(&mut self, split: Split) {
        self.balance.subscription.0 -= split.subscription.0;
        self.balance.topup.0 -= split.topup.0;
        self.change.subscription.0 -= split.subscription.0;
        self.change.topup.0 -= split.topup.0;
    }

    fn give_back(&mut self, split: Split) {
        self.balance.subscription.0 += split.subscription.0;
        self.balance.topup.0 += split.topup.0;
        self.change.subscription.0 += split.subscription.0;
        self.change.topup.0 += split.topup.0;
    }
}

/// An entry's charged buckets as stored.
pub(super) fn split(subscription: i64, topup: i64) -> Split {
    Split {
        subscription: Credits(subscription),
        topup: Credits(topup),
    }
}

/// The error for a write on an account that does not exist.
pub(super) fn unknown_account(account: AccountId) -> StoreError {
    StoreError::msg(format!("unknown account {}", account.0))
}
