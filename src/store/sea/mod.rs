//! The sea-orm backend: `SQLite` (the embedded default), `PostgreSQL` and `MySQL` through the same
//! code, except that a `SQLite` file's ledger writes bypass sqlx (see `sqlite_direct`).
//!
//! How each money movement stays atomic: reserves, settles and refunds go through the store's
//! committer, which applies them in batches, one write transaction per batch, and answers each
//! only after the commit (`group_commit`). A batch reads what it needs under lock (`SELECT ...
//! FOR UPDATE` on `PostgreSQL` and `MySQL`; `BEGIN IMMEDIATE` takes the database write lock on
//! `SQLite`), decides every write in queue order in memory (`batch`), then writes:
//! - **reserve**: subscription-first split of the locked balance, the debit as an `UPDATE`
//!   guarded by `bucket + change >= 0` whose affected-row count must match, the `pending` entry
//!   inserted; refused if the key was revoked. The `CHECK (bucket >= 0)` constraints back the
//!   guard up.
//! - **refund**: only an entry still `pending` (as locked, and as earlier writes in the batch
//!   left it) flips to `refunded`, with an `UPDATE ... WHERE status = 'pending'`, and its
//!   buckets get back what it took: a second refund finds nothing pending and moves nothing.
//! - **settle**: the same guarded flip to `ok`; no money moves.
//!
//! No transaction is held open across an upstream call, and on `SQLite` files and `PostgreSQL` no
//! lock is held through an fsync: batches commit without waiting for the disk and a flusher
//! makes them durable before the writes that need it are answered (`flush`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbErr,
    TransactionTrait,
};
use sea_orm_migration::MigratorTrait;

use super::{AccountId, ReserveError, StoreError};
use crate::credits::{Balance, Credits};

mod accounts;
mod alerting;
mod audit;
mod codes;
mod commit;
mod entity;
#[cfg(feature = "postgres")]
mod escrow;
mod grants;
// Held calls are kept by the owned file and escrow; the batch decider reads them in any build.
#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
mod held;
mod idempotent;
mod key_cache;
mod lapses;
mod leases;
mod ledger;
mod migration;
mod mode;
mod outbox;
#[cfg(feature = "sqlite")]
mod owned;
mod reads;
mod responses;
mod rows;
mod store;
mod upkeep;
mod writes;

use commit::group_commit::Committer;
pub use commit::group_commit::DEFAULT_MAX_BATCH;
use commit::group_commit::Writers;
pub use commit::jobs::GroupCommitStats;
#[cfg(feature = "sqlite")]
use commit::jobs::SQLITE_BUSY_TIMEOUT;
use commit::jobs::begin_write;
#[cfg(feature = "postgres")]
pub use escrow::DEFAULT_ESCROW_IDLE;
use key_cache::KeyCache;
pub use migration::Migrator;
pub use mode::ChargingMode;
use mode::{Frozen, Mode};
pub use store::SeaOrmStore;

impl From<DbErr> for StoreError {
    fn from(error: DbErr) -> StoreError {
        StoreError::Database(Box::new(error))
    }
}

impl From<DbErr> for ReserveError {
    fn from(error: DbErr) -> ReserveError {
        ReserveError::Store(error.into())
    }
}

impl SeaOrmStore {
    /// Connects to `url` (`sqlite://gateway.db?mode=rwc`, `postgres://...`) and applies the
    /// migrations.
    pub async fn connect(url: &str) -> Result<SeaOrmStore, StoreError> {
        SeaOrmStore::connect_with(ConnectOptions::new(url)).await
    }

