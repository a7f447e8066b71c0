//! One group-commit batch, decided in memory: which rows it must read (and lock), what each
//! write comes to against those rows, in queue order, and what must be written. The decisions
//! are the in-memory model's own, taken against rows nobody else can change while the batch's
//! transaction holds them. Both ways of writing a batch use this: set-based statements through
//! sea-orm ([`super::ledger_ops`]) and, for a `SQLite` file, direct calls on the committer's own
//! thread ([`super::sqlite_direct`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::credits::{Balance, Credits, Split};
use crate::events::WebhookEvent;
use crate::store::rules::alerts::{self, LimitAlert};
use crate::store::rules::holds;
use crate::store::rules::reserve::{Limited, Payer, decide_reserve};
use crate::store::rules::settle::{Beyond, Settlement, decide_settle};
#[cfg(feature = "sqlite")]
use crate::store::sea::held::HoldChanges;
use crate::store::sea::held::{HeldCall, Holds};
use crate::store::sea::writes::{KeyChange, KeyRead, Outcome, OwnedCharge, Write, unknown_account};
use crate::store::{
    AccountId, CallId, CallSuccess, Caller, KeyId, Reservation, ReserveError, StoreError,
};

pub(in crate::store::sea) use super::batch_rows::{EndedHold, Entry, Finish, NewEntry, Reads};

/// A batch decided: what to insert, finish and write to the accounts, and each write's answer.
#[derive(Debug)]
pub(in crate::store::sea) struct Plan<'a> {
    /// New `pending` entries, in queue order.
    pub(in crate::store::sea) new_entries: Vec<NewEntry<'a>>,
    /// Entries that stop being `pending`, with how.
    pub(in crate::store::sea) finished: Vec<(i64, Finish<'a>)>,
    /// Held calls that end, whose entries are inserted finished.
    pub(in crate::store::sea) ended_holds: Vec<EndedHold<'a>>,
    /// Each account's balance as the batch leaves it, and its net change.
    accounts: BTreeMap<i64, AccountState>,
    /// Each key as the batch leaves it.
    keys: BTreeMap<i64, KeyState>,
    /// When the batch's new entries are reserved: their `created_at`.
    pub(in crate::store::sea) now: DateTime<Utc>,
    /// The events the batch tells (see [`alerts`]), written in its transaction.
    pub(in crate::store::sea) events: Vec<WebhookEvent>,
    /// The reservations held in memory, if any: what they hold counts as spent.
    holds: Option<&'a Holds>,
    /// Whether this batch's reservations are held in memory instead of written.
    hold_new: bool,
    /// Whether a settle that leaves a shortfall is told.
    tell_shortfalls: bool,
    decisions: Vec<Decision>,
}

/// An account as the batch leaves it.
#[derive(Debug)]
struct AccountState {
    /// Its row: as read, plus `change`.
    row: Balance,
    /// What the batch writes to its row.
    change: Balance,
    /// What is held on it in memory, as the batch leaves it.
    held: Balance,
    subscription_ends_at: Option<DateTime<Utc>>,
    /// Below what its balance is told.
    alert_below: Option<Credits>,
    /// What it could spend when the batch began.
    opening: Balance,
}

/// A key as the batch leaves it.
#[derive(Debug)]
struct KeyState {
    read: KeyRead,
    /// What the batch's new held calls hold of its allowance.
    held: Credits,
    /// What the held calls the batch ends held of it (counted in the holds it was given, and
    /// no longer held once the batch ends them: a billed one is in `read`'s spending instead).
    released: Credits,
    /// Whether the batch changed its allowance (to be written).
    changed: bool,
    /// Whether the batch told its limit reached (the window to be written).
    told: bool,
}

impl KeyState {
    /// What the key's calls hold in memory: `elsewhere` (in the holds the batch was given),
    /// and the batch's own new holds, less those the batch ends.
    fn held_with(&self, elsewhere: Credits) -> Credits {
        Credits((elsewhere.get() + self.held.get() - self.released.get()).max(0))
    }

    /// Tells the key's limit if `charge`, now counted (with `held`, what its calls hold in
    /// memory), leaves too little for another like it, in a window not yet told.
    fn tell_limit(
        &mut self,
        charge: &OwnedCharge,
        held: Credits,
        at: DateTime<Utc>,
    ) -> Option<WebhookEvent> {
        let allowance = self.read.allowance?;
        if !self
            .read
            .limit_alert
            .due(&allowance, held, charge.price, at)
        {
            return None;
        }
        self.read.limit_alert = self.read.limit_alert.told(&allowance, at);
        self.told = true;
        let spent = Credits(allowance.spent_at(at).saturating_add(held.get()));
        let caller = charge.caller;
        let event =
            WebhookEvent::limit_reached(caller.account, caller.key, allowance.limit, spent, at);
        Some(event)
    }

