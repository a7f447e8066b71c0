//! Which idempotency keys have a record in an owned file (see `super::keyed`).

use std::hash::{BuildHasher, RandomState};

use foldhash::HashMap;

use crate::store::AccountId;

/// How many records the file holds for each account and key, by a hash of the pair: a key
/// counted zero times has none (a key sharing a hash with another's record is merely sent to
/// the database, which reads the record itself).
#[derive(Debug, Default)]
pub(in crate::store::sea) struct RecordIndex {
    counts: HashMap<u64, u32>,
    hasher: RandomState,
}

impl RecordIndex {
    fn slot(&self, account: AccountId, key: &str) -> u64 {
        self.hasher.hash_one((account.0, key))
    }

    /// Whether the file may hold a record of `key` for `account`.
    pub(in crate::store::sea) fn may_have(&self, account: AccountId, key: &str) -> bool {
        self.counts.contains_key(&self.slot(account, key))
    }

    /// Counts a record inserted for `key` of `account`.
    pub(in crate::store::sea) fn add(&mut self, account: AccountId, key: &str) {
        *self.counts.entry(self.slot(account, key)).or_default() += 1;
    }

    /// Counts a record of `key` of `account` deleted.
    pub(in crate::store::sea) fn remove(&mut self, account: AccountId, key: &str) {
        let slot = self.slot(account, key);
        if let Some(count) = self.counts.get_mut(&slot) {
            *count -= 1;
            if *count == 0 {
                self.counts.remove(&slot);
            }
        }
    }

    /// How many distinct keys (by hash) have records.
    #[cfg(test)]
    pub(in crate::store::sea) fn len(&self) -> usize {
        self.counts.len()
    }
}