    /// Connects with explicit options (pool size, `PostgreSQL` schema search path, ...) and applies
    /// the migrations. On `SQLite` this also sets WAL mode, `synchronous = FULL` on the pool's
    /// connections and a busy time-out, so concurrent writers queue instead of failing with
    /// "database is locked". Ledger writes are answered only once durable (an acknowledged charge
    /// survives a power loss), though their commits do not wait for the disk themselves: see
    /// [`GroupCommitStats::flushes`].
    ///
    /// Unless `options` say otherwise ([`ConnectOptions::test_before_acquire`] set to `false`,
    /// or [`ConnectOptions::test_before_acquire_if_idle_for`]), a pooled connection to a
    /// database server is tested with a ping before it is handed out only once it has been idle
    /// for 30 s, and a `SQLite` file's never: sqlx's default, a ping on every checkout, costs a
    /// round trip before each statement. A connection the server cut while in use fails its
    /// statement; the pool replaces it, and settles and refunds are retried.
    pub async fn connect_with(mut options: ConnectOptions) -> Result<SeaOrmStore, StoreError> {
        options.sqlx_logging(false);
        // Test only connections idle long enough to have been dropped (unless the caller chose);
        // a SQLite file's connections are not dropped at all.
        if options.get_test_before_acquire()
            && options.get_test_before_acquire_if_idle_for().is_none()
        {
            if options.get_url().starts_with("sqlite:") {
                options.test_before_acquire(false);
            } else {
                options.test_before_acquire_if_idle_for(PING_IF_IDLE_FOR);
            }
        }
        #[cfg(feature = "sqlite")]
        if options.get_url().starts_with("sqlite:") {
            use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
            options.map_sqlx_sqlite_opts(|sqlite| {
                sqlite
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(SQLITE_BUSY_TIMEOUT)
                    .foreign_keys(true)
            });
        }
        let sqlite_file = sqlite_file(options.get_url()).map(Arc::from);
        let db = Database::connect(options).await?;
        migrate(&db).await?;
        let postgres_flusher = db.get_database_backend() == sea_orm::DbBackend::Postgres
            && commit::flush::postgres_flush_allowed(&db).await?;
        let events = Arc::<alerting::EventSettings>::default();
        let committer = committer(
            &db,
            sqlite_file.as_deref(),
            DEFAULT_MAX_BATCH,
            postgres_flusher,
            None,
            &events,
        )?;
        Ok(SeaOrmStore {
            committer,
            db,
            keys: Arc::default(),
            sqlite_file,
            postgres_flusher,
            lease: Arc::default(),
            idempotency_window: super::DEFAULT_IDEMPOTENCY_WINDOW,
            mode: Mode::Shared,
            events,
        })
    }

    /// The same store owning its `SQLite` file: a reservation is then held in memory (credits
    /// held against the balance its batch read) and a call is written once, when it ends: an
    /// `ok` entry with its debit, or a `refunded` entry with nothing moved. That halves the
    /// ledger's writes per call; a crash loses only holds, which moved no money.
    ///
    /// A lock file beside the database (`<file>-owner.lock`) refuses a second owner, in this
    /// process or another, for as long as this store or a clone of it lives. Stores that do not
    /// own the file (the CLI, an admin tool, another process) may still grant, revoke, lapse and
    /// audit: each batch reads the account rows under the file's write lock, so the next
    /// reservation sees a grant or a revocation. If one of them takes credits that a held call
    /// counted on (a lapse at the end of a period, a call reserved by a store that does not own
    /// the file), that call ends `refunded`, unbilled, and its client is told the upstream
    /// failed: the account never goes below zero.
    ///
    /// A call with an idempotency key is held too when its key has no record in the file (the
    /// store counts the records' keys in memory, read once, and is the only one that writes
    /// them); the batch that ends it writes its record beside its entry, with the reply to keep
    /// if it was billed. A keyed call whose key has a record (a retry) is answered, or reserved,
    /// in the database (see [`Ledger::reserve`](crate::store::Ledger::reserve)), and so are
    /// calls while their store does not own the file. While held, a call has no call-log
    /// entry; [`Ledger::balance`](crate::store::Ledger::balance) counts it as spent.
    ///
    /// # Errors
    ///
    /// Not a `SQLite` file (always, in a build without the `sqlite` feature), the lock file
    /// cannot be made, or another store owns the file.
    pub fn own_file(self) -> Result<SeaOrmStore, StoreError> {
        #[cfg(feature = "sqlite")]
        if let Some(file) = self.sqlite_file.clone() {
            let owned = owned::Owned::lock(&file)?;
            return Ok(SeaOrmStore {
                committer: committer(
                    &self.db,
                    Some(&file),
                    DEFAULT_MAX_BATCH,
                    self.postgres_flusher,
                    Some(owned.holds.clone()),
                    &self.events,
                )?,
                mode: Mode::OwnedFile(owned),
                ..self
            });
        }
        Err(StoreError::msg("only a SQLite file can be owned"))
    }

