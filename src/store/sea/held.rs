//! Reservations held in memory: what a held call took, and the holds of a batch or a store.
//! Two modes hold calls: a `SQLite` file one gateway owns (`super::owned`) and escrow on
//! `PostgreSQL` (`super::escrow`); the committer's batches decide against them (`super::commit::batch`).

use foldhash::HashMap;
#[cfg(feature = "sqlite")]
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::writes::OwnedCharge;
#[cfg(feature = "sqlite")]
use super::writes::Write;
use crate::call::LimitPeriod;
use crate::credits::{Balance, Credits, Split};
#[cfg(feature = "sqlite")]
use crate::store::rules;
use crate::store::rules::holds::KeyHolds;
use crate::store::{AccountId, CallId, KeyId};

/// A call whose credits are held in memory.
#[derive(Debug, Clone)]
pub(super) struct HeldCall {
    pub(super) account: AccountId,
    pub(super) charge: OwnedCharge,
    pub(super) taken: Split,
    /// When it was reserved: its entry's `created_at`.
    pub(super) reserved_at: DateTime<Utc>,
}

/// Every held call, what they hold on each account and of each key's spending, and the ids
/// set aside for new ones.
#[derive(Debug, Default, Clone)]
pub(super) struct Holds {
    calls: HashMap<CallId, HeldCall>,
    accounts: HashMap<AccountId, Balance>,
    /// What each key's held calls hold, for its spending limit (every key, limited or not:
    /// a limit may be set while its calls are held).
    keys: HashMap<KeyId, KeyHolds>,
    #[cfg(feature = "sqlite")]
    ids: IdBlock,
    /// The held calls with an idempotency key, by account and key (only a file its store owns
    /// holds keyed calls: see `super::owned::keyed`). The client picks the keys, so they are
    /// hashed with std's `SipHash`.
    #[cfg(feature = "sqlite")]
    keyed: HashMap<AccountId, std::collections::HashMap<Arc<str>, CallId>>,
}

#[cfg(feature = "sqlite")]
/// Call ids set aside for held calls: `next..end`. The file's id sequence has been moved past
/// `end`, so entries inserted by anyone else never take one of them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct IdBlock {
    pub(super) next: i64,
    pub(super) end: i64,
}

#[cfg(feature = "sqlite")]
impl IdBlock {
    pub(super) fn left(self) -> i64 {
        self.end - self.next
    }
}

#[cfg(feature = "sqlite")]
/// What one committed batch did to the holds.
#[derive(Debug, Default)]
pub(super) struct HoldChanges {
    pub(super) added: Vec<(CallId, HeldCall)>,
    pub(super) ended: Vec<CallId>,
    pub(super) ids: Option<IdBlock>,
    /// The keys whose records the batch inserted, with their accounts (see
    /// `super::owned::keyed`).
    pub(super) recorded: Vec<(AccountId, crate::store::IdempotencyKey)>,
}

impl Holds {
    pub(super) fn call(&self, call: CallId) -> Option<&HeldCall> {
        self.calls.get(&call)
    }

    /// What is held on `account`.
    pub(super) fn on(&self, account: AccountId) -> Balance {
        self.accounts.get(&account).copied().unwrap_or_default()
    }

    /// What `key`'s held calls hold.
    #[cfg(feature = "sqlite")]
    pub(super) fn on_key(&self, key: KeyId) -> Credits {
        self.keys.get(&key).map_or(Credits::ZERO, KeyHolds::total)
    }

    /// What `key`'s held calls reserved in `period`'s window of `at` hold: what counts against
    /// its spending limit in that window.
    pub(super) fn on_key_in(&self, key: KeyId, period: LimitPeriod, at: DateTime<Utc>) -> Credits {
        self.keys
            .get(&key)
            .map_or(Credits::ZERO, |held| held.in_window(period, at))
    }

    #[cfg(feature = "sqlite")]
    fn key_part(&self, key: KeyId) -> KeyHolds {
        self.keys.get(&key).cloned().unwrap_or_default()
    }

    /// `row`, an account's credits as stored, less what is held on it: what it has to spend.
    pub(super) fn net(&self, account: AccountId, row: Balance) -> Balance {
        row.free_of(self.on(account))
    }

