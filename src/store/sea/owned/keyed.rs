//! Calls with an idempotency key on a file its store owns: held in memory like any other call
//! when their key has no record, so that they take the group commit instead of two
//! transactions of their own that each wait for the disk.
//!
//! The rule is `store::rules::idempotency`'s, and the store that owns the file is the only one
//! that charges on it, so it can know every record's key:
//! - [`RecordIndex`] counts, per account and key (by a hash), the records in the file. It is
//!   read once, by the first keyed call that needs the file, and then changed only by this
//!   store: a batch that bills a held keyed call inserts its record ([`added`](RecordIndex::add)
//!   when the batch's changes are taken), a keyed reservation made in the database may insert
//!   one, and forgetting deletes some. Each of those runs behind the holds' gate (a batch, or a
//!   [`Frozen`] reader), so the index and the file never disagree where a reservation can see.
//! - The held calls with a key are in the holds ([`Holds::keyed`]): a key whose call is running.
//!
//! A keyed reservation whose key has neither is decided at once, exactly as a call without a key
//! ([`decide::reserve_now`]): there is no record, so the rule says reserve. The batch that ends
//! the call writes its record with its entry (and the reply to keep, if it was billed); a
//! refunded call leaves no record, so its key is free again, as the rule says of a refunded
//! call. A crash loses the hold and so the record it would have had: nothing was billed, and
//! the retry is a new call.
//!
//! Every other keyed reservation (a record in the file, or a hash shared with one; a call of
//! the key running; rows the committer has not read) freezes the holds and is answered as on
//! any database: from the running call, or by a transaction of its own on the pool that reads
//! and writes the record (`super::super::idempotent`).

use chrono::{DateTime, Utc};
use sea_orm::{DatabaseConnection, EntityTrait, QuerySelect};

use super::Owned;
use super::decide;
use super::records::RecordIndex;
use super::state::{Frozen, State};
use crate::store::sea::alerting::Alerting;
use crate::store::sea::commit::group_commit::Writers;
use crate::store::sea::commit::jobs::Asked;
use crate::store::sea::entity::idempotent_call;
use crate::store::sea::idempotent;
use crate::store::sea::writes::OwnedCharge;
use crate::store::{
    AccountId, CallStatus, IdempotencyKey, KeyedCall, KeyedDecision, Reservation, ReserveError,
    StoreError, decide_keyed,
};

/// Reads every record's account and key. Run behind the holds' gate: nothing inserts or
/// deletes a record meanwhile.
async fn read_index(db: &DatabaseConnection) -> Result<RecordIndex, StoreError> {
    let keys: Vec<(i64, String)> = idempotent_call::Entity::find()
        .select_only()
        .column(idempotent_call::Column::AccountId)
        .column(idempotent_call::Column::IdemKey)
        .into_tuple()
        .all(db)
        .await?;
    let mut index = RecordIndex::default();
    for (account, key) in keys {
        index.add(AccountId(account), &key);
    }
    Ok(index)
}

/// Whether `key` of `account` is free by what the store knows without the file: it has no
/// record, and no call of it is held or queued.
fn free(state: &State, account: AccountId, key: &IdempotencyKey) -> bool {
    let unrecorded =
        (state.records.as_ref()).is_some_and(|records| !records.may_have(account, key.key()));
    unrecorded
        && state.holds.keyed(account, key.key()).is_none()
        && state.keyed_queued(account, key.key()).is_none()
}

/// A key marked taken in [`State::keyed_queued`] until dropped, however its reservation ends.
struct Taken<'a> {
    owned: &'a Owned,
    account: AccountId,
    key: &'a IdempotencyKey,
}

impl<'a> Taken<'a> {
    fn new(owned: &'a Owned, account: AccountId, key: &'a IdempotencyKey) -> Taken<'a> {
        owned.holds.lock().keyed_queued.push((account, key.clone()));
        Taken {
            owned,
            account,
            key,
        }
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut state = self.owned.holds.lock();
        state.keyed_untake(self.account, self.key.key());
    }
}