    /// The same store charging against credit escrow, on `PostgreSQL`: while it holds an
    /// instance lease ([`Leases::take_lease`](super::Leases::take_lease)), it moves a slice of
    /// each account's credits it charges (64 calls' worth, doubling up to 1024 while its escrow
    /// for the account is refilled again within 250 ms, and at most an eighth of what the
    /// account has to spend; only from an account with at least 256 calls' worth, so that one
    /// running low is charged in the database) into an escrow row of its own, holds reservations
    /// in memory against it, and writes each call once, when it ends: an `ok` entry with the
    /// escrow's debit, or a `refunded` entry with nothing moved. No call's write touches the
    /// account's row, which other instances charging the same account would wait on.
    ///
    /// What stays as without escrow: a reservation waits for a read that its caller's key is
    /// still active, so a revocation refuses the next call on every instance; subscription
    /// credits are spent first (top-up credits in escrow are swapped for subscription credits
    /// granted meanwhile) and never after their period; the balance, the account listings and
    /// the audit count escrowed credits as the account's; a lapse takes a subscription's
    /// escrowed credits too, except what the lapsing store's own calls hold (a call another
    /// instance holds on them then ends `refunded`, unbilled, and its client is told the
    /// upstream failed). Escrow comes back on
    /// [`Leases::release_lease`](super::Leases::release_lease), and, after a crash or a lost
    /// lease, when recovery ([`Leases::orphaned_reservations`](super::Leases::orphaned_reservations))
    /// finds its lease ended. Calls with an idempotency key, and all calls while no lease is
    /// held, are reserved in the database as without escrow; for a keyed call, the account's
    /// free escrow on this instance goes back first when it holds subscription credits.
    ///
    /// The price: credits in one instance's escrow are not spendable by another until they come
    /// back. An account that falls below 256 calls' worth gets no new escrow: each instance
    /// spends what it still has in escrow for it, then reserves in the database. A call that
    /// the database refuses for credits while other instances hold escrow for the account
    /// recalls it, keyed or not: escrow under a lease that has ended (a crashed instance's) goes
    /// back at once, and the instances whose leases hold are asked (`NOTIFY` on the channel
    /// `mg_escrow_recall`, each instance listening on one connection of its pool, which
    /// reconnects if the connection is lost) to give back what they have free; the call waits up
    /// to a second for their escrow to fall, and is tried once more. So an account is refused
    /// (402) only when the credits left are held by calls still running elsewhere, or a recall
    /// was missed (an instance reconnecting): what an instance's escrow for an account has free
    /// goes back anyway once no call has been held against it for 5 to 10 seconds
    /// ([`DEFAULT_ESCROW_IDLE`](super::DEFAULT_ESCROW_IDLE); see [`with_escrow_idle_after`](Self::with_escrow_idle_after)).
    /// And subscription credits come first within each instance's escrow and the account row,
    /// not across instances: one may spend top-up credits from its escrow while another still
    /// holds subscription credits of the same account in its own.
    ///
    /// # Errors
    ///
    /// Not a `PostgreSQL` database.
    pub fn with_escrow(self) -> Result<SeaOrmStore, StoreError> {
        #[cfg(feature = "postgres")]
        return self.with_escrow_idle_after(DEFAULT_ESCROW_IDLE);
        #[cfg(not(feature = "postgres"))]
        Err(StoreError::msg(
            "escrow needs PostgreSQL (the `postgres` feature)",
        ))
    }

    /// [`with_escrow`](Self::with_escrow), giving back what an account's escrow has free once
    /// no call has been held against it for `idle` to twice `idle` (at least 10 ms): the
    /// instance looks every `idle`. Shorter lets other instances spend an idle account's last
    /// credits sooner; each give-back is one short transaction on the account's row, and the
    /// next call on that account takes a new slice in another.
    ///
    /// # Errors
    ///
    /// Not a `PostgreSQL` database.
    #[cfg(feature = "postgres")]
    pub fn with_escrow_idle_after(
        self,
        idle: std::time::Duration,
    ) -> Result<SeaOrmStore, StoreError> {
        if self.db.get_database_backend() != sea_orm::DbBackend::Postgres {
            return Err(StoreError::msg("escrow needs PostgreSQL"));
        }
        let idle = idle.max(std::time::Duration::from_millis(10));
        Ok(SeaOrmStore {
            mode: Mode::Escrow(escrow::Escrow::start(
                self.db.clone(),
                idle,
                self.events.clone(),
            )),
            ..self
        })
    }

