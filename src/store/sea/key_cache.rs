//! The keys looked up before, so that a call does not need a database round trip to learn who
//! it is. Only active keys are remembered, each for [`RULES_TTL`] at most. A key revoked since
//! (on this gateway or on another one sharing the database) may still pass the lookup, but the
//! reservation that every charged call makes checks the key inside its transaction and refuses
//! it; the store then forgets the key, so its next lookup goes to the database again. Rules
//! changed through this store apply at once (it forgets the key); rules changed through another
//! store sharing the database apply here within [`RULES_TTL`].

use foldhash::HashMap;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use crate::keys::KeyHash;
use crate::store::{ActiveKey, KeyId};

/// Keys beyond this many are not remembered until the cache is emptied (it is, when full).
const CAPACITY: usize = 100_000;

/// How long a remembered key's rules are trusted before they are read again.
pub(crate) const RULES_TTL: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub(super) struct KeyCache {
    keys: RwLock<HashMap<KeyHash, (ActiveKey, Instant)>>,
    ttl: Duration,
}

impl Default for KeyCache {
    fn default() -> KeyCache {
        KeyCache::with_ttl(RULES_TTL)
    }
}

impl KeyCache {
    pub(super) fn with_ttl(ttl: Duration) -> KeyCache {
        KeyCache {
            keys: RwLock::default(),
            ttl,
        }
    }

    pub(super) fn get(&self, key: &KeyHash) -> Option<ActiveKey> {
        self.read()
            .get(key)
            .filter(|(_, loaded)| loaded.elapsed() < self.ttl)
            .map(|(active, _)| active.clone())
    }

    pub(super) fn remember(&self, key: &KeyHash, active: ActiveKey) {
        let mut keys = self.write();
        if keys.len() >= CAPACITY {
            keys.clear();
        }
        keys.insert(key.clone(), (active, Instant::now()));
    }

    pub(super) fn forget(&self, key: &KeyHash) {
        self.write().remove(key);
    }

    pub(super) fn forget_id(&self, key: KeyId) {
        self.write()
            .retain(|_, (active, _)| active.caller.key != key);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<KeyHash, (ActiveKey, Instant)>> {
        // The map is consistent whatever a panicking holder was doing: each change is one call.
        self.keys
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<KeyHash, (ActiveKey, Instant)>> {
        self.keys
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