    #[cfg(feature = "sqlite")]
    /// The held call that holds `key` for `account`, if one does.
    pub(super) fn keyed(&self, account: AccountId, key: &str) -> Option<&HeldCall> {
        let call = self.keyed.get(&account)?.get(key)?;
        self.calls.get(call)
    }

    #[cfg(feature = "sqlite")]
    pub(super) fn ids(&self) -> IdBlock {
        self.ids
    }

    #[cfg(feature = "sqlite")]
    /// Holds `taken` on `account` for a new call, under the next id set aside, if one is left.
    pub(super) fn hold(
        &mut self,
        account: AccountId,
        charge: &OwnedCharge,
        taken: Split,
    ) -> Option<CallId> {
        if self.ids.left() < 1 {
            return None;
        }
        let id = self.ids.next;
        let held = HeldCall {
            account,
            charge: charge.clone(),
            taken,
            reserved_at: Utc::now(),
        };
        let ids = IdBlock {
            next: id + 1,
            end: self.ids.end,
        };
        self.apply(HoldChanges {
            added: vec![(CallId(id), held)],
            ended: Vec::new(),
            ids: Some(ids),
            recorded: Vec::new(),
        });
        Some(CallId(id))
    }

    #[cfg(feature = "sqlite")]
    /// What a batch of `writes` needs of the holds, copied, so that it can be written while
    /// the state stays unlocked: the calls it ends, what is held on the accounts it touches
    /// and the ids set aside. Calls held meanwhile are not in it; they are not the batch's.
    pub(super) fn for_batch(&self, writes: &[&Write]) -> Holds {
        let mut part = Holds {
            ids: self.ids,
            ..Holds::default()
        };
        for write in writes {
            let account = match write {
                Write::Reserve(charge) => {
                    let key = charge.caller.key;
                    part.keys.insert(key, self.key_part(key));
                    charge.caller.account
                }
                Write::Settle(call, _) | Write::Refund(call, _) => match self.calls.get(call) {
                    Some(held) => {
                        part.calls.insert(*call, held.clone());
                        let key = held.charge.caller.key;
                        part.keys.insert(key, self.key_part(key));
                        held.account
                    }
                    // A call reserved in the file (a keyed one) whose cost may exceed what it
                    // took: its account and key, not known before its entry is read, may pay
                    // beyond it only what the calls held on them leave free, and within what
                    // the key's limit leaves beside them.
                    None => {
                        if matches!(write, Write::Settle(_, success) if success.cost.is_some()) {
                            part.accounts
                                .extend(self.accounts.iter().map(|(id, on)| (*id, *on)));
                            part.keys
                                .extend(self.keys.iter().map(|(id, on)| (*id, on.clone())));
                        }
                        continue;
                    }
                },
            };
            if let Some(&on) = self.accounts.get(&account) {
                part.accounts.insert(account, on);
            }
        }
        part
    }

    #[cfg(feature = "sqlite")]
    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }

    #[cfg(feature = "sqlite")]
    /// The held calls reserved before `cutoff`: how many, and the credits they hold.
    pub(super) fn older_than(&self, cutoff: DateTime<Utc>) -> crate::store::Overdue {
        older_than(self.calls.values(), cutoff)
    }

    #[cfg(feature = "sqlite")]
    /// Applies a committed batch's changes.
    pub(super) fn apply(&mut self, changes: HoldChanges) {
        for (id, held) in changes.added {
            let on = self.accounts.entry(held.account).or_default();
            *on = rules::holds::hold(*on, held.taken);
            (self.keys.entry(held.charge.caller.key).or_default())
                .add(held.reserved_at, held.taken.total());
            if let Some(keyed) = &held.charge.keyed {
                let calls = self.keyed.entry(held.account).or_default();
                calls.insert(keyed.shared_key(), id);
            }
            self.calls.insert(id, held);
        }
        for id in changes.ended {
            let Some(held) = self.calls.remove(&id) else {
                continue;
            };
            if let Some(keyed) = &held.charge.keyed
                && let Some(calls) = self.keyed.get_mut(&held.account)
            {
                calls.remove(keyed.key());
                if calls.is_empty() {
                    self.keyed.remove(&held.account);
                }
            }
            let key = held.charge.caller.key;
            if let Some(on_key) = self.keys.get_mut(&key)
                && on_key.remove(held.reserved_at, held.taken.total())
            {
                self.keys.remove(&key);
            }
            if let Some(on) = self.accounts.get_mut(&held.account) {
                *on = rules::holds::release(*on, held.taken);
                if *on == Balance::default() {
                    self.accounts.remove(&held.account);
                }
            }
        }
        if let Some(ids) = changes.ids {
            self.ids = ids;
        }
        debug_assert!(
            self.sums_agree(),
            "what is held on an account is not the sum of its held calls"
        );
    }

    /// Whether what is held on each account is the sum of its held calls.
    #[cfg(feature = "sqlite")]
    fn sums_agree(&self) -> bool {
        rules::holds::sums_agree(
            self.accounts
                .iter()
                .map(|(account, held)| (*account, *held)),
            self.calls.values().map(|held| (held.account, held.taken)),
        )
    }
}