    /// Counts `amount` against the key's allowance for a call reserved at `reserved_at`.
    fn record(&mut self, amount: i64, reserved_at: DateTime<Utc>) {
        if amount == 0 {
            return;
        }
        if let Some(allowance) = &mut self.read.allowance {
            allowance.record(amount, reserved_at);
            self.changed = true;
        }
    }
}

#[derive(Debug)]
enum Decision {
    /// Index into [`Plan::new_entries`].
    Reserved(usize),
    Refused(ReserveError),
    Finished(bool),
}

impl<'a> Plan<'a> {
    /// Decides every write, in order, against what the batch read less what `holds` hold (the
    /// calls they hold end here, see [`crate::store::sea::held`]). With `hold_new`, reservations are held
    /// in memory instead of written.
    pub(in crate::store::sea) fn decide(
        writes: &[&'a Write],
        reads: Reads,
        holds: Option<&'a Holds>,
        hold_new: bool,
    ) -> Result<Plan<'a>, StoreError> {
        let Reads {
            mut entries,
            accounts,
            keys,
            tell_shortfalls,
        } = reads;
        let now = Utc::now();
        let keys = keys
            .into_iter()
            .map(|(id, read)| {
                let state = KeyState {
                    read,
                    held: Credits::ZERO,
                    released: Credits::ZERO,
                    changed: false,
                    told: false,
                };
                (id, state)
            })
            .collect();
        let accounts = accounts
            .into_iter()
            .map(|(id, read)| {
                let mut state = AccountState {
                    row: read.balance,
                    change: Balance::default(),
                    held: holds
                        .map(|holds| holds.on(AccountId(id)))
                        .unwrap_or_default(),
                    subscription_ends_at: read.subscription_ends_at,
                    alert_below: read.alert_below,
                    opening: Balance::default(),
                };
                state.opening = state.free(now);
                (id, state)
            })
            .collect();
        let mut plan = Plan {
            new_entries: Vec::new(),
            finished: Vec::new(),
            ended_holds: Vec::new(),
            accounts,
            keys,
            now,
            events: Vec::new(),
            holds,
            hold_new: hold_new && holds.is_some(),
            tell_shortfalls,
            decisions: Vec::with_capacity(writes.len()),
        };
        for write in writes {
            if let Some((call, held)) = plan.open_hold(write) {
                let decision = plan.end_hold(write, call, held)?;
                plan.decisions.push(decision);
                continue;
            }
            let decision = match write {
                Write::Reserve(charge) => plan.reserve(charge),
                Write::Settle(call, success) => match entries.get_mut(&call.0) {
                    Some(entry) if entry.pending => {
                        let room = plan.key_room(entry.key, Credits::ZERO, entry.reserved_at);
                        let beyond = Beyond::of(success.beyond_reservation, room);
                        let settled =
                            plan.account(entry.account)?
                                .settle(entry.taken, success, beyond);
                        let change = settled.charged.total().get() - entry.taken.total().get();
                        plan.key(entry.key, change, entry.reserved_at);
                        let caller = Caller {
                            account: AccountId(entry.account),
                            key: KeyId(entry.key),
                        };
                        plan.tell_shortfall(caller, *call, success, &settled);
                        entry.pending = false;
                        plan.finished
                            .push((call.0, Finish::Settled(success, settled)));
                        Decision::Finished(true)
                    }
                    _ => Decision::Finished(false),
                },
                Write::Refund(call, failure) => match entries.get_mut(&call.0) {
                    Some(entry) if entry.pending => {
                        plan.account(entry.account)?.give_back(entry.taken);
                        plan.key(entry.key, -entry.taken.total().get(), entry.reserved_at);
                        entry.pending = false;
                        plan.finished.push((call.0, Finish::Refunded(failure)));
                        Decision::Finished(true)
                    }
                    _ => Decision::Finished(false),
                },
            };
            plan.decisions.push(decision);
        }
        plan.tell_low_balances();
        Ok(plan)
    }

    /// Tells each account whose balance the batch takes below its threshold.
    fn tell_low_balances(&mut self) {
        for (&id, state) in &self.accounts {
            let closing = state.free(self.now);
            if alerts::falls_below(state.alert_below, state.opening.total(), closing.total()) {
                let threshold = state.alert_below.unwrap_or(Credits::ZERO);
                let event = WebhookEvent::balance_low(AccountId(id), closing, threshold, self.now);
                self.events.push(event);
            }
        }
    }

    /// Counts `amount` against key `key`'s allowance, if it has one, for a call reserved at
    /// `reserved_at`.
    fn key(&mut self, key: i64, amount: i64, reserved_at: DateTime<Utc>) {
        if let Some(state) = self.keys.get_mut(&key) {
            state.record(amount, reserved_at);
        }
    }

