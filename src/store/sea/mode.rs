//! [`ChargingMode`]: how a [`SeaOrmStore`](crate::store::SeaOrmStore) charges, chosen once from its database and the
//! operator's settings; and [`Mode`], what the store keeps for it, to which the store's
//! ledger delegates whatever differs between modes.
//!
//! The modes, each in its own module: shared (every reservation a row, written by the
//! committer: `super::commit::group_commit`), the owned file (`super::owned`, `SQLite` only, behind the
//! `sqlite` feature) and escrow (`super::escrow`, `PostgreSQL` only, behind `postgres`).

#[cfg(feature = "postgres")]
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::commit::group_commit::Writers;
use super::idempotent;
use super::writes::OwnedCharge;
use crate::credits::{Balance, Credits};
use crate::store::{
    AccountId, CallFailure, CallId, CallSuccess, KeyId, LeaseId, Overdue, Reservation,
    ReserveError, StoreError,
};

/// What a store keeps for the mode it charges in.
#[derive(Debug, Clone, Default)]
pub(super) enum Mode {
    /// Every reservation is a row, written by the committer.
    #[default]
    Shared,
    /// The store owns its `SQLite` file: reservations held in memory.
    #[cfg(feature = "sqlite")]
    OwnedFile(super::owned::Owned),
    /// The store charges against escrow on `PostgreSQL`.
    #[cfg(feature = "postgres")]
    Escrow(Arc<super::escrow::Escrow>),
}

/// The held calls of an owned file, kept from changing while a transaction that must see
/// them runs (see `super::owned::SharedHolds::freeze`).
#[cfg(feature = "sqlite")]
pub(super) type Frozen<'a> = super::owned::Frozen<'a>;
/// Without the `sqlite` feature no store owns a file, and nothing is ever frozen.
#[cfg(not(feature = "sqlite"))]
pub(super) type Frozen<'a> = &'a super::held::Holds;

impl Mode {
    /// Which mode this is.
    pub(super) fn kind(&self) -> ChargingMode {
        match self {
            Mode::Shared => ChargingMode::Shared,
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(_) => ChargingMode::OwnedFile,
            #[cfg(feature = "postgres")]
            Mode::Escrow(_) => ChargingMode::Escrow,
        }
    }