impl Owned {
    /// Reserves a keyed call (see the module docs); `charge` carries the key.
    pub(in crate::store::sea) async fn reserve_keyed(
        &self,
        to: Writers<'_>,
        charge: OwnedCharge,
        key: &IdempotencyKey,
        window: std::time::Duration,
    ) -> Result<Reservation, ReserveError> {
        debug_assert!(charge.keyed.as_ref() == Some(key));
        let account = charge.caller.account;
        {
            let mut state = self.holds.lock();
            if free(&state, account, key)
                && let Some(reserved) = decide::reserve_now(&mut state, &charge)
            {
                return reserved;
            }
        }
        let slot = to.committer.slot().await?;
        let queued = {
            let mut state = self.holds.lock();
            if free(&state, account, key) {
                if let Some(reserved) = decide::reserve_now(&mut state, &charge) {
                    return reserved;
                }
                // Taken from now until its batch holds the call or refuses it.
                state.keyed_queued.push((account, key.clone()));
                Some(slot.queue(&mut *state, Asked::reserve(charge.clone())))
            } else {
                None
            }
        };
        if let Some(answer) = queued {
            return answer.wait().await;
        }
        let frozen = self.holds.freeze().await;
        // Nothing is held or recorded while the holds are frozen (a reservation queued
        // meanwhile waits for the committer, which waits for the gate).
        let taken = {
            let state = self.holds.lock();
            let running = frozen.keyed(account, key.key()).map(|held| {
                let fingerprint = held.charge.keyed.as_ref().map(IdempotencyKey::fingerprint);
                (fingerprint, held.charge.at)
            });
            let queued = state
                .keyed_queued(account, key.key())
                .map(|queued| (Some(queued.fingerprint()), charge.at));
            running.or(queued)
        };
        if let Some((fingerprint, at)) = taken {
            // As in the file: a revoked key is refused before its idempotency key is read.
            if !idempotent::key_active(to.db, charge.caller.key.0).await? {
                return Err(ReserveError::KeyRevoked);
            }
            let running = KeyedCall {
                fingerprint: fingerprint.unwrap_or_default(),
                status: CallStatus::Pending,
                created_at: at,
                reply: None,
            };
            return match decide_keyed(Some(running), key, charge.at, window) {
                KeyedDecision::Answer(answer) => Err(answer),
                KeyedDecision::Reserve => Err(StoreError::msg(
                    "internal: a running keyed call's key was free by the rule",
                )
                .into()),
            };
        }
        // The key is taken while the file decides it: a keyed reservation of it arriving
        // meanwhile (once the index is read, it could look free) waits behind the gate.
        let _taken = Taken::new(self, account, key);
        let loaded = self.holds.lock().records.is_some();
        if !loaded {
            let index = read_index(to.db).await?;
            self.holds.lock().records = Some(index);
        }
        self.reserve_in_file(to.db, charge, key, window, &frozen, to.alerting)
            .await
    }

    /// A keyed reservation decided by a transaction of its own, while the holds are frozen;
    /// a record it inserts is counted before they thaw.
    async fn reserve_in_file(
        &self,
        db: &DatabaseConnection,
        charge: OwnedCharge,
        key: &IdempotencyKey,
        window: std::time::Duration,
        frozen: &Frozen<'_>,
        alerting: Option<Alerting>,
    ) -> Result<Reservation, ReserveError> {
        let account = charge.caller.account;
        let (reservation, inserted) =
            idempotent::reserve(db, charge, key, window, Some(frozen), alerting).await?;
        if inserted && let Some(records) = self.holds.lock().records.as_mut() {
            records.add(account, key.key());
        }
        Ok(reservation)
    }

    /// Deletes the records older than `window` at `now` whose calls have ended, and uncounts
    /// them, behind the holds' gate.
    pub(in crate::store::sea) async fn forget_keyed(
        &self,
        db: &DatabaseConnection,
        now: DateTime<Utc>,
        window: std::time::Duration,
    ) -> Result<u64, StoreError> {
        let _frozen = self.holds.freeze().await;
        let deleted = idempotent::forget_listed(db, now, window).await?;
        if let Some(records) = self.holds.lock().records.as_mut() {
            for (account, key) in &deleted {
                records.remove(*account, key);
            }
        }
        Ok(deleted.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_counts_each_record_until_it_is_deleted() {
        let mut index = RecordIndex::default();
        let (one, two) = (AccountId(1), AccountId(2));
        assert!(!index.may_have(one, "k"));
        index.add(one, "k");
        assert!(index.may_have(one, "k"));
        assert!(
            !index.may_have(two, "k"),
            "another account's key is another key"
        );
        assert!(!index.may_have(one, "k2"));
        // A record deleted and another inserted for the same key: counted apart.
        index.add(one, "k");
        index.remove(one, "k");
        assert!(index.may_have(one, "k"));
        index.remove(one, "k");
        assert!(!index.may_have(one, "k"));
        assert_eq!(index.len(), 0);
        // Removing what was never counted changes nothing.
        index.remove(two, "x");
        assert_eq!(index.len(), 0);
    }
}
