//! The rows a `SQLite` file's committer keeps between batches (see [`RowCache`]).

use foldhash::HashMap;

use crate::credits::Balance;
use crate::store::rules::alerts::LimitAlert;
use crate::store::sea::writes::{AccountRead, KeyChange, KeyRead, Wanted};

/// Account rows and key states as the committer last read or wrote them, valid while the
/// committer's connection reports the same `PRAGMA data_version` (which changes when any other
/// connection commits: a grant, a revocation, a lapse, a keyed call, another process).
#[derive(Debug, Default)]
pub(in crate::store::sea) struct RowCache {
    version: Option<i64>,
    pub(in crate::store::sea) accounts: HashMap<i64, AccountRead>,
    /// Whether each key is active, and a limited key's allowance as the file stores it.
    pub(in crate::store::sea) keys: HashMap<i64, KeyRead>,
}

impl RowCache {
    /// Keeps the rows if `version` is the one they were read at; otherwise empties the cache
    /// for that version. `true` if they were kept.
    pub(in crate::store::sea) fn check(&mut self, version: i64) -> bool {
        if self.version == Some(version) {
            return true;
        }
        self.accounts.clear();
        self.keys.clear();
        self.version = Some(version);
        false
    }

    /// The rows a batch of `wanted` can take from here, copied, at the same version.
    pub(in crate::store::sea) fn part(&self, wanted: &Wanted) -> RowCache {
        let accounts = (wanted.accounts.iter())
            .filter_map(|id| Some((*id, *self.accounts.get(id)?)))
            .collect();
        let keys = (wanted.keys.iter())
            .filter_map(|id| Some((*id, *self.keys.get(id)?)))
            .collect();
        RowCache {
            version: self.version,
            accounts,
            keys,
        }
    }

    /// Takes in what a batch read into its [`RowCache::part`], if both are still at the same
    /// version.
    pub(in crate::store::sea) fn merge(&mut self, part: RowCache) {
        if self.version.is_some() && self.version == part.version {
            self.accounts.extend(part.accounts);
            self.keys.extend(part.keys);
        }
    }

    /// Forgets every row (after a batch whose outcome is unknown).
    pub(in crate::store::sea) fn clear(&mut self) {
        self.version = None;
        self.accounts.clear();
        self.keys.clear();
    }

    /// Applies a committed batch's changes to the limited keys it wrote.
    pub(in crate::store::sea) fn apply_keys(&mut self, changes: &[KeyChange]) {
        for change in changes {
            let Some(read) = self.keys.get_mut(&change.key) else {
                continue;
            };
            if let Some(allowance) = read.allowance.as_mut() {
                allowance.spent = change.spent;
                allowance.window = change.window;
            }
            if change.told_in.is_some() && read.limit_alert != LimitAlert::Off {
                read.limit_alert = LimitAlert::Armed {
                    told_in: change.told_in,
                };
            }
        }
    }

    /// Applies a committed batch's changes to the rows it read.
    pub(in crate::store::sea) fn apply(&mut self, changes: &[(i64, Balance)]) {
        for (id, change) in changes {
            if let Some(row) = self.accounts.get_mut(id) {
                row.balance.subscription.0 += change.subscription.0;
                row.balance.topup.0 += change.topup.0;
            }
        }
    }
}