    /// Tells a settle that charged less than its cost (`call.shortfall`), if such are told.
    fn tell_shortfall(
        &mut self,
        caller: Caller,
        call: CallId,
        success: &CallSuccess,
        settled: &Settlement,
    ) {
        if !self.tell_shortfalls {
            return;
        }
        self.events
            .extend(shortfall_event(caller, call, success, settled, self.now));
    }

    /// What key `key`'s limit still allows a call reserved at `reserved_at` to add, beside
    /// `own` (what the call holds that its key's spending does not count yet) and what the
    /// key's other calls hold in memory; `None` for a key without a limit.
    fn key_room(&self, key: i64, own: Credits, reserved_at: DateTime<Utc>) -> Option<Credits> {
        let state = self.keys.get(&key)?;
        let allowance = state.read.allowance?;
        let period = allowance.limit.period;
        let elsewhere = (self.holds).map_or(Credits::ZERO, |holds| {
            holds.on_key_in(KeyId(key), period, reserved_at)
        });
        let held = Credits(state.held_with(elsewhere).get().saturating_add(own.get()));
        Some(allowance.room(held, reserved_at, self.now))
    }

    fn account(&mut self, account: i64) -> Result<&mut AccountState, StoreError> {
        self.accounts
            .get_mut(&account)
            .ok_or_else(|| unknown_account(AccountId(account)))
    }

    /// The held call that `write` settles or refunds, unless it has ended already.
    fn open_hold(&self, write: &Write) -> Option<(i64, &'a HeldCall)> {
        let (Write::Settle(call, _) | Write::Refund(call, _)) = write else {
            return None;
        };
        let held = self.holds?.call(*call)?;
        let ended = self.ended_holds.iter().any(|ended| ended.call == call.0);
        (!ended).then_some((call.0, held))
    }

    /// Ends a held call: a settle debits its account, if the credits are still in the row; a
    /// refund (or a settle that finds them gone) moves nothing. Either way its entry is
    /// written, finished.
    fn end_hold(
        &mut self,
        write: &'a Write,
        call: i64,
        held: &'a HeldCall,
    ) -> Result<Decision, StoreError> {
        let key_id = held.charge.caller.key.0;
        if let Some(key) = self.keys.get_mut(&key_id) {
            key.released = Credits(key.released.get() + held.taken.total().get());
        }
        // Its own hold is not in the key's spending yet: it counts beside the others'.
        let room = self.key_room(key_id, held.taken.total(), held.reserved_at);
        let state = self.account(held.account.0)?;
        // Free of every hold, this call's too: what it may take beyond what it holds.
        let free = state.free(Utc::now());
        state.held = holds::release(state.held, held.taken);
        let (finish, decision) = match write {
            // A call is charged its cost: what it holds, less what goes back, plus what it
            // could take of the free credits beyond it.
            Write::Settle(_, success) => {
                let beyond = Beyond::of(success.beyond_reservation, room);
                let settled = decide_settle(held.taken, success.cost, free, beyond);
                match holds::debit_held(state.row, settled.charged) {
                    Some(row) => {
                        state.row = row;
                        state.change = state.change.minus(settled.charged);
                        // A held call's spending is written to its key when it is billed.
                        let charged = settled.charged.total().get();
                        self.key(held.charge.caller.key.0, charged, held.reserved_at);
                        self.tell_shortfall(held.charge.caller, CallId(call), success, &settled);
                        (Finish::Settled(success, settled), Decision::Finished(true))
                    }
                    None => (Finish::CreditsGone(success), Decision::Finished(false)),
                }
            }
            Write::Refund(_, failure) => (Finish::Refunded(failure), Decision::Finished(true)),
            Write::Reserve(_) => unreachable!("a reservation holds no call yet"),
        };
        self.ended_holds.push(EndedHold { call, held, finish });
        Ok(decision)
    }

    fn reserve(&mut self, charge: &'a OwnedCharge) -> Decision {
        let account = charge.caller.account;
        let key = charge.caller.key;
        let read = self.keys.get(&key.0);
        let key_active = read.is_some_and(|state| state.read.active);
        // Held calls of a window that has ended count in theirs, not in this one.
        let held_elsewhere = match (self.holds, read.and_then(|state| state.read.allowance)) {
            (Some(holds), Some(allowance)) => {
                holds.on_key_in(key, allowance.limit.period, self.now)
            }
            _ => Credits::ZERO,
        };
        let limited = read.and_then(|state| {
            let allowance = state.read.allowance?;
            Some(Limited {
                allowance,
                held: state.held_with(held_elsewhere),
                at: self.now,
            })
        });
        let holding = self.hold_new;
        let payer = self.accounts.get(&account.0).map(AccountState::payer);
        let taken = match decide_reserve(key_active, limited, payer, charge.at, charge.price) {
            Ok(taken) => taken,
            Err(refusal) => return Decision::Refused(refusal.into_error(account)),
        };
        if let Some(state) = self.keys.get_mut(&key.0) {
            if holding {
                state.held = Credits(state.held.get() + charge.price.get());
            } else {
                state.record(charge.price.get(), self.now);
            }
            let held = state.held_with(held_elsewhere);
            if let Some(event) = state.tell_limit(charge, held, self.now) {
                self.events.push(event);
            }
        }
        let Some(state) = self.accounts.get_mut(&account.0) else {
            unreachable!("decide_reserve found the account")
        };
        if holding {
            state.held = holds::hold(state.held, taken);
        } else {
            state.take(taken);
        }
        self.new_entries.push(NewEntry {
            account: account.0,
            charge,
            taken,
        });
        Decision::Reserved(self.new_entries.len() - 1)
    }