/// Of `calls`, those reserved before `cutoff`: how many, and the credits they hold.
pub(super) fn older_than<'a>(
    calls: impl Iterator<Item = &'a HeldCall>,
    cutoff: DateTime<Utc>,
) -> crate::store::Overdue {
    let mut overdue = crate::store::Overdue::default();
    for held in calls.filter(|held| held.reserved_at < cutoff) {
        overdue.calls += 1;
        overdue.credits += i128::from(held.taken.total().get());
    }
    overdue
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::protocol::Protocol;
    use crate::store::Caller;

    fn held(key: i64, price: i64, reserved_at: DateTime<Utc>) -> HeldCall {
        let caller = Caller {
            account: AccountId(1),
            key: KeyId(key),
        };
        HeldCall {
            account: caller.account,
            charge: OwnedCharge {
                caller,
                protocol: Protocol::ChatCompletions,
                model: "m".into(),
                requested_model: None,
                dropped_tools: None,
                price: Credits(price),
                request_id: None,
                at: reserved_at,
                instance: None,
                keyed: None,
            },
            taken: Split {
                subscription: Credits(price),
                topup: Credits::ZERO,
            },
            reserved_at,
        }
    }

    /// The owned file's side of a rollover (issue 67's minor point: a 3-a-day key's three
    /// calls still running at midnight refused the new day's first three): a key's held calls
    /// count against its limit in the window they were reserved in, never in the next; all of
    /// them still count as held on the key and the account.
    #[test]
    fn held_calls_count_against_a_limit_in_the_window_they_were_reserved_in() {
        let before_midnight = Utc.with_ymd_and_hms(2026, 12, 6, 23, 59, 59).unwrap();
        let after_midnight = before_midnight + chrono::Duration::seconds(2);
        let mut holds = Holds::default();
        holds.apply(HoldChanges {
            added: vec![
                (CallId(1), held(7, 1, before_midnight)),
                (CallId(2), held(7, 1, before_midnight)),
                (CallId(3), held(7, 1, before_midnight)),
                (CallId(4), held(7, 5, after_midnight)),
                (CallId(5), held(8, 2, before_midnight)),
            ],
            ..HoldChanges::default()
        });
        let key = KeyId(7);
        assert_eq!(holds.on_key(key), Credits(8));
        assert_eq!(
            holds.on_key_in(key, LimitPeriod::Day, after_midnight),
            Credits(5)
        );
        assert_eq!(
            holds.on_key_in(key, LimitPeriod::Day, before_midnight),
            Credits(3)
        );
        assert_eq!(
            holds.on_key_in(key, LimitPeriod::Month, after_midnight),
            Credits(8),
            "one month"
        );
        assert_eq!(holds.on(AccountId(1)).total(), Credits(10));

        holds.apply(HoldChanges {
            ended: vec![CallId(1), CallId(4)],
            ..HoldChanges::default()
        });
        assert_eq!(holds.on_key(key), Credits(2));
        assert_eq!(
            holds.on_key_in(key, LimitPeriod::Day, after_midnight),
            Credits::ZERO
        );
        holds.apply(HoldChanges {
            ended: vec![CallId(2), CallId(3), CallId(5)],
            ..HoldChanges::default()
        });
        assert_eq!(holds.on_key(key), Credits::ZERO);
        assert!(holds.keys.is_empty(), "no key left behind");
    }
}