    /// The database file, when the store is on a `SQLite` file.
    pub fn sqlite_file(&self) -> Option<&Path> {
        self.sqlite_file.as_deref()
    }

    /// How many reservations are held in memory now (always 0 unless the store owns its
    /// `SQLite` file, see [`own_file`](Self::own_file), or charges against escrow, see
    /// [`with_escrow`](Self::with_escrow)).
    pub async fn held_reservations(&self) -> usize {
        self.mode.held_calls()
    }

    /// What `account` has to spend when its row holds `row`: that with its escrowed credits,
    /// which are the account's whichever instance holds them, less what this store holds
    /// against its escrow.
    async fn with_escrow_of<C: ConnectionTrait>(
        &self,
        conn: &C,
        account: AccountId,
        row: Balance,
    ) -> Result<Balance, StoreError> {
        let whole = rows::with_escrow_rows(conn, account, row).await?;
        Ok(self.mode.net(account, whole))
    }

    /// The held calls of an owned file, frozen (see [`Mode::freeze_holds`]).
    async fn freeze_holds(&self) -> Option<Frozen<'_>> {
        self.mode.freeze_holds().await
    }

    /// Where the ledger's writes go.
    fn writers(&self) -> Writers<'_> {
        Writers {
            committer: &self.committer,
            db: &self.db,
            alerting: self.events.alerting(),
        }
    }

    /// How the ledger's writes have been grouped into transactions so far.
    pub fn group_commit_stats(&self) -> GroupCommitStats {
        self.committer.stats()
    }

    /// The same store with at most `max_batch` ledger writes per transaction (1: none shared).
    /// Fails only if a `SQLite` file cannot be opened again for the new committer.
    pub fn with_max_batch(self, max_batch: usize) -> Result<SeaOrmStore, StoreError> {
        #[cfg(feature = "sqlite")]
        let holds = match &self.mode {
            Mode::OwnedFile(owned) => Some(owned.holds.clone()),
            _ => None,
        };
        #[cfg(not(feature = "sqlite"))]
        let holds = None;
        Ok(SeaOrmStore {
            committer: committer(
                &self.db,
                self.sqlite_file.as_deref(),
                max_batch.max(1),
                self.postgres_flusher,
                holds,
                &self.events,
            )?,
            ..self
        })
    }

    /// The underlying connection, for embedders that keep their own tables beside ours.
    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    async fn begin_write(&self) -> Result<DatabaseTransaction, DbErr> {
        begin_write(&self.db).await
    }

    /// The same store writing webhook events to its outbox (`mg_webhook_events`): a code
    /// redeemed and a subscription lapsed in the transaction that did it, an upstream's breaker
    /// when it opens or closes. Off by default: turn it on where a
    /// [`WebhookDispatcher`](crate::webhooks::WebhookDispatcher) delivers them.
    pub fn with_webhook_events(self) -> SeaOrmStore {
        self.events.turn_on();
        self
    }

    /// The same store writing events of `types` only (default: every type), with webhook
    /// events on (see [`with_webhook_events`](Self::with_webhook_events)).
    pub fn with_webhook_event_types(
        self,
        types: impl IntoIterator<Item = crate::events::EventType>,
    ) -> SeaOrmStore {
        self.events.set_types(types);
        self
    }

    /// The same store telling `account.balance_low` (with webhook events on, see
    /// [`with_webhook_events`](Self::with_webhook_events)) when a reservation takes an
    /// account's spendable balance below `threshold` credits, for accounts without a threshold
    /// of their own ([`Accounts::set_low_balance`](crate::store::Accounts::set_low_balance));
    /// zero, the default, tells none. The event is written in the reservation's transaction.
    pub fn with_low_balance_alert(self, threshold: Credits) -> SeaOrmStore {
        self.events.set_low_balance(threshold);
        self
    }

    /// The same store holding idempotency keys for `window` after their call (default
    /// [`DEFAULT_IDEMPOTENCY_WINDOW`](super::DEFAULT_IDEMPOTENCY_WINDOW)). Gateways sharing a
    /// database should agree on it.
    pub fn with_idempotency_window(mut self, window: std::time::Duration) -> SeaOrmStore {
        self.idempotency_window = window;
        self
    }

    /// The same store trusting remembered keys' rules for `ttl` (default five seconds): how
    /// soon rules changed on another gateway sharing the database apply here.
    pub fn with_key_rules_ttl(mut self, ttl: std::time::Duration) -> SeaOrmStore {
        self.keys = Arc::new(KeyCache::with_ttl(ttl));
        self
    }
}