    /// How many reservations are held in memory now.
    pub(super) fn held_calls(&self) -> usize {
        match self {
            Mode::Shared => 0,
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => owned.held_calls(),
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) => escrow.held_calls(),
        }
    }

    /// The calls held in memory that were reserved before `cutoff`.
    pub(super) fn held_before(&self, cutoff: DateTime<Utc>) -> Overdue {
        let _ = cutoff;
        match self {
            Mode::Shared => Overdue::default(),
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => owned.held_before(cutoff),
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) => escrow.held_before(cutoff),
        }
    }

    /// What `account` has to spend when the database holds `whole` for it (its row with its
    /// escrowed credits): less what this store holds on it in memory.
    pub(super) fn net(&self, account: AccountId, whole: Balance) -> Balance {
        let _ = account;
        match self {
            Mode::Shared => whole,
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => owned.net(account, whole),
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) => whole.free_of(escrow.held_on(account)),
        }
    }

    /// The held calls of an owned file, frozen: no batch is written and no reservation held
    /// until the guard is dropped. Take it before a write transaction, never inside one.
    pub(super) async fn freeze_holds(&self) -> Option<Frozen<'_>> {
        match self {
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => Some(owned.holds.freeze().await),
            _ => None,
        }
    }

    /// While this store charges against escrow: no escrowed call ends until the guard drops.
    pub(super) async fn pause_escrow_writes(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        match self {
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) => Some(escrow.pause_writes().await),
            _ => None,
        }
    }

    /// What this store's calls held in memory hold of `key`'s spending limit (an owned file's;
    /// escrow holds no limited key's calls).
    pub(super) fn held_on_key(&self, key: KeyId) -> Credits {
        let _ = key;
        match self {
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => owned.holds.lock().holds.on_key(key),
            _ => Credits::ZERO,
        }
    }

    /// The subscription credits this store's escrowed calls hold on `account`, by lease.
    pub(super) fn escrow_held(&self, account: AccountId) -> Vec<(LeaseId, Credits)> {
        let _ = account;
        match self {
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) => escrow.subscription_held(account),
            _ => Vec::new(),
        }
    }

    /// Reserves a call without an idempotency key.
    pub(super) async fn reserve(
        &self,
        to: Writers<'_>,
        charge: OwnedCharge,
    ) -> Result<Reservation, ReserveError> {
        match self {
            Mode::Shared => to.committer.reserve(charge).await,
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => owned.reserve(to.committer, charge).await,
            // Boxed: inline, its future made every mode's four times larger (see
            // `SeaOrmStore::reserve`).
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) => {
                Box::pin(escrow.reserve_or_in_database(to.committer, charge)).await
            }
        }
    }

    /// Reserves a keyed call in the database with `reserve` (run again if a retry may help).
    pub(super) async fn reserve_keyed<F, Fut>(
        &self,
        charge: &OwnedCharge,
        reserve: F,
    ) -> Result<Reservation, ReserveError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Reservation, ReserveError>>,
    {
        match self {
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) => escrow.reserve_keyed(charge, reserve).await,
            _ => {
                let _ = charge;
                reserve().await
            }
        }
    }

    /// Settles `call`.
    pub(super) async fn settle(
        &self,
        to: Writers<'_>,
        call: CallId,
        success: CallSuccess,
    ) -> Result<bool, StoreError> {
        #[cfg(feature = "postgres")]
        if let Mode::Escrow(escrow) = self
            && !escrow.holds(call)
            && let Some(cost) = success.cost
        {
            escrow.free_for_database_settle(call, cost).await?;
        }
        match self {
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) if escrow.holds(call) => escrow.settle(call, success).await,
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => owned.settle(to, call, success).await,
            _ if success.reply.is_some() => {
                idempotent::settle(to.db, call, success, None, to.alerting).await
            }
            _ => to.committer.settle(call, success).await,
        }
    }

    /// Refunds `call`.
    pub(super) async fn refund(
        &self,
        to: Writers<'_>,
        call: CallId,
        failure: &CallFailure,
    ) -> Result<bool, StoreError> {
        match self {
            #[cfg(feature = "postgres")]
            Mode::Escrow(escrow) if escrow.holds(call) => escrow.refund(call, failure).await,
            #[cfg(feature = "sqlite")]
            Mode::OwnedFile(owned) => owned.refund(to.committer, call, failure).await,
            _ => to.committer.refund(call, failure.clone()).await,
        }
    }

    /// Before the lease `lease` is released: escrow goes back to its accounts.
    pub(super) async fn release(&self, lease: Option<LeaseId>) -> Result<(), StoreError> {
        match (self, lease) {
            #[cfg(feature = "postgres")]
            (Mode::Escrow(escrow), Some(lease)) => escrow.give_back(lease, None).await,
            _ => Ok(()),
        }
    }
}

/// How a [`SeaOrmStore`](crate::store::SeaOrmStore) charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChargingMode {
    /// Every reservation is a row in the database, written in the reserving transaction; any
    /// number of gateways share the database.
    Shared,
    /// One gateway owns a `SQLite` file and holds reservations in memory
    /// ([`SeaOrmStore::own_file`](crate::store::SeaOrmStore::own_file)).
    OwnedFile,
    /// Each gateway on `PostgreSQL` charges against escrow taken from the accounts
    /// ([`SeaOrmStore::with_escrow`](crate::store::SeaOrmStore::with_escrow)).
    Escrow,
}

impl ChargingMode {
    /// The mode's name, as the example gateway logs it.
    pub fn as_str(self) -> &'static str {
        match self {
            ChargingMode::Shared => "shared",
            ChargingMode::OwnedFile => "owned file",
            ChargingMode::Escrow => "escrow",
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::store::sea::SeaOrmStore;

    #[tokio::test]
    async fn a_sqlite_file_is_owned_unless_shared_and_escrow_is_refused_there() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("modes.db").display()
        );
        let store = SeaOrmStore::connect(&url).await.unwrap();
        assert_eq!(store.mode(), ChargingMode::Shared);
        assert_eq!(
            ChargingMode::choose(&store, false, true),
            ChargingMode::OwnedFile
        );
        assert_eq!(
            ChargingMode::choose(&store, true, false),
            ChargingMode::Shared
        );
        assert_eq!(
            ChargingMode::choose(&store, true, true),
            ChargingMode::Escrow
        );
        assert!(store.clone().in_mode(ChargingMode::Escrow).is_err());
        let owned = store.in_mode(ChargingMode::OwnedFile).unwrap();
        assert_eq!(owned.mode(), ChargingMode::OwnedFile);
    }
}
