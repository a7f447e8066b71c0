//! The callers of keys looked up before, so that a call does not need a database round trip to
//! learn who it is. Only active keys are remembered. A key revoked since (on this gateway or on
//! another one sharing the database) may still pass the lookup, but the reservation that every
//! charged call makes checks the key inside its transaction and refuses it; the store then
//! forgets the key, so its next lookup goes to the database again.

use std::collections::HashMap;
use std::sync::RwLock;

use crate::keys::KeyHash;
use crate::store::{Caller, KeyId};

/// Keys beyond this many are not remembered until the cache is emptied (it is, when full).
const CAPACITY: usize = 100_000;

#[derive(Debug, Default)]
pub(super) struct KeyCache {
    callers: RwLock<HashMap<KeyHash, Caller>>,
}

impl KeyCache {
    pub(super) fn get(&self, key: &KeyHash) -> Option<Caller> {
        self.read().get(key).copied()
    }

    pub(super) fn remember(&self, key: &KeyHash, caller: Caller) {
        let mut callers = self.write();
        if callers.len() >= CAPACITY {
            callers.clear();
        }
        callers.insert(key.clone(), caller);
    }

    pub(super) fn forget(&self, key: &KeyHash) {
        self.write().remove(key);
    }

    pub(super) fn forget_id(&self, key: KeyId) {
        self.write().retain(|_, caller| caller.key != key);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<KeyHash, Caller>> {
        // The map is consistent whatever a panicking holder was doing: each change is one call.
        self.callers
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<KeyHash, Caller>> {
        self.callers
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