    /// Each limited key whose row the batch changes: what it has spent, in which window, and
    /// the window its limit was told in if the batch told it.
    pub(in crate::store::sea) fn key_changes(&self) -> Vec<KeyChange> {
        self.keys
            .iter()
            .filter(|(_, state)| state.changed || state.told)
            .filter_map(|(id, state)| {
                let allowance = state.read.allowance?;
                let told_in = match state.read.limit_alert {
                    LimitAlert::Armed { told_in } if state.told => told_in,
                    _ => None,
                };
                Some(KeyChange {
                    key: *id,
                    spent: allowance.spent,
                    window: allowance.window,
                    told_in,
                })
            })
            .collect()
    }

    /// Each account whose balance the batch changes, with the net change.
    pub(in crate::store::sea) fn account_changes(&self) -> Vec<(i64, Balance)> {
        self.accounts
            .iter()
            .filter(|(_, held)| held.change != Balance::default())
            .map(|(id, held)| (*id, held.change))
            .collect()
    }

    #[cfg(feature = "sqlite")]
    /// What the batch does to the holds, given the ids its new reservations take (in order).
    pub(in crate::store::sea) fn hold_changes(
        &self,
        ids: &[i64],
        at: DateTime<Utc>,
    ) -> HoldChanges {
        HoldChanges {
            added: self
                .new_entries
                .iter()
                .zip(ids)
                .map(|(new, &id)| {
                    let held = HeldCall {
                        account: AccountId(new.account),
                        charge: new.charge.clone(),
                        taken: new.taken,
                        reserved_at: at,
                    };
                    (CallId(id), held)
                })
                .collect(),
            ended: self
                .ended_holds
                .iter()
                .map(|ended| CallId(ended.call))
                .collect(),
            ids: None,
            recorded: Vec::new(),
        }
    }

    /// Each write's answer, given the ids the new entries were inserted under (in order).
    pub(in crate::store::sea) fn outcomes(self, ids: &[i64]) -> Vec<Outcome> {
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

impl AccountState {
    /// What a reservation sees of this account (see [`decide_reserve`]).
    fn payer(&self) -> Payer {
        Payer {
            balance: self.row,
            held: self.held,
            subscription_ends_at: self.subscription_ends_at,
        }
    }

    /// What a call may spend now beyond what it and the other calls hold.
    fn free(&self, at: DateTime<Utc>) -> Balance {
        self.payer().free(at)
    }

    /// Settles a call whose reservation took `taken` from this account's row: the rest of it
    /// goes back, or what the cost needs beyond it is taken from what is free.
    fn settle(&mut self, taken: Split, success: &CallSuccess, beyond: Beyond) -> Settlement {
        let settled = decide_settle(taken, success.cost, self.free(Utc::now()), beyond);
        self.give_back(settled.returned);
        self.take(settled.extra);
        settled
    }

    fn take(&mut self, split: Split) {
        self.row = holds::take(self.row, split);
        self.change = self.change.minus(split);
    }

    fn give_back(&mut self, split: Split) {
        self.row = holds::give_back(self.row, split);
        self.change = self.change.plus(split);
    }
}

/// An entry's charged buckets as stored.
pub(in crate::store::sea) fn split(subscription: i64, topup: i64) -> Split {
    Split {
        subscription: Credits(subscription),
        topup: Credits(topup),
    }
}

/// The `call.shortfall` event of a settle that charged less than its cost; `None` if it charged
/// all of it.
pub(in crate::store::sea) fn shortfall_event(
    caller: Caller,
    call: CallId,
    success: &CallSuccess,
    settled: &Settlement,
    at: DateTime<Utc>,
) -> Option<WebhookEvent> {
    if settled.shortfall <= Credits::ZERO {
        return None;
    }
    let charged = settled.charged.total();
    let cost = Credits(charged.get().saturating_add(settled.shortfall.get()));
    Some(WebhookEvent::shortfall(
        caller,
        call,
        cost,
        charged,
        success.usage_rejected,
        at,
    ))
}
