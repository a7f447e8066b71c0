//! [`ChargingMode`]: how a [`SeaOrmStore`] charges, chosen once from its database and the
//! operator's settings.

use super::SeaOrmStore;
use crate::store::StoreError;

/// How a [`SeaOrmStore`] charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChargingMode {
    /// Every reservation is a row in the database, written in the reserving transaction; any
    /// number of gateways share the database.
    Shared,
    /// One gateway owns a `SQLite` file and holds reservations in memory
    /// ([`SeaOrmStore::own_file`]).
    OwnedFile,
    /// Each gateway on `PostgreSQL` charges against escrow taken from the accounts
    /// ([`SeaOrmStore::with_escrow`]).
    Escrow,
}

impl ChargingMode {
    /// The mode the example gateway runs in on `store`'s database: a `SQLite` file is owned
    /// unless `share_sqlite_file` (other processes write it too); otherwise escrow when
    /// `escrow` is asked (it needs `PostgreSQL`: [`SeaOrmStore::in_mode`] refuses it elsewhere);
    /// otherwise shared.
    pub fn choose(store: &SeaOrmStore, share_sqlite_file: bool, escrow: bool) -> ChargingMode {
        if store.sqlite_file().is_some() && !share_sqlite_file {
            ChargingMode::OwnedFile
        } else if escrow {
            ChargingMode::Escrow
        } else {
            ChargingMode::Shared
        }
    }

    /// The mode's name, as the example gateway logs it.
    pub fn as_str(self) -> &'static str {
        match self {
            ChargingMode::Shared => "shared",
            ChargingMode::OwnedFile => "owned file",
            ChargingMode::Escrow => "escrow",
        }
    }
}

impl SeaOrmStore {
    /// This store, charging in `mode` (a store connects [`Shared`](ChargingMode::Shared)).
    ///
    /// # Errors
    ///
    /// As [`own_file`](Self::own_file) and [`with_escrow`](Self::with_escrow): the mode is not
    /// one this database has, or another store owns the file.
    pub fn in_mode(self, mode: ChargingMode) -> Result<SeaOrmStore, StoreError> {
        match mode {
            ChargingMode::Shared => Ok(self),
            ChargingMode::OwnedFile => self.own_file(),
            ChargingMode::Escrow => self.with_escrow(),
        }
    }

    /// How this store charges.
    pub fn mode(&self) -> ChargingMode {
        if self.owned.is_some() {
            ChargingMode::OwnedFile
        } else if self.escrow.is_some() {
            ChargingMode::Escrow
        } else {
            ChargingMode::Shared
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

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