/// The file behind a `sqlite:` URL; `None` for other databases and in-memory `SQLite` (which a
/// second connection could not see).
fn sqlite_file(url: &str) -> Option<PathBuf> {
    #[cfg(feature = "sqlite")]
    if url.starts_with("sqlite:") && !url.contains(":memory:") && !url.contains("mode=memory") {
        use std::str::FromStr;
        let options = sea_orm::sqlx::sqlite::SqliteConnectOptions::from_str(url).ok()?;
        return Some(options.get_filename().to_path_buf());
    }
    let _ = url;
    None
}

/// The committer for a store: on a `SQLite` file, a thread calling `SQLite` directly; otherwise a
/// task on the sea-orm pool, with `PostgreSQL`'s flusher where it may run.
fn committer(
    db: &DatabaseConnection,
    sqlite_file: Option<&Path>,
    max_batch: usize,
    postgres_flusher: bool,
    #[cfg(feature = "sqlite")] holds: Option<Arc<owned::state::SharedHolds>>,
    #[cfg(not(feature = "sqlite"))] holds: Option<std::convert::Infallible>,
    events: &Arc<alerting::EventSettings>,
) -> Result<Committer, StoreError> {
    #[cfg(feature = "sqlite")]
    if let Some(file) = sqlite_file {
        let (connection, wal) = commit::sqlite_direct::open(file)?;
        // Beside the holds before any reservation can ask for it.
        let writer: Box<dyn commit::jobs::BatchWriter> = match &holds {
            Some(shared) => Box::new(owned::decide::install(shared, connection)),
            None => Box::new(commit::sqlite_direct::OwnConnection(connection)),
        };
        return Committer::start_direct(writer, wal, max_batch, events.clone());
    }
    let _ = (sqlite_file, holds);
    Ok(Committer::start(
        db.clone(),
        max_batch,
        postgres_flusher,
        events.clone(),
    ))
}

/// Applies the migrations one store at a time. Several gateway instances starting together on
/// an empty `PostgreSQL` or `MySQL` database would otherwise all try to create the same tables, and
/// all but one would fail to start. `PostgreSQL`: the whole migration runs in one transaction
/// (its DDL is transactional) that first takes an advisory lock for the schema, so the others
/// wait and then find nothing to do. `MySQL` commits each DDL statement as it goes, so the
/// migration runs on one session holding a named lock for the database.
async fn migrate(db: &DatabaseConnection) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let mysql = backend == sea_orm::DbBackend::MySql;
    let lock = match backend {
        sea_orm::DbBackend::Postgres => {
            "SELECT pg_advisory_xact_lock(\
             hashtextextended('model-gateway migrations ' || current_schema(), 0))"
        }
        sea_orm::DbBackend::MySql => {
            "SELECT CAST(GET_LOCK(CONCAT('model-gateway migrations ', DATABASE()), 60) AS SIGNED) \
             AS locked"
        }
        _ => return Migrator::up(db, None).await,
    };
    let session = db.begin().await?;
    let locked = session
        .query_one_raw(sea_orm::Statement::from_string(backend, lock))
        .await?;
    if mysql {
        // 1: taken; 0: another instance held it for a minute; NULL: an error.
        let taken = locked.and_then(|row| row.try_get::<Option<i64>>("", "locked").ok().flatten());
        if taken != Some(1) {
            return Err(DbErr::Custom(
                "another gateway instance has held the migration lock for a minute".into(),
            ));
        }
    }
    let migrated = Migrator::up(&session, None).await;
    if mysql {
        // A named lock belongs to the session, which goes back to the pool: release it whether
        // or not the migration succeeded.
        session
            .execute_unprepared("DO RELEASE_LOCK(CONCAT('model-gateway migrations ', DATABASE()))")
            .await?;
    }
    migrated?;
    session.commit().await
}

/// How long a pooled connection may sit idle before it is tested on checkout (see
/// [`SeaOrmStore::connect_with`]).
const PING_IF_IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(30);

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
        self.mode.kind()
    }
}
